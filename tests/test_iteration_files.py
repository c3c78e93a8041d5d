"""scripts/iteration_files.py traces one ES iteration (default settings, tiny Llama) and lists the package files it
passes through: the core files are there, es_update_ is inside the window, and the measured list is pinned so that a
change to it is seen (issue 59's target is at most 10 files; docs/architecture.md shows the table)."""

import os
import sys

from paths import REPO


sys.path.insert(0, os.path.join(REPO, "scripts"))

from iteration_files import table, trace_iteration  # noqa: E402


# Measured on the tiny Llama with default ESConfig settings, in the order of first call (issue 59's target: at most 10):
# when a change moves an iteration into other files, update this list and the table in docs/architecture.md.
MEASURED = [
    "trl_es/trainer/es/es_trainer.py",
    "trl_es/es/strategy.py",
    "trl_es/generation/base.py",
    "trl_es/es/perturbation.py",
    "trl_es/es/noise.py",
    "trl_es/rollout.py",
    "trl_es/generation/eager.py",
    "trl_es/trainer/es/es_metrics.py",
    "trl_es/es/fitness.py",
    "trl_es/es/seedlog.py",
]


def test_one_iteration_files(tmp_path):
    files = trace_iteration(str(tmp_path))
    print(f"\n{table(files)}")  # noqa: T201 (the measured count, with -s)
    core = {"trl_es/trainer/es/es_trainer.py", "trl_es/es/strategy.py", "trl_es/es/perturbation.py",
            "trl_es/rollout.py", "trl_es/es/fitness.py", "trl_es/es/seedlog.py"}
    assert core <= files.keys()
    assert list(files)[0] == "trl_es/trainer/es/es_trainer.py"  # the window opens at training_step
    assert any(name.startswith("ESTrainer.training_step:") for name in files["trl_es/trainer/es/es_trainer.py"])
    assert any(name.startswith("es_update_:") for name in files["trl_es/es/perturbation.py"])  # the update is in it
    assert any(name.startswith("RewardScorer.score:") for name in files["trl_es/rollout.py"])  # and the rewards
    assert all(not f.startswith(("trl_es/cli/", "trl_es/trainer/hyper_es/")) for f in files)  # nothing outside ES
    assert sorted(files) == sorted(MEASURED), f"{len(files)} files: {list(files)}"
    assert len(files) <= 10  # issue 59


def test_table_totals():
    files = {"trl_es/a.py": ["f:1", "g:5"], "trl_es/es/b.py": ["h:3"]}
    lines = table(files).splitlines()
    assert lines[1].split() == ["trl_es/a.py", "2"]
    assert lines[2].split() == ["trl_es/es/b.py", "1"]
    assert lines[-1].split() == ["total:", "2", "files", "3"]
    assert "    g:5" in table(files, show_all=True).splitlines()
