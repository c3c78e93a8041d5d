"""Fitness shaping: turning the population's raw rewards into update coefficients."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

FITNESS_SHAPINGS = ("zscore", "centered_rank", "none")


def _fill_nan_as_worst(fitness: torch.Tensor) -> torch.Tensor:
    nan = torch.isnan(fitness)
    if not nan.any():
        return fitness
    logger.warning(
        "%d of %d population members have NaN fitness; they are ranked worst.", int(nan.sum()), fitness.numel()
    )
    if nan.all():
        return torch.zeros_like(fitness)
    worst = fitness[~nan].min()
    # Strictly below every finite member, so a NaN member is ranked last, not tied with the worst finite one.
    spread = fitness[~nan].max() - worst
    return torch.where(nan, worst - (spread if spread > 0 else 1.0), fitness)


def centered_ranks(fitness: torch.Tensor) -> torch.Tensor:
    """Centered ranks in ``[-0.5, 0.5]`` (Salimans et al. 2017, arXiv 1703.03864, Sec. 3.1).

    Ties get the average of their ranks, so equal fitness values get equal coefficients.

    Args:
        fitness (`torch.Tensor`): Shape ``(N,)``, any float dtype, no NaN.

    Returns:
        `torch.Tensor`: Shape ``(N,)``, float64: ``rank / (N - 1) - 0.5`` with ranks in ``[0, N - 1]``.
    """
    f = fitness.to(torch.float64)
    n = f.numel()
    less = (f[None, :] < f[:, None]).sum(dim=1).to(torch.float64)
    equal = (f[None, :] == f[:, None]).sum(dim=1).to(torch.float64)
    ranks = less + (equal - 1) / 2
    return ranks / (n - 1) - 0.5


def shape_fitness(fitness: torch.Tensor, method: str = "zscore") -> torch.Tensor:
    """Turn raw fitness values into the coefficients ``z_i`` of the ES update.

    - ``"zscore"``: ``z_i = (F_i - mean(F)) / std(F)`` with the population standard deviation (ddof 0), as in
      Qiu et al. 2025 (arXiv 2509.24372, Algorithm 1, line "normalize rewards"). If every member has the same
      fitness, ``std = 0`` and all ``z_i = 0`` (a zero update, no division by zero).
    - ``"centered_rank"``: :func:`centered_ranks` (Salimans et al. 2017).
    - ``"none"``: ``z_i = F_i`` (raw rewards).

    A member with NaN fitness (e.g. all its rewards were ``None``) is ranked worst, with a warning in the log.

    Args:
        fitness (`torch.Tensor`): Shape ``(N,)``, float.
        method (`str`): One of ``"zscore"``, ``"centered_rank"``, ``"none"``.

    Returns:
        `torch.Tensor`: Shape ``(N,)``, float64.

    Raises:
        ValueError: for an unknown ``method`` or a fitness that is not 1-D with at least 2 entries.
    """
    if method not in FITNESS_SHAPINGS:
        raise ValueError(f"fitness_shaping must be one of {FITNESS_SHAPINGS}, got {method!r}.")
    if fitness.dim() != 1 or fitness.numel() < 2:
        raise ValueError(f"fitness must be 1-D with at least 2 members, got shape {tuple(fitness.shape)}.")
    f = _fill_nan_as_worst(fitness.to(torch.float64))
    if method == "none":
        return f
    if method == "centered_rank":
        return centered_ranks(f)
    std = f.std(unbiased=False)
    if std == 0 or not torch.isfinite(std):
        return torch.zeros_like(f)
    return (f - f.mean()) / std
