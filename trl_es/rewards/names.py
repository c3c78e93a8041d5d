"""Distinct, readable names for reward functions: the keys of every per-function metric (``rewards/<name>/mean``).

TRL's names can collide (two partials of one function, two lambdas); :func:`reward_func_names` suffixes those.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from torch import nn
from trl.trainer.utils import get_callable_name, get_config_model_id


__all__ = ["base_reward_func_name", "reward_func_names"]


def base_reward_func_name(func: Callable | nn.Module) -> str:
    """The name TRL's GRPOTrainer gives one reward function or reward model, before de-duplication."""
    if isinstance(func, nn.Module):  # as GRPOTrainer: nn.Module rather than PreTrainedModel (compiled models)
        config = getattr(func, "config", None)
        name = get_config_model_id(config).split("/")[-1] if config is not None else ""  # the id's last part
        return name or type(func).__name__
    # a partial's wrapped function, "<lambda>", a callable object's class; else the class name
    return get_callable_name(func) or type(func).__name__


def reward_func_names(funcs: Sequence[Callable | nn.Module]) -> list[str]:
    """One distinct name per reward function, in order: :func:`base_reward_func_name`, and ``_1``, ``_2``, ... on
    **each** of the functions sharing a base name.

    Example::

        >>> reward_func_names([partial(score, k=1), partial(score, k=2), lambda **kw: [], format_reward])
        ['score_1', 'score_2', '<lambda>', 'format_reward']

    Raises:
        TypeError: If an entry is neither callable nor an ``nn.Module``.
    """
    for i, func in enumerate(funcs):
        if not (callable(func) or isinstance(func, nn.Module)):
            raise TypeError(f"reward_funcs[{i}] must be a callable or a reward model, got {type(func).__name__}.")
    base = [base_reward_func_name(f) for f in funcs]
    counts = Counter(base)
    # every function of a shared name is suffixed: none passes for the only one of that name
    taken = {name for name in base if counts[name] == 1}
    next_suffix: dict[str, int] = {}
    names = []
    for name in base:
        if counts[name] == 1:
            names.append(name)
            continue
        suffix = next_suffix.get(name, 1)
        while f"{name}_{suffix}" in taken:  # a suffixed name another function holds is skipped
            suffix += 1
        names.append(f"{name}_{suffix}")
        taken.add(names[-1])
        next_suffix[name] = suffix + 1
    return names
