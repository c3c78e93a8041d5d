"""Sampling the next token without ``torch.multinomial`` over the vocabulary (slow on a CPU, docs/benchmarks.md): the
same distribution, drawn in a logits processor under greedy decoding.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, LogitsProcessor, TopPLogitsWarper

from .top_p import nucleus_among_candidates, swap_is_safe


__all__ = ["CandidateSampler", "use_candidate_sampler"]


class CandidateSampler(LogitsProcessor):
    r"""Draws each row's next token from ``softmax(scores / temperature)`` truncated to its top-p nucleus (Holtzman
    et al. 2020, arXiv 1904.09751, Eq. 3) by inverse transform sampling, and returns the draw as scores.

    With the kept probabilities :math:`q_1, \dots, q_n` of a row and one :math:`u \sim U[0, 1)`, the token is the
    first :math:`j` with :math:`\sum_{i \le j} q_i > u \sum_i q_i`. A seed gives other samples than
    ``do_sample=True`` (the same distribution). The last processor of a greedy ``generate``
    (:func:`use_candidate_sampler`): scores are ``0`` at the drawn token, ``-inf`` elsewhere.

    Raises:
        ValueError: for ``temperature <= 0``, ``top_p`` outside ``(0, 1]`` or ``candidates < 1`` (tokens searched for
            the nucleus before the fallback).
    """

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, candidates: int = 256):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}.")
        self.temperature, self.top_p, self.candidates = float(temperature), float(top_p), int(candidates)
        self.fallback_rows = 0  # rows whose nucleus was not among the candidates (for tests and tuning)

    def draw(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.LongTensor:
        """The drawn token of every row, int64 of shape ``(batch,)``.

        Raises:
            ValueError: for a row whose kept probabilities are not finite or sum to 0 (NaN or all ``-inf`` scores),
                as transformers' ``multinomial`` refuses them.
        """
        z = scores.float() / self.temperature
        # one uniform per row, whichever path the row takes
        # float64: over a 49,152-token vocabulary a float32 cumsum stops growing below p ~ 3e-8
        u = torch.rand(z.shape[0], 1, device=z.device, dtype=torch.float64)
        tokens = torch.empty(z.shape[0], dtype=torch.long, device=z.device)
        pending = torch.ones(z.shape[0], dtype=torch.bool, device=z.device)
        if self.top_p < 1:  # the nucleus among the candidates, as CandidateTopPLogitsWarper finds it
            indices, probs, keep, pending = nucleus_among_candidates(z, self.top_p, self.candidates)
            kept = (probs.double() * keep).cumsum(dim=-1)
            _check_mass(kept[~pending, -1])
            j = torch.searchsorted(kept, u * kept[:, -1:], right=True).clamp_(max=indices.shape[-1] - 1)
            tokens = indices.gather(1, j).squeeze(1)
            self.fallback_rows += int(pending.sum())
        if pending.any():  # the rest through TopPLogitsWarper itself (top_p = 1: the whole vocabulary)
            rows = pending.nonzero(as_tuple=True)[0]
            full = z[rows]
            if self.top_p < 1:
                full = TopPLogitsWarper(self.top_p)(input_ids[rows], full)
            kept = full.double().softmax(dim=-1).cumsum(dim=-1)
            _check_mass(kept[:, -1])
            j = torch.searchsorted(kept, u[rows] * kept[:, -1:], right=True).clamp_(max=z.shape[-1] - 1)
            tokens[rows] = j.squeeze(1)
        return tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tokens = self.draw(input_ids, scores)
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(1, tokens[:, None], 0.0)


def _check_mass(total: torch.Tensor) -> None:
    """Refuse rows whose kept probability mass is NaN, infinite or 0 (transformers' ``multinomial`` raises too)."""
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("CandidateSampler: a row's probabilities contain NaN or inf, or sum to 0 (scores that are "
                         "NaN or all -inf); transformers' sampling refuses such rows too.")


def use_candidate_sampler(generation_config: GenerationConfig, generate_kwargs: dict, candidates: int = 256,
                          model=None) -> tuple[GenerationConfig, dict]:
    """Swap transformers' sampling (temperature, top-p, ``multinomial``) for :class:`CandidateSampler` under greedy
    decoding, where the sampled distribution is the same.

    Applies where :func:`trl_es.generation.top_p.use_candidate_top_p` would (also at an explicit ``top_p = 1``),
    with one return sequence and nothing that reads the scores after the sampler; otherwise both come back unchanged.

    Returns:
        `(GenerationConfig, dict)`: The config and keyword arguments to give ``generate`` (on ``model``).
    """
    top_p = generation_config.top_p
    if top_p is None or not 0 < top_p <= 1 or not swap_is_safe(generation_config, generate_kwargs, model):
        return generation_config, generate_kwargs
    configs = [c for c in (generation_config, getattr(model, "generation_config", None)) if c is not None]
    # greedy decoding refuses several return sequences; a penalty_alpha would turn it into contrastive search
    if any((getattr(c, "num_return_sequences", None) or 1) != 1 or getattr(c, "penalty_alpha", None)
           for c in configs) or "num_return_sequences" in generate_kwargs or "penalty_alpha" in generate_kwargs:
        return generation_config, generate_kwargs
    reads_scores = ("output_scores", "output_logits", "renormalize_logits")  # they would read the draw
    if any(getattr(c, "watermarking_config", None) is not None or any(getattr(c, name, False) for name in reads_scores)
           for c in configs) or any(generate_kwargs.get(name) for name in (*reads_scores, "watermarking_config")):
        return generation_config, generate_kwargs
    config = copy.deepcopy(generation_config)
    temperature = config.temperature
    config.do_sample, config.temperature, config.top_p = False, None, None  # top_k stays 0 (explicit, not refilled)
    kwargs = dict(generate_kwargs)
    processors = list(kwargs.get("logits_processor") or [])
    # after any custom processor (an entropy recorder still sees the untruncated scores)
    kwargs["logits_processor"] = [*processors, CandidateSampler(temperature, top_p, candidates)]
    return config, kwargs
