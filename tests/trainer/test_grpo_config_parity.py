"""GRPOConfig parity of ESConfig (issue 42, classes 7, 12, 13, 14): GRPO's sampling default when a GRPO config sets
``num_generations``; every refused or invalid field in one error; fields set after construction checked when the
trainer is built; GRPO values that mean something else (or nothing) in ES said at start."""

import dataclasses
import logging
import pickle
import warnings

import pytest
from datasets import Dataset
from tiny import build_llama

from trl_es import ESConfig, ESTrainer
from trl_es.arguments import TrlESParser
from trl_es.trainer.averaging.es_parallel_averaging_config import ESParallelAveragingConfig

SMALL_TABLE = 1 << 20
CONFIG_LOGGER = "trl_es.trainer.es.es_config"


def config(tmp_path, **kwargs):
    return ESConfig(output_dir=str(tmp_path / "out"), report_to=[], **kwargs)


def parse(tmp_path, argv):
    (args,) = TrlESParser((ESConfig,)).parse_args_and_config(["--output_dir", str(tmp_path / "out"),
                                                              "--report_to", "none"] + argv)
    return args


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def trainer_args(tmp_path, **kwargs):
    return config(tmp_path, population_size=2, prompt_batch_size=2, max_completion_length=4, max_steps=1,
                  noise_table_size=SMALL_TABLE, save_strategy="no", disable_tqdm=True, **kwargs)


def build_trainer(args, tokenizer):
    return ESTrainer(build_llama(tokenizer), zero_reward, args=args,
                     train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tokenizer)


def sampling_logs(caplog):
    return [r for r in caplog.records if r.name == CONFIG_LOGGER and "asks for sampling" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- 7: GRPO's sampling
@pytest.mark.parametrize("kwargs, asked", [
    (dict(num_generations=3), "num_generations=3"),  # TRL's own GRPO tests
    (dict(num_generations=8), "num_generations=8"),  # GRPO's default group
    (dict(top_k=5), "top_k=5"),
    (dict(min_p=0.1), "min_p=0.1"),
    (dict(num_generations_eval=2), "num_generations_eval=2"),
])
def test_unset_temperature_samples_at_grpos_default_when_the_config_asks_for_sampling(tmp_path, caplog, kwargs,
                                                                                      asked):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        args = config(tmp_path, **kwargs)
    assert args.temperature == 1.0 and type(args.temperature) is float
    (record,) = sampling_logs(caplog)  # logged once
    assert asked in record.getMessage() and "temperature=1.0" in record.getMessage()


@pytest.mark.parametrize("kwargs", [dict(), dict(num_generations=1), dict(num_generations=1, num_generations_eval=1),
                                    dict(repetition_penalty=1.2)])
def test_unset_temperature_stays_greedy_for_one_completion_per_prompt(tmp_path, caplog, kwargs):
    """ES's reference default, bit for bit: greedy decoding, 0.0 (a float), nothing logged."""
    with caplog.at_level(logging.INFO, logger=CONFIG_LOGGER):
        args = config(tmp_path, **kwargs)
    assert args.temperature == 0.0 and type(args.temperature) is float
    assert sampling_logs(caplog) == []


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=0.0, num_generations=3), "num_generations=3"),
    (dict(temperature=0, num_generations=2), "num_generations=2"),
    (dict(temperature=0.0, num_generations_eval=4), "num_generations_eval=4"),
])
def test_explicit_greedy_temperature_with_several_generations_is_refused_naming_temperature(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} with greedy decoding \(temperature=0\) would score .* identical "
                                         r"copies.*set temperature > 0"):
        config(tmp_path, **kwargs)


def test_explicit_temperatures_are_kept(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        assert config(tmp_path, num_generations=3, temperature=0.7).temperature == 0.7
        assert config(tmp_path, temperature=0.5).temperature == 0.5
    assert sampling_logs(caplog) == []
    # generation_kwargs that sample by themselves keep deciding the sampling, as before (no temperature of ours)
    args = config(tmp_path, num_generations=2, generation_kwargs={"do_sample": True, "temperature": 0.7})
    assert args.temperature == 0.0


def test_command_line_and_yaml_recipe_resolve_the_same_way(tmp_path):
    assert parse(tmp_path, ["--num_generations", "3"]).temperature == 1.0
    assert parse(tmp_path, ["--num_generations", "3", "--temperature", "0.6"]).temperature == 0.6
    assert parse(tmp_path, []).temperature == 0.0
    with pytest.raises(ValueError, match=r"^num_generations=3 with greedy decoding \(temperature=0\)"):
        parse(tmp_path, ["--num_generations", "3", "--temperature", "0"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("num_generations: 4\nmax_completion_length: 8\n")
    assert parse(tmp_path, ["--config", str(recipe)]).temperature == 1.0
    recipe.write_text("num_generations: 4\ntemperature: 0.0\n")
    with pytest.raises(ValueError, match=r"^num_generations=4 with greedy decoding"):
        parse(tmp_path, ["--config", str(recipe)])


def test_trainer_samples_when_a_grpo_config_sets_num_generations(tmp_path, tokenizer):
    sampled = build_trainer(trainer_args(tmp_path, num_generations=3), tokenizer).generation_config
    assert sampled.do_sample and sampled.temperature == 1.0
    greedy = build_trainer(trainer_args(tmp_path), tokenizer).generation_config
    assert not greedy.do_sample


# ---------------------------------------------------------------------------------------------- 12: one error
def test_several_refused_fields_are_reported_in_one_error(tmp_path):
    with pytest.raises(ValueError) as info:
        config(tmp_path, cast_lm_head_to_fp32=True, multi_objective_aggregation="normalize_then_sum",
               log_multimodal="yes")
    message = str(info.value)
    assert message.startswith("3 fields of this config are refused or invalid")
    for text in ("cast_lm_head_to_fp32=True ", "model_init_kwargs", "multi_objective_aggregation='normalize_then_sum' ",
                 "fitness_shaping", "log_multimodal='yes' "):
        assert text in message, text


def test_a_single_refused_field_keeps_its_own_message(tmp_path):
    with pytest.raises(ValueError) as info:
        config(tmp_path, cast_lm_head_to_fp32=True)
    message = str(info.value)
    assert message.startswith("cast_lm_head_to_fp32=True is not supported by ES yet") and "float32" in message
    assert "fields of this config" not in message
    with pytest.raises(ValueError, match=r"^multi_objective_aggregation='normalize_then_sum' is not supported by ES "
                                         r"yet.*fitness_shaping"):
        config(tmp_path, multi_objective_aggregation="normalize_then_sum")


def test_refused_and_invalid_fields_are_reported_together(tmp_path):
    with pytest.raises(ValueError) as info:
        config(tmp_path, cast_lm_head_to_fp32=True, per_device_train_batch_size=2, prompt_batch_size=3,
               population_size=1, fitness_shaping="bogus")
    message = str(info.value)
    assert message.startswith("4 fields of this config are refused or invalid")
    for text in ("cast_lm_head_to_fp32=True", "prompt_batch_size=3 contradicts GRPO's batch fields",
                 "population_size must be >= 2", "fitness_shaping must be one of"):
        assert text in message, text


def test_train_command_and_yaml_recipe_report_all_refused_fields(tmp_path):
    from trl_es.cli.train_command import train

    with pytest.raises(ValueError, match=r"^2 fields of this config.*\n  1\. cast_lm_head_to_fp32=True .*\n  2\. "
                                         r"multi_objective_aggregation='normalize_then_sum' "):
        train(["--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--cast_lm_head_to_fp32", "true",
               "--multi_objective_aggregation", "normalize_then_sum"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("cast_lm_head_to_fp32: true\nmulti_objective_aggregation: normalize_then_sum\n"
                      "temperature: 0.0\nnum_generations: 4\nbeta: 0.04\n")
    with pytest.raises(ValueError) as info:
        parse(tmp_path, ["--config", str(recipe)])
    message = str(info.value)
    assert message.startswith("3 fields of this config")
    for text in ("cast_lm_head_to_fp32=True", "multi_objective_aggregation='normalize_then_sum'",
                 "num_generations=4 with greedy decoding"):
        assert text in message, text
    assert "beta" not in message  # accepted (no effect on ES, warned about)
    assert not (tmp_path / "out").exists()  # refused before anything was written


# ---------------------------------------------------------------------------------------------- 13: set after parsing
@pytest.mark.parametrize("name, value, match", [
    ("transformers_continuous_batching_config", {"seed": 1}, r"^transformers_continuous_batching_config=.*remove 'seed'"),
    ("cast_lm_head_to_fp32", True, r"^cast_lm_head_to_fp32=True is not supported by ES yet"),
    ("fitness_shaping", "bogus", r"^fitness_shaping must be one of"),
    ("population_size", 0, r"^population_size must be >= 2, got 0"),
    ("prompt_batch_size", 0, r"^prompt_batch_size must be an integer >= 1, got 0"),
])
def test_a_field_set_after_construction_is_checked_when_the_trainer_is_built(tmp_path, tokenizer, name, value,
                                                                               match):
    args = trainer_args(tmp_path)
    setattr(args, name, value)  # as TRL's grpo_continuous_batching.py does after parse_args
    with pytest.raises(ValueError, match=match):
        build_trainer(args, tokenizer)


def test_fields_set_after_construction_are_reported_together(tmp_path):
    args = config(tmp_path)
    args.transformers_continuous_batching_config = {"seed": 1}
    args.sigma = -1.0
    with pytest.raises(ValueError, match=r"(?s)^2 fields .*sigma must be > 0.*transformers_continuous_batching_config=.*"
                                         r"remove 'seed'"):
        args.check_fields()


@pytest.mark.parametrize("kwargs", [
    dict(), dict(num_generations=3), dict(top_k=5, repetition_penalty=1.2), dict(shuffle_dataset=False),
    dict(trust_remote_code=True), dict(per_device_train_batch_size=8), dict(temperature=0.7, top_k=3,
                                                                             generation_kwargs={"top_k": 2}),
    dict(per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=16), dict(beta=0.1),
    dict(generation_batch_size=64, num_generations=8),
])
def test_checking_again_changes_nothing_on_a_built_config(tmp_path, kwargs):
    """check_fields (run by ESTrainer) re-does __post_init__'s derivations idempotently."""
    args = config(tmp_path, **kwargs)
    before = args.to_dict()
    args.check_fields()
    args.check_fields()
    assert args.to_dict() == before


def test_checking_again_follows_fields_set_after_construction(tmp_path, caplog):
    args = config(tmp_path)
    args.prompt_batch_size = 4  # the derived per_device_train_batch_size follows
    args.check_fields()
    assert args.per_device_train_batch_size == 4
    args.per_device_train_batch_size = 16  # GRPO's meaning: 16 prompts, against prompt_batch_size=4 set above
    with pytest.raises(ValueError, match=r"^prompt_batch_size=4 contradicts GRPO's batch fields, "
                                         r"per_device_train_batch_size=16 x 1 process"):
        args.check_fields()
    args = config(tmp_path)
    args.num_generations = 4  # temperature left unset: GRPO's sampling, as if set at construction
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        args.check_fields()
    assert args.temperature == 1.0 and len(sampling_logs(caplog)) == 1
    args = config(tmp_path, top_k=5)
    args.top_k = 7  # the merged generation_kwargs follow (the old value does not win)
    args.check_fields()
    assert args.generation_kwargs == {"top_k": 7}


def test_the_translation_keeps_what_was_given_in_one_record_out_of_to_dict(tmp_path):
    """grpo_translation is the config's one record of the GRPO translation: not a field (no flag), not in to_dict."""
    args = config(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=16, top_k=5)
    record = args.grpo_translation
    assert record.given == {"temperature": None, "generation_kwargs": None, "per_device_train_batch_size": 16,
                            "gradient_accumulation_steps": 4, "prompt_batch_size": None}
    assert record.derived == {"temperature": 1.0, "generation_kwargs": {"top_k": 5}, "per_device_train_batch_size": 4,
                              "gradient_accumulation_steps": 1, "prompt_batch_size": 4}
    assert record.mapping == ("per_device_train_batch_size=16 x 1 process x gradient_accumulation_steps=4 / "
                              "num_generations=16")
    assert "grpo_translation" not in {f.name for f in dataclasses.fields(ESConfig)}
    assert "grpo_translation" not in args.to_dict() and "--grpo_translation" not in TrlESParser((ESConfig,)).format_help()
    assert [name for name in vars(args) if name.startswith("_") and name not in ("_n_gpu", "_setup_devices")] == []
    assert config(tmp_path, temperature=0.7).grpo_translation.given["temperature"] == 0.7


@pytest.mark.parametrize("kwargs", [
    dict(per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=16),
    dict(num_generations=3, top_k=5, beta=0.1),
])
def test_a_pickled_config_checks_again_as_the_one_it_was_pickled_from(tmp_path, kwargs):
    """training_args.bin: the record travels with the config; one pickled without a record checks again too."""
    args = config(tmp_path, **kwargs)
    again = pickle.loads(pickle.dumps(args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what was said is not said again
        again.check_fields()
    assert again.to_dict() == args.to_dict() and again.grpo_translation == args.grpo_translation
    del again.grpo_translation  # as a config pickled before the record: its prompt_batch_size counts as given
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again.check_fields()
    assert (again.prompt_batch_size, again.per_device_train_batch_size, again.temperature, again.generation_kwargs) == (
        args.prompt_batch_size, args.per_device_train_batch_size, args.temperature, args.generation_kwargs)


def test_the_merged_generation_kwargs_follow_a_dict_edited_or_assigned_after_construction(tmp_path):
    args = config(tmp_path, temperature=1.0, top_k=5)
    args.generation_kwargs["max_time"] = 9.0  # edited in place: kept, the merged top_k still follows the field
    args.top_k = 7
    args.check_fields()
    assert args.generation_kwargs == {"top_k": 7, "max_time": 9.0}
    args.generation_kwargs = {"top_k": 2}  # assigned: the user's own key wins, as in GRPO
    args.check_fields()
    assert args.generation_kwargs == {"top_k": 2}
    args.generation_kwargs = None
    args.top_k = 0
    args.check_fields()
    assert args.generation_kwargs is None


@pytest.mark.parametrize("num_generations, resolved", [(4, 1.0), (1, 0.0)])
def test_a_temperature_unset_after_construction_is_resolved_again(tmp_path, num_generations, resolved):
    args = config(tmp_path, temperature=0.7, num_generations=num_generations)
    args.temperature = None
    args.check_fields()
    assert args.temperature == resolved
    args.temperature = 0.5  # explicit again: kept
    args.check_fields()
    assert args.temperature == 0.5


# ---------------------------------------------------------------------------------------------- 14: ES's meaning
@pytest.mark.parametrize("learning_rate", [2e-5, 5e-7])
def test_an_adamw_scale_learning_rate_is_warned_about_once(tmp_path, learning_rate):
    with pytest.warns(UserWarning) as record:
        config(tmp_path, learning_rate=learning_rate)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1
    assert messages[0].startswith(f"learning_rate={learning_rate} is ES's step size alpha") and "5e-4" in messages[0]


@pytest.mark.parametrize("name, value, counterpart", [
    ("weight_decay", 0.1, "awd_lambda"),
    ("adam_beta1", 0.8, "Adam moments"),
    ("adam_beta2", 0.99, "Adam moments"),
    ("max_grad_norm", 1.0, "not clipped"),  # GRPO's default; ESConfig's is 0.0
])
def test_torch_optimizer_settings_es_never_reads_are_warned_about(tmp_path, name, value, counterpart):
    with pytest.warns(UserWarning) as record:
        config(tmp_path, **{name: value})
    (message,) = [str(w.message) for w in record]
    assert message.startswith(f"{name}={value} has no effect with es_optimizer='es'") and counterpart in message


@pytest.mark.parametrize("kwargs", [
    dict(),  # ESConfig's defaults (max_grad_norm 0.0, learning_rate 5e-4)
    dict(learning_rate=5e-4, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=0.0),
    dict(learning_rate=1e-2),
    dict(es_optimizer="torch", learning_rate=2e-5, weight_decay=0.1, max_grad_norm=1.0),  # AdamW reads them
])
def test_es_values_and_torch_optimizer_settings_are_not_warned_about(tmp_path, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config(tmp_path, **kwargs)


def test_parallel_averaging_keeps_the_sft_optimizer_settings_silent(tmp_path):
    """ES + SFT parallel averaging: weight_decay and the Adam betas configure the SFT optimizer."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ESParallelAveragingConfig(output_dir=str(tmp_path / "out"), report_to=[], weight_decay=0.1, adam_beta2=0.99)
    with pytest.warns(UserWarning, match="^learning_rate=1e-05 is ES's step size alpha"):
        ESParallelAveragingConfig(output_dir=str(tmp_path / "out"), report_to=[], learning_rate=1e-5)


def test_num_completions_to_print_zero_prints_none(tmp_path, tokenizer, capsys, one_thread):
    """open-r1's default, GRPO's meaning: no completion printed (the parquet file is still written)."""
    from trl.trainer.utils import print_prompt_completions_sample

    print_prompt_completions_sample(["p"], ["c"], {"r": [1.0]}, [0.0], 1, 0)  # GRPO: 0 prints nothing
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match=r"^num_completions_to_print must be None \(print all\) or an integer >= 0"):
        config(tmp_path, num_completions_to_print=-1)
    args = trainer_args(tmp_path, log_completions=True, num_completions_to_print=0)
    trainer = build_trainer(args, tokenizer)
    trainer.train()
    assert "Step 1" not in capsys.readouterr().out
    assert (tmp_path / "out" / "completions" / "completions_00001.parquet").exists()


@pytest.mark.parametrize("world_size, prompts", [(1, 2), (4, 8)])
def test_per_device_train_batch_size_counts_grpos_completions(tmp_path, monkeypatch, world_size, prompts):
    """GRPO's per_device_train_batch_size=16 with num_generations=8: 16 completions per process, 2 prompts each."""
    monkeypatch.setattr(ESConfig, "world_size", property(lambda self: world_size))
    args = config(tmp_path, per_device_train_batch_size=16, num_generations=8)
    assert (args.prompt_batch_size, args.per_device_train_batch_size) == (prompts, 2)
