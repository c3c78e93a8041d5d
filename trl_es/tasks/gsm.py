"""GSM-style word problems from ``reasoning-gym`` generators, graded with ``math-verify``.

Problems come from a procedural `reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generator
(default ``"gsm_symbolic"``: GSM8K templates with fresh numbers), so any number of seeded problems can be made
offline. The reward (:func:`gsm_reward`) takes the model's final answer from, in this order, the last
``<answer>...</answer>`` block, else the last ``\\boxed{...}``, else the last number in the text, and checks it
against the reference answer with ``math_verify.verify`` (numeric equality up to its rounding, so ``"560"``,
``"560.0"``, ``"\\boxed{560}"`` and ``"1,234"`` vs ``1234`` all match).
"""

from __future__ import annotations

import threading

from ..rewards import completion_text, dataset_column, extract_answer_tag, extract_boxed, find_numbers

__all__ = ["GSM_INSTRUCTION", "MAX_ANSWER_LENGTH", "extract_final_answer", "gsm_answer_score", "gsm_reward",
           "make_gsm_dataset"]

#: Appended to each question (after a blank line) to ask for a tagged final answer.
GSM_INSTRUCTION = "Think step by step, then give the final answer as a number in <answer> </answer> tags."
#: Extracted answers longer than this (characters) score 0 without being parsed.
MAX_ANSWER_LENGTH = 200


def extract_final_answer(text: str) -> str | None:
    r"""Return the final answer written in ``text``.

    Order: the content of the last ``<answer>...</answer>``; else the content of the last ``\boxed{...}``;
    else the last number (see :func:`trl_es.rewards.find_numbers`).

    Args:
        text (`str`): Completion text.

    Returns:
        `str | None`: The answer text (stripped), or ``None`` if there is none.
    """
    answer = extract_answer_tag(text)
    if answer is None:
        answer = extract_boxed(text)
    if answer is None:
        numbers = find_numbers(text)
        answer = str(numbers[-1]) if numbers else None
    return None if answer is None else answer.strip()


def gsm_answer_score(text: str, answer: str | float) -> float:
    """Score one completion: 1.0 if its final answer (:func:`extract_final_answer`) is mathematically equal
    to ``answer`` according to ``math_verify.verify``, else 0.0.

    Args:
        text (`str`): Completion text.
        answer (`str | int | float`): Reference answer, e.g. ``"288"``.

    Returns:
        `float`: 1.0 or 0.0. Missing, over-long (> :data:`MAX_ANSWER_LENGTH` characters) or unparsable answers
        score 0.0.
    """
    from math_verify import parse, verify

    predicted = extract_final_answer(text)
    if not predicted or len(predicted) > MAX_ANSWER_LENGTH:
        return 0.0
    # math-verify's timeouts use SIGALRM, which only works in the main thread; elsewhere run without one
    # (the answer length cap keeps parsing cheap).
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(str(answer), parsing_timeout=timeout)
    # Wrap in $...$ so math-verify reads plain numbers, LaTeX and expressions alike.
    pred = parse(predicted if "\\boxed" in predicted or "$" in predicted else f"${predicted}$", parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def gsm_reward(prompts: list, completions: list, completion_ids=None, answer=None, **kwargs) -> list[float]:
    """TRL reward function: :func:`gsm_answer_score` of each completion.

    Args:
        prompts (`list`): Prompts (unused).
        completions (`list[str | list[dict]]`): Completions, standard or conversational format.
        completion_ids (*optional*): Unused.
        answer (`list[str]`): Dataset column: the reference answer of each problem.
        **kwargs: Other columns and trainer extras; ignored.

    Returns:
        `list[float]`: 1.0 or 0.0 per completion.

    Raises:
        ValueError: If ``answer`` is missing or not as long as ``completions``.
    """
    answer = dataset_column("gsm_reward", "answer", answer, len(completions))
    return [gsm_answer_score(completion_text(c), a) for c, a in zip(completions, answer)]


def make_gsm_dataset(
    n: int,
    seed: int = 0,
    generator: str = "gsm_symbolic",
    conversational: bool = True,
    instruction: str | None = GSM_INSTRUCTION,
    **generator_kwargs,
):
    """Generate ``n`` word problems with a reasoning-gym generator, reproducibly.

    Args:
        n (`int`): Number of problems, ``>= 1``.
        seed (`int`, defaults to 0): Generator seed; same seed, same rows.
        generator (`str`, defaults to ``"gsm_symbolic"``): A reasoning-gym dataset name (any whose answers are
            numbers or math expressions works with :func:`gsm_reward`, e.g. ``"basic_arithmetic"``).
        conversational (`bool`, defaults to True): ``prompt`` as ``[{"role": "user", "content": ...}]``; if
            False, the plain string.
        instruction (`str | None`, defaults to :data:`GSM_INSTRUCTION`): Appended after the question; ``None``
            for the bare question.
        **generator_kwargs: Further options of the reasoning-gym generator's config.

    Returns:
        `datasets.Dataset`: Columns ``prompt``, ``question`` and ``answer`` (``str``).

    Raises:
        ValueError: If ``n`` is not positive or ``generator`` is not a reasoning-gym dataset name.
    """
    import reasoning_gym
    from datasets import Dataset

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    try:
        source = reasoning_gym.create_dataset(generator, size=n, seed=seed, **generator_kwargs)
    except (KeyError, ValueError) as e:
        raise ValueError(f"generator must be a reasoning-gym dataset name such as 'gsm_symbolic': {e}") from e
    rows = []
    for entry in source:
        question = entry["question"]
        text = question if instruction is None else f"{question}\n\n{instruction}"
        prompt = [{"role": "user", "content": text}] if conversational else text
        rows.append({"prompt": prompt, "question": question, "answer": str(entry["answer"])})
    return Dataset.from_list(rows)
