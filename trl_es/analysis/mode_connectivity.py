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
        pa = a[n].to(dst.device).float()  # float32, then cast back to each parameter's dtype
        pb = b[n].to(dst.device).float()
        # torch.lerp(a, b, t) = a + t (b - a): exact at t = 0 and t = 1, and exactly a wherever a == b
        dst.copy_(torch.lerp(pa, pb, t).to(dst.dtype))


def interpolate_models(theta_a: ModelLike, theta_b: ModelLike, t: float):
    r"""The linear interpolation :math:`\theta(t) = (1 - t)\,\theta_A + t\,\theta_B` (Frankle et al. 2020).

    Args:
        theta_a, theta_b (nn.Module | Mapping[str, Tensor] | str): end points at ``t = 0`` and ``t = 1``, same shapes.
        t (float): finite; values outside [0, 1] extrapolate.

    Returns:
        nn.Module | dict[str, Tensor]: a new model (a copy of ``theta_a``, PEFT merged), or for a state dict a new one
        with the float entries shared with ``theta_b`` interpolated and the rest copied.

    Raises:
        ValueError: if ``t`` is not finite, or the two share no floating-point parameter / differ in shapes.
        TypeError: on unsupported argument types.
    """
    (t,) = check_taus_or_ts([t], "t")  # finite; outside [0, 1] extrapolates
    theta_a = load_model(theta_a)
    pb = named_float_params(theta_b)
    if isinstance(theta_a, nn.Module):
        source = merged_module(theta_a)
        out = copy.deepcopy(source) if source is theta_a else source  # a merged PEFT model already is a fresh copy
        pa = {n: p.detach() for n, p in source.named_parameters()}  # theta_A, tied weights once
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
    r"""Barrier of a curve :math:`v(t)` above (loss) or below (reward) its chord (Frankle et al. 2020, Sec. 2).

    :math:`\max_t [\ell(t) - v(t)]` for ``higher_is_better``, else :math:`\max_t [v(t) - \ell(t)]`, clipped at 0, with
    the chord :math:`\ell(t) = v(0) + t\,(v(1) - v(0))`; ``ts`` is the grid of ``values``, containing 0 and 1.

    Raises:
        ValueError: if lengths differ or 0 / 1 are not in ``ts``.
    """
    values = [float(v) for v in values]
    ts = [float(t) for t in ts]
    if len(values) != len(ts):
        raise ValueError(f"`values` ({len(values)}) and `ts` ({len(ts)}) must have the same length.")
    if 0.0 not in ts or 1.0 not in ts:
        raise ValueError("`ts` must contain the end points 0 and 1.")
    v0, v1 = values[ts.index(0.0)], values[ts.index(1.0)]  # the chord's end points
    worst = 0.0
    for t, v in zip(ts, values, strict=False):  # the largest gap to the chord, at least 0
        line = v0 + t * (v1 - v0)
        gap = (line - v) if higher_is_better else (v - line)  # a constant curve has barrier exactly 0
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

    ``reward_fn`` and/or ``loss_fn`` (higher / lower is better, e.g. :func:`lm_loss_fn`) along :math:`\theta(t)`
    (:func:`interpolate_models`) for each ``t`` in ``ts`` (in [0, 1]; 0 and 1 added, sorted), on one working copy in
    eval mode without grad, and their :func:`barrier` s (0 for a model with itself). PEFT models are merged.

    Returns:
        dict: ``{"ts", "reward", "loss", "reward_barrier", "loss_barrier"}`` (``None`` for a function not given).

    Raises:
        ValueError: if neither function is given, a t is outside [0, 1], or the models share no parameters / differ.
        TypeError: if ``model_a`` is a state dict or a function is not callable.
    """
    if reward_fn is None and loss_fn is None:
        raise ValueError("give at least one of `reward_fn` (higher is better) or `loss_fn` (lower is better).")
    for name, fn in (("reward_fn", reward_fn), ("loss_fn", loss_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"`{name}` must be a callable model -> float, got {type(fn).__name__}.")
    # the end points are needed by the barrier
    ts = sorted(set(check_taus_or_ts(ts, "ts", lo=0.0, hi=1.0)) | {0.0, 1.0})
    model_a = load_model(model_a)
    if not isinstance(model_a, nn.Module):
        raise TypeError("`model_a` must be a model or a checkpoint path, not a state dict (the path is scored).")
    source = merged_module(model_a)
    # one copy reused for all t; the inputs are not modified
    work = copy.deepcopy(source) if source is model_a else source
    pa = {n: p.detach() for n, p in source.named_parameters()}
    pb = named_float_params(model_b)
    names = shared_names(pa, pb, labels=("model_a", "model_b"))
    work_params = dict(work.named_parameters())
    rewards, losses = [], []
    for t in ts:
        _lerp_into(work_params, pa, pb, names, t)  # theta(t) written into the one working copy
        with eval_mode(work), torch.no_grad():
            if reward_fn is not None:
                rewards.append(float(reward_fn(work)))
            if loss_fn is not None:
                losses.append(float(loss_fn(work)))
    return {
        "ts": ts,
        "reward": rewards if reward_fn is not None else None,
        "loss": losses if loss_fn is not None else None,
        # a reward dips below its chord
        "reward_barrier": barrier(rewards, ts, higher_is_better=True) if reward_fn is not None else None,
        # a loss rises above it
        "loss_barrier": barrier(losses, ts, higher_is_better=False) if loss_fn is not None else None,
    }


def update_cosine(theta_a: ModelLike, theta_b: ModelLike, theta_0: ModelLike) -> float:
    r"""Cosine of two fine-tuning updates from a common base (arXiv 2604.01499), in float64, in [-1, 1].

    .. math::
        \cos(\Delta_A, \Delta_B) = \frac{\langle \Delta_A, \Delta_B \rangle}{\|\Delta_A\|_2\,\|\Delta_B\|_2},
        \qquad \Delta_X = \mathrm{vec}(\theta_X - \theta_0)

    Raises:
        ValueError: if an update is identically zero, or the checkpoints share no parameters / differ in shapes.
    """
    pa, pb, p0 = named_float_params(theta_a), named_float_params(theta_b), named_float_params(theta_0)
    # every float parameter shared by the three, tied weights once
    names = shared_names(pa, pb, p0, labels=("theta_a", "theta_b", "theta_0"))
    dot = na = nb = 0.0
    with torch.no_grad():
        for n in names:
            base = p0[n].double()  # float64 throughout
            da = pa[n].to(base.device).double() - base  # differences, dot product and norms in float64
            db = pb[n].to(base.device).double() - base
            dot += float(torch.dot(da.flatten(), db.flatten()))
            na += float(torch.dot(da.flatten(), da.flatten()))
            nb += float(torch.dot(db.flatten(), db.flatten()))
    for label, sq in (("theta_a", na), ("theta_b", nb)):
        if sq == 0.0:
            raise ValueError(f"the update `{label}` - `theta_0` is identically zero; its cosine is undefined.")
    return max(-1.0, min(1.0, dot / (na**0.5 * nb**0.5)))  # clipped: rounding may leave [-1, 1]


def lm_loss_fn(
    tokenizer, texts: Sequence, batch_size: int = 8, max_length: int | None = None
) -> Callable[[nn.Module], float]:
    r"""A ``loss_fn`` for :func:`mode_connectivity`: ``fn(model)``, the mean token NLL (nats, float32) on ``texts``.

    .. math:: \mathcal{L}(\theta) = -\frac{1}{|T|} \sum_{x} \sum_{t=2}^{|x|} \log p_\theta(x_t \mid x_{<t})

    Args:
        texts (Sequence[str | list[dict]]): evaluation texts; conversations go through the chat template.
        batch_size (int): texts per forward pass, >= 1.
        max_length (int | None): truncate each text to this many tokens (>= 2).

    Raises:
        ValueError: if ``texts`` is empty, ``batch_size`` < 1, ``max_length`` < 2, or no text has 2 tokens.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an integer >= 1, got {batch_size!r}.")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"`max_length` must be None or an integer >= 2, got {max_length!r}.")
    # conversations through the chat template
    encoded = [ids[:max_length] if max_length else ids for ids in encode_prompts(tokenizer, texts)]
    if not any(len(x) >= 2 for x in encoded):
        raise ValueError("`texts` must contain at least one text of 2 or more tokens.")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # any id: padding is masked out

    def loss(model: nn.Module) -> float:
        device = model_device(model)
        total, count = 0.0, 0
        with eval_mode(model), torch.inference_mode():
            for start in range(0, len(encoded), batch_size):
                chunk = encoded[start : start + batch_size]
                length = max(len(x) for x in chunk)
                ids = torch.tensor([x + [pad_id] * (length - len(x)) for x in chunk], device=device)
                mask = torch.tensor([[1] * len(x) + [0] * (length - len(x)) for x in chunk], device=device)
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # right-padded, float32
                # token t predicted from x_<t
                nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
                target_mask = mask[:, 1:].to(nll.dtype)  # padding masked
                total += float((nll.double() * target_mask).sum())  # summed in float64 over all texts' tokens
                count += int(target_mask.sum())
        return total / count

    return loss
