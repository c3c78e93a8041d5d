"""The pieces reward functions are written with, and their names.

- :mod:`.verifiable`: completion text, answer extraction, number parsing and comparison, the format reward.
- :mod:`.names`: distinct, readable names for reward functions (the keys of every per-function metric).

Calling reward functions on completions (:class:`~trl_es.rollout.RewardScorer`) and the scored result
(:class:`~trl_es.rollout.RolloutResult`) are part of the rollout (:mod:`trl_es.rollout`).
"""

from .names import base_reward_func_name, reward_func_names
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
    "base_reward_func_name",
    "completion_text",
    "dataset_column",
    "extract_answer_tag",
    "extract_boxed",
    "find_number_spans",
    "find_numbers",
    "first_number",
    "format_reward",
    "last_number",
    "numbers_close",
    "parse_number",
    "reward_func_names",
    "think_answer_format_score",
]
