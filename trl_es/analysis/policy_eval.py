"""One trained policy, measured the way the ES-vs-GRPO recipes compare arms: accuracy, pass@k, diversity, drift."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from .diversity import success_diversity
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
    """Prompts per sampled ``generate`` call for ``sample_batch_size=None``.

    ``SAMPLE_ROWS_PER_CALL // num_samples`` prompts (about 128 rows a call: 8 prompts at 16 samples), and one prompt a
    call once its samples fill half a call (``num_samples >= 64``): then every row of the call shares the whole
    prompt, which the eager engine computes once. On the 2-core CPU (``benchmarks/eval_speed.py``, SmolLM2-135M, 12
    new tokens, one run each): 16 samples, completions/s at 1 / 4 / 8 / 16 / 24 prompts a call: 10.4 / 14.9 / 17.5 /
    15.6 / 12.5; 64 samples, at 1 / 2 / 8 prompts: 19.9 / 17.2 / 12.3.

    Args:
        num_samples (`int`): Completions per prompt, ``>= 1``.

    Returns:
        `int`: ``>= 1``.

    Raises:
        ValueError: if ``num_samples`` is not an integer ``>= 1``.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}.")
    if 2 * num_samples >= SAMPLE_ROWS_PER_CALL:
        return 1
    return SAMPLE_ROWS_PER_CALL // num_samples


def _scorer(reward_funcs):
    from ..rewards import RewardScorer

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
    """Greedy accuracy: the fraction of prompts whose greedy completion scores above ``success_threshold``.

    A completion is correct when the **last** reward function (the task's answer reward, as ``trl-es eval`` reads it)
    gives more than ``success_threshold``. Generation: :func:`trl_es.rollout.score_model` with the eager
    engine and a shared prompt prefix, ``batch_size`` prompts per ``generate`` call.

    Args:
        model (`nn.Module`): The policy (a causal LM).
        tokenizer (`PreTrainedTokenizerBase`): Its tokenizer (with a pad token).
        rows (`Sequence[dict]`): Dataset rows (``prompt`` and the columns the reward functions read); at least one.
        reward_funcs (`Callable | list`): TRL-style reward functions; the last one decides correctness.
        max_new_tokens (`int`): New tokens per completion.
        batch_size (`int`): Prompts per ``generate`` call.
        success_threshold (`float`): Correct when the answer reward is above this.
        chat_template_kwargs (`dict`, *optional*): For conversational prompts.
        progress (`bool`): Show a tqdm bar of completions done / total (stderr).

    Returns:
        `float`: In ``[0, 1]``.

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
    correct = 0
    with tqdm(total=len(rows), desc="greedy completions", unit="completion", disable=not progress) as bar:
        for first in range(0, len(rows), batch_size):
            out = score_model(model, tokenizer, rows[first : first + batch_size], scorer, config, 1,
                              chat_template_kwargs, engine=engine)
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
    r"""Sample ``num_samples`` completions per prompt, score them, and record their token entropy: the sampled pass of
    :func:`evaluate_policy`, ``trl-es eval`` and the race's entropy curve.

    Generation is training's eager engine with the shared prompt prefix computed once
    (:class:`trl_es.generation.EagerEngine`, ``share_prompt_prefix=True``) through :func:`trl_es.rollout.score_model`,
    each token drawn by :class:`trl_es.generation.sampling.CandidateSampler` (``candidate_sampling``, default: the
    distribution of transformers' sampling without its ``multinomial`` over the vocabulary; other draws for a seed),
    ``sample_batch_size`` prompts (``sample_batch_size * num_samples`` rows) per ``generate`` call; with 1 prompt per
    call its ``num_samples`` rows share the whole prompt but its last token (fewer FLOPs; with few samples, narrow
    and slow calls on the CPU). ``None``, the default, is :func:`auto_sample_batch_size`: about
    :data:`SAMPLE_ROWS_PER_CALL` rows a call, one prompt a call from 64 samples on. With ``record_entropy`` a
    :class:`trl_es.analysis.entropy.TokenEntropyRecorder` at ``generation_config.temperature`` records the entropy
    (nats) of the sampling distribution at every completion token up to and including EOS (before any top-p cut;
    it reads the scores and does not change the sampled tokens).

    Args:
        model (`nn.Module`): The policy (a causal LM).
        tokenizer (`PreTrainedTokenizerBase`): Its tokenizer (with a pad token).
        rows (`Sequence[dict]`): Dataset rows (``prompt`` and the columns the reward functions read); may be empty.
        reward_funcs (`Callable | list | RewardScorer`): TRL-style reward functions (or a ready
            :class:`trl_es.rewards.RewardScorer`); the last one decides correctness.
        generation_config (`GenerationConfig`): A sampling config (``do_sample=True``, ``temperature > 0``), e.g.
            :func:`trl_es.rollout.build_generation_config` with a temperature and the model's
            ``generation_config`` (so that its end-of-turn ids end the completions).
        num_samples (`int`): Completions per prompt, ``>= 1``.
        sample_batch_size (`int`, *optional*): Prompts per ``generate`` call, ``>= 1``; ``None`` (default):
            :func:`auto_sample_batch_size` (about :data:`SAMPLE_ROWS_PER_CALL` rows a call, one prompt a call from
            64 samples on).
        seed (`int`, *optional*): Seeds the sampling inside ``torch.random.fork_rng`` (the caller's RNG is left as it
            was); ``None`` samples from the current global RNG.
        success_threshold (`float`): A sample is correct when the last reward is above this (NaN: not correct).
        chat_template_kwargs (`dict`, *optional*): For conversational prompts.
        record_entropy (`bool`): Record the token entropy.
        progress (`bool`): A tqdm bar of completions done / total (stderr).
        candidate_sampling (`bool`): Draw tokens with :class:`trl_es.generation.sampling.CandidateSampler` (fast on
            a CPU); ``False``: transformers' own ``multinomial`` draws (other samples for the same seed).

    Returns:
        `dict`: ``rewards_per_func`` (float32 tensor ``(len(rows), num_samples, F)``, NaN for ``None`` rewards),
        ``correct`` (list of ``len(rows)`` ints: correct samples per prompt), ``token_entropy`` (mean, nats; NaN
        without tokens or ``record_entropy``), ``token_entropy_sum`` and ``token_entropy_tokens`` (they add up over
        processes).

    Raises:
        ValueError: if ``num_samples`` or ``sample_batch_size`` (not ``None``) is below 1, or the config does not
            sample.
    """
    from ..generation import EagerEngine
    from ..rewards import RewardScorer
    from ..rollout import score_model

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
    scorer = reward_funcs if isinstance(reward_funcs, RewardScorer) else _scorer(reward_funcs)
    engine = EagerEngine(share_prompt_prefix=True, candidate_sampling=candidate_sampling)
    recorder = TokenEntropyRecorder(temperature) if record_entropy else None
    per_func, correct, entropy_sum, entropy_tokens = [], [], 0.0, 0
    device = next(model.parameters()).device
    bar = tqdm(total=len(rows) * num_samples, desc=f"sampled completions (T={temperature:g})", unit="completion",
               disable=not progress)
    with contextlib.ExitStack() as stack:
        stack.enter_context(bar)
        if seed is not None:
            stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
            torch.manual_seed(seed)
        for first in range(0, len(rows), sample_batch_size):
            chunk = rows[first : first + sample_batch_size]
            kwargs = {}
            if recorder is not None:
                recorder.reset()
                kwargs["logits_processor"] = [recorder]
            out = score_model(model, tokenizer, chunk, scorer, generation_config, num_samples, chat_template_kwargs,
                              engine=engine, **kwargs)
            rewards = out.rewards_per_func.view(len(chunk), num_samples, -1)
            per_func.append(rewards)
            correct.extend(int(c) for c in (rewards[..., -1].nan_to_num(0.0) > success_threshold).sum(dim=1))
            if recorder is not None:
                entropy = mean_completion_entropy(recorder, out.completion_ids)
                entropy_sum += entropy["sum"]
                entropy_tokens += entropy["num_tokens"]
            bar.update(len(out.completions))
    width = len(scorer.names)
    return {
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

    - ``accuracy_greedy``: :func:`greedy_accuracy` (greedy Pass@1).
    - ``pass@k`` for each ``k`` in ``pass_k``: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, Sec.
      2.1), :func:`trl_es.analysis.mean_pass_at_k`, from ``num_samples`` completions per prompt sampled at
      ``temperature`` with nucleus ``top_p`` (no top-k truncation; the papers' protocol is
      :data:`trl_es.analysis.PAPER_PROTOCOL`). ``pass@1`` is the sampled accuracy.
    - ``js_succ``: :math:`\mathrm{JS}_{\text{succ}} = h(\bar p) - \frac{1}{P}\sum_j h(p_j)` in nats
      (:func:`trl_es.analysis.success_diversity`, arXiv 2608.27351) over the **prompts' success rates**
      :math:`p_j` (correct samples of prompt :math:`j` / ``num_samples``): the mutual information between which prompt
      is asked and whether a sample succeeds. 0 when every prompt is solved equally often; at most :math:`\ln 2`,
      when each prompt is solved always or never (a deterministic policy). The "members" of the population formula
      are the prompts here: a single policy has no population, and its i.i.d. samples are exchangeable, so rates
      per sample slot would only measure noise.
    - ``token_entropy``: the mean entropy (nats) of the sampling distribution at every sampled completion token, up
      to and including EOS (``softmax(logits / temperature)``, before the top-p cut)
      (:class:`trl_es.analysis.entropy.TokenEntropyRecorder`).
    - with ``base_model``: ``drift_l2``, ``drift_relative`` (:func:`trl_es.analysis.parameter_drift`); and with
      ``off_task_prompts`` too: ``off_task_kl`` (:func:`trl_es.analysis.off_task_kl`: completions sampled from the
      policy at temperature 1, ``kl_num_samples`` per prompt, ``kl_max_new_tokens`` tokens, seeded with ``seed``).

    Sampling is seeded with ``seed`` inside ``torch.random.fork_rng`` (the global RNG is left as it was); a
    completion is correct when the last reward function gives more than ``success_threshold``.

    Args:
        model (`nn.Module`): The policy.
        tokenizer (`PreTrainedTokenizerBase`): Its tokenizer (with a pad token).
        rows (`Sequence[dict]`): The split's rows; at least one.
        reward_funcs (`Callable | list`): TRL-style reward functions; the last one decides correctness.
        max_new_tokens (`int`): New tokens per completion (greedy and sampled).
        num_samples (`int`): Sampled completions per prompt; 0 skips every sampled figure.
        pass_k (`Sequence[int]`): The ``k`` of ``pass@k``, each in ``[1, num_samples]``.
        temperature (`float`): Sampling temperature, ``> 0``.
        top_p (`float`): Nucleus sampling threshold in ``(0, 1]`` (1: no truncation).
        base_model (`nn.Module`, *optional*): The model the policy was trained from (drift and KL reference).
        off_task_prompts (`Sequence`, *optional*): Prompts outside the task, for the KL.
        kl_max_new_tokens (`int`): New tokens per KL sample.
        kl_num_samples (`int`): KL samples per off-task prompt.
        batch_size (`int`): Prompts per greedy ``generate`` call.
        sample_batch_size (`int`, *optional*): Prompts per sampling ``generate`` call (``sample_batch_size *
            num_samples`` rows). ``None`` (default): :func:`auto_sample_batch_size`, about
            :data:`SAMPLE_ROWS_PER_CALL` rows a call, or one prompt at 64 samples or more. With 1 the engine's
            shared-prefix path computes the whole prompt once for its ``num_samples`` rows (all rows share it but
            its last token): about half the FLOPs on the arithmetic prompts, but at 16 samples narrow (16-row)
            calls, 0.6x the completions/s of 128-row calls on the 2-core CPU (docs/benchmarks.md).
        seed (`int`): Seed of the sampling.
        success_threshold (`float`): Correct when the answer reward is above this.
        chat_template_kwargs (`dict`, *optional*): For conversational prompts.
        progress (`bool`): Show tqdm bars of completions done / total (greedy, then sampled; stderr).

    Returns:
        `dict`: ``num_prompts``, ``accuracy_greedy``; with ``num_samples > 0`` also ``num_samples``,
        ``temperature``, ``top_p``, ``pass@k`` per ``k``, ``js_succ``, ``token_entropy``, ``token_entropy_tokens``
        (the sampled tokens it is averaged over), ``correct_per_prompt`` (list of ints); with ``base_model``
        ``drift_l2``, ``drift_relative``, and with ``off_task_prompts`` ``off_task_kl``.

    Raises:
        ValueError: if ``rows`` is empty, ``num_samples < 0``, a ``k`` is outside ``[1, num_samples]``, or
            ``temperature <= 0`` with ``num_samples > 0``.
    """
    from ..rollout import build_generation_config

    if not rows:
        raise ValueError("evaluate_policy needs at least one row.")
    check_sampling(temperature, top_p, num_samples, pass_k, allow_no_samples=True)
    rows = list(rows)
    report = {"num_prompts": len(rows)}
    report["accuracy_greedy"] = greedy_accuracy(model, tokenizer, rows, reward_funcs, max_new_tokens, batch_size,
                                                success_threshold, chat_template_kwargs, progress)
    if num_samples:
        config = build_generation_config(tokenizer, max_new_tokens, temperature=temperature, top_p=top_p,
                                         model_generation_config=getattr(model, "generation_config", None))
        sampled = sample_policy(model, tokenizer, rows, reward_funcs, config, num_samples, sample_batch_size,
                                seed=seed, success_threshold=success_threshold,
                                chat_template_kwargs=chat_template_kwargs, progress=progress)
        correct = sampled["correct"]
        report.update(num_samples=num_samples, temperature=float(temperature), top_p=float(top_p))
        for k in sorted(set(pass_k)):
            report[f"pass@{k}"] = mean_pass_at_k(num_samples, correct, k)
        report["js_succ"] = success_diversity([c / num_samples for c in correct])
        report["token_entropy"] = sampled["token_entropy"]
        report["token_entropy_tokens"] = sampled["token_entropy_tokens"]
        report["correct_per_prompt"] = correct
    if base_model is not None:
        drift = parameter_drift(model, base_model, per_group=False)
        report["drift_l2"], report["drift_relative"] = drift["l2"], drift["relative"]
        if off_task_prompts:
            kl = off_task_kl(model, base_model, tokenizer, list(off_task_prompts), max_new_tokens=kl_max_new_tokens,
                             num_samples=kl_num_samples, seed=seed)
            report["off_task_kl"] = kl["kl"]
    return report
