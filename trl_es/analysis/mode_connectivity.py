"""Linear mode connectivity between two checkpoints, and the cosine between their updates."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..generation.base import model_device
from ._common import (
    ModelLike,
    check_taus_or_ts,
    eval_mode,
    load_model,
    merged_module,
    named_float_params,
    shared_names,
)
from .kl import encode_prompts


__all__ = ["barrier", "interpolate_models", "lm_loss_fn", "mode_connectivity", "update_cosine"]


@torch.no_grad()
def _lerp_into(target: Mapping[str, torch.Tensor], a, b, names, t: float) -> None:
    for n in names:
        dst = target[n]
        pa = a[n].to(dst.device).float()
        pb = b[n].to(dst.device).float()
        # torch.lerp(a, b, t) = a + t (b - a): exact at t = 0 and t = 1, and exactly a wherever a == b
        dst.copy_(torch.lerp(pa, pb, t).to(dst.dtype))


def interpolate_models(theta_a: ModelLike, theta_b: ModelLike, t: float):
    r"""The linear interpolation :math:`\theta(t) = (1 - t)\,\theta_A + t\,\theta_B`.

    Computed as ``torch.lerp`` in float32 (then cast back to each parameter's dtype), which is exactly
    :math:`\theta_A` at ``t = 0``, :math:`\theta_B` at ``t = 1``, and unchanged wherever the two agree.
    Linear mode connectivity: Frankle et al. 2020, "Linear Mode Connectivity and the Lottery Ticket Hypothesis";
    applied to ES vs GRPO fine-tuning in arXiv 2604.01499.

    Args:
        theta_a (nn.Module | Mapping[str, Tensor] | str): end point at ``t = 0``.
        theta_b (nn.Module | Mapping[str, Tensor] | str): end point at ``t = 1`` (same names and shapes).
        t (float): interpolation coefficient (finite; values outside [0, 1] extrapolate).

    Returns:
        nn.Module | dict[str, Tensor]: if ``theta_a`` is a model (or path), a new model (deep copy of
        ``theta_a``, PEFT merged) holding theta(t); if it is a state dict, a new state dict in which floating-point
        entries shared with ``theta_b`` are interpolated and the rest copied from ``theta_a``.

    Raises:
        ValueError: if ``t`` is not finite, or the two share no floating-point parameter / differ in shapes.
        TypeError: on unsupported argument types.
    """
    (t,) = check_taus_or_ts([t], "t")
    theta_a = load_model(theta_a)
    pb = named_float_params(theta_b)
    if isinstance(theta_a, nn.Module):
        source = merged_module(theta_a)
        out = copy.deepcopy(source) if source is theta_a else source
        pa = {n: p.detach() for n, p in source.named_parameters()}
        names = shared_names(pa, pb, labels=("theta_a", "theta_b"))
        _lerp_into(dict(out.named_parameters()), pa, pb, names, t)
        return out
    pa = named_float_params(theta_a)
    names = shared_names(pa, pb, labels=("theta_a", "theta_b"))
    # deepcopy keeps tensors that share storage (tied weights) shared, so aliases follow their interpolated twin
    out = copy.deepcopy({n: v.detach() if isinstance(v, torch.Tensor) else v for n, v in theta_a.items()})
    _lerp_into(out, pa, pb, names, t)
    return out


def barrier(values: Sequence[float], ts: Sequence[float], higher_is_better: bool) -> float:
    r"""Barrier height of a curve along the path, relative to the straight line between its end points.

    With :math:`v(t)` sampled on ``ts`` (which must contain 0 and 1) and the chord
    :math:`\ell(t) = v(0) + t\,(v(1) - v(0))`:

    - reward (``higher_is_better=True``): :math:`\max_t\, [\ell(t) - v(t)]`, clipped at 0;
    - loss (``higher_is_better=False``): :math:`\max_t\, [v(t) - \ell(t)]`, clipped at 0.

    Frankle et al. 2020 (Sec. 2) define the error barrier this way; arXiv 2604.01499 uses it between ES and GRPO
    solutions. A constant curve has barrier exactly 0.

    Args:
        values (Sequence[float]): :math:`v(t)` for each t.
        ts (Sequence[float]): the grid, same length, containing 0 and 1.
        higher_is_better (bool): True for rewards/accuracies, False for losses.

    Returns:
        float: the barrier, >= 0.

    Raises:
        ValueError: if lengths differ or 0 / 1 are not in ``ts``.
    """
    values = [float(v) for v in values]
    ts = [float(t) for t in ts]
    if len(values) != len(ts):
        raise ValueError(f"`values` ({len(values)}) and `ts` ({len(ts)}) must have the same length.")
    if 0.0 not in ts or 1.0 not in ts:
        raise ValueError("`ts` must contain the end points 0 and 1.")
    v0, v1 = values[ts.index(0.0)], values[ts.index(1.0)]
    worst = 0.0
    for t, v in zip(ts, values, strict=False):
        line = v0 + t * (v1 - v0)
        gap = (line - v) if higher_is_better else (v - line)
        worst = max(worst, gap)
    return worst


def mode_connectivity(
    model_a: ModelLike,
    model_b: ModelLike,
    ts: Sequence[float] = tuple(i / 10 for i in range(11)),
    reward_fn: Callable[[nn.Module], float] | None = None,
    loss_fn: Callable[[nn.Module], float] | None = None,
) -> dict:
    r"""Linear mode connectivity between two checkpoints (Frankle et al. 2020; arXiv 2604.01499 for ES vs GRPO).

    Evaluates ``reward_fn`` and/or ``loss_fn`` along :math:`\theta(t) = (1-t)\,\theta_A + t\,\theta_B` (see
    :func:`interpolate_models`) for every ``t`` in ``ts`` (0 and 1 are added if missing; the grid is sorted), and the
    barriers

    .. math::
        B_r = \max\Big(0, \max_t\, \big[(1-t)\,r(0) + t\,r(1) - r(t)\big]\Big), \qquad
        B_\ell = \max\Big(0, \max_t\, \big[\ell(t) - (1-t)\,\ell(0) - t\,\ell(1)\big]\Big).

    A small barrier means the two solutions lie in one linearly connected basin. The barrier of a model with itself
    is 0. One deep copy of ``model_a`` is reused for all t; the inputs are not modified. The functions are called
    on that copy in eval mode under ``torch.no_grad()``.

    Args:
        model_a (nn.Module | str): end point at t = 0 (PEFT models are merged into a plain copy).
        model_b (nn.Module | Mapping[str, Tensor] | str): end point at t = 1, same architecture.
        ts (Sequence[float]): grid of t in [0, 1].
        reward_fn (Callable[[nn.Module], float] | None): scores a model, higher is better.
        loss_fn (Callable[[nn.Module], float] | None): a loss, lower is better (e.g. :func:`lm_loss_fn`).

    Returns:
        dict: ``{"ts": list[float], "reward": list[float] | None, "loss": list[float] | None,
        "reward_barrier": float | None, "loss_barrier": float | None}``.

    Raises:
        ValueError: if neither ``reward_fn`` nor ``loss_fn`` is given, a t is outside [0, 1], or the models share no
            parameters / differ in shapes.
        TypeError: if ``model_a`` is a state dict or a function is not callable.
    """
    if reward_fn is None and loss_fn is None:
        raise ValueError("give at least one of `reward_fn` (higher is better) or `loss_fn` (lower is better).")
    for name, fn in (("reward_fn", reward_fn), ("loss_fn", loss_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"`{name}` must be a callable model -> float, got {type(fn).__name__}.")
    ts = sorted(set(check_taus_or_ts(ts, "ts", lo=0.0, hi=1.0)) | {0.0, 1.0})
    model_a = load_model(model_a)
    if not isinstance(model_a, nn.Module):
        raise TypeError("`model_a` must be a model or a checkpoint path, not a state dict (the path is scored).")
    source = merged_module(model_a)
    work = copy.deepcopy(source) if source is model_a else source
    pa = {n: p.detach() for n, p in source.named_parameters()}
    pb = named_float_params(model_b)
    names = shared_names(pa, pb, labels=("model_a", "model_b"))
    work_params = dict(work.named_parameters())
    rewards, losses = [], []
    for t in ts:
        _lerp_into(work_params, pa, pb, names, t)
        with eval_mode(work), torch.no_grad():
            if reward_fn is not None:
                rewards.append(float(reward_fn(work)))
            if loss_fn is not None:
                losses.append(float(loss_fn(work)))
    return {
        "ts": ts,
        "reward": rewards if reward_fn is not None else None,
        "loss": losses if loss_fn is not None else None,
        "reward_barrier": barrier(rewards, ts, higher_is_better=True) if reward_fn is not None else None,
        "loss_barrier": barrier(losses, ts, higher_is_better=False) if loss_fn is not None else None,
    }


def update_cosine(theta_a: ModelLike, theta_b: ModelLike, theta_0: ModelLike) -> float:
    r"""Cosine similarity between two fine-tuning updates from a common base.

    .. math::
        \cos(\Delta_A, \Delta_B) = \frac{\langle \Delta_A, \Delta_B \rangle}{\|\Delta_A\|_2\,\|\Delta_B\|_2},
        \qquad \Delta_X = \mathrm{vec}(\theta_X - \theta_0),

    flattened over all floating-point parameters shared by the three (tied weights once, PEFT merged), with the
    differences, dot product and norms in float64. Used in arXiv 2604.01499 to compare ES and GRPO update directions.

    Args:
        theta_a (nn.Module | Mapping[str, Tensor] | str): first fine-tuned checkpoint.
        theta_b (nn.Module | Mapping[str, Tensor] | str): second fine-tuned checkpoint.
        theta_0 (nn.Module | Mapping[str, Tensor] | str): their common base.

    Returns:
        float: the cosine in [-1, 1].

    Raises:
        ValueError: if an update is identically zero (cosine undefined), or the checkpoints share no parameters /
            differ in shapes.
    """
    pa, pb, p0 = named_float_params(theta_a), named_float_params(theta_b), named_float_params(theta_0)
    names = shared_names(pa, pb, p0, labels=("theta_a", "theta_b", "theta_0"))
    dot = na = nb = 0.0
    with torch.no_grad():
        for n in names:
            base = p0[n].double()
            da = pa[n].to(base.device).double() - base
            db = pb[n].to(base.device).double() - base
            dot += float(torch.dot(da.flatten(), db.flatten()))
            na += float(torch.dot(da.flatten(), da.flatten()))
            nb += float(torch.dot(db.flatten(), db.flatten()))
    for label, sq in (("theta_a", na), ("theta_b", nb)):
        if sq == 0.0:
            raise ValueError(f"the update `{label}` - `theta_0` is identically zero; its cosine is undefined.")
    return max(-1.0, min(1.0, dot / (na**0.5 * nb**0.5)))


def lm_loss_fn(
    tokenizer, texts: Sequence, batch_size: int = 8, max_length: int | None = None
) -> Callable[[nn.Module], float]:
    r"""A ``loss_fn`` for :func:`mode_connectivity`: the mean token negative log-likelihood of a model on ``texts``.

    .. math:: \mathcal{L}(\theta) = -\frac{1}{|T|} \sum_{x} \sum_{t=2}^{|x|} \log p_\theta(x_t \mid x_{<t}),

    averaged over all predicted tokens of all texts (padding masked), log-probabilities in float32.

    Args:
        tokenizer (PreTrainedTokenizerBase): tokenizer of the models.
        texts (Sequence[str | list[dict]]): evaluation texts; conversations are rendered with the chat template.
        batch_size (int): texts per forward pass, >= 1.
        max_length (int | None): truncate each text to this many tokens (>= 2) if given.

    Returns:
        Callable[[nn.Module], float]: ``fn(model)`` -> mean token NLL in nats.

    Raises:
        ValueError: if ``texts`` is empty, ``batch_size`` < 1, ``max_length`` < 2, or no text has 2 tokens.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an integer >= 1, got {batch_size!r}.")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"`max_length` must be None or an integer >= 2, got {max_length!r}.")
    encoded = [ids[:max_length] if max_length else ids for ids in encode_prompts(tokenizer, texts)]
    if not any(len(x) >= 2 for x in encoded):
        raise ValueError("`texts` must contain at least one text of 2 or more tokens.")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def loss(model: nn.Module) -> float:
        device = model_device(model)
        total, count = 0.0, 0
        with eval_mode(model), torch.inference_mode():
            for start in range(0, len(encoded), batch_size):
                chunk = encoded[start : start + batch_size]
                length = max(len(x) for x in chunk)
                ids = torch.tensor([x + [pad_id] * (length - len(x)) for x in chunk], device=device)
                mask = torch.tensor([[1] * len(x) + [0] * (length - len(x)) for x in chunk], device=device)
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
                nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
                target_mask = mask[:, 1:].to(nll.dtype)
                total += float((nll.double() * target_mask).sum())
                count += int(target_mask.sum())
        return total / count

    return loss
