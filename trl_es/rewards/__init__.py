"""Rewards in one place: the verifiable reward pieces, reward-function names, scoring and the scored rollout result.

- :mod:`.verifiable`: completion text, answer extraction, number parsing and comparison, the format reward.
- :mod:`.names`: distinct, readable names for reward functions (the keys of every per-function metric).
- :mod:`.scoring`: :class:`RewardScorer` (reward functions and models, sync and async, their outputs checked).
- :mod:`.result`: :class:`RolloutResult`, a rollout's completions with their rewards.
"""

from .names import base_reward_func_name, reward_func_names
from .result import RolloutResult
from .scoring import RewardScorer, async_reward_loop, await_all, is_async_reward_func
from .verifiable import (
    ABS_TOL,
    MAX_INT_DIGITS,
    REL_TOL,
    completion_text,
    dataset_column,
    extract_answer_tag,
    extract_boxed,
    find_number_spans,
    find_numbers,
    first_number,
    format_reward,
    last_number,
    numbers_close,
    parse_number,
    think_answer_format_score,
)


__all__ = [
    "ABS_TOL",
    "MAX_INT_DIGITS",
    "REL_TOL",
    "RewardScorer",
    "RolloutResult",
    "async_reward_loop",
    "await_all",
    "base_reward_func_name",
    "completion_text",
    "dataset_column",
    "extract_answer_tag",
    "extract_boxed",
    "find_number_spans",
    "find_numbers",
    "first_number",
    "format_reward",
    "is_async_reward_func",
    "last_number",
    "numbers_close",
    "parse_number",
    "reward_func_names",
    "think_answer_format_score",
]
