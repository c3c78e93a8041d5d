"""The deltas of K LoRA adapters trained on one base model, read with every field peft can put in an adapter.

A LoRA module contributes ``Delta = scaling * B @ A`` (Hu et al. 2021, "LoRA", Eq. 3). The factors are read from
peft's own ``LoraLayer`` objects, so ``r``/``lora_alpha``, ``rank_pattern``, ``alpha_pattern``, rsLoRA,
``fan_in_fan_out``, ``target_modules``, ``exclude_modules`` and ``layers_to_transform`` are resolved by peft, not
re-derived here; they are kept as small fp32 copies and the full matrices are built on demand with the formula of
peft's ``lora.Linear.get_delta_weight``.

An adapter can also carry tensors that *replace* base tensors: ``modules_to_save`` (whole copies of modules),
``bias="all"``/``"lora_only"`` (trained biases) and ``trainable_token_indices`` (new embedding rows). peft's
``merge_and_unload`` puts them in place of the base's. Here each one becomes a dense task vector ``adapter - base``
([`DenseDelta`]) merged like any other delta: ``W0 + Delta`` with coefficient 1 is peft's merged model, and the base
model itself is never written.

What a merge of deltas cannot represent is refused by name before anything is loaded ([`check_adapter_config`]);
``docs/hyper_es.md`` ("Adapter fields") lists every ``LoraConfig`` field and how it is handled.
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
_TMP_ADAPTER = "_hyper_es"
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
    """Refuse an adapter whose config asks for something a merge of deltas cannot represent.

    Refused: any other peft method than LoRA; ``use_dora``, ``lora_bias``, ``target_parameters``, ``use_qalora``,
    ``layer_replication``, ``megatron_config``; every field peft tags as a LoRA variant (``velora_config``,
    ``alora_invocation_tokens``, ``monteclora_config``, ``use_bdlora``, ``arrow_config``, ``kasa_config``, ...); an
    ``init_lora_weights`` of [`BASE_MODIFYING_INITS`] (an adapter saved with peft's
    ``path_initial_model_for_weight_conversion`` is a plain LoRA adapter of the original base and is accepted).

    Args:
        config (`PeftConfig`): The adapter's config.
        adapter_name (`str`): Its name, for the message.

    Raises:
        ValueError: naming the adapter, the field, its value and what to do.
    """
    if not isinstance(config, LoraConfig):
        kind = getattr(config, "peft_type", type(config).__name__)
        raise ValueError(f"Adapter {adapter_name!r} is a {kind} adapter; Hyper-ES merges LoRA adapters only.")
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not value or not (field.name in _REFUSED_FIELDS or field.metadata.get("is_lora_variant")):
            continue
        why, todo = _REFUSED_FIELDS.get(field.name, _VARIANT)
        raise ValueError(f"Adapter {adapter_name!r}: {field.name}={value!r} {why}; {todo}.")
    init = config.init_lora_weights
    if isinstance(init, str) and init.lower().startswith(BASE_MODIFYING_INITS):
        raise ValueError(
            f"Adapter {adapter_name!r}: init_lora_weights={init!r} changes the base weights when the adapter is "
            "created, so its B @ A is relative to a modified base; save it with save_pretrained(..., "
            "path_initial_model_for_weight_conversion=<folder of the initial adapter>), which converts it into a plain "
            "LoRA adapter of the original base, and merge that."
        )


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
        delta = b @ a
        if self.fan_in_fan_out:
            delta = delta.T
        return delta * self.scaling

    def to(self, device: torch.device | str) -> LoraFactors:
        self.lora_A, self.lora_B = self.lora_A.to(device), self.lora_B.to(device)
        return self


@dataclass
class DenseDelta:
    """A dense delta ``adapter tensor - base tensor`` of one adapter on a tensor the adapter replaces.

    Attributes:
        value (`torch.Tensor`): float32, the shape of the base tensor. :meth:`delta` returns it without a copy: do not
            modify the result in place.
        field (`str`): The adapter field it comes from: ``"modules_to_save"``, ``"bias"``,
            ``"trainable_token_indices"``, or ``"save_embedding_layers"`` (a LoRA-targeted embedding or ``lm_head``
            saved with a base weight other than the base model's: that weight minus the base's, plus the LoRA delta).
    """

    value: torch.Tensor
    field: str = "modules_to_save"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The delta (float32, the shape of the base tensor)."""
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
    if module is not None:
        weight = getattr(module, "weight", None)
        return weight if isinstance(weight, torch.Tensor) else None
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def _lora_layers(peft_model: PeftModel) -> list[tuple[str, LoraLayer]]:
    """``(name, layer)`` for every LoRA layer, ``name`` relative to the base model
    (``model.layers.0.self_attn.q_proj``)."""
    inner = peft_model.base_model.model if isinstance(peft_model, PeftModel) else peft_model
    return [(name, module) for name, module in inner.named_modules() if isinstance(module, LoraLayer)]


def _active_adapter(peft_model: PeftModel) -> str:
    name = peft_model.active_adapter
    return name[0] if isinstance(name, list) else name


def extract_lora_factors(peft_model: PeftModel, adapter_name: str | None = None) -> dict[str, LoraFactors]:
    """Copy one adapter's factors out of a ``PeftModel`` (fp32, CPU).

    Only the LoRA layers are read: the adapter's other tensors (``modules_to_save``, biases, trainable tokens) are
    read by [`dense_deltas`], its config checked by [`check_adapter_config`].

    Args:
        peft_model (`PeftModel`): A model with LoRA adapters.
        adapter_name (`str`, *optional*): Which adapter; the active one by default.

    Returns:
        `dict[str, LoraFactors]`: By module name relative to the base model, in ``named_modules`` order.

    Raises:
        ValueError: for LoRA variants whose delta is not ``scaling * B @ A`` (DoRA, ``lora_bias``, other variants),
            LoRA on embeddings, or an adapter without LoRA layers.
        TypeError: for LoRA on layers other than peft's ``lora.Linear`` (convolutions, quantized layers).
    """
    if adapter_name is None:
        adapter_name = _active_adapter(peft_model)
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
        variant = getattr(layer, "lora_variant", {}).get(adapter_name)
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
            scaling=float(layer.scaling[adapter_name]),
            fan_in_fan_out=bool(layer.fan_in_fan_out),
        )
    if not factors:
        raise ValueError(f"Adapter {adapter_name!r} has no LoRA layers in this model.")
    return factors


def _token_indices(config: LoraConfig, module_name: str, adapter_name: str) -> list[int]:
    """The rows ``trainable_token_indices`` trains in module ``module_name`` (a list: the input embedding's)."""
    spec = config.trainable_token_indices
    if not isinstance(spec, Mapping):
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
    """The adapter's tensors that replace base tensors, as dense deltas ``adapter - base`` (fp32, CPU).

    Every tensor of ``state`` other than a ``lora_A``/``lora_B`` weight is one: a ``modules_to_save`` copy
    (``lm_head.weight``), a trained bias (``bias="all"``/``"lora_only"``), a ``trainable_token_indices`` row block
    (its delta is zero outside the trained rows), or the weight under a LoRA-targeted embedding or ``lm_head`` that
    peft saves with ``save_embedding_layers`` (skipped when it equals the base model's).

    Args:
        base_model (`nn.Module`): The base model (read, never written).
        state (`Mapping[str, torch.Tensor]`): The adapter's state dict in peft's saved format (``load_peft_weights`` of
            a folder, ``get_peft_model_state_dict`` of a ``PeftModel``): keys ``base_model.model.<path>``.
        config (`LoraConfig`): The adapter's config (for ``bias`` and ``trainable_token_indices``).
        adapter_name (`str`): For messages.

    Returns:
        `dict[str, DenseDelta]`: By delta name ([`delta_name`]).

    Raises:
        ValueError: for a tensor with no parameter of that name and shape in ``base_model`` (e.g. a DoRA magnitude),
            or a replaced tensor that the base model ties to another parameter the adapter does not replace alike
            (the merge would change both, where peft's ``merge_and_unload`` unties them). Tied tensors replaced alike
            (``ensure_weight_tying=True``) give one delta, on the first of the names in ``named_parameters`` order.
    """
    params = dict(base_model.named_parameters(remove_duplicate=False))
    saved: dict[str, tuple[str, torch.Tensor]] = {}  # base parameter -> (saved key, saved tensor)
    for key, value in state.items():
        if not key.endswith(_FACTOR_SUFFIXES):
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
            field, new = "trainable_token_indices", base.float().clone()
            new[_token_indices(config, delta_name(param), adapter_name)] = value
        else:
            if key.endswith(".base_layer.weight"):  # peft's save_embedding_layers: the weight under a LoRA layer
                if value.shape == base.shape and torch.equal(value, base.float()):
                    continue
                field = "save_embedding_layers"
            else:
                field = "bias" if param.endswith("bias") and config.bias != "none" else "modules_to_save"
            new = value
            if value.shape != base.shape:
                raise ValueError(
                    f"Adapter {adapter_name!r}: {field} tensor {param!r} has shape {tuple(value.shape)}, the base "
                    f"model's {tuple(base.shape)}: the adapter was trained on another base model."
                )
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
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            raise ValueError(
                f"The base model has a peft layer at {name!r} ({type(module).__name__}): pass the base model without "
                "adapters (e.g. peft_model.unload() on a copy), the adapters as folders or other PeftModels."
            )


def _load_factors(
    base_model: nn.Module, config: LoraConfig, state: Mapping[str, torch.Tensor], adapter_name: str
) -> dict[str, LoraFactors]:
    """The LoRA factors of a saved adapter, read through peft's own layers without writing any base tensor.

    The adapter's LoRA layers are built on ``base_model`` with peft (as a plain LoRA config: no ``modules_to_save``,
    biases or trainable tokens, which peft would load into or in place of base modules; default init, under a forked
    CPU RNG), only its ``lora_A``/``lora_B`` tensors are loaded, the factors copied and the layers unloaded again;
    the parameters' ``requires_grad`` flags are put back as they were.
    """
    plain = copy.deepcopy(config)
    plain.modules_to_save, plain.trainable_token_indices, plain.bias = None, None, "none"
    plain.init_lora_weights, plain.inference_mode = True, True
    factor_state = {k: v for k, v in state.items() if k.endswith(_FACTOR_SUFFIXES)}
    flags = [(p, p.requires_grad) for p in base_model.parameters()]
    with torch.random.fork_rng(devices=[]):
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
        for attr in ("peft_config", "_hf_peft_config_loaded"):
            if attr in base_model.__dict__:
                delattr(base_model, attr)
        for p, flag in flags:
            p.requires_grad_(flag)


class LoraDeltaSet:
    """The K adapters to merge, per module: LoRA factors or dense deltas; full deltas built on demand.

    Args:
        factors (`list[dict[str, LoraFactors | DenseDelta]]`): One dict per adapter (delta name, see [`delta_name`] ->
            its delta). An adapter without a delta on a name contributes a zero delta there.
        adapter_names (`list[str]`, *optional*): Names for logs and the genome JSON; ``adapter_0, ...`` by default.

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
        names: list[str] = []
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
        """Read K adapters given as saved adapter folders and/or ``PeftModel`` objects.

        Each adapter's config is checked first ([`check_adapter_config`]), before anything is loaded. Its LoRA layers
        give factors; its other tensors (``modules_to_save``, biases, trainable tokens) give dense deltas against
        ``base_model`` ([`dense_deltas`]). No tensor of ``base_model`` is written: a folder's LoRA layers are built on
        it with peft and unloaded again, its other tensors are read from the file.

        Args:
            base_model (`nn.Module`): The base model the adapters were trained on, without peft layers.
            adapters (`Sequence[str | PathLike | PeftModel]`): K adapters; a ``PeftModel`` contributes its active
                adapter.
            adapter_names (`Sequence[str]`, *optional*): Names; the folder's base name (or ``adapter_k``) by default.

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
            if len(set(adapter_names)) != len(adapter_names):
                adapter_names = [f"adapter_{k}" for k in range(len(adapters))]
        _check_plain_base(base_model)
        factors = []
        for k, (a, name) in enumerate(zip(adapters, adapter_names, strict=True)):
            if isinstance(a, PeftModel):
                config = a.peft_config[_active_adapter(a)]
                check_adapter_config(config, name)
                state = get_peft_model_state_dict(a, adapter_name=_active_adapter(a))
                lora = extract_lora_factors(a)
            elif isinstance(a, (str, os.PathLike)):
                config = PeftConfig.from_pretrained(os.fspath(a))
                check_adapter_config(config, name)
                state = load_peft_weights(os.fspath(a), device="cpu")
                lora = _load_factors(base_model, config, state, name)
            else:
                raise TypeError(f"adapters[{k}] is a {type(a).__name__}; expected a folder path or a PeftModel.")
            dense = dense_deltas(base_model, state, config, name)
            lora_ptrs = {t.data_ptr(): n for n in lora if (t := target_tensor(base_model, n)) is not None}
            for dense_name in list(dense):  # peft's save_embedding_layers: the base weight under a LoRA layer
                both = lora_ptrs.get(target_tensor(base_model, dense_name).data_ptr())
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
        ValueError: for ``rank < 1``, or a delta that is not a weight matrix (a 1-D delta or a ``.bias``: from
            ``modules_to_save`` of a norm or ``bias="all"``), which a LoRA adapter cannot carry.
        RuntimeError: if ``adapter_config.json`` or ``adapter_model.safetensors`` is missing afterwards.
    """
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}.")
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
