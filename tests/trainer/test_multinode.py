"""Several "nodes" on one host: two ``torchrun --nnodes 2 --nproc_per_node 2`` launchers (node ranks 0 and 1) meet at a
static rendezvous on 127.0.0.1 and run ``tests/distributed/run_es.py`` as one job of W = 4 CPU processes (gloo).

Population parallelism (8 members: 2 per process) ends bitwise where 1 process ends (weights, seed log, rewards; 2
processes on one node against 1: tests/trainer/test_distributed.py), and the bytes each process receives per iteration
are counted exactly and compared with what a GRPO step all-reduces for the same model (``bytes_table``; ``python
tests/trainer/test_multinode.py`` prints the table for W = 1, 2 and 4). ZeRO-3 over the 2 nodes (a bf16 model
partitioned over the 4 processes) ends bitwise where one process ends.
"""

import json
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest
from transformers import AutoModelForCausalLM
from paths import TESTS

HERE = TESTS
sys.path.insert(0, HERE)

from test_distributed import SCRIPT, assert_bitwise, run_here, seed_log, torchrun, weights  # noqa: E402

POPULATION = 8  # 2 members per process with W = 4
PROMPTS = 4  # run_es.py's prompt_batch_size
REWARD_FUNCS = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(out, model_dir, *extra, nproc_per_node=2, timeout=420):
    """Two torchrun launchers on this host, node ranks 0 and 1, static rendezvous on 127.0.0.1 (node 0 holds ranks
    0 and 1, node 1 ranks 2 and 3). Returns process 0's ``result.json``."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(nproc_per_node),
                "--master_addr", "127.0.0.1", "--master_port", str(port)]
    job = [SCRIPT, "--model", model_dir, "--out", str(out), *extra]
    os.makedirs(out, exist_ok=True)
    logs = [os.path.join(out, f"node{rank}.log") for rank in (0, 1)]  # files: a full pipe would stall a launcher
    nodes = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as f:
                nodes.append(subprocess.Popen([*launcher, "--node_rank", str(rank), *job], env=env, stdout=f,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for node in nodes:
            node.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for rank, (node, log) in enumerate(zip(nodes, logs)):
        with open(log) as f:
            assert node.returncode == 0, f"node {rank} failed:\n{f.read()[-6000:]}"
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def pickle_size(rows: int) -> int:
    return len(pickle.dumps([{"prompt": f"Write: {i}"} for i in range(rows)]))


def stats_bytes(population=POPULATION, reward_funcs=REWARD_FUNCS, shares=1) -> int:
    """The per-member statistics all-reduced once per iteration (float64): ``population x (6 + 2R)`` and TRL's
    completion statistics ``population x (6 + R + 6 x shares)``."""
    return 8 * population * (6 + 2 * reward_funcs) + 8 * population * (6 + reward_funcs + 6 * shares)


def es_bytes_per_iteration(world: int) -> int:
    """Bytes into each process per iteration, counted as ESTrainer counts them (``comm/bytes``): the gathered
    prompt rows (one int64 size and one padded pickle per process) and the all-reduced statistics."""
    if world == 1:
        return 0
    return 8 * world + world * pickle_size(PROMPTS // world) + stats_bytes()


def es_cross_node_bytes(world: int, nodes: int = 2) -> int:
    """Bytes per iteration that node 1 must receive from node 0 (and back), whatever the collective algorithm: node
    0's shares of the gathered rows (its processes' int64 sizes and pickles) and node 0's partial sum of the
    statistics."""
    other = world - world // nodes
    return other * (8 + pickle_size(PROMPTS // world)) + stats_bytes()


def grpo_bytes(params: int, world: int) -> dict:
    """A GRPO (DDP) step all-reduces the fp32 gradient of every trainable parameter, ``G = 4 x params`` bytes. A ring
    all-reduce (reduce-scatter then all-gather) sends and receives ``2 (W - 1) / W x G`` bytes per process; across a
    2-node boundary at least ``G`` bytes must cross each way (the other node's partial sum)."""
    grad = 4 * params
    return {"gradient_bytes": grad, "ring_received_per_process": 2 * (world - 1) * grad // world,
            "ring_sent_plus_received_per_process": 4 * (world - 1) * grad // world, "cross_node_min": grad}


def bytes_table(results: dict[int, dict], params: int) -> list[dict]:
    """One row per (W, process): its node and its counted ``comm/bytes`` per iteration, with GRPO's figures."""
    rows = []
    for world, result in sorted(results.items()):
        for proc in result.get("comm_bytes_per_process", [{"rank": 0, "node": 0, "comm_bytes": result["comm_bytes"]}]):
            grpo = grpo_bytes(params, world) if world > 1 else {}
            rows.append({"W": world, "rank": proc["rank"], "node": proc["node"],
                         "es_iter1": proc["comm_bytes"][0], "es_iter2": proc["comm_bytes"][-1],
                         "grpo_ring_received": grpo.get("ring_received_per_process", 0),
                         "grpo_ring_sent_plus_received": grpo.get("ring_sent_plus_received_per_process", 0)})
    return rows


def format_table(rows: list[dict], params: int) -> str:
    lines = [f"trainable parameters P = {params:,}; GRPO gradient 4P = {4 * params:,} bytes",
             "W rank node | ES bytes in: iter 1, iter 2 | GRPO ring all-reduce: received, sent+received per step"]
    for r in rows:
        lines.append(f"{r['W']} {r['rank']:>4} {r['node']:>4} | {r['es_iter1']:>10,.0f} {r['es_iter2']:>10,.0f} | "
                     f"{r['grpo_ring_received']:>10,} {r['grpo_ring_sent_plus_received']:>12,}")
    lines.append(f"cross-node (node 0 -> node 1, each way) per iteration, W = 4: ES {es_cross_node_bytes(4):,} bytes "
                 f"vs GRPO >= {4 * params:,} bytes")
    return "\n".join(lines)


def trainable_parameters(model_dir) -> int:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.distributed
def test_two_nodes_of_two_processes_match_one_process(tmp_path, tiny_model_dir):
    """W = 4 over 2 nodes and W = 1: bitwise the same weights, seed log and rewards. (W = 2 on one node against W = 1,
    weights, seed log, rewards and the exact bytes per iteration: tests/trainer/test_distributed.py's
    ``test_population_parallelism_matches_one_process``; ``python tests/trainer/test_multinode.py`` runs all three.)"""
    args = ("--population", str(POPULATION))
    one_out, one = run_here(tmp_path / "w1", tiny_model_dir, population=POPULATION)
    four = two_nodes(tmp_path / "w4", tiny_model_dir, *args)
    assert (one["world_size"], four["world_size"]) == (1, 4)
    assert not four["sharded"] and four["model_wrapped"] == "LlamaForCausalLM"
    assert four["replicas_identical"] == [True, True]
    assert [p["node"] for p in four["comm_bytes_per_process"]] == [0, 0, 1, 1]
    assert_bitwise(weights(tmp_path / "w4" / "model"), weights(one_out / "model"))
    assert seed_log(tmp_path / "w4") == seed_log(one_out)
    assert four["eval"]["eval_reward"] == one["eval"]["eval_reward"]
    for key in ("reward", "reward_std", "reward_min", "reward_max", "rewards/mean_code/mean", "completion_tokens"):
        assert [h[key] for h in four["log_history"] if "reward" in h] == \
               [h[key] for h in one["log_history"] if "reward" in h], key
    # Bytes into each process, per iteration: every process the same; iteration 1 adds the 16-byte fingerprints.
    per_iteration = es_bytes_per_iteration(4)
    for proc in four["comm_bytes_per_process"]:
        assert proc["comm_bytes"] == [per_iteration + 16 * 4, per_iteration], proc
    params = trainable_parameters(tiny_model_dir)
    assert es_bytes_per_iteration(4) < grpo_bytes(params, 4)["ring_received_per_process"] / 50
    print("\n" + format_table(bytes_table({1: one, 4: four}, params), params))


@pytest.mark.distributed
def test_zero3_over_two_nodes_matches_one_process(tmp_path, tiny_model_dir):
    """DeepSpeed ZeRO-3 under the two torchrun launchers: a bf16 model partitioned over 4 processes on 2 nodes, fp32
    master partitions, each process scoring every member on its prompt; the one-process weights and seed log."""
    one_out, one = run_here(tmp_path / "w1", tiny_model_dir, population=POPULATION, dtype="bfloat16")
    four = two_nodes(tmp_path / "zero3", tiny_model_dir, "--population", str(POPULATION), "--mode", "zero3",
                     "--dtype", "bfloat16")
    assert four["world_size"] == 4 and four["sharded"] and four["model_wrapped"] == "DeepSpeedEngine"
    assert_bitwise(weights(tmp_path / "zero3" / "model"), weights(one_out / "model"))
    assert seed_log(tmp_path / "zero3") == seed_log(one_out)
    assert four["eval"]["eval_reward"] == one["eval"]["eval_reward"]


if __name__ == "__main__":  # prints the bytes table: python tests/trainer/test_multinode.py
    import tempfile

    from tiny import build_llama, build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        from pathlib import Path

        tmp = Path(tmp)
        tokenizer = build_tokenizer()
        build_llama(tokenizer).save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        model_dir, args = str(tmp / "model"), ("--population", str(POPULATION))
        results = {1: run_here(tmp / "w1", model_dir, population=POPULATION)[1],
                   2: torchrun(tmp / "w2", model_dir, *args), 4: two_nodes(tmp / "w4", model_dir, *args)}
        params = trainable_parameters(model_dir)
        print(format_table(bytes_table(results, params), params))
        for size, p in (("SmolLM2-135M", 134_515_008), ("Qwen2.5-0.5B", 494_032_768), ("Qwen2.5-1.5B", 1_543_714_304),
                        ("Qwen2.5-7B", 7_615_616_512)):
            g = grpo_bytes(p, 4)
            print(f"{size}: GRPO ring received per process per step (W = 4) {g['ring_received_per_process']:,} "
                  f"bytes; ES {es_bytes_per_iteration(4):,} bytes (independent of the model size)")
