"""The rooms of docs/architecture.md: no import runs from a lower room into a higher one."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "trl_es")

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
    "reward_names": ("trainer", "cli"),
    "arguments": ("trainer", "cli"),
    "models": ("trainer", "cli"),
    "trainer": ("cli",),
}


def _module_files(room: str) -> list[str]:
    path = os.path.join(ROOT, room)
    if os.path.isdir(path):
        return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files if f.endswith(".py")]
    return [path + ".py"]


def _trl_es_imports(file: str) -> set[str]:
    """The first-level trl_es rooms a file imports (``trl_es.X`` or relative ``..X`` / ``.X`` from the top)."""
    package = os.path.relpath(os.path.dirname(file), os.path.join(ROOT, "..")).split(os.sep)  # ["trl_es", ...]
    rooms = set()
    for node in ast.walk(ast.parse(open(file).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names = [".".join([*base, node.module] if node.module else base)]
                if not node.module:
                    names = [".".join([*base, alias.name]) for alias in node.names]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "trl_es" and len(parts) > 1:
                rooms.add(parts[1])
            elif parts[0] == "trl_es":
                rooms.add("<package top>")
    return rooms


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
    assert _trl_es_imports(os.path.join(ROOT, "trainer", "es_trainer.py")) >= {"es", "rollout", "generation"}
    assert "trainer" in _trl_es_imports(os.path.join(ROOT, "cli", "train_command.py"))
