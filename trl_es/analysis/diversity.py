"""Population success diversity JS_succ: how differently the members of an ES population succeed."""

from __future__ import annotations

from collections.abc import Sequence

import torch


__all__ = ["binary_entropy", "success_diversity", "success_diversity_from_matrix"]


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    r"""Binary entropy in nats, :math:`h(p) = -p \ln p - (1-p) \ln(1-p)`, :math:`h(0) = h(1) = 0`, elementwise."""
    return torch.special.entr(p) + torch.special.entr(1 - p)  # entr(0) = 0


def success_diversity(success_rates: Sequence[float] | torch.Tensor) -> float:
    r"""Population success diversity :math:`\mathrm{JS}_{\text{succ}}` (arXiv 2608.27351), in nats, in [0, ln 2].

    .. math::
        \mathrm{JS}_{\text{succ}} = h\Big(\frac{1}{N}\sum_{i=1}^{N} p_i\Big) - \frac{1}{N}\sum_{i=1}^{N} h(p_i)

    with :math:`p_i` member :math:`i`'s success rate (``success_rates``, 1-D, N >= 1) and :math:`h` the
    :func:`binary_entropy`. Raises ``ValueError`` for another shape, no member, or a rate outside [0, 1] (or NaN).
    """
    p = torch.as_tensor(success_rates, dtype=torch.float64)  # float64
    if p.dim() != 1:
        raise ValueError(f"`success_rates` must be 1-D (one rate per population member), got shape {tuple(p.shape)}.")
    if p.numel() == 0:
        raise ValueError("`success_rates` must hold at least one member's rate.")
    if torch.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"`success_rates` must lie in [0, 1], got min {p.min().item()} and max {p.max().item()}.")
    # 0: all succeed equally often; ln 2: half always, half never
    js = binary_entropy(p.mean()) - binary_entropy(p).mean()
    return max(0.0, float(js))  # rounding may dip below 0


def success_diversity_from_matrix(successes: Sequence[Sequence[float]] | torch.Tensor) -> float:
    r""":func:`success_diversity` of the rates :math:`p_i = \frac{1}{P}\sum_{j} s_{ij}` of a 0/1 matrix ``(N, P)``.

    Raises:
        ValueError: if the input is not 2-D, has no member or no prompt, or holds values other than 0 and 1.
    """
    s = torch.as_tensor(successes)
    if s.dim() != 2:
        raise ValueError(f"`successes` must be 2-D (N members x P prompts), got shape {tuple(s.shape)}.")
    if s.shape[0] == 0 or s.shape[1] == 0:
        raise ValueError(f"`successes` needs at least one member and one prompt, got shape {tuple(s.shape)}.")
    s = s.to(torch.float64)  # bool, int or float 0/1
    if not ((s == 0) | (s == 1)).all():
        raise ValueError("`successes` must hold only 0/1 (or False/True) values.")
    return success_diversity(s.mean(dim=1))  # p_i: member i's rate over the P prompts
