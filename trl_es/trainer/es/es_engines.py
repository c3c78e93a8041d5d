"""ESTrainer's generation engine: eager / compiled (``generation_engine``) or a colocated vLLM engine
(``use_vllm``), and the population backend's settings.

A mixin of :class:`~trl_es.trainer.es.es_trainer.ESTrainer` (it reads ``args``, ``accelerator``, ``model``,
``processing_class``, ``generation_config``, ``population``, ``es_params`` and ``noise``; see ``docs/generation.md``).
"""

from __future__ import annotations

from ...es.perturbation import LowRankPerturbation
from ...es.population import member_indices
from ...generation import make_engine, resolve_pad_to_multiple_of


class ESEngineMixin:
    """The generation engine of :class:`~trl_es.trainer.es.es_trainer.ESTrainer`."""

    def _make_generation_engine(self):
        """The generation engine: vLLM with ``use_vllm`` (:meth:`_make_vllm_engine`), else that of
        ``args.generation_engine`` (``"auto"``: compiled on CUDA where the model supports a static cache, eager
        otherwise and under ZeRO-3)."""
        if self.args.use_vllm:
            return self._make_vllm_engine()
        name = self.args.generation_engine
        if name == "auto" and self.sharded:
            name = "eager"
        return make_engine(name, self.accelerator.unwrap_model(self.model), self.args.share_prompt_prefix,
                           resolve_pad_to_multiple_of(getattr(self.args, "pad_to_multiple_of", None)))

    def _make_vllm_engine(self):
        """One colocated vLLM engine in this process (:class:`~trl_es.generation.vllm_engine.VLLMEngine`), with LoRA
        slots for a group of low-rank members; the current weights are loaded at the first iteration.

        Raises:
            ImportError: if vLLM is not installed (naming what to install).
            ValueError: under DeepSpeed ZeRO-3 or with a PEFT model (not supported with use_vllm yet).
        """
        from ...generation.vllm_engine import VLLMEngine

        args = self.args
        if args.vllm_tensor_parallel_size > 1:
            raise ValueError("vllm_tensor_parallel_size > 1 is not supported yet: the processes sharing one engine "
                             "would have to score the same member together (docs/generation.md). Use 1.")
        if self.sharded:
            raise ValueError("use_vllm=True is not supported with DeepSpeed ZeRO-3 yet (each engine needs the whole "
                             "model): use population parallelism (no ZeRO-3) or use_vllm=False.")
        unwrapped = self.accelerator.unwrap_model(self.model)
        if hasattr(unwrapped, "peft_config"):
            raise ValueError("use_vllm=True is not supported with a PEFT model yet: ES would perturb the adapter, "
                             "which the engine does not hold. Use use_vllm=False.")
        lowrank = isinstance(self.population.perturbation, LowRankPerturbation)
        output_embeddings = unwrapped.get_output_embeddings() if hasattr(unwrapped, "get_output_embeddings") else None
        head = getattr(output_embeddings, "weight", None)
        if lowrank and head is not None and any(e.param.data_ptr() == head.data_ptr() for e in self.es_params.entries):
            raise ValueError("use_vllm=True with population_backend='batched_lowrank' cannot perturb the output "
                             "embeddings (lm_head) as a LoRA adapter (vLLM's LoRA covers the Linear projections): "
                             "set include_parameters, e.g. r'proj\\.weight$'.")
        VLLMEngine.check_generation_config(self.generation_config)  # before minutes of engine start-up
        members_here = len(member_indices(args.population_size, self.accelerator.process_index,
                                          self.accelerator.num_processes))
        return VLLMEngine(
            unwrapped, self.processing_class, self.accelerator,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            max_model_length=args.vllm_max_model_length,
            kv_cache_memory_bytes=args.vllm_kv_cache_memory_bytes,
            lora_rank=args.noise_rank if lowrank else None,
            max_loras=min(args.member_chunk_size or members_here, members_here) if lowrank else 1,
            model_impl=args.vllm_model_impl, structured_outputs_regex=args.vllm_structured_outputs_regex,
        )

    def _sync_engine_weights(self) -> None:
        """With ``use_vllm``: load the model's current weights into the engine, so that it computes with what the ES
        update produced: when the engine is built, after every iteration's update (a subclass's ``_es_step``
        included), after a checkpoint is loaded, and before an evaluation."""
        if self.args.use_vllm:
            self.generation_engine.sync_weights(self.accelerator.unwrap_model(self.model), self.es_params, self.noise)

    def _population_backend_kwargs(self) -> dict:
        """Backend-specific settings from the config."""
        if self.args.population_backend == "sequential":
            return {}
        return {"noise_rank": self.args.noise_rank, "member_chunk_size": self.args.member_chunk_size}
