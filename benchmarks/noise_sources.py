"""Cost of the ES noise sources: perturb + restore of every trained weight, and one update, per source and device.

For a model's trained tensors (default: the SmolLM2-135M architecture with random weights, all 134.5M parameters),
times ``GaussianPerturbation.perturb_`` + the restore (``TrainedParameters.write_master_to_model_``) for ``--members`` members and one ``es_update_`` over them,
with each noise source of ``trl_es.es.noise``:

- ``table``: slices of the shared 256 MiB table (memory-bound adds);
- ``gaussian``: a fresh draw per 2^20-element block from a CPU generator (moved to the device);
- ``device_gaussian``: the same from a generator on the weights' device (Philox on CUDA).

``--generators`` times the CPU draws and the arithmetic of each generator: ``numpy-pcg64`` (the default since
2026-12-02: portable noise, a multiply then an add) and ``torch`` (the legacy ``torch.randn`` noise and fused
``add(alpha=)`` kernels, which differ between CPUs). The table's one-time build is timed separately.

Also prints each source's resident memory (the table's 256 MiB). ``ESConfig.noise_source="auto"`` picks per device
from these figures (docs/scaling.md).

    python benchmarks/noise_sources.py                       # CPU, fp32, 4 members
    python benchmarks/noise_sources.py --device cuda --dtype bfloat16
    python benchmarks/noise_sources.py --generators numpy-pcg64 torch   # portable vs legacy, on CPU
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trl_es.es.noise import (DEFAULT_TABLE_SIZE, PORTABLE_GENERATOR, TABLE_SEED, DeviceGaussianNoise,
                             GaussianNoise, NoiseTable, standard_normal)
from trl_es.es.perturbation import GaussianPerturbation, TrainedParameters, es_update_, select_parameters
from trl_es.es.strategy import sample_population
from trl_es.files import write_json

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sources", nargs="+", default=["table", "gaussian", "device_gaussian"])
    parser.add_argument("--generators", nargs="+", default=[PORTABLE_GENERATOR], choices=["numpy-pcg64", "torch"])
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
    sources = {"table": lambda g: NoiseTable(DEFAULT_TABLE_SIZE, generator=g),
               "gaussian": GaussianNoise, "device_gaussian": DeviceGaussianNoise}
    for generator in args.generators:
        start = time.perf_counter()
        standard_normal(DEFAULT_TABLE_SIZE, TABLE_SEED, generator)
        build = time.perf_counter() - start
        figures[f"table_build/{generator}"] = {"seconds": build}
        print(f"{'table build':>16} [{generator}]: {build:7.3f} s for {DEFAULT_TABLE_SIZE:,} values", flush=True)
    for generator, kind in itertools.product(args.generators, args.sources):
        noise = sources[kind](generator)
        perturbation.perturb_(params, noise, members[0], 1e-3)  # warm-up: builds the table, loads kernels
        params.write_master_to_model_()
        sync()
        start = time.perf_counter()
        for member in members:
            perturbation.perturb_(params, noise, member, 1e-3)
            params.write_master_to_model_()
        sync()
        perturb = (time.perf_counter() - start) / len(members)
        start = time.perf_counter()
        es_update_(params, perturbation, noise, members, coefficients, 1e-6)
        sync()
        update = time.perf_counter() - start
        memory = DEFAULT_TABLE_SIZE * 4 / 2**20 if kind == "table" else 0.0
        figures[f"{kind}/{generator}"] = {"perturb_restore_seconds_per_member": perturb, "update_seconds": update,
                                          "resident_mib": memory}
        print(f"{kind:>16} [{generator}]: perturb+restore {perturb:7.3f} s/member, update ({args.members} members) "
              f"{update:7.3f} s, resident {memory:6.0f} MiB", flush=True)
    print(f"device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} trained_params={params.numel:,} "
          f"torch={torch.__version__}")
    if args.output_json:
        write_json(args.output_json, {"args": vars(args), "figures": figures})


if __name__ == "__main__":
    main()
