"""Every GRPOConfig field answered by ESConfig (trl_es/trainer/es/grpo_fields.py): honoured, mapped, ignored with a
warning, or refused; num_generations > 1 with an explicit greedy temperature refused."""

import dataclasses
import os
import sys

import pytest
from datasets import Dataset
from tiny import build_llama
from transformers import TrainingArguments
from trl import GRPOConfig

from trl_es import ESConfig, ESTrainer
from trl_es.arguments import TrlESParser
from trl_es.trainer.es.grpo_fields import GRPO_FIELDS, HONOURED, IGNORED, STATUSES, added_fields
from paths import TESTS

sys.path.insert(0, os.path.join(TESTS, os.pardir, "scripts"))
from grpo_fields_markdown import grpo_fields_markdown, native_shared_fields  # noqa: E402

DOCS_PAGE = os.path.join(TESTS, os.pardir, "docs", "grpo_fields.md")
TA_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}
ES_FIELDS = {f.name for f in dataclasses.fields(ESConfig)}
ES_OWN = set(ESConfig.__dict__["__annotations__"]) - {e.name for e in added_fields()}  # declared in es_config.py


def test_every_grpo_field_is_a_training_argument_an_es_field_or_answered_in_the_table():
    """A GRPOConfig field of the installed TRL that is in none of the three sets fails here (a new TRL field)."""
    answered = {entry.name for entry in GRPO_FIELDS}
    native = set(native_shared_fields())
    grpo = [f.name for f in dataclasses.fields(GRPOConfig)]
    unanswered = [name for name in grpo if name not in TA_FIELDS and name not in native and name not in answered]
    assert unanswered == [], f"GRPOConfig fields neither honoured nor refused in GRPO_FIELDS: {unanswered}"
    assert not native & answered
    assert sorted(answered - set(grpo)) == []  # no stale entries
    assert not answered & TA_FIELDS


def test_every_table_entry_is_an_es_config_field_and_honoured_ones_are_declared():
    for entry in GRPO_FIELDS:
        assert entry.name in ES_FIELDS, entry.name  # so ESConfig(name=...) and --name reach __post_init__
        assert entry.status in STATUSES
        assert entry.reason
        if entry.status == HONOURED:
            assert entry.name in ES_OWN, f"{entry.name} is honoured but not declared in es_config.py"
        else:
            field = next(f for f in dataclasses.fields(ESConfig) if f.name == entry.name)
            assert field.default is None and entry.reason in field.metadata["help"]
            assert f"\n        {entry.name} (`" in ESConfig.__doc__  # in the Parameters: of the class docstring


def test_docs_page_is_the_generated_table():
    with open(DOCS_PAGE, encoding="utf-8") as f:
        page = f.read()
    assert page == grpo_fields_markdown(), (
        "docs/grpo_fields.md is stale: python scripts/grpo_fields_markdown.py > docs/grpo_fields.md"
    )
    for entry in GRPO_FIELDS:
        assert f"| `{entry.name}`" in page
    assert "| `temperature` | `1.0` | `None`, resolved to `0.0` (greedy" in page
    assert "| `num_generations` | `8` | `1` |" in page


@pytest.mark.parametrize("name, value, counterpart", [
    ("cast_lm_head_to_fp32", True, "model_init_kwargs={'dtype': 'float32'}"),
    ("multi_objective_aggregation", "normalize_then_sum", "fitness_shaping"),
    ("log_multimodal", "yes", "ES has no counterpart"),
])
def test_refused_field_raises_value_error_naming_it_and_what_to_do(tmp_path, name, value, counterpart):
    with pytest.raises(ValueError) as info:
        ESConfig(output_dir=str(tmp_path), **{name: value})
    message = str(info.value)
    assert message.startswith(f"{name}={value!r} ") and counterpart in message
    assert "GRPOConfig setting with no meaning for ES" in message or "not supported by ES yet" in message


@pytest.mark.parametrize("name, value, counterpart", [
    ("beta", 0.04, "ES counterpart: awd_lambda"),
    ("loss_type", "grpo", "ES counterpart: es_optimizer"),
    ("scale_rewards", "batch", "ES counterpart: fitness_shaping"),
    ("epsilon", 0.2, "ES counterpart: sigma and learning_rate"),
    ("num_iterations", 2, "ES has no counterpart"),
    ("vllm_group_port", 51216, "no weight-update group"),
    ("disable_dropout", False, "eval mode"),
])
def test_ignored_field_is_kept_and_warned_about_with_its_counterpart(tmp_path, name, value, counterpart):
    with pytest.warns(UserWarning) as record:
        args = ESConfig(output_dir=str(tmp_path), **{name: value})
    (message,) = [str(w.message) for w in record if "no effect" in str(w.message)]
    assert message.startswith(f"{name}={value!r} has no effect on ES (accepted, not used): ") and counterpart in message
    assert getattr(args, name) == value
    assert next(e for e in GRPO_FIELDS if e.name == name).status == IGNORED


@pytest.mark.parametrize("argv, name", [
    (["--beta", "0.1"], "beta=0.1"),
    (["--loss_type", "dr_grpo"], "loss_type='dr_grpo'"),
    (["--scale_rewards", "none"], "scale_rewards='none'"),
    (["--epsilon", "0.3"], "epsilon=0.3"),
])
def test_ignored_field_on_the_command_line_gives_the_same_warning(tmp_path, argv, name):
    parser = TrlESParser((ESConfig,))
    with pytest.warns(UserWarning, match=f"^{name} has no effect on ES"):
        parser.parse_args_and_config(["--output_dir", str(tmp_path)] + argv)


@pytest.mark.parametrize("argv, name", [
    (["--cast_lm_head_to_fp32", "true"], "cast_lm_head_to_fp32=True"),
    (["--multi_objective_aggregation", "normalize_then_sum"], "multi_objective_aggregation='normalize_then_sum'"),
])
def test_refused_field_on_the_command_line_gives_the_same_error(tmp_path, argv, name):
    parser = TrlESParser((ESConfig,))
    with pytest.raises(ValueError, match=f"^{name} is not supported by ES yet"):
        parser.parse_args_and_config(["--output_dir", str(tmp_path)] + argv)
    from trl_es.cli.train_command import train

    with pytest.raises(ValueError, match=f"^{name} is not supported by ES yet"):
        train(["--output_dir", str(tmp_path), "--max_steps", "1"] + argv)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_values_under_which_grpo_does_what_es_does_are_accepted(tmp_path):
    """GRPO's 'off' values (no KL term, no entropy bonus, no completion logs, one pass) ask for nothing ES lacks."""
    args = ESConfig(output_dir=str(tmp_path), beta=0.0, num_iterations=1, entropy_coef=0.0,
                    multi_objective_aggregation="sum_then_normalize", disable_dropout=True)
    assert args.beta == 0.0
    with pytest.raises(ValueError, match=r"^multi_objective_aggregation='normalize_then_sum' is not supported by "
                                         r"ES yet.*fitness_shaping"):
        ESConfig(output_dir=str(tmp_path), multi_objective_aggregation="normalize_then_sum")
    # the refused fields left unset stay out of to_dict() (logs, trackers); a round trip gives the same config
    assert "beta" in args.to_dict() and "loss_type" not in args.to_dict()
    again = ESConfig(**{**args.to_dict(), "report_to": []})
    assert again.beta == 0.0 and again.loss_type is None


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_honoured_generation_fields_reach_the_trainers_generation_config(tmp_path, tokenizer):
    args = ESConfig(output_dir=str(tmp_path), temperature=1.0, top_k=7, min_p=0.05, repetition_penalty=1.3,
                    population_size=2, prompt_batch_size=2, max_completion_length=4, noise_table_size=1 << 20,
                    report_to=[], save_strategy="no", disable_tqdm=True)
    assert args.generation_kwargs == {"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.3}
    data = Dataset.from_dict({"prompt": ["a", "b"]})
    trainer = ESTrainer(build_llama(tokenizer), zero_reward, args=args, train_dataset=data, processing_class=tokenizer)
    config = trainer.generation_config
    assert (config.top_k, config.min_p, config.repetition_penalty, config.do_sample) == (7, 0.05, 1.3, True)
    # generation_kwargs win over the fields, as in GRPO; neutral values add nothing
    args = ESConfig(output_dir=str(tmp_path), temperature=1.0, top_k=7, generation_kwargs={"top_k": 3})
    assert args.generation_kwargs == {"top_k": 3}
    assert ESConfig(output_dir=str(tmp_path), top_k=0, repetition_penalty=1.0).generation_kwargs is None
    # repetition_penalty works with greedy decoding; the sampling filters are refused with an explicit greedy
    # temperature (unset, they sample at GRPO's 1.0: tests/trainer/test_grpo_config_parity.py)
    assert ESConfig(output_dir=str(tmp_path), repetition_penalty=1.2).generation_kwargs == {"repetition_penalty": 1.2}
    for name, value in (("top_k", 5), ("min_p", 0.1)):
        with pytest.raises(ValueError, match=f"^{name}={value} filters tokens when sampling.*temperature > 0"):
            ESConfig(output_dir=str(tmp_path), temperature=0.0, **{name: value})


def test_honoured_model_and_data_fields(tmp_path):
    args = ESConfig(output_dir=str(tmp_path), trust_remote_code=True, model_init_kwargs={"dtype": "float32"})
    assert args.model_init_kwargs == {"dtype": "float32", "trust_remote_code": True}
    with pytest.raises(ValueError, match="^trust_remote_code=True contradicts model_init_kwargs"):
        ESConfig(output_dir=str(tmp_path), trust_remote_code=True, model_init_kwargs={"trust_remote_code": False})
    assert ESConfig(output_dir=str(tmp_path), shuffle_dataset=False).train_sampling_strategy == "sequential"
    assert ESConfig(output_dir=str(tmp_path), shuffle_dataset=True).train_sampling_strategy == "random"
    assert ESConfig(output_dir=str(tmp_path)).train_sampling_strategy == "random"
    with pytest.raises(ValueError, match="^shuffle_dataset=True contradicts train_sampling_strategy='sequential'"):
        ESConfig(output_dir=str(tmp_path), shuffle_dataset=True, train_sampling_strategy="sequential")
    parser = TrlESParser((ESConfig,))
    (args,) = parser.parse_args_and_config(["--output_dir", str(tmp_path), "--shuffle_dataset", "false",
                                            "--top_k", "4", "--temperature", "1", "--trust_remote_code", "true"])
    assert (args.train_sampling_strategy, args.generation_kwargs, args.model_init_kwargs) == \
        ("sequential", {"top_k": 4}, {"trust_remote_code": True})


def test_num_generations_above_one_with_greedy_decoding_is_refused_by_name(tmp_path):
    """An explicit temperature=0 (left unset, num_generations > 1 samples at GRPO's 1.0: test_grpo_config_parity)."""
    with pytest.raises(ValueError, match=r"^num_generations=8 with greedy decoding \(temperature=0\) would score 8 "
                                         r"identical copies.*set temperature > 0 \(e.g. 1.0, GRPO's default.*\).*"
                                         r"or num_generations=1"):
        ESConfig(output_dir=str(tmp_path), num_generations=8, temperature=0.0)
    assert ESConfig(output_dir=str(tmp_path), num_generations=8, temperature=1.0).num_generations == 8
    assert ESConfig(output_dir=str(tmp_path), num_generations=1).temperature == 0.0  # the ES reference's default
    # sampling switched on through generation_kwargs counts as sampling
    ESConfig(output_dir=str(tmp_path), num_generations=2, generation_kwargs={"do_sample": True, "temperature": 0.7})
    with pytest.raises(ValueError, match="^num_generations=2 with greedy decoding"):
        TrlESParser((ESConfig,)).parse_args_and_config(["--output_dir", str(tmp_path), "--num_generations", "2",
                                                        "--temperature", "0"])


def test_trust_remote_code_reaches_the_tokenizer_and_reward_model_loads(tmp_path, tiny_model_dir, monkeypatch):
    """trust_remote_code=True goes to every load a GRPO user's run makes: the policy, its tokenizer, and a reward
    model given by path with its tokenizer (GRPOTrainer passes it to all of them)."""
    import transformers
    from datasets import Dataset
    from transformers import LlamaForSequenceClassification

    from trl_es import ESConfig, ESTrainer

    reward_dir = tmp_path / "reward"
    LlamaForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(reward_dir)
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(reward_dir)
    seen = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer,
                transformers.AutoModelForSequenceClassification):
        original = cls.from_pretrained.__func__

        def recording(klass, path, *args, _original=original, **kwargs):
            seen.append((klass.__name__, kwargs.get("trust_remote_code")))
            return _original(klass, path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(recording))
    args = ESConfig(output_dir=str(tmp_path / "out"), trust_remote_code=True, max_steps=1, population_size=2,
                    prompt_batch_size=2, max_completion_length=2, noise_table_size=1 << 20, report_to=[])
    ESTrainer(tiny_model_dir, str(reward_dir), args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}))
    assert sorted(set(seen)) == [("AutoModelForCausalLM", True), ("AutoModelForSequenceClassification", True),
                                 ("AutoTokenizer", True)]
