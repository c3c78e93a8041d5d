"""The ``trl-es`` console script: ``train``, ``eval`` and ``analyze``, built on TRL's ``TrlParser``, and
``vllm-serve`` (an ES vLLM server for ``vllm_mode="server"``).

Every ``ESConfig`` field and TRL's ``ModelConfig`` fields work on the command line or in a YAML file
(``--config recipe.yaml``; command-line values override the file); dict-valued fields take JSON on the command line
(``--generation_kwargs '{"repetition_penalty": 1.1}'``)::

    trl-es train --task arithmetic --output_dir runs/es --population_size 16 --max_steps 20
    trl-es train --config examples/recipes/arithmetic_smollm2.yaml
    trl-es eval --model_name_or_path runs/es --pass_k 1 4 --num_samples 8
    trl-es analyze --base_model embedded:SmolLM2-135M-Instruct --model_a runs/es --analysis_dir runs/analysis
    trl-es vllm-serve embedded:SmolLM2-135M-Instruct --port 8000

Every task has three disjoint splits: train (fitness), validation (what ``trl-es train`` evaluates during training by
default, for tuning) and test (what reports read: ``trl-es eval`` by default, and ``test_accuracy_*`` in
``results.json``). ``trl-es train`` writes ``trl_es_run.json`` (task and generation settings) next to the model, and
``trl-es eval`` grades with those settings unless told otherwise.

All three run under ``accelerate launch`` as well (``accelerate launch -m trl_es.cli train ...``).
The model defaults to the embedded SmolLM2-135M-Instruct (``embedded:SmolLM2-135M-Instruct``).
"""

from __future__ import annotations

import sys

from .analyze_command import analyze
from .arguments import (
    DEFAULT_MAX_NEW_TOKENS,
    EVAL_SPLITS,
    SPLITS,
    TASK_NAMES,
    AnalyzeArguments,
    EvalArguments,
    TaskArguments,
)
from .eval_command import evaluate, parse_eval_arguments
from .plotting import plot_training_curves
from .recipes import es_config_kwargs, load_recipe
from .run_file import RUN_FILE, RUN_GENERATION_KEYS, RUN_TASK_KEYS, read_run_settings, run_settings
from .splits import task_splits
from .train_command import train
from .vllm_serve_command import vllm_serve


COMMANDS = ("train", "eval", "analyze", "vllm-serve")

__all__ = [
    "COMMANDS",
    "DEFAULT_MAX_NEW_TOKENS",
    "EVAL_SPLITS",
    "RUN_FILE",
    "RUN_GENERATION_KEYS",
    "RUN_TASK_KEYS",
    "SPLITS",
    "TASK_NAMES",
    "AnalyzeArguments",
    "EvalArguments",
    "TaskArguments",
    "analyze",
    "es_config_kwargs",
    "evaluate",
    "load_recipe",
    "main",
    "parse_eval_arguments",
    "plot_training_curves",
    "read_run_settings",
    "run_settings",
    "task_splits",
    "train",
]


def main(argv: list[str] | None = None):
    """Entry point of the ``trl-es`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: trl-es {{{','.join(COMMANDS)}}} [--config recipe.yaml] [--field value ...]\n\n{__doc__}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "vllm-serve":
        return vllm_serve(rest)
    {"train": train, "eval": evaluate, "analyze": analyze}[command](rest)
    return 0
