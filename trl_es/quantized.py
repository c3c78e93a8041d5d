"""ES on a quantized base (QLoRA's loading path): the base loads with a ``quantization_config`` (bitsandbytes 4-bit
NF4/FP4 or 8-bit) and stays frozen; ES perturbs and updates the PEFT adapter's tensors only.

The adapters stay fp32 (peft's ``autocast_adapter_dtype`` default; TRL's QLoRA cast to bf16 is not done: most ES
steps would round away in bf16), and ES keeps its fp32 master of them as for any model, so every member is applied
and restored bitwise. The seed log's header records the base's quantization config (:data:`HEADER_KEY`): a resumed
run and :func:`trl_es.replay` refuse a base quantized otherwise, and :func:`quantization_config_from_header` gives
the config to load the base with. Refused by name (:func:`prepare_quantized_training`, which also keeps
bitsandbytes' CPU layout fixed): a quantized base without an adapter, vLLM generation, DeepSpeed ZeRO-3.
"""

from __future__ import annotations

import json


__all__ = [
    "HEADER_KEY",
    "prepare_quantized_training",
        "check_same_quantization",
    "quantization_config_from_header",
    "quantization_description",
    "quantization_header",
    "quantization_of",
    "refuse_full_parameter_quantization",
]

#: Seed-log header key of the base model's quantization config (absent for an unquantized base).
HEADER_KEY = "quantization_config"

_FULL_PARAMETER_REASON = (
    "full-parameter ES perturbs every trained weight in place (theta + sigma * eps) and restores it bitwise, which "
    "cannot be done on quantized codes (a 4-bit NF4/FP4 or 8-bit weight cannot hold theta + sigma * eps, and "
    "re-quantizing does not give back the codes)"
)


def _config_name(config) -> str:
    """``BitsAndBytesConfig(load_in_4bit=True)``-like name of a quantization config (a dict or a config object)."""
    values = config if isinstance(config, dict) else config.to_dict()
    bits = [f"{k}=True" for k in ("load_in_4bit", "load_in_8bit") if values.get(k)]
    name = "BitsAndBytesConfig" if values.get("quant_method") == "bitsandbytes" else type(config).__name__
    return f"{name}({', '.join(bits) or '...'})"


def refuse_full_parameter_quantization(quantization_config, where: str = "quantization_config") -> None:
    """Refuse a real ``quantization_config`` of a run that trains the full model (no ``peft_config``); ``None`` passes.

    Raises:
        ValueError: naming ``where``, the reason, and the QLoRA recipe (add a ``peft_config``).
    """
    if quantization_config is None:
        return
    raise ValueError(
        f"{where}={_config_name(quantization_config)} needs a peft_config: ESTrainer trains a quantized base through "
        f"a PEFT adapter only (QLoRA), because {_FULL_PARAMETER_REASON}. Pass peft_config=LoraConfig(...) (on the "
        "command line: --use_peft), or load the model unquantized."
    )


def quantization_of(model):
    """The quantization config of ``model``'s base (a ``PeftModel`` is looked through), or ``None`` if unquantized."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "is_quantized", False):  # transformers sets it when a quantizer loaded the weights
        return None
    return getattr(base.config, "quantization_config", None)


def quantization_description(config) -> dict | None:
    """A quantization config as JSON values (``to_dict()``; a dict is taken as it is), or ``None``."""
    if config is None:
        return None
    values = config if isinstance(config, dict) else config.to_dict()
    return json.loads(json.dumps(values, default=str))


def quantization_header(model) -> dict:
    """The seed-log header entry of ``model``'s base: ``{HEADER_KEY: description}``, or ``{}`` if unquantized."""
    description = quantization_description(quantization_of(model))
    return {} if description is None else {HEADER_KEY: description}


def prepare_quantized_training(model, args) -> None:
    """Refuse, by name, what ES cannot do on a quantized base, and keep the base's layout fixed; an unquantized
    ``model`` passes untouched.

    bitsandbytes' CPU path repacks a 4-bit layer at its first forward in eval mode (absmax to bf16), and
    ``state_dict()`` (every save) unpacks it without restoring what it computed: a checkpoint would change the base
    mid-run. Repacking is turned off (``Linear4bit.support_avx512bf16_for_cpu = False``; a layer already repacked is
    unpacked), so the base computes the same before and after every save and in a resumed run.

    Args:
        model: The policy, after ``peft_config`` was applied.
        args (`ESConfig`): The run's configuration.

    Raises:
        ValueError: a quantized base without a PEFT adapter (nothing trainable ES could restore exactly),
            ``use_vllm=True`` (the engine loads unquantized weights), DeepSpeed ZeRO-3 (partitioned quantized
            weights).
    """
    config = quantization_of(model)
    if config is None:
        return
    if not hasattr(model, "peft_config"):
        refuse_full_parameter_quantization(config, "a model quantized with quantization_config")
    name = _config_name(config)
    if args.use_vllm:
        raise ValueError(f"use_vllm=True is not supported with a quantized base ({name}): the vLLM engine loads the "
                         "policy's weights unquantized and takes no bitsandbytes layers from it. Set use_vllm=False "
                         "(ES then generates with the quantized model itself).")
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        raise ValueError(f"DeepSpeed ZeRO-3 is not supported with a quantized base ({name}): ZeRO-3 partitions the "
                         "frozen quantized weights too, which bitsandbytes layers cannot compute with on their own. "
                         "Use population parallelism (no DeepSpeed, or ZeRO stage 0-2): a quantized base fits one "
                         "process's memory.")
    keep_cpu_4bit_layout(model)


def keep_cpu_4bit_layout(model) -> None:
    """Turn off bitsandbytes' CPU repacking of ``model``'s 4-bit layers (absmax to bf16 at the first forward in eval
    mode), unpacking a layer already repacked: the base then dequantizes with its fp32 absmax, as on a GPU, in
    training, in every save and in ``trl-es eval`` alike. Any other model is left as it is."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            weight = getattr(module, "weight", None)
            if getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False):
                module.state_dict()  # bitsandbytes unpacks a repacked layer when it is saved


def check_same_quantization(saved: dict | None, model, where: str) -> None:
    """Refuse ``model`` if its base is not quantized as ``saved`` (a seed-log header's :data:`HEADER_KEY` entry).

    Raises:
        ValueError: naming both configs and how to load the base as it was trained.
    """
    current = quantization_description(quantization_of(model))
    if saved == current:
        return
    trained = "unquantized" if saved is None else f"quantized with {_config_name(saved)} ({saved})"
    now = "unquantized" if current is None else f"quantized with {_config_name(current)} ({current})"
    hint = ("load it with quantization_config=quantization_config_from_header(SeedLog.load(<seed log>).header) "
            "(trl_es.quantized)" if saved is not None else "load it without a quantization_config")
    raise ValueError(f"{where}: the run was trained on a base {trained}, but this model's base is {now}. The base "
                     f"must be the one the run was trained on: {hint}.")


def quantization_config_from_header(header: dict):
    """The ``BitsAndBytesConfig`` a run's base was loaded with, from its seed log's header
    (``SeedLog.load(path).header``), or ``None`` for an unquantized base; pass it to
    ``from_pretrained(..., quantization_config=...)`` to load the base the run was trained on."""
    saved = header.get(HEADER_KEY)
    if saved is None:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig.from_dict(dict(saved))
