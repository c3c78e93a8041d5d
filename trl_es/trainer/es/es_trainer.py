"""ESTrainer: Evolution Strategies fine-tuning as a TRL trainer (a drop-in for GRPOTrainer).

Setup, then one ES iteration (:meth:`ESTrainer.training_step`), then the Trainer hooks it overrides. Map:
``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
import time
from collections import defaultdict

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel, set_seed
from transformers.utils import logging
from trl.trainer.base_trainer import _BaseTrainer

from ...agents import Agents, MemberVLLMGeneration, tool_counts, tool_metrics
from ...es import EvolutionStrategy, PopulationBackend, TellResult, make_population_backend, member_indices, member_seed
from ...es.anchor import checkpoint_files
from ...es.fitness import MemberScores, PopulationScores
from ...es.perturbation import LowRankPerturbation, Member, TrainedParameters, linear_weight_names, select_parameters
from ...es.seedlog import SeedLog
from ...es.strategy import on_engine
from ...generation import EngineContext, OwnWeightsEngine, generate_completions, make_engine, prompt_add_special_tokens
from ...models import load_policy, warn_unused_init_kwargs, wrap_peft
from ...quantized import prepare_quantized_training, quantization_header
from ...rollout import RewardScorer, Rollout, build_generation_config, prompt_texts, validate_dataset
from ..distributed import SharedStream, all_gather_objects, es_parameter_entries, tensor_bytes
from .completion_logs import CompletionLog, empty_logs
from .es_checkpoint import ESCheckpointMixin, run_settings
from .es_config import ESConfig
from .es_distributed_setup import ESDistributedMixin
from .es_metrics import drift_metrics, drift_sums, iteration_metrics, warn_invalid_rewards
from .es_stability import ESStability


logger = logging.get_logger(__name__)


def identity(features):
    """Data collator that keeps the rows as they are (a list of dicts)."""
    return features


class ESTrainer(ESCheckpointMixin, ESDistributedMixin, _BaseTrainer):
    """Evolution Strategies trainer (Qiu et al. 2025, arXiv 2509.24372), with GRPOTrainer's constructor.

    One training step is one ES iteration: ``population_size`` members ``theta + sigma * eps_i`` are scored by the
    reward functions on the same prompts, and ``theta <- theta + alpha / N * sum_i z_i eps_i`` is applied in fp32.
    On ``W`` processes: population parallelism (members ``i % W == rank``), or sharded ES under ZeRO-3; the weights
    end bitwise as with one process (``docs/scaling.md``).

    Args:
        model (`str` or `PreTrainedModel`): A causal LM or its id/path (loaded with ``args.model_init_kwargs``; in
            float32 unless they set a ``dtype``, as GRPOTrainer: ``{"dtype": "auto"}`` keeps the checkpoint's).
        reward_funcs (`Callable | PreTrainedModel | str | list`): A reward function with TRL's signature
            ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, a sequence-classification
            reward model (or its id/path), or a list of them; may be omitted when an environment has ``get_reward``.
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
        optimizers (*optional*): ``(optimizer, scheduler)`` as in ``Trainer``; a given optimizer must own
            ``trainer.es_params.master_parameters()``.
        quantization_config (*optional*): GRPOTrainer's argument: a quantized base (e.g. ``BitsAndBytesConfig``),
            frozen, with a ``peft_config`` only (QLoRA; ES trains the fp32 adapter, see :mod:`trl_es.quantized`).
        peft_config (`peft.PeftConfig`, *optional*): Wrap the model with PEFT; ES then perturbs the adapter only.
        tools (`list[Callable]`, *optional*): GRPOTrainer's tools; every member's rollout runs GRPO's tool loop
            (docs/agents.md).
        rollout_func (`Callable`, *optional*): GRPOTrainer's ``rollout_func(prompts, trainer) -> dict``, called once
            per member with the member's weights in ``trainer.model``.
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*): GRPOTrainer's environments, one per
            rollout row, reset for every member under the same random numbers.

    Raises:
        ValueError: for a dataset without ``prompt`` or an empty dataset, an iterable train dataset without
            ``max_steps``, reward weights of the wrong length, a quantized base without a ``peft_config`` (or with
            vLLM or ZeRO-3: :func:`~trl_es.quantized.prepare_quantized_training`), a ``PeftModel``
            together with a ``peft_config``; tools with a chat template that cannot render or TRL cannot parse tool
            calls; agent rollouts (tools, environments, rollout_func) with ZeRO-3 or stacked low-rank members.
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
            }"""),  # noqa: E501 (the BibTeX author line)
    }

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs=None,
        args: ESConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
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
        # -> its local copy); a quantized base only under a peft_config, a PeftModel with a peft_config is refused
        revision = (args.model_init_kwargs or {}).get("revision") if isinstance(model, str) else None
        if isinstance(model, str):
            model = load_policy(model, args.model_init_kwargs, quantization_config, peft_config)
        else:
            warn_unused_init_kwargs(args.model_init_kwargs, quantization_config)
        model = wrap_peft(model, peft_config)
        prepare_quantized_training(model, args)  # the adapters stay fp32 (no QLoRA bf16 cast)

        # Processing class
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path, revision=revision,
                                                             trust_remote_code=args.trust_remote_code)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token

        # Agents: GRPO's tools, environments (their methods are tools, get_reward a reward) and rollout_func
        self.agents, processing_class = Agents.build(processing_class, tools, rollout_func, environment_factory)
        self.tools, self.environments = self.agents.tools, self.agents.environments  # GRPOTrainer's attributes
        self.rollout_func, self.chat_template = rollout_func, self.agents.chat_template

        # Rewards (an environment's get_reward last, weight 1, as in GRPO)
        funcs, weights, classes = self.agents.reward_setup(reward_funcs, args.reward_weights, reward_processing_classes)
        self.reward_scorer = RewardScorer(funcs, weights, classes, args.model_init_kwargs, args.trust_remote_code,
                                          args.chat_template_kwargs)
        self.reward_func_names = self.reward_scorer.names

        # Data (an environment may own it: empty prompts, max_steps sets the length, as in GRPO)
        train_dataset = self.agents.train_dataset(train_dataset, args)
        validate_dataset(train_dataset, "train_dataset", prompt_required=self.agents.prompt_required)
        if train_dataset is not None and not hasattr(train_dataset, "__len__"):
            self._check_iterable_train_dataset(args)
            train_dataset = SharedStream(train_dataset)
        if isinstance(eval_dataset, dict):
            for key, dataset in eval_dataset.items():
                validate_dataset(dataset, f"eval_dataset[{key!r}]", prompt_required=self.agents.prompt_required)
        else:
            validate_dataset(eval_dataset, "eval_dataset", prompt_required=self.agents.prompt_required)

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
        """The ES state of the current model and ``args``: :attr:`strategy` (population backend, trained parameters
        with their master, noise source, anchor), the generation engine and an empty seed log. Built by the
        constructor, and again for a model that ``model_init`` re-created (``hyperparameter_search``)."""
        args = self.args
        population = make_population_backend(args.population_backend, **self._population_backend_kwargs())
        self._build_strategy(population, args.noise_source)
        self.agents.check_population(self.sharded, population.stacked and args.member_chunk_size != 1)
        context = EngineContext(processing_class=self.processing_class, generation_config=self.generation_config,
                                accelerator=self.accelerator, params=self.es_params, population=self.population,
                                seed_log=lambda: self.seed_log, sharded=self.sharded, agents=self.agents.active)
        self.generation_engine = make_engine(args, self.accelerator.unwrap_model(self.model), context)
        self.strategy.population = on_engine(self.population, self.generation_engine)  # an engine with own weights
        strategy = self.strategy
        logger.info(
            "ESTrainer: population_backend=%s, perturbation=%s, noise=%s, generation_engine=%s, master copies %.1f "
            "MiB, anchor %s",
            args.population_backend, strategy.perturbation.describe(), strategy.noise.describe(),
            self.generation_engine.describe(), strategy.params.master_bytes / 2**20,
            "none" if strategy.anchor is None else strategy.anchor.storage,
        )
        self._comm_bytes = 0.0  # bytes moved into this process by ES's collectives since the last iteration
        self._forward_calls = 0  # model forward calls (decoding steps), counted under ZeRO-3
        header = strategy.describe(args.es_optimizer) | {"run_settings": run_settings(args, self.reward_func_names)}
        header |= quantization_header(self.accelerator.unwrap_model(self.model))  # the base a resume/replay needs
        self.seed_log = SeedLog(header=header)
        self.stability = ESStability(self)  # sigma="auto" and the collapse guard
        self.stability.add_settings(header)  # their settings, compared on resume
        self._sync_engine_weights()  # use_vllm: the engine starts from the model (a server: from the seed log)

    def _build_strategy(self, population: PopulationBackend, noise) -> None:
        """Set :attr:`strategy` on the trained parameters with ``noise`` (a ``noise_source`` name, or the source of the
        strategy it replaces). Raises ``ValueError`` for a selection the backend cannot perturb."""
        args = self.args
        unwrapped = self.accelerator.unwrap_model(self.model)
        lowrank = isinstance(population.perturbation, LowRankPerturbation)
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
        self._set_es_model_params([p for _, p in selected])
        params = TrainedParameters(
            es_parameter_entries(selected), torch.float32 if args.fp32_master_weights else None,
            share_params=lowrank or args.use_vllm,  # these never write members into the model's weights
        )
        if not self.sharded:
            population.check(params, unwrapped)
        anchored = args.awd_lambda > 0 or args.log_parameter_drift  # theta_0 (under ZeRO-3 the local partition)
        files = checkpoint_files(unwrapped) if anchored and args.anchor_storage != "memory" else ()
        self.strategy = EvolutionStrategy.build(
            params, population, args.sigma, args.population_size, noise=noise, noise_table_size=args.noise_table_size,
            lean_memory=args.lean_memory, anchor_storage=args.anchor_storage if anchored else None, anchor_files=files,
            seed=args.seed, antithetic=args.antithetic, fitness_shaping=args.fitness_shaping,
            awd_lambda=args.awd_lambda, awd_penalty=args.awd_penalty,
            on_module_change="ignore",  # the checkpoint hooks keep the master in step
        )

    # Read-only views of the strategy's parts, under the names the Trainer hooks (and users) read.
    @property
    def es_params(self) -> TrainedParameters:
        """The trained tensors and their master copy (``strategy.params``)."""
        return self.strategy.params

    @property
    def population(self) -> PopulationBackend:
        """How members are put into the model or engine (``strategy.population``)."""
        return self.strategy.population

    @property
    def noise(self):
        """The noise source (``strategy.noise``)."""
        return self.strategy.noise

    @property
    def anchor(self):
        """theta_0 of the trained tensors (for AWD and drift logging), or ``None`` (``strategy.anchor``)."""
        return self.strategy.anchor

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
    def reward_funcs(self) -> list:
        """GRPOTrainer's attribute: the reward functions and models, an environment's ``get_reward`` last."""
        return self.reward_scorer.reward_funcs

    @property
    def reward_weights(self) -> torch.Tensor:
        """GRPOTrainer's attribute: one float32 weight per reward function."""
        return self.reward_scorer.weights

    @property
    def vllm_generation(self) -> MemberVLLMGeneration:
        """GRPOTrainer's ``vllm_generation`` (``use_vllm=True`` only): for a ``rollout_func``,
        ``trainer.vllm_generation.generate(prompt_ids, None, num_generations)`` generates with the member being rolled
        out (see :class:`~trl_es.agents.MemberVLLMGeneration`)."""
        if not self.args.use_vllm:
            raise AttributeError("trainer.vllm_generation exists with use_vllm=True only (as in GRPOTrainer); "
                                 "without vLLM, a rollout_func generates with trainer.model.")
        return MemberVLLMGeneration(self)

    @property
    def rollout(self) -> Rollout:
        """The rollout: ``(model, prompt rows) -> scored completions``, a plain callable holding no trainer, built from
        the trainer's current tokenizer, reward scorer, generation config and engine; with tools, environments or a
        ``rollout_func``, an :class:`~trl_es.agents.AgentRollout` (``rollout_func`` bound to this trainer)."""
        args = self.args
        rollout = Rollout(self.processing_class, self.reward_scorer, self.generation_config, args.num_generations,
                          args.chat_template_kwargs, self.generation_engine)
        return self.agents.rollout(rollout, args, self) if self.agents.active else rollout

    # ------------------------------------------------------------------ the ES iteration
    # ------------------------------------------------------------------ the run's plan
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """``Trainer.train`` with ES's checkpoints and seed log, after logging :meth:`plan`."""
        if self.is_world_process_zero():
            logger.warning(self.plan())  # warning level: shows unless log_level is "error" or above
        return super().train(resume_from_checkpoint, trial, **kwargs)

    def plan(self) -> str:
        """What one iteration of this run does, one line per fact under ``***** ES plan *****`` (as Trainer's
        ``***** Running training *****``)."""
        args, world = self.args, self.accelerator.num_processes
        members = args.population_size
        if self.sharded and world > 1:  # ZeRO-3: all processes score every member together, each on its prompts
            per_process = f"{members} on every process, DeepSpeed ZeRO-3"
        else:
            counts = sorted({len(member_indices(members, rank, world)) for rank in range(world)}, reverse=True)
            per_process = " or ".join(map(str, counts)) + " per process"
        config = self.generation_config
        decoding = f"sampled at temperature {config.temperature}" if config.do_sample else "greedy"
        generations = args.num_generations
        schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        if args.es_optimizer == "es":
            step = f"alpha (learning_rate) = {args.learning_rate}, {schedule} schedule"
        else:
            optim = getattr(args.optim, "value", args.optim)
            step = (f"learning_rate = {args.learning_rate} ({optim} on the ES gradient estimate), {schedule} "
                    "schedule")
        entries = self.es_params.entries
        engine = self.generation_engine.describe()
        grpo = args.grpo_fields_plan()
        lines = [
            "***** ES plan *****",
            f"  Processes = {world}",
            f"  Members per iteration = {members} ({per_process})",
            f"  Prompts per iteration = {args.prompt_batch_size} ({args.per_device_train_batch_size} per process)",
            f"  Completions per prompt = {generations}, {decoding}",
            f"  Completions per iteration = {members * args.prompt_batch_size * generations} ({members} members x "
            f"{args.prompt_batch_size} prompts x {generations})",
            f"  Sigma = {args.sigma}",
            f"  Step: {step}",
            f"  Trained parameters = {sum(e.numel for e in entries):,} in {len(entries)} tensors "
            f"({args.population_backend}, {self.population.perturbation.describe()['type']} noise)",
            f"  Generation engine = {engine.get('name')}",
            f"  GRPO fields mapped = {'; '.join(grpo['mapped']) or 'none'}",
            "  GRPO fields ignored = " + (", ".join(grpo["ignored"]) + " (no effect on ES: see the warning at start)"
                                           if grpo["ignored"] else "none"),
        ]
        return "\n".join(lines)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One ES iteration: ask the strategy for its members, score them, tell it their fitness.

        Returns:
            `torch.Tensor`: ``-mean(population fitness)``, logged as the "loss".
        """
        args = self.args
        step = self.state.global_step  # iterations done so far; this one becomes step + 1
        rows = self._gather_prompt_rows(inputs)
        members = self.strategy.ask(step)
        # sigma="auto": the sigma of this iteration's members, in the record
        extra = self.stability.prepare_sigma(rows, step) if args.sigma == "auto" else {}

        start, forward_calls = time.perf_counter(), self._forward_calls
        member_scores = self._score_members(members, rows, step)
        evaluate_seconds = time.perf_counter() - start
        scores = self._population_scores(member_scores, len(rows))

        start = time.perf_counter()
        # the ES step, or with collapse_guard a rollback (the record then holds the undone members)
        if args.collapse_guard:
            told, recorded, guard_keys, shaped = self.stability.step_or_rollback(members, scores, step,
                                                                                 self._current_learning_rate())
        else:
            told = self._tell(members, scores.per_prompt_fitness(args.per_prompt_shaping),
                              self._current_learning_rate())
            recorded, guard_keys, shaped = members, {}, told.coefficients
        if self.sharded:  # ZeRO-3: after the whole tell (a subclass's _tell may move the weights again)
            self._sync_model_view()
        self.seed_log.append(step + 1, recorded, told.coefficients, told.learning_rate, told.shrink,
                             extra | guard_keys)
        self._sync_engine_weights()  # use_vllm: the new weights (a server: the new record) go to the engine
        update_seconds = time.perf_counter() - start
        if self.completion_log is not None:
            self.completion_log.finish_iteration(step + 1, shaped, self._gather_objects,
                                                 self.accelerator.is_main_process)

        if self.sharded and self.accelerator.num_processes > 1:
            self._record_param_gathers(self._forward_calls - forward_calls)
        self._metrics["comm/bytes"].append(float(self._comm_bytes))  # collectives: rows, statistics, fingerprints
        self._comm_bytes = 0.0
        metrics = iteration_metrics(scores, member_scores, self.reward_func_names, self.population.timings,
                                    evaluate_seconds, update_seconds)
        if self.tools:
            metrics.update(self._tool_metrics())
        metrics.update(self._engine_counts())
        for name, value in metrics.items():
            self._metrics[name].append(value)
        # as GRPOTrainer: num_tokens is the running total of prompt + completion tokens (state.num_input_tokens_seen)
        self.state.num_input_tokens_seen += int(scores.prompt_tokens.sum() + scores.tokens.sum())
        self._metrics["num_tokens"] = [float(self.state.num_input_tokens_seen)]
        fitness = scores.fitness
        mean = fitness[~torch.isnan(fitness)].mean() if not torch.isnan(fitness).all() else torch.tensor(math.nan)
        return torch.tensor(-float(mean), device=args.device)

    def _score_members(self, members: list[Member], rows: list[dict], step: int) -> dict[int, MemberScores]:
        """This process's members, a chunk at a time, applied to the model (restored exactly on leaving the ``with``)
        and rolled out on ``rows``; returns their scores by member index, in chunk order."""
        args = self.args
        if self.sharded:  # ZeRO-3: every member, scored by all processes together, each on its own prompts
            indices = list(range(args.population_size))
        else:
            indices = member_indices(args.population_size, self.accelerator.process_index,
                                     self.accelerator.num_processes)
        self._prepare_forward_precision()  # bf16/fp16: the forward evaluate() runs, also outside train()
        model = self.accelerator.unwrap_model(self.model)
        per_prompt = args.num_generations if args.per_prompt_shaping != "none" else None
        reward_kwargs = {"trainer_state": self.state, "log_extra": lambda *a, **k: None, "log_metric": self._log_metric}
        self.population.reset_timings()
        scores, log, outs = {}, self.completion_log, []

        def roll(chunk):  # one chunk's rollout, its stacked members applied (a server's, with vllm_mode="server")
            kwargs = {**reward_kwargs, "log_extra": log.log_extra_for_call()} if log is not None else reward_kwargs
            with self.strategy.apply([members[i] for i in chunk], model):
                self._seed_sampling(step, chunk)
                if self.sharded:  # ZeRO-3: the forward must gather the freshly perturbed partitions
                    self._sync_model_view()
                out = self.rollout(model, rows * len(chunk), num_members=len(chunk), reward_kwargs=kwargs)
            return out, kwargs.get("log_extra")

        chunks = list(self.strategy.chunks(indices))
        for chunk, (out, log_extra) in zip(chunks, self.generation_engine.map_chunks(roll, chunks), strict=True):
            warn_invalid_rewards(out.invalid, self.reward_func_names, self._warned_invalid)
            if self.agents.active:  # tool counts, and rollout_func's completions (do they depend on the member?)
                outs.append(out)
            if args.mask_truncated_completions:
                out = out.mask_truncated()
            if log is not None:
                log.add_call(chunk, out, log_extra)
            for index, member_rows in zip(chunk, out.split_member_rows(len(chunk)), strict=True):
                scores[index] = MemberScores.from_rollout(member_rows, args.success_threshold, per_prompt,
                                                          group_size=args.num_generations)
        if self.agents.active:
            self.agents.finish_iteration(outs, len(indices))
        return scores

    def _tool_metrics(self) -> dict[str, float]:
        """GRPO's ``tools/call_frequency`` (calls per rollout) and ``tools/failure_frequency`` (failed / calls) of
        the iteration's members, summed over processes (population parallelism)."""
        counts = self.agents.counts
        if self.accelerator.num_processes > 1 and not self.sharded:
            counts = self.accelerator.reduce(counts.to(self.accelerator.device), reduction="sum").cpu()
            self._comm_bytes += counts.numel() * 8
        return tool_metrics(counts)

    def _seed_sampling(self, step: int, chunk: list[int]) -> None:
        """With sampling (``generation_config.do_sample``), seed the generator of a chunk's rollout."""
        if not self.generation_config.do_sample:
            return
        if self.population.stacked:  # one stream per generate call, keyed by its first member (depends on chunking)
            torch.manual_seed(member_seed(self.args.seed + 1, step, -1 - int(chunk[0])))
        else:  # a member's samples do not depend on the process; sharded, each process has its own prompts' stream
            offset = (self.accelerator.process_index << 20) * self.sharded
            torch.manual_seed(member_seed(self.args.seed + 1 + offset, step, int(chunk[0])))

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

    def _tell(self, members: list[Member], fitness: torch.Tensor, learning_rate: float) -> TellResult:
        """The strategy's tell (shaping, ES step or a step of the Trainer's optimizer, AWD, render); a seam for
        trainers that combine ES with another update (ES + SFT parallel averaging)."""
        optimizer_step = self._optimizer_step if self.args.es_optimizer == "torch" else None
        return self.strategy.tell(members, fitness, learning_rate, optimizer_step)

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
        """``drift/l2`` and ``drift/relative`` of the trained parameters from theta_0, whole and, with
        ``log_module_drift``, per module type (:func:`~trl_es.trainer.es.es_metrics.drift_sums`; summed over processes
        under ZeRO-3, where each holds a partition)."""
        groups, sums = drift_sums(self.es_params.master_state_dict(), self.anchor)
        if self.sharded and self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums.to(self.accelerator.device), reduction="sum").cpu()
            self._comm_bytes += tensor_bytes(sums)
        return drift_metrics(groups, sums, per_module=self.args.log_module_drift)

    # ------------------------------------------------------------------ optimizer hooks (es_optimizer="torch")
    def create_optimizer(self, model=None):
        """The Trainer's optimizer class and kwargs, owning the fp32 master tensors (not the 16-bit parameters).

        With ``es_optimizer='es'`` it never receives a gradient, so ``step()`` is a no-op and allocates no state.
        """
        if self.optimizer is None:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            groups = [{"params": self.es_params.master_parameters(), "weight_decay": self.args.weight_decay}]
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def _optimizer_step(self) -> None:
        """``es_optimizer="torch"``: clip the ES gradient in ``master.grad``, step the Trainer's optimizer (its
        scheduler steps after the iteration, as in ``Trainer``)."""
        self._es_grad_norm = self._clip_es_gradient()
        self.optimizer.step()

    def _clip_es_gradient(self) -> torch.Tensor:
        """Clip the ES gradient estimate in ``master.grad`` to ``max_grad_norm`` (when ``> 0``) and return its norm
        (before clipping, as ``Trainer`` logs it)."""
        masters = self.es_params.master_parameters()
        if self.args.max_grad_norm <= 0:
            return torch.nn.utils.get_total_norm([m.grad for m in masters if m.grad is not None])
        if not (self.sharded and self.accelerator.num_processes > 1):
            return torch.nn.utils.clip_grad_norm_(masters, self.args.max_grad_norm)
        # ZeRO-3: the masters are partitions; the norm is over the whole gradient estimate.
        grads = [m.grad for m in masters if m.grad is not None]
        square = torch.zeros((), dtype=torch.float64)
        if grads:
            square = torch.stack([g.double().pow(2).sum() for g in grads]).sum()
        square = self.accelerator.reduce(square.reshape(1).to(self.accelerator.device), reduction="sum").cpu()
        total = square.sqrt()[0]
        torch.nn.utils.clip_grads_with_norm_(masters, self.args.max_grad_norm, total)
        return total

    def _clip_grad_norm(self, model):
        # The ES gradient was clipped and stepped within the iteration (see _tell): Trainer's clip is a no-op.
        # (es_optimizer="es" has no gradient: its norm is 0, as torch's clip of no gradient says.)
        return self._es_grad_norm if self._es_grad_norm is not None else torch.zeros(())

    def _get_grad_norm(self, model, grad_norm=None):
        norm = grad_norm if grad_norm is not None else self._es_grad_norm
        return norm.item() if hasattr(norm, "item") else norm

    def measure_sigma_effect(self, sigmas, rows: list[dict] | None = None) -> dict:
        """The effect ``sigma="auto"`` measures at each of ``sigmas`` (:meth:`ESStability.measure_sigma_effect`); the
        weights are unchanged."""
        return self.stability.measure_sigma_effect(sigmas, rows)

    def _current_learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else self.args.learning_rate

    # ------------------------------------------------------------------ generation engine
    def _engine_counts(self) -> dict[str, float]:
        """The engine's :meth:`~trl_es.generation.GenerationEngine.iteration_counts`, summed over the processes
        (e.g. ``vllm_server/members_rerun`` and ``vllm_server/live_servers`` with ``vllm_mode="server"``)."""
        counts = self.generation_engine.iteration_counts()
        if not counts:
            return {}
        values = torch.tensor(list(counts.values()), dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            values = self.accelerator.reduce(values.to(self.accelerator.device), reduction="sum").cpu()
            self._comm_bytes += values.numel() * 8
        return {name: float(v) for name, v in zip(counts, values, strict=True)}

    def _sync_engine_weights(self) -> None:
        """For an engine that holds its own weights (``use_vllm``): load the model's current weights into it, so that
        it computes with what the ES update produced: when the engine is built, after every iteration's update (a
        subclass's ``_tell`` included), after a checkpoint is loaded, and before an evaluation."""
        if isinstance(self.generation_engine, OwnWeightsEngine):
            self.generation_engine.sync_weights(self.accelerator.unwrap_model(self.model), self.es_params, self.noise)

    def _population_backend_kwargs(self) -> dict:
        """Backend-specific settings from the config."""
        if self.args.population_backend == "sequential":
            return {}
        return {"noise_rank": self.args.noise_rank, "member_chunk_size": self.args.member_chunk_size}

    # ------------------------------------------------------------------ data
    @staticmethod
    def _check_iterable_train_dataset(args: ESConfig) -> None:
        """Check ``args`` for an iterable (streaming) train dataset; every process then reads the stream itself.

        Raises:
            ValueError: if ``max_steps`` is not set, or ``accelerator_config.dispatch_batches`` is ``True``.
        """
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError("train_dataset is an iterable (streaming) dataset, which has no length: set max_steps "
                             "(the number of ES iterations) to a positive value, or pass a map-style datasets.Dataset.")
        if args.accelerator_config.dispatch_batches:
            raise ValueError("accelerator_config.dispatch_batches=True cannot dispatch an iterable dataset's text rows "
                             "(accelerate broadcasts tensors only): leave it unset (None) or set it to False.")
        # every process iterates the stream and keeps its slice of each batch (IterableDatasetShard): text rows
        # cannot be dispatched, accelerate broadcasts tensors only
        args.accelerator_config.dispatch_batches = False
        if args.dataloader_num_workers != 0:  # as GRPOTrainer: workers would interleave the stream's shards
            logger.warning(f"An iterable train dataset is read in stream order with dataloader_num_workers=0 "
                           f"(several workers would interleave its shards); overriding {args.dataloader_num_workers}.")
            args.dataloader_num_workers = 0

    def _set_signature_columns_if_needed(self):
        # Rows go to the reward functions as they are: keep every column.
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def _gather_prompt_rows(self, rows: list[dict]) -> list[dict]:
        """Each process loaded its share of the prompt batch; with population parallelism every process needs all of
        it (``torch.distributed.all_gather_object``, counted in ``comm/bytes``). Sharded (ZeRO-3) processes keep their
        share: each generates for its own prompts."""
        return list(rows) if self.sharded else self._gather_objects(rows)

    def _gather_objects(self, objects: list) -> list:
        """Every process's ``objects``, concatenated in rank order (``torch.distributed.all_gather_object``, the
        bytes it moves counted in ``comm/bytes``); on one process, ``objects`` itself."""
        if self.accelerator.num_processes == 1:
            return list(objects)
        parts, nbytes = all_gather_objects(list(objects))
        self._comm_bytes += nbytes
        return [obj for part in parts for obj in part]

    # ------------------------------------------------------------------ evaluation
    def _prepare_forward_precision(self) -> None:
        """Give the model the precision of training (bf16/fp16 autocast) before its first forward, so every ES forward
        (``evaluate`` before, during and after ``train``, the rollouts) runs the same computation."""
        if not self.accelerator.native_amp or self.is_deepspeed_enabled:  # DeepSpeed casts the weights instead
            return
        if any(getattr(m, "_is_accelerate_prepared", False) for m in (self.model, self.model_wrapped)):
            return
        # as Trainer before training or its first evaluation; evaluation_mode=True: no DDP wrapper
        prepared = self.accelerator.prepare_model(self.model, evaluation_mode=True)
        if prepared is not self.model:  # as Trainer's evaluation_loop (e.g. torch_compile's wrapper)
            self.model_wrapped = prepared
        self._rebind_es_params()  # preparing may move the weights to new storage (as in _prepare_for_training)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Score the unperturbed model on ``eval_dataset`` and log ``eval_reward`` (and per-function means).

        Rewards are summed as training sums a member's (:meth:`~trl_es.es.fitness.MemberScores.from_rollout`): a
        non-finite reward is left out as a ``None`` is, and counted.

        Returns:
            `dict[str, float]`: ``{prefix}_reward``, ``{prefix}_loss`` (``-{prefix}_reward``, so Trainer's default
            ``metric_for_best_model="loss"`` keeps the best eval reward; ``None`` when nothing was scored),
            ``{prefix}_rewards/{name}/mean``, ``{prefix}_num_completions``, ``{prefix}_num_invalid_rewards``,
            ``{prefix}_runtime``.
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
        validate_dataset(dataset, "eval_dataset", prompt_required=self.agents.prompt_required)
        if not hasattr(dataset, "__len__"):  # an iterable eval dataset: read whole (it must be finite)
            dataset = list(dataset)
        if self.is_deepspeed_enabled and self.sharded and getattr(self, "deepspeed", None) is None:
            self._prepare_deepspeed_engine()  # ZeRO-3 partitioned at load time: generation needs the engine's hooks
        self._prepare_forward_precision()
        self._sync_model_view()
        self._sync_engine_weights()
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        indices = list(range(rank, len(dataset), world))  # each process scores every W-th row
        rows = [dataset[i] for i in indices]
        unwrapped = self.accelerator.unwrap_model(self.model)
        batch = self.args.per_device_eval_batch_size
        # Under ZeRO-3 every process must run as many generate calls as the others (each forward gathers the
        # parameters from all of them): processes short of prompts score a placeholder batch and drop it.
        num_batches = math.ceil(math.ceil(len(dataset) / world) / batch) if self.sharded else None
        num_funcs = len(self.reward_func_names)
        scores = PopulationScores.collect({}, 1, num_funcs)  # the unperturbed model as a population of one
        calls_seen = torch.zeros(3, dtype=torch.float64)  # tool calls, failed calls, rollouts
        if self.generation_config.do_sample:  # however sampling is on (temperature > 0, generation_kwargs)
            torch.manual_seed(self.args.seed)
        num_generations = self.args.num_generations_eval or self.args.num_generations
        rollout = dataclasses.replace(self.rollout, num_generations=num_generations)
        start = time.perf_counter()
        for first in range(0, len(rows) if num_batches is None else num_batches * batch, batch):
            batch_rows = rows[first : first + batch]
            if not batch_rows:  # ZeRO-3 only: take part in the others' forwards, score nothing
                placeholder = prompt_texts([dataset[0]], self.processing_class, self.args.chat_template_kwargs)
                generate_completions(unwrapped, self.processing_class, placeholder, self.generation_config,
                                     engine=self.generation_engine,
                                     add_special_tokens=prompt_add_special_tokens([dataset[0]["prompt"]]))
                continue
            # an environment's task follows the row's index in the dataset, however the rows are split
            agent_kwargs = {"row_ids": indices[first : first + batch]} if self.agents.active else {}
            out = rollout(unwrapped, batch_rows, reward_kwargs={
                "trainer_state": self.state, "log_extra": lambda *a, **k: None, "log_metric": lambda *a, **k: None},
                **agent_kwargs)
            warn_invalid_rewards(out.invalid, self.reward_func_names, self._warned_invalid)
            calls_seen += tool_counts(out)
            member = MemberScores.from_rollout(out, self.args.success_threshold)  # training's sums and invalid rule
            scores = scores + PopulationScores.collect({0: member}, 1, num_funcs)
        if world > 1:
            scores = scores.all_reduce(lambda t: self.accelerator.reduce(t.to(self.accelerator.device), "sum").cpu())
            calls_seen = self.accelerator.reduce(calls_seen.to(self.accelerator.device), "sum").cpu()
        count = float(scores.reward_count[0])
        reward = float(scores.reward_sum[0]) / count if count > 0 else None  # as training's `reward`
        metrics = {
            f"{metric_key_prefix}_loss": 0.0 - reward if reward is not None else None,  # 0.0, not -0.0, at reward 0
            f"{metric_key_prefix}_reward": reward,
            f"{metric_key_prefix}_num_completions": int(len(dataset) * num_generations),
            f"{metric_key_prefix}_num_invalid_rewards": int(scores.invalid[0]),
            f"{metric_key_prefix}_runtime": time.perf_counter() - start,
        }
        for name, mean in zip(self.reward_func_names, scores.reward_means_per_func(), strict=True):
            if mean is not None:
                metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = mean
        if self.tools:  # GRPO's tools/* of the evaluation's rollouts
            metrics.update(tool_metrics(calls_seen, f"{metric_key_prefix}_"))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
