"""Tiny models and a tiny character-level tokenizer with a ChatML chat template, built locally (no hub)."""

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every printable ASCII character is one token; ChatML chat template."""
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


TINY_SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
"""The tiny models of the HF-side tests (head size 8)."""

VLLM_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
"""Sizes vLLM's CPU attention runs (head size 32; 8 is below its minimum)."""


def _tiny(config_class, model_class, tokenizer, seed, dtype, sizes, tie_word_embeddings):
    """A 2-layer model of ``config_class`` with ``sizes``, the tokenizer's special tokens, seeded with ``seed``."""
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=tie_word_embeddings,
        **sizes,
    )
    return model_class(config).to(dtype)


def build_llama(tokenizer, seed: int = 0, dtype=torch.float32) -> LlamaForCausalLM:
    return _tiny(LlamaConfig, LlamaForCausalLM, tokenizer, seed, dtype, TINY_SIZES, tie_word_embeddings=False)


def build_qwen2(tokenizer, seed: int = 0, dtype=torch.float32) -> Qwen2ForCausalLM:
    return _tiny(Qwen2Config, Qwen2ForCausalLM, tokenizer, seed, dtype, TINY_SIZES, tie_word_embeddings=True)


def build_reward_model(tokenizer, dtype=torch.float32) -> LlamaForSequenceClassification:
    """A one-layer Llama sequence classifier (one label, seed 0): a reward model for ``reward_funcs``."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForSequenceClassification(config).to(dtype)


def content_reward(completions, **kwargs) -> list[float]:
    """A reward that varies with a random tiny model's text (the sum of its character codes mod 7, in 0..6), so that
    GRPO's advantages and ES members' fitness differ where the arithmetic reward would score every completion 0."""
    from trl_es.rewards import completion_text

    return [float(sum(map(ord, completion_text(c))) % 7) for c in completions]


def build_vllm_llama(tokenizer, seed: int = 0, dtype=torch.float32, tie_word_embeddings: bool = True) -> LlamaForCausalLM:
    """A tiny Llama that vLLM's CPU attention runs (:data:`VLLM_SIZES`), with tied embeddings by default (as
    SmolLM2)."""
    return _tiny(LlamaConfig, LlamaForCausalLM, tokenizer, seed, dtype, VLLM_SIZES, tie_word_embeddings)


def build_vllm_qwen2(tokenizer, seed: int = 0, dtype=torch.float32) -> Qwen2ForCausalLM:
    """A tiny Qwen2 (q/k/v biases, untied lm_head) that vLLM's CPU attention runs (:data:`VLLM_SIZES`)."""
    model = _tiny(Qwen2Config, Qwen2ForCausalLM, tokenizer, seed, dtype, VLLM_SIZES, tie_word_embeddings=False)
    with torch.no_grad():  # random, visible biases (they are zero at init)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model
