"""Member scores and population fitness: what the rollouts of one ES iteration add up to, in named fields.

A member's rollout on this process's prompts gives a :class:`MemberScores` (sums and counts, no means: sums add up
across processes exactly). :class:`PopulationScores` holds them for the whole population, one row per member, in
float64; :meth:`PopulationScores.all_reduce` sums them over processes (one flat float64 tensor: a few numbers per
member travel, nothing else), and :attr:`PopulationScores.fitness` is then the fitness, computed once: the mean
weighted reward over all of a member's completions (Qiu et al. 2025, arXiv 2509.24372, Algorithm 1: ``R_n``), NaN
for a member with an invalid (non-finite) reward or nothing scored (such a member is ranked worst by
:func:`trl_es.es.shaping.shape_fitness`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch

__all__ = ["MemberScores", "PopulationScores"]


@dataclass
class MemberScores:
    """One member's rollout on this process's prompt rows, as sums and counts.

    Attributes:
        reward_sum (`float`): Sum of the weighted rewards over the completions (``None`` rewards skipped).
        reward_count (`int`): Completions with a weighted reward (not all-``None``).
        completions (`int`): Completions generated.
        tokens (`int`): Completion tokens generated.
        per_func_sum (`list[float]`): Per reward function, the sum of its rewards (``None`` skipped).
        per_func_count (`list[int]`): Per reward function, how many rewards it gave (not ``None``).
        invalid (`int`): Rewards that were a non-finite number (NaN, +-inf): the member then has no fitness.
        successes (`int`): Completions whose weighted reward is ``>= success_threshold``.
        seconds (`float`): Wall-clock seconds of the rollout (this process; not summed across processes).
        texts (`list[str]`): The completions.
    """

    reward_sum: float
    reward_count: int
    completions: int
    tokens: int
    per_func_sum: list[float]
    per_func_count: list[int]
    invalid: int
    successes: int
    seconds: float = 0.0
    texts: list[str] | None = None

    @classmethod
    def from_rollout(cls, rollout: Mapping, success_threshold: float, seconds: float = 0.0) -> MemberScores:
        """Sum one member's rollout (the rows it owns).

        Args:
            rollout (`Mapping`): ``rewards`` (``(n,)`` weighted rewards, NaN for all-``None``), ``rewards_per_func``
                (``(n, F)``, NaN for ``None`` and invalid), ``invalid`` (``(n, F)`` bool), ``completions`` (``n``
                texts) and ``num_tokens`` (int), as :func:`trl_es.rollout.score_model` returns them.
            success_threshold (`float`): A completion succeeds when its weighted reward is at least this.
            seconds (`float`): The rollout's wall-clock seconds.
        """
        rewards = rollout["rewards"].double()
        per_func = rollout["rewards_per_func"].double()
        return cls(
            reward_sum=float(rewards.nansum()),
            reward_count=int((~torch.isnan(rewards)).sum()),
            completions=len(rollout["completions"]),
            tokens=int(rollout["num_tokens"]),
            per_func_sum=per_func.nansum(dim=0).tolist(),
            per_func_count=(~torch.isnan(per_func)).sum(dim=0).tolist(),
            invalid=int(rollout["invalid"].sum()),
            successes=int((rewards >= success_threshold).sum()),  # NaN compares False
            seconds=float(seconds),
            texts=list(rollout["completions"]),
        )


#: The summed fields of :class:`PopulationScores`, in the order of the flat tensor (name, per reward function?).
_SUMMED = (("reward_sum", False), ("reward_count", False), ("completions", False), ("tokens", False),
           ("per_func_sum", True), ("per_func_count", True), ("invalid", False), ("successes", False))


@dataclass
class PopulationScores:
    """The population's scores, one row per member, float64 (zeros for members no process has scored yet).

    Attributes:
        reward_sum, reward_count, completions, tokens, invalid, successes (`torch.Tensor`): Shape ``(P,)``.
        per_func_sum, per_func_count (`torch.Tensor`): Shape ``(P, F)``.
    """

    reward_sum: torch.Tensor
    reward_count: torch.Tensor
    completions: torch.Tensor
    tokens: torch.Tensor
    per_func_sum: torch.Tensor
    per_func_count: torch.Tensor
    invalid: torch.Tensor
    successes: torch.Tensor

    @classmethod
    def collect(cls, scores: Mapping[int, MemberScores], population_size: int, num_funcs: int) -> PopulationScores:
        """The members this process scored (``{member index: MemberScores}``) in a population-sized table.

        Raises:
            ValueError: if a member's per-function lists do not have ``num_funcs`` entries.
        """
        table = {name: torch.zeros((population_size, num_funcs) if per_func else (population_size,),
                                   dtype=torch.float64) for name, per_func in _SUMMED}
        for index, member in scores.items():
            for name, per_func in _SUMMED:
                value = getattr(member, name)
                if per_func and len(value) != num_funcs:
                    raise ValueError(f"member {index}: {name} has {len(value)} entries, expected {num_funcs}.")
                table[name][index] = torch.tensor(value, dtype=torch.float64) if per_func else float(value)
        return cls(**table)

    def to_tensor(self) -> torch.Tensor:
        """All fields as one ``(P, 6 + 2F)`` float64 tensor (the layout of :meth:`from_tensor`)."""
        columns = [getattr(self, name) if per_func else getattr(self, name)[:, None] for name, per_func in _SUMMED]
        return torch.cat(columns, dim=1)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, num_funcs: int) -> PopulationScores:
        """Inverse of :meth:`to_tensor`."""
        values, column = {}, 0
        for name, per_func in _SUMMED:
            width = num_funcs if per_func else 1
            block = tensor[:, column : column + width]
            values[name] = block if per_func else block[:, 0]
            column += width
        return cls(**values)

    def all_reduce(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> PopulationScores:
        """Sum every field over processes with ``reduce_sum`` (e.g. ``accelerator.reduce(t, "sum")``); one call."""
        num_funcs = self.per_func_sum.shape[1]
        return PopulationScores.from_tensor(reduce_sum(self.to_tensor()), num_funcs)

    def nbytes(self) -> int:
        """Bytes of the flat tensor :meth:`all_reduce` moves."""
        return sum(getattr(self, f.name).numel() for f in fields(self)) * 8

    @property
    def fitness(self) -> torch.Tensor:
        """Per member, the mean weighted reward over its completions; NaN where a reward was invalid or nothing was
        scored. Shape ``(P,)``, float64."""
        valid = (self.reward_count > 0) & (self.invalid == 0)
        mean = self.reward_sum / self.reward_count.clamp(min=1)
        return torch.where(valid, mean, torch.full_like(mean, math.nan))

    def reward_means_per_func(self) -> list[float | None]:
        """Per reward function, its mean over the whole population's completions (``None`` if it gave none)."""
        sums, counts = self.per_func_sum.sum(dim=0), self.per_func_count.sum(dim=0)
        return [float(s / c) if c > 0 else None for s, c in zip(sums.tolist(), counts.tolist(), strict=True)]
