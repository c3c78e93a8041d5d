"""The direction pool of Hyper-ES: K LoRA adapters, each a short GRPO run on one bucket of the training data.

Each adapter is a few GRPO steps (Shao et al. 2024, "DeepSeekMath", Sec. 4.1) through TRL's ``GRPOTrainer`` with a
LoRA ``peft_config``; the search then only chooses how to merge them.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Sequence

import torch

from ..files import is_main_process, write_json


logger = logging.getLogger(__name__)

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
POOL_NAME = "direction_pool.json"


def split_buckets(
    dataset, num_buckets: int, seed: int = 42, split_key: Callable[[dict], object] | Sequence | None = None
) -> list:
    """Split a dataset into ``num_buckets`` (K) disjoint buckets whose sizes differ by at most one: a seeded random
    split, or K contiguous quantiles of ``split_key`` (a callable on a row, or one key per row), smallest keys first.

    Raises:
        ValueError: if ``num_buckets < 1``, the dataset has fewer rows than buckets, or a sequence ``split_key`` does
            not have one key per row.
    """
    n = len(dataset)
    if num_buckets < 1:
        raise ValueError(f"num_adapters must be >= 1, got {num_buckets}.")
    if n < num_buckets:
        raise ValueError(f"train_dataset has {n} rows, fewer than num_adapters={num_buckets} buckets.")
    if split_key is not None and not callable(split_key) and len(split_key) != n:
        raise ValueError(f"split_key has {len(split_key)} keys for {n} rows; give one key per row or a callable.")
    if split_key is None:
        # a private generator: the split depends on seed alone, and the global RNG is left as it was
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        keys = [split_key(dataset[i]) for i in range(n)] if callable(split_key) else list(split_key)
        order = sorted(range(n), key=keys.__getitem__)  # stable: ties keep the dataset's order
    ordered = dataset.select(order)
    # contiguous shards: bucket 0 holds the smallest keys (e.g. the easiest problems)
    return [ordered.shard(num_shards=num_buckets, index=k, contiguous=True) for k in range(num_buckets)]


def sampled_success_rates(
    model,
    tokenizer,
    rows: Sequence[dict],
    reward_funcs,
    num_samples: int = 4,
    max_completion_length: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    sample_batch_size: int | None = None,
    success_threshold: float = 0.5,
) -> list[float]:
    """The model's sampled success rate on each row, in ``[0, 1]``, a multiple of ``1 / num_samples``: the difficulty
    key of a task without one of its own (give ``1 - rate`` as ``split_key`` for buckets from the easiest).

    Raises:
        ValueError: if ``num_samples < 1`` or ``temperature <= 0`` (greedy decoding gives no rate).
    """
    from ..analysis import sample_policy
    from ..rollout import build_generation_config

    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to sample a success rate, got {temperature}.")
    # GRPO's sampling (TRL's defaults: temperature 1.0, top_p 1.0)
    config = build_generation_config(tokenizer, max_completion_length, temperature, top_p,
                                     model_generation_config=model.generation_config)
    # the last reward function decides (correct above success_threshold); a seeded generator leaves the caller's RNG
    out = sample_policy(model, tokenizer, list(rows), reward_funcs, config, num_samples, sample_batch_size,
                        seed=seed, success_threshold=success_threshold, record_entropy=False, progress=False)
    return [c / num_samples for c in out["correct"]]


def grpo_generated_tokens(trainer, steps: int) -> int | None:
    """Completion tokens a finished ``trl.GRPOTrainer`` run of ``steps`` optimizer steps generated, `None` when
    nothing was logged; exact when every step is logged (``logging_steps=1``)."""
    lengths = [log["completions/mean_length"] for log in trainer.state.log_history if "completions/mean_length" in log]
    if not lengths:
        return None
    args = trainer.args
    # completions per optimizer step: TRL generates once per steps_per_generation x num_iterations micro-batches
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * trainer.accelerator.num_processes
    per_step /= getattr(args, "num_iterations", 1)  # a generation is reused for num_iterations optimizer passes
    return int(round(sum(lengths) / len(lengths) * per_step * steps))  # mean logged length x completions


def build_direction_pool(
    model,
    train_dataset,
    reward_funcs,
    num_adapters: int = 4,
    output_dir: str = "direction_pool",
    processing_class=None,
    split_key: Callable[[dict], object] | Sequence | None = None,
    max_steps: int = 10,
    learning_rate: float = 1e-4,
    lora_r: int = 32,
    lora_alpha: int = 64,
    lora_dropout: float = 0.0,
    target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
    peft_config=None,
    grpo_kwargs: dict | None = None,
    seed: int = 42,
    callbacks: list | None = None,
) -> list[str]:
    """Train ``num_adapters`` (K) LoRA adapters with GRPO, one per bucket of ``train_dataset`` (see
    [`split_buckets`]), and save adapter ``k`` to ``<output_dir>/adapter_<k>`` (peft format), with
    ``<output_dir>/direction_pool.json`` recording the buckets and settings.

    Args:
        model (`str` or `PreTrainedModel`): The base model or its path; left unchanged.
        train_dataset (`datasets.Dataset`): Rows with a ``prompt`` column (plus any columns the rewards need).
        reward_funcs: Reward function(s)/model(s) with TRL's signature, passed to ``GRPOTrainer``.
        lora_r, lora_alpha, lora_dropout, target_modules: The LoRA configuration (ignored with ``peft_config``).
        grpo_kwargs (`dict`, *optional*): Extra ``GRPOConfig`` arguments, applied last.
        seed (`int`): Seed of the split; adapter ``k`` trains with ``seed + k``.

    Returns:
        `list[str]`: The K adapter folders, in bucket order.

    Raises:
        ValueError: if the dataset has fewer rows than ``num_adapters`` or ``max_steps < 1``.
    """
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from ..files import save_trainer_model

    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}.")
    buckets = split_buckets(train_dataset, num_adapters, seed=seed, split_key=split_key)
    if peft_config is None:
        # the Hyper-ES paper's LoRA: rank 32, alpha 64, on every attention and MLP projection; learning_rate=1e-4 (a
        # usual LoRA rate, large enough for a few steps to move the adapter) and max_steps=10 are ours
        peft_config = LoraConfig(
            r=lora_r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=list(target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
    # GRPOConfig() defaults bf16 to True, which fails on CPU; grpo_kwargs may still set it
    use_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    os.makedirs(output_dir, exist_ok=True)
    paths, records = [], []
    for k, bucket in enumerate(buckets):
        adapter_dir = os.path.join(output_dir, f"adapter_{k}")
        config_kwargs = {
            "output_dir": adapter_dir,
            "max_steps": max_steps,
            "learning_rate": learning_rate,
            "bf16": use_bf16,
            "seed": seed + k,  # each adapter its own seed: K different directions even on equal buckets
            "report_to": "none",
            "save_strategy": "no",  # saved once, after training, by save_trainer_model
            "logging_steps": 1,  # every step logged: grpo_generated_tokens is then exact
            "disable_tqdm": True,
        }
        config_kwargs.update(grpo_kwargs or {})  # the caller's GRPOConfig arguments win over the defaults above
        config_kwargs["output_dir"] = adapter_dir  # one folder per adapter, whatever grpo_kwargs says
        grpo_args = GRPOConfig(**config_kwargs)
        # GRPOTrainer wraps its model in place: every adapter starts from its own copy of the base model
        run_model = model if isinstance(model, str) else copy.deepcopy(model)
        trainer = GRPOTrainer(
            model=run_model,
            reward_funcs=reward_funcs,
            args=grpo_args,
            train_dataset=bucket,
            processing_class=processing_class,
            peft_config=copy.deepcopy(peft_config),  # peft writes into the config it is given: a fresh one per run
            callbacks=callbacks,
        )
        result = trainer.train()
        save_trainer_model(trainer, adapter_dir, f"adapter {k} of the direction pool")
        # LoRA B starts at zero: a B still zero means no gradient ever reached the adapter
        moved = any(p.detach().abs().max().item() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)
        if not moved:
            logger.warning(
                f"Direction pool: adapter {k} is still zero after {result.global_step} GRPO steps (its LoRA B is "
                "zero-initialized and every group had equal rewards, so no gradient): give it more steps, more "
                "generations per prompt, a higher temperature, or easier prompts."
            )
        # the mean reward of the first and the last logged step: did the adapter learn on its bucket?
        rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
        records.append(
            {
                "adapter": adapter_dir,
                "bucket_size": len(bucket),
                "nonzero_delta": moved,
                "steps": int(result.global_step),
                "reward_first_step": rewards[0] if rewards else None,
                "reward_last_step": rewards[-1] if rewards else None,
                "train_runtime_s": float(result.metrics["train_runtime"]),
                "generated_tokens": grpo_generated_tokens(trainer, int(result.global_step)),
            }
        )
        logger.info(f"Direction pool: adapter {k} trained on {len(bucket)} rows for {result.global_step} steps.")
        paths.append(adapter_dir)
        del trainer, run_model  # the copy of the model is freed before the next adapter is trained
    if is_main_process():  # written last: its presence marks a complete pool (``hyper_es.py --reuse_pool``)
        write_json(
            os.path.join(output_dir, POOL_NAME),
            {
                "num_adapters": num_adapters,
                "split": "random" if split_key is None else "key quantiles",
                "seed": seed,
                "max_steps": max_steps,
                "learning_rate": learning_rate,
                "lora": {
                    "r": peft_config.r,
                    "lora_alpha": peft_config.lora_alpha,
                    "target_modules": sorted(peft_config.target_modules)
                    if isinstance(peft_config.target_modules, (set, list, tuple))
                    else peft_config.target_modules,
                },
                "adapters": records,
            },
        )
    return paths
