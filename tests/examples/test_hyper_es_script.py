"""examples/scripts/hyper_es.py end to end on the tiny model: pool, GRPO-LoRA baselines, search, Pass@K, costs."""

import json
import os

import pytest
from example_script import example_script
from paths import REPO

from trl_es.arguments import TrlESParser
from trl_es.trainer.hyper_es.hyper_es_config import HyperESConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def script():
    with example_script("scripts/hyper_es.py", "hyper_es_script_e2e") as module:
        yield module


def run(script, tiny_model_dir, out, *extra, factors=("1.0", "1.5")):
    args = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--num_adapters", "2",
            "--pool_max_steps", "1", "--n_pool", "8", "--n_fitness", "4", "--n_eval", "4", "--pool_batch_size", "4",
            "--pool_num_generations", "4", "--pool_max_completion_length", "4", "--pool_learning_rate", "1e-2",
            "--lora_r", "4", "--lora_alpha", "8", "--max_generations", "1", "--population_size", "4",
            "--genome_granularity", "global", "--final_genome", "best", "--max_completion_length", "4", "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "4", "--temperature", "0.0", "--report_to", "none", "--save_strategy",
            "no", "--use_cpu", "--sampled_samples", "2", "--sampled_prompts", "3", *extra]
    if factors:
        args += ["--grpo_lora_factors", *factors]
    script_args, config = TrlESParser((script.HyperESScriptArguments, HyperESConfig)).parse_args_and_config(args)
    return script.main(script_args, config)


def test_comparison_with_grpo_lora_baselines_pass_at_k_and_costs(script, tiny_model_dir, tmp_path):
    results = run(script, tiny_model_dir, tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "comparison.json").read_text())
    assert saved["settings"]["pool_gradient_updates"] == 2 and saved["settings"]["sampled_prompts"] == 3
    arms = ["base", "best_single_adapter", "uniform_merge", "grpo_lora_2steps", "grpo_lora_3steps", "hyper_es"]
    assert sorted(saved["sampled"]) == sorted(arms)
    for arm in arms:
        figures = saved["sampled"][arm]
        assert set(figures) == {"pass@1", "pass@2", "token_entropy"}
        assert 0.0 <= figures["pass@1"] <= figures["pass@2"] <= 1.0 and figures["token_entropy"] > 0
    for name in ("grpo_lora_2steps", "grpo_lora_3steps"):
        assert 0.0 <= saved[name] <= 1.0
    costs = saved["costs"]
    assert {arm: costs[arm]["gradient_updates"] for arm in arms} == {
        "base": 0, "best_single_adapter": 1, "uniform_merge": 2, "grpo_lora_2steps": 2, "grpo_lora_3steps": 3,
        "hyper_es": 2}
    # GRPO: 4 completions of 1..4 tokens per step; the search: 4 candidates x 4 fitness rows x 1..4 tokens
    assert 2 * 4 <= costs["uniform_merge"]["generated_tokens"] <= 2 * 4 * 4
    assert 3 * 4 <= costs["grpo_lora_3steps"]["generated_tokens"] <= 3 * 4 * 4
    search = costs["hyper_es"]["search_generated_tokens"]
    assert 16 <= search <= 16 * 4
    assert costs["hyper_es"]["generated_tokens"] == costs["uniform_merge"]["generated_tokens"] + search
    assert costs["hyper_es"]["wall_seconds"] > costs["uniform_merge"]["wall_seconds"] > 0
    assert saved["hyper_es"] == results["hyper_es"]
    assert [p["generation"] for p in saved["search_curve"]] == [1]
    assert (tmp_path / "run" / "search_curve.png").stat().st_size > 0
    # Reused pool and baselines: nothing is trained again, the same (greedy) figures come back.
    baseline = tmp_path / "run" / "pool" / "grpo_lora_3steps" / "adapter_0" / "adapter_model.safetensors"
    stamp = baseline.stat().st_mtime_ns
    again = run(script, tiny_model_dir, tmp_path / "run")
    assert baseline.stat().st_mtime_ns == stamp
    assert again["grpo_lora_3steps"] == saved["grpo_lora_3steps"] and again["base"] == saved["base"]
    assert again["sampled"]["grpo_lora_3steps"] == saved["sampled"]["grpo_lora_3steps"]  # seeded sampling
    # a baseline recorded with its run's split (one bucket either way) is reused under another split
    rows_file = tmp_path / "run" / "pool" / "grpo_lora_3steps" / "pool_rows.json"
    assert json.loads(rows_file.read_text())["pool_split"] is None
    rows_file.write_text(json.dumps(dict(json.loads(rows_file.read_text()), pool_split="random")))
    again = run(script, tiny_model_dir, tmp_path / "run")
    assert baseline.stat().st_mtime_ns == stamp and again["grpo_lora_3steps"] == saved["grpo_lora_3steps"]
    with pytest.raises(ValueError, match="other rows or settings than this run.s \\(differing: pool_learning_rate;"):
        run(script, tiny_model_dir, tmp_path / "run", "--pool_learning_rate", "1e-3")
    tracked = run(script, tiny_model_dir, tmp_path / "tracked", "--n_validation", "3", "--track_validation",
                  "--max_generations", "2", "--sampled_samples", "0", factors=())
    assert [p["generation"] for p in tracked["search_curve"]] == [1, 2]
    assert all(0.0 <= p["validation_mean_genome"] <= 1.0 for p in tracked["search_curve"])
    assert "sampled" not in tracked and not any(k.startswith("grpo_lora") for k in tracked["costs"])
    with pytest.raises(ValueError, match="track_validation needs validation rows"):
        run(script, tiny_model_dir, tmp_path / "other", "--track_validation")
    with pytest.raises(ValueError, match="grpo_lora_factors must be > 0"):
        run(script, tiny_model_dir, tmp_path / "other", factors=("0",))


def test_table_over_seeds(tmp_path):
    with example_script("studies/hyper_es_table.py", "hyper_es_table") as table:
        def seed(base, uniform, hyper, grpo, p1):
            costs = {"gradient_updates": 72, "generated_tokens": 1000, "wall_seconds": 600.0}
            return {"base": base, "best_single_adapter": {"name": "adapter_0", "reward": 0.5},
                    "uniform_merge": uniform, "hyper_es": hyper, "grpo_lora_72steps": grpo, "grpo_lora_80steps": grpo,
                    "sampled": {arm: {"pass@1": p1, "pass@16": 0.9, "token_entropy": 0.4} for arm in (
                        "base", "best_single_adapter", "uniform_merge", "hyper_es", "grpo_lora_72steps",
                        "grpo_lora_80steps")},
                    "costs": {"base": {"gradient_updates": 0, "generated_tokens": 0, "wall_seconds": 0.0},
                              "best_single_adapter": dict(costs, gradient_updates=24),
                              "uniform_merge": costs, "hyper_es": dict(costs, wall_seconds=1200.0),
                              "grpo_lora_72steps": costs, "grpo_lora_80steps": dict(costs, gradient_updates=80)}}

        files = []
        for i, values in enumerate([(0.3, 0.6, 0.64, 0.62, 0.5), (0.3, 0.62, 0.66, 0.6, 0.7)]):
            path = tmp_path / f"seed{i}.json"
            path.write_text(json.dumps(seed(*values)))
            files.append(str(path))
        text = table.main([*files, "--output_file", str(tmp_path / "table.md")])
        assert (tmp_path / "table.md").read_text() == text
        lines = text.splitlines()
        assert lines[0].startswith("| arm | greedy per seed | greedy mean | std | pass@1 (mean +- std) | pass@16")
        assert [line.split(" | ")[0] for line in lines[2:8]] == [
            "| base", "| best_single_adapter", "| uniform_merge", "| hyper_es", "| grpo_lora_72steps",
            "| grpo_lora_80steps"]
        assert "| hyper_es | 0.640, 0.660 | 0.650 | 0.014 | 0.600 +- 0.141 | 0.900 +- 0.000 | 72 | 1,000 | 20.0 |" in text
        assert "Hyper-ES - (uniform merge + 0.02): +0.020." in text
        assert "Hyper-ES - grpo_lora_72steps (equal gradient updates): +0.040." in text
        assert "grpo_lora_80steps (equal" not in text
        with pytest.raises(ValueError, match="no comparison.json"):
            table.summarize([])


def test_table_plots_every_seeds_search_curve(tmp_path):
    with example_script("studies/hyper_es_table.py", "hyper_es_table_plot") as table:
        files = []
        for i in range(2):
            run = {"base": 0.3, "best_single_adapter": {"name": "adapter_0", "reward": 0.5}, "uniform_merge": 0.5,
                   "hyper_es": 0.55,
                   "search_curve": [{"generation": g, "fitness_best": 0.5 + 0.01 * g, "fitness_mean": 0.4 + 0.01 * g,
                                     "validation_mean_genome": 0.45 + 0.01 * i} for g in (1, 2, 3)]}
            (tmp_path / f"seed{i}").mkdir()
            path = tmp_path / f"seed{i}" / "comparison.json"
            path.write_text(json.dumps(run))
            files.append(str(path))
        table.main([*files, "--plot_file", str(tmp_path / "curves.png")])
        assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        del run["search_curve"]
        (tmp_path / "seed1" / "comparison.json").write_text(json.dumps(run))
        with pytest.raises(ValueError, match=r"no search_curve in \['seed1'\]"):
            table.main([*files, "--plot_file", str(tmp_path / "other.png")])
        assert not (tmp_path / "other.png").exists()


def test_carries(script):
    assert [script.carries(a, b, "+") for a, b in ((12, 34), (47, 35), (95, 5), (50, 50), (999, 1))] == [0, 1, 2, 1, 3]
    assert [script.carries(a, b, "-") for a, b in ((52, 38), (38, 52), (100, 1), (47, 35))] == [1, 1, 2, 0]
    with pytest.raises(ValueError, match="defined for the operators \\+ and -, got '\\*'"):
        script.carries(3, 4, "*")


def test_difficulty_pools_validation_choice_and_ablation_runs(script, tiny_model_dir, tmp_path):
    # carries: buckets are contiguous quantiles of (carries, |answer|); bucket 0 the easiest
    run(script, tiny_model_dir, tmp_path / "carries", "--pool_split", "carries", "--sampled_samples", "0",
        "--n_validation", "3", "--choose_single_on", "validation", factors=())
    from trl_es.merging import split_buckets
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict

    rows = make_arithmetic_dataset_dict(12, 3, 4, seed=0)["train"].select(range(8))
    key = lambda row: (script.carries(row["a"], row["b"], row["op"]), abs(row["answer"]))  # noqa: E731
    buckets = split_buckets(rows, 2, split_key=key)
    keys = [[key(r) for r in b] for b in buckets]
    assert max(keys[0]) <= min(keys[1]) and len(keys[0]) == len(keys[1]) == 4
    recorded = json.loads((tmp_path / "carries" / "pool" / "pool_rows.json").read_text())
    assert recorded["pool_split"] == "carries" and recorded["prompts"] == [str(r["prompt"]) for r in rows]
    saved = json.loads((tmp_path / "carries" / "comparison.json").read_text())
    assert saved["best_single_adapter"]["chosen_on"] == "validation"
    assert saved["settings"]["pool_split"] == "carries" and saved["settings"]["evaluations"] == 4
    # base_success: the base model's sampled rates, recorded with the pool; a rerun reuses it
    run(script, tiny_model_dir, tmp_path / "success", "--pool_split", "base_success", "--difficulty_samples", "2",
        "--sampled_samples", "0", factors=())
    recorded = json.loads((tmp_path / "success" / "pool" / "pool_rows.json").read_text())
    assert recorded["pool_split"] == "base_success" and recorded["difficulty_samples"] == 2
    pool = json.loads((tmp_path / "success" / "pool" / "direction_pool.json").read_text())
    assert pool["split"] == "key quantiles" and [a["bucket_size"] for a in pool["adapters"]] == [4, 4]
    # an ablation run: the pool of another run, no reference arms, no baseline trained
    ablation = run(script, tiny_model_dir, tmp_path / "ablation", "--pool_dir", str(tmp_path / "success" / "pool"),
                   "--pool_split", "base_success", "--difficulty_samples", "2", "--sampled_samples", "0",
                   "--no_reference_arms", "--search_density", "true")
    assert sorted(k for k in ablation if not k.startswith(("search", "settings"))) == [
        "costs", "hyper_es", "hyper_es_fitness", "uniform_merge"]
    assert sorted(ablation["costs"]) == ["hyper_es", "uniform_merge"]
    assert not (tmp_path / "success" / "pool" / "grpo_lora_2steps").exists()
    assert ablation["settings"]["search_density"] is True and ablation["settings"]["coefficients"] == 3
    with pytest.raises(ValueError, match="pool_split must be one of \\('random', 'difficulty', 'carries', "
                                         "'base_success'\\), got 'hard'"):
        run(script, tiny_model_dir, tmp_path / "other", "--pool_split", "hard")
    with pytest.raises(ValueError, match="choose_single_on='validation' needs validation rows"):
        run(script, tiny_model_dir, tmp_path / "other", "--choose_single_on", "validation")
    with pytest.raises(ValueError, match="choose_single_on must be 'fitness' or 'validation', got 'test'"):
        run(script, tiny_model_dir, tmp_path / "other", "--choose_single_on", "test")


def test_ablation_table_and_refusals(tmp_path):
    with example_script("studies/hyper_es_ablation.py", "hyper_es_ablation") as ablation:
        def write(folder, hyper, uniform, evaluations, grpo=None):
            folder.mkdir(parents=True)
            result = {"hyper_es": hyper, "uniform_merge": uniform,
                      "settings": {"pool_gradient_updates": 20, "evaluations": evaluations}}
            if grpo is not None:
                result["grpo_lora_20steps"] = grpo
            (folder / "comparison.json").write_text(json.dumps(result))

        write(tmp_path / "seed0", 0.60, 0.55, 100, grpo=0.65)
        write(tmp_path / "seed1", 0.70, 0.50, 100, grpo=0.64)
        write(tmp_path / "ablation" / "weights_to_2" / "seed0", 0.58, 0.55, 100)
        write(tmp_path / "ablation" / "budget_3n" / "seed1", 0.66, 0.50, 30)
        text = ablation.main(["--out", str(tmp_path), "--seeds", "0", "1", "--arms", "weights_to_2", "budget_3n",
                              "split_random", "--table_only"])
        lines = text.splitlines()
        assert lines[2] == "| recipe | - | 0, 1 | 0.600, 0.700 | 0.550, 0.500 | -0.050, +0.060 | - | 100 |"
        assert lines[3] == ("| weights_to_2 | weights in [0, 2] instead of [0, K] | 0 | 0.580 | 0.550 | -0.070 | "
                            "-0.020 | 100 |")
        assert lines[4] == ("| budget_3n | search budget 3 x n (3 generations) instead of 10 x n | 1 | 0.660 | 0.500 "
                            "| +0.020 | -0.040 | 30 |")
        assert lines[5].startswith("| split_random | pool split: random instead of carries | - | - | - | - | - |")
        assert (tmp_path / "ablation.md").read_text() == text
        # a finished run is not run again; an arm that reuses a missing pool and an unknown arm are refused
        assert ablation.run_arm(str(tmp_path), "weights_to_2", 0) == str(
            tmp_path / "ablation" / "weights_to_2" / "seed0" / "comparison.json")
        with pytest.raises(ValueError, match="reuses the recipe run's pool, and .*seed2/pool has none"):
            ablation.run_arm(str(tmp_path), "fitness_16", 2)
        with pytest.raises(ValueError, match="unknown ablation arm 'nope'"):
            ablation.run_arm(str(tmp_path), "nope", 0)


@pytest.mark.parametrize("recipe", ["hyper_es_paper_protocol_cpu.yaml", "hyper_es_arithmetic.yaml"])
def test_paper_protocol_recipes_parse_with_the_values_they_state(script, recipe):
    import yaml

    path = os.path.join(REPO, "examples", "recipes", recipe)
    script_args, config = TrlESParser((script.HyperESScriptArguments, HyperESConfig)).parse_args_and_config(
        ["--config", path])
    with open(path) as f:
        raw = yaml.safe_load(f)
    assert config.report_to == [] and raw.pop("report_to") == "none"
    for key, value in raw.items():
        target = script_args if hasattr(script_args, key) else config
        assert getattr(target, key) == value, key
    assert (script_args.num_adapters, script_args.pool_split, config.final_genome) == (10, "carries", "validation")
    assert config.population_size is None and config.weight_bounds == [0.0, 10.0]
    # 10 x n evaluations with pycma's default population 4 + floor(3 ln n)
    n = 10 if config.genome_granularity == "global" else 30 * 10
    popsize = 4 + int(3 * __import__("math").log(n))
    assert config.max_generations * popsize >= 10 * n


def test_scaled_uniform_merges_on_validation(script, tiny_model_dir, tmp_path):
    tiny = ["--model_name_or_path", tiny_model_dir, "--num_adapters", "2", "--pool_max_steps", "1", "--n_pool", "8",
            "--n_fitness", "4", "--n_eval", "4", "--n_validation", "3", "--pool_batch_size", "4",
            "--pool_num_generations", "4", "--pool_max_completion_length", "4", "--pool_learning_rate", "1e-2",
            "--lora_r", "4", "--lora_alpha", "8", "--max_completion_length", "4", "--per_device_eval_batch_size", "4",
            "--use_cpu", "--pool_split", "carries"]
    run(script, tiny_model_dir, tmp_path / "seed0", *tiny[2:], "--sampled_samples", "0", factors=())
    with example_script("studies/hyper_es_ablation.py", "hyper_es_ablation_scaled") as ablation:
        result = ablation.scaled_uniform(str(tmp_path), 0, [0.0, 1.0, 2.0],
                                         recipe=os.path.join(REPO, "examples", "recipes", "hyper_es_paper_protocol_cpu.yaml"),
                                         extra=tuple(tiny))
        assert sorted(result["validation"]) == ["0.0", "1.0", "2.0"] and result["validation_rows"] == 3
        saved = json.loads((tmp_path / "seed0" / "scaled_uniform.json").read_text())
        assert saved == result and result["num_adapters"] == 2
        recipe = os.path.join(REPO, "examples", "recipes", "hyper_es_paper_protocol_cpu.yaml")
        again = ablation.scaled_uniform(str(tmp_path), 0, [3.0], recipe=recipe, extra=tuple(tiny))  # added to them
        assert sorted(again["validation"]) == ["0.0", "1.0", "2.0", "3.0"]
        assert {k: again["validation"][k] for k in result["validation"]} == result["validation"]
        # weight 0 is the base model, weight 1 the uniform merge: scored independently on the same validation rows
        # (the tiny model scores 0 on arithmetic either way: this checks the rows and the plumbing)
        from trl_es.models import load_model_and_tokenizer
        from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset_dict
        from trl_es import HyperESTrainer

        model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
        validation = make_arithmetic_dataset_dict(12, 3, 4, seed=0)["validation"]
        pool = json.loads((tmp_path / "seed0" / "pool" / "direction_pool.json").read_text())
        trainer = HyperESTrainer(model, [a["adapter"] for a in pool["adapters"]], reward_funcs=arithmetic_reward,
                                 args=HyperESConfig(output_dir=str(tmp_path / "x"), use_cpu=True, report_to="none",
                                                    max_completion_length=4, density=0.5, seed=42,
                                                    weight_bounds=[0.0, 2.0], genome_granularity="global",
                                                    sign_election="weighted"),
                                 train_dataset=validation, eval_dataset=validation, processing_class=tokenizer)
        assert result["validation"]["0.0"] == trainer.evaluate(genome="base")["eval_reward"]
        assert result["validation"]["1.0"] == trainer.evaluate(genome="uniform")["eval_reward"]
        with pytest.raises(ValueError, match="no pool in .*seed1/pool trained on this seed's pool rows"):
            ablation.scaled_uniform(str(tmp_path), 1, [1.0], extra=tuple(tiny))
