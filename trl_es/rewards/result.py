"""The result of a rollout: one model's completions on prompt rows and their rewards, in named fields.

Made by :func:`trl_es.rollout.score_model` and :class:`trl_es.agents.AgentRollout`; read by
:class:`trl_es.es.fitness.MemberScores`, the completion logs and ``ESTrainer.evaluate``.
"""

# It sits with the rewards (below rollout and es/) so that the ES fitness reads it without importing generation.

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


__all__ = ["RolloutResult"]


@dataclass
class RolloutResult:
    """``n`` completions (a prompt row's ``num_generations`` consecutive) with their rewards.

    Attributes:
        rewards_per_func (`torch.Tensor`): ``(n, F)`` float32; NaN for ``None`` and invalid values.
        invalid (`torch.Tensor`): ``(n, F)`` bool: a returned NaN or +-inf.
        rewards (`torch.Tensor`): ``(n,)`` float64, ``RewardScorer.weighted``; NaN when a completion has none.
        completions, completion_ids (`list[str]`, `list[list[int]]`): Texts and token ids, tool turns included.
        prompts, reward_completions (`list`): Per completion, the prompt and completion the rewards saw (text or
            messages).
        completion_lengths, prompt_lengths (`list[int]`): Per completion, the model's tokens (no tool turns) and
            the prompt's (no padding).
        terminated (`list[bool]`): Per completion, it ended with a stop (EOS) or pad id.
        tool_calls, tool_failures (`int`): Tool calls made and failed (agent rollouts; else 0).
        seconds (`float`): Wall-clock seconds of the call.
    """

    rewards_per_func: torch.Tensor
    invalid: torch.Tensor
    rewards: torch.Tensor
    completions: list[str]
    completion_ids: list[list[int]]
    prompts: list  # an environment's prompt after reset
    reward_completions: list  # messages for conversational prompts: an agent's whole multi-turn completion
    completion_lengths: list[int]
    prompt_lengths: list[int]  # as the engines tokenize the prompt
    terminated: list[bool]  # GRPOTrainer's test for a completion not clipped at max_completion_length
    tool_calls: int = 0
    tool_failures: int = 0
    seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        """Completion tokens the model generated."""
        return sum(self.completion_lengths)

    def mask_truncated(self) -> RolloutResult:
        """``mask_truncated_completions``: a copy whose ``rewards`` are NaN where not :attr:`terminated`."""
        # rewards_per_func is kept: the per-function metrics count every completion
        ended = torch.tensor(self.terminated, dtype=torch.bool)
        return dataclasses.replace(self, rewards=torch.where(ended, self.rewards, torch.full_like(self.rewards,
                                                                                                  math.nan)))

    def split_member_rows(self, num_members: int) -> list[RolloutResult]:
        """One result per stacked member, from ``num_members`` equal consecutive blocks of rows; ``seconds`` split.

        Raises:
            ValueError: if the completions do not split into ``num_members`` equal blocks.
        """
        total = len(self.completions)
        if num_members < 1 or total % num_members:
            raise ValueError(f"{total} completions do not split into the rows of {num_members} members.")
        if num_members == 1:
            return [self]
        width = total // num_members  # completions per member
        parts = []
        for k in range(num_members):
            rows = slice(k * width, (k + 1) * width)
            parts.append(RolloutResult(  # tool counts left at 0: agent rollouts have one member a call
                **{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                   if f.name not in ("tool_calls", "tool_failures", "seconds")},
                seconds=self.seconds / num_members,
            ))
        return parts
