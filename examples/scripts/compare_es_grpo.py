"""The race: ESTrainer against TRL's GRPOTrainer on the arithmetic task, same model, same prompts, same clock.

Both methods train the same model (default: the embedded SmolLM2-135M-Instruct) on the same training prompts
"What is a + b? Reply with only the number." (a, b in 1..50) under the same wall-clock budget of *training* time
(a cap: a recipe whose ``max_steps`` ends ES earlier stops it there).
Held-out accuracy (greedy decoding, 10 new tokens, 200 prompts disjoint from the training ones, scored by
``score_model`` with ``RewardScorer([arithmetic_reward])``) is measured by one function for both methods: at
training time 0, every ``--eval_every_minutes`` of training time, and at the end. The training clock is paused
while evaluating. The methods run one after the other.

    python examples/scripts/compare_es_grpo.py --output_dir runs/es_vs_grpo            # both, 16-min budget each
    python examples/scripts/compare_es_grpo.py --es_overrides max_steps=26             # ES as measured in the docs
    python examples/scripts/compare_es_grpo.py --methods grpo --budget_minutes 4
    python examples/scripts/compare_es_grpo.py --es_overrides population_size=8 sigma=0.002

ES uses the main job's recipe (``--es_recipe``, default ``examples/recipes/arithmetic_smollm2.yaml``): its
ESConfig keys are used as is (task and model keys are dropped), then ``--es_overrides key=value ...`` apply;
``output_dir``, ``eval_strategy``, ``save_strategy``, ``report_to`` and ``seed`` are set by this script. The
recipe's ``max_steps`` is kept (its learning-rate schedule is laid out over it); without one ES runs until the budget. GRPO uses the anchor settings of the issue: lr 1e-5, 8 generations x 2 prompts per step, temperature 1.0,
beta 0, 10 completion tokens.

Writes to ``--output_dir``: ``results.json`` (table and accuracy curves), ``results.md`` (the table) and
``accuracy_vs_time.png`` (held-out accuracy against training minutes, both methods).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser, TrainerCallback

from trl_es.models import EMBEDDED_MODEL, load_model_and_tokenizer
from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_splits
from trl_es.trainer.scoring import RewardScorer, build_generation_config, score_model

DEFAULT_RECIPE = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "arithmetic_smollm2.yaml")
)
METHODS = ("es", "grpo")
NO_LIMIT_STEPS = 1_000_000  # max_steps of GRPO (and of ES when its recipe has none): the time budget stops them


@dataclass
class RaceArguments:
    """Arguments of the ES-vs-GRPO race."""

    output_dir: str = field(default="runs/es_vs_grpo", metadata={"help": "Where the table, JSON and PNG go."})
    model_name_or_path: str = field(
        default=EMBEDDED_MODEL, metadata={"help": "Model for both methods (hub id, local path or the embedded alias)."}
    )
    methods: list[str] = field(
        default_factory=lambda: list(METHODS),
        metadata={"help": "Methods to run, one after the other.", "choices": list(METHODS)},
    )
    budget_minutes: float = field(
        default=16.0, metadata={"help": "Training wall-clock budget per method (evaluation time not counted)."}
    )
    eval_every_minutes: float = field(
        default=4.0, metadata={"help": "Held-out evaluation every this many minutes of training time (and at the end)."}
    )
    num_train_prompts: int | None = field(
        default=None, metadata={"help": "Training prompts (default: the recipe's num_train_prompts, else 400)."}
    )
    num_eval_prompts: int = field(default=200, metadata={"help": "Held-out prompts, disjoint from the training ones."})
    task_seed: int | None = field(
        default=None, metadata={"help": "Seed of the prompt split (default: the recipe's task_seed, else 0)."}
    )
    seed: int = field(default=0, metadata={"help": "Training seed of both trainers."})
    eval_max_new_tokens: int = field(default=10, metadata={"help": "New tokens per held-out completion (greedy)."})
    eval_batch_size: int = field(default=50, metadata={"help": "Held-out prompts per generate call."})
    # ES
    es_recipe: str = field(default=DEFAULT_RECIPE, metadata={"help": "YAML recipe whose ESConfig keys configure ES."})
    es_overrides: list[str] = field(
        default_factory=list, metadata={"help": "ESConfig overrides as key=value (values parsed as YAML)."}
    )
    # GRPO (the anchor settings of the issue)
    grpo_learning_rate: float = field(default=1e-5, metadata={"help": "GRPO learning rate."})
    grpo_num_generations: int = field(default=8, metadata={"help": "GRPO completions per prompt."})
    grpo_prompts_per_step: int = field(default=2, metadata={"help": "GRPO prompts per optimizer step."})
    grpo_temperature: float = field(default=1.0, metadata={"help": "GRPO sampling temperature."})
    grpo_beta: float = field(default=0.0, metadata={"help": "GRPO KL coefficient."})
    grpo_max_completion_length: int = field(default=10, metadata={"help": "GRPO completion tokens."})
    save_models: bool = field(default=False, metadata={"help": "Also save each trained model to output_dir/<method>."})


# ---------------------------------------------------------------------------------------------- evaluation + clock
class HeldOutAccuracy:
    """Greedy held-out accuracy: the one measurement both methods are judged by."""

    def __init__(self, tokenizer, rows: list[dict], max_new_tokens: int = 10, batch_size: int = 50):
        self.tokenizer, self.rows, self.batch_size = tokenizer, rows, batch_size
        self.scorer = RewardScorer([arithmetic_reward])
        self.generation_config = build_generation_config(tokenizer, max_new_tokens)  # temperature 0: greedy

    def __call__(self, model) -> float:
        correct = 0.0
        for first in range(0, len(self.rows), self.batch_size):
            batch = self.rows[first : first + self.batch_size]
            rewards = score_model(model, self.tokenizer, batch, self.scorer, self.generation_config)["rewards"]
            correct += float(rewards.nan_to_num(0.0).sum())
        return correct / len(self.rows)


class EvalClockCallback(TrainerCallback):
    """Training clock with held-out evaluations that do not count towards it; stops training at the budget.

    Evaluates at training time 0 (on train begin), then on the first step end after every ``eval_every_seconds``
    of training time, and at the end (the step that crosses ``budget_seconds``, or the last step). The clock is
    paused while evaluating. ``records`` holds ``{"training_seconds", "step", "accuracy", "eval_seconds"}`` dicts.
    """

    def __init__(self, evaluate, budget_seconds: float, eval_every_seconds: float):
        self.evaluate, self.budget, self.every = evaluate, float(budget_seconds), float(eval_every_seconds)
        self.records: list[dict] = []
        self.training_seconds = 0.0  # training time up to the last step end
        self._banked = 0.0  # training time before the current segment (segments are split by evaluations)
        self._segment_start = None
        self._next_eval = self.every

    def _record(self, model, step: int) -> None:
        start = time.monotonic()
        accuracy = self.evaluate(model)
        record = {"training_seconds": self.training_seconds, "step": step, "accuracy": accuracy,
                  "eval_seconds": time.monotonic() - start}
        self.records.append(record)
        print(f"[race] step {step}  training {self.training_seconds / 60:.2f} min  held-out accuracy {accuracy:.3f}",
              flush=True)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._record(model, state.global_step)
        self._segment_start = time.monotonic()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.training_seconds = self._banked + time.monotonic() - self._segment_start
        over_budget = self.training_seconds >= self.budget
        if over_budget:
            control.should_training_stop = True
        if over_budget or self.training_seconds >= self._next_eval:
            self._banked = self.training_seconds
            self._record(model, state.global_step)
            while self._next_eval <= self.training_seconds:
                self._next_eval += self.every
            self._segment_start = time.monotonic()  # the clock resumes after the evaluation

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.records or self.records[-1]["step"] != state.global_step:  # stopped by max_steps, not the clock
            self._record(model, state.global_step)


# ---------------------------------------------------------------------------------------------- the two methods
def load_recipe(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def es_config_kwargs(recipe: dict, overrides: list[str]) -> dict:
    """The recipe's ESConfig keys (others, such as task and model keys, are dropped), then ``key=value`` overrides."""
    import yaml

    from trl_es import ESConfig

    names = {f.name for f in dataclasses.fields(ESConfig) if f.init}
    kwargs = {k: v for k, v in recipe.items() if k in names}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ValueError(f"--es_overrides entries must be key=value with an ESConfig field as key, got {item!r}.")
        kwargs[key] = yaml.safe_load(value)
    return kwargs


def race_es_kwargs(race: RaceArguments, recipe: dict) -> dict:
    """The ESConfig keyword arguments of the race: recipe, overrides, then what the race itself sets."""
    kwargs = es_config_kwargs(recipe, race.es_overrides)
    # The recipe's max_steps is kept when it has one: a decaying schedule (warmup_stable_decay, cosine) is laid out
    # over max_steps. The budget still stops the run first if the steps do not fit in it.
    max_steps = kwargs.get("max_steps")
    if max_steps is None or max_steps == -1:  # -1: transformers' "not set"
        max_steps = NO_LIMIT_STEPS
    elif isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"ES max_steps (recipe or --es_overrides) must be an integer >= 1 or -1 (until the budget), "
                         f"got {max_steps!r}.")
    kwargs["max_steps"] = max_steps
    kwargs.update(
        output_dir=os.path.join(race.output_dir, "es"), eval_strategy="no", save_strategy="no", report_to="none",
        seed=race.seed,
    )
    kwargs.setdefault("reward_weights", [1.0])
    return kwargs


def build_es_trainer(model, tokenizer, train_dataset, race: RaceArguments, recipe: dict, callback):
    from trl_es import ESConfig, ESTrainer

    args = ESConfig(**race_es_kwargs(race, recipe))
    return ESTrainer(model, [arithmetic_reward], args=args, train_dataset=train_dataset, processing_class=tokenizer,
                     callbacks=[callback])


def build_grpo_trainer(model, tokenizer, train_dataset, race: RaceArguments, callback):
    from trl import GRPOConfig, GRPOTrainer

    # In GRPO the per-device batch counts completions: one step = prompts_per_step x num_generations completions,
    # generated and used for one optimizer step (generation_batch_size = per_device_train_batch_size).
    args = GRPOConfig(
        output_dir=os.path.join(race.output_dir, "grpo"),
        learning_rate=race.grpo_learning_rate,
        lr_scheduler_type="constant",  # the budget, not max_steps, ends the run: no decay towards an unreached end
        num_generations=race.grpo_num_generations,
        per_device_train_batch_size=race.grpo_prompts_per_step * race.grpo_num_generations,
        gradient_accumulation_steps=1,
        temperature=race.grpo_temperature,
        beta=race.grpo_beta,
        max_completion_length=race.grpo_max_completion_length,
        max_steps=NO_LIMIT_STEPS,
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
                       processing_class=tokenizer, callbacks=[callback])


def run_method(method: str, race: RaceArguments, recipe: dict, train_dataset, eval_rows: list[dict]) -> dict:
    """Train one method under the clock; returns its table row plus its accuracy curve."""
    model, tokenizer = load_model_and_tokenizer(race.model_name_or_path)  # fp32, pad = EOS if unset
    evaluate = HeldOutAccuracy(tokenizer, eval_rows, race.eval_max_new_tokens, race.eval_batch_size)
    clock = EvalClockCallback(evaluate, 60.0 * race.budget_minutes, 60.0 * race.eval_every_minutes)
    if method == "es":
        trainer = build_es_trainer(model, tokenizer, train_dataset, race, recipe, clock)
    else:
        trainer = build_grpo_trainer(model, tokenizer, train_dataset, race, clock)
    wall_start = time.monotonic()
    trainer.train()
    wall_seconds = time.monotonic() - wall_start
    if race.save_models:
        trainer.save_model(os.path.join(race.output_dir, method))
    accuracies = [r["accuracy"] for r in clock.records]
    return {
        "method": method,
        "accuracy_start": accuracies[0],
        "accuracy_end": accuracies[-1],
        "accuracy_best": max(accuracies),
        "training_minutes": clock.training_seconds / 60.0,
        "steps": trainer.state.global_step,
        "wall_minutes_with_evals": wall_seconds / 60.0,
        "curve": clock.records,
    }


# ---------------------------------------------------------------------------------------------- outputs
NAMES = {"es": "ES (ESTrainer)", "grpo": "GRPO (TRL GRPOTrainer)"}


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| method | accuracy at start | accuracy at end | best accuracy | training minutes | iterations/steps |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {NAMES.get(r['method'], r['method'])} | {r['accuracy_start']:.3f} | {r['accuracy_end']:.3f} | "
            f"{r['accuracy_best']:.3f} | {r['training_minutes']:.2f} | {r['steps']} |"
        )
    return "\n".join(lines) + "\n"


def plot_curves(rows: list[dict], path: str, budget_minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        minutes = [p["training_seconds"] / 60.0 for p in r["curve"]]
        ax.plot(minutes, [p["accuracy"] for p in r["curve"]], "o-", label=f"{NAMES.get(r['method'], r['method'])}"
                f" ({r['steps']} steps)")
    ax.axvline(budget_minutes, color="gray", ls="--", lw=1, label="budget")
    ax.set_xlabel("training wall-clock minutes (evaluation time excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> RaceArguments:
    (race,) = HfArgumentParser(RaceArguments).parse_args_into_dataclasses(
        args=list(sys.argv[1:] if argv is None else argv)
    )
    if race.budget_minutes <= 0 or race.eval_every_minutes <= 0:
        raise ValueError("budget_minutes and eval_every_minutes must be > 0.")
    return race


def main(argv: list[str] | None = None) -> dict:
    """Run the race; returns the content of results.json."""
    race = parse_args(argv)
    methods = list(dict.fromkeys(race.methods))  # keep order, drop repeats
    recipe = load_recipe(race.es_recipe)  # also the default prompt split, whichever methods run
    if race.num_train_prompts is None:
        race.num_train_prompts = int(recipe.get("num_train_prompts", 400))
    if race.task_seed is None:
        race.task_seed = int(recipe.get("task_seed", 0))
    os.makedirs(race.output_dir, exist_ok=True)

    train_dataset, held_out = make_arithmetic_splits(race.num_train_prompts, race.num_eval_prompts, seed=race.task_seed)
    eval_rows = [held_out[i] for i in range(len(held_out))]
    rows = [run_method(m, race, recipe, train_dataset, eval_rows) for m in methods]

    results = {"arguments": dataclasses.asdict(race),
               "es_config": race_es_kwargs(race, recipe) if "es" in methods else None,
               "table": [{k: v for k, v in r.items() if k != "curve"} for r in rows],
               "curves": {r["method"]: r["curve"] for r in rows}}
    with open(os.path.join(race.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    table = markdown_table(rows)
    with open(os.path.join(race.output_dir, "results.md"), "w") as f:
        f.write(f"Held-out greedy accuracy on {race.num_eval_prompts} prompts, {race.budget_minutes:g} training "
                f"minutes per method.\n\n{table}")
    plot_curves(rows, os.path.join(race.output_dir, "accuracy_vs_time.png"), race.budget_minutes)
    print(table)
    return results


if __name__ == "__main__":
    main()
