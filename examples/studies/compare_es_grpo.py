"""The race: ESTrainer against TRL's GRPOTrainer on the arithmetic task, same model, same prompts, same clock.

Both methods train the same model (default: the embedded SmolLM2-135M-Instruct) on the training split of
``make_arithmetic_dataset_dict(num_train, num_validation, num_test, seed=task_seed)`` ("What is a + b? Reply with
only the number.", a, b in 1..50) under a wall-clock budget of *training* time, and are judged by one function:
greedy accuracy on ``--split`` (``test`` for the race, ``validation`` for tuning), graded by
:func:`trl_es.tasks.arithmetic.arithmetic_reward` (the first stated result), scored at training time 0, at every
budget mark, and at the end. The training clock is paused while evaluating. At the end each run is also scored at
``--final_max_new_tokens`` (the accuracy must not depend on where generation is cut) and with sampled completions
with the papers' sampling protocol (:data:`trl_es.analysis.PAPER_PROTOCOL`: T = 0.6, top-p 0.95; Pass@K from
``--sampled_samples`` samples per prompt, and the token entropy of those samples). During training the token
entropy of the policy (T = 1) on ``--entropy_prompts`` held-out validation prompts is recorded at every evaluation
(the entropy-collapse curve of arXiv 2608.27351).

Each (task seed, method, budget) arm runs in a fresh process tree, launched as :mod:`trl_es.launch` plans it:
ES by default with one single-threaded process per physical core (population parallelism), GRPO with
``--grpo_num_processes`` (default 1 process with every core's threads: its fastest configuration here, see
docs/es_vs_grpo.md). Processes agree on the clock (the maximum over processes), and share the evaluation.

    python examples/studies/compare_es_grpo.py --output_dir runs/race                 # 3 task seeds x 4/8/16 min
    python examples/studies/compare_es_grpo.py --methods es --split validation --budgets_minutes 8 \\
        --task_seeds 1 --es_overrides population_size=24 prompt_batch_size=12          # a tuning arm

ES uses ``--es_recipe`` (default ``examples/recipes/arithmetic_smollm2.yaml``): its ESConfig keys, then
``--es_overrides key=value ...``. With ``--es_schedule time`` (default) the recipe's learning-rate schedule is
replaced by one laid out over each run's budget in wall-clock time (:class:`TimeScheduleCallback`: constant, then a
cosine decay to 0 over the last ``--decay_fraction`` of the budget), and every budget is a separate run; with
``--es_schedule recipe`` the recipe's step schedule is kept and one run per seed is scored at every budget mark
(:class:`trl_es.trainer.time_budget.TimeScheduleCallback` is the time schedule).
GRPO: ``--grpo_*`` arguments; its learning rate is constant unless ``--grpo_schedule time``.

Writes to ``--output_dir``: ``results.json`` (every arm's curve and end-of-run figures), ``results.md`` (mean and
spread over task seeds per method and budget) and ``accuracy_vs_time.png``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser, TrainerCallback

from trl_es.cli import es_config_kwargs, load_recipe
from trl_es.files import save_figure, write_json

from _study.arms import write_results
from _study.spread import mean_and_std

DEFAULT_RECIPE = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "arithmetic_smollm2.yaml")
)
METHODS = ("es", "grpo")
SPLITS = ("test", "validation")
SCHEDULES = ("time", "recipe", "constant")
NO_LIMIT_STEPS = 1_000_000  # max_steps when the budget alone stops a run


@dataclass
class RaceArguments:
    """Arguments of the ES-vs-GRPO race."""

    output_dir: str = field(default="runs/es_vs_grpo", metadata={"help": "Where the table, JSON and PNG go."})
    model_name_or_path: str = field(
        default="embedded:SmolLM2-135M-Instruct",
        metadata={"help": "Model for both methods (hub id, local path or the embedded alias)."},
    )
    methods: list[str] = field(
        default_factory=lambda: list(METHODS),
        metadata={"help": "Methods to run, one after the other.", "choices": list(METHODS)},
    )
    budgets_minutes: list[float] = field(
        default_factory=lambda: [4.0, 8.0, 16.0],
        metadata={"help": "Training wall-clock budgets (evaluation time not counted)."},
    )
    task_seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Seeds of the prompt splits."})
    split: str = field(default="test", metadata={"help": "Split scored: test (race) or validation (tuning).",
                                                 "choices": list(SPLITS)})
    num_train_prompts: int = field(default=400, metadata={"help": "Training prompts."})
    num_validation_prompts: int = field(default=200, metadata={"help": "Validation prompts (tuning)."})
    num_test_prompts: int = field(default=200, metadata={"help": "Test prompts (reported only)."})
    seed: int = field(default=0, metadata={"help": "Training seed of both trainers."})
    eval_max_new_tokens: int | None = field(
        default=None, metadata={"help": "New tokens per scored completion (default: the ES recipe's "
                                "max_completion_length)."})
    final_max_new_tokens: int = field(default=64, metadata={"help": "End of run: greedy accuracy at this length too."})
    sampled_samples: int = field(default=16, metadata={
        "help": "End of run: samples per prompt for Pass@K at the papers' protocol (T=0.6, top-p 0.95; 0 = none)."})
    sample_batch_size: int = field(default=8, metadata={"help": "End of run: prompts per sampled generate call."})
    entropy_prompts: int = field(default=16, metadata={
        "help": "Validation prompts whose sampled token entropy (T=1, 2 samples each) is recorded at every "
        "evaluation during training (0 = none)."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per generate call when scoring."})
    save_models: bool = field(default=False, metadata={"help": "Save each trained model to its arm folder."})
    reuse_results: bool = field(default=False, metadata={
        "help": "Reuse an arm's result.json when its arm.json records the same settings (every argument but "
        "output_dir, methods, budgets_minutes, task_seeds, reuse_results and save_models, the arm's method, task "
        "seed, budget and marks, and for ES the resolved ESConfig), instead of training it again: a race can be run "
        "in parts and summarized once. The code version is not compared."})
    threads_per_process: int | None = field(
        default=None, metadata={"help": "torch threads per process (default: the launch plan's)."})
    # ES
    es_recipe: str = field(default=DEFAULT_RECIPE, metadata={"help": "YAML recipe whose ESConfig keys configure ES."})
    es_overrides: list[str] = field(default_factory=list,
                                    metadata={"help": "ESConfig overrides as key=value (values parsed as YAML)."})
    es_num_processes: int | None = field(default=None, metadata={"help": "ES processes (default: trl_es.launch's)."})
    es_schedule: str = field(default="time", metadata={
        "help": "time: the learning rate is laid out over each budget in wall-clock time (one run per budget); "
        "recipe: the recipe's step schedule (one run per seed, scored at every mark); constant.",
        "choices": list(SCHEDULES)})
    decay_fraction: float = field(default=0.35, metadata={"help": "Time schedule: cosine decay over this last part."})
    # GRPO
    grpo_num_processes: int = field(default=1, metadata={"help": "GRPO processes (1 = one process, all threads)."})
    grpo_learning_rate: float = field(default=1e-5, metadata={"help": "GRPO learning rate."})
    grpo_schedule: str = field(default="constant", metadata={"help": "GRPO learning-rate schedule.",
                                                              "choices": list(SCHEDULES)})
    grpo_num_generations: int = field(default=8, metadata={"help": "GRPO completions per prompt."})
    grpo_prompts_per_step: int = field(default=2, metadata={"help": "GRPO prompts per optimizer step."})
    grpo_temperature: float = field(default=1.0, metadata={"help": "GRPO sampling temperature."})
    grpo_beta: float = field(default=0.0, metadata={"help": "GRPO KL coefficient."})
    grpo_max_steps: int | None = field(
        default=None, metadata={"help": "GRPO optimizer steps (default: until the budget). For step-based tuning."})
    eval_every_steps: int | None = field(
        default=None, metadata={"help": "Also score every this many steps (step-based tuning, with a long budget)."})
    grpo_max_completion_length: int | None = field(
        default=None, metadata={"help": "GRPO completion tokens (default: the ES recipe's max_completion_length)."})
    worker: str | None = field(default=None, metadata={"help": "Internal: run one arm from this JSON spec file."})


# ---------------------------------------------------------------------------------------------- distributed helpers
def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum (or max) ``values`` over the processes (identity in one process)."""
    import torch
    import torch.distributed as dist

    if _world()[1] == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()


# ---------------------------------------------------------------------------------------------- evaluation + clock
class SplitAccuracy:
    """Accuracy on a split: the one measurement both methods are judged by.

    Each process scores every ``W``-th prompt with the eager engine (shared prompt prefix) and the counts are summed.
    """

    def __init__(self, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 50):
        from trl_es.generation import EagerEngine
        from trl_es.tasks.arithmetic import arithmetic_reward
        from trl_es.rollout import RewardScorer

        self.tokenizer, self.rows, self.batch_size = tokenizer, rows, batch_size
        self.max_new_tokens = max_new_tokens
        self.scorer = RewardScorer([arithmetic_reward])
        self.engine = EagerEngine(share_prompt_prefix=True)

    def __call__(self, model, max_new_tokens: int | None = None, temperature: float = 0.0, samples: int = 1) -> float:
        import torch

        from trl_es.rollout import build_generation_config, score_model

        rank, world = _world()
        mine = self.rows[rank::world]
        config = build_generation_config(self.tokenizer, max_new_tokens or self.max_new_tokens, temperature=temperature,
                                         model_generation_config=getattr(model, "generation_config", None))
        if temperature > 0:
            torch.manual_seed(1234 + rank)
        correct = 0.0
        for first in range(0, len(mine), self.batch_size):
            batch = mine[first : first + self.batch_size]
            out = score_model(model, self.tokenizer, batch, self.scorer, config, samples, engine=self.engine)
            correct += float(out.rewards.nan_to_num(0.0).sum())
        total_correct, total = _all_reduce([correct, float(len(mine) * samples)])
        return total_correct / total


class HeldOutEntropy:
    """Mean token entropy (nats) of the policy at T = 1 on held-out prompts, 2 samples each, split over processes
    (:func:`trl_es.analysis.sample_policy`, all of a process's prompts in one call; the entropy-collapse measure of
    arXiv 2608.27351)."""

    def __init__(self, tokenizer, rows: list[dict], max_new_tokens: int, samples: int = 2):
        from trl_es.rollout import RewardScorer
        from trl_es.tasks.arithmetic import arithmetic_reward

        self.tokenizer, self.rows, self.samples = tokenizer, rows, samples
        self.max_new_tokens = max_new_tokens
        self.scorer = RewardScorer([arithmetic_reward])

    def __call__(self, model) -> float:
        from trl_es.analysis import sample_policy
        from trl_es.rollout import build_generation_config

        rank, world = _world()
        mine = self.rows[rank::world]
        entropy = [0.0, 0.0]  # a process without rows adds nothing
        if mine:
            config = build_generation_config(self.tokenizer, self.max_new_tokens, temperature=1.0,
                                             model_generation_config=getattr(model, "generation_config", None))
            out = sample_policy(model, self.tokenizer, mine, self.scorer, config, self.samples,
                                sample_batch_size=len(mine), seed=4321 + rank, progress=False)
            entropy = [out["token_entropy_sum"], float(out["token_entropy_tokens"])]
        total, tokens = _all_reduce(entropy)
        return total / tokens if tokens else math.nan


def policy_figures(model, tokenizer, rows: list[dict], max_new_tokens: int, num_samples: int,
                   sample_batch_size: int) -> dict:
    """End of run, split over processes: Pass@K (K = 1, 2, 4, ... <= ``num_samples``) and the token entropy of the
    samples at the papers' protocol (:data:`trl_es.analysis.PAPER_PROTOCOL`), via
    :func:`trl_es.analysis.sample_policy` (the sampled pass of ``evaluate_policy`` and ``trl-es eval``; the greedy
    figure is :class:`SplitAccuracy`'s). A process without rows adds nothing."""
    from trl_es.analysis import PAPER_PROTOCOL, mean_pass_at_k, sample_policy
    from trl_es.rollout import build_generation_config
    from trl_es.tasks.arithmetic import arithmetic_reward

    rank, world = _world()
    mine = rows[rank::world]
    protocol = PAPER_PROTOCOL.with_samples(num_samples)
    keys = [f"pass@{k}" for k in protocol.pass_k]
    local = [0.0] * (len(keys) + 3)
    if mine:
        config = build_generation_config(tokenizer, max_new_tokens, protocol.temperature, protocol.top_p,
                                         model_generation_config=getattr(model, "generation_config", None))
        out = sample_policy(model, tokenizer, mine, [arithmetic_reward], config, num_samples, sample_batch_size,
                            seed=1234 + rank, progress=rank == 0)
        local = [mean_pass_at_k(num_samples, out["correct"], k) * len(mine) for k in protocol.pass_k] + [
            float(len(mine)), out["token_entropy_sum"], float(out["token_entropy_tokens"])]
    sums = _all_reduce(local)
    prompts = sums[len(keys)]
    figures = {f"sampled_{k}": value / prompts for k, value in zip(keys, sums, strict=False)}
    figures["sampled_token_entropy"] = sums[-2] / sums[-1] if sums[-1] else math.nan
    figures["sample_temperature"], figures["sample_top_p"] = protocol.temperature, protocol.top_p
    return figures


class EvalClockCallback(TrainerCallback):
    """Training clock with evaluations that do not count towards it; stops training at the budget.

    Evaluates at training time 0 (on train begin), then on the first step end after each mark in
    ``marks_seconds`` (and after every ``eval_every_seconds`` if given), and at the end (the step that crosses
    ``budget_seconds``, or the last step). The clock is paused while evaluating, and with several processes every
    process uses the largest clock of all, so all of them evaluate and stop at the same step. ``records`` holds
    ``{"training_seconds", "step", "accuracy", "eval_seconds"}`` dicts (and ``"token_entropy"`` with ``entropy``, a
    callable of the model).
    """

    def __init__(self, evaluate, budget_seconds: float, eval_every_seconds: float | None = None, marks_seconds=(),
                 every_steps: int | None = None, entropy=None):
        self.evaluate, self.budget, self.entropy = evaluate, float(budget_seconds), entropy
        self.every, self.every_steps = eval_every_seconds, every_steps
        self.marks = sorted(float(m) for m in marks_seconds if 0 < m < budget_seconds)
        self.records: list[dict] = []
        self.training_seconds = 0.0  # training time up to the last step end
        self._banked = 0.0  # training time before the current segment (segments are split by evaluations)
        self._segment_start = None
        self._next = self._next_due(0.0)

    def _next_due(self, now: float) -> float:
        candidates = [m for m in self.marks if m > now]
        if self.every:
            candidates.append((math.floor(now / self.every) + 1) * self.every)
        return min(candidates) if candidates else math.inf

    def _record(self, model, step: int) -> None:
        start = time.monotonic()
        accuracy = self.evaluate(model)
        record = {"training_seconds": self.training_seconds, "step": step, "accuracy": accuracy}
        if self.entropy is not None:
            record["token_entropy"] = self.entropy(model)
        record["eval_seconds"] = time.monotonic() - start
        self.records.append(record)
        if _world()[0] == 0:
            print(f"[race] step {step}  training {self.training_seconds / 60:.2f} min  accuracy {accuracy:.3f}",
                  flush=True)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._record(model, state.global_step)
        self._segment_start = time.monotonic()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        (elapsed,) = _all_reduce([self._banked + time.monotonic() - self._segment_start], op="max")
        self.training_seconds = elapsed
        over_budget = self.training_seconds >= self.budget
        if over_budget:
            control.should_training_stop = True
        step_due = bool(self.every_steps) and state.global_step % self.every_steps == 0
        if over_budget or step_due or self.training_seconds >= self._next:
            self._banked = self.training_seconds
            self._record(model, state.global_step)
            self._next = self._next_due(self.training_seconds)
            self._segment_start = time.monotonic()  # the clock resumes after the evaluation

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.records or self.records[-1]["step"] != state.global_step:  # stopped by max_steps, not the clock
            self._record(model, state.global_step)


# ---------------------------------------------------------------------------------------------- the two methods
def race_es_kwargs(race: RaceArguments, recipe: dict, output_dir: str) -> dict:
    """The ESConfig keyword arguments of an ES arm: recipe, overrides, then what the race itself sets.

    ``--es_schedule recipe`` keeps the recipe's ``max_steps`` and step schedule (the budget still stops the run
    first); ``time`` and ``constant`` run until the budget with a constant scheduler (the time schedule is applied by
    :class:`TimeScheduleCallback`).

    Raises:
        ValueError: for a ``max_steps`` that is not an integer >= 1 or -1.
    """
    kwargs = es_config_kwargs(recipe, race.es_overrides)
    max_steps = kwargs.get("max_steps")
    if max_steps is None or max_steps == -1:  # -1: transformers' "not set"
        max_steps = NO_LIMIT_STEPS
    elif isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"ES max_steps (recipe or --es_overrides) must be an integer >= 1 or -1 (until the budget), "
                         f"got {max_steps!r}.")
    if race.es_schedule != "recipe":
        max_steps = NO_LIMIT_STEPS
        kwargs["lr_scheduler_type"] = "constant"
        kwargs.pop("lr_scheduler_kwargs", None)
    kwargs["max_steps"] = max_steps
    kwargs.update(output_dir=output_dir, eval_strategy="no", save_strategy="no", report_to="none", seed=race.seed)
    kwargs.setdefault("reward_weights", [1.0])
    return kwargs


def completion_length(race: RaceArguments, recipe: dict) -> int:
    """Generation length of the race: ``--eval_max_new_tokens``, else the ES recipe's ``max_completion_length``."""
    if race.eval_max_new_tokens:
        return race.eval_max_new_tokens
    overrides = es_config_kwargs(recipe, race.es_overrides)
    return int(overrides.get("max_completion_length", 12))


def build_es_trainer(model, tokenizer, train_dataset, race: RaceArguments, recipe: dict, output_dir: str, callbacks):
    from trl_es import ESConfig, ESTrainer
    from trl_es.tasks.arithmetic import arithmetic_reward

    args = ESConfig(**race_es_kwargs(race, recipe, output_dir))
    return ESTrainer(model, [arithmetic_reward], args=args, train_dataset=train_dataset, processing_class=tokenizer,
                     callbacks=callbacks)


def build_grpo_trainer(model, tokenizer, train_dataset, race: RaceArguments, max_completion_length: int,
                       output_dir: str, callbacks):
    from trl import GRPOConfig, GRPOTrainer

    from trl_es.tasks.arithmetic import arithmetic_reward

    _, world = _world()
    completions = race.grpo_prompts_per_step * race.grpo_num_generations
    if completions % world:
        raise ValueError(f"GRPO's {completions} completions per step must split evenly over {world} processes.")
    # In GRPO the per-device batch counts completions: one step = prompts_per_step x num_generations completions,
    # generated and used for one optimizer step, shared by the processes.
    args = GRPOConfig(
        output_dir=output_dir,
        learning_rate=race.grpo_learning_rate,
        lr_scheduler_type="constant",  # the budget ends the run; a time schedule, if any, comes from a callback
        num_generations=race.grpo_num_generations,
        per_device_train_batch_size=completions // world,
        gradient_accumulation_steps=1,
        temperature=race.grpo_temperature,
        beta=race.grpo_beta,
        max_completion_length=race.grpo_max_completion_length or max_completion_length,
        max_steps=race.grpo_max_steps or NO_LIMIT_STEPS,
        bf16=False,
        gradient_checkpointing=False,  # speed only: a 135M model needs no activation memory savings
        eval_strategy="no",
        save_strategy="no",
        dataloader_pin_memory=False,
        logging_steps=1,
        report_to="none",
        seed=race.seed,
    )
    return GRPOTrainer(model=model, reward_funcs=[arithmetic_reward], args=args, train_dataset=train_dataset,
                       processing_class=tokenizer, callbacks=callbacks)


# ---------------------------------------------------------------------------------------------- one arm (worker)
def run_worker(spec: dict) -> dict:
    """Train one arm under the clock (in every process of its launch); process 0 writes ``spec["result"]``."""
    import torch

    from trl_es.models import load_model_and_tokenizer
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict

    race = RaceArguments(**spec["race"])
    if race.threads_per_process:
        torch.set_num_threads(race.threads_per_process)
    recipe = load_recipe(race.es_recipe)
    method, budget, marks = spec["method"], spec["budget_minutes"], spec["marks_minutes"]
    splits = make_arithmetic_dataset_dict(race.num_train_prompts, race.num_validation_prompts, race.num_test_prompts,
                                          seed=spec["task_seed"])
    rows = [splits[race.split][i] for i in range(len(splits[race.split]))]
    model, tokenizer = load_model_and_tokenizer(race.model_name_or_path)  # fp32, pad = EOS if unset
    length = completion_length(race, recipe)
    evaluate = SplitAccuracy(tokenizer, rows, length, race.eval_batch_size)
    entropy = None
    if race.entropy_prompts:
        held_out = splits["validation"]
        entropy = HeldOutEntropy(tokenizer, [held_out[i] for i in range(min(race.entropy_prompts, len(held_out)))],
                                 length)
    clock = EvalClockCallback(evaluate, 60.0 * budget, marks_seconds=[60.0 * m for m in marks],
                              every_steps=race.eval_every_steps, entropy=entropy)
    callbacks = [clock]
    schedule = race.es_schedule if method == "es" else race.grpo_schedule
    learning_rate = (race_es_kwargs(race, recipe, spec["output_dir"])["learning_rate"] if method == "es"
                     else race.grpo_learning_rate)
    if schedule == "time":
        from trl_es.trainer.time_budget import TimeScheduleCallback

        callbacks.append(TimeScheduleCallback(clock, learning_rate, 60.0 * budget, race.decay_fraction))
    if method == "es":
        trainer = build_es_trainer(model, tokenizer, splits["train"], race, recipe, spec["output_dir"], callbacks)
    else:
        trainer = build_grpo_trainer(model, tokenizer, splits["train"], race, length, spec["output_dir"], callbacks)
    if trainer.args.max_steps == NO_LIMIT_STEPS:  # the budget alone ends the run: a bar in minutes, not 1e6 steps
        from trl_es.trainer.time_budget import show_progress_in_minutes

        show_progress_in_minutes(trainer, 60.0 * budget, lambda: clock.training_seconds)
    wall_start = time.monotonic()
    trainer.train()
    wall_seconds = time.monotonic() - wall_start
    trained = trainer.accelerator.unwrap_model(trainer.model)
    final = {f"accuracy_at_{race.final_max_new_tokens}_tokens": evaluate(trained, race.final_max_new_tokens)}
    if race.sampled_samples:
        final.update(policy_figures(trained, tokenizer, rows, length, race.sampled_samples, race.sample_batch_size))
    if race.save_models:
        from trl_es.files import save_trainer_model

        save_trainer_model(trainer, os.path.join(spec["output_dir"], "model"))
    result = {
        "method": method, "task_seed": spec["task_seed"], "budget_minutes": budget, "split": race.split,
        "processes": _world()[1], "threads": torch.get_num_threads(), "schedule": schedule,
        "steps": trainer.state.global_step, "training_minutes": clock.training_seconds / 60.0,
        "wall_minutes_with_evals": wall_seconds / 60.0, "max_new_tokens": length,
        "curve": clock.records, **final,
    }
    if trainer.is_world_process_zero():
        write_json(spec["result"], result)
    return result


# ---------------------------------------------------------------------------------------------- orchestration
def arms(race: RaceArguments) -> list[dict]:
    """The runs of the race: per task seed and method, one run per budget (time schedule), else one run scored at
    every budget mark."""
    runs = []
    longest = max(race.budgets_minutes)
    for seed in race.task_seeds:
        for method in race.methods:
            schedule = race.es_schedule if method == "es" else race.grpo_schedule
            budgets = sorted(race.budgets_minutes) if schedule == "time" else [longest]
            for budget in budgets:
                marks = [b for b in race.budgets_minutes if b < budget]
                runs.append({"method": method, "task_seed": seed, "budget_minutes": budget, "marks_minutes": marks,
                             "output_dir": os.path.join(race.output_dir, f"seed{seed}", f"{method}_{budget:g}min")})
    return runs


ARM_SETTINGS_NAME = "arm.json"  # beside an arm's result.json: the settings it was run with (--reuse_results)
NOT_ARM_SETTINGS = ("output_dir", "methods", "budgets_minutes", "task_seeds", "reuse_results", "save_models", "worker")


def arm_settings(race: RaceArguments, spec: dict) -> dict:
    """What an arm's result depends on: the race arguments that are not about which arms run or where they are
    written, the arm's method, task seed, budget and marks, and the resolved ESConfig keyword arguments (so an edited
    recipe file does not pass for the old one; GRPO takes its completion length from the recipe too). JSON-normalized, so it compares equal to a saved copy."""
    settings = {k: v for k, v in dataclasses.asdict(race).items() if k not in NOT_ARM_SETTINGS}
    settings["arm"] = {k: spec[k] for k in ("method", "task_seed", "budget_minutes", "marks_minutes")}
    # Every arm: GRPO reads the recipe too (its completion length is the recipe's max_completion_length).
    settings["es_config"] = race_es_kwargs(race, load_recipe(race.es_recipe), "<arm>")
    return json.loads(json.dumps(settings))


def launch_arm(race: RaceArguments, spec: dict) -> dict:
    """Run one arm in a fresh process tree (its launch plan, :func:`trl_es.launch.run_worker`); return its result.

    Writes ``arm.json`` (:func:`arm_settings`) beside the result once the arm has finished; with
    ``--reuse_results`` an arm whose ``arm.json`` equals this run's settings and whose ``result.json`` exists is read
    back instead of run. An arm run again keeps the earlier result and settings as ``result.replaced.json`` and
    ``arm.replaced.json`` (one generation back)."""
    from trl_es.launch import plan_launch, run_worker

    processes = race.es_num_processes if spec["method"] == "es" else race.grpo_num_processes
    os.makedirs(spec["output_dir"], exist_ok=True)
    result_file = os.path.join(spec["output_dir"], "result.json")
    settings_file = os.path.join(spec["output_dir"], ARM_SETTINGS_NAME)
    settings = arm_settings(race, spec)
    label = f"[race] {spec['method']} seed {spec['task_seed']} budget {spec['budget_minutes']:g} min"
    if race.reuse_results and os.path.isfile(result_file) and os.path.isfile(settings_file):
        with open(settings_file) as f:
            saved = json.load(f)
        if saved == settings:
            print(f"{label}: reusing {result_file} (same settings)", flush=True)
            with open(result_file) as f:
                return json.load(f)
        print(f"{label}: {settings_file} records other settings; running the arm again (the earlier result is kept "
              "as result.replaced.json)", flush=True)
    for name in ("result", "arm"):  # an earlier result (and its settings): kept aside, not lost, then replaced
        path = os.path.join(spec["output_dir"], f"{name}.json")
        if os.path.isfile(path):
            os.replace(path, os.path.join(spec["output_dir"], f"{name}.replaced.json"))
    spec = dict(spec, race=dataclasses.asdict(race), result=result_file)
    print(f"{label}: {plan_launch(processes).reason}", flush=True)
    result = run_worker(os.path.abspath(__file__), spec, processes, race.threads_per_process)
    write_json(settings_file, settings)
    return result


def accuracy_at(result: dict, minutes: float) -> float:
    """The accuracy scored at the first evaluation at or after ``minutes`` of training (the budget's end point)."""
    for record in result["curve"]:
        if record["training_seconds"] >= 60.0 * minutes - 1e-9:
            return record["accuracy"]
    return result["curve"][-1]["accuracy"]


def summarize(race: RaceArguments, results: list[dict]) -> list[dict]:
    """One row per method and budget: accuracy per task seed (the run of that budget, else the longer run scored at
    that mark), mean and sample standard deviation, and the end-of-run figures of the runs of that budget."""
    rows = []
    for method in race.methods:
        for budget in sorted(race.budgets_minutes):
            per_seed, extra = {}, {}
            for seed in race.task_seeds:
                mine = [r for r in results if r["method"] == method and r["task_seed"] == seed]
                exact = [r for r in mine if r["budget_minutes"] == budget]
                if exact:
                    per_seed[seed] = exact[0]["curve"][-1]["accuracy"]
                    for key, value in exact[0].items():
                        if key.startswith(("accuracy_at_", "sampled_pass@", "sampled_token_entropy")):
                            extra.setdefault(key, []).append(value)
                elif mine:
                    per_seed[seed] = accuracy_at(max(mine, key=lambda r: r["budget_minutes"]), budget)
            if not per_seed:
                continue
            mean, std = mean_and_std(list(per_seed.values()))
            row = {"method": method, "budget_minutes": budget, "per_seed": per_seed, "mean": mean, "std": std}
            for key, values in extra.items():
                row[key], row[f"{key}_std"] = mean_and_std(values)
            rows.append(row)
    return rows


NAMES = {"es": "ES (ESTrainer)", "grpo": "GRPO (TRL GRPOTrainer)"}


def markdown_table(race: RaceArguments, rows: list[dict], start: float | None) -> str:
    from trl_es.analysis import PAPER_PROTOCOL

    seeds = ", ".join(str(s) for s in race.task_seeds)
    sampled = sorted({k for r in rows for k in r if k.startswith("sampled_") and not k.endswith("_std")},
                     key=lambda k: (not k.startswith("sampled_pass@"), int(k.split("@")[1]) if "@" in k else 0))
    sampled = [k for k in sampled if k in ("sampled_pass@1", "sampled_token_entropy") or k == max(
        (k for k in sampled if k.startswith("sampled_pass@")), key=lambda k: int(k.split("@")[1]), default=None)]
    header = "| method | budget (min) | per task seed | mean | std |" + "".join(
        f" {k.removeprefix('sampled_')} (mean +- std) |" for k in sampled)
    lines = [f"Greedy accuracy on the {race.split} split ({race.num_test_prompts if race.split == 'test' else race.num_validation_prompts}"
             f" prompts per task seed; task seeds {seeds}); start (untrained) {start:.3f} mean." if start is not None else "",
             "" if not sampled else "Sampled figures at the end of each budget's run (runs of exactly that budget): "
             f"T = {PAPER_PROTOCOL.temperature:g}, top-p {PAPER_PROTOCOL.top_p:g}, {race.sampled_samples} samples "
             "per prompt.", "", header, "|---" * (5 + len(sampled)) + "|"]
    for r in rows:
        per_seed = ", ".join(f"{v:.3f}" for v in r["per_seed"].values())
        cells = "".join(f" {r[k]:.3f} +- {r.get(k + '_std', 0.0):.3f} |" if k in r else " - |" for k in sampled)
        lines.append(f"| {NAMES.get(r['method'], r['method'])} | {r['budget_minutes']:g} | {per_seed} | "
                     f"{r['mean']:.3f} | {r['std']:.3f} |{cells}")
    return "\n".join(lines) + "\n"


def plot_curves(race: RaceArguments, results: list[dict], rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"es": "tab:blue", "grpo": "tab:orange"}
    with_entropy = any("token_entropy" in p for r in results for p in r["curve"])
    fig, axes = plt.subplots(1, 2 if with_entropy else 1, figsize=(13 if with_entropy else 7.5, 4.5), squeeze=False)
    ax = axes[0][0]
    if with_entropy:
        right = axes[0][1]
        for result in results:
            points = [p for p in result["curve"] if "token_entropy" in p]
            right.plot([p["training_seconds"] / 60.0 for p in points], [p["token_entropy"] for p in points], "o-",
                       color=colors.get(result["method"]), alpha=0.5, lw=1, ms=3)
        for method in race.methods:
            right.plot([], [], "o-", color=colors.get(method), label=NAMES.get(method, method))
        right.set_xlabel("training wall-clock minutes (evaluation time excluded)")
        right.set_ylabel("token entropy at T = 1 (nats), held-out prompts")
        right.grid(alpha=0.3)
        right.legend(fontsize=8)
    for result in results:
        minutes = [p["training_seconds"] / 60.0 for p in result["curve"]]
        ax.plot(minutes, [p["accuracy"] for p in result["curve"]], "-", color=colors.get(result["method"]),
                alpha=0.25, lw=1)
    for method in race.methods:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        x = [0.0] + [r["budget_minutes"] for r in mine]
        starts = [r["curve"][0]["accuracy"] for r in results if r["method"] == method]
        mean = [sum(starts) / len(starts)] + [r["mean"] for r in mine]
        std = [0.0] + [r["std"] for r in mine]
        ax.errorbar(x, mean, yerr=std, fmt="o-", color=colors.get(method), capsize=4, lw=2,
                    label=f"{NAMES.get(method, method)}: mean +- std over task seeds")
    ax.set_xlabel("training wall-clock minutes (evaluation time excluded)")
    ax.set_ylabel(f"greedy accuracy ({race.split} split)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_pass_at_k(race: RaceArguments, rows: list[dict], path: str) -> None:
    """Pass@K against K at the papers' protocol, mean over task seeds, one curve per method and budget (nothing
    is written without sampled figures)."""
    from trl_es.analysis import PAPER_PROTOCOL, plot_pass_at_k_curves

    ks = sorted({int(k.split("@")[1]) for r in rows for k in r if k.startswith("sampled_pass@") and "_std" not in k})
    curves = {f"{NAMES.get(r['method'], r['method'])}, {r['budget_minutes']:g} min": [r[f"sampled_pass@{k}"] for k in ks]
              for r in rows if all(f"sampled_pass@{k}" in r for k in ks)}
    if ks and curves:
        plot_pass_at_k_curves(curves, ks, path, temperature=PAPER_PROTOCOL.temperature, split=f"{race.split} split",
                              title=f"Pass@K, T = {PAPER_PROTOCOL.temperature:g}, top-p {PAPER_PROTOCOL.top_p:g}, "
                              f"mean over task seeds {', '.join(map(str, race.task_seeds))}")


def parse_args(argv: list[str] | None = None) -> RaceArguments:
    (race,) = HfArgumentParser(RaceArguments).parse_args_into_dataclasses(
        args=list(sys.argv[1:] if argv is None else argv)
    )
    if not race.budgets_minutes or min(race.budgets_minutes) <= 0:
        raise ValueError(f"budgets_minutes must be > 0, got {race.budgets_minutes}.")
    if race.split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {race.split!r}.")
    for name in ("es_schedule", "grpo_schedule"):
        if getattr(race, name) not in SCHEDULES:
            raise ValueError(f"{name} must be one of {SCHEDULES}, got {getattr(race, name)!r}.")
    if race.split == "test" and race.num_test_prompts < 1 or race.split == "validation" and race.num_validation_prompts < 1:
        raise ValueError(f"the {race.split} split is empty: set num_{race.split}_prompts.")
    return race


def main(argv: list[str] | None = None) -> dict:
    """Run the race (every arm in its own processes); returns the content of results.json."""
    race = parse_args(argv)
    if race.worker:
        with open(race.worker) as f:
            return run_worker(json.load(f))
    race.methods = list(dict.fromkeys(race.methods))  # keep order, drop repeats
    os.makedirs(race.output_dir, exist_ok=True)
    results = [launch_arm(race, spec) for spec in arms(race)]
    rows = summarize(race, results)
    starts = [r["curve"][0]["accuracy"] for r in results]
    output = {"arguments": dataclasses.asdict(race),
              "es_config": race_es_kwargs(race, load_recipe(race.es_recipe), "<arm>") if "es" in race.methods else None,
              "table": rows, "runs": results}
    table = markdown_table(race, rows, sum(starts) / len(starts) if starts else None)

    def plots():
        plot_curves(race, results, rows, os.path.join(race.output_dir, "accuracy_vs_time.png"))
        plot_pass_at_k(race, rows, os.path.join(race.output_dir, "pass_at_k.png"))

    write_results(race.output_dir, output, table, plots)
    return output


if __name__ == "__main__":
    main()
