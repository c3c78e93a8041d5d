"""Sequential (continual) tasks: ES at controlled iteration budgets against GRPO, task A then task B.

The sequential claim of *Matching Accuracy, Different Geometry: ES vs GRPO in LLM Post-Training* (arXiv 2604.01499):
trained on one task after another, ES stays competitive with GRPO **when its iteration budget is controlled**, and
with a large budget it forgets the earlier task (the paper's ES 300 steps forgets, ES 100 keeps nearly as much as
GRPO).

Per seed, from the same base model, every arm trains on task A (the arithmetic problems with ``--task_a_ops``), then
from that model on task B (``--task_b_ops``), with the same number of updates in both stages. The arms are GRPO
(TRL's ``GRPOTrainer``, ``--grpo_max_steps`` steps a stage) and ES (``ESTrainer``, the ``--es_recipe`` settings) at
each budget of ``--es_budgets`` (iterations a stage), trained by :func:`geometry.train_method`. After the base and
after each stage, on the **test** split:

- greedy accuracy on A and on B (:func:`trl_es.analysis.greedy_accuracy`);
- the LM loss on held-out text (:func:`trl_es.analysis.lm_loss_fn`: ``--lm_loss_texts``, else Countdown prompts);
- the update norm ``||theta - theta_0||`` from the base (:func:`trl_es.analysis.parameter_drift`).

From these: the **forgetting of A**, ``acc_A(after A) - acc_A(after A -> B)``, and the **gain on A kept**,
``acc_A(after A -> B) - acc_A(base)``.

The problems of both tasks come from one split of the grid ``(task_a_ops + task_b_ops) x [low, high]^2``, split by
operator. With ``+`` and ``-`` and the task seed of a :mod:`_study.pretraining` run it is that run's split, so no test
problem was in its corpus.

Writes ``--output_dir``/``results.json`` (every seed and the mean / std), ``results.md`` (the table) and
``accuracy.png``; per seed the stage checkpoints under ``seed<k>/<arm>/<A|AB>/step-<n>``. A finished seed's
``seed<k>/result.json`` with the same settings is reused.

    OMP_NUM_THREADS=1 python examples/studies/continual_tasks.py --config examples/recipes/continual_tiny.yaml
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from trl_es.files import is_main_process, save_figure, write_json

from _study import load_script
from _study.arms import parse_arguments, saved_result, settings_of, write_results
from _study.spread import format_mean_std, mean_std

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ("base", "A", "AB")  # the base model, after task A, after task A then task B


@dataclass
class ContinualArguments:
    """Arguments of the sequential-task study (every field is also a key of a YAML config)."""

    output_dir: str = field(default="runs/continual", metadata={"help": "Where checkpoints and tables go."})
    model_name_or_path: str = field(default="embedded:SmolLM2-135M-Instruct",
                                    metadata={"help": "The base model every arm starts from."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Training seeds."})
    # the task
    task_seed: int = field(default=0, metadata={"help": "Seed of the arithmetic split (the same for every seed)."})
    task_low: int = field(default=0, metadata={"help": "Smallest operand."})
    task_high: int = field(default=20, metadata={"help": "Largest operand."})
    task_a_ops: list[str] = field(default_factory=lambda: ["+"], metadata={"help": "Operators of task A (first)."})
    task_b_ops: list[str] = field(default_factory=lambda: ["-"], metadata={"help": "Operators of task B (second)."})
    conversational: bool = field(default=True, metadata={"help": "Chat-formatted prompts (an instruct model)."})
    num_train_prompts: int = field(default=400, metadata={"help": "Training problems of A and B together."})
    num_validation_prompts: int = field(default=100, metadata={"help": "Validation problems of A and B together."})
    num_test_prompts: int = field(default=200, metadata={"help": "Test problems of A and B together."})
    max_completion_length: int = field(default=12, metadata={"help": "Completion tokens (training and evaluation)."})
    # the arms
    es_recipe: str = field(default=os.path.normpath(os.path.join(HERE, "..", "recipes", "arithmetic_smollm2.yaml")),
                           metadata={"help": "YAML recipe whose ESConfig keys configure ES."})
    es_overrides: list[str] = field(default_factory=list,
                                    metadata={"help": "ESConfig overrides as key=value (after the recipe)."})
    es_budgets: list[int] = field(default_factory=lambda: [30, 90],
                                  metadata={"help": "ES iterations a stage; one ES arm per budget."})
    grpo_max_steps: int = field(default=60, metadata={"help": "GRPO steps a stage (0: no GRPO arm)."})
    learning_rate: float = field(default=1e-5, metadata={"help": "GRPO learning rate (constant)."})
    num_generations: int = field(default=8, metadata={"help": "GRPO completions per prompt."})
    prompts_per_step: int = field(default=2, metadata={"help": "GRPO prompts per step."})
    temperature: float = field(default=1.0, metadata={"help": "GRPO sampling temperature."})
    beta: float = field(default=0.0, metadata={"help": "GRPO KL coefficient."})
    # the measures
    lm_loss_texts: str | None = field(default=None, metadata={
        "help": "JSON list of held-out texts for the LM loss (default: Countdown prompts)."})
    num_kl_prompts: int = field(default=32, metadata={"help": "Countdown prompts of the default LM-loss texts."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per greedy generate call."})
    reuse: bool = field(default=True, metadata={"help": "Reuse a finished seed's result.json (same settings)."})

    def __post_init__(self):
        from trl_es.arguments import check_int

        if not self.seeds:
            raise ValueError("seeds must name at least one training seed.")
        if not self.task_a_ops or not self.task_b_ops or set(self.task_a_ops) & set(self.task_b_ops):
            raise ValueError(f"task_a_ops {self.task_a_ops} and task_b_ops {self.task_b_ops} must each name an "
                             "operator and share none.")
        for budget in self.es_budgets:
            check_int("es_budgets", budget, minimum=1)
        check_int("grpo_max_steps", self.grpo_max_steps, minimum=0)
        if not self.es_budgets and not self.grpo_max_steps:
            raise ValueError("es_budgets is empty and grpo_max_steps is 0: there is no arm to train.")
        if len(set(self.es_budgets)) != len(self.es_budgets):
            raise ValueError(f"es_budgets must not repeat a budget, got {self.es_budgets}.")

    def arms(self) -> dict[str, tuple[str, int]]:
        """``{arm name: (method, updates a stage)}``: ``grpo`` and ``es<budget>`` per ES budget."""
        arms = {"grpo": ("grpo", self.grpo_max_steps)} if self.grpo_max_steps else {}
        return {**arms, **{f"es{b}": ("es", b) for b in self.es_budgets}}


def task_splits(args: ContinualArguments) -> dict:
    """``{"A": splits, "B": splits}``, each ``{"train_dataset", "validation", "test"}``: one split of the grid of
    both tasks' operators divided by operator (:func:`geometry.operator_splits`), ``validation`` and ``test`` as
    lists of rows."""
    splits = load_script("geometry").operator_splits(args, {"A": args.task_a_ops, "B": args.task_b_ops})
    return {task: {"train_dataset": s["train"], "validation": list(s["validation"]), "test": list(s["test"])}
            for task, s in splits.items()}


def stage_arguments(args: ContinualArguments, start: str, updates: int, ops: list[str]):
    """The :class:`geometry.GeometryArguments` of one stage: train from ``start`` on ``ops`` for ``updates`` updates
    (ES iterations or GRPO steps), one checkpoint at the end."""
    geo = load_script("geometry")
    own = ("seeds", "model_name_or_path", "output_dir", "grpo_max_steps")
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(geo.GeometryArguments)
              if hasattr(args, f.name) and f.name not in own}
    return geo.GeometryArguments(
        **shared, model_name_or_path=start, seeds=[0], task_ops=list(ops), held_out_ops=[], eval_every=updates,
        es_max_steps=updates, grpo_max_steps=updates, analysis_prompts=1)


def measure(model, base, accuracy: dict, loss) -> dict:
    """Test accuracy on A and B (``accuracy``: ``{"A": fn, "B": fn}``), LM loss, update norm from the base."""
    from trl_es.analysis import parameter_drift

    out = {f"accuracy_{t}": fn(model) for t, fn in accuracy.items()}
    out["lm_loss"] = loss(model)
    out["update_norm"] = parameter_drift(model, base, per_group=False)["l2"]
    return out


def run_seed(args: ContinualArguments, seed: int, splits: dict) -> dict:
    """Base, then every arm through A and A -> B; ``seed<k>/result.json``."""
    from trl_es.analysis import lm_loss_fn
    from trl_es.models import load_model_and_tokenizer

    geo = load_script("geometry")
    folder = os.path.join(args.output_dir, f"seed{seed}")
    result_path = os.path.join(folder, "result.json")
    settings = settings_of(args, ("seeds",))
    saved = saved_result(result_path, settings, args.reuse)
    if saved is not None:
        print(f"[continual] seed {seed}: reusing {result_path}", flush=True)
        return saved
    base, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    eval_args = stage_arguments(args, args.model_name_or_path, 1, args.task_a_ops)
    loss = lm_loss_fn(tokenizer, geo.lm_texts(eval_args, [] if args.lm_loss_texts else geo.off_task_prompts(eval_args)))
    accuracy = {t: geo.accuracy_fn(eval_args, tokenizer, splits[t]["test"]) for t in "AB"}
    result = {"seed": seed, "settings": settings, "base": measure(base, base, accuracy, loss),
              "arms": {}}
    print(f"[continual] seed {seed}: base accuracy A {result['base']['accuracy_A']:.3f}, "
          f"B {result['base']['accuracy_B']:.3f}", flush=True)
    for arm, (method, updates) in args.arms().items():
        start, stages = args.model_name_or_path, {}
        for stage, task, ops in (("A", "A", args.task_a_ops), ("AB", "B", args.task_b_ops)):
            print(f"[continual] seed {seed}: {arm} trains on task {task} ({'/'.join(ops)}), {updates} updates",
                  flush=True)
            began = time.monotonic()
            record = geo.train_method(stage_arguments(args, start, updates, ops), method, seed,
                                      os.path.join(folder, arm, stage), splits[task])
            minutes = (time.monotonic() - began) / 60.0
            start = record[-1]["path"]
            model = load_model_and_tokenizer(start)[0]
            stages[stage] = {**measure(model, base, accuracy, loss), "path": start,
                             "train_minutes": minutes, "validation_accuracy": record[-1]["validation_accuracy"]}
            del model
            print(f"[continual] seed {seed}: {arm} after {stage}: accuracy A {stages[stage]['accuracy_A']:.3f}, "
                  f"B {stages[stage]['accuracy_B']:.3f}", flush=True)
        stages["forgetting_A"] = stages["A"]["accuracy_A"] - stages["AB"]["accuracy_A"]
        stages["gain_A_kept"] = stages["AB"]["accuracy_A"] - result["base"]["accuracy_A"]
        result["arms"][arm] = stages
    if is_main_process():
        write_json(result_path, result)
    return result


def summarize(args: ContinualArguments, seeds: list[dict]) -> dict:
    """Mean and sample standard deviation over the seeds of every number of :func:`run_seed`."""
    keys = ("accuracy_A", "accuracy_B", "lm_loss", "update_norm")
    summary = {"base": {k: mean_std([s["base"][k] for s in seeds]) for k in keys}, "arms": {}}
    for arm in args.arms():
        runs = [s["arms"][arm] for s in seeds]
        summary["arms"][arm] = {stage: {k: mean_std([r[stage][k] for r in runs]) for k in (*keys, "train_minutes")}
                                for stage in ("A", "AB")}
        for k in ("forgetting_A", "gain_A_kept"):
            summary["arms"][arm][k] = mean_std([r[k] for r in runs])
    return summary


def arm_label(args: ContinualArguments, arm: str) -> str:
    method, updates = args.arms()[arm]
    return f"GRPO, {updates} steps" if method == "grpo" else f"ES, {updates} iterations"


def markdown(args: ContinualArguments, summary: dict) -> str:
    a, b = "/".join(args.task_a_ops), "/".join(args.task_b_ops)
    base = summary["base"]
    lines = [f"Base `{args.model_name_or_path}`; task A = arithmetic {a}, task B = {b}, operands "
             f"{args.task_low}..{args.task_high} (task seed {args.task_seed}). Seeds {args.seeds}, mean ± sample std. "
             "Greedy accuracy on the test split of each task.", "",
             f"Base model: A {format_mean_std(base['accuracy_A'])}, B {format_mean_std(base['accuracy_B'])}, "
             f"LM loss {format_mean_std(base['lm_loss'])}.", "",
             "| arm (a stage) | A after A | B after A | A after A -> B | B after A -> B |", "|---|---|---|---|---|"]
    for arm, s in summary["arms"].items():
        lines.append(f"| {arm_label(args, arm)} | " + " | ".join(
            format_mean_std(s[stage][f"accuracy_{task}"]) for stage in ("A", "AB") for task in "AB") + " |")
    lines += ["", "| arm (a stage) | forgetting of A | gain on A kept | LM loss after A -> B | "
              "update norm after A -> B | minutes a stage |", "|---|---|---|---|---|---|"]
    for arm, s in summary["arms"].items():
        minutes = (s["A"]["train_minutes"]["mean"] + s["AB"]["train_minutes"]["mean"]) / 2
        lines.append(f"| {arm_label(args, arm)} | {format_mean_std(s['forgetting_A'])} | "
                     f"{format_mean_std(s['gain_A_kept'])} | {format_mean_std(s['AB']['lm_loss'])} | "
                     f"{format_mean_std(s['AB']['update_norm'], 2)} | {minutes:.1f} |")
    return "\n".join(lines) + "\n"


def plot(args: ContinualArguments, summary: dict, folder: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for axis, task in zip(axes, "AB"):
        for arm, s in summary["arms"].items():
            points = [summary["base"][f"accuracy_{task}"], s["A"][f"accuracy_{task}"], s["AB"][f"accuracy_{task}"]]
            axis.errorbar(range(3), [p["mean"] for p in points], yerr=[p["std"] for p in points], marker="o",
                          capsize=3, label=arm_label(args, arm))
        axis.set_xticks(range(3), ["base", "after A", "after A -> B"])
        axis.set_title(f"task {task} ({'/'.join(args.task_a_ops if task == 'A' else args.task_b_ops)})")
    axes[0].set_ylabel("test greedy accuracy")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, os.path.join(folder, "accuracy.png"))
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> ContinualArguments:
    return parse_arguments(ContinualArguments, argv)


def main(argv: list[str] | None = None) -> dict:
    """Every seed through every arm; results.json, results.md, accuracy.png."""
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    splits = task_splits(args)
    seeds = [run_seed(args, seed, splits) for seed in args.seeds]
    summary = summarize(args, seeds)
    results = {"args": dataclasses.asdict(args), "seeds": seeds, "summary": summary}
    write_results(args.output_dir, results, markdown(args, summary), lambda: plot(args, summary, args.output_dir))
    return results


if __name__ == "__main__":
    main()
