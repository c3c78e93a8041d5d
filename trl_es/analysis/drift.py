"""Parameter drift ||theta - theta_0|| of a fine-tuned checkpoint from its base, overall and per module type."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ._common import ModelLike, named_float_params, shared_names


__all__ = ["group_name", "parameter_drift", "tensor_drift"]

_LAYER_INDEX = re.compile(r"^\d+$")  # the 3 of model.layers.3


def group_name(param_name: str) -> str:
    """Module-type group of a parameter: the last module name before the leaf, layer indices dropped.

    ``model.layers.3.self_attn.q_proj.weight`` -> ``q_proj``, ``lm_head.weight`` -> ``lm_head``, ``weight`` as is.
    """
    parts = [p for p in param_name.split(".") if not _LAYER_INDEX.match(p)]  # every layer's q_proj forms one group
    if len(parts) <= 1:
        return parts[0] if parts else param_name
    return parts[-2]  # the module before the leaf (weight, bias)


def tensor_drift(
    params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], per_group: bool = True
) -> dict:
    r"""Parameter drift between two ``name -> tensor`` dicts (arXiv 2608.27351, arXiv 2604.01499).

    .. math::
        \|\theta - \theta_0\|_2 = \Big(\sum_j (\theta_j - \theta_{0,j})^2\Big)^{1/2}, \qquad
        \text{relative} = \|\theta - \theta_0\|_2 / \|\theta_0\|_2

    ``params`` and ``anchor`` are compared on the float tensors they share; ``per_group`` adds the drift per module
    type (:func:`group_name`).

    Returns:
        dict: ``{"l2", "relative", "base_l2", "numel"}`` (``relative`` ``nan`` when ``base_l2`` is 0), and
        ``"per_group": {group: {...}}`` when asked.

    Raises:
        ValueError: if the dicts share no floating-point name, or a shared name has different shapes.
        TypeError: if a value is not a tensor.
    """
    cur = named_float_params(params)
    ref = named_float_params(anchor)
    names = shared_names(cur, ref, labels=("params", "anchor"))  # float tensors in both dicts
    sums: dict[str, list] = {}
    total = [0.0, 0.0, 0]  # [squared drift, squared base norm, numel]
    with torch.no_grad():
        for name in names:
            p = cur[name]
            a = ref[name]
            if a.device != p.device:
                a = a.to(p.device, non_blocking=True)  # the anchor moves to the parameter's device
            p32 = p.float()  # differences in float32 (bf16/fp16 upcast), one temporary per tensor
            a32 = a.float()
            # squared norms accumulated in float64
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
    # relative is nan for a zero base
    return {"l2": l2, "relative": l2 / base if base > 0 else float("nan"), "base_l2": base, "numel": int(numel)}


def parameter_drift(model: ModelLike, base_model: ModelLike, per_group: bool = True) -> dict:
    r""":func:`tensor_drift` of ``model`` from ``base_model`` (modules, state dicts or checkpoint paths), overall and
    per module type; a ``peft.PeftModel`` compares through a merged copy (:math:`W + \Delta W`), tied weights once.

    Raises:
        ValueError: if the two share no float parameter name or shapes differ, or a PEFT model cannot be merged.
        TypeError: if an argument is of an unsupported type.
    """
    return tensor_drift(named_float_params(model), named_float_params(base_model), per_group=per_group)
