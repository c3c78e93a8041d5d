"""Countdown: combine the given numbers with ``+ - * /`` to reach a target (the reference ES task).

The task of Qiu et al. 2025, "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning"
(arXiv 2509.24372), with the paper's grader (``countdown_task.py``): reward = ``0.1 * format + answer``, where
``format`` is :func:`trl_es.rewards.think_answer_format_score` and ``answer`` is 1.0 iff the last
``<answer>...</answer>`` uses each given number once and evaluates to the target within ``1e-5``. Model text is
parsed with :mod:`ast` and evaluated exactly with :class:`fractions.Fraction`, never passed to :func:`eval`.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from ..rewards import (
    completion_text,
    dataset_column,
    extract_answer_tag,
    numbers_close,
    parse_number,
    think_answer_format_score,
)


__all__ = [
    "ANSWER_WEIGHT",
    "FORMAT_WEIGHT",
    "MAX_EXPRESSION_LENGTH",
    "countdown_answer_reward",
    "countdown_answer_score",
    "countdown_format_reward",
    "countdown_prompt_text",
    "countdown_reward",
    "countdown_user_message",
    "evaluate_expression",
    "load_countdown_json",
    "make_countdown_dataset",
]

#: Weight of the format reward in the paper's total reward.
FORMAT_WEIGHT = 0.1
#: Weight of the answer reward in the paper's total reward.
ANSWER_WEIGHT = 1.0
#: Answers longer than this (characters, after stripping) score 0 without being parsed.
MAX_EXPRESSION_LENGTH = 512

_ALLOWED_CHARS_RE = re.compile(r"[0-9+\-*/()\s]+")  # digits, the four operators, brackets and whitespace
_BINARY_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_UNARY_OPS = (ast.UAdd, ast.USub)

_SYSTEM_TEXT = (
    "You are a helpful assistant. You first think about the reasoning process in your mind and then provide the "
    "user with the answer."
)
_TASK_TEXT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic operations "
    "(+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. And return the "
    "final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)


def _numpy_style(numbers: Sequence[int]) -> str:
    # The paper's prompts print the numbers as a NumPy int array: right-aligned to a common width.
    width = max(len(str(x)) for x in numbers)
    return "[" + " ".join(str(x).rjust(width) for x in numbers) + "]"


def countdown_prompt_text(numbers: Sequence[int], target: float | str) -> str:
    """The paper's plain-text prompt (its data's ``context``, character for character), ending in ``...\\n<think>``.

    ``target`` is printed as given (``"27.4"`` stays ``27.4``).
    """
    task = _TASK_TEXT.format(numbers=_numpy_style(numbers), target=target)
    return f"{_SYSTEM_TEXT}{task}Let me solve this step by step.\n<think>"


def countdown_user_message(numbers: Sequence[int], target: float | str) -> str:
    """The instruction as a chat user message, the numbers printed as ``[44, 19, 35]``."""
    return _TASK_TEXT.format(numbers="[" + ", ".join(str(x) for x in numbers) + "]", target=target)


def _check_node(node: ast.AST) -> None:
    if isinstance(node, ast.Expression):
        return
    if isinstance(node, ast.Constant) and type(node.value) is int:  # not bool, float, str, ...
        return
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY_OPS):
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY_OPS):
        return
    if isinstance(node, _BINARY_OPS + _UNARY_OPS):  # ast.walk also yields the operator objects
        return
    raise ValueError(f"expression contains a disallowed element: {type(node).__name__}")


def _apply(op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if right == 0:  # named here, before Fraction raises its own message
        raise ZeroDivisionError("division by zero in expression")
    return left / right


def _evaluate(root: ast.AST) -> Fraction:
    # Post-order with an explicit stack (no recursion, so the depth of the expression never meets the recursion
    # limit or a worker thread's smaller C stack). Nodes were checked by _check_node.
    values: list[Fraction] = []
    stack: list[tuple[ast.AST, bool]] = [(root.body if isinstance(root, ast.Expression) else root, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, ast.Constant):
            values.append(Fraction(node.value))
        elif isinstance(node, ast.UnaryOp):
            if not children_done:
                stack += [(node, True), (node.operand, False)]
            elif isinstance(node.op, ast.USub):  # a unary + leaves the value
                values.append(-values.pop())
        elif not children_done:  # BinOp
            stack += [(node, True), (node.right, False), (node.left, False)]
        else:
            right, left = values.pop(), values.pop()
            values.append(_apply(node.op, left, right))
    return values[0]


def evaluate_expression(
    expression: str, numbers: Sequence[int] | None = None, max_length: int = MAX_EXPRESSION_LENGTH
) -> Fraction:
    """Evaluate a Countdown expression exactly: integer literals, binary ``+ - * /``, unary ``+``/``-``, brackets only.

    Args:
        expression (`str`): E.g. ``"(44 + 19) + 35"``; whitespace of any kind counts as a space.
        numbers (`Sequence[int]`, *optional*): If given, the literals must be these numbers, each once (any order).
        max_length (`int`, *optional*): Longer expressions are rejected unparsed (:data:`MAX_EXPRESSION_LENGTH`).

    Returns:
        `fractions.Fraction`: The exact value, e.g. ``Fraction(137, 5)`` for ``"98 / (47 - 52) + 47"``.

    Raises:
        ValueError: If the expression is empty, too long, malformed, uses a disallowed element, or does not use
            ``numbers`` exactly once each.
        ZeroDivisionError: If it divides by zero.
    """
    expression = expression.strip()
    if not expression:
        raise ValueError("expression is empty")
    if len(expression) > max_length:
        raise ValueError(f"expression is longer than max_length={max_length} characters")
    if not _ALLOWED_CHARS_RE.fullmatch(expression):  # no names, calls, attributes, **, //, %, decimals
        raise ValueError("expression may only contain digits, + - * / ( ) and spaces")
    expression = re.sub(r"\s+", " ", expression)  # any whitespace counts as a space
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"expression is malformed: {e}") from None
    literals = []
    for node in ast.walk(tree):  # iterative: no recursion on deep input
        _check_node(node)
        if isinstance(node, ast.Constant):
            literals.append(node.value)
    # each given number exactly once, as a multiset
    if numbers is not None and Counter(literals) != Counter(int(x) for x in numbers):
        raise ValueError(f"expression uses the numbers {sorted(literals)}, expected each of {sorted(numbers)} once")
    return _evaluate(tree)


def _target_value(target: float | str) -> float:
    value = parse_number(target)  # "27.4" and "-11" are numbers too
    if value is None:
        raise ValueError(f"target must be a number or a string holding one (e.g. 98, '27.4', '-11'), got {target!r}")
    return value


def countdown_answer_score(text: str, numbers: Sequence[int], target: float | str) -> float:
    """1.0 if the last ``<answer>`` uses ``numbers`` once each and equals ``target`` within ``1e-5``, else 0.0.

    Raises:
        ValueError: If ``target`` (a number, or a string such as ``"27.4"`` or ``"-11"``) is not a number.
    """
    goal = _target_value(target)
    answer = extract_answer_tag(text)  # only the last answer block counts
    if answer is None:
        return 0.0
    try:
        value = evaluate_expression(answer, numbers)
        close = numbers_close(float(value), goal)  # absolute tolerance 1e-5, as the paper's grader
    except (ValueError, ZeroDivisionError):
        return 0.0
    except OverflowError:  # beyond the float range: cannot be within 1e-5 of a (finite) target
        return 0.0
    return 1.0 if close else 0.0


def countdown_format_reward(prompts: list, completions: list, completion_ids=None, **kwargs) -> list[float]:
    """TRL reward function: the paper's format score per completion, in ``{0, 0.1, 0.5, 0.6, 1}``.

    Weight it by :data:`FORMAT_WEIGHT`; see :func:`trl_es.rewards.think_answer_format_score`.
    """
    return [think_answer_format_score(completion_text(c)) for c in completions]


def countdown_answer_reward(
    prompts: list, completions: list, completion_ids=None, numbers=None, target=None, **kwargs
) -> list[float]:
    """TRL reward function: :func:`countdown_answer_score` per completion (its mean is the task accuracy).

    ``numbers`` (`list[list[int]]`) and ``target`` (`list[int | float | str]`) are dataset columns.

    Raises:
        ValueError: If ``numbers``/``target`` are missing, of the wrong length, or a target is not a number.
    """
    n = len(completions)
    numbers = dataset_column("countdown_answer_reward", "numbers", numbers, n)
    target = dataset_column("countdown_answer_reward", "target", target, n)
    rows = zip(completions, numbers, target, strict=False)
    return [countdown_answer_score(completion_text(c), nums, t) for c, nums, t in rows]


def countdown_reward(
    prompts: list, completions: list, completion_ids=None, numbers=None, target=None, **kwargs
) -> list[float]:
    """TRL reward function: the paper's total ``0.1 * format + 1.0 * answer`` (max 1.1), per completion.

    Equivalent to ``[countdown_format_reward, countdown_answer_reward]`` with ``reward_weights=[0.1, 1.0]``.
    """
    fmt = countdown_format_reward(prompts, completions)
    ans = countdown_answer_reward(prompts, completions, numbers=numbers, target=target)
    return [FORMAT_WEIGHT * f + ANSWER_WEIGHT * a for f, a in zip(fmt, ans, strict=False)]


def _random_problem(
    rng: random.Random, size: int, low: int, high: int, max_target: int | None
) -> tuple[list[int], int, str]:
    while True:  # the defaults resemble the paper's data: numbers 1-99, most targets 1-100
        numbers = [rng.randint(low, high) for _ in range(size)]
        for _ in range(20):  # several expression shapes for these numbers before drawing new ones
            items = [(Fraction(x), str(x)) for x in numbers]
            ok = True
            while len(items) > 1:
                i, j = rng.sample(range(len(items)), 2)  # a random pair, joined by a random operator
                (a, ea), (b, eb) = items[i], items[j]
                op = rng.choice("+-*/")
                if op == "/" and b == 0:
                    ok = False
                    break
                value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b
                items = [it for k, it in enumerate(items) if k not in (i, j)] + [(value, f"({ea} {op} {eb})")]
            if not ok:
                continue
            value, expression = items[0]
            # an integer in [1, max_target]: the stored solution solves it
            if value.denominator == 1 and value >= 1 and (max_target is None or value <= max_target):
                return numbers, int(value), expression


def make_countdown_dataset(
    n: int,
    seed: int = 0,
    num_numbers: int | Sequence[int] = (3, 4),
    low: int = 1,
    high: int = 99,
    max_target: int | None = 100,
    conversational: bool = True,
):
    """``n`` solvable Countdown problems, reproducibly (``random.Random(seed)``).

    Args:
        n (`int`): Number of problems, ``>= 1``.
        num_numbers (`int | Sequence[int]`, defaults to ``(3, 4)``): Numbers per problem (each 2-6), drawn uniformly.
        low, high (`int`, defaults to 1, 99): The numbers' range, ``1 <= low <= high``.
        max_target (`int | None`, defaults to 100): Largest target, ``>= 1``; ``None`` for no limit.
        conversational (`bool`, defaults to True): ``prompt`` as a user message (:func:`countdown_user_message`), else
            the paper's plain-text prompt (:func:`countdown_prompt_text`).

    Returns:
        (`datasets.Dataset`): Columns ``prompt``, ``numbers`` (``list[int]``), ``target`` (``int``) and
            ``solution`` (``str``, fully bracketed, e.g. ``"((44 + 19) + 35)"``).

    Raises:
        ValueError: If an argument is out of range.
    """
    from datasets import Dataset

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    sizes = [num_numbers] if isinstance(num_numbers, int) else list(num_numbers)  # k uniform over num_numbers
    if not sizes or any(not isinstance(k, int) or not 2 <= k <= 6 for k in sizes):
        raise ValueError(f"num_numbers must be an int or a non-empty list of ints in 2..6, got {num_numbers!r}")
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        raise ValueError(f"low and high must be integers with 1 <= low <= high, got low={low!r}, high={high!r}")
    if max_target is not None and (not isinstance(max_target, int) or max_target < 1):
        raise ValueError(f"max_target must be None or an integer >= 1, got {max_target!r}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        numbers, target, solution = _random_problem(rng, rng.choice(sizes), low, high, max_target)
        prompt = (
            [{"role": "user", "content": countdown_user_message(numbers, target)}]
            if conversational
            else countdown_prompt_text(numbers, target)
        )
        rows.append({"prompt": prompt, "numbers": numbers, "target": target, "solution": solution})
    return Dataset.from_list(rows)


def load_countdown_json(
    path: str | os.PathLike, split: str = "all", train_size: int = 200, test_size: int = 2000
):
    """Load Countdown problems in the paper's JSON format: a list of ``{"id", "context", "numbers", "target", ...}``.

    Args:
        path (`str | os.PathLike`): The JSON file.
        split (`str`, defaults to ``"all"``): ``"train"`` (first ``train_size`` items), ``"test"`` (last
            ``test_size`` items) or ``"all"``; the paper trains on the first 200 and tests on the last 2000.

    Returns:
        (`datasets.Dataset`): Columns ``id``, ``prompt`` (the ``context``, ending in ``<think>``), ``numbers``,
            ``target`` (``str``, as in the file), ``solution`` (``str`` or ``None``).

    Raises:
        ValueError: If ``split`` is not one of the allowed values, the file is not a list of such items, or
            the train and test splits would overlap or exceed the file.
    """
    from datasets import Dataset

    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be one of 'train', 'test', 'all', got {split!r}")
    with open(path, encoding="utf-8") as f:
        items = json.load(f)
    required = {"id", "context", "numbers", "target"}
    if not isinstance(items, list) or not all(isinstance(x, dict) and required <= x.keys() for x in items):
        raise ValueError(f"{path} must hold a JSON list of objects with keys {sorted(required)} (and 'solution')")
    if split != "all":
        if train_size < 0 or test_size < 0 or train_size + test_size > len(items):
            raise ValueError(
                f"train_size={train_size} + test_size={test_size} must be >= 0 each and at most the "
                f"{len(items)} items in {path} (the splits must not overlap)"
            )
        # train: the first items; test: the last
        items = items[:train_size] if split == "train" else items[len(items) - test_size :]
    rows = [
        {
            "id": x["id"],
            "prompt": x["context"],  # the completion starts inside the think block (TRL standard format)
            "numbers": [int(v) for v in x["numbers"]],
            "target": str(x["target"]),  # kept a string ("27.4", "-11"); the rewards parse it
            "solution": x.get("solution"),
        }
        for x in items
    ]
    return Dataset.from_list(rows)
