"""The fastest-launch planner of the main job (trl_es.launch)."""

import sys

import pytest

from trl_es.launch import launch_command, main, physical_cores, plan_launch, reusable_result


def test_cpu_cores_get_one_single_threaded_process_each():
    plan = plan_launch(gpus=0, cores=2)
    assert (plan.launcher, plan.num_processes, plan.threads) == ("torchrun", 2, 1)
    assert plan.env["OMP_NUM_THREADS"] == "1" and plan.env["ACCELERATE_USE_CPU"] == "1"
    command = launch_command(plan, "job.py", ["--max_steps", "3"], port=29511)
    assert command == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                       "29511", "job.py", "--max_steps", "3"]
    assert plan_launch(gpus=0, cores=8).num_processes == 8


def test_one_core_or_one_forced_process_falls_back_to_one_process():
    for plan in (plan_launch(gpus=0, cores=1), plan_launch(num_processes=1, gpus=0, cores=4)):
        assert (plan.launcher, plan.num_processes) == ("python", 1)
        assert launch_command(plan, "job.py", ["-x"]) == [sys.executable, "job.py", "-x"]
    assert plan_launch(num_processes=1, gpus=0, cores=4).threads == 4  # all cores' threads in the one process


def test_gpus_get_one_process_each():
    plan = plan_launch(gpus=4, cores=16)
    assert (plan.launcher, plan.num_processes, plan.threads) == ("accelerate", 4, 4)
    assert launch_command(plan, "job.py", [])[1:5] == ["launch", "--num_processes", "4", "--multi_gpu"]
    assert plan_launch(gpus=1, cores=16).launcher == "python"


def test_bad_process_count_and_dry_run(capsys):
    with pytest.raises(ValueError, match="num_processes must be >= 1"):
        plan_launch(num_processes=0, gpus=0, cores=2)
    assert main(["--dry_run", "--num_processes", "1", "job.py", "--a", "1"]) == 0
    assert f"{sys.executable} job.py --a 1" in capsys.readouterr().out
    assert physical_cores() >= 1


def test_more_processes_than_gpus_is_refused():
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        plan_launch(num_processes=4, gpus=2, cores=16)


def test_reusable_result_matches_the_saved_spec_up_to_ignored_args(tmp_path):
    import json

    path = str(tmp_path / "result.json")
    spec = {"kind": "train", "arm": "rl", "args": {"arms": ["rl"], "lr": 1e-5}, "result": path}
    assert reusable_result(spec) is None  # nothing saved yet
    saved = {"spec": spec, "steps": 32}
    with open(path, "w") as f:
        json.dump(saved, f)
    assert reusable_result(spec) == saved
    assert reusable_result(spec, reuse=False) is None
    more_arms = {**spec, "args": {"arms": ["rl", "sft"], "lr": 1e-5}}
    assert reusable_result(more_arms) is None  # the arm list counts unless ignored ...
    assert reusable_result(more_arms, ignored_args=("arms",)) == saved  # ... and is ignored when named
    other_lr = {**spec, "args": {"arms": ["rl"], "lr": 2e-5}}
    assert reusable_result(other_lr, ignored_args=("arms",)) is None  # what the job computes always counts
    assert reusable_result({**spec, "arm": "sft"}, ignored_args=("arms",)) is None
    with open(path, "w") as f:
        json.dump({"steps": 32}, f)  # a result without its spec is never reused
    assert reusable_result(spec) is None


def test_launcher_prepares_the_embedded_cache_in_the_parent_before_the_workers(monkeypatch, tmp_path):
    """Several processes: the cache is built (or checked) once, here, before the command starts; one process or
    --no_embedded_cache: not."""
    import subprocess

    import trl_es.launch as launch

    events = []
    monkeypatch.setattr(launch, "prepare_embedded_model", lambda: events.append("prepare") or str(tmp_path))
    monkeypatch.setattr(subprocess, "call", lambda command, env=None: events.append(command[:2]) or 0)
    monkeypatch.setattr(launch, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(launch, "physical_cores", lambda: 2)
    assert main(["job.py", "--a", "1"]) == 0
    assert events == ["prepare", [sys.executable, "-m"]]  # torchrun, after the cache
    events.clear()
    assert main(["--num_processes", "1", "job.py"]) == 0
    assert events == [[sys.executable, "job.py"]]
    events.clear()
    assert main(["--no_embedded_cache", "job.py"]) == 0
    assert events == [[sys.executable, "-m"]]


def test_prepare_embedded_model_builds_the_cache(monkeypatch, tmp_path, tokenizer):
    import importlib.util

    from tiny import build_llama

    from trl_es import models
    from trl_es.launch import prepare_embedded_model

    monkeypatch.setenv("TRL_ES_CACHE", str(tmp_path))
    monkeypatch.setenv("TRL_ES_NO_EMBEDDED_CACHE", "1")
    monkeypatch.setattr(models, "_load_gguf", lambda: (build_llama(tokenizer), tokenizer))
    assert prepare_embedded_model() is None and not (tmp_path / "SmolLM2-135M-Instruct").exists()  # opted out
    monkeypatch.delenv("TRL_ES_NO_EMBEDDED_CACHE")
    assert prepare_embedded_model() == str(tmp_path / "SmolLM2-135M-Instruct")
    assert models._cache_problem(tmp_path / "SmolLM2-135M-Instruct") is None
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == models.EMBEDDED_PACKAGE else real_find_spec(name, *a, **k))
    assert prepare_embedded_model() is None  # no package: nothing to prepare (a worker that needs it says so)
