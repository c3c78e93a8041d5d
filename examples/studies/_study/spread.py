"""Mean and spread over seeds, as the study scripts report every figure (``mean ± sample std``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

__all__ = ["format_mean_std", "mean_and_std", "mean_std"]


def mean_std(values: Iterable[float | None]) -> dict:
    """Mean and sample standard deviation (``n - 1`` in the denominator) of the values that are not ``None`` or NaN.

    Args:
        values (`Iterable[float | None]`): One figure per seed (or run); ``None`` and NaN are left out.

    Returns:
        `dict`: ``{"mean": float | None, "std": float | None, "n": int}``; ``std`` is 0.0 for one value, and both
        are ``None`` when no value is left.
    """
    kept = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not kept:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(kept), "std": statistics.stdev(kept) if len(kept) > 1 else 0.0, "n": len(kept)}


def format_mean_std(stat: dict | None, digits: int = 3) -> str:
    """``"0.383 ± 0.010"`` for a :func:`mean_std` result; ``"n/a"`` for ``None`` or no value."""
    if not stat or stat.get("mean") is None:
        return "n/a"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def mean_and_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation of ``values`` as a pair, in plain float arithmetic (``sum / n``).

    The race (compare_es_grpo.py) and Hyper-ES (hyper_es_table.py) tables use this arithmetic; it may differ from
    :func:`mean_std` (``statistics``) in the last bits, so each table keeps its own to re-summarize its stored runs
    bit for bit.

    Args:
        values (`list[float]`): One figure per seed, at least one.

    Returns:
        `tuple[float, float]`: ``(mean, std)``; ``std`` is 0.0 for one value.

    Raises:
        ZeroDivisionError: If ``values`` is empty.
    """
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
