"""ESConfig: the configuration of ESTrainer."""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from trl.trainer.base_config import _BaseConfig

from ...arguments import DictValuedFields, check_finite_floats, check_int, document_parameters, literal_field_errors
from ...es.noise import DEFAULT_TABLE_SIZE, NOISE_BLOCK_SIZE
from ...generation import check_continuous_batching_config, resolve_pad_to_multiple_of
from .grpo_fields import (
    GRPO_FIELDS,
    MAPPED,
    added_fields,
    answer_grpo_fields,
    grpo_field_errors,
    grpo_field_notices,
    ignored_fields,
    notices_message,
    raise_field_errors,
    refused_fields,
)


#: ``temperature`` of a config that leaves it unset (``None``) and asks for sampling (GRPO's default).
GRPO_TEMPERATURE = 1.0
#: Below this, ``learning_rate`` under ``es_optimizer="es"`` is an AdamW-scale value, warned about at start.
ES_STEP_SIZE_WARNING_BELOW = 1e-4
#: ``prompt_batch_size`` of a config that sets neither it nor any of GRPO's batch fields.
DEFAULT_PROMPT_BATCH_SIZE = 8
#: GRPO's ``per_device_train_batch_size`` (``TrainingArguments``' default), used in the mapping of GRPO's batch fields
#: when another of them is set and it is not.
GRPO_PER_DEVICE_TRAIN_BATCH_SIZE = 8

logger = logging.getLogger(__name__)

#: The batch fields ESConfig derives (``prompt_batch_size`` from GRPO's when those are set; the other two from it).
_BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "prompt_batch_size")


def check_fp16_device(config) -> None:
    """``fp16=True`` on the CPU would change nothing: accelerate runs fp16 mixed precision (autocast) on GPUs only,
    so every forward would stay in the model's dtype while the config says fp16.

    Raises:
        ValueError: naming the field and what to use instead.
    """
    if config.fp16 and config.device.type == "cpu":
        raise ValueError("fp16=True is not applied on the CPU (accelerate runs fp16 mixed precision on GPUs only, so "
                         "every forward would stay in the model's dtype): use bf16=True (bf16 autocast on the CPU), or "
                         "fp16=False and load the model in float16 with model_init_kwargs={'dtype': 'float16'}.")


def _collect(errors: list[str], check, *args) -> None:
    """Run ``check(*args)``; append the message of a ``ValueError`` it raises to ``errors``."""
    try:
        check(*args)
    except ValueError as error:
        errors.append(str(error))


@document_parameters(groups={  # the Parameters: of the docstring, from each field's help
    "Parameters that override `TrainingArguments` defaults": (
        "learning_rate", "lr_scheduler_type", "max_grad_norm", "bf16", "gradient_checkpointing", "logging_steps",
        "per_device_train_batch_size", "dataloader_pin_memory", "remove_unused_columns", "resume_from_checkpoint"),
    "Parameters that control the model": ("model_init_kwargs", "trust_remote_code"),
    "Parameters that control the ES iteration": (
        "population_size", "sigma", "fitness_shaping", "per_prompt_shaping", "antithetic", "prompt_batch_size",
        "es_optimizer", "include_parameters", "exclude_parameters", "fp32_master_weights", "noise_source",
        "noise_table_size", "population_backend", "noise_rank", "member_chunk_size", "generation_engine",
        "share_prompt_prefix", "anchor_storage", "lean_memory"),
    "Parameters that control generation acceleration powered by vLLM": (
        "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_length",
        "vllm_kv_cache_memory_bytes", "vllm_model_impl", "vllm_structured_outputs_regex"),
    "Parameters for \"server\" vLLM mode": (
        "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
        "vllm_server_base_urls"),
    "Parameters that control generation acceleration powered by transformers continuous batching": (
        "use_transformers_continuous_batching", "transformers_continuous_batching_config", "use_transformers_paged"),
    "Parameters that control Anchored Weight Decay (AWD)": (
        "awd_lambda", "awd_penalty", "log_parameter_drift", "log_module_drift", "success_threshold"),
    "Parameters that control generation (GRPO's names and meanings)": (
        "num_generations", "max_completion_length", "temperature", "top_p", "generation_kwargs",
        "chat_template_kwargs", "reward_weights", "top_k", "min_p", "repetition_penalty",
        "max_tool_calling_iterations"),
    "Parameters that control the data": ("shuffle_dataset", "pad_to_multiple_of"),
    "Parameters of evaluation and completion logs (GRPO's names and meanings)": (
        "num_generations_eval", "mask_truncated_completions", "log_completions", "num_completions_to_print",
        "log_unique_prompts", "log_completions_hub_repo"),
    "Parameters of TRL's GRPOConfig that ES maps onto prompt_batch_size (docs/grpo_fields.md)": tuple(
        e.name for e in GRPO_FIELDS if e.status == MAPPED),
    "Parameters of TRL's GRPOConfig that have no effect on ES, named in one warning at start (docs/grpo_fields.md)":
        tuple(e.name for e in ignored_fields()),
    "Parameters of TRL's GRPOConfig that ES refuses (docs/grpo_fields.md)": tuple(e.name for e in refused_fields()),
})
@dataclass
@answer_grpo_fields  # every other GRPOConfig field, refused by name (grpo_fields.GRPO_FIELDS)
class ESConfig(_BaseConfig):
    r"""
    Configuration class for [`ESTrainer`]: Evolution Strategies fine-tuning (Qiu et al. 2025, arXiv 2509.24372).

    Every [`~transformers.TrainingArguments`] field works as usual (``output_dir``, ``max_steps``,
    ``logging_steps``, ``save_steps``, ``report_to``, ``seed``, ...). One *step* is one ES iteration: a population
    of ``population_size`` perturbed models is scored on ``prompt_batch_size`` prompts and the weights move once.

    The ES defaults are those of the reference (Qiu et al. 2025, Sec. 4 and Algorithm 1): ``population_size=30``,
    ``sigma=1e-3``, ``learning_rate=5e-4``, z-scored fitness, greedy decoding. Unlike TRL's GRPOConfig,
    ``ESConfig()`` constructs on a CPU-only machine: ``bf16`` defaults to ``False``, and ``gradient_checkpointing``
    to ``None`` (resolved to ``False``: ES computes no gradient). With ``es_optimizer="es"`` the defaults add no
    weight decay, no clipping and no decaying schedule (``lr_scheduler_type="constant"``, ``max_grad_norm=0``).

    Preemption: ``resume_from_checkpoint="latest"`` (with ``save_steps``) makes a relaunched job (``torchrun
    --max-restarts N``) resume by itself from the newest complete checkpoint; a kill costs at most the iterations
    since that checkpoint (docs/scaling.md, "Preemption and elastic restarts").

    Only the parameters specific to ES (or whose defaults ES changes) are listed here; see
    [`~transformers.TrainingArguments`] for the rest. Every other field of TRL's ``GRPOConfig`` is a field here too
    (docs/grpo_fields.md): honoured under GRPO's name; GRPO's batch fields (``per_device_train_batch_size``,
    ``gradient_accumulation_steps``, ``steps_per_generation`` / ``generation_batch_size``) mapped onto
    ``prompt_batch_size``, GRPO's prompts per optimizer step (logged once); the settings of GRPO's loss (``beta``,
    ``epsilon``, ``loss_type``, ...) accepted and named in one warning with their ES counterpart (``beta`` ->
    ``awd_lambda``, the clipping fields -> ``sigma`` / ``learning_rate``); or refused with a ``ValueError`` that says
    why and what to do instead, where ES would give other results than the field asks for.
    """

    # Every dict-typed field (found from the type hints, new fields included) accepts a JSON string, as in TRL.
    _VALID_DICT_FIELDS = DictValuedFields()

    # ------------------------------------------------------------------ overridden TrainingArguments defaults
    learning_rate: float = field(
        default=5e-4,
        metadata={
            "help": "The ES step size alpha of the update theta <- theta + alpha/N * sum_i z_i * eps_i "
            "(Qiu et al. 2025, arXiv 2509.24372, Algorithm 1; default 5e-4 from the paper). With "
            "es_optimizer='torch' it is the torch optimizer's learning rate."
        },
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": "Learning-rate schedule. Default 'constant', as the ES reference (no decay)."},
    )
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Clip the ES gradient estimate to this norm (es_optimizer='torch' only). 0 = no clipping."},
    )
    bf16: bool | None = field(
        default=False,
        metadata={"help": "Load/train in bf16 mixed precision. Default False so ESConfig() works on CPU."},
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Unused by ES (no backward pass); resolves to False. Default None, which (unlike TRL's True) does "
            "not trigger transformers' deprecation warning for this alias of activation_checkpointing."
        },
    )
    remove_unused_columns: bool | None = field(
        default=False,
        metadata={"help": "Keep every dataset column: extra columns reach the reward functions as keyword arguments."},
    )
    dataloader_pin_memory: bool = field(
        default=False, metadata={"help": "Pin dataloader memory. Default False: ES loads text rows, not tensors."}
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every X ES iterations (default 1)."})
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Checkpoint to resume from when train() is called without resume_from_checkpoint: a checkpoint "
            "folder, or 'latest': the newest complete checkpoint-N of output_dir (a newer one left incomplete by a "
            "kill is skipped with a warning), or a new run if there is none. With 'latest' a job relaunched after "
            "preemption (torchrun --max-restarts N) resumes by itself; see docs/scaling.md. (TrainingArguments only "
            "stores it.)"
        },
    )
    per_device_train_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "GRPO's meaning: completions per process per micro-step. Set, it is mapped with "
            "gradient_accumulation_steps and num_generations onto prompt_batch_size = per_device_train_batch_size x "
            "processes x gradient_accumulation_steps / num_generations (GRPO's prompts per optimizer step; logged "
            "once). After construction it holds what the Trainer's dataloader loads: prompt_batch_size / processes "
            "prompts per process."
        },
    )

    # ------------------------------------------------------------------ model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `AutoModelForCausalLM.from_pretrained` when `model` is a string "
            "(e.g. {'dtype': 'bfloat16'})."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "GRPO's option: allow models that ship custom code from the Hub. True adds "
            "trust_remote_code=True to model_init_kwargs (used when `model` is a string)."
        },
    )

    # ------------------------------------------------------------------ ES
    population_size: int = field(
        default=30,
        metadata={"help": "Number N of perturbed models scored per iteration (default 30, Qiu et al. 2025). >= 2."},
    )
    sigma: float = field(
        default=1e-3,
        metadata={"help": "Noise scale sigma: member i is scored at theta + sigma * eps_i (default 1e-3, Qiu et al.)."},
    )
    fitness_shaping: Literal["zscore", "centered_rank", "none"] = field(
        default="zscore",
        metadata={
            "help": "How rewards become update coefficients: 'zscore' ((F - mean) / std, the reference's choice), "
            "'centered_rank' (ranks mapped to [-0.5, 0.5], Salimans et al. 2017), or 'none' (raw rewards)."
        },
    )
    per_prompt_shaping: Literal["none", "center", "zscore", "centered_rank"] = field(
        default="none",
        metadata={
            "help": "Shape each prompt's column of the members x prompts fitness matrix across the members before "
            "the mean over prompts (EGGROLL, arXiv 2511.16652): 'none' (a member's fitness is its mean reward), "
            "'center' (minus the population's mean on that prompt), 'zscore' (each prompt that separates the "
            "members weighs the same; one all members solve weighs nothing), 'centered_rank'. fitness_shaping "
            "applies after it."
        },
    )
    antithetic: bool = field(
        default=False,
        metadata={
            "help": "Mirrored sampling: members come in pairs +eps/-eps sharing a seed (population_size must be even)."
        },
    )
    prompt_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Prompts every member is scored on in one iteration (all members see the same prompts, so "
            "fitness values are comparable). Must be divisible by the number of processes. Unset (None): GRPO's "
            "prompts per optimizer step when GRPO's batch fields are set (per_device_train_batch_size x processes x "
            "gradient_accumulation_steps / num_generations), else 8. Set together with them, it must agree."
        },
    )
    es_optimizer: Literal["es", "torch"] = field(
        default="es",
        metadata={
            "help": "'es': the reference update applied directly. 'torch': the ES gradient estimate "
            "-(1/N) sum_i z_i eps_i is handed to the Trainer's optimizer via p.grad (Adam, schedulers, clipping)."
        },
    )
    include_parameters: str | None = field(
        default=None,
        metadata={
            "help": "Regular expression: perturb only trainable parameters whose name matches (re.search). "
            "Default: all trainable parameters (with a PEFT model, the adapter parameters)."
        },
    )
    exclude_parameters: str | None = field(
        default=None, metadata={"help": "Regular expression: never perturb parameters whose name matches."}
    )
    fp32_master_weights: bool = field(
        default=True,
        metadata={
            "help": "Keep an fp32 master copy of bf16/fp16 trained parameters, so updates below a 16-bit step are "
            "not lost (updates are always summed in fp32)."
        },
    )
    noise_source: Literal["auto", "table", "gaussian", "device_gaussian"] = field(
        default="auto",
        metadata={
            "help": "Where the Gaussian noise comes from: 'table' (slices of a shared table at hashed offsets, "
            f"Salimans et al. 2017), 'gaussian' (a fresh draw per {NOISE_BLOCK_SIZE}-element block from a CPU "
            "generator: identical on every device, ~10x slower than the table on CPU, no table memory), "
            "'device_gaussian' (the same from a generator on the weights' device: Philox on CUDA; values depend on "
            "the device type) or 'auto' (measured defaults: 'gaussian' for the low-rank backend, 'device_gaussian' "
            "for full-rank noise on CUDA, 'table' for full-rank noise elsewhere; see benchmarks/noise_sources.py)."
        },
    )
    noise_table_size: int = field(
        default=DEFAULT_TABLE_SIZE,
        metadata={
            "help": "Entries of the shared Gaussian noise table when the table is used, 2**26 = 256 MiB by default. "
            "0 = no table: fresh Gaussian noise per block (as noise_source='gaussian')."
        },
    )
    population_backend: Literal["sequential", "batched_lowrank"] = field(
        default="sequential",
        metadata={
            "help": "How members are evaluated: 'sequential' (perturb the weights in place with full-rank noise, "
            "generate, restore, one member at a time) or 'batched_lowrank' (EGGROLL, arXiv 2511.16652: rank-"
            "noise_rank perturbations applied per batch row, the members of a process in one generate call (or in "
            "chunks of member_chunk_size); trains only nn.Linear weights, select them with include_parameters, "
            "e.g. `r'proj\\.weight$'`)."
        },
    )
    noise_rank: int = field(
        default=1,
        metadata={
            "help": "Rank r >= 1 of each member's perturbation of each weight with population_backend="
            "'batched_lowrank': E_i = sigma / sqrt(r) * A_i B_i^T (EGGROLL, arXiv 2511.16652). Extra cost per "
            "token and Linear is O(r (in + out)). Ignored by 'sequential'."
        },
    )
    member_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "With population_backend='batched_lowrank': members per generate call (None: all members of a "
            "process in one call). One call holds member_chunk_size x prompt_batch_size x num_generations rows; "
            "lower it to bound activation and KV-cache memory. Ignored by 'sequential'."
        },
    )

    generation_engine: Literal["auto", "eager", "compiled", "continuous_batching"] = field(
        default="auto",
        metadata={
            "help": "How completions are generated: 'eager' (model.generate), 'compiled' (static KV cache + compiled "
            "decoding step on fixed batch buckets; for GPUs), 'continuous_batching' (transformers' generate_batch; "
            "set by use_transformers_continuous_batching) or 'auto' ('compiled' on CUDA when the model supports a "
            "static cache, else 'eager'). The choice is logged at start."
        },
    )
    share_prompt_prefix: bool = field(
        default=True,
        metadata={
            "help": "Eager engine: run the token prefix that all prompts of a batch share (chat-template system prompt "
            "and role markers) once per population member instead of once per prompt, then continue every prompt "
            "from its cache. Same computation up to rounding; skipped where unsafe (see docs/generation.md)."
        },
    )
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Generate with vLLM (TRL's GRPOConfig option): one colocated engine per process; full-rank members "
            "are written into the engine's weights from their seeds inside the vLLM worker, low-rank members are "
            "LoRA adapters (one per member, a group in one generate call). Needs vLLM (docs/generation.md). Not with "
            "DeepSpeed ZeRO-3 or a PEFT model yet."
        },
    )
    vllm_mode: Literal["colocate", "server"] = field(
        default="colocate",
        metadata={
            "help": "'colocate' (vLLM in the training process, TRL's meaning) or 'server' (a `vllm serve` started "
            "with trl_es's ES worker extension, at least one per training process: members and updates travel as "
            "seeds, completions over HTTP; docs/generation.md)."
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "Fraction of GPU memory the colocated engine takes for weights, activations and KV cache (TRL's "
            "default 0.3). Ignored on the CPU (see vllm_kv_cache_memory_bytes)."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "GPUs one engine spans (tensor parallelism, TRL's meaning); only 1 is supported yet (each "
                          "process scores its own members on its own engine)."},
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={"help": "Context window of the engine (prompt + completion tokens); None: the model config's."},
    )
    vllm_kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={
            "help": "KV-cache bytes of each engine (vLLM's kv_cache_memory_bytes). None: 1 GiB on the CPU, vLLM's "
            "sizing from vllm_gpu_memory_utilization on GPUs."
        },
    )
    vllm_model_impl: Literal["vllm"] = field(
        default="vllm",
        metadata={
            "help": "GRPO's option: the engine's model implementation: 'vllm' (vLLM's own). 'transformers' (vLLM's "
            "transformers backend) is refused: it does not start as a generative model in ES's engine yet."
        },
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None,
        metadata={
            "help": "GRPO's option: every completion is constrained to match this regex (vLLM structured outputs); "
            "None: off."
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={"help": "Base URL of the vLLM server (e.g. 'http://localhost:8000'); if set, vllm_server_host and "
                          "vllm_server_port are ignored (TRL's meaning)."},
    )
    vllm_server_host: str = field(
        default="0.0.0.0",
        metadata={"help": "Host of the vLLM server; ignored if vllm_server_base_url is set (TRL's meaning)."},
    )
    vllm_server_port: int = field(
        default=8000,
        metadata={"help": "Port of the vLLM server; ignored if vllm_server_base_url is set (TRL's meaning)."},
    )
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "Seconds to wait for the vLLM server to be up, then an error (TRL's meaning)."},
    )
    vllm_server_base_urls: list[str] | None = field(
        default=None,
        metadata={"help": "Several servers, at least one per training process (process i of W uses entries i, "
                          "i + W, ...; its members are dispatched dynamically over them, one in flight per server, "
                          "and a failed server's member runs again on another); overrides vllm_server_base_url. "
                          "None: the one server above."},
    )
    anchor_storage: Literal["auto", "memory", "file"] = field(
        default="auto",
        metadata={
            "help": "Where theta_0 (for AWD and drift logging) is kept: 'memory' (a resident copy in the model's "
            "dtype), 'file' or 'auto' (read back one tensor at a time from the base model's safetensors file when "
            "it holds exactly the initial values, checked at start; a resident copy for tensors it does not hold)."
        },
    )

    lean_memory: bool = field(
        default=False,
        metadata={
            "help": "Hold only what ES needs, at some speed: no noise table (noise_source 'auto' draws fresh "
            "Gaussian blocks, or uses the device generator on CUDA), and theta_0 only from the base checkpoint's "
            "safetensors file (anchor_storage 'auto' -> 'file'; drift logging is skipped when the file does not hold "
            "theta_0 and AWD is off). With population_backend='batched_lowrank' (no master copy of fp32 weights) "
            "and, for 16-bit models, fp32_master_weights=False, this is the lean mode of docs/scaling.md."
        },
    )

    # ------------------------------------------------------------------ transformers continuous batching (GRPO's)
    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={
            "help": "Generate with transformers' continuous batching engine (model.generate_batch: paged KV cache, "
            "requests scheduled as they finish), as GRPO does; sets generation_engine='continuous_batching'. One "
            "member a call on the live weights: population_backend='sequential' only, not with use_vllm, DeepSpeed "
            "ZeRO-3 or tools (docs/generation.md)."
        },
    )
    transformers_continuous_batching_config: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `transformers.generation.ContinuousBatchingConfig` (GRPO's; "
            "max_memory_percent defaults to GRPO's 0.5). Not 'seed': ES seeds each member's sampling."
        },
    )
    use_transformers_paged: bool = field(
        default=False,
        metadata={"help": "Deprecated (as in TRL). Use `use_transformers_continuous_batching` instead."},
    )
    # ------------------------------------------------------------------ AWD
    awd_lambda: float = field(
        default=0.0,
        metadata={
            "help": "Anchored Weight Decay strength lambda (arXiv 2605.30148): after each ES step the drift "
            "theta - theta_0 is shrunk by alpha*lambda. 0 = off. Paper: l2 with lambda=10 at alpha=5e-4; l1 with 0.01."
        },
    )
    awd_penalty: Literal["l2", "l1"] = field(
        default="l2",
        metadata={
            "help": "AWD penalty: 'l2' (delta <- (1 - alpha*lambda) delta) or 'l1' (soft-threshold delta at "
            "alpha*lambda)."
        },
    )

    log_parameter_drift: bool = field(
        default=True,
        metadata={
            "help": "Keep a CPU fp32 copy of the initial trained parameters theta_0 and log ||theta - theta_0|| "
            "(drift/l2) and its ratio to ||theta_0|| (drift/relative) at every log."
        },
    )
    log_module_drift: bool = field(
        default=False,
        metadata={
            "help": "Also log the drift of each module type (drift/l2/<module>, drift/relative/<module>: q_proj, "
            "down_proj, embed_tokens, ...; two keys per type, about 20 on a Llama) at every log. Needs "
            "log_parameter_drift=True."
        },
    )

    success_threshold: float = field(
        default=1.0,
        metadata={
            "help": "A completion counts as a success when its weighted reward is >= this value; used for the "
            "logged success_rate and the population success diversity JS_succ (arXiv 2608.27351). Default 1.0: a "
            "correct answer in the built-in tasks."
        },
    )

    # ------------------------------------------------------------------ generation (GRPO's names and meanings)
    num_generations: int = field(
        default=1,
        metadata={
            "help": "Completions per prompt per member (default 1: greedy decoding is deterministic). More than 1 "
            "samples: with temperature unset it samples at GRPO's 1.0; an explicit temperature=0 is refused (greedy "
            "copies of a prompt would be identical)."
        },
    )
    max_completion_length: int = field(default=256, metadata={"help": "Maximum new tokens per completion."})
    temperature: float | None = field(
        default=None,
        metadata={
            "help": "Sampling temperature; 0 = greedy decoding. Unset (None) resolves to 0.0 (greedy, as in the ES "
            "reference), or to GRPO's 1.0 (logged) when the config asks for sampling: num_generations > 1, "
            "num_generations_eval > 1, top_k or min_p set."
        },
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold (temperature > 0 only)."})
    generation_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Extra keyword arguments for `GenerationConfig` (override the above)."}
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Extra keyword arguments for `apply_chat_template` on conversational prompts."}
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Weight of each reward function (default all 1.0); `None` rewards are skipped, as in GRPO."},
    )
    top_k: int = field(
        default=0,
        metadata={
            "help": "GRPO's top-k filtering when sampling (0 = off). Merged into generation_kwargs (whose own top_k "
            "wins). Sampling only: with temperature unset it samples at GRPO's 1.0; refused with an explicit "
            "temperature=0."
        },
    )
    min_p: float | None = field(
        default=None,
        metadata={
            "help": "GRPO's min-p filtering when sampling, in [0, 1]. Merged into generation_kwargs (whose own min_p "
            "wins). Sampling only: with temperature unset it samples at GRPO's 1.0; refused with an explicit "
            "temperature=0."
        },
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "help": "GRPO's repetition penalty (> 0; 1.0 = off, > 1 discourages repeats), greedy or sampling. Merged "
            "into generation_kwargs (whose own repetition_penalty wins)."
        },
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "GRPO's: the most tool-calling rounds of a rollout with tools (ESTrainer's tools= or "
            "environment_factory=): after each round the tools' results are appended and the model continues, within "
            "max_completion_length (tool tokens included). None: until no call is made. An integer >= 0."
        },
    )

    # ------------------------------------------------------------------ data
    shuffle_dataset: bool | None = field(
        default=None,
        metadata={
            "help": "GRPO's option: False reads the training prompts in dataset order (train_sampling_strategy="
            "'sequential'); True shuffles them (train_sampling_strategy 'random', the default). None: as "
            "train_sampling_strategy."
        },
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "GRPO's option: each prompt batch is left-padded (masked) to a multiple of this many tokens. "
            "'auto' (GRPO's default: a multiple of 128 on AWS Neuron only, which ES does not run on) and None pad to "
            "the longest prompt."
        },
    )

    # ------------------------------------------------------------------ evaluation and completion logs
    num_generations_eval: int | None = field(
        default=None,
        metadata={
            "help": "Completions per prompt in evaluate() (None: num_generations). More than 1 samples (temperature "
            "unset: GRPO's 1.0; an explicit temperature=0 is refused)."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "ES's reading of GRPO's option: a completion that did not end with an EOS id (cut at "
            "max_completion_length) is left out of its member's fitness, as a completion whose rewards are all None. "
            "A member whose completions were all cut has no fitness (ranked worst); when no member has one, the step "
            "is exactly zero. The rewards/<name>/* metrics still count every completion; reward and fitness/* count "
            "the ones left in. Training only: evaluate() scores every completion."
        },
    )
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "At every log, the last iteration's completions (every member's, gathered to the main process): "
            "printed as a table with rich, written to `output_dir/completions/completions_{step:05d}.parquet`, and "
            "logged as a table to wandb / trackio when they are in report_to. Columns: step, prompt, completion, one "
            "per reward function, the reward functions' log_extra columns, advantage (the member's shaped fitness: "
            "its coefficient in the update) and member."
        },
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={"help": "Completions printed with rich at each log (a fixed-seed sample; None: all; 0: none, as in "
                          "GRPO)."},
    )
    log_unique_prompts: bool = field(
        default=False, metadata={"help": "Log one row per distinct prompt to wandb / trackio."}
    )
    log_completions_hub_repo: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset repo to which the completion parquet files are pushed (every 2 minutes, as GRPO); "
            "needs log_completions=True."
        },
    )

    #: TrainingArguments fields of a torch optimizer that the es_optimizer='es' update never reads, and what ES has
    #: instead: set to another value than ESConfig's default, they are warned about at start. A subclass whose other
    #: optimizer reads some of them (ES + SFT parallel averaging) names those in _optimizer_fields_read_elsewhere.
    _es_inert_optimizer_fields = {
        "weight_decay": "ES counterpart: awd_lambda (Anchored Weight Decay toward the initial weights theta_0)",
        "adam_beta1": "the ES update keeps no Adam moments",
        "adam_beta2": "the ES update keeps no Adam moments",
        "max_grad_norm": "the ES step is not clipped (learning_rate and sigma set its size)",
    }
    _optimizer_fields_read_elsewhere = ()

    def __post_init__(self):
        check_finite_floats(self)  # NaN / +-inf in any float field (inherited ones too), before anything else
        # Every field error is collected and raised at the end in one ValueError (raise_field_errors): a GRPO command
        # line with several refused fields is fixed in one run, not one rerun per field.
        errors = self._grpo_user_errors()
        batch = {name: getattr(self, name) for name in _BATCH_FIELDS}  # as given (None: unset), mapped below
        self.per_device_train_batch_size = 1  # replaced below; set before TrainingArguments validates batch sizes
        from ..distributed import resolve_cpu_world

        resolve_cpu_world(self)  # several launched processes without GPU: use_cpu=True, before the devices are set up
        try:
            super().__post_init__()
        except ValueError as error:
            if not errors:
                raise
            raise_field_errors(errors + [str(error)])
        self._temperature_unset = self.temperature is None  # resolved in _check_and_derive (again in check_fields)
        self._check_and_derive(errors, batch)
        self._warn_about_grpo_scale_values()

    def check_fields(self) -> None:
        """Check the config again, as at construction, for fields set on a built config (TRL's
        ``grpo_continuous_batching.py`` sets ``training_args.use_transformers_continuous_batching = True`` after
        ``parse_args``); ``ESTrainer`` calls it when it is built. The derivations of ``__post_init__`` are redone
        idempotently: a batch field (``per_device_train_batch_size``, ``gradient_accumulation_steps``,
        ``prompt_batch_size``) still at the value ES derived counts as given at construction (so the mapping of
        GRPO's batch fields follows a changed field), a ``temperature`` left unset at construction (and not assigned
        since) is resolved again, and ``generation_kwargs`` gets the GRPO fields it took from them replaced, not
        merged twice. ``TrainingArguments.__post_init__`` is not run again. Ignored GRPO fields set since construction
        are warned about (what was warned about once is not repeated).

        Raises:
            ValueError: naming every refused or invalid field, in one message as ``__post_init__``.
        """
        check_finite_floats(self)
        errors = self._grpo_user_errors()
        given, derived = getattr(self, "_batch_given", {}), getattr(self, "_batch_derived", {})
        batch = {name: given[name] if name in derived and getattr(self, name) == derived[name] else getattr(self, name)
                 for name in _BATCH_FIELDS}
        self._check_and_derive(errors, batch)
        self._warn_about_grpo_scale_values()

    def _grpo_user_errors(self) -> list[str]:
        """The errors checked before ``TrainingArguments.__post_init__``: every refused ``GRPOConfig`` field
        (``cast_lm_head_to_fp32=True``, continuous batching, ...: named with what to do instead) and what
        ``es_optimizer='torch'`` cannot go with."""
        errors = grpo_field_errors(self)
        if self.es_optimizer == "torch":
            if self.fp16:
                errors.append("fp16=True cannot go with es_optimizer='torch': ES has no backward pass, so there is no "
                              "loss to scale (the GradScaler would unscale an unscaled gradient). Load the model in "
                              "float16 with model_init_kwargs={'dtype': 'float16'} instead, with fp16=False.")
            optim = getattr(self.optim, "value", self.optim)
            if "schedule_free" in str(optim):
                errors.append(f"optim={optim!r} cannot go with es_optimizer='torch': ES steps the optimizer within the "
                              "iteration and Trainer's own step then finds no gradient, which a schedule-free "
                              "optimizer would still count as a step. Use a torch optimizer such as 'adamw_torch' or "
                              "'sgd'.")
        return errors

    def _check_and_derive(self, errors: list[str], batch: dict[str, Any]) -> None:
        """The checks and derivations after ``TrainingArguments.__post_init__`` (and in :meth:`check_fields`): each
        error is appended to ``errors``, then all of them are raised in one ``ValueError``. ``batch``: the batch
        fields as given (:data:`_BATCH_FIELDS`; ``None``: unset), mapped by :meth:`_map_grpo_batch`."""
        self._resolve_temperature()
        if self.population_size < 2:
            errors.append(f"population_size must be >= 2, got {self.population_size}.")
        elif self.antithetic and self.population_size % 2:
            errors.append(f"antithetic=True needs an even population_size, got {self.population_size}.")
        if not self.sigma > 0:
            errors.append(f"sigma must be > 0, got {self.sigma}.")
        if not self.learning_rate > 0:
            errors.append(f"learning_rate must be > 0, got {self.learning_rate}.")
        own_reason = ("vllm_model_impl",) if self.vllm_model_impl == "transformers" else ()  # refused with its reason
        errors += literal_field_errors(self, skip=own_reason)  # every Literal field: fitness_shaping, es_optimizer, ...
        if not isinstance(self.noise_rank, int) or self.noise_rank < 1:
            errors.append(f"noise_rank must be an integer >= 1, got {self.noise_rank!r}.")
        _collect(errors, self._check_optional_counts, "member_chunk_size")
        if self.awd_lambda < 0:
            errors.append(f"awd_lambda must be >= 0, got {self.awd_lambda}.")
        elif self.awd_penalty == "l2" and self.learning_rate * self.awd_lambda >= 1:
            errors.append(
                f"awd_penalty='l2' needs learning_rate * awd_lambda < 1 (got {self.learning_rate * self.awd_lambda}): "
                "the drift would flip sign."
            )
        if self.noise_table_size != 0 and self.noise_table_size < NOISE_BLOCK_SIZE:
            errors.append(f"noise_table_size must be 0 or >= {NOISE_BLOCK_SIZE}, got {self.noise_table_size}.")
        _collect(errors, self._check_vllm_settings)
        _collect(errors, self._apply_continuous_batching)
        for name in ("num_generations", "max_completion_length"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1, got {getattr(self, name)}.")
        _collect(errors, self._check_optional_counts, "num_generations_eval")
        count = self.num_completions_to_print
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            errors.append(f"num_completions_to_print must be None (print all) or an integer >= 0 (0 prints none, as "
                          f"in GRPO), got {count!r}.")
        if self.log_completions_hub_repo is not None and not self.log_completions:
            errors.append("log_completions_hub_repo is set, but log_completions is False: set log_completions=True "
                          "to push the completion logs to the Hub, or unset log_completions_hub_repo.")
        if self.log_module_drift and not self.log_parameter_drift:
            errors.append("log_module_drift=True logs the drift per module type, but log_parameter_drift=False logs "
                          "no drift: set log_parameter_drift=True, or unset log_module_drift.")
        if self.temperature < 0:
            errors.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}.")
        self._apply_grpo_generation_fields(errors)
        try:  # GRPO's pad_to_multiple_of, resolved as GRPOConfig does: "auto" -> None (no Neuron), "64" -> 64
            self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        except ValueError as error:
            errors.append(str(error))
        _collect(errors, self._apply_grpo_model_and_data_fields)
        _collect(errors, self._map_grpo_batch, batch)
        if self.save_on_each_node:
            errors.append("save_on_each_node=True is not supported: transformers 5 save_pretrained writes the model "
                          "only on global rank 0, so the other nodes would get checkpoints without weights. Save "
                          "to a shared filesystem from the main process (save_on_each_node=False).")
        _collect(errors, check_fp16_device, self)
        raise_field_errors(errors)

    def _resolve_temperature(self) -> None:
        """``temperature`` left unset (``None``): GRPO's 1.0 when the config asks for sampling (``num_generations >
        1``, ``num_generations_eval > 1``, ``top_k`` or ``min_p`` set; logged once), else 0.0, the ES reference's
        greedy decoding (so ``num_generations=1`` stays greedy, bit for bit). ``generation_kwargs`` that switch
        sampling on themselves (``do_sample=True``) keep 0.0: they set the sampling, as before. An explicit
        ``temperature`` is kept as it is."""
        if not getattr(self, "_temperature_unset", False):
            return
        if self.temperature is not None and self.temperature != getattr(self, "_resolved_temperature", None):
            self._temperature_unset = False  # assigned after construction: explicit from now on
            return
        asks = []
        for name in ("num_generations", "num_generations_eval"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                asks.append(f"{name}={value}")
        asks += [f"{name}={getattr(self, name)!r}" for name, off in (("top_k", 0), ("min_p", None))
                 if getattr(self, name) != off]
        kwargs = self.generation_kwargs if isinstance(self.generation_kwargs, dict) else {}
        sample = bool(asks) and not kwargs.get("do_sample")
        resolved = GRPO_TEMPERATURE if sample else 0.0
        if sample and getattr(self, "_resolved_temperature", None) != resolved:
            logger.warning(f"temperature is unset and {', '.join(asks)} asks for sampling: sampling at GRPO's default "
                           f"temperature={GRPO_TEMPERATURE} (ES's own default, for one greedy completion per prompt, "
                           "is 0.0). Set temperature to choose another.")
        self.temperature = resolved
        self._resolved_temperature = resolved

    def _inert_optimizer_fields(self) -> list[str]:
        """The torch-optimizer settings (:attr:`_es_inert_optimizer_fields`) set to another value than their
        ``ESConfig`` default under ``es_optimizer='es'``, which never reads them."""
        if self.es_optimizer != "es":
            return []
        defaults = {f.name: f.default for f in dataclasses.fields(type(self))}
        return [name for name in self._es_inert_optimizer_fields
                if name not in self._optimizer_fields_read_elsewhere and getattr(self, name) != defaults.get(name)]

    def _warn_about_grpo_scale_values(self) -> None:
        """Warn about values a GRPO recipe brings that mean something else, or nothing, in ES: an AdamW-scale
        ``learning_rate`` under ``es_optimizer='es'`` (it is ES's step size alpha), and in one warning every setting
        that has no effect: the ignored ``GRPOConfig`` fields (GRPO's loss: ``beta``, ``epsilon``, ``loss_type``,
        ...; :func:`~.grpo_fields.grpo_field_notices`) and, under ``es_optimizer='es'``, the torch-optimizer settings
        the ES update never reads (:meth:`_inert_optimizer_fields`), each with its ES counterpart. Called at
        construction and by :meth:`check_fields`; what was said once is not said again."""
        said = self.__dict__.setdefault("_warned", set())
        messages = []
        if self.es_optimizer == "es" and 0 < self.learning_rate < ES_STEP_SIZE_WARNING_BELOW:
            messages.append(f"learning_rate={self.learning_rate} is ES's step size alpha (theta += alpha / N * sum_i "
                            "z_i * eps_i; ES's default 5e-4), not an AdamW learning rate: an AdamW-scale value "
                            "(GRPO's default 1e-6, a GRPO recipe's 5e-7 .. 5e-5) moves the weights by next to "
                            "nothing. Use an ES step size (5e-4 .. 1e-2), or es_optimizer='torch' to hand the ES "
                            "gradient estimate to AdamW at this learning rate.")
        notices = grpo_field_notices(self)
        notices += [f"{name}={getattr(self, name)} has no effect with es_optimizer='es' (the ES update uses no torch "
                    f"optimizer): {self._es_inert_optimizer_fields[name]}. With es_optimizer='torch' it configures the "
                    "torch optimizer that receives the ES gradient estimate."
                    for name in self._inert_optimizer_fields()]
        notices = [notice for notice in notices if notice not in said]
        if notices:
            messages.append(notices_message(notices))
        for message in messages:
            if message not in said:
                warnings.warn(message, UserWarning, stacklevel=4)
        said.update(messages, notices)

    def _apply_grpo_generation_fields(self, errors: list[str]) -> None:
        """GRPO's ``top_k``, ``min_p`` and ``repetition_penalty``, merged into ``generation_kwargs`` (what the trainer
        builds its ``GenerationConfig`` from; a key ``generation_kwargs`` already holds wins, as in GRPO); values that
        change nothing (``top_k=0``, ``min_p=None``, ``repetition_penalty=1.0``) are not added. The keys this adds
        are remembered, so a second call (:meth:`check_fields`) replaces them instead of letting the old values win.
        Then ``num_generations > 1`` with greedy decoding is refused: the copies of a prompt would be identical.

        Appends to ``errors``: naming the field: a sampling-only setting, or ``num_generations > 1``, with greedy
        decoding (an explicit ``temperature=0``); a value out of range.
        """
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            errors.append(f"top_k must be an integer >= 0 (0 = off, as in GRPO), got {self.top_k!r}.")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            errors.append(f"min_p must be None or in [0, 1], got {self.min_p}.")
        if not self.repetition_penalty > 0:
            errors.append(f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty}.")
        limit = self.max_tool_calling_iterations
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            errors.append(f"max_tool_calling_iterations must be None (no limit) or an integer >= 0, got {limit!r}.")
        kwargs = self.generation_kwargs if isinstance(self.generation_kwargs, dict) else {}
        added = getattr(self, "_generation_kwargs_added", ())
        kwargs = {key: value for key, value in kwargs.items() if key not in added}
        sampling = self.temperature > 0 or bool(kwargs.get("do_sample"))
        if not sampling:
            for name, off in (("top_k", 0), ("min_p", None)):
                if getattr(self, name) != off:
                    errors.append(f"{name}={getattr(self, name)!r} filters tokens when sampling, but temperature=0 "
                                  f"decodes greedily: set temperature > 0 (e.g. 1.0, GRPO's default, which an unset "
                                  f"temperature resolves to) to sample, or leave {name} at {off!r}.")
            for name in ("num_generations", "num_generations_eval"):
                count = getattr(self, name)
                if count is not None and count > 1:
                    errors.append(f"{name}={count} with greedy decoding (temperature=0) would score {count} "
                                  "identical copies of each completion: set temperature > 0 (e.g. 1.0, GRPO's "
                                  "default, which an unset temperature resolves to) to sample different completions, "
                                  f"or {name}=1.")
        neutral = (("top_k", 0), ("min_p", None), ("repetition_penalty", 1.0))
        merged = {name: getattr(self, name) for name, off in neutral if getattr(self, name) != off}
        self._generation_kwargs_added = tuple(key for key in merged if key not in kwargs)
        if merged or added:
            self.generation_kwargs = {**merged, **kwargs} or None

    def _apply_grpo_model_and_data_fields(self) -> None:
        """GRPO's ``trust_remote_code`` (into ``model_init_kwargs``) and ``shuffle_dataset`` (as
        ``train_sampling_strategy``).

        Raises:
            ValueError: naming both fields when they contradict each other.
        """
        if self.trust_remote_code:
            init_kwargs = dict(self.model_init_kwargs or {})
            if init_kwargs.get("trust_remote_code", True) is not True:
                raise ValueError("trust_remote_code=True contradicts model_init_kwargs={'trust_remote_code': "
                                 f"{init_kwargs['trust_remote_code']!r}}}: set one of them.")
            init_kwargs["trust_remote_code"] = True
            self.model_init_kwargs = init_kwargs
        if self.shuffle_dataset is not None:
            strategy = getattr(self.train_sampling_strategy, "value", self.train_sampling_strategy)
            wanted = "random" if self.shuffle_dataset else "sequential"
            if strategy not in ("random", wanted):
                raise ValueError(f"shuffle_dataset={self.shuffle_dataset} contradicts train_sampling_strategy="
                                 f"{strategy!r}: set train_sampling_strategy alone ('random' shuffles, 'sequential' "
                                 "keeps the dataset order), or shuffle_dataset alone.")
            self.train_sampling_strategy = wanted

    def to_dict(self) -> dict[str, Any]:
        """``TrainingArguments.to_dict``, without the mapped, ignored and refused ``GRPOConfig`` fields left unset
        (``None``), so logs and trackers show the ES settings only; ``per_device_train_batch_size`` and
        ``gradient_accumulation_steps`` as given (GRPO's meaning, ``None``: unset), next to the ``prompt_batch_size``
        they were mapped to, so ``ESConfig(**config.to_dict())`` is the same config."""
        d = super().to_dict()
        for entry in added_fields():
            if d.get(entry.name, 0) is None:
                del d[entry.name]
        given = getattr(self, "_batch_given", {})
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if name in given and getattr(self, name) == self._batch_derived[name]:
                d[name] = given[name]
        return d

    def _map_grpo_batch(self, batch: dict[str, Any]) -> None:
        """``prompt_batch_size``, from GRPO's batch fields when any is set, and the per-process batch.

        GRPO (TRL 1.16) takes one optimizer step on ``per_device_train_batch_size x processes x
        gradient_accumulation_steps`` completions, ``num_generations`` of each prompt: that number divided by
        ``num_generations`` prompts. ES's counterpart is the prompts of one iteration, so ``prompt_batch_size`` is
        that; ``steps_per_generation`` / ``generation_batch_size`` (how many optimizer steps GRPO spends one
        generation batch on; ES generates afresh for every iteration) are checked as GRPO checks them. An unset
        ``per_device_train_batch_size`` is GRPO's default 8 there; with none of GRPO's batch fields set,
        ``prompt_batch_size`` unset is 8. The mapping is logged once (:meth:`grpo_fields_plan` has it for the plan
        of ``train()``). Then ``per_device_train_batch_size`` is ``prompt_batch_size / processes`` (what the Trainer's
        dataloader loads on each process; ESTrainer gathers them) and ``gradient_accumulation_steps`` 1 (one step is
        one ES iteration).

        Args:
            batch (`dict`): ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and
                ``prompt_batch_size`` as given (``None``: unset).

        Raises:
            ValueError: naming the fields: a value GRPO refuses too (not divisible), a GRPO batch that is not a whole
                number of prompts per optimizer step, a ``prompt_batch_size`` given with GRPO's batch fields that
                disagrees with them (both named), or one not divisible by the number of processes.
        """
        per_device, accumulation, prompts = (batch[name] for name in _BATCH_FIELDS)
        if prompts is not None:
            check_int("prompt_batch_size", prompts, 1)
        world, mapping = self.world_size, None
        if (per_device is not None or accumulation != 1 or self.generation_batch_size is not None
                or self.steps_per_generation is not None):
            mapped, mapping = self._grpo_prompts(per_device, accumulation, world)
            if prompts is not None and prompts != mapped:
                raise ValueError(f"prompt_batch_size={prompts} contradicts GRPO's batch fields, {mapping[0]} = "
                                 f"{mapped} prompts per optimizer step. Set prompt_batch_size alone (ES's prompts per "
                                 "iteration) or GRPO's batch fields alone, or make them agree.")
            prompts = mapped
        elif prompts is None:
            prompts = DEFAULT_PROMPT_BATCH_SIZE
        if prompts % world:
            source = f" (GRPO's batch fields: {mapping[0]})" if mapping else ""
            raise ValueError(f"prompt_batch_size ({prompts}{source}) must be divisible by the number of processes "
                             f"({world}): each process loads prompt_batch_size / {world} whole prompts, then all "
                             "share them (GRPO may split a prompt's completions over processes; ES cannot).")
        self.prompt_batch_size = prompts
        self.per_device_train_batch_size = prompts // world
        self.gradient_accumulation_steps = 1
        self._batch_given = dict(batch)
        self._batch_derived = {name: getattr(self, name) for name in _BATCH_FIELDS}
        self._grpo_batch_mapping = mapping
        if mapping is not None and mapping != getattr(self, "_logged_batch_mapping", None):
            logger.warning(f"GRPO's batch fields mapped to prompt_batch_size={prompts}: {mapping[1]}")
            self._logged_batch_mapping = mapping

    def _grpo_prompts(self, per_device: int | None, accumulation: int, world: int) -> tuple[int, tuple[str, str]]:
        """GRPO's prompts per optimizer step, and the mapping in words: ``(formula, explanation)``.

        Raises:
            ValueError: as :meth:`_map_grpo_batch`.
        """
        if per_device is not None:
            check_int("per_device_train_batch_size", per_device, 1)
        check_int("gradient_accumulation_steps", accumulation, 1)
        self._check_optional_counts("generation_batch_size", "steps_per_generation")
        generations = self.num_generations
        check_int("num_generations", generations, 1)
        size = per_device if per_device is not None else GRPO_PER_DEVICE_TRAIN_BATCH_SIZE
        global_batch = size * world
        steps, generation = self.steps_per_generation, self.generation_batch_size
        if generation is not None and steps is not None:
            raise ValueError(f"generation_batch_size={generation} and steps_per_generation={steps} cannot both be set "
                             "(GRPO refuses it too): set one of them.")
        if generation is not None:
            if generation % global_batch:
                raise ValueError(f"generation_batch_size ({generation}) must be divisible by the global batch size "
                                 f"per_device_train_batch_size x processes = {size} x {world} = {global_batch} (GRPO "
                                 "refuses it too).")
            steps = generation // global_batch
        elif steps is None:
            steps = accumulation  # GRPO's default: one generation batch per optimizer step
        generation = global_batch * steps
        if generation % generations:
            raise ValueError(f"generation_batch_size ({generation} = per_device_train_batch_size {size} x {world} "
                             f"processes x steps_per_generation {steps}) must be divisible by num_generations "
                             f"({generations}) (GRPO refuses it too): a generation batch holds whole prompts.")
        completions = global_batch * accumulation
        processes = f"{world} process{'es' if world > 1 else ''}"
        grpo_step = (f"per_device_train_batch_size={size}{'' if per_device is not None else ' (unset: GRPO default)'}"
                     f" x {processes} x gradient_accumulation_steps={accumulation}")
        if completions % generations:
            raise ValueError(f"GRPO's batch fields cannot be mapped: one GRPO optimizer step holds {grpo_step} = "
                             f"{completions} completions, not a whole number of prompts at num_generations="
                             f"{generations} (GRPO spreads a prompt's completions over optimizer steps here), but an "
                             "ES iteration scores whole prompts. Make that product a multiple of num_generations, or "
                             "set prompt_batch_size instead of GRPO's batch fields.")
        prompts = completions // generations
        formula = f"{grpo_step} / num_generations={generations}"
        words = (f"one GRPO optimizer step holds {grpo_step} = {completions} completions, {completions} / "
                 f"num_generations={generations} = {prompts} prompts; each ES iteration scores every member on "
                 f"{prompts} prompts, {generations} completion(s) each. per_device_train_batch_size is now "
                 f"{prompts // world if prompts % world == 0 else '-'} (prompts per process) and "
                 "gradient_accumulation_steps 1.")
        if self.generation_batch_size is not None or self.steps_per_generation is not None:
            words += (f" generation_batch_size={generation} (steps_per_generation={steps}): GRPO generates "
                      f"{generation} completions at a time and spends them over {steps}/{accumulation} optimizer "
                      "step(s); ES generates afresh for every iteration, with the same prompts per update.")
        return prompts, (formula, words)

    def grpo_fields_plan(self) -> dict[str, list[str]]:
        """GRPO's fields this config mapped or ignores, for the plan ``ESTrainer.train()`` prints.

        Returns:
            `dict`: ``"mapped"``: the batch mapping (``"per_device_train_batch_size=16 x 1 process x
            gradient_accumulation_steps=4 / num_generations=16 -> prompt_batch_size=4"``), empty when none of GRPO's
            batch fields was set; ``"ignored"``: ``name=value`` of each ignored GRPO field and inert optimizer field
            that was warned about at start.
        """
        mapping = getattr(self, "_grpo_batch_mapping", None)
        mapped = [f"{mapping[0]} -> prompt_batch_size={self.prompt_batch_size}"] if mapping else []
        for name in ("generation_batch_size", "steps_per_generation"):
            if mapping and getattr(self, name) is not None:
                mapped.append(f"{name}={getattr(self, name)} (how GRPO reuses a generation batch: ES generates "
                              "afresh every iteration)")
        ignored = [f"{e.name}={getattr(self, e.name)!r}" for e in ignored_fields()
                   if not e.accepts(getattr(self, e.name), self)]
        ignored += [f"{name}={getattr(self, name)!r}" for name in self._inert_optimizer_fields()]
        return {"mapped": mapped, "ignored": ignored}

    def _check_optional_counts(self, *names: str) -> None:
        """Each of ``names`` is ``None`` or an integer >= 1 (a bool is not a count).

        Raises:
            ValueError: naming the first field that is not, and its value.
        """
        for name in names:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}.")

    def _apply_continuous_batching(self) -> None:
        """GRPO's continuous-batching fields: ``use_transformers_paged`` (deprecated) turns
        ``use_transformers_continuous_batching`` on with a ``FutureWarning``, as in TRL; either that field or
        ``generation_engine='continuous_batching'`` sets the other. ``transformers_continuous_batching_config`` is
        checked whether or not the engine is on (GRPO ignores it when off).

        Raises:
            ValueError: naming the fields, for an invalid config, or the engine with ``use_vllm``, another
                ``generation_engine`` or ``population_backend='batched_lowrank'``.
        """
        if self.use_transformers_paged and not self.use_transformers_continuous_batching:
            warnings.warn("`use_transformers_paged` is deprecated and will be removed in TRL v2.0.0. Use "
                          "`use_transformers_continuous_batching` instead.", FutureWarning, stacklevel=5)
            self.use_transformers_continuous_batching = True
        check_continuous_batching_config(self.transformers_continuous_batching_config)
        if not (self.use_transformers_continuous_batching or self.generation_engine == "continuous_batching"):
            return
        name = "use_transformers_continuous_batching=True" if self.use_transformers_continuous_batching \
            else "generation_engine='continuous_batching'"
        if self.use_vllm:
            raise ValueError(f"{name} and use_vllm=True name two generation engines: set one of them.")
        if self.generation_engine not in ("auto", "continuous_batching"):
            raise ValueError(f"{name} contradicts generation_engine={self.generation_engine!r}: set one of them.")
        if self.population_backend == "batched_lowrank":
            raise ValueError(f"{name} generates one member a call on the live weights; population_backend="
                             "'batched_lowrank' (per-row low-rank members in one call) needs generation_engine "
                             "'eager' or 'compiled': use population_backend='sequential', or unset "
                             "use_transformers_continuous_batching.")
        self.generation_engine = "continuous_batching"
        self.use_transformers_continuous_batching = True

    def _check_vllm_settings(self) -> None:
        """The vLLM fields (checked whether or not ``use_vllm`` is on, so a bad value never waits for a GPU run;
        ``vllm_mode`` and ``vllm_model_impl`` values outside their ``Literal`` are refused by
        :func:`~trl_es.arguments.literal_field_errors`).

        Raises:
            ValueError: naming the field and its allowed values.
        """
        if not (isinstance(self.vllm_server_timeout, (int, float)) and self.vllm_server_timeout >= 0):
            raise ValueError(f"vllm_server_timeout must be a number of seconds >= 0, got {self.vllm_server_timeout!r}.")
        check_int("vllm_server_port", self.vllm_server_port, 1)
        urls = self.vllm_server_base_urls
        if urls is not None and (not isinstance(urls, (list, tuple)) or not urls
                                 or not all(isinstance(u, str) and u for u in urls)):
            raise ValueError(f"vllm_server_base_urls must be None or a list of distinct URLs, at least one per "
                             f"training process; got {urls!r}.")
        if urls is not None or self.vllm_server_base_url is not None:  # one spelling per server, as the client's
            from ...generation.vllm_server import normalize_server_url

            if self.vllm_server_base_url is not None:
                normalize_server_url(self.vllm_server_base_url, "vllm_server_base_url")
            normalized = [normalize_server_url(u, "vllm_server_base_urls") for u in urls or ()]
            if len(set(normalized)) != len(normalized):
                raise ValueError(f"vllm_server_base_urls must be None or a list of distinct URLs, at least one per "
                                 f"training process; got {urls!r}, that is {normalized} (scheme and host case, "
                                 "default port and trailing '/' do not make another server).")
        if self.use_vllm and self.vllm_mode == "server" and self.population_backend != "sequential":
            raise ValueError("vllm_mode='server' writes full-rank members into the server's weights: use "
                             f"population_backend='sequential' (got {self.population_backend!r}).")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}.")
        check_int("vllm_tensor_parallel_size", self.vllm_tensor_parallel_size, 1)
        self._check_optional_counts("vllm_max_model_length", "vllm_kv_cache_memory_bytes")
        if self.vllm_model_impl == "transformers":
            raise ValueError("vllm_model_impl='transformers' is not supported by ES yet: vLLM 0.32's transformers "
                             "backend does not start as a generative model in ES's colocated engine ('LLM.generate() "
                             "is only supported for generative models'). Use vllm_model_impl='vllm'.")
        if self.vllm_structured_outputs_regex is not None:
            try:
                re.compile(self.vllm_structured_outputs_regex)
            except re.error as error:
                raise ValueError(f"vllm_structured_outputs_regex={self.vllm_structured_outputs_regex!r} is not a "
                                 f"regular expression: {error}.") from None
            if not self.use_vllm:
                raise ValueError("vllm_structured_outputs_regex constrains vLLM's sampler: set use_vllm=True (the "
                                 "transformers engines take no regex), or unset it.")
        if self.use_vllm and self.generation_engine not in ("auto",):
            raise ValueError(f"use_vllm=True generates with vLLM: leave generation_engine at 'auto' (got "
                             f"{self.generation_engine!r}).")
