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
        return yaml.safe_load(f) or {}


def es_config_kwargs(recipe: dict, overrides: list[str]) -> dict:
    """The recipe's ``ESConfig`` keys (others, such as task and model keys, are dropped), then ``key=value``
    overrides whose values are parsed as YAML (the ``--es_overrides`` of the example scripts).

    Raises:
        ValueError: for an override that is not ``key=value`` with an ``ESConfig`` field as key.
    """
    import yaml

    names = {f.name for f in dataclasses.fields(ESConfig) if f.init}
    kwargs = {k: v for k, v in recipe.items() if k in names}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ValueError(f"--es_overrides entries must be key=value with an ESConfig field as key, got {item!r}.")
        kwargs[key] = yaml.safe_load(value)
    return kwargs
