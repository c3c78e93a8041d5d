"""The compiled engine: transformers' static KV cache with a compiled decoding step, on fixed batch buckets."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig
from transformers.generation import CompileConfig

from .base import GenerationEngine, model_device, tokenize_left_padded


DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Rows per group are padded up to the next of these (rows beyond the last bucket: the next multiple of it)."""

DEFAULT_LENGTH_BUCKET = 128
"""The static cache holds ``prompt + max_new_tokens`` rounded up to a multiple of this (and never shrinks)."""


def supports_static_cache(model) -> bool:
    """Whether ``model`` can generate with transformers' static cache under ``torch.compile`` (its class declares
    ``_can_compile_fullgraph``, as Llama, Qwen2, Mistral, Gemma... do)."""
    return bool(getattr(model, "_can_compile_fullgraph", False)) and not model.config.is_encoder_decoder


def bucket(value: int, buckets=DEFAULT_BATCH_BUCKETS) -> int:
    """The smallest bucket ``>= value`` (beyond the largest bucket: the next multiple of it)."""
    for size in buckets:
        if size >= value:
            return size
    return -(-value // buckets[-1]) * buckets[-1]


class CompiledEngine(GenerationEngine):
    """``model.generate`` with a static KV cache and a compiled decoding step (CUDA graphs with
    ``mode="reduce-overhead"``), compiled once per batch bucket. Greedy output equals
    :class:`~trl_es.generation.EagerEngine`'s wherever the two kernels agree to rounding.

    Args:
        compile (`bool`): Compile the decoding step (``False``: static cache only; for debugging and CPU tests).
        mode (`str` or `None`): ``torch.compile`` mode; default ``"reduce-overhead"`` on CUDA, ``"default"`` elsewhere.
        fullgraph (`bool`): Ask ``torch.compile`` for one graph (fails loudly on graph breaks).
        length_bucket (`int`): Granularity of the cache length.
        batch_buckets (`tuple[int, ...]`): Allowed rows per row group.
        pad_to_multiple_of (`int`, *optional*): GRPO's ``pad_to_multiple_of``: the left-padded prompt batch is padded
            to a multiple of it, masked out.
    """

    name = "compiled"

    def __init__(self, compile: bool = True, mode: str | None = None, fullgraph: bool = False,
                 length_bucket: int = DEFAULT_LENGTH_BUCKET, batch_buckets=DEFAULT_BATCH_BUCKETS,
                 pad_to_multiple_of: int | None = None):
        self.compile = bool(compile)
        self.pad_to_multiple_of = pad_to_multiple_of  # GRPO's: the padded prompt length is a multiple of it
        self.mode = mode
        self.fullgraph = bool(fullgraph)
        self.length_bucket = int(length_bucket)
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.shapes_seen: set[tuple[int, int]] = set()  # (batch, cache length) of each call: one compile per entry

    def describe(self) -> dict:
        return {"name": self.name, "compile": self.compile, "mode": self.mode}

    def _config(self, generation_config: GenerationConfig, device: torch.device,
                prompt_length: int) -> GenerationConfig:
        config = copy.deepcopy(generation_config)
        config.cache_implementation = "static"  # prefill runs uncompiled: prompt lengths need no bucket
        needed = prompt_length + int(config.max_new_tokens or 0)  # rounded up; transformers never shrinks it
        config.max_cache_len = -(-needed // self.length_bucket) * self.length_bucket
        if self.compile:
            mode = self.mode or ("reduce-overhead" if device.type == "cuda" else "default")  # CUDA graphs on GPUs
            compile_config = CompileConfig(fullgraph=self.fullgraph, dynamic=False, mode=mode)  # fixed shapes
            if device.type not in ("cuda", "xpu"):
                compile_config._compile_all_devices = True
            config.compile_config = compile_config
        else:  # static cache only (debugging, CPU tests)
            config.disable_compile = True
        return config

    def _generate_ids(self, model, processing_class, texts, generation_config, num_row_groups,
                      add_special_tokens=False, **generate_kwargs):
        device = model_device(model)
        per_group = len(texts) // num_row_groups
        padded_group = bucket(per_group, self.batch_buckets)  # one compile per batch bucket, not per call
        padded = []
        for g in range(num_row_groups):
            group = texts[g * per_group : (g + 1) * per_group]
            padded += group + [group[-1]] * (padded_group - per_group)  # repeat the last prompt, dropped below
        inputs = tokenize_left_padded(processing_class, padded, device, add_special_tokens, self.pad_to_multiple_of)
        config = self._config(generation_config, device, inputs["input_ids"].shape[1])
        self.shapes_seen.add((len(padded), config.max_cache_len))
        output = model.generate(**inputs, generation_config=config, **generate_kwargs)
        completion = output[:, inputs["input_ids"].shape[1] :].tolist()
        # the padding rows dropped, every row in its group
        return [completion[g * padded_group + k] for g in range(num_row_groups) for k in range(per_group)]
