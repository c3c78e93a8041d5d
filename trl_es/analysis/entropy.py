"""Mean token entropy of sampled completions, recorded during generation (no extra forward pass)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor


__all__ = ["TokenEntropyRecorder", "mean_completion_entropy"]


class TokenEntropyRecorder(LogitsProcessor):
    r"""A ``transformers`` logits processor that records the entropy of every next-token distribution it sees.

    At each decoding step ``t`` it stores, for every row ``b``,

    .. math::
        H_{b,t} = -\sum_{v} p_{b,t}(v) \ln p_{b,t}(v), \qquad p_{b,t} = \mathrm{softmax}(s_{b,t} / T),

    in nats, where :math:`s_{b,t}` are the scores it receives and :math:`T` is ``temperature``, and returns the scores
    unchanged (sampling is not affected). Passed to ``generate(logits_processor=[recorder])``, it sits before
    ``generate``'s own warpers (transformers >= 5 appends temperature, top-k and top-p after the custom processors), so
    with ``temperature`` equal to the sampling temperature and no top-k / top-p truncation, :math:`p_{b,t}` is the
    distribution the token at step ``t`` was sampled from. Computed in float32 with ``log_softmax`` (exact at
    :math:`p = 0`).

    The row order is ``generate``'s: for :func:`trl_es.generation.generate_completions` with ``num_generations=n``,
    row ``i * n + j`` is sample ``j`` of prompt ``i``. Rows that already ended keep being scored by ``generate``;
    :func:`mean_completion_entropy` drops those steps.

    Args:
        temperature (`float`): ``T > 0``, the temperature the scores are divided by.

    Attributes:
        steps (`list[torch.Tensor]`): One float32 CPU tensor of shape ``(batch,)`` per decoding step.

    Raises:
        ValueError: if ``temperature <= 0``.
    """

    def __init__(self, temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        self.temperature = float(temperature)
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        # p ln p with p = 0 gives 0 * -inf = nan: xlogy-style masking keeps it at 0
        self.steps.append(-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(dim=-1).cpu())
        return scores

    def reset(self) -> None:
        """Forget the recorded steps (before the next ``generate`` call)."""
        self.steps = []


def mean_completion_entropy(
    recorder: TokenEntropyRecorder, completion_ids: Sequence[Sequence[int]]
) -> dict:
    """Mean of the recorded entropies over the generated tokens of every completion.

    Step ``t`` of row ``b`` counts when ``t < len(completion_ids[b])``: the tokens the completion holds, up to and
    including its first EOS (as :func:`trl_es.generation.generate_completions` cuts them), not the padding
    ``generate`` adds after a row ended.

    Args:
        recorder (`TokenEntropyRecorder`): After one ``generate`` call over ``len(completion_ids)`` rows.
        completion_ids (`Sequence[Sequence[int]]`): The completions' token ids, one list per row, in row order.

    Returns:
        `dict`: ``{"sum": float, "num_tokens": int, "mean": float}``; entropies in nats (``mean`` is ``nan`` when
        no token was generated). ``sum`` and ``num_tokens`` add up over several calls.

    Raises:
        ValueError: if the recorded batch size differs from ``len(completion_ids)``, or a completion is longer than
            the number of recorded steps.
    """
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
    mask = torch.arange(table.shape[1])[None, :] < lengths[:, None]
    total = float(table.double()[mask].sum())
    count = int(mask.sum())
    return {"sum": total, "num_tokens": count, "mean": total / count if count else float("nan")}
