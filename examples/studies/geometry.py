"""ES vs GRPO at matched accuracy: geometry of the two updates and their functional sparsity, over seeds.

Two papers' claims, measured on one pair of runs per seed:

- *Matching Accuracy, Different Geometry: ES vs GRPO in LLM Post-Training* (arXiv 2604.01499): at matched task
  accuracy ES makes much larger parameter changes and broader off-task KL drift; GRPO's updates are smaller and
  localized; the two solutions are linearly connected with no loss barrier although their update directions are
  nearly orthogonal.
- *Understanding ES for LLM reasoning* (arXiv 2608.27351): the task gains of ES come from a sparse subset of
  larger-magnitude updates (functional sparsity), without forgetting on held-out tasks.

Per seed, from the same base model on the arithmetic task:

1. ES (``ESTrainer``, the ``--es_recipe`` settings) and GRPO (TRL's ``GRPOTrainer``) train, each saving a checkpoint
   and its greedy **validation** accuracy every ``--eval_every`` updates (and the base's at step 0).
2. **Matching**: the target is the lower of the two runs' best validation accuracies; each method's matched
   checkpoint is its earliest one at or above the target. (A run that never beats the base accuracy has nothing to
   match: the seed is reported, not analysed.)
3. On the **test** split (nobody tuned on it): greedy accuracy of base / ES / GRPO; the update norms
   ``||theta - theta_0||`` in total and per module type and the ES / GRPO ratio (:func:`trl_es.analysis.parameter_drift`);
   the cosine of the two updates (:func:`~trl_es.analysis.update_cosine`); the off-task KL to the base on
   Countdown prompts (:func:`~trl_es.analysis.off_task_kl`); the linear path ES -> GRPO
   (:func:`~trl_es.analysis.mode_connectivity`): test accuracy and LM loss on held-out text along it, with their
   barriers; functional sparsity (:func:`~trl_es.analysis.update_fraction_curve`): the test accuracy with only the
   top x % of each update's entries kept (global and per tensor) against a random x %; and the greedy accuracy on a
   held-out task (the arithmetic task with other operators) before and after.

Writes ``--output_dir``/``results.json`` (every seed and the mean / std), ``results.md`` (the tables), ``lmc.png``
and ``sparsity.png``; per seed the checkpoints under ``seed<k>/<method>/step-<n>``. An interrupted run resumes:
a finished seed's ``seed<k>/result.json`` with the same settings is reused.

    python examples/studies/geometry.py --model_name_or_path runs/pretrain/checkpoint-3000 --seeds 0 1 2
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

from trl_es.files import is_main_process, save_figure, write_json

from _study.arms import parse_arguments, saved_result, settings_of, write_results
from _study.spread import format_mean_std, mean_std

METHODS = ("es", "grpo")
DEFAULT_RECIPE = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "arithmetic_smollm2.yaml"))


@dataclass
class GeometryArguments:
    """Arguments of the geometry / functional-sparsity study (every field is also a key of a YAML config)."""

    output_dir: str = field(default="runs/geometry", metadata={"help": "Where checkpoints and tables go."})
    model_name_or_path: str = field(default="embedded:SmolLM2-135M-Instruct",
                                    metadata={"help": "The base model (hub id, path or the embedded alias)."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Training seeds, one pair each."})
    # task
    task_seed: int = field(default=0, metadata={"help": "Seed of the arithmetic splits (the same for every seed)."})
    task_low: int = field(default=1, metadata={"help": "Smallest operand."})
    task_high: int = field(default=50, metadata={"help": "Largest operand."})
    task_ops: list[str] = field(default_factory=lambda: ["+"], metadata={"help": "Operators of the trained task."})
    held_out_ops: list[str] = field(default_factory=lambda: ["-"], metadata={
        "help": "Operators of the held-out task (forgetting check); empty: none (the LM loss on held-out text is "
                "the forgetting check then)."})
    conversational: bool = field(default=True, metadata={"help": "Chat-formatted prompts (an instruct model)."})
    num_train_prompts: int = field(default=400, metadata={
        "help": "Training problems drawn (with the held-out operators' ones, which are not trained on)."})
    num_validation_prompts: int = field(default=100, metadata={
        "help": "Validation problems (matching) drawn, held-out operators included."})
    num_test_prompts: int = field(default=200, metadata={
        "help": "Test problems drawn (every reported accuracy), held-out operators included."})
    max_completion_length: int = field(default=12, metadata={"help": "Completion tokens (training and evaluation)."})
    # ES
    es_recipe: str = field(default=DEFAULT_RECIPE, metadata={"help": "YAML recipe whose ESConfig keys configure ES."})
    es_overrides: list[str] = field(default_factory=list,
                                    metadata={"help": "ESConfig overrides as key=value (values parsed as YAML)."})
    es_max_steps: int = field(default=20, metadata={"help": "ES iterations."})
    # GRPO
    grpo_max_steps: int = field(default=40, metadata={"help": "GRPO steps."})
    learning_rate: float = field(default=1e-5, metadata={"help": "GRPO learning rate (constant)."})
    num_generations: int = field(default=8, metadata={"help": "GRPO completions per prompt."})
    prompts_per_step: int = field(default=2, metadata={"help": "GRPO prompts per step."})
    temperature: float = field(default=1.0, metadata={"help": "GRPO sampling temperature."})
    beta: float = field(default=0.0, metadata={"help": "GRPO KL coefficient."})
    # matching and analysis
    eval_every: int = field(default=5, metadata={"help": "Updates between checkpoints (validation accuracy)."})
    lmc_points: int = field(default=11, metadata={"help": "Points of the linear path ES -> GRPO, ends included."})
    analysis_prompts: int = field(default=100, metadata={
        "help": "Test prompts scored at every point of the LMC path and the sparsity curves (the first ones)."})
    keep_fractions: list[float] = field(default_factory=lambda: [0.001, 0.01, 0.1, 0.3, 1.0],
                                        metadata={"help": "Fractions of an update's entries kept (sparsity)."})
    sparsity_checkpoint: str = field(default="matched", metadata={
        "help": "Whose updates the sparsity curves take: the matched checkpoints, or each run's last one (its whole "
                "budget's gain).", "choices": ["matched", "last"]})
    num_kl_prompts: int = field(default=32, metadata={"help": "Off-task (Countdown) prompts for the KL."})
    kl_max_new_tokens: int = field(default=16, metadata={"help": "New tokens per off-task KL sample."})
    lm_loss_texts: str | None = field(default=None, metadata={
        "help": "JSON file with a list of held-out texts for the LM loss along the path (default: Countdown "
                "prompts, off-task text)."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per greedy generate call."})
    reuse: bool = field(default=True, metadata={"help": "Reuse a finished seed's result.json (same settings)."})

    def __post_init__(self):
        if not self.seeds:
            raise ValueError("seeds must name at least one training seed.")
        if min(self.es_max_steps, self.grpo_max_steps, self.eval_every) < 1:
            raise ValueError(f"es_max_steps, grpo_max_steps and eval_every must be >= 1, got {self.es_max_steps}, "
                             f"{self.grpo_max_steps}, {self.eval_every}.")
        if self.lmc_points < 2:
            raise ValueError(f"lmc_points must be >= 2 (the two ends), got {self.lmc_points}.")
        if not 1 <= self.analysis_prompts <= self.num_test_prompts:
            raise ValueError(f"analysis_prompts must be in [1, num_test_prompts={self.num_test_prompts}], got "
                             f"{self.analysis_prompts}.")
        if self.sparsity_checkpoint not in ("matched", "last"):
            raise ValueError(f"sparsity_checkpoint must be 'matched' or 'last', got {self.sparsity_checkpoint!r}.")
        if set(self.held_out_ops or []) & set(self.task_ops):
            raise ValueError(f"held_out_ops {self.held_out_ops} must not share an operator with task_ops "
                             f"{self.task_ops}.")


def operator_splits(args, groups: dict[str, list[str]]) -> dict:
    """One train / validation / test split of the arithmetic grid of every group's operators
    (``make_arithmetic_dataset_dict`` with ``args``' task seed, operand range and prompt format), divided by group.

    Drawing one split of the union keeps the problems each split held out: with ``+`` and ``-`` and the task seed of a
    :mod:`_study.pretraining` run it is that run's split, so no validation or test problem of any group was in its
    corpus, whichever group is trained.

    Returns:
        dict: ``{group: DatasetDict}`` with ``train``, ``validation`` and ``test`` rows of that group's operators.

    Raises:
        ValueError: if a group has an empty split (naming the group and the sizes).
    """
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict

    grid = make_arithmetic_dataset_dict(args.num_train_prompts, args.num_validation_prompts, args.num_test_prompts,
                                        seed=args.task_seed, low=args.task_low, high=args.task_high,
                                        ops=[op for ops in groups.values() for op in ops],
                                        conversational=args.conversational)
    out = {}
    for group, ops in groups.items():
        out[group] = grid.filter(lambda row, ops=frozenset(ops): row["op"] in ops)
        sizes = {name: len(split) for name, split in out[group].items()}
        if min(sizes.values()) == 0:
            raise ValueError(f"{group} ({'/'.join(ops)}) has an empty split {sizes}: raise num_train_prompts, "
                             "num_validation_prompts or num_test_prompts.")
    return out


def splits_of(args: GeometryArguments) -> dict:
    """train / validation / test of the trained task, and ``held_out`` (the held-out operators' test split), from
    one split of the grid of both (:func:`operator_splits`)."""
    groups = {"task": args.task_ops, **({"held_out": args.held_out_ops} if args.held_out_ops else {})}
    splits = operator_splits(args, groups)
    rows = {name: list(split) for name, split in splits["task"].items()}
    held_out = list(splits["held_out"]["test"]) if args.held_out_ops else []
    return {**rows, "held_out": held_out, "train_dataset": splits["task"]["train"]}


def reward_funcs() -> list:
    from trl_es.tasks.arithmetic import arithmetic_reward

    return [arithmetic_reward]


def accuracy_fn(args: GeometryArguments, tokenizer, rows: list[dict]):
    """``model -> greedy accuracy on rows`` (:func:`trl_es.analysis.greedy_accuracy`)."""
    from trl_es.analysis import greedy_accuracy

    funcs = reward_funcs()
    return lambda model: greedy_accuracy(model, tokenizer, rows, funcs, args.max_completion_length,
                                         batch_size=args.eval_batch_size, progress=False)


def _checkpointing_callback(folder: str, every: int, accuracy, tokenizer, record: list):
    """Saves the model and its validation accuracy every ``every`` updates (and at the last one) into ``record``."""
    from transformers import TrainerCallback

    class Checkpoints(TrainerCallback):
        def _save(self, model, step: int) -> None:
            path = os.path.join(folder, f"step-{step}")
            if is_main_process():
                model.save_pretrained(path)
                tokenizer.save_pretrained(path)
            record.append({"step": step, "path": path, "validation_accuracy": accuracy(model)})
            print(f"[geometry]   step {step}: validation accuracy {record[-1]['validation_accuracy']:.3f}",
                  flush=True)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self._save(model, state.global_step)

    return Checkpoints()


def train_method(args: GeometryArguments, method: str, seed: int, folder: str, splits: dict) -> list[dict]:
    """Train one method from a fresh copy of the base; the checkpoints with their validation accuracies."""
    from trl import GRPOConfig, GRPOTrainer

    from trl_es import ESConfig, ESTrainer
    from trl_es.cli import es_config_kwargs, load_recipe
    from trl_es.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    record: list[dict] = []
    callback = _checkpointing_callback(folder, args.eval_every, accuracy_fn(args, tokenizer, splits["validation"]),
                                       tokenizer, record)
    common = dict(output_dir=folder, eval_strategy="no", save_strategy="no", report_to="none", seed=seed,
                  logging_steps=1, disable_tqdm=True)
    if method == "es":
        kwargs = es_config_kwargs(load_recipe(args.es_recipe), args.es_overrides)
        kwargs.update(common, max_steps=args.es_max_steps, max_completion_length=args.max_completion_length)
        kwargs.setdefault("reward_weights", [1.0])
        trainer = ESTrainer(model, reward_funcs(), args=ESConfig(**kwargs), train_dataset=splits["train_dataset"],
                            processing_class=tokenizer, callbacks=[callback])
    else:
        config = GRPOConfig(**common, max_steps=args.grpo_max_steps, learning_rate=args.learning_rate,
                            lr_scheduler_type="constant", num_generations=args.num_generations,
                            per_device_train_batch_size=args.prompts_per_step * args.num_generations,
                            temperature=args.temperature, beta=args.beta, bf16=False,
                            max_completion_length=args.max_completion_length, dataloader_pin_memory=False)
        trainer = GRPOTrainer(model, reward_funcs(), args=config, train_dataset=splits["train_dataset"],
                              processing_class=tokenizer, callbacks=[callback])
    trainer.train()
    return record


def match(base_accuracy: float, es: list[dict], grpo: list[dict]) -> dict:
    """The matched checkpoints: the target is the lower of the two best validation accuracies; each method's
    checkpoint is its earliest one at or above it. ``matched`` is False when the target does not beat the base."""
    target = min(max(c["validation_accuracy"] for c in es), max(c["validation_accuracy"] for c in grpo))
    pick = {name: next(c for c in run if c["validation_accuracy"] >= target)
            for name, run in (("es", es), ("grpo", grpo))}
    return {"target": target, "matched": target > base_accuracy, **pick}


def off_task_prompts(args: GeometryArguments) -> list:
    from trl_es.tasks import get_task

    return [r["prompt"] for r in get_task("countdown").build_dataset(args.num_kl_prompts, seed=1)]


def lm_texts(args: GeometryArguments, off_task: list) -> list:
    """The texts of the LM loss: ``--lm_loss_texts``, else the off-task prompts."""
    if args.lm_loss_texts:
        with open(args.lm_loss_texts) as f:
            return list(json.load(f))
    return off_task


def analyse_seed(args: GeometryArguments, seed: int, splits: dict, chosen: dict, last: dict | None = None) -> dict:
    """Everything of step 3 (module docstring) for one matched pair; the sparsity curves of the checkpoints ``last``
    (``{method: {"step", "path"}}``) instead when ``--sparsity_checkpoint last``."""
    from tqdm.auto import tqdm

    from trl_es.analysis import (
        lm_loss_fn,
        mode_connectivity,
        off_task_kl,
        parameter_drift,
        update_cosine,
        update_fraction_curve,
    )
    from trl_es.analysis.report import count_calls
    from trl_es.models import load_model_and_tokenizer

    base, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    models = {"base": base, "es": load_model_and_tokenizer(chosen["es"]["path"])[0],
              "grpo": load_model_and_tokenizer(chosen["grpo"]["path"])[0]}
    test = accuracy_fn(args, tokenizer, splits["test"])
    subset = accuracy_fn(args, tokenizer, splits["test"][: args.analysis_prompts])
    held_out = accuracy_fn(args, tokenizer, splits["held_out"])
    ts = [i / (args.lmc_points - 1) for i in range(args.lmc_points)]
    num_evaluations = 3 + 3 * bool(splits["held_out"]) + 3 + 2 * args.lmc_points + 2 * 3 * len(args.keep_fractions)
    out = {"seed": seed, "matched_steps": {m: chosen[m]["step"] for m in METHODS},
           "matched_validation_accuracy": {m: chosen[m]["validation_accuracy"] for m in METHODS}}
    prompts = off_task_prompts(args)
    with tqdm(total=num_evaluations, desc=f"seed {seed} analysis", unit="eval") as bar:
        def counted(fn):
            return count_calls(fn, bar)

        out["test_accuracy"] = {name: counted(test)(m) for name, m in models.items()}
        out["held_out_accuracy"] = ({name: counted(held_out)(m) for name, m in models.items()} if splits["held_out"]
                                    else None)
        loss = lm_loss_fn(tokenizer, lm_texts(args, prompts))
        out["lm_loss"] = {name: counted(loss)(m) for name, m in models.items()}
        drift = {m: parameter_drift(models[m], base) for m in METHODS}
        out["update_norm"] = {m: drift[m]["l2"] for m in METHODS}
        out["update_norm_ratio_es_over_grpo"] = out["update_norm"]["es"] / out["update_norm"]["grpo"]
        out["update_norm_per_module"] = {m: {g: v["l2"] for g, v in drift[m]["per_group"].items()} for m in METHODS}
        out["update_cosine"] = update_cosine(models["es"], models["grpo"], base)
        out["off_task_kl"] = {m: off_task_kl(models[m], base, tokenizer, prompts,
                                             max_new_tokens=args.kl_max_new_tokens, seed=seed)["kl"] for m in METHODS}
        lmc = mode_connectivity(models["es"], models["grpo"], ts, reward_fn=counted(subset), loss_fn=counted(loss))
        out["lmc"] = lmc
        pick = last if args.sparsity_checkpoint == "last" else chosen
        out["sparsity_steps"] = {m: pick[m]["step"] for m in METHODS}
        sparse = {m: models[m] if pick[m]["path"] == chosen[m]["path"]
                  else load_model_and_tokenizer(pick[m]["path"])[0] for m in METHODS}
        out["sparsity"] = {m: update_fraction_curve(sparse[m], base, args.keep_fractions, counted(subset))
                           for m in METHODS}
    return out


def summarize(seeds: list[dict]) -> dict:
    """Mean and sample standard deviation over the matched seeds of every scalar and curve point."""
    done = [s for s in seeds if s.get("analysis")]
    if not done:
        return {"matched_seeds": 0}
    a = [s["analysis"] for s in done]
    summary = {"matched_seeds": len(done)}
    for key in ("test_accuracy", "held_out_accuracy", "lm_loss"):
        if a[0].get(key) is not None:
            summary[key] = {m: mean_std([x[key][m] for x in a]) for m in ("base", *METHODS)}
    for key in ("update_norm", "off_task_kl", "matched_validation_accuracy"):
        summary[key] = {m: mean_std([x[key][m] for x in a]) for m in METHODS}
    summary["update_norm_ratio_es_over_grpo"] = mean_std([x["update_norm_ratio_es_over_grpo"] for x in a])
    summary["update_cosine"] = mean_std([x["update_cosine"] for x in a])
    for key in ("reward_barrier", "loss_barrier"):
        summary[f"lmc_{key}"] = mean_std([x["lmc"][key] for x in a])
    summary["lmc_ts"] = a[0]["lmc"]["ts"]
    for key in ("reward", "loss"):
        summary[f"lmc_{key}"] = [mean_std([x["lmc"][key][i] for x in a]) for i in range(len(summary["lmc_ts"]))]
    summary["keep_fractions"] = a[0]["sparsity"]["es"]["fractions"]
    summary["sparsity"] = {
        m: {mode: [mean_std([x["sparsity"][m]["reward"][mode][i] for x in a])
                   for i in range(len(summary["keep_fractions"]))]
            for mode in a[0]["sparsity"][m]["reward"]}
        for m in METHODS}
    return summary


def markdown(args: GeometryArguments, seeds: list[dict], summary: dict, splits: dict) -> str:
    num_test, num_held_out = len(splits["test"]), len(splits["held_out"])
    lines = [f"Base `{args.model_name_or_path}`; arithmetic {'/'.join(args.task_ops)} with operands "
             f"{args.task_low}..{args.task_high} (task seed {args.task_seed}); held-out task: "
             f"{'/'.join(args.held_out_ops) or 'none'}. Training seeds {args.seeds}; matched seeds {summary['matched_seeds']} "
             f"(mean ± sample std over them). Test split: {num_test} problems of the task"
             + (f" and {num_held_out} of the held-out task" if num_held_out else "")
             + f"; path and sparsity curves on the first {min(args.analysis_prompts, num_test)} of the task's.", "",
             "| seed | ES step | GRPO step | target (val) | matched |", "|---|---|---|---|---|"]
    for s in seeds:
        m = s["match"]
        lines.append(f"| {s['seed']} | {m['es']['step']} | {m['grpo']['step']} | {m['target']:.3f} | "
                     f"{'yes' if m['matched'] else 'no (the weaker run never beat the base)'} |")
    if not summary.get("matched_seeds"):
        return "\n".join(lines) + "\n"
    lines += ["", "| quantity | base | ES | GRPO |", "|---|---|---|---|"]
    for key, label in (("test_accuracy", "test greedy accuracy"), ("held_out_accuracy", "held-out task accuracy"),
                       ("lm_loss", "LM loss, held-out text (nats/token)")):
        if key not in summary:
            continue
        lines.append(f"| {label} | " + " | ".join(format_mean_std(summary[key][m]) for m in ("base", *METHODS)) + " |")
    for key, label, digits in (("update_norm", "update L2 norm", 3), ("off_task_kl", "off-task KL (nats/token)", 4)):
        lines.append(f"| {label} | | " + " | ".join(format_mean_std(summary[key][m], digits) for m in METHODS) + " |")
    lines += ["", f"- ES / GRPO update norm: {format_mean_std(summary['update_norm_ratio_es_over_grpo'], 2)}",
              f"- cosine of the two updates: {format_mean_std(summary['update_cosine'], 4)}",
              f"- LMC barrier, test accuracy: {format_mean_std(summary['lmc_reward_barrier'])}; LM loss: "
              f"{format_mean_std(summary['lmc_loss_barrier'])} nats", ""]
    lines += [f"Sparsity curves of the {args.sparsity_checkpoint} checkpoints:", ""]
    header = ["kept fraction"] + [f"{m} {mode}" for m in METHODS for mode in summary["sparsity"][m]]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, fraction in enumerate(summary["keep_fractions"]):
        cells = [f"{fraction:g}"] + [format_mean_std(summary["sparsity"][m][mode][i]) for m in METHODS
                                     for mode in summary["sparsity"][m]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plots(summary: dict, folder: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not summary.get("matched_seeds"):
        return
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ts = summary["lmc_ts"]
    for axis, key, label in ((ax[0], "lmc_reward", "test accuracy"), (ax[1], "lmc_loss", "LM loss (nats)")):
        means = [p["mean"] for p in summary[key]]
        stds = [p["std"] for p in summary[key]]
        axis.errorbar(ts, means, yerr=stds, marker="o", capsize=3)
        axis.set_xlabel("t (0: ES, 1: GRPO)")
        axis.set_ylabel(label)
    fig.suptitle("Linear path ES -> GRPO (mean ± std over seeds)")
    fig.tight_layout()
    save_figure(fig, os.path.join(folder, "lmc.png"))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    fractions = summary["keep_fractions"]
    for m in METHODS:
        for mode, points in summary["sparsity"][m].items():
            ax.errorbar(fractions, [p["mean"] for p in points], yerr=[p["std"] for p in points], marker="o",
                        capsize=3, label=f"{m}, {mode}", linestyle="--" if mode == "random" else "-")
    ax.set_xscale("log")
    ax.set_xlabel("fraction of the update's entries kept")
    ax.set_ylabel("test accuracy")
    ax.legend(fontsize=8)
    ax.set_title("Functional sparsity: top-|delta| entries vs random")
    fig.tight_layout()
    save_figure(fig, os.path.join(folder, "sparsity.png"))
    plt.close(fig)


def run_seed(args: GeometryArguments, seed: int, splits: dict) -> dict:
    folder = os.path.join(args.output_dir, f"seed{seed}")
    result_path = os.path.join(folder, "result.json")
    settings = settings_of(args, ("seeds",))
    saved = saved_result(result_path, settings, args.reuse)
    if saved is not None:
        print(f"[geometry] seed {seed}: reusing {result_path}", flush=True)
        return saved
    from trl_es.models import load_model_and_tokenizer

    start = time.monotonic()
    base, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    base_validation = accuracy_fn(args, tokenizer, splits["validation"])(base)
    del base
    print(f"[geometry] seed {seed}: base validation accuracy {base_validation:.3f}", flush=True)
    runs = {}
    for method in METHODS:
        print(f"[geometry] seed {seed}: training {method}", flush=True)
        runs[method] = train_method(args, method, seed, os.path.join(folder, method), splits)
    chosen = match(base_validation, runs["es"], runs["grpo"])
    result = {"seed": seed, "settings": settings, "base_validation_accuracy": base_validation,
              "checkpoints": runs, "match": chosen}
    if chosen["matched"]:
        print(f"[geometry] seed {seed}: matched at validation accuracy {chosen['target']:.3f} (ES step "
              f"{chosen['es']['step']}, GRPO step {chosen['grpo']['step']}); analysing", flush=True)
        result["analysis"] = analyse_seed(args, seed, splits, chosen, {m: runs[m][-1] for m in METHODS})
    else:
        print(f"[geometry] seed {seed}: the weaker run's best validation accuracy ({chosen['target']:.3f}) does not "
              f"beat the base's ({base_validation:.3f}): nothing to match", flush=True)
    result["minutes"] = (time.monotonic() - start) / 60.0
    if is_main_process():
        write_json(result_path, result)
    return result


def parse_args(argv: list[str] | None = None) -> GeometryArguments:
    return parse_arguments(GeometryArguments, argv)


def main(argv: list[str] | None = None) -> dict:
    """Train, match and analyse every seed; write results.json, results.md and the plots."""
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    splits = splits_of(args)
    seeds = [run_seed(args, seed, splits) for seed in args.seeds]
    summary = summarize(seeds)
    results = {"args": dataclasses.asdict(args), "seeds": seeds, "summary": summary}
    write_results(args.output_dir, results, markdown(args, seeds, summary, splits),
                  lambda: plots(summary, args.output_dir))
    return results


if __name__ == "__main__":
    main()
