"""OpenAI-ES as one ask/tell object on any ``nn.Module`` (Qiu et al. 2025, arXiv 2509.24372, Algorithm 1).

The loop owns evaluation, as with pycma's ``CMAEvolutionStrategy`` (and :class:`~trl_es.es.cma_search.CMASearch`):

    strategy = EvolutionStrategy.for_module(model, sigma=0.01, population_size=8)
    for step in range(steps):
        members = strategy.ask(step)
        fitness = []
        for group in strategy.groups(range(len(members))):
            with strategy.apply([members[i] for i in group], model):  # restored bitwise on leaving, also on errors
                fitness += score(model)
        strategy.tell(members, torch.tensor(fitness), learning_rate=5e-4)

Nothing here imports TRL or ``transformers``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .noise import NoiseSource, make_noise_source
from .population import PopulationBackend, SequentialPopulation, sample_population
from .shaping import shape_fitness
from .update import Member, TrainedParameters, es_gradient_, es_update_, select_parameters


@dataclass
class Told:
    """What :meth:`EvolutionStrategy.tell` did (what the seed log records for the iteration).

    Attributes:
        coefficients (`list[float]`): The shaped fitness ``z_i``, one per member.
        learning_rate (`float`): ``alpha`` of the step.
        shrink (`float`): ``alpha * awd_lambda`` of Anchored Weight Decay (0 without AWD).
    """

    coefficients: list[float]
    learning_rate: float
    shrink: float


class EvolutionStrategy:
    """The ES state of one run (trained tensors with their fp32 master, noise, population, sigma) and its
    ask / groups / apply / tell.

    Args:
        params (`TrainedParameters`): The trained tensors and their master copy.
        noise (`NoiseSource`): Where ``eps(seed)`` comes from.
        population (`PopulationBackend`): How members are put into the model (in place, or as low-rank adapters).
        sigma (`float`): The noise scale.
        population_size (`int`): ``N``, members per iteration (>= 2; even with ``antithetic``).
        seed (`int`): Base seed of the members' noise seeds.
        antithetic (`bool`): Mirrored pairs ``+eps, -eps`` (Salimans et al. 2017, Sec. 2.1).
        fitness_shaping (`str`): ``"zscore"``, ``"centered_rank"`` or ``"none"`` (:func:`shape_fitness`).
        awd_lambda (`float`): Anchored Weight Decay after each step (arXiv 2605.30148, Algorithm 1); 0: off.
        awd_penalty (`str`): ``"l2"`` or ``"l1"``.
        anchor (`Mapping[str, torch.Tensor]`, *optional*): theta_0 of the trained tensors (needed for AWD).

    """

    def __init__(self, params: TrainedParameters, noise: NoiseSource, population: PopulationBackend, sigma: float,
                 population_size: int, seed: int = 0, antithetic: bool = False, fitness_shaping: str = "zscore",
                 awd_lambda: float = 0.0, awd_penalty: str = "l2", anchor: Mapping[str, torch.Tensor] | None = None):
        self.params, self.noise, self.population = params, noise, population
        self.sigma, self.population_size, self.seed, self.antithetic = sigma, population_size, seed, antithetic
        self.fitness_shaping, self.awd_lambda, self.awd_penalty = fitness_shaping, awd_lambda, awd_penalty
        self.anchor = anchor

    @classmethod
    def for_module(cls, model: nn.Module, sigma: float, population_size: int, include: str | None = None,
                   noise_source: str = "gaussian", **kwargs) -> EvolutionStrategy:
        """A sequential (in-place, full-rank) strategy on ``model``'s trainable tensors with an fp32 master; with
        ``awd_lambda > 0`` the anchor is the master at construction. ``kwargs`` go to the constructor."""
        params = TrainedParameters(select_parameters(model, include), torch.float32)
        if kwargs.get("awd_lambda", 0) > 0 and kwargs.get("anchor") is None:
            kwargs["anchor"] = {n: t.clone() for n, t in params.master_state_dict().items()}
        return cls(params, make_noise_source(0, noise_source), SequentialPopulation(), sigma, population_size,
                   **kwargs)

    @property
    def perturbation(self):
        return self.population.perturbation

    def ask(self, step: int) -> list[Member]:
        """The ``population_size`` members of iteration ``step`` (seeds and signs: :func:`sample_population`);
        the same on every process."""
        return sample_population(self.seed, step, self.population_size, self.antithetic)

    def groups(self, indices: Sequence[int]) -> list[list[int]]:
        """The member indices in the groups :meth:`apply` takes (one a group, or ``member_chunk_size`` stacked)."""
        return self.population.groups(indices)

    @contextlib.contextmanager
    def apply(self, members: Sequence[Member], model: nn.Module | None = None) -> Iterator[None]:
        """Context in which ``model`` computes with ``members`` applied (one group of :meth:`groups`; stacked
        members own equal row blocks, in order); the weights are restored exactly on exit, also on an exception."""
        with self.population.apply(self.params, self.noise, members, self.sigma, model):
            yield

    def tell(self, members: Sequence[Member], fitness: torch.Tensor, learning_rate: float,
             optimizer_step: Callable[[], None] | None = None) -> Told:
        """Move the weights for one iteration: shape the fitness, step, decay toward the anchor, render.

        Without ``optimizer_step``: the ES step ``theta <- theta + alpha / N * sum_i z_i eps_i`` in fp32 into the
        master (:func:`es_update_`). With it: the ES gradient ``-(1/N) sum_i z_i eps_i`` goes to ``master.grad``
        (:func:`es_gradient_`), ``optimizer_step()`` steps a torch optimizer owning the masters, and the gradients
        are cleared. Then AWD (``awd_lambda > 0``) and the render of the master into the model.

        Args:
            members (`Sequence[Member]`): The ``N`` members of :meth:`ask`.
            fitness (`torch.Tensor`): Shape ``(N,)``, float; NaN for an invalid member (ranked worst).
            learning_rate (`float`): ``alpha``.
            optimizer_step (`Callable[[], None]`, *optional*): Clips and steps a torch optimizer.

        Returns:
            `Told`: the coefficients, ``alpha`` and the AWD shrink, as the seed log records them.

        Raises:
            ValueError: for a bad fitness shape or shaping name, or ``awd_lambda > 0`` without an anchor (raised
                before the weights change).
        """
        if self.awd_lambda > 0 and self.anchor is None:
            raise ValueError("awd_lambda > 0 needs an anchor (theta_0 of the trained tensors).")
        coefficients = shape_fitness(fitness, self.fitness_shaping).tolist()
        if optimizer_step is None:
            es_update_(self.params, self.perturbation, self.noise, members, coefficients, learning_rate)  # renders
        else:
            es_gradient_(self.params, self.perturbation, self.noise, members, coefficients)
            optimizer_step()
            for master in self.params.master_parameters():
                master.grad = None  # stepped: a later optimizer.step() finds nothing to do
        shrink = 0.0
        if self.awd_lambda > 0:
            shrink = learning_rate * self.awd_lambda
            self.params.anchored_weight_decay_(self.anchor, shrink, self.awd_penalty)  # renders
        elif optimizer_step is not None:
            self.params.render_()
        return Told(coefficients, learning_rate, shrink)
