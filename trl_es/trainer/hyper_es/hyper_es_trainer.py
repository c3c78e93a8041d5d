"""Hyper-ES (arXiv 2608.05541): CMA-ES over layer-wise DARE-TIES merge coefficients of K LoRA adapters.

A candidate's fitness is the mean reward of the merged model's completions on the generation's prompts.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel, TrainerCallback
from transformers.trainer_utils import TrainOutput, get_last_checkpoint
from trl.trainer.base_trainer import _BaseTrainer

# CMASearch is also imported: checkpoints pickled as trl_es.trainer.hyper_es.hyper_es_trainer.CMASearch still load
from ...es.cma_search import CMASearch, stand_in_fitness
from ...es.strategy import member_indices, member_seed
from ...files import SAVED_MODEL_FILES, require_files
from ...merging.dare_ties import MergeApplier
from ...merging.genome import Genome, GenomeSpace
from ...merging.lora_delta import LoraDeltaSet, save_deltas_as_lora
from ...models import load_policy
from ...rollout import RewardScorer, build_generation_config, score_model, validate_dataset
from .hyper_es_checkpoint import GENOME_NAME, HyperESCheckpointMixin
from .hyper_es_config import HyperESConfig
from .hyper_es_final import choose_final_genome, resolve_genome


logger = logging.getLogger(__name__)

FitnessFn = Callable[[nn.Module, Genome], float]


class HyperESTrainer(HyperESCheckpointMixin, _BaseTrainer):
    """Hyper-ES (arXiv 2608.05541): CMA-ES over the layer-wise DARE-TIES coefficients that merge K LoRA adapters
    into a base model; one generation is one ``global_step``, and after ``train`` the model holds the final merge.

    Args:
        model (`str` or `PreTrainedModel`): The base model (or its path); its target weights are changed in place.
        adapters (`Sequence[str | PeftModel]` or `LoraDeltaSet`): The K LoRA adapters on the same base.
        reward_funcs: TRL-style reward function(s) or reward model(s); not needed with ``fitness_fn``.
        train_dataset (`datasets.Dataset`): The fitness split (a ``prompt`` column, standard or conversational).
        eval_dataset (`datasets.Dataset`, *optional*): Held-out prompts for [`evaluate`]; required with
            ``final_genome="validation"``, which chooses the final genome on them.
        fitness_fn (`Callable[[nn.Module, Genome], float]`, *optional*): Replaces generation + rewards: the fitness to
            maximize of the model holding the candidate merge, given the candidate's genome.

    Raises:
        ValueError: without ``reward_funcs`` and ``fitness_fn``, without a usable ``train_dataset`` when rewards are
            used, or when the adapters do not fit the model.
    """

    # _BaseTrainer (hence transformers.Trainer) gives device placement, callbacks, log, save_model, push_to_hub and
    # the TRL model card; train and evaluate are overridden: no optimizer, no backward, CMA-ES's ask/tell
    _tag_names: ClassVar[list[str]] = ["trl", "trl-es", "hyper-es", "model-merging"]
    _name = "Hyper-ES"

    def __init__(
        self,
        model: str | PreTrainedModel,
        adapters,
        reward_funcs=None,
        args: HyperESConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks: list[TrainerCallback] | None = None,
        reward_processing_classes=None,
        fitness_fn: FitnessFn | None = None,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = HyperESConfig(f"{os.path.basename(str(name).rstrip('/')) or 'model'}-Hyper-ES")
        if isinstance(model, str):
            model = load_policy(model, args.model_init_kwargs)  # as ESTrainer / GRPOTrainer: float32 unless a dtype
        if processing_class is None and fitness_fn is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if fitness_fn is None:
            if reward_funcs is None:
                raise ValueError("HyperESTrainer needs reward_funcs (or a fitness_fn) to score merged models.")
            if train_dataset is None:
                raise ValueError("HyperESTrainer needs a train_dataset (the fitness split) to score merged models.")
            validate_dataset(train_dataset, "train_dataset")
        validate_dataset(eval_dataset, "eval_dataset")
        if args.final_genome == "validation" and eval_dataset is None:
            raise ValueError(
                "final_genome='validation' chooses the final genome on the validation rows: pass them as "
                "eval_dataset (rows not used for fitness, nor the split you report)."
            )
        if args.final_genome == "validation" and fitness_fn is not None:
            raise ValueError("final_genome='validation' scores rows of eval_dataset, but a fitness_fn ignores rows: "
                             "use final_genome='rescored', 'best' or 'mean' with a fitness_fn.")
        model.requires_grad_(False)  # no backward pass: the weights are written, never trained
        delta_set = adapters if isinstance(adapters, LoraDeltaSet) else LoraDeltaSet.from_adapters(model, adapters)
        if args.export_lora_rank is not None:  # refused now, not after a whole search and the merged model's save
            not_lora = sorted(n for n, shape in delta_set.shapes.items() if len(shape) != 2 or n.endswith(".bias"))
            if not_lora:
                raise ValueError(f"export_lora_rank={args.export_lora_rank} cannot export {not_lora[:5]} as LoRA: "
                                 "not weight matrices (modules_to_save of norms, or trained biases, of the adapters). "
                                 "Set export_lora_rank=None (the merged model is saved whole).")
        if processing_class is not None and processing_class.pad_token is None:
            # batched generation pads the prompts: eos as pad, as GRPOTrainer does
            processing_class.pad_token = processing_class.eos_token

        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
        )
        self.fitness_fn = fitness_fn
        self.scorer = None if reward_funcs is None else RewardScorer(
            reward_funcs, args.reward_weights, reward_processing_classes, args.model_init_kwargs,
            chat_template_kwargs=args.chat_template_kwargs)
        self.generation_config = (
            build_generation_config(
                processing_class, args.max_completion_length, args.temperature, args.top_p, args.generation_kwargs,
                self.model.generation_config,
            )
            if processing_class is not None
            else None
        )
        self.applier = MergeApplier(self.model, delta_set, cache_pruned=args.cache_pruned_deltas)
        self.merge_seed = args.merge_seed if args.merge_seed is not None else args.seed  # the DARE drop masks' seed
        self.space = GenomeSpace.from_modules(
            delta_set.module_names,
            delta_set.adapter_names,
            args.genome_granularity,
            weight_bounds=tuple(args.weight_bounds),
            density_bounds=tuple(args.density_bounds),
            search_density=args.search_density,
            density=args.density,
            seed=self.merge_seed,
            sign_election=args.sign_election,
            majority_sign_method=args.majority_sign_method,
        )
        self.search: CMASearch | None = None
        self.best_genome: Genome | None = None
        self.history: list[dict] = []
        self.rows_drawn = 0  # position in the stream of fitness rows (fitness_rows), checkpointed
        self._tokens = 0  # completion tokens this process generated for rewards (fitness and evaluate)
        self.scored_tokens = 0  # completion tokens generated to score candidates, summed over processes (cost)

    # ---- The search ----

    def new_search(self) -> CMASearch:
        """A fresh CMA-ES over :attr:`space`, starting at the uniform merge (``initial_weight``)."""
        args = self.args
        return CMASearch(
            self.space.x0(args.initial_weight),
            args.sigma0,
            popsize=args.population_size,
            seed=args.seed,
            options=args.cma_options,
            top_k=args.rescore_top_k,
            noise_max_evaluations=args.noise_max_evaluations if args.noise_handling else None,
            noise_reevals=args.noise_reevals,
        )

    def candidate_genome(self, x: np.ndarray, generation: int, index: int) -> Genome:
        """Decode candidate ``index`` of ``generation`` (its own DARE seed with ``resample_drop_mask``)."""
        genome = self.space.decode(x)
        # (generation, index) seeds a fresh drop mask per candidate; else every candidate shares merge_seed's masks
        if self.args.resample_drop_mask:
            genome.seed = member_seed(self.merge_seed, generation, index)
        return genome

    def fitness_rows(self, generation: int) -> list[dict]:
        """The prompts of ``generation`` without noise handling, shared by all its candidates: the whole split with
        ``prompt_batch_size=None``, else the generation's batch of :meth:`stream_rows`."""
        size = self.args.prompt_batch_size
        # a function of (seed, generation) alone: a resumed run draws the same prompts
        return self.stream_rows(generation * (size or 0), size)

    def stream_rows(self, start: int, count: int | None) -> list[dict]:
        """Rows ``start .. start + count`` of a stream of seeded permutations of the fitness split; the whole split
        when ``count`` is `None` or at least the split's size."""
        dataset = self.train_dataset
        if dataset is None:
            return []
        n = len(dataset)
        if count is None or count >= n:
            return [dataset[i] for i in range(n)]
        indices = []
        for pos in range(start, start + count):
            epoch, offset = divmod(pos, n)
            # one permutation per pass, seeded by (seed, pass): each row once per pass, no state to checkpoint
            indices.append(int(np.random.default_rng([self.args.seed, epoch]).permutation(n)[offset]))
        return [dataset[i] for i in indices]

    def draw_rows(self, batches: int) -> list[dict]:
        """The next ``batches`` prompt batches of the stream (advances :attr:`rows_drawn`)."""
        size = self.args.prompt_batch_size
        count = None if size is None else size * batches
        rows = self.stream_rows(self.rows_drawn, count)
        self.rows_drawn += count or 0
        return rows

    def _mean_reward(self, rows: list[dict], chunk: int) -> dict:
        chunk = max(1, chunk)
        per_func, rewards = [], []
        for start in range(0, len(rows), chunk):  # chunk prompts per generate call: the memory of one batch
            out = score_model(
                self.model,
                self.processing_class,
                rows[start : start + chunk],
                self.scorer,
                self.generation_config,
                self.args.num_generations,
                self.args.chat_template_kwargs,
            )
            per_func.append(out.rewards_per_func)
            rewards.append(out.rewards)
            self._tokens += out.num_tokens
        return {"rewards_per_func": torch.cat(per_func), "rewards": torch.cat(rewards)}

    def score_current_model(self, rows: list[dict], genome: Genome | None = None) -> float:
        """Fitness of the model as it is now: ``fitness_fn`` if given, else the mean weighted reward on ``rows``."""
        with self._forward_precision():  # the precision evaluate scores with
            if self.fitness_fn is not None:
                return float(self.fitness_fn(self.model, genome))
            rewards = self._mean_reward(rows, self.args.per_device_train_batch_size)["rewards"]
        return float(torch.nanmean(rewards).item())

    def _forward_precision(self):
        """The one precision context of every Hyper-ES forward (candidates' fitness, the final choice, ``evaluate``):
        bf16 with ``bf16=True`` (fp16 with ``fp16=True`` on a GPU), else none."""
        # the model is never prepared (train is not Trainer's loop), so its forward has no autocast of its own
        return self.accelerator.autocast()

    def score_genomes(self, genomes: Sequence[Genome], rows: list[dict]) -> list[float]:
        """Fitness of each genome's merge on ``rows`` (all-reduced under ``torch.distributed``): one float per genome,
        NaN where every reward was ``None``."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)
        # the all-reduce runs on the model's device (NCCL wants CUDA tensors); CPU otherwise
        device = self.applier.device if distributed and self.applier.device.type != "cpu" else torch.device("cpu")
        fitness = torch.zeros(len(genomes) + 1, dtype=torch.float64, device=device)  # last: completion tokens
        tokens_before = self._tokens
        try:
            # this process's share of the candidates; the others' entries stay 0 and the all-reduce sums them in
            for i in member_indices(len(genomes), rank, world):
                self.applier.apply(genomes[i])
                fitness[i] = self.score_current_model(rows, genomes[i])
        finally:
            self.applier.restore()  # W0 again, also after an exception
        fitness[-1] = self._tokens - tokens_before
        if distributed:
            torch.distributed.all_reduce(fitness)
        self.scored_tokens += int(fitness[-1].item())
        return fitness[:-1].cpu().tolist()

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> TrainOutput:
        """Run CMA-ES for ``max_generations`` generations (or until pycma's termination criteria), then put the final
        merge (``final_genome``) into the model; ``resume_from_checkpoint`` (a ``checkpoint-*`` folder, or `True` for
        the last one in ``output_dir``) continues the search exactly where it stopped.

        Returns:
            `TrainOutput`: ``global_step`` (generations done), ``training_loss`` (the negated score the final genome
            was chosen by) and metrics ``train_runtime``, ``train_fitness_best``, ``train_fitness_final``,
            ``train_generations`` and ``train_generated_tokens`` (completion tokens over all processes, this call).

        Raises:
            ValueError: If no candidate got a finite fitness (see ``final_genome``), or no checkpoint to resume from.
        """
        args = self.args
        start_time = time.time()
        tokens_at_start = self.scored_tokens  # train_generated_tokens counts this call only (from the resume point)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No checkpoint found in output_dir {args.output_dir!r} to resume from.")
        if resume_from_checkpoint:
            self._load_checkpoint(resume_from_checkpoint)
        else:
            self.search = self.new_search()
            self.history = []
            self.rows_drawn = 0
            self.state.global_step = 0
        self.state.max_steps = args.max_generations
        self.state.logging_steps = args.logging_steps
        self.state.save_steps = args.save_steps
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        logger.info(
            f"Hyper-ES: {self.space.dim} coefficients ({self.space.num_groups} groups x {self.space.num_adapters} "
            f"adapters{' + densities' if self.space.search_density else ''}), population {self.search.popsize}, "
            f"{args.max_generations} generations."
        )
        search = self.search
        while search.generation < args.max_generations:
            stop = search.stop()
            if stop:
                logger.info(f"CMA-ES stopped after {search.generation} generations: {stop}")
                break
            generation = search.generation
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            gen_start = time.time()
            xs = search.ask()
            # every candidate of the generation scored on the *same* prompts
            evaluations = search.evaluations  # prompt batches per fitness (> 1 only with noise handling)
            rows = self.draw_rows(evaluations)
            genomes = [self.candidate_genome(x, generation, i) for i, x in enumerate(xs)]
            raw = self.score_genomes(genomes, rows)
            scored = [math.isfinite(f) for f in raw]
            fitness = stand_in_fitness(raw)  # NaN where no reward: the generation's worst (CMASearch.tell takes no NaN)
            if not all(scored):
                logger.warning(
                    f"Generation {generation}: {scored.count(False)} candidate(s) had no reward; scored {min(fitness)}."
                )
            noisy = getattr(search, "noise_handler", None) is not None
            # pycma's noise handler re-scores a few candidates on the next batches of the stream
            reevaluate = self._reevaluator(xs, genomes, evaluations) if noisy else None
            search.tell(xs, fitness, tags=[(generation, i) for i in range(len(xs))], scored=scored,
                        reevaluate=reevaluate)
            self.state.global_step = search.generation
            self.state.epoch = None  # no epochs: the fitness rows are a stream
            best = int(np.argmax(fitness))
            best_genome = self.candidate_genome(xs[best], generation, best)
            record = {
                "fitness/best": float(fitness[best]),
                "fitness/mean": float(np.mean(fitness)),
                "fitness/std": float(np.std(fitness)),
                "fitness/best_so_far": float(search.best_fitness),
                "cma/sigma": search.sigma,
                **(
                    # pycma's noise measure, and the prompt batches per fitness
                    {"noise/s": search.noise_s, "noise/evaluations": float(evaluations)}
                    if noisy
                    else {}
                ),
                "time/generation_s": time.time() - gen_start,
                **{f"best/{k}": v for k, v in best_genome.summary().items()},  # mean weight per adapter
            }
            self.history.append({"generation": search.generation, **record})
            logger.info(f"Generation {search.generation}: best genome {best_genome.summary()}")
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self._due(args.logging_steps, search.generation):
                self.log(dict(record))
            if args.save_strategy == "steps" and self._due(args.save_steps, search.generation):
                self._save_checkpoint_state()
            if self.control.should_training_stop:
                break

        self.best_genome, final_fitness, rescored = choose_final_genome(self, search)
        self.best_genome.metadata = {
            "fitness": float(final_fitness),
            "best_fitness_seen": float(search.best_fitness),
            "generations": search.generation,
            "final_genome": args.final_genome,
        }
        if rescored:
            self.best_genome.metadata["validation" if args.final_genome == "validation" else "rescored"] = rescored
        self.applier.apply(self.best_genome)  # the model holds the final merge: save_model writes it
        runtime = time.time() - start_time
        metrics = {
            "train_runtime": runtime,
            "train_fitness_best": float(search.best_fitness),
            "train_fitness_final": float(final_fitness),
            "train_generations": float(search.generation),
            "train_generated_tokens": float(self.scored_tokens - tokens_at_start),
        }
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.log(dict(metrics))
        # pycma minimizes the negated fitness: the loss is that of the final genome
        return TrainOutput(self.state.global_step, -float(final_fitness), metrics)

    def _reevaluator(self, xs: list[np.ndarray], genomes: list[Genome], evaluations: int):
        """For pycma's noise handler: a candidate of this generation re-scored on the next ``evaluations`` prompt
        batches of the stream."""
        rows = self.draw_rows(evaluations)  # drawn now: the stream does not depend on what is re-scored

        def reevaluate(x: np.ndarray) -> float:
            # by identity: the noise handler passes xs' own arrays
            i = next(j for j, candidate in enumerate(xs) if candidate is x)
            return self.score_genomes([genomes[i]], rows)[0]

        return reevaluate

    @staticmethod
    def _due(every: float, step: int) -> bool:
        every = int(every) if every >= 1 else 1  # a fractional logging/save_steps (a ratio) counts as every step
        return step % every == 0

    # ---- Evaluation and saving ----

    def merged(self, genome: Genome | int | str | None):
        """Context manager: the model with ``genome``'s merge applied (what :meth:`evaluate` scores), put back as it
        was afterwards, also on an exception. ``genome`` as in :meth:`evaluate` (`None`: the model as it is).

        Raises:
            ValueError: for an unknown ``genome``, or ``"best"`` before :meth:`train`.
        """
        state = resolve_genome(genome, self.space, self.args.initial_weight, self.best_genome)
        return self.applier.applied(state) if state is not None else contextlib.nullcontext()

    def evaluate(
        self,
        eval_dataset=None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        genome: Genome | int | str | None = None,
    ) -> dict[str, float]:
        """Mean reward on ``eval_dataset`` (default: the trainer's) of the model, or of ``genome``'s merge: `None`
        (the model as it is), ``"base"``, ``"uniform"``, ``"best"``, an adapter index ``k`` (``W0 + Delta_k``) or a
        [`Genome`]; the model is put back as it was afterwards. ``ignore_keys`` is unused (Trainer's signature).

        Returns:
            `dict[str, float]`: ``{prefix}_reward`` (mean weighted reward), ``{prefix}_reward_std``,
            ``{prefix}_rewards/{func}`` (mean per reward function), ``{prefix}_runtime``; with ``fitness_fn``:
            ``{prefix}_fitness``.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        context = self.merged(genome)
        start = time.time()
        with context, self._forward_precision():
            if self.fitness_fn is not None:
                # the genome applied now, if any (fitness_fn takes None for the base or a single adapter)
                current = self.applier.state if isinstance(self.applier.state, Genome) else None
                metrics = {f"{metric_key_prefix}_fitness": float(self.fitness_fn(self.model, current))}
            else:
                if dataset is None:
                    raise ValueError("evaluate needs an eval_dataset (none given here nor to the trainer).")
                validate_dataset(dataset, "eval_dataset")
                out = self._mean_reward(
                    [dataset[i] for i in range(len(dataset))], self.args.per_device_eval_batch_size
                )
                rewards = out["rewards"]
                metrics = {
                    # nan-aware: a completion no reward function scored is left out, not counted as 0
                    f"{metric_key_prefix}_reward": float(torch.nanmean(rewards).item()),
                    f"{metric_key_prefix}_reward_std": float(np.nanstd(rewards.numpy())),
                }
                for j, name in enumerate(self.scorer.names):
                    metrics[f"{metric_key_prefix}_rewards/{name}"] = float(
                        torch.nanmean(out["rewards_per_func"][:, j]).item()
                    )
        metrics[f"{metric_key_prefix}_runtime"] = time.time() - start
        self.log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model as it is (after ``train``: the merged model) with ``save_pretrained``, the tokenizer,
        ``best_genome.json`` and, with ``export_lora_rank``, the merge as a LoRA adapter in ``merged_lora/``."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        super().save_model(output_dir, _internal_call=_internal_call)
        if not self.args.should_save:  # one process writes
            return
        require_files(output_dir, SAVED_MODEL_FILES, "the Hyper-ES model")  # save_pretrained may skip silently
        if self.best_genome is None:
            return
        self.best_genome.save_json(os.path.join(output_dir, GENOME_NAME))
        if self.args.export_lora_rank is not None:
            save_deltas_as_lora(
                # the merged full deltas, recomputed from the genome (the model holds W0 + delta, not the delta)
                {k: v.cpu() for k, v in self.applier.merged_deltas(self.best_genome).items()},
                self.args.export_lora_rank,
                os.path.join(output_dir, "merged_lora"),
                base_model_name_or_path=getattr(self.model.config, "_name_or_path", None),
            )
