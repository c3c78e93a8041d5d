"""One trained policy, measured the way the ES-vs-GRPO recipes compare arms: accuracy, pass@k, diversity, drift."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..es.fitness import success_diversity
from .drift import parameter_drift
from .entropy import TokenEntropyRecorder, mean_completion_entropy
from .kl import off_task_kl
from .pass_at_k import mean_pass_at_k
from .protocol import check_sampling


__all__ = ["SAMPLE_ROWS_PER_CALL", "auto_sample_batch_size", "evaluate_policy", "greedy_accuracy", "sample_policy"]

SAMPLE_ROWS_PER_CALL = 128
"""Rows (prompts x samples) per sampled ``generate`` call that ``sample_batch_size=None`` aims at: the fastest width
measured for the eager engine on the 2-core CPU (``benchmarks/eval_speed.py``, docs/benchmarks.md)."""


def auto_sample_batch_size(num_samples: int) -> int:
    """Prompts per sampled ``generate`` call for ``sample_batch_size=None``: about :data:`SAMPLE_ROWS_PER_CALL` rows.

    Raises:
        ValueError: if ``num_samples`` is not an integer ``>= 1``.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}.")
    # its samples fill half a call: one prompt, whose whole prompt the engine computes once
    if 2 * num_samples >= SAMPLE_ROWS_PER_CALL:
        return 1
    # 2-core CPU, 16 samples, prompts a call 1/4/8/16/24: 10.4/14.9/17.5/15.6/12.5 completions/s
    return SAMPLE_ROWS_PER_CALL // num_samples


def _scorer(reward_funcs):
    from ..rollout import RewardScorer

    # one function or a list
    return RewardScorer(list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])


def greedy_accuracy(
    model,
    tokenizer,
    rows: Sequence[dict],
    reward_funcs,
    max_new_tokens: int,
    batch_size: int = 50,
    success_threshold: float = 0.5,
    chat_template_kwargs: dict | None = None,
    progress: bool = True,
) -> float:
    """The fraction of ``rows`` whose greedy completion gets more than ``success_threshold`` from the **last** reward.

    Args:
        rows (`Sequence[dict]`): Dataset rows (``prompt`` and the columns the rewards read); at least one.
        reward_funcs (`Callable | list`): TRL-style reward functions; the last one decides correctness.
        max_new_tokens (`int`): New tokens per completion.
        batch_size (`int`): Prompts per ``generate`` call.
        progress (`bool`): A tqdm bar of completions done / total (stderr).

    Raises:
        ValueError: if ``rows`` is empty.
    """
    from ..generation import EagerEngine
    from ..rollout import build_generation_config, score_model

    if not rows:
        raise ValueError("greedy_accuracy needs at least one row.")
    scorer = _scorer(reward_funcs)
    engine = EagerEngine(share_prompt_prefix=True)
    config = build_generation_config(tokenizer, max_new_tokens,
                                     model_generation_config=getattr(model, "generation_config", None))
    correct = 0  # greedy: one completion per prompt
    with tqdm(total=len(rows), desc="greedy completions", unit="completion", disable=not progress) as bar:
        for first in range(0, len(rows), batch_size):
            # batch_size prompts a call
            out = score_model(model, tokenizer, rows[first : first + batch_size], scorer, config, 1,
                              chat_template_kwargs, engine=engine)
            # the last reward is the task's answer, as trl-es eval reads it
            correct += int((out.rewards_per_func[:, -1].nan_to_num(0.0) > success_threshold).sum())
            bar.update(len(out.completions))
    return correct / len(rows)


def sample_policy(
    model,
    tokenizer,
    rows: Sequence[dict],
    reward_funcs,
    generation_config,
    num_samples: int,
    sample_batch_size: int | None = None,
    seed: int | None = None,
    success_threshold: float = 0.5,
    chat_template_kwargs: dict | None = None,
    record_entropy: bool = True,
    progress: bool = True,
    candidate_sampling: bool = True,
) -> dict:
    r"""Sample ``num_samples`` completions per prompt, score them, and record their token entropy.

    Args:
        rows (`Sequence[dict]`): Dataset rows (``prompt`` and the columns the rewards read); may be empty.
        reward_funcs (`Callable | list | RewardScorer`): TRL-style reward functions; the last one decides correctness.
        generation_config (`GenerationConfig`): Samples (``do_sample=True``, ``temperature > 0``), e.g.
            :func:`trl_es.rollout.build_generation_config` with the model's ``generation_config``.
        sample_batch_size (`int`, *optional*): Prompts per ``generate`` call; ``None``: :func:`auto_sample_batch_size`.
        seed (`int`, *optional*): Seeds the sampling inside ``torch.random.fork_rng``; ``None``: the global RNG.
        candidate_sampling (`bool`): Draw with :class:`trl_es.generation.sampling.CandidateSampler` (fast on a CPU);
            ``False``: transformers' ``multinomial`` (other samples for the same seed).

    Returns:
        `dict`: ``rewards_per_func`` (float32 ``(len(rows), num_samples, F)``, NaN for ``None`` rewards), ``correct``
        (per prompt), ``token_entropy`` (nats; NaN without tokens), ``token_entropy_sum``, ``token_entropy_tokens``.

    Raises:
        ValueError: if ``num_samples`` or ``sample_batch_size`` is below 1, or the config does not sample.
    """
    from ..generation import EagerEngine
    from ..rollout import RewardScorer, score_model

    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}.")
    if sample_batch_size is None:
        sample_batch_size = auto_sample_batch_size(num_samples)
    if isinstance(sample_batch_size, bool) or not isinstance(sample_batch_size, int) or sample_batch_size < 1:
        raise ValueError(f"sample_batch_size must be an integer >= 1, got {sample_batch_size!r}.")
    temperature = generation_config.temperature
    if not generation_config.do_sample or temperature is None or not temperature > 0:
        raise ValueError(f"generation_config must sample (do_sample=True, temperature > 0), got do_sample="
                         f"{generation_config.do_sample}, temperature={temperature}.")
    rows = list(rows)
    # a ready scorer is reused as is
    scorer = reward_funcs if isinstance(reward_funcs, RewardScorer) else _scorer(reward_funcs)
    # training's engine; a prompt's rows share all but its last token
    engine = EagerEngine(share_prompt_prefix=True, candidate_sampling=candidate_sampling)
    # reads the scores before any top-p cut; changes no token
    recorder = TokenEntropyRecorder(temperature) if record_entropy else None
    per_func, correct, entropy_sum, entropy_tokens = [], [], 0.0, 0
    device = next(model.parameters()).device  # fork_rng forks the CUDA RNG of this device too
    bar = tqdm(total=len(rows) * num_samples, desc=f"sampled completions (T={temperature:g})", unit="completion",
               disable=not progress)
    with contextlib.ExitStack() as stack:
        stack.enter_context(bar)
        if seed is not None:
            # the caller's RNG is left as it was
            stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
            torch.manual_seed(seed)
        for first in range(0, len(rows), sample_batch_size):
            chunk = rows[first : first + sample_batch_size]  # sample_batch_size * num_samples rows a call
            kwargs = {}
            if recorder is not None:
                recorder.reset()  # one generate call per recording
                kwargs["logits_processor"] = [recorder]
            out = score_model(model, tokenizer, chunk, scorer, generation_config, num_samples, chat_template_kwargs,
                              engine=engine, **kwargs)
            rewards = out.rewards_per_func.view(len(chunk), num_samples, -1)  # (prompts, samples, reward functions)
            per_func.append(rewards)
            # NaN (a None reward) is not correct
            correct.extend(int(c) for c in (rewards[..., -1].nan_to_num(0.0) > success_threshold).sum(dim=1))
            if recorder is not None:
                entropy = mean_completion_entropy(recorder, out.completion_ids)
                entropy_sum += entropy["sum"]  # sums and counts: they add up over chunks and processes
                entropy_tokens += entropy["num_tokens"]
            bar.update(len(out.completions))
    width = len(scorer.names)
    return {
        # no rows: an empty tensor of the right shape
        "rewards_per_func": torch.cat(per_func) if per_func else torch.empty(0, num_samples, width),
        "correct": correct,
        "token_entropy": entropy_sum / entropy_tokens if entropy_tokens else math.nan,
        "token_entropy_sum": entropy_sum,
        "token_entropy_tokens": entropy_tokens,
    }


def evaluate_policy(
    model,
    tokenizer,
    rows: Sequence[dict],
    reward_funcs,
    max_new_tokens: int,
    num_samples: int = 16,
    pass_k: Sequence[int] = (1, 2, 4, 8, 16),
    temperature: float = 1.0,
    top_p: float = 1.0,
    base_model=None,
    off_task_prompts: Sequence | None = None,
    kl_max_new_tokens: int = 16,
    kl_num_samples: int = 1,
    batch_size: int = 50,
    sample_batch_size: int | None = None,
    seed: int = 0,
    success_threshold: float = 0.5,
    chat_template_kwargs: dict | None = None,
    progress: bool = True,
) -> dict:
    r"""Every figure the recipes compare arms by, for one policy on one split.

    - ``accuracy_greedy``: :func:`greedy_accuracy`.
    - ``pass@k``: Chen et al. 2021 (arXiv 2107.03374, Sec. 2.1), :func:`~trl_es.analysis.mean_pass_at_k`, over
      ``num_samples`` completions per prompt at ``temperature`` and ``top_p``.
    - ``js_succ``: :math:`h(\bar p) - \frac{1}{P}\sum_j h(p_j)` in nats over the prompts' success rates :math:`p_j`
      (:func:`~trl_es.analysis.success_diversity`, arXiv 2608.27351), in ``[0, \ln 2]``.
    - ``token_entropy``: mean entropy (nats) of ``softmax(logits / temperature)`` at the sampled tokens, EOS included.
    - with ``base_model``: ``drift_l2``, ``drift_relative`` (:func:`~trl_es.analysis.parameter_drift`); with
      ``off_task_prompts`` too: ``off_task_kl`` (:func:`~trl_es.analysis.off_task_kl`, ``kl_*`` its sampling).

    Args:
        rows (`Sequence[dict]`): The split's rows; at least one.
        num_samples (`int`): Sampled completions per prompt; 0 skips every sampled figure.
        pass_k (`Sequence[int]`): The ``k`` of ``pass@k``, each in ``[1, num_samples]``.
        batch_size, sample_batch_size (`int`): Prompts per greedy / sampled ``generate`` call.
        seed (`int`): Seed of the sampling and the KL, inside ``torch.random.fork_rng``.

    Returns:
        `dict`: ``num_prompts``, ``accuracy_greedy``; with samples ``num_samples``, ``temperature``, ``top_p``,
        ``pass@k`` per ``k``, ``js_succ``, ``token_entropy``, ``token_entropy_tokens``, ``correct_per_prompt``; the
        drift and KL keys above.

    Raises:
        ValueError: if ``rows`` is empty, ``num_samples < 0``, a ``k`` is outside ``[1, num_samples]``, or
            ``temperature <= 0`` with ``num_samples > 0``.
    """
    from ..rollout import build_generation_config

    if not rows:
        raise ValueError("evaluate_policy needs at least one row.")
    check_sampling(temperature, top_p, num_samples, pass_k, allow_no_samples=True)  # num_samples = 0: greedy only
    rows = list(rows)
    report = {"num_prompts": len(rows)}
    report["accuracy_greedy"] = greedy_accuracy(model, tokenizer, rows, reward_funcs, max_new_tokens, batch_size,
                                                success_threshold, chat_template_kwargs, progress)
    if num_samples:
        # its end-of-turn ids end the completions
        config = build_generation_config(tokenizer, max_new_tokens, temperature=temperature, top_p=top_p,
                                         model_generation_config=getattr(model, "generation_config", None))
        sampled = sample_policy(model, tokenizer, rows, reward_funcs, config, num_samples, sample_batch_size,
                                seed=seed, success_threshold=success_threshold,
                                chat_template_kwargs=chat_template_kwargs, progress=progress)
        correct = sampled["correct"]
        report.update(num_samples=num_samples, temperature=float(temperature), top_p=float(top_p))
        for k in sorted(set(pass_k)):  # pass@1 is the sampled accuracy
            report[f"pass@{k}"] = mean_pass_at_k(num_samples, correct, k)
        # members are the prompts: one policy's i.i.d. samples have no population
        report["js_succ"] = success_diversity([c / num_samples for c in correct])
        report["token_entropy"] = sampled["token_entropy"]
        report["token_entropy_tokens"] = sampled["token_entropy_tokens"]
        report["correct_per_prompt"] = correct
    if base_model is not None:
        drift = parameter_drift(model, base_model, per_group=False)  # the whole model's drift only
        report["drift_l2"], report["drift_relative"] = drift["l2"], drift["relative"]
        if off_task_prompts:
            # completions sampled from the policy at temperature 1
            kl = off_task_kl(model, base_model, tokenizer, list(off_task_prompts), max_new_tokens=kl_max_new_tokens,
                             num_samples=kl_num_samples, seed=seed)
            report["off_task_kl"] = kl["kl"]
    return report
