"""Sampled Pass@K evaluation vs training's own generation, completions per second, in one run (issue 22, item 5).

Both on the embedded SmolLM2-135M-Instruct, arithmetic task, the main job's settings (``max_completion_length`` 12,
fp32, the eager engine with the shared chat prefix computed once):

- ``training``: one ES iteration's generation as ESTrainer runs it for the main job: the batched low-rank population
  (``--population`` rank-1 members, antithetic) applied, one greedy ``generate`` over ``population x prompts`` rows
  (:class:`trl_es.rollout.Rollout`, the trainer's call).
- ``eval_sample_batch_<s>``: ``trl-es eval --sample_batch_size s``'s sampled path itself,
  :func:`trl_es.analysis.sample_policy` (also ``evaluate_policy``'s and the race's): per ``s`` prompts, one call of
  ``s x num_samples`` rows at T = 0.6, top-p 0.95 (:data:`trl_es.analysis.PAPER_PROTOCOL`), scored with the task's
  rewards, token entropy recorded (as ``trl-es eval`` does; ``eval_before`` recorded none).
- ``eval_multinomial_<s>`` (with ``--time_multinomial``): the same with transformers' own draws
  (``sample_policy(candidate_sampling=False)``, ``torch.multinomial`` over the vocabulary; the path before
  2026-12-02).
- ``eval_before``: the same completions the way ``trl-es eval`` made them before (plain engine, 32 prompts x
  ``num_samples`` rows per call), on ``--before_prompts`` prompts.

Each variant runs once untimed first. With ``--repeats R`` the variants are then timed in R interleaved rounds (every
variant once per round, in order), so a drift of the machine's speed during the run reaches training and evaluation
alike; each variant's ``completions_per_s`` is the median of its R rates (all in ``rates``), and each ratio eval /
training is given as the ratio of the medians and per round (``..._per_round``: both timed within seconds of each
other). Completions/s, the ratios and a JSON file are printed.

    python benchmarks/eval_speed.py --threads 2 --output_file runs/eval_speed.json
    python benchmarks/eval_speed.py --threads 2 --repeats 5 --sample_batch_sizes 8 --output_file runs/eval_speed_r5.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from trl import ModelConfig

from trl_es.analysis import PAPER_PROTOCOL, sample_policy
from trl_es.cli.arguments import TaskArguments
from trl_es.cli.loading import load_model_and_tokenizer
from trl_es.cli.splits import task_splits
from trl_es.es.noise import make_noise_source
from trl_es.es.perturbation import Member, TrainedParameters, linear_weight_names
from trl_es.es.strategy import BatchedLowRankPopulation
from trl_es.files import write_json
from trl_es.generation import EagerEngine
from trl_es.rollout import RewardScorer, Rollout, build_generation_config, score_model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=12, help="Prompts per training iteration.")
    parser.add_argument("--eval_prompts", type=int, default=24)
    parser.add_argument("--before_prompts", type=int, default=8)
    parser.add_argument("--num_samples", type=int, default=16)
    parser.add_argument("--sample_batch_sizes", type=int, nargs="+", default=[1, 4, 8],
                        help="trl-es eval --sample_batch_size values to time (prompts per sampled call).")
    parser.add_argument("--time_multinomial", action="store_true",
                        help="Also time each width with transformers' multinomial draws (the path before 2026-12-02).")
    parser.add_argument("--new_tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1,
                        help="Interleaved timing rounds (every variant once per round); medians are reported.")
    parser.add_argument("--output_file", default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(ModelConfig(model_name_or_path="embedded:SmolLM2-135M-Instruct"))
    model.eval()
    task, splits = task_splits(TaskArguments(task="arithmetic"))
    train_rows = [splits["train"][i] for i in range(args.prompts)]
    eval_rows = [splits["validation"][i] for i in range(max(args.eval_prompts, args.before_prompts))]
    scorer = RewardScorer(task.reward_funcs)
    engine = EagerEngine(share_prompt_prefix=True)
    greedy = build_generation_config(tokenizer, args.new_tokens, model_generation_config=model.generation_config)
    sampled = build_generation_config(tokenizer, args.new_tokens, PAPER_PROTOCOL.temperature, PAPER_PROTOCOL.top_p,
                                      model_generation_config=model.generation_config)

    backend = BatchedLowRankPopulation(noise_rank=1)
    names = set(linear_weight_names(model))  # the low-rank backend's default selection, as ESTrainer takes it
    params = TrainedParameters([(n, p) for n, p in model.named_parameters() if n in names])
    noise = make_noise_source(kind="auto", lowrank=True)  # ESConfig noise_source="auto" with low-rank members
    rollout = Rollout(tokenizer, scorer, greedy, 1, None, engine)
    members = [Member(seed, sign) for seed in range(args.population // 2) for sign in (1, -1)]

    def training():
        with backend.apply(params, noise, members, 0.005, model):
            out = rollout(model, train_rows * len(members), num_members=len(members))
        return len(out.completions)

    def evaluation(rows, sample_batch_size, candidate_sampling=True):
        out = sample_policy(model, tokenizer, rows, scorer, sampled, args.num_samples, sample_batch_size,
                            progress=False, candidate_sampling=candidate_sampling)
        return out["rewards_per_func"].shape[0] * out["rewards_per_func"].shape[1]

    def before(rows):
        done = 0
        for first in range(0, len(rows), 32):
            done += len(score_model(model, tokenizer, rows[first : first + 32], scorer, sampled, args.num_samples)
                        .completions)
        return done

    variants = {"training": (training, training)}
    for size in args.sample_batch_sizes:
        variants[f"eval_sample_batch_{size}"] = (lambda size=size: evaluation(eval_rows[: args.eval_prompts], size),
                                                 lambda size=size: evaluation(eval_rows[:size], size))
        if args.time_multinomial:
            variants[f"eval_multinomial_{size}"] = (
                lambda size=size: evaluation(eval_rows[: args.eval_prompts], size, False),
                lambda size=size: evaluation(eval_rows[:size], size, False))
    variants["eval_before"] = (lambda: before(eval_rows[: args.before_prompts]), lambda: before(eval_rows[:2]))
    result = {"threads": torch.get_num_threads(), "settings": vars(args)}
    with torch.no_grad():
        for name, (_, warm_up) in variants.items():
            print(f"warm-up: {name}", file=sys.stderr, flush=True)
            warm_up()
        rates = {name: [] for name in variants}
        for round_index in range(args.repeats):
            for name, (fn, _) in variants.items():
                print(f"timing: {name} (round {round_index + 1}/{args.repeats})", file=sys.stderr, flush=True)
                torch.manual_seed(round_index)
                start = time.perf_counter()
                completions = fn()
                seconds = time.perf_counter() - start
                rates[name].append(completions / seconds)
                print(f"{name}: {completions} completions in {seconds:.1f} s = {completions / seconds:.1f}/s",
                      file=sys.stderr, flush=True)
                result[name] = {"completions": completions, "seconds": seconds}
        for name in variants:
            result[name]["completions_per_s"] = statistics.median(rates[name])
            result[name]["rates"] = rates[name]
            if args.repeats > 1:
                del result[name]["seconds"]  # the last round's only; the rates hold every round

    def ratio(name, over):
        result[f"ratio_{name}_over_{over}"] = result[name]["completions_per_s"] / result[over]["completions_per_s"]
        if args.repeats > 1:
            result[f"ratio_{name}_over_{over}_per_round"] = [a / b for a, b in zip(rates[name], rates[over])]

    for size in args.sample_batch_sizes:
        ratio(f"eval_sample_batch_{size}", "training")
        ratio(f"eval_sample_batch_{size}", "eval_before")
        if args.time_multinomial:
            ratio(f"eval_multinomial_{size}", "training")
    result["protocol"] = {"temperature": PAPER_PROTOCOL.temperature, "top_p": PAPER_PROTOCOL.top_p}
    print(json.dumps(result, indent=2))
    if args.output_file:
        write_json(args.output_file, result)
    return result


if __name__ == "__main__":
    main()
