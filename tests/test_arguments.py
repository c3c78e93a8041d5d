"""Dict-valued options: every dict-typed field of the configs and CLI argument dataclasses accepts JSON on the
command line (as TrlParser parses it for trl-es and the example scripts), and malformed JSON names the flag."""

import dataclasses
import typing

import pytest
from example_script import example_script
from trl import ModelConfig, TrlParser

from trl_es import ESConfig
from trl_es.arguments import TrlESParser, dict_valued_fields, parse_json_dict
from trl_es.cli import AnalyzeArguments, EvalArguments, TaskArguments
from trl_es.trainer.hyper_es.hyper_es_config import HyperESConfig


@pytest.fixture(scope="module")
def hyper_es_script():
    with example_script("scripts/hyper_es.py", "hyper_es_script_args") as module:
        yield module


def _commands(hyper_es_script):
    """The dataclass groups each command line parses: trl-es train / eval / analyze, examples/scripts/hyper_es.py."""
    return [
        (TaskArguments, ESConfig, ModelConfig),
        (TaskArguments, EvalArguments, ModelConfig),
        (AnalyzeArguments, TaskArguments),
        (hyper_es_script.HyperESScriptArguments, HyperESConfig),
    ]


def _is_dict_hint(hint) -> bool:
    # Independent of the implementation: a dict anywhere at the top of the annotation.
    return hint is dict or typing.get_origin(hint) is dict or any(
        a is dict or typing.get_origin(a) is dict for a in typing.get_args(hint)
    )


def _base_args(dataclass_types, tmp_path):
    return ["--output_dir", str(tmp_path)] if any(hasattr(t, "output_dir") for t in dataclass_types) else []


def test_dict_fields_are_found_from_the_type_hints():
    for cls in (ESConfig, HyperESConfig, EvalArguments, TaskArguments, ModelConfig):
        hints = typing.get_type_hints(cls)
        expected = [f.name for f in dataclasses.fields(cls) if _is_dict_hint(hints[f.name])]
        assert list(dict_valued_fields(cls)) == expected, cls.__name__
    assert {"generation_kwargs", "chat_template_kwargs", "model_init_kwargs", "lr_scheduler_kwargs"} <= set(
        dict_valued_fields(ESConfig))
    assert {"cma_options", "generation_kwargs"} <= set(dict_valued_fields(HyperESConfig))
    assert set(dict_valued_fields(EvalArguments)) == {"generation_kwargs", "chat_template_kwargs"}
    # transformers' _VALID_DICT_FIELDS mechanism covers every dict-typed field of the configs.
    assert set(dict_valued_fields(ESConfig)) <= set(ESConfig._VALID_DICT_FIELDS)
    assert set(dict_valued_fields(HyperESConfig)) <= set(HyperESConfig._VALID_DICT_FIELDS)


def test_every_dict_field_accepts_json_on_the_command_line(tmp_path, hyper_es_script):
    checked = set()
    for dataclass_types in _commands(hyper_es_script):
        for cls in dataclass_types:
            for name in dict_valued_fields(cls):
                if name in ("deepspeed", "accelerator_config"):
                    continue  # transformers/accelerate validate their content on construction (malformed JSON: below)
                value = {"a": 1, "nested": {"b": [1, 2]}, "flag": True, "name": "x"}
                if name == "transformers_continuous_batching_config":  # checked against ContinuousBatchingConfig
                    value = {"max_batch_tokens": 64, "scheduler_type": "fifo", "allow_block_sharing": False}
                parser = TrlESParser(dataclass_types)
                argv = [*_base_args(dataclass_types, tmp_path), f"--{name}", _json(value)]
                parsed = parser.parse_args_into_dataclasses(argv)
                target = next(obj for obj in parsed if type(obj) is cls)
                assert getattr(target, name) == value, (cls.__name__, name)
                checked.add((cls.__name__, name))
    assert {("ESConfig", "generation_kwargs"), ("ESConfig", "chat_template_kwargs"),
            ("ESConfig", "model_init_kwargs"), ("ESConfig", "lr_scheduler_kwargs"), ("HyperESConfig", "cma_options"),
            ("HyperESConfig", "generation_kwargs"), ("EvalArguments", "generation_kwargs"),
            ("EvalArguments", "chat_template_kwargs")} <= checked


def _json(value) -> str:
    import json

    return json.dumps(value)


def test_generation_kwargs_from_the_issue(tmp_path):
    argv = ["--output_dir", str(tmp_path), "--generation_kwargs", '{"repetition_penalty": 1.1}']
    _, es_args, _ = TrlESParser((TaskArguments, ESConfig, ModelConfig)).parse_args_into_dataclasses(argv)
    assert es_args.generation_kwargs == {"repetition_penalty": 1.1}
    # Plain TrlParser (as a user script would use it) decodes it too: ESConfig._VALID_DICT_FIELDS lists it.
    (config,) = TrlParser((ESConfig,)).parse_args_into_dataclasses(argv)
    assert config.generation_kwargs == {"repetition_penalty": 1.1}
    (config,) = TrlParser((HyperESConfig,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--cma_options", '{"CMA_diagonal": true}'])
    assert config.cma_options == {"CMA_diagonal": True}
    # A YAML mapping works as before, and so does a JSON string in YAML.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("generation_kwargs: {repetition_penalty: 1.2}\nchat_template_kwargs: '{\"a\": 2}'\n")
    _, es_args, _ = TrlESParser((TaskArguments, ESConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(recipe), "--output_dir", str(tmp_path)])
    assert es_args.generation_kwargs == {"repetition_penalty": 1.2} and es_args.chat_template_kwargs == {"a": 2}


@pytest.mark.parametrize("bad", ['{"repetition_penalty": 1.1', "{repetition_penalty: 1.1}", "[1, 2]",
                                 "repetition_penalty=1.1"])
def test_malformed_json_names_the_flag(tmp_path, bad):
    parser = TrlESParser((TaskArguments, ESConfig, ModelConfig), prog="trl-es train")
    with pytest.raises(ValueError, match=r"argument --generation_kwargs.*must be a JSON object"):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--generation_kwargs", bad])


def test_every_dict_field_names_its_flag_on_malformed_json(tmp_path, hyper_es_script):
    for dataclass_types in _commands(hyper_es_script):
        for cls in dataclass_types:
            for name in dict_valued_fields(cls):
                argv = [*_base_args(dataclass_types, tmp_path), f"--{name}", "{oops"]
                with pytest.raises(ValueError, match=f"argument --{name}"):
                    TrlESParser(dataclass_types).parse_args_into_dataclasses(argv)


def test_other_bad_values_raise_value_errors_naming_the_flag(tmp_path):
    parser = TrlESParser((TaskArguments, EvalArguments, ModelConfig), prog="trl-es eval")
    with pytest.raises(ValueError, match=r"argument --task: invalid choice: 'chess' \(choose from"):
        parser.parse_args_into_dataclasses(["--task", "chess"])
    with pytest.raises(ValueError, match=r"argument --num_samples/--num-samples: invalid int value: 'many'"):
        parser.parse_args_into_dataclasses(["--num_samples", "many"])
    # Path-or-dict fields of transformers still take a file path.
    (config,) = TrlESParser((ESConfig,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--lr_scheduler_kwargs", '{"num_decay_steps": 8}'])
    assert config.lr_scheduler_kwargs == {"num_decay_steps": 8}


def test_parse_json_dict_and_python_construction():
    assert parse_json_dict('{"a": 1}', "--x") == {"a": 1} and parse_json_dict({"a": 1}, "--x") == {"a": 1}
    assert parse_json_dict(None, "--x") is None
    assert parse_json_dict("ds.json", "--x", allow_plain_string=True) == "ds.json"
    with pytest.raises(ValueError, match="--x must be a JSON object"):
        parse_json_dict("ds.json", "--x")
    # Dataclasses built in Python decode JSON strings too (ESConfig through _VALID_DICT_FIELDS, EvalArguments itself).
    assert EvalArguments(generation_kwargs='{"top_k": 5}').generation_kwargs == {"top_k": 5}
    with pytest.raises(ValueError, match="--chat_template_kwargs must be a JSON object"):
        EvalArguments(chat_template_kwargs="{bad")


# ----------------------------------------------------------------------------- non-finite hyper-parameters


def _float_fields(cls) -> list[str]:
    """Every field of a config dataclass whose type admits a float (``float``, ``float | None``, ``list[float]``...)."""
    import dataclasses
    import typing

    def admits_float(tp) -> bool:
        if tp is float:
            return True
        return any(admits_float(arg) for arg in typing.get_args(tp))

    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if f.init and admits_float(hints.get(f.name))]


def _configs():
    from trl_es import ESConfig, ESParallelAveragingConfig, HyperESConfig, ParallelAveragingConfig

    cpu = {"bf16": False, "use_cpu": True}  # GRPOConfig's bf16 default needs a GPU
    return [(ESConfig, {}), (HyperESConfig, {}), (ESParallelAveragingConfig, {}), (ParallelAveragingConfig, cpu)]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_every_float_field_of_every_config_rejects_non_finite_values(tmp_path, bad):
    import typing

    checked = 0
    for cls, extra in _configs():
        names = _float_fields(cls)
        assert {"learning_rate", "weight_decay", "max_grad_norm", "warmup_steps"} & set(names)  # inherited ones too
        hints = typing.get_type_hints(cls)
        for name in names:
            is_list = typing.get_origin(hints[name]) is list or any(
                typing.get_origin(a) is list for a in typing.get_args(hints[name]))
            value = [1.0, bad] if is_list and float not in typing.get_args(hints[name]) + (hints[name],) else bad
            with pytest.raises(ValueError, match=rf"^{name}(\[1\])? must be a finite number") as error:
                cls(output_dir=str(tmp_path), **extra, **{name: value})
            assert "NaN or +-inf" in str(error.value)
            checked += 1
    assert checked >= 4 * 10


def test_list_of_floats_is_checked_element_by_element(tmp_path):
    from trl_es import ESConfig, HyperESConfig

    with pytest.raises(ValueError, match=r"^reward_weights\[1\] must be a finite number .* got nan"):
        ESConfig(output_dir=str(tmp_path), reward_weights=[1.0, float("nan")])
    with pytest.raises(ValueError, match=r"^density_bounds\[0\] must be a finite number .* got -inf"):
        HyperESConfig(output_dir=str(tmp_path), density_bounds=[float("-inf"), 1.0])
    args = ESConfig(output_dir=str(tmp_path), reward_weights=[1.0, 0.5], learning_rate=1e-2, sigma=5e-3)
    assert args.reward_weights == [1.0, 0.5] and args.learning_rate == 1e-2  # finite values pass untouched


def test_non_finite_flag_on_the_command_line_names_the_field(tmp_path):
    from trl_es.cli import evaluate, train

    with pytest.raises(ValueError, match="^learning_rate must be a finite number"):
        train(["--output_dir", str(tmp_path), "--learning_rate", "inf", "--max_steps", "1"])
    with pytest.raises(ValueError, match="^time_budget_minutes must be a finite number"):
        train(["--output_dir", str(tmp_path), "--time_budget_minutes", "nan", "--max_steps", "1"])
    with pytest.raises(ValueError, match="^sample_temperature must be a finite number"):
        evaluate(["--model_name_or_path", str(tmp_path), "--sample_temperature", "inf"])
    assert not any(tmp_path.iterdir())  # nothing written


def test_configs_print_no_deprecation_warning(tmp_path):
    """ESConfig used to re-declare the deprecated gradient_checkpointing (transformers 5: activation_checkpointing)."""
    import warnings

    for cls, extra in _configs():
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            args = cls(output_dir=str(tmp_path), **extra)
        expected = cls.__name__ == "ParallelAveragingConfig"  # GRPO's default (on) for the backward passes
        assert args.activation_checkpointing is expected and args.gradient_checkpointing is expected, cls.__name__


@pytest.mark.parametrize("module, cls_name", [("trl_es.trainer.es.es_config", "ESConfig"),
                                               ("trl_es.trainer.hyper_es.hyper_es_config", "HyperESConfig")])
def test_config_docstring_lists_every_own_field_in_grouped_parameters(module, cls_name):
    """TRL's convention: a ``Parameters:`` block with ``> ...`` groups naming every field the config declares."""
    import ast
    import importlib
    import inspect

    cls = getattr(importlib.import_module(module), cls_name)
    tree = ast.parse(inspect.getsource(cls))
    own = [node.target.id for node in tree.body[0].body
           if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not node.target.id.startswith("_")]
    doc = cls.__doc__
    assert "    Parameters:\n" in doc and doc.count("        > Parameters that ") >= 3
    missing = [name for name in own if f"\n        {name} (`" not in doc]
    assert own and missing == []
