"""YAML recipes for scripts that build an ``ESConfig`` themselves (the example scripts' ``--es_recipe`` and
``--es_overrides``); ``trl-es train`` reads recipes with TRL's ``TrlParser`` (``--config``) instead."""

from __future__ import annotations

import dataclasses

from ..trainer.es.es_config import ESConfig


__all__ = ["es_config_kwargs", "load_recipe"]


def load_recipe(path: str) -> dict:
    """A YAML recipe as a dict (an empty file gives ``{}``)."""
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}  # an empty file is None


def es_config_kwargs(recipe: dict, overrides: list[str]) -> dict:
    """The recipe's ``ESConfig`` keys (task and model keys dropped), then the ``key=value`` ``overrides`` (YAML values).

    Raises:
        ValueError: for an override that is not ``key=value`` with an ``ESConfig`` field as key.
    """
    import yaml

    names = {f.name for f in dataclasses.fields(ESConfig) if f.init}  # the fields ESConfig(...) takes
    kwargs = {k: v for k, v in recipe.items() if k in names}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ValueError(f"--es_overrides entries must be key=value with an ESConfig field as key, got {item!r}.")
        kwargs[key] = yaml.safe_load(value)  # "0.1" -> 0.1, "[1, 2]" -> [1, 2], "true" -> True
    return kwargs
