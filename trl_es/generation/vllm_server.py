"""The trainer's side of an ES vLLM server: :class:`ESServerClient` drives one ``vllm serve`` running
:class:`~.vllm_server_worker.ESServerWorkerExtension` with seeds, and asks it for completions by token ids.

Over ``POST /collective_rpc`` (vLLM's dev-mode endpoint, ``VLLM_SERVER_DEV_MODE=1``) go the ES calls, their arguments
as JSON strings: the seed log's header and records once (:meth:`ESServerClient.init`), a member's ``(seed, sign,
sigma)`` (:meth:`~ESServerClient.perturb`), the restore, one record per iteration (:meth:`~ESServerClient.update`).
Over ``POST /v1/completions`` go token-id prompts and come back completion token ids (the request of TRL's
``VLLMClient.generate``: ``return_token_ids``). After ``init`` and every ``update`` the server's checksum is compared
with the trainer's weights; a mismatch raises :class:`ServerMismatchError` naming the server.

The session makes no automatic retries: whether a call may be repeated is the caller's decision (a perturbation
or a restore may be: it is absolute, not relative; an update is refused by the server when repeated).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from torch import nn

from ..es.update import Member
from .base import GenerationEngine, encode_prompts
from .vllm_engine import VLLMEngine, sampling_kwargs, with_model_defaults
from .vllm_server_worker import server_checksum


class ServerError(RuntimeError):
    """A call to an ES server failed (unreachable, timed out, or the server raised); the message names the server
    and the call."""


class ServerMismatchError(ServerError):
    """A server's weights are not the trainer's (its checksum differs): it must be re-initialised."""


class ESServerClient:
    """One ES vLLM server.

    Args:
        base_url (`str`): The server's URL (``http://host:port``), as TRL's ``vllm_server_base_url``.
        timeout (`float`): Seconds one request may take (a generation included), then :class:`ServerError`.
        connection_timeout (`float`): Seconds to wait for the server's ``/health`` at construction (TRL's
            ``vllm_server_timeout``); ``0``: one try.

    Raises:
        ServerError: if the server does not answer ``/health`` within ``connection_timeout``.
    """

    def __init__(self, base_url: str, timeout: float = 600.0, connection_timeout: float = 0.0):
        import requests

        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.session = requests.Session()
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
            except requests.RequestException:
                pass
            if time.monotonic() - start >= total_timeout:
                raise ServerError(f"ES server {self.base_url} is not reachable (GET /health) after {total_timeout:.0f} "
                                  "s; start it with `VLLM_SERVER_DEV_MODE=1 vllm serve ... --worker-extension-cls "
                                  "trl_es.generation.vllm_server_worker.ESServerWorkerExtension`.")
            time.sleep(1.0)

    def rpc(self, method: str, *args) -> list:
        """Run ``method(*args)`` of the extension on every worker of the server; their results, one per worker.

        Raises:
            ServerError: naming the server and ``method`` (the server's own message included).
        """
        body = {"method": method, "args": list(args), "kwargs": {}, "timeout": self.timeout}
        return self._request("POST", "/collective_rpc", f"{method}", body)["results"]

    # ------------------------------------------------------------------ ES calls
    def init(self, model: nn.Module, header: dict, records: Sequence[dict] = (), awd: bool = False) -> int:
        """Initialise the server's ES state from its base checkpoint, ``header`` and ``records`` (a seed log), and
        check it now holds ``model``'s weights.

        Args:
            model (`nn.Module`): The trainer's unwrapped HF model, at the step of the last record.
            header (`dict`): The seed log's header.
            records (`Sequence[dict]`): The seed log's records, steps ``1..k``.
            awd (`bool`): Whether the run uses Anchored Weight Decay (the server keeps theta_0).

        Returns:
            `int`: ``k``, the server's step.

        Raises:
            ServerMismatchError: if the server's weights are not ``model``'s (another base checkpoint or dtype).
        """
        spec = {"header": header, "records": list(records), "awd": bool(awd),
                "weights": [name for name, _ in model.named_parameters()]}
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
        """Apply one seed-log record on the server and check it then holds ``model``'s weights (the trainer's,
        after the same step).

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
        """Completions of the token-id prompts with the server's current weights (TRL's ``VLLMClient.generate``
        request, one completion a prompt).

        Args:
            prompt_ids (`Sequence[Sequence[int]]`): Token ids, one list a prompt.
            max_tokens (`int`): New tokens at most.
            sampling (`dict`, *optional*): Further ``/v1/completions`` fields (``temperature``, ``top_p``,
                ``top_k``, ``seed``, ``stop_token_ids``, ...); greedy (``temperature=0``) by default.

        Returns:
            `list[list[int]]`: One completion's token ids a prompt, in order.
        """
        payload = {"model": self.model, "prompt": [list(map(int, p)) for p in prompt_ids], "n": 1,
                   "max_tokens": int(max_tokens), "temperature": 0.0, "return_token_ids": True,
                   **(sampling or {})}
        choices = self._request("POST", "/v1/completions", "completions", payload)["choices"]
        if len(choices) != len(prompt_ids):
            raise ServerError(f"ES server {self.base_url}: {len(prompt_ids)} prompts gave {len(choices)} completions.")
        return [list(c["token_ids"]) for c in sorted(choices, key=lambda c: c.get("index", 0))]


class VLLMServerEngine(GenerationEngine):
    """Generation on an ES vLLM server (``ESConfig(use_vllm=True, vllm_mode="server")``): members written into the
    server's weights from their seeds, completions over HTTP; the trainer's model stays the source of truth.

    :meth:`sync_weights` (once per iteration, after the update is in the seed log) brings the server to the
    trainer's step: the last record when the server is one step behind, else (a new server, one that restarted, a
    resumed run) a re-initialisation from the base checkpoint and the whole seed log; then the checksums are
    compared.

    Args:
        processing_class (`PreTrainedTokenizerBase`): The tokenizer (its EOS is vLLM's own stop).
        client (`ESServerClient`): The server.
        seed_log (`Callable[[], SeedLog]`): The trainer's seed log (read at each sync).
        awd (`bool`): Whether the run uses Anchored Weight Decay.
        max_concurrent_requests (`int`): Sampled rows go one request each (each its own seed), this many at once.
    """

    name = "vllm_server"

    def __init__(self, processing_class, client: ESServerClient, seed_log: Callable, awd: bool = False,
                 max_concurrent_requests: int = 32):
        self.processing_class, self.client, self._seed_log, self.awd = processing_class, client, seed_log, awd
        self.max_concurrent_requests = int(max_concurrent_requests)

    def describe(self) -> dict:
        return {"name": self.name, "base_url": self.client.base_url}

    def sync_weights(self, model: nn.Module, params=None, noise=None) -> None:
        """Bring the server to the trainer's weights (``model``, after the seed log's last record); checked.

        Raises:
            ServerMismatchError: if, after the catch-up, the server's checksum is not ``model``'s.
        """
        log = self._seed_log()
        if log.header.get("not_replayable"):
            raise ValueError(f"vllm_mode='server' replays the seed log on the server; this run's cannot be: "
                             f"{log.header['not_replayable']}")
        records, step = log.records, self.client.step()
        if step == len(records):  # nothing new (an evaluation): check
            self.client.check(model, f"at step {step}")
        elif records and step == len(records) - 1:
            self.client.update(records[-1], model)
        else:  # a new or restarted server, a resumed run: base checkpoint + seed log
            self.client.init(model, log.header, records, self.awd)

    def perturb_(self, member: Member, sigma: float) -> None:
        self.client.perturb(member, sigma)

    def restore_(self) -> None:
        self.client.restore()

    def _generate_ids(self, model, processing_class, texts, generation_config, num_row_groups,
                      add_special_tokens=False, **generate_kwargs):
        if generate_kwargs:
            raise ValueError(f"vllm_mode='server' takes no model.generate arguments, got {sorted(generate_kwargs)}.")
        prompt_ids = encode_prompts(processing_class, texts, add_special_tokens)
        config = with_model_defaults(generation_config, getattr(model, "generation_config", None))
        rows = sampling_kwargs(config, len(prompt_ids), self.processing_class.eos_token_id)  # the colocated engine's
        for row in rows:
            row.pop("detokenize")
        if all(row == rows[0] for row in rows):  # greedy: one request
            kwargs = dict(rows[0])
            return self.client.generate(prompt_ids, kwargs.pop("max_tokens"), kwargs)

        def one(j):  # a seed a row, as the colocated engine's SamplingParams
            kwargs = dict(rows[j])
            return self.client.generate([prompt_ids[j]], kwargs.pop("max_tokens"), kwargs)[0]

        with ThreadPoolExecutor(max_workers=min(self.max_concurrent_requests, len(rows))) as pool:
            return list(pool.map(one, range(len(rows))))

    check_generation_config = staticmethod(VLLMEngine.check_generation_config)
