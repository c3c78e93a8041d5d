"""The collapse guard: a run that rolls itself back through its seed log when the center's fitness collapses.

Iteration ``t`` (seed-log record ``t``) scores members around the weights after record ``t - 1`` ("state ``t - 1``");
the members' pooled mean reward is the free proxy for that state's fitness, and its standard error is that of a mean
over the iteration's completions, ``sqrt(var / n)`` (``var``: the pooled variance of the completions' rewards, ``n``:
completions per member), which counts the batch-to-batch spread of the prompts. A **collapse** is ``patience``
iterations in a row whose mean is below the best mean so far by more than ``threshold`` standard errors of the
difference (``sqrt(se^2 + se_best^2)``).

On a collapse the iteration's record is a **rollback**: the ES steps applied since the best state are undone in one
update (their members, coefficients ``-z_i * alpha_j / N_j``, ``learning_rate`` = the number of members, so the step
``alpha / N`` is 1), which returns the fp32 master to the best state's up to fp32 rounding of the summed steps. It is
an ordinary record (``members``, ``coefficients``, ``learning_rate``), so :func:`~trl_es.es.seedlog.replay`, a resume
and a vLLM server replay it with the arithmetic of every other record, bitwise. After ``k`` rollbacks the learning
rate is multiplied by ``alpha_factor ** k``. The guard's state is a function of the seed log's records alone
(:meth:`CollapseGuard.from_records`), so a resumed run and every process decide as the uninterrupted run does.
Nothing here imports TRL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Rollback:
    """The record content of a rollback: undo ``undone`` (record steps, newest first) back to state ``to_state``."""

    to_state: int  # the seed-log length whose weights the run returns to
    undone: list[int]
    members: list[list[int]]  # [seed, sign] of every undone member, newest record first
    coefficients: list[float]  # -z_i * alpha_j / N_j
    learning_rate: float  # the number of members: the step alpha / N is 1


class CollapseGuard:
    """The guard's state over a run's seed-log records (see the module docstring).

    Args:
        threshold (`float`): Standard errors below the best mean that count as a drop (> 0).
        patience (`int`): Drops in a row that make a collapse (>= 1).
        alpha_factor (`float`): Factor of the learning rate after each rollback, in ``(0, 1]``.
    """

    def __init__(self, threshold: float = 3.0, patience: int = 3, alpha_factor: float = 0.5):
        self.threshold, self.patience, self.alpha_factor = float(threshold), int(patience), float(alpha_factor)
        self.best: tuple[float, float] | None = None  # (mean, se) of the best state so far
        self.best_chain = 0  # len(chain) at the best state
        self.best_state = 0  # the seed-log length at the best state
        self.chain: list[int] = []  # the record steps whose ES steps the weights hold now, oldest first
        self.drops = 0  # drops in a row
        self.rollbacks = 0

    @property
    def alpha_scale(self) -> float:
        """The factor of the learning rate now: ``alpha_factor ** rollbacks``."""
        return self.alpha_factor ** self.rollbacks

    def observe(self, state: int, mean: float, se: float) -> bool:
        """Take iteration ``state + 1``'s measure of state ``state`` (the seed-log length before the iteration);
        returns whether it completes a collapse that a rollback can undo."""
        if not math.isfinite(mean):  # nothing scored: no evidence either way
            return False
        se = se if math.isfinite(se) else 0.0
        if self.best is None or mean > self.best[0]:
            self.best, self.best_chain, self.best_state, self.drops = (mean, se), len(self.chain), state, 0
            return False
        if mean < self.best[0] - self.threshold * math.sqrt(se**2 + self.best[1] ** 2):
            self.drops += 1
        else:
            self.drops = 0
        if self.drops < self.patience:
            return False
        self.drops = 0
        return len(self.chain) > self.best_chain  # at the best state already: nothing to undo

    def rollback(self, records: Sequence[dict]) -> Rollback:
        """The rollback to the best state, given the run's records (steps ``1..n``, ``records[k - 1]`` is step ``k``);
        updates the state as the record will."""
        undone = list(reversed(self.chain[self.best_chain:]))
        members, coefficients = [], []
        for step in undone:
            record = records[step - 1]
            scale = float(record["learning_rate"]) / len(record["members"])  # alpha_j / N_j of that step
            members += [[int(seed), int(sign)] for seed, sign in record["members"]]
            coefficients += [-float(z) * scale for z in record["coefficients"]]
        self._roll_back()
        return Rollback(self.best_state, undone, members, coefficients, float(len(members)))

    def _roll_back(self) -> None:
        """The state change of a rollback: the weights hold the best state's steps again."""
        self.chain = self.chain[: self.best_chain]
        self.rollbacks += 1

    def applied(self, step: int) -> None:
        """Record ``step`` as an ordinary ES step the weights now hold."""
        self.chain.append(step)

    @classmethod
    def from_records(cls, records: Sequence[dict], **settings) -> CollapseGuard:
        """The guard after ``records`` (each with ``fitness_mean`` and ``fitness_se``; a rollback with
        ``rollback_to``); a record without them (written without the guard) is an ES step observed as nothing."""
        guard = cls(**settings)
        for index, record in enumerate(records):
            if "fitness_mean" in record:
                guard.observe(index, float(record["fitness_mean"]), float(record.get("fitness_se", 0.0)))
            if "rollback_to" in record:
                guard._roll_back()
            else:
                guard.applied(int(record["step"]))
        return guard


def mean_and_se(reward_sum: float, reward_sq_sum: float, count: float, members: int) -> tuple[float, float]:
    """The pooled mean reward of an iteration and its standard error ``sqrt(var / (count / members))`` (a member's
    number of completions); ``(nan, nan)`` when nothing was scored."""
    if count <= 0:
        return math.nan, math.nan
    mean = reward_sum / count
    var = max(reward_sq_sum / count - mean * mean, 0.0)
    return mean, math.sqrt(var / max(count / members, 1.0))
