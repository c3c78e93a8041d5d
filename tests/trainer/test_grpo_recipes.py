"""Drop-in for GRPO recipes (issue 63): GRPO's batch fields keep GRPO's meaning (mapped onto prompt_batch_size, TRL
1.16's prompts per optimizer step), GRPO's loss-only settings are accepted and named in one warning, the refusals that
protect from wrong results stay, and ``train()`` logs the run's plan."""

import logging
import warnings

import pytest
from datasets import Dataset
from tiny import build_llama
from trl import GRPOConfig

from trl_es import ESConfig, ESTrainer
from trl_es.arguments import TrlESParser

SMALL_TABLE = 1 << 20
CONFIG_LOGGER = "trl_es.trainer.es.es_config"
TRAINER_LOGGER = "trl_es.trainer.es.es_trainer"


def config(tmp_path, **kwargs):
    return ESConfig(output_dir=str(tmp_path / "out"), report_to=[], **kwargs)


def grpo_config(tmp_path, **kwargs):
    return GRPOConfig(output_dir=str(tmp_path / "grpo"), report_to=[], bf16=False, use_cpu=True, **kwargs)


def parse(tmp_path, argv):
    (args,) = TrlESParser((ESConfig,)).parse_args_and_config(["--output_dir", str(tmp_path / "out"),
                                                              "--report_to", "none"] + argv)
    return args


@pytest.fixture
def processes(monkeypatch):
    """Set the number of processes the config sees (``world_size``, what the trainer's processes are)."""
    def set_world(world_size):
        monkeypatch.setattr(ESConfig, "world_size", property(lambda self: world_size))
        monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: world_size))
    return set_world


def mapping_logs(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == CONFIG_LOGGER and "batch fields mapped" in r.getMessage()]


def no_effect_warnings(record):
    return [str(w.message) for w in record if "no effect" in str(w.message)]


# ---------------------------------------------------------------------------------------------- 1: batch fields
@pytest.mark.parametrize("world, kwargs, prompts", [
    (1, dict(per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=16), 4),  # open-r1
    (2, dict(per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=16), 8),
    (1, dict(per_device_train_batch_size=8, num_generations=8), 1),  # TRL's defaults
    (4, dict(per_device_train_batch_size=8, num_generations=8), 4),
    (1, dict(per_device_train_batch_size=8, num_generations=8, generation_batch_size=32), 1),
    (2, dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
             generation_batch_size=32), 4),
    (1, dict(per_device_train_batch_size=8, num_generations=4, steps_per_generation=2), 2),
    (2, dict(per_device_train_batch_size=6, gradient_accumulation_steps=3, num_generations=9,
             steps_per_generation=6), 4),
])
def test_grpo_batch_fields_map_onto_grpos_prompts_per_optimizer_step(tmp_path, processes, world, kwargs, prompts):
    """prompt_batch_size is what TRL's own GRPOConfig gives: its generation batch (generation_batch_size
    completions, spent over steps_per_generation micro-steps) holds num_generations completions of each prompt, so
    one optimizer step (gradient_accumulation_steps micro-steps) holds generation_batch_size / num_generations x
    gradient_accumulation_steps / steps_per_generation prompts."""
    processes(world)
    grpo = grpo_config(tmp_path, temperature=1.0, **kwargs)
    grpo_prompts = grpo.generation_batch_size // grpo.num_generations * grpo.gradient_accumulation_steps
    assert grpo_prompts % grpo.steps_per_generation == 0
    assert grpo_prompts // grpo.steps_per_generation == prompts
    args = config(tmp_path, **kwargs)
    assert args.prompt_batch_size == prompts
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (prompts // world, 1)
    assert args.train_batch_size == prompts // world  # what the Trainer's dataloader loads on each process


@pytest.mark.parametrize("kwargs, prompts", [
    (dict(per_device_train_batch_size=8), 8),  # ES's num_generations=1: 8 completions are 8 prompts
    (dict(per_device_train_batch_size=8, num_generations=8), 1),  # GRPO's group of 8: one prompt, not 8
    (dict(per_device_train_batch_size=16, num_generations=8, prompt_batch_size=2), 2),  # set both, agreeing
    (dict(gradient_accumulation_steps=2, num_generations=8), 2),  # per_device_train_batch_size unset: GRPO's 8
    (dict(prompt_batch_size=6), 6),  # ES's own field alone
    (dict(), 8),  # ES's default
])
def test_per_device_train_batch_size_counts_completions_as_in_grpo(tmp_path, kwargs, prompts):
    assert config(tmp_path, **kwargs).prompt_batch_size == prompts


@pytest.mark.parametrize("kwargs, match", [
    (dict(per_device_train_batch_size=8, num_generations=4, generation_batch_size=12),
     r"^generation_batch_size \(12\) must be divisible by the global batch size per_device_train_batch_size x "
     r"processes = 8 x 1 = 8 \(GRPO refuses it too\)\.$"),
    (dict(per_device_train_batch_size=6, num_generations=4),
     r"^generation_batch_size \(6 = per_device_train_batch_size 6 x 1 processes x steps_per_generation 1\) must be "
     r"divisible by num_generations \(4\) \(GRPO refuses it too\)"),
    (dict(per_device_train_batch_size=4, num_generations=8, generation_batch_size=8, steps_per_generation=2),
     r"^generation_batch_size=8 and steps_per_generation=2 cannot both be set \(GRPO refuses it too\)"),
])
def test_combinations_grpo_rejects_are_rejected_naming_the_fields(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=r"generation_batch_size"):
        grpo_config(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=match):
        config(tmp_path, temperature=1.0, **kwargs)


@pytest.mark.parametrize("kwargs, completions", [
    (dict(per_device_train_batch_size=2, steps_per_generation=4, num_generations=8), 2),
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, generation_batch_size=16,
          num_generations=16), 4),
])
def test_a_grpo_step_of_part_of_a_prompt_is_refused_with_the_reason(tmp_path, kwargs, completions):
    """GRPO accepts these (a prompt's completions spread over several optimizer steps); an ES iteration scores
    whole prompts, so they cannot be mapped."""
    grpo_config(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=rf"^GRPO's batch fields cannot be mapped: one GRPO optimizer step holds "
                                         rf".* = {completions} completions, not a whole number of prompts at "
                                         rf"num_generations={kwargs['num_generations']}.*ES iteration scores whole "
                                         r"prompts.*set prompt_batch_size instead"):
        config(tmp_path, **kwargs)


@pytest.mark.parametrize("kwargs, given, mapped", [
    (dict(prompt_batch_size=8, per_device_train_batch_size=16, num_generations=8), 8, 2),
    (dict(prompt_batch_size=4, per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=16), 4,
     4),
    (dict(prompt_batch_size=32, per_device_train_batch_size=16), 32, 16),
])
def test_prompt_batch_size_and_grpos_batch_fields_must_agree(tmp_path, kwargs, given, mapped):
    if given == mapped:
        assert config(tmp_path, **kwargs).prompt_batch_size == mapped
        return
    with pytest.raises(ValueError, match=rf"^prompt_batch_size={given} contradicts GRPO's batch fields, "
                                         rf"per_device_train_batch_size=\d+ x 1 process x gradient_accumulation_steps="
                                         rf"\d+ / num_generations=\d+ = {mapped} prompts per optimizer step\. Set "
                                         r"prompt_batch_size alone"):
        config(tmp_path, **kwargs)


@pytest.mark.parametrize("world, kwargs, prompts", [
    (2, dict(per_device_train_batch_size=2, num_generations=4), 1),
    (4, dict(per_device_train_batch_size=3, num_generations=2), 6),
])
def test_prompts_that_do_not_split_over_the_processes_are_refused(tmp_path, processes, world, kwargs, prompts):
    processes(world)
    grpo_config(tmp_path, **kwargs)  # GRPO splits a prompt's completions over processes
    with pytest.raises(ValueError, match=rf"^prompt_batch_size \({prompts} \(GRPO's batch fields: .*\)\) must be "
                                         rf"divisible by the number of processes \({world}\): each process loads "
                                         r"prompt_batch_size / \d+ whole prompts"):
        config(tmp_path, **kwargs)


def test_the_mapping_is_logged_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        args = config(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=16)
        args.check_fields()
        args.check_fields()
    (message,) = mapping_logs(caplog)
    assert message == ("GRPO's batch fields mapped to prompt_batch_size=4: one GRPO optimizer step holds "
                       "per_device_train_batch_size=16 x 1 process x gradient_accumulation_steps=4 = 64 completions, "
                       "64 / num_generations=16 = 4 prompts; each ES iteration scores every member on 4 prompts, 16 "
                       "completion(s) each. per_device_train_batch_size is now 4 (prompts per process) and "
                       "gradient_accumulation_steps 1.")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        config(tmp_path, prompt_batch_size=4)
        config(tmp_path)
    assert mapping_logs(caplog) == []  # nothing of GRPO's set: nothing mapped


def test_command_line_yaml_and_round_trip_map_the_same_way(tmp_path):
    argv = ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "4", "--num_generations", "16"]
    assert parse(tmp_path, argv).prompt_batch_size == 4
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("per_device_train_batch_size: 8\nnum_generations: 8\ngeneration_batch_size: 64\n")
    args = parse(tmp_path, ["--config", str(recipe)])
    assert (args.prompt_batch_size, args.generation_batch_size) == (1, 64)
    for built in (args, config(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=4,
                               num_generations=16)):
        d = built.to_dict()  # GRPO's fields as given, so the config rebuilt from it maps the same way
        assert (d["per_device_train_batch_size"], d["gradient_accumulation_steps"]) in ((8, 1), (16, 4))
        again = ESConfig(**{**d, "report_to": []})
        assert (again.prompt_batch_size, again.per_device_train_batch_size) == (built.prompt_batch_size,
                                                                                built.per_device_train_batch_size)


def test_batch_fields_set_after_construction_are_mapped_again(tmp_path):
    args = config(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=16)
    args.check_fields()
    assert args.prompt_batch_size == 4
    args.gradient_accumulation_steps = 8  # a script sets it after parse_args: ESTrainer checks again
    args.check_fields()
    assert (args.prompt_batch_size, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 8, 1)
    args.per_device_train_batch_size = 32
    args.check_fields()
    assert args.prompt_batch_size == 16  # 32 x 8 / 16, the changed accumulation kept
    args = config(tmp_path)
    args.per_device_train_batch_size = 4
    args.num_generations = 2
    args.check_fields()
    assert args.prompt_batch_size == 2


# ---------------------------------------------------------------------------------------------- 2: loss-only fields
def test_grpo_loss_settings_are_accepted_and_listed_in_one_warning(tmp_path):
    with pytest.warns(UserWarning) as record:
        args = config(tmp_path, beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", num_iterations=2)
    (message,) = no_effect_warnings(record)
    lines = message.splitlines()
    assert lines[0] == "5 settings of this config have no effect on ES (accepted, not used; all of them are listed):"
    assert [line.split(" has no effect")[0] for line in lines[1:]] == [
        "  1. beta=0.04", "  2. num_iterations=2", "  3. epsilon=0.2", "  4. epsilon_high=0.28",
        "  5. loss_type='dapo'"]
    assert "ES counterpart: awd_lambda" in lines[1]
    assert all("ES counterpart: sigma and learning_rate" in line for line in lines[3:5])
    assert "ES counterpart: es_optimizer" in lines[5]
    assert (args.beta, args.loss_type) == (0.04, "dapo")  # kept as given, never read
    assert args.grpo_fields_plan()["ignored"] == ["beta=0.04", "num_iterations=2", "epsilon=0.2", "epsilon_high=0.28",
                                                  "loss_type='dapo'"]


def test_a_gspo_command_line_runs_with_one_warning(tmp_path, caplog):
    """The flags of a GSPO command line (TRL's gspo.py docstring): accepted, the batch mapped."""
    argv = ["--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4", "--beta", "0.0",
            "--loss_type", "grpo", "--gradient_accumulation_steps", "2", "--steps_per_generation", "8",
            "--num_generations", "4", "--weight_decay", "0.1"]
    with pytest.warns(UserWarning) as record, caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        args = parse(tmp_path, argv)
    (message,) = no_effect_warnings(record)
    assert message.startswith("5 settings of this config have no effect on ES")
    for name in ("epsilon=0.0003", "epsilon_high=0.0004", "importance_sampling_level='sequence'", "loss_type='grpo'",
                 "weight_decay=0.1 has no effect with es_optimizer='es'"):
        assert f". {name}" in message, name
    assert "beta" not in message  # beta=0.0: GRPO without a KL term, as ES
    assert args.prompt_batch_size == 8 * 1 * 2 // 4  # GRPO's per_device_train_batch_size default 8
    (mapped,) = mapping_logs(caplog)
    assert "generation_batch_size=64 (steps_per_generation=8): GRPO generates 64 completions at a time" in mapped


@pytest.mark.parametrize("kwargs", [
    dict(beta=0.0, num_iterations=1, entropy_coef=0.0, top_entropy_quantile=1.0, disable_dropout=True),
    dict(multi_objective_aggregation="sum_then_normalize", use_transformers_continuous_batching=False,
         vllm_importance_sampling_correction=False, log_multimodal=True),
])
def test_grpo_values_that_do_what_es_does_are_silent(tmp_path, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = config(tmp_path, **kwargs)
    assert args.grpo_fields_plan() == {"mapped": [], "ignored": []}


def test_loss_settings_set_after_construction_are_warned_about_once(tmp_path, tokenizer):
    args = trainer_args(tmp_path)
    args.beta = 0.3
    args.scale_rewards = "batch"
    with pytest.warns(UserWarning) as record:
        args.check_fields()
    (message,) = no_effect_warnings(record)
    assert message.startswith("2 settings") and "1. beta=0.3" in message and "2. scale_rewards='batch'" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args.check_fields()  # said once


# ---------------------------------------------------------------------------------------------- 2: refusals kept
@pytest.mark.parametrize("kwargs, match", [
    (dict(cast_lm_head_to_fp32=True), r"^cast_lm_head_to_fp32=True is not supported by ES yet: .* changes the "
                                      r"logits.*delete it"),
    (dict(multi_objective_aggregation="normalize_then_sum"), r"^multi_objective_aggregation='normalize_then_sum' "
                                                             r"is not supported by ES yet"),
    (dict(temperature=0.0, num_generations=4), r"^num_generations=4 with greedy decoding \(temperature=0\)"),
])
def test_settings_that_would_change_the_results_stay_refused(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **kwargs)


@pytest.mark.parametrize("name, value, match", [
    ("cast_lm_head_to_fp32", True, r"^cast_lm_head_to_fp32=True is not supported by ES yet: .*delete it"),
    ("multi_objective_aggregation", "normalize_then_sum",
     r"^multi_objective_aggregation='normalize_then_sum' is not supported by ES yet"),
])
def test_a_refused_setting_forced_on_after_parsing_says_what_to_do(tmp_path, tokenizer, name, value, match):
    args = trainer_args(tmp_path)
    setattr(args, name, value)  # as TRL's grpo_continuous_batching.py sets a field after parse_args
    with pytest.raises(ValueError, match=match):
        build_trainer(args, tokenizer)


# ---------------------------------------------------------------------------------------------- 3: the plan
def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def trainer_args(tmp_path, **kwargs):
    defaults = dict(population_size=2, max_completion_length=2, max_steps=1, noise_table_size=SMALL_TABLE,
                    save_strategy="no", disable_tqdm=True)
    if not {"per_device_train_batch_size", "gradient_accumulation_steps"} & set(kwargs):
        defaults["prompt_batch_size"] = 2
    return config(tmp_path, **{**defaults, **kwargs})


def build_trainer(args, tokenizer):
    return ESTrainer(build_llama(tokenizer), zero_reward, args=args,
                     train_dataset=Dataset.from_dict({"prompt": ["a", "b", "c", "d"]}), processing_class=tokenizer)


def plan_of(trainer, caplog):
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOGGER):
        trainer.train()
    (plan,) = [r.getMessage() for r in caplog.records if r.name == TRAINER_LOGGER and "ES plan" in r.getMessage()]
    return plan.splitlines()


def test_train_logs_the_plan_of_a_grpo_recipe(tmp_path, tokenizer, caplog, one_thread):
    args = trainer_args(tmp_path, per_device_train_batch_size=4, num_generations=2, beta=0.04, weight_decay=0.1)
    trainer = build_trainer(args, tokenizer)
    numel = sum(p.numel() for p in trainer.model.parameters())
    tensors = len(list(trainer.model.parameters()))
    assert plan_of(trainer, caplog) == [
        "***** ES plan *****",
        "  Processes = 1",
        "  Members per iteration = 2 (2 per process)",
        "  Prompts per iteration = 2 (2 per process)",
        "  Completions per prompt = 2, sampled at temperature 1.0",
        "  Completions per iteration = 8 (2 members x 2 prompts x 2)",
        "  Sigma = 0.001",
        "  Step: alpha (learning_rate) = 0.0005, constant schedule",
        f"  Trained parameters = {numel:,} in {tensors} tensors (sequential, gaussian noise)",
        "  Generation engine = eager",
        "  GRPO fields mapped = per_device_train_batch_size=4 x 1 process x gradient_accumulation_steps=1 / "
        "num_generations=2 -> prompt_batch_size=2",
        "  GRPO fields ignored = beta=0.04, weight_decay=0.1 (no effect on ES: see the warning at start)",
    ]


def test_the_plan_says_one_greedy_completion_when_num_generations_is_unset(tmp_path, tokenizer, caplog, one_thread):
    """A GRPO recipe that leaves num_generations unset gets ES's 1 greedy completion per prompt, and is told so."""
    args = trainer_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, sigma=0.01,
                        learning_rate=0.02, lr_scheduler_type="linear")
    lines = plan_of(build_trainer(args, tokenizer), caplog)
    assert lines[3:8] == [
        "  Prompts per iteration = 4 (4 per process)",
        "  Completions per prompt = 1, greedy",
        "  Completions per iteration = 8 (2 members x 4 prompts x 1)",
        "  Sigma = 0.01",
        "  Step: alpha (learning_rate) = 0.02, linear schedule",
    ]
    assert lines[10:] == [
        "  GRPO fields mapped = per_device_train_batch_size=2 x 1 process x gradient_accumulation_steps=2 / "
        "num_generations=1 -> prompt_batch_size=4",
        "  GRPO fields ignored = none",
    ]
