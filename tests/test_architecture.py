"""The rooms of docs/architecture.md: no import runs from a lower room into a higher one."""

import ast
import os

import pytest
from paths import TESTS

ROOT = os.path.join(TESTS, "..", "trl_es")

#: room (a package or a module of trl_es) -> the trl_es rooms it must not import
FORBIDDEN = {
    "es": ("trainer", "cli", "analysis", "merging", "tasks", "rollout", "generation"),
    "generation": ("trainer", "cli", "analysis", "merging", "rollout"),
    "rollout": ("trainer", "cli", "analysis", "merging"),
    "analysis": ("trainer", "cli"),
    "merging": ("trainer", "cli"),
    "tasks": ("trainer", "cli"),
    "metrics": ("trainer", "cli", "analysis"),
    "files": ("trainer", "cli"),
    "fingerprint": ("trainer", "cli"),
    "rewards": ("trainer", "cli", "analysis", "merging", "tasks", "rollout", "generation", "es", "agents"),
    "arguments": ("trainer", "cli"),
    "models": ("trainer", "cli"),
    "trainer": ("cli",),
}


def _module_files(room: str) -> list[str]:
    path = os.path.join(ROOT, room)
    if os.path.isdir(path):
        return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files if f.endswith(".py")]
    return [path + ".py"]


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """The nodes inside ``if TYPE_CHECKING:`` blocks: imports for annotations, which never run."""
    nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            nodes.update(n for stmt in node.body for n in ast.walk(stmt))
    return nodes


def _imported_names(file: str) -> set[str]:
    """The dotted names a file imports when it runs, relative imports resolved (``from ..X import y`` ->
    ``trl_es.<...>.X``); those under ``if TYPE_CHECKING:`` are left out."""
    package = os.path.relpath(os.path.dirname(file), os.path.join(ROOT, "..")).split(os.sep)  # ["trl_es", ...]
    names = set()
    tree = ast.parse(open(file).read())
    type_only = _type_checking_only(tree)
    for node in ast.walk(tree):
        if node in type_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                if node.module:
                    names.add(".".join([*base, node.module]))
                else:
                    names.update(".".join([*base, alias.name]) for alias in node.names)
            else:
                names.add(node.module or "")
    return names


def _trl_es_imports(file: str) -> set[str]:
    """The first-level trl_es rooms a file imports (``trl_es.X`` or relative ``..X`` / ``.X`` from the top)."""
    rooms = set()
    for name in _imported_names(file):
        parts = name.split(".")
        if parts[0] == "trl_es" and len(parts) > 1:
            rooms.add(parts[1])
        elif parts[0] == "trl_es":
            rooms.add("<package top>")
    return rooms


#: trainer family (a package or a shared module of trl_es.trainer) -> the trainer rooms it must not import: a family
#: may build on the ES family (ES + SFT averaging subclasses ESTrainer) and on the shared modules, never on another
#: family; the shared modules build on none.
TRAINER_FORBIDDEN = {
    "es": ("hyper_es", "averaging", "<trainer top>"),
    "hyper_es": ("averaging", "<trainer top>"),
    "averaging": ("hyper_es", "<trainer top>"),
    "distributed": ("es", "hyper_es", "averaging", "time_budget", "<trainer top>"),
    "time_budget": ("es", "hyper_es", "averaging", "distributed", "<trainer top>"),
}


def _trainer_imports(file: str) -> set[str]:
    """The ``trl_es.trainer`` rooms a file imports (``<trainer top>``: the package ``trl_es.trainer`` itself)."""
    rooms = set()
    for name in _imported_names(file):
        parts = name.split(".")
        if parts[:2] == ["trl_es", "trainer"]:
            rooms.add(parts[2] if len(parts) > 2 else "<trainer top>")
    return rooms


@pytest.mark.parametrize("family", sorted(TRAINER_FORBIDDEN))
def test_trainer_families_import_only_the_es_family_and_the_shared_modules(family):
    files = _module_files(os.path.join("trainer", family))
    assert files and all(os.path.isfile(f) for f in files), family
    offenders = {}
    for file in files:
        bad = _trainer_imports(file) & set(TRAINER_FORBIDDEN[family])
        if bad:
            offenders[os.path.relpath(file, ROOT)] = sorted(bad)
    assert offenders == {}


def test_every_trainer_module_is_in_a_family_or_shared():
    """A new module at trl_es/trainer/ must be placed in a family (or named shared above), so the check covers it."""
    top = os.path.join(ROOT, "trainer")
    entries = {e[:-3] if e.endswith(".py") else e for e in os.listdir(top) if e != "__pycache__"}
    assert entries - {"__init__"} == set(TRAINER_FORBIDDEN)


def test_es_trainer_has_at_most_two_project_mixins():
    """Every Trainer override ESTrainer makes is in es_trainer.py or one of at most two mixins (a self-contained
    group of hooks each: checkpoints, distributed setup)."""
    from trl_es import ESTrainer

    project = [c for c in ESTrainer.__mro__[1:] if c.__module__.startswith("trl_es.")]
    assert [c.__name__ for c in project] == ["ESCheckpointMixin", "ESDistributedMixin"]
    overriders = {c.__module__ for c in ESTrainer.__mro__ if c.__module__.startswith("trl_es.")}
    assert overriders == {"trl_es.trainer.es.es_trainer", "trl_es.trainer.es.es_checkpoint",
                          "trl_es.trainer.es.es_distributed_setup"}


def test_one_iteration_reads_in_at_most_four_trainer_files():
    """training_step's own calls land in es_trainer.py, the two mixins and the metrics/completion helpers;
    es_stability.py only with sigma="auto" or collapse_guard=True (tests/test_iteration_files.py traces the default)."""
    trainer_imports = {n for n in _imported_names(os.path.join(ROOT, "trainer", "es", "es_trainer.py"))
                       if n.startswith("trl_es.trainer.es.")}
    assert trainer_imports == {"trl_es.trainer.es.completion_logs", "trl_es.trainer.es.es_checkpoint",
                               "trl_es.trainer.es.es_config", "trl_es.trainer.es.es_distributed_setup",
                               "trl_es.trainer.es.es_metrics", "trl_es.trainer.es.es_stability"}


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_no_import_from_a_lower_room_into_a_higher_one(room):
    files = _module_files(room)
    assert files and all(os.path.isfile(f) for f in files), room
    offenders = {}
    for file in files:
        bad = _trl_es_imports(file) & {*FORBIDDEN[room], "<package top>"}
        if bad:
            offenders[os.path.relpath(file, ROOT)] = sorted(bad)
    assert offenders == {}


def test_the_import_reader_sees_relative_and_absolute_imports(tmp_path):
    """The check above cannot pass vacuously: it finds an upward import where there is one."""
    assert _trl_es_imports(os.path.join(ROOT, "trainer", "es", "es_trainer.py")) >= {"es", "rollout", "models"}
    assert _trl_es_imports(os.path.join(ROOT, "trainer", "es", "es_trainer.py")) >= {"es", "generation"}
    assert "trainer" in _trl_es_imports(os.path.join(ROOT, "cli", "train_command.py"))
    averaging = os.path.join(ROOT, "trainer", "averaging", "es_parallel_averaging_trainer.py")
    assert _trainer_imports(averaging) >= {"es"}  # ..es.es_trainer, resolved inside trl_es.trainer
    assert _trl_es_imports(averaging) == {"trainer"}  # not the core trl_es.es: ``..es`` here is trl_es.trainer.es
    typed = tmp_path / "typed.py"  # a rollout annotation in a lower room: skipped only under TYPE_CHECKING
    typed.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from trl_es.rollout import X\n"
                     "from trl_es.es import Y\n")
    assert _trl_es_imports(str(typed)) == {"es"}
    typed.write_text("from trl_es.rollout import X\n")
    assert _trl_es_imports(str(typed)) == {"rollout"}

