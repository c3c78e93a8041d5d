"""The unbiased pass@k estimator of Chen et al. 2021 (Sec. 2.1), pure numpy: the one implementation."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np


__all__ = ["estimate_pass_at_k", "mean_pass_at_k", "pass_at_k"]


def _check_count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # a bool is not a count
        raise TypeError(f"`{name}` must be an integer, got {value!r} of type {type(value).__name__}.")
    value = int(value)  # numpy integers too
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value}.")
    return value


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    r"""Unbiased pass@k of one problem: ``n >= 1`` samples, ``0 <= c <= n`` correct, ``1 <= k <= n`` (Chen et al. 2021).

    .. math::
        \text{pass@}k = 1 - \binom{n-c}{k} \Big/ \binom{n}{k} = 1 - \prod_{i=n-c+1}^{n} \left(1 - \frac{k}{i}\right)

    Returns a float in ``[0, 1]`` (``c / n`` for ``k = 1``) for ``(num_samples, num_correct, k) = (n, c, k)``.

    Raises:
        TypeError: if an argument is not an integer. ValueError: if a count is out of those ranges.
    """
    n = _check_count(num_samples, "num_samples", 1)
    c = _check_count(num_correct, "num_correct", 0)
    k = _check_count(k, "k", 1)
    if c > n:
        raise ValueError(f"`num_correct` ({c}) must be <= `num_samples` ({n}).")
    if k > n:  # pass@k needs at least k samples per problem
        raise ValueError(f"`k` ({k}) must be <= `num_samples` ({n}): pass@k needs at least k samples per problem.")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    # the paper's numerically stable product form
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def estimate_pass_at_k(num_samples: int | Sequence[int], num_correct: Sequence[int], k: int) -> np.ndarray:
    r"""Per-problem :func:`pass_at_k`, shape ``(P,)``, float64, for ``P`` counts ``num_correct`` and ``n`` per problem
    (or one ``n`` for all).

    Raises:
        TypeError, ValueError: as :func:`pass_at_k`; ValueError also for no problem or lengths that differ.
    """
    # a single count is one problem
    correct = list(num_correct) if not isinstance(num_correct, numbers.Integral) else [num_correct]
    if len(correct) == 0:
        raise ValueError("`num_correct` must contain at least one problem.")
    if isinstance(num_samples, numbers.Integral):
        samples = [num_samples] * len(correct)  # one n shared by all problems
    else:
        samples = list(num_samples)
        if len(samples) != len(correct):
            raise ValueError(
                f"`num_samples` has {len(samples)} entries but `num_correct` has {len(correct)}; "
                "give one n per problem or a single int."
            )
    return np.array([pass_at_k(n, c, k) for n, c in zip(samples, correct, strict=False)], dtype=np.float64)


def mean_pass_at_k(num_samples: int | Sequence[int], num_correct: Sequence[int], k: int) -> float:
    r"""Mean over problems of :func:`estimate_pass_at_k`: :math:`\frac{1}{P} \sum_p \big[1 - \prod_{i=n_p-c_p+1}^{n_p}
    (1 - k/i)\big]`.
    """
    return float(estimate_pass_at_k(num_samples, num_correct, k).mean())
