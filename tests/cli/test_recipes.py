"""Every shipped recipe parses into the dataclasses of the command that runs it, with the values it states."""

import os

import pytest
import yaml
from example_script import example_script
from trl import ModelConfig, TrlParser

from trl_es import ESConfig
from trl_es.cli import TaskArguments, task_splits
from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict
from trl_es.trainer.hyper_es.hyper_es_config import HyperESConfig
from paths import REPO

ROOT = REPO
RECIPES = os.path.join(ROOT, "examples", "recipes")


@pytest.fixture(scope="module")
def hyper_es_script():
    with example_script("scripts/hyper_es.py", "hyper_es_script") as module:
        yield module


def parse(dataclass_types, recipe):
    return TrlParser(dataclass_types).parse_args_and_config(["--config", os.path.join(RECIPES, recipe)])


def test_every_recipe_is_covered():
    # Each recipe has a test that parses it: this file (main job, Hyper-ES), test_awd_retention.py,
    # test_parallel_averaging_script.py, test_sequential_recipes.py, test_geometry_script.py (geometry_tiny,
    # geometry_addition_tiny), test_diversity_script.py (diversity_tiny), test_pretraining_excursions_script.py
    # (excursions_tiny),
    # test_continual_tasks_script.py (continual_tiny), test_hyper_es_script.py (hyper_es_paper_protocol_cpu).
    assert sorted(os.listdir(RECIPES)) == ["arithmetic_smollm2.yaml", "awd_retention_cpu.yaml", "continual_tiny.yaml",
                                          "diversity_tiny.yaml",
                                          "excursions_tiny.yaml", "geometry_addition_tiny.yaml", "geometry_tiny.yaml",
                                          "hyper_es_arithmetic.yaml", "hyper_es_arithmetic_cpu.yaml",
                                          "hyper_es_paper_protocol_cpu.yaml",
                                          "parallel_averaging_arithmetic_cpu.yaml", "sequential_arithmetic_cpu.yaml",
                                          "sequential_arithmetic_gpu.yaml"]


def test_main_job_recipe():
    task_args, es_args, model_args = parse((TaskArguments, ESConfig, ModelConfig), "arithmetic_smollm2.yaml")
    assert (es_args.population_size, es_args.sigma, es_args.learning_rate, es_args.max_steps) == (24, 0.005, 0.01, 26)
    assert (es_args.population_backend, es_args.prompt_batch_size, es_args.max_completion_length) == (
        "batched_lowrank", 12, 12)
    assert es_args.antithetic and es_args.fitness_shaping == "zscore"
    assert (task_args.task, task_args.num_train_prompts, task_args.num_eval_prompts) == ("arithmetic", 400, 200)
    assert model_args.model_name_or_path == "embedded:SmolLM2-135M-Instruct"


@pytest.mark.parametrize("recipe", ["hyper_es_arithmetic.yaml", "hyper_es_arithmetic_cpu.yaml"])
def test_hyper_es_recipes(recipe, hyper_es_script):
    script_args, config = parse((hyper_es_script.HyperESScriptArguments, HyperESConfig), recipe)
    with open(os.path.join(RECIPES, recipe)) as f:
        raw = yaml.safe_load(f)
    assert config.report_to == [] and raw.pop("report_to") == "none"  # transformers turns "none" into []
    for key, value in raw.items():
        target = script_args if hasattr(script_args, key) else config
        assert getattr(target, key) == (value if not isinstance(value, list) else list(value)), key
    assert config.genome_granularity == "layer" and (script_args.lora_r, script_args.lora_alpha) == (32, 64)


def test_cpu_hyper_es_recipe_uses_the_main_job_held_out_prompts(hyper_es_script):
    """The Hyper-ES script's held-out prompts are the main job's test split (test first in the permutation: the same
    for any train/validation sizes)."""
    script_args, _ = parse((hyper_es_script.HyperESScriptArguments, HyperESConfig), "hyper_es_arithmetic_cpu.yaml")
    task_args, _, _ = parse((TaskArguments, ESConfig, ModelConfig), "arithmetic_smollm2.yaml")
    assert script_args.n_pool + script_args.n_fitness == 400 and script_args.n_eval == 200
    _, main_splits = task_splits(task_args)
    held_out = make_arithmetic_dataset_dict(script_args.n_pool + script_args.n_fitness, 0, script_args.n_eval,
                                            seed=script_args.task_seed)["test"]
    assert len(held_out) == len(main_splits["test"]) == 200
    assert [(r["a"], r["b"], r["op"]) for r in held_out] == [(r["a"], r["b"], r["op"]) for r in main_splits["test"]]
