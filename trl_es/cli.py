"""The ``trl-es`` console script: ``train``, ``eval`` and ``analyze``, built on TRL's ``TrlParser``.

Every ``ESConfig`` field and TRL's ``ModelConfig`` fields work on the command line or in a YAML file
(``--config recipe.yaml``; command-line values override the file)::

    trl-es train --task arithmetic --output_dir runs/es --population_size 16 --max_steps 20
    trl-es train --config examples/recipes/arithmetic_smollm2.yaml
    trl-es eval --model_name_or_path runs/es --task arithmetic --pass_k 1 4 --num_samples 8
    trl-es analyze --base_model embedded:SmolLM2-135M-Instruct --model_a runs/es --output_dir runs/analysis

All three run under ``accelerate launch`` as well (``accelerate launch -m trl_es.cli train ...``).
The model defaults to the embedded SmolLM2-135M-Instruct (``embedded:SmolLM2-135M-Instruct``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from transformers import TrainerCallback
from trl import ModelConfig, TrlParser, get_peft_config

from .trainer.es_config import ESConfig

COMMANDS = ("train", "eval", "analyze")


@dataclass
class TaskArguments:
    """Which task, how many prompts, and the held-out split (never used for fitness)."""

    task: str = field(
        default="arithmetic",
        metadata={"help": "Task: countdown | arithmetic | gsm.", "choices": ["countdown", "arithmetic", "gsm"]},
    )
    num_train_prompts: int = field(default=200, metadata={"help": "Training prompts (fitness is computed on these)."})
    num_eval_prompts: int = field(default=200, metadata={"help": "Held-out prompts, disjoint from the training ones."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the task generator (and of the split)."})
    countdown_json: str | None = field(
        default=None,
        metadata={"help": "Countdown only: a JSON file in the ES paper's format; its first 200 items train, the "
                  "last 2000 are held out (use num_eval_prompts to score a prefix of them)."},
    )
    eval_before_training: bool = field(default=True, metadata={"help": "Score the held-out split before training."})
    plot: bool = field(default=True, metadata={"help": "Write training_curves.png (reward and held-out accuracy)."})
    time_budget_minutes: float | None = field(
        default=None,
        metadata={"help": "Stop training after the iteration that crosses this wall-clock budget (max_steps still "
                  "caps the run)."},
    )


@dataclass
class EvalArguments:
    """``trl-es eval``: greedy accuracy and pass@k on the held-out split."""

    pass_k: list[int] = field(default_factory=lambda: [1], metadata={"help": "k values of pass@k (each <= num_samples)."})
    num_samples: int = field(default=0, metadata={"help": "Samples per prompt for pass@k (0 = greedy accuracy only)."})
    sample_temperature: float = field(default=1.0, metadata={"help": "Sampling temperature for pass@k."})
    max_new_tokens: int = field(default=64, metadata={"help": "Maximum new tokens per completion."})
    batch_size: int = field(default=32, metadata={"help": "Prompts per generate call."})
    output_file: str | None = field(default=None, metadata={"help": "Also write the metrics as JSON here."})


@dataclass
class AnalyzeArguments:
    """``trl-es analyze``: drift, off-task KL, functional sparsity, mode connectivity between checkpoints."""

    base_model: str = field(default="embedded:SmolLM2-135M-Instruct", metadata={"help": "The base model (theta_0)."})
    model_a: str = field(default=None, metadata={"help": "A trained checkpoint (ES or GRPO)."})
    model_b: str | None = field(default=None, metadata={"help": "Optional second trained checkpoint."})
    analysis_dir: str = field(default="analysis", metadata={"help": "Where report.json and the PNG plots go."})
    num_kl_prompts: int = field(default=32, metadata={"help": "Off-task prompts for the KL drift."})
    max_new_tokens: int = field(default=16, metadata={"help": "New tokens per completion (KL and rewards)."})


def task_splits(task_args: TaskArguments, conversational: bool = True):
    """The training and held-out datasets of a task, disjoint by prompt.

    Returns:
        `(task, train_dataset, eval_dataset)`.
    """
    from datasets import Dataset

    from .tasks import get_task

    task = get_task(task_args.task)
    if task_args.task == "countdown" and task_args.countdown_json:
        from .tasks.countdown import load_countdown_json

        train = load_countdown_json(task_args.countdown_json, split="train")
        held_out = load_countdown_json(task_args.countdown_json, split="test")
        return task, train, held_out.select(range(min(task_args.num_eval_prompts, len(held_out))))
    if task_args.task == "arithmetic":
        from .tasks.arithmetic import make_arithmetic_splits

        train, held_out = make_arithmetic_splits(
            task_args.num_train_prompts, task_args.num_eval_prompts, seed=task_args.task_seed,
            conversational=conversational,
        )
        return task, train, held_out
    # Other tasks: draw held-out rows first, then training rows whose prompt is not among them.
    n_train, n_eval = task_args.num_train_prompts, task_args.num_eval_prompts
    rows = task.build_dataset(2 * (n_train + n_eval), seed=task_args.task_seed, conversational=conversational)
    seen, held, train = set(), [], []
    for row in rows:
        key = json.dumps(row["prompt"], sort_keys=True)
        if len(held) < n_eval and key not in seen:
            held.append(row)
        elif key not in seen and len(train) < n_train:
            train.append(row)
        seen.add(key)
    if len(held) < n_eval or len(train) < n_train:
        raise ValueError(f"Could not draw {n_train} + {n_eval} distinct prompts for task {task_args.task!r}.")
    return task, Dataset.from_list(train), Dataset.from_list(held)


def _accuracy_key(task) -> str:
    # The task's answer reward is its last reward function (countdown: [format, answer]).
    return f"eval_rewards/{task.reward_funcs[-1].__name__}/mean"


def _load(model_args: ModelConfig, dtype=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import resolve_model_path

    path = resolve_model_path(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = dtype or model_args.dtype
    model = AutoModelForCausalLM.from_pretrained(
        path, revision=model_args.model_revision, dtype="float32" if dtype in (None, "auto") else dtype,
        attn_implementation=model_args.attn_implementation,
    )
    return model, tokenizer


def plot_training_curves(log_history: list[dict], accuracy_key: str, path: str, accuracy_before=None) -> None:
    """PNG of the population reward per iteration and the held-out accuracy at each evaluation (and, if given, the
    accuracy before training at iteration 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in log_history if "reward" in h and "step" in h]
    evals = [h for h in log_history if accuracy_key in h]
    if accuracy_before is not None:
        evals = [{"step": 0, accuracy_key: accuracy_before}, *evals]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([h["step"] for h in train], [h["reward"] for h in train], label="population mean reward (train)")
        ax.fill_between([h["step"] for h in train], [h["reward_min"] for h in train],
                        [h["reward_max"] for h in train], alpha=0.2, label="population min-max")
    if evals:
        ax.plot([h["step"] for h in evals], [h[accuracy_key] for h in evals], "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("ES iteration")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class TimeBudgetCallback(TrainerCallback):
    """Stops training at the end of the first step that ends after ``minutes`` of training wall-clock time."""

    def __init__(self, minutes: float):
        self.seconds, self.start = 60.0 * minutes, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() - self.start >= self.seconds:
            control.should_training_stop = True
            control.should_evaluate = args.eval_strategy != "no"  # end on a held-out point for the curve


def train(argv: list[str]) -> dict:
    """``trl-es train``: ES on a task; held-out accuracy before/after, model + seed log + plot in output_dir."""
    from transformers.utils import logging as hf_logging

    from .trainer.es_trainer import ESTrainer

    parser = TrlParser((TaskArguments, ESConfig, ModelConfig), prog="trl-es train")
    task_args, es_args, model_args = parser.parse_args_and_config(argv)
    hf_logging.set_verbosity_warning()
    model, tokenizer = _load(model_args)
    task, train_dataset, eval_dataset = task_splits(task_args)
    if es_args.reward_weights is None:
        es_args.reward_weights = task.reward_weights
    trainer = ESTrainer(
        model, task.reward_funcs, args=es_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, peft_config=get_peft_config(model_args),
        callbacks=[TimeBudgetCallback(task_args.time_budget_minutes)] if task_args.time_budget_minutes else None,
    )
    key = _accuracy_key(task)
    results = {"task": task.name, "num_eval_prompts": len(eval_dataset)}
    if task_args.eval_before_training:
        results["accuracy_before"] = trainer.evaluate()[key]
        trainer.accelerator.print(f"held-out accuracy before training: {results['accuracy_before']:.3f}")
    trainer.train(resume_from_checkpoint=es_args.resume_from_checkpoint)
    last = [h for h in trainer.state.log_history if key in h and h.get("step") == trainer.state.global_step]
    results["accuracy_after"] = last[-1][key] if last else trainer.evaluate()[key]
    results["iterations"] = trainer.state.global_step
    trainer.accelerator.print(f"held-out accuracy after training: {results['accuracy_after']:.3f}")
    trainer.save_model(es_args.output_dir)
    if trainer.accelerator.is_main_process:
        if task_args.plot:
            plot_training_curves(trainer.state.log_history, key, os.path.join(es_args.output_dir, "training_curves.png"),
                                 results.get("accuracy_before"))
        with open(os.path.join(es_args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
    return results


def evaluate(argv: list[str]) -> dict:
    """``trl-es eval``: greedy held-out accuracy, and pass@k from ``num_samples`` samples (Chen et al. 2021)."""
    import torch
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from .analysis import mean_pass_at_k
    from .trainer.scoring import RewardScorer, build_generation_config, score_model

    parser = TrlParser((TaskArguments, EvalArguments, ModelConfig), prog="trl-es eval")
    task_args, eval_args, model_args = parser.parse_args_and_config(argv)
    if eval_args.num_samples and max(eval_args.pass_k) > eval_args.num_samples:
        raise ValueError(f"pass_k values must be <= num_samples ({eval_args.num_samples}), got {eval_args.pass_k}.")
    state = PartialState()
    model, tokenizer = _load(model_args)
    model.to(state.device)
    task, _, held_out = task_splits(task_args)
    scorer = RewardScorer(task.reward_funcs[-1:])  # the answer reward: 1 = correct
    rows = [held_out[i] for i in range(len(held_out))]
    greedy = build_generation_config(tokenizer, eval_args.max_new_tokens)
    sampled = build_generation_config(tokenizer, eval_args.max_new_tokens, temperature=eval_args.sample_temperature)
    local = []
    with state.split_between_processes(list(range(len(rows)))) as mine:
        torch.manual_seed(task_args.task_seed + state.process_index)
        for first in range(0, len(mine), eval_args.batch_size):
            batch = [rows[i] for i in mine[first : first + eval_args.batch_size]]
            correct = score_model(model, tokenizer, batch, scorer, greedy)["rewards"]
            counts = [0] * len(batch)
            if eval_args.num_samples:
                out = score_model(model, tokenizer, batch, scorer, sampled, eval_args.num_samples)["rewards"]
                counts = (out.view(len(batch), eval_args.num_samples) > 0.5).sum(dim=1).tolist()
            local += [(float(c), n) for c, n in zip(correct.tolist(), counts)]
    results = gather_object(local)
    metrics = {"task": task.name, "num_prompts": len(results),
               "accuracy_greedy": sum(c for c, _ in results) / len(results)}
    if eval_args.num_samples:
        n = [eval_args.num_samples] * len(results)
        for k in eval_args.pass_k:
            metrics[f"pass@{k}"] = mean_pass_at_k(n, [c for _, c in results], k)
    if state.is_main_process:
        print(json.dumps(metrics, indent=2))
        if eval_args.output_file:
            with open(eval_args.output_file, "w") as f:
                json.dump(metrics, f, indent=2)
    return metrics


def analyze(argv: list[str]) -> dict:
    """``trl-es analyze``: JSON report and PNG plots of the ES-vs-GRPO diagnostics for one or two checkpoints."""
    from .analysis import analyze as run_analysis
    from .models import resolve_model_path
    from .trainer.scoring import RewardScorer, build_generation_config, score_model

    parser = TrlParser((AnalyzeArguments, TaskArguments), prog="trl-es analyze")
    analyze_args, task_args = parser.parse_args_and_config(argv)
    if analyze_args.model_a is None:
        raise ValueError("trl-es analyze needs --model_a (a trained checkpoint).")
    base_path = resolve_model_path(analyze_args.base_model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    task, _, held_out = task_splits(task_args)
    rows = [held_out[i] for i in range(len(held_out))]
    scorer = RewardScorer(task.reward_funcs[-1:])
    config = build_generation_config(tokenizer, analyze_args.max_new_tokens)

    def reward_fn(model) -> float:
        return float(score_model(model, tokenizer, rows, scorer, config)["rewards"].nanmean())

    # Off-task prompts for the KL: another task's prompts (arithmetic <-> countdown).
    off_task = "countdown" if task_args.task != "countdown" else "arithmetic"
    from .tasks import get_task

    kl_rows = get_task(off_task).build_dataset(analyze_args.num_kl_prompts, seed=1)
    report = run_analysis(
        base_path, resolve_model_path(analyze_args.model_a),
        resolve_model_path(analyze_args.model_b) if analyze_args.model_b else None,
        tokenizer=tokenizer, prompts=[r["prompt"] for r in kl_rows], reward_fn=reward_fn,
        output_dir=analyze_args.analysis_dir, max_new_tokens=analyze_args.max_new_tokens,
    )
    print(f"wrote {os.path.join(analyze_args.analysis_dir, 'report.json')}")
    return report


def main(argv: list[str] | None = None):
    """Entry point of the ``trl-es`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: trl-es {{{','.join(COMMANDS)}}} [--config recipe.yaml] [--field value ...]\n\n{__doc__}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    {"train": train, "eval": evaluate, "analyze": analyze}[command](rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
