"""AWD's claim, reproduced: Anchored Weight Decay keeps prior-task accuracy while ES learns the target task.

*Overcoming Forgetting in LLM Fine-Tuning with Evolution Strategies* (Schweighofer et al. 2026, arXiv 2605.30148)
finds that ES's prior-task drift is a random walk in weakly constrained directions of weight space, and that
anchoring the weights to the initial model (AWD: after every ES step, ``delta <- (1 - alpha * lambda) * delta`` with
``delta = theta - theta_0``; ``ESConfig.awd_lambda`` / ``awd_penalty``) keeps prior-task performance while the target
task still improves, at a lower cost than a larger population (which averages the random walk away).

This script trains ES on the target task (arithmetic addition, a, b in 1..50: the main job's task and recipe) for a
fixed number of iterations ``--max_steps`` with

- ``awd_lambda = 0`` (the baseline) and every value of ``--awd_lambdas`` (the candidates), population
  ``population_size`` of the ES recipe (24);
- ``awd_lambda = 0`` with the larger population ``--large_population_size`` (48: twice the cost per iteration).

Prior tasks: problems the base model already solves, in the same prompt format but with operations the target task
never trains (``--prior_tasks``, default multiplication and subtraction with operands in 1..12; the base
SmolLM2-135M-Instruct answers about 0.7 and 0.3 of them, against 0.04-0.11 on operands in 1..50, see
docs/recipes.md).

Every run saves only its seed log (a few kB); its weights at any iteration are rebuilt from the base model with
:func:`trl_es.replay`'s arithmetic (bitwise the trained weights: checked against the trained model's fingerprint at
the last iteration). Tracking, at iterations ``--eval_every``, ``2 * eval_every``, ..., ``max_steps`` (and once for
the base model):

1. **Selection (validation).** Target and prior-task greedy accuracy on the validation splits of every
   ``awd_lambda`` run. Rule: a candidate is eligible if its final target accuracy is at least the ``lambda = 0``
   run's minus ``--target_tolerance``; the ``--num_chosen`` eligible candidates with the highest mean prior-task
   accuracy are chosen (ties: higher target accuracy; too few eligible: the rest by target accuracy).
2. **Report (test).** Target and prior-task greedy accuracy on the test splits, off-task KL to the base model
   (Countdown prompts, as ``trl-es analyze``) and parameter drift, for ``lambda = 0``, the chosen values and the
   large population.

Writes to ``--output_dir``: ``results.md`` (selection table and report table), ``results.json`` (everything, with
every tracked point), ``awd_retention.png`` (target accuracy, mean prior-task accuracy, off-task KL and drift
against the iteration), per run ``<run>/es_seed_log.jsonl`` and ``result.json``.

    python examples/studies/awd_retention.py --config examples/recipes/awd_retention_cpu.yaml
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field

from transformers import TrainerCallback

from trl_es.analysis import weights_fingerprint as fingerprint
from trl_es.cli import es_config_kwargs as recipe_es_config_kwargs
from trl_es.cli import load_recipe
from trl_es.files import is_main_process, save_figure, write_json

from _study.arms import JobArguments, Jobs, parse_arguments, write_results

#: Prior tasks: name -> (operator, low, high) of make_arithmetic_dataset_dict.
PRIOR_TASKS = {
    "mul_1_12": ("*", 1, 12),
    "sub_1_12": ("-", 1, 12),
    "mul_1_9": ("*", 1, 9),
    "sub_1_9": ("-", 1, 9),
    "mul_1_20": ("*", 1, 20),
}
SCHEDULES = ("constant", "recipe")
DEFAULT_RECIPE = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "arithmetic_smollm2.yaml"))


@dataclass
class AWDArguments(JobArguments):
    """Arguments of the AWD retention experiment (every field is also a key of the YAML recipe)."""

    output_dir: str = field(default="runs/awd_retention", metadata={"help": "Where runs, tables and the plot go."})
    model_name_or_path: str = field(default="embedded:SmolLM2-135M-Instruct",
                                    metadata={"help": "The base model (hub id, path or the embedded alias)."})
    task_seed: int = field(default=0, metadata={"help": "Seed of every split (target and prior tasks)."})
    num_train_prompts: int = field(default=400, metadata={"help": "Target-task training prompts."})
    num_validation_prompts: int = field(default=200, metadata={"help": "Target-task validation prompts (selection)."})
    num_test_prompts: int = field(default=200, metadata={"help": "Target-task test prompts (report)."})
    prior_tasks: list[str] = field(default_factory=lambda: ["mul_1_12", "sub_1_12"], metadata={
        "help": "Prior tasks (operator and operand range).", "choices": list(PRIOR_TASKS)})
    num_prior_prompts: int = field(default=64, metadata={
        "help": "Prompts per prior task in each of its validation and test splits (2 x 64 <= the 144 problems of "
        "operands in 1..12)."})
    seed: int = field(default=0, metadata={"help": "ES seed of every run (the same noise seeds in every run)."})
    max_steps: int = field(default=12, metadata={"help": "ES iterations of every run (the fixed budget)."})
    eval_every: int = field(default=4, metadata={"help": "Track every this many iterations (and at the end)."})
    awd_lambdas: list[float] = field(default_factory=lambda: [3.0, 10.0, 30.0], metadata={
        "help": "Candidate AWD strengths (besides 0); alpha * lambda must stay < 1 for the l2 penalty."})
    awd_penalty: str = field(default="l2", metadata={"help": "AWD penalty: l2 or l1.", "choices": ["l2", "l1"]})
    num_chosen: int = field(default=2, metadata={"help": "Candidates chosen on validation for the report."})
    target_tolerance: float = field(default=0.05, metadata={
        "help": "Selection: a candidate's final validation target accuracy may be at most this much below lambda=0's."})
    large_population_size: int = field(default=48, metadata={
        "help": "Population of the no-AWD cost comparison run (0 = no such run)."})
    es_recipe: str = field(default=DEFAULT_RECIPE, metadata={"help": "YAML recipe whose ESConfig keys configure ES."})
    es_overrides: list[str] = field(default_factory=list,
                                    metadata={"help": "ESConfig overrides as key=value (values parsed as YAML)."})
    es_schedule: str = field(default="constant", metadata={
        "help": "constant: constant alpha (so the AWD shrink alpha * lambda is constant); recipe: the recipe's "
        "schedule.", "choices": list(SCHEDULES)})
    es_num_processes: int | None = field(default=None, metadata={"help": "ES processes (default: trl_es.launch's)."})
    eval_max_new_tokens: int | None = field(default=None, metadata={
        "help": "New tokens per evaluated completion (default: the ES recipe's max_completion_length)."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per greedy generate call."})
    num_kl_prompts: int = field(default=16, metadata={"help": "Off-task (Countdown) prompts for the KL."})
    kl_max_new_tokens: int = field(default=16, metadata={"help": "New tokens per off-task KL sample."})

    def __post_init__(self):
        if not self.prior_tasks or any(t not in PRIOR_TASKS for t in self.prior_tasks):
            raise ValueError(f"prior_tasks must be a non-empty list from {list(PRIOR_TASKS)}, got {self.prior_tasks}.")
        if self.max_steps < 1 or self.eval_every < 1:
            raise ValueError(f"max_steps and eval_every must be >= 1, got {self.max_steps}, {self.eval_every}.")
        if not self.awd_lambdas or any(not lam > 0 for lam in self.awd_lambdas):
            raise ValueError(f"awd_lambdas must be a non-empty list of values > 0, got {self.awd_lambdas}.")
        if not 1 <= self.num_chosen <= len(self.awd_lambdas):
            raise ValueError(f"num_chosen must be in [1, len(awd_lambdas)={len(self.awd_lambdas)}], got "
                             f"{self.num_chosen}.")
        if self.es_schedule not in SCHEDULES:
            raise ValueError(f"es_schedule must be one of {SCHEDULES}, got {self.es_schedule!r}.")
        if self.num_validation_prompts < 1 or self.num_test_prompts < 1 or self.num_prior_prompts < 1:
            raise ValueError("num_validation_prompts, num_test_prompts and num_prior_prompts must be >= 1.")


# ---------------------------------------------------------------------------------------------- shared pieces
def es_config_kwargs(args: AWDArguments) -> dict:
    """The ES recipe's ESConfig keys, the schedule choice, then ``--es_overrides`` (values parsed as YAML)."""
    recipe = load_recipe(args.es_recipe)
    if args.es_schedule == "constant":
        recipe = {k: v for k, v in recipe.items() if k != "lr_scheduler_kwargs"}
        recipe["lr_scheduler_type"] = "constant"
    return recipe_es_config_kwargs(recipe, args.es_overrides)


def completion_length(args: AWDArguments) -> int:
    return args.eval_max_new_tokens or int(es_config_kwargs(args).get("max_completion_length", 10))


def task_reward_funcs() -> list:
    """The reward functions of the target and prior tasks: :func:`trl_es.tasks.arithmetic.arithmetic_reward`."""
    from trl_es.tasks.arithmetic import arithmetic_reward

    return [arithmetic_reward]


def target_splits(args: AWDArguments):
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict

    return make_arithmetic_dataset_dict(args.num_train_prompts, args.num_validation_prompts, args.num_test_prompts,
                                        seed=args.task_seed)


def prior_splits(args: AWDArguments, name: str):
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict

    op, low, high = PRIOR_TASKS[name]
    return make_arithmetic_dataset_dict(0, args.num_prior_prompts, args.num_prior_prompts, seed=args.task_seed,
                                        low=low, high=high, ops=(op,))


def runs_of(args: AWDArguments) -> list[dict]:
    """The training runs: lambda = 0, each candidate lambda, the large population without AWD."""
    population = int(es_config_kwargs(args).get("population_size", 30))
    runs = [{"run": "awd_0", "awd_lambda": 0.0, "population_size": population}]
    runs += [{"run": f"awd_{lam:g}", "awd_lambda": float(lam), "population_size": population}
             for lam in args.awd_lambdas]
    if args.large_population_size:
        runs.append({"run": f"pop_{args.large_population_size}", "awd_lambda": 0.0,
                     "population_size": args.large_population_size})
    return runs


# ---------------------------------------------------------------------------------------------- training (one run)
class _Seconds(TrainerCallback):
    """Training wall-clock seconds (``train_begin`` to ``train_end``)."""

    seconds = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        import time

        self._start = time.monotonic()

    def on_train_end(self, args, state, control, **kwargs):
        import time

        self.seconds = time.monotonic() - self._start


def train_run(spec: dict) -> dict:
    """One ES run (in every process of its launch): ``max_steps`` iterations; keeps the seed log only."""
    from trl_es import ESConfig, ESTrainer
    from trl_es.models import load_model_and_tokenizer

    args = AWDArguments(**spec["args"])
    model, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    kwargs = es_config_kwargs(args)
    kwargs.update(output_dir=spec["output_dir"], max_steps=args.max_steps, population_size=spec["population_size"],
                  awd_lambda=spec["awd_lambda"], awd_penalty=args.awd_penalty, eval_strategy="no",
                  save_strategy="no", report_to="none", seed=args.seed, logging_steps=1, disable_tqdm=True)
    kwargs.setdefault("reward_weights", [1.0])
    clock = _Seconds()
    trainer = ESTrainer(model, task_reward_funcs(), args=ESConfig(**kwargs), train_dataset=target_splits(args)["train"],
                        processing_class=tokenizer, callbacks=[clock])
    trainer.train()  # writes es_seed_log.jsonl to output_dir
    trained = trainer.accelerator.unwrap_model(trainer.model)
    config = trainer.args
    result = {"spec": spec, "run": spec["run"], "awd_lambda": spec["awd_lambda"],
              "population_size": spec["population_size"], "iterations": trainer.state.global_step,
              "training_minutes": clock.seconds / 60.0,
              "completions_generated": trainer.state.global_step * config.population_size * config.prompt_batch_size
              * config.num_generations,
              "seed_log": os.path.join(spec["output_dir"], "es_seed_log.jsonl"),
              "final_fingerprint": fingerprint(trained)}
    if trainer.is_world_process_zero():
        write_json(spec["result"], result)
    return result


# ---------------------------------------------------------------------------------------------- tracking (one run)
class IncrementalReplay:
    """Rebuild a run's weights iteration by iteration from the base model and its seed log, in place.

    The same arithmetic as :func:`trl_es.replay` (the fp32 master, the logged perturbation and noise source, AWD with
    the base weights as anchor), applied one record at a time, so that a run can be measured at several iterations
    for the price of one replay: ``advance_to(t)`` applies every record with ``step <= t``.
    """

    def __init__(self, model, log_path: str):
        import torch

        from trl_es.es.noise import noise_source_from_description
        from trl_es.es.perturbation import LowRankPerturbation, TrainedParameters
        from trl_es.es.seedlog import SeedLog, header_perturbation

        self.log = SeedLog.load(log_path)
        named = dict(model.named_parameters())
        master_dtype = torch.float32 if self.log.header.get("master_dtype", "float32") == "float32" else None
        self.perturbation = header_perturbation(self.log.header)
        self.params = TrainedParameters([(n, named[n]) for n, _ in self.log.header["parameters"]], master_dtype,
                                        share_params=isinstance(self.perturbation, LowRankPerturbation))
        self.anchor = {n: t.detach().clone() for n, t in self.params.master_state_dict().items()}
        self.noise = noise_source_from_description(self.log.header["noise"])
        self.penalty = self.log.header.get("awd_penalty", "l2")
        self.step = 0

    def advance_to(self, step: int) -> None:
        from trl_es.es.seedlog import apply_record

        for record in self.log.records:
            if self.step < record["step"] <= step:
                apply_record(self.params, self.noise, record, self.anchor, self.penalty, self.perturbation)
                self.step = record["step"]


def measure(model, tokenizer, args: AWDArguments, split: str, base=None) -> dict:
    """Greedy accuracy on the target task's and every prior task's ``split``; with ``base``, off-task KL and drift."""
    from trl_es.analysis import greedy_accuracy, off_task_kl, parameter_drift

    def rows(dataset):
        return [dataset[i] for i in range(len(dataset))]

    length, funcs = completion_length(args), task_reward_funcs()
    out = {"target": greedy_accuracy(model, tokenizer, rows(target_splits(args)[split]), funcs, length,
                                     args.eval_batch_size)}
    for name in args.prior_tasks:
        out[name] = greedy_accuracy(model, tokenizer, rows(prior_splits(args, name)[split]), funcs, length,
                                    args.eval_batch_size)
    out["prior_mean"] = sum(out[name] for name in args.prior_tasks) / len(args.prior_tasks)
    if base is not None:
        from trl_es.tasks import get_task

        prompts = [r["prompt"] for r in get_task("countdown").build_dataset(args.num_kl_prompts, seed=1)]
        out["off_task_kl"] = off_task_kl(model, base, tokenizer, prompts, max_new_tokens=args.kl_max_new_tokens,
                                         seed=args.seed)["kl"] if prompts else None
        drift = parameter_drift(model, base, per_group=False)
        out["drift_l2"], out["drift_relative"] = drift["l2"], drift["relative"]
    return out


def track(spec: dict) -> dict:
    """Measure one run at ``spec["points"]`` (iterations) on ``spec["split"]``; the base model when no seed log."""
    import torch

    from trl_es.models import load_model_and_tokenizer

    torch.manual_seed(0)
    args = AWDArguments(**spec["args"])
    base, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    report = spec["split"] == "test"
    points = []
    if spec.get("seed_log") is None:  # the base model, iteration 0
        values = measure(base, tokenizer, args, spec["split"])
        if report:
            values.update(off_task_kl=0.0, drift_l2=0.0, drift_relative=0.0)  # zero by definition (not measured)
        points.append({"iteration": 0, **values})
        replay_exact = None
    else:
        model = copy.deepcopy(base)
        replayer = IncrementalReplay(model, spec["seed_log"])
        for step in spec["points"]:
            replayer.advance_to(step)
            points.append({"iteration": step, **measure(model, tokenizer, args, spec["split"],
                                                         base if report else None)})
        replay_exact = fingerprint(model) == spec["final_fingerprint"] if replayer.step == spec["iterations"] else None
    result = {"spec": spec, "run": spec["run"], "split": spec["split"], "points": points,
              "replay_exact": replay_exact}
    if is_main_process():
        write_json(spec["result"], result)
    return result


# ---------------------------------------------------------------------------------------------- orchestration
# the arguments that choose which runs exist and which are reported: adding a candidate lambda trains and tracks only
# the new run
JOBS = Jobs(__file__, "awd", not_in_result=("awd_lambdas", "num_chosen", "target_tolerance"))


def train_all(args: AWDArguments) -> list[dict]:
    results = []
    for run in runs_of(args):
        folder = os.path.join(args.output_dir, run["run"])
        os.makedirs(folder, exist_ok=True)
        spec = {"kind": "train", **run, "output_dir": folder, "args": dataclasses.asdict(args),
                "result": os.path.join(folder, "result.json")}
        results.append(JOBS.run(args, spec, train_run, args.es_num_processes,
                                f"training {run['run']}: awd_lambda {run['awd_lambda']:g}, population "
                                f"{run['population_size']}, {args.max_steps} iterations"))
    return results


def track_all(args: AWDArguments, runs: list[dict], split: str) -> dict[str, dict]:
    """Track ``runs`` (and the base model) on ``split``; returns results by run name (``"base"`` included)."""
    points = sorted({*range(args.eval_every, args.max_steps + 1, args.eval_every), args.max_steps})
    specs = [{"kind": "track", "run": "base", "split": split, "seed_log": None, "args": dataclasses.asdict(args),
              "result": os.path.join(args.output_dir, f"base_{split}.json")}]
    for run in runs:
        specs.append({"kind": "track", "run": run["run"], "split": split, "seed_log": run["seed_log"],
                      "points": [p for p in points if p <= run["iterations"]], "iterations": run["iterations"],
                      "final_fingerprint": run["final_fingerprint"], "args": dataclasses.asdict(args),
                      "result": os.path.join(args.output_dir, run["run"], f"tracking_{split}.json")})
    results = JOBS.run_all(args, specs, track, f"tracking {{}} job(s) on the {split} split")
    return {s["run"]: result for s, result in zip(specs, results)}


def select(args: AWDArguments, runs: list[dict], validation: dict[str, dict]) -> dict:
    """The selection rule on the validation split (see the module doc); returns the choice and the numbers."""
    final = {r["run"]: validation[r["run"]]["points"][-1] for r in runs}
    baseline = final["awd_0"]["target"]
    rows = []
    for run in runs:
        if run["run"] == "awd_0" or run["run"].startswith("pop_"):
            continue
        values = final[run["run"]]
        rows.append({"run": run["run"], "awd_lambda": run["awd_lambda"], "target": values["target"],
                     "prior_mean": values["prior_mean"], **{t: values[t] for t in args.prior_tasks},
                     "eligible": values["target"] >= baseline - args.target_tolerance - 1e-12})
    eligible = sorted((r for r in rows if r["eligible"]), key=lambda r: (-r["prior_mean"], -r["target"]))
    rest = sorted((r for r in rows if not r["eligible"]), key=lambda r: (-r["target"], -r["prior_mean"]))
    chosen = [r["run"] for r in (eligible + rest)[: args.num_chosen]]
    for r in rows:
        r["chosen"] = r["run"] in chosen
    return {"rule": f"eligible: final validation target accuracy >= awd_0's ({baseline:.3f}) - "
                    f"{args.target_tolerance:g}; chosen: the {args.num_chosen} eligible with the highest mean "
                    "prior-task validation accuracy (ties: target accuracy; too few eligible: the rest by target "
                    "accuracy)",
            "baseline": {"run": "awd_0", "target": baseline, "prior_mean": final["awd_0"]["prior_mean"],
                         **{t: final["awd_0"][t] for t in args.prior_tasks}},
            "candidates": rows, "chosen": chosen}


def _fmt(value, digits=3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def report_rows(args: AWDArguments, runs: list[dict], test: dict[str, dict]) -> list[dict]:
    base = test["base"]["points"][0]
    rows = [{"run": "base", "awd_lambda": None, "population_size": None, "iterations": 0, "training_minutes": 0.0,
             "completions_generated": 0, **{k: base[k] for k in ("target", "prior_mean", *args.prior_tasks)},
             "off_task_kl": base.get("off_task_kl"), "drift_l2": base.get("drift_l2"), "replay_exact": None}]
    for run in runs:
        last = test[run["run"]]["points"][-1]
        rows.append({"run": run["run"], "awd_lambda": run["awd_lambda"], "population_size": run["population_size"],
                     "iterations": run["iterations"], "training_minutes": run["training_minutes"],
                     "completions_generated": run["completions_generated"],
                     **{k: last[k] for k in ("target", "prior_mean", *args.prior_tasks)},
                     "off_task_kl": last.get("off_task_kl"), "drift_l2": last.get("drift_l2"),
                     "replay_exact": test[run["run"]]["replay_exact"]})
    for row in rows:
        row["prior_mean_change"] = row["prior_mean"] - rows[0]["prior_mean"]
    return rows


def markdown(args: AWDArguments, selection: dict, rows: list[dict]) -> str:
    priors = args.prior_tasks
    lines = ["## Selection (validation split, final iteration)", "", selection["rule"] + ".", "",
             "| run | lambda | target | " + " | ".join(priors) + " | prior mean | eligible | chosen |",
             "|" + "---|" * (6 + len(priors)),
             f"| awd_0 | 0 | {_fmt(selection['baseline']['target'])} | "
             + " | ".join(_fmt(selection["baseline"][p]) for p in priors)
             + f" | {_fmt(selection['baseline']['prior_mean'])} | baseline | |"]
    for r in selection["candidates"]:
        lines.append(f"| {r['run']} | {r['awd_lambda']:g} | {_fmt(r['target'])} | "
                     + " | ".join(_fmt(r[p]) for p in priors)
                     + f" | {_fmt(r['prior_mean'])} | {'yes' if r['eligible'] else 'no'} | "
                     f"{'**yes**' if r['chosen'] else ''} |")
    lines += ["", f"## Report (test split, after {args.max_steps} iterations)", "",
              f"Target: {args.num_test_prompts} addition prompts; prior tasks: {args.num_prior_prompts} prompts each; "
              "greedy accuracy. Cost: completions generated in training, and training minutes.", "",
              "| run | lambda | population | completions | training min | target | " + " | ".join(priors)
              + " | prior mean | prior change | off-task KL | drift L2 |",
              "|" + "---|" * (10 + len(priors))]
    for r in rows:
        lam = "" if r["awd_lambda"] is None else f"{r['awd_lambda']:g}"
        pop = "" if r["population_size"] is None else str(r["population_size"])
        lines.append(f"| {r['run']} | {lam} | {pop} | {r['completions_generated']} | "
                     f"{_fmt(r['training_minutes'], 1)} | "
                     f"{_fmt(r['target'])} | " + " | ".join(_fmt(r[p]) for p in priors)
                     + f" | {_fmt(r['prior_mean'])} | {r['prior_mean_change']:+.3f} | {_fmt(r['off_task_kl'], 4)} | "
                     f"{_fmt(r['drift_l2'], 2)} |")
    return "\n".join(lines) + "\n"


def plot(args: AWDArguments, shown: list[str], test: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = test["base"]["points"][0]
    panels = [("target", "target accuracy (test)"), ("prior_mean", "mean prior-task accuracy (test)"),
              ("off_task_kl", "off-task KL to base"), ("drift_l2", "drift ||theta - theta_0||")]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for ax, (key, title) in zip(axes, panels):
        for name in shown:
            points = [base] + test[name]["points"]
            ax.plot([p["iteration"] for p in points], [p.get(key) for p in points], "o-", lw=2, label=name)
        ax.set_title(title)
        ax.set_xlabel("ES iteration")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> AWDArguments:
    return parse_arguments(AWDArguments, argv)


def main(argv: list[str] | None = None) -> dict:
    """Train every run, select on validation, report on test; returns the content of results.json."""
    args = parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            spec = json.load(f)
        return train_run(spec) if spec["kind"] == "train" else track(spec)
    os.makedirs(args.output_dir, exist_ok=True)
    runs = train_all(args)
    lambda_runs = [r for r in runs if not r["run"].startswith("pop_")]
    validation = track_all(args, lambda_runs, "validation")
    selection = select(args, lambda_runs, validation)
    shown = ["awd_0", *selection["chosen"], *[r["run"] for r in runs if r["run"].startswith("pop_")]]
    reported = [r for r in runs if r["run"] in shown]
    test = track_all(args, reported, "test")
    rows = report_rows(args, reported, test)
    output = {"arguments": dataclasses.asdict(args), "es_config": es_config_kwargs(args), "runs": runs,
              "selection": selection, "validation": validation, "report": rows, "test": test}
    write_results(args.output_dir, output, markdown(args, selection, rows),
                  lambda: plot(args, shown, test, os.path.join(args.output_dir, "awd_retention.png")))
    return output


if __name__ == "__main__":
    main()
