"""Verifiable rewards' pieces: completion text, answer extraction, number parsing and comparison.

Reward functions take TRL's signature, ``reward(prompts, completions, completion_ids=None, **kwargs) ->
list[float | None]``, with dataset columns as keyword lists of ``len(completions)``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from typing import Any


__all__ = [
    "ABS_TOL",
    "MAX_INT_DIGITS",
    "REL_TOL",
    "completion_text",
    "extract_answer_tag",
    "extract_boxed",
    "find_number_spans",
    "find_numbers",
    "first_number",
    "format_reward",
    "last_number",
    "numbers_close",
    "parse_number",
    "think_answer_format_score",
]

#: Default absolute tolerance of :func:`numbers_close`: Countdown's grader (Qiu et al. 2025, arXiv 2509.24372).
ABS_TOL = 1e-5
#: Default relative tolerance of :func:`numbers_close` (0: purely absolute, as in the paper).
REL_TOL = 0.0

# A number: optional sign, digits (optionally grouped by thousands commas), optional decimals.
# The sign counts only when it does not follow a word character or a closing bracket, so "10-3" reads as
# 10 and 3, while "x = -3" reads as -3. Digits glued to a previous digit, "." or "," are not a new number.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]])[-\u2212])?(?<![\d.,])(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?"
)
# A whole string that is one number: sign, thousands commas, decimals, exponent, or a leading ".5".
_FULL_NUMBER_RE = re.compile(r"[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|[-+\u2212]?\.\d+")


def completion_text(completion: str | Sequence[dict[str, Any]] | dict[str, Any]) -> str:
    """The text of one completion (a string, a message list or one message, TRL's standard or conversational
    format): the string, or the **last** assistant message's content ("" when there is none).

    Raises:
        TypeError: If ``completion`` is none of the forms above.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):  # one message
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        messages = list(completion)
        if not all(isinstance(m, dict) for m in messages):
            raise TypeError(
                "completion must be a string or a list of message dicts like "
                f"[{{'role': 'assistant', 'content': ...}}], got a list containing {type(messages[0]).__name__}"
            )
        for message in reversed(messages):  # with tool calls the final answer is the last assistant turn
            if message.get("role", "assistant") == "assistant":
                return _content_text(message.get("content"))
        return ""  # no assistant turn
    raise TypeError(
        "completion must be a string (standard format) or a list of messages (conversational format), "
        f"got {type(completion).__name__}"
    )


def _content_text(content: Any) -> str:
    # a content is a string or a list of parts [{"type": "text", "text": ...}]
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal parts: their text only
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    raise TypeError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _tag_blocks(text: str, open_tag: str, close_tag: str) -> list[str]:
    # Same result as re.findall(f"{open_tag}(.*?){close_tag}", text, re.DOTALL), in linear time (the regex is
    # quadratic on text with many unclosed open tags).
    blocks, pos = [], 0
    while True:
        start = text.find(open_tag, pos)
        if start == -1:
            return blocks
        end = text.find(close_tag, start + len(open_tag))
        if end == -1:
            return blocks
        blocks.append(text[start + len(open_tag) : end])
        pos = end + len(close_tag)


def extract_answer_tag(text: str) -> str | None:
    """The unstripped content of the **last** ``<answer>...</answer>`` block, or ``None``.

    Example::

        >>> extract_answer_tag("<answer>1</answer> no, <answer> 2 </answer>")
        ' 2 '
    """
    blocks = _tag_blocks(text, "<answer>", "</answer>")
    return blocks[-1] if blocks else None


def extract_boxed(text: str) -> str | None:
    r"""The content of the **last** ``\boxed{...}`` (braces matched: ``"\frac{1}{2}"``), or ``None`` if none closes."""
    if "\\boxed{" not in text:  # the common case, without the scan
        return None
    # One linear pass with a stack of open braces (no quadratic rescans on adversarial input).
    stack: list[int] = []  # content start for a \boxed{ brace, -1 for any other brace
    best_start, best = -1, None
    i, n = 0, len(text)
    while i < n:
        if text.startswith("\\boxed{", i):
            i += len("\\boxed{")
            stack.append(i)
            continue
        ch = text[i]
        if ch == "{":
            stack.append(-1)
        elif ch == "}" and stack:
            start = stack.pop()
            if start > best_start:  # the \boxed{ opened last wins, even when an earlier one closes after it
                best_start, best = start, text[start:i]
        i += 1
    return best


#: Digit strings longer than this are read as floats (``inf`` for huge ones): int() is quadratic in the length.
MAX_INT_DIGITS = 1000


def _to_number(token: str) -> int | float:
    # thousands commas dropped; U+2212 is the typographic minus
    token = token.replace(",", "").replace("\u2212", "-")
    if re.fullmatch(r"[-+]?\d+", token) and len(token) <= MAX_INT_DIGITS:
        return int(token)
    return float(token)  # decimals, or past MAX_INT_DIGITS: a float (inf for a huge one)


def find_numbers(text: str) -> list[int | float]:
    """Every number written in ``text``, in order: ``"1,234"``, ``"27.4"``; ``"10-3"`` gives ``[10, 3]``,
    ``"x = -3"`` gives ``[-3]``, ``"1/2"`` gives ``[1, 2]`` (no exponents, no fractions).

    Returns:
        `list[int | float]`: ``int`` without decimals, else ``float`` (also past :data:`MAX_INT_DIGITS` digits).
    """
    return [_to_number(m.group(0)) for m in _NUMBER_RE.finditer(text)]


def find_number_spans(text: str, limit: int | None = None) -> list[tuple[int | float, int, int]]:
    """The numbers of :func:`find_numbers` as ``(value, start, end)``, ``text[start:end]`` as written (sign included);
    the scan stops after ``limit`` numbers."""
    matches = _NUMBER_RE.finditer(text)
    if limit is not None:  # a lazy scan: the text past the limit is never read
        matches = itertools.islice(matches, limit)
    return [(_to_number(m.group(0)), m.start(), m.end()) for m in matches]


def first_number(text: str) -> int | float | None:
    """The first number of :func:`find_numbers`, or ``None``."""
    m = _NUMBER_RE.search(text)
    return _to_number(m.group(0)) if m else None


def last_number(text: str) -> int | float | None:
    """The last number of :func:`find_numbers`, or ``None``."""
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def parse_number(value: Any) -> int | float | None:
    """A target or answer that should be one number (a number or a string such as ``" -15.7 "``, ``"1,234"``,
    ``"1e3"``): ``int`` when written without decimals or exponent; ``None`` for booleans, NaN, +-inf and extra text."""
    if isinstance(value, bool):  # an int subclass, not an answer
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        s = value.strip()
        if len(s) > 100 or not _FULL_NUMBER_RE.fullmatch(s):  # a long string is no single number: never scanned
            return None
        number = _to_number(s)
        # "1e999" parses to inf
        return number if math.isfinite(number) else None
    return None


def numbers_close(a: float, b: float, abs_tol: float = ABS_TOL, rel_tol: float = REL_TOL) -> bool:
    """``|a - b| <= max(rel_tol * max(|a|, |b|), abs_tol)`` (:func:`math.isclose`; ``False`` for NaN).

    The defaults are the Countdown grader's (Qiu et al. 2025): ``"27.4"`` is met by ``137/5``.

    Raises:
        ValueError: If a tolerance is negative.
    """
    if abs_tol < 0 or rel_tol < 0:
        raise ValueError(f"abs_tol and rel_tol must be >= 0, got abs_tol={abs_tol}, rel_tol={rel_tol}")
    try:
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol)
    except OverflowError:  # int too large for float
        return a == b


def _has_block(text: str, open_tag: str, close_tag: str) -> bool:  # an open tag with a close tag after it
    start = text.find(open_tag)
    return start != -1 and text.find(close_tag, start + len(open_tag)) != -1


def think_answer_format_score(text: str, prefill: str = "<think>") -> float:
    """The ``<think>...</think>\\n<answer>...</answer>`` format score of Qiu et al. 2025 (arXiv 2509.24372,
    ``countdown_task.py``): 1.0 for exactly that format, else 0.1 for a think block plus 0.5 for an answer block.

    Args:
        text (`str`): Completion text (trailing whitespace ignored).
        prefill (`str`, defaults to ``"<think>"``): What the prompt ends with, prepended; ``""`` for prompts that
            do not open the think block.

    Returns:
        `float`: One of 0.0, 0.1, 0.5, 0.6, 1.0.
    """
    # the paper's prompt ends inside <think>; it strips EOS, TRL may keep a final newline
    text = prefill + text.rstrip()
    # The paper's regex ^<think>.*?</think>\n<answer>.*?</answer>$ (DOTALL), checked in linear time: the first
    # separator after the opening tag is the most permissive choice.
    middle = text.find("</think>\n<answer>", len("<think>"))
    if (
        text.startswith("<think>")
        and text.endswith("</answer>")
        and middle != -1
        and middle + len("</think>\n<answer>") <= len(text) - len("</answer>")
    ):
        return 1.0
    score = 0.0
    if _has_block(text, "<think>", "</think>"):
        score += 0.1
    if _has_block(text, "<answer>", "</answer>"):
        score += 0.5
    return score


def format_reward(prompts: list, completions: list, completion_ids: list | None = None, **kwargs) -> list[float]:
    """TRL reward function: :func:`think_answer_format_score` (prefill ``"<think>"``) of each completion, one score in
    ``{0, 0.1, 0.5, 0.6, 1}`` per completion."""
    # the dataset columns and TRL's extras (trainer_state, log_metric, ...) in kwargs are not needed
    return [think_answer_format_score(completion_text(c)) for c in completions]


def dataset_column(func_name: str, name: str, values, n: int) -> list:
    """``list(values)``, the column ``name`` that reward function ``func_name`` received for ``n`` completions.

    Raises:
        ValueError: If the column is missing (``values is None``) or its length is not ``n``.
    """
    if values is None or len(values) != n:
        raise ValueError(
            f"{func_name} needs the dataset column '{name}' with one entry per completion, got "
            f"{None if values is None else len(values)} entries for {n} completions"
        )
    return list(values)
