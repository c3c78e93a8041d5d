"""Cost of the ES noise sources: perturb + restore of every trained weight, and one update, per source and device.

For a model's trained tensors (default: the SmolLM2-135M architecture with random weights, all 134.5M parameters),
times ``GaussianPerturbation.perturb_`` + the restore (``TrainedParameters.render_``) for ``--members`` members and one ``es_update_`` over them,
with each noise source of ``trl_es.es.noise``:

- ``table``: slices of the shared 256 MiB table (memory-bound adds);
- ``gaussian``: fresh ``torch.randn`` per 2^20-element block from a CPU generator (moved to the device);
- ``device_gaussian``: the same from a generator on the weights' device (Philox on CUDA).

Also prints each source's resident memory (the table's 256 MiB). ``ESConfig.noise_source="auto"`` picks per device
from these figures (docs/scaling.md).

    python benchmarks/noise_sources.py                       # CPU, fp32, 4 members
    python benchmarks/noise_sources.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trl_es.es.noise import DEFAULT_TABLE_SIZE, make_noise_source
from trl_es.es.perturbation import GaussianPerturbation
from trl_es.es.population import sample_population
from trl_es.es.update import TrainedParameters, es_update_, select_parameters
from trl_es.files import write_json

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sources", nargs="+", default=["table", "gaussian", "device_gaussian"])
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(os.path.join(HERE, "smollm2_135m_config.json"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).to(args.device)
    params = TrainedParameters(select_parameters(model))
    members = sample_population(0, 0, args.members, antithetic=args.members % 2 == 0)
    coefficients = torch.linspace(-1, 1, args.members).tolist()
    perturbation = GaussianPerturbation()

    def sync():
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()

    figures = {}
    for kind in args.sources:
        noise = make_noise_source(DEFAULT_TABLE_SIZE, kind, args.device)
        perturbation.perturb_(params, noise, members[0], 1e-3)  # warm-up: builds the table, loads kernels
        params.render_()
        sync()
        start = time.perf_counter()
        for member in members:
            perturbation.perturb_(params, noise, member, 1e-3)
            params.render_()
        sync()
        perturb = (time.perf_counter() - start) / len(members)
        start = time.perf_counter()
        es_update_(params, perturbation, noise, members, coefficients, 1e-6)
        sync()
        update = time.perf_counter() - start
        memory = DEFAULT_TABLE_SIZE * 4 / 2**20 if kind == "table" else 0.0
        figures[kind] = {"perturb_restore_seconds_per_member": perturb, "update_seconds": update,
                         "resident_mib": memory}
        print(f"{kind:>16}: perturb+restore {perturb:7.3f} s/member, update ({args.members} members) {update:7.3f} s, "
              f"resident {memory:6.0f} MiB", flush=True)
    print(f"device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} trained_params={params.numel:,} "
          f"torch={torch.__version__}")
    if args.output_json:
        write_json(args.output_json, {"args": vars(args), "figures": figures})


if __name__ == "__main__":
    main()
