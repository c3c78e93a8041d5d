"""GRPO's completion logs, num_generations_eval and mask_truncated_completions on ESTrainer (issue 33)."""

import json
import math
import os
import sys
import types

import pandas as pd
import pytest
import torch
from datasets import Dataset
from tiny import build_llama

from trl_es import ESConfig, ESTrainer
from trl_es.rollout import RolloutResult
from trl_es.trainer.es import completion_logs

SMALL_TABLE = 1 << 20


def es_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=2, population_size=4, prompt_batch_size=2,
                    max_completion_length=6, sigma=0.05, learning_rate=0.05, report_to=[], save_strategy="no",
                    noise_table_size=SMALL_TABLE, disable_tqdm=True, seed=0)
    defaults.update(kwargs)
    return ESConfig(**defaults)


def prompts(n=4, word="Write"):
    return Dataset.from_dict({"prompt": [f"{word}: {i}" for i in range(n)]})


class Recorder:
    """A reward function (length of the completion in tokens) that records every call and logs an extra column."""

    __name__ = "length"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, log_extra=None, trainer_state=None, **kwargs):
        self.calls.append({"prompts": list(prompts), "completions": list(completions),
                           "ids": [list(i) for i in completion_ids]})
        if log_extra is not None:
            log_extra("head", [c[:2] for c in completions])
        return [float(len(i)) for i in completion_ids]


def seed_log(path):
    with open(os.path.join(path, "es_seed_log.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------- completion logs
def test_completion_table_holds_every_member_with_its_rewards_and_coefficient(tmp_path, tokenizer, one_thread):
    reward = Recorder()
    args = es_args(tmp_path, log_completions=True, temperature=1.0, num_generations=2,
                   save_strategy="steps", save_steps=1)
    trainer = ESTrainer(build_llama(tokenizer), reward, args=args, train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    folder = tmp_path / "out" / "completions"
    assert sorted(os.listdir(folder)) == ["completions_00001.parquet", "completions_00002.parquet"]
    records = [json.loads(line) for line in open(tmp_path / "out" / "es_seed_log.jsonl") if '"step"' in line]
    records = {r["step"]: r for r in records}
    for step in (1, 2):
        table = pd.read_parquet(folder / f"completions_{step:05d}.parquet")
        assert list(table.columns) == ["step", "prompt", "completion", "length", "head", "advantage", "member"]
        assert len(table) == 4 * 2 * 2  # population x prompt_batch_size x num_generations
        assert set(table["step"]) == {step}
        # The reward calls of this iteration (one per member, members in order on one process).
        calls = reward.calls[(step - 1) * 4 : step * 4]
        for member in range(4):
            rows = table[table["member"] == member]
            assert list(rows["completion"]) == calls[member]["completions"]
            assert list(rows["prompt"]) == calls[member]["prompts"]
            assert list(rows["length"]) == [float(len(i)) for i in calls[member]["ids"]]
            assert list(rows["head"]) == [c[:2] for c in calls[member]["completions"]]
            assert set(rows["advantage"]) == {records[step]["coefficients"][member]}
    assert "head" in trainer._logs["extra"] and trainer._logs["step"] == 2
    assert len(trainer._logs["prompt"]) == 16


def test_completions_are_printed_with_a_seeded_sample(tmp_path, tokenizer, one_thread, capsys):
    import random

    state = random.getstate()
    args = es_args(tmp_path, max_steps=1, log_completions=True, num_completions_to_print=3)
    trainer = ESTrainer(build_llama(tokenizer), Recorder(), args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    trainer.train()
    printed = capsys.readouterr().out
    assert "Step 1" in printed and "Advantage" in printed and "member" in printed
    assert printed.count("Write: ") == 3  # three rows of eight
    assert random.getstate() == state  # the sample does not draw from Python's global generator


def test_completion_table_goes_to_trackers_with_unique_prompts(tmp_path, tokenizer, one_thread, monkeypatch):
    logged = []

    class Table:
        def __init__(self, dataframe):
            self.dataframe = dataframe

    fake = types.SimpleNamespace(run=object(), Table=Table, log=lambda d: logged.append(d))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = es_args(tmp_path, max_steps=1, log_completions=True, log_unique_prompts=True, temperature=1.0,
                   num_generations=2)
    trainer = ESTrainer(build_llama(tokenizer), Recorder(), args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    trainer.completion_log.report_to = ["wandb"]  # Trainer's own wandb callback stays out of this test
    trainer.train()
    assert len(logged) == 1
    frame = logged[0]["completions"].dataframe
    assert len(frame) == 2 and sorted(frame["prompt"]) == sorted(set(trainer._logs["prompt"]))


def test_completion_logs_push_to_the_hub_as_grpo(tmp_path, tokenizer, monkeypatch):
    import huggingface_hub

    calls = {}
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo, **kw: calls.setdefault("repo", (repo, kw)))

    class Card:
        @staticmethod
        def from_template(card_data, template_path, repo_id, hub_model_id):
            calls["template"] = template_path
            return types.SimpleNamespace(push_to_hub=lambda repo: calls.setdefault("card", repo))

    class Scheduler:
        def __init__(self, **kwargs):
            calls["scheduler"] = kwargs

    monkeypatch.setattr(huggingface_hub, "DatasetCard", Card)
    monkeypatch.setattr(huggingface_hub, "CommitScheduler", Scheduler)
    args = es_args(tmp_path, max_steps=1, log_completions=True, log_completions_hub_repo="me/es-logs")
    ESTrainer(build_llama(tokenizer), Recorder(), args=args, train_dataset=prompts(), processing_class=tokenizer)
    assert calls["repo"] == ("me/es-logs", {"private": None, "repo_type": "dataset", "exist_ok": True})
    assert calls["card"] == "me/es-logs" and os.path.exists(calls["template"])
    assert calls["scheduler"]["folder_path"] == str(tmp_path / "out" / "completions")
    assert calls["scheduler"]["allow_patterns"] == ["*.parquet"] and calls["scheduler"]["repo_type"] == "dataset"


def test_log_extra_with_the_wrong_length_is_refused_and_weights_kept(tmp_path, tokenizer, one_thread):
    def bad(completions, log_extra, **kwargs):
        log_extra("oops", [1])
        return [0.0] * len(completions)

    model = build_llama(tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ESTrainer(model, bad, args=es_args(tmp_path, log_completions=True), train_dataset=prompts(),
                        processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"log_extra\('oops', values\) got 1 values"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_no_completion_logs_by_default(tmp_path, tokenizer, one_thread):
    trainer = ESTrainer(build_llama(tokenizer), Recorder(), args=es_args(tmp_path, max_steps=1),
                        train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    assert trainer.completion_log is None and trainer._logs["prompt"] == []
    assert not os.path.exists(tmp_path / "out" / "completions")


# ---------------------------------------------------------------------------------------------- evaluation
def test_num_generations_eval(tmp_path, tokenizer, one_thread):
    reward = Recorder()
    args = es_args(tmp_path, temperature=1.0, num_generations=2, num_generations_eval=3)
    trainer = ESTrainer(build_llama(tokenizer), reward, args=args, train_dataset=prompts(),
                        eval_dataset=prompts(5, "Say"), processing_class=tokenizer)
    metrics = trainer.evaluate()
    assert metrics["eval_num_completions"] == 15
    scored = [p for call in reward.calls for p in call["prompts"]]
    assert len(scored) == 15 and all(scored.count(f"Say: {i}") == 3 for i in range(5))
    lengths = [len(i) for call in reward.calls for i in call["ids"]]
    assert metrics["eval_reward"] == pytest.approx(sum(lengths) / len(lengths))


@pytest.mark.parametrize("field, kwargs, match", [
    ("num_generations_eval", dict(num_generations_eval=2, temperature=0.0),
     r"num_generations_eval=2 with greedy decoding"),
    ("num_generations_eval", dict(num_generations_eval=0, temperature=1.0), r"num_generations_eval must be None or"),
    ("num_completions_to_print", dict(num_completions_to_print=-1), r"num_completions_to_print must be None"),
    ("log_completions_hub_repo", dict(log_completions_hub_repo="me/x"), r"log_completions is False"),
])
def test_bad_logging_and_eval_settings_are_refused_by_name(tmp_path, field, kwargs, match):
    with pytest.raises(ValueError, match=match):
        es_args(tmp_path, **kwargs)


# ---------------------------------------------------------------------------------------------- truncation
def _terminated(ids, tokenizer):
    return bool(ids) and ids[-1] in (tokenizer.eos_token_id, tokenizer.pad_token_id)


def test_mask_truncated_completions_leaves_cut_completions_out_of_the_fitness(tmp_path, tokenizer, one_thread):
    reward = Recorder()
    args = es_args(tmp_path, max_steps=1, temperature=1.0, num_generations=4, prompt_batch_size=4,
                   mask_truncated_completions=True)
    trainer = ESTrainer(build_llama(tokenizer), reward, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    trainer.train()
    ids = [i for call in reward.calls for i in call["ids"]]
    kept = [len(i) for i in ids if _terminated(i, tokenizer)]
    assert 0 < len(kept) < len(ids)  # this seed: some completions end, most are cut at 6 tokens
    log = trainer.state.log_history[0]
    assert log["reward"] == pytest.approx(sum(kept) / len(kept))  # the fitness counts the ended ones only
    assert log["rewards/length/mean"] == pytest.approx(sum(map(len, ids)) / len(ids))  # per function: all
    no_fitness = sum(not any(_terminated(i, tokenizer) for i in call["ids"]) for call in reward.calls)
    assert log["num_nan_members"] == no_fitness


def test_mask_truncated_completions_with_every_completion_cut_leaves_the_weights(tmp_path, tokenizer, one_thread):
    """TRL's all-masked case: no completion ends within 2 tokens here, so no member has a fitness and the step is
    exactly zero."""
    model = build_llama(tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reward = Recorder()
    args = es_args(tmp_path, max_completion_length=2, mask_truncated_completions=True)
    trainer = ESTrainer(model, reward, args=args, train_dataset=prompts(), processing_class=tokenizer)
    trainer.train()
    assert not any(_terminated(i, tokenizer) for call in reward.calls for i in call["ids"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [h["num_nan_members"] for h in trainer.state.log_history if "num_nan_members" in h] == [4.0, 4.0]
    assert all(c == 0.0 for record in seed_log(tmp_path / "out")[1:] for c in record["coefficients"])


def scored(prompts, completions, rewards_per_func):
    """A RolloutResult of the given prompts, completions and rewards (one token per completion)."""
    n = len(completions)
    return RolloutResult(rewards_per_func, torch.zeros(rewards_per_func.shape, dtype=torch.bool),
                         rewards_per_func.double().sum(dim=1), list(completions), [[1]] * n, list(prompts),
                         list(completions), [1] * n, [1] * n, [True] * n)


def test_completion_log_unit_orders_rows_by_member():
    log = completion_logs.CompletionLog(["r"], "/nonexistent")
    log.log_extra_for_call()
    log.add_call([3], scored(["p"] * 2, ["a", "b"], torch.tensor([[1.0], [math.nan]])))
    log.log_extra_for_call()
    log.add_call([1], scored(["q"] * 2, ["c", "d"], torch.tensor([[2.0], [3.0]])))
    log.finish_iteration(7, [0.0, -1.0, 0.0, 1.0])
    assert log.table() == {"step": [7] * 4, "prompt": ["q", "q", "p", "p"], "completion": ["c", "d", "a", "b"],
                           "r": [2.0, 3.0, 1.0, None], "advantage": [-1.0, -1.0, 1.0, 1.0], "member": [1, 1, 3, 3]}
