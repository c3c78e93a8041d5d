"""Arithmetic: "What is a + b? Reply with only the number." (a small, fast task for smoke runs).

Problems come from the grid of all ``(op, a, b)`` with ``a, b`` in ``[low, high]`` and ``op`` in ``ops``. The reward
(:func:`arithmetic_reward`) scores the **first stated result** (:func:`stated_result`), so it does not depend on where
generation is cut.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from ..rewards import completion_text, dataset_column, find_number_spans, numbers_close


__all__ = [
    "ALLOWED_OPS",
    "OPERATOR_SPELLINGS",
    "arithmetic_question",
    "arithmetic_reward",
    "check_arithmetic_args",
    "make_arithmetic_dataset",
    "make_arithmetic_dataset_dict",
    "make_arithmetic_sft_dataset",
    "make_arithmetic_splits",
    "stated_result",
    "worked_answer",
]

#: Operators a problem may use.
ALLOWED_OPS = ("+", "-", "*")

# the exact result of each operator
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

#: How a restatement may spell each operator (regular expressions, matched case-insensitively, with any spaces
#: and an optional bracket around them, as in "(-5) - (-3)"): "47 + 35", "47 plus 35"; "47 - 35" (also the minus
#: sign U+2212, the en dash), "47 minus 35";
#: "6 * 7", "6 x 7", "6 × 7", "6 · 7", "6 \\times 7", "6 \\cdot 7", "6 times 7", "6 multiplied by 7".
OPERATOR_SPELLINGS = {
    "+": (r"\+", "plus"),
    "-": ("-", "\u2212", "\u2013", "minus"),
    "*": (r"\*", "x", "\u00d7", "\u00b7", "\u22c5", r"\\times", r"\\cdot", "times", r"multiplied\s+by"),
}
_OPERATOR_RES = {
    op: re.compile(r"\s*\)?\s*(?:" + "|".join(spellings) + r")\s*\(?\s*", re.IGNORECASE)
    for op, spellings in OPERATOR_SPELLINGS.items()
}
_COMMUTATIVE = ("+", "*")  # a restatement may swap their operands


def arithmetic_question(a: int, op: str, b: int) -> str:
    """The question text, e.g. ``"What is 3 + 4? Reply with only the number."``."""
    return f"What is {a} {op} {b}? Reply with only the number."


def check_arithmetic_args(low: int, high: int, ops: Sequence[str]) -> tuple[str, ...]:
    """``ops`` (a string is one operator) as a tuple, after checking the grid ``low <= high`` and ``ops``.

    Raises:
        ValueError: If ``low``/``high`` are not integers with ``low <= high``, or ``ops`` is empty, repeats an
            operator or names one outside :data:`ALLOWED_OPS`.
    """
    if not (isinstance(low, int) and isinstance(high, int) and low <= high):
        raise ValueError(f"low and high must be integers with low <= high, got low={low!r}, high={high!r}")
    if isinstance(ops, str):  # a single string is one operator
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
    """``n >= 1`` problems drawn uniformly **with replacement** from the grid by ``random.Random(seed)``.

    Operands in ``[low, high]``, ``ops`` a subset of :data:`ALLOWED_OPS`; ``prompt`` is ``[{"role": "user",
    "content": question}]`` if ``conversational``, else the question. Columns ``prompt``, ``a``, ``b``, ``op``,
    ``answer`` (``int``). Raises ``ValueError`` for an argument out of range.
    """
    from datasets import Dataset

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    ops = check_arithmetic_args(low, high, ops)
    rng = random.Random(seed)
    size = len(ops) * (high - low + 1) ** 2
    # a private Random: same seed, same rows
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
    """Disjoint ``(train, held_out)`` sets of ``n_train`` and ``n_eval`` problems, drawn **without replacement**.

    Prefer :func:`make_arithmetic_dataset_dict` (its test split does not change with the train size); the other
    arguments as :func:`make_arithmetic_dataset`. Raises ``ValueError`` for an argument out of range or more rows than
    the grid holds.
    """
    from datasets import Dataset

    for name, value in (("n_train", n_train), ("n_eval", n_eval)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    ops = check_arithmetic_args(low, high, ops)
    size = len(ops) * (high - low + 1) ** 2
    if n_train + n_eval > size:
        raise ValueError(
            f"n_train + n_eval = {n_train + n_eval} exceeds the {size} distinct problems for low={low}, "
            f"high={high}, ops={ops}; widen the range or add operators"
        )
    # the first n_train train, the rest held out
    indices = random.Random(seed).sample(range(size), n_train + n_eval)
    train = Dataset.from_list(_rows(indices[:n_train], low, high, ops, conversational))
    held_out = Dataset.from_list(_rows(indices[n_train:], low, high, ops, conversational))
    return train, held_out


def _permutation_prefix(rng: random.Random, size: int, k: int) -> list[int]:
    # The first k entries of a Fisher-Yates permutation of range(size), drawn lazily (O(k) time and memory for a
    # grid of any size): entry i is drawn uniformly from the entries not drawn yet. Entry i depends only on the
    # first i + 1 draws, so a longer prefix extends a shorter one.
    swapped: dict[int, int] = {}
    prefix = []
    for i in range(k):
        j = rng.randrange(i, size)
        prefix.append(swapped.get(j, j))
        swapped[j] = swapped.get(i, i)
    return prefix


def make_arithmetic_dataset_dict(
    num_train: int,
    num_validation: int,
    num_test: int,
    seed: int = 0,
    low: int = 1,
    high: int = 50,
    ops: Sequence[str] = ("+",),
    conversational: bool = True,
):
    """Disjoint train, validation and test splits (``datasets.DatasetDict``): no question appears twice.

    One permutation of the grid drawn from ``random.Random(seed)`` gives **test** (its first ``num_test``), then
    **validation**, then **train**: the test split depends only on ``(seed, low, high, ops, num_test)``. Sizes are
    ``>= 0``; the other arguments and the columns as :func:`make_arithmetic_dataset` (empty splits keep the columns).

    Raises:
        ValueError: If a size is not an integer ``>= 0``, all three are 0, another argument is out of range, or the
            sizes add up to more than the grid holds.
    """
    from datasets import Dataset, DatasetDict

    sizes = {"num_train": num_train, "num_validation": num_validation, "num_test": num_test}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:  # a bool is not a size
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    total = num_train + num_validation + num_test
    if total == 0:
        raise ValueError("num_train, num_validation and num_test are all 0: nothing to generate")
    ops = check_arithmetic_args(low, high, ops)
    size = len(ops) * (high - low + 1) ** 2
    if total > size:
        raise ValueError(
            f"num_train + num_validation + num_test = {num_train} + {num_validation} + {num_test} = {total} exceeds "
            f"the {size} distinct problems for low={low}, high={high}, ops={ops}; widen the range or add operators"
        )
    # test first, then validation: a larger train split leaves them as they are
    indices = _permutation_prefix(random.Random(seed), size, total)
    everything = Dataset.from_list(_rows(indices, low, high, ops, conversational))
    first_train = num_test + num_validation  # tune on validation (the trainer's evaluations), report test

    def rows(start: int, stop: int):  # datasets rejects an empty range that starts at the end: select [] then
        return everything.select(range(start, stop) if stop > start else [])

    return DatasetDict(
        {"train": rows(first_train, total), "validation": rows(num_test, first_train), "test": rows(0, num_test)}
    )


def worked_answer(a: int, op: str, b: int) -> str:
    """The correct answer in the model's own format, ``f"{a} {op} {b} = {result}"`` (e.g. ``"47 + 35 = 82"``).

    Raises:
        ValueError: If ``op`` is not one of :data:`ALLOWED_OPS`.
    """
    if op not in _APPLY:  # SmolLM2-135M-Instruct answers this way despite 'Reply with only the number'
        raise ValueError(f"op must be one of {ALLOWED_OPS}, got {op!r}")
    return f"{a} {op} {b} = {_APPLY[op](a, b)}"


def make_arithmetic_sft_dataset(dataset):
    """TRL prompt-completion rows for ``trl.SFTTrainer``: each prompt with its :func:`worked_answer` as the completion.

    Args:
        dataset (`datasets.Dataset`): Rows of :func:`make_arithmetic_dataset` / :func:`make_arithmetic_dataset_dict`.

    Returns:
        (`datasets.Dataset`): The same rows plus ``completion``: ``[{"role": "assistant", ...}]`` for a conversational
            prompt, ``" 47 + 35 = 82"`` (one leading space) for a plain one.

    Raises:
        ValueError: If a column ``prompt``, ``a``, ``b`` or ``op`` is missing, or ``completion`` exists.
    """
    # kept, so arithmetic_reward still grades the rows
    missing = [c for c in ("prompt", "a", "b", "op") if c not in dataset.column_names]
    if missing:
        raise ValueError(f"make_arithmetic_sft_dataset needs the columns prompt, a, b, op; {missing} missing")
    if "completion" in dataset.column_names:
        raise ValueError("dataset already has a 'completion' column")

    def add_completion(row):
        text = worked_answer(row["a"], row["op"], row["b"])
        conversational = isinstance(row["prompt"], list)
        # SFTTrainer joins a plain prompt and completion as they are: the space is the completion's
        return {"completion": [{"role": "assistant", "content": text}] if conversational else " " + text}

    return dataset.map(add_completion)


def _is_operand(value: int | float, operand) -> bool:
    return operand is not None and numbers_close(value, operand)


def stated_result(text: str, a=None, b=None, op: str | None = None) -> int | float | None:
    """The first stated result of a completion: its first number, after a leading restatement ``a op b`` of the problem.

    A restatement is the operands in order (either order for ``+`` and ``*``) joined only by ``op`` in any spelling of
    :data:`OPERATOR_SPELLINGS`; the result is then the next number. For ``47 + 35``: ``"82"``, ``"The answer is 82"``,
    ``"35+47=82"`` and ``"47 + 35 = 82\\n56 - 44 = 12"`` state 82; ``"83, no 82"`` states 83; ``"47 + 35"`` nothing.
    Text after a complete number never changes it (unless the answer is an operand: ``"7 "`` vs ``"7 * 1 = 8"``).

    Args:
        text (`str`): Completion text.
        a, b (`int | float`, *optional*): Operands; with ``a``, ``b`` or ``op`` ``None``, the first number.
        op (`str`, *optional*): One of :data:`ALLOWED_OPS`.

    Returns:
        `int | float | None`: The stated result (:func:`trl_es.rewards.find_numbers`), or ``None``.

    Raises:
        ValueError: If ``op`` is given and is not one of :data:`ALLOWED_OPS`.
    """
    if op is not None and op not in _OPERATOR_RES:
        raise ValueError(f"op must be one of {ALLOWED_OPS} (or None), got {op!r}")
    numbers = find_number_spans(text, limit=3)  # a restatement and its result: three numbers at most
    if not numbers:
        return None
    if a is not None and b is not None and op is not None and len(numbers) >= 2:
        (x, _, x_end), (y, y_start, _) = numbers[0], numbers[1]
        between = text[x_end:y_start]
        if _OPERATOR_RES[op].fullmatch(between):  # only the operator between them: a restatement
            second = y
        elif op == "-" and not between.strip() and text[y_start] in "-\u2212":
            second = -y  # "47 -35": the minus was read as the sign of 35
        else:
            second = None
        if second is not None:
            in_order = _is_operand(x, a) and _is_operand(second, b)
            swapped = op in _COMMUTATIVE and _is_operand(x, b) and _is_operand(second, a)
            # the result is the number after the restatement, whatever joins them (=, is, equals)
            if in_order or swapped:
                return numbers[2][0] if len(numbers) > 2 else None
    return numbers[0][0]  # no restatement: the first number


def arithmetic_reward(
    prompts: list, completions: list, completion_ids=None, answer=None, a=None, b=None, op=None, **kwargs
) -> list[float]:
    """TRL reward function: 1.0 if the first stated result (:func:`stated_result`) equals ``answer``, else 0.0.

    ``completions`` are standard or conversational; ``answer``, ``a``, ``b``, ``op`` are dataset columns (without
    ``a``/``b``/``op`` the first number is compared), with :func:`trl_es.rewards.numbers_close` (``"82.0"`` is 82).

    Raises:
        ValueError: If ``answer`` is missing or not as long as ``completions``, or ``a``/``b``/``op`` are given with
            another length.
    """
    n = len(completions)
    # refuses a missing column or one of another length
    answer = dataset_column("arithmetic_reward", "answer", answer, n)
    problem = [None] * n  # no a/b/op columns: no restatement, the first number
    if a is not None and b is not None and op is not None:
        problem = list(
            zip(
                dataset_column("arithmetic_reward", "a", a, n),
                dataset_column("arithmetic_reward", "b", b, n),
                dataset_column("arithmetic_reward", "op", op, n), strict=False,
            )
        )
    scores = []
    for c, expected, operands in zip(completions, answer, problem, strict=False):
        # a last-number rule would grade where generation was cut (0.63 at 10 tokens, 0.36 at 64)
        value = stated_result(completion_text(c), *(operands or ()))
        scores.append(1.0 if value is not None and numbers_close(value, expected) else 0.0)
    return scores
