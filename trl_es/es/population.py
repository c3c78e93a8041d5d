"""Population sampling and evaluation (evaluation only: the update lives in :mod:`trl_es.es.update`).

In the spirit of pycma's ask/tell, this module never decides what a member's fitness *is*: the caller passes a
:class:`Rollout` that scores the model as it currently is (generation + rewards) and *returns* a
:class:`MemberResult`. A population backend only decides how members are put into the model:

- :class:`SequentialPopulation`: full-rank Gaussian members written into the weights in place, one member at a
  time, restored bitwise also when the rollout raises (``KeyboardInterrupt`` included);
- :class:`BatchedLowRankPopulation`: rank-``r`` members as per-row adapters, many members in one batched call of
  :meth:`Rollout.stacked` (EGGROLL, arXiv 2511.16652); the weights are never written.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

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


@dataclass
class MemberResult:
    """What a rollout returns for one member.

    Attributes:
        fitness (`float`): The member's fitness (NaN if nothing could be scored).
        details (`dict`): Anything else the caller wants back (completions, per-function rewards, timings...).
    """

    fitness: float
    details: dict = field(default_factory=dict)


class Rollout(ABC):
    """Scores the model as it currently is: the one thing a population backend asks of its caller.

    Attributes:
        model (`nn.Module` or `None`): The model being scored; backends that install per-row adapters (batched
            low-rank) find the targeted modules here.
    """

    model: nn.Module | None = None

    @abstractmethod
    def member(self, index: int) -> MemberResult:
        """Score the model as it is now for member ``index`` (its perturbation is already in the weights)."""

    def stacked(self, indices: Sequence[int]) -> dict[int, MemberResult]:
        """Score ``len(indices)`` members in one batched call: the prompt batch is repeated once per member and
        member ``indices[k]`` owns the ``k``-th block of rows (its perturbation applies to those rows only).

        Raises:
            NotImplementedError: if this rollout cannot stack members (the batched low-rank backend needs it).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot score stacked members (no stacked()).")


class PopulationBackend(ABC):
    """How a population is put into the model and scored (evaluation only).

    Attributes:
        perturbation (`Perturbation`): What ``eps_i`` is; the ES step (:func:`trl_es.es.update.es_update_`) moves
            the weights along its direction sums.
        timings (`dict[str, float]`): Seconds spent in the last :meth:`evaluate` outside the rollout
            (``"perturb"``, ``"restore"``).
    """

    name = "population"

    def __init__(self, perturbation: Perturbation):
        self.perturbation = perturbation
        self.timings: dict[str, float] = {}

    def describe(self) -> dict:
        """JSON-serializable facts about this backend (written into the seed log header for information)."""
        return {"name": self.name}

    def check(self, params: TrainedParameters, model: nn.Module | None = None) -> None:
        """Raise ``ValueError`` before any work if ``params`` cannot be evaluated by this backend."""
        self.perturbation.check(params)

    @abstractmethod
    def evaluate(
        self,
        params: TrainedParameters,
        noise: NoiseSource,
        members: Sequence[Member],
        indices: Sequence[int],
        sigma: float,
        rollout: Rollout,
    ) -> dict[int, MemberResult]:
        """Score the members ``members[i]`` for ``i`` in ``indices``.

        Args:
            params (`TrainedParameters`): The trained parameters (with their master copy).
            noise (`NoiseSource`): The noise source.
            members (`Sequence[Member]`): The whole population of this iteration.
            indices (`Sequence[int]`): The members this process evaluates.
            sigma (`float`): Noise scale.
            rollout (`Rollout`): Scores the model in its current state.

        Returns:
            `dict[int, MemberResult]`: The rollout's result for every index.
        """

    def close(self) -> None:
        """Release what the backend installed in a model (nothing by default)."""


class SequentialPopulation(PopulationBackend):
    """Evaluate members one after another by perturbing the weights in place (Qiu et al. 2025, Algorithm 1).

    The weights are restored bitwise from the master copy after each member, in a ``finally`` block: an exception
    in the rollout (reward function, generation, ``KeyboardInterrupt``) leaves the model exactly as before.
    """

    name = "sequential"

    def __init__(self):
        super().__init__(GaussianPerturbation())

    def evaluate(self, params, noise, members, indices, sigma, rollout):
        self.timings = {"perturb": 0.0, "restore": 0.0}
        results = {}
        for i in indices:
            try:
                start = time.perf_counter()
                self.perturbation.perturb_(params, noise, members[i], sigma)
                self.timings["perturb"] += time.perf_counter() - start
                results[i] = rollout.member(i)
            finally:
                start = time.perf_counter()
                self.perturbation.restore_(params)
                self.timings["restore"] += time.perf_counter() - start
        return results


class BatchedLowRankPopulation(PopulationBackend):
    """Evaluate many members in one batched call with per-row low-rank perturbations (EGGROLL).

    Member ``i`` perturbs every trained weight ``W`` (``out x in``) by ``E_i = sign_i (sigma/sqrt(r)) A_i B_i^T``
    (Sarkar et al. 2025, arXiv 2511.16652). On the first :meth:`evaluate` the backend installs persistent
    :class:`~trl_es.es.perturbation.LowRankAdapters` on the targeted ``nn.Linear`` modules of ``rollout.model``
    (nothing is registered per call after that); for each chunk of ``member_chunk_size`` members it loads their
    factors, calls ``rollout.stacked(chunk)`` once, and clears the adapters in a ``finally`` block (an exception,
    ``KeyboardInterrupt`` included, leaves the model unperturbed). The weights are never modified, so an fp32 model
    needs no master copy with this backend.

    Row map: in ``rollout.stacked(indices)`` member ``indices[k]`` owns the ``k``-th of ``len(indices)`` equal
    blocks of rows of every batch (see :class:`~trl_es.es.perturbation.LowRankAdapters`).

    Trained parameters: every one must be the weight of ``nn.Linear`` modules and of nothing else; otherwise
    :meth:`check` (and the first :meth:`evaluate`) raises ``ValueError`` naming them
    (:func:`~trl_es.es.perturbation.linear_weight_names` gives the default selection).

    Args:
        noise_rank (`int`): ``r >= 1``, the rank of each member's perturbation of each weight.
        member_chunk_size (`int` or `None`): Members per stacked call (``None``: all members of this process in one
            call). The batch is ``member_chunk_size * len(prompts) * num_generations`` rows; lower it to bound
            activation and KV-cache memory.

    Raises:
        ValueError: if ``noise_rank < 1`` or ``member_chunk_size < 1``.
    """

    name = "batched_lowrank"

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
        installed: the adapters come with the first :meth:`evaluate`)."""
        super().check(params)
        if model is not None:
            linear_targets(model, params)

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

    def evaluate(self, params, noise, members, indices, sigma, rollout):
        """Score members ``indices`` with ``rollout.stacked``, ``member_chunk_size`` members per call (see class doc).

        ``timings["perturb"]`` is the time spent building and loading factors, ``timings["restore"]`` the time
        spent clearing the adapters.

        Raises:
            ValueError: if ``rollout.model`` is ``None`` or the trained parameters are not all Linear weights.
        """
        self.timings = {"perturb": 0.0, "restore": 0.0}
        model = getattr(rollout, "model", None)
        if model is None:
            raise ValueError("BatchedLowRankPopulation needs the model: give the rollout a `.model` attribute "
                             "(ESTrainer's rollout has one).")
        adapters = self.adapters(model, params)
        indices = list(indices)
        chunk = self.member_chunk_size or max(1, len(indices))
        results: dict[int, MemberResult] = {}
        for lo in range(0, len(indices), chunk):
            part = indices[lo : lo + chunk]
            try:
                start = time.perf_counter()
                adapters.load_(noise, [members[i] for i in part], sigma)
                self.timings["perturb"] += time.perf_counter() - start
                results.update(rollout.stacked(part))
            finally:
                start = time.perf_counter()
                adapters.clear_()
                self.timings["restore"] += time.perf_counter() - start
        return results

    def close(self) -> None:
        """Remove the adapters' hooks from the model."""
        if self._adapters is not None:
            self._adapters.remove()
            self._adapters = None


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
