"""examples/studies/awd_retention.py: AWD against no AWD and a larger population, a tiny end-to-end run in-process."""

import json
import os

import pytest
from tiny import content_reward
from paths import REPO

pytestmark = pytest.mark.usefixtures("one_thread")


STUDY = "awd_retention"


def test_tiny_end_to_end_tracks_every_column(study, run_study, monkeypatch):
    monkeypatch.setattr(study, "task_reward_funcs", lambda: [content_reward])
    out = run_study.output_dir
    argv = [
        "--in_process", "true",
        "--num_train_prompts", "16", "--num_validation_prompts", "3", "--num_test_prompts", "3",
        "--num_prior_prompts", "3", "--max_steps", "3", "--eval_every", "2", "--awd_lambdas", "1", "5",
        "--num_chosen", "1", "--large_population_size", "8", "--num_kl_prompts", "2", "--kl_max_new_tokens", "4",
        "--eval_max_new_tokens", "6", "--es_overrides", "population_size=4", "prompt_batch_size=2",
        "noise_table_size=1048576", "max_completion_length=6", "sigma=0.1", "learning_rate=0.05",
    ]
    results = run_study(*argv)
    assert [r["run"] for r in results["runs"]] == ["awd_0", "awd_1", "awd_5", "pop_8"]
    assert [r["completions_generated"] for r in results["runs"]] == [3 * 4 * 2] * 3 + [3 * 8 * 2]
    selection = results["selection"]
    assert len(selection["chosen"]) == 1 and selection["chosen"][0] in ("awd_1", "awd_5")
    report = {row["run"]: row for row in results["report"]}
    assert list(report) == ["base", "awd_0", selection["chosen"][0], "pop_8"]
    columns = ("target", "mul_1_12", "sub_1_12", "prior_mean", "prior_mean_change", "off_task_kl", "drift_l2",
               "training_minutes", "completions_generated")
    for name, row in report.items():
        for key in columns:
            assert row[key] is not None, (name, key)
        if name != "base":
            assert row["replay_exact"] is True  # the replayed weights are bitwise the trained ones (AWD included)
            assert row["drift_l2"] > 0
    assert report["base"]["drift_l2"] == 0.0 and report["base"]["prior_mean_change"] == 0.0
    # every run is tracked at iterations 2 and 3 (eval_every 2, and the end), on both splits
    for name in ("awd_0", "awd_1", "awd_5"):
        assert [p["iteration"] for p in results["validation"][name]["points"]] == [2, 3]
        assert "off_task_kl" not in results["validation"][name]["points"][0]  # selection reads accuracies only
    assert [p["iteration"] for p in results["test"]["pop_8"]["points"]] == [2, 3]
    markdown = (out / "results.md").read_text()
    for header in ("## Selection (validation split", "## Report (test split", "| target |", "mul_1_12", "sub_1_12",
                   "prior mean", "off-task KL", "drift L2", "completions"):
        assert header in markdown
    assert (out / "awd_retention.png").stat().st_size > 0
    assert json.loads((out / "results.json").read_text())["selection"] == selection

    # the same run with only the chosen candidate listed: every run and tracking is reused, the report is the same
    monkeypatch.setattr(study, "train_run", lambda *a, **k: pytest.fail("a run was trained again"))
    monkeypatch.setattr(study, "track", lambda *a, **k: pytest.fail("a run was tracked again"))
    lam = selection["chosen"][0].removeprefix("awd_")
    i = argv.index("--awd_lambdas")
    again = run_study(*argv[:i + 1], lam, *argv[i + 3:])
    assert again["report"] == json.loads(json.dumps(results["report"]))


def test_selection_rule(study):
    args = study.parse_args(["--awd_lambdas", "3", "10", "30", "--num_chosen", "2", "--target_tolerance", "0.05"])
    runs = [{"run": name, "awd_lambda": lam} for name, lam in
            (("awd_0", 0.0), ("awd_3", 3.0), ("awd_10", 10.0), ("awd_30", 30.0))]
    final = {"awd_0": (0.60, 0.40), "awd_3": (0.58, 0.45), "awd_10": (0.56, 0.55), "awd_30": (0.40, 0.70)}
    validation = {name: {"points": [{"target": t, "prior_mean": p, "mul_1_12": p, "sub_1_12": p}]}
                  for name, (t, p) in final.items()}
    selection = study.select(args, runs, validation)
    # awd_30 keeps the most prior accuracy but loses 0.20 of target accuracy (> 0.05): not eligible
    assert [c["eligible"] for c in selection["candidates"]] == [True, True, False]
    assert selection["chosen"] == ["awd_10", "awd_3"]  # by prior accuracy among the eligible
    args = study.parse_args(["--awd_lambdas", "3", "10", "30", "--num_chosen", "2", "--target_tolerance", "0.01"])
    assert study.select(args, runs, validation)["chosen"] == ["awd_3", "awd_10"]  # none eligible: by target accuracy


def test_recipe_parses(study):
    root = os.path.join(REPO, "examples", "recipes")
    args = study.parse_args(["--config", os.path.join(root, "awd_retention_cpu.yaml")])
    assert args.awd_lambdas == [3.0, 10.0, 30.0] and args.prior_tasks == ["mul_1_12", "sub_1_12"]
    kwargs = study.es_config_kwargs(args)
    assert kwargs["lr_scheduler_type"] == "constant" and "lr_scheduler_kwargs" not in kwargs
    assert max(args.awd_lambdas) * kwargs["learning_rate"] < 1  # AWD l2 stays a shrink
    with pytest.raises(ValueError, match="prior_tasks"):
        study.parse_args(["--prior_tasks", "div"])
