"""The configs' fields, written once: dict-valued options as JSON (:class:`TrlESParser`), ``Literal`` choices
(:func:`literal_field_errors`), and the ``Parameters:`` docstring generated from ``metadata["help"]``
(:func:`document_parameters`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

from trl import TrlParser


__all__ = [
    "DictValuedFields",
    "TrlESParser",
    "check_finite_floats",
    "check_int",
    "check_literal_fields",
    "decode_dict_fields",
    "dict_valued_fields",
    "document_parameters",
    "literal_choices",
    "literal_field_errors",
    "parse_json_dict",
]


def _is_dict_type(tp: Any) -> bool:
    """Whether a (resolved) type hint is ``dict``/``dict[...]``, or a union with such a member."""
    if tp is dict or typing.get_origin(tp) is dict:  # dict or dict[K, V]
        return True
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:  # dict | str | None, Optional[dict[str, Any]], ...
        return any(_is_dict_type(arg) for arg in typing.get_args(tp))
    return False


@functools.cache
def dict_valued_fields(cls: type) -> tuple[str, ...]:
    """The names of the fields of dataclass ``cls`` typed ``dict``, ``dict[K, V]`` or a union with one, in field order.

    Raises:
        TypeError: If ``cls`` is not a dataclass type.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"dict_valued_fields needs a dataclass type, got {cls!r}")
    hints = typing.get_type_hints(cls)
    # not field.type: HfArgumentParser rewrites it in place
    return tuple(f.name for f in dataclasses.fields(cls) if f.name in hints and _is_dict_type(hints[f.name]))


class DictValuedFields:
    """A ``_VALID_DICT_FIELDS`` descriptor: the parents' entries, then every dict-typed field of the class read from."""

    def __get__(self, instance, owner: type) -> list[str]:  # transformers' __post_init__ decodes JSON for each of these
        names: list[str] = []
        for base in reversed(owner.__mro__[1:]):  # fields a parent lists come first, in their order
            inherited = base.__dict__.get("_VALID_DICT_FIELDS")
            if isinstance(inherited, (list, tuple)):
                names += [n for n in inherited if n not in names]
        names += [n for n in dict_valued_fields(owner) if n not in names]  # then this class's own, subclasses included
        return names


def check_finite_floats(config: Any) -> None:
    """Reject NaN and +-inf in every float field of dataclass ``config``, and in every float of a list or tuple field.

    Raises:
        ValueError: naming the field (and the index for a list) and the value, e.g. ``learning_rate must be a finite
            number (not NaN or +-inf), got inf.``
    """
    for f in dataclasses.fields(config):  # called first in __post_init__: a bad value fails before a model loads
        value = getattr(config, f.name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number (not NaN or +-inf), got {value}.")
        if isinstance(value, (list, tuple)):  # reward_weights, density_bounds; dict fields are left to their libraries
            for i, item in enumerate(value):
                if isinstance(item, float) and not math.isfinite(item):
                    raise ValueError(f"{f.name}[{i}] must be a finite number (not NaN or +-inf), got {item}.")


def check_int(name: str, value: Any, minimum: int) -> None:
    """Reject a value that is not an integer ``>= minimum`` (a ``bool`` is not an integer here).

    Raises:
        ValueError: naming the field and the value, e.g. ``max_steps must be an integer >= 1, got 0``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:  # a bool is not an integer here
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _literal_args(tp: Any) -> tuple | None:
    """The values of a ``Literal[...]`` hint (with ``None`` for ``Literal[...] | None``); ``None`` if it is none."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        literals = [_literal_args(arg) for arg in args if arg is not type(None)]
        if len(literals) == 1 and literals[0] is not None:
            return literals[0] + ((None,) if type(None) in args else ())  # Literal[...] | None allows None too
    return None


@functools.cache
def literal_choices(cls: type) -> dict[str, tuple]:
    """The ``Literal``-typed fields of dataclass ``cls`` -> their allowed values, in field order."""
    hints = typing.get_type_hints(cls)
    choices = {f.name: _literal_args(hints.get(f.name)) for f in dataclasses.fields(cls)}
    return {name: values for name, values in choices.items() if values is not None}


def literal_field_errors(config: Any, skip: Sequence[str] = ()) -> list[str]:
    """One message per ``Literal`` field of ``config`` whose value is not a choice, in field order (empty: all fine).

    ``skip`` names fields another check refuses with its own reason. A message reads
    ``"awd_penalty must be one of ('l2', 'l1'), got 'l3'."``.
    """
    errors = []
    for name, allowed in literal_choices(type(config)).items():
        value = getattr(config, name)
        # HfArgumentParser refuses a bad flag; this catches kwargs, YAML, assignment
        if name not in skip and not any(value == a and isinstance(value, type(a)) for a in allowed):
            errors.append(f"{name} must be one of {allowed}, got {value!r}.")
    return errors


def check_literal_fields(config: Any) -> None:
    """Raise ``ValueError`` with the first of :func:`literal_field_errors`, if any."""
    errors = literal_field_errors(config)
    if errors:
        raise ValueError(errors[0])


def _type_text(annotation: Any) -> str:
    """A field's annotation in TRL's docstring style: ``int | str | None`` -> ```int`, `str` or `None```."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text + "|"):  # split at the top-level | only, not inside dict[str, int | None]
        depth += char == "["
        depth -= char == "]"
        if char == "|" and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    names = ["str" if p.startswith("Literal[") else "dict" if p.startswith("dict[") else p for p in parts]
    names = [f"`{n}`" for n in dict.fromkeys(names)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def document_parameters(groups: Mapping[str, Sequence[str]]):
    """Class decorator (above ``@dataclass``): append TRL's ``Parameters:`` section, built from ``metadata["help"]``.

    Args:
        groups (`Mapping[str, Sequence[str]]`): Heading (a ``> Parameters that ...`` line) -> its fields, in order.
            Every field the class body declares must be in a group; fields of its bases may be.

    Returns:
        `Callable[[type], type]`: The decorator; it returns the class with ``__doc__`` extended.

    Raises:
        TypeError: naming the fields that are in no group, in two, not fields of the class, or without a help.
    """

    def decorate(cls: type) -> type:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        listed = [name for names in groups.values() for name in names]
        problems = {
            "not fields": [n for n in listed if n not in fields],
            "in two groups": sorted({n for n in listed if listed.count(n) > 1}),
            "in no group": [n for n in cls.__dict__.get("__annotations__", {}) if n not in listed],
            "without a help": [n for n in listed if n in fields and not fields[n].metadata.get("help")],
        }
        problems = {what: names for what, names in problems.items() if names}
        if problems:
            raise TypeError(f"document_parameters({cls.__name__}): " + "; ".join(
                f"{what}: {names}" for what, names in problems.items()))
        lines = ["", "    Parameters:"]
        for heading, names in groups.items():
            lines += [f"        > {heading}", ""]
            for name in names:
                f = fields[name]
                default = f.default
                # a default_factory shows its value
                if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
                    default = f.default_factory()
                kind = _type_text(f.type)
                kind += "" if default is dataclasses.MISSING else f", *optional*, defaults to `{default!r}`"
                # TRL's entry: name (`type`, *optional*, defaults to `value`):
                lines.append(f"        {name} ({kind}):")
                lines += textwrap.wrap(f.metadata["help"], 120, initial_indent=" " * 12, subsequent_indent=" " * 12,
                                       break_long_words=False, break_on_hyphens=False)
            lines.append("")
        # --help and the docs then show the same words
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "    "
        return cls

    return decorate


def parse_json_dict(value: Any, flag: str, allow_plain_string: bool = False) -> Any:
    """Decode the command-line/YAML value of a dict-valued option: a string as a JSON object, anything else as is.

    ``flag`` (e.g. ``"--generation_kwargs"``) is named in the error; with ``allow_plain_string`` a string that does not
    start with ``{`` is returned unchanged.

    Raises:
        ValueError: Naming ``flag``, if the string is not a JSON object (malformed JSON, or JSON of another type).
    """
    if not isinstance(value, str):
        return value
    text = value.strip()
    if allow_plain_string and not text.startswith("{"):  # --deepspeed or --fsdp_config may be a file path
        return value
    example = f"""{flag} '{{"key": 1, "other": "text"}}'"""  # shown in both errors
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object, e.g. {example}; got malformed JSON {value!r} ({e})") from None
    if not isinstance(decoded, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. {example}; got {type(decoded).__name__} {value!r}")
    return decoded


def decode_dict_fields(obj: Any) -> None:
    """Decode, in place, JSON strings held by the dict-typed fields of dataclass instance ``obj``.

    Raises:
        ValueError: Naming the field's flag, if a string is not a JSON object.
    """
    for name in dict_valued_fields(type(obj)):  # for dataclasses that are not TrainingArguments (no _VALID_DICT_FIELDS)
        setattr(obj, name, parse_json_dict(getattr(obj, name), f"--{name}"))


class _JsonDictType:
    """argparse ``type=`` of a dict-valued field: JSON object -> dict, errors naming the flag."""

    def __init__(self, flag: str, allow_plain_string: bool):
        self.flag, self.allow_plain_string = flag, allow_plain_string
        self.__name__ = "JSON object"

    def __call__(self, value: str):
        import argparse

        try:
            return parse_json_dict(value, self.flag, self.allow_plain_string)
        except ValueError as e:
            # argparse prefixes 'argument --flag:' itself
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{self.flag} ")) from None


class TrlESParser(TrlParser):
    """TRL's ``TrlParser`` (``--config recipe.yaml`` plus flags) whose dict-typed fields take JSON, e.g.
    ``--generation_kwargs '{"repetition_penalty": 1.1}'``; a bad value raises ``ValueError`` naming the flag.
    """

    def __init__(self, dataclass_types=None, **kwargs):
        super().__init__(dataclass_types, **kwargs)
        from transformers import TrainingArguments

        path_or_dict = set(TrainingArguments._VALID_DICT_FIELDS)
        actions = {action.dest: action for action in self._actions}
        for dtype in self.dataclass_types:  # every dataclass parsed: configs and script arguments alike
            for name in dict_valued_fields(dtype):
                action = actions.get(name)
                if action is None:
                    continue
                # transformers' path-or-dict fields still take a file path
                plain = issubclass(dtype, TrainingArguments) and name in path_or_dict
                action.type = _JsonDictType(f"--{name}", allow_plain_string=plain)
                action.metavar = action.metavar or "JSON"  # --help shows JSON

    def error(self, message: str):
        """Raise ``ValueError(message)`` (argparse would print usage and exit with status 2)."""
        raise ValueError(f"{self.prog}: error: {message}")  # like HfArgumentParser's error for unknown flags

