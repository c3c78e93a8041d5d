"""Hyper-ES (arXiv 2608.05541): CMA-ES over layer-wise DARE-TIES merge coefficients of K LoRA adapters.

Each candidate of a CMA-ES generation is a vector of merge coefficients (see ``trl_es.merging.genome``); it is decoded,
the K adapters' full deltas are merged with DARE-TIES per module (``trl_es.merging.dare_ties``) and written into the
base weights, and the merged model is scored by the mean reward of its completions on the generation's prompts.
pycma (Hansen et al., ``cma``) minimizes, so it is told the negated fitness.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint, rotate_checkpoints
from trl.trainer.base_trainer import _BaseTrainer

from ..es.population import member_indices, member_seed
from ..files import SAVED_MODEL_FILES, atomic_path, require_files
from ..merging.dare_ties import MergeApplier
from ..merging.genome import Genome, GenomeSpace
from ..merging.lora_delta import LoraDeltaSet, save_deltas_as_lora
from .hyper_es_config import HyperESConfig
from .scoring import RewardScorer, build_generation_config, score_model, validate_dataset

logger = logging.getLogger(__name__)

STATE_NAME = "hyper_es_state.pkl"
GENOME_NAME = "best_genome.json"
TRAINER_STATE_NAME = "trainer_state.json"

FitnessFn = Callable[[nn.Module, Genome], float]


class CMASearch:
    """pycma's ask/tell in the unit box ``[0, 1]^n``, maximizing, with a private and checkpointed numpy RNG.

    By default pycma samples from numpy's *global* RNG (``np.random.randn``) and seeds it from ``opts["seed"]``
    (``0``/``None`` meaning "from the clock"). Here pycma samples from a private ``np.random.RandomState(seed)``
    (pycma's ``randn`` option; its own seeding is switched off with ``seed=nan``), and the global RNG is also swapped
    for a private state around every ``ask``/``tell`` in case pycma draws from it elsewhere. So the search is
    reproducible from ``seed`` alone (any integer, 0 included), does not disturb the caller's numpy RNG, and a pickle
    of this object (pycma's ``CMAEvolutionStrategy`` pickles, with its sampler's RNG) resumes bit-for-bit.

    Args:
        x0 (`np.ndarray`): Initial mean, shape ``(n,)``, in ``[0, 1]``.
        sigma0 (`float`): Initial step size (unit-box units).
        popsize (`int`, *optional*): Population size; pycma's default ``4 + floor(3 ln n)`` when `None`.
        seed (`int`): Seed of the sampling RNG.
        options (`dict`, *optional*): Extra pycma options, applied last.
        top_k (`int`, defaults to 5): How many of the best candidates told so far are kept in :attr:`top`.
    """

    def __init__(
        self,
        x0: np.ndarray,
        sigma0: float,
        popsize: int | None = None,
        seed: int = 0,
        options: dict | None = None,
        top_k: int = 5,
    ):
        import cma

        self._rng = np.random.RandomState(seed)
        self._rng_state = np.random.RandomState(seed + 1).get_state()
        opts = {
            "bounds": [0.0, 1.0],
            "randn": self._rng.randn,  # pickled with the strategy: resume continues the same stream
            "seed": float("nan"),  # no pycma seeding: this object owns the RNG state
            "verbose": -9,
            "verb_log": 0,
            "verb_disp": 0,
            # Rewards are often discrete (accuracy) and greedy decoding makes plateaus common: pycma's flat-fitness
            # and function-value tolerances would stop the search early. The budget (max_generations) is enforced by the
            # caller's loop, not pycma's ``maxiter``, so a resumed run may extend it.
            "tolflatfitness": 10**9,
            "tolfun": 0.0,
            "tolfunhist": 0.0,
        }
        if popsize is not None:
            opts["popsize"] = int(popsize)
        opts.update(options or {})
        with self._numpy_rng():
            self.es = cma.CMAEvolutionStrategy(np.asarray(x0, dtype=np.float64), float(sigma0), opts)
        self.best_x: np.ndarray | None = None
        self.best_fitness = -math.inf
        self.best_tag = None
        self.top_k = int(top_k)
        self.top: list[tuple[float, np.ndarray, object]] = []  # (fitness, x, tag), highest first
        self.num_told = 0  # candidates told
        self.num_finite = 0  # ... of which had a finite fitness

    @contextlib.contextmanager
    def _numpy_rng(self):
        outer = np.random.get_state()
        np.random.set_state(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = np.random.get_state()
            np.random.set_state(outer)

    @property
    def popsize(self) -> int:
        return int(self.es.popsize)

    @property
    def generation(self) -> int:
        """Completed generations (pycma ``countiter``)."""
        return int(self.es.countiter)

    @property
    def sigma(self) -> float:
        return float(self.es.sigma)

    @property
    def mean(self) -> np.ndarray:
        """The distribution mean, inside the box (pycma ``result.xfavorite``, clipped)."""
        return np.clip(np.asarray(self.es.result.xfavorite, dtype=np.float64), 0.0, 1.0)

    def ask(self) -> list[np.ndarray]:
        """Sample one generation, every vector in ``[0, 1]^n``."""
        with self._numpy_rng():
            return [np.asarray(x, dtype=np.float64) for x in self.es.ask()]

    def tell(
        self,
        xs: Sequence[np.ndarray],
        fitness: Sequence[float],
        tags: Sequence | None = None,
        scored: Sequence[bool] | None = None,
    ) -> None:
        """Report the fitness (to *maximize*) of the vectors from the last :meth:`ask`.

        Args:
            xs (`Sequence[np.ndarray]`): The vectors of the last :meth:`ask`.
            fitness (`Sequence[float]`): One fitness per vector, none NaN.
            tags (`Sequence`, *optional*): One tag per vector, kept with the best vector (:attr:`best_tag`) and in
                :attr:`top`.
            scored (`Sequence[bool]`, *optional*): Whether each fitness was measured (``False``: a stand-in for a
                candidate without any reward). Unscored vectors still steer pycma but never become :attr:`best_x`
                or enter :attr:`top`. Default: all scored.

        Raises:
            ValueError: if a fitness is NaN (replace it before telling).
        """
        fitness = [float(f) for f in fitness]
        if any(math.isnan(f) for f in fitness):
            raise ValueError("CMASearch.tell got a NaN fitness; replace it by a finite value first.")
        tags = list(tags) if tags is not None else [None] * len(fitness)
        scored = list(scored) if scored is not None else [True] * len(fitness)
        if not hasattr(self, "top"):  # a search pickled before top-k bookkeeping existed
            self.top_k, self.top, self.num_told, self.num_finite = 5, [], 0, 0
        for x, f, tag, measured in zip(xs, fitness, tags, scored, strict=True):
            self.num_told += 1
            if not measured:
                continue
            self.num_finite += 1
            if f > self.best_fitness:
                self.best_fitness, self.best_x, self.best_tag = f, np.array(x, dtype=np.float64), tag
            if len(self.top) < self.top_k or f > self.top[-1][0]:
                self.top.append((f, np.array(x, dtype=np.float64), tag))
                self.top.sort(key=lambda item: -item[0])  # stable: earlier candidates first among equals
                del self.top[self.top_k :]
        with self._numpy_rng():
            self.es.tell(list(xs), [-f for f in fitness])

    def stop(self) -> dict:
        """pycma's termination conditions met so far (empty dict: keep going)."""
        return dict(self.es.stop())


class HyperESTrainer(_BaseTrainer):
    """Hyper-ES: CMA-ES over the DARE-TIES coefficients that merge K LoRA adapters into a base model.

    The trainer subclasses TRL's ``_BaseTrainer`` (hence ``transformers.Trainer``) and overrides ``train`` and
    ``evaluate``: it reuses the Trainer's device placement, callbacks and ``log`` (``report_to``, ``log_history``),
    ``save_model``/``push_to_hub`` and the TRL model card, while the optimisation loop (no optimizer, no backward
    pass) is CMA-ES's ask/tell. One generation is one ``global_step``.

    Per generation: all candidates are scored on the *same* prompts; under ``torch.distributed`` each process scores
    the candidates ``member_indices(popsize, rank, world_size)`` and the fitnesses are all-reduced. Logged:
    ``fitness/best``, ``fitness/mean``, ``fitness/std``, ``fitness/best_so_far``, ``cma/sigma`` and the best
    candidate's mean weight per adapter. Checkpoints (``save_steps``) hold the pickled CMA-ES state; training
    resumes from them exactly. After ``train``, the model holds the final merge; ``save_model`` writes it with
    ``save_pretrained``, plus ``best_genome.json`` and optionally a rank-``export_lora_rank`` LoRA adapter.

    Args:
        model (`str` or `PreTrainedModel`): The base model (or its path); its target weights are changed in place.
        adapters (`Sequence[str | PeftModel]` or `LoraDeltaSet`): The K LoRA adapters (folders or ``PeftModel`` s on
            the same base), e.g. from [`~trl_es.merging.build_direction_pool`].
        reward_funcs: TRL-style reward function(s) or reward model(s) (see ``trl_es.trainer.scoring.RewardScorer``);
            not needed with ``fitness_fn``.
        args (`HyperESConfig`, *optional*): Configuration.
        train_dataset (`datasets.Dataset`): The fitness split (a ``prompt`` column, standard or conversational).
        eval_dataset (`datasets.Dataset`, *optional*): Held-out prompts for [`evaluate`].
        processing_class: The tokenizer (loaded from the model path when `None`).
        callbacks (`list[TrainerCallback]`, *optional*): Trainer callbacks.
        reward_processing_classes: Tokenizers of reward models.
        fitness_fn (`Callable[[nn.Module, Genome], float]`, *optional*): Replaces generation + rewards: called with the
            model holding the candidate merge and the candidate's genome; returns the fitness to maximize.

    Raises:
        ValueError: without ``reward_funcs`` and ``fitness_fn``, without a usable ``train_dataset`` when rewards are
            used, or when the adapters do not fit the model.
    """

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
            model = AutoModelForCausalLM.from_pretrained(model, **(args.model_init_kwargs or {}))
        if processing_class is None and fitness_fn is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if fitness_fn is None:
            if reward_funcs is None:
                raise ValueError("HyperESTrainer needs reward_funcs (or a fitness_fn) to score merged models.")
            if train_dataset is None:
                raise ValueError("HyperESTrainer needs a train_dataset (the fitness split) to score merged models.")
            validate_dataset(train_dataset, "train_dataset")
        validate_dataset(eval_dataset, "eval_dataset")
        model.requires_grad_(False)
        delta_set = adapters if isinstance(adapters, LoraDeltaSet) else LoraDeltaSet.from_adapters(model, adapters)
        if processing_class is not None and processing_class.pad_token is None:
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
        self.scorer = (
            RewardScorer(reward_funcs, args.reward_weights, reward_processing_classes)
            if reward_funcs is not None
            else None
        )
        self.generation_config = (
            build_generation_config(
                processing_class, args.max_completion_length, args.temperature, args.top_p, args.generation_kwargs
            )
            if processing_class is not None
            else None
        )
        self.applier = MergeApplier(self.model, delta_set, cache_pruned=args.cache_pruned_deltas)
        self.merge_seed = args.merge_seed if args.merge_seed is not None else args.seed
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
        )

    def candidate_genome(self, x: np.ndarray, generation: int, index: int) -> Genome:
        """Decode candidate ``index`` of ``generation`` (its own DARE seed with ``resample_drop_mask``)."""
        genome = self.space.decode(x)
        if self.args.resample_drop_mask:
            genome.seed = member_seed(self.merge_seed, generation, index)
        return genome

    def fitness_rows(self, generation: int) -> list[dict]:
        """The prompts of ``generation``, shared by all its candidates.

        With ``prompt_batch_size=None`` (or at least the split's size) the whole split; otherwise the next
        ``prompt_batch_size`` rows of a stream of seeded permutations of the split (one per pass), so that every row is
        used once per pass and the batch depends only on ``(seed, generation)`` (resume-safe).
        """
        dataset = self.train_dataset
        if dataset is None:
            return []
        n, size = len(dataset), self.args.prompt_batch_size
        if size is None or size >= n:
            return [dataset[i] for i in range(n)]
        start = generation * size
        indices = []
        for pos in range(start, start + size):
            epoch, offset = divmod(pos, n)
            perm = np.random.default_rng([self.args.seed, epoch]).permutation(n)
            indices.append(int(perm[offset]))
        return [dataset[i] for i in indices]

    def _mean_reward(self, rows: list[dict], chunk: int) -> dict:
        chunk = max(1, chunk)
        per_func, rewards = [], []
        for start in range(0, len(rows), chunk):
            out = score_model(
                self.model,
                self.processing_class,
                rows[start : start + chunk],
                self.scorer,
                self.generation_config,
                self.args.num_generations,
                self.args.chat_template_kwargs,
            )
            per_func.append(out["rewards_per_func"])
            rewards.append(out["rewards"])
        return {"rewards_per_func": torch.cat(per_func), "rewards": torch.cat(rewards)}

    def score_current_model(self, rows: list[dict], genome: Genome | None = None) -> float:
        """Fitness of the model as it is now: ``fitness_fn`` if given, else the mean weighted reward on ``rows``."""
        if self.fitness_fn is not None:
            return float(self.fitness_fn(self.model, genome))
        rewards = self._mean_reward(rows, self.args.per_device_train_batch_size)["rewards"]
        return float(torch.nanmean(rewards).item())

    def score_genomes(self, genomes: Sequence[Genome], rows: list[dict]) -> list[float]:
        """Fitness of each genome's merge on ``rows`` (this process's share under ``torch.distributed``, all-reduced).

        Returns:
            `list[float]`: One fitness per genome; NaN where every reward was ``None``.
        """
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)
        device = self.applier.device if distributed and self.applier.device.type != "cpu" else torch.device("cpu")
        fitness = torch.zeros(len(genomes), dtype=torch.float64, device=device)
        try:
            for i in member_indices(len(genomes), rank, world):
                self.applier.apply(genomes[i])
                fitness[i] = self.score_current_model(rows, genomes[i])
        finally:
            self.applier.restore()
        if distributed:
            torch.distributed.all_reduce(fitness)
        return fitness.cpu().tolist()

    def evaluate_population(self, xs: Sequence[np.ndarray], rows: list[dict], generation: int) -> list[float]:
        """Score every candidate of ``generation`` (see :meth:`score_genomes`).

        Returns:
            `list[float]`: One fitness per candidate; NaN (every reward ``None``) is replaced by the generation's
            worst finite fitness (0.0 if none is finite).
        """
        genomes = [self.candidate_genome(x, generation, i) for i, x in enumerate(xs)]
        return self._replace_non_finite(self.score_genomes(genomes, rows), generation)

    @staticmethod
    def _replace_non_finite(values: list[float], generation: int) -> list[float]:
        finite = [f for f in values if math.isfinite(f)]
        if len(finite) < len(values):
            worst = min(finite) if finite else 0.0
            logger.warning(
                f"Generation {generation}: {len(values) - len(finite)} candidate(s) had no reward; scored {worst}."
            )
            values = [f if math.isfinite(f) else worst for f in values]
        return values

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> TrainOutput:
        """Run CMA-ES for ``max_generations`` generations (or until pycma's termination criteria), then put the final
        merge (``final_genome``) into the model.

        Args:
            resume_from_checkpoint (`str` or `bool`, *optional*): A ``checkpoint-*`` folder, or `True` for the last one
                in ``output_dir``: continues the CMA-ES exactly where it stopped.

        Returns:
            `TrainOutput`: ``global_step`` (generations done), ``training_loss`` (the negated fitness of the final
            genome: re-scored on the whole fitness split with ``final_genome="rescored"``; pycma minimizes negated
            fitness) and metrics (``train_runtime``, ``train_fitness_best`` (best seen during the search),
            ``train_fitness_final``, ``train_generations``).

        Raises:
            ValueError: If no candidate got a finite fitness (see ``final_genome``), or no checkpoint to resume from.
        """
        args = self.args
        start_time = time.time()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No checkpoint found in output_dir {args.output_dir!r} to resume from.")
        if resume_from_checkpoint:
            self._load_checkpoint(resume_from_checkpoint)
        else:
            self.search = self.new_search()
            self.history = []
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
            rows = self.fitness_rows(generation)
            genomes = [self.candidate_genome(x, generation, i) for i, x in enumerate(xs)]
            raw = self.score_genomes(genomes, rows)
            fitness = self._replace_non_finite(raw, generation)
            search.tell(
                xs, fitness, tags=[(generation, i) for i in range(len(xs))], scored=[math.isfinite(f) for f in raw]
            )
            self.state.global_step = search.generation
            self.state.epoch = None
            best = int(np.argmax(fitness))
            best_genome = self.candidate_genome(xs[best], generation, best)
            record = {
                "fitness/best": float(fitness[best]),
                "fitness/mean": float(np.mean(fitness)),
                "fitness/std": float(np.std(fitness)),
                "fitness/best_so_far": float(search.best_fitness),
                "cma/sigma": search.sigma,
                "time/generation_s": time.time() - gen_start,
                **{f"best/{k}": v for k, v in best_genome.summary().items()},
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

        self.best_genome, final_fitness, rescored = self._final_genome(search)
        self.best_genome.metadata = {
            "fitness": float(final_fitness),
            "best_fitness_seen": float(search.best_fitness),
            "generations": search.generation,
            "final_genome": args.final_genome,
        }
        if rescored:
            self.best_genome.metadata["rescored"] = rescored
        self.applier.apply(self.best_genome)
        runtime = time.time() - start_time
        metrics = {
            "train_runtime": runtime,
            "train_fitness_best": float(search.best_fitness),
            "train_fitness_final": float(final_fitness),
            "train_generations": float(search.generation),
        }
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.log(dict(metrics))
        return TrainOutput(self.state.global_step, -float(final_fitness), metrics)

    def _final_genome(self, search: CMASearch) -> tuple[Genome, float, list[dict]]:
        """The genome kept after training (``final_genome``), its fitness, and the re-scoring record.

        ``"rescored"``: the best candidates seen (:attr:`CMASearch.top`) and the CMA-ES mean are scored on the whole
        fitness split; the highest score wins (ties: the candidate with the higher search fitness, the mean last).

        Returns:
            `(Genome, float, list[dict])`: The genome; its fitness (the re-scored value with ``"rescored"``, the search
            value with ``"best"``, the best fitness seen with ``"mean"``); one ``{"candidate", "generation",
            "index", "search_fitness", "fitness"}`` record per re-scored genome (empty otherwise).

        Raises:
            ValueError: If candidates were scored but none got a finite fitness (every reward ``None``), or no
                re-scored genome did.
        """
        mode = self.args.final_genome
        num_told, num_finite = getattr(search, "num_told", 0), getattr(search, "num_finite", 0)
        if num_told and not num_finite:
            raise ValueError(
                f"Hyper-ES: none of the {num_told} candidates scored in {search.generation} generation(s) got a "
                "finite fitness (every reward function returned None / NaN for every completion), so there is no "
                f"basis for final_genome={mode!r}. Check that the reward functions apply to this dataset (the "
                "columns they read) and to these completions."
            )
        top = getattr(search, "top", [])
        if mode == "best" and search.best_x is not None:
            return self.candidate_genome(search.best_x, *search.best_tag), float(search.best_fitness), []
        if mode != "rescored" or not top:
            return self.space.decode(search.mean), float(search.best_fitness), []
        genomes = [self.candidate_genome(x, *tag) for _, x, tag in top] + [self.space.decode(search.mean)]
        dataset = self.train_dataset
        rows = [dataset[i] for i in range(len(dataset))] if dataset is not None else []
        scores = self.score_genomes(genomes, rows)
        record = [
            {"candidate": f"top{rank + 1}", "generation": int(tag[0]), "index": int(tag[1]),
             "search_fitness": float(f), "fitness": float(s)}
            for rank, ((f, _, tag), s) in enumerate(zip(top, scores[:-1], strict=True))
        ]
        record.append({"candidate": "mean", "generation": search.generation, "index": None,
                       "search_fitness": None, "fitness": float(scores[-1])})
        finite = [i for i, s in enumerate(scores) if math.isfinite(s)]
        if not finite:
            raise ValueError(
                f"Hyper-ES: none of the {len(genomes)} genomes re-scored on the whole fitness split got a finite "
                "fitness (every reward was None / NaN); no final genome can be chosen."
            )
        best = max(finite, key=lambda i: (scores[i], -i))  # first of the highest, in the order of `genomes`
        logger.info(f"Re-scored {len(genomes)} genomes on the whole fitness split: {record}; kept {record[best]}.")
        return genomes[best], float(scores[best]), record

    @staticmethod
    def _due(every: float, step: int) -> bool:
        every = int(every) if every >= 1 else 1
        return step % every == 0

    # ---- Checkpoints ----

    def _save_checkpoint_state(self) -> str:
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.search.generation}")
        if self.args.should_save:
            os.makedirs(folder, exist_ok=True)
            payload = {
                "version": 1,
                "search": self.search,
                "history": self.history,
                "space_dim": self.space.dim,
                "group_names": self.space.group_names,
                "adapter_names": self.space.adapter_names,
            }
            if self.search.best_x is not None:
                self.candidate_genome(self.search.best_x, *self.search.best_tag).save_json(
                    os.path.join(folder, GENOME_NAME)
                )
            with atomic_path(os.path.join(folder, TRAINER_STATE_NAME)) as tmp:
                self.state.save_to_json(tmp)
            # The CMA-ES state last: a checkpoint folder that holds it is complete (resuming needs it).
            with atomic_path(os.path.join(folder, STATE_NAME)) as tmp, open(tmp, "wb") as f:
                pickle.dump(payload, f)
            rotate_checkpoints(self.args.output_dir, save_total_limit=self.args.save_total_limit)
        return folder

    def _load_checkpoint(self, folder: str) -> None:
        from transformers.trainer_callback import TrainerState

        with open(os.path.join(folder, STATE_NAME), "rb") as f:
            payload = pickle.load(f)  # our own checkpoint format (pycma's state pickles)
        if payload["space_dim"] != self.space.dim or payload["adapter_names"] != self.space.adapter_names:
            raise ValueError(
                f"Checkpoint {folder!r} was made for {payload['space_dim']} coefficients over adapters "
                f"{payload['adapter_names']}; this trainer has {self.space.dim} over {self.space.adapter_names}."
            )
        self.search = payload["search"]
        self.history = payload["history"]
        state_file = os.path.join(folder, TRAINER_STATE_NAME)
        if os.path.exists(state_file):
            self.state = TrainerState.load_from_json(state_file)
        self.state.global_step = self.search.generation
        logger.info(f"Resumed Hyper-ES from {folder} at generation {self.search.generation}.")

    # ---- Evaluation and saving ----

    def _resolve_state(self, genome):
        if genome is None:
            return None
        if isinstance(genome, Genome) or isinstance(genome, int) and not isinstance(genome, bool):
            return genome
        if genome == "base":
            return "base"
        if genome == "uniform":
            return self.space.uniform(self.args.initial_weight)
        if genome == "best":
            if self.best_genome is None:
                raise ValueError("genome='best' needs a trained genome: call train() first.")
            return self.best_genome
        raise ValueError(f"genome must be a Genome, an adapter index, 'base', 'uniform' or 'best'; got {genome!r}.")

    def evaluate(
        self,
        eval_dataset=None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        genome: Genome | int | str | None = None,
    ) -> dict[str, float]:
        """Mean reward on ``eval_dataset`` (default: the trainer's) of the model, or of a given merge.

        Args:
            eval_dataset (`datasets.Dataset`, *optional*): Prompts to score.
            ignore_keys: Unused (Trainer signature).
            metric_key_prefix (`str`): Prefix of the metric names.
            genome: What to evaluate: `None` (the model as it is: the final merge after ``train``), ``"base"``,
                ``"uniform"`` (all weights ``initial_weight``), ``"best"``, an adapter index ``k`` (adapter ``k`` alone,
                ``W0 + Delta_k``), or a [`Genome`]. The model is put back as it was afterwards.

        Returns:
            `dict[str, float]`: ``{prefix}_reward`` (mean weighted reward), ``{prefix}_reward_std``,
            ``{prefix}_rewards/{func}`` (mean per reward function), ``{prefix}_runtime``; with ``fitness_fn``:
            ``{prefix}_fitness``.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        state = self._resolve_state(genome)
        start = time.time()
        context = self.applier.applied(state) if state is not None else contextlib.nullcontext()
        with context:
            if self.fitness_fn is not None:
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
        if not self.args.should_save:
            return
        require_files(output_dir, SAVED_MODEL_FILES, "the Hyper-ES model")  # save_pretrained may skip silently
        if self.best_genome is None:
            return
        self.best_genome.save_json(os.path.join(output_dir, GENOME_NAME))
        if self.args.export_lora_rank is not None:
            save_deltas_as_lora(
                {k: v.cpu() for k, v in self.applier.merged_deltas(self.best_genome).items()},
                self.args.export_lora_rank,
                os.path.join(output_dir, "merged_lora"),
                base_model_name_or_path=getattr(self.model.config, "_name_or_path", None),
            )
