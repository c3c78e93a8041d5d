"""Population backends: how the members of an ES iteration are drawn and put into the model; the strategy object
(:class:`~trl_es.es.strategy.EvolutionStrategy`) holds one, and the loop that owns it scores the members (pycma's
``ask()``/``tell()``: the strategy never evaluates).

- :meth:`PopulationBackend.ask` draws the iteration's members (seeds and signs: :func:`sample_population`);
- :meth:`PopulationBackend.groups` says which members are applied together;
- :meth:`PopulationBackend.apply` is a context manager: on entry the group's members are put into the model, on exit
  the model is restored exactly, also when the body raises (``KeyboardInterrupt`` included).

Two backends, each also inside a generation engine with its own weights (:func:`on_engine`: a :class:`WeightsHost`,
such as the vLLM engines):

- :class:`SequentialPopulation`: one full-rank Gaussian member at a time, written into the weights in place
  (Qiu et al. 2025, arXiv 2509.24372, Algorithm 1) and restored bitwise from the master copy;
- :class:`BatchedLowRankPopulation`: groups of rank-``r`` members as per-row adapters, all of a group in one batched
  forward: member ``group[k]`` owns the ``k``-th of ``len(group)`` equal blocks of rows (EGGROLL, arXiv
  2511.16652); the weights are never written.

The update (:meth:`EvolutionStrategy.tell <trl_es.es.strategy.EvolutionStrategy.tell>`) is
:func:`trl_es.es.update.es_update_` / :func:`~trl_es.es.update.es_gradient_`, one function for every perturbation.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from torch import nn

from .noise import NoiseSource
from .perturbation import GaussianPerturbation, LowRankAdapters, LowRankPerturbation, Perturbation, linear_targets
from .update import Member, TrainedParameters


def member_seed(base_seed: int, step: int, index: int) -> int:
    """The noise seed of member ``index`` at iteration ``step``: a 31-bit hash of ``(base_seed, step, index)``.

    Independent of the number of processes, so a run is reproducible from ``base_seed`` alone.
    """
    digest = hashlib.blake2b(f"es-member\x00{base_seed}\x00{step}\x00{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def sample_population(base_seed: int, step: int, population_size: int, antithetic: bool = False) -> list[Member]:
    """Draw the ``population_size`` members of iteration ``step``.

    With ``antithetic=True`` (mirrored sampling, Salimans et al. 2017, Sec. 2.1) members ``2k`` and ``2k + 1``
    share one seed with signs ``+1`` and ``-1``.

    Raises:
        ValueError: if ``population_size < 2`` or it is odd with ``antithetic=True``.
    """
    if population_size < 2:
        raise ValueError(f"population_size must be >= 2, got {population_size}.")
    if antithetic:
        if population_size % 2:
            raise ValueError(f"antithetic=True needs an even population_size, got {population_size}.")
        return [Member(member_seed(base_seed, step, k), sign) for k in range(population_size // 2) for sign in (1, -1)]
    return [Member(member_seed(base_seed, step, i), 1) for i in range(population_size)]


def member_indices(population_size: int, rank: int, world_size: int) -> list[int]:
    """The members a process evaluates: ``i`` with ``i % world_size == rank`` (round robin)."""
    return list(range(rank, population_size, world_size))


class PopulationBackend(ABC):
    """How a population's members are drawn and put into the model (never how they are scored).

    Attributes:
        perturbation (`Perturbation`): What ``eps_i`` is; the ES step (:func:`trl_es.es.update.es_update_`) moves
            the weights along its direction sums.
        stacked (`bool`): Whether a group of members shares one batched forward (row blocks), rather than one member
            at a time.
        timings (`dict[str, float]`): Seconds spent putting members in (``"perturb"``) and taking them out
            (``"restore"``) since the last :meth:`reset_timings`.
    """

    name = "population"
    stacked = False

    def __init__(self, perturbation: Perturbation):
        self.perturbation = perturbation
        self.timings: dict[str, float] = {"perturb": 0.0, "restore": 0.0}

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

    def groups(self, indices: Sequence[int]) -> list[list[int]]:
        """The members ``indices`` in the groups :meth:`apply` takes (one member a group by default)."""
        return [[i] for i in indices]

    def reset_timings(self) -> None:
        """Zero :attr:`timings` (at the start of an iteration)."""
        self.timings = {"perturb": 0.0, "restore": 0.0}

    @contextlib.contextmanager
    def apply(self, params: TrainedParameters, noise: NoiseSource, members: Sequence[Member], sigma: float,
              model: nn.Module | None = None) -> Iterator[None]:
        """Context in which ``model`` computes with ``members`` applied; restored exactly on exit, also on an
        exception (``KeyboardInterrupt`` included).

        Args:
            params (`TrainedParameters`): The trained parameters (with their master copy).
            noise (`NoiseSource`): The noise source.
            members (`Sequence[Member]`): One group of :meth:`groups` (the members themselves, in row-block order).
            sigma (`float`): The noise scale.
            model (`nn.Module`, *optional*): The model (backends with per-row adapters install them on it).
        """
        try:
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
    """One member at a time, its perturbation written into the weights in place (Qiu et al. 2025, Algorithm 1).

    The weights are restored bitwise from the master copy when :meth:`apply` exits, also on an exception
    (reward function, generation, ``KeyboardInterrupt``): the model is then exactly as before.
    """

    name = "sequential"

    def __init__(self):
        super().__init__(GaussianPerturbation())

    def _apply_members(self, params, noise, members, sigma, model):
        if len(members) != 1:
            raise ValueError(f"SequentialPopulation applies one member at a time, got {len(members)}.")
        self.perturbation.perturb_(params, noise, members[0], sigma)

    def _restore_members(self, params):
        params.write_master_to_model_()


class BatchedLowRankPopulation(PopulationBackend):
    """Many members in one batched forward, each as a per-row low-rank adapter (EGGROLL).

    Member ``i`` perturbs every trained weight ``W`` (``out x in``) by ``E_i = sign_i (sigma/sqrt(r)) A_i B_i^T``
    (Sarkar et al. 2025, arXiv 2511.16652). On the first :meth:`apply` the backend installs persistent
    :class:`~trl_es.es.perturbation.LowRankAdapters` on the targeted ``nn.Linear`` modules of the model (nothing is
    registered per call after that); :meth:`apply` loads a group's factors and clears the adapters on exit (an
    exception, ``KeyboardInterrupt`` included, leaves the model unperturbed). The weights are never modified, so an
    fp32 model needs no master copy with this backend.

    Row map: inside ``apply(..., members=group)`` member ``group[k]`` owns the ``k``-th of ``len(group)`` equal
    blocks of rows of every batch (see :class:`~trl_es.es.perturbation.LowRankAdapters`).

    Trained parameters: every one must be the weight of ``nn.Linear`` modules and of nothing else; otherwise
    :meth:`check` (and the first :meth:`apply`) raises ``ValueError`` naming them
    (:func:`~trl_es.es.perturbation.linear_weight_names` gives the default selection).

    Args:
        noise_rank (`int`): ``r >= 1``, the rank of each member's perturbation of each weight.
        member_chunk_size (`int` or `None`): Members per group (``None``: all members of this process in one group).
            The batch is ``member_chunk_size * len(prompts) * num_generations`` rows; lower it to bound activation and
            KV-cache memory.

    Raises:
        ValueError: if ``noise_rank < 1`` or ``member_chunk_size < 1``.
    """

    name = "batched_lowrank"
    stacked = True

    def __init__(self, noise_rank: int = 1, member_chunk_size: int | None = None):
        super().__init__(LowRankPerturbation(noise_rank))
        if member_chunk_size is not None and (isinstance(member_chunk_size, bool) or member_chunk_size < 1):
            raise ValueError(f"member_chunk_size must be None or >= 1, got {member_chunk_size!r}.")
        self.member_chunk_size = member_chunk_size
        self._adapters: LowRankAdapters | None = None

    @property
    def noise_rank(self) -> int:
        return self.perturbation.rank

    def describe(self) -> dict:
        """``{"name": "batched_lowrank", "noise_rank": r}``."""
        return {"name": self.name, "noise_rank": self.noise_rank}

    def check(self, params: TrainedParameters, model: nn.Module | None = None) -> None:
        """Raise ``ValueError`` if a trained tensor is not (only) an ``nn.Linear`` weight of ``model`` (nothing is
        installed: the adapters come with the first :meth:`apply`)."""
        super().check(params)
        if model is not None:
            linear_targets(model, params)

    def groups(self, indices: Sequence[int]) -> list[list[int]]:
        """``member_chunk_size`` members a group (all of them when it is ``None``)."""
        indices = list(indices)
        chunk = self.member_chunk_size or max(1, len(indices))
        return [indices[lo : lo + chunk] for lo in range(0, len(indices), chunk)]

    def adapters(self, model: nn.Module, params: TrainedParameters) -> LowRankAdapters:
        """The persistent adapters on ``model`` for ``params`` (installed on first use, kept until :meth:`close`).

        Raises:
            ValueError: see :func:`~trl_es.es.perturbation.linear_targets`.
        """
        current = self._adapters
        if current is None or current.model is not model or current.params is not params:
            self.close()
            self._adapters = LowRankAdapters(model, params, self.perturbation)
        return self._adapters

    def _apply_members(self, params, noise, members, sigma, model):
        if model is None:
            raise ValueError("BatchedLowRankPopulation.apply needs the model (its adapters go on its Linear layers).")
        self.adapters(model, params).load_(noise, members, sigma)

    def _restore_members(self, params):
        if self._adapters is not None:
            self._adapters.clear_()

    def close(self) -> None:
        """Remove the adapters' hooks from the model."""
        if self._adapters is not None:
            self._adapters.remove()
            self._adapters = None


class WeightsHost(ABC):
    """Holds its own copy of the weights, and takes full-rank members into it from their seeds (a generation engine
    such as vLLM's: :class:`~trl_es.generation.base.OwnWeightsEngine`); :func:`on_engine` puts a population there."""

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
    """:class:`SequentialPopulation` applied inside an engine that holds its own copy of the weights: each member is
    written into the *engine's* weights from its seed (bitwise the weights :class:`SequentialPopulation` writes into
    the model), and restored by loading the current weights again. The model itself is never perturbed, so a
    parameter in the master dtype may be its own master.
    """

    def __init__(self, engine: WeightsHost):
        super().__init__()
        self.engine = engine

    def describe(self) -> dict:
        """``{"name": "sequential", "engine": <engine name>}``."""
        return {"name": self.name, "engine": self.engine.name}

    def _apply_members(self, params, noise, members, sigma, model):
        if len(members) != 1:
            raise ValueError(f"SequentialPopulation applies one member at a time, got {len(members)}.")
        self.engine.perturb_(members[0], sigma)

    def _restore_members(self, params):
        self.engine.restore_()


class EngineLowRankPopulation(BatchedLowRankPopulation):
    """:class:`BatchedLowRankPopulation` whose members are adapters of an engine (vLLM multi-LoRA, as the EGGROLL
    authors run it): a group's members are loaded as one LoRA adapter each
    (:func:`~trl_es.es.perturbation.lowrank_lora_factors`), row block ``k`` of the group's ``generate`` call uses
    adapter ``k``; the weights are never written. Exit removes the adapters, also on an exception.

    Args:
        noise_rank (`int`), member_chunk_size (`int` or `None`): As in :class:`BatchedLowRankPopulation`.
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
    """The population of ``backend`` applied where ``engine`` computes: inside it for a :class:`WeightsHost` (a
    :class:`SequentialPopulation` becomes an :class:`EngineSequentialPopulation`, a
    :class:`BatchedLowRankPopulation` an :class:`EngineLowRankPopulation` with its rank and chunk size), else
    ``backend`` itself (the engine runs the model).

    Raises:
        ValueError: for low-rank members and an engine that is no :class:`AdapterHost`, or another backend.
    """
    if not isinstance(engine, WeightsHost):
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
