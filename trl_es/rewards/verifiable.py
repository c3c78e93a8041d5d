"""Shared pieces for verifiable rewards: completion text, answer extraction, number parsing and comparison.

Every reward function in :mod:`trl_es` uses TRL's reward-function signature, so the same function works in
:class:`trl.GRPOTrainer` and in :class:`trl_es.ESTrainer`::

    def reward(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]: ...

``completions`` holds either strings (TRL's *standard* format) or lists of messages such as
``[{"role": "assistant", "content": "..."}]`` (TRL's *conversational* format); :func:`completion_text` turns
either into a string. Extra dataset columns arrive as keyword lists of the same length as ``completions``
(e.g. ``target=[...]``); other keyword arguments that TRL adds (``trainer_state``, ``log_extra``,
``log_metric``, ...) are accepted and ignored.
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

#: Default absolute tolerance of :func:`numbers_close`; the reference ES paper's Countdown grader
#: (Qiu et al. 2025, arXiv 2509.24372) accepts ``abs(result - target) < 1e-5``.
ABS_TOL = 1e-5
#: Default relative tolerance of :func:`numbers_close` (0: purely absolute, as in the reference paper).
REL_TOL = 0.0

# A number: optional sign, digits (optionally grouped by thousands commas), optional decimals.
# The sign counts only when it does not follow a word character or a closing bracket, so "10-3" reads as
# 10 and 3, while "x = -3" reads as -3. Digits glued to a previous digit, "." or "," are not a new number.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]])[-\u2212])?(?<![\d.,])(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?"
)
_FULL_NUMBER_RE = re.compile(r"[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|[-+\u2212]?\.\d+")


def completion_text(completion: str | Sequence[dict[str, Any]] | dict[str, Any]) -> str:
    """Return the text of one completion, in TRL's standard or conversational format.

    Args:
        completion (`str` | `list[dict]` | `dict`): A string (standard format), a list of messages such as
            ``[{"role": "assistant", "content": "..."}]`` (conversational format; with tool calls TRL appends
            ``tool`` and further ``assistant`` messages), or a single message dict. A message's ``content``
            may be a string or a list of parts ``[{"type": "text", "text": "..."}]``.

    Returns:
        `str`: The string itself, or the content of the **last** assistant message (the one that holds the
            final answer); the empty string for a message list without assistant content.

    Raises:
        TypeError: If ``completion`` is none of the forms above.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        messages = list(completion)
        if not all(isinstance(m, dict) for m in messages):
            raise TypeError(
                "completion must be a string or a list of message dicts like "
                f"[{{'role': 'assistant', 'content': ...}}], got a list containing {type(messages[0]).__name__}"
            )
        for message in reversed(messages):
            if message.get("role", "assistant") == "assistant":
                return _content_text(message.get("content"))
        return ""
    raise TypeError(
        "completion must be a string (standard format) or a list of messages (conversational format), "
        f"got {type(completion).__name__}"
    )


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal parts
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
    """Return the content of the **last** ``<answer>...</answer>`` block, or ``None`` if there is none.

    Blocks are found left to right, each from an ``<answer>`` to the next ``</answer>`` (as
    ``re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)`` does, but in linear time).

    Args:
        text (`str`): Completion text.

    Returns:
        `str | None`: The (unstripped) content of the last complete answer block.

    Example::

        >>> extract_answer_tag("<answer>1</answer> no, <answer> 2 </answer>")
        ' 2 '
    """
    blocks = _tag_blocks(text, "<answer>", "</answer>")
    return blocks[-1] if blocks else None


def extract_boxed(text: str) -> str | None:
    r"""Return the content of the **last** ``\boxed{...}`` (braces matched), or ``None`` if there is none.

    Args:
        text (`str`): Completion text.

    Returns:
        `str | None`: The content between the braces, e.g. ``"\frac{1}{2}"`` for ``"\boxed{\frac{1}{2}}"``;
            ``None`` if there is no ``\boxed{`` or its braces never close.
    """
    if "\\boxed{" not in text:
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
            if start > best_start:
                best_start, best = start, text[start:i]
        i += 1
    return best


#: Digit strings longer than this are read as floats (``inf`` for huge ones) instead of ints: converting a huge
#: digit string to an int is quadratic in its length, and Python refuses more than 4300 digits by default.
MAX_INT_DIGITS = 1000


def _to_number(token: str) -> int | float:
    token = token.replace(",", "").replace("\u2212", "-")
    if re.fullmatch(r"[-+]?\d+", token) and len(token) <= MAX_INT_DIGITS:
        return int(token)
    return float(token)


def find_numbers(text: str) -> list[int | float]:
    """Return every number written in ``text``, in order.

    A number is an optional minus sign, digits (thousands may be grouped with commas: ``1,234``) and optional
    decimals (``27.4``). The minus sign counts only when it does not follow a letter, digit or closing bracket,
    so ``"10-3"`` gives ``[10, 3]`` and ``"x = -3"`` gives ``[-3]``. Exponents and fractions are not numbers
    here (``"1/2"`` gives ``[1, 2]``).

    Args:
        text (`str`): Any text.

    Returns:
        `list[int | float]`: ``int`` for numbers written without decimals, else ``float``; a digit string longer
            than :data:`MAX_INT_DIGITS` is read as a ``float`` (``inf`` when out of range), so any text is read in time
            linear in its length.
    """
    return [_to_number(m.group(0)) for m in _NUMBER_RE.finditer(text)]


def find_number_spans(text: str, limit: int | None = None) -> list[tuple[int | float, int, int]]:
    """Return the numbers of ``text`` (see :func:`find_numbers`) with where they are written, in order.

    Args:
        text (`str`): Any text.
        limit (`int`, *optional*): Stop after this many numbers (the scan stops there too).

    Returns:
        `list[tuple[int | float, int, int]]`: ``(value, start, end)`` per number; ``text[start:end]`` is the number
            as written, its sign included.
    """
    matches = _NUMBER_RE.finditer(text)
    if limit is not None:
        matches = itertools.islice(matches, limit)
    return [(_to_number(m.group(0)), m.start(), m.end()) for m in matches]


def first_number(text: str) -> int | float | None:
    """Return the first number in ``text`` (see :func:`find_numbers`), or ``None`` if there is none."""
    m = _NUMBER_RE.search(text)
    return _to_number(m.group(0)) if m else None


def last_number(text: str) -> int | float | None:
    """Return the last number in ``text`` (see :func:`find_numbers`), or ``None`` if there is none."""
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def parse_number(value: Any) -> int | float | None:
    """Parse a target or answer value that should be a single number.

    Args:
        value (`int` | `float` | `str`): A number, or a string holding exactly one number such as ``"98"``,
            ``" -15.7 "``, ``"1,234"`` or ``"1e3"`` (surrounding whitespace allowed).

    Returns:
        `int | float | None`: The number (``int`` when written without decimals or exponent), ``None`` for
            anything else, including booleans, NaN, infinities and strings with extra text.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        s = value.strip()
        if len(s) > 100 or not _FULL_NUMBER_RE.fullmatch(s):
            return None
        number = _to_number(s)
        return number if math.isfinite(number) else None
    return None


def numbers_close(a: float, b: float, abs_tol: float = ABS_TOL, rel_tol: float = REL_TOL) -> bool:
    """Whether two numbers are equal up to a tolerance: ``|a - b| <= max(rel_tol * max(|a|, |b|), abs_tol)``.

    This is :func:`math.isclose`; the defaults (absolute ``1e-5``, relative ``0``) follow the reference ES
    paper's Countdown grader, so a target written as ``"27.4"`` or ``"266.6666666666667"`` is met by an
    expression that evaluates to ``137/5`` or ``800/3``.

    Args:
        a (`float`): First number.
        b (`float`): Second number.
        abs_tol (`float`, defaults to ``1e-5``): Absolute tolerance, ``>= 0``.
        rel_tol (`float`, defaults to ``0``): Relative tolerance, ``>= 0``.

    Returns:
        `bool`: ``False`` also when either number is NaN.

    Raises:
        ValueError: If a tolerance is negative.
    """
    if abs_tol < 0 or rel_tol < 0:
        raise ValueError(f"abs_tol and rel_tol must be >= 0, got abs_tol={abs_tol}, rel_tol={rel_tol}")
    try:
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol)
    except OverflowError:  # int too large for float
        return a == b


def _has_block(text: str, open_tag: str, close_tag: str) -> bool:
    start = text.find(open_tag)
    return start != -1 and text.find(close_tag, start + len(open_tag)) != -1


def think_answer_format_score(text: str, prefill: str = "<think>") -> float:
    """Score the ``<think>...</think>\\n<answer>...</answer>`` format as the reference ES paper does.

    The paper's Countdown prompt ends with ``<think>``, so the completion starts *inside* the think block;
    ``prefill`` is prepended before checking, as in the paper (a completion that opens ``<think>`` itself still
    matches, because the think block may contain anything). Trailing whitespace is ignored (the paper strips
    the end-of-sequence token; TRL decodes without special tokens but may keep a final newline).

    Scores (Qiu et al. 2025, arXiv 2509.24372, ``countdown_task.py``):

    - ``1.0`` if ``prefill + text`` is exactly ``<think>...</think>\\n<answer>...</answer>``;
    - otherwise ``0.1`` if a ``<think>...</think>`` block is present, plus ``0.5`` if an
      ``<answer>...</answer>`` block is present (so 0.0, 0.1, 0.5 or 0.6).

    Args:
        text (`str`): Completion text.
        prefill (`str`, defaults to ``"<think>"``): Text the prompt already ends with. Use ``""`` for prompts
            that do not open the think block.

    Returns:
        `float`: One of 0.0, 0.1, 0.5, 0.6, 1.0.
    """
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
    """TRL reward function: the ``<think>``/``<answer>`` format score of each completion.

    See :func:`think_answer_format_score` (prefill ``"<think>"``) for the scoring rule.

    Args:
        prompts (`list`): Prompts (unused).
        completions (`list[str | list[dict]]`): Completions, standard or conversational format.
        completion_ids (`list[list[int]]`, *optional*): Unused.
        **kwargs (`Any`): Dataset columns and trainer extras; ignored.

    Returns:
        `list[float]`: One score in ``{0, 0.1, 0.5, 0.6, 1}`` per completion.
    """
    return [think_answer_format_score(completion_text(c)) for c in completions]


def dataset_column(func_name: str, name: str, values, n: int) -> list:
    """The dataset column ``name`` as a reward function receives it, checked: present and one value per completion.

    Args:
        func_name (`str`): The reward function's name (for the error message).
        name (`str`): The column name.
        values (`Sequence | None`): What the reward function received as ``name=...`` (``None`` when the column is
            missing).
        n (`int`): Number of completions.

    Returns:
        `list`: ``list(values)``.

    Raises:
        ValueError: If the column is missing or its length is not ``n``.
    """
    if values is None or len(values) != n:
        raise ValueError(
            f"{func_name} needs the dataset column '{name}' with one entry per completion, got "
            f"{None if values is None else len(values)} entries for {n} completions"
        )
    return list(values)
