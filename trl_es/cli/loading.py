"""Loading the model and tokenizer a command runs on, from TRL's ``ModelConfig``."""

from __future__ import annotations

from trl import ModelConfig, get_quantization_config


def load_model_and_tokenizer(model_args: ModelConfig, dtype=None, trust_remote_code: bool = False,
                             training: bool = True):
    """The causal LM and its tokenizer (pad token = EOS when it has none), in ``float32`` unless a dtype is set.

    ``model_args`` gives ``model_name_or_path``, ``model_revision``, ``dtype`` (``"auto"``: the checkpoint's own),
    ``attn_implementation`` and ``load_in_4bit`` / ``load_in_8bit`` (TRL's ``get_quantization_config``: a
    bitsandbytes base); ``dtype`` overrides its dtype; ``trust_remote_code`` goes to both loads.

    Raises:
        ValueError: for ``load_in_4bit`` / ``load_in_8bit`` without ``use_peft`` when ``training`` (ES trains a
            quantized base through an adapter only: :func:`trl_es.quantized.refuse_full_parameter_quantization`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import resolve_model_path
    from ..quantized import keep_cpu_4bit_layout, refuse_full_parameter_quantization

    quantization_config = get_quantization_config(model_args)  # --load_in_4bit / --load_in_8bit
    if training and not model_args.use_peft:
        refuse_full_parameter_quantization(quantization_config)  # a quantized base: --use_peft's adapter only
    path = resolve_model_path(model_args.model_name_or_path)  # a folder, a hub id or an embedded: name
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision,
                                              # ESConfig's: TRL's ModelConfig has none
                                              trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = dtype or model_args.dtype
    model = AutoModelForCausalLM.from_pretrained(
        path, revision=model_args.model_revision, trust_remote_code=trust_remote_code,
        dtype="float32" if dtype is None else dtype,  # "auto": the checkpoint's dtype, as TRL's grpo.py loads it
        attn_implementation=model_args.attn_implementation, quantization_config=quantization_config,
    )
    keep_cpu_4bit_layout(model)  # a 4-bit base computes in `trl-es eval` as it did in training
    return model, tokenizer
