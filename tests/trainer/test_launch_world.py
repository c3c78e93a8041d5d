"""The launcher's world is the trainer's, on CPU too (issue 42).

``torchrun --nproc_per_node 2`` (or ``accelerate launch --multi_gpu``) sets ``WORLD_SIZE=2``, but accelerate builds a
process group on a CPU only with ``use_cpu=True``: with a plain ``ESConfig(...)`` every process used to see
``world_size 1``, train the whole population alone and write the same files (rank 1's ``require_files`` check then
failed on ``checkpoint-1``). ``ESConfig`` now runs such a launch as ``use_cpu=True``
(:func:`trl_es.trainer.distributed.resolve_cpu_world`), and refuses before any work what cannot run so (DeepSpeed
without a pre-built state, a GPU-only ``ddp_backend``), naming ``use_cpu``.

The launched tests run ``tests/distributed/run_es.py --plain_config`` (no ``use_cpu`` in its config) and compare with
the one-process run of ``tests/trainer/test_distributed.py`` (the ``reference`` fixture). docs/scaling.md's
preemption recipe (torchrun --standalone --max-restarts, save_steps=1, resume_from_checkpoint="latest") with a plain
config runs in ``tests/trainer/test_preemption.py::test_killed_worker_restarts_and_ends_bitwise_as_uninterrupted``.
"""

import logging
import os
import sys
from types import SimpleNamespace

import pytest
from test_distributed import assert_bitwise, launch, reference, seed_log, weights  # noqa: F401
from test_preemption import assert_complete_checkpoints

from trl_es import ESConfig
from trl_es.trainer import distributed
from trl_es.trainer.distributed import accelerator_process_group_backend, resolve_cpu_world

no_accelerator = pytest.mark.skipif(accelerator_process_group_backend() is not None,
                                    reason="a GPU (or another accelerator with a process-group backend) is visible")


def assert_two_processes_like_one(result, out, ref_out, ref):
    assert result["world_size"] == 2 and result["args_world_size"] == 2 and result["use_cpu"] is True
    assert_bitwise(weights(out / "model"), weights(ref_out / "model"))
    assert seed_log(out) == seed_log(ref_out)
    assert result["eval"]["eval_reward"] == ref["eval"]["eval_reward"]


# ---------------------------------------------------------------------------------------------- launched
@no_accelerator
@pytest.mark.distributed
def test_torchrun_with_a_plain_config_runs_as_two_processes(reference, tmp_path, tiny_model_dir):
    """torchrun, 2 processes, no use_cpu: one gloo group (world size 2), the one-process weights, seed log and
    evaluation, and whole checkpoints written once (by process 0) at every step."""
    ref_out, ref = reference
    result = launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                     "--master_port", str(29300 + os.getpid() % 200)],
                    tmp_path, tiny_model_dir, "--plain_config", "--save_steps", "1")
    assert_two_processes_like_one(result, tmp_path, ref_out, ref)
    assert result["replicas_identical"] == [True, True]
    assert result["prompt_batches_identical"] is True
    assert_complete_checkpoints(tmp_path, ref_out)


@no_accelerator
@pytest.mark.distributed
def test_accelerate_launch_multi_gpu_on_cpu_runs_two_processes(reference, tmp_path, tiny_model_dir):
    """``accelerate launch --multi_gpu --num_processes 2`` on a CPU starts 2 processes through torchrun (accelerate's
    one-process launcher would start one): with a plain config they form one gloo group and end as one process."""
    ref_out, ref = reference
    result = launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                     "--main_process_port", str(29500 + os.getpid() % 200)],
                    tmp_path, tiny_model_dir, "--plain_config")
    assert_two_processes_like_one(result, tmp_path, ref_out, ref)


# ---------------------------------------------------------------------------------------------- in this process
@pytest.fixture
def launched_world(monkeypatch):
    """The environment torchrun gives process 0 of 2 (no process group is created: the tests stop before)."""
    for name in ("ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                 "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(distributed, "_CPU_WORLD_LOGGED", False)


def fields(**kwargs):
    base = dict(use_cpu=False, accelerator_config=None, deepspeed=None, ddp_backend=None)
    return SimpleNamespace(**{**base, **kwargs})


@no_accelerator
def test_several_launched_processes_without_gpu_run_as_use_cpu(launched_world, caplog):
    args = fields()
    with caplog.at_level(logging.WARNING):
        resolve_cpu_world(args)
        resolve_cpu_world(fields())  # logged once per process
    assert args.use_cpu is True
    assert caplog.text.count("use_cpu=True") == 2 and "WORLD_SIZE=2" in caplog.text  # one message, named twice
    # A script that built the process group itself keeps its state; one process is left alone.
    kept = fields(accelerator_config={"use_configured_state": True})
    resolve_cpu_world(kept)
    assert kept.use_cpu is False


@no_accelerator
@pytest.mark.parametrize("setting", [
    {"deepspeed": {"zero_optimization": {"stage": 3}}},
    {"ddp_backend": "nccl"},
    {"env": "ACCELERATE_USE_DEEPSPEED"},  # accelerate launch's DeepSpeed launcher, no deepspeed field
])
def test_a_config_that_cannot_run_several_cpu_processes_is_refused_naming_use_cpu(launched_world, monkeypatch,
                                                                                   tmp_path, setting):
    """Refused by ESConfig itself, before transformers sets up any device or process group."""
    setting = dict(setting)
    if setting.pop("env", None):
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*use_cpu=True"):
        ESConfig(output_dir=str(tmp_path), report_to=[], **setting)


def test_one_process_is_left_alone(monkeypatch, tmp_path):
    for name in distributed.WORLD_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    args = fields()
    resolve_cpu_world(args)
    assert args.use_cpu is False
    assert ESConfig(output_dir=str(tmp_path), report_to=[]).world_size == 1


def test_accelerate_one_process_launcher_asked_for_several_warns(monkeypatch, caplog):
    """``accelerate launch --num_processes 2`` without ``--multi_gpu`` on a CPU starts one process (with
    ``MASTER_PORT`` and no ``WORLD_SIZE``): it runs, as one process, with a warning naming the launch lines."""
    for name in (*distributed.WORLD_SIZE_VARIABLES, "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(distributed, "_CPU_WORLD_LOGGED", False)
    args = fields()
    with caplog.at_level(logging.WARNING):
        resolve_cpu_world(args)
    assert args.use_cpu is False
    assert "accelerate launch --multi_gpu" in caplog.text and "torchrun --nproc_per_node" in caplog.text
