"""The ES-vs-GRPO papers' Pass@K sampling protocol (arXiv 2608.27351): T = 0.6, top-p 0.95, K up to 64.

``trl-es eval``, the recipes and the race read :data:`PAPER_PROTOCOL` (and :data:`UNIT_TEMPERATURE_PROTOCOL`).
"""

from __future__ import annotations

from dataclasses import dataclass


__all__ = ["PAPER_PROTOCOL", "UNIT_TEMPERATURE_PROTOCOL", "SamplingProtocol", "check_sampling"]


def check_sampling(temperature: float, top_p: float, num_samples: int, pass_k, allow_no_samples: bool = False) -> None:
    """Check sampled Pass@K settings: ``temperature > 0``, ``top_p`` in ``(0, 1]``, ``num_samples >= 1`` (``>= 0`` with
    ``allow_no_samples``), ``pass_k`` non-empty and in ``[1, num_samples]``; nothing but ``top_p`` without samples.

    Raises:
        ValueError: naming the field and the allowed values.
    """
    least = 0 if allow_no_samples else 1
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < least:
        raise ValueError(f"num_samples must be an integer >= {least}, got {num_samples!r}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if num_samples == 0:  # no samples: no sampled figure to check
        return
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature}.")
    if not pass_k:
        raise ValueError("pass_k must hold at least one k to sample for, got none.")
    if any(not 1 <= k <= num_samples for k in pass_k):
        raise ValueError(f"every pass_k value must be in [1, num_samples={num_samples}], got {list(pass_k)}.")


@dataclass(frozen=True)
class SamplingProtocol:
    """How sampled completions are drawn (``temperature``, ``top_p``) and Pass@K read from them.

    Raises:
        ValueError: naming the field, for a value outside its range (:func:`check_sampling`).
    """

    temperature: float
    top_p: float  # nucleus threshold in (0, 1]; no top-k truncation
    num_samples: int  # completions per prompt: n of the unbiased estimator
    pass_k: tuple[int, ...]  # the K of Pass@K, each in [1, num_samples]

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.num_samples, self.pass_k)

    def with_samples(self, num_samples: int) -> SamplingProtocol:
        """The same protocol with ``num_samples`` per prompt and the powers of two ``K <= num_samples``."""
        # the powers of two up to num_samples
        ks = tuple(k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= num_samples)
        return SamplingProtocol(self.temperature, self.top_p, num_samples, ks)


#: The papers' evaluation: T = 0.6, top-p 0.95, 64 samples per prompt, K in 1, 2, 4, ..., 64.
PAPER_PROTOCOL = SamplingProtocol(temperature=0.6, top_p=0.95, num_samples=64, pass_k=(1, 2, 4, 8, 16, 32, 64))

#: The same at T = 1, no truncation (the sampling distribution itself).
UNIT_TEMPERATURE_PROTOCOL = SamplingProtocol(temperature=1.0, top_p=1.0, num_samples=64,
                                             pass_k=(1, 2, 4, 8, 16, 32, 64))
