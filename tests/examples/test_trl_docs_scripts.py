"""examples/trl_docs/: TRL's GRPO docs scripts run with ESTrainer, with only the import and the trainer class changed.

Two checks per script:

- its text is TRL's: undoing the swap (``from trl_es import`` -> ``from trl import``, ``ESTrainer`` ->
  ``GRPOTrainer``, ``ESConfig`` -> ``GRPOConfig``) and dropping what the script marks as filled in (``# trl_es: begin
  added`` ... ``# trl_es: end``; ``# trl_es: begin instead of: TEXT`` ... ``# trl_es: end`` stands for TEXT) gives the
  TRL docs blocks kept verbatim in ``tests/data/trl_docs_blocks/<script>.py.txt`` (themselves checked against a TRL
  git mirror when there is one);
- it trains: run as a subprocess (``python script.py``) through the libraries' own hub code paths, with the hub
  model and dataset ids it names answered offline from a fake Hugging Face cache (:mod:`hub_cache`) holding a tiny
  model and a few rows. The run must exit 0, take the number of ES steps the dataset size and ESConfig's defaults
  imply (``ceil(rows / prompt_batch_size) * num_train_epochs``), log ``train_loss`` and save the final checkpoint
  (``trainer_state.json``, weights, ES seed log) in ESTrainer's default ``output_dir`` (``<model name>-ES``).

Run length: the scripts pass no config, so ESConfig's defaults apply (30 members, 256 new tokens): ~10 minutes per
script on the tiny model on a CPU. Without touching the scripts, the test lowers two defaults that set the cost of a
step but not the number of steps (``population_size``, ``max_completion_length``; :data:`SHORT_RUN`) through a
``sitecustomize`` module it puts on the subprocess's ``PYTHONPATH``; the run checks that they were applied (the seed
log's population, the completions' length). The subprocesses are children of one warm interpreter
(:mod:`warm_python`): the libraries are imported once for the ten scripts.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hub_cache import add_dataset, add_model, offline_env
from warm_python import WarmPython
from paths import REPO, TESTS

from trl_es.trainer.es.es_config import DEFAULT_PROMPT_BATCH_SIZE  # prompt_batch_size left unset (None) resolves to it

ROOT = Path(REPO)
SCRIPTS_DIR = ROOT / "examples" / "trl_docs"
BLOCKS_DIR = Path(TESTS) / "data" / "trl_docs_blocks"

TRL_MIRROR = Path(os.environ.get("TRL_DOCS_MIRROR", "/work/.mirror/huggingface+trl/repo"))
"""A git mirror of huggingface/trl; the snapshot check against it is skipped where it is absent."""
TRL_COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"
"""The TRL commit the blocks were copied from (2026-07-24)."""

GRPO_DOCS, QUICKSTART_DOCS = "docs/source/grpo_trainer.md", "docs/source/quickstart.md"
PASSING = "Passing the reward function to the trainer"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"

DEEPMATH = "trl-lib/DeepMath-103K"
DEEPMATH_ROWS = [
    # trl-lib/DeepMath-103K's format (TRL's examples/datasets/deepmath_103k.py): a conversational "prompt" (one user
    # message) and a "solution" ("$answer$", or True/False/Yes/No as is).
    {"prompt": [{"role": "user", "content": question}], "solution": solution}
    for question, solution in [
        ("What is 2+3?", "$5$"), ("Compute 4*6.", "$24$"), ("Is 7 prime?", "Yes"), ("What is 10-4?", "$6$"),
        ("Simplify 6/3.", "$2$"), ("What is 3^2?", "$9$"), ("Is 1 > 2?", "False"), ("What is 7+8?", "$15$"),
        ("Compute 9-9.", "$0$"), ("What is 2*11?", "$22$"),
    ]
]
"""10 rows: with the default prompt_batch_size of 8, an epoch is 2 steps, the second one a partial batch."""
HUB_DATASETS = {DEEPMATH: {"train": DEEPMATH_ROWS, "test": DEEPMATH_ROWS[:2]}}
HUB_MODELS = [MODEL]


@dataclasses.dataclass(frozen=True)
class DocsScript:
    """A script of examples/trl_docs/ and what its run must show."""

    blocks: tuple[tuple[str, str, int], ...]  # its TRL docs blocks: (docs file, section heading, n-th python block)
    rows: int  # rows of its training dataset
    reward_funcs: tuple[str, ...]  # the reward functions that score something (logged as rewards/<name>/mean)
    metrics: tuple[str, ...] = ()  # other metrics every step logs (a reward function's log_metric)


SCRIPTS = {
    "quickstart": DocsScript(((QUICKSTART_DOCS, "Group Relative Policy Optimization", 0),),
                             len(DEEPMATH_ROWS), ("accuracy_reward",)),
    "train_grpo": DocsScript(((GRPO_DOCS, "Quick start", 0),), len(DEEPMATH_ROWS), ("accuracy_reward",)),
    "reward_len": DocsScript(((GRPO_DOCS, "Example 1: Reward longer completions", 0), (GRPO_DOCS, PASSING, 0)),
                             2, ("reward_func",)),
    "reward_num_chars": DocsScript(
        ((GRPO_DOCS, "Example 1.1: Reward longer completions (based on the number of characters)", 0),
         (GRPO_DOCS, PASSING, 0)), 2, ("reward_func",)),
    "format_reward": DocsScript(
        ((GRPO_DOCS, "Example 2: Reward completions with a specific format", 0), (GRPO_DOCS, PASSING, 0)),
        len(DEEPMATH_ROWS), ("format_reward_func",)),
    "reference_reward": DocsScript(
        ((GRPO_DOCS, "Example 3: Reward completions based on a reference", 0), (GRPO_DOCS, PASSING, 0)),
        2, ("reward_func",)),
    # coding_reward_func scores rows whose task is "coding", but the dataset's code rows say "code" (as in the TRL
    # docs): it returns None everywhere, and ESTrainer logs no mean for a function without a reward (GRPO logs NaN).
    "multi_task": DocsScript(((GRPO_DOCS, "Example 4: Multi-task reward functions", 0),), 4, ("math_reward_func",)),
    "async_reward": DocsScript(
        ((GRPO_DOCS, "Example 5: Asynchronous reward functions", 0), (GRPO_DOCS, PASSING, 0)),
        len(DEEPMATH_ROWS), ("async_reward_func",)),
    "log_extra_reward": DocsScript(
        ((GRPO_DOCS, "Example 6: Logging extra columns and metrics", 0), (GRPO_DOCS, PASSING, 0)),
        2, ("reward_func",), metrics=("accuracy",)),
    "multiple_rewards": DocsScript(
        ((GRPO_DOCS, "Example 1: Reward longer completions", 0),
         (GRPO_DOCS, "Example 5: Asynchronous reward functions", 0), (GRPO_DOCS, PASSING, 1)),
        len(DEEPMATH_ROWS), ("reward_func", "async_reward_func1", "async_reward_func2")),
}

SHORT_RUN = {"population_size": 2, "max_completion_length": 8}
"""ESConfig defaults the test lowers for the scripts' runs (the cost of a step, not the number of steps)."""
HARNESS_ENV = "TRL_ES_TEST_ESCONFIG_DEFAULTS"
SITECUSTOMIZE = textwrap.dedent(f'''\
    """Written by tests/examples/test_trl_docs_scripts.py: ESConfig defaults from ${HARNESS_ENV} (JSON), for short runs of
    scripts that pass no config. Only the defaults change: a value a script passes still wins."""
    import json, os, sys
    _defaults = json.loads(os.environ.get("{HARNESS_ENV}") or "{{}}")
    if _defaults:
        import inspect
        from trl_es import ESConfig
        _init = ESConfig.__init__
        _names = [p.name for p in inspect.signature(_init).parameters.values() if p.default is not p.empty]
        _values = list(_init.__defaults__)
        assert len(_names) == len(_values), "ESConfig.__init__ has keyword-only defaults: update the test harness"
        for _name, _value in _defaults.items():
            _values[_names.index(_name)] = _value
        _init.__defaults__ = tuple(_values)
        print(f"[test harness] ESConfig defaults changed: {{_defaults}}", file=sys.stderr)
''')


# ---------------------------------------------------------------------------------------------------- the text


MARKER = "# trl_es:"


def trl_text(script: str) -> str:
    """The TRL docs text a script stands for: its ``# trl_es:`` notes and filled-in regions dropped (an ``instead
    of: TEXT`` region becomes TEXT, at the marker's indentation), then the import and class swap undone."""
    out, region = [], None
    for line in script.splitlines():
        stripped = line.strip()
        if stripped.startswith(MARKER):
            note = stripped[len(MARKER):].strip()
            if note.startswith("begin"):
                assert region is None, f"nested '{MARKER} begin': {line!r}"
                region = note
                if note.startswith("begin instead of:"):
                    out.append(line[: len(line) - len(line.lstrip())] + note[len("begin instead of:"):].strip())
                else:
                    assert note.startswith("begin added"), f"unknown marker: {line!r}"
            elif note == "end":
                assert region is not None, f"'{MARKER} end' without begin: {line!r}"
                region = None
            continue  # a note
        if region is None:
            out.append(line)
    assert region is None, f"unclosed '{MARKER} {region}'"
    text = "\n".join(out)
    text = re.sub(r"^from trl_es import ", "from trl import ", text, flags=re.M)
    return text.replace("ESTrainer", "GRPOTrainer").replace("ESConfig", "GRPOConfig")


def normalized(text: str) -> str:
    """Trailing spaces dropped, runs of blank lines as one, no blank lines at either end."""
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    return "\n".join(line for i, line in enumerate(lines) if line or (i and lines[i - 1]))


def test_scripts_blocks_and_readme_agree():
    scripts = {p.stem for p in SCRIPTS_DIR.glob("*.py")}
    assert scripts == set(SCRIPTS)
    assert {p.name.removesuffix(".py.txt") for p in BLOCKS_DIR.glob("*.py.txt")} == set(SCRIPTS)
    readme = (SCRIPTS_DIR / "README.md").read_text()
    for name in SCRIPTS:
        assert f"{name}.py" in readme


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_is_trl_text_with_the_import_swapped(name):
    script = (SCRIPTS_DIR / f"{name}.py").read_text()
    assert normalized(trl_text(script)) == normalized((BLOCKS_DIR / f"{name}.py.txt").read_text())
    # the swap itself: ESTrainer from trl_es; no GRPO name, and nothing imported from trl but its rewards
    code = "\n".join(line for line in script.splitlines() if not line.strip().startswith(MARKER))
    assert re.search(r"^from trl_es import ESTrainer$", code, flags=re.M)
    assert not re.search(r"^from trl import|GRPO", code, flags=re.M)


def trl_docs_python_block(text: str, heading: str, nth: int) -> str:
    """The ``nth`` fenced python block after the markdown heading ``heading``, verbatim."""
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and line.lstrip("#").strip() == heading)
    found = -1
    for i in range(start + 1, len(lines)):
        if lines[i].rstrip("\n") == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip("\n") == "```")
            found += 1
            if found == nth:
                return "".join(lines[i + 1: end])
    raise LookupError(f"no python block {nth} after {heading!r}")


def mirror_has_commit() -> bool:
    """Whether :data:`TRL_MIRROR` is a git repository that holds :data:`TRL_COMMIT`."""
    try:
        return subprocess.run(["git", "-C", str(TRL_MIRROR), "cat-file", "-e", f"{TRL_COMMIT}^{{commit}}"],
                              capture_output=True).returncode == 0
    except OSError:  # no git
        return False


@pytest.mark.skipif(not mirror_has_commit(),
                    reason=f"no TRL git mirror with commit {TRL_COMMIT[:12]} at {TRL_MIRROR} (set TRL_DOCS_MIRROR)")
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_blocks_are_trl_docs_verbatim(name):
    docs = {}
    for path, _, _ in SCRIPTS[name].blocks:
        if path not in docs:
            docs[path] = subprocess.run(["git", "-C", str(TRL_MIRROR), "show", f"{TRL_COMMIT}:{path}"],
                                        capture_output=True, text=True, check=True).stdout
    expected = "\n".join(trl_docs_python_block(docs[path], heading, nth)
                         for path, heading, nth in SCRIPTS[name].blocks)
    assert (BLOCKS_DIR / f"{name}.py.txt").read_text() == expected


# ---------------------------------------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """A fake HF cache with the hub models and datasets the scripts name, and the harness's sitecustomize."""
    home = tmp_path_factory.mktemp("hf_home")
    for model in HUB_MODELS:
        add_model(home, model)
    for dataset, splits in HUB_DATASETS.items():
        add_dataset(home, dataset, splits)
    (home / "harness").mkdir()
    (home / "harness" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return home


def test_the_cache_holds_every_hub_id_the_scripts_name():
    for name in SCRIPTS:
        script = (SCRIPTS_DIR / f"{name}.py").read_text()
        assert set(re.findall(r'model="([^"]+)"', script)) <= set(HUB_MODELS), name
        assert set(re.findall(r'load_dataset\("([^"]+)"', script)) <= set(HUB_DATASETS), name


def default(field_name: str):
    """ESConfig's default for ``field_name`` (its dataclass field)."""
    from trl_es import ESConfig

    return next(f.default for f in dataclasses.fields(ESConfig) if f.name == field_name)


def printed_logs(stdout: str) -> list[dict]:
    """The log dicts the Trainer printed (one line each, Python literals)."""
    logs = []
    for line in stdout.splitlines():
        if line.startswith("{") and line.endswith("}"):
            logs.append(ast.literal_eval(line))
    return logs


@pytest.fixture(scope="module")
def python(hf_home):
    """``python script.py`` in the fake cache's offline environment with the harness: one warm interpreter forks a
    child per script (tests/warm_python.py), which prints the harness's line once, at its start."""
    env = {
        **os.environ,
        **offline_env(hf_home),
        "PYTHONPATH": os.pathsep.join(p for p in [str(hf_home / "harness"), str(ROOT), os.environ.get("PYTHONPATH")] if p),
        HARNESS_ENV: json.dumps(SHORT_RUN),
        "OMP_NUM_THREADS": "1",  # a tiny model: thread start-up costs more than it gains
        "TOKENIZERS_PARALLELISM": "false",
    }
    with WarmPython(env) as warm:
        yield warm


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_trains(name, python, tmp_path):
    spec = SCRIPTS[name]
    assert not default("dataloader_drop_last")  # a last partial batch of prompts is a step
    steps = math.ceil(spec.rows / DEFAULT_PROMPT_BATCH_SIZE) * int(default("num_train_epochs"))
    proc = python.run([SCRIPTS_DIR / f"{name}.py"], cwd=tmp_path)
    assert proc.returncode == 0, f"{name}.py failed:\n{proc.stderr[-6000:]}"

    logs = printed_logs(proc.stdout)
    step_logs = [log for log in logs if "loss" in log]
    assert len(step_logs) == steps, proc.stdout[-3000:]
    final = [log for log in logs if "train_loss" in log]
    assert len(final) == 1 and math.isfinite(float(final[0]["train_loss"]))
    for log in step_logs:
        for key in [f"rewards/{func}/mean" for func in spec.reward_funcs] + list(spec.metrics):
            assert key in log, sorted(log)
        assert math.isclose(float(log["loss"]), -float(log["fitness/mean"]), rel_tol=1e-3, abs_tol=1e-6)  # ES's loss
        assert float(log["completions/max_length"]) <= SHORT_RUN["max_completion_length"]

    output_dir = tmp_path / f"{MODEL.split('/')[-1]}-ES"  # ESTrainer's default output_dir
    checkpoint = output_dir / f"checkpoint-{steps}"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == steps
    assert state["epoch"] == default("num_train_epochs")
    assert [h["step"] for h in state["log_history"] if "loss" in h] == list(range(1, steps + 1))
    for file in ("model.safetensors", "config.json", "tokenizer.json", "es_seed_log.jsonl"):
        assert (checkpoint / file).is_file(), file
    header = json.loads((output_dir / "es_seed_log.jsonl").read_text().splitlines()[0])
    assert header["population_size"] == SHORT_RUN["population_size"]
