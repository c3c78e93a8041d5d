"""Distinct, readable names for reward functions: the keys of every per-function metric (train, eval, reports).

TRL's GRPOTrainer names a reward function with ``trl.trainer.utils.get_callable_name`` (a ``functools.partial`` is
unwrapped to the wrapped function's name, a callable object falls back to its class name) and a reward model with the
last part of its ``config._name_or_path``. Those names can collide (two partials of one function, two lambdas, bound
methods of two instances of one class, two functions with the same ``__name__``), and a collision merges or drops
metrics keyed by name (``rewards/<name>/mean``). :func:`reward_func_names` keeps TRL's names and suffixes the
colliding ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from torch import nn
from trl.trainer.utils import get_callable_name, get_config_model_id


__all__ = ["base_reward_func_name", "reward_func_names"]


def base_reward_func_name(func: Callable | nn.Module) -> str:
    """The name TRL's GRPOTrainer gives one reward function (before any de-duplication).

    Args:
        func (`Callable` | `nn.Module`): A reward function (plain function, ``functools.partial``, lambda, bound
            method, callable object) or a reward model (an ``nn.Module`` with a ``config``).

    Returns:
        `str`: For a reward model, the last ``/``-separated part of its ``config._name_or_path`` (TRL's
        ``get_config_model_id(config).split("/")[-1]``), or its class name when that is empty; for a callable,
        ``trl.trainer.utils.get_callable_name(func)`` (partials unwrapped to the wrapped function's ``__name__``,
        ``"<lambda>"`` for lambdas, the method name for bound methods, the class name for callable objects).
    """
    if isinstance(func, nn.Module):  # as GRPOTrainer: nn.Module rather than PreTrainedModel (compiled models)
        config = getattr(func, "config", None)
        name = get_config_model_id(config).split("/")[-1] if config is not None else ""
        return name or type(func).__name__
    return get_callable_name(func) or type(func).__name__


def reward_func_names(funcs: Sequence[Callable | nn.Module]) -> list[str]:
    """One distinct, readable name per reward function, in order.

    Each function gets :func:`base_reward_func_name` (the name TRL's GRPOTrainer logs it under). When several
    functions share a base name, **each** of them gets a suffix ``_1``, ``_2``, ... in list order (TRL has no
    de-duplication convention; a suffix on every member of the group keeps any one of them from passing for the
    only function of that name). A suffixed name that is already taken by another function is skipped, so the
    result is always distinct. The names depend only on the functions' base names and order: deterministic.

    Example::

        >>> reward_func_names([partial(score, k=1), partial(score, k=2), lambda **kw: [], format_reward])
        ['score_1', 'score_2', '<lambda>', 'format_reward']

    Args:
        funcs (`Sequence[Callable | nn.Module]`): The reward functions and reward models, in the order the trainer
            scores them.

    Returns:
        `list[str]`: ``len(funcs)`` distinct names.

    Raises:
        TypeError: If an entry is neither callable nor an ``nn.Module``.
    """
    for i, func in enumerate(funcs):
        if not (callable(func) or isinstance(func, nn.Module)):
            raise TypeError(f"reward_funcs[{i}] must be a callable or a reward model, got {type(func).__name__}.")
    base = [base_reward_func_name(f) for f in funcs]
    counts = Counter(base)
    taken = {name for name in base if counts[name] == 1}
    next_suffix: dict[str, int] = {}
    names = []
    for name in base:
        if counts[name] == 1:
            names.append(name)
            continue
        suffix = next_suffix.get(name, 1)
        while f"{name}_{suffix}" in taken:
            suffix += 1
        names.append(f"{name}_{suffix}")
        taken.add(names[-1])
        next_suffix[name] = suffix + 1
    return names
