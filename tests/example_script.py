"""Load a script of examples/scripts/ as a module, for tests of its functions and dataclasses."""

import importlib.util
import os
import sys
from contextlib import contextmanager

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "scripts")


@contextmanager
def example_script(filename: str, module_name: str):
    """Import ``examples/scripts/<filename>`` as ``module_name`` for the duration of the block."""
    spec = importlib.util.spec_from_file_location(module_name, os.path.join(SCRIPTS, filename))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses resolve string annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(module_name, None)
