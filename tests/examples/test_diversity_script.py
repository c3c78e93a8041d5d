"""examples/studies/diversity_pass_at_k.py: JS_succ vs Pass@K across ES runs, a tiny end-to-end run in-process."""

import json
import math
import os

import pytest
from tiny import content_reward
from paths import REPO

pytestmark = pytest.mark.usefixtures("one_thread")


STUDY = "diversity_pass_at_k"


def test_spearman_is_the_rank_correlation(study):
    assert study.spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 25.0, 100.0]) == pytest.approx(1.0)
    assert study.spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert study.spearman([1.0, 2.0], [1.0, 2.0]) is None  # fewer than 3 runs
    assert study.spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None  # a constant series has no rank correlation


def test_tiny_end_to_end(study, run_study, monkeypatch):
    monkeypatch.setattr(study, "reward_funcs", lambda: [content_reward])
    out = run_study.output_dir
    argv = ["--population_sizes", "2", "4",
            "--seeds", "0", "1", "--es_max_steps", "2", "--num_train_prompts", "8", "--num_test_prompts", "3",
            "--max_completion_length", "5", "--num_samples", "4", "--pass_k", "1", "4", "--eval_batch_size", "3",
            "--es_overrides", "prompt_batch_size=2", "noise_table_size=1048576", "sigma=0.1"]
    results = run_study(*argv)
    runs = results["runs"]
    assert [(r["population_size"], r["seed"]) for r in runs] == [(2, 0), (2, 1), (4, 0), (4, 1)]
    for r in runs:
        assert len(r["js_succ_per_iteration"]) == 2  # one logged value per iteration
        assert all(0.0 <= v <= math.log(2) + 1e-12 for v in r["js_succ_per_iteration"])
        assert r["js_succ_mean"] == pytest.approx(sum(r["js_succ_per_iteration"]) / 2)
        assert 0.0 <= r["pass@1"] <= r["pass@4"] <= 1.0
    summary = results["summary"]
    assert summary["runs"] == 4 and summary["per_population_size"][2]["pass@4"]["n"] == 2
    for value in summary["spearman_js_succ_vs"].values():
        assert value is None or -1.0 <= value <= 1.0
    markdown = (out / "results.md").read_text()
    assert "Spearman correlation of mean JS_succ with pass@4 over 4 runs" in markdown
    assert (out / "js_succ_vs_pass_at_k.png").stat().st_size > 0
    monkeypatch.setattr(study, "run_one", lambda *a, **k: pytest.fail("a finished run was trained again"))
    again = run_study(*argv)
    assert json.loads(json.dumps(again["runs"])) == json.loads(json.dumps(runs))


def test_recipe_parses(study):
    root = os.path.join(REPO, "examples", "recipes")
    args = study.parse_args(["--config", os.path.join(root, "diversity_tiny.yaml")])
    assert args.population_sizes == [4, 8, 24] and args.seeds == [0, 1, 2] and args.pass_k == [1, 4, 8]
    assert args.model_name_or_path == "runs/pretrain_from_scratch/checkpoint-2000" and args.conversational is False


def test_bad_arguments_name_the_field(study):
    with pytest.raises(ValueError, match="population_sizes must be integers >= 2"):
        study.parse_args(["--population_sizes", "1", "4"])
    with pytest.raises(ValueError, match="pass_k values must be in"):
        study.parse_args(["--num_samples", "4", "--pass_k", "8"])
