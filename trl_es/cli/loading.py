"""Loading the model and tokenizer a command runs on, from TRL's ``ModelConfig``."""

from __future__ import annotations

from trl import ModelConfig, get_quantization_config


def load_model_and_tokenizer(model_args: ModelConfig, dtype=None, trust_remote_code: bool = False):
    """The causal LM and its tokenizer (pad token = EOS when it has none), in ``float32`` unless a dtype is set.

    ``model_args`` gives ``model_name_or_path``, ``model_revision``, ``dtype`` (``"auto"``: the checkpoint's own) and
    ``attn_implementation``; ``dtype`` overrides its dtype; ``trust_remote_code`` goes to both loads.

    Raises:
        ValueError: for ``load_in_4bit`` / ``load_in_8bit`` (ES does not load quantized models).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import refuse_quantization, resolve_model_path

    refuse_quantization(get_quantization_config(model_args))  # --load_in_4bit / --load_in_8bit: refused by name
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
        attn_implementation=model_args.attn_implementation,
    )
    return model, tokenizer
