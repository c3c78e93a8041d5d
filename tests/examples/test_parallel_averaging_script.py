"""examples/studies/parallel_averaging.py: every arm at equal steps, a tiny end-to-end run in-process."""

import json
import math
import os

import pytest
from tiny import content_reward
from paths import REPO

pytestmark = pytest.mark.usefixtures("one_thread")


STUDY = "parallel_averaging"


def test_tiny_end_to_end_every_arm(study, run_study, tmp_path, monkeypatch):
    monkeypatch.setattr(study, "task_reward_funcs", lambda: [content_reward])
    out = run_study.output_dir
    texts = tmp_path / "general.json"
    texts.write_text(json.dumps(["the red fox runs in the park", "a small cat sleeps at noon"]))
    argv = [
        "--in_process", "true", "--arms", "base", "rl", "sft", "sft_rl", "rl_sft", "es", "es_sft",
        "--max_steps", "4", "--es_max_steps", "1",
        "--num_train_prompts", "16", "--num_validation_prompts", "0", "--num_test_prompts", "3",
        "--max_completion_length", "6", "--num_generations", "4", "--prompts_per_step", "1", "--sft_batch_size", "4",
        "--learning_rate", "1e-3", "--sft_learning_rate", "1e-3", "--num_samples", "4", "--pass_k", "1", "4",
        "--num_kl_prompts", "2", "--kl_max_new_tokens", "4", "--lm_loss_texts", str(texts),
        "--es_overrides", "population_size=4", "prompt_batch_size=2", "noise_table_size=1048576",
        "max_completion_length=6", "sigma=0.1",
    ]
    results = run_study(*argv)
    rows = {row["arm"]: row for row in results["table"]}
    assert list(rows) == ["base", "rl", "sft", "sft_rl", "rl_sft", "es", "es_sft"]
    # equal steps: N updates for every gradient arm, split 2 + 2 for SFT -> RL
    assert rows["rl"]["updates"] == "4 grpo" and rows["sft"]["updates"] == "4 sft"
    assert rows["sft_rl"]["updates"] == "2 sft + 2 grpo" and rows["rl_sft"]["updates"] == "4 grpo+sft"
    assert rows["es"]["updates"] == "1 es" and rows["es_sft"]["updates"] == "1 es+sft"
    assert rows["base"]["off_task_kl"] == 0.0 and rows["base"]["drift_l2"] == 0.0
    for name, row in rows.items():
        assert 0.0 <= row["accuracy_greedy"] <= 1.0 and 0.0 <= row["pass@1"] <= row["pass@4"] <= 1.0
        assert row["off_task_kl"] is not None
        assert math.isfinite(row["lm_loss"]) and row["lm_loss"] > 0
        if name != "base":
            assert row["drift_l2"] > 0, name
    markdown = (out / "results.md").read_text()
    for label in ("RL only (GRPO)", "SFT only", "SFT -> RL", "RL + SFT parallel averaging", "ES + SFT parallel",
                  "Pass@4", "off-task KL", "LM loss"):
        assert label in markdown
    assert "at temperature 0.6, top-p 0.95;" in markdown  # the papers' protocol, by default
    assert (out / "pass_at_k.png").stat().st_size > 0
    assert json.loads((out / "results.json").read_text())["table"] == json.loads(json.dumps(results["table"]))

    # a finished run with fewer arms listed: nothing is trained or evaluated again, the table is the same
    monkeypatch.setattr(study, "train_arm", lambda *a, **k: pytest.fail("an arm was trained again"))
    monkeypatch.setattr(study, "evaluate_arm", lambda *a, **k: pytest.fail("an arm was evaluated again"))
    again = run_study(*argv[:argv.index("--arms") + 1], "rl", "es_sft", *argv[argv.index("--max_steps"):])
    assert [row["arm"] for row in again["table"]] == ["rl", "es_sft"]
    assert again["table"] == [row for row in json.loads(json.dumps(results["table"])) if row["arm"] in ("rl", "es_sft")]


def test_recipe_parses(study):
    root = os.path.join(REPO, "examples", "recipes")
    args = study.parse_args(["--config", os.path.join(root, "parallel_averaging_arithmetic_cpu.yaml")])
    assert args.arms == ["base", "rl", "sft", "sft_rl", "rl_sft"] and args.rl_weight == args.sft_weight == 0.5
    assert study.grpo_kwargs(args, "x", args.max_steps)["per_device_train_batch_size"] == 16
