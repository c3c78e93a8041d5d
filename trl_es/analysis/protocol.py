"""The sampling protocol of the ES-vs-GRPO papers' Pass@K evaluation, in one place.

The ES-vs-GRPO papers (the dynamics paper, arXiv 2608.27351) score sampled completions at temperature 0.6 with
nucleus sampling at top-p 0.95 and report Pass@K up to K = 64. ``trl-es eval`` takes its default sampling from
:data:`PAPER_PROTOCOL`; the recipes and the race read the same object (and :data:`UNIT_TEMPERATURE_PROTOCOL` for the
T = 1 figures beside it).
"""

from __future__ import annotations

from dataclasses import dataclass


__all__ = ["PAPER_PROTOCOL", "UNIT_TEMPERATURE_PROTOCOL", "SamplingProtocol", "check_sampling"]


def check_sampling(temperature: float, top_p: float, num_samples: int, pass_k, allow_no_samples: bool = False) -> None:
    """Check sampled Pass@K settings (shared by :class:`SamplingProtocol` and
    :func:`trl_es.analysis.evaluate_policy`).

    Args:
        temperature (`float`): Must be ``> 0`` (checked only when there are samples).
        top_p (`float`): Must be in ``(0, 1]``.
        num_samples (`int`): An integer ``>= 1`` (``>= 0`` with ``allow_no_samples``: 0 means no sampled figures).
        pass_k (`Sequence[int]`): Non-empty when there are samples, each in ``[1, num_samples]``.
        allow_no_samples (`bool`): Accept ``num_samples == 0``.

    Raises:
        ValueError: naming the field and the allowed values.
    """
    least = 0 if allow_no_samples else 1
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < least:
        raise ValueError(f"num_samples must be an integer >= {least}, got {num_samples!r}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if num_samples == 0:
        return
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature}.")
    if not pass_k:
        raise ValueError("pass_k must hold at least one k to sample for, got none.")
    if any(not 1 <= k <= num_samples for k in pass_k):
        raise ValueError(f"every pass_k value must be in [1, num_samples={num_samples}], got {list(pass_k)}.")


@dataclass(frozen=True)
class SamplingProtocol:
    """How sampled completions are drawn and Pass@K is read from them.

    Attributes:
        temperature (`float`): Sampling temperature, ``> 0``.
        top_p (`float`): Nucleus sampling threshold in ``(0, 1]`` (no top-k truncation).
        num_samples (`int`): Completions sampled per prompt (``n`` of the unbiased estimator).
        pass_k (`tuple[int, ...]`): The ``K`` of Pass@K, each in ``[1, num_samples]``.

    Raises:
        ValueError: naming the field, for a value outside its range.
    """

    temperature: float
    top_p: float
    num_samples: int
    pass_k: tuple[int, ...]

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.num_samples, self.pass_k)

    def with_samples(self, num_samples: int) -> SamplingProtocol:
        """The same protocol with ``num_samples`` per prompt and the powers of two ``K <= num_samples``."""
        ks = tuple(k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= num_samples)
        return SamplingProtocol(self.temperature, self.top_p, num_samples, ks)


#: The papers' evaluation: T = 0.6, top-p 0.95, 64 samples per prompt, K in 1, 2, 4, ..., 64.
PAPER_PROTOCOL = SamplingProtocol(temperature=0.6, top_p=0.95, num_samples=64, pass_k=(1, 2, 4, 8, 16, 32, 64))

#: The same at T = 1, no truncation (the sampling distribution itself; the recipes' earlier figures).
UNIT_TEMPERATURE_PROTOCOL = SamplingProtocol(temperature=1.0, top_p=1.0, num_samples=64,
                                             pass_k=(1, 2, 4, 8, 16, 32, 64))
