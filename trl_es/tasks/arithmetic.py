"""Arithmetic: "What is a + b? Reply with only the number." (a small, fast task for smoke runs).

Problems are drawn from the grid of all ``(op, a, b)`` with ``a, b`` in ``[low, high]`` and ``op`` in ``ops``
(``+``, ``-``, ``*``). The reward (:func:`arithmetic_reward`) is 1.0 if the **first** number in the completion
equals the answer, else 0.0; see :func:`trl_es.rewards.find_numbers` for what counts as a number.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..rewards import completion_text, dataset_column, last_number, numbers_close

__all__ = [
    "ALLOWED_OPS",
    "arithmetic_question",
    "arithmetic_reward",
    "make_arithmetic_dataset",
    "make_arithmetic_splits",
]

#: Operators a problem may use.
ALLOWED_OPS = ("+", "-", "*")

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_question(a: int, op: str, b: int) -> str:
    """The question text, e.g. ``"What is 3 + 4? Reply with only the number."``.

    Args:
        a (`int`): Left operand.
        op (`str`): One of :data:`ALLOWED_OPS`.
        b (`int`): Right operand.

    Returns:
        `str`: The question.
    """
    return f"What is {a} {op} {b}? Reply with only the number."


def _check_args(low: int, high: int, ops: Sequence[str]) -> tuple[str, ...]:
    if not (isinstance(low, int) and isinstance(high, int) and low <= high):
        raise ValueError(f"low and high must be integers with low <= high, got low={low!r}, high={high!r}")
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    if not ops or any(op not in ALLOWED_OPS for op in ops) or len(set(ops)) != len(ops):
        raise ValueError(f"ops must be a non-empty sequence of distinct operators from {ALLOWED_OPS}, got {ops!r}")
    return ops


def _rows(indices: Sequence[int], low: int, high: int, ops: tuple[str, ...], conversational: bool) -> list[dict]:
    width = high - low + 1
    rows = []
    for index in indices:  # index -> (op, a, b) over the grid ops x [low, high]^2
        op_index, rest = divmod(index, width * width)
        a, b = low + rest // width, low + rest % width
        op = ops[op_index]
        question = arithmetic_question(a, op, b)
        prompt = [{"role": "user", "content": question}] if conversational else question
        rows.append({"prompt": prompt, "a": a, "b": b, "op": op, "answer": _APPLY[op](a, b)})
    return rows


def make_arithmetic_dataset(
    n: int,
    seed: int = 0,
    low: int = 1,
    high: int = 50,
    ops: Sequence[str] = ("+",),
    conversational: bool = True,
):
    """Generate ``n`` arithmetic problems, drawn uniformly **with replacement**, reproducibly.

    Args:
        n (`int`): Number of rows, ``>= 1``.
        seed (`int`, defaults to 0): Seed of a private :class:`random.Random`; same seed, same rows.
        low (`int`, defaults to 1): Smallest operand.
        high (`int`, defaults to 50): Largest operand, ``>= low``.
        ops (`Sequence[str]`, defaults to ``("+",)``): Operators to draw from, a subset of ``("+", "-", "*")``.
        conversational (`bool`, defaults to True): ``prompt`` as ``[{"role": "user", "content": question}]``;
            if False, the question string.

    Returns:
        `datasets.Dataset`: Columns ``prompt``, ``a``, ``b``, ``op`` and ``answer`` (``int``).

    Raises:
        ValueError: If an argument is out of range.
    """
    from datasets import Dataset

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    ops = _check_args(low, high, ops)
    rng = random.Random(seed)
    size = len(ops) * (high - low + 1) ** 2
    return Dataset.from_list(_rows([rng.randrange(size) for _ in range(n)], low, high, ops, conversational))


def make_arithmetic_splits(
    n_train: int,
    n_eval: int = 200,
    seed: int = 0,
    low: int = 1,
    high: int = 50,
    ops: Sequence[str] = ("+",),
    conversational: bool = True,
):
    """Generate disjoint train and held-out problem sets: no question appears twice, in either or across.

    ``n_train + n_eval`` distinct problems are drawn **without replacement** from the grid of
    ``len(ops) * (high - low + 1) ** 2`` problems; the first ``n_train`` form the train set.

    Args:
        n_train (`int`): Train rows, ``>= 1``.
        n_eval (`int`, defaults to 200): Held-out rows, ``>= 1``.
        seed (`int`, defaults to 0): Seed; same seed, same splits.
        low, high, ops, conversational: As in :func:`make_arithmetic_dataset`.

    Returns:
        `tuple[datasets.Dataset, datasets.Dataset]`: ``(train, held_out)``, columns as in
        :func:`make_arithmetic_dataset`.

    Raises:
        ValueError: If an argument is out of range or ``n_train + n_eval`` exceeds the number of distinct
            problems.
    """
    from datasets import Dataset

    for name, value in (("n_train", n_train), ("n_eval", n_eval)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    ops = _check_args(low, high, ops)
    size = len(ops) * (high - low + 1) ** 2
    if n_train + n_eval > size:
        raise ValueError(
            f"n_train + n_eval = {n_train + n_eval} exceeds the {size} distinct problems for low={low}, "
            f"high={high}, ops={ops}; widen the range or add operators"
        )
    indices = random.Random(seed).sample(range(size), n_train + n_eval)
    train = Dataset.from_list(_rows(indices[:n_train], low, high, ops, conversational))
    held_out = Dataset.from_list(_rows(indices[n_train:], low, high, ops, conversational))
    return train, held_out


def arithmetic_reward(prompts: list, completions: list, completion_ids=None, answer=None, **kwargs) -> list[float]:
    """TRL reward function: 1.0 if the last number in the completion equals the answer, else 0.0.

    The last number is found by :func:`trl_es.rewards.last_number` (``"-12"``, ``"1,234"`` and ``"7.0"``
    are numbers; ``"7.0"`` equals 7); a completion without a number scores 0.0. So ``"8"``, ``"8."``,
    ``"The answer is 8"`` and ``"3 + 5 = 8"`` all score 1.0 for ``3 + 5``; ``"8, no 9"`` scores 0.0.
    The *last* number, because SmolLM2-135M-Instruct answers 196 of 200 held-out prompts in the form
    ``"a + b = c"`` despite "Reply with only the number" (a first-number rule scores it 0.005, the last-number
    rule 0.28, close to the 0.295 baseline this task was specified with).

    Args:
        prompts (`list`): Prompts (unused).
        completions (`list[str | list[dict]]`): Completions, standard or conversational format.
        completion_ids (*optional*): Unused.
        answer (`list[int]`): Dataset column: the correct result of each problem.
        **kwargs: Other columns and trainer extras; ignored.

    Returns:
        `list[float]`: 1.0 or 0.0 per completion.

    Raises:
        ValueError: If ``answer`` is missing or not as long as ``completions``.
    """
    answer = dataset_column("arithmetic_reward", "answer", answer, len(completions))
    scores = []
    for c, expected in zip(completions, answer):
        value = last_number(completion_text(c))
        scores.append(1.0 if value is not None and numbers_close(value, expected) else 0.0)
    return scores
