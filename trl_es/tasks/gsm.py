"""GSM-style word problems from ``reasoning-gym`` generators, graded numerically or with ``math-verify``.

Problems come from a procedural `reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generator (default
``"gsm_symbolic"``: GSM8K templates with fresh numbers). :func:`gsm_reward` compares the final answer
(:func:`extract_final_answer`) exactly as a decimal when both are plain numbers (:func:`plain_number`), else with
``math_verify`` in a helper process with a time limit (:func:`math_verify_equal`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from decimal import Decimal, InvalidOperation

from ..rewards import completion_text, dataset_column, extract_answer_tag, extract_boxed, find_numbers


__all__ = [
    "GSM_INSTRUCTION",
    "MATH_VERIFY_TIMEOUT",
    "MAX_ANSWER_LENGTH",
    "extract_final_answer",
    "gsm_answer_score",
    "gsm_reward",
    "make_gsm_dataset",
    "math_verify_equal",
    "math_verify_input_ok",
    "plain_number",
]

logger = logging.getLogger(__name__)

#: Appended to each question (after a blank line) to ask for a tagged final answer.
GSM_INSTRUCTION = "Think step by step, then give the final answer as a number in <answer> </answer> tags."
#: Extracted answers longer than this (characters) score 0 without being parsed.
MAX_ANSWER_LENGTH = 200
#: Seconds one math-verify comparison may take (wall clock, in the helper process) before it is abandoned, scored
#: 0.0 and its helper process killed. Inside the helper, math-verify's own limit is 1 s per parse and per comparison.
MATH_VERIFY_TIMEOUT = 5.0
#: Seconds a new helper process may take to start (import math-verify and sympy) before grading falls back to
#: calling math-verify in this process.
MATH_VERIFY_STARTUP_TIMEOUT = 60.0


def extract_final_answer(text: str) -> str | None:
    r"""The final answer in ``text``, stripped: the last ``<answer>...</answer>``, else the last ``\boxed{...}``, else
    the last number (:func:`trl_es.rewards.find_numbers`); ``None`` if there is none.
    """
    answer = extract_answer_tag(text)
    if answer is None:
        answer = extract_boxed(text)
    if answer is None:
        numbers = find_numbers(text)
        answer = str(numbers[-1]) if numbers else None
    return None if answer is None else answer.strip()


# ---------------------------------------------------------------------------------------------- plain numbers

_WRAPPERS_RE = re.compile(
    r"\\(?:boxed|fbox|text|textrm|textnormal|textbf|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"
)
_CURRENCY_RE = re.compile(
    r"\\\$|\$|\\(?:euro|texteuro|pounds|textsterling|textdollar|yen|textyen)\b"
    r"|[\u20ac\u00a3\u00a5\u20b9\u20a9\u20bd\u00a2]|\b(?:USD|US|EUR|GBP|CAD|AUD|INR)\b"
)
_LATEX_SPACE_RE = re.compile(r"\\[,;:! ]|~|\\quad|\\qquad")
_LEADING_RE = re.compile(r"^(?:(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?|[A-Za-z]\w*\s*=|=)\s*", re.IGNORECASE)
_NUMBER_PART = (
    r"(?P<sign>[-+\u2212]?)\s*"
    r"(?P<number>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d{1,3}(?:[ \u00a0\u2009\u202f]\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
# A unit: "%", or words of letters joined by spaces, "/", "-", ".", "'" (dollars, km/h, square feet, per cent);
# squares and cubes (m^2, m²) are removed before matching.
_UNIT_PART = r"(?P<unit>%|[^\W\d_]+(?:[\s/.'\u2019-]+[^\W\d_]+)*)?"
_PLAIN_RE = re.compile(rf"{_NUMBER_PART}\s*{_UNIT_PART}")
_POWER_UNIT_RE = re.compile(r"(?<=[^\W\d_])(?:\^\{?[23]\}?|[\u00b2\u00b3])")  # m^2, cm³: after a letter only
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}


def plain_number(text: str) -> Decimal | None:
    r"""``text`` as one plain number (exact ``Decimal``), after removing the usual decorations of a numeric answer.

    Removed: wrappers (``\boxed{..}``, ``\text{..}``, ``\mathrm{..}``, ...), currency signs and codes (``$``, ``\$``,
    ``€``, ``£``, ``USD``, ...), LaTeX spacing, trailing punctuation, a leading ``=``, ``x =`` or ``The answer is``,
    thousands separators (``1,234``, ``1 234``), and a unit after the number (``%``, ``18 dollars``, ``18 km/h``,
    ``18 m^2``; ``18%`` reads as 18). The scale words ``thousand`` ... ``trillion`` multiply (``1.5 million``).

    Returns:
        `decimal.Decimal | None`: e.g. ``Decimal("1234.00")`` for ``"\$1,234.00"``; ``None`` if anything else is left
            (another number, an operator, a fraction) or ``text`` is longer than :data:`MAX_ANSWER_LENGTH`.
    """
    if not isinstance(text, str) or len(text) > MAX_ANSWER_LENGTH:
        return None
    s = text
    for _ in range(3):  # nested wrappers: \boxed{\text{18}}
        s = _WRAPPERS_RE.sub(r"\1", s)
    s = s.replace("\\%", "%").replace("{,}", ",").replace("\u2212", "-")
    s = re.sub(r"\\[()\[\]]", " ", s)  # \( \) \[ \] go
    s = _CURRENCY_RE.sub(" ", s)  # anywhere: $ is also a LaTeX math delimiter
    s = _LATEX_SPACE_RE.sub(" ", s)
    s = s.strip().rstrip(".,;:!? \t\n")
    s = _LEADING_RE.sub("", s).strip()
    match = _PLAIN_RE.fullmatch(_POWER_UNIT_RE.sub("", s))  # a sign, a decimal, an optional unit, nothing else
    if match is None:
        return None
    digits = re.sub(r"[, \u00a0\u2009\u202f]", "", match["number"])  # thousands separators go
    try:
        value = Decimal(digits)
    except InvalidOperation:
        return None
    unit = (match["unit"] or "").lower()
    scale = _SCALES.get(unit.split()[0] if unit.split() else "")
    if scale is not None:  # 1.5 million is 1500000
        value *= scale
    return -value if match["sign"] == "-" else value


# ---------------------------------------------------------------------------------------------- math-verify, bounded

_HEAVY_COMMANDS_RE = re.compile(r"\\(?:sum|prod|int|iint|iiint|oint|lim|limsup|liminf)(?![A-Za-z])")
_MAX_NESTING = 10


def _exponent(text: str, start: int) -> str:
    """The exponent at ``text[start:]`` (after ``^`` or ``**``): a bracketed group or a run of word characters."""
    i = start
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] in "{(":
        opener, closer = text[i], "}" if text[i] == "{" else ")"
        depth, j = 0, i
        while j < len(text):
            depth += (text[j] == opener) - (text[j] == closer)
            if depth == 0:
                return text[i : j + 1]
            j += 1
        return text[i:]
    match = re.match(r"[-+]?[\w.\\]+", text[i:])
    return match.group(0) if match else ""


def math_verify_input_ok(text: str) -> bool:
    r"""Whether math-verify (and sympy) may be asked about ``text``, a cheap pre-screen.

    Rejected: longer than :data:`MAX_ANSWER_LENGTH`; brackets nested deeper than 10; a power tower
    (``10^{10^{10}}``, ``2**3**4``) or an exponent of 4 or more digits; more than 4 powers; a factorial of anything but
    a number below 1000; ``\sum``, ``\prod``, ``\int``, ``\lim``.
    """
    # such answers never equal a GSM number, and make sympy compute for hours
    if len(text) > MAX_ANSWER_LENGTH or _HEAVY_COMMANDS_RE.search(text):
        return False
    depth = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            if depth > _MAX_NESTING:
                return False
        elif ch in ")]}":
            depth = max(0, depth - 1)
    powers = [m.end() for m in re.finditer(r"\^|\*\*", text)]
    if len(powers) > 4:
        return False
    for end in powers:
        exponent = _exponent(text, end)
        rest = text[end:].lstrip(" ")[len(exponent) :].lstrip(" ")
        if "^" in exponent or "**" in exponent or rest.startswith(("^", "**")) or re.search(r"\d{4,}", exponent):
            return False  # a tower (10^{10^{10}}, 2**3**4) or a big exponent
    for match in re.finditer(r"!", text):
        before = text[: match.start()].rstrip()
        # only n! with n < 1000: (10^3)! and 1000! are refused
        if not re.search(r"(?<![\d.])\d{1,3}$", before) and not before.endswith("\\"):
            return False
    return True


class _MathVerifyProcess:
    """One helper process running ``_math_verify_worker.py``; a reader thread forwards its replies to a queue."""

    def __init__(self):
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_verify_worker.py")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same math_verify as this process
        self.process = subprocess.Popen(
            [sys.executable, worker],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            encoding="utf-8",
            bufsize=1,
        )
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="math-verify-reader", daemon=True).start()
        if self._next_reply(MATH_VERIFY_STARTUP_TIMEOUT) != {"ready": True}:
            self.kill()
            raise RuntimeError("the math-verify helper process did not start")

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                self.replies.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.replies.put(None)  # the process is gone

    def _next_reply(self, seconds: float):
        try:
            return self.replies.get(timeout=seconds)
        except queue.Empty:
            return None

    def equal(self, gold: str, pred: str, seconds: float) -> bool | None:
        """``True``/``False`` from math-verify, or ``None`` without a reply within ``seconds`` (wall clock)."""
        start = time.monotonic()
        try:
            # math-verify's own limit, per parse and per comparison
            request = {"gold": gold, "pred": pred, "timeout": max(1, int(seconds // 5))}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return None
        reply = self._next_reply(seconds)
        # a reply queued too late counts as late: the caller restarts the helper
        if reply is None or time.monotonic() - start > seconds:
            return None
        return bool(reply.get("equal"))

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


_idle_helpers: list[_MathVerifyProcess] = []
_all_helpers: list[_MathVerifyProcess] = []
_helpers_lock = threading.Lock()
_helpers_unavailable = False


def _forget_helpers_after_fork() -> None:
    # A forked child must not talk to its parent's helpers (their pipes are shared, their reader threads are not
    # copied) nor wait on a lock some parent thread held at the fork: start afresh, without killing anything.
    global _helpers_lock, _helpers_unavailable
    _helpers_lock = threading.Lock()
    _idle_helpers.clear()
    _all_helpers.clear()
    _helpers_unavailable = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers_after_fork)


def _acquire_helper() -> _MathVerifyProcess | None:
    global _helpers_unavailable
    with _helpers_lock:
        if _idle_helpers:
            return _idle_helpers.pop()
        if _helpers_unavailable:  # one failed start: math-verify in this process from then on
            return None
    try:
        helper = _MathVerifyProcess()
    except (OSError, RuntimeError, TypeError, ValueError) as e:
        logger.warning(f"math-verify helper process unavailable ({e}); math-verify runs in this process instead.")
        with _helpers_lock:
            _helpers_unavailable = True
        return None
    with _helpers_lock:
        _all_helpers.append(helper)
    return helper


@atexit.register
def _stop_helpers() -> None:
    with _helpers_lock:
        helpers = list(_all_helpers)
        _all_helpers.clear()
        _idle_helpers.clear()
    for helper in helpers:
        helper.kill()


def _math_verify_in_process(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    # math-verify's time limits use SIGALRM, which only works in the main thread; elsewhere only the pre-screen
    # (math_verify_input_ok) bounds the work.
    seconds = max(1, int(MATH_VERIFY_TIMEOUT)) if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(gold, parsing_timeout=seconds)
    pred_parsed = parse(pred, parsing_timeout=seconds)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=seconds))


def math_verify_equal(gold: str, pred: str, timeout: float = MATH_VERIFY_TIMEOUT) -> bool:
    """``math_verify.verify(parse(gold), parse(pred))``, in bounded time on any thread and in any process.

    Args:
        gold (`str`): The reference answer.
        pred (`str`): The answer to check, e.g. ``"$\\frac{576}{2}$"``.
        timeout (`float`, *optional*): Seconds to wait (:data:`MATH_VERIFY_TIMEOUT`); a new helper first takes 1-2 s
            to start (at most :data:`MATH_VERIFY_STARTUP_TIMEOUT`).

    Returns:
        `bool`: Whether math-verify finds them equal; ``False`` on a timeout or an input that fails
            :func:`math_verify_input_ok`.
    """
    if not (math_verify_input_ok(gold) and math_verify_input_ok(pred)):
        return False
    helper = _acquire_helper()  # a helper per concurrent caller: a slow comparison holds up no other thread
    if helper is None:
        return _math_verify_in_process(gold, pred)  # no helper could start: math-verify here
    result = helper.equal(gold, pred, timeout)
    with _helpers_lock:
        if result is None:
            if helper in _all_helpers:
                _all_helpers.remove(helper)
        else:
            _idle_helpers.append(helper)
    if result is None:
        helper.kill()
        # a computation SIGALRM could not interrupt: the next call starts a new helper
        logger.warning(f"math-verify gave no answer within {timeout} s; scored as not equal.")
        return False
    return result


def gsm_answer_score(text: str, answer: str | float) -> float:
    r"""1.0 if the final answer of ``text`` (:func:`extract_final_answer`) equals ``answer`` (e.g. ``"288"``), else 0.0.

    Two plain numbers (:func:`plain_number`) compare exactly (``18.00`` equals ``18``); anything else goes to
    :func:`math_verify_equal`. Missing, over-long (> :data:`MAX_ANSWER_LENGTH`) or unparsable answers score 0.0.
    """
    predicted = extract_final_answer(text)
    if not predicted or len(predicted) > MAX_ANSWER_LENGTH:
        return 0.0
    gold = str(answer).strip()
    gold_value = plain_number(gold)
    if gold_value is not None:
        predicted_value = plain_number(predicted)
        if predicted_value is not None:
            return 1.0 if predicted_value == gold_value else 0.0  # tolerance 0: 18.5 is not 18
    # $...$ so that plain expressions and LaTeX are both read
    pred = predicted if "\\boxed" in predicted or "$" in predicted else f"${predicted}$"
    return 1.0 if math_verify_equal(gold, pred) else 0.0


def gsm_reward(prompts: list, completions: list, completion_ids=None, answer=None, **kwargs) -> list[float]:
    """TRL reward function: :func:`gsm_answer_score` of each completion against the ``answer`` dataset column.

    Raises:
        ValueError: If ``answer`` is missing or not as long as ``completions``.
    """
    answer = dataset_column("gsm_reward", "answer", answer, len(completions))
    return [gsm_answer_score(completion_text(c), a) for c, a in zip(completions, answer, strict=False)]


def make_gsm_dataset(
    n: int,
    seed: int = 0,
    generator: str = "gsm_symbolic",
    conversational: bool = True,
    instruction: str | None = GSM_INSTRUCTION,
    **generator_kwargs,
):
    """``n >= 1`` word problems from a reasoning-gym generator, reproducibly (same ``seed``, same rows).

    Args:
        generator (`str`, defaults to ``"gsm_symbolic"``): A reasoning-gym dataset name whose answers are numbers or
            math expressions (e.g. ``"basic_arithmetic"``); ``**generator_kwargs`` go to its config.
        conversational (`bool`, defaults to True): ``prompt`` as a user message; if False, the plain string.
        instruction (`str | None`, *optional*): Appended after the question (:data:`GSM_INSTRUCTION`); ``None``: none.

    Returns:
        (`datasets.Dataset`): Columns ``prompt``, ``question`` and ``answer`` (``str``).

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
