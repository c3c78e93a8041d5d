"""The argument dataclasses of ``trl-es``: :class:`TaskArguments` (all three commands), :class:`EvalArguments`
(``trl-es eval``) and :class:`AnalyzeArguments` (``trl-es analyze``); ``trl-es train`` adds ``ESConfig`` and TRL's
``ModelConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from ..arguments import check_finite_floats, check_literal_fields, decode_dict_fields


TaskName = Literal["countdown", "arithmetic", "gsm"]
TASK_NAMES = get_args(TaskName)
#: Splits of every task, see :func:`trl_es.cli.task_splits`.
SPLITS = ("train", "validation", "test")
#: Splits an evaluation may read.
EvalSplit = Literal["validation", "test"]
EVAL_SPLITS = get_args(EvalSplit)
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass
class TaskArguments:
    """Which task, and the sizes of its three disjoint splits (train, validation, test)."""

    task: TaskName = field(default="arithmetic", metadata={"help": "Task: countdown | arithmetic | gsm."})
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
    eval_split: EvalSplit = field(
        default="validation",
        metadata={"help": "The split the trainer's evaluations during `trl-es train` read (accuracy_before/after, "
                  "the curve): 'validation' (default; tune on it) or 'test' (report from it; then no separate "
                  "test_accuracy_*). Tuning reads validation, reports read test."},
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
        check_literal_fields(self)  # task, eval_split
        for name in ("num_train_prompts", "num_validation_prompts", "num_eval_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
        if self.time_budget_minutes is not None and self.time_budget_minutes < 0:  # 0 = no budget
            raise ValueError(
                f"time_budget_minutes must be >= 0 (0 or unset: no budget), got {self.time_budget_minutes}."
            )


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

    split: EvalSplit = field(
        default="test", metadata={"help": "Split to score: 'test' (default: reports read test) or 'validation'."}
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
                  "> 0, else 0.6 (the papers' protocol, trl_es.analysis.PAPER_PROTOCOL)."},
    )
    max_new_tokens: int | None = field(
        default=None,
        metadata={"help": "Maximum new tokens per completion. None: the run's/recipe's max_completion_length, else "
                  f"{DEFAULT_MAX_NEW_TOKENS}."},
    )
    top_p: float | None = field(
        default=None,
        metadata={"help": "Nucleus sampling of the sampled completions. None: run/recipe, else 0.95 (the papers' "
                  "protocol)."},
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
    batch_size: int = field(default=32, metadata={"help": "Prompts per greedy generate call."})
    sample_batch_size: int | None = field(
        default=None,
        metadata={"help": "Prompts per sampled generate call (x num_samples rows). None (default): "
                  "trl_es.analysis.auto_sample_batch_size, 128 // num_samples prompts (about 128 rows a call), one "
                  "prompt a call from 64 samples on: the fastest widths measured on the CPU."},
    )
    output_file: str | None = field(default=None, metadata={"help": "Also write the metrics as JSON here."})

    def __post_init__(self):
        decode_dict_fields(self)
        check_finite_floats(self)
        check_literal_fields(self)  # split
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0 (0 = one sample), got {self.num_samples}.")
        if not self.pass_k or any(k < 1 for k in self.pass_k):
            raise ValueError(f"pass_k values must be >= 1, got {self.pass_k}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}.")
        if self.sample_batch_size is not None and self.sample_batch_size < 1:
            raise ValueError(f"sample_batch_size must be >= 1 (or None: about 128 rows a call), got "
                             f"{self.sample_batch_size}.")
        if self.sample_temperature is not None and not self.sample_temperature > 0:
            raise ValueError(f"sample_temperature must be > 0 (the sampled completions of pass@k; greedy accuracy is "
                             f"always reported), got {self.sample_temperature}.")


@dataclass
class AnalyzeArguments:
    """``trl-es analyze``: drift, off-task KL, functional sparsity, mode connectivity between checkpoints."""

    base_model: str = field(default="embedded:SmolLM2-135M-Instruct", metadata={"help": "The base model (theta_0)."})
    model_a: str = field(default=None, metadata={"help": "A trained checkpoint (ES or GRPO)."})
    model_b: str | None = field(default=None, metadata={"help": "Optional second trained checkpoint."})
    analysis_dir: str = field(default="analysis", metadata={"help": "Where report.json and the PNG plots go."})
    num_kl_prompts: int = field(default=32, metadata={"help": "Off-task prompts for the KL drift."})
    max_new_tokens: int = field(default=16, metadata={"help": "New tokens per completion (KL and rewards)."})
