"""Mean token entropy of sampled completions, recorded during generation (no extra forward pass)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor


__all__ = ["TokenEntropyRecorder", "mean_completion_entropy"]


class TokenEntropyRecorder(LogitsProcessor):
    r"""A ``transformers`` logits processor that records the entropy (nats) of every next-token distribution it sees.

    .. math::
        H_{b,t} = -\sum_{v} p_{b,t}(v) \ln p_{b,t}(v), \qquad p_{b,t} = \mathrm{softmax}(s_{b,t} / T)

    Use as ``generate(logits_processor=[recorder])``, with ``temperature`` the sampling temperature ``T > 0``
    (``ValueError`` otherwise); :attr:`steps` holds one float32 CPU tensor ``(batch,)`` per step.
    """

    def __init__(self, temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        self.temperature = float(temperature)
        self.steps: list[torch.Tensor] = []  # one (batch,) float32 CPU tensor per decoding step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # before generate's own warpers: the distribution sampled from
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        # p ln p with p = 0 gives 0 * -inf = nan: xlogy-style masking keeps it at 0
        self.steps.append(-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(dim=-1).cpu())
        return scores  # unchanged: sampling is not affected

    def reset(self) -> None:
        """Forget the recorded steps (before the next ``generate`` call)."""
        self.steps = []


def mean_completion_entropy(
    recorder: TokenEntropyRecorder, completion_ids: Sequence[Sequence[int]]
) -> dict:
    """Mean of the recorded entropies over each row's completion tokens (EOS included, padding after it not).

    Args:
        recorder (`TokenEntropyRecorder`): After one ``generate`` call over ``len(completion_ids)`` rows.
        completion_ids (`Sequence[Sequence[int]]`): The completions' token ids, one list per row, in row order.

    Returns:
        `dict`: ``{"sum": float, "num_tokens": int, "mean": float}`` in nats (``mean`` ``nan`` without tokens); ``sum``
        and ``num_tokens`` add up over calls.

    Raises:
        ValueError: if the recorded batch size differs from ``len(completion_ids)``, or a completion is longer than
            the number of recorded steps.
    """
    # tokens up to and including EOS, as generate_completions cuts them
    lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.long)
    if not recorder.steps:
        if int(lengths.sum()) > 0:
            raise ValueError("The recorder saw no decoding step, but the completions hold tokens.")
        return {"sum": 0.0, "num_tokens": 0, "mean": float("nan")}
    table = torch.stack(recorder.steps, dim=1)  # (batch, steps)
    if table.shape[0] != len(completion_ids):
        raise ValueError(f"The recorder saw {table.shape[0]} rows, but {len(completion_ids)} completions were given.")
    if int(lengths.max()) > table.shape[1]:
        raise ValueError(f"A completion has {int(lengths.max())} tokens, but only {table.shape[1]} steps were "
                         "recorded.")
    # generate keeps scoring rows that ended: those steps drop
    mask = torch.arange(table.shape[1])[None, :] < lengths[:, None]
    total = float(table.double()[mask].sum())  # float64 sum
    count = int(mask.sum())
    return {"sum": total, "num_tokens": count, "mean": total / count if count else float("nan")}
