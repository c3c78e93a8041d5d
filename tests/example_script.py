"""Load a script of examples/ (``scripts/<name>.py`` or ``studies/<name>.py``) as a module, for tests of its functions
and dataclasses, and run a study's ``main`` in-process (the ``study`` and ``run_study`` fixtures of conftest.py)."""

import importlib.util
import os
import sys
from contextlib import contextmanager

from paths import REPO

EXAMPLES = os.path.join(REPO, "examples")
SCRIPTS = os.path.join(EXAMPLES, "scripts")  # the product's example scripts
STUDIES = os.path.join(EXAMPLES, "studies")  # the study harnesses and their helper package _study


@contextmanager
def example_script(path: str, module_name: str):
    """Import ``examples/<path>`` (e.g. ``"studies/geometry.py"``) as ``module_name`` for the duration of the block.

    A study script imports its helpers as ``_study``: ``python examples/studies/x.py`` has ``examples/studies`` on
    ``sys.path``, and so do the tests (conftest.py).
    """
    spec = importlib.util.spec_from_file_location(module_name, os.path.join(EXAMPLES, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses resolve string annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(module_name, None)


class StudyRun:
    """``run(*argv)``: ``module.main`` with ``--model_name_or_path model --output_dir output_dir`` before ``argv`` (a
    later flag of the same name wins), in-process; returns what ``main`` returns."""

    def __init__(self, module, model: str, output_dir):
        self.module, self.model, self.output_dir = module, model, output_dir

    def __call__(self, *argv: str):
        return self.module.main(["--model_name_or_path", self.model, "--output_dir", str(self.output_dir), *argv])
