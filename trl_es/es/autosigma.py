"""``sigma="auto"``: the noise scale chosen from a measured, scale-free effect of the members on their rollouts.

The effect of a sigma is the fraction of (member, completion) pairs whose greedy completion differs from the
center's (the unperturbed model's) on the same prompts: 0 when the members decode as the center does, 1 when every
completion changed. It means the same on every backend and model, where the number sigma does not (full-rank noise
in place moves a model more than rank-1 members at the same sigma). :class:`SigmaSearch` finds the sigma whose effect
is ``target`` from a few probes on the calibration's prompts (the first batch and drawn ones): it brackets the target
by factors of :data:`BRACKET_FACTOR` from :data:`START_SIGMA` (a re-calibration: from the sigma in use), halves the
bracket geometrically, and interpolates ``log sigma`` linearly between the bracket's ends. Every step is a function
of the measured counts only, so every process that sees the same counts (all-reduced) picks the same sigma. Nothing
here imports TRL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


SIGMA_AUTO = "auto"
START_SIGMA = 1e-3  # the paper's default (Qiu et al. 2025), where the search starts
BRACKET_FACTOR = 4.0  # each bracketing probe moves sigma by this factor
SIGMA_RANGE = (1e-6, 1.0)  # the search never probes outside it
MAX_PROBES = 8  # bracketing and bisection probes, at most
BISECTIONS = 2  # geometric halvings of the bracket once it is found
PROBE_MEMBERS = 8  # members of the first iteration that a probe rolls out (fewer if the population is smaller)


def _count_differing(center: Sequence, members: Sequence[Sequence], what: str, same) -> tuple[int, int]:
    """``(differ, total)`` of every member's values against the center's of the same row, ``same(a, b)`` comparing."""
    differ = total = 0
    for values in members:
        if len(values) != len(center):
            raise ValueError(f"a member has {len(values)} {what}, the center {len(center)}: the effect compares the "
                             "same rows.")
        differ += sum(not same(a, b) for a, b in zip(values, center, strict=True))
        total += len(center)
    return differ, total


def differing_completions(center: Sequence[Sequence[int]],
                          members: Sequence[Sequence[Sequence[int]]]) -> tuple[int, int]:
    """``(differ, total)``: of every member's completions (token ids, in the center's row order), how many differ from
    the center's completion of the same row.

    Raises:
        ValueError: if a member has not as many completions as the center.
    """
    return _count_differing(center, members, "completions", lambda a, b: list(a) == list(b))


def differing_rewards(center: Sequence[float], members: Sequence[Sequence[float]]) -> tuple[int, int]:
    """``(differ, total)``: of every member's rewards (in the center's row order), how many differ from the center's
    reward of the same row (two NaNs, no reward on either, are equal).

    Raises:
        ValueError: if a member has not as many rewards as the center.
    """
    return _count_differing(center, members, "rewards", lambda a, b: a == b or (math.isnan(a) and math.isnan(b)))


class SigmaSearch:
    """The deterministic probe sequence of ``sigma="auto"`` (see the module docstring).

    Use: ``while (sigma := search.next_sigma()) is not None: search.tell(sigma, effect(sigma))``, then
    :meth:`choice`.

    Args:
        target (`float`): The effect to reach, in ``(0, 1)``.
        start (`float`): The first probe.

    Raises:
        ValueError: for a target outside ``(0, 1)`` or a start outside :data:`SIGMA_RANGE`.
    """

    def __init__(self, target: float, start: float = START_SIGMA, max_probes: int = MAX_PROBES,
                 bisections: int = BISECTIONS):
        if not 0 < target < 1:
            raise ValueError(f"sigma_target must be in (0, 1) (a fraction of completions), got {target!r}.")
        if not SIGMA_RANGE[0] <= start <= SIGMA_RANGE[1]:
            raise ValueError(f"the first sigma probe must be in {SIGMA_RANGE}, got {start!r}.")
        self.target, self.start, self.max_probes, self.bisections = float(target), float(start), max_probes, bisections
        self.probes: list[tuple[float, float]] = []  # (sigma, effect), in probe order
        self._bracketed_at: int | None = None  # probes made when the target was first bracketed

    def _bracket(self) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
        """The probes just below (effect < target) and at or above the target, nearest in sigma."""
        below = [p for p in self.probes if p[1] < self.target]
        above = [p for p in self.probes if p[1] >= self.target]
        low = max(below, key=lambda p: p[0]) if below else None
        high = min(above, key=lambda p: p[0]) if above else None
        return low, high

    def next_sigma(self) -> float | None:
        """The next sigma to probe, or ``None`` when the search is done."""
        if not self.probes:
            return self.start
        if len(self.probes) >= self.max_probes:
            return None
        low, high = self._bracket()
        if low is None or high is None:  # no bracket yet: step toward the target
            last = self.probes[-1]
            sigma = last[0] * BRACKET_FACTOR if last[1] < self.target else last[0] / BRACKET_FACTOR
            return sigma if SIGMA_RANGE[0] <= sigma <= SIGMA_RANGE[1] else None
        if low[0] >= high[0]:  # the effect fell as sigma rose (a noisy count): stop, choice() takes the nearest
            return None
        if self._bracketed_at is None:
            self._bracketed_at = len(self.probes)
        if len(self.probes) - self._bracketed_at >= self.bisections:
            return None
        return math.sqrt(low[0] * high[0])  # geometric midpoint

    def tell(self, sigma: float, effect: float) -> None:
        """Record the effect measured at ``sigma``."""
        self.probes.append((float(sigma), float(effect)))

    def choice(self) -> float:
        """The sigma whose effect is the target: ``log sigma`` interpolated between the bracket's ends, or, without a
        bracket, the probe nearest the target.

        Raises:
            ValueError: if nothing was probed.
        """
        if not self.probes:
            raise ValueError("SigmaSearch.choice needs at least one probe.")
        low, high = self._bracket()
        if low is None or high is None or low[0] >= high[0] or high[1] <= low[1]:
            # ties: the probe nearest the target's side (the largest sigma below it, the smallest above)
            return min(self.probes, key=lambda p: (abs(p[1] - self.target), -p[0] if p[1] < self.target else p[0]))[0]
        fraction = (self.target - low[1]) / (high[1] - low[1])
        return math.exp(math.log(low[0]) + fraction * (math.log(high[0]) - math.log(low[0])))
