"""Member scores and population fitness: the rollouts of one ES iteration as sums and counts.

:class:`MemberScores` is one member on this process; :class:`PopulationScores` is the population, float64, one row
per member, summed over processes in one flat tensor. Fitness: the mean weighted reward ``R_n`` (Qiu et al. 2025,
arXiv 2509.24372, Algorithm 1), NaN for an invalid member; per prompt: EGGROLL's members x prompts matrix (Sarkar
et al. 2025, arXiv 2511.16652) with GRPO's group baseline (Shao et al. 2024, arXiv 2402.03300, Eq. 3) per column.

Fitness shaping (:func:`shape_fitness`): the raw fitness to the coefficients ``z_i`` of the ES update. Before any
shaping, non-finite members are ranked worst (warned) and values within ``TIE_ULPS`` float64 ulps are merged
(:func:`merge_ties`); a population in one tie group gets exactly zero coefficients.

Population success diversity (:func:`success_diversity`, JS_succ, arXiv 2608.27351): how differently the members
succeed, logged each iteration and read by the diagnostics (:mod:`trl_es.analysis`).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .perturbation import zscore


if TYPE_CHECKING:  # annotations only: the rollout sits above es/ (it imports generation, which imports es/)
    from ..rollout import RolloutResult


__all__ = ["FITNESS_SHAPINGS", "LENGTH_EXTREMES", "PER_PROMPT_SHAPINGS", "TIE_ULPS", "MemberScores",
           "PopulationScores", "binary_entropy", "centered_ranks", "merge_ties", "shape_fitness", "success_diversity",
           "success_diversity_from_matrix"]

logger = logging.getLogger(__name__)

#: The values of ``ESConfig.per_prompt_shaping`` (see :meth:`PopulationScores.per_prompt_fitness`).
PER_PROMPT_SHAPINGS = ("none", "center", "zscore", "centered_rank")


@dataclass
class MemberScores:
    """One member's rollout on this process's prompt rows, as sums and counts (``None`` rewards skipped)."""

    reward_sum: float  # sum of the weighted rewards
    reward_count: int  # completions with a weighted reward
    completions: int
    tokens: int  # completion tokens
    per_func_sum: list[float]  # per reward function, the sum of its rewards
    per_func_count: list[int]  # per reward function, how many rewards it gave
    invalid: int  # non-finite rewards (NaN, +-inf): the member then has no fitness
    successes: int  # completions whose weighted reward is >= success_threshold
    seconds: float = 0.0  # wall-clock of the rollout on this process (not summed across processes)
    texts: list[str] | None = None
    prompt_reward_sum: list[float] | None = None  # per prompt row, in order; only for per-prompt shaping
    prompt_reward_count: list[int] | None = None
    # the statistics below feed the logged metrics only, never the fitness
    prompt_tokens: int = 0  # counted once per completion, as GRPOTrainer's num_tokens
    reward_sq_sum: float = 0.0
    per_func_sq_sum: list[float] | None = None
    terminated: int = 0  # ended with EOS or pad; the others were clipped at max_completion_length
    terminated_tokens: int = 0
    min_length: int | None = None  # None: no completion
    max_length: int | None = None
    min_terminated_length: int | None = None
    max_terminated_length: int | None = None
    groups: int = 0  # prompt rows counted for zero_std_groups
    zero_std_groups: int = 0  # GRPOTrainer's frac_reward_zero_std: unbiased nanstd close to 0

    @classmethod
    def from_rollout(cls, rollout: RolloutResult, success_threshold: float, num_generations: int | None = None,
                     group_size: int | None = None) -> MemberScores:
        """Sum one member's rollout (the rows it owns); ``None`` for ``num_generations`` / ``group_size`` skips the
        per-prompt sums / the zero-spread groups.

        Raises:
            ValueError: if the completions do not split into rows of ``num_generations`` (or ``group_size``).
        """
        rewards = rollout.rewards.double()
        per_func = rollout.rewards_per_func.double()
        prompt_sum = prompt_count = None
        if num_generations is not None:  # consecutive completions per prompt row
            if num_generations < 1 or rewards.numel() % num_generations:
                raise ValueError(f"{rewards.numel()} completions do not split into prompt rows of "
                                 f"num_generations={num_generations}.")
            by_prompt = rewards.view(-1, num_generations)
            prompt_sum = by_prompt.nansum(dim=1).tolist()
            prompt_count = (~torch.isnan(by_prompt)).sum(dim=1).tolist()
        stats = _completion_stats(rollout, rewards, per_func, group_size)
        return cls(
            **stats,
            reward_sum=float(rewards.nansum()),
            reward_count=int((~torch.isnan(rewards)).sum()),
            completions=len(rollout.completions),
            tokens=int(rollout.num_tokens),
            per_func_sum=per_func.nansum(dim=0).tolist(),
            per_func_count=(~torch.isnan(per_func)).sum(dim=0).tolist(),
            invalid=int(rollout.invalid.sum()),
            successes=int((rewards >= success_threshold).sum()),  # NaN compares False
            seconds=float(rollout.seconds),
            texts=list(rollout.completions),
            prompt_reward_sum=prompt_sum,
            prompt_reward_count=prompt_count,
        )


def _completion_stats(rollout: RolloutResult, rewards: torch.Tensor, per_func: torch.Tensor,
                      group_size: int | None) -> dict:
    """The statistics fields of :class:`MemberScores` (metrics only) from one rollout."""
    finite = rewards[~torch.isnan(rewards)]
    stats = {"reward_sq_sum": float(finite.pow(2).sum()), "per_func_sq_sum": per_func.pow(2).nansum(dim=0).tolist()}
    lengths = rollout.completion_lengths  # the model's tokens (tool turns left out)
    # terminated: ended with EOS or pad; the others were clipped at max_completion_length
    done = [n for n, end in zip(lengths, rollout.terminated, strict=True) if end]
    stats.update(terminated=len(done), terminated_tokens=sum(done), prompt_tokens=int(sum(rollout.prompt_lengths)),
                 min_length=min(lengths, default=None), max_length=max(lengths, default=None),
                 min_terminated_length=min(done, default=None), max_terminated_length=max(done, default=None))
    if group_size is not None:
        if group_size < 1 or rewards.numel() % group_size:
            raise ValueError(f"{rewards.numel()} completions do not split into prompt rows of {group_size}.")
        grouped = rewards.view(-1, group_size)
        if group_size == 1:  # as GRPOTrainer: one sample has no spread
            zero = torch.ones(grouped.shape[0], dtype=torch.bool)
        else:
            count = (~torch.isnan(grouped)).sum(dim=1)
            mean = grouped.nanmean(dim=1, keepdim=True)
            # unbiased nanstd, as GRPOTrainer's frac_reward_zero_std
            variance = (grouped - mean).pow(2).nansum(dim=1) / (count - 1).clamp(min=1)
            std = torch.where(count > 1, variance.sqrt(), torch.full_like(variance, math.nan))
            zero = torch.isclose(std, torch.zeros_like(std))  # NaN (fewer than 2 rewards): not zero, as nanstd
        stats.update(groups=int(grouped.shape[0]), zero_std_groups=int(zero.sum()))
    return stats


#: The summed completion statistics of :class:`PopulationScores` (optional), in the order of the flat tensor.
_STATS = (("prompt_tokens", False), ("reward_sq_sum", False), ("terminated", False), ("terminated_tokens", False),
          ("groups", False), ("zero_std_groups", False), ("per_func_sq_sum", True))

#: Per process share, the columns of ``PopulationScores.length_extremes``.
LENGTH_EXTREMES = ("completions", "min_length", "max_length", "terminated", "min_terminated_length",
                   "max_terminated_length")

#: The summed fields of :class:`PopulationScores`, in the order of the flat tensor (name, per reward function?).
_SUMMED = (("reward_sum", False), ("reward_count", False), ("completions", False), ("tokens", False),
           ("per_func_sum", True), ("per_func_count", True), ("invalid", False), ("successes", False))


@dataclass
class PopulationScores:
    """The population's scores, one row per member, float64 (zeros for members not scored yet).

    Shapes: ``(P,)`` per member, ``(P, F)`` per reward function, ``(P, B)`` per prompt of the iteration (all
    processes'), ``length_extremes`` ``(P, S, 6)`` per process share ``S`` (columns :data:`LENGTH_EXTREMES`, 0 where
    none). Optional fields are ``None`` when not collected.
    """

    reward_sum: torch.Tensor
    reward_count: torch.Tensor
    completions: torch.Tensor
    tokens: torch.Tensor
    per_func_sum: torch.Tensor
    per_func_count: torch.Tensor
    invalid: torch.Tensor
    successes: torch.Tensor
    prompt_sum: torch.Tensor | None = None  # (P, B): member i's weighted-reward sum on prompt p
    prompt_count: torch.Tensor | None = None
    prompt_tokens: torch.Tensor | None = None
    reward_sq_sum: torch.Tensor | None = None
    terminated: torch.Tensor | None = None
    terminated_tokens: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    zero_std_groups: torch.Tensor | None = None
    per_func_sq_sum: torch.Tensor | None = None
    length_extremes: torch.Tensor | None = None  # min and max do not add up: each process fills its own share

    @classmethod
    def collect(cls, scores: Mapping[int, MemberScores], population_size: int, num_funcs: int,
                num_prompts: int | None = None, prompt_offset: int = 0, completion_stats: bool = False,
                num_shares: int = 1, share_index: int = 0) -> PopulationScores:
        """The members this process scored (``{member index: MemberScores}``) in a population-sized table.

        Raises:
            ValueError: if a member's per-function lists do not have ``num_funcs`` entries, or its per-prompt lists
                are missing or do not fit in ``num_prompts`` columns from ``prompt_offset``.
        """
        table = {name: torch.zeros((population_size, num_funcs) if per_func else (population_size,),
                                   dtype=torch.float64) for name, per_func in _SUMMED}
        if num_prompts is not None:  # this process's prompts sit at the columns from prompt_offset
            table["prompt_sum"] = torch.zeros(population_size, num_prompts, dtype=torch.float64)
            table["prompt_count"] = torch.zeros(population_size, num_prompts, dtype=torch.float64)
        for index, member in scores.items():
            for name, per_func in _SUMMED:
                value = getattr(member, name)
                if per_func and len(value) != num_funcs:
                    raise ValueError(f"member {index}: {name} has {len(value)} entries, expected {num_funcs}.")
                table[name][index] = torch.tensor(value, dtype=torch.float64) if per_func else float(value)
            if num_prompts is None:
                continue
            sums, counts = member.prompt_reward_sum, member.prompt_reward_count
            if sums is None or counts is None or len(sums) != len(counts) or prompt_offset + len(sums) > num_prompts:
                found = None if sums is None else len(sums)
                raise ValueError(f"member {index}: per-prompt sums ({found} prompts) do not fit in {num_prompts} "
                                 f"prompt columns from column {prompt_offset}.")
            columns = slice(prompt_offset, prompt_offset + len(sums))
            table["prompt_sum"][index, columns] = torch.tensor(sums, dtype=torch.float64)
            table["prompt_count"][index, columns] = torch.tensor(counts, dtype=torch.float64)
        if completion_stats:  # this process fills share share_index of num_shares in length_extremes
            table.update(_collect_stats(scores, population_size, num_funcs, num_shares, share_index))
        return cls(**table)

    def _blocks(self) -> list[torch.Tensor]:
        blocks = [getattr(self, name) if per_func else getattr(self, name)[:, None] for name, per_func in _SUMMED]
        if self.prompt_sum is not None:
            blocks += [self.prompt_sum, self.prompt_count]
        if self.length_extremes is not None:  # the statistics travel in the same flat tensor
            blocks += [getattr(self, name) if per_func else getattr(self, name)[:, None] for name, per_func in _STATS]
            blocks.append(self.length_extremes.reshape(self.length_extremes.shape[0], -1))
        return blocks

    def to_tensor(self) -> torch.Tensor:
        """All fields as one ``(P, 6 + 2F [+ 2B] [+ 6 + F + 6S])`` float64 tensor."""
        return torch.cat(self._blocks(), dim=1)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, num_funcs: int, num_prompts: int | None = None,
                    num_shares: int | None = None) -> PopulationScores:
        """Inverse of :meth:`to_tensor` (``num_prompts``: ``B`` when the per-prompt columns are there;
        ``num_shares``: ``S`` when the completion statistics are)."""
        values, column = {}, 0
        for name, per_func in _SUMMED:
            width = num_funcs if per_func else 1
            block = tensor[:, column : column + width]
            values[name] = block if per_func else block[:, 0]
            column += width
        if num_prompts is not None:
            values["prompt_sum"] = tensor[:, column : column + num_prompts]
            values["prompt_count"] = tensor[:, column + num_prompts : column + 2 * num_prompts]
            column += 2 * num_prompts
        if num_shares is not None:
            for name, per_func in _STATS:
                width = num_funcs if per_func else 1
                block = tensor[:, column : column + width]
                values[name] = block if per_func else block[:, 0]
                column += width
            width = num_shares * len(LENGTH_EXTREMES)
            values["length_extremes"] = tensor[:, column : column + width].reshape(-1, num_shares, len(LENGTH_EXTREMES))
        return cls(**values)

    # sums, not means: sums add up across processes exactly; a few numbers per member travel
    def all_reduce(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> PopulationScores:
        """Sum every field over processes with ``reduce_sum`` (e.g. ``accelerator.reduce(t, "sum")``); one call."""
        num_funcs = self.per_func_sum.shape[1]
        num_prompts = None if self.prompt_sum is None else self.prompt_sum.shape[1]
        num_shares = None if self.length_extremes is None else self.length_extremes.shape[1]
        return PopulationScores.from_tensor(reduce_sum(self.to_tensor()), num_funcs, num_prompts, num_shares)

    def __add__(self, other: PopulationScores) -> PopulationScores:
        """Field by field sums of two tables of the same layout (scores of disjoint rows, e.g. evaluation batches)."""
        num_funcs = self.per_func_sum.shape[1]
        num_prompts = None if self.prompt_sum is None else self.prompt_sum.shape[1]
        num_shares = None if self.length_extremes is None else self.length_extremes.shape[1]
        return PopulationScores.from_tensor(self.to_tensor() + other.to_tensor(), num_funcs, num_prompts, num_shares)

    def nbytes(self) -> int:
        """Bytes of the flat tensor :meth:`all_reduce` moves."""
        return sum(block.numel() for block in self._blocks()) * 8

    @property
    def fitness(self) -> torch.Tensor:
        """Per member, the mean weighted reward over its completions; NaN where a reward was invalid or nothing was
        scored. Shape ``(P,)``, float64."""
        valid = (self.reward_count > 0) & (self.invalid == 0)  # an invalid member is ranked worst by shaping
        mean = self.reward_sum / self.reward_count.clamp(min=1)
        return torch.where(valid, mean, torch.full_like(mean, math.nan))

    def fitness_matrix(self) -> torch.Tensor:
        """``R[i, p]``, member ``i``'s mean weighted reward on prompt ``p``: ``(P, B)`` float64, NaN where none.

        Raises:
            ValueError: if the per-prompt sums were not collected.
        """
        if self.prompt_sum is None:
            raise ValueError("no per-prompt sums: collect the scores with num_prompts (per_prompt_shaping != 'none').")
        matrix = self.prompt_sum / self.prompt_count.clamp(min=1)
        # NaN where a member has no sample of the prompt, and on the whole row of a member without a fitness
        matrix = torch.where(self.prompt_count > 0, matrix, torch.full_like(matrix, math.nan))
        return torch.where(torch.isnan(self.fitness)[:, None], torch.full_like(matrix, math.nan), matrix)

    def per_prompt_fitness(self, method: str) -> torch.Tensor:
        """Fitness ``(P,)`` float64: each prompt's column of :meth:`fitness_matrix` shaped across the members, then
        the ``nanmean`` over prompts; ``method`` is one of :data:`PER_PROMPT_SHAPINGS`.

        Raises:
            ValueError: for an unknown ``method``, or (``method != "none"``) if the per-prompt sums were not collected.
        """
        if method not in PER_PROMPT_SHAPINGS:
            raise ValueError(f"per_prompt_shaping must be one of {PER_PROMPT_SHAPINGS}, got {method!r}.")
        if method == "none":  # the mean over all of a member's completions
            return self.fitness
        matrix = self.fitness_matrix()
        shaped = torch.full_like(matrix, math.nan)
        for p in range(matrix.shape[1]):  # the population on one prompt is GRPO's group
            column = matrix[:, p]
            have = ~torch.isnan(column)
            if int(have.sum()) == 0:
                continue
            if method == "center":  # with every cell present this is a constant shift: the update of "none"
                shaped[have, p] = column[have] - column[have].mean()
            elif int(have.sum()) == 1:
                shaped[have, p] = 0.0  # one member alone on a prompt: nothing to compare it with
            else:  # "zscore" / "centered_rank": every prompt that separates the members weighs the same
                shaped[have, p] = shape_fitness(column[have], method)
        fitness = shaped.nanmean(dim=1)  # over the prompts the member has
        # a member without a fitness stays NaN: ranked worst by the shaping that follows
        return torch.where(torch.isnan(self.fitness), torch.full_like(fitness, math.nan), fitness)

    def reward_means_per_func(self) -> list[float | None]:
        """Per reward function, its mean over the whole population's completions (``None`` if it gave none)."""
        sums, counts = self.per_func_sum.sum(dim=0), self.per_func_count.sum(dim=0)
        return [float(s / c) if c > 0 else None for s, c in zip(sums.tolist(), counts.tolist(), strict=True)]


def _collect_stats(scores: Mapping[int, MemberScores], population_size: int, num_funcs: int, num_shares: int,
                   share_index: int) -> dict[str, torch.Tensor]:
    """The completion-statistics fields of :meth:`PopulationScores.collect`."""
    if not 0 <= share_index < num_shares:
        raise ValueError(f"share_index {share_index} is not in [0, {num_shares}).")
    table = {name: torch.zeros((population_size, num_funcs) if per_func else (population_size,), dtype=torch.float64)
             for name, per_func in _STATS}
    table["length_extremes"] = torch.zeros(population_size, num_shares, len(LENGTH_EXTREMES), dtype=torch.float64)
    for index, member in scores.items():
        for name, per_func in _STATS:
            value = getattr(member, name)
            if per_func and (value is None or len(value) != num_funcs):
                found = None if value is None else len(value)
                raise ValueError(f"member {index}: {name} has {found} entries, expected {num_funcs}.")
            table[name][index] = torch.tensor(value, dtype=torch.float64) if per_func else float(value)
        row = [member.completions, member.min_length, member.max_length, member.terminated,
               member.min_terminated_length, member.max_terminated_length]
        table["length_extremes"][index, share_index] = torch.tensor([float(v or 0) for v in row], dtype=torch.float64)
    return table


# ----------------------------------------------------------------------------------------------------- fitness shaping
FITNESS_SHAPINGS = ("zscore", "centered_rank", "none")

# relative, unlike the reference code's (F - mean) / (std + 1e-8): its absolute epsilon turns ulp-level noise into a
# full step and damps real signal below ~1e-8
TIE_ULPS = 64
"""Fitness values closer than this many float64 ulps of the larger magnitude are equal."""


def _fill_invalid_as_worst(fitness: torch.Tensor, valid_values: torch.Tensor) -> torch.Tensor:
    """Set every non-finite entry of ``fitness`` strictly below the smallest of ``valid_values`` (with a warning)."""
    invalid = ~torch.isfinite(fitness)
    if not invalid.any():
        return fitness
    logger.warning(
        "%d of %d population members have no finite fitness (NaN, or a non-finite reward); they are ranked worst.",
        int(invalid.sum()), fitness.numel(),
    )
    if valid_values.numel() == 0:
        return torch.zeros_like(fitness)
    worst = valid_values.min()
    # Strictly below every finite member, by a margin no rounding can close: at least the population's spread,
    # the magnitude of the worst value, and 1.
    gap = max(float(valid_values.max() - worst), float(worst.abs()), 1.0)
    return torch.where(invalid, worst - gap, fitness)


def merge_ties(fitness: torch.Tensor, ulps: int = TIE_ULPS) -> torch.Tensor:
    """Merge fitness values equal up to rounding into their tie group's mean: sorted neighbours ``a <= b`` join when
    ``b - a <= ulps * 2**-52 * max(|a|, |b|)``. ``fitness``: ``(N,)`` finite; returns ``(N,)`` float64.
    """
    f = fitness.to(torch.float64)
    if f.numel() < 2:
        return f.clone()
    values, order = torch.sort(f)
    scale = torch.maximum(values[1:].abs(), values[:-1].abs())
    new_group = torch.ones_like(values, dtype=torch.bool)
    # relative to the two neighbours: a large value elsewhere never merges small, real differences
    new_group[1:] = (values[1:] - values[:-1]) > ulps * torch.finfo(torch.float64).eps * scale
    group = torch.cumsum(new_group.long(), 0) - 1
    count = torch.zeros(int(group[-1]) + 1, dtype=torch.float64).index_add_(0, group, torch.ones_like(values))
    total = torch.zeros_like(count).index_add_(0, group, values)
    merged = torch.empty_like(f)
    merged[order] = (total / count)[group]
    return merged


def centered_ranks(fitness: torch.Tensor) -> torch.Tensor:
    """Centered ranks ``rank / (N - 1) - 0.5`` in ``[-0.5, 0.5]``, ties averaged (Salimans et al. 2017, arXiv
    1703.03864, Sec. 3.1). ``fitness``: ``(N,)``, no NaN; returns ``(N,)`` float64.
    """
    f = fitness.to(torch.float64)
    n = f.numel()
    less = (f[None, :] < f[:, None]).sum(dim=1).to(torch.float64)
    equal = (f[None, :] == f[:, None]).sum(dim=1).to(torch.float64)
    ranks = less + (equal - 1) / 2  # ties share their average rank: equal fitness, equal coefficients
    return ranks / (n - 1) - 0.5


def shape_fitness(fitness: torch.Tensor, method: str = "zscore") -> torch.Tensor:
    """Turn raw fitness ``(N,)`` into the coefficients ``z_i``, ``(N,)`` float64 finite: ``"zscore"`` (ddof 0; Qiu
    et al. 2025, arXiv 2509.24372, Algorithm 1), ``"centered_rank"`` (:func:`centered_ranks`) or ``"none"``.

    Raises:
        ValueError: for an unknown ``method`` or a fitness that is not 1-D with at least 2 entries.
    """
    if method not in FITNESS_SHAPINGS:
        raise ValueError(f"fitness_shaping must be one of {FITNESS_SHAPINGS}, got {method!r}.")
    if fitness.dim() != 1 or fitness.numel() < 2:
        raise ValueError(f"fitness must be 1-D with at least 2 members, got shape {tuple(fitness.shape)}.")
    f = fitness.to(torch.float64)
    valid = torch.isfinite(f)
    if method == "none":  # equal fitness: alpha * F * mean(eps), a random step, hence the warning
        f = _fill_invalid_as_worst(f, f[valid])
        merged = merge_ties(f)
        if bool((merged == merged[0]).all()) and bool(f.abs().max() > 0):
            warnings.warn(
                "fitness_shaping='none' with equal fitness across the population: the ES step is alpha * F * "
                "mean(eps), a random step carrying no signal. Use 'zscore' or 'centered_rank' for a zero step.",
                stacklevel=2,
            )
        return f
    merged = f.clone()
    merged[valid] = merge_ties(f[valid])  # ties among the valid members first, then the invalid ones below them
    merged = _fill_invalid_as_worst(merged, merged[valid])
    if bool((merged == merged[0]).all()):  # one tie group: no signal, an exactly zero step
        return torch.zeros_like(f)
    if method == "centered_rank":
        return centered_ranks(merged)
    return zscore(merged)  # exactly rounded mean and variance: the same coefficients on every CPU


# ------------------------------------------------ population success diversity JS_succ: how differently members succeed
def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    r"""Binary entropy in nats, :math:`h(p) = -p \ln p - (1-p) \ln(1-p)`, :math:`h(0) = h(1) = 0`, elementwise."""
    return torch.special.entr(p) + torch.special.entr(1 - p)  # entr(0) = 0


def success_diversity(success_rates: Sequence[float] | torch.Tensor) -> float:
    r"""Population success diversity :math:`\mathrm{JS}_{\text{succ}}` (arXiv 2608.27351), in nats, in [0, ln 2].

    .. math::
        \mathrm{JS}_{\text{succ}} = h\Big(\frac{1}{N}\sum_{i=1}^{N} p_i\Big) - \frac{1}{N}\sum_{i=1}^{N} h(p_i)

    with :math:`p_i` member :math:`i`'s success rate (``success_rates``, 1-D, N >= 1) and :math:`h` the
    :func:`binary_entropy`. Raises ``ValueError`` for another shape, no member, or a rate outside [0, 1] (or NaN).
    """
    p = torch.as_tensor(success_rates, dtype=torch.float64)  # float64
    if p.dim() != 1:
        raise ValueError(f"`success_rates` must be 1-D (one rate per population member), got shape {tuple(p.shape)}.")
    if p.numel() == 0:
        raise ValueError("`success_rates` must hold at least one member's rate.")
    if torch.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"`success_rates` must lie in [0, 1], got min {p.min().item()} and max {p.max().item()}.")
    # 0: all succeed equally often; ln 2: half always, half never
    js = binary_entropy(p.mean()) - binary_entropy(p).mean()
    return max(0.0, float(js))  # rounding may dip below 0


def success_diversity_from_matrix(successes: Sequence[Sequence[float]] | torch.Tensor) -> float:
    r""":func:`success_diversity` of the rates :math:`p_i = \frac{1}{P}\sum_{j} s_{ij}` of a 0/1 matrix ``(N, P)``.

    Raises:
        ValueError: if the input is not 2-D, has no member or no prompt, or holds values other than 0 and 1.
    """
    s = torch.as_tensor(successes)
    if s.dim() != 2:
        raise ValueError(f"`successes` must be 2-D (N members x P prompts), got shape {tuple(s.shape)}.")
    if s.shape[0] == 0 or s.shape[1] == 0:
        raise ValueError(f"`successes` needs at least one member and one prompt, got shape {tuple(s.shape)}.")
    s = s.to(torch.float64)  # bool, int or float 0/1
    if not ((s == 0) | (s == 1)).all():
        raise ValueError("`successes` must hold only 0/1 (or False/True) values.")
    return success_diversity(s.mean(dim=1))  # p_i: member i's rate over the P prompts
