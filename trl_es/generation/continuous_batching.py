"""The continuous-batching engine: transformers' ``model.generate_batch`` (paged KV cache, requests scheduled as they
finish), as GRPOTrainer generates with ``use_transformers_continuous_batching=True``."""

from __future__ import annotations

import copy
import math

import torch
from transformers import GenerationConfig

from .base import GenerationEngine, encode_prompts, model_device
from .eager import ORDER_DEPENDENT_PROCESSORS


TRL_MAX_MEMORY_PERCENT = 0.5
"""GRPOTrainer's default ``max_memory_percent`` (transformers' own leaves too little memory beside training)."""

CPU_MAX_BATCH_TOKENS = 1024
"""On the CPU, tokens per forward (transformers' default 8192 sizes a dense attention mask of 8192 x cache tokens)."""


def check_continuous_batching_config(config) -> dict:
    """``transformers_continuous_batching_config`` as a dict of keyword arguments of
    :class:`~transformers.generation.ContinuousBatchingConfig` (``None``: empty), checked by building one.

    Raises:
        ValueError: naming the field, for anything ``ContinuousBatchingConfig`` refuses, and for ``seed``.
    """
    from transformers.generation import ContinuousBatchingConfig

    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"transformers_continuous_batching_config must be None or a dict of ContinuousBatchingConfig "
                         f"keyword arguments, got {config!r}.")
    if "seed" in config:  # one fixed seed would give every member the same draws
        raise ValueError(f"transformers_continuous_batching_config={config!r}: remove 'seed': ES seeds each member's "
                         "sampling from the config's seed (one fixed seed would give every member the same draws).")
    try:
        ContinuousBatchingConfig(**config)
    except (TypeError, ValueError) as error:
        raise ValueError(f"transformers_continuous_batching_config={config!r} is not a valid ContinuousBatchingConfig: "
                         f"{error}") from None
    return dict(config)


def unsupported_processors(model, generation_config: GenerationConfig) -> list[str]:
    """The names of the logits processors (and settings) of ``generation_config`` that continuous batching would not
    apply as ``generate`` does; empty when every one applies."""
    processors = model._get_logits_processor(generation_config, input_ids_seq_length=1)  # as generate builds them
    # those transformers drops (repetition_penalty, ...)
    found = [type(p).__name__ for p in processors if getattr(p, "supports_continuous_batching", None) is False]
    found += [name for name in ("min_length", "min_new_tokens", *ORDER_DEPENDENT_PROCESSORS)
              if getattr(generation_config, name, None)]  # need generate's EOS tensor, or read a row's token order
    return found


class ContinuousBatchingEngine(GenerationEngine):
    """``model.generate_batch``: transformers' continuous batching (paged KV cache), called as GRPOTrainer calls it,
    one request per row, on the live model (one member a call: ``num_row_groups=1``). Greedy completions equal
    :class:`~trl_es.generation.EagerEngine`'s wherever the paged and padded attention kernels agree to rounding.

    Args:
        config (`dict`, *optional*): ``transformers_continuous_batching_config``: keyword arguments of
            :class:`~transformers.generation.ContinuousBatchingConfig` (checked by
            :func:`check_continuous_batching_config`).

    Raises:
        ValueError: for an invalid ``config``.
    """

    name = "continuous_batching"

    def __init__(self, config: dict | None = None):
        self.config = check_continuous_batching_config(config)

    def describe(self) -> dict:
        return {"name": self.name, "config": dict(self.config)} if self.config else {"name": self.name}

    def check_generation_config(self, model, generation_config: GenerationConfig) -> None:
        """Raise ``ValueError`` naming the generation settings continuous batching would not apply."""
        unsupported = unsupported_processors(model, generation_config)
        if unsupported:
            raise ValueError(f"use_transformers_continuous_batching: transformers' continuous batching does not apply "
                             f"{', '.join(unsupported)} as generate does (it drops them, or they read packed rows): "
                             "unset those generation settings, or generate with generation_engine='eager'.")

    def batching_config(self, model, encoded: list[list[int]], max_new_tokens: int, do_sample: bool):
        """A fresh :class:`~transformers.generation.ContinuousBatchingConfig` for one call (transformers resolves it
        in place): the user's keys, GRPO's memory default, the CPU sizing, and the sampling seed."""
        from transformers.generation import ContinuousBatchingConfig

        kwargs = dict(self.config)
        if model_device(model).type == "cpu" and "num_blocks" not in kwargs and "max_memory_percent" not in kwargs:
            # transformers would size the cache from the machine's RAM: size it to the call instead
            page = kwargs.get("page_size", ContinuousBatchingConfig.page_size)
            kwargs["num_blocks"] = sum(math.ceil((len(row) + max_new_tokens) / page) for row in encoded)
            longest = max(len(row) for row in encoded)
            kwargs.setdefault("max_batch_tokens", max(longest, min(CPU_MAX_BATCH_TOKENS,
                                                                   sum(len(row) for row in encoded))))
        kwargs.setdefault("max_memory_percent", TRL_MAX_MEMORY_PERCENT)
        kwargs["seed"] = int(torch.randint(2**31 - 1, ())) if do_sample else 0  # from the member's seeded generator
        return ContinuousBatchingConfig(**kwargs)

    def _generate_ids(self, model, processing_class, texts, generation_config, num_row_groups,
                      add_special_tokens=False, **generate_kwargs):
        if num_row_groups != 1:
            raise ValueError(f"the continuous-batching engine generates one member a call (num_row_groups=1), got "
                             f"num_row_groups={num_row_groups}: batched low-rank members need the eager or compiled "
                             "engine.")
        if generate_kwargs:
            raise ValueError(f"the continuous-batching engine takes no generate keyword arguments, got "
                             f"{sorted(generate_kwargs)} (synced_gpus: DeepSpeed ZeRO-3 needs the eager engine).")
        self.check_generation_config(model, generation_config)
        encoded = encode_prompts(processing_class, texts, add_special_tokens)
        config = copy.deepcopy(generation_config)  # transformers writes into the one it gets
        batching = self.batching_config(model, encoded, int(config.max_new_tokens or 0), bool(config.do_sample))
        device = model_device(model)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # its manual_seed stays inside
            outputs = model.generate_batch(encoded, generation_config=config, continuous_batching_config=batching,
                                           progress_bar=False)
        results = list(outputs.values())  # in request order
        failed = [r.request_id for r in results if r.error is not None]
        if len(results) != len(encoded) or failed:
            raise RuntimeError(f"transformers' generate_batch returned {len(results)} of {len(encoded)} completions"
                               f"{f', failed: {failed}' if failed else ''} (see its log above).")
        return [list(r.generated_tokens) for r in results]
