"""examples/scripts/compare_es_grpo.py: the ES-vs-GRPO race, run in-process on the tiny model with a tiny budget."""

import json
import os
import time
from types import SimpleNamespace

import pytest
from example_script import example_script


@pytest.fixture(scope="module")
def race():
    with example_script("compare_es_grpo.py", "compare_es_grpo") as module:
        yield module


def test_clock_excludes_evaluation_time_and_stops_at_budget(race):
    calls = []

    def slow_eval(model):
        calls.append(model)
        time.sleep(0.2)  # evaluation time: must not count towards the training clock
        return 0.5

    clock = race.EvalClockCallback(slow_eval, budget_seconds=0.25, eval_every_seconds=0.1)
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


def test_es_config_kwargs_drops_task_keys_and_applies_overrides(race):
    recipe = {"model_name_or_path": "x", "task": "arithmetic", "num_train_prompts": 400, "sigma": 0.003,
              "population_size": 16}
    kwargs = race.es_config_kwargs(recipe, ["population_size=8", "antithetic=false"])
    assert kwargs == {"sigma": 0.003, "population_size": 8, "antithetic": False}
    with pytest.raises(ValueError, match="key=value"):
        race.es_config_kwargs(recipe, ["not_a_field=1"])


def test_default_recipe_gives_a_valid_es_config(race, tmp_path):
    from trl_es import ESConfig

    args = race.parse_args(["--output_dir", str(tmp_path)])
    kwargs = race.race_es_kwargs(args, race.load_recipe(args.es_recipe))
    config = ESConfig(**kwargs)
    assert config.eval_strategy == "no" and config.max_steps == race.load_recipe(args.es_recipe)["max_steps"]
    # without max_steps in the recipe, the budget alone stops ES
    recipe = {k: v for k, v in race.load_recipe(args.es_recipe).items() if k not in ("max_steps", "lr_scheduler_type",
                                                                                  "lr_scheduler_kwargs")}
    assert ESConfig(**race.race_es_kwargs(args, recipe)).max_steps == race.NO_LIMIT_STEPS
    overridden = race.parse_args(["--output_dir", str(tmp_path), "--es_overrides", "max_steps=26"])
    assert race.race_es_kwargs(overridden, race.load_recipe(args.es_recipe))["max_steps"] == 26
    unset = race.parse_args(["--output_dir", str(tmp_path), "--es_overrides", "max_steps=-1"])
    assert race.race_es_kwargs(unset, race.load_recipe(args.es_recipe))["max_steps"] == race.NO_LIMIT_STEPS
    for bad in ("0", "-3", "2.5", "true"):
        wrong = race.parse_args(["--output_dir", str(tmp_path), "--es_overrides", f"max_steps={bad}"])
        with pytest.raises(ValueError, match="max_steps"):
            race.race_es_kwargs(wrong, race.load_recipe(args.es_recipe))
    assert config.output_dir == os.path.join(str(tmp_path), "es")


def test_race_on_tiny_model(race, tiny_model_dir, tmp_path):
    out = tmp_path / "race"
    results = race.main([
        "--model_name_or_path", tiny_model_dir, "--output_dir", str(out),
        "--budget_minutes", "0.05", "--eval_every_minutes", "0.02",
        "--num_train_prompts", "16", "--num_eval_prompts", "6", "--eval_batch_size", "6",
        "--es_overrides", "population_size=4", "prompt_batch_size=4", "noise_table_size=1048576",
        "max_steps=100000",  # the budget, not the recipe's 22 steps, ends ES here
    ])
    with open(out / "results.json") as f:
        saved = json.load(f)
    assert saved["table"] == json.loads(json.dumps(results["table"]))
    assert [row["method"] for row in saved["table"]] == ["es", "grpo"]
    for row in saved["table"]:
        for key in ("accuracy_start", "accuracy_end", "accuracy_best"):
            assert 0.0 <= row[key] <= 1.0
        assert row["accuracy_best"] >= max(row["accuracy_start"], row["accuracy_end"])
        assert row["steps"] >= 1 and row["training_minutes"] >= 0.05
        curve = saved["curves"][row["method"]]
        assert curve[0]["training_seconds"] == 0.0 and curve[0]["step"] == 0
        assert curve[-1]["step"] == row["steps"]
    assert saved["es_config"]["population_size"] == 4
    assert (out / "accuracy_vs_time.png").stat().st_size > 0
    table = (out / "results.md").read_text()
    assert "| method | accuracy at start | accuracy at end | best accuracy | training minutes |" in table
    assert "GRPO" in table and "ES" in table
