"""The ``trl-es`` console script: ``train``, ``eval`` and ``analyze``, built on TRL's ``TrlParser``.

Every ``ESConfig`` field and TRL's ``ModelConfig`` fields work on the command line or in a YAML file
(``--config recipe.yaml``; command-line values override the file); dict-valued fields take JSON on the command line
(``--generation_kwargs '{"repetition_penalty": 1.1}'``)::

    trl-es train --task arithmetic --output_dir runs/es --population_size 16 --max_steps 20
    trl-es train --config examples/recipes/arithmetic_smollm2.yaml
    trl-es eval --model_name_or_path runs/es --pass_k 1 4 --num_samples 8
    trl-es analyze --base_model embedded:SmolLM2-135M-Instruct --model_a runs/es --output_dir runs/analysis

Every task has three disjoint splits: train (fitness), validation (what ``trl-es train`` evaluates during training by
default, for tuning) and test (what reports read: ``trl-es eval`` by default, and ``test_accuracy_*`` in
``results.json``). ``trl-es train`` writes ``trl_es_run.json`` (task and generation settings) next to the model, and
``trl-es eval`` grades with those settings unless told otherwise.

All three run under ``accelerate launch`` as well (``accelerate launch -m trl_es.cli train ...``).
The model defaults to the embedded SmolLM2-135M-Instruct (``embedded:SmolLM2-135M-Instruct``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field

from transformers import TrainerCallback
from trl import ModelConfig, get_peft_config

from .arguments import TrlESParser, check_finite_floats, decode_dict_fields
from .files import save_figure, write_json
from .trainer.es_config import ESConfig
from .trainer.reward_names import reward_func_names

COMMANDS = ("train", "eval", "analyze")
TASK_NAMES = ("countdown", "arithmetic", "gsm")
#: Splits of every task, see :func:`task_splits`.
SPLITS = ("train", "validation", "test")
#: Splits an evaluation may read.
EVAL_SPLITS = ("validation", "test")
#: Written by ``trl-es train`` to ``output_dir``; read by ``trl-es eval``.
RUN_FILE = "trl_es_run.json"
#: The task arguments recorded in :data:`RUN_FILE` (and read back by ``trl-es eval``).
RUN_TASK_KEYS = ("task", "task_seed", "num_train_prompts", "num_validation_prompts", "num_eval_prompts",
                 "eval_split", "countdown_json")
#: The ``ESConfig`` generation settings recorded in :data:`RUN_FILE`.
RUN_GENERATION_KEYS = ("max_completion_length", "temperature", "top_p", "generation_kwargs", "chat_template_kwargs")
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass
class TaskArguments:
    """Which task, and the sizes of its three disjoint splits (train, validation, test)."""

    task: str = field(
        default="arithmetic",
        metadata={"help": "Task: countdown | arithmetic | gsm.", "choices": list(TASK_NAMES)},
    )
    num_train_prompts: int = field(default=200, metadata={"help": "Training prompts (fitness is computed on these)."})
    num_validation_prompts: int = field(
        default=200,
        metadata={"help": "Validation prompts, disjoint from train and test: what the trainer's evaluations during "
                  "`trl-es train` read by default (eval_split), i.e. what tuning looks at. 0 = no validation split."},
    )
    num_eval_prompts: int = field(
        default=200,
        metadata={"help": "Test prompts, disjoint from train and validation: what reports read (`trl-es eval` by "
                  "default, test_accuracy_* in results.json). For arithmetic the test split depends only on "
                  "task_seed and this number."},
    )
    task_seed: int = field(default=0, metadata={"help": "Seed of the task generator (and of the splits)."})
    eval_split: str = field(
        default="validation",
        metadata={"help": "The split the trainer's evaluations during `trl-es train` read (accuracy_before/after, "
                  "the curve): 'validation' (default; tune on it) or 'test' (report from it; then no separate "
                  "test_accuracy_*). Tuning reads validation, reports read test.",
                  "choices": list(EVAL_SPLITS)},
    )
    countdown_json: str | None = field(
        default=None,
        metadata={"help": "Countdown only: a JSON file in the ES paper's format; its first 200 items train, the "
                  "last 2000 are held out: test = the first num_eval_prompts of them, validation = the next "
                  "num_validation_prompts."},
    )
    eval_before_training: bool = field(
        default=True, metadata={"help": "Score the eval split (and the test split) before training."}
    )
    score_test_split: bool = field(
        default=True,
        metadata={"help": "With eval_split=validation, also score the test split before and after training "
                  "(test_accuracy_* in results.json). Set false while tuning, so no test figure is even computed."},
    )
    plot: bool = field(default=True, metadata={"help": "Write training_curves.png (reward and eval-split accuracy)."})
    time_budget_minutes: float | None = field(
        default=None,
        metadata={"help": "Stop training after the iteration that crosses this wall-clock budget (max_steps still "
                  "caps the run)."},
    )

    def __post_init__(self):
        check_finite_floats(self)
        if self.task not in TASK_NAMES:
            raise ValueError(f"task must be one of {TASK_NAMES}, got {self.task!r}.")
        if self.eval_split not in EVAL_SPLITS:
            raise ValueError(f"eval_split must be one of {EVAL_SPLITS}, got {self.eval_split!r}.")
        for name in ("num_train_prompts", "num_validation_prompts", "num_eval_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")


@dataclass
class EvalArguments:
    """``trl-es eval``: greedy accuracy, sampled pass@1 (and pass@k), per-reward-function means on one split.

    Settings left unset (``None``) come from, in this order: a ``--config`` recipe (``trl-es eval`` accepts a
    training recipe: its ``ESConfig`` keys ``max_completion_length``, ``temperature``, ``top_p``,
    ``generation_kwargs``, ``chat_template_kwargs`` map to the settings below, other ``ESConfig`` keys are ignored),
    then the model folder's ``trl_es_run.json`` (written by ``trl-es train``), then the defaults stated in each help.
    Flags given on the command line always win. The task arguments (task, task_seed, num_*_prompts,
    countdown_json) are resolved the same way.
    """

    split: str = field(
        default="test",
        metadata={"help": "Split to score: 'test' (default: reports read test) or 'validation'.",
                  "choices": list(EVAL_SPLITS)},
    )
    pass_k: list[int] = field(
        default_factory=lambda: [1], metadata={"help": "k values of pass@k (each <= the number of samples)."}
    )
    num_samples: int = field(
        default=0,
        metadata={"help": "Sampled completions per prompt for pass@k. 0 (default) = one sample: pass@1 only."},
    )
    sample_temperature: float | None = field(
        default=None,
        metadata={"help": "Temperature of the sampled completions. None: the run's/recipe's temperature when it is "
                  "> 0, else 1.0."},
    )
    max_new_tokens: int | None = field(
        default=None,
        metadata={"help": "Maximum new tokens per completion. None: the run's/recipe's max_completion_length, else "
                  f"{DEFAULT_MAX_NEW_TOKENS}."},
    )
    top_p: float | None = field(
        default=None, metadata={"help": "Nucleus sampling of the sampled completions. None: run/recipe, else 1.0."}
    )
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra GenerationConfig arguments (JSON), for greedy and sampled completions. None: "
                  "run/recipe, else none."},
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra apply_chat_template arguments (JSON). None: run/recipe, else none."},
    )
    batch_size: int = field(default=32, metadata={"help": "Prompts per generate call."})
    output_file: str | None = field(default=None, metadata={"help": "Also write the metrics as JSON here."})

    def __post_init__(self):
        decode_dict_fields(self)
        check_finite_floats(self)
        if self.split not in EVAL_SPLITS:
            raise ValueError(f"split must be one of {EVAL_SPLITS}, got {self.split!r}.")
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0 (0 = one sample), got {self.num_samples}.")
        if not self.pass_k or any(k < 1 for k in self.pass_k):
            raise ValueError(f"pass_k values must be >= 1, got {self.pass_k}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}.")


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
    """The train, validation and test datasets of a task, disjoint by prompt.

    - arithmetic: :func:`trl_es.tasks.arithmetic.make_arithmetic_dataset_dict` (one seeded permutation of the
      problem grid: test first, then validation, then train, so the test split does not change with the other
      sizes);
    - countdown with ``countdown_json``: train = the paper's first 200 items; test = the first ``num_eval_prompts``
      of its last 2000, validation = the next ``num_validation_prompts``;
    - other tasks: ``2 x`` the needed rows are generated with ``task_seed``; the first distinct prompts go to test,
      the next to validation, the next to train.

    Args:
        task_args (`TaskArguments`): Task name, split sizes (``num_train_prompts``, ``num_validation_prompts``,
            ``num_eval_prompts`` for test) and ``task_seed``.
        conversational (`bool`, defaults to `True`): Prompts as chat messages (else plain strings).

    Returns:
        (`tuple[Task, datasets.DatasetDict]`): The task (reward functions and weights) and its splits under the
            keys ``"train"``, ``"validation"``, ``"test"``.

    Raises:
        ValueError: If the sizes exceed what the task can provide, or the task is unknown.
    """
    from datasets import Dataset, DatasetDict

    from .tasks import get_task

    task = get_task(task_args.task)
    n_train, n_validation, n_test = (
        task_args.num_train_prompts, task_args.num_validation_prompts, task_args.num_eval_prompts
    )
    if task_args.task == "countdown" and task_args.countdown_json:
        from .tasks.countdown import load_countdown_json

        train = load_countdown_json(task_args.countdown_json, split="train")
        held_out = load_countdown_json(task_args.countdown_json, split="test")
        if n_test + n_validation > len(held_out):
            raise ValueError(
                f"num_eval_prompts + num_validation_prompts = {n_test} + {n_validation} exceeds the {len(held_out)} "
                f"held-out items of {task_args.countdown_json}."
            )
        return task, DatasetDict({
            "train": train,
            "validation": held_out.select(list(range(n_test, n_test + n_validation))),
            "test": held_out.select(list(range(n_test))),
        })
    if task_args.task == "arithmetic":
        from .tasks.arithmetic import make_arithmetic_dataset_dict

        splits = make_arithmetic_dataset_dict(
            n_train, n_validation, n_test, seed=task_args.task_seed, conversational=conversational
        )
        return task, splits
    # Other tasks: draw test rows first, then validation, then train rows, each prompt at most once.
    total = n_train + n_validation + n_test
    if total == 0:
        raise ValueError("num_train_prompts, num_validation_prompts and num_eval_prompts are all 0.")
    rows = task.build_dataset(2 * total, seed=task_args.task_seed, conversational=conversational)
    wanted = {"test": n_test, "validation": n_validation, "train": n_train}
    drawn: dict[str, list] = {name: [] for name in wanted}
    seen = set()
    for row in rows:
        key = json.dumps(row["prompt"], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        name = next((n for n in ("test", "validation", "train") if len(drawn[n]) < wanted[n]), None)
        if name is None:
            break
        drawn[name].append(row)
    if any(len(drawn[n]) < wanted[n] for n in wanted):
        raise ValueError(
            f"Could not draw {n_train} + {n_validation} + {n_test} distinct prompts for task {task_args.task!r}."
        )
    empty = rows.select([])  # keeps the columns
    return task, DatasetDict({n: Dataset.from_list(drawn[n]) if drawn[n] else empty for n in SPLITS})


def _accuracy_name(task) -> str:
    # The task's answer reward is its last reward function (countdown: [format, answer]); the trainers log it under
    # its distinct name (trl_es.trainer.reward_names.reward_func_names).
    return reward_func_names(task.reward_funcs)[-1]


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


def run_settings(task_args: TaskArguments, es_args) -> dict:
    """What :data:`RUN_FILE` records about a training run: the task arguments and the generation settings.

    Args:
        task_args (`TaskArguments`): The run's task arguments.
        es_args (`ESConfig`): The run's config (any object with the :data:`RUN_GENERATION_KEYS` attributes).

    Returns:
        `dict`: ``{key: value}`` for :data:`RUN_TASK_KEYS` and :data:`RUN_GENERATION_KEYS` (JSON-serialisable).
    """
    settings = {key: getattr(task_args, key) for key in RUN_TASK_KEYS}
    settings.update({key: getattr(es_args, key) for key in RUN_GENERATION_KEYS})
    return json.loads(json.dumps(settings, default=str))


def read_run_settings(model_name_or_path: str | None) -> dict:
    """The :data:`RUN_FILE` of a trained model: in its folder, or in the parent folder of a ``checkpoint-*`` folder.

    Args:
        model_name_or_path (`str`, *optional*): A model folder, id or ``embedded:`` name.

    Returns:
        `dict`: The recorded settings; empty when there is no such file (a hub id, a base model).

    Raises:
        ValueError: If the file exists but does not hold a JSON object.
    """
    from .models import resolve_model_path

    if not model_name_or_path:
        return {}
    path = resolve_model_path(model_name_or_path)
    if not os.path.isdir(path):
        return {}
    candidates = [os.path.join(path, RUN_FILE)]
    if os.path.basename(os.path.normpath(path)).startswith("checkpoint-"):
        candidates.append(os.path.join(os.path.dirname(os.path.normpath(path)), RUN_FILE))
    for candidate in candidates:
        if os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as f:
                settings = json.load(f)
            if not isinstance(settings, dict):
                raise ValueError(f"{candidate} must hold a JSON object of run settings.")
            return settings
    return {}


def plot_training_curves(log_history: list[dict], accuracy_key: str, path: str, accuracy_before=None,
                         label: str = "validation accuracy (greedy)") -> None:
    """PNG of the population reward per iteration and the eval-split accuracy at each evaluation (and, if given, the
    accuracy before training at iteration 0).

    Args:
        log_history (`list[dict]`): ``trainer.state.log_history``.
        accuracy_key (`str`): The logged accuracy key, e.g. ``"eval_rewards/arithmetic_reward/mean"``.
        path (`str`): Where the PNG goes.
        accuracy_before (`float`, *optional*): Accuracy at iteration 0.
        label (`str`): Legend of the accuracy curve.
    """
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
        ax.plot([h["step"] for h in evals], [h[accuracy_key] for h in evals], "o-", label=label)
    ax.set_xlabel("ES iteration")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
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
    """``trl-es train``: ES on a task; model, seed log, ``results.json``, ``trl_es_run.json`` and a plot in output_dir.

    ``results.json`` holds ``accuracy_before``/``accuracy_after`` on the eval split (``--eval_split``, default
    validation: what the trainer's evaluations read) and, when that is validation, ``test_accuracy_before``/
    ``test_accuracy_after``: the test split scored once before and once after training, for reporting.

    Args:
        argv (`list[str]`): Command-line arguments after ``train``.

    Returns:
        `dict`: The contents of ``results.json``.

    Raises:
        ValueError: On bad arguments (naming the flag), or an empty eval split.
    """
    from transformers.utils import logging as hf_logging

    from .trainer.es_trainer import ESTrainer

    parser = TrlESParser((TaskArguments, ESConfig, ModelConfig), prog="trl-es train")
    task_args, es_args, model_args = parser.parse_args_and_config(argv)
    hf_logging.set_verbosity_warning()
    task, splits = task_splits(task_args)
    split = task_args.eval_split
    eval_dataset, test_dataset = splits[split], splits["test"]
    if len(eval_dataset) == 0:
        count = "num_validation_prompts" if split == "validation" else "num_eval_prompts"
        raise ValueError(f"eval_split={split!r} is empty: set --{count} >= 1 (or choose the other --eval_split).")
    model, tokenizer = _load(model_args)
    if es_args.reward_weights is None:
        es_args.reward_weights = task.reward_weights
    trainer = ESTrainer(
        model, task.reward_funcs, args=es_args, train_dataset=splits["train"], eval_dataset=eval_dataset,
        processing_class=tokenizer, peft_config=get_peft_config(model_args),
        callbacks=[TimeBudgetCallback(task_args.time_budget_minutes)] if task_args.time_budget_minutes else None,
    )
    if trainer.accelerator.is_main_process:
        write_json(os.path.join(es_args.output_dir, RUN_FILE), run_settings(task_args, es_args))
    name = _accuracy_name(task)
    key, test_key = f"eval_rewards/{name}/mean", f"eval_test_rewards/{name}/mean"
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
    results["accuracy_after"] = last[-1][key] if last else trainer.evaluate()[key]
    results["iterations"] = trainer.state.global_step
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


def _split_config(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--config PATH`` (as TRL's ``TrlParser`` reads it), and ``PATH``."""
    argv = list(argv)
    if "--config" not in argv:
        return argv, None
    index = argv.index("--config")
    if index + 1 >= len(argv):
        raise ValueError("--config needs a path to a YAML recipe.")
    path = argv[index + 1]
    del argv[index : index + 2]
    return argv, path


def _given_flags(dataclass_types, argv: list[str]) -> set[str]:
    """The destinations of the flags written in ``argv`` (whatever their value)."""
    probe = TrlESParser(dataclass_types)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    namespace, _ = probe.parse_known_args(argv)
    return set(vars(namespace))


#: EvalArguments setting -> the ESConfig key (in a recipe or trl_es_run.json) it is read from.
_EVAL_SETTING_SOURCES = {
    "max_new_tokens": "max_completion_length",
    "sample_temperature": "temperature",
    "top_p": "top_p",
    "generation_kwargs": "generation_kwargs",
    "chat_template_kwargs": "chat_template_kwargs",
}
_EVAL_DEFAULTS = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "sample_temperature": 1.0, "top_p": 1.0}
_TASK_SETTINGS = ("task", "task_seed", "num_train_prompts", "num_validation_prompts", "num_eval_prompts",
                  "countdown_json")


def parse_eval_arguments(argv: list[str]):
    """Parse ``trl-es eval`` arguments and resolve every setting: flag, then recipe, then run file, then default.

    A ``--config`` recipe may be a training recipe: its ``trl-es eval`` keys are used as such, its ``ESConfig``
    generation keys map to the eval settings (``max_completion_length`` -> ``max_new_tokens``, ``temperature`` ->
    ``sample_temperature`` when ``> 0``, ``top_p``, ``generation_kwargs``, ``chat_template_kwargs``), its other
    ``ESConfig`` keys are ignored. The run file is ``trl_es_run.json`` of ``--model_name_or_path``
    (:func:`read_run_settings`).

    Args:
        argv (`list[str]`): Command-line arguments after ``eval``.

    Returns:
        (`tuple[TaskArguments, EvalArguments, ModelConfig, dict]`): The resolved arguments and, per resolved
            setting, ``{"value": ..., "source": "flag" | "recipe" | "run" | "default"}``.

    Raises:
        ValueError: On bad flags (naming them), or recipe keys that are neither eval arguments nor ESConfig fields.
    """
    import yaml

    dataclass_types = (TaskArguments, EvalArguments, ModelConfig)
    parser = TrlESParser(dataclass_types, prog="trl-es eval")
    argv, config_path = _split_config(argv)
    recipe = {}
    if config_path is not None:
        with open(config_path, encoding="utf-8") as f:
            recipe = yaml.safe_load(f) or {}
        if not isinstance(recipe, dict):
            raise ValueError(f"Config file {config_path} must contain a YAML mapping.")
        for key, value in (recipe.pop("env", None) or {}).items():  # as TrlParser
            os.environ[key] = str(value)
    known = {action.dest for action in parser._actions}
    es_fields = {f.name for f in dataclasses.fields(ESConfig)}
    unknown = sorted(k for k in recipe if k not in known and k not in es_fields)
    if unknown:
        raise ValueError(
            f"--config {config_path}: {unknown} are neither trl-es eval arguments nor ESConfig fields."
        )
    parser.set_defaults_with_config(**{k: v for k, v in recipe.items() if k in known})
    given = _given_flags(dataclass_types, argv)
    task_args, eval_args, model_args = parser.parse_args_into_dataclasses(argv)
    run = read_run_settings(model_args.model_name_or_path)

    settings = {}
    for name in _TASK_SETTINGS:  # the parsed value already holds a flag's or the recipe's value
        if name in given:
            source = "flag"
        elif name in recipe:
            source = "recipe"
        elif name in run:
            source = "run"
            setattr(task_args, name, run[name])
        else:
            source = "default"
        settings[name] = {"value": getattr(task_args, name), "source": source}
    for name, es_key in _EVAL_SETTING_SOURCES.items():
        value = getattr(eval_args, name)
        source = "flag" if name in given else "recipe" if name in recipe else None
        for origin, values in (("recipe", recipe), ("run", run)):  # the ESConfig key, e.g. max_completion_length
            candidate = values.get(es_key)
            if source is not None or candidate is None:
                continue
            if name == "sample_temperature" and not candidate > 0:
                continue  # trained with greedy decoding: sample at the default temperature
            value, source = candidate, origin
        if source is None:
            value, source = _EVAL_DEFAULTS.get(name), "default"
        setattr(eval_args, name, value)
        settings[name] = {"value": value, "source": source}
    TaskArguments.__post_init__(task_args)
    EvalArguments.__post_init__(eval_args)  # checks (and JSON-decodes) the resolved values
    return task_args, eval_args, model_args, settings


def evaluate(argv: list[str]) -> dict:
    """``trl-es eval``: greedy accuracy, sampled pass@1 and pass@k (Chen et al. 2021), per-reward-function means.

    Grades exactly as training did unless told otherwise: the task, split sizes and generation settings come from
    the model's ``trl_es_run.json`` (see :func:`parse_eval_arguments` for the order of precedence). One split
    (``--split``, default test) is scored with greedy decoding (``accuracy_greedy``) and with ``num_samples`` (at
    least 1) sampled completions per prompt at ``sample_temperature`` (``pass@1``, and ``pass@k`` for each
    ``--pass_k``). A completion is correct when the task's answer reward (its last reward function) is above 0.5.
    Every reward function's mean is reported under its distinct name (``greedy_rewards/<name>/mean``,
    ``sampled_rewards/<name>/mean``).

    Args:
        argv (`list[str]`): Command-line arguments after ``eval``.

    Returns:
        `dict`: The metrics (also printed, and written to ``--output_file`` if given), with ``settings``: each
            resolved setting's value and where it came from.

    Raises:
        ValueError: On bad arguments, ``pass_k`` above the number of samples, or an empty split.
    """
    import torch
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from .analysis import mean_pass_at_k
    from .trainer.scoring import RewardScorer, build_generation_config, score_model

    task_args, eval_args, model_args, settings = parse_eval_arguments(argv)
    num_samples = eval_args.num_samples or 1
    if max(eval_args.pass_k) > num_samples:
        raise ValueError(
            f"pass_k values must be <= num_samples ({eval_args.num_samples}; 0 means one sample), got "
            f"{eval_args.pass_k}; raise --num_samples."
        )
    task, splits = task_splits(task_args)
    dataset = splits[eval_args.split]
    if len(dataset) == 0:
        raise ValueError(f"The {eval_args.split} split is empty; set its size (num_*_prompts) >= 1.")
    state = PartialState()
    model, tokenizer = _load(model_args)
    model.to(state.device)
    scorer = RewardScorer(task.reward_funcs)
    answer = len(scorer.names) - 1  # the answer reward: > 0.5 = correct
    rows = [dataset[i] for i in range(len(dataset))]
    common = {"top_p": eval_args.top_p, "generation_kwargs": eval_args.generation_kwargs}
    greedy = build_generation_config(tokenizer, eval_args.max_new_tokens, 0.0, **common)
    sampled = build_generation_config(tokenizer, eval_args.max_new_tokens, eval_args.sample_temperature, **common)
    local = []  # per prompt: greedy rewards per function, sampled rewards per function (n rows), correct samples
    with state.split_between_processes(list(range(len(rows)))) as mine:
        torch.manual_seed(task_args.task_seed + state.process_index)
        for first in range(0, len(mine), eval_args.batch_size):
            batch = [rows[i] for i in mine[first : first + eval_args.batch_size]]
            out_greedy = score_model(model, tokenizer, batch, scorer, greedy, 1, eval_args.chat_template_kwargs)
            out_sampled = score_model(
                model, tokenizer, batch, scorer, sampled, num_samples, eval_args.chat_template_kwargs
            )
            per_func = out_sampled["rewards_per_func"].view(len(batch), num_samples, -1)
            for j in range(len(batch)):
                local.append((out_greedy["rewards_per_func"][j].tolist(), per_func[j].tolist(),
                               int((per_func[j, :, answer] > 0.5).sum())))
    results = gather_object(local)
    metrics = {
        "task": task.name, "split": eval_args.split, "num_prompts": len(results), "num_samples": num_samples,
        "sample_temperature": eval_args.sample_temperature, "max_new_tokens": eval_args.max_new_tokens,
        "accuracy_greedy": sum(g[answer] > 0.5 for g, _, _ in results) / len(results),
    }
    for k in sorted({1, *eval_args.pass_k}):
        metrics[f"pass@{k}"] = mean_pass_at_k(num_samples, [c for _, _, c in results], k)
    for f, name in enumerate(scorer.names):
        greedy_values = [g[f] for g, _, _ in results if g[f] == g[f]]  # NaN (None rewards) skipped
        sampled_values = [s[f] for _, samples, _ in results for s in samples if s[f] == s[f]]
        metrics[f"greedy_rewards/{name}/mean"] = sum(greedy_values) / len(greedy_values) if greedy_values else None
        metrics[f"sampled_rewards/{name}/mean"] = (
            sum(sampled_values) / len(sampled_values) if sampled_values else None
        )
    metrics["settings"] = settings
    if state.is_main_process:
        print(
            f"{task.name} {eval_args.split} split, {len(results)} prompts: greedy accuracy "
            f"{metrics['accuracy_greedy']:.3f} | sampled pass@1 {metrics['pass@1']:.3f} "
            f"(temperature {eval_args.sample_temperature:g}, {num_samples} sample(s) per prompt, "
            f"max_new_tokens {eval_args.max_new_tokens})"
        )
        print(json.dumps(metrics, indent=2))
        if eval_args.output_file:
            write_json(eval_args.output_file, metrics)
    return metrics


def analyze(argv: list[str]) -> dict:
    """``trl-es analyze``: JSON report and PNG plots of the ES-vs-GRPO diagnostics for one or two checkpoints
    (rewards on the task's test split)."""
    from .analysis import analyze as run_analysis
    from .models import resolve_model_path
    from .trainer.scoring import RewardScorer, build_generation_config, score_model

    parser = TrlESParser((AnalyzeArguments, TaskArguments), prog="trl-es analyze")
    analyze_args, task_args = parser.parse_args_and_config(argv)
    if analyze_args.model_a is None:
        raise ValueError("trl-es analyze needs --model_a (a trained checkpoint).")
    base_path = resolve_model_path(analyze_args.base_model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    task, splits = task_splits(task_args)
    held_out = splits["test"]
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
