"""examples/studies/_study: from-scratch pre-training (RL Excursions, arXiv 2606.04272): the synthetic corpus, the run
and its checkpoints."""

import math
import os
import random
import re

import pytest
import torch
from example_script import example_script
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_es.tasks.arithmetic import arithmetic_question, arithmetic_reward, make_arithmetic_dataset_dict

from _study.pretraining import (
    build_tiny_llama,
    checkpoint_steps,
    pretrain_from_scratch,
    pretraining_tokenizer,
    train_corpus_tokenizer,
)
from _study.pretraining_corpus import (
    GENERAL_VOCABULARY,
    arithmetic_document,
    general_document,
    make_pretraining_corpus,
    pretraining_arithmetic_splits,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)


def _problem(text):
    """(a, op, b) of a task document."""
    a, op, b = re.match(r"What is (-?\d+) ([-+*]) (-?\d+)\?", text).groups()
    return int(a), op, int(b)


def test_corpus_is_deterministic_for_a_seed():
    first = make_pretraining_corpus(300, task_fraction=0.3, num_general_eval=40, seed=3)
    second = make_pretraining_corpus(300, task_fraction=0.3, num_general_eval=40, seed=3)
    other = make_pretraining_corpus(300, task_fraction=0.3, num_general_eval=40, seed=4)
    for split in ("train", "general_eval", "task_problems"):
        assert first[split].to_list() == second[split].to_list()
    assert first["train"]["text"] != other["train"]["text"]
    assert first["general_eval"]["text"] != other["general_eval"]["text"]
    assert general_document(random.Random(7)) == general_document(random.Random(7))


def test_corpus_splits_mix_and_do_not_overlap():
    corpus = make_pretraining_corpus(400, task_fraction=0.25, num_general_eval=100, seed=0, low=0, high=5)
    train, general_eval = corpus["train"], corpus["general_eval"]
    assert len(train) == 400 and len(general_eval) == 100
    assert train.column_names == ["text", "kind"]
    kinds = train["kind"]
    assert kinds.count("task") == 100 and kinds.count("general") == 300
    assert kinds[:100].count("task") not in (0, 100)  # shuffled, not blocked
    assert set(general_eval["kind"]) == {"general"}
    assert not set(train["text"]) & set(general_eval["text"])
    assert len(set(general_eval["text"])) == 100
    for text, kind in zip(train["text"], kinds):
        if kind == "task":
            a, op, b = _problem(text)
            assert 0 <= a <= 5 and 0 <= b <= 5 and op in "+-"
            assert text == arithmetic_document(a, op, b)
        else:
            words = {w.strip(".,").lower() for w in text.split()}
            assert words <= GENERAL_VOCABULARY and text.endswith(".") and text[0].isupper()
    # task_problems: the distinct problems of train, with their counts
    problems = corpus["task_problems"]
    counted = {(r["a"], r["op"], r["b"]): r["count"] for r in problems}
    seen = [_problem(t) for t, k in zip(train["text"], kinds) if k == "task"]
    assert counted == {p: seen.count(p) for p in set(seen)}
    assert all(r["prompt"] == arithmetic_question(r["a"], r["op"], r["b"]) for r in problems)
    assert all(r["answer"] == (r["a"] + r["b"] if r["op"] == "+" else r["a"] - r["b"]) for r in problems)


def test_task_fraction_extremes():
    only_general = make_pretraining_corpus(20, task_fraction=0.0, num_general_eval=5)
    assert set(only_general["train"]["kind"]) == {"general"} and len(only_general["task_problems"]) == 0
    assert only_general["task_problems"].column_names == ["prompt", "a", "b", "op", "answer", "count"]
    only_task = make_pretraining_corpus(20, task_fraction=1.0, num_general_eval=0)
    assert set(only_task["train"]["kind"]) == {"task"} and len(only_task["general_eval"]) == 0


def test_held_out_problems_never_appear_in_the_corpus():
    splits = pretraining_arithmetic_splits(num_validation=20, num_test=30, seed=1, low=0, high=6, ops=("+", "-"))
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [98 - 50, 20, 30]
    keys = {s: {(r["a"], r["op"], r["b"]) for r in splits[s]} for s in splits}
    assert keys["train"] | keys["validation"] | keys["test"] == {
        (a, op, b) for op in "+-" for a in range(7) for b in range(7)}
    assert all(isinstance(p, str) for p in splits["test"]["prompt"])  # plain-text prompts
    # the test split does not depend on the number of training problems
    assert splits["test"].to_list() == make_arithmetic_dataset_dict(
        5, 20, 30, seed=1, low=0, high=6, ops=("+", "-"), conversational=False)["test"].to_list()
    held_out = keys["validation"] | keys["test"]
    for exclude in ([splits["validation"], splits["test"]], sorted(held_out),
                    [dict(a=a, op=op, b=b) for a, op, b in held_out]):
        corpus = make_pretraining_corpus(500, task_fraction=0.6, num_general_eval=0, seed=0, low=0, high=6,
                                         exclude_problems=exclude)
        appearing = {_problem(t) for t, k in zip(corpus["train"]["text"], corpus["train"]["kind"]) if k == "task"}
        assert appearing and not appearing & held_out and appearing <= keys["train"]
        assert {(r["a"], r["op"], r["b"]) for r in corpus["task_problems"]} == appearing


@pytest.mark.parametrize("answer_format", ["worked", "number"])
def test_task_documents_are_prompt_plus_a_rewarded_answer(answer_format):
    for a, op, b in [(13, "-", 17), (0, "+", 9), (20, "+", 20)]:
        prompt = arithmetic_question(a, op, b)
        document = arithmetic_document(a, op, b, answer_format=answer_format)
        assert document.startswith(prompt + " ")
        completion = document[len(prompt):]
        wrong = completion[:-1] + str((int(completion[-1]) + 1) % 10)
        rewards = arithmetic_reward([prompt] * 2, [completion, wrong], answer=[eval(f"{a}{op}{b}")] * 2,
                                    a=[a] * 2, b=[b] * 2, op=[op] * 2)
        assert rewards == [1.0, 0.0]
    assert arithmetic_document(13, "-", 17) == "What is 13 - 17? Reply with only the number. 13 - 17 = -4"
    assert arithmetic_document(13, "-", 17, "number") == "What is 13 - 17? Reply with only the number. -4"


@pytest.mark.parametrize("kwargs, field", [
    (dict(task_fraction=1.5), "task_fraction"),
    (dict(task_fraction=-0.1), "task_fraction"),
    (dict(task_fraction=float("nan")), "task_fraction"),
    (dict(task_fraction="0.3"), "task_fraction"),
    (dict(num_documents=0), "num_documents"),
    (dict(num_general_eval=-1), "num_general_eval"),
    (dict(low=5, high=2), "high"),
    (dict(ops=("/",)), "ops"),
    (dict(min_sentences=0), "min_sentences"),
    (dict(min_sentences=3, max_sentences=2), "max_sentences"),
    (dict(answer_format="words"), "answer_format"),
    (dict(exclude_problems=[(1, "+")]), "exclude_problems"),
    (dict(low=0, high=0, ops=("+",), exclude_problems=[(0, "+", 0)]), "exclude_problems"),
])
def test_bad_corpus_fields_raise_naming_the_field(kwargs, field):
    kwargs = {"num_documents": 10, **kwargs}
    with pytest.raises(ValueError, match=field):
        make_pretraining_corpus(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_test=-1), "num_test"),
    (dict(num_validation=1.5), "num_validation"),
    (dict(num_validation=10, num_test=8, low=0, high=2, ops=("+",)), "num_validation"),
])
def test_bad_split_fields_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        pretraining_arithmetic_splits(**kwargs)


def test_corpus_tokenizer_round_trips_and_splits_digits():
    corpus = make_pretraining_corpus(200, num_general_eval=0)
    tokenizer = train_corpus_tokenizer(corpus["train"]["text"], vocab_size=400)
    assert len(tokenizer) == 400
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token) == (
        "<|endoftext|>", "<|im_end|>", "<|im_start|>")
    for text in corpus["train"]["text"][:20] + ["Unseen: Zürich 😀 12345\n\tok"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    ids = tokenizer(" 13 = -4", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["Ġ", "1", "3", "Ġ=", "Ġ-", "4"]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    again = train_corpus_tokenizer(corpus["train"]["text"], vocab_size=400)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()  # deterministic
    with pytest.raises(ValueError, match="vocab_size"):
        train_corpus_tokenizer(["a"], vocab_size=100)


def test_pretraining_tokenizer_gets_a_pad_token_other_than_eos(tokenizer):
    same = pretraining_tokenizer(tokenizer)
    assert same.pad_token == "<pad>" and same is not tokenizer
    tokenizer_eos_pad = pretraining_tokenizer(tokenizer)
    tokenizer_eos_pad.pad_token = tokenizer_eos_pad.eos_token
    fixed = pretraining_tokenizer(tokenizer_eos_pad)
    assert fixed.pad_token_id not in (None, fixed.eos_token_id)
    assert tokenizer_eos_pad.pad_token == tokenizer_eos_pad.eos_token  # the input is not modified
    model = build_tiny_llama(fixed, seed=0, **TINY_CONFIG)
    assert model.config.vocab_size == len(fixed) and model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == fixed.eos_token_id
    assert model.generation_config.pad_token_id == fixed.pad_token_id
    again = build_tiny_llama(fixed, seed=0, **TINY_CONFIG)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_checkpoint_steps():
    assert checkpoint_steps(6, 2) == [2, 4, 6]
    assert checkpoint_steps(7, 3) == [3, 6, 7]
    assert checkpoint_steps(2, 5) == [2]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    corpus = make_pretraining_corpus(256, task_fraction=0.3, num_general_eval=32, seed=0, low=0, high=9)
    tokenizer = train_corpus_tokenizer(corpus["train"]["text"], vocab_size=300)
    out = tmp_path_factory.mktemp("pretrain")
    threads = torch.get_num_threads()  # a module fixture is set up before the function fixture one_thread
    torch.set_num_threads(1)
    try:
        result = pretrain_from_scratch(out, corpus, tokenizer, max_steps=25, save_steps=10, seed=0,
                                       model_config=TINY_CONFIG, per_device_train_batch_size=16, learning_rate=1e-2,
                                       logging_steps=5, eval_batch_size=32, progress=False)
    finally:
        torch.set_num_threads(threads)
    return out, result, tokenizer, corpus


def test_pretraining_writes_the_expected_checkpoints(tiny_run):
    out, result, tokenizer, _ = tiny_run
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-20", "checkpoint-25"]
    assert [c["step"] for c in result["checkpoints"]] == [10, 20, 25]
    states = []
    for checkpoint in result["checkpoints"]:
        assert checkpoint["path"] == os.path.join(str(out), f"checkpoint-{checkpoint['step']}")
        assert not os.path.exists(os.path.join(checkpoint["path"], "optimizer.pt"))
        model = AutoModelForCausalLM.from_pretrained(checkpoint["path"])
        loaded_tokenizer = AutoTokenizer.from_pretrained(checkpoint["path"])
        assert model.config.model_type == "llama" and model.config.hidden_size == 32
        assert model.config.vocab_size == len(loaded_tokenizer) == 300
        assert loaded_tokenizer.pad_token == "<|endoftext|>" and loaded_tokenizer.eos_token == "<|im_end|>"
        assert model.generation_config.eos_token_id == loaded_tokenizer.eos_token_id
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    for earlier, later in zip(states, states[1:]):
        assert earlier.keys() == later.keys()
        assert any(not torch.equal(earlier[k], later[k]) for k in earlier)
        assert torch.equal(later["model.embed_tokens.weight"], later["lm_head.weight"])  # tied
    assert result["num_parameters"] == sum(v.numel() for k, v in states[-1].items() if k != "lm_head.weight")


def test_pretraining_losses_are_finite_and_go_down(tiny_run):
    _, result, _, _ = tiny_run
    initial = result["initial_general_eval_loss"]
    assert math.isfinite(initial) and initial > 5.0  # about ln(300) = 5.7 for a random model
    for checkpoint in result["checkpoints"]:
        for key in ("train_loss", "eval_loss", "general_eval_loss"):
            assert math.isfinite(checkpoint[key]) and checkpoint[key] > 0
        # the Trainer's eval loss includes the EOS token, lm_loss_fn's does not: close, not equal
        assert abs(checkpoint["eval_loss"] - checkpoint["general_eval_loss"]) < 0.5
    final = result["checkpoints"][-1]
    assert final["general_eval_loss"] < initial - 1.0
    assert final["general_eval_loss"] < result["checkpoints"][0]["general_eval_loss"]
    train_losses = [e["loss"] for e in result["log_history"] if "loss" in e]
    assert len(train_losses) == 5 and train_losses[-1] < train_losses[0] - 1.0
    assert result["train_runtime_s"] > 0


def test_pretraining_is_reproducible(tiny_run, tmp_path):
    out, result, tokenizer, corpus = tiny_run
    again = pretrain_from_scratch(tmp_path, corpus, tokenizer, max_steps=25, save_steps=25, seed=0,
                                  model_config=TINY_CONFIG, per_device_train_batch_size=16, learning_rate=1e-2,
                                  logging_steps=5, eval_batch_size=32, progress=False)
    assert again["initial_general_eval_loss"] == result["initial_general_eval_loss"]
    assert again["checkpoints"][0]["general_eval_loss"] == pytest.approx(
        result["checkpoints"][-1]["general_eval_loss"], abs=1e-5)
    first = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint-25")).state_dict()
    second = AutoModelForCausalLM.from_pretrained(os.path.join(tmp_path, "checkpoint-25")).state_dict()
    assert all(torch.allclose(first[k], second[k], atol=1e-5) for k in first)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_steps=0), "max_steps"),
    (dict(save_steps=0), "save_steps"),
    (dict(per_device_train_batch_size=0), "per_device_train_batch_size"),
    (dict(max_length=1), "max_length"),
    (dict(learning_rate=0.0), "learning_rate"),
    (dict(logging_steps=0), "logging_steps"),
])
def test_bad_pretraining_fields_raise_naming_the_field(tiny_run, tmp_path, kwargs, field):
    _, _, tokenizer, corpus = tiny_run
    kwargs = {"max_steps": 2, "save_steps": 1, **kwargs}
    with pytest.raises(ValueError, match=field):
        pretrain_from_scratch(tmp_path, corpus, tokenizer, model_config=TINY_CONFIG, progress=False, **kwargs)
    with pytest.raises(ValueError, match="general_eval"):
        pretrain_from_scratch(tmp_path, {"train": corpus["train"]}, tokenizer, max_steps=1, save_steps=1,
                              progress=False)
    assert not os.listdir(tmp_path)


def test_script_end_to_end(tmp_path):
    import json

    with example_script("studies/pretrain_from_scratch.py", "pretrain_from_scratch") as script:
        out = tmp_path / "run"
        result = script.main([
            "--output_dir", str(out), "--high", "6", "--num_validation_problems", "10", "--num_test_problems", "12",
            "--num_documents", "200", "--num_general_eval", "16", "--vocab_size", "300", "--hidden_size", "32",
            "--intermediate_size", "64", "--num_hidden_layers", "2", "--max_steps", "6", "--save_steps", "3",
            "--per_device_train_batch_size", "8", "--num_seen_problems", "5", "--eval_max_new_tokens", "4",
        ])
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6", "general_eval.json", "pretraining.json"]
    with open(out / "pretraining.json") as f:
        written = json.load(f)
    assert written == json.loads(json.dumps(result))
    assert [c["step"] for c in written["checkpoints"]] == [3, 6]
    for checkpoint in written["checkpoints"]:
        assert 0.0 <= checkpoint["test_accuracy"] <= 1.0 and 0.0 <= checkpoint["seen_accuracy"] <= 1.0
        assert math.isfinite(checkpoint["general_eval_loss"])
    assert written["arithmetic_splits"]["kwargs"]["num_test"] == 12
    assert written["corpus"]["num_task_documents"] == 60 and written["tokenizer_size"] == 300
    # the recorded calls rebuild the same problems and the same held-out general text
    splits = pretraining_arithmetic_splits(**written["arithmetic_splits"]["kwargs"])
    corpus = make_pretraining_corpus(**written["corpus"]["kwargs"],
                                     exclude_problems=[splits["validation"], splits["test"]])
    with open(written["corpus"]["general_eval_file"]) as f:
        assert json.load(f) == corpus["general_eval"]["text"] and len(corpus["general_eval"]) == 16
    assert len(corpus["task_problems"]) == written["corpus"]["num_distinct_task_problems"]
