"""What ESTrainer logs about an iteration: population fitness and rewards, success diversity, throughput, timings, and
the drift from theta_0 (the table: ``docs/es_trainer.md``).
"""

# Plain functions of the scores summed over processes (the same on every process, for any number of processes) and
# of this process's rollouts and timings.

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

import torch

from ...analysis.drift import group_name
from ...es.fitness import LENGTH_EXTREMES, MemberScores, PopulationScores, success_diversity
from ...es.noise import NOISE_BLOCK_SIZE


__all__ = ["completion_metrics", "drift_metrics", "drift_sums", "iteration_metrics", "warn_invalid_rewards"]


def iteration_metrics(scores: PopulationScores, members: Mapping[int, MemberScores], reward_names: Sequence[str],
                      timings: Mapping[str, float], evaluate_seconds: float, update_seconds: float) -> dict[str, float]:
    """The logged metrics of one ES iteration: GRPOTrainer's keys (same meaning, over all completions of all members)
    and ES's own (``fitness/*``, JS_succ of arXiv 2608.27351, ``time/*``); ``docs/es_trainer.md`` defines each.

    Args:
        scores (`PopulationScores`): Summed over processes; ``reward_std``, ``rewards/<name>/std`` and
            ``completions/*`` need ``completion_stats=True``.
        members (`Mapping[int, MemberScores]`): The members this process scored (throughput and timings).
        reward_names (`Sequence[str]`): The reward functions' distinct names.
        timings (`Mapping[str, float]`): The population backend's ``perturb`` / ``restore`` seconds.
        evaluate_seconds, update_seconds (`float`): Seconds of this process's member loop and of the update.

    Returns:
        `dict[str, float]`: A key is left out when it has no value (e.g. no completion was scored).
    """
    metrics = {}
    fitness = scores.fitness
    finite = fitness[~torch.isnan(fitness)]  # a member's fitness: its mean weighted reward; NaN: invalid
    if finite.numel():
        metrics["fitness/mean"] = float(finite.mean())
        metrics["fitness/std"] = float(finite.std(unbiased=False))
        metrics["reward_min"] = float(finite.min())
        metrics["reward_max"] = float(finite.max())
    # over the completions with a weighted reward (not all-None), also where another of a member's rewards was invalid;
    # with no invalid rewards, reward == fitness/mean (the negated training "loss")
    count = float(scores.reward_count.sum())
    if count > 0:
        metrics["reward"] = float(scores.reward_sum.sum()) / count
        if scores.reward_sq_sum is not None and count > 1:
            metrics["reward_std"] = _std(float(scores.reward_sum.sum()), float(scores.reward_sq_sum.sum()), count)
    metrics["num_nan_members"] = float(torch.isnan(fitness).sum())  # ranked worst in the update
    metrics["num_invalid_rewards"] = float(scores.invalid.sum())
    scored = scores.completions > 0
    if scored.any():
        success_rates = scores.successes[scored] / scores.completions[scored]
        metrics["success_rate"] = float(success_rates.mean())
        metrics["success_diversity"] = success_diversity(success_rates)  # JS_succ, arXiv 2608.27351
    sums, counts = scores.per_func_sum.sum(dim=0).tolist(), scores.per_func_count.sum(dim=0).tolist()
    squares = scores.per_func_sq_sum.sum(dim=0).tolist() if scores.per_func_sq_sum is not None else None
    # per function, over the completions it scored (not None, not invalid)
    for j, (name, mean) in enumerate(zip(reward_names, scores.reward_means_per_func(), strict=True)):
        if mean is not None:
            metrics[f"rewards/{name}/mean"] = mean
        if squares is not None and counts[j] > 1:
            metrics[f"rewards/{name}/std"] = _std(sums[j], squares[j], counts[j])
    if scores.length_extremes is not None:
        metrics.update(completion_metrics(scores))
    generation_seconds = sum(m.seconds for m in members.values())  # this process's rollouts: generation and rewards
    if members:
        completions = sum(m.completions for m in members.values())
        metrics["completions_per_second"] = completions / max(generation_seconds, 1e-9)
    # this iteration's; num_tokens (cumulative, prompt + completion) is the trainer's
    metrics["completion_tokens"] = float(scores.tokens.sum())
    metrics["time/generation_and_reward"] = generation_seconds
    metrics["time/perturb"] = timings.get("perturb", 0.0)
    metrics["time/restore"] = timings.get("restore", 0.0)
    metrics["time/update"] = update_seconds
    # the member loop's rest: data, all_reduce, logs
    metrics["time/other"] = max(0.0, evaluate_seconds - generation_seconds - sum(timings.values()))
    return metrics


def _std(total: float, square_total: float, count: float) -> float:
    """Unbiased standard deviation from a sum, a sum of squares and a count (> 1), as TRL's ``nanstd``."""
    mean = total / count
    # clamped: rounding can make the difference slightly negative
    return math.sqrt(max(0.0, (square_total - count * mean * mean) / (count - 1)))


def completion_metrics(scores: PopulationScores) -> dict[str, float]:
    """GRPOTrainer's ``frac_reward_zero_std`` and ``completions/*`` from ``scores`` summed over processes.

    Raises:
        ValueError: if the statistics were not collected (``length_extremes`` is ``None``).
    """
    if scores.length_extremes is None:
        raise ValueError("no completion statistics: collect the scores with completion_stats=True.")
    metrics = {}
    groups = float(scores.groups.sum())
    if groups > 0:  # GRPO's group: one member's num_generations completions of a prompt
        metrics["frac_reward_zero_std"] = float(scores.zero_std_groups.sum()) / groups
    extremes = scores.length_extremes.reshape(-1, len(LENGTH_EXTREMES))  # one row per (member, share)
    column = {name: extremes[:, k] for k, name in enumerate(LENGTH_EXTREMES)}
    completions = float(scores.completions.sum())
    if completions <= 0:
        return metrics
    have = column["completions"] > 0
    metrics["completions/mean_length"] = float(scores.tokens.sum()) / completions  # tokens, EOS included
    metrics["completions/min_length"] = float(column["min_length"][have].min())
    metrics["completions/max_length"] = float(column["max_length"][have].max())
    terminated = float(scores.terminated.sum())
    metrics["completions/clipped_ratio"] = 1.0 - terminated / completions  # cut at max_completion_length
    ended = column["terminated"] > 0
    if terminated > 0:
        metrics["completions/mean_terminated_length"] = float(scores.terminated_tokens.sum()) / terminated
        metrics["completions/min_terminated_length"] = float(column["min_terminated_length"][ended].min())
        metrics["completions/max_terminated_length"] = float(column["max_terminated_length"][ended].max())
    else:  # 0 when none ended, as TRL
        for key in ("mean", "min", "max"):
            metrics[f"completions/{key}_terminated_length"] = 0.0
    return metrics


def drift_sums(masters: Mapping[str, torch.Tensor],
               anchor: Mapping[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    """``sum (theta - theta_0)^2`` and ``sum theta_0^2`` over the trained tensors (``masters`` and ``anchor`` by name),
    whole and per module type, in float64.

    Returns:
        `(groups, sums)`: the sorted module types (:func:`trl_es.analysis.drift.group_name`) and a float64 tensor
        ``(1 + len(groups), 2)``: row 0 the whole model, then one row per group.
    """
    # sums, so that ZeRO-3 partitions add up across processes
    groups = sorted({group_name(name) for name in anchor})
    sums = torch.zeros(len(groups) + 1, 2, dtype=torch.float64)
    for name, master in masters.items():
        flat, theta0 = master.detach().reshape(-1), anchor[name].reshape(-1)
        row = torch.zeros(2, dtype=torch.float64)
        for lo in range(0, flat.numel(), NOISE_BLOCK_SIZE):  # no model-sized float64 temporaries
            current = flat[lo : lo + NOISE_BLOCK_SIZE].double()
            initial = theta0[lo : lo + NOISE_BLOCK_SIZE].to(current.device).double()
            row += torch.stack([(current - initial).pow(2).sum(), initial.pow(2).sum()]).cpu()
        sums[0] += row
        sums[1 + groups.index(group_name(name))] += row
    return groups, sums


def drift_metrics(groups: Sequence[str], sums: torch.Tensor, per_module: bool = True) -> dict[str, float]:
    """``drift/l2`` = ``||theta - theta_0||`` and ``drift/relative`` = ``||theta - theta_0|| / ||theta_0||``, for the
    whole model and, with ``per_module``, per module type (``drift/l2/q_proj``, ...), from :func:`drift_sums` (summed
    over processes)."""
    drift = {}
    keys, rows = ["", *[f"/{g}" for g in groups]], sums.tolist()
    rows = rows if per_module else rows[:1]  # row 0: the whole model
    for key, (diff_sq, base_sq) in zip(keys[: len(rows)], rows, strict=True):
        norm = math.sqrt(diff_sq)  # ||theta - theta_0||
        drift[f"drift/l2{key}"] = norm
        drift[f"drift/relative{key}"] = norm / math.sqrt(base_sq) if base_sq > 0 else 0.0
    return drift


def warn_invalid_rewards(invalid: torch.Tensor, reward_names: Sequence[str], warned: set[str]) -> None:
    """Warn once per reward function that returned a non-finite number: ``invalid`` ``(num_completions, num_funcs)``
    bool, ``warned`` the names already warned about (updated)."""
    for j in torch.nonzero(invalid.any(dim=0)).flatten().tolist():
        name = reward_names[j]
        if name not in warned:
            warned.add(name)
            warnings.warn(
                f"Reward function {name!r} returned a non-finite reward (NaN or +-inf). Such a reward never reaches "
                "the weights: the member that produced it gets no fitness and is ranked worst (counted in "
                "num_nan_members and num_invalid_rewards); evaluate() leaves it out of the means. Return None for "
                "'not applicable'. This warning is shown once per reward function.",
                stacklevel=3,
            )
