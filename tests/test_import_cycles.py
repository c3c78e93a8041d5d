"""trl_es has no import cycle: the module graph of every ``import`` and ``from ... import`` (relative ones, and the
lazy ones inside functions, included; those under ``if TYPE_CHECKING:``, which never run, left out) has no strongly
connected component of more than one module, and no module
imports itself. The checker is tried on a small package with a cycle first, so the main test can fail."""

import ast
import os
from paths import REPO
from test_architecture import _type_checking_only

ROOT = REPO


def module_graph(root: str, package: str) -> dict[str, set[str]]:
    """The import graph of ``package`` (a folder under ``root``): module -> the modules of the package it imports.

    ``from pkg import name`` points at the submodule ``pkg.name`` when there is one, else at ``pkg``; ``import a.b``
    at ``a.b``. Imports anywhere in a file count (module level, functions, classes) except under
    ``if TYPE_CHECKING:`` (annotations only); other packages are left out.
    """
    files = {}
    for folder, _, names in os.walk(os.path.join(root, package)):
        for name in names:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, name), root)[: -len(".py")].split(os.sep)
                is_package = parts[-1] == "__init__"
                files[".".join(parts[:-1] if is_package else parts)] = (os.path.join(folder, name), is_package)
    graph = {module: set() for module in files}
    for module, (path, is_package) in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        here = module if is_package else module.rpartition(".")[0]  # the package relative imports start from
        type_only = _type_checking_only(tree)
        for node in ast.walk(tree):
            if node in type_only:
                continue
            if isinstance(node, ast.Import):
                graph[module] |= {alias.name for alias in node.names if alias.name in files}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in files:
                        graph[module].add(f"{target}.{alias.name}")
                    elif target in files:
                        graph[module].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``: its strongly connected components of two or more modules, and modules that import
    themselves (Tarjan's algorithm, iterative), each sorted, in sorted order."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        cycles.append(sorted(component))
    return sorted(cycles)


TYPE_ONLY = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"  # the block below it never runs


def write_package(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_the_cycles_of_a_small_package(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "from .config import Config\n",
        "pkg/config.py": "from .fields import answer\n",  # config -> fields ...
        "pkg/fields.py": "def docs():\n    from .config import Config\n",  # ... -> config, lazily: a cycle
        "pkg/sub/__init__.py": "",
        "pkg/sub/a.py": "from .. import sub\nimport pkg.sub.b\n",  # a -> sub (package), a -> b
        "pkg/sub/b.py": "from pkg.sub import a\n",  # b -> a: a second cycle, absolute and via `from pkg import name`
        "pkg/own.py": "from . import own\n",  # a module that imports itself
        "pkg/leaf.py": "import os\nfrom .config import Config\n",  # no cycle through leaf
        "pkg/typed.py": f"{TYPE_ONLY}    from .leaf import x\nimport pkg.leaf\n",
    })
    graph = module_graph(str(tmp_path), "pkg")
    assert graph["pkg.fields"] == {"pkg.config"} and graph["pkg.sub.a"] == {"pkg.sub", "pkg.sub.b"}
    assert graph["pkg.typed"] == {"pkg.leaf"}  # the plain import counts, the TYPE_CHECKING one does not
    write_package(tmp_path, {"pkg/leaf.py": f"{TYPE_ONLY}    from . import typed\n"})  # leaf <-> typed, for types
    cycles = [["pkg.config", "pkg.fields"], ["pkg.own"], ["pkg.sub.a", "pkg.sub.b"]]  # none through leaf and typed
    assert import_cycles(module_graph(str(tmp_path), "pkg")) == cycles
    write_package(tmp_path, {"pkg/leaf.py": "import os\nfrom .config import Config\n"})
    assert import_cycles(graph) == [["pkg.config", "pkg.fields"], ["pkg.own"], ["pkg.sub.a", "pkg.sub.b"]]
    write_package(tmp_path, {"pkg/fields.py": "def docs():\n    return None\n", "pkg/sub/b.py": "", "pkg/own.py": ""})
    assert import_cycles(module_graph(str(tmp_path), "pkg")) == []


def test_trl_es_has_no_import_cycle():
    graph = module_graph(ROOT, "trl_es")
    assert "trl_es.trainer.es.es_config" in graph and len(graph) > 50  # the package was read
    assert import_cycles(graph) == []
