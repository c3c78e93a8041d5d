"""Griffe extension (mkdocs.yml): the API reference shows the docstrings trl_es generates when it is imported.

mkdocstrings reads the source, where a config decorated with :func:`trl_es.arguments.document_parameters` has no
``Parameters:`` section: the decorator writes it from the fields' help at import time. For each such class this
extension imports it from the checkout being documented and puts its runtime ``__doc__`` in place of the source one.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

import griffe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECORATOR = "document_parameters"


class GeneratedDocstrings(griffe.Extension):
    """Replace the source docstring of every class decorated with ``document_parameters`` by its runtime one."""

    def on_class(self, *, cls: griffe.Class, loader: griffe.GriffeLoader, **kwargs) -> None:
        if not any(DECORATOR in str(decorator.value) for decorator in cls.decorators):
            return
        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)  # import the checkout whose source griffe reads
        runtime = getattr(importlib.import_module(cls.module.path), cls.name)
        source, imported = os.path.realpath(str(cls.filepath)), os.path.realpath(inspect.getsourcefile(runtime))
        if source != imported:
            raise RuntimeError(f"{cls.path}: griffe reads {source} but Python imports {imported}; document the "
                               "checkout that is imported (run mkdocs from the repository root).")
        old = cls.docstring
        cls.docstring = griffe.Docstring(
            runtime.__doc__,
            lineno=old.lineno if old else None,
            endlineno=old.endlineno if old else None,
            parent=cls,
            parser=old.parser if old else loader.docstring_parser,
            parser_options=old.parser_options if old else loader.docstring_options,
        )
