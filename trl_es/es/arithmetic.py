"""Arithmetic that gives the same bits on every CPU: the ES core's sums and steps, and the fitness statistics.

torch's CPU kernels fuse ``y + alpha * x`` into one rounding where the CPU has FMA and reduce in an order set by the
SIMD width; here each step is one correctly rounded IEEE operation per element and small sums are exactly rounded
(:func:`math.fsum`), so a seed log replays to the same weights on any CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def add_scaled_(y: torch.Tensor, x: torch.Tensor, alpha: float, portable: bool = True) -> torch.Tensor:
    """``y += alpha * x`` in place, returns ``y``; ``portable=False``: torch's fused one-pass add (legacy seed logs)."""
    if portable:  # a multiply, then an add: two IEEE roundings, the same bits on every CPU
        return y.add_(x * alpha)
    return y.add_(x, alpha=alpha)  # fused into one rounding on FMA CPUs: kept for version-1 logs


def added_scaled(y: torch.Tensor, x: torch.Tensor, alpha: float, portable: bool = True,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``y + alpha * x`` as a new tensor (or into ``out``) of ``torch.add``'s dtype, rounded as :func:`add_scaled_`."""
    if portable:
        return torch.add(y, x * alpha, out=out) if out is not None else torch.add(y, x * alpha)
    return torch.add(y, x, alpha=alpha, out=out) if out is not None else torch.add(y, x, alpha=alpha)


def exact_sum(values: Iterable[float]) -> float:
    """The exactly rounded float64 sum (:func:`math.fsum`): independent of order and CPU. NaN in, NaN out."""
    return math.fsum(float(v) for v in values)


def exact_mean(values: torch.Tensor) -> float:
    """Mean of a 1-D tensor: the exactly rounded float64 sum over the count; ``ValueError`` when empty."""
    if values.numel() == 0:
        raise ValueError("exact_mean of an empty tensor.")
    return exact_sum(values.reshape(-1).tolist()) / values.numel()


def zscore(values: torch.Tensor) -> torch.Tensor:
    """``(v - mean(v)) / std(v)``, ddof 0, the same bits on every CPU: ``(N,)`` finite, not all equal, to float64."""
    v = values.to(torch.float64)
    centered = v - exact_mean(v)  # torch's mean/std reduce in an order set by the SIMD width
    std = math.sqrt(exact_sum((centered * centered).tolist()) / v.numel())
    return centered / std
