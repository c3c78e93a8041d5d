"""Population success diversity (JS_succ) against Pass@K across ES runs and population sizes (arXiv 2608.27351).

*Understanding ES for LLM reasoning* reports that ES runs whose populations have a higher Jensen-Shannon diversity
of successful completions, :math:`\\mathrm{JS}_{\\text{succ}} = h(\\bar p) - \\frac{1}{N}\\sum_i h(p_i)` over the
members' success rates :math:`p_i` (:func:`trl_es.analysis.success_diversity`), end with a higher Pass@K, and that
larger models need smaller populations. This script trains ES from one base for every population size in
``--population_sizes`` and every seed in ``--seeds`` (the other settings from ``--es_recipe``), records the mean of
the ``success_diversity`` that ``ESTrainer`` logs every iteration, and evaluates each final model on the **test**
split (:func:`trl_es.analysis.evaluate_policy`: greedy accuracy and Pass@K from ``--num_samples`` samples per prompt
at the papers' protocol). It reports, across all runs, the Spearman rank correlation of mean JS_succ with each
Pass@K (Pearson's correlation of ``pandas``' average ranks) and the table per population size (mean ± std over seeds).

Writes ``--output_dir``/``results.json``, ``results.md`` and ``js_succ_vs_pass_at_k.png``; a finished run's
``runs/pop<N>_seed<s>.json`` with the same settings is reused.

    python examples/studies/diversity_pass_at_k.py --model_name_or_path runs/pretrain/checkpoint-3000 \\
        --population_sizes 4 8 16 32 --seeds 0 1 2
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass, field

from trl_es.analysis.protocol import PAPER_PROTOCOL
from trl_es.files import is_main_process, save_figure, write_json

from _study.arms import parse_arguments, saved_result, settings_of, write_results
from _study.spread import format_mean_std, mean_std

DEFAULT_RECIPE = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "arithmetic_smollm2.yaml"))


@dataclass
class DiversityArguments:
    """Arguments of the JS_succ vs Pass@K study (every field is also a key of a YAML config)."""

    output_dir: str = field(default="runs/diversity_pass_at_k", metadata={"help": "Where the tables go."})
    model_name_or_path: str = field(default="embedded:SmolLM2-135M-Instruct", metadata={"help": "The base model."})
    population_sizes: list[int] = field(default_factory=lambda: [4, 8, 16, 32],
                                        metadata={"help": "ES population sizes, one run per size and seed."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Training seeds."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the arithmetic splits."})
    task_low: int = field(default=1, metadata={"help": "Smallest operand."})
    task_high: int = field(default=50, metadata={"help": "Largest operand."})
    task_ops: list[str] = field(default_factory=lambda: ["+"], metadata={"help": "Operators of the task."})
    conversational: bool = field(default=True, metadata={"help": "Chat-formatted prompts (an instruct model)."})
    num_train_prompts: int = field(default=400, metadata={"help": "Training prompts."})
    num_test_prompts: int = field(default=100, metadata={"help": "Test prompts."})
    max_completion_length: int = field(default=12, metadata={"help": "Completion tokens."})
    es_recipe: str = field(default=DEFAULT_RECIPE, metadata={"help": "YAML recipe whose ESConfig keys configure ES."})
    es_overrides: list[str] = field(default_factory=list,
                                    metadata={"help": "ESConfig overrides as key=value (values parsed as YAML)."})
    es_max_steps: int = field(default=20, metadata={"help": "ES iterations of every run."})
    num_samples: int = field(default=8, metadata={"help": "Samples per test prompt (Pass@K)."})
    pass_k: list[int] = field(default_factory=lambda: [1, 4, 8], metadata={"help": "The K of Pass@K."})
    sample_temperature: float = field(default=PAPER_PROTOCOL.temperature, metadata={"help": "Sampling temperature."})
    sample_top_p: float = field(default=PAPER_PROTOCOL.top_p, metadata={"help": "Nucleus top-p of the samples."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per greedy generate call."})
    reuse: bool = field(default=True, metadata={"help": "Reuse a finished run's JSON (same settings)."})

    def __post_init__(self):
        if not self.population_sizes or min(self.population_sizes) < 2:
            raise ValueError(f"population_sizes must be integers >= 2, got {self.population_sizes}.")
        if not self.seeds:
            raise ValueError("seeds must name at least one training seed.")
        if self.num_samples < 1 or any(not 1 <= k <= self.num_samples for k in self.pass_k):
            raise ValueError(f"pass_k values must be in [1, num_samples={self.num_samples}], got {self.pass_k}.")


def reward_funcs() -> list:
    from trl_es.tasks.arithmetic import arithmetic_reward

    return [arithmetic_reward]


def splits_of(args: DiversityArguments):
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict

    splits = make_arithmetic_dataset_dict(args.num_train_prompts, 0, args.num_test_prompts, seed=args.task_seed,
                                          low=args.task_low, high=args.task_high, ops=args.task_ops,
                                          conversational=args.conversational)
    return splits["train"], [splits["test"][i] for i in range(len(splits["test"]))]


def run_one(args: DiversityArguments, population_size: int, seed: int) -> dict:
    """Train ES with ``population_size`` members and ``seed``; its mean logged JS_succ and its test figures."""
    from trl_es import ESConfig, ESTrainer
    from trl_es.analysis import evaluate_policy
    from trl_es.cli import es_config_kwargs, load_recipe
    from trl_es.models import load_model_and_tokenizer

    start = time.monotonic()
    model, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    train, test = splits_of(args)
    kwargs = es_config_kwargs(load_recipe(args.es_recipe), args.es_overrides)
    kwargs.update(output_dir=os.path.join(args.output_dir, "runs", f"pop{population_size}_seed{seed}"),
                  max_steps=args.es_max_steps, population_size=population_size, seed=seed, eval_strategy="no",
                  save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True,
                  max_completion_length=args.max_completion_length)
    kwargs.setdefault("reward_weights", [1.0])
    trainer = ESTrainer(model, reward_funcs(), args=ESConfig(**kwargs), train_dataset=train,
                        processing_class=tokenizer)
    trainer.train()
    diversity = [row["success_diversity"] for row in trainer.state.log_history
                 if row.get("success_diversity") is not None and not math.isnan(row["success_diversity"])]
    report = evaluate_policy(model, tokenizer, test, reward_funcs(), args.max_completion_length,
                             num_samples=args.num_samples, pass_k=args.pass_k, temperature=args.sample_temperature,
                             top_p=args.sample_top_p, batch_size=args.eval_batch_size, seed=seed, progress=False)
    return {"population_size": population_size, "seed": seed,
            "js_succ_mean": statistics.fmean(diversity) if diversity else None, "js_succ_per_iteration": diversity,
            "accuracy_greedy": report["accuracy_greedy"], **{f"pass@{k}": report[f"pass@{k}"] for k in args.pass_k},
            "minutes": (time.monotonic() - start) / 60.0}


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation of two series (ties get their average rank); ``None`` below 3 pairs or for a
    constant series."""
    import pandas as pd

    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    # Spearman's rho: Pearson's correlation of the average ranks (``Series.corr(method="spearman")`` needs scipy)
    value = pd.Series([x for x, _ in pairs]).rank().corr(pd.Series([y for _, y in pairs]).rank())
    return None if value is None or math.isnan(value) else float(value)


def summarize(args: DiversityArguments, runs: list[dict]) -> dict:
    keys = ["js_succ_mean", "accuracy_greedy", *(f"pass@{k}" for k in args.pass_k)]
    per_size = {n: {key: mean_std([r[key] for r in runs if r["population_size"] == n]) for key in keys}
                for n in args.population_sizes}
    correlation = {f"pass@{k}": spearman([r["js_succ_mean"] for r in runs], [r[f"pass@{k}"] for r in runs])
                   for k in args.pass_k}
    return {"per_population_size": per_size, "spearman_js_succ_vs": correlation, "runs": len(runs)}


def markdown(args: DiversityArguments, summary: dict) -> str:
    ks = list(args.pass_k)
    header = ["population", "mean JS_succ (nats)", "greedy accuracy", *(f"Pass@{k}" for k in ks)]
    lines = [f"Base `{args.model_name_or_path}`; {args.es_max_steps} ES iterations per run; seeds {args.seeds} "
             f"(mean ± sample std); test split of {args.num_test_prompts} prompts, Pass@K from {args.num_samples} "
             f"samples at temperature {args.sample_temperature:g}, top-p {args.sample_top_p:g}.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for n, stats in summary["per_population_size"].items():
        lines.append("| " + " | ".join([str(n), format_mean_std(stats["js_succ_mean"], 4), format_mean_std(stats["accuracy_greedy"]),
                                        *(format_mean_std(stats[f"pass@{k}"]) for k in ks)]) + " |")
    lines.append("")
    for key, value in summary["spearman_js_succ_vs"].items():
        shown = "n/a" if value is None else f"{value:+.3f}"
        lines.append(f"- Spearman correlation of mean JS_succ with {key} over {summary['runs']} runs: {shown}")
    return "\n".join(lines) + "\n"


def plot(args: DiversityArguments, runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(args.pass_k)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for n in args.population_sizes:
        points = [(r["js_succ_mean"], r[f"pass@{k}"]) for r in runs if r["population_size"] == n
                  and r["js_succ_mean"] is not None]
        ax.scatter([p[0] for p in points], [p[1] for p in points], label=f"N = {n}")
    ax.set_xlabel("mean population JS_succ during training (nats)")
    ax.set_ylabel(f"test Pass@{k}")
    ax.legend(fontsize=8)
    ax.set_title("JS_succ vs Pass@K, one point per run")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> DiversityArguments:
    return parse_arguments(DiversityArguments, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    settings = settings_of(args, ("population_sizes", "seeds"))
    runs = []
    grid = [(n, s) for n in args.population_sizes for s in args.seeds]
    for i, (n, seed) in enumerate(grid):
        path = os.path.join(args.output_dir, "runs", f"pop{n}_seed{seed}.json")
        saved = saved_result(path, settings, args.reuse)
        if saved is not None:
            runs.append(saved["run"])
            continue
        print(f"[diversity] run {i + 1}/{len(grid)}: population {n}, seed {seed}", flush=True)
        run = run_one(args, n, seed)
        if is_main_process():
            write_json(path, {"settings": settings, "run": run})
        runs.append(run)
    summary = summarize(args, runs)
    results = {"args": dataclasses.asdict(args), "runs": runs, "summary": summary}
    write_results(args.output_dir, results, markdown(args, summary),
                  lambda: plot(args, runs, os.path.join(args.output_dir, "js_succ_vs_pass_at_k.png")))
    return results


if __name__ == "__main__":
    main()
