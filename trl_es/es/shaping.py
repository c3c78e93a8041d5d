"""Fitness shaping: turning the population's raw rewards into update coefficients.

Two rules apply before any shaping, whatever the method:

- **Invalid members.** A member whose fitness is not a finite number (NaN: nothing could be scored, or a reward
  function / reward model returned NaN or +-inf for one of its completions, see ``ESTrainer``) is ranked worst:
  its fitness is set strictly below every finite member's, with one warning per call that names how many.
- **Ties up to rounding.** Fitness values are float64 means of rewards; members with the same rewards in a
  different order can differ by a few ulps. Sorted neighbours closer than ``TIE_ULPS`` float64 ulps of the larger of
  the two, ``b - a <= TIE_ULPS * 2**-52 * max(|a|, |b|)``, are merged into one tie group (chains of such neighbours;
  each group takes its mean). Invalid members are then set strictly below the worst valid one. If every member
  lands in one group the population carries no signal and the scale-free shapings (``"zscore"``,
  ``"centered_rank"``) return exactly zero coefficients, so the ES step is exactly zero. The tolerance is relative to
  the fitness scale, unlike the reference code's ``(F - mean) / (std + 1e-8)``, whose absolute epsilon both turns
  ulp-level noise into a full step (``std`` of ~1e-17 for 30 equal values of 1/3 gives coefficients of +-1) and damps
  real signal of fitness values below ~1e-8.
"""

from __future__ import annotations

import logging
import warnings

import torch

from .arithmetic import zscore


logger = logging.getLogger(__name__)

FITNESS_SHAPINGS = ("zscore", "centered_rank", "none")

TIE_ULPS = 64
"""Fitness values closer than this many float64 ulps of the largest magnitude are equal (see the module doc)."""


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
    """Merge fitness values that are equal up to rounding into one value per tie group (their mean).

    Sorted neighbours ``a <= b`` are in one group when ``b - a <= ulps * 2**-52 * max(|a|, |b|)``: the tolerance is
    relative to the two values themselves, so a large value elsewhere in the population never merges small, real
    differences. Groups are chains of such neighbours.

    Args:
        fitness (`torch.Tensor`): Shape ``(N,)``, float64, finite.
        ulps (`int`): The tolerance in float64 ulps of the larger magnitude of two neighbours.

    Returns:
        `torch.Tensor`: Shape ``(N,)``, float64; every group holds one value (bitwise equal within a group).
    """
    f = fitness.to(torch.float64)
    if f.numel() < 2:
        return f.clone()
    values, order = torch.sort(f)
    scale = torch.maximum(values[1:].abs(), values[:-1].abs())
    new_group = torch.ones_like(values, dtype=torch.bool)
    new_group[1:] = (values[1:] - values[:-1]) > ulps * torch.finfo(torch.float64).eps * scale
    group = torch.cumsum(new_group.long(), 0) - 1
    count = torch.zeros(int(group[-1]) + 1, dtype=torch.float64).index_add_(0, group, torch.ones_like(values))
    total = torch.zeros_like(count).index_add_(0, group, values)
    merged = torch.empty_like(f)
    merged[order] = (total / count)[group]
    return merged


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

    First invalid (non-finite) members are ranked worst and ties up to rounding are merged (module doc). Then:

    - ``"zscore"``: ``z_i = (F_i - mean(F)) / std(F)`` with the population standard deviation (ddof 0), as in
      Qiu et al. 2025 (arXiv 2509.24372, Algorithm 1, "normalize rewards"). All members tied: all ``z_i = 0``.
    - ``"centered_rank"``: :func:`centered_ranks` (Salimans et al. 2017). All members tied: all ``z_i = 0``.
    - ``"none"``: ``z_i = F_i`` (raw rewards, after the invalid-member fill; ties are *not* merged). With equal
      fitness the ES step is then ``alpha * F * mean_i(eps_i)``: a random step, not zero. A warning says so each
      time it happens; prefer a scale-free shaping unless the rewards are centred by design.

    Args:
        fitness (`torch.Tensor`): Shape ``(N,)``, float.
        method (`str`): One of ``"zscore"``, ``"centered_rank"``, ``"none"``.

    Returns:
        `torch.Tensor`: Shape ``(N,)``, float64, finite.

    Raises:
        ValueError: for an unknown ``method`` or a fitness that is not 1-D with at least 2 entries.
    """
    if method not in FITNESS_SHAPINGS:
        raise ValueError(f"fitness_shaping must be one of {FITNESS_SHAPINGS}, got {method!r}.")
    if fitness.dim() != 1 or fitness.numel() < 2:
        raise ValueError(f"fitness must be 1-D with at least 2 members, got shape {tuple(fitness.shape)}.")
    f = fitness.to(torch.float64)
    valid = torch.isfinite(f)
    if method == "none":
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
    if bool((merged == merged[0]).all()):
        return torch.zeros_like(f)
    if method == "centered_rank":
        return centered_ranks(merged)
    return zscore(merged)  # exactly rounded mean and variance: the same coefficients on every CPU
