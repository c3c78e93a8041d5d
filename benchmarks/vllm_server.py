"""ES on vLLM servers, seeds only: members/s and bytes per iteration with 1 and 2 servers, against the colocated
engine and against a weight-broadcast design's bytes.

For each server count ``S`` in ``--servers``: ``S`` servers are started with the launch line users copy
(``trl-es vllm-serve MODEL``, 127.0.0.1), initialised from the model's seed-log header, then one ES iteration runs
as the trainer runs it, through the trainer's ``VLLMServerEngine``: members dispatched dynamically over the servers
(``map_chunks``, one member in flight per server): perturb -> greedy completions of ``--prompts`` arithmetic prompts
x ``--new_tokens`` tokens -> restore, then the engine's weight sync (every server applies the update itself),
checked against the HF model's checksum.
Bytes are the request + response bodies of the ES calls (``/collective_rpc``); completions (prompts and token ids
over ``/v1/completions``) are counted apart, as a colocated engine has them too. A weight-broadcast design (engine 0
sends every weight to the others after each update, as the ES anchors do) moves ``parameters x bytes per parameter x
(S - 1)``; trl_es's colocated layout moves nothing, but each trainer process holds an engine.

``--colocated`` then times the same members on the colocated engine (``VLLMEngine``, in this process) after the
servers are gone. Needs vLLM (``.venv-vllm`` on a CPU machine)::

    .venv-vllm/bin/python benchmarks/vllm_server.py --servers 1 2 --colocated --output_file runs/vllm_server.json
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import torch

from trl_es.cli.vllm_serve_command import served_folder
from trl_es.es.noise import DEFAULT_TABLE_SIZE, make_noise_source
from trl_es.es.perturbation import TrainedParameters, select_parameters
from trl_es.es.strategy import EvolutionStrategy, SequentialPopulation
from trl_es.files import write_json
from trl_es.generation.vllm_server import ESServerClient, ServerError, VLLMServerEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(folder: str, count: int, log_dir: str, max_model_len: int) -> list[tuple[subprocess.Popen, str]]:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    servers = []
    for i in range(count):
        port = free_port()
        command = [sys.executable, "-m", "trl_es.cli", "vllm-serve", folder, "--port", str(port), "--dtype",
                   "float32", "--", "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(1 << 28)]
        log = open(os.path.join(log_dir, f"server{i}.log"), "ab")
        servers.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True), f"http://127.0.0.1:{port}"))
    return servers


def wait_for(url: str, process: subprocess.Popen, seconds: float) -> ESServerClient:
    deadline = time.monotonic() + seconds
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {process.returncode} (see its log)")
        try:
            return ESServerClient(url, connection_timeout=0)
        except ServerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def stop(servers) -> None:
    for process, _ in servers:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict

    rows = make_arithmetic_dataset_dict(count, 1, 1, seed=0)["train"]
    return [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
            for r in rows]


def server_iteration(clients, strategy, model, tokenizer, header, prompts, new_tokens: int) -> dict:
    """One iteration as ``ESTrainer`` runs it on servers: the trainer's :class:`VLLMServerEngine` dispatches the
    members (``map_chunks``: one member in flight per server), then syncs the update to every server (checked)."""
    from transformers import GenerationConfig

    from trl_es.es.strategy import EngineSequentialPopulation
    from trl_es.es.seedlog import SeedLog

    log = SeedLog(header)
    engine = VLLMServerEngine(tokenizer, clients, seed_log=lambda: log)
    population = EngineSequentialPopulation(engine)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id)
    members = strategy.ask(0)
    before = [c.rpc_bytes for c in clients]

    def roll(group):
        with population.apply(strategy.params, strategy.noise, [members[i] for i in group], strategy.sigma, model):
            return engine.generate(model, tokenizer, prompts, config).ids

    start = time.perf_counter()
    completions = engine.map_chunks(roll, [[i] for i in range(len(members))])
    members_seconds = time.perf_counter() - start
    told = strategy.tell(members, torch.randn(len(members), generator=torch.Generator().manual_seed(0)), 1e-3)
    log.append(1, members, told.coefficients, told.learning_rate)
    start = time.perf_counter()
    engine.sync_weights(model)  # every server applies the record itself; checksums compared with the model's
    update_seconds = time.perf_counter() - start
    return {"members": len(members), "members_seconds": members_seconds,
            "members_per_second": len(members) / members_seconds, "update_seconds": update_seconds,
            "es_call_bytes_per_server": [c.rpc_bytes - b for c, b in zip(clients, before, strict=True)],
            "members_rerun": engine.members_rerun, "completions": completions}


def colocated_iteration(model, tokenizer, strategy, prompts, new_tokens: int) -> dict:
    from accelerate import Accelerator
    from transformers import GenerationConfig

    from trl_es.es.strategy import EngineSequentialPopulation
    from trl_es.generation.vllm_engine import VLLMEngine

    engine = VLLMEngine(model, tokenizer, Accelerator(), kv_cache_memory_bytes=1 << 28, max_model_length=512)
    engine.sync_weights(model, strategy.params, strategy.noise)
    population = EngineSequentialPopulation(engine)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id)
    members = strategy.ask(0)
    start = time.perf_counter()
    completions = []
    for member in members:
        with population.apply(strategy.params, strategy.noise, [member], strategy.sigma, model):
            completions.append(engine.generate(model, tokenizer, prompts, config).ids)
    seconds = time.perf_counter() - start
    engine.close()
    return {"members": len(members), "members_seconds": seconds, "members_per_second": len(members) / seconds,
            "completions": completions}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    p.add_argument("--servers", nargs="*", type=int, default=[1, 2])
    p.add_argument("--population", type=int, default=8)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--new_tokens", type=int, default=12)
    p.add_argument("--sigma", type=float, default=1e-3)
    p.add_argument("--colocated", action="store_true", help="also time the members on the colocated engine")
    p.add_argument("--start_seconds", type=float, default=600)
    p.add_argument("--output_file", default=None)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = served_folder(args.model, None, "float32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = prompt_ids(tokenizer, args.prompts)
    numel = sum(t.numel() for _, t in model.named_parameters())
    log_dir = os.path.dirname(os.path.abspath(args.output_file or "vllm_server.json"))
    os.makedirs(log_dir, exist_ok=True)
    results = {"model": args.model, "parameters": numel, "population": args.population, "prompts": args.prompts,
               "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "servers": {}}
    for count in args.servers:
        strategy = EvolutionStrategy(TrainedParameters(select_parameters(model)),
                                     make_noise_source(DEFAULT_TABLE_SIZE, "table"), SequentialPopulation(),
                                     args.sigma, args.population, antithetic=True)
        header = {"noise": strategy.noise.describe(), "perturbation": strategy.perturbation.describe(),
                  "master_dtype": "float32", "parameters": [[e.name, e.numel] for e in strategy.params.entries]}
        servers = start_servers(folder, count, log_dir, 512)
        try:
            start = time.perf_counter()
            clients = [wait_for(url, process, args.start_seconds) for process, url in servers]
            started = time.perf_counter() - start
            start = time.perf_counter()
            for c in clients:
                c.init(model, header)
            init_seconds = time.perf_counter() - start
            init_bytes = [c.rpc_bytes for c in clients]
            row = server_iteration(clients, strategy, model, tokenizer, header, prompts, args.new_tokens)
        finally:
            stop(servers)
        row.update(start_seconds=started, init_seconds=init_seconds, init_bytes_per_server=init_bytes,
                   broadcast_bytes_per_iteration=numel * 4 * (count - 1), weights_bytes=numel * 4)
        print(f"{count} server(s): {row['members_per_second']:.3f} members/s, update {row['update_seconds']:.2f} s, "
              f"ES-call bytes per iteration per server {row['es_call_bytes_per_server']}, a broadcast design "
              f"{row['broadcast_bytes_per_iteration']} B", flush=True)
        results["servers"][str(count)] = row
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # the base again
    if args.colocated:
        strategy = EvolutionStrategy(TrainedParameters(select_parameters(model)),
                                     make_noise_source(DEFAULT_TABLE_SIZE, "table"), SequentialPopulation(),
                                     args.sigma, args.population, antithetic=True)
        row = colocated_iteration(model, tokenizer, strategy, prompts, args.new_tokens)
        print(f"colocated: {row['members_per_second']:.3f} members/s", flush=True)
        results["colocated"] = row
        first = results["servers"].get(str(args.servers[0]))
        if first is not None:
            results["colocated_completions_equal_server"] = row["completions"] == first["completions"]
    if args.output_file:
        write_json(args.output_file, results)
    return results


if __name__ == "__main__":
    main()
