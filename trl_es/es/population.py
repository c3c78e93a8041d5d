"""Population sampling and evaluation.

In the spirit of pycma's ask/tell, this module never decides what a member's fitness *is*: the caller passes a
``rollout`` that scores the model as it currently is (generation + rewards). A population backend only decides how
members are put into the model. The sequential backend below perturbs the weights in place, one member at a time,
and restores them bitwise, also when the rollout raises (``KeyboardInterrupt`` included).
"""

from __future__ import annotations

import hashlib
import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from .noise import NoiseSource
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
    """How a population is put into the model, scored, and turned into an update.

    A backend defines the perturbation ``eps_i`` of a member, so it also owns the update that moves the weights
    along ``sum_i z_i eps_i`` (:meth:`update_`, :meth:`gradient_`). The default (full-rank Gaussian noise) delegates
    to :class:`TrainedParameters`. ``name`` is recorded in the seed log so ``replay`` applies the same update.

    Attributes:
        timings (`dict[str, float]`): Seconds spent in the last :meth:`evaluate` outside the rollout
            (``"perturb"``, ``"restore"``).
    """

    name = "sequential"

    def __init__(self):
        self.timings: dict[str, float] = {}

    def describe(self) -> dict:
        """JSON-serializable facts needed to replay this backend's updates (written into the seed log header)."""
        return {"name": self.name}

    def update_(self, params: TrainedParameters, noise: NoiseSource, members, coefficients, learning_rate) -> None:
        """``theta <- theta + alpha / N * sum_i z_i eps_i`` in fp32 (see :meth:`TrainedParameters.es_update_`)."""
        params.es_update_(noise, members, coefficients, learning_rate)

    def gradient_(self, params: TrainedParameters, noise: NoiseSource, members, coefficients) -> None:
        """Store ``-(1/N) sum_i z_i eps_i`` in the masters' ``.grad`` (see :meth:`TrainedParameters.es_gradient_`)."""
        params.es_gradient_(noise, members, coefficients)

    @abstractmethod
    def evaluate(
        self,
        params: TrainedParameters,
        noise: NoiseSource,
        members: Sequence[Member],
        indices: Sequence[int],
        sigma: float,
        rollout: Callable[[int], float],
    ) -> dict[int, float]:
        """Score the members ``members[i]`` for ``i`` in ``indices``.

        Args:
            params (`TrainedParameters`): The trained parameters (with their master copy).
            noise (`NoiseSource`): The noise source.
            members (`Sequence[Member]`): The whole population of this iteration.
            indices (`Sequence[int]`): The members this process evaluates.
            sigma (`float`): Noise scale.
            rollout (`Callable[[int], float]`): Scores the model in its current state; receives the member index.
                It also has ``rollout.stacked(indices) -> dict[int, float]``: one generate call over the prompt batch
                repeated once per listed member (member ``indices[k]`` owns rows ``[k * B, (k + 1) * B)``), for
                backends that apply a different perturbation to each block of rows.

        Returns:
            `dict[int, float]`: Fitness by member index.
        """


class SequentialPopulation(PopulationBackend):
    """Evaluate members one after another by perturbing the weights in place (Qiu et al. 2025, Algorithm 1).

    The weights are restored bitwise from the master copy after each member, in a ``finally`` block: an exception
    in the rollout (reward function, generation, ``KeyboardInterrupt``) leaves the model exactly as before.
    """

    def evaluate(self, params, noise, members, indices, sigma, rollout):
        self.timings = {"perturb": 0.0, "restore": 0.0}
        fitness = {}
        for i in indices:
            try:
                start = time.perf_counter()
                params.perturb_(noise, members[i], sigma)
                self.timings["perturb"] += time.perf_counter() - start
                fitness[i] = rollout(i)
            finally:
                start = time.perf_counter()
                params.restore_()
                self.timings["restore"] += time.perf_counter() - start
        return fitness


POPULATION_BACKENDS: dict[str, str] = {
    "sequential": "trl_es.es.population:SequentialPopulation",
    "batched_lowrank": "trl_es.es.lowrank:BatchedLowRankPopulation",
}
"""Registered backends: name -> ``module:class`` (imported when first used)."""


def make_population_backend(name: str, **kwargs) -> PopulationBackend:
    """Build a registered backend by name (``ESConfig.population_backend``).

    Raises:
        ValueError: for an unknown name, listing the registered ones.
    """
    if name not in POPULATION_BACKENDS:
        raise ValueError(f"population_backend must be one of {tuple(POPULATION_BACKENDS)}, got {name!r}.")
    module_name, class_name = POPULATION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)(**kwargs)
