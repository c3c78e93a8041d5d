"""Population success diversity JS_succ: how differently the members of an ES population succeed."""

from __future__ import annotations

from collections.abc import Sequence

import torch


__all__ = ["binary_entropy", "success_diversity", "success_diversity_from_matrix"]


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    r"""Binary entropy in nats, :math:`h(p) = -p \ln p - (1-p) \ln(1-p)`, with :math:`h(0) = h(1) = 0`.

    Computed as ``torch.special.entr(p) + torch.special.entr(1 - p)`` (``entr(0) = 0``).

    Args:
        p (Tensor): probabilities in [0, 1], any shape, floating point.

    Returns:
        Tensor: ``h(p)``, same shape and dtype, in [0, ln 2].
    """
    return torch.special.entr(p) + torch.special.entr(1 - p)


def success_diversity(success_rates: Sequence[float] | torch.Tensor) -> float:
    r"""Population success diversity :math:`\mathrm{JS}_{\text{succ}}` (arXiv 2608.27351).

    The generalised Jensen-Shannon divergence of the members' Bernoulli success distributions on a prompt batch:

    .. math::
        \mathrm{JS}_{\text{succ}} = h\Big(\frac{1}{N}\sum_{i=1}^{N} p_i\Big) - \frac{1}{N}\sum_{i=1}^{N} h(p_i),

    with :math:`p_i` member :math:`i`'s success rate and :math:`h` the binary entropy **in nats**
    (:func:`binary_entropy`, :math:`h(0)=h(1)=0`). It is 0 when all members succeed equally often and at most
    :math:`\ln 2` (half the members always succeed, half never). Computed in float64.

    Args:
        success_rates (Sequence[float] | Tensor): 1-D, length N >= 1, values in [0, 1].

    Returns:
        float: :math:`\mathrm{JS}_{\text{succ}}` in nats, in [0, ln 2].

    Raises:
        ValueError: if the input is not 1-D, is empty, or holds values outside [0, 1] (or NaN).
    """
    p = torch.as_tensor(success_rates, dtype=torch.float64)
    if p.dim() != 1:
        raise ValueError(f"`success_rates` must be 1-D (one rate per population member), got shape {tuple(p.shape)}.")
    if p.numel() == 0:
        raise ValueError("`success_rates` must hold at least one member's rate.")
    if torch.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"`success_rates` must lie in [0, 1], got min {p.min().item()} and max {p.max().item()}.")
    js = binary_entropy(p.mean()) - binary_entropy(p).mean()
    return max(0.0, float(js))


def success_diversity_from_matrix(successes: Sequence[Sequence[float]] | torch.Tensor) -> float:
    r""":math:`\mathrm{JS}_{\text{succ}}` (arXiv 2608.27351) from a per-member, per-prompt success matrix.

    The success rate of member :math:`i` is :math:`p_i = \frac{1}{P}\sum_{j} s_{ij}`; then
    :func:`success_diversity`.

    Args:
        successes (Tensor | nested sequence): shape ``(N members, P prompts)``, values 0/1 (bool, int or float).

    Returns:
        float: :math:`\mathrm{JS}_{\text{succ}}` in nats.

    Raises:
        ValueError: if the input is not 2-D, has no member or no prompt, or holds values other than 0 and 1.
    """
    s = torch.as_tensor(successes)
    if s.dim() != 2:
        raise ValueError(f"`successes` must be 2-D (N members x P prompts), got shape {tuple(s.shape)}.")
    if s.shape[0] == 0 or s.shape[1] == 0:
        raise ValueError(f"`successes` needs at least one member and one prompt, got shape {tuple(s.shape)}.")
    s = s.to(torch.float64)
    if not ((s == 0) | (s == 1)).all():
        raise ValueError("`successes` must hold only 0/1 (or False/True) values.")
    return success_diversity(s.mean(dim=1))
