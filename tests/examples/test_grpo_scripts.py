"""examples/grpo_scripts/: public GRPO training scripts run on ESTrainer with only the names swapped (issue 63).

Per script: its text is the verbatim source (tests/data/grpo_scripts/<script>.py.txt) with the swaps of
:mod:`grpo_scripts_swaps` (names only) and its TRL 1.16 ports applied; and it runs, as a subprocess, with its
documented command scaled down (``--max_steps 1 --population_size 2 --max_completion_length 8 --report_to none``;
a script without a command line gets the same values forced into ``ESConfig`` by a ``sitecustomize`` module, which
also moves a GPU-only script body to the CPU: ``use_cpu=True`` forced too (its ``bf16=True`` is then bf16 autocast on
the CPU), ``attn_implementation="flash_attention_2"`` -> ``"eager"`` and ``.to("cuda")`` -> ``.to("cpu")``),
offline against a fake Hugging Face cache (:mod:`hub_cache`) holding a tiny model under each hub model id and a few
rows in each hub dataset's format. A run must exit 0, print the train summary and leave the model (or adapter), a
seed log of one step and the model card in its output_dir. The scripts with a command line run as children of one
warm interpreter (:mod:`warm_python`: the libraries imported once); the two with forced values, as fresh ones.

open-r1's ``grpo.py`` imports its ``open_r1`` package and reads a recipe (``--config``): both are vendored beside it
(:data:`grpo_scripts_swaps.VENDORED`), each file checked against its upstream git blob id (its verbatim text for the
few with swaps or ports). Its command line passes the recipe and overrides what only a GPU runs (bf16, vLLM, flash
attention, Liger kernels) and what needs the Hub (push_to_hub); the recipe's GRPO fields reach ESConfig as written.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import trl
from grpo_scripts_swaps import PORTS, SWAPS, VENDORED, VENDORED_PORTS, VENDORED_SWAPS
from hub_cache import add_dataset, add_model, offline_env
from paths import REPO, TESTS
from warm_python import WarmPython


ROOT = Path(REPO)
SCRIPTS_DIR = ROOT / "examples" / "grpo_scripts"
SOURCES_DIR = Path(TESTS) / "data" / "grpo_scripts"
SHORT = ["--max_steps", "1", "--population_size", "2", "--max_completion_length", "8", "--report_to", "none"]
FORCED = {"max_steps": 1, "population_size": 2, "max_completion_length": 8, "report_to": "none"}
FORCED_ENV = "TRL_ES_TEST_ESCONFIG_FORCED"
CPU_ENV = "TRL_ES_TEST_CPU_SHIM"
OPEN_R1_RECIPE = SCRIPTS_DIR / "recipes" / "DeepSeek-R1-Distill-Qwen-1.5B" / "grpo" / "config_demo.yaml"

@dataclasses.dataclass(frozen=True)
class Script:
    args: tuple[str, ...]  # the documented command's arguments, scaled down (SHORT last: its values win)
    output_dir: str  # where the run leaves the model
    forced: bool = False  # no command line: FORCED goes into ESConfig through sitecustomize
    saves_model: bool = True  # the script calls save_model(output_dir) after train()
    cpu: bool = False  # a GPU-only body (bf16, flash_attention_2, .to("cuda")): sitecustomize moves it to the CPU


SCRIPTS = {
    # TRL docs (clis.md, "GRPO"): trl grpo --model_name_or_path Qwen/Qwen2.5-0.5B
    #   --dataset_name HuggingFaceH4/Polaris-Dataset-53K --reward_funcs accuracy_reward
    "trl_grpo": Script(("--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--dataset_name",
                        "HuggingFaceH4/Polaris-Dataset-53K", "--reward_funcs", "accuracy_reward",
                        "--output_dir", "Qwen2.5-0.5B-GRPO", *SHORT), "Qwen2.5-0.5B-GRPO"),
    # gspo.py's docstring command (accelerate launch ... on one process)
    "gspo": Script(("--model_name_or_path", "Qwen/Qwen3-0.6B", "--output_dir", "gspo-Qwen3-0.6B",
                    "--learning_rate", "1e-5", "--dtype", "bfloat16", "--max_completion_length", "1024",
                    "--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--log_completions",
                    "--per_device_train_batch_size", "8", "--num_generations", "8",
                    "--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4",
                    "--beta", "0.0", "--loss_type", "grpo", "--gradient_accumulation_steps", "2",
                    "--steps_per_generation", "8", *SHORT), "gspo-Qwen3-0.6B"),
    # grpo_continuous_batching.py's docstring command (python ...)
    "grpo_continuous_batching": Script(("--model_name_or_path", "Qwen/Qwen3-1.7B", "--output_dir",
                                        "grpo-gsm8k-continuous-batching", "--num_generations", "32",
                                        "--max_completion_length", "1024", "--use_peft", "--log_completions",
                                        *SHORT), "grpo-gsm8k-continuous-batching"),
    # grpo_2048.py: no command line (python grpo_2048.py); GRPOConfig's default output_dir
    "grpo_2048": Script((), "trainer_output", forced=True, saves_model=False),
    # willccbb's GSM8K gist (python grpo_demo.py): no command line; flash attention and .to("cuda") in its body
    "grpo_demo": Script((), "outputs/Qwen-1.5B-GRPO", forced=True, saves_model=False, cpu=True),
    # open-r1's README: accelerate launch ... src/open_r1/grpo.py --config <demo recipe> --vllm_mode colocate; on a CPU,
    # less what needs a GPU or the Hub
    "open_r1_grpo": Script(("--config", str(OPEN_R1_RECIPE), "--vllm_mode", "colocate", "--bf16", "false",
                            "--use_vllm", "false", "--attn_implementation", "eager", "--use_liger_kernel", "false",
                            "--push_to_hub", "false", *SHORT), "data/DeepSeek-R1-Distill-Qwen-1.5B-GRPO"),
    # philschmid's recipe grpo-qwen-2.5-3b-deepseek-r1-countdown.yaml as flags, the fields TRL 1.16 on a CPU has
    "countdown_r1_grpo": Script(("--model_name_or_path", "Qwen/Qwen2.5-1.5B-Instruct", "--output_dir",
                                 "runs/qwen-r1-aha-moment", "--dataset_id_or_path", "Jiayi-Pan/Countdown-Tasks-3to4",
                                 "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "8",
                                 "--learning_rate", "1.0e-5", "--lr_scheduler_type", "cosine", "--beta", "0.04",
                                 "--max_completion_length", "768", "--num_generations", "8", "--logging_steps", "2",
                                 "--save_strategy", "steps", "--save_steps", "25", "--seed", "42", *SHORT),
                                "runs/qwen-r1-aha-moment"),
}
XFAIL = {
}

TOOL_TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
HUB_MODELS = {"Qwen/Qwen2.5-0.5B": None, "Qwen/Qwen3-0.6B": None, "Qwen/Qwen3-1.7B": None,
              "Qwen/Qwen3-4B": TOOL_TEMPLATE, "Qwen/Qwen2.5-1.5B-Instruct": None,
              "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": None}


def _conversation(question):
    return [{"role": "user", "content": question}]


def hub_datasets():
    """(id, splits, config) of each hub dataset the scripts load, in its real columns."""
    numina = [{"problem": f"What is {i} * 3?", "solution": f"{i} * 3 = $\\boxed{{{3 * i}}}$",
               "messages": [{"role": "user", "content": f"What is {i} * 3?"},
                            {"role": "assistant", "content": f"$\\boxed{{{3 * i}}}$"}]} for i in range(40)]
    # open-r1/OpenR1-Math-220k's columns (its "default" config); the script reads "problem", accuracy_reward "solution"
    openr1_math = [{"problem": f"Find $x$ if $x - {i} = {i}$.", "solution": f"Adding {i}: $x = \\boxed{{{2 * i}}}$",
                    "answer": f"{2 * i}", "problem_type": "Algebra", "question_type": "math-word-problem",
                    "source": "olympiads", "uuid": f"00000000-0000-0000-0000-{i:012d}",
                    "is_reasoning_complete": [True], "generations": [f"<think>\n{i} + {i}\n</think>\n{2 * i}"],
                    "correctness_math_verify": [True], "correctness_count": 1,
                    "messages": [{"role": "user", "content": f"Find $x$ if $x - {i} = {i}$."},
                                 {"role": "assistant", "content": f"$x = {2 * i}$"}]} for i in range(8)]
    rng = random.Random(0)
    countdown = [{"target": rng.randint(10, 99), "nums": [rng.randint(1, 99) for _ in range(3)]} for _ in range(50000)]
    return [
        ("HuggingFaceH4/Polaris-Dataset-53K",
         {"train": [{"prompt": _conversation(f"What is {i} + {i}?"), "solution": f"${2 * i}$"} for i in range(4)]},
         "default"),
        ("AI-MO/NuminaMath-TIR", {"train": numina, "test": numina[:20]}, "default"),  # gspo takes train[:5%]: 2 rows
        ("openai/gsm8k", {"train": [{"question": f"Tom has {i} apples and buys 2. How many has he?",
                                     "answer": f"{i} + 2 = <<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}"}
                                    for i in range(4)]}, "main"),
        ("open-r1/OpenR1-Math-220k", {"train": openr1_math}, "default"),
        # run_r1_grpo.py selects 50000 rows of the shuffled dataset
        ("Jiayi-Pan/Countdown-Tasks-3to4", {"train": countdown}, "default"),
    ]


SITECUSTOMIZE = textwrap.dedent(f'''\
    """Written by tests/examples/test_grpo_scripts.py: ESConfig values from ${FORCED_ENV} (JSON) forced into every
    ESConfig, for scripts without a command line; with ${CPU_ENV} set, a GPU-only script body runs on the CPU."""
    import functools, json, os, sys
    _forced = json.loads(os.environ.get("{FORCED_ENV}") or "{{}}")
    if _forced:
        from trl_es import ESConfig
        _init = ESConfig.__init__

        @functools.wraps(_init)
        def __init__(self, *args, **kwargs):
            _init(self, *args, **{{**kwargs, **_forced}})

        ESConfig.__init__ = __init__
        print(f"[test harness] ESConfig values forced: {{_forced}}", file=sys.stderr)
    if os.environ.get("{CPU_ENV}"):
        import transformers
        _from_pretrained = transformers.AutoModelForCausalLM.from_pretrained

        def from_pretrained(*args, **kwargs):
            if kwargs.get("attn_implementation") == "flash_attention_2":
                kwargs["attn_implementation"] = "eager"  # flash-attn runs on GPUs only
            return _from_pretrained(*args, **kwargs)

        transformers.AutoModelForCausalLM.from_pretrained = from_pretrained
        _to = transformers.PreTrainedModel.to

        @functools.wraps(_to)
        def to(self, *args, **kwargs):
            return _to(self, *("cpu" if a == "cuda" else a for a in args), **kwargs)

        transformers.PreTrainedModel.to = to
        print("[test harness] flash_attention_2 -> eager, .to('cuda') -> .to('cpu')", file=sys.stderr)
''')


# ---------------------------------------------------------------------------------------------------- the text


def _tokens(text: str) -> collections.Counter:
    """Names and symbols, commas left out (a name moved between import lists moves a comma)."""
    return collections.Counter(t for t in re.findall(r"[A-Za-z_][\w.]*|\S", text) if t != ",")


def _trl_grpo_names(text: str) -> list[str]:
    """TRL's GRPOConfig/GRPOTrainer as a script names them: imported from trl, or as ``trl.GRPO...``."""
    names = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trl":
            names += [a.name for a in node.names if a.name in ("GRPOConfig", "GRPOTrainer")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trl":
            names += [node.attr] if node.attr in ("GRPOConfig", "GRPOTrainer") else []
    return names


def _git_blob(data: bytes) -> str:
    """The git blob id of a file's bytes (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_scripts_sources_and_swaps_agree():
    assert {p.stem for p in SCRIPTS_DIR.glob("*.py")} == set(SCRIPTS) == set(SWAPS)
    assert {p.name.removesuffix(".py.txt") for p in SOURCES_DIR.glob("*.py.txt")} == set(SCRIPTS)
    readme = (SCRIPTS_DIR / "README.md").read_text()
    for name in SCRIPTS:
        assert f"`{name}.py`" in readme


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_is_the_source_with_the_names_swapped(name):
    source = text = (SOURCES_DIR / f"{name}.py.txt").read_text()
    for old, new in SWAPS[name]:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    # the swaps rename GRPOConfig/GRPOTrainer and move them to a trl_es import: nothing else
    renamed = text.replace("ESConfig", "GRPOConfig").replace("ESTrainer", "GRPOTrainer").replace("trl_es", "trl")
    assert not _tokens(source) - _tokens(renamed)
    assert set(_tokens(renamed) - _tokens(source)) <= {"from", "trl", "import"}
    for old, new, reason in PORTS.get(name, []):
        assert text.count(old) == 1 and reason, old
        text = text.replace(old, new)
    script = (SCRIPTS_DIR / f"{name}.py").read_text()
    assert script == text
    assert "GRPOTrainer" not in script and _trl_grpo_names(script) == []  # open-r1's own GRPOConfig keeps its name
    assert re.search(r"^\s*from trl_es import ES(Config, ESTrainer|Trainer|Config)$", script, flags=re.M)


def test_vendored_files_are_upstream_with_the_names_swapped():
    """open-r1's files beside its script: the upstream bytes (git blob id), or, for the few with swaps or ports, the
    verbatim upstream text (kept in tests/data) with only those applied."""
    vendored = {p.relative_to(SCRIPTS_DIR).as_posix() for d in ("open_r1", "recipes")
                for p in (SCRIPTS_DIR / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert vendored == set(VENDORED)
    assert set(VENDORED_SWAPS) | set(VENDORED_PORTS) <= set(VENDORED)
    for path, (_, blob) in VENDORED.items():
        if path not in VENDORED_SWAPS and path not in VENDORED_PORTS:
            assert _git_blob((SCRIPTS_DIR / path).read_bytes()) == blob, path
            continue
        source = text = (SOURCES_DIR / f"{path}.txt").read_text()
        assert _git_blob(source.encode()) == blob, path
        for old, new in VENDORED_SWAPS.get(path, []):
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        renamed = text.replace("ESConfig", "GRPOConfig").replace("trl_es", "trl")
        assert not _tokens(source) - _tokens(renamed) and set(_tokens(renamed) - _tokens(source)) <= {"import", "trl"}
        for old, new, reason in VENDORED_PORTS.get(path, []):
            assert text.count(old) == 1 and reason, old
            text = text.replace(old, new)
        assert (SCRIPTS_DIR / path).read_text() == text, path
        if path.endswith(".py") and path in VENDORED_SWAPS:
            assert _trl_grpo_names(text) == [], path


# ---------------------------------------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    for model, template in HUB_MODELS.items():
        add_model(home, model, chat_template=template)
    for dataset, splits, config in hub_datasets():
        add_dataset(home, dataset, splits, config=config)
    (home / "harness").mkdir()
    (home / "harness" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return home


def _script_env(hf_home, spec: Script) -> dict[str, str]:
    """The environment a script runs in: offline against ``hf_home``, the harness's sitecustomize first."""
    return {
        **os.environ,
        **offline_env(hf_home),
        "PYTHONPATH": os.pathsep.join(p for p in [str(hf_home / "harness"), str(ROOT), os.environ.get("PYTHONPATH")]
                                      if p),
        FORCED_ENV: json.dumps({**FORCED, **({"use_cpu": True} if spec.cpu else {})}) if spec.forced else "",
        CPU_ENV: "1" if spec.cpu else "",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


@pytest.fixture(scope="module")
def python(hf_home):
    """``python script.py`` for the scripts with a command line (their start-up environment is the same): children
    of one warm interpreter (tests/warm_python.py) that imports the libraries once."""
    with WarmPython(_script_env(hf_home, Script((), ""))) as warm:
        yield warm


def run_script(python, hf_home, spec: Script, argv: list, cwd) -> subprocess.CompletedProcess:
    if spec.forced or spec.cpu:  # the harness reads these at start-up: a fresh interpreter
        return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=_script_env(hf_home, spec),
                              capture_output=True, text=True, timeout=300)
    return python.run(argv, cwd=cwd, timeout=300)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n]))
                                  if n in XFAIL else n for n in sorted(SCRIPTS)])
def test_script_runs(name, python, hf_home, tmp_path):
    spec = SCRIPTS[name]
    proc = run_script(python, hf_home, spec, [SCRIPTS_DIR / f"{name}.py", *spec.args], tmp_path)
    assert proc.returncode == 0, f"{name}.py failed:\n{proc.stderr[-4000:]}"
    assert "train_loss" in proc.stdout, proc.stdout[-2000:]  # Trainer's summary of the run (or log_metrics' table)
    output_dir = tmp_path / spec.output_dir
    for file in ("es_seed_log.jsonl", "README.md"):
        assert (output_dir / file).is_file(), file
    records = (output_dir / "es_seed_log.jsonl").read_text().splitlines()[1:]
    assert [json.loads(r)["step"] for r in records] == [1]  # one ES step
    if spec.saves_model:
        assert (output_dir / "model.safetensors").is_file() or (output_dir / "adapter_model.safetensors").is_file()
    card = (output_dir / "README.md").read_text()
    assert "| `population_size` | `2` |" in card and "arXiv:2509.24372" in card


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_trl_grpo_runs_qlora_with_load_in_4bit_and_use_peft(python, hf_home, tmp_path, quant_type):
    """Issue 60's done-when: TRL's ``trl/scripts/grpo.py`` with ``--load_in_4bit --use_peft`` (its QLoRA command line)
    on ESTrainer with only the names swapped: the base loads in 4 bits through TRL's ``get_quantization_config``
    (compute dtype = ``--dtype``, float32), ES trains the fp32 LoRA adapter, the seed log records the quantization."""
    pytest.importorskip("bitsandbytes")
    from safetensors.torch import load_file

    model_id = "Qwen/Qwen2.5-0.5B-Instruct-QLoRA-test"  # hidden size 64: bitsandbytes' CPU 4-bit needs whole blocks
    add_model(hf_home, model_id, architecture="llama64")
    spec = SCRIPTS["trl_grpo"]
    args = list(spec.args)
    args[args.index("Qwen/Qwen2.5-0.5B")] = model_id
    args += ["--load_in_4bit", "--use_peft", "--bnb_4bit_quant_type", quant_type]
    proc = run_script(python, hf_home, spec, [SCRIPTS_DIR / "trl_grpo.py", *args], tmp_path)
    assert proc.returncode == 0, f"trl_grpo.py --load_in_4bit --use_peft failed:\n{proc.stderr[-4000:]}"
    assert "train_loss" in proc.stdout, proc.stdout[-2000:]
    output_dir = tmp_path / spec.output_dir
    lines = (output_dir / "es_seed_log.jsonl").read_text().splitlines()
    header = json.loads(lines[0])["quantization_config"]
    assert header["load_in_4bit"] is True and header["bnb_4bit_quant_type"] == quant_type
    assert header["bnb_4bit_compute_dtype"] == "float32"
    assert [json.loads(r)["step"] for r in lines[1:]] == [1]
    adapter = load_file(str(output_dir / "adapter_model.safetensors"))
    assert adapter and all(t.dtype == torch.float32 for t in adapter.values())  # no QLoRA bf16 cast
    assert {k.split(".")[-2] for k in adapter} == {"lora_A", "lora_B"}
    assert not (output_dir / "model.safetensors").exists()  # the base is not saved: it stays the hub's
