"""Nucleus (top-p) sampling without sorting the vocabulary: the same tokens as transformers' ``TopPLogitsWarper``.

``TopPLogitsWarper`` sorts every row's whole vocabulary at every step, which dominates sampling on a CPU
(docs/benchmarks.md).
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, LogitsProcessor, TopPLogitsWarper


__all__ = ["CandidateTopPLogitsWarper", "nucleus_among_candidates", "use_candidate_top_p"]

#: Generation settings that, passed to ``generate`` as keyword arguments, would override the config's sampling.
_SAMPLING_KEYS = frozenset({"do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff",
                            "eta_cutoff", "top_h", "num_beams"})


class CandidateTopPLogitsWarper(LogitsProcessor):
    r"""Top-p on ``softmax(scores / temperature)`` (Holtzman et al. 2020, arXiv 1904.09751, Eq. 3), found among the
    ``candidates`` largest scores.

    With the probabilities :math:`d_1 \ge d_2 \ge \dots` of a row, token :math:`j` is kept when
    :math:`\sum_{k<j} d_k < \text{top\_p}` (``TopPLogitsWarper``'s rule; equal up to float32 rounding and ties).
    Runs before transformers' temperature warper: returns the input scores, ``-inf`` outside the nucleus.

    Raises:
        ValueError: for ``top_p`` outside ``(0, 1)``, ``temperature <= 0`` or ``candidates < 1`` (tokens searched
            before the fallback).
    """

    def __init__(self, top_p: float, temperature: float = 1.0, candidates: int = 256):
        if not 0 < top_p < 1:
            raise ValueError(f"top_p must be in (0, 1), got {top_p}.")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}.")
        self.top_p, self.temperature, self.candidates = float(top_p), float(temperature), int(candidates)
        self.fallback_rows = 0  # rows whose nucleus was not among the candidates (for tests and tuning)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        z = scores.float() / self.temperature  # the temperature warper runs after us: divide here to find the nucleus
        indices, probs, keep, missed = nucleus_among_candidates(z, self.top_p, self.candidates)
        out = torch.full_like(scores, -float("inf"))
        out.scatter_(1, indices, torch.where(keep, scores.gather(1, indices), out.gather(1, indices)))
        if missed.any():  # the candidates hold less than top_p: TopPLogitsWarper itself
            self.fallback_rows += int(missed.sum())
            rows = missed.nonzero(as_tuple=True)[0]
            removed = torch.isinf(TopPLogitsWarper(self.top_p)(input_ids[rows], z[rows])) & ~torch.isinf(z[rows])
            out[rows] = scores[rows].masked_fill(removed, -float("inf"))
        return out


def nucleus_among_candidates(z: torch.Tensor, top_p: float, candidates: int):
    """The top-p nucleus of ``softmax(z)`` (``z``: float32 ``(batch, vocab)``, divided by the temperature) among the
    ``candidates`` largest entries of each row: ``indices`` (int64 ``(batch, k)``, by decreasing probability),
    ``probs`` (float32, under the full softmax), ``keep`` (bool, in the nucleus) and ``missed`` (bool ``(batch,)``:
    the candidates hold less than ``top_p``, the row is not settled)."""
    k = min(candidates, z.shape[-1])
    values, indices = z.topk(k, dim=-1)
    probs = (values - torch.logsumexp(z, dim=-1, keepdim=True)).exp()
    cumulative = probs.cumsum(dim=-1)
    keep = (cumulative - probs) < top_p  # the mass strictly before the token
    # a token outside the candidates of a row they cover has >= top_p before it: the nucleus is exact
    keep[:, 0] = True
    return indices, probs, keep, cumulative[:, -1] < top_p


def use_candidate_top_p(generation_config: GenerationConfig, generate_kwargs: dict, candidates: int = 256,
                        model=None) -> tuple[GenerationConfig, dict]:
    """Swap transformers' top-p for :class:`CandidateTopPLogitsWarper` where it gives the same tokens.

    Applies only where :func:`swap_is_safe` and ``0 < top_p < 1``; otherwise both come back unchanged.

    Returns:
        `(GenerationConfig, dict)`: The config and keyword arguments to give ``generate`` (on ``model``).
    """
    top_p, temperature = generation_config.top_p, generation_config.temperature
    if top_p is None or not 0 < top_p < 1 or not swap_is_safe(generation_config, generate_kwargs, model):
        return generation_config, generate_kwargs
    config = copy.deepcopy(generation_config)
    config.top_p = 1.0  # the warper, appended after any custom processor, does top-p
    kwargs = dict(generate_kwargs)
    processors = list(kwargs.get("logits_processor") or [])
    kwargs["logits_processor"] = [*processors, CandidateTopPLogitsWarper(top_p, temperature, candidates)]
    return config, kwargs


def swap_is_safe(generation_config: GenerationConfig, generate_kwargs: dict, model=None) -> bool:
    """Whether transformers would sample with exactly temperature then top-p (the settings a swap replaces)."""
    temperature = generation_config.temperature
    # top_k explicitly 0: an unset one becomes transformers' default of 50
    if not generation_config.do_sample or temperature is None or not temperature > 0 or generation_config.top_k != 0:
        return False
    if (generation_config.num_beams or 1) != 1 or _SAMPLING_KEYS & set(generate_kwargs):  # kwargs override config
        return False
    configs = [generation_config, getattr(model, "generation_config", None)]  # the model's fill the unset ones
    return not any(_sets_other_warper(config) for config in configs if config is not None)


def _sets_other_warper(config: GenerationConfig) -> bool:
    """Whether ``config`` turns on a warper that transformers runs between temperature and top-p or after it."""
    if getattr(config, "top_h", None) is not None or getattr(config, "min_p", None) is not None:
        return True
    typical = getattr(config, "typical_p", None)
    cutoffs = (getattr(config, "epsilon_cutoff", None), getattr(config, "eta_cutoff", None))
    return (typical is not None and typical < 1.0) or any(c is not None and 0 < c < 1 for c in cutoffs)
