"""Parameter drift ||theta - theta_0|| of a fine-tuned checkpoint from its base, overall and per module type."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ._common import ModelLike, named_float_params, shared_names


__all__ = ["group_name", "parameter_drift", "tensor_drift"]

_LAYER_INDEX = re.compile(r"^\d+$")


def group_name(param_name: str) -> str:
    """Module-type group of a parameter: the last module name before the leaf (``weight``/``bias``/...), numeric
    layer indices dropped. ``model.layers.3.self_attn.q_proj.weight`` -> ``q_proj``; ``lm_head.weight`` ->
    ``lm_head``; a bare ``weight`` (no module) -> ``weight``."""
    parts = [p for p in param_name.split(".") if not _LAYER_INDEX.match(p)]
    if len(parts) <= 1:
        return parts[0] if parts else param_name
    return parts[-2]


def tensor_drift(
    params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], per_group: bool = True
) -> dict:
    r"""Parameter drift between two ``name -> tensor`` dicts (the cheap form, e.g. for logging during training).

    .. math::
        \|\theta - \theta_0\|_2 = \Big(\sum_j (\theta_j - \theta_{0,j})^2\Big)^{1/2}, \qquad
        \text{relative} = \|\theta - \theta_0\|_2 / \|\theta_0\|_2 ,

    the L2 distance from the initialisation used as the "how far did fine-tuning move" measure in the ES-vs-GRPO
    comparisons (e.g. arXiv 2608.27351, arXiv 2604.01499). Differences are taken in float32 (bf16/fp16 weights are
    upcast) and the squared norms accumulated in float64. Only floating-point tensors whose names appear in both dicts
    are compared; ``anchor`` tensors are moved to the device of the matching ``params`` tensor when they differ.
    Nothing is copied beyond one float32 temporary per tensor.

    Args:
        params (Mapping[str, Tensor]): current parameters, e.g. ``dict(model.named_parameters())``.
        anchor (Mapping[str, Tensor]): the reference parameters theta_0 with the same names and shapes.
        per_group (bool): also report the drift per module type (see :func:`parameter_drift`).

    Returns:
        dict: ``{"l2": float, "relative": float, "base_l2": float, "numel": int, "per_group": {group: {...}}}``;
        ``relative`` is ``nan`` when ``base_l2`` is 0. ``per_group`` is present only when ``per_group`` is True and
        holds the same four keys for each group.

    Raises:
        ValueError: if the dicts share no floating-point name, or a shared name has different shapes.
        TypeError: if a value is not a tensor.
    """
    cur = named_float_params(params)
    ref = named_float_params(anchor)
    names = shared_names(cur, ref, labels=("params", "anchor"))
    sums: dict[str, list] = {}
    total = [0.0, 0.0, 0]
    with torch.no_grad():
        for name in names:
            p = cur[name]
            a = ref[name]
            if a.device != p.device:
                a = a.to(p.device, non_blocking=True)
            p32 = p.float()
            a32 = a.float()
            diff_sq = torch.linalg.vector_norm(p32 - a32, dtype=torch.float64).item() ** 2
            base_sq = torch.linalg.vector_norm(a32, dtype=torch.float64).item() ** 2
            total[0] += diff_sq
            total[1] += base_sq
            total[2] += p.numel()
            if per_group:
                g = sums.setdefault(group_name(name), [0.0, 0.0, 0])
                g[0] += diff_sq
                g[1] += base_sq
                g[2] += p.numel()
    out = _summary(*total)
    if per_group:
        out["per_group"] = {g: _summary(*v) for g, v in sums.items()}
    return out


def _summary(diff_sq: float, base_sq: float, numel: int) -> dict:
    l2 = diff_sq**0.5
    base = base_sq**0.5
    return {"l2": l2, "relative": l2 / base if base > 0 else float("nan"), "base_l2": base, "numel": int(numel)}


def parameter_drift(model: ModelLike, base_model: ModelLike, per_group: bool = True) -> dict:
    r"""Parameter drift of ``model`` from ``base_model``: :math:`\|\theta-\theta_0\|_2` and
    :math:`\|\theta-\theta_0\|_2/\|\theta_0\|_2`, for the whole model and per module type.

    Formula and numerics as in :func:`tensor_drift` (float32 differences, float64 accumulation). Groups are module
    types: the last module name before the parameter leaf (``.weight``/``.bias``) with layer indices dropped, so
    ``model.layers.*.self_attn.q_proj.weight`` and ``...q_proj.bias`` of every layer form the group ``q_proj``;
    likewise ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, ``embed_tokens``,
    ``input_layernorm``, ``post_attention_layernorm``, ``norm`` (final norm), ``lm_head``.

    PEFT: a ``peft.PeftModel`` (either argument) is compared through a merged deep copy (``merge_and_unload``), i.e.
    the effective weights :math:`W + \Delta W` under the base architecture's parameter names, so a LoRA checkpoint
    and its plain base model compare directly; the inputs are not modified. Tied weights (e.g. ``lm_head`` tied to
    ``embed_tokens``) are counted once.

    Args:
        model (nn.Module | Mapping[str, Tensor] | str): fine-tuned model, its state dict, or a checkpoint path
            (loaded with ``AutoModelForCausalLM.from_pretrained``; a PEFT adapter dir with
            ``AutoPeftModelForCausalLM``).
        base_model (nn.Module | Mapping[str, Tensor] | str): the reference theta_0, same forms.
        per_group (bool): also report per-module-type drift.

    Returns:
        dict: ``{"l2", "relative", "base_l2", "numel", "per_group": {group: {"l2", "relative", "base_l2",
        "numel"}}}`` with float values (``numel`` int).

    Raises:
        ValueError: if the two share no floating-point parameter name or shapes differ; if a PEFT model cannot be
            merged.
        TypeError: if an argument is of an unsupported type.
    """
    return tensor_drift(named_float_params(model), named_float_params(base_model), per_group=per_group)
