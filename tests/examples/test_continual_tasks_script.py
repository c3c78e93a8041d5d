"""examples/studies/continual_tasks.py: task A then task B, ES at two budgets vs GRPO, a tiny run in-process."""

import json
import os

import pytest
from tiny import content_reward
from paths import REPO

pytestmark = pytest.mark.usefixtures("one_thread")


STUDY = "continual_tasks"


def test_tiny_end_to_end(study, run_study, tiny_model_dir, monkeypatch):
    geo = study.load_script("geometry")
    monkeypatch.setattr(geo, "reward_funcs", lambda: [content_reward])
    out = run_study.output_dir
    argv = [
        "--seeds", "0", "1", "--es_budgets", "1", "2", "--grpo_max_steps", "1", "--num_train_prompts", "8",
        "--num_validation_prompts", "4",
        "--num_test_prompts", "6", "--max_completion_length", "4", "--num_generations", "4", "--prompts_per_step", "1",
        "--learning_rate", "1e-2", "--num_kl_prompts", "2", "--eval_batch_size", "6",
        "--es_overrides", "population_size=4", "prompt_batch_size=2", "noise_table_size=1048576", "sigma=0.1",
        "learning_rate=0.05",
    ]
    trained = []
    real_train = geo.train_method

    def spy(args, method, seed, folder, splits):
        trained.append((method, args.es_max_steps if method == "es" else args.grpo_max_steps,
                        args.model_name_or_path, sorted({r["op"] for r in splits["train_dataset"]})))
        return real_train(args, method, seed, folder, splits)

    monkeypatch.setattr(geo, "train_method", spy)
    results = run_study(*argv)
    # per seed and arm: task A ("+") from the base, then task B ("-") from the stage-A checkpoint
    for seed in (0, 1):
        for method, updates, arm in (("grpo", 1, "grpo"), ("es", 1, "es1"), ("es", 2, "es2")):
            stage_a = str(out / f"seed{seed}" / arm / "A" / f"step-{updates}")
            assert (method, updates, tiny_model_dir, ["+"]) in trained
            assert (method, updates, stage_a, ["-"]) in trained
            assert results["seeds"][seed]["arms"][arm]["A"]["path"] == stage_a
    assert len(trained) == 2 * 3 * 2
    for s in results["seeds"]:
        base = s["base"]
        assert base["update_norm"] == 0.0
        for arm, r in s["arms"].items():
            assert r["A"]["update_norm"] > 0 and r["AB"]["update_norm"] > 0
            assert r["forgetting_A"] == r["A"]["accuracy_A"] - r["AB"]["accuracy_A"]
            assert r["gain_A_kept"] == r["AB"]["accuracy_A"] - base["accuracy_A"]
            for stage in ("A", "AB"):  # accuracies on 6 test problems split by operator
                assert all(0.0 <= r[stage][k] <= 1.0 for k in ("accuracy_A", "accuracy_B"))
    summary = results["summary"]
    assert list(summary["arms"]) == ["grpo", "es1", "es2"] and summary["base"]["accuracy_A"]["n"] == 2
    markdown = (out / "results.md").read_text()
    for label in ("GRPO, 1 steps", "ES, 1 iterations", "ES, 2 iterations", "forgetting of A"):
        assert label in markdown
    assert (out / "accuracy.png").stat().st_size > 0
    assert json.loads((out / "results.json").read_text())["summary"] == json.loads(json.dumps(summary))

    # a finished seed is reused: nothing is trained again
    monkeypatch.setattr(geo, "train_method", lambda *a, **k: pytest.fail("a finished seed was trained again"))
    assert json.loads(json.dumps(run_study(*argv)["summary"])) == json.loads(json.dumps(summary))


def test_tasks_split_one_grid_by_operator(study):
    from _study.pretraining_corpus import pretraining_arithmetic_splits

    root = os.path.join(REPO, "examples", "recipes")
    args = study.parse_args(["--config", os.path.join(root, "continual_tiny.yaml")])
    assert (args.task_a_ops, args.task_b_ops, args.es_budgets, args.grpo_max_steps) == (["+"], ["-"], [30, 90], 60)
    assert list(args.arms()) == ["grpo", "es30", "es90"]
    splits = study.task_splits(args)
    held = pretraining_arithmetic_splits(num_validation=100, num_test=200)  # the pre-training script's defaults
    key = lambda rows: [(r["a"], r["op"], r["b"]) for r in rows]  # noqa: E731
    for name in ("test", "validation"):
        a, b = key(splits["A"][name]), key(splits["B"][name])
        assert {op for _, op, _ in a} == {"+"} and {op for _, op, _ in b} == {"-"}
        assert sorted(a + b) == sorted(key(held[name]))  # exactly the problems pre-training held out
    assert len(splits["A"]["train_dataset"]) + len(splits["B"]["train_dataset"]) == 400


def test_bad_arguments_name_the_field(study):
    with pytest.raises(ValueError, match="share none"):
        study.parse_args(["--task_a_ops", "+", "-", "--task_b_ops", "-"])
    with pytest.raises(ValueError, match="es_budgets must be an integer >= 1"):
        study.parse_args(["--es_budgets", "0"])
    with pytest.raises(ValueError, match="no arm to train"):
        study.ContinualArguments(es_budgets=[], grpo_max_steps=0)
    with pytest.raises(ValueError, match="must not repeat"):
        study.parse_args(["--es_budgets", "5", "5"])
