"""Helpers of the study scripts of ``examples/studies/`` (not part of the ``trl_es`` package).

The study scripts import this package as ``_study``: ``python examples/studies/<script>.py`` puts
``examples/studies/`` on ``sys.path`` (as do the worker processes ``trl_es.launch`` starts from a script's path).

- :mod:`_study.arms`: the arm orchestration: job arguments, reusing saved results, running jobs, writing results.
- :mod:`_study.pretraining`: pre-train a tiny Llama from scratch with intermediate checkpoints.
- :mod:`_study.pretraining_corpus`: the synthetic corpus it trains on (arithmetic + English-like text).
- :mod:`_study.spread`: mean ± sample std over seeds, as every study table reports a figure.
- :func:`load_script`: another study script imported as a module (a study that builds on another's functions).
"""

from __future__ import annotations

import importlib.util
import os
import sys

STUDIES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # examples/studies/

__all__ = ["STUDIES", "load_script"]


def load_script(name: str):
    """The study script ``examples/studies/<name>.py`` imported as a module (once a process).

    Args:
        name (`str`): The script's file name without ``.py`` (``"geometry"``).

    Returns:
        `types.ModuleType`: The module, registered in ``sys.modules`` as ``_study_script_<name>`` (dataclasses
        resolve string annotations through ``sys.modules``); its ``if __name__ == "__main__"`` block does not run.

    Raises:
        FileNotFoundError: If ``examples/studies/<name>.py`` does not exist.
    """
    module_name = f"_study_script_{name}"
    if module_name not in sys.modules:
        path = os.path.join(STUDIES, f"{name}.py")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no study script {path}")
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)  # a failed import leaves no half-built module behind
            raise
    return sys.modules[module_name]
