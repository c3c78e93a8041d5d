"""The ES server worker extension (``vllm serve --worker-extension-cls ...ESServerWorkerExtension``) without vLLM: its
methods on a stand-in worker whose ``model_runner.reload_weights`` copies HF-named tensors into an HF model, as
vLLM's in-place reload does. Members, restores and updates must be bitwise the trainer's."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from tiny import build_llama, build_qwen2

from trl_es import ESConfig, ESTrainer
from trl_es.es.strategy import EvolutionStrategy
from trl_es.generation.vllm_server_worker import ESServerWorkerExtension, server_checksum


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def mean_code(completions, **kwargs):
    return [sum(map(ord, c)) / (128 * max(1, len(c))) for c in completions]


class StandInRunner:
    """vLLM's ``model_runner`` as the extension uses it: ``model_config``, ``reload_weights``, ``get_model``."""

    def __init__(self, model, directory):
        self.model = model
        self.model_config = SimpleNamespace(model=directory, dtype=next(model.parameters()).dtype)
        self.reloads = 0

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights_iterator:
                named[name].copy_(tensor)
        self.reloads += 1

    def get_model(self):
        return self.model


class StandInWorker(ESServerWorkerExtension):
    def __init__(self, runner):
        self.model_runner = runner


def served(model_fn, tmp_path):
    """A worker over a fresh copy of the checkpoint ``model_fn()`` saves (the server's own weights)."""
    directory = str(tmp_path / "served")
    model_fn().save_pretrained(directory)
    return StandInWorker(StandInRunner(model_fn(), directory))


def header_of(strategy: EvolutionStrategy) -> dict:
    return {"noise": strategy.noise.describe(), "perturbation": strategy.perturbation.describe(),
            "master_dtype": "float32", "awd_penalty": strategy.awd_penalty,
            "parameters": [[e.name, e.numel] for e in strategy.params.entries]}


def spec_of(model, header, records=(), awd=False) -> str:
    return json.dumps({"header": header, "weights": [n for n, _ in model.named_parameters()],
                       "records": list(records), "awd": awd})


@pytest.mark.parametrize("build", [build_llama, build_qwen2])  # untied head; tied head (a weight named once)
def test_members_restores_and_updates_are_the_trainers_bitwise(tmp_path, tokenizer, build):
    model_fn = lambda: build(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    worker = served(model_fn, tmp_path)
    model = model_fn()
    strategy = EvolutionStrategy.for_module(model, sigma=0.02, population_size=4, antithetic=True, awd_lambda=0.5)
    info = worker.es_server_init(spec_of(model, header_of(strategy), awd=True))
    base = snapshot(model)
    assert info == {"step": 0, "checksum": server_checksum(model.named_parameters()),
                    "num_parameters": len(strategy.params.entries)}
    records = []
    for step in range(2):
        members = strategy.ask(step)
        for member in members:  # arguments as JSON strings carry them
            with strategy.apply([member], model):
                expected = snapshot(model)
            worker.es_server_perturb(str(member.seed), str(member.sign), "0.02")
            assert_bitwise(snapshot(worker.model_runner.model), expected)
            worker.es_server_restore()
            assert_bitwise(snapshot(worker.model_runner.model), snapshot(model))
        told = strategy.tell(members, torch.tensor([0.3, -1.0, 2.0, 0.5]), learning_rate=0.01)
        records.append({"step": step + 1, "members": [[m.seed, m.sign] for m in members],
                        "coefficients": told.coefficients, "learning_rate": told.learning_rate,
                        "awd_shrink": told.shrink})
        assert worker.es_server_update(json.dumps(records[-1])) == {
            "step": step + 1, "checksum": server_checksum(model.named_parameters())}
        assert_bitwise(snapshot(worker.model_runner.model), snapshot(model))
    assert any(not torch.equal(base[k], v) for k, v in snapshot(model).items())  # the updates moved the weights
    # a server that restarted catches up from the base checkpoint and the records: seeds, not weights
    restarted = StandInWorker(StandInRunner(model_fn(), worker.model_runner.model_config.model))
    assert restarted.es_server_step() == -1
    assert restarted.es_server_init(spec_of(model, header_of(strategy), records, awd=True))["checksum"] == \
        server_checksum(model.named_parameters())
    assert_bitwise(snapshot(restarted.model_runner.model), snapshot(model))


def test_a_trainers_seed_log_initialises_a_server_to_its_weights(tmp_path, tokenizer):
    args = ESConfig(output_dir=str(tmp_path / "run"), max_steps=2, population_size=4, prompt_batch_size=4,
                    max_completion_length=6, sigma=0.05, learning_rate=0.05, awd_lambda=1.0, report_to=[],
                    save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True)
    trainer = ESTrainer(build_llama(tokenizer, dtype=torch.bfloat16), mean_code, args=args, processing_class=tokenizer,
                        train_dataset=Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(8)]}))
    trainer.train()
    worker = served(lambda: build_llama(tokenizer, dtype=torch.bfloat16), tmp_path)
    info = worker.es_server_init(spec_of(trainer.model, trainer.seed_log.header, trainer.seed_log.records))
    assert info["step"] == 2 and info["checksum"] == server_checksum(trainer.model.named_parameters())
    assert_bitwise(snapshot(worker.model_runner.model), snapshot(trainer.model))


def test_bad_calls_are_named_and_change_nothing(tmp_path, tokenizer):
    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    worker = served(model_fn, tmp_path)
    with pytest.raises(RuntimeError, match="es_server_init first"):
        worker.es_server_perturb(1, 1, 0.01)
    model = model_fn()
    strategy = EvolutionStrategy.for_module(model, sigma=0.02, population_size=2)
    header = header_of(strategy)
    with pytest.raises(ValueError, match="full-rank members in place"):
        worker.es_server_init(spec_of(model, {**header, "perturbation": {"type": "lowrank", "rank": 1}}))
    with pytest.raises(ValueError, match="missing \\['nope'\\]"):
        worker.es_server_init(json.dumps({"header": header, "weights": ["nope"]}))
    with pytest.raises(ValueError, match="JSON string"):
        worker.es_server_init("{not json")
    with pytest.raises(ValueError, match="steps 1..k in order; got steps \\[2\\]"):
        worker.es_server_init(spec_of(model, header, [{"step": 2}]))
    worker.es_server_init(spec_of(model, header))
    checksum = worker.es_server_checksum()
    for args in [(1, 2, 0.01), ("x", 1, 0.01), (1, 1, 0.0), (1, 1, "nan"), (-1, 1, 0.01)]:
        with pytest.raises(ValueError, match="es_server_perturb"):
            worker.es_server_perturb(*args)
    record = {"step": 1, "members": [[5, 1], [5, -1]], "coefficients": [1.0, -1.0], "learning_rate": 0.1}
    with pytest.raises(ValueError, match="at step 0, so it takes the record of step 1; got step 3"):
        worker.es_server_update({**record, "step": 3})
    with pytest.raises(ValueError, match="as many 'coefficients'"):
        worker.es_server_update({**record, "coefficients": [1.0]})
    with pytest.raises(ValueError, match="keeps no anchor"):
        worker.es_server_update({**record, "awd_shrink": 0.1})
    assert worker.es_server_checksum() == checksum == server_checksum(model.named_parameters())
    assert worker.es_server_step() == 0
    assert worker.es_server_update(record)["step"] == 1 and worker.es_server_checksum() != checksum


def test_a_checkpoint_without_safetensors_is_named(tmp_path, tokenizer):
    model = build_llama(tokenizer)
    worker = StandInWorker(StandInRunner(model, str(tmp_path)))
    strategy = EvolutionStrategy.for_module(model, sigma=0.02, population_size=2)
    with pytest.raises(FileNotFoundError, match="No .safetensors file"):
        worker.es_server_init(spec_of(model, header_of(strategy)))


# ------------------------------------------------------------------------------- the client over HTTP
class StandInServer:
    """``vllm serve``'s ES surface over real HTTP on 127.0.0.1: ``/health``, ``/v1/models``, ``/collective_rpc``
    (the stand-in worker's methods; an exception -> HTTP 500 with its message) and ``/v1/completions`` (greedy
    ``generate`` of the worker's model from token ids, ``return_token_ids``). With ``VLLM_API_KEY`` set, the ``/v1``
    routes answer 401 without ``Authorization: Bearer <key>``, as vLLM's authentication middleware; ``/collective_rpc``
    is not guarded (vLLM's GUARDED_PREFIX), so the extension's own check is what refuses there. ``headers`` records
    each request's ``(path, Authorization header, collective_rpc kwargs)``."""

    def __init__(self, worker):
        import os
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.worker, self.calls, self.dead, self.headers = worker, [], False, []
        server = self

        def guarded(handler, kwargs=None):  # vLLM's AuthenticationMiddleware: /v1 needs the key when the server has one
            key = os.environ.get("VLLM_API_KEY")
            server.headers.append((handler.path, handler.headers.get("Authorization"), kwargs))
            if key and handler.path.startswith("/v1") and handler.headers.get("Authorization") != f"Bearer {key}":
                handler._send(401, {"error": "Unauthorized"})
                return True
            return False

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                if server.dead:  # killed: the connection drops, no answer
                    self.close_connection = True
                    self.connection.close()
                    return
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if guarded(self):
                    return
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "stand-in"}]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if guarded(self, body.get("kwargs")):
                    return
                server.calls.append((self.path, body.get("method")))
                try:
                    if self.path == "/collective_rpc":
                        result = getattr(server.worker, body["method"])(*body["args"], **body["kwargs"])
                        self._send(200, {"results": [result]})
                    elif self.path == "/v1/completions":
                        self._send(200, {"choices": server.complete(body)})
                    else:
                        self._send(404, {"detail": "Not Found"})
                except Exception as error:  # noqa: BLE001 (vLLM answers 500 with the worker's error)
                    self._send(500, {"error": f"{type(error).__name__}: {error}"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def complete(self, body):
        model = self.worker.model_runner.model
        choices = []
        if body.get("temperature") != 0.0:
            raise ValueError("the stand-in decodes greedily only")
        kwargs = {"max_new_tokens": body["max_tokens"], "min_new_tokens": body.get("min_tokens", 0),
                  "do_sample": False, "pad_token_id": 0, "repetition_penalty": body.get("repetition_penalty", 1.0)}
        if body.get("stop_token_ids"):
            kwargs["eos_token_id"] = body["stop_token_ids"]
        for i, prompt in enumerate(body["prompt"]):
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), **kwargs)
            choices.append({"index": i, "prompt_token_ids": prompt, "token_ids": out[0, len(prompt):].tolist()})
        return choices[::-1]  # out of order: the client puts them back by index

    def kill(self):
        """Answer nothing from now on (every request's connection drops), as a SIGKILLed server."""
        self.dead = True

    def restart(self, worker):
        """Answer again, with a fresh worker (at step -1, the base checkpoint's weights)."""
        self.worker, self.dead = worker, False

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_client_drives_a_server_over_http_and_checks_its_weights(tmp_path, tokenizer):
    from trl_es.generation.vllm_server import ESServerClient, ServerError, ServerMismatchError

    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    server = StandInServer(served(model_fn, tmp_path))
    try:
        model = model_fn()
        strategy = EvolutionStrategy.for_module(model, sigma=0.05, population_size=2, antithetic=True)
        header = header_of(strategy)
        client = ESServerClient(server.url, timeout=60)
        assert client.model == "stand-in" and client.step() == -1
        assert client.init(model, header) == 0
        prompts = [[5, 6, 7], [8, 9]]
        members = strategy.ask(0)
        for member in members:
            client.perturb(member, 0.05)
            with strategy.apply([member], model), torch.no_grad():
                expected = [model.generate(torch.tensor([p]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
            assert client.generate(prompts, max_tokens=4, sampling={"min_tokens": 4}) == expected  # the member's completions, in prompt order
            client.restore()
        told = strategy.tell(members, torch.tensor([1.0, 0.0]), learning_rate=0.05)
        record = {"step": 1, "members": [[m.seed, m.sign] for m in members], "coefficients": told.coefficients,
                  "learning_rate": told.learning_rate, "awd_shrink": 0.0}
        client.update(record, model)  # checked against the trainer's weights
        assert client.step() == 1
        rpcs = [method for path, method in server.calls if path == "/collective_rpc"]
        assert rpcs == ["es_server_step", "es_server_init"] + ["es_server_perturb", "es_server_restore"] * 2 + [
            "es_server_update", "es_server_step"]
        with pytest.raises(ServerError, match=f"{server.url}: es_server_update failed with HTTP 500: .*at step 1"):
            client.update(record, model)  # a repeated update is refused by the server, and named
        with pytest.raises(ServerMismatchError, match=f"{server.url} does not hold the trainer's weights"):
            client.init(model, header)  # no records: the server holds the base, the trainer step 1
        assert client.init(model, header, [record]) == 1  # a catch-up from the seed log
    finally:
        server.close()
    with pytest.raises(ServerError, match="not reachable"):
        ESServerClient(server.url, connection_timeout=0)


def test_a_run_on_a_server_ends_bitwise_where_the_eager_engine_ends(tmp_path, tokenizer):
    """ESConfig(use_vllm=True, vllm_mode="server") against the stand-in server (greedy): the same completions, so
    the same fitness and updates; the server checks its weights against the trainer's after every step."""
    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    data = Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(8)]})

    def run(out, **kwargs):
        args = ESConfig(output_dir=str(tmp_path / out), max_steps=2, population_size=4, prompt_batch_size=4,
                        max_completion_length=6, sigma=0.05, learning_rate=0.05, temperature=0.0, awd_lambda=0.5,
                        report_to=[], save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, **kwargs)
        trainer = ESTrainer(model_fn(), mean_code, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        return trainer

    eager = run("eager")
    server = StandInServer(served(model_fn, tmp_path))
    try:
        on_server = run("server", use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url)
        assert on_server.generation_engine.describe() == {"name": "vllm_server", "base_urls": [server.url]}
        assert_bitwise(snapshot(on_server.model), snapshot(eager.model))
        assert any(not torch.equal(a, b) for a, b in zip(snapshot(model_fn()).values(), snapshot(eager.model).values()))
        assert_bitwise(snapshot(server.worker.model_runner.model), snapshot(eager.model))
        rpcs = [m for path, m in server.calls if path == "/collective_rpc"]
        # init from the (empty) seed log; per iteration 4 members, then the update; the trainer's model never moved
        assert rpcs.count("es_server_init") == 1 and rpcs.count("es_server_update") == 2
        assert rpcs.count("es_server_perturb") == rpcs.count("es_server_restore") == 8
        on_server.evaluate(data.select(range(2)))  # nothing new: checked, not re-initialised
        assert [m for p, m in server.calls if p == "/collective_rpc"][-2:] == ["es_server_step", "es_server_checksum"]
    finally:
        server.close()


def test_a_rollout_func_on_a_server_generates_with_each_member(tmp_path, tokenizer, monkeypatch):
    """rollout_func with vllm_mode="server": trainer.vllm_generation.generate runs on the server holding the member,
    so the run ends bitwise where the plain eager run ends; trainer.model keeps the unperturbed weights meanwhile."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    data = Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(8)]})
    base, calls, seen = snapshot(model_fn()), [], []  # seen: trainer.model's weights during each call

    def rollout_func(prompts, trainer):
        ids = tokenizer(prompts)["input_ids"]  # plain text, with special tokens, as GRPO tokenizes it
        prompt_ids, completion_ids, logprobs, token_ids = trainer.vllm_generation.generate(ids, None, 1)
        assert (prompt_ids, logprobs, token_ids) == (ids, None, None)
        calls.append(repr(completion_ids))
        seen.append(repr([p.sum().item() for p in trainer.model.parameters()]))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}

    def run(out, **kwargs):
        args = ESConfig(output_dir=str(tmp_path / out), max_steps=2, population_size=4, prompt_batch_size=4,
                        max_completion_length=6, sigma=0.05, learning_rate=0.05, temperature=0.0,
                        report_to=[], save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, **kwargs)
        trainer = ESTrainer(model_fn(), mean_code, args=args, train_dataset=data, processing_class=tokenizer,
                            rollout_func=rollout_func if kwargs else None)
        trainer.train()
        return trainer

    eager = run("eager")
    assert not calls
    server = StandInServer(served(model_fn, tmp_path))
    try:
        on_server = run("server", use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url)
        assert len(calls) == 8 and len(set(calls[:4])) == 4  # once per member, each its own completions
        assert len(set(seen[:4])) == len(set(seen[4:])) == 1 and seen[0] != seen[4]  # members on the server only
        assert_bitwise(snapshot(on_server.model), snapshot(eager.model))
        assert any(not torch.equal(a, b) for a, b in zip(base.values(), snapshot(eager.model).values()))
        with pytest.raises(AttributeError, match="only trainer.vllm_generation.generate"):
            on_server.vllm_generation.vllm_client  # noqa: B018 (TRL's client would miss the member)
        with pytest.raises(ValueError, match="takes token ids"):
            on_server.vllm_generation.generate(["Write: 1"], None, 1)
    finally:
        server.close()
    assert not hasattr(eager, "vllm_generation")  # as GRPOTrainer: only with use_vllm=True


class StartEnvironment:
    """reset draws its task from `random`: every member must get the same task for a row (common random numbers),
    also when two server threads roll members out at once."""

    def reset(self, **kwargs):
        import random

        self.start = random.randint(0, 9)
        return f" from {self.start}"

    def get_reward(self) -> float:
        return self.start / 10


def test_environments_on_two_servers_end_bitwise_where_the_eager_engine_ends(tmp_path, tokenizer, monkeypatch):
    """environment_factory with members dispatched over two stand-in servers (a pool per server thread): the resets,
    tasks and rewards are the eager run's, and the weights end bitwise equal."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write {i}"}] for i in range(8)]})
    tasks = []

    def reward(completions, environments, **kwargs):
        tasks.append(tuple(e.start for e in environments))
        return [sum(map(ord, c[0]["content"])) / 1000 + e.start for c, e in zip(completions, environments)]

    def run(out, **kwargs):
        args = ESConfig(output_dir=str(tmp_path / out), max_steps=2, population_size=4, prompt_batch_size=3,
                        max_completion_length=5, sigma=0.05, learning_rate=0.05, temperature=0.0,
                        report_to=[], save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, **kwargs)
        trainer = ESTrainer(model_fn(), reward, args=args, train_dataset=data, processing_class=tokenizer,
                            environment_factory=StartEnvironment)
        trainer.train()
        history = [h["rewards/StartEnvironment/mean"] for h in trainer.state.log_history if "reward" in h]
        return trainer, history

    eager, eager_history = run("eager")
    eager_tasks, tasks[:] = list(tasks), []
    assert len(set(eager_tasks[:4])) == 1 and eager_tasks[0] != eager_tasks[4]  # per iteration, not per member
    servers = [StandInServer(served(model_fn, tmp_path / name)) for name in "ab"]
    try:
        on_servers, history = run("servers", use_vllm=True, vllm_mode="server",
                                  vllm_server_base_urls=[s.url for s in servers])
        assert sorted(tasks) == sorted(eager_tasks) and history == eager_history
        assert_bitwise(snapshot(on_servers.model), snapshot(eager.model))
        assert all(any(m == "es_server_perturb" for _, m in s.calls) for s in servers)  # both scored members
    finally:
        for s in servers:
            s.close()


def test_vllm_serve_prints_the_es_server_line(tmp_path, tokenizer, capsys):
    from trl_es.cli import main

    folder = str(tmp_path / "tiny")
    build_llama(tokenizer).save_pretrained(folder)
    assert main(["vllm-serve", folder, "--port", "8123", "--print_only", "--", "--max-model-len", "256"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"VLLM_SERVER_DEV_MODE=1 {sys.executable} -m vllm.entrypoints.launchers.api_server.entry "
                           f"--model {folder} --host 127.0.0.1 --port 8123 --dtype float32 "
                           "--worker-extension-cls trl_es.generation.vllm_server_worker.ESServerWorkerExtension "
                           "--no-enable-prefix-caching")
    assert line.endswith("--max-model-len 256") and ("--enforce-eager" in line) == (not torch.cuda.is_available())


def test_bytes_of_an_iteration_do_not_depend_on_the_model_size(tmp_path, tokenizer):
    from tiny import build_vllm_llama

    from trl_es.generation.vllm_server import ESServerClient

    def iteration_bytes(build, name):
        model_fn = lambda: build(tokenizer)  # noqa: E731
        server = StandInServer(served(model_fn, tmp_path / name))
        try:
            model = model_fn()
            strategy = EvolutionStrategy.for_module(model, sigma=0.05, population_size=4, antithetic=True)
            client = ESServerClient(server.url)
            client.init(model, header_of(strategy))
            before = client.rpc_bytes
            members = strategy.ask(0)
            for member in members:
                client.perturb(member, 0.05)
                client.restore()
            told = strategy.tell(members, torch.tensor([1.0, 0.0, 0.5, 2.0]), learning_rate=0.05)
            client.update({"step": 1, "members": [[m.seed, m.sign] for m in members],
                           "coefficients": told.coefficients, "learning_rate": 0.05}, model)
            return client.rpc_bytes - before, sum(p.numel() for p in model.parameters())
        finally:
            server.close()

    (small, small_numel), (large, large_numel) = iteration_bytes(build_llama, "a"), iteration_bytes(build_vllm_llama, "b")
    assert large_numel > 2 * small_numel and small == large and small < 4096


def test_members_are_dispatched_over_two_servers_and_a_killed_server_costs_one_member(tmp_path, tokenizer):
    """One process, two stand-in servers: members dispatched dynamically (one in flight per server); the run ends
    bitwise where the eager run ends. Server B killed at the first reward of iteration 2: its member runs again on A
    (counted once), B is left out; started again during iteration 3, it is re-initialised at the next sync."""
    from trl_es.generation.vllm_server import ServerError

    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    data = Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(8)]})
    servers, events = [], []

    def reward(completions, trainer_state, **kwargs):
        step = trainer_state.global_step
        if servers and step == 1 and "kill" not in events:
            events.append("kill")
            servers[1].kill()
        if servers and step == 2 and "restart" not in events:
            events.append("restart")
            servers[1].restart(served(model_fn, tmp_path / "restarted"))
        return mean_code(completions)

    def run(out, **kwargs):
        args = ESConfig(output_dir=str(tmp_path / out), max_steps=3, population_size=6, prompt_batch_size=4,
                        max_completion_length=6, sigma=0.05, learning_rate=0.05, temperature=0.0, report_to=[],
                        save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, logging_steps=1, **kwargs)
        trainer = ESTrainer(model_fn(), reward, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        return trainer

    eager = run("eager")
    servers.extend(StandInServer(served(model_fn, tmp_path / name)) for name in ("a", "b"))
    try:
        urls = [s.url for s in servers]
        on_servers = run("servers", use_vllm=True, vllm_mode="server", vllm_server_base_urls=urls)
        assert events == ["kill", "restart"]
        assert_bitwise(snapshot(on_servers.model), snapshot(eager.model))
        logs = [h for h in on_servers.state.log_history if "vllm_server/members_rerun" in h]
        assert [h["vllm_server/members_rerun"] for h in logs] == [0.0, 1.0, 0.0]
        assert [h["vllm_server/live_servers"] for h in logs] == [2.0, 1.0, 2.0]  # B back after the last sync
        assert [h["reward"] for h in logs] == [h["reward"] for h in eager.state.log_history if "reward" in h]
        perturbs = [sum(1 for p, m in s.calls if m == "es_server_perturb") for s in servers]
        assert sum(perturbs) == 6 * 3 + 1 and min(perturbs) >= 1  # every member once, one again; both served
        for server in servers:  # B re-initialised from the seed log at the last sync
            assert_bitwise(snapshot(server.worker.model_runner.model), snapshot(eager.model))
        servers[0].kill()
        servers[1].kill()
        before = snapshot(on_servers.model)
        with pytest.raises(ServerError, match=f"No ES server is left.*{urls[0]}.*{urls[1]}"):
            on_servers.evaluate(data.select(range(2)))
        assert_bitwise(snapshot(on_servers.model), before)
    finally:
        for server in servers:
            server.close()


def test_an_exception_in_a_reward_on_two_servers_restores_both(tmp_path, tokenizer):
    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    data = Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(8)]})
    calls = []

    def reward(completions, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("reward failed")
        return mean_code(completions)

    servers = [StandInServer(served(model_fn, tmp_path / name)) for name in ("a", "b")]
    try:
        args = ESConfig(output_dir=str(tmp_path / "run"), max_steps=1, population_size=6, prompt_batch_size=4,
                        max_completion_length=6, sigma=0.05, temperature=0.0, report_to=[], save_strategy="no",
                        noise_table_size=1 << 20, disable_tqdm=True, use_vllm=True, vllm_mode="server",
                        vllm_server_base_urls=[s.url for s in servers])
        trainer = ESTrainer(model_fn(), reward, args=args, train_dataset=data, processing_class=tokenizer)
        with pytest.raises(RuntimeError, match="reward failed"):
            trainer.train()
        base = snapshot(model_fn())
        assert_bitwise(snapshot(trainer.model), base)
        for server in servers:  # the members in flight restored
            assert_bitwise(snapshot(server.worker.model_runner.model), base)
            rpcs = [m for p, m in server.calls if p == "/collective_rpc"]
            assert rpcs.count("es_server_perturb") == rpcs.count("es_server_restore") >= 1
    finally:
        for server in servers:
            server.close()


def test_fewer_servers_than_processes_is_named(tmp_path, tokenizer):
    from trl_es.generation.vllm_server import VLLMServerEngine

    with pytest.raises(ValueError, match="at least one ES server"):
        VLLMServerEngine(tokenizer, [], lambda: None)


# ------------------------------------------------------------------------------- checked numbers, atomic init
def at_step_one(tmp_path, tokenizer, awd=False):
    """A served stand-in worker and the trainer's model, both after one update; the record of step 2 to come."""
    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    worker, model = served(model_fn, tmp_path), model_fn()
    strategy = EvolutionStrategy.for_module(model, sigma=0.02, population_size=2, antithetic=True,
                                            awd_lambda=0.5 if awd else 0.0)
    header = header_of(strategy)
    worker.es_server_init(spec_of(model, header, awd=awd))
    members = strategy.ask(0)
    told = strategy.tell(members, torch.tensor([1.0, -0.5]), learning_rate=0.05)
    first = {"step": 1, "members": [[m.seed, m.sign] for m in members], "coefficients": told.coefficients,
             "learning_rate": told.learning_rate, "awd_shrink": told.shrink}
    worker.es_server_update(json.dumps(first))
    second = {**first, "step": 2, "members": [[m.seed, m.sign] for m in strategy.ask(1)]}
    return worker, model, header, first, second


def assert_unchanged(worker, model, step, reloads, api_key=None):
    """The server's step, masters-derived weights and engine weights are still the trainer's."""
    assert worker.es_server_step(api_key=api_key) == step
    assert worker.es_server_checksum(api_key=api_key) == server_checksum(model.named_parameters())
    assert_bitwise(snapshot(worker.model_runner.model), snapshot(model))
    assert worker.model_runner.reloads == reloads


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("change, field", [
    ({"coefficients": [NAN, 1.0]}, "coefficients\\[0\\]"),  # JSON NaN
    ({"coefficients": [1.0, -INF]}, "coefficients\\[1\\]"),  # JSON -Infinity
    ({"coefficients": [1.0, "x"]}, "coefficients\\[1\\]"),
    ({"learning_rate": NAN}, "learning_rate"),
    ({"learning_rate": INF}, "learning_rate"),
    ({"learning_rate": -0.1}, "learning_rate"),
    ({"learning_rate": True}, "learning_rate"),
    ({"awd_shrink": NAN}, "awd_shrink"),
    ({"awd_shrink": 1.0}, "awd_shrink"),  # l2: 0 <= shrink < 1
    ({"awd_shrink": -0.1}, "awd_shrink"),
    ({"members": [[2**63, 1], [7, -1]]}, "members\\[0\\]: seed"),
    ({"members": [[1.5, 1], [7, -1]]}, "members\\[0\\]: seed"),
    ({"members": [[NAN, 1], [7, -1]]}, "members\\[0\\]: seed"),
    ({"members": [[3, 1], [7, 0]]}, "members\\[1\\]: sign"),
    ({"members": [[3, 1], [7, NAN]]}, "members\\[1\\]: sign"),
    ({"members": [[3, 1], [7]]}, "'members' \\(\\[seed, sign\\] pairs\\)"),
    ({"step": True}, "so it takes the record of step 2; got step True"),
])
def test_a_non_finite_or_out_of_range_number_in_an_update_changes_nothing(tmp_path, tokenizer, change, field):
    worker, model, _, _, second = at_step_one(tmp_path, tokenizer, awd=True)
    reloads = worker.model_runner.reloads
    with pytest.raises(ValueError, match=f"es_server_update.*{field}"):
        worker.es_server_update(json.dumps({**second, **change}))  # JSON carries NaN and Infinity as such
    assert_unchanged(worker, model, 1, reloads)
    assert all(torch.isfinite(m).all() for m in worker._es_masters.values())
    assert worker.es_server_update(json.dumps(second))["step"] == 2  # the good record still applies


@pytest.mark.parametrize("sigma", ["inf", "-inf", "nan", "-0.01", "0", True, None])
def test_a_non_finite_or_non_positive_sigma_loads_no_member(tmp_path, tokenizer, sigma):
    worker, model, *_ = at_step_one(tmp_path, tokenizer)
    reloads = worker.model_runner.reloads
    with pytest.raises(ValueError, match="es_server_perturb: sigma must be a finite number in \\(0.0, inf\\)"):
        worker.es_server_perturb("5", "1", sigma)
    assert_unchanged(worker, model, 1, reloads)


@pytest.mark.parametrize("seed, sign, field", [("-1", "1", "seed"), (str(2**63), "1", "seed"), ("1e3", "1", "seed"),
                                               (True, "1", "seed"), ("5", "2", "sign"), ("5", "0", "sign"),
                                               ("5", 1.5, "sign")])
def test_a_bad_seed_or_sign_loads_no_member(tmp_path, tokenizer, seed, sign, field):
    worker, model, *_ = at_step_one(tmp_path, tokenizer)
    reloads = worker.model_runner.reloads
    with pytest.raises(ValueError, match=f"es_server_perturb: {field}"):
        worker.es_server_perturb(seed, sign, "0.02")
    assert_unchanged(worker, model, 1, reloads)


def broken_specs(model, header, first):
    """Specs each with one bad field, and the field the error must name."""
    weights = [n for n, _ in model.named_parameters()]
    return [
        ({"header": header, "weights": weights, "records": [{k: v for k, v in first.items() if k != "members"}]},
         "records\\[0\\].*'members'"),
        ({"header": header, "weights": weights, "records": [{**first, "coefficients": [NAN, 1.0]}]},
         "records\\[0\\]: coefficients\\[0\\]"),
        ({"header": header, "weights": weights, "records": [{**first, "learning_rate": INF}]},
         "records\\[0\\]: learning_rate"),
        ({"header": header, "weights": weights, "records": [first, {**first, "step": 2, "awd_shrink": NAN}]},
         "records\\[1\\]: awd_shrink"),
        ({"header": {k: v for k, v in header.items() if k != "noise"}, "weights": weights}, "header.noise"),
        ({"header": {**header, "noise": {**header["noise"], "type": "table", "size": 1 << 20, "seed": NAN}},
          "weights": weights}, "header.noise.seed"),
        ({"header": {**header, "noise": {**header["noise"], "type": "table", "size": INF, "seed": 0}},
          "weights": weights}, "header.noise.size"),
        ({"header": {k: v for k, v in header.items() if k != "parameters"}, "weights": weights}, "header.parameters"),
        ({"header": {**header, "awd_penalty": "l3"}, "weights": weights}, "header.awd_penalty"),
        ({"header": {**header, "perturbation": {"kind": "x"}}, "weights": weights}, "header.perturbation"),
        ({"header": header, "weights": weights, "records": ["step 1"]}, "steps 1..k"),
        ({"header": header, "records": []}, "needs 'weights'"),
        ({"header": header, "weights": weights[:-1] + ["nope"]}, "missing \\['nope'\\]"),
        ("[1, 2]", "spec must be an object"),
    ]


def test_a_failed_reinitialisation_leaves_the_server_as_it_was(tmp_path, tokenizer):
    """es_server_init builds the new state aside: every malformed spec is a ValueError naming the field, and the
    server stays at step 1 with the trainer's weights (engine and masters), members and updates still working."""
    worker, model, header, first, second = at_step_one(tmp_path, tokenizer)
    reloads = worker.model_runner.reloads
    for spec, field in broken_specs(model, header, first):
        with pytest.raises(ValueError, match=field):
            worker.es_server_init(spec if isinstance(spec, str) else json.dumps(spec))
        assert_unchanged(worker, model, 1, reloads)
    worker.es_server_perturb("3", "-1", "0.02")
    worker.es_server_restore()
    assert worker.es_server_update(json.dumps(second))["step"] == 2


def test_an_engine_that_fails_the_reload_of_an_init_leaves_no_half_state(tmp_path, tokenizer):
    worker, model, header, first, _ = at_step_one(tmp_path, tokenizer)
    reload = worker.model_runner.reload_weights

    def failing(weights_iterator, is_checkpoint_format=True):
        raise RuntimeError("engine out of memory")

    worker.model_runner.reload_weights = failing
    with pytest.raises(RuntimeError, match="engine out of memory"):
        worker.es_server_init(spec_of(model, header, [first]))
    assert worker.es_server_step() == -1  # no ES state: the trainer's next sync re-initialises it
    with pytest.raises(RuntimeError, match="es_server_init first"):
        worker.es_server_checksum()
    worker.model_runner.reload_weights = reload
    assert worker.es_server_init(spec_of(model, header, [first]))["checksum"] == server_checksum(
        model.named_parameters())


def test_the_colocated_calls_are_refused_on_a_server(tmp_path, tokenizer):
    """es_bind/es_perturb/es_load_current (and the reload helpers) would move the weights without the server's
    checks; over /collective_rpc they are refused, and the state-changing helpers are not methods at all."""
    worker, model, *_ = at_step_one(tmp_path, tokenizer)
    reloads = worker.model_runner.reloads
    for method, args in [("es_bind", ("a", "", "x")), ("es_perturb", ("5", "1", "0.5")), ("es_load_current", ()),
                         ("_es_reload", ([],)), ("_es_reprocess_tied_heads", ())]:
        with pytest.raises(RuntimeError, match=f"{method} is a colocated engine's call"):
            getattr(worker, method)(*args)
    assert not hasattr(worker, "_es_apply") and not hasattr(worker, "_es_build_and_apply")
    assert_unchanged(worker, model, 1, reloads)


# ------------------------------------------------------------------------------- URLs
@pytest.mark.parametrize("spellings, normal", [
    (["http://127.0.0.1:8011", "http://127.0.0.1:8011/", "HTTP://127.0.0.1:8011//", " 127.0.0.1:8011"],
     "http://127.0.0.1:8011"),
    (["http://Node1:80", "http://node1/", "node1:80", "HtTp://NODE1"], "http://node1"),
    (["https://h:443/v1x/", "https://H/v1x"], "https://h/v1x"),
    (["[::1]:8000", "http://[::1]:8000/"], "http://[::1]:8000"),
    (["localhost:8000", "http://localhost:8000"], "http://localhost:8000"),  # TRL: host:port is http://host:port
])
def test_server_urls_have_one_spelling(spellings, normal):
    from trl_es.generation.vllm_server import normalize_server_url

    assert [normalize_server_url(u) for u in spellings] == [normal] * len(spellings)


@pytest.mark.parametrize("url", ["ftp://h:1", "http://:8000", "http://h:99999", "http://h:8000/?a=1", "http://[::1",
                                 "", "http://h:8000#x"])
def test_a_url_that_is_not_a_server_url_is_named(tmp_path, url):
    from trl_es.generation.vllm_server import normalize_server_url

    with pytest.raises(ValueError, match="vllm_server_base_url must be"):
        normalize_server_url(url, "vllm_server_base_url")
    with pytest.raises(ValueError, match="vllm_server_base_url must be"):
        ESConfig(output_dir=str(tmp_path), report_to=[], use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
    with pytest.raises(ValueError, match="vllm_server_base_urls must be"):
        ESConfig(output_dir=str(tmp_path), report_to=[], use_vllm=True, vllm_mode="server",
                 vllm_server_base_urls=["http://ok:1", url])


@pytest.mark.parametrize("urls", [["http://127.0.0.1:8011", "http://127.0.0.1:8011/"],
                                  ["http://LocalHost:80", "localhost", "http://b:1"],
                                  ["https://h:443", "HTTPS://h/"]])
def test_one_server_under_two_spellings_is_refused(tmp_path, urls):
    with pytest.raises(ValueError, match="vllm_server_base_urls must be None or a list of distinct URLs"):
        ESConfig(output_dir=str(tmp_path), report_to=[], use_vllm=True, vllm_mode="server", vllm_server_base_urls=urls)
    distinct = ["http://127.0.0.1:8011", "http://127.0.0.1:8012", "https://127.0.0.1:8011", "http://127.0.0.1:8011/a"]
    assert ESConfig(output_dir=str(tmp_path), report_to=[], use_vllm=True, vllm_mode="server",
                    vllm_server_base_urls=distinct).vllm_server_base_urls == distinct


def test_a_url_without_a_scheme_reaches_the_server_at_once(tmp_path, tokenizer):
    """host:port is http://host:port (TRL's VLLMClient): the client answers in well under the connection timeout,
    and a run with it ends bitwise where the run with the full URL ends."""
    import time

    from trl_es.generation.vllm_server import ESServerClient

    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    server = StandInServer(served(model_fn, tmp_path))
    try:
        port = server.url.rsplit(":", 1)[1]
        for url in (f"127.0.0.1:{port}", f"localhost:{port}/"):
            start = time.monotonic()
            client = ESServerClient(url, connection_timeout=30)
            assert time.monotonic() - start < 10 and client.step() == -1
            assert client.base_url == url.rstrip("/").join(["http://", ""])
        data = Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(4)]})
        args = ESConfig(output_dir=str(tmp_path / "run"), max_steps=1, population_size=2, prompt_batch_size=2,
                        max_completion_length=4, sigma=0.05, learning_rate=0.05, temperature=0.0, report_to=[],
                        save_strategy="no", noise_table_size=1 << 20, disable_tqdm=True, use_vllm=True,
                        vllm_mode="server", vllm_server_base_url=f"127.0.0.1:{port}", vllm_server_timeout=30)
        trainer = ESTrainer(model_fn(), mean_code, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        assert trainer.generation_engine.describe()["base_urls"] == [server.url]
        assert_bitwise(snapshot(server.worker.model_runner.model), snapshot(trainer.model))
        base, trained = snapshot(model_fn()), snapshot(trainer.model)
        assert any(not torch.equal(base[k], trained[k]) for k in base)  # it trained
    finally:
        server.close()


@pytest.mark.parametrize("url, error", [("http://a..b:8000", "LocationParseError"),
                                        ("http://ho st:8000", "InvalidURL"),
                                        ("http://exa\u00a0mple:8000", "InvalidURL")])
def test_a_url_requests_cannot_use_is_named_at_once_not_after_the_timeout(url, error):
    import time

    from trl_es.generation.vllm_server import ESServerClient

    start = time.monotonic()
    with pytest.raises(ValueError, match=f"ES server URL .* cannot be used: .*{error}"):
        ESServerClient(url, connection_timeout=240)
    assert time.monotonic() - start < 5


# ------------------------------------------------------------------------------- the shared API key
ES_CALLS = [("es_server_perturb", ("5", "1", "0.02")), ("es_server_restore", ()), ("es_server_checksum", ()),
            ("es_server_step", ()), ("es_read_weights", ())]


@pytest.mark.parametrize("key", [None, "", "wrong", "the-key ", "THE-KEY"])
def test_a_call_without_the_servers_key_changes_nothing(tmp_path, tokenizer, monkeypatch, key):
    worker, model, header, first, second = at_step_one(tmp_path, tokenizer)
    monkeypatch.setenv("VLLM_API_KEY", "the-key")  # the server's key, from now on
    reloads = worker.model_runner.reloads
    refusal = "refused: this server requires its API key" if not key else "refused: wrong API key"
    calls = ES_CALLS + [("es_server_update", (json.dumps(second),)),
                        ("es_server_init", (spec_of(model, header, [first]),))]
    for method, args in calls:
        with pytest.raises(PermissionError, match=f"{method} {refusal}") as raised:
            getattr(worker, method)(*args, api_key=key)
        assert "the-key" not in str(raised.value)
        assert_unchanged(worker, model, 1, reloads, api_key="the-key")
    for method, args in calls[:-1]:  # with the key: as without one before
        getattr(worker, method)(*args, api_key="the-key")
    assert worker.es_server_step(api_key="the-key") == 2


@pytest.mark.parametrize("key", ["some-key", "the-key"])
def test_a_call_with_a_key_to_a_server_without_one_is_refused(tmp_path, tokenizer, monkeypatch, key):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    worker, model, *_ = at_step_one(tmp_path, tokenizer)
    reloads = worker.model_runner.reloads
    with pytest.raises(PermissionError, match="es_server_perturb refused: the call carries an API key, but this "
                                              "server has none \\(VLLM_API_KEY is unset where it runs\\)"):
        worker.es_server_perturb("5", "1", "0.02", api_key=key)
    assert_unchanged(worker, model, 1, reloads)


@pytest.mark.parametrize("key", [None, "wrong"])
def test_the_client_is_refused_without_the_key_and_nothing_moves(tmp_path, tokenizer, monkeypatch, key):
    """A server with a key: a client without it (or with another) is refused at its first /v1 request; a raw
    /collective_rpc (which vLLM does not guard) without the key is refused by the extension; the weights stay."""
    import requests

    from trl_es.generation.vllm_server import ESServerClient, ServerRefusedError

    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    server = StandInServer(served(model_fn, tmp_path))
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    try:
        model = model_fn()
        strategy = EvolutionStrategy.for_module(model, sigma=0.05, population_size=2, antithetic=True)
        ESServerClient(server.url).init(model, header_of(strategy))  # the key from VLLM_API_KEY
        reloads = server.worker.model_runner.reloads
        sent = "no key" if key is None else "a key that is not the server's"
        with pytest.raises(ServerRefusedError, match=f"{server.url} refused the model list \\(HTTP 401\\): the "
                                                     f"trainer sent {sent}") as raised:
            ESServerClient(server.url, api_key=key or "")
        assert "s3cret" not in str(raised.value)
        body = {"method": "es_server_perturb", "args": ["5", "1", "0.5"], "kwargs": {} if key is None else
                {"api_key": key}}
        answer = requests.post(server.url + "/collective_rpc", json=body, timeout=30)
        assert answer.status_code == 500 and "es_server_perturb refused" in answer.text
        assert server.worker.model_runner.reloads == reloads
        assert_bitwise(snapshot(server.worker.model_runner.model), snapshot(model))
    finally:
        server.close()


def test_a_run_with_the_key_is_bitwise_the_run_without_and_the_key_is_written_nowhere(tmp_path, tokenizer,
                                                                                       monkeypatch):
    """VLLM_API_KEY set where the trainer and the (stand-in) server run: every request carries the key (Bearer, and
    api_key in every ES call), the run ends bitwise where the keyless run ends, and the key is in no file of the
    output dir (seed log, checkpoint, training args) nor in the logs."""
    import os

    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    data = Dataset.from_dict({"prompt": [f"Write: {i}" for i in range(8)]})

    def run(out, url):
        args = ESConfig(output_dir=str(tmp_path / out), max_steps=2, population_size=4, prompt_batch_size=4,
                        max_completion_length=6, sigma=0.05, learning_rate=0.05, temperature=0.0, awd_lambda=0.5,
                        report_to=[], save_strategy="steps", save_steps=2, noise_table_size=1 << 20,
                        disable_tqdm=True, use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
        trainer = ESTrainer(model_fn(), mean_code, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        return trainer

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    servers = [StandInServer(served(model_fn, tmp_path / name)) for name in ("open", "keyed")]
    try:
        keyless = run("keyless", servers[0].url)
        monkeypatch.setenv("VLLM_API_KEY", "k3y-0f-the-run")
        keyed = run("keyed", servers[1].url)
        assert_bitwise(snapshot(keyed.model), snapshot(keyless.model))
        assert_bitwise(snapshot(servers[1].worker.model_runner.model), snapshot(keyless.model))
        assert [m for _, m in servers[1].calls] == [m for _, m in servers[0].calls]  # the same calls
        assert all(auth is None and kwargs in (None, {}) for _, auth, kwargs in servers[0].headers)
        assert servers[1].headers and all(auth == "Bearer k3y-0f-the-run" for _, auth, _ in servers[1].headers)
        assert all(kwargs == {"api_key": "k3y-0f-the-run"} for path, _, kwargs in servers[1].headers
                   if path == "/collective_rpc")
        files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "keyed") for f in fs]
        assert any(f.endswith("es_seed_log.jsonl") for f in files) and any("checkpoint-2" in f for f in files)
        for file in files:
            with open(file, "rb") as f:
                assert b"k3y-0f-the-run" not in f.read(), file
        assert "k3y-0f-the-run" not in repr(keyed.state.log_history) + repr(keyed.args)
    finally:
        for server in servers:
            server.close()


def test_a_server_whose_key_changed_stops_the_run_instead_of_being_left_out(tmp_path, tokenizer, monkeypatch):
    """A refusal is a configuration error, not a fault: sync_weights and map_chunks raise ServerRefusedError
    (the server is not left out and its member not re-run elsewhere)."""
    from trl_es.es.seedlog import SeedLog
    from trl_es.generation.vllm_server import ESServerClient, ServerRefusedError, VLLMServerEngine

    model_fn = lambda: build_llama(tokenizer, dtype=torch.bfloat16)  # noqa: E731
    servers = [StandInServer(served(model_fn, tmp_path / name)) for name in "ab"]
    monkeypatch.setenv("VLLM_API_KEY", "old")
    try:
        model = model_fn()
        strategy = EvolutionStrategy.for_module(model, sigma=0.05, population_size=2, antithetic=True)
        log = SeedLog(header_of(strategy))
        engine = VLLMServerEngine(tokenizer, [ESServerClient(s.url) for s in servers], lambda: log)
        engine.sync_weights(model)
        monkeypatch.setenv("VLLM_API_KEY", "new")  # the servers' key, not the trainer's any more
        with pytest.raises(ServerRefusedError, match="es_server_step.*HTTP 500.*es_server_step refused: wrong API key"):
            engine.sync_weights(model)
        with pytest.raises(ServerRefusedError, match="es_server_perturb refused: wrong API key"):
            engine.map_chunks(lambda group: engine.perturb_(group[0], 0.05), [[m] for m in strategy.ask(0)])
        assert engine.left_out == {} and engine.members_rerun == 0
    finally:
        for server in servers:
            server.close()


@pytest.mark.parametrize("path", ["/collective_rpc", "/v1/completions", "/sleep"])
def test_the_middleware_needs_the_key_on_every_route_but_health(monkeypatch, path):
    import asyncio

    from trl_es.generation.vllm_server_worker import ESAuthenticationMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    def status(path, authorization=None):
        sent = []

        async def send(message):
            sent.append(message)

        headers = [] if authorization is None else [(b"authorization", authorization.encode())]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        asyncio.run(ESAuthenticationMiddleware(app)(scope, None, send))
        return sent[0]["status"]

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert status(path) == 200  # no key: open, as vLLM without --api-key
    monkeypatch.setenv("VLLM_API_KEY", "k")
    assert [status(path, a) for a in (None, "Bearer wrong", "Basic k", "Bearer k ", "Bearer k", "bearer k")] == [
        401, 401, 401, 401, 200, 200]
    assert status("/health") == 200


def test_vllm_serve_takes_the_key_from_the_environment_only(tmp_path, tokenizer, capsys, monkeypatch):
    from trl_es.cli import main

    folder = str(tmp_path / "tiny")
    build_llama(tokenizer).save_pretrained(folder)
    monkeypatch.setenv("VLLM_API_KEY", "sh0wn-n0where")
    assert main(["vllm-serve", folder, "--print_only"]) == 0
    out = capsys.readouterr().out
    assert "--middleware trl_es.generation.vllm_server_worker.ESAuthenticationMiddleware" in out
    assert "VLLM_API_KEY is set (not shown)" in out and "sh0wn-n0where" not in out
    monkeypatch.delenv("VLLM_API_KEY")
    assert main(["vllm-serve", folder, "--print_only"]) == 0
    assert "No VLLM_API_KEY: /collective_rpc, which moves the weights, is open" in capsys.readouterr().out
    for flag in (["--api-key", "k"], ["--api-key=k"]):
        with pytest.raises(SystemExit):
            main(["vllm-serve", folder, "--print_only", "--", *flag])
        assert "pass the server's key in the environment" in capsys.readouterr().err
