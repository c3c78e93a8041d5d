"""Multi-process ES on CPU (gloo): population parallelism and DeepSpeed ZeRO-2/3 end bitwise where one process ends.

Every test launches ``tests/distributed/run_es.py`` (2 iterations of a tiny Llama, population 4, 4 prompts, greedy
decoding) with two processes and compares with the same job run in this process (one process, one thread).
"""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_es import replay

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "distributed", "run_es.py")
sys.path.insert(0, os.path.join(HERE, "distributed"))

import run_es

pytestmark = pytest.mark.distributed

STATS_BYTES = 4 * (4 + 2 * 1) * 8  # population x (sum, count, completions, tokens, per-function sum and count) fp64


def launch(launcher: list[str], out, model_dir, *extra, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [*launcher, SCRIPT, "--model", model_dir, "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def torchrun(out, model_dir, *extra):
    return launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", str(29600 + os.getpid() % 300)], out, model_dir, *extra)


def deepspeed(out, model_dir, *extra):
    return launch(["deepspeed", "--num_gpus", "2", "--master_port", str(29900 + os.getpid() % 300)],
                  out, model_dir, *extra)


def weights(path):
    return {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def seed_log(path):
    with open(os.path.join(path, "es_seed_log.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """The job in one process (one thread, as the launched processes)."""
    out = tmp_path_factory.mktemp("single")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_es.run("plain", tiny_model_dir, str(out))
    finally:
        torch.set_num_threads(threads)
    return out, result


def test_reference_trains(reference, tiny_model_dir):
    out, result = reference
    assert result["world_size"] == 1 and result["comm_bytes"] == [0.0, 0.0]
    base, trained = weights(tiny_model_dir), weights(out / "model")
    assert any(not torch.equal(base[k], trained[k]) for k in base)


def test_population_parallelism_matches_one_process(reference, tmp_path, tiny_model_dir):
    """Process 1 starts from different weights: ESTrainer finds out (fingerprints) and broadcasts process 0's."""
    ref_out, ref = reference
    result = torchrun(tmp_path, tiny_model_dir, "--skew_rank", "1")
    assert result["world_size"] == 2 and not result["sharded"]
    assert result["model_wrapped"] == "LlamaForCausalLM"  # not DistributedDataParallel
    assert result["replicas_identical"] == [True, True]  # after each iteration, on every process
    assert_bitwise(weights(tmp_path / "model"), weights(ref_out / "model"))
    assert seed_log(tmp_path) == seed_log(ref_out)
    assert result["eval"]["eval_reward"] == ref["eval"]["eval_reward"]
    train_logs = [h for h in result["log_history"] if "reward" in h]
    ref_logs = [h for h in ref["log_history"] if "reward" in h]
    for key in ("reward", "reward_std", "rewards/mean_code/mean", "completion_tokens"):
        assert [h[key] for h in train_logs] == [h[key] for h in ref_logs], key
    # Bytes into each process: 2 prompt rows pickled per process (all the same size here) gathered with their
    # int64 sizes, the per-member statistics; on the first iteration also the 16-byte weight fingerprints and the
    # broadcast of process 0's parameters, buffers, fp32 master and anchor (3 copies of the parameters).
    rows = len(pickle.dumps([{"prompt": "Write: 0"}, {"prompt": "Write: 1"}]))
    per_iteration = 2 * 8 + 2 * rows + STATS_BYTES
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    broadcast = sum(3 * p.numel() * 4 for p in model.parameters()) + sum(b.numel() * 4 for b in model.buffers())
    assert result["comm_bytes"] == [per_iteration + 2 * 16 + broadcast, per_iteration]
    # The seed log, written by process 0, replays to the trained weights.
    rebuilt = replay(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path))
    assert_bitwise({k: v for k, v in rebuilt.state_dict().items()}, weights(tmp_path / "model"))


def test_zero3_matches_one_process(reference, tmp_path, tiny_model_dir):
    """Parameters partitioned over 2 processes (loaded under zero.Init); members scored by both together."""
    ref_out, ref = reference
    result = deepspeed(tmp_path, tiny_model_dir, "--mode", "zero3", "--save_steps", "2")
    assert result["world_size"] == 2 and result["sharded"]
    assert result["model_wrapped"] == "DeepSpeedEngine"
    trained = weights(tmp_path / "model")  # gathered by Trainer.save_model
    assert_bitwise(trained, weights(ref_out / "model"))
    assert_bitwise(weights(tmp_path / "checkpoint-2"), trained)
    assert seed_log(tmp_path) == seed_log(ref_out)
    assert seed_log(tmp_path / "checkpoint-2") == seed_log(ref_out)
    assert result["eval"]["eval_reward"] == ref["eval"]["eval_reward"]  # 9 prompts: 5 on process 0, 4 on 1
    gathered = [h["comm/param_gather_bytes"] for h in result["log_history"] if "comm/param_gather_bytes" in h]
    assert len(gathered) == 2 and all(g > 0 for g in gathered)


def test_zero2_runs_as_population_parallelism(reference, tmp_path, tiny_model_dir):
    ref_out, _ = reference
    result = deepspeed(tmp_path, tiny_model_dir, "--mode", "zero2")
    assert result["model_wrapped"] == "DeepSpeedEngine" and not result["sharded"]
    assert result["replicas_identical"] == [True, True]
    assert_bitwise(weights(tmp_path / "model"), weights(ref_out / "model"))
