"""examples/studies/agents_es_vs_grpo.py: the tool task's reward, traces and splits, and the whole study (SFT warm-up,
GRPO, ES at GRPO's completions and minutes) on the tiny Llama with TRL's Qwen2.5 template."""

import json
import os

from tiny_tools import tool_model, tool_tokenizer
from warm_python import WarmSubprocess


STUDY = "agents_es_vs_grpo"


def test_product_reward_grades_the_final_assistant_message(study):
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 34}}}]}
    tool = {"role": "tool", "name": "multiply", "content": "408"}
    completions = [
        [call, tool, {"role": "assistant", "content": "12 * 34 = 408"}],  # called, relayed: right
        [call, tool, {"role": "assistant", "content": "12 * 34 = 418"}],  # called, miscopied: wrong
        [{"role": "assistant", "content": "12 * 34 = 408"}],  # no call, right product: right
        [call, tool],  # the budget ran out before the answer: the last assistant text is the call's (empty)
        "12 * 34 = 408",  # a plain-text completion
    ]
    assert study.product_reward(completions, a=[12] * 5, b=[34] * 5) == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_traces_render_through_trls_template(study):
    row = {"prompt": study.question({"a": 23, "b": 45}), "a": 23, "b": 45}
    tok = tool_tokenizer()
    called = tok.apply_chat_template(study.trace(row, call=True)["messages"], tools=[study.multiply], tokenize=False)
    direct = tok.apply_chat_template(study.trace(row, call=False)["messages"], tools=[study.multiply], tokenize=False)
    assert '<tool_call>\n{"name": "multiply", "arguments": {"a": 23, "b": 45}}\n</tool_call>' in called
    assert "<tool_response>\n1035\n</tool_response>" in called and called.rstrip().endswith("23 * 45 = 1035<|im_end|>")
    answer = direct.split("<|im_start|>assistant")[-1]  # the system prompt shows the call format; the answer not
    assert "<tool_call>" not in answer and direct.rstrip().endswith("23 * 45 = 1035<|im_end|>")
    assert called.split("What is 23 * 45?")[-1].count("<tool_call>") == 1  # one call, after the question


def test_splits_are_disjoint_and_sized(study):
    args = study.parse_args(["--output_dir", "x", "--num_sft", "30", "--num_train", "20", "--num_validation", "10",
                             "--num_test", "10"])
    rows = study.splits(args)
    assert {k: len(v) for k, v in rows.items()} == {"test": 10, "validation": 10, "sft": 30, "train": 20}
    problems = [(r["a"], r["b"]) for split in rows.values() for r in split]
    assert len(set(problems)) == 70 and all(10 <= a <= 99 and 10 <= b <= 99 for a, b in problems)
    assert rows["test"] == study.splits(study.parse_args(["--output_dir", "x", "--num_test", "10"]))["test"]


def test_study_end_to_end_on_the_tiny_model(study, tmp_path, warm_python, monkeypatch):
    arms = WarmSubprocess(warm_python)  # each arm's `python agents_es_vs_grpo.py ... --arm`: a warm child
    monkeypatch.setattr(study, "subprocess", arms)
    tok = tool_tokenizer()
    model_dir = str(tmp_path / "tiny")
    tool_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = str(tmp_path / "run")
    result = study.main(["--output_dir", out, "--model", model_dir, "--seeds", "0", "--num_sft", "8",
                         "--num_train", "16", "--num_validation", "2", "--num_test", "4", "--warmup_steps", "1",
                         "--max_completion_length", "8", "--completions_budget", "8", "--es_population_size", "2",
                         "--es_prompt_batch_size", "2", "--grpo_prompts_per_step", "1", "--grpo_num_generations", "4",
                         "--eval_batch_size", "4"])
    assert [cmd[-4:-2] for cmd in arms.commands] == [["--arm", "grpo"], ["--arm", "es"]]  # a process per arm
    assert os.path.exists(os.path.join(out, "warmup", "config.json"))
    assert result["warmup"]["num_rollouts"] == 4 and 0.0 <= result["warmup"]["accuracy"] <= 1.0
    grpo, es = result["arms"]
    assert (grpo["method"], es["method"]) == ("grpo", "es")
    assert grpo["steps"] == 2 and grpo["completions"] == 8 and [p["step"] for p in grpo["curve"]] == [1, 2]
    mark = es["equal_completions"]
    assert mark["steps"] == 2 and mark["completions"] == 8 and mark["num_rollouts"] == 4  # ceil(8 / (2 x 2))
    assert es["steps"] >= 2 and es["train_minutes"] >= grpo["train_minutes"]  # ES stops after GRPO's minutes
    assert [p["step"] for p in es["curve"]] == list(range(1, es["steps"] + 1))
    assert all(p["call_frequency"] is not None for p in es["curve"] + grpo["curve"])
    table = open(os.path.join(out, "results.md")).read().splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == [
        "| SFT warm-up (start of both)", "| GRPO", "| ES, GRPO's completions", "| ES, GRPO's minutes"]
    saved = json.load(open(os.path.join(out, "results.json")))
    assert [a["method"] for a in saved["arms"]] == ["grpo", "es"] and os.path.exists(os.path.join(out, "curves.png"))
