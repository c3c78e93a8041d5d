"""Generation engines: prompt texts in, completion ids out; the one path to generation in trl_es.

``"eager"`` (:class:`EagerEngine`), ``"compiled"`` (:class:`CompiledEngine`), ``"continuous_batching"``
(:class:`ContinuousBatchingEngine`), ``"auto"`` (compiled on CUDA where it can, else eager), and with ``use_vllm``
the engines that hold their own weights (:class:`OwnWeightsEngine`). :func:`make_engine` builds each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..es.strategy import AdapterHost, WeightsHost
from .base import (
    Completions,
    EngineContext,
    GenerationEngine,
    OwnWeightsEngine,
    eos_token_ids,
    model_device,
    prompt_add_special_tokens,
    resolve_pad_to_multiple_of,
    standard_strided_head_input,
    stop_token_ids,
)
from .compiled import CompiledEngine, supports_static_cache
from .continuous_batching import ContinuousBatchingEngine, check_continuous_batching_config
from .eager import EagerEngine, common_prefix_length, generate_completions


GENERATION_ENGINES = ("auto", "eager", "compiled", "continuous_batching")
"""The built-in values of ``ESConfig.generation_engine``."""


@dataclass
class EngineSettings:
    """The config fields an engine builder reads, for :func:`make_engine` called with a name (as ``ESConfig``'s)."""

    generation_engine: str = "auto"  # a name of ENGINES, or "auto"
    share_prompt_prefix: bool = False  # eager: the shared prompt prefix once per row group
    pad_to_multiple_of: int | str | None = None  # GRPO's, resolved by resolve_pad_to_multiple_of
    transformers_continuous_batching_config: dict | None = None  # ContinuousBatchingConfig keyword arguments
    use_vllm: bool = False  # True needs ESConfig's vllm_* fields


def _pad_to_multiple_of(config) -> int | None:
    return resolve_pad_to_multiple_of(getattr(config, "pad_to_multiple_of", None))


def _eager(config, model, context: EngineContext) -> GenerationEngine:
    return EagerEngine(share_prompt_prefix=config.share_prompt_prefix, pad_to_multiple_of=_pad_to_multiple_of(config))


def _compiled(config, model, context: EngineContext) -> GenerationEngine:
    if model is not None and not supports_static_cache(model):
        raise ValueError(f"generation_engine='compiled' needs a model with static-cache support "
                         f"(_can_compile_fullgraph); {type(model).__name__} has none: use 'eager' or 'auto'.")
    return CompiledEngine(pad_to_multiple_of=_pad_to_multiple_of(config))


def _continuous_batching(config, model, context: EngineContext) -> GenerationEngine:
    unsupported = [what for what, on in (("DeepSpeed ZeRO-3", context.sharded),  # one member a call, whole weights
                                         ("tools, environment_factory or rollout_func", context.agents)) if on]
    if unsupported:
        raise ValueError(f"use_transformers_continuous_batching=True is not supported with "
                         f"{' and '.join(unsupported)} in ESTrainer: use generation_engine='eager' (unset "
                         "use_transformers_continuous_batching).")
    engine = ContinuousBatchingEngine(config.transformers_continuous_batching_config)  # checks the config
    if context.generation_config is not None:  # settings it would not apply, refused before the first member
        engine.check_generation_config(model, context.generation_config)
    return engine


ENGINES: dict[str, Callable[[Any, nn.Module | None, EngineContext], GenerationEngine]] = {
    "eager": _eager,
    "compiled": _compiled,
    "continuous_batching": _continuous_batching,
}
"""The engines ``generation_engine`` names: name -> ``builder(config, model, context)``; a new engine registers here
(one that holds its own weights subclasses :class:`OwnWeightsEngine`)."""


def resolve_engine_name(name: str, model: nn.Module | None = None, sharded: bool = False) -> str:
    """``"auto"`` -> ``"compiled"`` on CUDA for a model with static-cache support (not ``sharded``), else ``"eager"``.

    Raises:
        ValueError: for a name that is neither ``"auto"`` nor in :data:`ENGINES`.
    """
    if name != "auto" and name not in ENGINES:
        raise ValueError(f"generation_engine must be one of {('auto', *ENGINES)}, got {name!r}.")
    if name != "auto":
        return name
    # compiled only on CUDA, for a model with a static cache, and not under ZeRO-3
    if not sharded and model is not None and model_device(model).type == "cuda" and supports_static_cache(model):
        return "compiled"
    return "eager"


def make_engine(config="auto", model: nn.Module | None = None, context: EngineContext | None = None,
                **settings) -> GenerationEngine:
    """Build the engine ``config`` (an ``ESConfig``, or a name with :class:`EngineSettings` fields in ``settings``)
    names, for the unwrapped ``model``; ``context`` holds the trainer's parts (needed by the vLLM engines).

    Raises:
        ValueError: for an unknown name or a setting the chosen engine does not support (named).
        ImportError: for a vLLM engine without vLLM installed.
    """
    context = context or EngineContext()
    if isinstance(config, str):
        if "continuous_batching_config" in settings:
            settings["transformers_continuous_batching_config"] = settings.pop("continuous_batching_config")
        config = EngineSettings(config, **settings)
    if config.use_vllm:  # lazy: vLLM's modules import without vLLM, but the engines need it
        if config.vllm_mode == "server":  # ES servers; else colocated
            from .vllm_server import VLLMServerEngine

            return VLLMServerEngine.from_config(config, model, context)
        from .vllm_engine import VLLMEngine

        return VLLMEngine.from_config(config, model, context)
    # "auto" resolved against the model
    return ENGINES[resolve_engine_name(config.generation_engine, model, context.sharded)](config, model, context)


__all__ = [
    "AdapterHost",
    "GENERATION_ENGINES",
    "CompiledEngine",
    "ENGINES",
    "Completions",
    "ContinuousBatchingEngine",
    "EagerEngine",
    "EngineContext",
    "EngineSettings",
    "GenerationEngine",
    "OwnWeightsEngine",
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
    "WeightsHost",
]
