"""Arithmetic: "What is a + b? Reply with only the number." (a small, fast task for smoke runs).

Problems are drawn from the grid of all ``(op, a, b)`` with ``a, b`` in ``[low, high]`` and ``op`` in ``ops``
(``+``, ``-``, ``*``). The reward (:func:`arithmetic_reward`) is 1.0 if the **first stated result** of the completion
equals the answer, else 0.0 (see :func:`stated_result`): the first number, after skipping a leading restatement
``a op b`` of the problem. It does not depend on what the model writes after its result, so accuracy does not depend
on where generation is cut.
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
_COMMUTATIVE = ("+", "*")


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


def check_arithmetic_args(low: int, high: int, ops: Sequence[str]) -> tuple[str, ...]:
    """Check the operand range and operators of an arithmetic grid, as every function of this module does.

    Args:
        low (`int`): Smallest operand.
        high (`int`): Largest operand, ``>= low``.
        ops (`Sequence[str] | str`): Distinct operators of :data:`ALLOWED_OPS` (a single string is one operator).

    Returns:
        `tuple[str, ...]`: ``ops`` as a tuple.

    Raises:
        ValueError: If ``low``/``high`` are not integers with ``low <= high``, or ``ops`` is empty, repeats an
            operator or names one outside :data:`ALLOWED_OPS`.
    """
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
        (`datasets.Dataset`): Columns ``prompt``, ``a``, ``b``, ``op`` and ``answer`` (``int``).

    Raises:
        ValueError: If an argument is out of range.
    """
    from datasets import Dataset

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    ops = check_arithmetic_args(low, high, ops)
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

    The legacy two-way split (kept as it was, so its splits do not change); new code should use
    :func:`make_arithmetic_dataset_dict`, whose test split does not change with the train size.

    ``n_train + n_eval`` distinct problems are drawn **without replacement** from the grid of
    ``len(ops) * (high - low + 1) ** 2`` problems; the first ``n_train`` form the train set.

    Args:
        n_train (`int`): Train rows, ``>= 1``.
        n_eval (`int`, defaults to 200): Held-out rows, ``>= 1``.
        seed (`int`, defaults to 0): Seed; same seed, same splits.
        low (`int`): As in :func:`make_arithmetic_dataset`.
        high (`int`): As in :func:`make_arithmetic_dataset`.
        ops (`Sequence[str]`): As in :func:`make_arithmetic_dataset`.
        conversational (`bool`): As in :func:`make_arithmetic_dataset`.

    Returns:
        (`tuple[datasets.Dataset, datasets.Dataset]`): ``(train, held_out)``, columns as in
            :func:`make_arithmetic_dataset`.

    Raises:
        ValueError: If an argument is out of range or ``n_train + n_eval`` exceeds the number of distinct
            problems.
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
    """Generate disjoint train, validation and test splits: no question appears twice, in a split or across them.

    One permutation of the grid of ``len(ops) * (high - low + 1) ** 2`` problems is drawn from
    ``random.Random(seed)``; **test** is its first ``num_test`` problems, **validation** the next
    ``num_validation``, **train** the next ``num_train``. So the test split depends only on ``(seed, low, high,
    ops, num_test)``: it stays the same when the train or validation sizes change, and validation stays the same
    when the train size changes. Tune on validation (e.g. the trainer's periodic evaluations) and report test.

    Args:
        num_train (`int`): Train rows, ``>= 0``.
        num_validation (`int`): Validation rows, ``>= 0`` (0 gives an empty validation split).
        num_test (`int`): Test rows, ``>= 0``.
        seed (`int`, defaults to 0): Seed; same seed, same splits; another seed, other splits.
        low (`int`): As in :func:`make_arithmetic_dataset`.
        high (`int`): As in :func:`make_arithmetic_dataset`.
        ops (`Sequence[str]`): As in :func:`make_arithmetic_dataset`.
        conversational (`bool`): As in :func:`make_arithmetic_dataset`.

    Returns:
        (`datasets.DatasetDict`): Keys ``"train"``, ``"validation"``, ``"test"``; columns as in
            :func:`make_arithmetic_dataset` (empty splits keep the columns).

    Raises:
        ValueError: If a size is not an integer ``>= 0``, all three are 0, another argument is out of range, or the
            sizes add up to more than the grid holds.
    """
    from datasets import Dataset, DatasetDict

    sizes = {"num_train": num_train, "num_validation": num_validation, "num_test": num_test}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
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
    indices = _permutation_prefix(random.Random(seed), size, total)
    everything = Dataset.from_list(_rows(indices, low, high, ops, conversational))
    first_train = num_test + num_validation

    def rows(start: int, stop: int):  # datasets rejects an empty range that starts at the end: select [] then
        return everything.select(range(start, stop) if stop > start else [])

    return DatasetDict(
        {"train": rows(first_train, total), "validation": rows(num_test, first_train), "test": rows(0, num_test)}
    )


def worked_answer(a: int, op: str, b: int) -> str:
    """The correct answer in the model's own format: ``"47 + 35 = 82"`` (a restatement, then the result).

    SmolLM2-135M-Instruct answers the arithmetic prompts this way despite "Reply with only the number";
    :func:`arithmetic_reward` scores it 1.0 (its first stated result is the answer).

    Args:
        a (`int`): Left operand.
        op (`str`): One of :data:`ALLOWED_OPS`.
        b (`int`): Right operand.

    Returns:
        `str`: ``f"{a} {op} {b} = {result}"``.

    Raises:
        ValueError: If ``op`` is not one of :data:`ALLOWED_OPS`.
    """
    if op not in _APPLY:
        raise ValueError(f"op must be one of {ALLOWED_OPS}, got {op!r}")
    return f"{a} {op} {b} = {_APPLY[op](a, b)}"


def make_arithmetic_sft_dataset(dataset):
    """Supervised targets for arithmetic prompts: each prompt with its correct worked answer as the completion.

    The result is a *prompt-completion* dataset in TRL's format, as ``trl.SFTTrainer`` takes it: a conversational
    prompt (``[{"role": "user", ...}]``) gets the completion ``[{"role": "assistant", "content": "47 + 35 =
    82"}]``, a plain-text prompt gets the string ``" 47 + 35 = 82"`` (:func:`worked_answer` after one space:
    ``SFTTrainer`` joins a plain prompt and its completion as they are, so the space between the prompt's last word
    and the answer must be the completion's, as in the text ``"...the number. 47 + 35 = 82"`` a base model reads and
    a sampled completion starts). The other columns (``a``, ``b``, ``op``, ``answer``) are kept, so
    :func:`arithmetic_reward` still grades the rows.

    Args:
        dataset (`datasets.Dataset`): Rows of :func:`make_arithmetic_dataset` / :func:`make_arithmetic_dataset_dict`
            (columns ``prompt``, ``a``, ``b``, ``op``; e.g. the train split).

    Returns:
        (`datasets.Dataset`): The same rows plus a ``completion`` column.

    Raises:
        ValueError: If a column ``prompt``, ``a``, ``b`` or ``op`` is missing, or ``dataset`` already has a
            ``completion`` column.
    """
    missing = [c for c in ("prompt", "a", "b", "op") if c not in dataset.column_names]
    if missing:
        raise ValueError(f"make_arithmetic_sft_dataset needs the columns prompt, a, b, op; {missing} missing")
    if "completion" in dataset.column_names:
        raise ValueError("dataset already has a 'completion' column")

    def add_completion(row):
        text = worked_answer(row["a"], row["op"], row["b"])
        conversational = isinstance(row["prompt"], list)
        return {"completion": [{"role": "assistant", "content": text}] if conversational else " " + text}

    return dataset.map(add_completion)


def _is_operand(value: int | float, operand) -> bool:
    return operand is not None and numbers_close(value, operand)


def stated_result(text: str, a=None, b=None, op: str | None = None) -> int | float | None:
    """The first stated result of a completion: its first number, after a leading restatement of the problem.

    If the first two numbers of ``text`` are the operands ``a`` and ``b`` in that order (or ``b``, ``a`` for the
    commutative ``+`` and ``*``) with only the operator ``op`` between them (any spelling in
    :data:`OPERATOR_SPELLINGS`, any spaces, brackets around a negative operand), they are a restatement of the
    problem and the result is the **next**
    number (whatever joins them: ``=``, ``is``, ``equals``, ...). Otherwise the result is the **first** number.
    With ``a``, ``b`` or ``op`` missing (``None``) the result is always the first number.

    For ``47 + 35``: ``"82"``, ``"82."``, ``"The answer is 82"``, ``"47 + 35 = 82"``, ``"35+47=82"``,
    ``"47 + 35 = 82\\n56 - 44 = 12"`` and ``"47 plus 35 equals 82, and ..."`` all state 82; ``"47 + 35 = 83 ...
    82"`` states 83, ``"83, no 82"`` states 83, ``"47 + 35"`` and ``"no idea"`` state nothing.

    The result depends only on the text up to and including its number: whatever follows a complete number (one
    followed by a character that cannot continue it, e.g. a space or a newline) never changes it. One exception is
    inherent to the rule: when the answer equals an operand (``7 * 1``), the text ``"7 "`` states 7, while its
    continuation ``"7 * 1 = 8"`` restates the problem and states 8.

    Args:
        text (`str`): Completion text.
        a (`int | float`, *optional*): Left operand of the problem.
        b (`int | float`, *optional*): Right operand.
        op (`str`, *optional*): Operator, one of :data:`ALLOWED_OPS`.

    Returns:
        `int | float | None`: The stated result (see :func:`trl_es.rewards.find_numbers` for what a number is), or
        ``None`` if there is none.

    Raises:
        ValueError: If ``op`` is given and is not one of :data:`ALLOWED_OPS`.
    """
    if op is not None and op not in _OPERATOR_RES:
        raise ValueError(f"op must be one of {ALLOWED_OPS} (or None), got {op!r}")
    numbers = find_number_spans(text, limit=3)
    if not numbers:
        return None
    if a is not None and b is not None and op is not None and len(numbers) >= 2:
        (x, _, x_end), (y, y_start, _) = numbers[0], numbers[1]
        between = text[x_end:y_start]
        if _OPERATOR_RES[op].fullmatch(between):
            second = y
        elif op == "-" and not between.strip() and text[y_start] in "-\u2212":
            second = -y  # "47 -35": the minus was read as the sign of 35
        else:
            second = None
        if second is not None:
            in_order = _is_operand(x, a) and _is_operand(second, b)
            swapped = op in _COMMUTATIVE and _is_operand(x, b) and _is_operand(second, a)
            if in_order or swapped:
                return numbers[2][0] if len(numbers) > 2 else None
    return numbers[0][0]


def arithmetic_reward(
    prompts: list, completions: list, completion_ids=None, answer=None, a=None, b=None, op=None, **kwargs
) -> list[float]:
    """TRL reward function: 1.0 if the completion's first stated result equals the answer, else 0.0.

    The rule ("first stated result", :func:`stated_result`): the answer is the first number of the completion,
    after skipping a leading restatement ``a op b`` of the problem (together with the ``=``/"is"/"equals" that
    follows it). So for ``47 + 35``, ``"82"``, ``"82."``, ``"The answer is 82"``, ``"47 + 35 = 82"``,
    ``"47+35=82\\n56 - 44 = 12"`` and ``"47 + 35 equals 82, and 56 - 44 = 12"`` score 1.0; ``"47 + 35 = 83\\n...
    82"``, ``"83, no 82"`` and a completion without a number score 0.0. Numbers compare with
    :func:`trl_es.rewards.numbers_close` (``"82.0"`` equals 82).

    Why: SmolLM2-135M-Instruct answers ``"47 + 35 = 82"`` despite "Reply with only the number", and once trained
    it keeps going (``"47 + 35 = 82\\n56 - 44 = 12"``): a last-number rule then grades where generation was cut
    (accuracy 0.63 at 10 new tokens, 0.36 at 64), while the first stated result does not change with the length.

    Without the ``a``, ``b`` and ``op`` columns (datasets other than :func:`make_arithmetic_dataset`'s), no
    restatement can be recognised and the answer is the first number of the completion.

    Args:
        prompts (`list`): Prompts (unused).
        completions (`list[str | list[dict]]`): Completions, standard or conversational format.
        completion_ids (*optional*): Unused.
        answer (`list[int]`): Dataset column: the correct result of each problem.
        a (`list[int]`, *optional*): Dataset column: left operands.
        b (`list[int]`, *optional*): Dataset column: right operands.
        op (`list[str]`, *optional*): Dataset column: operators.
        **kwargs: Other columns and trainer extras; ignored.

    Returns:
        `list[float]`: 1.0 or 0.0 per completion.

    Raises:
        ValueError: If ``answer`` is missing or not as long as ``completions``, or ``a``/``b``/``op`` are given with
            another length.
    """
    n = len(completions)
    answer = dataset_column("arithmetic_reward", "answer", answer, n)
    problem = [None] * n
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
        value = stated_result(completion_text(c), *(operands or ()))
        scores.append(1.0 if value is not None and numbers_close(value, expected) else 0.0)
    return scores
