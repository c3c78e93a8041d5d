"""ESTrainer: Evolution Strategies fine-tuning as a TRL trainer (a drop-in for GRPOTrainer).

The file reads as the setup story (constructor: model, processing class, rewards, data, generation, ES state) and
then one ES iteration top to bottom (:meth:`ESTrainer.training_step`): ask the population for its members, apply
each group of members and roll out (the population restores the model on leaving the ``with``), sum the scores over
processes, shape the fitness, tell the update (ES step or torch optimizer, AWD, render), append to the seed log,
record the metrics. Checkpoint I/O (:mod:`.es_checkpoint`), multi-process preparation (:mod:`.es_distributed_setup`),
held-out evaluation (:mod:`.es_evaluation`), the metrics (:mod:`.es_metrics`), the generation engine
(:mod:`.es_engines`), the prompt data (:mod:`.es_data`) and the optimizer hooks (:mod:`.es_optimizer`) live beside it. Map of the rooms: ``docs/architecture.md``.
"""

from __future__ import annotations

import math
import re
import textwrap
import time
import warnings
from collections import defaultdict

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel, set_seed
from transformers.utils import logging
from trl.trainer.base_trainer import _BaseTrainer

from ...es.anchor import checkpoint_files, make_anchor
from ...es.fitness import MemberScores, PopulationScores
from ...es.noise import make_noise_source
from ...es.perturbation import LowRankPerturbation, linear_weight_names
from ...es.population import make_population_backend, member_indices, member_seed, on_engine
from ...es.seedlog import SeedLog
from ...es.shaping import shape_fitness
from ...es.update import Member, TrainedParameters, es_gradient_, es_update_, select_parameters
from ...models import load_policy, warn_unused_init_kwargs, wrap_peft
from ...rollout import (RewardScorer, Rollout, build_generation_config, completions_for_rewards, mask_truncated_rewards,
                       split_row_groups, validate_dataset)
from .completion_logs import CompletionLog, empty_logs
from ..distributed import es_parameter_entries, is_zero3_param, tensor_bytes
from .es_checkpoint import ESCheckpointMixin, run_settings
from .es_config import ESConfig
from .es_data import ESDataMixin, SharedStream, identity
from .es_distributed_setup import ESDistributedMixin
from .es_engines import ESEngineMixin
from .es_evaluation import ESEvaluationMixin
from .es_metrics import drift_metrics, drift_sums, iteration_metrics, warn_invalid_rewards
from .es_optimizer import ESOptimizerMixin

logger = logging.get_logger(__name__)


class ESTrainer(ESCheckpointMixin, ESDistributedMixin, ESEvaluationMixin, ESEngineMixin, ESDataMixin, ESOptimizerMixin,
                _BaseTrainer):
    """Evolution Strategies trainer (Qiu et al. 2025, arXiv 2509.24372), with GRPOTrainer's constructor.

    Each training step is one ES iteration: every process takes its share of ``prompt_batch_size`` prompts and the
    shares are gathered, so all members are scored on the same prompts; ``population_size`` members
    ``theta + sigma * eps_i`` are generated for and scored by the reward functions (the weights are perturbed in
    place and restored bitwise); the rewards are shaped (z-score by default); and
    ``theta <- theta + alpha / N * sum_i z_i eps_i`` is applied in fp32 (or handed to a torch optimizer).

    Launched on ``W`` processes (``torchrun``, ``accelerate launch``, ``deepspeed``; see ``docs/scaling.md``):
    without DeepSpeed or with ZeRO-1/2, *population parallelism*: every process holds the whole model (not wrapped in
    DDP), scores the members ``i % W == rank``, and per-member reward statistics are summed across processes; every
    process then applies the same update. With DeepSpeed ZeRO-3, *sharded ES*: every member is scored by all
    processes together, each on its share of the prompts, and each process perturbs, restores and updates only its
    partition of the parameters. Either way the weights end bitwise as with one process, given the same completions.

    Args:
        model (`str` or `PreTrainedModel`): A causal LM or its id/path (loaded with ``args.model_init_kwargs``; in
            float32 unless they set a ``dtype``, as GRPOTrainer: ``{"dtype": "auto"}`` keeps the checkpoint's).
        reward_funcs (`Callable | PreTrainedModel | str | list`): A reward function with TRL's signature
            ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, a sequence-classification
            reward model (or its id/path), or a list of them.
        args (`ESConfig`, *optional*): The configuration; default ``ESConfig(f"{model_name}-ES")``.
        train_dataset (`datasets.Dataset` or `datasets.IterableDataset`): Rows with a ``prompt`` (standard text or
            conversational messages); other columns reach reward functions as keyword arguments. An iterable
            (streaming) dataset needs ``max_steps``; every process reads the stream (see
            :meth:`_check_iterable_train_dataset`).
        eval_dataset (`datasets.Dataset`, *optional*): Scored by :meth:`evaluate` with the unperturbed model (an
            iterable one is read whole: it must be finite).
        processing_class (`PreTrainedTokenizerBase`, *optional*): Default: loaded from the model's path.
        reward_processing_classes (*optional*): Tokenizers of reward models, as in GRPOTrainer.
        callbacks (`list[TrainerCallback]`, *optional*): Extra Trainer callbacks.
        optimizers (*optional*): ``(optimizer, scheduler)`` as in ``Trainer``; with ``es_optimizer='torch'`` a given
            optimizer must own ``trainer.es_params.master_parameters()``.
        quantization_config (*optional*): GRPOTrainer's argument (TRL's ``grpo.py`` always passes one): ``None``;
            a real config is refused (quantized weights cannot be perturbed and restored exactly).
        peft_config (`peft.PeftConfig`, *optional*): Wrap the model with PEFT; ES then perturbs the adapter only.

    Raises:
        ValueError: for a dataset without ``prompt`` or an empty dataset, an iterable train dataset without
            ``max_steps``, reward weights of the wrong length, a real ``quantization_config``, a ``PeftModel``
            together with a ``peft_config``.
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
        quantization_config=None,
        peft_config=None,
    ):
        # Args
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            args = ESConfig(f"{model_name.split('/')[-1]}-ES")
        if not isinstance(args, ESConfig):
            raise TypeError(f"args must be an ESConfig, got {type(args).__name__}.")
        args.check_fields()  # fields set after construction (TRL's scripts set some after parse_args), all in one error
        set_seed(args.seed)  # as GRPOTrainer: PEFT's random adapter init (and a new reward head's) is seeded

        # Model: by name as GRPOTrainer loads it (float32 unless model_init_kwargs sets a dtype; the embedded alias
        # -> its local copy); a real quantization_config is refused, a PeftModel with a peft_config too
        revision = (args.model_init_kwargs or {}).get("revision") if isinstance(model, str) else None
        if isinstance(model, str):
            model = load_policy(model, args.model_init_kwargs, quantization_config)
        else:
            warn_unused_init_kwargs(args.model_init_kwargs, quantization_config)
        model = wrap_peft(model, peft_config)

        # Processing class
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path, revision=revision,
                                                             trust_remote_code=args.trust_remote_code)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token

        # Rewards
        self.reward_scorer = RewardScorer(reward_funcs, args.reward_weights, reward_processing_classes,
                                          args.model_init_kwargs, args.trust_remote_code, args.chat_template_kwargs)
        self.reward_func_names = self.reward_scorer.names

        # Data
        validate_dataset(train_dataset, "train_dataset")
        if train_dataset is not None and not hasattr(train_dataset, "__len__"):
            self._check_iterable_train_dataset(args)
            train_dataset = SharedStream(train_dataset)
        if isinstance(eval_dataset, dict):
            for key, dataset in eval_dataset.items():
                validate_dataset(dataset, f"eval_dataset[{key!r}]")
        else:
            validate_dataset(eval_dataset, "eval_dataset")

        # Generation
        self.generation_config = build_generation_config(
            processing_class, args.max_completion_length, args.temperature, args.top_p, args.generation_kwargs,
            model.generation_config,  # its end-of-turn ids (e.g. Gemma's <end_of_turn>) end completions too
        )
        self._es_grad_norm = None  # es_optimizer="torch": the norm of the last ES gradient (logged as grad_norm)

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

        # ES state: built after Trainer placed the model on its device, so the tensors are the final ones (under
        # DeepSpeed ZeRO-3 it is rebuilt from the partitions once DeepSpeed has partitioned the model). The backend
        # checks the selection here, before any work.
        self._init_es_state()
        self._metrics = defaultdict(list)
        self._warned_invalid: set[str] = set()
        self.completion_log = None  # log_completions: the last iteration's completions (GRPO's trainer._logs)
        if args.log_completions:
            self.completion_log = CompletionLog(self.reward_func_names, args.output_dir, args.num_completions_to_print,
                                                args.log_unique_prompts, args.report_to, args.log_completions_hub_repo)
            if self.accelerator.is_main_process:
                self.completion_log.start_hub_upload(args.hub_private_repo, args.hub_model_id)

    def _init_es_state(self) -> None:
        """The ES state of the current model and ``args``: population backend, trained parameters with their master
        and anchor, noise source, generation engine and an empty seed log. Built by the constructor, and again for a
        model that ``model_init`` re-created (``hyperparameter_search``)."""
        args = self.args
        self.population = make_population_backend(args.population_backend, **self._population_backend_kwargs())
        self._build_es_state()
        lowrank = isinstance(self.population.perturbation, LowRankPerturbation)
        device = self.es_params.entries[0].param.device
        noise_source = args.noise_source
        if args.lean_memory and noise_source == "auto":  # no table: fresh blocks (device generator on CUDA)
            noise_source = "device_gaussian" if device.type == "cuda" else "gaussian"
        self.noise = make_noise_source(args.noise_table_size, noise_source, device, lowrank=lowrank)
        self.generation_engine = self._make_generation_engine()
        if args.use_vllm:  # members go into the engine, which holds its own copy of the weights
            self.population = on_engine(self.population, self.generation_engine)
            self._sync_engine_weights()
        logger.info(
            "ESTrainer: population_backend=%s, perturbation=%s, noise=%s, generation_engine=%s, master copies %.1f "
            "MiB, anchor %s",
            args.population_backend, self.population.perturbation.describe(), self.noise.describe(),
            self.generation_engine.describe(), self.es_params.master_bytes / 2**20,
            "none" if self.anchor is None else self.anchor.storage,
        )
        self._comm_bytes = 0.0  # bytes moved into this process by ES's collectives since the last iteration
        self._forward_calls = 0  # model forward calls (decoding steps), counted under ZeRO-3
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
                "perturbation": self.population.perturbation.describe(),
                "population_backend": self.population.describe(),
                "run_settings": run_settings(args, self.reward_func_names),
            }
        )

    def _build_es_state(self) -> None:
        """The trained parameters (whole, or this process's ZeRO-3 partitions), their master and the anchor.

        With the low-rank backend and no ``include_parameters``, the selection is every ``nn.Linear`` weight that is
        not tied to another module (logged); the backend then checks the selection against the model, so a bad one
        raises here, before any work. A low-rank backend never writes the weights: a parameter already in the
        master dtype is its own master (no copy).
        """
        args = self.args
        unwrapped = self.accelerator.unwrap_model(self.model)
        lowrank = isinstance(self.population.perturbation, LowRankPerturbation)
        include = args.include_parameters
        if lowrank and include is None:
            names = linear_weight_names(unwrapped)
            if args.use_vllm:  # vLLM's LoRA adapters cover the projections, not an (untied) lm_head
                head = getattr(unwrapped.get_output_embeddings(), "weight", None)
                names = [n for n in names if unwrapped.get_parameter(n) is not head]
            if not names:
                raise ValueError("population_backend='batched_lowrank' found no trainable nn.Linear weight to train.")
            include = "^(?:" + "|".join(re.escape(n) for n in names) + ")$"
            logger.info("population_backend='batched_lowrank' trains the %d nn.Linear weights (set include_parameters "
                        "to choose others).", len(names))
        selected = select_parameters(unwrapped, include, args.exclude_parameters)
        self._es_model_params = [p for _, p in selected]
        self.es_params = TrainedParameters(
            es_parameter_entries(selected), torch.float32 if args.fp32_master_weights else None,
            share_params=lowrank or args.use_vllm,  # these never write members into the model's weights
        )
        if not any(is_zero3_param(p) for p in self._es_model_params):
            self.population.check(self.es_params, unwrapped)
        self.anchor = None  # theta_0 (under ZeRO-3 the local partition): for AWD and drift logging
        if args.awd_lambda > 0 or args.log_parameter_drift:
            storage = "file" if args.lean_memory and args.anchor_storage == "auto" else args.anchor_storage
            files = checkpoint_files(unwrapped) if storage != "memory" else []
            anchor = make_anchor(self.es_params, storage, files)
            if args.lean_memory and anchor.resident_bytes:
                if args.awd_lambda > 0:
                    warnings.warn(f"lean_memory: the base checkpoint file does not hold theta_0 of every trained "
                                  f"tensor; AWD keeps {anchor.resident_bytes / 2**20:.1f} MiB of it in memory.",
                                  stacklevel=2)
                else:
                    logger.info("lean_memory: theta_0 is not in a checkpoint file; drift logging is skipped.")
                    anchor = None
            self.anchor = anchor

    @property
    def reward_processing_classes(self) -> list:
        """One entry per reward function, as GRPOTrainer's attribute: the tokenizer of a reward model (given, or
        loaded from the model's path), the given entry (``None`` by default) for a function. The scorer's own list
        (``reward_scorer.processing_classes``)."""
        return self.reward_scorer.processing_classes

    @reward_processing_classes.setter
    def reward_processing_classes(self, value: list) -> None:
        self.reward_scorer.processing_classes = value

    @property
    def rollout(self) -> Rollout:
        """The rollout: ``(model, prompt rows) -> scored completions``, a plain callable holding no trainer, built from
        the trainer's current tokenizer, reward scorer, generation config and engine."""
        return Rollout(self.processing_class, self.reward_scorer, self.generation_config, self.args.num_generations,
                       self.args.chat_template_kwargs, self.generation_engine)

    # ------------------------------------------------------------------ the ES iteration
    def training_step(self, model, inputs, num_items_in_batch=None):
        """One ES iteration: ask the population for its members, score them, shape the fitness, tell the update.

        Returns:
            `torch.Tensor`: ``-mean(population fitness)``, logged as the "loss".
        """
        args = self.args
        step = self.state.global_step  # iterations done so far; this one becomes step + 1
        rows = self._gather_prompt_rows(inputs)
        members = self.population.ask(args.seed, step, args.population_size, args.antithetic)

        start, forward_calls = time.perf_counter(), self._forward_calls
        member_scores = self._score_members(members, rows, step)
        evaluate_seconds = time.perf_counter() - start
        scores = self._population_scores(member_scores, len(rows))
        coefficients = shape_fitness(scores.per_prompt_fitness(args.per_prompt_shaping), args.fitness_shaping).tolist()

        start = time.perf_counter()
        learning_rate, shrink = self._es_step(members, coefficients, self._current_learning_rate())
        self._sync_model_view()  # ZeRO-3: after the whole tell (a subclass's _es_step may move the weights again)
        self._sync_engine_weights()  # use_vllm: the new weights go to the engine once per iteration
        update_seconds = time.perf_counter() - start
        self.seed_log.append(step + 1, members, coefficients, learning_rate, shrink)
        if self.completion_log is not None:
            self.completion_log.finish_iteration(step + 1, coefficients, self._gather_objects,
                                                 self.accelerator.is_main_process)

        self._record_comm(self._forward_calls - forward_calls)
        metrics = iteration_metrics(scores, member_scores, self.reward_func_names, self.population.timings,
                                    evaluate_seconds, update_seconds)
        for name, value in metrics.items():
            self._metrics[name].append(value)
        # as GRPOTrainer: num_tokens is the running total of prompt + completion tokens (state.num_input_tokens_seen)
        self.state.num_input_tokens_seen += int(scores.prompt_tokens.sum() + scores.tokens.sum())
        self._metrics["num_tokens"] = [float(self.state.num_input_tokens_seen)]
        fitness = scores.fitness
        mean = fitness[~torch.isnan(fitness)].mean() if not torch.isnan(fitness).all() else torch.tensor(math.nan)
        return torch.tensor(-float(mean), device=args.device)

    def _score_members(self, members: list[Member], rows: list[dict], step: int) -> dict[int, MemberScores]:
        """The member loop: this process's members, a group at a time, applied to the model (restored exactly on
        leaving the ``with``, also on an exception) and rolled out on the prompt rows.

        Population parallelism: members ``i % W == rank``, each on the whole prompt batch; ZeRO-3 (sharded): every
        member, scored by all processes together, each on its own prompts.
        """
        args = self.args
        if self.sharded:
            indices = list(range(args.population_size))
        else:
            indices = member_indices(args.population_size, self.accelerator.process_index,
                                     self.accelerator.num_processes)
        self._prepare_forward_precision()  # bf16/fp16: the forward evaluate() runs, also outside train()
        model = self.accelerator.unwrap_model(self.model)
        per_prompt = args.num_generations if args.per_prompt_shaping != "none" else None
        reward_kwargs = {"trainer_state": self.state, "log_extra": lambda *a, **k: None, "log_metric": self._log_metric}
        self.population.reset_timings()
        scores, log = {}, self.completion_log
        for group in self.population.groups(indices):
            if log is not None:
                reward_kwargs["log_extra"] = log.log_extra_for_call()
            with self.population.apply(self.es_params, self.noise, [members[i] for i in group], args.sigma, model):
                self._seed_sampling(step, group)
                self._sync_model_view()  # ZeRO-3: the forward must gather the freshly perturbed partitions
                out = self.rollout(model, rows * len(group), num_row_groups=len(group), reward_kwargs=reward_kwargs)
            warn_invalid_rewards(out["invalid"], self.reward_func_names, self._warned_invalid)
            if args.mask_truncated_completions:
                mask_truncated_rewards(out)
            if log is not None:
                repeated = [row for row in rows * len(group) for _ in range(args.num_generations)]
                log.add_call(group, repeated, completions_for_rewards(out["completions"], repeated),
                             out["rewards_per_func"])
            for index, part in zip(group, split_row_groups(out, len(group)), strict=True):
                scores[index] = MemberScores.from_rollout(part, args.success_threshold, part["seconds"], per_prompt,
                                                          group_size=args.num_generations)
        return scores

    def _seed_sampling(self, step: int, group: list[int]) -> None:
        """With sampling (``generation_config.do_sample``: ``temperature > 0`` or ``generation_kwargs={"do_sample":
        True}``), seed the generator of a group's rollout.

        One member a group: the member's samples do not depend on which process scores it (sharded, each process
        samples its own prompts, so each has its own stream). Stacked members: one stream per generate call, keyed by
        its first member, so chunks never share a stream; a member's samples then depend on which members share its
        call (chunking, number of processes): with sampling, the batched backend is not invariant to either (greedy
        decoding is).
        """
        if not self.generation_config.do_sample:
            return
        if self.population.stacked:
            torch.manual_seed(member_seed(self.args.seed + 1, step, -1 - int(group[0])))
        else:
            offset = (self.accelerator.process_index << 20) * self.sharded
            torch.manual_seed(member_seed(self.args.seed + 1 + offset, step, int(group[0])))

    def _population_scores(self, member_scores: dict[int, MemberScores], num_rows: int) -> PopulationScores:
        """The members' scores in one population table, summed over processes (a few float64 per member travel; with
        per-prompt shaping also a sum and a count per prompt: ``num_rows`` prompts here, a sharded process's share)."""
        num_prompts, offset = None, 0
        if self.args.per_prompt_shaping != "none":
            shares = self.accelerator.num_processes if self.sharded else 1
            if shares > 1:  # each process fills its own prompts' columns: the shares must be equal
                counts = self.accelerator.gather(torch.tensor([num_rows], device=self.accelerator.device)).tolist()
                self._comm_bytes += 8 * len(counts)
                if len(set(counts)) != 1:
                    raise ValueError(f"per_prompt_shaping={self.args.per_prompt_shaping!r} under ZeRO-3 needs the "
                                     f"same number of prompts on every process; got {counts} (an iterable dataset or "
                                     "uneven batches). Use per_prompt_shaping='none' or a map-style dataset.")
            num_prompts, offset = num_rows * shares, num_rows * self.accelerator.process_index * (shares > 1)
        shares = self.accelerator.num_processes if self.sharded else 1  # min/max lengths: one column block each
        scores = PopulationScores.collect(member_scores, self.args.population_size, len(self.reward_func_names),
                                          num_prompts, offset, completion_stats=True, num_shares=shares,
                                          share_index=self.accelerator.process_index if shares > 1 else 0)
        if self.accelerator.num_processes > 1:
            device = self.accelerator.device
            scores = scores.all_reduce(lambda t: self.accelerator.reduce(t.to(device), reduction="sum").cpu())
            self._comm_bytes += scores.nbytes()
        return scores

    def _es_step(self, members, coefficients: list[float], learning_rate: float) -> tuple[float, float]:
        """The tell: move the weights for one iteration, for both ``es_optimizer`` values, then AWD, then render.

        ``"es"``: the ES step ``theta <- theta + alpha / N * sum_i z_i eps_i`` into the fp32 master
        (:func:`~trl_es.es.update.es_update_`). ``"torch"``: the ES gradient ``-(1/N) sum_i z_i eps_i``
        (:func:`~trl_es.es.update.es_gradient_`), clipped to ``max_grad_norm``, and one step of the Trainer's
        optimizer (its scheduler steps after the iteration, as in ``Trainer``). Then Anchored Weight Decay
        (``awd_lambda > 0``) and the render of the master into the model. Subclasses that combine ES with other
        updates (ES + SFT parallel averaging) override this.

        Returns:
            `(learning_rate, awd_shrink)`: what the seed log records for this iteration (the effective ``alpha`` of
            the ES step and ``alpha * lambda``), so that :func:`trl_es.replay` reproduces it.
        """
        perturbation = self.population.perturbation
        if self.args.es_optimizer == "es":
            es_update_(self.es_params, perturbation, self.noise, members, coefficients, learning_rate)  # renders
        else:
            es_gradient_(self.es_params, perturbation, self.noise, members, coefficients)
            self._es_grad_norm = self._clip_es_gradient()
            self.optimizer.step()
            for master in self.es_params.master_parameters():
                master.grad = None  # stepped: Trainer's own optimizer.step() after the iteration finds nothing to do
        shrink = self._apply_awd(learning_rate)  # renders when it decays
        if self.args.es_optimizer == "torch" and shrink == 0.0:
            self.es_params.render_()
        return learning_rate, shrink

    def _apply_awd(self, learning_rate: float) -> float:
        """Anchored Weight Decay after the ES step (arXiv 2605.30148, Algorithm 1). Returns ``alpha * lambda``."""
        if self.args.awd_lambda <= 0:
            return 0.0
        shrink = learning_rate * self.args.awd_lambda
        self.es_params.anchored_weight_decay_(self.anchor, shrink, self.args.awd_penalty)
        return shrink

    def _log_metric(self, name: str, value: float) -> None:
        self._metrics[name].append(float(value))

    @property
    def _logs(self) -> dict:
        """GRPOTrainer's ``trainer._logs``: the completion table of the last iteration (``log_completions=True``;
        filled on the main process): ``prompt``, ``completion``, ``rewards`` (per reward name), ``advantages``,
        ``extra`` (``log_extra`` columns), and ES's ``member`` and ``step``. Empty when completions are not logged."""
        return self.completion_log.logs if self.completion_log is not None else empty_logs()

    # ------------------------------------------------------------------ logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if not any(key.startswith("eval_") for key in logs):
            for key, values in self._metrics.items():
                valid = [v for v in values if not math.isnan(v)]
                logs[key] = sum(valid) / len(valid) if valid else None
            self._metrics.clear()
            if self.anchor is not None and self.args.log_parameter_drift:
                logs.update(self._parameter_drift())
        super().log(logs, start_time)
        if self.completion_log is not None and self.accelerator.is_main_process:
            self.completion_log.write()  # once per iteration's table, after the metrics (as GRPOTrainer)

    def _parameter_drift(self) -> dict[str, float]:
        """``drift/l2`` and ``drift/relative`` of the trained parameters from theta_0, whole and per module type
        (:func:`~trl_es.trainer.es.es_metrics.drift_sums`; summed over processes under ZeRO-3, where each holds a
        partition)."""
        groups, sums = drift_sums(self.es_params.master_state_dict(), self.anchor)
        if self.sharded and self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums.to(self.accelerator.device), reduction="sum").cpu()
            self._comm_bytes += tensor_bytes(sums)
        return drift_metrics(groups, sums)


    # ------------------------------------------------------------------ evaluation
