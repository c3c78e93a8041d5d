"""Preemption-proof ES runs (issue 35): a process SIGKILLed mid-run costs at most the iteration in flight.

An ES run's whole state is its weights plus its seed log, checkpointed every iteration (``save_steps=1``). With
``ESConfig(resume_from_checkpoint="latest")`` a job relaunched by ``torchrun --max-restarts 1`` resumes by itself
from the newest complete checkpoint (``ESCheckpointMixin._latest_complete_checkpoint``) and ends bitwise where an
uninterrupted run ends. The distributed tests really kill a process (``tests/distributed/run_es.py --kill_*``, first
attempt only) and compare with the one-process run of ``tests/trainer/test_distributed.py``; the others check the choice of
checkpoint in one process.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import assert_bitwise, launch, reference, reference_bf16, seed_log, weights  # noqa: F401
from test_es_trainer import es_args, mean_code, prompts
from tiny import build_llama
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_es import ESTrainer, replay
from trl_es.trainer.es.es_checkpoint import AUTO_RESUME


def elastic(out, model_dir, *extra, nproc=2, limit=240):
    """``torchrun --standalone --nproc_per_node 2 --max-restarts 1`` (torch elastic: all workers restart once if one
    dies), with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: every attempt's workers get a new TCPStore. (By default
    torchrun keeps one store for all attempts, the rendezvous' with c10d or ``--standalone``, the one of
    ``--master_port`` with the static rendezvous, and the workers use it without a per-attempt prefix: the restarted
    gloo groups can read the killed attempt's addresses there and hang in ``ProcessGroupGloo``'s connect, or fail
    with "Gloo connectFullMesh failed ... Connection refused", as they did here with torch 2.13, plain and under
    ZeRO-3.) ``timeout`` stops torchrun (which stops its workers) before the test gives up."""
    return launch(["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "timeout", "-k", "20", str(limit), sys.executable,
                   "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   "--max-restarts", "1"],
                  out, model_dir, "--auto_resume", "--save_steps", "1", *extra, timeout=limit + 60)


def assert_complete_checkpoints(out, ref_out, steps=(1, 2), sharded=False):
    """Every checkpoint the final attempt left is whole (its trainer state, scheduler, seed log up to its step) and
    its model is the uninterrupted run's at that step; no temporary file is left anywhere."""
    leftovers = [os.path.join(d, n) for d, _, names in os.walk(out) for n in names if ".tmp" in n]
    assert leftovers == []
    for step in steps:
        folder = out / f"checkpoint-{step}"
        names = set(os.listdir(folder))
        assert {"trainer_state.json", "scheduler.pt", "config.json", "es_seed_log.jsonl"} <= names, names
        with open(folder / "trainer_state.json") as f:
            assert json.load(f)["global_step"] == step
        assert seed_log(folder) == seed_log(ref_out)[: step + 1]  # the header and steps 1..step
        if sharded:
            assert {f"es_master.rank{r:05d}-of-00002.safetensors" for r in range(2)} <= names
    assert_bitwise(weights(out / f"checkpoint-{steps[-1]}"), weights(ref_out / "model"))


# ---------------------------------------------------------------------------------------------- real kills
@pytest.mark.distributed
def test_killed_worker_restarts_and_ends_bitwise_as_uninterrupted(reference, tmp_path, tiny_model_dir):
    """Population parallelism, 2 processes: process 1 is SIGKILLed in the middle of iteration 2 (one of its members
    scored); torch elastic restarts both, which resume from checkpoint-1 and end with the uninterrupted weights and
    seed log. The config is docs/scaling.md's recipe with a plain config (no ``use_cpu``: the launcher's world is the
    trainer's, tests/trainer/test_launch_world.py); the other kill tests set ``use_cpu`` as the other launched tests."""
    ref_out, ref = reference
    result = elastic(tmp_path, tiny_model_dir, "--plain_config", "--kill_at_step", "2", "--kill_rank", "1")
    assert result["restart_count"] == 1  # the second attempt wrote the result: the kill happened
    assert result["world_size"] == 2 and result["args_world_size"] == 2 and result["use_cpu"] is True
    assert sorted(result["checkpoints_at_start"]) == ["checkpoint-1"]
    assert result["steps_run"] == [2]  # only the iteration in flight was run again
    assert result["replicas_identical"] == [True]
    assert_bitwise(weights(tmp_path / "model"), weights(ref_out / "model"))
    assert seed_log(tmp_path) == seed_log(ref_out)
    assert result["eval"]["eval_reward"] == ref["eval"]["eval_reward"]
    assert_complete_checkpoints(tmp_path, ref_out)
    rebuilt = replay(build_llama_from(tiny_model_dir), str(tmp_path))
    assert_bitwise(dict(rebuilt.state_dict()), weights(tmp_path / "model"))


@pytest.mark.distributed
def test_kill_during_checkpoint_write_falls_back_to_the_previous_checkpoint(reference, tmp_path, tiny_model_dir):
    """Process 0 is SIGKILLed while it writes checkpoint-2: after the model, seed log and ES state, before the
    scheduler and trainer_state.json. The restarted run skips that partial folder, resumes from checkpoint-1, and
    still ends bitwise as the uninterrupted run (checkpoint-2 rewritten whole)."""
    ref_out, _ = reference
    result = elastic(tmp_path, tiny_model_dir, "--kill_in_save_at_step", "2", "--kill_rank", "0")
    assert result["restart_count"] == 1
    partial = result["checkpoints_at_start"]["checkpoint-2"]
    assert "model.safetensors" in partial and "es_seed_log.jsonl" in partial
    assert "trainer_state.json" not in partial and "scheduler.pt" not in partial
    assert "trainer_state.json" in result["checkpoints_at_start"]["checkpoint-1"]
    assert result["steps_run"] == [2]  # resumed from checkpoint-1, not from the partial checkpoint-2
    assert_bitwise(weights(tmp_path / "model"), weights(ref_out / "model"))
    assert seed_log(tmp_path) == seed_log(ref_out)
    assert_complete_checkpoints(tmp_path, ref_out)


@pytest.mark.distributed
def test_zero3_killed_worker_restarts_and_ends_bitwise_as_uninterrupted(reference_bf16, tmp_path, tiny_model_dir):
    """ZeRO-3 (DeepSpeed on gloo, launched by torchrun --max-restarts 1, bf16 model, fp32 master shards): process 1
    SIGKILLed in the middle of iteration 2; the restarted job resumes from checkpoint-1's shards and ends bitwise as
    the one-process run."""
    ref_out, _ = reference_bf16
    result = elastic(tmp_path, tiny_model_dir, "--mode", "zero3", "--dtype", "bfloat16", "--kill_at_step", "2",
                     "--kill_rank", "1")
    assert result["sharded"] and result["restart_count"] == 1
    assert sorted(result["checkpoints_at_start"]) == ["checkpoint-1"]
    assert result["steps_run"] == [2]
    assert_bitwise(weights(tmp_path / "model"), weights(ref_out / "model"))
    assert seed_log(tmp_path) == seed_log(ref_out)
    assert_complete_checkpoints(tmp_path, ref_out, sharded=True)


def build_llama_from(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir)


# ---------------------------------------------------------------------------------------------- choosing, one process
@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: one intra-op thread is faster (and leaves the other cores to other jobs)."""


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tokenizer):
    """A 2-iteration run with a checkpoint after each iteration, and its final weights."""
    args = es_args(tmp_path_factory.mktemp("run"), max_steps=2, save_strategy="steps", save_steps=1)
    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    trainer.train()
    return args.output_dir, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def relaunch(output_dir, tokenizer, resume_from_checkpoint=AUTO_RESUME, **kwargs):
    """A new trainer on ``output_dir`` as a relaunched job builds it (train() called without arguments)."""
    args = es_args(Path(output_dir).parent, output_dir=output_dir, max_steps=2, save_strategy="steps",
                   save_steps=1, resume_from_checkpoint=resume_from_checkpoint, **kwargs)
    steps = []

    class Steps(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            steps.append(state.global_step)

    trainer = ESTrainer(build_llama(tokenizer), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer, callbacks=[Steps()])
    trainer.train()
    return trainer, steps


def copy_run(two_checkpoints, tmp_path, drop=()):
    """The run's folder copied to ``tmp_path/out``, without the files ``drop`` names (``checkpoint-2/x``)."""
    out = str(tmp_path / "out")
    shutil.copytree(two_checkpoints[0], out)
    for name in drop:
        os.remove(os.path.join(out, name))
    return out


def test_latest_without_a_checkpoint_starts_a_new_run(tmp_path, tokenizer, two_checkpoints):
    trainer, steps = relaunch(str(tmp_path / "empty"), tokenizer)
    assert steps == [1, 2]
    assert_bitwise(dict(trainer.model.state_dict()), two_checkpoints[1])


def test_latest_resumes_from_the_newest_complete_checkpoint(tmp_path, tokenizer, two_checkpoints, caplog):
    """checkpoint-2 lost its trainer_state.json (a kill mid-write): skipped with a warning naming it; checkpoint-1
    resumed, iteration 2 run again, the uninterrupted weights."""
    out = copy_run(two_checkpoints, tmp_path, drop=["checkpoint-2/trainer_state.json"])
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            trainer, steps = relaunch(out, tokenizer)
    finally:
        hf_logging.disable_propagation()
    assert steps == [2]
    assert_bitwise(dict(trainer.model.state_dict()), two_checkpoints[1])
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and os.path.join(out, "checkpoint-2") in skipped[0]
    assert "trainer_state.json" in skipped[0]


def test_latest_skips_a_truncated_trainer_state(tmp_path, tokenizer, two_checkpoints):
    out = copy_run(two_checkpoints, tmp_path)
    with open(os.path.join(out, "checkpoint-2", "trainer_state.json"), "r+") as f:
        f.truncate(20)
    trainer, steps = relaunch(out, tokenizer)
    assert steps == [2]
    assert_bitwise(dict(trainer.model.state_dict()), two_checkpoints[1])


def test_latest_with_every_step_done_runs_nothing_more(tmp_path, tokenizer, two_checkpoints):
    """A job that had finished and is relaunched (e.g. by a scheduler): it resumes at max_steps and stops."""
    trainer, steps = relaunch(copy_run(two_checkpoints, tmp_path), tokenizer)
    assert steps == [] and trainer.state.global_step == 2
    assert_bitwise(dict(trainer.model.state_dict()), two_checkpoints[1])


def test_path_in_the_config_is_resumed(tmp_path, tokenizer, two_checkpoints):
    out = copy_run(two_checkpoints, tmp_path)
    trainer, steps = relaunch(str(tmp_path / "elsewhere"), tokenizer,
                              resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
    assert steps == [2]
    assert_bitwise(dict(trainer.model.state_dict()), two_checkpoints[1])


def test_latest_does_not_skip_a_checkpoint_of_other_settings(tmp_path, tokenizer, two_checkpoints):
    """Only incomplete folders are skipped: a complete checkpoint of other settings is refused by name."""
    out = copy_run(two_checkpoints, tmp_path)
    with pytest.raises(ValueError, match=r"sigma \(checkpoint: 0.02, this run: 0.03\)"):
        relaunch(out, tokenizer, sigma=0.03)


def test_incomplete_zero3_shard_set_is_incomplete(tmp_path, tokenizer, two_checkpoints):
    """A checkpoint whose per-process master shards miss one rank (that process killed before writing it) is not
    complete, so "latest" would skip it."""
    from safetensors.torch import save_file

    args = es_args(tmp_path, max_steps=2)
    trainer = ESTrainer(build_llama(tokenizer, dtype=torch.bfloat16), mean_code, args=args, train_dataset=prompts(),
                        processing_class=tokenizer)
    folder = tmp_path / "ckpt"
    shutil.copytree(os.path.join(two_checkpoints[0], "checkpoint-2"), folder)
    save_file({"x": torch.zeros(1)}, folder / "es_master.rank00000-of-00002.safetensors")
    assert "es_master.safetensors" in trainer._missing_checkpoint_files(str(folder))
    save_file({"x": torch.zeros(1)}, folder / "es_master.rank00001-of-00002.safetensors")
    assert "es_master.safetensors" not in trainer._missing_checkpoint_files(str(folder))
