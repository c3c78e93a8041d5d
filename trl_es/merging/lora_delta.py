"""Full-matrix LoRA deltas ``Delta_k = scaling_k * B_k @ A_k`` of K adapters trained on one base model.

The factors are read from peft's own ``LoraLayer`` objects (so ``rank_pattern``, ``alpha_pattern``, rsLoRA and
``fan_in_fan_out`` are handled by peft, not re-derived here) and kept as small fp32 copies; the full ``(out, in)``
matrices are built on demand, one module at a time, with the formula of peft's ``lora.Linear.get_delta_weight``
(Hu et al. 2021, "LoRA", Eq. 3: ``h = W0 x + (alpha / r) B A x``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from ..files import atomic_path, require_files, write_json


@dataclass
class LoraFactors:
    """The LoRA factors of one adapter on one module.

    Attributes:
        lora_A (`torch.Tensor`): Shape ``(r, in_features)``, float32.
        lora_B (`torch.Tensor`): Shape ``(out_features, r)``, float32.
        scaling (`float`): ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), as computed by peft.
        fan_in_fan_out (`bool`): Whether the base weight is stored ``(in, out)`` (GPT-2 ``Conv1D``).
    """

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float
    fan_in_fan_out: bool = False

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``scaling * B @ A`` (transposed for ``fan_in_fan_out``), as peft's ``get_delta_weight``.

        Returns:
            `torch.Tensor`: float32, the shape of the base layer's ``weight``.
        """
        a = self.lora_A.to(device) if device is not None else self.lora_A
        b = self.lora_B.to(device) if device is not None else self.lora_B
        delta = b @ a
        if self.fan_in_fan_out:
            delta = delta.T
        return delta * self.scaling


def _lora_layers(peft_model: PeftModel) -> list[tuple[str, LoraLayer]]:
    """``(name, layer)`` for every LoRA layer, ``name`` relative to the base model (``model.layers.0.self_attn.q_proj``)."""
    inner = peft_model.base_model.model if isinstance(peft_model, PeftModel) else peft_model
    return [(name, module) for name, module in inner.named_modules() if isinstance(module, LoraLayer)]


def extract_lora_factors(peft_model: PeftModel, adapter_name: str | None = None) -> dict[str, LoraFactors]:
    """Copy one adapter's factors out of a ``PeftModel`` (fp32, CPU).

    Args:
        peft_model (`PeftModel`): A model with LoRA adapters.
        adapter_name (`str`, *optional*): Which adapter; the active one by default.

    Returns:
        `dict[str, LoraFactors]`: By module name relative to the base model, in ``named_modules`` order.

    Raises:
        ValueError: for LoRA variants whose delta is not ``scaling * B @ A`` (DoRA, ``lora_bias``), LoRA on
            embeddings, or an adapter without LoRA layers.
        TypeError: for LoRA on layers other than peft's ``lora.Linear`` (convolutions, quantized layers).
    """
    if adapter_name is None:
        adapter_name = peft_model.active_adapter
        if isinstance(adapter_name, list):
            adapter_name = adapter_name[0]
    factors: dict[str, LoraFactors] = {}
    for name, layer in _lora_layers(peft_model):
        if adapter_name in getattr(layer, "lora_embedding_A", {}):
            raise ValueError(
                f"Module {name!r}: LoRA on embeddings is not supported by the merge (linear layers only)."
            )
        if adapter_name not in layer.lora_A:
            continue
        if not isinstance(layer, LoraLinear):
            raise TypeError(
                f"Module {name!r} is a {type(layer).__name__}; only peft `lora.Linear` layers are supported."
            )
        if layer.use_dora.get(adapter_name, False) or layer.lora_bias.get(adapter_name, False):
            raise ValueError(
                f"Adapter {adapter_name!r} on {name!r} uses DoRA or lora_bias: its delta is not scaling * B @ A, "
                "which the DARE-TIES merge needs."
            )
        factors[name] = LoraFactors(
            lora_A=layer.lora_A[adapter_name].weight.detach().float().cpu().clone(),
            lora_B=layer.lora_B[adapter_name].weight.detach().float().cpu().clone(),
            scaling=float(layer.scaling[adapter_name]),
            fan_in_fan_out=bool(layer.fan_in_fan_out),
        )
    if not factors:
        raise ValueError(f"Adapter {adapter_name!r} has no LoRA layers in this model.")
    return factors


class LoraDeltaSet:
    """The K LoRA adapters to merge, as factors per module; full deltas built on demand.

    Args:
        factors (`list[dict[str, LoraFactors]]`): One dict per adapter (module name -> factors). An adapter that does
            not target a module contributes a zero delta there.
        adapter_names (`list[str]`, *optional*): Names for logs and the genome JSON; ``adapter_0, ...`` by default.

    Raises:
        ValueError: if fewer than one adapter is given, or two adapters disagree on a module's shape.
    """

    def __init__(self, factors: Sequence[dict[str, LoraFactors]], adapter_names: Sequence[str] | None = None):
        if len(factors) < 1:
            raise ValueError("LoraDeltaSet needs at least one adapter.")
        self.factors = [dict(f) for f in factors]
        self.adapter_names = (
            list(adapter_names) if adapter_names is not None else [f"adapter_{k}" for k in range(len(factors))]
        )
        if len(self.adapter_names) != len(self.factors):
            raise ValueError(f"adapter_names has {len(self.adapter_names)} names for {len(self.factors)} adapters.")
        names: list[str] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        for k, adapter in enumerate(self.factors):
            for name, f in adapter.items():
                shape = (f.lora_B.shape[0], f.lora_A.shape[1])
                shape = shape[::-1] if f.fan_in_fan_out else shape
                if name not in self.shapes:
                    self.shapes[name] = shape
                    names.append(name)
                elif self.shapes[name] != shape:
                    raise ValueError(
                        f"Adapter {self.adapter_names[k]!r} has delta shape {shape} on {name!r}, other adapters "
                        f"{self.shapes[name]}: adapters must be trained on the same base model."
                    )
        self.module_names = names

    @property
    def num_adapters(self) -> int:
        return len(self.factors)

    def delta(self, name: str, k: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Adapter ``k``'s full delta on module ``name`` (float32; zeros if that adapter does not target it)."""
        f = self.factors[k].get(name)
        if f is None:
            return torch.zeros(self.shapes[name], dtype=torch.float32, device=device)
        return f.delta(device)

    def deltas(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """All K deltas of module ``name``.

        Returns:
            `torch.Tensor`: Shape ``(K, *weight.shape)``, float32.
        """
        return torch.stack([self.delta(name, k, device) for k in range(self.num_adapters)])

    def to(self, device: torch.device | str) -> LoraDeltaSet:
        """Move the (small) factors to ``device``, in place; returns ``self``."""
        for adapter in self.factors:
            for f in adapter.values():
                f.lora_A, f.lora_B = f.lora_A.to(device), f.lora_B.to(device)
        return self

    @classmethod
    def from_adapters(
        cls,
        base_model: nn.Module,
        adapters: Sequence[str | os.PathLike | PeftModel],
        adapter_names: Sequence[str] | None = None,
    ) -> LoraDeltaSet:
        """Read K adapters given as saved adapter folders and/or ``PeftModel`` objects.

        Folders are loaded onto ``base_model`` with ``PeftModel.from_pretrained`` / ``load_adapter`` and unloaded again
        with ``unload()``: the base model's weights are never changed and it is left without LoRA layers.

        Args:
            base_model (`nn.Module`): The base model the adapters were trained on (only used for folders).
            adapters (`Sequence[str | PathLike | PeftModel]`): K adapters; a ``PeftModel`` contributes its active adapter.
            adapter_names (`Sequence[str]`, *optional*): Names; the folder's base name (or ``adapter_k``) by default.

        Raises:
            ValueError: if no adapter is given, or the adapters do not fit the base model.
        """
        if len(adapters) == 0:
            raise ValueError("adapters is empty: give at least one LoRA adapter (a folder or a PeftModel).")
        if adapter_names is None:
            adapter_names = [
                os.path.basename(os.path.normpath(a)) if isinstance(a, (str, os.PathLike)) else f"adapter_{k}"
                for k, a in enumerate(adapters)
            ]
            if len(set(adapter_names)) != len(adapter_names):
                adapter_names = [f"adapter_{k}" for k in range(len(adapters))]
        factors: list[dict[str, LoraFactors] | None] = [None] * len(adapters)
        paths = [(k, os.fspath(a)) for k, a in enumerate(adapters) if isinstance(a, (str, os.PathLike))]
        for k, a in enumerate(adapters):
            if isinstance(a, PeftModel):
                factors[k] = extract_lora_factors(a)
            elif not isinstance(a, (str, os.PathLike)):
                raise TypeError(f"adapters[{k}] is a {type(a).__name__}; expected a folder path or a PeftModel.")
        if paths:
            tmp_names = [f"_hyper_es_{k}" for k, _ in paths]
            peft_model = PeftModel.from_pretrained(base_model, paths[0][1], adapter_name=tmp_names[0])
            try:
                for (k, path), tmp in zip(paths[1:], tmp_names[1:], strict=True):
                    peft_model.load_adapter(path, adapter_name=tmp)
                for (k, _), tmp in zip(paths, tmp_names, strict=True):
                    factors[k] = extract_lora_factors(peft_model, tmp)
            finally:
                peft_model.unload()
                for attr in ("peft_config", "_hf_peft_config_loaded"):
                    if attr in base_model.__dict__:
                        delattr(base_model, attr)
        return cls(factors, adapter_names)

    def check_model(self, model: nn.Module) -> None:
        """Raise ``ValueError`` unless every module exists in ``model`` with a ``weight`` of the delta's shape."""
        modules = dict(model.named_modules())
        for name in self.module_names:
            module = modules.get(name)
            if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
                raise ValueError(f"The adapters target {name!r}, which is not a module with a weight in the model.")
            if tuple(module.weight.shape) != self.shapes[name]:
                raise ValueError(
                    f"Module {name!r}: weight shape {tuple(module.weight.shape)} but the adapters' delta has shape "
                    f"{self.shapes[name]}: the adapters were trained on another base model."
                )


def low_rank_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` factorization of a delta by truncated SVD (Eckart-Young): ``delta ~= B @ A``.

    The singular values are split evenly (``B = U sqrt(S)``, ``A = sqrt(S) Vh``); when ``rank`` exceeds
    ``min(out, in)`` the factors are padded with zeros.

    Args:
        delta (`torch.Tensor`): Shape ``(out, in)``.
        rank (`int`): The LoRA rank ``r``.

    Returns:
        `(lora_A, lora_B)`: Shapes ``(r, in)`` and ``(out, r)``, float32.
    """
    u, s, vh = torch.linalg.svd(delta.float(), full_matrices=False)
    keep = min(rank, s.numel())
    root = s[:keep].sqrt()
    lora_b = torch.zeros(delta.shape[0], rank, dtype=torch.float32, device=delta.device)
    lora_a = torch.zeros(rank, delta.shape[1], dtype=torch.float32, device=delta.device)
    lora_b[:, :keep] = u[:, :keep] * root
    lora_a[:keep] = root[:, None] * vh[:keep]
    return lora_a, lora_b


def save_deltas_as_lora(
    deltas: dict[str, torch.Tensor],
    rank: int,
    output_dir: str | os.PathLike,
    base_model_name_or_path: str | None = None,
) -> LoraConfig:
    """Save full-matrix deltas as one peft LoRA adapter of rank ``rank`` (truncated SVD per module).

    The adapter has ``lora_alpha = r`` (scaling 1) and targets exactly the given modules; load it with
    ``PeftModel.from_pretrained(base_model, output_dir)``.

    Call it on the one process that writes (``HyperESTrainer.save_model`` does, under ``args.should_save``). The
    weights and ``hyper_es_export.json`` are written atomically (:func:`trl_es.files.atomic_path`), and the folder is
    checked at the end.

    Args:
        deltas (`dict[str, torch.Tensor]`): Module name (relative to the base model) -> ``(out, in)`` delta.
        rank (`int`): LoRA rank.
        output_dir: Folder for ``adapter_config.json`` and ``adapter_model.safetensors``.
        base_model_name_or_path (`str`, *optional*): Recorded in the adapter config.

    Returns:
        `LoraConfig`: The saved config.

    Raises:
        RuntimeError: if ``adapter_config.json`` or ``adapter_model.safetensors`` is missing afterwards.
    """
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}.")
    os.makedirs(output_dir, exist_ok=True)
    state = {}
    for name, delta in deltas.items():
        lora_a, lora_b = low_rank_factors(delta, rank)
        state[f"base_model.model.{name}.lora_A.weight"] = lora_a.cpu().contiguous()
        state[f"base_model.model.{name}.lora_B.weight"] = lora_b.cpu().contiguous()
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        target_modules=sorted(deltas),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )
    config.save_pretrained(os.fspath(output_dir))
    with atomic_path(os.path.join(output_dir, "adapter_model.safetensors")) as tmp:
        save_file(state, tmp, metadata={"format": "pt"})
    write_json(os.path.join(output_dir, "hyper_es_export.json"),
               {"rank": rank, "method": "truncated SVD of the merged full delta per module"})
    require_files(output_dir, ["adapter_config.json", "adapter_model.safetensors"], "the exported LoRA adapter")
    return config
