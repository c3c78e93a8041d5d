"""examples/studies/compare_es_grpo.py: the ES-vs-GRPO race, run in-process on the tiny model with a tiny budget."""

import json
import time
from types import SimpleNamespace

import pytest
from warm_python import WarmSubprocess


STUDY = "compare_es_grpo"


def test_clock_excludes_evaluation_time_and_stops_at_budget(study):
    calls = []

    def slow_eval(model):
        calls.append(model)
        time.sleep(0.2)  # evaluation time: must not count towards the training clock
        return 0.5

    clock = study.EvalClockCallback(slow_eval, budget_seconds=0.25, eval_every_seconds=0.1)
    args, state = SimpleNamespace(), SimpleNamespace(global_step=0)
    control = SimpleNamespace(should_training_stop=False)
    clock.on_train_begin(args, state, control, model="m")
    start = time.monotonic()  # after the time-0 evaluation
    while not control.should_training_stop:
        time.sleep(0.06)  # one "training step"
        state.global_step += 1
        clock.on_step_end(args, state, control, model="m")
    wall = time.monotonic() - start
    clock.on_train_end(args, state, control, model="m")

    steps = [r["step"] for r in clock.records]
    seconds = [r["training_seconds"] for r in clock.records]
    assert steps[0] == 0 and seconds[0] == 0.0
    assert steps[-1] == state.global_step and len(steps) == len(set(steps))  # no second eval at the end
    assert seconds == sorted(seconds) and seconds[-1] == clock.training_seconds
    assert clock.training_seconds >= 0.25  # stopped on the first step end past the budget
    assert len(calls) >= 3  # time 0, at least one periodic evaluation, the end
    # The clock is the wall time minus the evaluations after time 0 (each of which took >= 0.2 s).
    eval_seconds = sum(r["eval_seconds"] for r in clock.records[1:])
    assert eval_seconds >= 0.2 * (len(calls) - 1)
    assert abs((wall - eval_seconds) - clock.training_seconds) < 0.05


def test_es_config_kwargs_drops_task_keys_and_applies_overrides(study):
    recipe = {"model_name_or_path": "x", "task": "arithmetic", "num_train_prompts": 400, "sigma": 0.003,
              "population_size": 16}
    kwargs = study.es_config_kwargs(recipe, ["population_size=8", "antithetic=false"])
    assert kwargs == {"sigma": 0.003, "population_size": 8, "antithetic": False}
    with pytest.raises(ValueError, match="key=value"):
        study.es_config_kwargs(recipe, ["not_a_field=1"])


def test_race_es_kwargs_per_schedule(study, tmp_path):
    from trl_es import ESConfig

    recipe = study.load_recipe(study.DEFAULT_RECIPE)
    args = study.parse_args(["--output_dir", str(tmp_path), "--es_schedule", "recipe"])
    kwargs = study.race_es_kwargs(args, recipe, str(tmp_path / "es"))
    config = ESConfig(**kwargs)
    assert config.eval_strategy == "no" and config.max_steps == recipe["max_steps"]
    assert config.lr_scheduler_type == recipe["lr_scheduler_type"] and config.output_dir == str(tmp_path / "es")
    # the time schedule (default): the budget stops the run; alpha comes from TimeScheduleCallback
    timed = study.race_es_kwargs(study.parse_args(["--output_dir", str(tmp_path)]), recipe, str(tmp_path))
    assert timed["max_steps"] == study.NO_LIMIT_STEPS and timed["lr_scheduler_type"] == "constant"
    assert "lr_scheduler_kwargs" not in timed
    unset = study.parse_args(["--output_dir", str(tmp_path), "--es_schedule", "recipe", "--es_overrides", "max_steps=-1"])
    assert study.race_es_kwargs(unset, recipe, str(tmp_path))["max_steps"] == study.NO_LIMIT_STEPS
    for bad in ("0", "-3", "2.5", "true"):
        wrong = study.parse_args(["--output_dir", str(tmp_path), "--es_overrides", f"max_steps={bad}"])
        with pytest.raises(ValueError, match="max_steps"):
            study.race_es_kwargs(wrong, recipe, str(tmp_path))


def test_arms_and_summary(study, tmp_path):
    args = study.parse_args(["--output_dir", str(tmp_path), "--budgets_minutes", "4", "8", "--task_seeds", "0", "1"])
    arms = study.arms(args)
    # ES with the time schedule: one run per budget; GRPO (constant lr): one run scored at every mark
    assert [(a["method"], a["task_seed"], a["budget_minutes"], a["marks_minutes"]) for a in arms] == [
        ("es", 0, 4.0, []), ("es", 0, 8.0, [4.0]), ("grpo", 0, 8.0, [4.0]),
        ("es", 1, 4.0, []), ("es", 1, 8.0, [4.0]), ("grpo", 1, 8.0, [4.0])]

    def run(method, seed, budget, curve, **extra):
        return {"method": method, "task_seed": seed, "budget_minutes": budget,
                "curve": [{"training_seconds": 60.0 * t, "accuracy": a} for t, a in curve], **extra}

    results = [run("es", 0, 4.0, [(0, 0.2), (4.1, 0.5)], **{"sampled_pass@1": 0.3}),
               run("es", 0, 8.0, [(0, 0.2), (4.0, 0.4), (8.2, 0.6)]),
               run("grpo", 0, 8.0, [(0, 0.2), (4.3, 0.55), (8.1, 0.45)]),
               run("es", 1, 4.0, [(0, 0.3), (4.0, 0.7)], **{"sampled_pass@1": 0.5}),
               run("es", 1, 8.0, [(0, 0.3), (4.1, 0.5), (8.0, 0.8)]),
               run("grpo", 1, 8.0, [(0, 0.3), (4.0, 0.65), (8.3, 0.55)])]
    rows = {(r["method"], r["budget_minutes"]): r for r in study.summarize(args, results)}
    assert rows[("es", 4.0)]["per_seed"] == {0: 0.5, 1: 0.7}  # the 4-minute runs' ends, not the 8-minute runs' marks
    assert rows[("es", 4.0)]["mean"] == pytest.approx(0.6) and rows[("es", 4.0)]["std"] == pytest.approx(0.1414, abs=1e-4)
    assert rows[("es", 4.0)]["sampled_pass@1"] == pytest.approx(0.4)
    assert rows[("es", 4.0)]["sampled_pass@1_std"] == pytest.approx(0.1414, abs=1e-4)
    assert rows[("grpo", 4.0)]["per_seed"] == {0: 0.55, 1: 0.65}  # the 8-minute run scored at its 4-minute mark
    assert rows[("grpo", 8.0)]["mean"] == pytest.approx(0.5)
    table = study.markdown_table(args, list(rows.values()), 0.25)
    assert "| ES (ESTrainer) | 4 | 0.500, 0.700 | 0.600 | 0.141 | 0.400 +- 0.141 |" in table
    assert "| GRPO (TRL GRPOTrainer) | 8 | 0.450, 0.550 | 0.500 | 0.071 | - |" in table


@pytest.fixture
def warm_arms(warm_python, monkeypatch):
    """Each arm's ``python compare_es_grpo.py --worker SPEC`` (:func:`trl_es.launch.run_worker`, one plain process
    per arm here) as a child of the worker's warm interpreter (tests/warm_python.py: the libraries imported once, not
    once per arm); the commands run."""
    import trl_es.launch

    shim = WarmSubprocess(warm_python)
    monkeypatch.setattr(trl_es.launch, "subprocess", shim)
    return shim.commands


def test_race_on_tiny_model(run_study, warm_arms):
    out = run_study.output_dir
    results = run_study(
        "--task_seeds", "0",
        "--budgets_minutes", "0.02", "0.04", "--num_train_prompts", "16", "--num_validation_prompts", "4",
        "--num_test_prompts", "6", "--eval_batch_size", "6", "--sampled_samples", "2", "--final_max_new_tokens", "8",
        "--entropy_prompts", "2",
        "--es_num_processes", "1", "--threads_per_process", "1",
        "--es_overrides", "population_size=4", "prompt_batch_size=4", "noise_table_size=1048576",
        "max_completion_length=6",
    )
    with open(out / "results.json") as f:
        saved = json.load(f)
    assert [(r["method"], r["budget_minutes"]) for r in saved["table"]] == [
        ("es", 0.02), ("es", 0.04), ("grpo", 0.02), ("grpo", 0.04)]
    assert len(saved["runs"]) == 3  # ES: one run per budget; GRPO: one run scored at the 0.02 mark
    assert [cmd[2] for cmd in warm_arms] == ["--worker"] * 3  # one process per arm
    for run in saved["runs"]:
        assert run["split"] == "test" and run["processes"] == 1 and run["max_new_tokens"] == 6
        assert run["steps"] >= 1 and run["training_minutes"] >= run["budget_minutes"]
        assert run["curve"][0]["training_seconds"] == 0.0 and run["curve"][0]["step"] == 0
        assert 0.0 <= run["accuracy_at_8_tokens"] <= 1.0
        assert 0.0 <= run["sampled_pass@1"] <= run["sampled_pass@2"] <= 1.0
        assert run["sample_temperature"] == 0.6 and run["sample_top_p"] == 0.95 and run["sampled_token_entropy"] > 0
        assert all(p["token_entropy"] > 0 for p in run["curve"])  # recorded at every evaluation
    assert (out / "accuracy_vs_time.png").stat().st_size > 0 and (out / "pass_at_k.png").stat().st_size > 0
    assert "| method | budget (min) | per task seed | mean | std |" in (out / "results.md").read_text()
    assert saved["table"] == json.loads(json.dumps(results["table"]))


def test_reuse_results_reads_back_an_arm_run_with_the_same_settings(study, tmp_path, monkeypatch):
    import trl_es.launch

    calls = []

    def fake_worker(script, spec, processes, threads):
        calls.append(spec["task_seed"])
        result = {"method": spec["method"], "task_seed": spec["task_seed"], "run": len(calls)}
        with open(spec["result"], "w") as f:
            json.dump(result, f)
        return result

    monkeypatch.setattr(trl_es.launch, "run_worker", fake_worker)
    argv = ["--output_dir", str(tmp_path), "--budgets_minutes", "4", "--task_seeds", "0", "--methods", "es"]
    args = study.parse_args([*argv, "--reuse_results"])
    (spec,) = study.arms(args)
    assert study.launch_arm(args, spec)["run"] == 1  # nothing saved yet: runs
    saved = json.loads((tmp_path / "seed0" / "es_4min" / "arm.json").read_text())
    assert saved["arm"] == {"method": "es", "task_seed": 0, "budget_minutes": 4.0, "marks_minutes": []}
    assert saved["es_config"]["population_size"] == study.race_es_kwargs(args, study.load_recipe(args.es_recipe),
                                                                        "<arm>")["population_size"]
    assert study.launch_arm(args, spec)["run"] == 1 and calls == [0]  # same settings: read back, not run
    # Another run's output folder or arm list does not matter; any setting of the arm does.
    wider = study.parse_args([*argv, "--reuse_results", "--task_seeds", "0", "1", "--save_models"])
    assert study.launch_arm(wider, study.arms(wider)[0])["run"] == 1 and calls == [0]
    changed = study.parse_args([*argv, "--reuse_results", "--es_overrides", "sigma=0.01"])
    assert study.launch_arm(changed, study.arms(changed)[0])["run"] == 2
    arm_dir = tmp_path / "seed0" / "es_4min"
    assert json.loads((arm_dir / "result.replaced.json").read_text())["run"] == 1  # the earlier result is kept
    assert json.loads((arm_dir / "arm.replaced.json").read_text()) == saved
    assert study.launch_arm(changed, study.arms(changed)[0])["run"] == 2  # now saved with the new settings
    no_reuse = study.parse_args([*argv, "--es_overrides", "sigma=0.01"])
    assert study.launch_arm(no_reuse, study.arms(no_reuse)[0])["run"] == 3 and calls == [0, 0, 0]
