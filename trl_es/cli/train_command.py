"""``trl-es train``: ES on a task, with its model, seed log, ``results.json``, run file and training curves."""

from __future__ import annotations

import os
import shlex

from trl import ModelConfig, get_peft_config

from ..arguments import TrlESParser
from ..files import write_json
from ..rewards import reward_func_names
from ..trainer.es.es_config import ESConfig
from ..trainer.time_budget import TrainingClock
from .arguments import TASK_NAMES, TaskArguments
from .loading import load_model_and_tokenizer
from .plotting import plot_training_curves
from .run_file import RUN_FILE, run_settings
from .splits import task_splits


SCRIPT_FLAGS = ("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming",
                "reward_funcs", "reward_model_name_or_path")
"""Flags of ``examples/scripts/es.py`` (TRL's ``ScriptArguments`` and the reward functions) that ``trl-es train``,
which trains on a built-in task, does not take."""


def _script_flags(unused: list[str]) -> list[str]:
    """The :data:`SCRIPT_FLAGS` among the parser's unused strings, each with the values that follow it."""
    given, taking = [], False
    for arg in unused:  # a flag and the values up to the next flag
        if arg.startswith("--"):
            taking = arg[2:].split("=")[0] in SCRIPT_FLAGS
        if taking:
            given.append(arg)
    return given


def parse_train_arguments(argv: list[str]):
    """``trl-es train``'s arguments: ``(TaskArguments, ESConfig, ModelConfig)`` from flags and ``--config`` YAML.

    Raises:
        ValueError: for an unknown flag or YAML key; for a dataset or reward flag of the TRL-style script
            (:data:`SCRIPT_FLAGS`: ``--dataset_name``, ``--reward_funcs``, ...), one that names them and gives the
            ``python examples/scripts/es.py`` command that takes them.
    """
    # flags override the --config YAML
    parser = TrlESParser((TaskArguments, ESConfig, ModelConfig), prog="trl-es train")
    *parsed, from_config, from_flags = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True)
    in_config, in_flags = _script_flags(from_config), _script_flags(from_flags)
    if in_config or in_flags:
        names = sorted({arg[2:].split("=")[0] for arg in in_config + in_flags if arg.startswith("--")})
        config = ["--config", argv[argv.index("--config") + 1]] if in_config else []  # es.py reads the YAML too
        command = shlex.join(["python", "examples/scripts/es.py", *config, *in_flags])
        raise ValueError(
            f"trl-es train trains on a built-in task (--task {' | '.join(TASK_NAMES)}) and takes no "
            f"{', '.join('--' + n for n in names)}: a dataset with reward functions is trained by the TRL-style "
            f"script (TRL's grpo.py with ESTrainer), e.g. {command} "
            "--output_dir <dir> (with the same ESConfig and ModelConfig flags)."
        )
    if from_config:
        raise ValueError(f"Unknown arguments from config file: {from_config}.")
    if from_flags:
        raise ValueError(f"Some specified arguments are not used by the HfArgumentParser: {from_flags}")
    return tuple(parsed)


def _accuracy_name(task) -> str:
    # The task's answer reward is its last reward function (countdown: [format, answer]); the trainers log it under
    # its distinct name (trl_es.rewards.reward_func_names).
    return reward_func_names(task.reward_funcs)[-1]


def train(argv: list[str]) -> dict:
    """``trl-es train``: ES on a task; model, seed log, ``results.json``, ``trl_es_run.json`` and a plot in output_dir.

    Returns:
        `dict`: ``results.json``: ``accuracy_before``/``accuracy_after`` on the eval split, ``test_accuracy_*`` (test
        split, with ``eval_split=validation``), ``iterations``, ``max_steps``, ``stopped_by_time_budget``, the curve.

    Raises:
        ValueError: On bad arguments (naming the flag), or an empty eval split.
    """
    from transformers.utils import logging as hf_logging

    from ..trainer.es.es_trainer import ESTrainer

    task_args, es_args, model_args = parse_train_arguments(argv)
    hf_logging.set_verbosity_warning()  # transformers' info logs would drown the progress
    task, splits = task_splits(task_args)
    split = task_args.eval_split
    eval_dataset, test_dataset = splits[split], splits["test"]
    if len(eval_dataset) == 0:
        count = "num_validation_prompts" if split == "validation" else "num_eval_prompts"
        raise ValueError(f"eval_split={split!r} is empty: set --{count} >= 1 (or choose the other --eval_split).")
    model, tokenizer = load_model_and_tokenizer(model_args, trust_remote_code=es_args.trust_remote_code)
    if es_args.reward_weights is None:
        es_args.reward_weights = task.reward_weights  # the task's weights unless the config sets them
    # stops training at the budget and evaluates once more
    clock = TrainingClock(60.0 * task_args.time_budget_minutes, evaluate_at_stop=True) \
        if task_args.time_budget_minutes else None
    trainer = ESTrainer(
        model, task.reward_funcs, args=es_args, train_dataset=splits["train"], eval_dataset=eval_dataset,
        processing_class=tokenizer, peft_config=get_peft_config(model_args),
        callbacks=[clock] if clock is not None else None,
    )
    if trainer.accelerator.is_main_process:
        stale = os.path.join(es_args.output_dir, "results.json")
        if os.path.isfile(stale):  # an earlier run's: it marks a finished run, which this one is not (yet)
            os.remove(stale)
        write_json(os.path.join(es_args.output_dir, RUN_FILE), run_settings(task_args, es_args))
    name = _accuracy_name(task)
    key, test_key = f"eval_rewards/{name}/mean", f"eval_test_rewards/{name}/mean"
    # tuning reads validation; the test split is scored only before and after
    score_test = split == "validation" and len(test_dataset) > 0 and task_args.score_test_split
    results = {"task": task.name, "eval_split": split, "num_train_prompts": len(splits["train"]),
               "num_validation_prompts": len(splits["validation"]), "num_test_prompts": len(test_dataset)}
    if task_args.eval_before_training:
        results["accuracy_before"] = trainer.evaluate()[key]
        trainer.accelerator.print(f"{split} accuracy before training: {results['accuracy_before']:.3f}")
        if score_test:
            results["test_accuracy_before"] = trainer.evaluate(test_dataset, metric_key_prefix="eval_test")[test_key]
            trainer.accelerator.print(f"test accuracy before training: {results['test_accuracy_before']:.3f}")
    trainer.train(resume_from_checkpoint=es_args.resume_from_checkpoint)
    last = [h for h in trainer.state.log_history if key in h and h.get("step") == trainer.state.global_step]
    # the final evaluation, when training logged one
    results["accuracy_after"] = last[-1][key] if last else trainer.evaluate()[key]
    results["iterations"] = trainer.state.global_step
    results["max_steps"] = trainer.state.max_steps
    cut = clock.describe_stop() if clock is not None else None
    results["stopped_by_time_budget"] = cut is not None  # True: a cut run, not comparable with a whole one
    if cut is not None:
        results["time_budget_minutes"] = task_args.time_budget_minutes
        trainer.accelerator.print(f"WARNING: {cut}; the figures below are those of a cut run.")
    # the eval split's accuracy at each evaluation
    results["curve"] = [{"step": h["step"], "accuracy": h[key]} for h in trainer.state.log_history
                        if key in h and "step" in h]
    results["train_seconds"] = next((h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h),
                                    None)
    trainer.accelerator.print(f"{split} accuracy after training: {results['accuracy_after']:.3f}")
    if score_test:
        results["test_accuracy_after"] = trainer.evaluate(test_dataset, metric_key_prefix="eval_test")[test_key]
        trainer.accelerator.print(f"test accuracy after training: {results['test_accuracy_after']:.3f}")
    trainer.save_model(es_args.output_dir)  # every process (ZeRO-3 gathers); checked where it is written
    if trainer.accelerator.is_main_process:
        if task_args.plot:
            plot_training_curves(
                trainer.state.log_history, key, os.path.join(es_args.output_dir, "training_curves.png"),
                results.get("accuracy_before"), label=f"{split} accuracy (greedy)",
            )
        write_json(os.path.join(es_args.output_dir, "results.json"), results)  # last: marks a finished run
    return results
