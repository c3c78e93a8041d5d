"""Each config field written once: its help is its docstring entry (trl_es.arguments.document_parameters), and an enum
field is a ``Literal`` whose one check (literal_field_errors) names the field and its choices on every path: keyword
argument, command-line flag (argparse's "invalid choice"), YAML recipe, field set after construction."""

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field

import pytest
from trl import ModelConfig

from trl_es import ESConfig, ESParallelAveragingConfig, HyperESConfig, ParallelAveragingConfig
from trl_es.arguments import TrlESParser, document_parameters, literal_choices, literal_field_errors
from trl_es.cli.arguments import TaskArguments
from trl_es.trainer.averaging.sft_averaging import SFTAveragingFields
from paths import REPO

ROOT = REPO
CONFIGS = [ESConfig, HyperESConfig, ParallelAveragingConfig, ESParallelAveragingConfig]
SFT_FIELDS = [f.name for f in dataclasses.fields(SFTAveragingFields)]
#: The fields each config documents: those its body declares (refused GRPOConfig fields included), and for the
#: parallel-averaging configs the update weights and the sft_* fields of their bases.
DOCUMENTED = {
    ESConfig: list(ESConfig.__dict__["__annotations__"]),
    HyperESConfig: list(HyperESConfig.__dict__["__annotations__"]),
    ParallelAveragingConfig: ["rl_weight", *SFT_FIELDS, "activation_checkpointing", "gradient_checkpointing"],
    ESParallelAveragingConfig: ["es_weight", *SFT_FIELDS],
}
ENTRY = re.compile(r"^        (\w+) \((.*)\):$")


def parameters(doc: str) -> dict[str, dict[str, tuple[str, str]]]:
    """The ``Parameters:`` of a docstring: group heading -> {field: (type text, description)}."""
    groups, group, name = {}, None, None
    section = doc[doc.index("\n    Parameters:\n"):]
    for line in section.splitlines()[2:]:
        if line.startswith("        > "):
            group, name = line[len("        > "):], None
            groups[group] = {}
        elif (match := ENTRY.match(line)) and group is not None:
            name = match.group(1)
            groups[group][name] = (match.group(2), "")
        elif line.startswith(" " * 12) and name is not None:
            kind, text = groups[group][name]
            groups[group][name] = (kind, (text + " " + line.strip()).strip())
    return groups


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_a_help(cls):
    empty = [f.name for f in dataclasses.fields(cls) if not str(f.metadata.get("help", "")).strip()]
    assert empty == []


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_the_docstring_lists_every_field_under_a_group_with_its_help_and_default(cls):
    groups = parameters(cls.__doc__)
    listed = [name for entries in groups.values() for name in entries]
    assert len(listed) == len(set(listed))  # each field once
    assert sorted(listed) == sorted(DOCUMENTED[cls])  # every documented field, under a group
    assert all(heading.startswith("Parameters ") for heading in groups)  # TRL's "> Parameters that ..." lines
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for entries in groups.values():
        for name, (kind, text) in entries.items():
            assert text == words(fields[name].metadata["help"]), name  # the help, word for word
            default = fields[name].default
            if default is dataclasses.MISSING:
                default = fields[name].default_factory()
            assert kind.endswith(f"*optional*, defaults to `{default!r}`"), name


def test_the_drifted_texts_are_the_ones_the_code_does():
    """The help of the fields whose docstring entry and help said different things keeps what the code does."""
    help_of = {f.name: f.metadata["help"] for f in dataclasses.fields(ESConfig)}
    assert "evaluate() scores every completion" in help_of["mask_truncated_completions"]
    assert "rewards/<name>/* metrics still count every completion" in help_of["mask_truncated_completions"]
    assert "advantage" in help_of["log_completions"] and "report_to" in help_of["log_completions"]
    assert "which ES does not run on" in help_of["pad_to_multiple_of"]
    hyper = {f.name: f.metadata["help"] for f in dataclasses.fields(HyperESConfig)}
    assert "the CMA-ES mean and the start" in hyper["rescore_top_k"]  # the finalists include the search's start


def test_document_parameters_refuses_a_field_left_out_or_without_help():
    @dataclass
    class Two:
        a: int = field(default=1, metadata={"help": "The a."})
        b: int = field(default=2, metadata={"help": ""})

    with pytest.raises(TypeError, match=r"in no group: \['b'\]"):
        document_parameters(groups={"Parameters that control a": ("a",)})(Two)
    with pytest.raises(TypeError, match=r"without a help: \['b'\].*") as info:
        document_parameters(groups={"Parameters that control a": ("a", "b")})(Two)
    with pytest.raises(TypeError, match=r"not fields: \['c'\]"):
        document_parameters(groups={"Parameters that control a": ("a", "b", "c")})(Two)
    assert "Two" in str(info.value)


def test_the_literal_fields_are_the_cores_choices():
    """A Literal lists the values the core accepts, in the core's order (the order of the error messages)."""
    from trl_es.es.anchor import ANCHOR_STORAGES
    from trl_es.es.fitness import FITNESS_SHAPINGS, PER_PROMPT_SHAPINGS
    from trl_es.es.noise import NOISE_SOURCES
    from trl_es.es.perturbation import AWD_PENALTIES
    from trl_es.es.strategy import POPULATION_BACKENDS
    from trl_es.generation import GENERATION_ENGINES
    from trl_es.merging.dare_ties import MAJORITY_SIGN_METHODS, SIGN_ELECTIONS
    from trl_es.merging.genome import GRANULARITIES

    assert literal_choices(ESConfig) == {
        "fitness_shaping": FITNESS_SHAPINGS, "per_prompt_shaping": PER_PROMPT_SHAPINGS, "es_optimizer": ("es", "torch"),
        "noise_source": NOISE_SOURCES, "population_backend": tuple(POPULATION_BACKENDS),
        "vllm_mode": ("colocate", "server"), "vllm_model_impl": ("vllm",),
        "anchor_storage": ANCHOR_STORAGES, "awd_penalty": AWD_PENALTIES,
    }
    from trl_es.generation import ENGINES  # generation_engine: "auto" or any registered engine, checked on ENGINES

    assert ("auto", *ENGINES) == GENERATION_ENGINES and ESConfig.__dataclass_fields__["generation_engine"].type in ("str", str)
    assert literal_choices(HyperESConfig) == {
        "final_genome": ("rescored", "best", "mean", "validation"), "genome_granularity": GRANULARITIES,
        "sign_election": SIGN_ELECTIONS, "majority_sign_method": MAJORITY_SIGN_METHODS,
    }


LITERALS = [(cls, name, choices) for cls in (ESConfig, HyperESConfig) for name, choices in literal_choices(cls).items()]
LITERAL_IDS = [f"{cls.__name__}.{name}" for cls, name, _ in LITERALS]


@pytest.mark.parametrize("cls, name, choices", LITERALS, ids=LITERAL_IDS)
def test_a_literal_field_refuses_a_bad_value_naming_the_field_and_its_choices(tmp_path, cls, name, choices):
    with pytest.raises(ValueError) as info:
        cls(output_dir=str(tmp_path), report_to=[], **{name: "bogus"})
    assert f"{name} must be one of {choices}, got 'bogus'." in str(info.value)
    assert literal_field_errors(cls(output_dir=str(tmp_path), report_to=[])) == []  # the defaults are choices


@pytest.mark.parametrize("cls, name, choices", LITERALS, ids=LITERAL_IDS)
def test_a_bad_flag_is_argparses_invalid_choice_and_a_bad_yaml_value_the_same_error(tmp_path, cls, name, choices):
    parser = TrlESParser((cls,))
    with pytest.raises(ValueError, match=rf"argument --{name}.*invalid choice: 'bogus'") as info:
        parser.parse_args_and_config(["--output_dir", str(tmp_path), f"--{name}", "bogus"])
    assert all(repr(choice) in str(info.value) for choice in choices)  # argparse lists the choices
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"{name}: bogus\nreport_to: []\n")
    with pytest.raises(ValueError, match=re.escape(f"{name} must be one of {choices}, got 'bogus'.")):
        parser.parse_args_and_config(["--output_dir", str(tmp_path), "--config", str(recipe)])


def test_a_literal_field_set_after_construction_is_checked_again(tmp_path):
    args = ESConfig(output_dir=str(tmp_path), report_to=[])
    args.awd_penalty = "l3"
    with pytest.raises(ValueError, match=r"^awd_penalty must be one of \('l2', 'l1'\), got 'l3'\.$"):
        args.check_fields()
    assert literal_field_errors(args, skip=("awd_penalty",)) == []


def test_several_bad_literal_values_are_reported_in_one_error(tmp_path):
    with pytest.raises(ValueError) as info:
        ESConfig(output_dir=str(tmp_path), report_to=[], fitness_shaping="softmax", noise_source="uniform")
    message = str(info.value)
    assert message.startswith("2 fields of this config are refused or invalid")
    assert "fitness_shaping must be one of" in message and "noise_source must be one of" in message


def test_the_train_commands_help_shows_the_choices():
    help_text = TrlESParser((TaskArguments, ESConfig, ModelConfig), prog="trl-es train").format_help()
    for cls in (TaskArguments, ESConfig):
        for name, choices in literal_choices(cls).items():
            assert f"--{name} {{{','.join(choices)}}}" in help_text, name
    hyper_help = TrlESParser((HyperESConfig,)).format_help()
    for name, choices in literal_choices(HyperESConfig).items():
        assert f"--{name} {{{','.join(choices)}}}" in hyper_help, name


def test_trl_es_train_help_on_the_command_line_shows_the_choices(warm_python):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = warm_python.run(["-m", "trl_es.cli", "train", "--help"], timeout=300, env=env, cwd=ROOT)  # `python -m`
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--fitness_shaping {zscore,centered_rank,none}" in proc.stdout
    assert "--task {countdown,arithmetic,gsm}" in proc.stdout


def test_literal_choices_reads_optional_literals():
    @dataclass
    class Choice:
        mode: typing.Literal["a", "b"] | None = None
        other: str = "x"

    assert literal_choices(Choice) == {"mode": ("a", "b", None)}
    assert literal_field_errors(Choice(mode="c")) == ["mode must be one of ('a', 'b', None), got 'c'."]
    assert literal_field_errors(Choice()) == []
