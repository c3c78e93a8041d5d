"""Generation engines: prompt texts in, completion ids out; the one path to generation in trl_es.

- ``"eager"`` (:class:`EagerEngine`): ``model.generate`` as transformers runs it; optionally with the shared prompt
  prefix computed once per row group (``share_prompt_prefix``, the default in ``ESConfig``).
- ``"compiled"`` (:class:`CompiledEngine`): static KV cache + compiled decoding step on fixed batch buckets.
- ``"continuous_batching"`` (:class:`ContinuousBatchingEngine`): transformers' ``model.generate_batch`` (paged KV
  cache, requests scheduled as they finish), as GRPO's ``use_transformers_continuous_batching=True``.
- ``"auto"``: the compiled engine on CUDA when the model supports a static cache, else eager.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import (
    Completions,
    GenerationEngine,
    eos_token_ids,
    model_device,
    prompt_add_special_tokens,
    resolve_pad_to_multiple_of,
    stop_token_ids,
)
from .compiled import CompiledEngine, supports_static_cache
from .continuous_batching import ContinuousBatchingEngine, check_continuous_batching_config
from .eager import EagerEngine, common_prefix_length


GENERATION_ENGINES = ("auto", "eager", "compiled", "continuous_batching")


def resolve_engine_name(name: str, model: nn.Module | None = None) -> str:
    """``"auto"`` -> ``"compiled"`` on CUDA for a model that supports a static cache, else ``"eager"``.

    Raises:
        ValueError: for a name not in :data:`GENERATION_ENGINES`.
    """
    if name not in GENERATION_ENGINES:
        raise ValueError(f"generation_engine must be one of {GENERATION_ENGINES}, got {name!r}.")
    if name != "auto":
        return name
    if model is not None and model_device(model).type == "cuda" and supports_static_cache(model):
        return "compiled"
    return "eager"


def make_engine(name: str = "auto", model: nn.Module | None = None, share_prompt_prefix: bool = False,
                pad_to_multiple_of: int | None = None,
                continuous_batching_config: dict | None = None) -> GenerationEngine:
    """Build an engine by name (``ESConfig.generation_engine``); ``"auto"`` is resolved against ``model``.

    Args:
        name (`str`): ``"auto"``, ``"eager"``, ``"compiled"`` or ``"continuous_batching"``.
        model (`nn.Module` or `None`): The model the engine will run (for ``"auto"``).
        share_prompt_prefix (`bool`): For the eager engine: compute the shared prompt prefix once per row group.
        pad_to_multiple_of (`int`, *optional*): GRPO's: pad each prompt batch to a multiple of it (the
            continuous-batching engine pads nothing, as GRPO's continuous batching).
        continuous_batching_config (`dict`, *optional*): For ``"continuous_batching"``: GRPO's
            ``transformers_continuous_batching_config``.

    Raises:
        ValueError: for an unknown name, ``"compiled"`` with a model that has no static-cache support, or an invalid
            ``continuous_batching_config``.
    """
    name = resolve_engine_name(name, model)
    if name == "compiled":
        if model is not None and not supports_static_cache(model):
            raise ValueError(f"generation_engine='compiled' needs a model with static-cache support "
                             f"(_can_compile_fullgraph); {type(model).__name__} has none: use 'eager' or 'auto'.")
        return CompiledEngine(pad_to_multiple_of=pad_to_multiple_of)
    if name == "continuous_batching":
        return ContinuousBatchingEngine(continuous_batching_config)
    return EagerEngine(share_prompt_prefix=share_prompt_prefix, pad_to_multiple_of=pad_to_multiple_of)


@torch.no_grad()
def generate_completions(
    model: nn.Module,
    processing_class,
    prompts,
    generation_config,
    num_generations: int = 1,
    engine: GenerationEngine | None = None,
    num_row_groups: int = 1,
    **generate_kwargs,
) -> Completions:
    """Generate ``num_generations`` completions per prompt with ``engine`` (default: the plain eager engine).

    See :meth:`GenerationEngine.generate`. Returns :class:`Completions` (unpacks as ``texts, ids``).
    """
    engine = engine or EagerEngine()
    return engine.generate(model, processing_class, prompts, generation_config, num_generations, num_row_groups,
                           **generate_kwargs)


__all__ = [
    "GENERATION_ENGINES",
    "CompiledEngine",
    "Completions",
    "ContinuousBatchingEngine",
    "EagerEngine",
    "GenerationEngine",
    "check_continuous_batching_config",
    "common_prefix_length",
    "eos_token_ids",
    "generate_completions",
    "make_engine",
    "prompt_add_special_tokens",
    "resolve_pad_to_multiple_of",
    "resolve_engine_name",
    "stop_token_ids",
    "supports_static_cache",
]
