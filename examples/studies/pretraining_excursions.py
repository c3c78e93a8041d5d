"""RL, SFT, SFT -> RL and RL + SFT averaging on intermediate pre-training checkpoints (arXiv 2606.04272).

*RL Excursions during Pre-Training* trains an LM from scratch and applies RL, SFT and SFT -> RL to intermediate
checkpoints. Its claims: RL is effective very early and often matches SFT -> RL; RL on a base checkpoint expands the
output distribution (Pass@K up), and the sharpening reported elsewhere appears only when RL follows SFT; general
ability stays unchanged under RL and degrades under SFT; parallel averaging of RL and SFT updates beats every other
method.

This script runs that study on this machine:

1. **Pre-training** (``examples/studies/pretrain_from_scratch.py``, skipped when ``--pretrain_dir`` already holds
   its ``pretraining.json``): a tiny Llama trained from random weights on arithmetic + general text, with
   checkpoints every few hundred steps; the held-out arithmetic problems never appear in its corpus.
2. **Excursions**: from each checkpoint in ``--checkpoints`` (default: every one) and for each seed in ``--seeds``,
   ``examples/studies/parallel_averaging.py`` trains every arm of ``--arms`` at an equal number of updates (RL =
   GRPO, SFT, SFT -> RL, RL + SFT parallel averaging, ES) on the problems seen in pre-training, with plain-text
   prompts, and evaluates it on the held-out **test** problems: greedy Pass@1, Pass@K from samples, and the general
   ability as the LM loss on the pre-training run's held-out general text (``lm_loss``).
3. **Table** per (checkpoint, arm), mean ± sample std over seeds, and plots of Pass@1, Pass@K and LM loss against
   the checkpoint's pre-training step.

``--parallel_args`` passes more options to parallel_averaging.py as ``key=value`` (e.g. ``max_steps=32
learning_rate=1e-4``), ``--pretrain_args`` to pretrain_from_scratch.py.
Writes ``--output_dir``/``results.json``, ``results.md``, ``excursions.png``; per checkpoint and seed the arm folders
of parallel_averaging.py (reused when rerun with the same settings).

    python examples/studies/pretraining_excursions.py --pretrain_dir runs/pretrain_from_scratch --seeds 0 1 2
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from trl_es.files import save_figure

from _study import load_script
from _study.arms import parse_arguments, write_results
from _study.spread import format_mean_std, mean_std

ARM_ORDER = load_script("parallel_averaging").ARMS  # the arms parallel_averaging.py runs, in its table order


@dataclass
class ExcursionArguments:
    """Arguments of the pre-training excursions study (every field is also a key of a YAML config)."""

    output_dir: str = field(default="runs/pretraining_excursions", metadata={"help": "Where the tables go."})
    pretrain_dir: str = field(default="runs/pretrain_from_scratch", metadata={
        "help": "pretrain_from_scratch.py's output folder; pre-trained first (its defaults plus --pretrain_args) "
                "when it holds no pretraining.json."})
    pretrain_args: list[str] = field(default_factory=list, metadata={
        "help": "More arguments of pretrain_from_scratch.py as key=value (e.g. max_steps=800; list values "
                "separated by spaces)."})
    checkpoints: list[int] = field(default_factory=list,
                                   metadata={"help": "Pre-training steps to start from (default: every checkpoint)."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Training seeds of the arms."})
    arms: list[str] = field(default_factory=lambda: ["base", "rl", "sft", "sft_rl", "rl_sft", "es"],
                            metadata={"help": "parallel_averaging.py arms.", "choices": list(ARM_ORDER)})
    num_train_prompts: int = field(default=400, metadata={"help": "RL / SFT training problems (seen in pre-training)."})
    parallel_args: list[str] = field(default_factory=list, metadata={
        "help": "More arguments of parallel_averaging.py as key=value (e.g. max_steps=32 'pass_k=1 4 8')."})

    def __post_init__(self):
        if not self.seeds:
            raise ValueError("seeds must name at least one training seed.")
        if not self.arms or any(arm not in ARM_ORDER for arm in self.arms):
            raise ValueError(f"arms must be a non-empty list from {list(ARM_ORDER)}, got {self.arms}.")
        as_argv(self.pretrain_args, "pretrain_args")
        as_argv(self.parallel_args, "parallel_args")


def as_argv(items: list[str], field_name: str) -> list[str]:
    """``["max_steps=32", "pass_k=1 4"]`` -> ``["--max_steps", "32", "--pass_k", "1", "4"]``.

    Raises:
        ValueError: for an item that is not ``key=value`` (naming ``field_name``).
    """
    argv = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or key.startswith("-"):
            raise ValueError(f"{field_name} items must be key=value (e.g. max_steps=32), got {item!r}.")
        argv += [f"--{key}", *value.split()]
    return argv


def pretrained(args: ExcursionArguments) -> dict:
    """pretraining.json of ``--pretrain_dir``, pre-training first when it is missing."""
    path = os.path.join(args.pretrain_dir, "pretraining.json")
    if not os.path.exists(path):
        print(f"[excursions] pre-training into {args.pretrain_dir}", flush=True)
        load_script("pretrain_from_scratch").main(["--output_dir", args.pretrain_dir,
                                                   *as_argv(args.pretrain_args, "pretrain_args")])
    with open(path) as f:
        return json.load(f)


def general_texts(pretraining: dict) -> str:
    """The pre-training run's held-out general text: the JSON file it wrote (``corpus.general_eval_file``)."""
    path = pretraining["corpus"]["general_eval_file"]
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} (the pre-training run's held-out general text) is missing.")
    return path


def parallel_argv(args: ExcursionArguments, pretraining: dict, checkpoint: dict, seed: int, texts: str) -> list[str]:
    """parallel_averaging.py's arguments for one checkpoint and seed: the pre-training run's problem split."""
    split = pretraining["arithmetic_splits"]["kwargs"]
    return ["--model_name_or_path", checkpoint["path"], "--output_dir",
            os.path.join(args.output_dir, f"step{checkpoint['step']}", f"seed{seed}"), "--seed", str(seed),
            "--arms", *args.arms, "--task_seed", str(split["seed"]), "--task_low", str(split["low"]),
            "--task_high", str(split["high"]), "--task_ops", *split["ops"], "--conversational", "false",
            "--num_train_prompts", str(args.num_train_prompts),
            "--num_validation_prompts", str(split["num_validation"]), "--num_test_prompts", str(split["num_test"]),
            "--lm_loss_texts", texts, *as_argv(args.parallel_args, "parallel_args")]


def summarize(runs: list[dict], pass_k: list[int]) -> list[dict]:
    """One row per (checkpoint step, arm): mean ± std over seeds of the test figures and the LM loss."""
    keys = ["accuracy_greedy", *(f"pass@{k}" for k in pass_k), "lm_loss", "drift_l2"]
    rows = []
    for step in sorted({r["step"] for r in runs}):
        arms = [a for a in ARM_ORDER if any(r["step"] == step and r["arm"] == a for r in runs)]
        for arm in arms:
            picked = [r for r in runs if r["step"] == step and r["arm"] == arm]
            rows.append({"step": step, "arm": arm, "seeds": len(picked),
                         **{key: mean_std([r.get(key) for r in picked]) for key in keys}})
    return rows


def markdown(rows: list[dict], pass_k: list[int], labels: dict, pretraining: dict) -> str:
    k = max(pass_k)
    header = ["pre-training step", "arm", "greedy Pass@1", "Pass@1 (sampled)", f"Pass@{k}", "LM loss (general text)"]
    lines = [f"Tiny Llama pre-trained from scratch ({pretraining['num_parameters']:,} parameters); test split of "
             f"{pretraining['arithmetic_splits']['kwargs']['num_test']} problems never in its corpus; mean ± sample "
             "std over seeds.", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join([str(r["step"]), labels.get(r["arm"], r["arm"]), format_mean_std(r["accuracy_greedy"]),
                                        format_mean_std(r["pass@1"]), format_mean_std(r[f"pass@{k}"]), format_mean_std(r["lm_loss"])]) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], pass_k: list[int], labels: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(pass_k)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for arm in ARM_ORDER:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        steps = [r["step"] for r in mine]
        for ax, key in zip(axes, ("accuracy_greedy", f"pass@{k}", "lm_loss")):
            points = [r[key] for r in mine]
            ax.errorbar(steps, [p["mean"] for p in points], yerr=[p["std"] or 0.0 for p in points], marker="o",
                        capsize=3, label=labels.get(arm, arm))
    for ax, title in zip(axes, ("greedy Pass@1 (test)", f"Pass@{k} (test)", "LM loss, held-out general text")):
        ax.set_xlabel("pre-training step of the starting checkpoint")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> ExcursionArguments:
    return parse_arguments(ExcursionArguments, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    pretraining = pretrained(args)
    checkpoints = [c for c in pretraining["checkpoints"] if not args.checkpoints or c["step"] in args.checkpoints]
    missing = set(args.checkpoints) - {c["step"] for c in checkpoints}
    if missing:
        raise ValueError(f"checkpoints {sorted(missing)} are not in {args.pretrain_dir}; it has "
                         f"{[c['step'] for c in pretraining['checkpoints']]}.")
    texts = general_texts(pretraining)
    parallel = load_script("parallel_averaging")
    runs, pass_k = [], None
    grid = [(c, s) for c in checkpoints for s in args.seeds]
    for i, (checkpoint, seed) in enumerate(grid):
        print(f"[excursions] {i + 1}/{len(grid)}: checkpoint step {checkpoint['step']}, seed {seed}", flush=True)
        out = parallel.main(parallel_argv(args, pretraining, checkpoint, seed, texts))
        pass_k = sorted(set(out["arguments"]["pass_k"]))
        runs += [{"step": checkpoint["step"], "seed": seed, **row} for row in out["table"]]
    rows = summarize(runs, pass_k)
    labels = parallel.ARM_LABELS
    results = {"args": dataclasses.asdict(args), "pretraining": {k: v for k, v in pretraining.items()
                                                                 if k != "checkpoints"},
               "checkpoints": checkpoints, "runs": runs, "table": rows}
    table = markdown(rows, pass_k, labels, pretraining)
    write_results(args.output_dir, results, table,
                  lambda: plot(rows, pass_k, labels, os.path.join(args.output_dir, "excursions.png")))
    return results


if __name__ == "__main__":
    main()
