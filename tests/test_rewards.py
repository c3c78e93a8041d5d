"""Shared reward pieces: completion text, answer extraction, numbers, tolerance, format score."""

import math

import pytest
from time_limit import time_limit

from trl_es.rewards import (
    completion_text,
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


# ----------------------------------------------------------------------------- completion_text


def test_completion_text_standard_and_conversational():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "hi"}]) == "hi"
    assert completion_text({"role": "assistant", "content": "one"}) == "one"
    # Tool calling: TRL appends tool results and a further assistant turn; the last assistant turn counts.
    messages = [
        {"role": "assistant", "content": "call", "tool_calls": [{"name": "f"}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "<answer>42</answer>"},
    ]
    assert completion_text(messages) == "<answer>42</answer>"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"text": "b"}]}]
    assert completion_text(parts) == "ab"
    assert completion_text([{"role": "assistant", "content": None}]) == ""
    assert completion_text([{"role": "tool", "content": "x"}]) == ""


@pytest.mark.parametrize("bad", [3, None, [1, 2], [{"role": "assistant", "content": 5}]])
def test_completion_text_rejects_other_types(bad):
    with pytest.raises(TypeError, match="completion|content"):
        completion_text(bad)


# ----------------------------------------------------------------------------- extraction


def test_extract_answer_tag_last_wins():
    assert extract_answer_tag("<answer>1</answer> then <answer> 2 </answer>") == " 2 "
    assert extract_answer_tag("<answer>a\nb</answer>") == "a\nb"
    assert extract_answer_tag("<answer>open only") is None
    assert extract_answer_tag("no tags") is None
    assert extract_answer_tag("<answer></answer>") == ""


def test_extract_boxed():
    assert extract_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{1} or \boxed{2}") == "2"
    assert extract_boxed(r"\boxed{3} and \boxed{4") == "3"  # the last one never closes
    assert extract_boxed("nothing") is None
    with time_limit(5):
        assert extract_boxed("\\boxed{" * 20_000) is None


def test_find_numbers():
    assert find_numbers("10-3") == [10, 3]
    assert find_numbers("x = -3, y=(2)-1") == [-3, 2, 1]
    assert find_numbers("1,234.5 and 7.") == [1234.5, 7]
    assert find_numbers("3, 4") == [3, 4]
    assert find_numbers("1/2") == [1, 2]
    assert find_numbers("\u22125") == [-5]
    assert find_numbers("none") == []
    assert type(find_numbers("7")[0]) is int and type(find_numbers("7.0")[0]) is float


def test_find_number_spans_and_huge_numbers():
    assert find_number_spans("x = -3, then 1,234.5!") == [(-3, 4, 6), (1234.5, 13, 20)]
    assert find_number_spans("1 2 3 4", limit=2) == [(1, 0, 1), (2, 2, 3)]
    with time_limit(5):  # Python refuses int() of > 4300 digits and is quadratic below: huge numbers read as floats
        assert find_numbers("9" * 200_000 + " and 7") == [math.inf, 7]
        assert find_numbers("1" * 1000) == [int("1" * 1000)] and find_numbers("1" * 1001) == [float("1" * 1001)]
        assert last_number("12 " + "9" * 5000) == math.inf


def test_first_and_last_number():
    assert first_number("The answer is 8, not 9") == 8
    assert last_number("The answer is 8, not 9") == 9
    assert first_number("no digits") is None
    assert last_number("") is None


@pytest.mark.parametrize(
    "value, expected",
    [("98", 98), (" -11 ", -11), ("27.4", 27.4), ("266.6666666666667", 266.6666666666667), ("1,234", 1234),
     ("1e3", 1000.0), (".5", 0.5), (7, 7), (2.5, 2.5)],
)
def test_parse_number_accepts(value, expected):
    got = parse_number(value)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("value", ["abc", "12 apples", "", "1 2", True, None, float("nan"), float("inf"), "nan",
                                   "9" * 200])
def test_parse_number_rejects(value):
    assert parse_number(value) is None


def test_numbers_close_tolerance():
    assert numbers_close(800 / 3, 266.6666666666667)
    assert numbers_close(27.4, 27.400009)  # within the paper's 1e-5
    assert not numbers_close(27.4, 27.40002)
    assert numbers_close(-11, -11.0)
    assert not numbers_close(100, 101, abs_tol=0.5)
    assert numbers_close(100, 101, rel_tol=0.01)
    assert not numbers_close(float("nan"), float("nan"))
    assert numbers_close(10**400, 10**400) and not numbers_close(10**400, 10**400 + 1)
    with pytest.raises(ValueError, match="abs_tol"):
        numbers_close(1, 1, abs_tol=-1)


# ----------------------------------------------------------------------------- format score


@pytest.mark.parametrize(
    "text, expected",
    [
        ("reasoning</think>\n<answer>1 + 2</answer>", 1.0),  # starts inside the think block (prompt opened it)
        ("reasoning</think>\n<answer>1 + 2</answer>\n", 1.0),  # trailing whitespace ignored
        ("<think>reasoning</think>\n<answer>1 + 2</answer>", 1.0),  # opening <think> repeated: still fine
        ("reasoning</think> <answer>1</answer>", 0.6),  # space instead of newline: partial credit
        ("reasoning</think>\n<answer>1</answer> trailing text", 0.6),
        ("<answer>1</answer>", 0.5),  # the think block never closes
        ("reasoning</think>", 0.1),
        ("reasoning</think>\n<answer>1", 0.1),  # malformed answer tag
        ("", 0.0),
    ],
)
def test_think_answer_format_score(text, expected):
    assert think_answer_format_score(text) == expected


def test_format_score_without_prefill():
    assert think_answer_format_score("<think>r</think>\n<answer>1</answer>", prefill="") == 1.0
    assert think_answer_format_score("r</think>\n<answer>1</answer>", prefill="") == 0.5


def test_format_reward_trl_signature_both_formats():
    completions = ["r</think>\n<answer>1</answer>", [{"role": "assistant", "content": "<answer>1</answer>"}], "x"]
    out = format_reward(["p"] * 3, completions, completion_ids=None, trainer_state=None, target=[1] * 3)
    assert out == [1.0, 0.5, 0.0]
    assert all(isinstance(v, float) for v in out)
    assert not any(math.isnan(v) for v in out)


def test_linear_time_matchers_equal_the_paper_regexes():
    """The format score and answer extraction reimplement the paper's regexes in linear time; on random
    strings built from the tags they must agree with the regexes exactly."""
    import random
    import re

    def paper_format(text):
        text = "<think>" + text.rstrip()
        if re.match(r"^<think>.*?</think>\n<answer>.*?</answer>$", text, re.DOTALL):
            return 1.0
        return 0.1 * bool(re.search(r"<think>.*?</think>", text, re.DOTALL)) + 0.5 * bool(
            re.search(r"<answer>.*?</answer>", text, re.DOTALL)
        )

    def paper_answer(text):
        matches = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
        return matches[-1] if matches else None

    pieces = ["<think>", "</think>", "<answer>", "</answer>", "\n", " ", "x", "</think>\n<answer>"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        assert think_answer_format_score(text) == pytest.approx(paper_format(text)), repr(text)
        assert extract_answer_tag(text) == paper_answer(text), repr(text)


def test_hostile_text_is_handled_quickly():
    with time_limit(5):
        assert think_answer_format_score("<answer>" * 50_000) == 0.0
        assert think_answer_format_score("</think>\n<answer>" * 20_000) == 0.1  # answer never closed
        assert think_answer_format_score("</think>\n<answer>" * 20_000 + "</answer>") == 1.0
        assert extract_answer_tag("<answer>" * 50_000) is None
        assert find_numbers("-1" * 50_000)[:3] == [-1, 1, 1]  # later minus signs follow a digit: subtraction
