"""examples/studies/pretraining_excursions.py: pre-train from scratch, then every arm from every checkpoint (tiny)."""

import json
import math
import os

import pytest
from paths import REPO

pytestmark = pytest.mark.usefixtures("one_thread")


STUDY = "pretraining_excursions"


def test_key_value_arguments(study):
    assert study.as_argv(["max_steps=32", "pass_k=1 4"], "x") == ["--max_steps", "32", "--pass_k", "1", "4"]
    with pytest.raises(ValueError, match="parallel_args items must be key=value"):
        study.parse_args(["--parallel_args", "max_steps"])


def test_tiny_end_to_end(study, tmp_path):
    out, pre = tmp_path / "exc", tmp_path / "pre"
    argv = ["--output_dir", str(out), "--pretrain_dir", str(pre), "--seeds", "0", "1",
            "--arms", "base", "rl", "sft", "es", "--num_train_prompts", "8",
            "--pretrain_args", "max_steps=4", "save_steps=2", "num_documents=200", "num_general_eval=4",
            "num_validation_problems=2", "num_test_problems=3", "high=4", "hidden_size=16", "intermediate_size=32",
            "num_hidden_layers=1", "num_attention_heads=2", "vocab_size=300", "num_seen_problems=2",
            "per_device_train_batch_size=8",
            "--parallel_args", "in_process=true", "max_steps=2", "es_max_steps=1", "max_completion_length=4",
            "num_generations=4", "prompts_per_step=1", "sft_batch_size=4", "num_samples=2", "pass_k=1 2",
            "num_kl_prompts=0", "es_overrides=population_size=4 prompt_batch_size=2 noise_table_size=1048576"]
    results = study.main(argv)
    pretraining = json.loads((pre / "pretraining.json").read_text())
    assert [c["step"] for c in pretraining["checkpoints"]] == [2, 4]
    assert len(json.loads(open(pretraining["corpus"]["general_eval_file"]).read())) == 4
    # 2 checkpoints x 2 seeds x 4 arms, every arm evaluated on the 3 held-out problems
    assert sorted((r["step"], r["seed"], r["arm"]) for r in results["runs"]) == sorted(
        (step, seed, arm) for step in (2, 4) for seed in (0, 1) for arm in ("base", "rl", "sft", "es"))
    for r in results["runs"]:
        assert math.isfinite(r["lm_loss"]) and r["lm_loss"] > 0
        assert 0.0 <= r["pass@1"] <= r["pass@2"] <= 1.0
    rows = {(r["step"], r["arm"]): r for r in results["table"]}
    assert len(rows) == 8 and all(r["seeds"] == 2 for r in rows.values())
    # the base arm is the checkpoint itself: its LM loss is the same for both seeds (std 0)
    assert rows[(2, "base")]["lm_loss"]["std"] == 0.0
    assert rows[(2, "base")]["lm_loss"]["mean"] != rows[(4, "base")]["lm_loss"]["mean"]
    markdown = (out / "results.md").read_text()
    assert "RL only (GRPO)" in markdown and "LM loss (general text)" in markdown
    assert (out / "excursions.png").stat().st_size > 0


def test_recipe_parses_into_parallel_averaging_arguments(study):
    root = os.path.join(REPO, "examples", "recipes")
    args = study.parse_args(["--config", os.path.join(root, "excursions_tiny.yaml")])
    assert args.checkpoints == [500, 1500, 3000] and args.seeds == [0, 1, 2]
    pretraining = {"arithmetic_splits": {"kwargs": {"seed": 0, "low": 0, "high": 20, "ops": ["+", "-"],
                                                    "num_validation": 100, "num_test": 200}}}
    argv = study.parallel_argv(args, pretraining, {"step": 500, "path": "ckpt"}, 1, "texts.json")
    parallel = study.load_script("parallel_averaging").parse_args(argv)
    assert (parallel.max_steps, parallel.learning_rate, parallel.es_max_steps, parallel.pass_k) == (32, 1e-4, 30,
                                                                                                   [1, 2, 4, 8])
    assert parallel.es_overrides[:2] == ["population_backend=sequential", "sigma=0.01"]
    assert (parallel.task_ops, parallel.conversational, parallel.seed) == (["+", "-"], False, 1)
