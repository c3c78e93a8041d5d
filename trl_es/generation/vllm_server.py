"""The trainer's side of an ES vLLM server: :class:`ESServerClient` drives one ``vllm serve`` running
:class:`~.vllm_server_worker.ESServerWorkerExtension` with seeds, and asks it for completions by token ids.

ES calls go over ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``), prompts over ``POST /v1/completions``. After
``init`` and every ``update`` the server's checksum is compared with the trainer's weights
(:class:`ServerMismatchError`). A shared ``VLLM_API_KEY`` goes with every request, never logged
(:class:`ServerRefusedError` when refused). No automatic retries: the caller decides.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from ..es.perturbation import Member
from .base import EngineContext, OwnWeightsEngine, encode_prompts
from .vllm_engine import VLLMEngine, sampling_kwargs, with_model_defaults
from .vllm_server_worker import API_KEY_ENV, server_checksum


logger = logging.getLogger(__name__)


def _global_rng_states() -> tuple:
    """Python's, NumPy's and torch's default CPU generator states (what a server thread carries across a wait)."""
    return random.getstate(), np.random.get_state(), torch.random.get_rng_state()


def _set_global_rng_states(states: tuple) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.random.set_rng_state(states[2])


class ServerError(RuntimeError):
    """A call to an ES server failed (unreachable, timed out, or the server raised); the message names the server
    and the call."""


class ServerMismatchError(ServerError):
    """A server's weights are not the trainer's (its checksum differs): it must be re-initialised."""


class ServerRefusedError(ServerError):
    """A server refused the trainer's API key (none, or another than its ``VLLM_API_KEY``): a configuration error,
    not a fault another server could absorb."""


_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_server_url(url: str, what: str = "base_url") -> str:
    """``url`` (http(s), or ``host:port``) in one spelling per server, e.g. ``"HTTP://Node1:80/"`` -> ``"http://node1"``.

    Raises:
        ValueError: naming ``what`` for another scheme, no host, a bad port, a query or a fragment.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{what} must be a server URL (http://host:port), got {url!r}.")
    text = url.strip()
    if "://" not in text:  # host:port, as TRL's VLLMClient takes it
        text = "http://" + text
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as error:
        raise ValueError(f"{what} must be a server URL (http://host:port), got {url!r}: {error}.") from None
    scheme = parts.scheme.lower()  # lower-case scheme and host, default port dropped, no trailing /
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"{what} must be an http or https URL with a host and no query or fragment "
                         f"(http://host:port), got {url!r}.")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # an IPv6 address keeps its brackets
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        host = f"{host}:{port}"
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}" if userinfo else host
    return urllib.parse.urlunsplit((scheme, netloc, parts.path.rstrip("/"), "", ""))


class ESServerClient:
    """One ES vLLM server.

    Args:
        base_url (`str`): The server's URL (``http://host:port`` or ``host:port``, as TRL's ``vllm_server_base_url``).
        timeout (`float`): Seconds one request may take (a generation included), then :class:`ServerError`.
        connection_timeout (`float`): Seconds to wait for the server's ``/health`` at construction (TRL's
            ``vllm_server_timeout``); ``0``: one try.
        api_key (`str`, *optional*): The servers' shared key; default ``VLLM_API_KEY`` (unset or empty: none).

    Raises:
        ValueError: for a URL that is not one.
        ServerError: if the server does not answer ``/health`` within ``connection_timeout``.
        ServerRefusedError: if the server refuses the key.
    """

    def __init__(self, base_url: str, timeout: float = 600.0, connection_timeout: float = 0.0,
                 api_key: str | None = None):
        import requests

        self.base_url = normalize_server_url(base_url)
        self.timeout = float(timeout)
        self.session = requests.Session()
        api_key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
        self._api_key = api_key or None  # sent, never logged
        if self._api_key:
            self.session.headers["Authorization"] = f"Bearer {self._api_key}"  # vLLM's --api-key check of /v1
        self.rpc_bytes = 0  # request + response body bytes of the ES calls (/collective_rpc) so far
        self._wait_for_health(float(connection_timeout))
        self.model = self._request("GET", "/v1/models", "the model list")["data"][0]["id"]

    # ------------------------------------------------------------------ transport
    def _request(self, verb: str, path: str, what: str, payload: dict | None = None) -> dict:
        import requests

        body = None if payload is None else json.dumps(payload).encode()
        headers = None if body is None else {"Content-Type": "application/json"}
        try:
            response = self.session.request(verb, self.base_url + path, data=body, headers=headers,
                                            timeout=self.timeout)
        except requests.RequestException as error:
            raise ServerError(f"ES server {self.base_url}: {what} failed: {error}") from error
        if path == "/collective_rpc":
            self.rpc_bytes += len(body) + len(response.content)
        if response.status_code == 401 or (response.status_code != 200 and "API key" in response.text
                                           and " refused: " in response.text):  # the extension's refusal
            sent = "a key that is not the server's" if self._api_key else f"no key ({API_KEY_ENV} is unset)"
            raise ServerRefusedError(f"ES server {self.base_url} refused {what} (HTTP {response.status_code}): the "
                                     f"trainer sent {sent}; set {API_KEY_ENV} to the servers' shared key where the "
                                     f"trainer and the servers run. Server said: {response.text[:500]}")
        if response.status_code != 200:
            raise ServerError(f"ES server {self.base_url}: {what} failed with HTTP {response.status_code}: "
                              f"{response.text[:2000]}")
        return response.json()

    def _wait_for_health(self, total_timeout: float) -> None:
        import requests

        start = time.monotonic()
        while True:
            try:
                if self.session.get(self.base_url + "/health", timeout=10).status_code == 200:
                    return
            except ValueError as error:  # requests' URL handling (InvalidURL, InvalidSchema, urllib3's parse errors)
                raise ValueError(f"ES server URL {self.base_url!r} cannot be used: {type(error).__module__}."
                                 f"{type(error).__name__}: {error}") from None
            except requests.RequestException:  # not up yet: try again
                pass
            if time.monotonic() - start >= total_timeout:
                raise ServerError(f"ES server {self.base_url} is not reachable (GET /health) after {total_timeout:.0f} "
                                  "s; start it with `VLLM_SERVER_DEV_MODE=1 vllm serve ... --worker-extension-cls "
                                  "trl_es.generation.vllm_server_worker.ESServerWorkerExtension`.")
            time.sleep(1.0)

    def healthy(self, timeout: float = 5.0) -> bool:
        """Whether the server answers ``GET /health`` within ``timeout`` seconds (one try)."""
        import requests

        try:
            return self.session.get(self.base_url + "/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def rpc(self, method: str, *args) -> list:
        """Run ``method(*args)`` of the extension on every worker of the server; their results, one per worker.

        Raises:
            ServerError: naming the server and ``method`` (the server's own message included).
            ServerRefusedError: if the server refuses the key.
        """
        kwargs = {"api_key": self._api_key} if self._api_key else {}  # the extension's own check
        body = {"method": method, "args": list(args), "kwargs": kwargs, "timeout": self.timeout}
        return self._request("POST", "/collective_rpc", f"{method}", body)["results"]

    # ------------------------------------------------------------------ ES calls
    def init(self, model: nn.Module, header: dict, records: Sequence[dict] = (), awd: bool = False) -> int:
        """Initialise the server's ES state from its base checkpoint and a seed log (``header``, ``records`` of steps
        ``1..k``), check it holds ``model``'s weights, and return ``k``.

        Raises:
            ServerMismatchError: if the server's weights are not ``model``'s (another base checkpoint or dtype).
        """
        spec = {"header": header, "records": list(records), "awd": bool(awd),  # awd: the server keeps theta_0
                "weights": [name for name, _ in model.named_parameters()]}  # the checksum's names and order
        results = self.rpc("es_server_init", json.dumps(spec))
        self._check(results, model, f"after es_server_init at step {len(records)}")
        return int(results[0]["step"])

    def perturb(self, member: Member, sigma: float) -> None:
        """Write member ``member`` at ``sigma`` into the server's weights (undo with :meth:`restore`)."""
        self.rpc("es_server_perturb", str(int(member.seed)), str(int(member.sign)), repr(float(sigma)))

    def restore(self) -> None:
        """Load the server's current weights again (the exact restore)."""
        self.rpc("es_server_restore")

    def update(self, record: dict, model: nn.Module) -> None:
        """Apply one seed-log record on the server (refused when repeated) and check it holds ``model``'s weights.

        Raises:
            ServerMismatchError: if the checksums differ.
        """
        self._check(self.rpc("es_server_update", json.dumps(record)), model, f"after step {record['step']}")

    def step(self) -> int:
        """The server's last applied step (``-1``: not initialised, e.g. it restarted)."""
        return min(int(s) for s in self.rpc("es_server_step"))

    def check(self, model: nn.Module, when: str = "now") -> None:
        """Raise :class:`ServerMismatchError` unless the server holds ``model``'s weights."""
        self._check([{"checksum": c} for c in self.rpc("es_server_checksum")], model, when)

    def _check(self, results: list, model: nn.Module, when: str) -> None:
        expected = server_checksum(model.named_parameters())
        got = sorted({r["checksum"] for r in results})
        if got != [expected]:
            raise ServerMismatchError(f"ES server {self.base_url} does not hold the trainer's weights {when}: "
                                      f"checksums {got} (its workers) against {expected}. Serve the trainer's base "
                                      "model in the trainer's dtype, and re-initialise a server that restarted.")

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[Sequence[int]], max_tokens: int, sampling: dict | None = None
                 ) -> list[list[int]]:
        """One completion's token ids per token-id prompt, in order, with the server's current weights; ``sampling``
        holds further ``/v1/completions`` fields (greedy by default)."""
        payload = {"model": self.model, "prompt": [list(map(int, p)) for p in prompt_ids], "n": 1,
                   "max_tokens": int(max_tokens), "temperature": 0.0, "return_token_ids": True,
                   **(sampling or {})}
        choices = self._request("POST", "/v1/completions", "completions", payload)["choices"]
        if len(choices) != len(prompt_ids):
            raise ServerError(f"ES server {self.base_url}: {len(prompt_ids)} prompts gave {len(choices)} completions.")
        return [list(c["token_ids"]) for c in sorted(choices, key=lambda c: c.get("index", 0))]


class VLLMServerEngine(OwnWeightsEngine):
    """Generation on ES vLLM servers (``ESConfig(use_vllm=True, vllm_mode="server")``): members written into a
    server's weights from their seeds, completions over HTTP; the trainer's model stays the source of truth.

    Several servers: :meth:`map_chunks` runs one member group per server at a time, each rollout as a sequential
    loop would give it; a failed server is left out and its member run on another (:attr:`members_rerun`).

    Args:
        processing_class (`PreTrainedTokenizerBase`): The tokenizer (its EOS is vLLM's own stop).
        clients (`Sequence[ESServerClient]`): The servers of this process (one, or several for dynamic dispatch).
        seed_log (`Callable[[], SeedLog]`): The trainer's seed log (read at each sync).
        awd (`bool`): Whether the run uses Anchored Weight Decay.
        max_concurrent_requests (`int`): Sampled rows go one request each (each its own seed), this many at once.
    """

    name = "vllm_server"

    def __init__(self, processing_class, clients: Sequence[ESServerClient] | ESServerClient, seed_log: Callable,
                 awd: bool = False, max_concurrent_requests: int = 32):
        self.processing_class, self._seed_log, self.awd = processing_class, seed_log, awd
        self.clients = [clients] if isinstance(clients, ESServerClient) else list(clients)
        if not self.clients:
            raise ValueError("VLLMServerEngine needs at least one ES server.")
        self.max_concurrent_requests = int(max_concurrent_requests)
        self.left_out: dict[int, str] = {}  # server index -> its error, until it answers /health again at a sync
        self.members_rerun = 0  # members run again on another server, so far
        self._members_rerun_counted = 0  # members_rerun at the last iteration_counts()
        # the trainer process's code (rewards, tools) runs under it, one server thread at a time; released while a
        # thread waits for its server, the global RNG states travelling with the thread
        self._host = threading.Lock()
        self._local = threading.local()  # a server thread's server index and whether it holds the host lock
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"es-server-{k}") for k in range(len(self.clients))]

    @classmethod
    def from_config(cls, args, model: nn.Module, context: EngineContext) -> VLLMServerEngine:
        """The engine over this process's servers (``vllm_server_base_urls[process_index::num_processes]``, else the
        one server of ``vllm_server_base_url`` or host and port).

        Raises:
            ValueError: for fewer servers than processes, ZeRO-3, a PEFT model, a run whose updates a server cannot
                replay (``es_optimizer='torch'``), or generation settings vLLM does not take.
            ServerError: if a server does not answer.
        """
        world = context.accelerator.num_processes
        if context.sharded or hasattr(model, "peft_config"):
            raise ValueError("vllm_mode='server' is not supported with DeepSpeed ZeRO-3 or a PEFT model yet.")
        if args.es_optimizer != "es":
            raise ValueError("vllm_mode='server' replays each update on the server from its seed-log record: use "
                             "es_optimizer='es' (a torch optimizer's state is not in the record).")
        urls = args.vllm_server_base_urls
        if urls is None:
            urls = [args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"]
        if len(urls) < world:
            raise ValueError(f"vllm_mode='server' needs at least one server per training process (a server holds "
                             f"one member at a time): {world} processes, {len(urls)} server(s). Set "
                             f"vllm_server_base_urls to {world} or more URLs (process i uses entries i, i + {world}, "
                             "...).")
        cls.check_generation_config(context.generation_config)  # before waiting for the servers
        clients = [ESServerClient(url, connection_timeout=args.vllm_server_timeout)  # each waited for
                   for url in urls[context.accelerator.process_index::world]]  # process i: entries i, i + W, ...
        return cls(context.processing_class, clients, context.seed_log, awd=args.awd_lambda > 0)

    def describe(self) -> dict:
        return {"name": self.name, "base_urls": [c.base_url for c in self.clients]}

    def iteration_counts(self) -> dict[str, float]:
        """``vllm_server/members_rerun`` (members run again on another server since the last call) and
        ``vllm_server/live_servers`` (servers scoring members)."""
        rerun, self._members_rerun_counted = self.members_rerun - self._members_rerun_counted, self.members_rerun
        return {"vllm_server/members_rerun": float(rerun), "vllm_server/live_servers": float(len(self.live_servers()))}

    @property
    def client(self) -> ESServerClient:
        """This server thread's server; outside the member loop (an evaluation) the first one not left out."""
        index = getattr(self._local, "server", None)
        if index is None:  # not a server thread
            index = next((k for k in range(len(self.clients)) if k not in self.left_out), 0)
        return self.clients[index]

    def live_servers(self) -> list[str]:
        """The URLs of the servers not left out."""
        return [c.base_url for k, c in enumerate(self.clients) if k not in self.left_out]

    def _leave_out(self, index: int, error: BaseException, group=None) -> None:
        self.left_out[index] = str(error)  # until it answers /health at a sync
        rerun = "" if group is None else f"; its member(s) {list(group)} run again on another server"
        logger.warning("%s%s. It scores no member until it answers /health again (checked at each weight sync, "
                       "then re-initialised from the seed log).", error, rerun)

    def _all_left_out(self) -> ServerError:
        errors = "; ".join(self.left_out[k] for k in sorted(self.left_out))
        return ServerError(f"No ES server is left ({len(self.clients)} failed): {errors}")

    @contextlib.contextmanager
    def _waiting(self):
        """Around a call to this thread's server: other server threads run the process's code meanwhile; this
        thread's global generator states are put back when it resumes."""
        if not getattr(self._local, "holding", False):  # the caller's thread: nothing to hand over
            yield
            return
        states = _global_rng_states()  # this thread's, put back when it resumes
        self._host.release()
        try:
            yield
        finally:
            self._host.acquire()
            _set_global_rng_states(states)

    def map_chunks(self, fn: Callable, groups: Sequence) -> list:
        """``[fn(group) for group in groups]`` with each group's members on one server, dispatched dynamically; a
        :class:`ServerError` in ``fn`` reruns the group elsewhere, any other exception stops the dispatch and is raised.

        Raises:
            ServerError: if every server has been left out with groups still to score (naming each server's error).
        """
        groups, pending, results, failure = list(groups), deque(range(len(groups))), {}, []
        grad_enabled, states = torch.is_grad_enabled(), _global_rng_states()

        def serve(index: int) -> None:  # one server thread: groups until none is left
            self._local.server, self._local.holding = index, True
            try:
                with self._host, torch.set_grad_enabled(grad_enabled):
                    while pending and not failure:
                        j = pending.popleft()
                        try:
                            results[j] = fn(groups[j])
                        except ServerRefusedError as error:  # configuration, not a fault: stop
                            failure.append(error)
                            return
                        except ServerError as error:  # this server failed: leave it out, the group goes back
                            pending.appendleft(j)
                            self.members_rerun += len(groups[j])
                            self._leave_out(index, error, groups[j])
                            return
                        except BaseException as error:  # noqa: B036 (KeyboardInterrupt too: raised by the caller)
                            failure.append(error)
                            return
            finally:
                self._local.server, self._local.holding = None, False

        try:
            while pending and not failure:  # again with the live servers while groups are left
                live = [k for k in range(len(self.clients)) if k not in self.left_out]
                if not live:
                    raise self._all_left_out()
                for future in [self._threads[k].submit(serve, k) for k in live]:
                    future.result()
        finally:  # the state a sequential loop leaves does not depend on which thread ran last
            _set_global_rng_states(states)
        if failure:
            raise failure[0]
        return [results[j] for j in range(len(groups))]

    def sync_weights(self, model: nn.Module, params=None, noise=None) -> None:
        """Bring every server to the trainer's weights (``model``, after the seed log's last record), checked; a
        server that fails is left out, and re-initialised once it answers ``/health`` again.

        Raises:
            ServerMismatchError: if, after the catch-up, a server's checksum is not ``model``'s.
            ServerRefusedError: if a server refuses the key.
            ServerError: if no server is left.
        """
        log = self._seed_log()
        if log.header.get("not_replayable"):
            raise ValueError(f"vllm_mode='server' replays the seed log on the server; this run's cannot be: "
                             f"{log.header['not_replayable']}")
        records = log.records

        def sync(index: int) -> None:
            client = self.clients[index]
            if index in self.left_out:
                if not client.healthy():
                    return
                logger.warning("ES server %s answers again: re-initialising it from the seed log.", client.base_url)
                del self.left_out[index]
            step = client.step()
            if step == len(records):  # nothing new (an evaluation): check
                client.check(model, f"at step {step}")
            elif records and step == len(records) - 1:  # one step behind: the last record
                client.update(records[-1], model)
            else:  # a new or restarted server, a resumed run: base checkpoint + seed log
                client.init(model, log.header, records, self.awd)

        futures = [(k, self._threads[k].submit(sync, k)) for k in range(len(self.clients))]  # servers in parallel
        for index, future in futures:
            try:
                future.result()
            except (ServerMismatchError, ServerRefusedError):
                raise
            except ServerError as error:
                self._leave_out(index, error)
        if len(self.left_out) == len(self.clients):
            raise self._all_left_out()

    def perturb_(self, member: Member, sigma: float) -> None:
        client = self.client  # this thread's server
        with self._waiting():  # the host lock is released while the server works
            client.perturb(member, sigma)

    def restore_(self) -> None:
        client = self.client
        with self._waiting():
            client.restore()

    def _generate_ids(self, model, processing_class, texts, generation_config, num_row_groups,
                      add_special_tokens=False, **generate_kwargs):
        if generate_kwargs:
            raise ValueError(f"vllm_mode='server' takes no model.generate arguments, got {sorted(generate_kwargs)}.")
        prompt_ids = encode_prompts(processing_class, texts, add_special_tokens)
        config = with_model_defaults(generation_config, getattr(model, "generation_config", None))
        rows = sampling_kwargs(config, len(prompt_ids), self.processing_class.eos_token_id)  # the colocated engine's
        for row in rows:
            row.pop("detokenize")  # not a /v1/completions field
        client = self.client
        if all(row == rows[0] for row in rows):  # greedy: one request
            kwargs = dict(rows[0])
            with self._waiting():
                return client.generate(prompt_ids, kwargs.pop("max_tokens"), kwargs)

        def one(j):  # a seed a row, as the colocated engine's SamplingParams
            kwargs = dict(rows[j])
            return client.generate([prompt_ids[j]], kwargs.pop("max_tokens"), kwargs)[0]

        with self._waiting(), ThreadPoolExecutor(max_workers=min(self.max_concurrent_requests, len(rows))) as pool:
            return list(pool.map(one, range(len(rows))))

    check_generation_config = staticmethod(VLLMEngine.check_generation_config)
