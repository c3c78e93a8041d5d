"""examples/studies/geometry.py: ES vs GRPO at matched accuracy, a tiny end-to-end run in-process (two seeds)."""

import json
import math
import os

import pytest
from example_script import example_script
from tiny import content_reward
from paths import REPO

pytestmark = pytest.mark.usefixtures("one_thread")


STUDY = "geometry"


def test_match_picks_the_earliest_checkpoint_at_the_lower_best():
    with example_script("studies/geometry.py", "geometry_match") as geo:
        es = [{"step": 1, "validation_accuracy": 0.2}, {"step": 2, "validation_accuracy": 0.5},
              {"step": 3, "validation_accuracy": 0.4}]
        grpo = [{"step": 5, "validation_accuracy": 0.3}, {"step": 10, "validation_accuracy": 0.45}]
        chosen = geo.match(0.1, es, grpo)
        assert chosen["target"] == 0.45 and chosen["es"]["step"] == 2 and chosen["grpo"]["step"] == 10
        assert chosen["matched"]
        assert not geo.match(0.45, es, grpo)["matched"]  # no gain over the base: nothing to match


def test_tiny_end_to_end(study, run_study, tmp_path, monkeypatch):
    monkeypatch.setattr(study, "reward_funcs", lambda: [content_reward])
    real_match = study.match
    # a random tiny model may not beat its own base on validation: analyse the pair the rule picks anyway
    monkeypatch.setattr(study, "match", lambda base, es, grpo: {**real_match(base, es, grpo), "matched": True})
    out = run_study.output_dir
    argv = [
        "--seeds", "0", "1",
        "--es_max_steps", "2", "--grpo_max_steps", "2", "--eval_every", "1", "--lmc_points", "3",
        "--num_train_prompts", "8", "--num_validation_prompts", "6", "--num_test_prompts", "8",
        "--analysis_prompts", "3", "--max_completion_length", "5", "--num_generations", "4", "--prompts_per_step", "1",
        "--learning_rate", "1e-2", "--keep_fractions", "0.1", "1.0", "--num_kl_prompts", "2",
        "--kl_max_new_tokens", "4", "--eval_batch_size", "4",
        "--es_overrides", "population_size=4", "prompt_batch_size=2", "noise_table_size=1048576", "sigma=0.1",
        "learning_rate=0.05",
    ]
    results = run_study(*argv)
    assert [s["seed"] for s in results["seeds"]] == [0, 1]
    for s in results["seeds"]:
        assert [c["step"] for c in s["checkpoints"]["es"]] == [1, 2]
        assert [c["step"] for c in s["checkpoints"]["grpo"]] == [1, 2]
        a = s["analysis"]
        lmc, sparsity = a["lmc"], a["sparsity"]
        assert lmc["ts"] == [0.0, 0.5, 1.0] and len(lmc["reward"]) == len(lmc["loss"]) == 3
        # the path's ends are the two models: the same accuracy as the full updates (fraction 1 keeps all of them)
        assert lmc["reward"][0] == sparsity["es"]["reward"]["global"][-1]
        assert lmc["reward"][-1] == sparsity["grpo"]["reward"]["global"][-1]
        assert lmc["loss"][0] == a["lm_loss"]["es"] and lmc["loss"][-1] == a["lm_loss"]["grpo"]
        assert a["lm_loss"]["base"] != a["lm_loss"]["es"]
        total = sparsity["es"]["num_coordinates"]
        assert sparsity["es"]["kept"]["global"] == [round(0.1 * total), total]
        assert sparsity["es"]["kept"]["random"] == sparsity["es"]["kept"]["global"]
        assert a["update_norm"]["es"] > 0 and a["update_norm"]["grpo"] > 0
        assert a["update_norm_ratio_es_over_grpo"] == pytest.approx(a["update_norm"]["es"] / a["update_norm"]["grpo"])
        assert -1.0 <= a["update_cosine"] <= 1.0
        assert set(a["test_accuracy"]) == {"base", "es", "grpo"} == set(a["held_out_accuracy"])
        assert set(a["off_task_kl"]) == {"es", "grpo"}  # a Monte-Carlo estimate: it may dip below 0 on 2 prompts
        assert all(math.isfinite(v) for v in a["off_task_kl"].values())
    summary = results["summary"]
    assert summary["matched_seeds"] == 2 and summary["update_cosine"]["n"] == 2
    markdown = (out / "results.md").read_text()
    for label in ("ES / GRPO update norm", "cosine of the two updates", "LMC barrier", "kept fraction", "es random"):
        assert label in markdown
    assert (out / "lmc.png").stat().st_size > 0 and (out / "sparsity.png").stat().st_size > 0
    assert json.loads((out / "results.json").read_text())["summary"] == json.loads(json.dumps(summary))

    # a finished seed is reused: nothing is trained again
    real_train = study.train_method
    monkeypatch.setattr(study, "train_method", lambda *a, **k: pytest.fail("a finished seed was trained again"))
    again = run_study(*argv)
    assert json.loads(json.dumps(again["summary"])) == json.loads(json.dumps(summary))

    # the sparsity curves of each run's last checkpoint: its full update at fraction 1, scored on the same prompts
    monkeypatch.setattr(study, "train_method", real_train)
    last = run_study(*argv, "--seeds", "0", "--sparsity_checkpoint", "last", "--output_dir", str(tmp_path / "last"))
    a = last["seeds"][0]["analysis"]
    assert a["sparsity_steps"] == {"es": 2, "grpo": 2}
    assert results["seeds"][0]["analysis"]["sparsity_steps"] == {m: results["seeds"][0]["match"][m]["step"]
                                                                for m in ("es", "grpo")}
    assert "Sparsity curves of the last checkpoints" in (tmp_path / "last" / "results.md").read_text()


def test_recipe_parses_and_tests_on_the_problems_pre_training_held_out(study):
    from trl_es import ESConfig
    from trl_es.cli import es_config_kwargs, load_recipe
    from _study.pretraining_corpus import pretraining_arithmetic_splits

    root = os.path.join(REPO, "examples", "recipes")
    args = study.parse_args(["--config", os.path.join(root, "geometry_tiny.yaml")])
    assert args.seeds == [0, 1, 2, 3, 4] and args.held_out_ops == [] and args.conversational is False
    assert (args.es_max_steps, args.grpo_max_steps, args.learning_rate, args.prompts_per_step) == (30, 60, 1e-4, 4)
    es = ESConfig(**{**es_config_kwargs(load_recipe(args.es_recipe), args.es_overrides), "output_dir": "x"})
    assert (es.population_backend, es.sigma, es.learning_rate, es.population_size) == ("sequential", 0.01, 0.01, 24)
    splits = study.splits_of(args)
    held = pretraining_arithmetic_splits(num_validation=100, num_test=200)  # the pre-training script's defaults
    key = lambda rows: [(r["a"], r["op"], r["b"]) for r in rows]  # noqa: E731
    assert key(splits["test"]) == key(held["test"]) and key(splits["validation"]) == key(held["validation"])


def test_addition_recipe_trains_plus_and_holds_out_minus_of_the_same_split(study):
    from _study.pretraining_corpus import pretraining_arithmetic_splits

    root = os.path.join(REPO, "examples", "recipes")
    args = study.parse_args(["--config", os.path.join(root, "geometry_addition_tiny.yaml")])
    assert (args.task_ops, args.held_out_ops, args.es_max_steps, args.grpo_max_steps) == (["+"], ["-"], 90, 60)
    assert args.sparsity_checkpoint == "last"
    assert args.model_name_or_path.endswith("checkpoint-1500")
    splits = study.splits_of(args)
    held = pretraining_arithmetic_splits(num_validation=100, num_test=200)  # the pre-training script's defaults
    key = lambda rows: [(r["a"], r["op"], r["b"]) for r in rows]  # noqa: E731
    assert {op for _, op, _ in key(splits["test"])} == {"+"} and {op for _, op, _ in key(splits["held_out"])} == {"-"}
    # the trained and the held-out test problems are exactly pre-training's held-out test problems
    assert sorted(key(splits["test"]) + key(splits["held_out"])) == sorted(key(held["test"]))
    assert {r["op"] for r in splits["train_dataset"]} == {"+"} and {r["op"] for r in splits["validation"]} == {"+"}


def test_bad_arguments_name_the_field(study):
    with pytest.raises(ValueError, match="held_out_ops"):
        study.parse_args(["--task_ops", "+", "--held_out_ops", "+", "-"])
    with pytest.raises(ValueError, match="analysis_prompts must be in"):
        study.parse_args(["--num_test_prompts", "10", "--analysis_prompts", "11"])
    with pytest.raises(ValueError, match="sparsity_checkpoint must be 'matched' or 'last'"):
        study.GeometryArguments(sparsity_checkpoint="best")
    with pytest.raises(ValueError, match="lmc_points must be >= 2"):
        study.parse_args(["--lmc_points", "1"])
