"""The deltas of K LoRA adapters trained on one base model, read with every field peft can put in an adapter.

A LoRA module contributes ``Delta = scaling * B @ A`` (Hu et al. 2021, "LoRA", Eq. 3), kept as fp32 factors
([`LoraFactors`]); a tensor the adapter *replaces* (``modules_to_save``, trained biases, ``trainable_token_indices``)
becomes a dense task vector ``adapter - base`` ([`DenseDelta`]). ``docs/hyper_es.md`` ("Adapter fields") lists
every ``LoraConfig`` field and how it is handled.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftConfig, PeftModel
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, load_peft_weights, set_peft_model_state_dict
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

from ..files import atomic_path, require_files, write_json


_PREFIX = "base_model.model."  # of every key in a saved peft state dict
_FACTOR_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_TOKENS_SUFFIX = ".token_adapter.trainable_tokens_delta"
_TMP_ADAPTER = "_hyper_es"  # the adapter name _load_factors builds on the base model and unloads
_PLAIN_VARIANTS = {"MiCALinearVariant"}  # LoRA variants whose delta is scaling * B @ A (peft: "identical to vanilla")

BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
"""``init_lora_weights`` values (prefixes) for which peft rewrites the base weights: the adapter is relative to them."""

_RETRAIN = "retrain the adapter without it, or merge it into the base with peft's merge_and_unload() outside Hyper-ES"
_REFUSED_FIELDS = {
    "use_dora": ("(DoRA) rescales each column by a learned magnitude: the update is not a delta that adds", _RETRAIN),
    "lora_bias": ("adds a learned bias to lora_B, a delta the merge does not carry", _RETRAIN),
    "target_parameters": ("puts LoRA on raw parameters (peft's ParamWrapper), which the merge does not read",
                          "target the modules with target_modules instead"),
    "use_qalora": ("(QA-LoRA) applies B @ A to group-pooled inputs of a quantized layer: not a weight delta",
                   _RETRAIN),
    "layer_replication": ("stacks copies of base layers: the adapted model is not the base architecture",
                          "merge it with peft's merge_and_unload() and use that model as the base"),
    "megatron_config": ("builds Megatron parallel LoRA layers, which the merge does not read", _RETRAIN),
}
_VARIANT = ("selects a LoRA variant whose forward is not W0 + scaling * B @ A", _RETRAIN)


def check_adapter_config(config: PeftConfig, adapter_name: str) -> None:
    """Refuse an adapter whose config asks for something a merge of deltas cannot represent: another peft method
    than LoRA, a field of ``_REFUSED_FIELDS``, a LoRA variant, or an ``init_lora_weights`` of [`BASE_MODIFYING_INITS`].

    Raises:
        ValueError: naming the adapter (``adapter_name``), the field, its value and what to do.
    """
    if not isinstance(config, LoraConfig):
        kind = getattr(config, "peft_type", type(config).__name__)
        raise ValueError(f"Adapter {adapter_name!r} is a {kind} adapter; Hyper-ES merges LoRA adapters only.")
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        # peft tags every variant field (velora_config, alora_invocation_tokens, use_bdlora, ...) "is_lora_variant"
        if not value or not (field.name in _REFUSED_FIELDS or field.metadata.get("is_lora_variant")):
            continue
        why, todo = _REFUSED_FIELDS.get(field.name, _VARIANT)
        raise ValueError(f"Adapter {adapter_name!r}: {field.name}={value!r} {why}; {todo}.")
    init = config.init_lora_weights
    # one saved with path_initial_model_for_weight_conversion has init True again: a plain adapter, accepted
    if isinstance(init, str) and init.lower().startswith(BASE_MODIFYING_INITS):
        raise ValueError(
            f"Adapter {adapter_name!r}: init_lora_weights={init!r} changes the base weights when the adapter is "
            "created, so its B @ A is relative to a modified base; save it with save_pretrained(..., "
            "path_initial_model_for_weight_conversion=<folder of the initial adapter>), which converts it into a plain "
            "LoRA adapter of the original base, and merge that."
        )


@dataclass
class LoraFactors:
    """The LoRA factors of one adapter on one module: ``lora_A`` of shape ``(r, in_features)`` and ``lora_B`` of shape
    ``(out_features, r)``, float32; ``scaling`` as peft computes it; ``fan_in_fan_out``: the base weight is stored
    ``(in, out)`` (GPT-2 ``Conv1D``)."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float
    fan_in_fan_out: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the base weight (and of :meth:`delta`)."""
        shape = (self.lora_B.shape[0], self.lora_A.shape[1])
        return shape[::-1] if self.fan_in_fan_out else shape

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``scaling * B @ A`` (transposed for ``fan_in_fan_out``), as peft's ``get_delta_weight``.

        Returns:
            `torch.Tensor`: float32, the shape of the base layer's ``weight``.
        """
        a = self.lora_A.to(device) if device is not None else self.lora_A
        b = self.lora_B.to(device) if device is not None else self.lora_B
        delta = b @ a  # peft's lora.Linear.get_delta_weight, in float32
        if self.fan_in_fan_out:
            delta = delta.T
        return delta * self.scaling

    def to(self, device: torch.device | str) -> LoraFactors:
        self.lora_A, self.lora_B = self.lora_A.to(device), self.lora_B.to(device)
        return self


@dataclass
class DenseDelta:
    """A dense delta ``adapter tensor - base tensor`` (``value``: float32, the base tensor's shape) of one adapter on
    a tensor it replaces; ``field``: ``"modules_to_save"``, ``"bias"``, ``"trainable_token_indices"`` or
    ``"save_embedding_layers"``."""

    value: torch.Tensor
    field: str = "modules_to_save"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The delta (float32, the shape of the base tensor)."""
        # no copy: callers must not modify the result in place
        return self.value.to(device) if device is not None else self.value

    def to(self, device: torch.device | str) -> DenseDelta:
        self.value = self.value.to(device)
        return self


def delta_name(parameter_name: str) -> str:
    """The name a delta on a parameter goes by: the module name for a ``weight`` (``lm_head.weight`` -> ``lm_head``,
    as for LoRA deltas), else the parameter name (``model.layers.0.self_attn.q_proj.bias``)."""
    return parameter_name.removesuffix(".weight")


def target_tensor(model: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor of ``model`` that the delta ``name`` is added to (see [`delta_name`]), or ``None``."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if module is not None:  # a module name: its weight (LoRA targets, modules_to_save, embeddings)
        weight = getattr(module, "weight", None)
        return weight if isinstance(weight, torch.Tensor) else None
    try:
        return model.get_parameter(name)  # else a parameter name (a trained bias)
    except AttributeError:
        return None


def _lora_layers(peft_model: PeftModel) -> list[tuple[str, LoraLayer]]:
    """``(name, layer)`` for every LoRA layer, ``name`` relative to the base model
    (``model.layers.0.self_attn.q_proj``)."""
    # names relative to the base model: below PeftModel's base_model.model wrappers
    inner = peft_model.base_model.model if isinstance(peft_model, PeftModel) else peft_model
    return [(name, module) for name, module in inner.named_modules() if isinstance(module, LoraLayer)]


def _active_adapter(peft_model: PeftModel) -> str:
    name = peft_model.active_adapter
    # a list when several adapters are active; the first one counts
    return name[0] if isinstance(name, list) else name


def extract_lora_factors(peft_model: PeftModel, adapter_name: str | None = None) -> dict[str, LoraFactors]:
    """Copy one adapter's LoRA factors (the active one by default) out of a ``PeftModel`` (fp32, CPU), by module name
    relative to the base model, in ``named_modules`` order; the other tensors are [`dense_deltas`]'s.

    Raises:
        ValueError: for LoRA variants whose delta is not ``scaling * B @ A`` (DoRA, ``lora_bias``, other variants),
            LoRA on embeddings, or an adapter without LoRA layers.
        TypeError: for LoRA on layers other than peft's ``lora.Linear`` (convolutions, quantized layers).
    """
    if adapter_name is None:
        adapter_name = _active_adapter(peft_model)
    factors: dict[str, LoraFactors] = {}
    # r/lora_alpha, rank_pattern, alpha_pattern, rsLoRA, target_modules, exclude_modules, layers_to_transform: all
    # resolved by peft in its own layers, read here, never re-derived
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
        variant = getattr(layer, "lora_variant", {}).get(adapter_name)
        # a variant whose forward is still scaling * B @ A (MiCA) merges like plain LoRA
        plain_variant = variant is None or type(variant).__name__ in _PLAIN_VARIANTS
        if layer.use_dora.get(adapter_name, False) or layer.lora_bias.get(adapter_name, False) or not plain_variant:
            raise ValueError(
                f"Adapter {adapter_name!r} on {name!r} uses DoRA, lora_bias or a LoRA variant "
                f"({type(variant).__name__ if variant else 'none'}): its delta is not scaling * B @ A, which the "
                "DARE-TIES merge needs."
            )
        factors[name] = LoraFactors(
            lora_A=layer.lora_A[adapter_name].weight.detach().float().cpu().clone(),
            lora_B=layer.lora_B[adapter_name].weight.detach().float().cpu().clone(),
            scaling=float(layer.scaling[adapter_name]),  # lora_alpha / r, or / sqrt(r) with rsLoRA
            fan_in_fan_out=bool(layer.fan_in_fan_out),
        )
    if not factors:
        raise ValueError(f"Adapter {adapter_name!r} has no LoRA layers in this model.")
    return factors


def _token_indices(config: LoraConfig, module_name: str, adapter_name: str) -> list[int]:
    """The rows ``trainable_token_indices`` trains in module ``module_name`` (a list: the input embedding's)."""
    spec = config.trainable_token_indices
    if not isinstance(spec, Mapping):  # a bare list is for the input embedding
        return list(spec)
    found = [v for k, v in spec.items() if module_name == k or module_name.endswith("." + k)]
    if len(found) != 1:
        raise ValueError(
            f"Adapter {adapter_name!r}: trainable_token_indices={spec!r} has {len(found)} entries for {module_name!r}."
        )
    return list(found[0])


def dense_deltas(
    base_model: nn.Module, state: Mapping[str, torch.Tensor], config: LoraConfig, adapter_name: str
) -> dict[str, DenseDelta]:
    """The adapter's tensors that replace base tensors (every tensor of ``state`` other than a ``lora_A``/``lora_B``
    weight), as dense deltas ``adapter - base`` (fp32, CPU) by delta name ([`delta_name`]). ``state``: peft's saved
    format, keys ``base_model.model.<path>``; ``base_model`` is read, never written.

    Raises:
        ValueError: for a tensor with no parameter of that name and shape in ``base_model`` (e.g. a DoRA magnitude),
            or a replaced tensor that the base model ties to another parameter the adapter does not replace alike.
    """
    params = dict(base_model.named_parameters(remove_duplicate=False))
    saved: dict[str, tuple[str, torch.Tensor]] = {}  # base parameter -> (saved key, saved tensor)
    for key, value in state.items():
        if not key.endswith(_FACTOR_SUFFIXES):
            # the saved key back to the base parameter's name
            param = key.removeprefix(_PREFIX).replace(".base_layer.", ".").replace(_TOKENS_SUFFIX, ".weight")
            if param not in params:
                raise ValueError(
                    f"Adapter {adapter_name!r}: tensor {key!r} is neither a lora_A/lora_B weight nor a parameter of "
                    "the base model, so the merge cannot carry it (is the adapter for this base model?)."
                )
            saved[param] = (key, value.detach())
    out: dict[str, DenseDelta] = {}
    for param, (key, value) in saved.items():
        base = params[param].detach()
        value = value.to(device=base.device, dtype=torch.float32)
        tied = [n for n, p in params.items() if p.data_ptr() == base.data_ptr()]  # param itself and its tied names
        if key.endswith(_TOKENS_SUFFIX):  # new rows; peft applies them to a tied output layer as well
            # the base tensor with the trained rows put in: the delta is zero outside them
            field, new = "trainable_token_indices", base.float().clone()
            new[_token_indices(config, delta_name(param), adapter_name)] = value
        else:
            if key.endswith(".base_layer.weight"):  # peft's save_embedding_layers: the weight under a LoRA layer
                if value.shape == base.shape and torch.equal(value, base.float()):
                    continue  # the base model's own weight: no delta
                field = "save_embedding_layers"
            else:
                # a bias saved under bias="all"/"lora_only" is trained; any other tensor is a modules_to_save copy
                field = "bias" if param.endswith("bias") and config.bias != "none" else "modules_to_save"
            new = value
            if value.shape != base.shape:
                raise ValueError(
                    f"Adapter {adapter_name!r}: {field} tensor {param!r} has shape {tuple(value.shape)}, the base "
                    f"model's {tuple(base.shape)}: the adapter was trained on another base model."
                )
            # the merge would change every tied name, where peft's merge_and_unload() unties them
            if not all(n in saved and torch.equal(saved[n][1].to(value), value) for n in tied):
                raise ValueError(
                    f"Adapter {adapter_name!r}: {field} replaces {param!r}, which the base model ties to "
                    f"{[n for n in tied if n != param]}: a "
                    "merge would change both, peft's merge_and_unload() unties them. Train the adapter with "
                    "ensure_weight_tying=True, or untie the base model's weights before training and merging."
                )
        name = delta_name(tied[0])  # tied tensors replaced alike (ensure_weight_tying): one delta, first name
        if name not in out:
            out[name] = DenseDelta((new - base.float()).cpu(), field)
    return out


def _check_plain_base(base_model: nn.Module) -> None:
    for name, module in base_model.named_modules():
        # a peft layer (or modules_to_save wrapper) in the base would be read as part of W0
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            raise ValueError(
                f"The base model has a peft layer at {name!r} ({type(module).__name__}): pass the base model without "
                "adapters (e.g. peft_model.unload() on a copy), the adapters as folders or other PeftModels."
            )


def _load_factors(
    base_model: nn.Module, config: LoraConfig, state: Mapping[str, torch.Tensor], adapter_name: str
) -> dict[str, LoraFactors]:
    """The LoRA factors of a saved adapter, read through peft's own layers built on ``base_model`` and unloaded again,
    without writing any base tensor."""
    plain = copy.deepcopy(config)
    # no modules_to_save, biases or trainable tokens: peft would load those into or in place of base modules
    plain.modules_to_save, plain.trainable_token_indices, plain.bias = None, None, "none"
    plain.init_lora_weights, plain.inference_mode = True, True
    factor_state = {k: v for k, v in state.items() if k.endswith(_FACTOR_SUFFIXES)}
    flags = [(p, p.requires_grad) for p in base_model.parameters()]  # PeftModel freezes the base: put back after
    with torch.random.fork_rng(devices=[]):  # the default init draws from the CPU RNG; the caller's is left as it was
        peft_model = PeftModel(base_model, plain, adapter_name=_TMP_ADAPTER)
    try:
        try:
            result = set_peft_model_state_dict(peft_model, factor_state, adapter_name=_TMP_ADAPTER)
        except RuntimeError as err:  # size mismatches
            raise ValueError(f"Adapter {adapter_name!r} does not fit the base model: {err}") from err
        missing = [k for k in result.missing_keys if f".{_TMP_ADAPTER}." in k]
        if result.unexpected_keys or missing:
            raise ValueError(
                f"Adapter {adapter_name!r} does not fit the base model: tensors without a module "
                f"{sorted(result.unexpected_keys)[:4]}, LoRA layers without tensors {sorted(missing)[:4]}."
            )
        return extract_lora_factors(peft_model, _TMP_ADAPTER)
    finally:
        peft_model.unload()
        # the attributes peft sets on the base model, which would make it look like a peft model afterwards
        for attr in ("peft_config", "_hf_peft_config_loaded"):
            if attr in base_model.__dict__:
                delattr(base_model, attr)
        for p, flag in flags:
            p.requires_grad_(flag)


class LoraDeltaSet:
    """The K adapters to merge, per module: ``factors`` holds one dict per adapter (delta name -> LoRA factors or
    dense delta); full deltas built on demand. ``adapter_names``: ``adapter_0, ...`` by default.

    Raises:
        ValueError: if fewer than one adapter is given, or two adapters disagree on a module's shape.
    """

    def __init__(
        self, factors: Sequence[dict[str, LoraFactors | DenseDelta]], adapter_names: Sequence[str] | None = None
    ):
        if len(factors) < 1:
            raise ValueError("LoraDeltaSet needs at least one adapter.")
        self.factors = [dict(f) for f in factors]
        self.adapter_names = (
            list(adapter_names) if adapter_names is not None else [f"adapter_{k}" for k in range(len(factors))]
        )
        if len(self.adapter_names) != len(self.factors):
            raise ValueError(f"adapter_names has {len(self.adapter_names)} names for {len(self.factors)} adapters.")
        names: list[str] = []  # every delta name, first seen first, over all adapters
        self.shapes: dict[str, tuple[int, ...]] = {}
        for k, adapter in enumerate(self.factors):
            for name, f in adapter.items():
                if name not in self.shapes:
                    self.shapes[name] = f.shape
                    names.append(name)
                elif self.shapes[name] != f.shape:
                    raise ValueError(
                        f"Adapter {self.adapter_names[k]!r} has delta shape {f.shape} on {name!r}, other adapters "
                        f"{self.shapes[name]}: adapters must be trained on the same base model."
                    )
        self.module_names = names

    @property
    def num_adapters(self) -> int:
        return len(self.factors)

    def delta(self, name: str, k: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Adapter ``k``'s full delta on ``name`` (float32, the target's shape; zeros if that adapter has none)."""
        f = self.factors[k].get(name)
        if f is None:  # an adapter without a delta on a name contributes zero there
            return torch.zeros(self.shapes[name], dtype=torch.float32, device=device)
        return f.delta(device)

    def deltas(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """All K deltas of module ``name``: shape ``(K, *weight.shape)``, float32."""
        return torch.stack([self.delta(name, k, device) for k in range(self.num_adapters)])

    def to(self, device: torch.device | str) -> LoraDeltaSet:
        """Move the factors and dense deltas to ``device``, in place; returns ``self``."""
        for adapter in self.factors:
            for f in adapter.values():
                f.to(device)
        return self

    @classmethod
    def from_adapters(
        cls,
        base_model: nn.Module,
        adapters: Sequence[str | os.PathLike | PeftModel],
        adapter_names: Sequence[str] | None = None,
    ) -> LoraDeltaSet:
        """Read K adapters (saved folders and/or ``PeftModel`` objects, whose active adapter counts) trained on
        ``base_model`` (without peft layers, never written); ``adapter_names``: the folders' base names by default.

        Raises:
            ValueError: if no adapter is given, an adapter uses a field the merge cannot represent (named in the
                message), or the adapters do not fit the base model.
            TypeError: for an adapter that is neither a folder nor a ``PeftModel``.
        """
        if len(adapters) == 0:
            raise ValueError("adapters is empty: give at least one LoRA adapter (a folder or a PeftModel).")
        if adapter_names is None:
            adapter_names = [
                os.path.basename(os.path.normpath(a)) if isinstance(a, (str, os.PathLike)) else f"adapter_{k}"
                for k, a in enumerate(adapters)
            ]
            if len(set(adapter_names)) != len(adapter_names):  # two folders with one base name: numbered instead
                adapter_names = [f"adapter_{k}" for k in range(len(adapters))]
        _check_plain_base(base_model)
        factors = []
        for k, (a, name) in enumerate(zip(adapters, adapter_names, strict=True)):
            if isinstance(a, PeftModel):
                config = a.peft_config[_active_adapter(a)]
                check_adapter_config(config, name)  # each config checked before anything of it is loaded
                state = get_peft_model_state_dict(a, adapter_name=_active_adapter(a))
                lora = extract_lora_factors(a)
            elif isinstance(a, (str, os.PathLike)):
                config = PeftConfig.from_pretrained(os.fspath(a))
                check_adapter_config(config, name)
                state = load_peft_weights(os.fspath(a), device="cpu")
                lora = _load_factors(base_model, config, state, name)  # built on base_model and unloaded again
            else:
                raise TypeError(f"adapters[{k}] is a {type(a).__name__}; expected a folder path or a PeftModel.")
            dense = dense_deltas(base_model, state, config, name)
            lora_ptrs = {t.data_ptr(): n for n in lora if (t := target_tensor(base_model, n)) is not None}
            for dense_name in list(dense):  # peft's save_embedding_layers: the base weight under a LoRA layer
                both = lora_ptrs.get(target_tensor(base_model, dense_name).data_ptr())
                # a saved weight other than the base's: that difference plus the LoRA delta, as one dense delta
                if both is not None and (extra := dense.pop(dense_name).value).any():
                    lora[both] = DenseDelta(extra + lora[both].delta(), "save_embedding_layers")
            factors.append({**lora, **dense})
        return cls(factors, adapter_names)

    def check_model(self, model: nn.Module) -> None:
        """Raise ``ValueError`` unless every delta has a target tensor ([`target_tensor`]) of its shape in ``model``."""
        for name in self.module_names:
            tensor = target_tensor(model, name)
            if tensor is None:
                raise ValueError(f"The adapters target {name!r}, which is not a module with a weight in the model.")
            if tuple(tensor.shape) != self.shapes[name]:
                raise ValueError(
                    f"Module {name!r}: weight shape {tuple(tensor.shape)} but the adapters' delta has shape "
                    f"{self.shapes[name]}: the adapters were trained on another base model."
                )


def low_rank_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` factorization of a delta of shape ``(out, in)`` by truncated SVD (Eckart-Young):
    ``delta ~= B @ A``; returns ``(lora_A, lora_B)`` of shapes ``(r, in)`` and ``(out, r)``, float32."""
    u, s, vh = torch.linalg.svd(delta.float(), full_matrices=False)
    keep = min(rank, s.numel())  # a rank above min(out, in) leaves zero-padded factors
    root = s[:keep].sqrt()  # the singular values split evenly: B = U sqrt(S), A = sqrt(S) Vh
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
    """Save full-matrix deltas (module name relative to the base model -> ``(out, in)`` delta) as one peft LoRA
    adapter of rank ``rank`` (truncated SVD per module) in ``output_dir``, loadable with
    ``PeftModel.from_pretrained(base_model, output_dir)``; returns the saved config. Call it on the one process that
    writes.

    Raises:
        ValueError: for ``rank < 1``, or a delta that is not a weight matrix (a 1-D delta or a ``.bias``), which a
            LoRA adapter cannot carry.
        RuntimeError: if ``adapter_config.json`` or ``adapter_model.safetensors`` is missing afterwards.
    """
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}.")
    # 1-D deltas and .bias come from modules_to_save of a norm or bias="all"
    not_lora = sorted(name for name, delta in deltas.items() if delta.dim() != 2 or name.endswith(".bias"))
    if not_lora:
        raise ValueError(
            f"Cannot export {not_lora} as LoRA: not weight matrices (they come from modules_to_save or trained "
            "biases of the merged adapters). Use the saved merged model, or do not set a LoRA export rank."
        )
    os.makedirs(output_dir, exist_ok=True)
    state = {}
    for name, delta in deltas.items():
        lora_a, lora_b = low_rank_factors(delta, rank)
        # peft's saved key format; safetensors wants contiguous CPU tensors
        state[f"base_model.model.{name}.lora_A.weight"] = lora_a.cpu().contiguous()
        state[f"base_model.model.{name}.lora_B.weight"] = lora_b.cpu().contiguous()
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,  # scaling 1: B @ A is the delta itself
        target_modules=sorted(deltas),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )
    config.save_pretrained(os.fspath(output_dir))
    # weights and the export record written atomically; the folder checked at the end
    with atomic_path(os.path.join(output_dir, "adapter_model.safetensors")) as tmp:
        save_file(state, tmp, metadata={"format": "pt"})
    write_json(os.path.join(output_dir, "hyper_es_export.json"),
               {"rank": rank, "method": "truncated SVD of the merged full delta per module"})
    require_files(output_dir, ["adapter_config.json", "adapter_model.safetensors"], "the exported LoRA adapter")
    return config
