"""Tasks: Countdown (safe grader, generator, paper JSON), arithmetic, GSM (reasoning-gym + math-verify), registry."""

import json
import os
from fractions import Fraction

import pytest
from time_limit import time_limit

from trl_es.tasks import TASKS, get_task
from trl_es.tasks.arithmetic import (
    arithmetic_reward,
    make_arithmetic_dataset,
    make_arithmetic_splits,
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
)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def test_arithmetic_reward_last_number_rule():
    completions = ["8", "8.", "The answer is 8", "3 + 5 = 8", "", "-8", "8.0", "9", "8, no 9", "3 + 5 =",
                   [{"role": "assistant", "content": "8"}]]
    out = arithmetic_reward(None, completions, answer=[8] * len(completions), trainer_state=None)
    assert out == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert arithmetic_reward(None, ["-4", "4", "1,234"], answer=[-4, -4, 1234]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="'answer'"):
        arithmetic_reward(None, ["1"])


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
