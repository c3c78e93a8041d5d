"""The run file: ``trl-es train`` records a run's task and generation settings in :data:`RUN_FILE` next to the model;
``trl-es eval`` reads them back (:func:`read_run_settings`) and grades with them unless told otherwise."""

from __future__ import annotations

import json
import os

from .arguments import TaskArguments


#: Written by ``trl-es train`` to ``output_dir``; read by ``trl-es eval``.
RUN_FILE = "trl_es_run.json"
#: The task arguments recorded in :data:`RUN_FILE` (and read back by ``trl-es eval``).
RUN_TASK_KEYS = ("task", "task_seed", "num_train_prompts", "num_validation_prompts", "num_eval_prompts",
                 "eval_split", "countdown_json")
#: The ``ESConfig`` generation settings recorded in :data:`RUN_FILE`.
RUN_GENERATION_KEYS = ("max_completion_length", "temperature", "top_p", "generation_kwargs", "chat_template_kwargs")


def run_settings(task_args: TaskArguments, es_args) -> dict:
    """What :data:`RUN_FILE` records of a run: ``task_args``' :data:`RUN_TASK_KEYS` and ``es_args``'
    :data:`RUN_GENERATION_KEYS`, JSON-serialisable.
    """
    settings = {key: getattr(task_args, key) for key in RUN_TASK_KEYS}
    settings.update({key: getattr(es_args, key) for key in RUN_GENERATION_KEYS})
    return json.loads(json.dumps(settings, default=str))  # values JSON cannot hold become strings


def read_run_settings(model_name_or_path: str | None) -> dict:
    """The :data:`RUN_FILE` of a trained model, in its folder or a ``checkpoint-*`` folder's parent; ``{}`` without one.

    Raises:
        ValueError: If the file exists but does not hold a JSON object.
    """
    from ..models import resolve_model_path

    if not model_name_or_path:
        return {}
    path = resolve_model_path(model_name_or_path)
    if not os.path.isdir(path):  # a hub id or a base model has no run file
        return {}
    candidates = [os.path.join(path, RUN_FILE)]
    if os.path.basename(os.path.normpath(path)).startswith("checkpoint-"):
        candidates.append(os.path.join(os.path.dirname(os.path.normpath(path)), RUN_FILE))  # the run's own output_dir
    for candidate in candidates:
        if os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as f:
                settings = json.load(f)
            if not isinstance(settings, dict):
                raise ValueError(f"{candidate} must hold a JSON object of run settings.")
            return settings
    return {}
