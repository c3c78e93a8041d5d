"""Functional sparsity (arXiv 2608.27351): how much of a fine-tuning update can be reset to the base without losing
reward, by a threshold on its magnitude (:func:`functional_sparsity`) or by keeping a fraction of its entries,
largest first, against a random fraction (:func:`keep_update_fraction`, :func:`update_fraction_curve`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ._common import ModelLike, check_taus_or_ts, eval_mode, load_model, merged_module, named_float_params, shared_names


__all__ = ["KEEP_MODES", "functional_sparsity", "keep_update_fraction", "reset_small_updates", "update_fraction_curve"]

#: How :func:`keep_update_fraction` chooses the kept entries of an update.
KEEP_MODES = ("global", "per_tensor", "random")  # largest |delta| of all, largest of each tensor, the random control


def _prepare(model: ModelLike, base_model: ModelLike):
    """(working copy, its params by name, current params, base params, shared names)."""
    model = load_model(model)  # a path is loaded
    if not isinstance(model, nn.Module):
        raise TypeError("`model` must be a model or a checkpoint path, not a state dict (the copy must be scorable).")
    source = merged_module(model)
    work = copy.deepcopy(source) if source is model else source  # a merged PEFT model already is a fresh copy
    # every float parameter shared by name, tied weights once
    cur = {n: p.detach() for n, p in source.named_parameters()}
    base = named_float_params(base_model)  # theta_0, by name
    names = shared_names(cur, base, labels=("model", "base_model"))
    return work, dict(work.named_parameters()), cur, base, names


@torch.no_grad()
def _reset_into(work_params, cur, base, names, tau: float) -> float:
    """Write theta^(tau) into ``work_params``; return the fraction of coordinates reset."""
    reset, total = 0, 0
    for n in names:
        p = cur[n]
        b = base[n].to(p.device)
        mask = (p.float() - b.float()).abs() <= tau  # float32; an untouched coordinate counts as reset at every tau
        reset += int(mask.sum())  # counted over every compared coordinate
        total += p.numel()
        work_params[n].copy_(torch.where(mask, b.to(p.dtype), p))  # one working copy; the inputs are not modified
    return reset / total if total else float("nan")


def reset_small_updates(model: ModelLike, base_model: ModelLike, tau: float) -> tuple[nn.Module, float]:
    r"""A copy of ``model``, each coordinate with :math:`|\theta_j - \theta_{0,j}| \le \tau` reset to the base's.

    Returns the copy (inputs untouched) and the fraction of compared coordinates reset (:func:`functional_sparsity`).
    Raises ``ValueError`` for a negative or non-finite ``tau`` or models that share no parameters / differ in shapes,
    ``TypeError`` for a state dict as ``model``.
    """
    (tau,) = check_taus_or_ts([tau], "tau", lo=0.0)  # finite, >= 0
    work, work_params, cur, base, names = _prepare(model, base_model)
    return work, _reset_into(work_params, cur, base, names, tau)


def functional_sparsity(
    model: ModelLike,
    base_model: ModelLike,
    taus: Sequence[float],
    reward_fn: Callable[[nn.Module], float] | None,
) -> dict:
    r"""Functional sparsity of a fine-tuning update (arXiv 2608.27351): the reward after resetting small updates.

    For each :math:`\tau`, :math:`\theta^{(\tau)}_j = \theta_{0,j}` where :math:`|\theta_j - \theta_{0,j}| \le \tau`,
    else :math:`\theta_j`; the fraction reset is :math:`\frac{1}{D}\sum_j \mathbb{1}[|\theta_j-\theta_{0,j}|\le\tau]`.

    Args:
        taus (Sequence[float]): thresholds, finite and >= 0, in parameter units.
        reward_fn (Callable[[nn.Module], float] | None): scores the copy once per tau, in eval mode, no grad.

    Returns:
        dict: ``{"taus", "fraction_reset", "reward" (None without reward_fn), "num_coordinates"}``.

    Raises:
        ValueError: for a bad or no tau, or models that share no parameters / differ in shapes.
        TypeError: for a state dict as ``model`` (it must be scored) or a ``reward_fn`` not callable.
    """
    taus = check_taus_or_ts(taus, "taus", lo=0.0)
    if reward_fn is not None and not callable(reward_fn):
        raise TypeError(f"`reward_fn` must be a callable model -> float or None, got {type(reward_fn).__name__}.")
    work, work_params, cur, base, names = _prepare(model, base_model)
    fractions, rewards = [], []
    for tau in taus:
        # tau = 0: the model as it is, and its untouched fraction
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


def _kept_count(fraction: float, numel: int) -> int:
    """``round(fraction * numel)``, halves up: the number of entries a fraction keeps (exact, no float drift)."""
    return min(numel, int(math.floor(fraction * numel + 0.5)))


def _check_fractions(fractions, modes) -> tuple[list[float], list[str]]:
    fractions = check_taus_or_ts(fractions, "fractions", lo=0.0, hi=1.0)
    modes = list(modes)
    if not modes or any(mode not in KEEP_MODES for mode in modes):  # an empty or unknown mode
        raise ValueError(f"mode must be one of {KEEP_MODES}; got {modes!r}.")
    return fractions, modes


class _UpdateOrder:
    """The entries of the update ``theta - theta_0`` ranked for keeping, per mode, computed once for every fraction."""

    def __init__(self, cur, base, names, seed: int):
        self.names, self.cur, self.base, self.seed = names, cur, base, seed
        self.numels = [cur[n].numel() for n in names]
        self._orders: dict[str, object] = {}  # mode -> ranking, computed on first use
        self._abs_deltas: list[torch.Tensor] | None = None

    def abs_deltas(self) -> list[torch.Tensor]:
        """``|theta - theta_0|`` of every compared tensor, flat, float32 on the CPU (computed once)."""
        if self._abs_deltas is None:
            self._abs_deltas = [(self.cur[n].detach().float().cpu() - self.base[n].detach().float().cpu()).abs()
                                .flatten() for n in self.names]
        return self._abs_deltas

    def order(self, mode: str):
        if mode not in self._orders:
            if mode == "global":
                flat = torch.cat(self.abs_deltas())  # entries concatenated in parameter order
                # largest first, ties by position
                self._orders[mode] = torch.argsort(flat, descending=True, stable=True)
            elif mode == "per_tensor":
                # per tensor, ties by position
                self._orders[mode] = [torch.argsort(d, descending=True, stable=True) for d in self.abs_deltas()]
            else:
                generator = torch.Generator().manual_seed(self.seed)  # a private generator: the global RNG is untouched
                # uniform without replacement
                self._orders[mode] = torch.randperm(sum(self.numels), generator=generator)
        return self._orders[mode]

    def masks(self, fraction: float, mode: str) -> tuple[list[torch.Tensor], int]:
        """One flat bool mask per compared tensor (``True``: keep the update there) and the number kept."""
        order = self.order(mode)
        if mode == "per_tensor":
            masks = []
            for tensor_order, numel in zip(order, self.numels, strict=True):
                mask = torch.zeros(numel, dtype=torch.bool)
                mask[tensor_order[: _kept_count(fraction, numel)]] = True  # round(f n) of this tensor
                masks.append(mask)
            return masks, sum(int(m.sum()) for m in masks)
        total = sum(self.numels)
        flat = torch.zeros(total, dtype=torch.bool)
        flat[order[: _kept_count(fraction, total)]] = True  # round(f D) of all entries
        return list(flat.split(self.numels)), int(flat.sum())


@torch.no_grad()
def _keep_into(work_params, cur, base, names, masks) -> None:
    for n, mask in zip(names, masks, strict=True):
        p = cur[n]
        # copied, not recomputed: fraction 1 is the model bitwise, 0 the base
        work_params[n].copy_(torch.where(mask.view(p.shape).to(p.device), p, base[n].to(p.device, p.dtype)))


def keep_update_fraction(
    model: ModelLike, base_model: ModelLike, fraction: float, mode: str = "global", seed: int = 0
) -> tuple[nn.Module, int]:
    r"""A copy of ``model`` keeping a ``fraction`` :math:`f` of its update :math:`\Delta`, the base elsewhere.

    ``mode`` (:data:`KEEP_MODES`): ``"global"``, the :math:`\mathrm{round}(f D)` largest :math:`|\Delta_j|` of all;
    ``"per_tensor"``, the :math:`\mathrm{round}(f n)` largest of each tensor; ``"random"``, as many drawn with ``seed``
    (the control of arXiv 2608.27351). Returns the copy (inputs untouched) and the number of entries kept; raises
    ``ValueError`` for a bad ``fraction`` or ``mode``, or models that share no parameters / differ in shapes.
    """
    (fraction,), (mode,) = _check_fractions([fraction], [mode])
    work, work_params, cur, base, names = _prepare(model, base_model)
    masks, kept = _UpdateOrder(cur, base, names, seed).masks(fraction, mode)  # True: the update is kept there
    _keep_into(work_params, cur, base, names, masks)
    return work, kept


def update_fraction_curve(
    model: ModelLike,
    base_model: ModelLike,
    fractions: Sequence[float],
    reward_fn: Callable[[nn.Module], float] | None,
    modes: Sequence[str] = KEEP_MODES,
    seed: int = 0,
) -> dict:
    r""":func:`keep_update_fraction`'s copy scored for every fraction and mode (arXiv 2608.27351, random as control).

    Args:
        fractions (Sequence[float]): fractions of entries kept, each in [0, 1] (e.g. 0.001 ... 1.0).
        reward_fn (Callable[[nn.Module], float] | None): scores the copy per (mode, fraction), in eval mode, no grad.
        modes (Sequence[str]): some of :data:`KEEP_MODES`; ``seed``: the random mode's permutation seed.

    Returns:
        dict: ``{"fractions", "num_coordinates", "kept": {mode: list[int]}, "reward": {mode: list[float]} | None}``.

    Raises:
        ValueError: for a bad or no fraction, no or an unknown mode, or models that differ.
        TypeError: if ``reward_fn`` is neither callable nor ``None``.
    """
    fractions, modes = _check_fractions(fractions, modes)
    if reward_fn is not None and not callable(reward_fn):
        raise TypeError(f"`reward_fn` must be a callable model -> float or None, got {type(reward_fn).__name__}.")
    work, work_params, cur, base, names = _prepare(model, base_model)
    order = _UpdateOrder(cur, base, names, seed)  # ranked once per mode, reused for every fraction
    kept = {mode: [] for mode in modes}  # entries kept per (mode, fraction)
    rewards = {mode: [] for mode in modes} if reward_fn is not None else None
    for mode in modes:
        for fraction in fractions:
            masks, count = order.masks(fraction, mode)
            _keep_into(work_params, cur, base, names, masks)
            kept[mode].append(count)
            if reward_fn is not None:
                with eval_mode(work), torch.no_grad():
                    rewards[mode].append(float(reward_fn(work)))
    return {"fractions": fractions, "num_coordinates": sum(order.numels), "kept": kept, "reward": rewards}
