"""The Hyper-ES comparison over seeds: one ``comparison.json`` per seed (``examples/scripts/hyper_es.py``) in, a
markdown table of mean +- sample standard deviation out.

Per arm (base, best single adapter, uniform merge, Hyper-ES, each GRPO-LoRA baseline): greedy held-out accuracy per
seed, its mean and spread, sampled pass@1 and the largest pass@K (when the runs have ``sampled``), gradient updates,
generated tokens and wall-clock minutes of training/search (``costs``), and the distance of Hyper-ES to the issue's
targets (uniform merge + 0.02; GRPO-LoRA at equal gradient updates). With ``--plot_file``, one figure of every seed's
search curve (``search_curve`` of ``comparison.json``, written with ``--track_validation``): the fitness of each
generation's best candidate and the candidates' mean, and the validation accuracy of the CMA-ES mean genome.

    python examples/studies/hyper_es_table.py runs/hyper_es_cpu/seed*/comparison.json --output_file table.md \
        --plot_file search_curves.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from trl_es.files import save_figure, write_text

from _study.spread import mean_and_std

ARMS = ("base", "best_single_adapter", "uniform_merge", "hyper_es")


def greedy(result: dict, arm: str) -> float:
    value = result[arm]
    return value["reward"] if isinstance(value, dict) else value


def arms_of(results: list[dict]) -> list[str]:
    """The arms every run has: the four of every run, then the GRPO-LoRA baselines (by gradient updates)."""
    baselines = [k for k in results[0] if k.startswith("grpo_lora_") and all(k in r for r in results)]
    return [*ARMS, *sorted(baselines, key=lambda k: int(k.removeprefix("grpo_lora_").removesuffix("steps")))]


def summarize(results: list[dict]) -> dict:
    """``{arm: {"greedy": [...], "greedy_mean", "greedy_std", "pass@k_mean"/"_std" ..., costs means}}``.

    Raises:
        ValueError: without results.
    """
    if not results:
        raise ValueError("no comparison.json given.")
    table = {}
    for arm in arms_of(results):
        values = [greedy(r, arm) for r in results]
        row = {"greedy": values}
        row["greedy_mean"], row["greedy_std"] = mean_and_std(values)
        sampled = [r.get("sampled", {}).get(arm) for r in results]
        if all(sampled):
            for key in sampled[0]:
                row[f"{key}_mean"], row[f"{key}_std"] = mean_and_std([s[key] for s in sampled])
        for key in ("gradient_updates", "generated_tokens", "wall_seconds"):
            costs = [r.get("costs", {}).get(arm, {}).get(key) for r in results]
            row[key] = None if any(c is None for c in costs) else sum(costs) / len(costs)
        table[arm] = row
    return table


def markdown(table: dict, seeds: int) -> str:
    ks = sorted({int(k[5:].split("_")[0]) for row in table.values() for k in row if k.startswith("pass@")})
    shown = sorted({ks[0], ks[-1]}) if ks else []  # pass@1 and the largest K
    head = ["arm", "greedy per seed", "greedy mean", "std", *[f"pass@{k} (mean +- std)" for k in shown],
            "gradient updates", "generated tokens", "train/search minutes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, row in table.items():
        cells = [arm, ", ".join(f"{v:.3f}" for v in row["greedy"]), f"{row['greedy_mean']:.3f}", f"{row['greedy_std']:.3f}"]
        for k in shown:
            mean = row.get(f"pass@{k}_mean")
            cells.append("-" if mean is None else f"{mean:.3f} +- {row[f'pass@{k}_std']:.3f}")
        cells.append("-" if row["gradient_updates"] is None else f"{row['gradient_updates']:g}")
        cells.append("-" if row["generated_tokens"] is None else f"{row['generated_tokens']:,.0f}")
        cells.append("-" if row["wall_seconds"] is None else f"{row['wall_seconds'] / 60:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"{seeds} seed(s); costs are means over seeds (Hyper-ES: its pool plus the search).")
    hyper = table["hyper_es"]["greedy_mean"]
    lines.append(f"Hyper-ES - (uniform merge + 0.02): {hyper - table['uniform_merge']['greedy_mean'] - 0.02:+.3f}.")
    pool_updates = table["uniform_merge"]["gradient_updates"]
    equal = [arm for arm, row in table.items() if arm.startswith("grpo_lora_") and row["gradient_updates"] == pool_updates]
    for arm in equal:
        lines.append(f"Hyper-ES - {arm} (equal gradient updates): {hyper - table[arm]['greedy_mean']:+.3f}.")
    return "\n".join(lines) + "\n"


def plot_search_curves(results: list[dict], labels: list[str], path: str) -> None:
    """Fitness (best and mean of each generation's candidates) and the mean genome's validation accuracy by CMA-ES
    generation, one colour per seed, two panels; saved atomically to ``path``.

    Raises:
        ValueError: if a run has no ``search_curve`` (it ran without ``--track_validation``).
    """
    missing = [label for label, r in zip(labels, results) if not r.get("search_curve")]
    if missing:
        raise ValueError(f"no search_curve in {missing}: run hyper_es.py with --track_validation for --plot_file.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (fitness, validation) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for i, (label, result) in enumerate(zip(labels, results)):
        curve, colour = result["search_curve"], f"C{i}"
        generations = [c["generation"] for c in curve]
        fitness.plot(generations, [c["fitness_best"] for c in curve], "o-", color=colour, label=f"{label}: best")
        fitness.plot(generations, [c["fitness_mean"] for c in curve], "o--", color=colour, alpha=0.6,
                     label=f"{label}: mean")
        tracked = [c for c in curve if c.get("validation_mean_genome") is not None]
        validation.plot([c["generation"] for c in tracked], [c["validation_mean_genome"] for c in tracked], "s-",
                        color=colour, label=label)
    fitness.set_title("fitness rows: best candidate and candidates' mean")
    validation.set_title("validation: CMA-ES mean genome")
    for ax in (fitness, validation):
        ax.set_xlabel("CMA-ES generation")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fitness.set_ylabel("accuracy")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="comparison.json files, one per seed.")
    parser.add_argument("--output_file", default=None)
    parser.add_argument("--plot_file", default=None, help="A figure of every seed's search curve (e.g. .png).")
    args = parser.parse_args(argv)
    results = []
    for path in args.files:
        with open(path) as f:
            results.append(json.load(f))
    text = markdown(summarize(results), len(results))
    sys.stdout.write(text)
    if args.output_file:
        write_text(args.output_file, text)
    if args.plot_file:
        plot_search_curves(results, [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in args.files],
                           args.plot_file)
    return text


if __name__ == "__main__":
    main()
