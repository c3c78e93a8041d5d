"""CMA-ES (Hansen 2016, "The CMA Evolution Strategy: A Tutorial") in the unit box, maximizing: a thin layer over
pycma's ``cma.CMAEvolutionStrategy`` ask/tell with a private, checkpointable RNG, a record of the best candidates and,
optionally, pycma's uncertainty handling (``cma.NoiseHandler``, Hansen et al. 2009, "A Method for Handling
Uncertainty in Evolutionary Optimization", IEEE TEC 13(1)).

Used by Hyper-ES (:class:`trl_es.trainer.hyper_es.hyper_es_trainer.HyperESTrainer`) to search DARE-TIES merge
coefficients, but it knows nothing of models: it asks for vectors in ``[0, 1]^n`` and is told one fitness per vector.
Nothing here imports TRL or ``transformers.Trainer``; pycma is imported when a search is built.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import numpy as np


__all__ = ["CMASearch", "stand_in_fitness"]


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
        noise_max_evaluations (`int`, *optional*): If set, noise handling is on: a ``cma.NoiseHandler(n, maxevals=[1,
            1, noise_max_evaluations], aggregate=np.mean, reevals=noise_reevals, epsilon=0)``. After each
            :meth:`tell` given a ``reevaluate`` callable, it re-evaluates a few candidates (pycma's choice: the first
            ones and the best of the rest), measures how much their ranks change (``noise_s`` > 0: the noise hides the
            ranking), and then raises sigma by pycma's factor and :attr:`evaluations`, the number of evaluations the
            caller should average for each fitness of the next generation (down again, to 1, when the ranking holds).
            As in pycma's ``fmin(..., noise_handler=...)``; ``tolfacupx`` is disabled as there.
        noise_reevals (`float`, *optional*): Candidates re-evaluated per generation (pycma's ``reevals``; `None`:
            pycma's ``2 + popsize / 20``).
    """

    def __init__(
        self,
        x0: np.ndarray,
        sigma0: float,
        popsize: int | None = None,
        seed: int = 0,
        options: dict | None = None,
        top_k: int = 5,
        noise_max_evaluations: int | None = None,
        noise_reevals: float | None = None,
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
        if noise_max_evaluations is not None:
            opts["tolfacupx"] = math.inf  # as fmin with a noise handler: sigma may grow on purpose
        opts.update(options or {})
        with self._numpy_rng():
            self.es = cma.CMAEvolutionStrategy(np.asarray(x0, dtype=np.float64), float(sigma0), opts)
        self.noise_handler = (
            cma.NoiseHandler(
                len(x0), maxevals=[1, 1, int(noise_max_evaluations)], aggregate=np.mean, reevals=noise_reevals,
                epsilon=0.0,  # re-evaluate the candidate itself, not a perturbed copy
            )
            if noise_max_evaluations is not None
            else None
        )
        self.best_x: np.ndarray | None = None
        self.best_fitness = -math.inf
        self.best_tag = None
        self.top_k = int(top_k)
        self.top: list[tuple[float, np.ndarray, object]] = []  # (fitness, x, tag), highest first
        self.num_told = 0  # candidates told
        self.num_finite = 0  # ... of which had a finite fitness
        self.num_reevaluated = 0  # candidates re-evaluated by the noise handler

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
    def evaluations(self) -> int:
        """How many evaluations to average per fitness this generation (pycma ``NoiseHandler.evaluations``; 1
        without noise handling)."""
        handler = getattr(self, "noise_handler", None)  # None in searches pickled before noise handling existed
        return int(handler.evaluations) if handler is not None else 1

    @property
    def noise_s(self) -> float | None:
        """pycma's noise measure ``noiseS`` (> 0: the noise changes the ranking); `None` without noise handling."""
        handler = getattr(self, "noise_handler", None)
        return float(handler.noiseS) if handler is not None else None

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
        reevaluate: Callable[[np.ndarray], float] | None = None,
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
            reevaluate (`Callable[[np.ndarray], float]`, *optional*): With noise handling: a fresh fitness (to
                maximize) of one of ``xs``, measured independently of ``fitness`` (e.g. on other rows) and averaged
                over :attr:`evaluations` evaluations, as its ``fitness`` was; NaN falls back to its ``fitness``.
                Called once per re-evaluated candidate (pycma asks for it :attr:`evaluations` times: the value is
                reused). Without it, or without noise handling, nothing is re-evaluated.

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
        handler = getattr(self, "noise_handler", None)
        with self._numpy_rng():
            self.es.tell(list(xs), [-f for f in fitness])
            if handler is not None and reevaluate is not None:
                self._treat_noise(handler, list(xs), fitness, reevaluate)

    def _treat_noise(self, handler, xs: list, fitness: list[float], reevaluate) -> None:
        """pycma's noise treatment after a ``tell``, as in ``cma.fmin``: re-evaluate, measure, raise sigma."""
        told = {id(x): f for x, f in zip(xs, fitness, strict=True)}
        memo: dict[int, float] = {}

        def minimized(x):  # pycma calls it `evaluations` times per re-evaluated x; one measurement, reused
            if id(x) not in memo:
                value = float(reevaluate(x))
                memo[id(x)] = -(value if math.isfinite(value) else told[id(x)])
            return memo[id(x)]

        self.es.sigma *= handler(xs, [-f for f in fitness], minimized)
        self.es.countevals += handler.evaluations_just_done
        self.num_reevaluated = getattr(self, "num_reevaluated", 0) + len(memo)

    def stop(self) -> dict:
        """pycma's termination conditions met so far (empty dict: keep going)."""
        return dict(self.es.stop())


def stand_in_fitness(values: Sequence[float]) -> list[float]:
    """The fitness to tell CMA-ES for a generation in which some candidates were not scored.

    :meth:`CMASearch.tell` takes no NaN: a candidate without a finite fitness (every reward ``None``) is given the
    generation's worst finite fitness (``0.0`` when none is finite), so that it steers the search away without
    stopping it. Tell it with ``scored=False`` so that it never becomes the best or enters the top.

    Args:
        values (`Sequence[float]`): One measured fitness per candidate, NaN (or infinite) where unscored.

    Returns:
        `list[float]`: The values, every non-finite one replaced.
    """
    finite = [f for f in values if math.isfinite(f)]
    worst = min(finite) if finite else 0.0
    return [f if math.isfinite(f) else worst for f in values]
