"""Functional sparsity: how much of a fine-tuning update can be reset to the base weights without losing reward.

Two views of arXiv 2608.27351's claim that ES's task gains come from a sparse subset of larger-magnitude updates:
by a threshold on the update's magnitude (:func:`functional_sparsity`) and by keeping a fraction of its entries,
largest first, against a random fraction as the control (:func:`keep_update_fraction`, :func:`update_fraction_curve`).
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
KEEP_MODES = ("global", "per_tensor", "random")


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


def _kept_count(fraction: float, numel: int) -> int:
    """``round(fraction * numel)``, halves up: the number of entries a fraction keeps (exact, no float drift)."""
    return min(numel, int(math.floor(fraction * numel + 0.5)))


def _check_fractions(fractions, modes) -> tuple[list[float], list[str]]:
    fractions = check_taus_or_ts(fractions, "fractions", lo=0.0, hi=1.0)
    modes = list(modes)
    if not modes or any(mode not in KEEP_MODES for mode in modes):
        raise ValueError(f"mode must be one of {KEEP_MODES}; got {modes!r}.")
    return fractions, modes


class _UpdateOrder:
    """The entries of the update ``theta - theta_0`` ranked for keeping, per mode (computed once, reused for every
    fraction): ``global``, by ``|delta|`` over all compared entries, largest first, ties by position (a stable sort
    of the entries concatenated in parameter order); ``per_tensor``, the same within each tensor; ``random``, a
    permutation of all entries from ``torch.Generator().manual_seed(seed)``."""

    def __init__(self, cur, base, names, seed: int):
        self.names, self.cur, self.base, self.seed = names, cur, base, seed
        self.numels = [cur[n].numel() for n in names]
        self._orders: dict[str, object] = {}
        self._abs_deltas: list[torch.Tensor] | None = None

    def abs_deltas(self) -> list[torch.Tensor]:
        """``|theta - theta_0|`` of every compared tensor, flat, in float32 on the CPU (computed once, for every
        magnitude mode)."""
        if self._abs_deltas is None:
            self._abs_deltas = [(self.cur[n].detach().float().cpu() - self.base[n].detach().float().cpu()).abs()
                                .flatten() for n in self.names]
        return self._abs_deltas

    def order(self, mode: str):
        if mode not in self._orders:
            if mode == "global":
                flat = torch.cat(self.abs_deltas())
                self._orders[mode] = torch.argsort(flat, descending=True, stable=True)
            elif mode == "per_tensor":
                self._orders[mode] = [torch.argsort(d, descending=True, stable=True) for d in self.abs_deltas()]
            else:
                generator = torch.Generator().manual_seed(self.seed)
                self._orders[mode] = torch.randperm(sum(self.numels), generator=generator)
        return self._orders[mode]

    def masks(self, fraction: float, mode: str) -> tuple[list[torch.Tensor], int]:
        """One flat bool mask per compared tensor (``True``: keep the update there) and the number kept."""
        order = self.order(mode)
        if mode == "per_tensor":
            masks = []
            for tensor_order, numel in zip(order, self.numels, strict=True):
                mask = torch.zeros(numel, dtype=torch.bool)
                mask[tensor_order[: _kept_count(fraction, numel)]] = True
                masks.append(mask)
            return masks, sum(int(m.sum()) for m in masks)
        total = sum(self.numels)
        flat = torch.zeros(total, dtype=torch.bool)
        flat[order[: _kept_count(fraction, total)]] = True
        return list(flat.split(self.numels)), int(flat.sum())


@torch.no_grad()
def _keep_into(work_params, cur, base, names, masks) -> None:
    for n, mask in zip(names, masks, strict=True):
        p = cur[n]
        work_params[n].copy_(torch.where(mask.view(p.shape).to(p.device), p, base[n].to(p.device, p.dtype)))


def keep_update_fraction(
    model: ModelLike, base_model: ModelLike, fraction: float, mode: str = "global", seed: int = 0
) -> tuple[nn.Module, int]:
    r"""A copy of ``model`` that keeps a fraction of its update :math:`\Delta = \theta - \theta_0` and resets the
    rest to :math:`\theta_0` (arXiv 2608.27351, functional sparsity: "a sparse subset of larger-magnitude updates").

    Entry :math:`j` of the copy is :math:`\theta_j` where it is kept and :math:`\theta_{0,j}` elsewhere (copied, not
    recomputed: ``fraction = 1`` gives the model's weights bitwise, ``fraction = 0`` the base's). ``mode``:

    - ``"global"``: the :math:`k = \mathrm{round}(f D)` entries of largest :math:`|\Delta_j|` over all :math:`D`
      compared entries (ties by parameter order, then position);
    - ``"per_tensor"``: in every tensor of :math:`n` entries, its :math:`\mathrm{round}(f n)` largest;
    - ``"random"``: :math:`k` entries drawn uniformly without replacement (``seed``), the control.

    :math:`\mathrm{round}` is half up. :math:`|\Delta|` is computed in float32. All floating-point parameters
    shared by name are compared (tied weights once; PEFT models are merged into a plain copy first).

    Args:
        model (nn.Module | str): the fine-tuned model.
        base_model (nn.Module | Mapping[str, Tensor] | str): the base weights theta_0 (same architecture).
        fraction (float): the fraction of entries kept, in [0, 1].
        mode (str): one of :data:`KEEP_MODES`.
        seed (int): the random mode's permutation seed.

    Returns:
        tuple[nn.Module, int]: the copy (inputs untouched) and the number of entries kept.

    Raises:
        ValueError: if ``fraction`` is outside [0, 1] or not finite, ``mode`` is unknown, or the models share no
            parameters / differ in shapes.
    """
    (fraction,), (mode,) = _check_fractions([fraction], [mode])
    work, work_params, cur, base, names = _prepare(model, base_model)
    masks, kept = _UpdateOrder(cur, base, names, seed).masks(fraction, mode)
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
    r"""The reward of the model with only a fraction of its update kept, for every fraction and mode
    (:func:`keep_update_fraction`; arXiv 2608.27351, functional sparsity, with a random fraction as the control).

    The ranking of the update's entries is computed once per mode and reused for every fraction; all copies are
    written into one working copy of ``model``.

    Args:
        model (nn.Module | str): the fine-tuned model.
        base_model (nn.Module | Mapping[str, Tensor] | str): the base weights theta_0.
        fractions (Sequence[float]): fractions of entries kept, each in [0, 1] (e.g. 0.001 ... 1.0).
        reward_fn (Callable[[nn.Module], float] | None): scores a model; called once per (mode, fraction) on the
            copy, in eval mode under ``torch.no_grad()``. ``None`` reports the counts only.
        modes (Sequence[str]): some of :data:`KEEP_MODES`.
        seed (int): the random mode's permutation seed.

    Returns:
        dict: ``{"fractions": list[float], "num_coordinates": int, "kept": {mode: list[int]},
        "reward": {mode: list[float]} | None}``.

    Raises:
        ValueError: for a fraction outside [0, 1], an empty ``fractions`` or ``modes``, an unknown mode, or models
            that share no parameters / differ in shapes.
        TypeError: if ``reward_fn`` is neither callable nor ``None``.
    """
    fractions, modes = _check_fractions(fractions, modes)
    if reward_fn is not None and not callable(reward_fn):
        raise TypeError(f"`reward_fn` must be a callable model -> float or None, got {type(reward_fn).__name__}.")
    work, work_params, cur, base, names = _prepare(model, base_model)
    order = _UpdateOrder(cur, base, names, seed)
    kept = {mode: [] for mode in modes}
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
