"""Arithmetic that gives the same bits on every CPU: the ES core's sums and steps, and the fitness statistics.

torch's CPU kernels are compiled once per SIMD level (``default``, AVX2, AVX-512) and picked at run time. A kernel
that computes ``y + alpha * x`` in one pass (``add(x, alpha=...)``, ``addcmul``) is fused into one rounding (FMA)
where the CPU has FMA, and rounded twice where it has not, so the same call gives different bits on different CPUs.
Reductions (``sum``, ``mean``, ``std``) add in an order set by the vector width. Here every step is one correctly
rounded IEEE operation per element (a multiply, then an add, in separate passes) and every sum of a few fitness
values is exactly rounded (:func:`math.fsum`), so a seed log replays to the same weights on any CPU and processes on
different CPUs agree on every update.

Version-1 seed logs whose noise has no ``"generator"`` were trained with torch's fused kernels: :func:`add_scaled_`
keeps them (``portable=False``) so that ``replay`` reproduces those runs where they were trained.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def add_scaled_(y: torch.Tensor, x: torch.Tensor, alpha: float, portable: bool = True) -> torch.Tensor:
    """``y += alpha * x`` in place.

    Args:
        y (`torch.Tensor`): Updated in place (any float dtype; fp32 in the ES core).
        x (`torch.Tensor`): Broadcastable to ``y``.
        alpha (`float`): The scale (rounded to ``y``'s dtype, as torch does for a Python scalar).
        portable (`bool`): ``True``: a multiply, then an add (two IEEE roundings: the same bits on every CPU);
            ``False``: torch's one-pass ``add_(x, alpha=alpha)`` (fused on FMA CPUs; legacy seed logs).

    Returns:
        `torch.Tensor`: ``y``.
    """
    if portable:
        return y.add_(x * alpha)
    return y.add_(x, alpha=alpha)


def added_scaled(y: torch.Tensor, x: torch.Tensor, alpha: float, portable: bool = True,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``y + alpha * x`` as a new tensor (or into ``out``), with :func:`add_scaled_`'s rounding.

    Returns:
        `torch.Tensor`: The result, of ``torch.add``'s dtype for ``y`` and ``x``.
    """
    if portable:
        return torch.add(y, x * alpha, out=out) if out is not None else torch.add(y, x * alpha)
    return torch.add(y, x, alpha=alpha, out=out) if out is not None else torch.add(y, x, alpha=alpha)


def exact_sum(values: Iterable[float]) -> float:
    """The exactly rounded float64 sum (:func:`math.fsum`): independent of order and CPU. NaN in, NaN out."""
    return math.fsum(float(v) for v in values)


def exact_mean(values: torch.Tensor) -> float:
    """Mean of a 1-D tensor, exactly rounded sum over the count (float64).

    Raises:
        ValueError: for an empty tensor.
    """
    if values.numel() == 0:
        raise ValueError("exact_mean of an empty tensor.")
    return exact_sum(values.reshape(-1).tolist()) / values.numel()


def zscore(values: torch.Tensor) -> torch.Tensor:
    """``(v - mean(v)) / std(v)`` with the population standard deviation (ddof 0), the same bits on every CPU.

    Args:
        values (`torch.Tensor`): Shape ``(N,)``, float, finite, not all equal.

    Returns:
        `torch.Tensor`: Shape ``(N,)``, float64.
    """
    v = values.to(torch.float64)
    centered = v - exact_mean(v)
    std = math.sqrt(exact_sum((centered * centered).tolist()) / v.numel())
    return centered / std
