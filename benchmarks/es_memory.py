"""Peak memory of one training process: ES (ESTrainer) vs TRL's GRPOTrainer on the same model and batch.

Each method runs in a fresh subprocess (so one peak cannot hide another) and reports its peak resident set size,
``resource.getrusage(RUSAGE_SELF).ru_maxrss``. ``tracemalloc`` does not see torch's allocations, so RSS is the
measure. Another subprocess only imports the libraries and loads the model (and reads every weight once: the
safetensors file is memory-mapped, so weights count in RSS only once touched): the "loaded model" baseline. ES runs
twice: with the default 256 MiB noise table, and with ``noise_table_size=0`` (fresh Gaussian noise per block).

Both methods train the same model (fp32 weights, ``GRPOConfig(bf16=False)``) with the same number of completions
per step (``--completions``, each ``--new_tokens`` tokens): ES scores ``--population_size`` members, each on
``--completions`` prompts; GRPO generates ``--num_generations`` completions for each of
``--completions / --num_generations`` prompts, then takes one optimizer step (AdamW). Goal (issue): ES peak <= 0.5 x
GRPO peak.

    python benchmarks/es_memory.py                         # the embedded SmolLM2-135M-Instruct
    python benchmarks/es_memory.py --model path/to/model --iterations 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

METHODS = ("load", "es", "es_no_table", "grpo")


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(cli) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    from trl_es.models import load_model_and_tokenizer, resolve_model_path
    from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset

    hf_logging.set_verbosity_error()
    torch.set_num_threads(cli.threads)
    path = resolve_model_path(cli.model)
    model, tokenizer = load_model_and_tokenizer(path, dtype=torch.float32)
    dataset = make_arithmetic_dataset(cli.completions * cli.iterations, seed=0)
    out_dir = tempfile.mkdtemp()
    common = {"output_dir": out_dir, "max_steps": cli.iterations, "max_completion_length": cli.new_tokens,
              "report_to": [], "save_strategy": "no", "disable_tqdm": True, "bf16": False, "seed": 0,
              "generation_kwargs": {"min_new_tokens": cli.new_tokens}}
    info = {"method": cli.worker, "parameters": sum(p.numel() for p in model.parameters())}
    if cli.worker in ("es", "es_no_table"):
        from trl_es import ESConfig, ESTrainer

        table = cli.noise_table_size if cli.worker == "es" else 0
        args = ESConfig(population_size=cli.population_size, prompt_batch_size=cli.completions,
                        noise_table_size=table, log_parameter_drift=False, **common)
        trainer = ESTrainer(model, arithmetic_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
        info["setup"] = (f"population {cli.population_size} x {cli.completions} prompts x {cli.new_tokens} tokens, "
                         f"noise_table_size {table}")
    elif cli.worker == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(per_device_train_batch_size=cli.completions, num_generations=cli.num_generations,
                          temperature=1.0, **common)
        trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer)
        trainer.train()
        info["setup"] = (f"{cli.completions // cli.num_generations} prompts x {cli.num_generations} generations x "
                         f"{cli.new_tokens} tokens, optim {args.optim}, beta {args.beta}")
    else:
        with torch.no_grad():
            for param in model.parameters():  # make the memory-mapped weights resident, as training does
                param.sum()
        info["setup"] = "imports + model load only"
    info["peak_rss_mib"] = peak_rss_mib()
    return info


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model id/path (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--completions", type=int, default=8, help="Completions per step (ES: prompts per member).")
    parser.add_argument("--num_generations", type=int, default=2, help="GRPO completions per prompt.")
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--population_size", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--noise_table_size", type=int, default=1 << 26, help="ES noise table entries (256 MiB).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=METHODS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    cli = parser.parse_args()

    if cli.worker:
        with open(cli.result, "w") as f:
            json.dump(worker(cli), f)
        return

    results = {}
    for method in METHODS:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            result_path = handle.name
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, "--result", result_path]
        for key in ("model", "completions", "num_generations", "new_tokens", "population_size", "iterations",
                    "noise_table_size", "threads"):
            value = getattr(cli, key)
            if value is not None:
                cmd += [f"--{key}", str(value)]
        subprocess.run(cmd, check=True)
        with open(result_path) as f:
            results[method] = json.load(f)
        os.remove(result_path)
        print(f"{method:>5}: peak RSS {results[method]['peak_rss_mib']:8.1f} MiB  ({results[method]['setup']})",
              flush=True)

    load, es, es_no_table, grpo = (results[m]["peak_rss_mib"] for m in METHODS)
    print(f"model: {cli.model or 'embedded SmolLM2-135M-Instruct'}, {results['es']['parameters']:,} parameters "
          f"(fp32: {results['es']['parameters'] * 4 / 2**20:.0f} MiB); {cli.iterations} iteration(s)")
    print(f"ES / GRPO peak RSS: {es / grpo:.3f}   (goal <= 0.5); without the noise table: {es_no_table / grpo:.3f}")
    print(f"ES / GRPO above the loaded model ({load:.0f} MiB): {(es - load) / (grpo - load):.3f}; without the noise "
          f"table: {(es_no_table - load) / (grpo - load):.3f}")


if __name__ == "__main__":
    main()
