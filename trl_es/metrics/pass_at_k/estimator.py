"""The unbiased pass@k estimator of Chen et al. 2021 (Sec. 2.1): the one implementation.

Pure numpy, no ``trl_es`` import: the ``evaluate`` metric next to it (``pass_at_k.py``, which imports it relatively,
so that ``evaluate.load`` copies it along) and :mod:`trl_es.analysis.pass_at_k` (which re-exports it) both use it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np


__all__ = ["estimate_pass_at_k", "mean_pass_at_k", "pass_at_k"]


def _check_count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an integer, got {value!r} of type {type(value).__name__}.")
    value = int(value)
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value}.")
    return value


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    r"""Unbiased estimate of pass@k for one problem.

    From Chen et al. 2021, "Evaluating Large Language Models Trained on Code", Sec. 2.1:
    with ``n`` samples of which ``c`` are correct,

    .. math::
        \text{pass@}k = 1 - \binom{n-c}{k} \Big/ \binom{n}{k}
                      = 1 - \prod_{i=n-c+1}^{n} \left(1 - \frac{k}{i}\right),

    the numerically stable product form of the paper's reference code (equal to 1 when ``n - c < k``).

    Args:
        num_samples (int): ``n``, number of samples drawn for the problem, ``n >= 1``.
        num_correct (int): ``c``, number of those samples that are correct, ``0 <= c <= n``.
        k (int): ``k``, the budget, ``1 <= k <= n``.

    Returns:
        float: the unbiased pass@k estimate in ``[0, 1]``. For ``k = 1`` it equals ``c / n``.

    Raises:
        TypeError: if an argument is not an integer.
        ValueError: if ``n < 1``, ``c < 0``, ``k < 1``, ``c > n`` or ``k > n``.
    """
    n = _check_count(num_samples, "num_samples", 1)
    c = _check_count(num_correct, "num_correct", 0)
    k = _check_count(k, "k", 1)
    if c > n:
        raise ValueError(f"`num_correct` ({c}) must be <= `num_samples` ({n}).")
    if k > n:
        raise ValueError(f"`k` ({k}) must be <= `num_samples` ({n}): pass@k needs at least k samples per problem.")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def estimate_pass_at_k(num_samples: int | Sequence[int], num_correct: Sequence[int], k: int) -> np.ndarray:
    r"""Per-problem unbiased pass@k estimates (Chen et al. 2021, Sec. 2.1; see :func:`pass_at_k`).

    Args:
        num_samples (int or sequence of int): ``n`` per problem, or one ``n`` shared by all problems.
        num_correct (sequence of int): ``c`` per problem, length ``P``.
        k (int): the budget, ``1 <= k <= n`` for every problem.

    Returns:
        np.ndarray: shape ``(P,)``, dtype float64, pass@k of each problem.

    Raises:
        TypeError: if a count is not an integer.
        ValueError: if ``num_correct`` is empty, the lengths differ, or a count is out of range
            (see :func:`pass_at_k`).
    """
    correct = list(num_correct) if not isinstance(num_correct, numbers.Integral) else [num_correct]
    if len(correct) == 0:
        raise ValueError("`num_correct` must contain at least one problem.")
    if isinstance(num_samples, numbers.Integral):
        samples = [num_samples] * len(correct)
    else:
        samples = list(num_samples)
        if len(samples) != len(correct):
            raise ValueError(
                f"`num_samples` has {len(samples)} entries but `num_correct` has {len(correct)}; "
                "give one n per problem or a single int."
            )
    return np.array([pass_at_k(n, c, k) for n, c in zip(samples, correct, strict=False)], dtype=np.float64)


def mean_pass_at_k(num_samples: int | Sequence[int], num_correct: Sequence[int], k: int) -> float:
    r"""Mean over problems of the unbiased pass@k estimate (Chen et al. 2021, Sec. 2.1).

    .. math:: \text{pass@}k = \frac{1}{P} \sum_{p=1}^{P} \Big[1 - \prod_{i=n_p-c_p+1}^{n_p} (1 - k/i)\Big]

    Args:
        num_samples (int or sequence of int): ``n`` per problem, or one ``n`` shared by all problems.
        num_correct (sequence of int): ``c`` per problem.
        k (int): the budget, ``1 <= k <= n`` for every problem.

    Returns:
        float: the mean pass@k.

    Raises:
        TypeError, ValueError: as :func:`estimate_pass_at_k`.
    """
    return float(estimate_pass_at_k(num_samples, num_correct, k).mean())
