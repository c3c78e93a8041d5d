"""examples/studies/sequential_recipes.py: GRPO -> ES and ES -> GRPO, a tiny end-to-end run in-process."""

import json

import pytest
import torch
from tiny import content_reward
from paths import REPO

pytestmark = pytest.mark.usefixtures("one_thread")


STUDY = "sequential_recipes"


TINY = ["--in_process", "true", "--num_train_prompts", "16", "--num_validation_prompts", "0",
        "--num_test_prompts", "3", "--num_samples", "4", "--pass_k", "1", "2", "4", "--num_kl_prompts", "2",
        "--kl_max_new_tokens", "4", "--eval_max_new_tokens", "6", "--grpo_num_generations", "4",
        "--grpo_prompts_per_step", "1", "--es_overrides", "population_size=4", "prompt_batch_size=2",
        "noise_table_size=1048576", "max_completion_length=6", "sigma=0.1"]


def test_tiny_end_to_end_hands_over_exact_weights_and_writes_table_and_plot(study, run_study, monkeypatch):
    monkeypatch.setattr(study, "task_reward_funcs", lambda: [content_reward])
    out = run_study.output_dir
    results = run_study("--budget_minutes", "0.01", *TINY)
    arms = {item["arm"]: item for item in results["arms"]}
    assert list(arms) == ["base", "grpo", "es", "grpo_es", "es_grpo"]
    for name in ("grpo_es", "es_grpo"):
        first, second = arms[name]["phases"]
        assert [first["method"], second["method"]] == name.split("_")
        assert first["final_fingerprint"] != first["initial_fingerprint"]  # phase 1 trained ...
        assert second["initial_fingerprint"] == first["final_fingerprint"]  # ... and phase 2 started from it exactly
        assert second["spec"]["model"] == first["model_dir"]
        assert first["steps"] >= 1 and second["steps"] >= 1
    # the saved model of phase 1 is bitwise the model phase 2 loads
    from transformers import AutoModelForCausalLM

    first = arms["grpo_es"]["phases"][0]
    loaded = AutoModelForCausalLM.from_pretrained(first["model_dir"], dtype=torch.float32)
    assert study.fingerprint(loaded) == first["final_fingerprint"]

    table = {row["arm"]: row for row in results["table"]}
    assert table["base"]["drift_l2"] == 0.0 and table["base"]["off_task_kl"] == 0.0
    for row in table.values():
        assert row["handover_exact"]
        assert 0.0 <= row["accuracy_greedy"] <= 1.0
        assert 0.0 <= row["pass@1"] <= row["pass@2"] <= row["pass@4"] <= 1.0
        assert row["token_entropy"] > 0 and 0.0 <= row["js_succ"] <= 0.6932
    for name in ("grpo", "es", "grpo_es", "es_grpo"):
        assert table[name]["drift_l2"] > 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["table"] == json.loads(json.dumps(results["table"]))
    markdown = (out / "results.md").read_text()
    for label in ("base model", "GRPO only", "ES only", "GRPO -> ES", "ES -> GRPO", "Pass@4", "JS_succ"):
        assert label in markdown
    assert "4 samples per prompt at temperature 0.6, top-p 0.95" in markdown  # the papers' protocol, by default
    assert (out / "pass_at_k.png").stat().st_size > 0

    # listing only some arms of a finished run reuses their phases and evaluations: nothing runs again
    monkeypatch.setattr(study, "train_phase", lambda *a, **k: pytest.fail("a phase was trained again"))
    monkeypatch.setattr(study, "evaluate_arm", lambda *a, **k: pytest.fail("an arm was evaluated again"))
    again = run_study("--budget_minutes", "0.01", *TINY, "--arms", "es_grpo", "base")
    assert [row["arm"] for row in again["table"]] == ["es_grpo", "base"]
    assert again["table"] == [table["es_grpo"], table["base"]]


def test_recipes_parse_into_valid_arguments(study):
    import os

    root = os.path.join(REPO, "examples", "recipes")
    for name in ("sequential_arithmetic_cpu.yaml", "sequential_arithmetic_gpu.yaml"):
        args = study.parse_args(["--config", os.path.join(root, name)])
        assert args.arms == ["base", "grpo", "es", "grpo_es", "es_grpo"]
        assert args.num_samples == 16 and args.pass_k == [1, 2, 4, 8, 16]
        study.es_config_kwargs(study.load_recipe(args.es_recipe), args.es_overrides)  # ES overrides are ESConfig keys
    with pytest.raises(ValueError, match="arms"):
        study.parse_args(["--arms", "nope"])
