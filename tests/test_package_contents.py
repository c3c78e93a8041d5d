"""The package holds what a user imports; the studies live in examples/studies/ and build on the package only."""

import ast
import glob
import os

import pytest
from example_script import EXAMPLES, STUDIES, example_script

PACKAGE = os.path.join(os.path.dirname(EXAMPLES), "trl_es")

#: study-only modules that left the package, and where they live now
MOVED = {
    "trl_es/pretraining.py": "examples/studies/_study/pretraining.py",
    "trl_es/tasks/pretraining_corpus.py": "examples/studies/_study/pretraining_corpus.py",
    "trl_es/analysis/spread.py": "examples/studies/_study/spread.py",
}


def _package_files() -> list[str]:
    return sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))


def _imported_modules(path: str) -> set[str]:
    """The absolute module names a file imports (relative imports stay inside trl_es and are left out)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package_path", sorted(MOVED))
def test_study_only_modules_left_the_package(package_path):
    root = os.path.dirname(EXAMPLES)
    assert not os.path.exists(os.path.join(root, package_path))
    assert os.path.isfile(os.path.join(root, MOVED[package_path]))


def test_the_package_imports_nothing_from_the_examples():
    files = _package_files()
    assert len(files) > 50  # the walk found the package
    offending = {os.path.relpath(f, PACKAGE): sorted(n for n in _imported_modules(f)
                                                      if n.split(".")[0] in ("examples", "_study"))
                 for f in files}
    assert {f: names for f, names in offending.items() if names} == {}
    names = {n.split(".")[-1] for f in files for n in _imported_modules(f) if n.startswith("trl_es")}
    assert not names & {"pretraining", "pretraining_corpus", "spread"}


def test_the_examples_import_no_private_trl_es_name():
    """Example and study code builds on trl_es's public names only (``from trl_es.x import _y`` is refused)."""
    private = []
    for path in sorted(glob.glob(os.path.join(EXAMPLES, "**", "*.py"), recursive=True)):
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trl_es"):
                private += [f"{os.path.relpath(path, EXAMPLES)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert private == []


STUDY_SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(STUDIES, "*.py")))


def test_the_studies_folder_holds_the_study_harnesses():
    assert {"compare_es_grpo.py", "geometry.py", "continual_tasks.py", "pretraining_excursions.py",
            "parallel_averaging.py"} <= set(STUDY_SCRIPTS)
    readme = open(os.path.join(STUDIES, "README.md")).read()
    for name in STUDY_SCRIPTS + sorted(os.path.basename(p) for p in glob.glob(os.path.join(STUDIES, "*.sh"))):
        assert f"`{name}`" in readme, name  # one line per study in examples/studies/README.md


@pytest.mark.parametrize("name", STUDY_SCRIPTS)
def test_every_study_script_imports(name):
    """Each study imports (its module level runs: imports of trl_es and _study, dataclasses); nothing trains."""
    with example_script(f"studies/{name}", f"study_import_{name[:-3]}") as module:
        assert callable(getattr(module, "main", None)), name
