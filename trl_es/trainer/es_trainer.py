"""ESTrainer: Evolution Strategies fine-tuning as a TRL trainer (a drop-in for GRPOTrainer)."""

from __future__ import annotations

import math
import os
import textwrap
import time
from collections import defaultdict

import torch
from accelerate.utils import gather_object
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.trainer.base_trainer import _BaseTrainer

from ..es.noise import make_noise_source
from ..es.population import SequentialPopulation, member_indices, member_seed, sample_population
from ..es.seedlog import SEED_LOG_NAME, SeedLog
from ..es.shaping import shape_fitness
from ..es.update import TrainedParameters, select_parameters
from .es_config import ESConfig
from .scoring import RewardScorer, build_generation_config, score_model, validate_dataset

MASTER_WEIGHTS_NAME = "es_master.safetensors"
ANCHOR_WEIGHTS_NAME = "es_anchor.safetensors"


def identity(features):
    """Data collator that keeps the rows as they are (a list of dicts)."""
    return features


class _TorchOptimizerSync(TrainerCallback):
    """With ``es_optimizer='torch'``: after the optimizer moved the fp32 masters, apply AWD and render the model."""

    def __init__(self, trainer: ESTrainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        if args.es_optimizer == "torch":
            trainer._apply_awd(trainer._current_learning_rate())
            trainer.es_params.render_()


class ESTrainer(_BaseTrainer):
    """Evolution Strategies trainer (Qiu et al. 2025, arXiv 2509.24372), with GRPOTrainer's constructor.

    Each training step is one ES iteration: every process takes its share of ``prompt_batch_size`` prompts and the
    shares are gathered, so all members are scored on the same prompts; ``population_size`` members
    ``theta + sigma * eps_i`` are generated for and scored by the reward functions (the weights are perturbed in
    place and restored bitwise); the rewards are shaped (z-score by default); and
    ``theta <- theta + alpha / N * sum_i z_i eps_i`` is applied in fp32 (or handed to a torch optimizer).

    Args:
        model (`str` or `PreTrainedModel`): A causal LM or its id/path (loaded with ``args.model_init_kwargs``).
        reward_funcs: A reward function with TRL's signature
            ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, a sequence-classification
            reward model (or its id/path), or a list of them.
        args (`ESConfig`, *optional*): The configuration; default ``ESConfig(f"{model_name}-ES")``.
        train_dataset (`datasets.Dataset`): Rows with a ``prompt`` (standard text or conversational messages);
            other columns reach reward functions as keyword arguments.
        eval_dataset (`datasets.Dataset`, *optional*): Scored by :meth:`evaluate` with the unperturbed model.
        processing_class (`PreTrainedTokenizerBase`, *optional*): Default: loaded from the model's path.
        reward_processing_classes (*optional*): Tokenizers of reward models, as in GRPOTrainer.
        callbacks (`list[TrainerCallback]`, *optional*): Extra Trainer callbacks.
        optimizers (*optional*): ``(optimizer, scheduler)`` as in ``Trainer``; with ``es_optimizer='torch'`` a given
            optimizer must own ``trainer.es_params.master_parameters()``.
        peft_config (`peft.PeftConfig`, *optional*): Wrap the model with PEFT; ES then perturbs the adapter only.

    Raises:
        ValueError: for a dataset without ``prompt`` or an empty dataset, reward weights of the wrong length.
    """

    _tag_names = ["trl", "trl-es", "evolution-strategies"]
    _name = "ES"
    _paper = {
        "title": "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning",
        "id": "2509.24372",
        "citation": textwrap.dedent("""\
            @article{qiu2025evolution,
                title   = {{Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning}},
                author  = {Xin Qiu and Yulu Gan and Conor F. Hayes and Qiyao Liang and Elliot Meyerson and Babak Hodjat and Risto Miikkulainen},
                year    = 2025,
                eprint  = {arXiv:2509.24372}
            }"""),
    }

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs,
        args: ESConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        # Args
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            args = ESConfig(f"{model_name.split('/')[-1]}-ES")
        if not isinstance(args, ESConfig):
            raise TypeError(f"args must be an ESConfig, got {type(args).__name__}.")

        # Model
        if isinstance(model, str):
            init_kwargs = dict(args.model_init_kwargs or {})
            init_kwargs.setdefault("dtype", "auto")
            model = AutoModelForCausalLM.from_pretrained(model, **init_kwargs)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)

        # Processing class
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token

        # Rewards
        self.reward_scorer = RewardScorer(reward_funcs, args.reward_weights, reward_processing_classes)
        self.reward_func_names = self.reward_scorer.names

        # Data
        validate_dataset(train_dataset, "train_dataset")
        if isinstance(eval_dataset, dict):
            for key, dataset in eval_dataset.items():
                validate_dataset(dataset, f"eval_dataset[{key!r}]")
        else:
            validate_dataset(eval_dataset, "eval_dataset")

        # Generation
        self.generation_config = build_generation_config(
            processing_class, args.max_completion_length, args.temperature, args.top_p, args.generation_kwargs
        )

        super().__init__(
            model=model,
            args=args,
            data_collator=identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.model_accepts_loss_kwargs = False
        for func in self.reward_scorer.reward_funcs:
            if isinstance(func, nn.Module):
                func.to(self.accelerator.device)

        # ES state: built after Trainer placed the model on its device, so the tensors are the final ones.
        unwrapped = self.accelerator.unwrap_model(self.model)
        selected = select_parameters(unwrapped, args.include_parameters, args.exclude_parameters)
        self.es_params = TrainedParameters(selected, torch.float32 if args.fp32_master_weights else None)
        self.noise = make_noise_source(args.noise_table_size)
        self.population = SequentialPopulation()
        self.anchor = None  # theta_0 on CPU (fp32): for AWD and drift logging
        if args.awd_lambda > 0 or args.log_parameter_drift:
            self.anchor = {n: t.detach().float().cpu().clone() for n, t in self.es_params.master_state_dict().items()}
        self.seed_log = SeedLog(
            header={
                "noise": self.noise.describe(),
                "sigma": args.sigma,
                "population_size": args.population_size,
                "antithetic": args.antithetic,
                "fitness_shaping": args.fitness_shaping,
                "optimizer": args.es_optimizer,
                "master_dtype": "float32" if args.fp32_master_weights else None,
                "awd_penalty": args.awd_penalty,
                "parameters": [[e.name, e.numel] for e in self.es_params.entries],
            }
        )
        self._metrics = defaultdict(list)
        self.add_callback(_TorchOptimizerSync(self))

    # ------------------------------------------------------------------ data
    def _set_signature_columns_if_needed(self):
        # Rows go to the reward functions as they are: keep every column.
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def _gather_prompt_rows(self, rows: list[dict]) -> list[dict]:
        """Each process loaded its share of the prompt batch; every process needs all of it."""
        if self.accelerator.num_processes == 1:
            return list(rows)
        return gather_object(list(rows))

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model=None):
        """The Trainer's optimizer class and kwargs, owning the fp32 master tensors (not the 16-bit parameters).

        With ``es_optimizer='es'`` it never receives a gradient, so ``step()`` is a no-op and allocates no state.
        """
        if self.optimizer is None:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            groups = [{"params": self.es_params.master_parameters(), "weight_decay": self.args.weight_decay}]
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def _clip_grad_norm(self, model):
        return torch.nn.utils.clip_grad_norm_(self.es_params.master_parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grads = [m.grad for m in self.es_params.master_parameters() if m.grad is not None]
            if not grads:
                return None
            grad_norm = torch.nn.utils.get_total_norm(grads)
        return grad_norm.item() if hasattr(grad_norm, "item") else grad_norm

    def _current_learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else self.args.learning_rate

    # ------------------------------------------------------------------ the ES iteration
    def _rollout(self, rows, step: int):
        """A function that scores the model as it currently is on ``rows`` (one member's rollout)."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        reward_kwargs = {"trainer_state": self.state, "log_extra": lambda *a, **k: None, "log_metric": self._log_metric}
        results = {}

        def rollout(index: int) -> float:
            if self.args.temperature > 0:  # the member's samples do not depend on which process scores it
                torch.manual_seed(member_seed(self.args.seed + 1, step, index))
            start = time.perf_counter()
            out = score_model(
                unwrapped,
                self.processing_class,
                rows,
                self.reward_scorer,
                self.generation_config,
                self.args.num_generations,
                self.args.chat_template_kwargs,
                reward_kwargs,
            )
            out["seconds"] = time.perf_counter() - start
            results[index] = out
            rewards = out["rewards"]
            return float(rewards.nanmean()) if not torch.isnan(rewards).all() else math.nan

        return rollout, results

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One ES iteration. Returns ``-mean(population fitness)`` as the logged "loss"."""
        args = self.args
        step = self.state.global_step  # iterations done so far; this one becomes step + 1
        rows = self._gather_prompt_rows(inputs)
        members = sample_population(args.seed, step, args.population_size, args.antithetic)
        indices = member_indices(args.population_size, self.accelerator.process_index, self.accelerator.num_processes)

        start = time.perf_counter()
        rollout, results = self._rollout(rows, step)
        local = self.population.evaluate(self.es_params, self.noise, members, indices, args.sigma, rollout)
        evaluate_seconds = time.perf_counter() - start

        fitness = torch.zeros(args.population_size, dtype=torch.float64, device=self.accelerator.device)
        for i, value in local.items():
            fitness[i] = value
        if self.accelerator.num_processes > 1:  # N scalars travel, nothing else
            fitness = self.accelerator.reduce(fitness, reduction="sum")
        fitness = fitness.cpu()
        coefficients = shape_fitness(fitness, args.fitness_shaping)

        start = time.perf_counter()
        learning_rate = self._current_learning_rate()
        if args.es_optimizer == "es":
            self.es_params.es_update_(self.noise, members, coefficients.tolist(), learning_rate)
            shrink = self._apply_awd(learning_rate)
        else:
            self.es_params.es_gradient_(self.noise, members, coefficients.tolist())
            shrink = learning_rate * args.awd_lambda if args.awd_lambda > 0 else 0.0
        update_seconds = time.perf_counter() - start
        self.seed_log.append(step + 1, members, coefficients.tolist(), learning_rate, shrink)

        self._record_metrics(fitness, results, evaluate_seconds, update_seconds)
        mean = fitness[~torch.isnan(fitness)].mean() if not torch.isnan(fitness).all() else torch.tensor(math.nan)
        return torch.tensor(-float(mean), device=args.device)

    def _apply_awd(self, learning_rate: float) -> float:
        """Anchored Weight Decay after the ES step (arXiv 2605.30148, Algorithm 1). Returns ``alpha * lambda``."""
        if self.args.awd_lambda <= 0:
            return 0.0
        shrink = learning_rate * self.args.awd_lambda
        self.es_params.anchored_weight_decay_(self.anchor, shrink, self.args.awd_penalty)
        return shrink

    def _log_metric(self, name: str, value: float) -> None:
        self._metrics[name].append(float(value))

    def _record_metrics(self, fitness, results, evaluate_seconds, update_seconds):
        finite = fitness[~torch.isnan(fitness)]
        if finite.numel():
            self._metrics["reward"].append(float(finite.mean()))
            self._metrics["reward_std"].append(float(finite.std(unbiased=False)))
            self._metrics["reward_min"].append(float(finite.min()))
            self._metrics["reward_max"].append(float(finite.max()))
        self._metrics["num_nan_members"].append(float(torch.isnan(fitness).sum()))
        generation_seconds = sum(r["seconds"] for r in results.values())
        if results:
            per_func = torch.cat([r["rewards_per_func"] for r in results.values()])
            for j, name in enumerate(self.reward_func_names):
                column = per_func[:, j]
                if not torch.isnan(column).all():
                    self._metrics[f"rewards/{name}/mean"].append(float(column.nanmean()))
            completions = sum(len(r["completions"]) for r in results.values())
            tokens = sum(r["num_tokens"] for r in results.values())
            self._metrics["completions_per_second"].append(completions / max(generation_seconds, 1e-9))
            self._metrics["completion_tokens"].append(float(tokens))
        timings = self.population.timings
        self._metrics["time/generation_and_reward"].append(generation_seconds)
        self._metrics["time/perturb"].append(timings.get("perturb", 0.0))
        self._metrics["time/restore"].append(timings.get("restore", 0.0))
        self._metrics["time/update"].append(update_seconds)
        self._metrics["time/other"].append(max(0.0, evaluate_seconds - generation_seconds - sum(timings.values())))

    def _parameter_drift(self) -> dict[str, float]:
        """``||theta - theta_0||`` and ``||theta - theta_0|| / ||theta_0||`` over the trained parameters (fp64 sums)."""
        diff_sq, base_sq = 0.0, 0.0
        for name, master in self.es_params.master_state_dict().items():
            theta0 = self.anchor[name]
            diff_sq += float((master.detach().float().cpu() - theta0).double().pow(2).sum())
            base_sq += float(theta0.double().pow(2).sum())
        norm = math.sqrt(diff_sq)
        return {"drift/l2": norm, "drift/relative": norm / math.sqrt(base_sq) if base_sq > 0 else 0.0}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if not any(key.startswith("eval_") for key in logs):
            for key, values in self._metrics.items():
                valid = [v for v in values if not math.isnan(v)]
                logs[key] = sum(valid) / len(valid) if valid else None
            self._metrics.clear()
            if self.anchor is not None and self.args.log_parameter_drift:
                logs.update(self._parameter_drift())
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Score the unperturbed model on ``eval_dataset`` and log ``eval_reward`` (and per-function means).

        Returns:
            `dict[str, float]`: ``{prefix}_reward``, ``{prefix}_rewards/{name}/mean``, ``{prefix}_num_completions``.
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
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        rows = [dataset[i] for i in range(rank, len(dataset), world)]
        unwrapped = self.accelerator.unwrap_model(self.model)
        batch = self.args.prompt_batch_size
        sums = torch.zeros(2 + len(self.reward_func_names), dtype=torch.float64)  # total, count, per-function
        counts = torch.zeros(len(self.reward_func_names), dtype=torch.float64)
        if self.args.temperature > 0:
            torch.manual_seed(self.args.seed)
        start = time.perf_counter()
        for first in range(0, len(rows), batch):
            out = score_model(
                unwrapped, self.processing_class, rows[first : first + batch], self.reward_scorer,
                self.generation_config, self.args.num_generations, self.args.chat_template_kwargs,
                {"trainer_state": self.state, "log_extra": lambda *a, **k: None, "log_metric": lambda *a, **k: None},
            )
            rewards = out["rewards"].double()
            sums[0] += rewards.nansum()
            sums[1] += (~torch.isnan(rewards)).sum()
            per_func = out["rewards_per_func"].double()
            sums[2:] += per_func.nansum(dim=0)
            counts += (~torch.isnan(per_func)).sum(dim=0)
        if world > 1:
            sums = self.accelerator.reduce(sums.to(self.accelerator.device), "sum").cpu()
            counts = self.accelerator.reduce(counts.to(self.accelerator.device), "sum").cpu()
        metrics = {
            f"{metric_key_prefix}_reward": float(sums[0] / sums[1]) if sums[1] > 0 else None,
            f"{metric_key_prefix}_num_completions": int(len(dataset) * self.args.num_generations),
            f"{metric_key_prefix}_runtime": time.perf_counter() - start,
        }
        for j, name in enumerate(self.reward_func_names):
            if counts[j] > 0:
                metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = float(sums[2 + j] / counts[j])
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def train(self, *args, **kwargs):
        """``Trainer.train``, then the seed log is written to ``output_dir`` (a whole run in a few kilobytes)."""
        output = super().train(*args, **kwargs)
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.seed_log.save(os.path.join(self.args.output_dir, SEED_LOG_NAME))
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as ``Trainer`` does, plus the seed log (``es_seed_log.jsonl``)."""
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.seed_log.save(os.path.join(output_dir, SEED_LOG_NAME))

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if not self.args.should_save:
            return
        # The model's weights are a rendering of the master: save the master too when they differ in dtype.
        masters = self.es_params.master_state_dict()
        if any(e.master.dtype != e.param.dtype for e in self.es_params.entries):
            save_file({n: t.detach().cpu().contiguous() for n, t in masters.items()}, os.path.join(folder, MASTER_WEIGHTS_NAME))
        if self.anchor is not None:
            save_file({n: t.contiguous() for n, t in self.anchor.items()}, os.path.join(folder, ANCHOR_WEIGHTS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        master_path = os.path.join(resume_from_checkpoint, MASTER_WEIGHTS_NAME)
        if os.path.exists(master_path):
            self.es_params.load_master_state_dict(load_file(master_path))
        else:
            self.es_params.refresh_master_from_model_()
        anchor_path = os.path.join(resume_from_checkpoint, ANCHOR_WEIGHTS_NAME)
        if self.anchor is not None and os.path.exists(anchor_path):
            self.anchor = load_file(anchor_path)
        log_path = os.path.join(resume_from_checkpoint, SEED_LOG_NAME)
        if os.path.exists(log_path):
            self.seed_log.records = SeedLog.load(log_path).records

