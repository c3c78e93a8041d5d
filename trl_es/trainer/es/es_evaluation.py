"""ESTrainer's held-out evaluation: the unperturbed model scored on a dataset with the training's rollout.

A mixin of :class:`~trl_es.trainer.es.es_trainer.ESTrainer` (it reads ``rollout``, ``reward_func_names``, the
generation settings and, under ZeRO-3, the DeepSpeed engine).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from ...generation import generate_completions, prompt_add_special_tokens
from ...rollout import prompt_texts, validate_dataset
from .es_metrics import warn_invalid_rewards


class ESEvaluationMixin:
    """``evaluate()``: greedy (or sampled) rewards of the current weights on ``eval_dataset``."""

    def _prepare_forward_precision(self) -> None:
        """Give the model the precision of training before any forward: every ES forward (``evaluate`` before,
        during and after ``train``, the members' rollouts) then runs the same computation.

        accelerate applies mixed precision (``bf16``/``fp16``) by wrapping the model's ``forward`` in its autocast
        (outputs cast back to fp32) when the model is prepared; ``Trainer`` prepares it when training starts, and
        before its own first evaluation. ES prepares it the same way (``evaluation_mode=True``: no DDP wrapper) at
        its first forward, whichever comes first. Without mixed precision, or under DeepSpeed (which casts the
        weights instead), nothing changes. Called by ``evaluate`` and by the member loop (``_score_members``).
        """
        if not self.accelerator.native_amp or self.is_deepspeed_enabled:
            return
        if any(getattr(m, "_is_accelerate_prepared", False) for m in (self.model, self.model_wrapped)):
            return
        prepared = self.accelerator.prepare_model(self.model, evaluation_mode=True)
        if prepared is not self.model:  # as Trainer's evaluation_loop (e.g. torch_compile's wrapper)
            self.model_wrapped = prepared
        self._rebind_es_params()  # preparing may move the weights to new storage (as in _prepare_for_training)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Score the unperturbed model on ``eval_dataset`` and log ``eval_reward`` (and per-function means).

        Each process scores its share of the prompts (every ``W``-th row), ``per_device_eval_batch_size`` prompts per
        generate call (``num_generations_eval`` completions each, default ``num_generations``), with the trainer's
        generation engine and settings.
        Invalid (non-finite) rewards are left out of the means and counted.

        Returns:
            `dict[str, float]`: ``{prefix}_reward``, ``{prefix}_loss`` (``-{prefix}_reward``, as the training "loss"
            is the negated mean reward: so ``load_best_model_at_end=True`` with Trainer's default
            ``metric_for_best_model="loss"`` keeps the checkpoint of the highest eval reward; ``None`` when nothing
            was scored), ``{prefix}_rewards/{name}/mean``, ``{prefix}_num_completions``,
            ``{prefix}_num_invalid_rewards``, ``{prefix}_runtime``.
        """
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (given to ESTrainer or to evaluate).")
        if isinstance(dataset, dict):
            metrics = {}
            for key, subset in dataset.items():
                metrics.update(self.evaluate(subset, ignore_keys, f"{metric_key_prefix}_{key}"))
            return metrics
        validate_dataset(dataset, "eval_dataset")
        if not hasattr(dataset, "__len__"):  # an iterable eval dataset: read whole (it must be finite)
            dataset = list(dataset)
        if self.is_deepspeed_enabled and self.sharded and getattr(self, "deepspeed", None) is None:
            self._prepare_deepspeed_engine()  # ZeRO-3 partitioned at load time: generation needs the engine's hooks
        self._prepare_forward_precision()
        self._sync_model_view()
        self._sync_engine_weights()
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        rows = [dataset[i] for i in range(rank, len(dataset), world)]
        unwrapped = self.accelerator.unwrap_model(self.model)
        batch = self.args.per_device_eval_batch_size
        # Under ZeRO-3 every process must run as many generate calls as the others (each forward gathers the
        # parameters from all of them): processes short of prompts score a placeholder batch and drop it.
        num_batches = math.ceil(math.ceil(len(dataset) / world) / batch) if self.sharded else None
        sums = torch.zeros(3 + len(self.reward_func_names), dtype=torch.float64)  # total, count, invalid, per function
        counts = torch.zeros(len(self.reward_func_names), dtype=torch.float64)
        if self.generation_config.do_sample:  # however sampling is on (temperature > 0, generation_kwargs)
            torch.manual_seed(self.args.seed)
        num_generations = self.args.num_generations_eval or self.args.num_generations
        rollout = dataclasses.replace(self.rollout, num_generations=num_generations)
        start = time.perf_counter()
        for first in range(0, len(rows) if num_batches is None else num_batches * batch, batch):
            chunk = rows[first : first + batch]
            if not chunk:  # ZeRO-3 only: take part in the others' forwards, score nothing
                placeholder = prompt_texts([dataset[0]], self.processing_class, self.args.chat_template_kwargs)
                generate_completions(unwrapped, self.processing_class, placeholder, self.generation_config,
                                     engine=self.generation_engine,
                                     add_special_tokens=prompt_add_special_tokens([dataset[0]["prompt"]]))
                continue
            out = rollout(unwrapped, chunk, reward_kwargs={
                "trainer_state": self.state, "log_extra": lambda *a, **k: None, "log_metric": lambda *a, **k: None})
            warn_invalid_rewards(out["invalid"], self.reward_func_names, self._warned_invalid)
            rewards = out["rewards"].double()
            valid_rows = ~out["invalid"].any(dim=1)
            sums[0] += rewards[valid_rows].nansum()
            sums[1] += (~torch.isnan(rewards[valid_rows])).sum()
            sums[2] += out["invalid"].sum()
            per_func = out["rewards_per_func"].double()
            sums[3:] += per_func.nansum(dim=0)
            counts += (~torch.isnan(per_func)).sum(dim=0)
        if world > 1:
            sums = self.accelerator.reduce(sums.to(self.accelerator.device), "sum").cpu()
            counts = self.accelerator.reduce(counts.to(self.accelerator.device), "sum").cpu()
        reward = float(sums[0] / sums[1]) if sums[1] > 0 else None
        metrics = {
            f"{metric_key_prefix}_loss": -reward if reward is not None else None,
            f"{metric_key_prefix}_reward": reward,
            f"{metric_key_prefix}_num_completions": int(len(dataset) * num_generations),
            f"{metric_key_prefix}_num_invalid_rewards": int(sums[2]),
            f"{metric_key_prefix}_runtime": time.perf_counter() - start,
        }
        for j, name in enumerate(self.reward_func_names):
            if counts[j] > 0:
                metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = float(sums[3 + j] / counts[j])
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
