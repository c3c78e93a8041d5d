"""Functional sparsity: how much of a fine-tuning update can be reset to the base weights without losing reward."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ._common import ModelLike, check_taus_or_ts, eval_mode, load_model, merged_module, named_float_params, shared_names

__all__ = ["functional_sparsity", "reset_small_updates"]


def _prepare(model: ModelLike, base_model: ModelLike):
    """(working copy, its params by name, current params, base params, shared names)."""
    model = load_model(model)
    if not isinstance(model, nn.Module):
        raise TypeError("`model` must be a model or a checkpoint path, not a state dict (the copy must be scorable).")
    source = merged_module(model)
    work = copy.deepcopy(source) if source is model else source  # a merged PEFT model already is a fresh copy
    cur = {n: p.detach() for n, p in source.named_parameters()}
    base = named_float_params(base_model)
    names = shared_names(cur, base, labels=("model", "base_model"))
    return work, dict(work.named_parameters()), cur, base, names


@torch.no_grad()
def _reset_into(work_params, cur, base, names, tau: float) -> float:
    """Write theta^(tau) into ``work_params``; return the fraction of coordinates reset."""
    reset, total = 0, 0
    for n in names:
        p = cur[n]
        b = base[n].to(p.device)
        mask = (p.float() - b.float()).abs() <= tau
        reset += int(mask.sum())
        total += p.numel()
        work_params[n].copy_(torch.where(mask, b.to(p.dtype), p))
    return reset / total if total else float("nan")


def reset_small_updates(model: ModelLike, base_model: ModelLike, tau: float) -> tuple[nn.Module, float]:
    r"""A copy of ``model`` in which every coordinate with :math:`|\theta_j - \theta_{0,j}| \le \tau` is reset to
    its base value :math:`\theta_{0,j}` (arXiv 2608.27351, functional sparsity; see :func:`functional_sparsity`).

    Args:
        model (nn.Module | str): the fine-tuned model (PEFT models are merged into a plain copy first).
        base_model (nn.Module | Mapping[str, Tensor] | str): the base weights theta_0 (same architecture).
        tau (float): the threshold, finite and >= 0.

    Returns:
        tuple[nn.Module, float]: the pruned copy (inputs untouched) and the fraction of compared coordinates reset.

    Raises:
        ValueError: if tau is negative or not finite, or the models share no parameters / differ in shapes.
        TypeError: if ``model`` is a state dict.
    """
    (tau,) = check_taus_or_ts([tau], "tau", lo=0.0)
    work, work_params, cur, base, names = _prepare(model, base_model)
    return work, _reset_into(work_params, cur, base, names, tau)


def functional_sparsity(
    model: ModelLike,
    base_model: ModelLike,
    taus: Sequence[float],
    reward_fn: Callable[[nn.Module], float] | None,
) -> dict:
    r"""Functional sparsity of a fine-tuning update (arXiv 2608.27351).

    For each threshold :math:`\tau`, build :math:`\theta^{(\tau)}` with

    .. math::
        \theta^{(\tau)}_j = \begin{cases} \theta_{0,j} & |\theta_j - \theta_{0,j}| \le \tau \\
                                          \theta_j & \text{otherwise} \end{cases}

    and report the fraction of coordinates reset, :math:`\frac{1}{D}\sum_j \mathbb{1}[|\theta_j-\theta_{0,j}|\le\tau]`,
    and the reward :math:`r(\theta^{(\tau)})`. If the reward survives large resets, the update is functionally
    sparse: few coordinates carry the behaviour change. Differences are compared in float32. Coordinates the update
    left unchanged count as reset at every tau (resetting them is a no-op), so ``tau = 0`` gives the unmodified
    model's reward and the fraction of untouched coordinates.

    All floating-point parameters shared by name are considered (tied weights once; PEFT models are merged into a
    plain copy). The work happens in one deep copy of ``model``; the input models are not modified.

    Args:
        model (nn.Module | str): the fine-tuned model (or checkpoint path).
        base_model (nn.Module | Mapping[str, Tensor] | str): the base theta_0.
        taus (Sequence[float]): thresholds, finite and >= 0, in parameter units.
        reward_fn (Callable[[nn.Module], float] | None): scores a model (e.g. mean task reward on a fixed prompt
            set); called once per tau on the pruned copy, in eval mode under ``torch.no_grad()``. ``None`` reports
            the fractions only.

    Returns:
        dict: ``{"taus": list[float], "fraction_reset": list[float], "reward": list[float] | None,
        "num_coordinates": int}``.

    Raises:
        ValueError: if a tau is negative or not finite, ``taus`` is empty, or the models share no parameters /
            differ in shapes.
        TypeError: if ``model`` is a state dict (a model is needed to score) or ``reward_fn`` is not callable.
    """
    taus = check_taus_or_ts(taus, "taus", lo=0.0)
    if reward_fn is not None and not callable(reward_fn):
        raise TypeError(f"`reward_fn` must be a callable model -> float or None, got {type(reward_fn).__name__}.")
    work, work_params, cur, base, names = _prepare(model, base_model)
    fractions, rewards = [], []
    for tau in taus:
        fractions.append(_reset_into(work_params, cur, base, names, tau))
        if reward_fn is not None:
            with eval_mode(work), torch.no_grad():
                rewards.append(float(reward_fn(work)))
    return {
        "taus": taus,
        "fraction_reset": fractions,
        "reward": rewards if reward_fn is not None else None,
        "num_coordinates": int(sum(cur[n].numel() for n in names)),
    }
