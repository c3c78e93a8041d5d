"""Shared helpers of the diagnostics: loading checkpoints, extracting comparable parameters, PEFT merging."""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Mapping

import torch
from torch import nn


ModelLike = nn.Module | Mapping | str | os.PathLike  # a module, a state dict or a checkpoint path



def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def load_model(model_or_path, device=None, model_kwargs: dict | None = None):
    """``model_or_path`` if a module or a state dict; a path loaded in eval mode on ``device`` (with ``model_kwargs``).

    Raises:
        TypeError: for anything else.
    """
    if isinstance(model_or_path, (nn.Module, Mapping)):
        return model_or_path
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(
            "expected an nn.Module, a state dict (Mapping[str, Tensor]) or a checkpoint path, "
            f"got {type(model_or_path).__name__}."
        )
    path = os.fspath(model_or_path)
    kwargs = dict(model_kwargs or {})
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "adapter_config.json")):  # a PEFT adapter folder
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, **kwargs)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device is not None:
        model = model.to(device)
    return model.eval()


def merged_module(model: nn.Module) -> nn.Module:
    """The plain module ``model`` computes with: a PEFT model's merged copy (base names), any other module as is.

    Raises:
        ValueError: if the adapters cannot be merged (``merge_and_unload``).
    """
    if not is_peft_model(model):
        return model
    merged = copy.deepcopy(model)  # the input is not modified
    try:
        return merged.merge_and_unload()
    except (AttributeError, NotImplementedError, ValueError) as err:
        raise ValueError(
            f"cannot merge the adapters of this PEFT model ({type(model.base_model).__name__}) into its base weights; "
            "weight-space diagnostics need a mergeable adapter (e.g. LoRA) or a plain model."
        ) from err


def named_float_params(obj) -> dict[str, torch.Tensor]:
    """Floating-point parameters of a module / state dict / checkpoint path, by name (detached, not copied), tied once.
    """
    obj = load_model(obj)
    if isinstance(obj, nn.Module):
        # named_parameters lists tied weights once
        return {n: p.detach() for n, p in merged_module(obj).named_parameters()}
    out: dict[str, torch.Tensor] = {}
    seen = set()
    for name, t in obj.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(t).__name__}, expected a torch.Tensor.")
        if not t.is_floating_point():
            continue
        if t.numel() > 0 and t.device.type != "meta":
            # an entry aliasing an earlier one (tied weights) is dropped
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if key in seen:
                continue
            seen.add(key)
        out[name] = t.detach()
    return out


def shared_names(*param_dicts: Mapping[str, torch.Tensor], labels: tuple[str, ...]) -> list[str]:
    """Names present in every dict, in the first's order; warns when the name sets differ.

    Raises:
        ValueError: when nothing is shared or a shape differs.
    """
    first = param_dicts[0]
    common = [n for n in first if all(n in d for d in param_dicts[1:])]
    if not common:
        examples = ", ".join(f"{lab}: {list(d)[:3]}" for lab, d in zip(labels, param_dicts, strict=False))
        raise ValueError(
            f"{' / '.join(labels)} share no floating-point parameter names ({examples}); pass checkpoints of the "
            "same architecture (PEFT models are merged to base names automatically)."
        )
    union = set().union(*(d.keys() for d in param_dicts))
    if len(union) != len(common):
        missing = sorted(union - set(common))
        warnings.warn(
            f"{len(missing)} parameter name(s) are not present in all of {', '.join(labels)} and are ignored, "
            f"e.g. {missing[:5]}.",
            stacklevel=3,
        )
    for n in common:
        shapes = [tuple(d[n].shape) for d in param_dicts]
        if len(set(shapes)) != 1:
            raise ValueError(
                f"parameter {n!r} has different shapes in {', '.join(labels)}: {shapes}; "
                "the checkpoints must share one architecture."
            )
    return common


def check_taus_or_ts(values, name: str, lo: float | None = None, hi: float | None = None) -> list[float]:
    """A non-empty list of finite floats within ``[lo, hi]``."""
    if isinstance(values, (int, float)):  # one number is a list of one
        values = [values]
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise TypeError(f"`{name}` must be a sequence of numbers, got {values!r}.") from err
    if not out:
        raise ValueError(f"`{name}` must contain at least one value.")
    for v in out:
        if not math.isfinite(v):
            raise ValueError(f"`{name}` must hold finite numbers, got {v}.")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"`{name}` values must lie in [{lo}, {hi}], got {v}.")
    return out


class eval_mode:
    """Context manager: put modules in eval mode and restore their previous training flags on exit."""

    def __init__(self, *modules: nn.Module):
        # each module once; state dicts skipped
        self.modules = [m for m in dict.fromkeys(modules) if isinstance(m, nn.Module)]

    def __enter__(self):
        self.flags = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
        return self

    def __exit__(self, *exc):
        for m, flag in zip(self.modules, self.flags, strict=False):
            m.train(flag)  # the training flags as they were
        return False
