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
from ...generation import ENGINES, check_continuous_batching_config
from .es_stability import stability_field_errors
from .grpo_fields import (
    BATCH_FIELDS,
    DEFAULT_PROMPT_BATCH_SIZE,
    GRPO_FIELDS,
    MAPPED,
    GRPOTranslation,
    added_fields,
    answer_grpo_fields,
    check_optional_counts,
    collect_error,
    grpo_field_errors,
    grpo_field_notices,
    grpo_fields_plan,
    ignored_fields,
    notices_message,
    raise_field_errors,
    refused_fields,
    translate_grpo_fields,
)


#: Below this, ``learning_rate`` under ``es_optimizer="es"`` is an AdamW-scale value, warned about at start.
ES_STEP_SIZE_WARNING_BELOW = 1e-4

logger = logging.getLogger(__name__)


def check_fp16_device(config) -> None:
    """Refuse ``fp16=True`` on the CPU.

    Raises:
        ValueError: naming the field and what to use instead.
    """
    # accelerate runs fp16 autocast on GPUs only: every forward would stay in the model's dtype
    if config.fp16 and config.device.type == "cpu":
        raise ValueError("fp16=True is not applied on the CPU (accelerate runs fp16 mixed precision on GPUs only, so "
                         "every forward would stay in the model's dtype): use bf16=True (bf16 autocast on the CPU), or "
                         "fp16=False and load the model in float16 with model_init_kwargs={'dtype': 'float16'}.")


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
    "Parameters of sigma='auto' and the collapse guard": (
        "sigma_target", "sigma_adapt_steps", "sigma_calibration_prompts", "collapse_guard", "collapse_guard_threshold",
        "collapse_guard_patience", "collapse_guard_alpha_factor"),
    "Parameters that control generation acceleration powered by vLLM": (
        "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_length",
        "vllm_kv_cache_memory_bytes", "vllm_model_impl", "vllm_structured_outputs_regex"),
    "Parameters for \"server\" vLLM mode": (
        "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
        "vllm_server_base_urls"),
    "Parameters that control generation acceleration powered by transformers continuous batching": (
        "use_transformers_continuous_batching", "transformers_continuous_batching_config", "use_transformers_paged"),
    "Parameters that control Anchored Weight Decay (AWD)": (
        "awd_lambda", "awd_penalty", "log_parameter_drift", "log_module_drift"),
    "Parameters that control the success metrics": ("success_threshold",),
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

    One *step* is one ES iteration: ``population_size`` perturbed models are scored on ``prompt_batch_size`` prompts
    and the weights move once. The defaults are the paper's (Sec. 4, Algorithm 1: ``population_size=30``,
    ``sigma=1e-3``, ``learning_rate=5e-4``, z-scored fitness, greedy decoding), and ``ESConfig()`` constructs on a
    CPU-only machine (``bf16=False``).

    Every [`~transformers.TrainingArguments`] field works as usual; every other field of TRL's ``GRPOConfig`` is a field
    here too, honoured, mapped onto ``prompt_batch_size``, ignored with a warning, or refused (docs/grpo_fields.md).
    Only ES's parameters, and those whose defaults ES changes, are listed here; a refused or invalid field raises
    one ``ValueError`` naming every such field.
    """

    # keeps the values given for the fields GRPO's translation rewrites, so check_fields redoes it; not annotated: no
    # dataclass field, flag or YAML key; pickled, not in to_dict(); set by __post_init__
    grpo_translation = None

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
            "(e.g. {'dtype': 'bfloat16'}; a 'quantization_config' loads a frozen quantized base, with a peft_config "
            "only: docs/scaling.md, ES on a quantized base)."
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
    # `| None` makes transformers' HfArgumentParser read the value as a string ("auto" or a number); None is refused
    sigma: float | str | None = field(
        default=1e-3,
        metadata={"help": "Noise scale sigma: member i is scored at theta + sigma * eps_i (default 1e-3, Qiu et al.); "
                  "a number > 0, or 'auto': chosen before the first iteration (again after a rollback and every "
                  "sigma_adapt_steps iterations) so that a fraction sigma_target of the members' greedy completions "
                  "differ from the unperturbed model's (docs/es_trainer.md, 'sigma=auto'). Every seed-log record then "
                  "holds the sigma it used."},
    )
    sigma_target: float = field(
        default=0.48,
        metadata={"help": "sigma='auto': the fraction of (member, prompt) greedy completions on the calibration's "
                  "prompts that differ from the unperturbed model's, in (0, 1). 0.48: the effect of the main job's "
                  "tuned sigma (5e-3, rank-1 members, SmolLM2-135M) over the first batches of 3 training seeds."},
    )
    sigma_adapt_steps: int = field(
        default=0,
        metadata={"help": "sigma='auto': choose sigma again every this many iterations, with the same probes around "
                  "the current weights, starting from the sigma in use (0: at the first iteration and after a "
                  "rollback only). >= 0."},
    )
    sigma_calibration_prompts: int = field(
        default=48,
        metadata={"help": "sigma='auto': prompts a calibration rolls out, the iteration's batch and the rest drawn "
                  "from train_dataset (seeded by seed and the step: the same on every process and on resume; a "
                  "smaller train_dataset gives all its rows, an iterable one none; at most the batch: none drawn). 48 "
                  "narrows the chosen sigma's spread between training seeds from 2.7x (12 prompts) to 1.3x "
                  "(docs/es_trainer.md). An integer >= 0."},
    )
    collapse_guard: bool = field(
        default=False,
        metadata={"help": "Roll the weights back through the seed log when the reward collapses: after "
                  "collapse_guard_patience iterations in a row whose mean reward is more than collapse_guard_threshold "
                  "standard errors below the best so far, the ES steps since the best weights are undone (a seed-log "
                  "record) and the learning rate is multiplied by collapse_guard_alpha_factor (docs/es_trainer.md)."},
    )
    collapse_guard_threshold: float = field(
        default=3.0,
        metadata={"help": "collapse_guard: a drop is a mean reward more than this many standard errors below the "
                  "best mean so far (> 0)."},
    )
    collapse_guard_patience: int = field(
        default=3,
        metadata={"help": "collapse_guard: drops in a row that make a collapse (>= 1)."},
    )
    collapse_guard_alpha_factor: float = field(
        default=0.5,
        metadata={"help": "collapse_guard: the learning rate is multiplied by this factor after each rollback, in "
                  "(0, 1]."},
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
            f"gradient_accumulation_steps / num_generations), else {DEFAULT_PROMPT_BATCH_SIZE}. Set together with "
            "them, it must agree."
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
            f"Salimans et al. 2017), 'gaussian' (fresh CPU draws: a new draw per {NOISE_BLOCK_SIZE}-element block from "
            "a CPU generator, identical on every device, ~10x slower than the table on CPU, no table memory), "
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

    generation_engine: str = field(  # "auto" or a name of trl_es.generation.ENGINES (a registered engine too)
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
            "help": "GRPO's option: every completion is constrained to match this regex (vLLM structured outputs; "
            "needs use_vllm=True); None: off."
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

    # ------------------------------------------------------------------ success metrics
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
            "help": "GRPO's option: each prompt batch is left-padded (masked) to a multiple of this many tokens, in "
            "the eager (shared prefix included) and compiled engines; vLLM takes unpadded prompts (as GRPO's vLLM "
            "path). "
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
            "help": "Hub dataset repo to which the completion parquet files are pushed (huggingface_hub "
            "CommitScheduler, every 2 minutes, as GRPO); needs log_completions=True."
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
        errors = self._grpo_user_errors()  # every field error is raised at the end, in one ValueError
        batch = {name: getattr(self, name) for name in BATCH_FIELDS}  # as given (None: unset)
        self.per_device_train_batch_size = 1  # mapped below; set before TrainingArguments validates batch sizes
        from ..distributed import resolve_cpu_world

        resolve_cpu_world(self)  # several launched processes without GPU: use_cpu=True, before the devices are set up
        try:
            super().__post_init__()
        except ValueError as error:
            if not errors:
                raise
            raise_field_errors(errors + [str(error)])
        self.grpo_translation = GRPOTranslation.given_by(self, **batch)  # after TrainingArguments decoded JSON dicts
        self._check_and_derive(errors)
        self._warn_about_grpo_scale_values()

    def check_fields(self) -> None:
        """Check the config again, as at construction, for fields set on a built config (``ESTrainer`` calls it);
        idempotent, warnings not repeated, ``TrainingArguments.__post_init__`` not rerun.

        Raises:
            ValueError: naming every refused or invalid field, in one message as ``__post_init__``.
        """
        # TRL's grpo_continuous_batching.py sets a field after parse_args; a field assigned since counts as given
        check_finite_floats(self)
        self._check_and_derive(self._grpo_user_errors())
        self._warn_about_grpo_scale_values()

    def _grpo_user_errors(self) -> list[str]:
        """The errors checked before ``TrainingArguments.__post_init__``: refused ``GRPOConfig`` fields and what
        ``es_optimizer='torch'`` cannot go with."""
        errors = grpo_field_errors(self)
        if self.es_optimizer == "torch":
            if self.fp16:  # no backward pass: no loss for a GradScaler to scale
                errors.append("fp16=True cannot go with es_optimizer='torch': ES has no backward pass, so there is no "
                              "loss to scale (the GradScaler would unscale an unscaled gradient). Load the model in "
                              "float16 with model_init_kwargs={'dtype': 'float16'} instead, with fp16=False.")
            optim = getattr(self.optim, "value", self.optim)
            if "schedule_free" in str(optim):  # it counts Trainer's gradient-less step as a step
                errors.append(f"optim={optim!r} cannot go with es_optimizer='torch': ES steps the optimizer within the "
                              "iteration and Trainer's own step then finds no gradient, which a schedule-free "
                              "optimizer would still count as a step. Use a torch optimizer such as 'adamw_torch' or "
                              "'sgd'.")
        return errors

    def _check_and_derive(self, errors: list[str]) -> None:
        """ES's checks and GRPO's translation (:func:`~.grpo_fields.translate_grpo_fields`), after
        ``TrainingArguments.__post_init__``; ``errors`` and every error found are raised in one ``ValueError``."""
        if self.population_size < 2:
            errors.append(f"population_size must be >= 2, got {self.population_size}.")
        elif self.antithetic and self.population_size % 2:
            errors.append(f"antithetic=True needs an even population_size, got {self.population_size}.")
        errors += stability_field_errors(self)  # sigma ('auto' or > 0) and the collapse guard's fields
        if not self.learning_rate > 0:
            errors.append(f"learning_rate must be > 0, got {self.learning_rate}.")
        own_reason = ("vllm_model_impl",) if self.vllm_model_impl == "transformers" else ()  # refused with its reason
        # the Literal fields (fitness_shaping, es_optimizer, ...) against their allowed values
        errors += literal_field_errors(self, skip=own_reason)
        if self.generation_engine != "auto" and self.generation_engine not in ENGINES:
            errors.append(f"generation_engine must be one of {('auto', *ENGINES)}, got {self.generation_engine!r}.")
        if not isinstance(self.noise_rank, int) or self.noise_rank < 1:
            errors.append(f"noise_rank must be an integer >= 1, got {self.noise_rank!r}.")
        collect_error(errors, check_optional_counts, self, "member_chunk_size")
        if self.awd_lambda < 0:
            errors.append(f"awd_lambda must be >= 0, got {self.awd_lambda}.")
        elif self.awd_penalty == "l2" and self.learning_rate * self.awd_lambda >= 1:  # the shrink 1 - alpha*lambda > 0
            errors.append(
                f"awd_penalty='l2' needs learning_rate * awd_lambda < 1 (got {self.learning_rate * self.awd_lambda}): "
                "the drift would flip sign."
            )
        if self.noise_table_size != 0 and self.noise_table_size < NOISE_BLOCK_SIZE:  # a table holds a block at least
            errors.append(f"noise_table_size must be 0 or >= {NOISE_BLOCK_SIZE}, got {self.noise_table_size}.")
        collect_error(errors, self._check_vllm_settings)
        collect_error(errors, self._apply_continuous_batching)
        # generation and completion logs
        for name in ("num_generations", "max_completion_length"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1, got {getattr(self, name)}.")
        collect_error(errors, check_optional_counts, self, "num_generations_eval")
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
        for note in translate_grpo_fields(self, errors):  # temperature, generation_kwargs, batch fields, ...
            logger.warning(note)
        if self.save_on_each_node:  # transformers 5 writes the weights on global rank 0 only
            errors.append("save_on_each_node=True is not supported: transformers 5 save_pretrained writes the model "
                          "only on global rank 0, so the other nodes would get checkpoints without weights. Save "
                          "to a shared filesystem from the main process (save_on_each_node=False).")
        collect_error(errors, check_fp16_device, self)  # needs the device TrainingArguments set up
        raise_field_errors(errors)  # all of them in one message: a recipe is fixed in one run

    def _inert_optimizer_fields(self) -> list[str]:
        """The torch-optimizer settings (:attr:`_es_inert_optimizer_fields`) set to another value than their
        ``ESConfig`` default under ``es_optimizer='es'``, which never reads them."""
        if self.es_optimizer != "es":
            return []
        defaults = {f.name: f.default for f in dataclasses.fields(type(self))}  # ESConfig's, not TrainingArguments'
        return [name for name in self._es_inert_optimizer_fields
                if name not in self._optimizer_fields_read_elsewhere and getattr(self, name) != defaults.get(name)]

    def _warn_about_grpo_scale_values(self) -> None:
        """Warn once each: an AdamW-scale ``learning_rate`` under ``es_optimizer='es'``, and every setting with no
        effect (ignored ``GRPOConfig`` fields, :meth:`_inert_optimizer_fields`) with ES's counterpart."""
        said = self.grpo_translation.said  # check_fields reruns this: each message once
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

    def to_dict(self) -> dict[str, Any]:
        """``TrainingArguments.to_dict``, without GRPO's mapped, ignored and refused fields left unset (``None``), and
        GRPO's batch fields as given, so ``ESConfig(**config.to_dict())`` is the same config."""
        d = super().to_dict()
        for entry in added_fields():
            if d.get(entry.name, 0) is None:
                del d[entry.name]
        if self.grpo_translation is not None:  # None while TrainingArguments.__post_init__ runs
            given = self.grpo_translation.user_values(self)
            d.update({name: given[name] for name in ("per_device_train_batch_size", "gradient_accumulation_steps")})
        return d

    def grpo_fields_plan(self) -> dict[str, list[str]]:
        """GRPO's fields mapped or ignored and the torch-optimizer settings ES never reads, for ``train()``'s plan
        (:func:`~.grpo_fields.grpo_fields_plan`)."""
        plan = grpo_fields_plan(self)
        plan["ignored"] += [f"{name}={getattr(self, name)!r}" for name in self._inert_optimizer_fields()]
        return plan

    def _apply_continuous_batching(self) -> None:
        """GRPO's continuous-batching fields: ``use_transformers_continuous_batching`` and
        ``generation_engine='continuous_batching'`` set each other (``use_transformers_paged``, deprecated, too).

        Raises:
            ValueError: naming the fields, for an invalid config, or the engine with ``use_vllm``, another
                ``generation_engine`` or ``population_backend='batched_lowrank'``.
        """
        if self.use_transformers_paged and not self.use_transformers_continuous_batching:
            warnings.warn("`use_transformers_paged` is deprecated and will be removed in TRL v2.0.0. Use "
                          "`use_transformers_continuous_batching` instead.", FutureWarning, stacklevel=5)
            self.use_transformers_continuous_batching = True
        # checked also when off (GRPO ignores it then)
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
        """Check the vLLM fields, also with ``use_vllm`` off (a bad value never waits for a GPU run); their ``Literal``
        values are :func:`~trl_es.arguments.literal_field_errors`'s.

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
        check_optional_counts(self, "vllm_max_model_length", "vllm_kv_cache_memory_bytes")
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
