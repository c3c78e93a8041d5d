"""Sequential GRPO -> ES and ES -> GRPO against GRPO only, ES only and the base model, at one training budget.

The ES-vs-GRPO dynamics paper combines GRPO's strength at Pass@1 with ES's gains at Pass@K by running one after the
other on an equal split of the update budget; which order is better depends on the task. This script runs the five
arms on the arithmetic task ("What is a + b? Reply with only the number.", a, b in 1..50) from one model:

    base       no training
    grpo       TRL's GRPOTrainer for the whole budget
    es         ESTrainer for the whole budget
    grpo_es    GRPO for half the budget, then ES for the other half, starting from GRPO's exact weights
    es_grpo    ES, then GRPO

Every arm gets the same wall-clock budget of *training* (``--budget_minutes``; model loading, saving and evaluation
are not counted; a phase stops at the first step end past its budget). Each phase runs in a fresh process tree
launched as :mod:`trl_es.launch` plans it: ES on one single-threaded process per core (population parallelism, its
fastest set-up on a CPU), GRPO on one process with every core's threads (its fastest, docs/es_vs_grpo.md). A phase
saves its model (fp32 safetensors) and the next phase loads it, so it starts from the exact weights: every phase
records a SHA-256 fingerprint of the weights at its first and last step, and the table's JSON keeps them. With
``--in_process`` every phase runs in this process instead (tests, or one GPU).

ES: the ESConfig keys of ``--es_recipe`` (default ``examples/recipes/arithmetic_smollm2.yaml``, the main job's),
then ``--es_overrides key=value``; its step schedule is replaced by a schedule laid out over each ES phase's budget
in wall-clock time (constant, then a cosine decay to 0 over its last ``--decay_fraction``), or a constant one
(``--es_schedule constant``). GRPO: the settings of examples/studies/compare_es_grpo.py (learning rate 1e-5,
constant; 8 generations x 2 prompts per step; temperature 1; beta 0; completion length = the ES recipe's
``max_completion_length``).

Evaluation, on the **test** split of ``make_arithmetic_dataset_dict(num_train, num_validation, num_test,
seed=task_seed)``, by :func:`trl_es.analysis.evaluate_policy`: greedy Pass@1; Pass@K for K in ``--pass_k`` from
``--num_samples`` completions per prompt sampled at ``--sample_temperature`` (the unbiased estimator of Chen et al.
2021); JS_succ over the prompts' success rates; the mean token entropy of the sampled completions; the off-task KL
to the base model on Countdown prompts (as ``trl-es analyze`` measures it); the parameter drift from the base.
Arms are evaluated ``--eval_workers`` at a time, each in its own process.

Writes to ``--output_dir``: ``results.md`` (the table), ``results.json`` (table, arguments, every phase's record),
``pass_at_k.png`` (Pass@K curves of all arms), and per arm and phase ``<arm>/<phase>/model`` and ``result.json``.

    python examples/studies/sequential_recipes.py --config examples/recipes/sequential_arithmetic_cpu.yaml
    python examples/studies/sequential_recipes.py --config examples/recipes/sequential_arithmetic_gpu.yaml
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from transformers import TrainerCallback

from trl_es.analysis.protocol import PAPER_PROTOCOL
from trl_es.analysis import weights_fingerprint as fingerprint
from trl_es.cli import es_config_kwargs, load_recipe
from trl_es.files import is_main_process, write_json

from _study.arms import JobArguments, Jobs, parse_arguments, write_results

ARMS = {
    "base": (),
    "grpo": (("grpo", 1.0),),
    "es": (("es", 1.0),),
    "grpo_es": (("grpo", 0.5), ("es", 0.5)),
    "es_grpo": (("es", 0.5), ("grpo", 0.5)),
}
ARM_LABELS = {"base": "base model", "grpo": "GRPO only", "es": "ES only", "grpo_es": "GRPO -> ES",
              "es_grpo": "ES -> GRPO"}
SCHEDULES = ("time", "constant")
NO_LIMIT_STEPS = 1_000_000  # max_steps when the budget alone stops a phase
DEFAULT_RECIPE = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "arithmetic_smollm2.yaml"))


@dataclass
class SequentialArguments(JobArguments):
    """Arguments of the sequential-recipes comparison (every field is also a key of the YAML recipe)."""

    output_dir: str = field(default="runs/sequential", metadata={"help": "Where models, tables and the plot go."})
    model_name_or_path: str = field(default="embedded:SmolLM2-135M-Instruct",
                                    metadata={"help": "The base model of every arm (hub id, path or embedded alias)."})
    arms: list[str] = field(default_factory=lambda: list(ARMS),
                            metadata={"help": "Arms to run, in order.", "choices": list(ARMS)})
    budget_minutes: float = field(default=8.0, metadata={
        "help": "Training wall-clock budget of every arm, in minutes; each phase of a two-phase arm gets half."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the arithmetic splits."})
    num_train_prompts: int = field(default=400, metadata={"help": "Training prompts."})
    num_validation_prompts: int = field(default=200, metadata={"help": "Validation prompts (unused here; they fix "
                                                                       "which problems train holds)."})
    num_test_prompts: int = field(default=200, metadata={"help": "Test prompts: every figure of the table."})
    seed: int = field(default=0, metadata={"help": "Training seed of every phase and the evaluation's sampling seed."})
    # ES
    es_recipe: str = field(default=DEFAULT_RECIPE, metadata={"help": "YAML recipe whose ESConfig keys configure ES."})
    es_overrides: list[str] = field(default_factory=list,
                                    metadata={"help": "ESConfig overrides as key=value (values parsed as YAML)."})
    es_num_processes: int | None = field(default=None, metadata={"help": "ES processes (default: trl_es.launch's)."})
    es_schedule: str = field(default="time", metadata={
        "help": "time: constant, then a cosine decay to 0 over the last decay_fraction of each ES phase's budget; "
        "constant.", "choices": list(SCHEDULES)})
    decay_fraction: float = field(default=0.35, metadata={"help": "Time schedule: the decaying last part."})
    # GRPO (compare_es_grpo.py's settings)
    grpo_num_processes: int = field(default=1, metadata={"help": "GRPO processes (1: one process, all threads)."})
    grpo_learning_rate: float = field(default=1e-5, metadata={"help": "GRPO learning rate (constant)."})
    grpo_num_generations: int = field(default=8, metadata={"help": "GRPO completions per prompt."})
    grpo_prompts_per_step: int = field(default=2, metadata={"help": "GRPO prompts per optimizer step."})
    grpo_temperature: float = field(default=1.0, metadata={"help": "GRPO sampling temperature."})
    grpo_beta: float = field(default=0.0, metadata={"help": "GRPO KL coefficient."})
    grpo_max_completion_length: int | None = field(default=None, metadata={
        "help": "GRPO completion tokens (default: the ES recipe's max_completion_length)."})
    # evaluation
    num_samples: int = field(default=16, metadata={"help": "Sampled completions per test prompt (Pass@K)."})
    pass_k: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16], metadata={"help": "The K of Pass@K."})
    sample_temperature: float = field(default=PAPER_PROTOCOL.temperature, metadata={
        "help": "Sampling temperature of the Pass@K samples (default: the papers' protocol, 0.6)."})
    sample_top_p: float = field(default=PAPER_PROTOCOL.top_p, metadata={
        "help": "Nucleus top-p of the Pass@K samples (default: the papers' protocol, 0.95)."})
    eval_max_new_tokens: int | None = field(default=None, metadata={
        "help": "New tokens per evaluated completion (default: the ES recipe's max_completion_length)."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per greedy generate call."})
    sample_batch_size: int | None = field(default=None, metadata={
        "help": "Prompts per sampling generate call; None: trl_es.analysis.auto_sample_batch_size (about 128 rows a "
                "call, one prompt a call from 64 samples on). 1: each prompt computed once for its samples."})
    num_kl_prompts: int = field(default=32, metadata={"help": "Off-task (Countdown) prompts for the KL."})
    kl_max_new_tokens: int = field(default=16, metadata={"help": "New tokens per off-task KL sample."})

    def __post_init__(self):
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise ValueError(f"arms must be a non-empty list from {list(ARMS)}, got {self.arms}.")
        if not self.budget_minutes > 0:
            raise ValueError(f"budget_minutes must be > 0, got {self.budget_minutes}.")
        if self.es_schedule not in SCHEDULES:
            raise ValueError(f"es_schedule must be one of {SCHEDULES}, got {self.es_schedule!r}.")
        if self.num_test_prompts < 1:
            raise ValueError(f"num_test_prompts must be >= 1, got {self.num_test_prompts}.")
        if self.num_samples < 1 or any(not 1 <= k <= self.num_samples for k in self.pass_k):
            raise ValueError(f"pass_k values must be in [1, num_samples={self.num_samples}], got {self.pass_k}.")


# ---------------------------------------------------------------------------------------------- shared pieces
def completion_length(args: SequentialArguments) -> int:
    """Tokens per completion: ``eval_max_new_tokens``, else the ES recipe's ``max_completion_length``."""
    if args.eval_max_new_tokens:
        return args.eval_max_new_tokens
    return int(es_config_kwargs(load_recipe(args.es_recipe), args.es_overrides).get("max_completion_length", 10))


def task_reward_funcs() -> list:
    """The task's reward functions: :func:`trl_es.tasks.arithmetic.arithmetic_reward` (training and evaluation)."""
    from trl_es.tasks.arithmetic import arithmetic_reward

    return [arithmetic_reward]


def splits_of(args: SequentialArguments):
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict

    return make_arithmetic_dataset_dict(args.num_train_prompts, args.num_validation_prompts, args.num_test_prompts,
                                        seed=args.task_seed)


class FingerprintAtStart(TrainerCallback):
    """The weights' :func:`fingerprint` at train begin (after the trainer was built, before the first step)."""

    value: str | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.value = fingerprint(model)


# ---------------------------------------------------------------------------------------------- one phase
def build_es_trainer(model, tokenizer, train, args: SequentialArguments, output_dir: str, callbacks):
    from trl_es import ESConfig, ESTrainer

    kwargs = es_config_kwargs(load_recipe(args.es_recipe), args.es_overrides)
    kwargs.update(output_dir=output_dir, max_steps=NO_LIMIT_STEPS, lr_scheduler_type="constant", eval_strategy="no",
                  save_strategy="no", report_to="none", seed=args.seed)
    kwargs.pop("lr_scheduler_kwargs", None)
    kwargs.setdefault("reward_weights", [1.0])
    return ESTrainer(model, task_reward_funcs(), args=ESConfig(**kwargs), train_dataset=train,
                     processing_class=tokenizer, callbacks=callbacks)


def build_grpo_trainer(model, tokenizer, train, args: SequentialArguments, output_dir: str, callbacks):
    from trl import GRPOConfig, GRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    completions = args.grpo_prompts_per_step * args.grpo_num_generations
    if completions % world:
        raise ValueError(f"GRPO's {completions} completions per step must split evenly over {world} processes.")
    config = GRPOConfig(
        output_dir=output_dir,
        learning_rate=args.grpo_learning_rate,
        lr_scheduler_type="constant",
        num_generations=args.grpo_num_generations,
        per_device_train_batch_size=completions // world,
        gradient_accumulation_steps=1,
        temperature=args.grpo_temperature,
        beta=args.grpo_beta,
        max_completion_length=args.grpo_max_completion_length or completion_length(args),
        max_steps=NO_LIMIT_STEPS,
        bf16=False,
        activation_checkpointing=False,  # speed only: a 135M model needs no activation memory savings
        eval_strategy="no",
        save_strategy="no",
        dataloader_pin_memory=False,
        logging_steps=1,
        report_to="none",
        seed=args.seed,
    )
    return GRPOTrainer(model=model, reward_funcs=task_reward_funcs(), args=config, train_dataset=train,
                       processing_class=tokenizer, callbacks=callbacks)


def train_phase(spec: dict) -> dict:
    """One phase (in every process of its launch): load ``spec["model"]``, train ``spec["method"]`` for
    ``spec["budget_seconds"]`` of training time, save to ``spec["output_dir"]/model``; process 0 writes the result."""
    from trl_es.models import load_model_and_tokenizer
    from trl_es.files import save_trainer_model
    from trl_es.trainer.time_budget import TimeScheduleCallback, TrainingClock, show_progress_in_minutes

    args = SequentialArguments(**spec["args"])
    model, tokenizer = load_model_and_tokenizer(spec["model"])  # fp32
    train = splits_of(args)["train"]
    clock, start = TrainingClock(spec["budget_seconds"]), FingerprintAtStart()
    callbacks = [clock, start]
    if spec["method"] == "es":
        trainer = build_es_trainer(model, tokenizer, train, args, spec["output_dir"], callbacks)
        if args.es_schedule == "time":
            trainer.add_callback(TimeScheduleCallback(clock, trainer.args.learning_rate, spec["budget_seconds"],
                                                      args.decay_fraction))
    else:
        trainer = build_grpo_trainer(model, tokenizer, train, args, spec["output_dir"], callbacks)
    show_progress_in_minutes(trainer, spec["budget_seconds"], clock.elapsed_seconds)  # the budget ends the phase
    trainer.train()
    model_dir = os.path.join(spec["output_dir"], "model")
    save_trainer_model(trainer, model_dir)  # every process (ZeRO-3 gathers); checked where it was written
    trained = trainer.accelerator.unwrap_model(trainer.model)
    result = {"spec": spec, "method": spec["method"], "steps": trainer.state.global_step,
              "training_minutes": clock.training_seconds / 60.0, "model_dir": model_dir,
              "initial_fingerprint": start.value, "final_fingerprint": fingerprint(trained)}
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(model_dir)
        write_json(spec["result"], result)
    return result


# ---------------------------------------------------------------------------------------------- evaluation
def off_task_prompts(count: int) -> list:
    """Countdown prompts for the off-task KL, the ones ``trl-es analyze`` uses for arithmetic runs."""
    from trl_es.tasks import get_task

    return [row["prompt"] for row in get_task("countdown").build_dataset(count, seed=1)] if count else []


def evaluate_arm(spec: dict) -> dict:
    """Evaluate one arm's final model on the test split (in one process) and write ``spec["result"]``."""
    import torch

    from trl_es.analysis import evaluate_policy
    from trl_es.models import load_model_and_tokenizer

    args = SequentialArguments(**spec["args"])
    base, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    is_base = spec["model"] == args.model_name_or_path
    model = base if is_base else load_model_and_tokenizer(spec["model"])[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    base.to(device)
    test = splits_of(args)["test"]
    report = evaluate_policy(
        model, tokenizer, [test[i] for i in range(len(test))], task_reward_funcs(), completion_length(args),
        num_samples=args.num_samples, pass_k=args.pass_k, temperature=args.sample_temperature,
        top_p=args.sample_top_p,
        base_model=None if is_base else base, off_task_prompts=off_task_prompts(args.num_kl_prompts),
        kl_max_new_tokens=args.kl_max_new_tokens, batch_size=args.eval_batch_size,
        sample_batch_size=args.sample_batch_size, seed=args.seed,
    )
    if is_base:  # the base model against itself: zero by definition (not measured)
        report.update(drift_l2=0.0, drift_relative=0.0, off_task_kl=0.0 if args.num_kl_prompts else None)
    result = {"spec": spec, "arm": spec["arm"], **report}
    if is_main_process():
        write_json(spec["result"], result)
    return result


# ---------------------------------------------------------------------------------------------- orchestration
JOBS = Jobs(__file__, "sequential", not_in_result=("arms",))  # adding arms runs only the new ones


def run_arm(args: SequentialArguments, arm: str) -> dict:
    """Train one arm phase after phase; each phase starts from the previous phase's saved model."""
    model_path, phases = args.model_name_or_path, []
    for index, (method, fraction) in enumerate(ARMS[arm]):
        folder = os.path.join(args.output_dir, arm, f"phase{index + 1}_{method}")
        os.makedirs(folder, exist_ok=True)
        spec = {"kind": "train", "arm": arm, "method": method, "model": model_path, "output_dir": folder,
                "budget_seconds": 60.0 * args.budget_minutes * fraction, "args": dataclasses.asdict(args),
                "result": os.path.join(folder, "result.json")}
        processes = args.es_num_processes if method == "es" else args.grpo_num_processes
        result = JOBS.run(args, spec, train_phase, processes, f"{arm}: phase {index + 1} {method} for "
                          f"{spec['budget_seconds'] / 60:.2f} min from {model_path}")
        phases.append(result)
        model_path = result["model_dir"]
    return {"arm": arm, "model": model_path, "phases": phases}


def evaluate_arms(args: SequentialArguments, trained: list[dict]) -> list[dict]:
    specs = []
    for item in trained:
        folder = os.path.join(args.output_dir, item["arm"])
        os.makedirs(folder, exist_ok=True)
        specs.append({"kind": "evaluate", "arm": item["arm"], "model": item["model"], "args": dataclasses.asdict(args),
                      "result": os.path.join(folder, "evaluation.json")})
    return JOBS.run_all(args, specs, evaluate_arm, "evaluating {} arm(s) on the test split")


TABLE_COLUMNS = ("greedy Pass@1", "Pass@K", "JS_succ", "token entropy", "off-task KL", "drift L2", "drift rel.")


def table_rows(args: SequentialArguments, trained: list[dict], evaluations: list[dict]) -> list[dict]:
    rows = []
    for item, ev in zip(trained, evaluations):
        row = {"arm": item["arm"], "label": ARM_LABELS[item["arm"]],
               "phases": [f"{p['method']} {p['training_minutes']:.2f} min, {p['steps']} steps" for p in item["phases"]],
               "training_minutes": sum(p["training_minutes"] for p in item["phases"]),
               "steps": [p["steps"] for p in item["phases"]],
               "handover_exact": all(a["final_fingerprint"] == b["initial_fingerprint"]
                                     for a, b in zip(item["phases"], item["phases"][1:])),
               "accuracy_greedy": ev["accuracy_greedy"],
               **{f"pass@{k}": ev[f"pass@{k}"] for k in sorted(set(args.pass_k))},
               **{key: ev.get(key) for key in ("js_succ", "token_entropy", "off_task_kl", "drift_l2",
                                               "drift_relative")}}
        rows.append(row)
    return rows


def _fmt(value, digits=3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown_table(args: SequentialArguments, rows: list[dict]) -> str:
    ks = sorted(set(args.pass_k))
    header = (["arm", "phases (training time, steps)", "greedy Pass@1"] + [f"Pass@{k}" for k in ks]
              + ["JS_succ (nats)", "token entropy (nats)", "off-task KL", "drift L2", "drift rel."])
    lines = [
        f"Test split: {args.num_test_prompts} prompts (task seed {args.task_seed}); Pass@K from {args.num_samples} "
        f"samples per prompt at temperature {args.sample_temperature:g}, top-p {args.sample_top_p:g}; training budget "
        f"{args.budget_minutes:g} min per arm.", "",
        "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
    ]
    for r in rows:
        cells = [r["label"], "; ".join(r["phases"]) or "none", _fmt(r["accuracy_greedy"])]
        cells += [_fmt(r[f"pass@{k}"]) for k in ks]
        cells += [_fmt(r["js_succ"], 4), _fmt(r["token_entropy"]), _fmt(r["off_task_kl"], 4), _fmt(r["drift_l2"], 2),
                  _fmt(r["drift_relative"], 5)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_pass_at_k(args: SequentialArguments, rows: list[dict], path: str) -> None:
    from trl_es.analysis import plot_pass_at_k_curves

    ks = sorted(set(args.pass_k))
    plot_pass_at_k_curves({r["label"]: [r[f"pass@{k}"] for k in ks] for r in rows}, ks, path,
                          temperature=args.sample_temperature,
                          title=f"Pass@K at a {args.budget_minutes:g}-minute training budget per arm")


def parse_args(argv: list[str] | None = None) -> SequentialArguments:
    return parse_arguments(SequentialArguments, argv)


def main(argv: list[str] | None = None) -> dict:
    """Run every arm, evaluate them, write the table, the JSON and the plot; returns the content of results.json."""
    args = parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            spec = json.load(f)
        return train_phase(spec) if spec["kind"] == "train" else evaluate_arm(spec)
    os.makedirs(args.output_dir, exist_ok=True)
    trained = [run_arm(args, arm) for arm in args.arms]
    evaluations = evaluate_arms(args, trained)
    rows = table_rows(args, trained, evaluations)
    output = {"arguments": dataclasses.asdict(args), "table": rows, "arms": trained, "evaluations": evaluations}
    write_results(args.output_dir, output, markdown_table(args, rows),
                  lambda: plot_pass_at_k(args, rows, os.path.join(args.output_dir, "pass_at_k.png")))
    return output


if __name__ == "__main__":
    main()
