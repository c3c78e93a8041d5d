"""How much of a Python tree is docstring and how much is comment, per top-level subpackage::

    python scripts/docstring_shares.py                      # trl_es/
    python scripts/docstring_shares.py path/to/grpo_trainer.py

- docstring lines: the lines of every module, class and function docstring (the string statement that opens the body);
- comment lines: the lines that hold a ``#`` comment (``tokenize``), on their own or beside code;
- lines: every line of the ``*.py`` files, blank ones included;
- long docstrings: the definitions (classes and functions) whose docstring has 8 or more lines and at least as many
  lines as the rest of the definition (every line after the docstring to the definition's last, as counted for
  issue 59: 151 of 935 definitions on fb323b7).
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import tokenize
from dataclasses import dataclass, fields


LONG_DOCSTRING = 8  # lines from which a docstring counts as long
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass
class Shares:
    """Line counts of one file or the sum of several."""

    files: int = 0
    lines: int = 0
    docstring_lines: int = 0
    comment_lines: int = 0
    definitions: int = 0
    long_docstrings: int = 0  # definitions whose docstring (>= LONG_DOCSTRING lines) is as long as their code

    def __add__(self, other: Shares) -> Shares:
        return Shares(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Shares)))


def _docstring_span(node: ast.AST) -> tuple[int, int] | None:
    """First and last line (1-based, inclusive) of the docstring of a module, class or function, or None."""
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].lineno, body[0].end_lineno
    return None


def measure_source(source: str) -> Shares:
    """The :class:`Shares` of one file's text (``files`` is 1)."""
    lines = source.splitlines()
    tree = ast.parse(source)
    docstring: set[int] = set()
    definitions = long_docstrings = 0
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, *_DEFINITIONS)):
            continue
        definitions += not isinstance(node, ast.Module)
        span = _docstring_span(node)
        if span is None:
            continue
        first, last = span
        docstring.update(range(first, last + 1))
        length = last - first + 1
        # the rest of the definition: every line after the docstring, blank ones included
        if not isinstance(node, ast.Module) and length >= LONG_DOCSTRING and length >= node.end_lineno - last:
            long_docstrings += 1
    comments = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}
    return Shares(files=1, lines=len(lines), docstring_lines=len(docstring), comment_lines=len(comments),
                  definitions=definitions, long_docstrings=long_docstrings)


def measure(path: str) -> dict[str, Shares]:
    """The :class:`Shares` of ``path`` (a ``.py`` file or a folder, walked for ``*.py``), keyed by the top-level entry
    below ``path`` each file lives in (``"."`` for the files directly in it, the file's name for a file)."""
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return {os.path.basename(path): measure_source(f.read())}
    groups: dict[str, Shares] = {}
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(root, name), path)
                group = relative.split(os.sep)[0] if os.sep in relative else "."
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    groups[group] = groups.get(group, Shares()) + measure_source(f.read())
    return groups


def table(groups: dict[str, Shares]) -> str:
    """A fixed-width table, a row a group and the total last."""
    total = sum(groups.values(), Shares())
    header = f"{'':<22}{'files':>6}{'lines':>8}{'docstr':>8}{'%':>6}{'comment':>8}{'%':>6}{'defs':>6}{'long':>6}"
    rows = [header]
    for name, s in [*sorted(groups.items()), ("total", total)]:
        doc = 100 * s.docstring_lines / max(s.lines, 1)
        com = 100 * s.comment_lines / max(s.lines, 1)
        rows.append(f"{name:<22}{s.files:>6}{s.lines:>8}{s.docstring_lines:>8}{doc:>6.1f}{s.comment_lines:>8}"
                    f"{com:>6.1f}{s.definitions:>6}{s.long_docstrings:>6}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("::")[0], formatter_class=argparse.RawTextHelpFormatter)
    default = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trl_es")
    parser.add_argument("path", nargs="?", default=default, help="a .py file or a folder (default: trl_es/)")
    print(table(measure(parser.parse_args(argv).path)))


if __name__ == "__main__":
    main()
