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
