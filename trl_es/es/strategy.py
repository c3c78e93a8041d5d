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
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .anchor import make_anchor
from .noise import DEFAULT_TABLE_SIZE, NoiseSource, make_noise_source
from .perturbation import LowRankPerturbation
from .population import PopulationBackend, SequentialPopulation, sample_population
from .shaping import shape_fitness
from .update import Member, TrainedParameters, es_gradient_, es_update_, select_parameters


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
