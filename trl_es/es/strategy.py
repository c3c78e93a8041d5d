"""OpenAI-ES as one ask/tell object on any ``nn.Module`` (Qiu et al. 2025, arXiv 2509.24372, Algorithm 1).

The loop owns evaluation, as with pycma's ``CMAEvolutionStrategy``:

    strategy = EvolutionStrategy.for_module(model, sigma=0.01, population_size=8)
    for step in range(steps):
        members = strategy.ask(step)
        fitness = []
        for chunk in strategy.chunks(range(len(members))):
            with strategy.apply([members[i] for i in chunk], model):  # restored bitwise on leaving, also on errors
                fitness += score(model)
        strategy.tell(members, torch.tensor(fitness), learning_rate=5e-4)

Weights put into the module between calls are what the next ``apply`` restores and ``tell`` steps from
(:meth:`EvolutionStrategy.sync_with_module`). Nothing here imports TRL or ``transformers``.

The population schedule of ask/tell: the members of an iteration (:func:`sample_population`, seeds by
:func:`member_seed`, a process's share by :func:`member_indices`) and how a group of them is put into the model
(a :class:`PopulationBackend`): :class:`SequentialPopulation` writes one full-rank member into the weights in place
(Qiu et al. 2025, arXiv 2509.24372, Algorithm 1); :class:`BatchedLowRankPopulation` applies a group of rank-``r``
members as per-row adapters in one batched forward (EGGROLL, arXiv 2511.16652). :func:`on_engine` runs either
inside a generation engine that holds its own weights (:class:`WeightsHost`). The strategy never scores members
(pycma's ask/tell).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .anchor import make_anchor
from .fitness import shape_fitness
from .noise import DEFAULT_TABLE_SIZE, NoiseSource, make_noise_source
from .perturbation import (
    GaussianPerturbation,
    LowRankAdapters,
    LowRankPerturbation,
    Member,
    Perturbation,
    TrainedParameters,
    es_gradient_,
    es_update_,
    linear_targets,
    select_parameters,
)


MODULE_CHANGE_RULES = ("reread", "raise", "ignore")
"""What :meth:`EvolutionStrategy.sync_with_module` does when the module's weights changed outside the strategy."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer view
_COMPARE_CHUNK = 1 << 24  # elements compared at a time (bounds the temporary cast of a 16-bit model's master)


def holds_render(param: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether ``param`` holds bitwise ``cast(master)`` (same shape and device), what
    :meth:`TrainedParameters.write_master_to_model_` writes.
    """
    if param.shape != master.shape:
        return False
    flat_param, flat_master = param.reshape(-1), master.reshape(-1)
    bits = _BITS[param.element_size()]  # compared as integers: -0.0 differs from 0.0, a NaN equals itself
    for lo in range(0, flat_param.numel(), _COMPARE_CHUNK):  # chunk by chunk: no full-size temporary
        live = flat_param[lo : lo + _COMPARE_CHUNK]
        rendered = flat_master[lo : lo + _COMPARE_CHUNK].to(param.dtype)
        if not torch.equal(live.view(bits), rendered.view(bits)):
            return False
    return True


@dataclass
class TellResult:
    """What :meth:`EvolutionStrategy.tell` did, as the seed log records it for the iteration."""

    coefficients: list[float]  # the shaped fitness z_i, one per member
    learning_rate: float  # alpha of the step
    shrink: float  # alpha * awd_lambda of Anchored Weight Decay (0 without AWD)


class EvolutionStrategy:
    """The ES state of one run (trained tensors with their fp32 master, noise, population, sigma) and its
    ask / groups / apply / tell (Qiu et al. 2025, arXiv 2509.24372, Algorithm 1).

    Raises:
        ValueError: for an unknown ``on_module_change``.
    """

    def __init__(self, params: TrainedParameters, noise: NoiseSource, population: PopulationBackend, sigma: float,
                 population_size: int, seed: int = 0, antithetic: bool = False, fitness_shaping: str = "zscore",
                 awd_lambda: float = 0.0, awd_penalty: str = "l2", anchor: Mapping[str, torch.Tensor] | None = None,
                 module: nn.Module | None = None, on_module_change: str = "reread"):
        if on_module_change not in MODULE_CHANGE_RULES:
            raise ValueError(f"on_module_change must be one of {MODULE_CHANGE_RULES}, got {on_module_change!r}.")
        self.params = params  # the trained tensors and their master copy
        self.noise = noise  # where eps(seed) comes from
        self.population = population  # how members are put into the model (in place, or as low-rank adapters)
        self.sigma = sigma
        self.population_size = population_size  # N >= 2; even with antithetic
        self.seed = seed  # base seed of the members' noise seeds
        self.antithetic = antithetic  # mirrored pairs +eps, -eps (Salimans et al. 2017, Sec. 2.1)
        self.fitness_shaping = fitness_shaping  # "zscore", "centered_rank" or "none" (shape_fitness)
        self.awd_lambda = awd_lambda  # Anchored Weight Decay (arXiv 2605.30148, Algorithm 1); 0: off
        self.awd_penalty = awd_penalty  # "l2" or "l1"
        self.anchor = anchor  # theta_0 of the trained tensors, needed for AWD
        self.module = module  # looked up by name on every call, so new storage (assign=True, .half()) is followed
        # what apply/tell do when the module's tensors changed outside the strategy (sync_with_module):
        # "reread" takes them as the master, "raise" refuses, "ignore" leaves it to the caller
        self.on_module_change = on_module_change

    @classmethod
    def for_module(cls, model: nn.Module, sigma: float, population_size: int, include: str | None = None,
                   noise_source: str = "gaussian", **kwargs) -> EvolutionStrategy:
        """A sequential, full-rank strategy on ``model``'s trainable tensors with an fp32 master and
        ``module=model``; ``kwargs`` go to the constructor.
        """
        params = TrainedParameters(select_parameters(model, include), torch.float32)
        if kwargs.get("awd_lambda", 0) > 0 and kwargs.get("anchor") is None:  # theta_0: the master at construction
            kwargs["anchor"] = {n: t.clone() for n, t in params.master_state_dict().items()}
        kwargs.setdefault("module", model)
        return cls(params, make_noise_source(0, noise_source), SequentialPopulation(), sigma, population_size,
                   **kwargs)

    @classmethod
    def build(cls, params: TrainedParameters, population: PopulationBackend, sigma: float, population_size: int, *,
              noise: NoiseSource | str = "auto", noise_table_size: int = DEFAULT_TABLE_SIZE, lean_memory: bool = False,
              anchor_storage: str | None = None, anchor_files: Sequence[str] = (), **kwargs) -> EvolutionStrategy:
        """The strategy of ``params`` with its noise source and anchor, each built by its own module's rules;
        ``kwargs`` go to the constructor.

        Raises:
            ValueError: for ``awd_lambda > 0`` without ``anchor_storage``; as :func:`make_noise_source`,
                :func:`~trl_es.es.anchor.make_anchor` and the constructor.
        """
        awd = kwargs.get("awd_lambda", 0) > 0
        if awd and anchor_storage is None:
            raise ValueError("awd_lambda > 0 needs an anchor: set anchor_storage ('auto', 'memory' or 'file').")
        anchor = None
        if anchor_storage is not None:  # theta_0, as the parameters hold it now
            anchor = make_anchor(params, anchor_storage, list(anchor_files), lean_memory=lean_memory, required=awd)
        if isinstance(noise, str):
            # on the trained tensors' device; lean_memory holds no table (the memory rule)
            lowrank = isinstance(population.perturbation, LowRankPerturbation)
            noise = make_noise_source(noise_table_size, noise, params.entries[0].param.device, lowrank=lowrank,
                                      lean_memory=lean_memory)
        return cls(params, noise, population, sigma, population_size, anchor=anchor, **kwargs)

    def describe(self, optimizer: str = "es") -> dict:
        """The run's facts for the seed log's header (:class:`~trl_es.es.seedlog.SeedLog`), JSON-serializable.

        Args:
            optimizer (`str`): How :meth:`tell` steps: ``"es"`` (its own update) or ``"torch"`` (``optimizer_step``).
        """
        dtype = self.params.master_dtype
        return {
            "noise": self.noise.describe(),
            "sigma": self.sigma,
            "population_size": self.population_size,
            "antithetic": self.antithetic,
            "fitness_shaping": self.fitness_shaping,
            "optimizer": optimizer,
            "master_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "awd_penalty": self.awd_penalty,
            "parameters": [[e.name, e.numel] for e in self.params.entries],
            "perturbation": self.perturbation.describe(),
            "population_backend": self.population.describe(),
        }

    @property
    def perturbation(self):
        return self.population.perturbation

    def ask(self, step: int) -> list[Member]:
        """The ``population_size`` members of iteration ``step`` (seeds and signs: :func:`sample_population`);
        the same on every process."""
        return sample_population(self.seed, step, self.population_size, self.antithetic)

    def chunks(self, indices: Sequence[int]) -> list[list[int]]:
        """The member indices in the chunks :meth:`apply` takes (one a chunk, or ``member_chunk_size`` stacked)."""
        return self.population.chunks(indices)

    def sync_with_module(self) -> list[str]:
        """Make the master hold what the module holds where the two parted outside the strategy; run first by
        :meth:`apply` and :meth:`tell`. Returns the names of the re-read tensors.

        Raises:
            ValueError: with ``on_module_change="raise"``, naming the changed tensors; or, with :attr:`module` set,
                naming a trained tensor the module no longer has, or holds with another shape or on another device.
        """
        # "ignore": the caller keeps the master in step itself (ESTrainer, through its checkpoint hooks)
        if self.on_module_change == "ignore" or self.params is None or self.params.perturbed:
            return []
        live = self._live_tensors()
        moved, changed = [], []
        for e in self.params.entries:
            tensor = live[e.name]
            # new storage (load_state_dict(assign=True), model.to(dtype)): follow it
            if tensor.data_ptr() != e.param.data_ptr() or tensor.dtype != e.param.dtype:
                moved.append((e, tensor))
            # values compared, not version counters (p.data.copy_ bumps none); a shared master is the module's
            if not e.master_is_param and not holds_render(tensor, e.master):
                changed.append((e, tensor))
        if changed and self.on_module_change == "raise":
            names = [e.name for e, _ in changed]
            raise ValueError(f"The module's trained tensors {names} no longer hold the strategy's weights: they were "
                             "written outside the strategy (e.g. load_state_dict). Build a new strategy for the new "
                             "weights, or use on_module_change='reread'.")
        for e, tensor in moved:
            self.params.rebind_(e.name, tensor)
        with torch.no_grad():
            for e, tensor in changed:
                e.master.copy_(tensor)  # a 16-bit value is exact in fp32
        return [e.name for e, _ in changed]

    def _live_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors the module holds now, by entry name (the entries' own tensors without :attr:`module`).

        Raises:
            ValueError: naming a tensor the module no longer has, or holds with another shape or on another device.
        """
        if self.module is None:
            return {e.name: e.param for e in self.params.entries}
        named = dict(self.module.named_parameters())
        live = {}
        for e in self.params.entries:
            param = named.get(e.name)
            if param is None:
                raise ValueError(f"The module no longer has the trained parameter {e.name!r}; build a new strategy.")
            tensor = param.data
            # the master keeps its shape and device: a reshaped or moved model needs a new strategy
            if tensor.shape != e.param.shape or tensor.device != e.master.device or not tensor.is_contiguous():
                raise ValueError(
                    f"The module's parameter {e.name!r} is now {tuple(tensor.shape)} on {tensor.device} "
                    f"(contiguous: {tensor.is_contiguous()}); the strategy trains it as {tuple(e.param.shape)} on "
                    f"{e.master.device}, contiguous. Build a new strategy after reshaping or moving the model.")
            live[e.name] = tensor
        return live

    @contextlib.contextmanager
    def apply(self, members: Sequence[Member], model: nn.Module | None = None) -> Iterator[None]:
        """Context in which ``model`` (default :attr:`module`) computes with ``members`` (one group of
        :meth:`groups`) applied; on exit, also on an exception, the weights are restored bitwise to the entry's.
        """
        self.sync_with_module()
        model = model if model is not None else self.module  # stacked members own equal row blocks, in order
        with self.population.apply(self.params, self.noise, members, self.sigma, model):
            yield

    def tell(self, members: Sequence[Member], fitness: torch.Tensor, learning_rate: float,
             optimizer_step: Callable[[], None] | None = None) -> TellResult:
        """Move the weights for one iteration: shape the fitness, step, decay toward the anchor, write the master.

        ``members``: the ``N >= 2`` of :meth:`ask`; ``fitness``: ``(N,)`` real, non-finite values rank worst
        (:func:`shape_fitness`); ``learning_rate``: ``alpha``, finite; ``optimizer_step``: steps a torch optimizer
        owning the masters. Returns the :class:`TellResult` the seed log records.

        Raises:
            ValueError: for members that are not :class:`Member`, a fitness that is not one real value per member, a
                non-finite learning rate, an unknown shaping name, or ``awd_lambda > 0`` without an anchor (raised
                before the weights change); see also :meth:`sync_with_module`.
        """
        fitness = _check_fitness(members, fitness)
        if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real) \
                or not math.isfinite(learning_rate):
            raise ValueError(f"learning_rate must be a finite number, got {learning_rate!r}.")
        if self.awd_lambda > 0 and self.anchor is None:
            raise ValueError("awd_lambda > 0 needs an anchor (theta_0 of the trained tensors).")
        coefficients = shape_fitness(fitness, self.fitness_shaping).tolist()
        self.sync_with_module()  # step from what the module holds
        if optimizer_step is None:  # theta <- theta + alpha / N * sum_i z_i eps_i, fp32 into the master
            es_update_(self.params, self.perturbation, self.noise, members, coefficients, learning_rate)  # renders
        else:
            # -(1/N) sum_i z_i eps_i into master.grad, for the torch optimizer
            es_gradient_(self.params, self.perturbation, self.noise, members, coefficients)
            optimizer_step()
            for master in self.params.master_parameters():
                master.grad = None  # stepped: a later optimizer.step() finds nothing to do
        shrink = 0.0
        if self.awd_lambda > 0:
            shrink = learning_rate * self.awd_lambda
            self.params.anchored_weight_decay_(self.anchor, shrink, self.awd_penalty)  # renders
        elif optimizer_step is not None:
            self.params.write_master_to_model_()
        return TellResult(coefficients, learning_rate, shrink)


def _check_fitness(members: Sequence[Member], fitness) -> torch.Tensor:
    """``fitness`` as a tensor of shape ``(len(members),)``, or a ``ValueError`` naming both (pycma's ``tell``)."""
    members = list(members)
    if len(members) < 2 or not all(isinstance(m, Member) for m in members):
        kinds = sorted({type(m).__name__ for m in members})
        raise ValueError(f"tell needs the members of ask(): a sequence of at least 2 Member, got {len(members)} "
                         f"of {kinds}.")
    if not isinstance(fitness, torch.Tensor):
        try:
            fitness = torch.as_tensor(fitness)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"fitness must be one real value per member ({len(members)} members), got "
                             f"{fitness!r}: {error}") from error
    if fitness.is_complex() or fitness.dtype == torch.bool:  # real numbers only, as pycma's tell
        raise ValueError(f"fitness must be real numbers, got dtype {fitness.dtype}.")
    if fitness.dim() != 1 or fitness.numel() != len(members):
        raise ValueError(f"fitness has shape {tuple(fitness.shape)} ({fitness.numel()} values) for {len(members)} "
                         f"members: tell needs one value per member of ask(), shape ({len(members)},), fitness[i] "
                         "that of members[i].")
    return fitness


# ------------------------------------------------------------------------------------------------------ the population
def member_seed(base_seed: int, step: int, index: int) -> int:
    """The noise seed of member ``index`` at iteration ``step``: a 31-bit hash of ``(base_seed, step, index)``."""
    # independent of the number of processes: a run is reproducible from base_seed alone
    digest = hashlib.blake2b(f"es-member\x00{base_seed}\x00{step}\x00{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def sample_population(base_seed: int, step: int, population_size: int, antithetic: bool = False) -> list[Member]:
    """The ``population_size`` members of iteration ``step``, antithetic pairs with ``antithetic`` (Salimans et al.
    2017, Sec. 2.1); ``ValueError`` if ``population_size < 2`` or odd with ``antithetic``.
    """
    if population_size < 2:
        raise ValueError(f"population_size must be >= 2, got {population_size}.")
    if antithetic:
        if population_size % 2:
            raise ValueError(f"antithetic=True needs an even population_size, got {population_size}.")
        # members 2k and 2k + 1 share seed k with signs +1, -1
        return [Member(member_seed(base_seed, step, k), sign) for k in range(population_size // 2) for sign in (1, -1)]
    return [Member(member_seed(base_seed, step, i), 1) for i in range(population_size)]


def member_indices(population_size: int, rank: int, world_size: int) -> list[int]:
    """The members a process evaluates: ``i`` with ``i % world_size == rank`` (round robin)."""
    return list(range(rank, population_size, world_size))  # round robin


class PopulationBackend(ABC):
    """How a population's members are drawn and put into the model (never how they are scored)."""

    name = "population"
    stacked = False  # a group of members shares one batched forward (row blocks)

    def __init__(self, perturbation: Perturbation):
        self.perturbation = perturbation  # what eps_i is; es_update_ moves the weights along its direction sums
        self.timings: dict[str, float] = {"perturb": 0.0, "restore": 0.0}  # seconds since reset_timings

    def describe(self) -> dict:
        """JSON-serializable facts about this backend (written into the seed log header for information)."""
        return {"name": self.name}

    def check(self, params: TrainedParameters, model: nn.Module | None = None) -> None:
        """Raise ``ValueError`` before any work if ``params`` cannot be perturbed by this backend."""
        self.perturbation.check(params)

    @staticmethod
    def ask(base_seed: int, step: int, population_size: int, antithetic: bool = False) -> list[Member]:
        """The members of iteration ``step`` (:func:`sample_population`)."""
        return sample_population(base_seed, step, population_size, antithetic)

    def chunks(self, indices: Sequence[int]) -> list[list[int]]:
        """The members ``indices`` in the chunks :meth:`apply` takes (one member a chunk by default)."""
        return [[i] for i in indices]

    def reset_timings(self) -> None:
        """Zero :attr:`timings` (at the start of an iteration)."""
        self.timings = {"perturb": 0.0, "restore": 0.0}

    @contextlib.contextmanager
    def apply(self, params: TrainedParameters, noise: NoiseSource, members: Sequence[Member], sigma: float,
              model: nn.Module | None = None) -> Iterator[None]:
        """Context in which ``model`` computes with ``members`` (one group of :meth:`groups`, in row-block order)
        applied; restored exactly on exit, also on an exception (``KeyboardInterrupt`` included).
        """
        try:  # the finally restores also after a partial apply or a KeyboardInterrupt
            start = time.perf_counter()
            self._apply_members(params, noise, members, sigma, model)
            self.timings["perturb"] += time.perf_counter() - start
            yield
        finally:
            start = time.perf_counter()
            self._restore_members(params)
            self.timings["restore"] += time.perf_counter() - start

    @abstractmethod
    def _apply_members(self, params, noise, members, sigma, model) -> None:
        """Apply ``members`` (see :meth:`apply`)."""

    @abstractmethod
    def _restore_members(self, params) -> None:
        """Undo :meth:`_apply_members` exactly (also after a partial :meth:`_apply_members`)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the backend installed in a model (nothing by default)."""


class SequentialPopulation(PopulationBackend):
    """One member at a time, written into the weights in place and restored bitwise from the master (Qiu et al.
    2025, Algorithm 1).
    """

    name = "sequential"

    def __init__(self):
        super().__init__(GaussianPerturbation())

    def _apply_members(self, params, noise, members, sigma, model):
        if len(members) != 1:
            raise ValueError(f"SequentialPopulation applies one member at a time, got {len(members)}.")
        self.perturbation.perturb_(params, noise, members[0], sigma)

    def _restore_members(self, params):
        params.write_master_to_model_()  # bitwise: the model is exactly as before, also after an exception


class BatchedLowRankPopulation(PopulationBackend):
    """Many members in one batched forward, each a per-row low-rank adapter ``E_i = sign_i (sigma/sqrt(r)) A_i
    B_i^T`` on every trained ``nn.Linear`` weight (EGGROLL, Sarkar et al. 2025, arXiv 2511.16652).

    Raises:
        ValueError: if ``noise_rank < 1`` or ``member_chunk_size < 1``.
    """

    name = "batched_lowrank"
    stacked = True

    def __init__(self, noise_rank: int = 1, member_chunk_size: int | None = None):
        super().__init__(LowRankPerturbation(noise_rank))  # r >= 1, per member and weight
        if member_chunk_size is not None and (isinstance(member_chunk_size, bool) or member_chunk_size < 1):
            raise ValueError(f"member_chunk_size must be None or >= 1, got {member_chunk_size!r}.")
        # members per group (None: all of this process's); the batch is member_chunk_size * prompts * generations
        # rows: lower it to bound activation and KV-cache memory
        self.member_chunk_size = member_chunk_size
        self._adapters: LowRankAdapters | None = None

    @property
    def noise_rank(self) -> int:
        return self.perturbation.rank

    def describe(self) -> dict:
        """``{"name": "batched_lowrank", "noise_rank": r}``."""
        return {"name": self.name, "noise_rank": self.noise_rank}

    def check(self, params: TrainedParameters, model: nn.Module | None = None) -> None:
        """Raise ``ValueError`` if a trained tensor is not (only) an ``nn.Linear`` weight of ``model``."""
        super().check(params)
        if model is not None:
            linear_targets(model, params)

    def chunks(self, indices: Sequence[int]) -> list[list[int]]:
        """``member_chunk_size`` members a chunk (all of them when it is ``None``)."""
        indices = list(indices)
        chunk = self.member_chunk_size or max(1, len(indices))  # None: one chunk of all
        return [indices[lo : lo + chunk] for lo in range(0, len(indices), chunk)]

    def adapters(self, model: nn.Module, params: TrainedParameters) -> LowRankAdapters:
        """The persistent adapters on ``model`` for ``params`` (installed on first use, kept until :meth:`close`).

        Raises:
            ValueError: see :func:`~trl_es.es.perturbation.linear_targets`.
        """
        current = self._adapters
        # installed once and kept: nothing is registered per apply
        if current is None or current.model is not model or current.params is not params:
            self.close()
            self._adapters = LowRankAdapters(model, params, self.perturbation)
        return self._adapters

    def _apply_members(self, params, noise, members, sigma, model):
        if model is None:
            raise ValueError("BatchedLowRankPopulation.apply needs the model (its adapters go on its Linear layers).")
        # member group[k] owns the k-th of len(group) equal row blocks; the weights are never written
        self.adapters(model, params).load_(noise, members, sigma)

    def _restore_members(self, params):
        if self._adapters is not None:  # cleared, not removed: the hooks stay for the next group
            self._adapters.clear_()

    def close(self) -> None:
        """Remove the adapters' hooks from the model."""
        if self._adapters is not None:
            self._adapters.remove()
            self._adapters = None


class WeightsHost(ABC):
    """An engine holding its own copy of the weights that takes full-rank members from their seeds
    (:class:`~trl_es.generation.base.OwnWeightsEngine`).
    """

    name = "weights_host"

    @abstractmethod
    def perturb_(self, member: Member, sigma: float) -> None:
        """Write member ``member`` into the held weights: each trained tensor ``cast(master + sign sigma eps)``,
        bitwise what :class:`SequentialPopulation` writes into the model."""

    @abstractmethod
    def restore_(self) -> None:
        """Hold the current weights again, exactly (after :meth:`perturb_`, also a partial one)."""


class AdapterHost(WeightsHost):
    """A :class:`WeightsHost` that also takes low-rank members as per-row-block adapters (vLLM's multi-LoRA)."""

    @abstractmethod
    def load_adapters_(self, params: TrainedParameters, perturbation: LowRankPerturbation, noise: NoiseSource,
                       members: Sequence[Member], sigma: float) -> None:
        """Load ``members`` as adapters: row block ``k`` of the next ``generate`` calls uses member ``k``'s, until
        :meth:`clear_adapters_`."""

    @abstractmethod
    def clear_adapters_(self) -> None:
        """Remove the loaded adapters (none loaded: nothing)."""


class EngineSequentialPopulation(SequentialPopulation):
    """:class:`SequentialPopulation` written into an engine's own weights (bitwise the same); the model is
    never perturbed.
    """

    def __init__(self, engine: WeightsHost):
        super().__init__()
        self.engine = engine  # the model is never perturbed: a parameter in the master dtype may be its own master

    def describe(self) -> dict:
        """``{"name": "sequential", "engine": <engine name>}``."""
        return {"name": self.name, "engine": self.engine.name}

    def _apply_members(self, params, noise, members, sigma, model):
        if len(members) != 1:
            raise ValueError(f"SequentialPopulation applies one member at a time, got {len(members)}.")
        self.engine.perturb_(members[0], sigma)  # bitwise the weights SequentialPopulation writes into the model

    def _restore_members(self, params):
        self.engine.restore_()  # loads the current weights again


class EngineLowRankPopulation(BatchedLowRankPopulation):
    """:class:`BatchedLowRankPopulation` as an engine's adapters (vLLM multi-LoRA), one per member; row block
    ``k`` of the group's ``generate`` uses adapter ``k``.
    """

    def __init__(self, engine: AdapterHost, noise_rank: int = 1, member_chunk_size: int | None = None):
        super().__init__(noise_rank, member_chunk_size)
        self.engine = engine

    def describe(self) -> dict:
        """``{"name": "batched_lowrank", "noise_rank": r, "engine": <engine name>}``."""
        return {**super().describe(), "engine": self.engine.name}

    def _apply_members(self, params, noise, members, sigma, model):
        self.engine.load_adapters_(params, self.perturbation, noise, members, sigma)

    def _restore_members(self, params):
        self.engine.clear_adapters_()

    def close(self) -> None:
        self.engine.clear_adapters_()


def on_engine(backend: PopulationBackend, engine) -> PopulationBackend:
    """``backend`` applied inside ``engine`` when it is a :class:`WeightsHost`, else ``backend`` itself.

    Raises:
        ValueError: for low-rank members and an engine that is no :class:`AdapterHost`, or another backend.
    """
    if not isinstance(engine, WeightsHost):  # the engine runs the model itself
        return backend
    if isinstance(backend, BatchedLowRankPopulation):
        if not isinstance(engine, AdapterHost):
            raise ValueError(f"The {engine.name!r} engine takes full-rank members only: use "
                             "population_backend='sequential'.")
        return EngineLowRankPopulation(engine, backend.noise_rank, backend.member_chunk_size)
    if isinstance(backend, SequentialPopulation):
        return EngineSequentialPopulation(engine)
    raise ValueError(f"Population backend {backend.name!r} cannot run inside a generation engine.")


POPULATION_BACKENDS: dict[str, type[PopulationBackend]] = {
    "sequential": SequentialPopulation,
    "batched_lowrank": BatchedLowRankPopulation,
}
"""Registered backends: name -> class."""


def make_population_backend(name: str, **kwargs) -> PopulationBackend:
    """Build a registered backend by name (``ESConfig.population_backend``).

    Raises:
        ValueError: for an unknown name, listing the registered ones.
    """
    if name not in POPULATION_BACKENDS:
        raise ValueError(f"population_backend must be one of {tuple(POPULATION_BACKENDS)}, got {name!r}.")
    return POPULATION_BACKENDS[name](**kwargs)
