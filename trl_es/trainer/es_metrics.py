"""What ESTrainer logs about an iteration: population fitness and rewards, success diversity, throughput, timings, and
the drift from theta_0.

Plain functions of the iteration's scores (:class:`~trl_es.es.fitness.PopulationScores`, summed over processes, so
the same on every process and for any number of processes) and of this process's member rollouts and timings.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

import torch

from ..analysis.diversity import success_diversity
from ..analysis.drift import group_name
from ..es.fitness import MemberScores, PopulationScores
from ..es.noise import NOISE_BLOCK_SIZE

__all__ = ["drift_metrics", "drift_sums", "iteration_metrics", "warn_invalid_rewards"]


def iteration_metrics(scores: PopulationScores, members: Mapping[int, MemberScores], reward_names: Sequence[str],
                      timings: Mapping[str, float], evaluate_seconds: float, update_seconds: float) -> dict[str, float]:
    """The logged metrics of one ES iteration.

    Args:
        scores (`PopulationScores`): The population's scores, summed over processes.
        members (`Mapping[int, MemberScores]`): The members this process scored (for throughput and timings).
        reward_names (`Sequence[str]`): The reward functions' distinct names.
        timings (`Mapping[str, float]`): The population backend's ``perturb`` / ``restore`` seconds.
        evaluate_seconds (`float`): Seconds of the member loop on this process.
        update_seconds (`float`): Seconds of the update.

    Returns:
        `dict[str, float]`: ``reward`` / ``reward_std`` / ``reward_min`` / ``reward_max`` (over the members with a
        fitness), ``num_nan_members``, ``num_invalid_rewards``, ``success_rate`` and ``success_diversity`` (JS_succ,
        arXiv 2608.27351), ``rewards/<name>/mean``, ``completions_per_second``, ``completion_tokens`` and ``time/*``.
    """
    metrics = {}
    fitness = scores.fitness
    finite = fitness[~torch.isnan(fitness)]
    if finite.numel():
        metrics["reward"] = float(finite.mean())
        metrics["reward_std"] = float(finite.std(unbiased=False))
        metrics["reward_min"] = float(finite.min())
        metrics["reward_max"] = float(finite.max())
    metrics["num_nan_members"] = float(torch.isnan(fitness).sum())
    metrics["num_invalid_rewards"] = float(scores.invalid.sum())
    scored = scores.completions > 0
    if scored.any():
        success_rates = scores.successes[scored] / scores.completions[scored]
        metrics["success_rate"] = float(success_rates.mean())
        metrics["success_diversity"] = success_diversity(success_rates)
    for name, mean in zip(reward_names, scores.reward_means_per_func(), strict=True):
        if mean is not None:
            metrics[f"rewards/{name}/mean"] = mean
    generation_seconds = sum(m.seconds for m in members.values())
    if members:
        completions = sum(m.completions for m in members.values())
        metrics["completions_per_second"] = completions / max(generation_seconds, 1e-9)
    metrics["completion_tokens"] = float(scores.tokens.sum())
    metrics["time/generation_and_reward"] = generation_seconds
    metrics["time/perturb"] = timings.get("perturb", 0.0)
    metrics["time/restore"] = timings.get("restore", 0.0)
    metrics["time/update"] = update_seconds
    metrics["time/other"] = max(0.0, evaluate_seconds - generation_seconds - sum(timings.values()))
    return metrics


def drift_sums(masters: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    """``sum (theta - theta_0)^2`` and ``sum theta_0^2`` over the trained tensors, whole and per module type.

    Computed in float64, block by block (no model-sized float64 temporaries). Sums, so that partitions (ZeRO-3) add
    up across processes.

    Args:
        masters (`Mapping[str, torch.Tensor]`): theta (the fp32 masters) by name.
        anchor (`Mapping[str, torch.Tensor]`): theta_0 by name (same names; any device and float dtype).

    Returns:
        `(groups, sums)`: the module types (:func:`trl_es.analysis.drift.group_name`, sorted) and a float64 tensor of
        shape ``(1 + len(groups), 2)``: row 0 the whole model, then one row per group.
    """
    groups = sorted({group_name(name) for name in anchor})
    sums = torch.zeros(len(groups) + 1, 2, dtype=torch.float64)
    for name, master in masters.items():
        flat, theta0 = master.detach().reshape(-1), anchor[name].reshape(-1)
        row = torch.zeros(2, dtype=torch.float64)
        for lo in range(0, flat.numel(), NOISE_BLOCK_SIZE):
            current = flat[lo : lo + NOISE_BLOCK_SIZE].double()
            initial = theta0[lo : lo + NOISE_BLOCK_SIZE].to(current.device).double()
            row += torch.stack([(current - initial).pow(2).sum(), initial.pow(2).sum()]).cpu()
        sums[0] += row
        sums[1 + groups.index(group_name(name))] += row
    return groups, sums


def drift_metrics(groups: Sequence[str], sums: torch.Tensor) -> dict[str, float]:
    """``drift/l2`` = ``||theta - theta_0||`` and ``drift/relative`` = ``||theta - theta_0|| / ||theta_0||``, for the
    whole model and per module type (``drift/l2/q_proj``, ...), from :func:`drift_sums` (summed over processes)."""
    drift = {}
    for key, (diff_sq, base_sq) in zip(["", *[f"/{g}" for g in groups]], sums.tolist(), strict=True):
        norm = math.sqrt(diff_sq)
        drift[f"drift/l2{key}"] = norm
        drift[f"drift/relative{key}"] = norm / math.sqrt(base_sq) if base_sq > 0 else 0.0
    return drift


def warn_invalid_rewards(invalid: torch.Tensor, reward_names: Sequence[str], warned: set[str]) -> None:
    """Warn once per reward function (tracked in ``warned``) that returned a non-finite number.

    Args:
        invalid (`torch.Tensor`): ``(num_completions, num_funcs)`` bool, as the rollout returns it.
        reward_names (`Sequence[str]`): The functions' names.
        warned (`set[str]`): Names already warned about; updated.
    """
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
