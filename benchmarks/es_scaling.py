"""ES iteration time and bytes communicated with 1 and 2 processes on CPU (gloo).

For each model, runs the same ES job (arithmetic prompts, greedy decoding, every member generates exactly
``--new_tokens`` tokens) with:

- ``W=1``: one process with one torch thread, and one with ``--threads`` threads (all cores);
- ``W=2`` population parallelism: ``torchrun --nproc_per_node 2``, ``--threads / 2`` threads each; each process
  scores half of the members on the whole prompt batch;
- ``W=2`` ZeRO-3 (``--zero3``, tiny model only by default): DeepSpeed ZeRO-3 partitions the weights over the two
  processes; every member is scored by both, each on half of the prompts, gathering the weights on the fly.

It prints the seconds per iteration (mean over the iterations after the first, which includes warm-up), the
speedup over one process with one thread, and
``comm/bytes`` per iteration as logged by ESTrainer (process 0: the bytes its collectives moved into it; under
ZeRO-3 this includes DeepSpeed's parameter all-gathers, estimated as one full gather per forward call).

    python benchmarks/es_scaling.py                               # tiny Llama and the embedded SmolLM2-135M
    python benchmarks/es_scaling.py --models tiny --iterations 4
    python benchmarks/es_scaling.py --models 135m --model path/to/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("tiny", "135m")


def build_model(kind: str, model_path: str | None):
    import torch

    if kind == "tiny":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from tiny import build_llama, build_tokenizer

        tokenizer = build_tokenizer()
        return build_llama(tokenizer), tokenizer
    from trl_es.models import load_model_and_tokenizer

    return load_model_and_tokenizer(model_path, dtype=torch.float32)


def worker(cli) -> dict | None:
    import torch
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    extra = {}
    if cli.mode == "zero3":
        import deepspeed
        from accelerate import PartialState

        deepspeed.init_distributed(dist_backend="gloo")
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")  # accelerate picks no DeepSpeed backend on CPU by itself
        extra = {"deepspeed": {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                               "train_batch_size": "auto", "gradient_accumulation_steps": "auto"},
                 "accelerator_config": {"use_configured_state": True}}
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        extra = {"use_cpu": True}

    from trl_es import ESConfig, ESTrainer
    from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset

    hf_logging.set_verbosity_error()
    torch.set_num_threads(cli.threads)
    model, tokenizer = build_model(cli.kind, cli.model)
    durations = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            durations.append(time.perf_counter() - self.start)

    args = ESConfig(
        output_dir=tempfile.mkdtemp(), max_steps=cli.iterations, population_size=cli.population_size,
        prompt_batch_size=cli.prompts, max_completion_length=cli.new_tokens,
        generation_kwargs={"min_new_tokens": cli.new_tokens}, noise_table_size=cli.noise_table_size,
        report_to=[], save_strategy="no", disable_tqdm=True, seed=0, **extra,
    )
    dataset = make_arithmetic_dataset(cli.prompts * cli.iterations, seed=0)
    trainer = ESTrainer(model, arithmetic_reward, args=args, train_dataset=dataset, processing_class=tokenizer,
                        callbacks=[Timer()])
    trainer.train()
    if not trainer.accelerator.is_main_process:
        return None
    logs = [h for h in trainer.state.log_history if "comm/bytes" in h]
    return {
        "parameters": sum(p.numel() for p in trainer.accelerator.unwrap_model(trainer.model).parameters())
        if not trainer.sharded else sum(int(p.ds_numel) for p in trainer.accelerator.unwrap_model(trainer.model).parameters()),
        "world_size": trainer.accelerator.num_processes,
        "durations": durations,
        "comm_bytes": [h["comm/bytes"] for h in logs],
        "threads": torch.get_num_threads(),
    }


def launch(cli, kind: str, mode: str, world: int, threads: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        result_path = handle.name
    args = [os.path.abspath(__file__), "--worker", "--kind", kind, "--mode", mode, "--result", result_path,
            "--threads", str(threads)]
    for key in ("iterations", "population_size", "prompts", "new_tokens", "noise_table_size"):
        args += [f"--{key}", str(getattr(cli, key))]
    if cli.model:
        args += ["--model", cli.model]
    launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--nproc_per_node", str(world)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    subprocess.run([*launcher, *args], check=True, env=env)
    with open(result_path) as f:
        result = json.load(f)
    os.remove(result_path)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,135m", help="Comma-separated subset of tiny,135m.")
    parser.add_argument("--model", default=None, help="Path of the 135M model (default: the embedded one).")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--population_size", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--noise_table_size", type=int, default=1 << 26)
    parser.add_argument("--threads", type=int, default=2, help="Torch threads in all (split over the processes).")
    parser.add_argument("--zero3", default="tiny", help="Models also run with ZeRO-3 (comma-separated, or 'none').")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("plain", "zero3"), default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    cli = parser.parse_args()

    if cli.worker:
        from trl_es.files import write_json

        result = worker(cli)
        if result is not None:  # the main process only (worker returns None on the others)
            write_json(cli.result, result, indent=None)
        return

    rows = []
    zero3 = set(cli.zero3.split(",")) if cli.zero3 != "none" else set()
    for kind in cli.models.split(","):
        per_process = max(1, cli.threads // 2)
        runs = [("plain", 1, 1)] + ([("plain", 1, cli.threads)] if cli.threads > 1 else [])
        runs += [("plain", 2, per_process)] + ([("zero3", 2, per_process)] if kind in zero3 else [])
        baseline = None
        for mode, world, threads in runs:
            result = launch(cli, kind, mode, world, threads)
            steady = result["durations"][1:] or result["durations"]
            seconds = sum(steady) / len(steady)
            baseline = baseline or seconds
            rows.append((kind, result["parameters"], "ZeRO-3" if mode == "zero3" else "population", world,
                         result["threads"], seconds, baseline / seconds, result["comm_bytes"]))
            print(f"done: {kind} {mode} W={world} threads={threads}: {seconds:.2f} s/iteration", flush=True)

    print(f"\npopulation {cli.population_size}, {cli.prompts} prompts x {cli.new_tokens} new tokens, "
          f"{cli.iterations} iterations, {cli.threads} torch threads in all")
    print(f"{'model':>6} {'params':>12} {'mode':>10} {'W':>2} {'thr':>3} {'s/iter':>8} {'speedup':>8}  comm/bytes per iteration")
    for kind, params, mode, world, threads, seconds, speedup, comm in rows:
        print(f"{kind:>6} {params:>12,} {mode:>10} {world:>2} {threads:>3} {seconds:>8.2f} {speedup:>8.2f}  "
              f"{[int(c) for c in comm]}")


if __name__ == "__main__":
    main()
