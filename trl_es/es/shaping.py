"""Fitness shaping: the population's raw fitness to the coefficients ``z_i`` of the ES update.

Before any shaping, non-finite members are ranked worst (warned) and values within ``TIE_ULPS`` float64 ulps are
merged (:func:`merge_ties`); a population in one tie group gets exactly zero coefficients.
"""

from __future__ import annotations

import logging
import warnings

import torch

from .arithmetic import zscore


logger = logging.getLogger(__name__)

FITNESS_SHAPINGS = ("zscore", "centered_rank", "none")

# relative, unlike the reference code's (F - mean) / (std + 1e-8): its absolute epsilon turns ulp-level noise into a
# full step and damps real signal below ~1e-8
TIE_ULPS = 64
"""Fitness values closer than this many float64 ulps of the larger magnitude are equal."""


def _fill_invalid_as_worst(fitness: torch.Tensor, valid_values: torch.Tensor) -> torch.Tensor:
    """Set every non-finite entry of ``fitness`` strictly below the smallest of ``valid_values`` (with a warning)."""
    invalid = ~torch.isfinite(fitness)
    if not invalid.any():
        return fitness
    logger.warning(
        "%d of %d population members have no finite fitness (NaN, or a non-finite reward); they are ranked worst.",
        int(invalid.sum()), fitness.numel(),
    )
    if valid_values.numel() == 0:
        return torch.zeros_like(fitness)
    worst = valid_values.min()
    # Strictly below every finite member, by a margin no rounding can close: at least the population's spread,
    # the magnitude of the worst value, and 1.
    gap = max(float(valid_values.max() - worst), float(worst.abs()), 1.0)
    return torch.where(invalid, worst - gap, fitness)


def merge_ties(fitness: torch.Tensor, ulps: int = TIE_ULPS) -> torch.Tensor:
    """Merge fitness values equal up to rounding into their tie group's mean: sorted neighbours ``a <= b`` join when
    ``b - a <= ulps * 2**-52 * max(|a|, |b|)``. ``fitness``: ``(N,)`` finite; returns ``(N,)`` float64.
    """
    f = fitness.to(torch.float64)
    if f.numel() < 2:
        return f.clone()
    values, order = torch.sort(f)
    scale = torch.maximum(values[1:].abs(), values[:-1].abs())
    new_group = torch.ones_like(values, dtype=torch.bool)
    # relative to the two neighbours: a large value elsewhere never merges small, real differences
    new_group[1:] = (values[1:] - values[:-1]) > ulps * torch.finfo(torch.float64).eps * scale
    group = torch.cumsum(new_group.long(), 0) - 1
    count = torch.zeros(int(group[-1]) + 1, dtype=torch.float64).index_add_(0, group, torch.ones_like(values))
    total = torch.zeros_like(count).index_add_(0, group, values)
    merged = torch.empty_like(f)
    merged[order] = (total / count)[group]
    return merged


def centered_ranks(fitness: torch.Tensor) -> torch.Tensor:
    """Centered ranks ``rank / (N - 1) - 0.5`` in ``[-0.5, 0.5]``, ties averaged (Salimans et al. 2017, arXiv
    1703.03864, Sec. 3.1). ``fitness``: ``(N,)``, no NaN; returns ``(N,)`` float64.
    """
    f = fitness.to(torch.float64)
    n = f.numel()
    less = (f[None, :] < f[:, None]).sum(dim=1).to(torch.float64)
    equal = (f[None, :] == f[:, None]).sum(dim=1).to(torch.float64)
    ranks = less + (equal - 1) / 2  # ties share their average rank: equal fitness, equal coefficients
    return ranks / (n - 1) - 0.5


def shape_fitness(fitness: torch.Tensor, method: str = "zscore") -> torch.Tensor:
    """Turn raw fitness ``(N,)`` into the coefficients ``z_i``, ``(N,)`` float64 finite: ``"zscore"`` (ddof 0; Qiu
    et al. 2025, arXiv 2509.24372, Algorithm 1), ``"centered_rank"`` (:func:`centered_ranks`) or ``"none"``.

    Raises:
        ValueError: for an unknown ``method`` or a fitness that is not 1-D with at least 2 entries.
    """
    if method not in FITNESS_SHAPINGS:
        raise ValueError(f"fitness_shaping must be one of {FITNESS_SHAPINGS}, got {method!r}.")
    if fitness.dim() != 1 or fitness.numel() < 2:
        raise ValueError(f"fitness must be 1-D with at least 2 members, got shape {tuple(fitness.shape)}.")
    f = fitness.to(torch.float64)
    valid = torch.isfinite(f)
    if method == "none":  # equal fitness: alpha * F * mean(eps), a random step, hence the warning
        f = _fill_invalid_as_worst(f, f[valid])
        merged = merge_ties(f)
        if bool((merged == merged[0]).all()) and bool(f.abs().max() > 0):
            warnings.warn(
                "fitness_shaping='none' with equal fitness across the population: the ES step is alpha * F * "
                "mean(eps), a random step carrying no signal. Use 'zscore' or 'centered_rank' for a zero step.",
                stacklevel=2,
            )
        return f
    merged = f.clone()
    merged[valid] = merge_ties(f[valid])  # ties among the valid members first, then the invalid ones below them
    merged = _fill_invalid_as_worst(merged, merged[valid])
    if bool((merged == merged[0]).all()):  # one tie group: no signal, an exactly zero step
        return torch.zeros_like(f)
    if method == "centered_rank":
        return centered_ranks(merged)
    return zscore(merged)  # exactly rounded mean and variance: the same coefficients on every CPU
