"""Tasks: Countdown (safe grader, generator, paper JSON), arithmetic, GSM (reasoning-gym + math-verify), registry."""

import json
import os
from fractions import Fraction

import pytest
from time_limit import time_limit

from trl_es.tasks import TASKS, get_task
from trl_es.tasks.arithmetic import (
    arithmetic_question,
    arithmetic_reward,
    make_arithmetic_dataset,
    make_arithmetic_dataset_dict,
    make_arithmetic_splits,
    stated_result,
)
from trl_es.tasks.countdown import (
    countdown_answer_reward,
    countdown_answer_score,
    countdown_format_reward,
    countdown_prompt_text,
    countdown_reward,
    evaluate_expression,
    load_countdown_json,
    make_countdown_dataset,
)
from trl_es.tasks.gsm import (
    extract_final_answer,
    gsm_answer_score,
    gsm_reward,
    make_gsm_dataset,
    math_verify_equal,
    math_verify_input_ok,
    plain_number,
)
from paths import REPO

_REPO = REPO
_CANDIDATES = [os.path.join(base, "shared", "data", "countdown_paper.json") for base in (_REPO, os.path.dirname(_REPO))]
PAPER_JSON = next((p for p in _CANDIDATES if os.path.exists(p)), _CANDIDATES[0])
needs_paper_json = pytest.mark.skipif(not os.path.exists(PAPER_JSON), reason="countdown_paper.json not available")


def wrap(expression: str) -> str:
    return f"some reasoning</think>\n<answer>{expression}</answer>"


# ============================================================================= Countdown: expression evaluation


@pytest.mark.parametrize(
    "expression, value",
    [
        ("(44 + 19) + 35", Fraction(98)),
        ("98 / (47 - 52) + 47", Fraction(137, 5)),  # 27.4
        ("-3 + 5", Fraction(2)),
        ("+3 * -(2 - 7)", Fraction(15)),
        (" 1 +\n 2 ", Fraction(3)),  # any whitespace counts as a space
        ("10 / 4", Fraction(5, 2)),  # true division, exact
    ],
)
def test_evaluate_expression_values(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["2**3", "9**9**9**9", "abs(3)", "x", "__import__('os')", "4//2", "4 % 3", "1.5", "1e5", "(1)(2)", "[1]", "True",
     "1 2", "(1 + 2", "", "   ", "1 +", "0x10", "1_000", "3 = 3", "1 < 2"],
)
def test_evaluate_expression_rejects(expression):
    with pytest.raises(ValueError):
        evaluate_expression(expression)


def test_evaluate_expression_number_check_and_division_by_zero():
    assert evaluate_expression("35 + 44 + 19", numbers=[44, 19, 35]) == 98
    with pytest.raises(ValueError, match="expected each"):
        evaluate_expression("44 + 44", numbers=[44, 19])
    with pytest.raises(ZeroDivisionError):
        evaluate_expression("5 / (3 - 3)", numbers=[5, 3, 3])
    with pytest.raises(ValueError, match="max_length"):
        evaluate_expression("1 + " * 200 + "1")


# ============================================================================= Countdown: answer score

NUMS, TARGET = [44, 19, 35], 98


@pytest.mark.parametrize(
    "text, expected",
    [
        (wrap("(44 + 19) + 35"), 1.0),  # valid
        (wrap("35+44+19"), 1.0),  # order and spacing free
        (wrap("44 + 19 + 36"), 0.0),  # wrong number
        (wrap("44 + 44 + 10"), 0.0),  # reused number, foreign number
        (wrap("44 + 19"), 0.0),  # missing number (and wrong value)
        (wrap("44 + 19 + 35 + 0"), 0.0),  # extra number
        (wrap("(44 + 19) * 35 / 35 + 35"), 0.0),  # reuses 35
        (wrap("44 + 19 + 35 = 98"), 0.0),  # an equation, not an expression
        ("reasoning</think>\n<answer>44 + 19 + 35", 0.0),  # unclosed answer tag
        ("<Answer>44 + 19 + 35</Answer>", 0.0),  # tags are case-sensitive
        (wrap("(44 + 19 + 35"), 0.0),  # unbalanced brackets
        ("<answer>44 + 19 + 35</answer> on second thought <answer>44 - 19 + 35</answer>", 0.0),  # last wins
        ("<answer>44 - 19 + 35</answer> on second thought <answer>44 + 19 + 35</answer>", 1.0),
        ("The answer is 44 + 19 + 35.", 0.0),  # no answer tag
        (wrap("44 * 19 ** 35"), 0.0),
    ],
)
def test_countdown_answer_score_cases(text, expected):
    assert countdown_answer_score(text, NUMS, TARGET) == expected


def test_countdown_answer_score_division_by_zero():
    assert countdown_answer_score(wrap("5 / (3 - 3)"), [5, 3, 3], 5) == 0.0
    assert countdown_answer_score(wrap("(3 + 3) - 5"), [5, 3, 3], "1") == 1.0


def test_countdown_non_integer_and_negative_targets():
    # Paper item 204: target "27.4"; 98 / (47 - 52) + 47 = 137/5 exactly.
    assert countdown_answer_score(wrap("((98 / (47 - 52)) + 47)"), [98, 47, 47, 52], "27.4") == 1.0
    assert countdown_answer_score(wrap("98 - 47 - 52 + 47"), [98, 47, 47, 52], "27.4") == 0.0  # = 46
    # Paper item 254: the target string is a rounded float; 800/3 is within 1e-5.
    assert countdown_answer_score(wrap("(10 / (60 - 57)) * 80"), [60, 10, 57, 80], "266.6666666666667") == 1.0
    # 137/5 = 27.4 is 2e-5 away from 27.40002 (outside the 1e-5 tolerance) and 9e-6 from 27.400009 (inside).
    assert countdown_answer_score(wrap("137 / 5"), [137, 5], "27.40002") == 0.0
    assert countdown_answer_score(wrap("137 / 5"), [137, 5], "27.400009") == 1.0
    # Paper item 365: target "-11".
    assert countdown_answer_score(wrap("69 - (55 + 25)"), [69, 55, 25], "-11") == 1.0
    assert countdown_answer_score(wrap("-(55 + 25) + 69"), [69, 55, 25], -11) == 1.0  # unary minus allowed
    assert countdown_answer_score(wrap("(55 + 25) - 69"), [69, 55, 25], "-11") == 0.0  # = +11


def test_countdown_hostile_inputs_return_zero_quickly():
    with time_limit(10):
        assert countdown_answer_score(wrap("9" * 100_000), NUMS, TARGET) == 0.0
        assert countdown_answer_score(wrap("(" * 100_000 + "1" + ")" * 100_000), [1], 1) == 0.0
        assert countdown_answer_score(wrap("-" * 500 + "1"), [1], 1) == 1.0  # 500 minus signs: +1, allowed
        assert countdown_answer_score(wrap("(" * 250 + "1" + ")" * 250), [1], 1) == 0.0  # nested too deeply
        assert countdown_answer_score("<answer>" * 50_000, NUMS, TARGET) == 0.0
        assert countdown_answer_score(wrap("9**9**9**9**9"), [9] * 5, TARGET) == 0.0
        assert countdown_answer_score(wrap("99999999999 * 99999999999"), [99999999999] * 2, TARGET) == 0.0


def test_countdown_reward_functions_both_formats():
    good, half = wrap("(44 + 19) + 35"), "<answer>44</answer>"
    completions = [good, [{"role": "assistant", "content": good}], half, ""]
    kwargs = {"numbers": [NUMS] * 4, "target": [str(TARGET)] * 4, "trainer_state": None, "log_extra": None}
    assert countdown_answer_reward(["p"] * 4, completions, None, **kwargs) == [1.0, 1.0, 0.0, 0.0]
    assert countdown_format_reward(["p"] * 4, completions, None, **kwargs) == [1.0, 1.0, 0.5, 0.0]
    assert countdown_reward(["p"] * 4, completions, None, **kwargs) == pytest.approx([1.1, 1.1, 0.05, 0.0])


def test_countdown_reward_errors():
    with pytest.raises(ValueError, match="needs the dataset column 'numbers'"):
        countdown_answer_reward(["p"], ["x"], target=[1])
    with pytest.raises(ValueError, match="column 'target' with one entry per completion, got 2 entries for 1"):
        countdown_answer_reward(["p"], ["x"], numbers=[[1]], target=[1, 2])
    with pytest.raises(ValueError, match="target must be a number"):
        countdown_answer_reward(["p"], ["x"], numbers=[[1]], target=["ten"])


# ============================================================================= Countdown: generator


def test_make_countdown_dataset_columns_and_solvability():
    ds = make_countdown_dataset(50, seed=3)
    assert ds.column_names == ["prompt", "numbers", "target", "solution"]
    for row in ds:
        assert len(row["numbers"]) in (3, 4) and all(1 <= x <= 99 for x in row["numbers"])
        assert isinstance(row["target"], int) and 1 <= row["target"] <= 100
        assert row["prompt"][0]["role"] == "user"
        assert f"[{', '.join(map(str, row['numbers']))}]" in row["prompt"][0]["content"]
        assert f"equals {row['target']}." in row["prompt"][0]["content"]
        assert evaluate_expression(row["solution"], row["numbers"]) == row["target"]
        assert countdown_answer_score(wrap(row["solution"]), row["numbers"], row["target"]) == 1.0


def test_make_countdown_dataset_seeding_and_options():
    a, b, c = (make_countdown_dataset(20, seed=s) for s in (0, 0, 1))
    assert a.to_list() == b.to_list()
    assert a["numbers"] != c["numbers"]
    plain = make_countdown_dataset(5, seed=0, conversational=False, num_numbers=3, low=10, high=20, max_target=None)
    assert all(p.endswith("Let me solve this step by step.\n<think>") for p in plain["prompt"])
    assert all(len(x) == 3 and all(10 <= v <= 20 for v in x) for x in plain["numbers"])
    for kwargs, name in [({"n": 0}, "n"), ({"n": 2, "num_numbers": 7}, "num_numbers"), ({"n": 2, "low": 0}, "low"),
                         ({"n": 2, "max_target": 0}, "max_target")]:
        with pytest.raises(ValueError, match=name):
            make_countdown_dataset(**kwargs)


def test_countdown_prompt_text_matches_paper_format():
    expected = (
        "You are a helpful assistant. You first think about the reasoning process in your mind and then provide the "
        "user with the answer.Using the numbers [ 9 59 25 11], create an equation that equals 24. You can use basic "
        "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think>"
        " tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
        "Let me solve this step by step.\n<think>"
    )  # paper item 283
    assert countdown_prompt_text([9, 59, 25, 11], "24") == expected


# ============================================================================= Countdown: paper JSON


def test_load_countdown_json_small_file(tmp_path):
    items = [
        {"id": i, "context": f"ctx {i}<think>", "numbers": [i, 2], "target": str(i + 2), "solution": f"({i} + 2)"}
        for i in range(5)
    ]
    items[4]["solution"] = None
    path = tmp_path / "cd.json"
    path.write_text(json.dumps(items))
    train = load_countdown_json(path, split="train", train_size=2, test_size=3)
    test = load_countdown_json(path, split="test", train_size=2, test_size=3)
    assert train["id"] == [0, 1] and test["id"] == [2, 3, 4]
    assert train["prompt"] == ["ctx 0<think>", "ctx 1<think>"] and test["solution"][-1] is None
    assert load_countdown_json(path)["target"] == ["2", "3", "4", "5", "6"]
    with pytest.raises(ValueError, match="must not overlap"):
        load_countdown_json(path, split="train", train_size=3, test_size=3)
    with pytest.raises(ValueError, match="split must be one of"):
        load_countdown_json(path, split="validation")
    path.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="JSON list"):
        load_countdown_json(path)


@needs_paper_json
def test_load_countdown_json_paper_split():
    train = load_countdown_json(PAPER_JSON, split="train")
    test = load_countdown_json(PAPER_JSON, split="test")
    assert len(train) == 200 and len(test) == 2000
    assert train["id"] == list(range(200)) and test["id"] == list(range(200, 2200))
    row = train[0]
    assert row["numbers"] == [44, 19, 35] and row["target"] == "98" and row["solution"] == "((44 + 19) + 35)"
    assert row["prompt"].startswith("You are a helpful assistant.") and row["prompt"].endswith("\n<think>")
    # Our prompt builder reproduces every context of the file.
    everything = load_countdown_json(PAPER_JSON)
    assert all(countdown_prompt_text(r["numbers"], r["target"]) == r["prompt"] for r in everything)
    targets = [float(t) for t in everything["target"]]
    assert sum(not t.is_integer() for t in targets) == 43 and sum(t < 0 for t in targets) == 19


@needs_paper_json
def test_paper_reference_solutions_grade():
    """2181 items carry a solution; 15 of those reuse a number (e.g. id 798: (38 - 22) + 38 with [42, 22, 38])
    and so are not valid under the paper's own rule. All other reference solutions must score 1.0."""
    ds = load_countdown_json(PAPER_JSON)
    with_solution = [r for r in ds if r["solution"] is not None]
    scores = countdown_answer_reward(
        None, [wrap(r["solution"]) for r in with_solution],
        numbers=[r["numbers"] for r in with_solution], target=[r["target"] for r in with_solution],
    )
    failing = sorted(r["id"] for r, s in zip(with_solution, scores) if s == 0.0)
    assert len(with_solution) == 2181
    assert failing == [263, 281, 429, 566, 640, 798, 800, 1085, 1178, 1340, 1444, 1560, 1574, 1847, 1984]


# ============================================================================= Arithmetic


def test_make_arithmetic_dataset():
    ds = make_arithmetic_dataset(30, seed=0)
    assert ds.column_names == ["prompt", "a", "b", "op", "answer"]
    for row in ds:
        assert 1 <= row["a"] <= 50 and 1 <= row["b"] <= 50 and row["op"] == "+"
        assert row["answer"] == row["a"] + row["b"]
        assert row["prompt"] == [
            {"role": "user", "content": f"What is {row['a']} + {row['b']}? Reply with only the number."}
        ]
    assert make_arithmetic_dataset(30, seed=0).to_list() == ds.to_list()
    assert make_arithmetic_dataset(30, seed=1)["prompt"] != ds["prompt"]
    mixed = make_arithmetic_dataset(60, seed=0, low=-5, high=5, ops=("-", "*"), conversational=False)
    assert set(mixed["op"]) == {"-", "*"} and isinstance(mixed["prompt"][0], str)
    assert all(r["answer"] == (r["a"] - r["b"] if r["op"] == "-" else r["a"] * r["b"]) for r in mixed)
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_dataset(3, ops=("/",))
    with pytest.raises(ValueError, match="low and high"):
        make_arithmetic_dataset(3, low=5, high=1)


def test_make_arithmetic_splits_disjoint():
    train, held_out = make_arithmetic_splits(500, n_eval=200, seed=0)
    assert len(train) == 500 and len(held_out) == 200
    questions = [p[0]["content"] for p in list(train["prompt"]) + list(held_out["prompt"])]
    assert len(set(questions)) == 700
    again = make_arithmetic_splits(500, n_eval=200, seed=0)
    assert again[1].to_list() == held_out.to_list()
    train, held_out = make_arithmetic_splits(2, n_eval=2, low=1, high=2)  # the whole 4-problem grid
    assert sorted((r["a"], r["b"]) for r in list(train) + list(held_out)) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    with pytest.raises(ValueError, match="exceeds the 4 distinct problems"):
        make_arithmetic_splits(3, n_eval=2, low=1, high=2)


def _reward(completions, a, b, op, answer):
    n = len(completions)
    return arithmetic_reward(None, completions, answer=[answer] * n, a=[a] * n, b=[b] * n, op=[op] * n)


def test_arithmetic_reward_first_stated_result():
    right = ["82", "82.", "82.0", "The answer is 82", "47 + 35 = 82", "47+35=82\n56 - 44 = 12",
             "47 + 35 equals 82, and 56 - 44 = 12", "35 + 47 = 82", "47 plus 35 is 82", "47 + 35 =\n82 (done)",
             "$47 + 35 = 82$", [{"role": "assistant", "content": "47 + 35 = 82\n56 - 44 = 12"}]]
    wrong = ["47 + 35 = 83\n... 82", "83, no 82", "", "no idea", "47 + 35", "47 + 35 =", "-82", "47 + 36 = 82",
             "47 - 35 = 82", "8", "820"]
    assert _reward(right, 47, 35, "+", 82) == [1.0] * len(right)
    assert _reward(wrong, 47, 35, "+", 82) == [0.0] * len(wrong)


@pytest.mark.parametrize(
    "text, a, b, op, expected",
    [
        ("47 - 35 = 12", 47, 35, "-", 12),
        ("47 -35 = 12", 47, 35, "-", 12),  # the minus is read as the sign of 35, still a restatement
        ("47 \u2212 35 = 12", 47, 35, "-", 12),
        ("47 minus 35 is 12", 47, 35, "-", 12),
        ("35 - 47 = -12", 47, 35, "-", 35),  # "-" is not commutative: 35 is the first number
        ("(-5) - (-3) = -2", -5, -3, "-", -2),
        ("-5 - -3 = -2", -5, -3, "-", -2),
        ("6 * 7 = 42", 6, 7, "*", 42),
        ("7 x 6 = 42", 6, 7, "*", 42),
        ("6 \u00d7 7 = 42", 6, 7, "*", 42),
        ("6 \\times 7 = 42", 6, 7, "*", 42),
        ("6 times 7 equals 42", 6, 7, "*", 42),
        ("6 multiplied by 7 is 42", 6, 7, "*", 42),
        ("6 + 7 = 13", 6, 7, "*", 6),  # another operator: no restatement
        ("6 * 7", 6, 7, "*", None),
        ("1,234 + 1 = 1,235", 1234, 1, "+", 1235),
    ],
)
def test_stated_result_operator_spellings(text, a, b, op, expected):
    assert stated_result(text, a, b, op) == expected


def test_arithmetic_reward_without_problem_columns_takes_the_first_number():
    completions = ["8", "8.", "The answer is 8", "3 + 5 = 8", "", "-8", "8.0", "9", "8, no 9", "3 + 5 =",
                   [{"role": "assistant", "content": "8"}]]
    out = arithmetic_reward(None, completions, answer=[8] * len(completions), trainer_state=None)
    assert out == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert arithmetic_reward(None, ["-4", "4", "1,234"], answer=[-4, -4, 1234]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="'answer'"):
        arithmetic_reward(None, ["1"])
    with pytest.raises(ValueError, match="column 'b' with one entry per completion, got 2 entries for 1"):
        arithmetic_reward(None, ["1"], answer=[1], a=[1], b=[1, 2], op=["+"])
    with pytest.raises(ValueError, match=r"op must be one of \('\+', '-', '\*'\)"):
        stated_result("1 / 1 = 1", 1, 1, "/")


def test_arithmetic_reward_is_prefix_stable():
    """A completion that holds its whole answer (a complete number) keeps its score whatever text is appended."""
    import random

    completions = [  # (text, a, b, op, answer); each ends after a character that cannot continue a number
        ("82 ", 47, 35, "+", 82), ("82.\n", 47, 35, "+", 82), ("The answer is 82.\n", 47, 35, "+", 82),
        ("47 + 35 = 82\n", 47, 35, "+", 82), ("47+35=82 ", 47, 35, "+", 82), ("35 + 47 = 82!", 47, 35, "+", 82),
        ("47 + 35 = 83\n", 47, 35, "+", 82), ("83, ", 47, 35, "+", 82), ("47 - 35 = 12\n", 47, 35, "-", 12),
        ("6 x 7 = 42 ", 6, 7, "*", 42), ("The result: 41\n", 20, 21, "+", 41), ("-2 ", -5, -3, "-", -2),
    ]
    rng = random.Random(0)
    alphabet = "0123456789 +-=*x.,\n abcdefghij"
    suffixes = ["56 - 44 = 12", "\n47 + 35 = 83", "0", ".5", ",000", " = 82", "82", "no, 83", "\u2212 1", ""]
    suffixes += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    expected = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    for (text, a, b, op, answer), score in zip(completions, expected, strict=True):
        assert _reward([text], a, b, op, answer) == [score], text
        extended = [text + suffix for suffix in suffixes]
        assert _reward(extended, a, b, op, answer) == [score] * len(extended), text


def test_make_arithmetic_dataset_dict_splits():
    splits = make_arithmetic_dataset_dict(300, 100, 200, seed=0)
    assert list(splits) == ["train", "validation", "test"]
    assert [len(splits[k]) for k in splits] == [300, 100, 200]
    assert splits["train"].column_names == ["prompt", "a", "b", "op", "answer"]
    keys = {k: [(r["op"], r["a"], r["b"]) for r in splits[k]] for k in splits}
    assert len(set(keys["train"] + keys["validation"] + keys["test"])) == 600  # disjoint, no repeats
    assert all(r["answer"] == r["a"] + r["b"] for r in splits["test"])
    # Deterministic per seed, different across seeds.
    again = make_arithmetic_dataset_dict(300, 100, 200, seed=0)
    assert all(again[k].to_list() == splits[k].to_list() for k in splits)
    other = make_arithmetic_dataset_dict(300, 100, 200, seed=1)
    assert other["test"]["prompt"] != splits["test"]["prompt"] and other["train"]["prompt"] != splits["train"]["prompt"]
    # The test split does not change with the train or validation sizes; validation not with the train size.
    bigger = make_arithmetic_dataset_dict(1000, 50, 200, seed=0)
    assert bigger["test"].to_list() == splits["test"].to_list()
    assert make_arithmetic_dataset_dict(10, 100, 200, seed=0)["validation"].to_list() == splits["validation"].to_list()
    small = make_arithmetic_dataset_dict(0, 0, 50, seed=0)
    assert small["test"].to_list() == splits["test"].select(range(50)).to_list()


def test_make_arithmetic_dataset_dict_edges_and_errors():
    empty_validation = make_arithmetic_dataset_dict(3, 0, 1, low=1, high=2)
    assert len(empty_validation["validation"]) == 0
    assert empty_validation["validation"].column_names == ["prompt", "a", "b", "op", "answer"]
    whole = make_arithmetic_dataset_dict(2, 1, 1, low=1, high=2, ops=("+", "*"), conversational=False)
    assert sum(len(whole[k]) for k in whole) == 4 and isinstance(whole["test"][0]["prompt"], str)
    grid = make_arithmetic_dataset_dict(4, 2, 2, low=1, high=2, ops=("+", "*"))
    assert sorted((r["op"], r["a"], r["b"]) for k in grid for r in grid[k]) == sorted(
        (op, a, b) for op in "+*" for a in (1, 2) for b in (1, 2))
    assert grid["test"][0]["prompt"][0]["content"] == arithmetic_question(grid["test"][0]["a"], grid["test"][0]["op"],
                                                                           grid["test"][0]["b"])
    with pytest.raises(ValueError, match=r"= 9 exceeds the 8 distinct problems"):
        make_arithmetic_dataset_dict(5, 2, 2, low=1, high=2, ops=("+", "*"))
    for kwargs, name in [({"num_train": -1}, "num_train"), ({"num_validation": -2}, "num_validation"),
                         ({"num_test": 1.5}, "num_test")]:
        sizes = {"num_train": 1, "num_validation": 1, "num_test": 1, **kwargs}
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 0"):
            make_arithmetic_dataset_dict(**sizes)
    with pytest.raises(ValueError, match="all 0"):
        make_arithmetic_dataset_dict(0, 0, 0)
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_dataset_dict(1, 1, 1, ops=("/",))


# ============================================================================= GSM


def test_make_gsm_dataset():
    ds = make_gsm_dataset(3, seed=1)
    assert ds.column_names == ["prompt", "question", "answer"]
    # Hand-checked: apples 35 + 93 = 128; kiwi 3 * 35 + (93 - 38) = 160; total 288.
    assert ds[0]["question"].startswith("At John's house, there is 3 times as much kiwi as apple.")
    assert ds[0]["answer"] == "288"
    assert ds[0]["prompt"][0]["content"].endswith("<answer> </answer> tags.")
    assert make_gsm_dataset(3, seed=1).to_list() == ds.to_list()
    assert make_gsm_dataset(3, seed=2)["question"] != ds["question"]
    plain = make_gsm_dataset(2, seed=1, conversational=False, instruction=None)
    assert plain["prompt"] == plain["question"]
    with pytest.raises(ValueError, match="reasoning-gym dataset name"):
        make_gsm_dataset(2, generator="no_such_generator")


def test_extract_final_answer_order():
    assert extract_final_answer(r"\boxed{5} <answer> 7 </answer>") == "7"
    assert extract_final_answer(r"step 3 gives \boxed{12} then 4") == "12"
    assert extract_final_answer("3 apples and 4 pears") == "4"
    assert extract_final_answer("nothing") is None


def test_gsm_reward_with_math_verify():
    completions = ["<answer>288</answer>", "<answer>287</answer>", r"so \boxed{288}", "3 + 5 then 288.",
                   "<answer>288.0</answer>", r"<answer>\frac{576}{2}</answer>", "no answer",
                   r"\boxed{288} <answer>287</answer>", [{"role": "assistant", "content": "<answer>288</answer>"}],
                   "<answer>" + "9" * 500 + "</answer>"]
    out = gsm_reward(None, completions, answer=["288"] * len(completions), log_metric=None)
    assert out == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert gsm_answer_score("<answer>1,234</answer>", "1234") == 1.0
    with pytest.raises(ValueError, match="'answer'"):
        gsm_reward(None, ["1"], answer=[])


@pytest.mark.parametrize(
    "answer",
    ["18", "$18", "\\$18", "18$", "\u20ac18", "\u00a318", "18 dollars", "18 apples", "18 km/h", "18%", "18\\%",
     "18.", "18.00", "18.0 dollars.", "$18$", "\\boxed{18}", "\\text{18 dollars}", "x = 18", "The answer is 18",
     "18 m^2", "USD 18", "18!", " 18 ; "],
)
def test_gsm_accepts_decorated_numbers(answer):
    assert gsm_answer_score(f"<answer>{answer}</answer>", "18") == 1.0
    assert gsm_answer_score(f"<answer>{answer}</answer>", "19") == 0.0  # and still rejects a wrong number


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("1,234", "1234", 1.0), ("1 234", "1234", 1.0), ("$1,234.00", "1234", 1.0), ("1{,}234", "1234", 1.0),
        ("1,235", "1234", 0.0), ("1.5 million", "1500000", 1.0), ("-$18", "-18", 1.0), ("\u221218", "-18", 1.0),
        ("18", "-18", 0.0), ("18.5", "18", 0.0), ("18.001", "18", 0.0), (".5", "0.5", 1.0), ("18%", "0.18", 0.0),
        ("18 dollars and 50 cents", "18", 0.0), ("18 or 19", "19", 0.0),
    ],
)
def test_gsm_numeric_comparison(answer, gold, expected):
    assert gsm_answer_score(f"<answer>{answer}</answer>", gold) == expected


def test_plain_number_normalisation():
    from decimal import Decimal

    assert plain_number("\\$1,234.50") == Decimal("1234.50")
    assert plain_number("18 km/h") == 18 and plain_number("2 thousand apples") == 2000
    for not_plain in ["1/2", "\\frac{1}{2}", "18 + 1", "2^{3}", "eighteen", "about 18", "18 and 19", "", "x" * 300]:
        assert plain_number(not_plain) is None, not_plain


def test_math_verify_pre_screen():
    for ok in ["\\frac{576}{2}", "2^{10}", "3!", "(1 + 2) * 3"]:
        assert math_verify_input_ok(ok), ok
    for bad in ["10^{10^{10}}", "2**3**4", "10^10^10", "2^{100000}", "(10^3)!", "1000!", "\\sum_{i=1}^{9} i",
                "(" * 11 + "1" + ")" * 11, "1" * 201, "2^2^2", "x^{y^{z}}"]:
        assert not math_verify_input_ok(bad), bad


# The worst inputs for every grader: huge powers, deep nesting, very long strings, division by zero, huge values.
_WORST_GSM = ["<answer>10^{10^{10}}</answer>", "<answer>9^{9^{9^{9}}}</answer>", "<answer>2**3**4**5</answer>",
              "<answer>" + "(" * 5000 + "1" + ")" * 5000 + "</answer>", "<answer>(10^{9})!</answer>",
              "<answer>" * 50_000, "9" * 200_000, "\\boxed{" * 20_000, "<answer>" + "1+" * 99 + "1</answer>",
              "<answer>\\sum_{n=1}^{10^{12}} n</answer>", "<answer>\\int_0^1 x^{1000000} dx</answer>"]
_WORST_COUNTDOWN = [(wrap("9" * 100_000), NUMS, TARGET), (wrap("(" * 100_000 + "1" + ")" * 100_000), [1], 1),
                    (wrap("(" * 250 + "1" + ")" * 250), [1], 1), ("<answer>" * 50_000, NUMS, TARGET),
                    (wrap("1/(1-1)"), [1, 1, 1], 1), (wrap("9**9**9**9"), [9] * 4, 1),
                    (wrap(" * ".join(["9" * 120] * 4)), [int("9" * 120)] * 4, 1),  # beyond float range
                    (wrap("-(" * 120 + "1" + ")" * 120), [1], -1)]
_WORST_ARITHMETIC = ["9" * 1_000_000, "47 + 35 = " + "9" * 100_000, "-" * 500_000 + "1", "1," * 300_000]


def _grade_worst_inputs() -> list[float]:
    scores = [gsm_answer_score(text, "5") for text in _WORST_GSM]
    scores += [countdown_answer_score(text, nums, target) for text, nums, target in _WORST_COUNTDOWN]
    scores += arithmetic_reward(None, _WORST_ARITHMETIC, answer=[82] * 4, a=[47] * 4, b=[35] * 4, op=["+"] * 4)
    return scores


def test_graders_return_in_bounded_time_in_the_main_thread():
    import time

    start = time.monotonic()
    with time_limit(20):
        scores = _grade_worst_inputs()
    assert scores == [0.0] * len(scores)
    assert time.monotonic() - start < 10


def test_graders_return_in_bounded_time_in_a_worker_thread():
    """math-verify's own time limits need the main thread; the graders must not depend on them."""
    import threading

    results = []
    worker = threading.Thread(target=lambda: results.append(_grade_worst_inputs()), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "a grader did not return within 10 s in a worker thread"
    assert results == [[0.0] * (len(_WORST_GSM) + len(_WORST_COUNTDOWN) + len(_WORST_ARITHMETIC))]
    # Ordinary answers still grade right off the main thread, through math-verify as well.
    right = []
    worker = threading.Thread(target=lambda: right.extend(
        [gsm_answer_score("<answer>\\frac{576}{2}</answer>", "288"), gsm_answer_score("<answer>$18</answer>", "18"),
         gsm_answer_score("<answer>\\frac{576}{3}</answer>", "288")]), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert right == [1.0, 1.0, 0.0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs POSIX fork")
def test_gsm_grading_in_a_forked_daemonic_worker():
    """A forked worker (daemonic, as in a multiprocessing pool) grades through a helper of its own."""
    import multiprocessing

    texts = ["<answer>\\frac{576}{2}</answer>", "<answer>$288</answer>", "<answer>\\frac{576}{3}</answer>"]
    assert [gsm_answer_score(t, "288") for t in texts] == [1.0, 1.0, 0.0]  # this process has a helper now
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.starmap_async(gsm_answer_score, [(t, "288") for t in texts]).get(timeout=30) == [1.0, 1.0, 0.0]


def test_math_verify_helper_timeout_kills_and_restarts():
    import trl_es.tasks.gsm as gsm

    assert math_verify_equal("288", "$\\frac{576}{2}$") is True
    helpers = list(gsm._all_helpers)
    # No answer can come back within 0.1 ms: the comparison counts as not equal and the helper is killed ...
    assert math_verify_equal("288", "$\\frac{576}{2}$", timeout=1e-4) is False
    killed = [h for h in helpers if h not in gsm._all_helpers]
    assert len(killed) == 1 and killed[0].process.poll() is not None
    # ... and the next comparison starts a new helper.
    assert math_verify_equal("288", "$\\frac{576}{2}$") is True
    assert math_verify_equal("288", "$\\frac{575}{2}$") is False


# ============================================================================= Registry


def test_get_task_registry():
    assert sorted(TASKS) == ["arithmetic", "countdown", "gsm"]
    countdown = get_task("countdown")
    assert countdown.reward_weights == [0.1, 1.0]
    assert [f.__name__ for f in countdown.reward_funcs] == ["countdown_format_reward", "countdown_answer_reward"]
    countdown.reward_funcs.clear()  # a copy: the registry is untouched
    assert len(get_task("countdown").reward_funcs) == 2
    with pytest.raises(ValueError, match=r"unknown task 'chess'; choose one of \['arithmetic', 'countdown', 'gsm'\]"):
        get_task("chess")


@pytest.mark.parametrize("name", ["countdown", "arithmetic", "gsm"])
def test_registry_builders_and_rewards_fit_together(name):
    task = get_task(name)
    ds = task.build_dataset(2, seed=0)
    assert "prompt" in ds.column_names and len(ds) == 2
    columns = {k: ds[k] for k in ds.column_names if k != "prompt"}
    for reward_func in task.reward_funcs:
        out = reward_func(ds["prompt"], ["no idea", [{"role": "assistant", "content": "no idea"}]], **columns)
        assert out == [0.0, 0.0]
    assert len(task.reward_weights) == len(task.reward_funcs)
