"""Parallel averaging of RL and SFT updates (RL Excursions, arXiv 2606.04272) against RL only, SFT only and SFT -> RL.

Arms, each from the same base model on the arithmetic task ("What is a + b? Reply with only the number.", a, b in
1..50), at an equal number of weight updates ``--max_steps`` (N):

    base     no training
    rl       TRL's GRPOTrainer, N steps
    sft      TRL's SFTTrainer on the correct worked answers ("47 + 35 = 82"), N steps
    sft_rl   SFTTrainer for round(sft_fraction * N) steps, then GRPOTrainer for the rest (the standard pipeline)
    rl_sft   ParallelAveragingTrainer: every step theta_bar + w_RL Delta_RL + w_SFT Delta_SFT, N steps
    es       ESTrainer, --es_max_steps iterations (optional arm)
    es_sft   ESParallelAveragingTrainer: ES + SFT parallel averaging, --es_max_steps iterations (optional arm)

RL is GRPO with the settings of examples/studies/compare_es_grpo.py (learning rate 1e-5, 8 generations x 2 prompts
per step, temperature 1, beta 0, ``--max_completion_length`` tokens); SFT uses the same optimizer (AdamW) with its own
state, ``--sft_learning_rate``, ``--sft_batch_size`` examples per step; the SFT data are the training prompts with
their correct answers in the model's own format (:func:`trl_es.tasks.arithmetic.make_arithmetic_sft_dataset`). Every
arm trains in this process, one after the other (ParallelAveragingTrainer runs in one process).

Evaluation on the **test** split (:func:`trl_es.analysis.evaluate_policy`): greedy Pass@1, Pass@K from
``--num_samples`` samples per prompt at temperature 1, and, as the general-ability proxy, the off-task KL to the base
model on Countdown prompts (and the parameter drift); with ``--lm_loss_texts``, also the LM loss on held-out general
text (the paper's measure). Arms are evaluated ``--eval_workers`` at a time. ``--task_low / --task_high / --task_ops
/ --conversational`` choose the arithmetic task (plain-text prompts for a base model, e.g. a pre-training
checkpoint of examples/studies/pretraining_excursions.py).

Writes to ``--output_dir``: ``results.md``, ``results.json``, ``pass_at_k.png``, and per arm ``<arm>/model`` and
``result.json``.

    python examples/studies/parallel_averaging.py --config examples/recipes/parallel_averaging_arithmetic_cpu.yaml
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

from trl_es.analysis.protocol import PAPER_PROTOCOL
from trl_es.files import is_main_process, require_files, write_json

from _study.arms import JobArguments, Jobs, parse_arguments, write_results

ARMS = ("base", "rl", "sft", "sft_rl", "rl_sft", "es", "es_sft")
ARM_LABELS = {"base": "base model", "rl": "RL only (GRPO)", "sft": "SFT only", "sft_rl": "SFT -> RL",
              "rl_sft": "RL + SFT parallel averaging", "es": "ES only", "es_sft": "ES + SFT parallel averaging"}
DEFAULT_RECIPE = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "arithmetic_smollm2.yaml"))


@dataclass
class ParallelRecipeArguments(JobArguments):
    """Arguments of the parallel-averaging demonstration (every field is also a key of the YAML recipe)."""

    output_dir: str = field(default="runs/parallel_averaging", metadata={"help": "Where models and tables go."})
    model_name_or_path: str = field(default="embedded:SmolLM2-135M-Instruct",
                                    metadata={"help": "The base model (hub id, path or the embedded alias)."})
    arms: list[str] = field(default_factory=lambda: ["base", "rl", "sft", "sft_rl", "rl_sft"],
                            metadata={"help": "Arms to run, in order.", "choices": list(ARMS)})
    max_steps: int = field(default=32, metadata={"help": "N: weight updates of every gradient arm."})
    sft_fraction: float = field(default=0.5, metadata={"help": "sft_rl: the share of the N steps spent on SFT."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the arithmetic splits."})
    task_low: int = field(default=1, metadata={"help": "Smallest operand of the arithmetic task."})
    task_high: int = field(default=50, metadata={"help": "Largest operand of the arithmetic task."})
    task_ops: list[str] = field(default_factory=lambda: ["+"], metadata={"help": "Operators of the arithmetic task."})
    conversational: bool = field(default=True, metadata={
        "help": "Chat-formatted prompts (an instruct model); False: plain-text prompts (a base model)."})
    num_train_prompts: int = field(default=400, metadata={"help": "Training prompts (RL prompts and SFT examples)."})
    num_validation_prompts: int = field(default=200, metadata={"help": "Validation prompts (unused here)."})
    num_test_prompts: int = field(default=200, metadata={"help": "Test prompts: every figure of the table."})
    seed: int = field(default=0, metadata={"help": "Training seed of every arm and the evaluation's sampling seed."})
    max_completion_length: int = field(default=10, metadata={"help": "Completion tokens (training and evaluation)."})
    # RL (GRPO)
    learning_rate: float = field(default=1e-5, metadata={"help": "GRPO learning rate (constant)."})
    num_generations: int = field(default=8, metadata={"help": "GRPO completions per prompt."})
    prompts_per_step: int = field(default=2, metadata={"help": "GRPO prompts per step."})
    temperature: float = field(default=1.0, metadata={"help": "GRPO sampling temperature."})
    beta: float = field(default=0.0, metadata={"help": "GRPO KL coefficient."})
    # SFT and averaging
    sft_learning_rate: float = field(default=1e-5, metadata={"help": "SFT learning rate (constant)."})
    sft_batch_size: int = field(default=8, metadata={"help": "SFT examples per step."})
    rl_weight: float = field(default=0.5, metadata={"help": "w_RL (and w_ES for es_sft)."})
    sft_weight: float = field(default=0.5, metadata={"help": "w_SFT."})
    # ES (optional arms)
    es_recipe: str = field(default=DEFAULT_RECIPE, metadata={"help": "YAML recipe whose ESConfig keys configure ES."})
    es_overrides: list[str] = field(default_factory=list,
                                    metadata={"help": "ESConfig overrides as key=value (values parsed as YAML)."})
    es_max_steps: int = field(default=10, metadata={"help": "ES iterations of the es and es_sft arms."})
    # evaluation
    num_samples: int = field(default=8, metadata={"help": "Sampled completions per test prompt (Pass@K)."})
    pass_k: list[int] = field(default_factory=lambda: [1, 2, 4, 8], metadata={"help": "The K of Pass@K."})
    sample_temperature: float = field(default=PAPER_PROTOCOL.temperature, metadata={
        "help": "Sampling temperature of the Pass@K samples (default: the papers' protocol, 0.6)."})
    sample_top_p: float = field(default=PAPER_PROTOCOL.top_p, metadata={
        "help": "Nucleus top-p of the Pass@K samples (default: the papers' protocol, 0.95)."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per greedy generate call."})
    sample_batch_size: int | None = field(default=None, metadata={
        "help": "Prompts per sampling generate call; None: trl_es.analysis.auto_sample_batch_size (about 128 rows a "
                "call, one prompt a call from 64 samples on)."})
    num_kl_prompts: int = field(default=32, metadata={"help": "Off-task (Countdown) prompts for the KL."})
    lm_loss_texts: str | None = field(default=None, metadata={
        "help": "JSON file with a list of held-out general texts: each arm's mean token NLL on them is reported as "
                "lm_loss (the general-ability measure of arXiv 2606.04272; trl_es.analysis.lm_loss_fn)."})
    kl_max_new_tokens: int = field(default=16, metadata={"help": "New tokens per off-task KL sample."})

    def __post_init__(self):
        if not self.arms or any(a not in ARMS for a in self.arms):
            raise ValueError(f"arms must be a non-empty list from {list(ARMS)}, got {self.arms}.")
        if self.max_steps < 1 or self.es_max_steps < 1:
            raise ValueError(f"max_steps and es_max_steps must be >= 1, got {self.max_steps}, {self.es_max_steps}.")
        if not 0 < self.sft_fraction < 1:
            raise ValueError(f"sft_fraction must be in (0, 1), got {self.sft_fraction}.")
        if self.num_samples < 1 or any(not 1 <= k <= self.num_samples for k in self.pass_k):
            raise ValueError(f"pass_k values must be in [1, num_samples={self.num_samples}], got {self.pass_k}.")


def task_reward_funcs() -> list:
    """The task's reward functions: :func:`trl_es.tasks.arithmetic.arithmetic_reward`."""
    from trl_es.tasks.arithmetic import arithmetic_reward

    return [arithmetic_reward]


def datasets_of(args: ParallelRecipeArguments):
    """(RL training rows, SFT rows for the same prompts, test rows)."""
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict, make_arithmetic_sft_dataset

    splits = make_arithmetic_dataset_dict(args.num_train_prompts, args.num_validation_prompts, args.num_test_prompts,
                                          seed=args.task_seed, low=args.task_low, high=args.task_high,
                                          ops=args.task_ops, conversational=args.conversational)
    return splits["train"], make_arithmetic_sft_dataset(splits["train"]), splits["test"]


def _common(args: ParallelRecipeArguments, output_dir: str, max_steps: int) -> dict:
    return dict(output_dir=output_dir, max_steps=max_steps, lr_scheduler_type="constant", bf16=False,
                activation_checkpointing=False, eval_strategy="no", save_strategy="no", logging_steps=1,
                report_to="none", seed=args.seed, dataloader_pin_memory=False, disable_tqdm=True)


def grpo_kwargs(args: ParallelRecipeArguments, output_dir: str, max_steps: int) -> dict:
    """compare_es_grpo.py's GRPO settings: one step = prompts_per_step x num_generations completions."""
    return dict(_common(args, output_dir, max_steps), learning_rate=args.learning_rate,
                num_generations=args.num_generations,
                per_device_train_batch_size=args.prompts_per_step * args.num_generations,
                gradient_accumulation_steps=1, temperature=args.temperature, beta=args.beta,
                max_completion_length=args.max_completion_length)


def sft_kwargs(args: ParallelRecipeArguments, output_dir: str, max_steps: int) -> dict:
    return dict(_common(args, output_dir, max_steps), learning_rate=args.sft_learning_rate,
                per_device_train_batch_size=args.sft_batch_size)


def es_kwargs(args: ParallelRecipeArguments, output_dir: str) -> dict:
    from trl_es.cli import es_config_kwargs, load_recipe

    kwargs = es_config_kwargs(load_recipe(args.es_recipe), args.es_overrides)
    kwargs.update(output_dir=output_dir, max_steps=args.es_max_steps, eval_strategy="no", save_strategy="no",
                  report_to="none", seed=args.seed, logging_steps=1, disable_tqdm=True)
    kwargs.setdefault("reward_weights", [1.0])
    return kwargs


def train_arm(args: ParallelRecipeArguments, arm: str, folder: str) -> dict:
    """Train one arm from a fresh copy of the base model and save it to ``folder/model``."""
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    from trl_es import (
        ESConfig,
        ESParallelAveragingConfig,
        ESParallelAveragingTrainer,
        ESTrainer,
        ParallelAveragingConfig,
        ParallelAveragingTrainer,
    )
    from trl_es.models import load_model_and_tokenizer
    from trl_es.files import SAVED_MODEL_FILES

    model, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    rl, sft, _ = datasets_of(args)
    funcs = task_reward_funcs()
    stages, start = [], time.monotonic()

    def run(trainer, name):
        trainer.train()
        stages.append({"stage": name, "steps": trainer.state.global_step})
        return trainer

    if arm == "rl":
        run(GRPOTrainer(model, funcs, args=GRPOConfig(**grpo_kwargs(args, folder, args.max_steps)), train_dataset=rl,
                        processing_class=tokenizer), "grpo")
    elif arm == "sft":
        run(SFTTrainer(model, args=SFTConfig(**sft_kwargs(args, folder, args.max_steps)), train_dataset=sft,
                       processing_class=tokenizer), "sft")
    elif arm == "sft_rl":
        sft_steps = max(1, round(args.sft_fraction * args.max_steps))
        run(SFTTrainer(model, args=SFTConfig(**sft_kwargs(args, folder, sft_steps)), train_dataset=sft,
                       processing_class=tokenizer), "sft")
        run(GRPOTrainer(model, funcs, args=GRPOConfig(**grpo_kwargs(args, folder, args.max_steps - sft_steps)),
                        train_dataset=rl, processing_class=tokenizer), "grpo")  # from SFT's weights, in memory
    elif arm == "rl_sft":
        config = ParallelAveragingConfig(**grpo_kwargs(args, folder, args.max_steps), rl_weight=args.rl_weight,
                                         sft_weight=args.sft_weight, sft_learning_rate=args.sft_learning_rate,
                                         sft_per_device_train_batch_size=args.sft_batch_size)
        run(ParallelAveragingTrainer(model, funcs, args=config, train_dataset=rl, sft_dataset=sft,
                                     processing_class=tokenizer), "grpo+sft")
    elif arm == "es":
        run(ESTrainer(model, funcs, args=ESConfig(**es_kwargs(args, folder)), train_dataset=rl,
                      processing_class=tokenizer), "es")
    elif arm == "es_sft":
        config = ESParallelAveragingConfig(**es_kwargs(args, folder), es_weight=args.rl_weight,
                                           sft_weight=args.sft_weight, sft_learning_rate=args.sft_learning_rate,
                                           sft_per_device_train_batch_size=args.sft_batch_size)
        run(ESParallelAveragingTrainer(model, funcs, args=config, train_dataset=rl, sft_dataset=sft,
                                       processing_class=tokenizer), "es+sft")
    model_dir = os.path.join(folder, "model")
    if is_main_process():  # save_pretrained writes no weights on a torch.distributed rank != 0: checked below
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        require_files(model_dir, SAVED_MODEL_FILES, f"the model of arm {arm!r}")
    return {"stages": stages, "training_minutes": (time.monotonic() - start) / 60.0, "model_dir": model_dir}


def evaluate_arm(spec: dict) -> dict:
    """Evaluate one arm's model on the test split (in one process) and write ``spec["result"]``."""
    import torch

    from trl_es.analysis import evaluate_policy
    from trl_es.models import load_model_and_tokenizer
    from trl_es.tasks import get_task

    args = ParallelRecipeArguments(**spec["args"])
    base, tokenizer = load_model_and_tokenizer(args.model_name_or_path)
    is_base = spec["arm"] == "base"
    model = base if is_base else load_model_and_tokenizer(spec["model"])[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    base.to(device)
    _, _, test = datasets_of(args)
    prompts = [r["prompt"] for r in get_task("countdown").build_dataset(args.num_kl_prompts, seed=1)] \
        if args.num_kl_prompts else []
    report = evaluate_policy(
        model, tokenizer, [test[i] for i in range(len(test))], task_reward_funcs(), args.max_completion_length,
        num_samples=args.num_samples, pass_k=args.pass_k, temperature=args.sample_temperature,
        top_p=args.sample_top_p,
        base_model=None if is_base else base, off_task_prompts=prompts, kl_max_new_tokens=args.kl_max_new_tokens,
        batch_size=args.eval_batch_size, sample_batch_size=args.sample_batch_size, seed=args.seed,
    )
    if is_base:  # the base model against itself: zero by definition (not measured)
        report.update(drift_l2=0.0, drift_relative=0.0, off_task_kl=0.0 if prompts else None)
    report["lm_loss"] = None
    if args.lm_loss_texts:
        from trl_es.analysis import lm_loss_fn

        with open(args.lm_loss_texts) as f:
            texts = json.load(f)
        with torch.no_grad():
            report["lm_loss"] = float(lm_loss_fn(tokenizer, texts, batch_size=args.eval_batch_size)(model.eval()))
    result = {"spec": spec, "arm": spec["arm"], **report}
    if is_main_process():
        write_json(spec["result"], result)
    return result


JOBS = Jobs(__file__, "parallel_averaging", not_in_result=("arms",))  # adding arms runs only the new ones


def _fmt(value, digits=3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown_table(args: ParallelRecipeArguments, rows: list[dict]) -> str:
    ks = sorted(set(args.pass_k))
    header = (["arm", "updates", "training min", "greedy Pass@1"] + [f"Pass@{k}" for k in ks]
              + ["off-task KL", "drift L2", "JS_succ", "token entropy"] + (["LM loss"] if args.lm_loss_texts else []))
    lines = [f"Test split: {args.num_test_prompts} prompts (task seed {args.task_seed}); Pass@K from "
             f"{args.num_samples} samples per prompt at temperature {args.sample_temperature:g}, top-p "
             f"{args.sample_top_p:g}; N = {args.max_steps} "
             f"updates per gradient arm, {args.es_max_steps} iterations per ES arm.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [ARM_LABELS[r["arm"]], r["updates"], _fmt(r["training_minutes"], 1), _fmt(r["accuracy_greedy"])]
        cells += [_fmt(r[f"pass@{k}"]) for k in ks]
        cells += [_fmt(r.get("off_task_kl"), 4), _fmt(r.get("drift_l2"), 2), _fmt(r["js_succ"], 4),
                  _fmt(r["token_entropy"])]
        cells += [_fmt(r.get("lm_loss"))] if args.lm_loss_texts else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_pass_at_k(args: ParallelRecipeArguments, rows: list[dict], path: str) -> None:
    from trl_es.analysis import plot_pass_at_k_curves

    ks = sorted(set(args.pass_k))
    plot_pass_at_k_curves({ARM_LABELS[r["arm"]]: [r[f"pass@{k}"] for k in ks] for r in rows}, ks, path,
                          temperature=args.sample_temperature)


def parse_args(argv: list[str] | None = None) -> ParallelRecipeArguments:
    return parse_arguments(ParallelRecipeArguments, argv)


def main(argv: list[str] | None = None) -> dict:
    """Train every arm (in this process), evaluate them, write the table, the JSON and the plot."""
    args = parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            return evaluate_arm(json.load(f))
    os.makedirs(args.output_dir, exist_ok=True)
    trained = {}
    for arm in args.arms:
        folder = os.path.join(args.output_dir, arm)
        os.makedirs(folder, exist_ok=True)
        spec = {"kind": "train", "arm": arm, "args": dataclasses.asdict(args),
                "result": os.path.join(folder, "result.json")}
        result = JOBS.reusable(spec, args.reuse)
        if result is None:
            print(f"[parallel_averaging] training {arm}", flush=True)
            record = train_arm(args, arm, folder) if arm != "base" else \
                {"stages": [], "training_minutes": 0.0, "model_dir": args.model_name_or_path}
            result = {"spec": spec, **record}
            if is_main_process():
                write_json(spec["result"], result)
        trained[arm] = result
    specs = [{"kind": "evaluate", "arm": arm, "model": trained[arm]["model_dir"], "args": dataclasses.asdict(args),
              "result": os.path.join(args.output_dir, arm, "evaluation.json")} for arm in args.arms]
    evaluations = JOBS.run_all(args, specs, evaluate_arm, "evaluating {} arm(s) on the test split")
    rows = []
    for arm, ev in zip(args.arms, evaluations):
        stages = trained[arm]["stages"]
        rows.append({"arm": arm, "label": ARM_LABELS[arm],
                     "updates": " + ".join(f"{s['steps']} {s['stage']}" for s in stages) or "0",
                     "training_minutes": trained[arm]["training_minutes"],
                     **{k: v for k, v in ev.items() if k not in ("spec", "arm", "correct_per_prompt")}})
    output = {"arguments": dataclasses.asdict(args), "table": rows, "evaluations": evaluations}
    write_results(args.output_dir, output, markdown_table(args, rows),
                  lambda: plot_pass_at_k(args, rows, os.path.join(args.output_dir, "pass_at_k.png")))
    return output


if __name__ == "__main__":
    main()
