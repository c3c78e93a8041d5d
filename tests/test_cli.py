"""The trl-es CLI end to end on a tiny model (two ES iterations), eval with pass@k, analyze."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_es import replay
from trl_es.cli import main, task_splits, TaskArguments


def test_train_two_iterations(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("task: arithmetic\nnum_train_prompts: 8\nnum_eval_prompts: 4\npopulation_size: 4\n"
                      "prompt_batch_size: 4\nmax_completion_length: 4\nsigma: 0.02\nlearning_rate: 0.02\n")
    status = main(["train", "--config", str(recipe), "--model_name_or_path", tiny_model_dir, "--output_dir", str(out),
                   "--max_steps", "2", "--report_to", "none", "--save_strategy", "no",
                   "--noise_table_size", str(1 << 20), "--eval_strategy", "steps", "--eval_steps", "1"])
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == "arithmetic" and results["num_eval_prompts"] == 4
    assert 0.0 <= results["accuracy_after"] <= 1.0
    assert (out / "training_curves.png").stat().st_size > 1000
    records = [json.loads(line) for line in (out / "es_seed_log.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in records] == [1, 2]
    trained = AutoModelForCausalLM.from_pretrained(out)
    rebuilt = replay(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    for (name, a), b in zip(trained.state_dict().items(), rebuilt.state_dict().values()):
        assert torch.equal(a, b), name


def test_eval_pass_at_k(tmp_path, tiny_model_dir):
    output = tmp_path / "metrics.json"
    main(["eval", "--model_name_or_path", tiny_model_dir, "--task", "arithmetic", "--num_eval_prompts", "6",
          "--num_samples", "3", "--pass_k", "1", "3", "--max_new_tokens", "3", "--output_file", str(output)])
    metrics = json.loads(output.read_text())
    assert metrics["num_prompts"] == 6
    # A random tiny model never answers a + b correctly.
    assert metrics["accuracy_greedy"] == 0.0 and metrics["pass@1"] == 0.0 and metrics["pass@3"] == 0.0


def test_eval_rejects_k_above_samples(tiny_model_dir):
    with pytest.raises(ValueError, match="pass_k values must be <= num_samples"):
        main(["eval", "--model_name_or_path", tiny_model_dir, "--num_samples", "2", "--pass_k", "4"])


def test_analyze_writes_report(tmp_path, tiny_model_dir):
    main(["analyze", "--base_model", tiny_model_dir, "--model_a", tiny_model_dir, "--task", "arithmetic",
          "--num_eval_prompts", "4", "--num_train_prompts", "4", "--num_kl_prompts", "2", "--max_new_tokens", "3",
          "--analysis_dir", str(tmp_path / "analysis")])
    report = json.loads((tmp_path / "analysis" / "report.json").read_text())
    assert report["drift"]["a"]["l2"] == 0.0  # the checkpoint is the base model itself


def test_splits_are_disjoint():
    for task in ("arithmetic", "countdown"):
        _, train, held_out = task_splits(TaskArguments(task=task, num_train_prompts=50, num_eval_prompts=30))
        train_prompts = {json.dumps(p) for p in train["prompt"]}
        held_prompts = {json.dumps(p) for p in held_out["prompt"]}
        assert len(held_out) == 30 and len(train) == 50 and not train_prompts & held_prompts


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "trl_es.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "trl-es" in result.stdout and "train" in result.stdout
