"""Population backends: how the members of an ES iteration are drawn and put into the model.

:class:`SequentialPopulation` writes one full-rank member into the weights in place (Qiu et al. 2025, arXiv
2509.24372, Algorithm 1); :class:`BatchedLowRankPopulation` applies a group of rank-``r`` members as per-row
adapters in one batched forward (EGGROLL, arXiv 2511.16652). :func:`on_engine` runs either inside a generation
engine that holds its own weights (:class:`WeightsHost`). The strategy never scores members (pycma's ask/tell).
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
