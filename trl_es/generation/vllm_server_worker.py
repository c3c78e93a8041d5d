"""The vLLM *server* side of ES: a worker extension that holds the ES state itself, so only seeds travel.

A user starts vLLM's own server with it (``VLLM_SERVER_DEV_MODE=1 vllm serve DIR --worker-extension-cls
trl_es.generation.vllm_server_worker.ESServerWorkerExtension --no-enable-prefix-caching``); the trainer drives it
through ``POST /collective_rpc``. Unlike the colocated :class:`~.vllm_worker.ESWorkerExtension`, it owns a copy of
the weights, the fp32 masters and the noise source, and replays seed-log records bitwise as the trainer does.

Every argument (JSON) is checked before any state changes (``ValueError`` naming it). When ``VLLM_API_KEY`` is set
where the server runs, every ES call must carry it as ``api_key`` (``PermissionError`` otherwise): vLLM's
``--api-key`` does not guard ``/collective_rpc``. The client serialises member calls per server.
"""

# no vLLM import: this module loads (and is tested) without vLLM

from __future__ import annotations

import contextlib
import glob
import hashlib
import hmac
import json
import math
import os
from collections.abc import Iterable, Mapping

import torch

from ..es.noise import noise_source_from_description
from ..es.perturbation import AWD_PENALTIES, GaussianPerturbation, Member, TrainedParameters
from ..es.seedlog import apply_record, header_perturbation
from ..fingerprint import tensors_fingerprint
from .vllm_worker import ESWorkerExtension


def server_checksum(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 (64 hex characters) of ``(name, tensor)`` pairs in the given order, e.g. the unwrapped HF model's
    ``named_parameters()``: equal exactly when names, dtypes, shapes and bytes are."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    return tensors_fingerprint({name: t.detach() for name, t in items}).hex()


def read_checkpoint(directory: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``directory``, cast to ``dtype``, by checkpoint name.

    Raises:
        FileNotFoundError: if ``directory`` holds no ``.safetensors`` file (e.g. a GGUF file: save the model with
            ``save_pretrained`` first).
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No .safetensors file in {directory!r}: the ES server reads the base weights from "
                                "the served checkpoint (save the model with `save_pretrained` and serve that folder).")
    weights = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(dtype).contiguous()
    return weights


API_KEY_ENV = "VLLM_API_KEY"  # the shared key: vLLM's (its /v1 routes) and OpenAI clients' variable


def _authorize(api_key, method: str) -> None:
    """Refuse ``method`` unless ``api_key`` is the server's key (``VLLM_API_KEY``; no key on either side: open).

    Raises:
        PermissionError: naming ``method`` and what is wrong (never the key).
    """
    expected = os.environ.get(API_KEY_ENV) or None
    given = api_key or None
    if expected is None and given is None:  # an open server
        return
    if expected is None:
        raise PermissionError(f"{method} refused: the call carries an API key, but this server has none "
                              f"({API_KEY_ENV} is unset where it runs); start it with the trainer's {API_KEY_ENV}.")
    if given is None:
        raise PermissionError(f"{method} refused: this server requires its API key and the call carries none; set "
                              f"{API_KEY_ENV} to the server's key where the trainer runs.")
    if not _key_matches(given, expected):
        raise PermissionError(f"{method} refused: wrong API key; set {API_KEY_ENV} to the server's key where the "
                              "trainer runs.")


def _key_matches(given, expected: str) -> bool:
    """Whether ``given`` is ``expected``, in constant time (both hashed first, so their lengths do not leak)."""
    digest = lambda key: hashlib.sha256(str(key).encode("utf-8")).digest()  # noqa: E731
    return hmac.compare_digest(digest(given), digest(expected))


class ESAuthenticationMiddleware:
    """ASGI middleware for ``vllm serve --middleware``: when ``VLLM_API_KEY`` is set, every HTTP route but ``/health``
    (``/collective_rpc`` included, which vLLM's ``--api-key`` leaves open) needs ``Authorization: Bearer <key>``, else
    401."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        expected = os.environ.get(API_KEY_ENV)
        if not expected or scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = {name.lower(): value for name, value in scope.get("headers", [])}
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and _key_matches(token, expected):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": f"Unauthorized: this ES server needs its API key ({API_KEY_ENV}) as "
                                    "'Authorization: Bearer <key>'."}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _load(value, what: str):
    if isinstance(value, (dict, list)):
        return value
    try:
        return json.loads(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what} must be a JSON string (or an object), got {str(value)[:80]!r}: {error}") from None


def _integer(value, what: str, low: int, high: int) -> int:
    """``value`` (an int, an integral float or a decimal string, as JSON carries them; not a bool) as an int in
    ``[low, high)``; else ``ValueError`` naming ``what``."""
    number = None  # JSON carries numbers as ints, floats or strings
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = int(value)
    if number is None or not low <= number < high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}), got {value!r}.")
    return number


def _real(value, what: str, low: float, high: float = math.inf, low_open: bool = False,
          high_open: bool = False) -> float:
    """``value`` (a number or a numeric string; not a bool) as a finite float in the given interval; else
    ``ValueError`` naming ``what`` (``NaN`` and infinities included)."""
    number = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError, OverflowError):
            number = float(value)
    inside = number is not None and math.isfinite(number) and (low < number if low_open else low <= number) and (
        number < high if high_open else number <= high)
    if not inside:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == math.inf else ']'}"  # "[0, 1)"
        raise ValueError(f"{what} must be a finite number in {interval}, got {value!r}.")
    return number


def _member(seed, sign, what: str = "es_server_perturb") -> Member:
    seed = _integer(seed, f"{what}: seed", 0, 2**63)
    sign = _integer(sign, f"{what}: sign (1 or -1)", -1, 2)
    if sign == 0:  # in [-1, 2) but not a sign
        raise ValueError(f"{what}: sign (1 or -1) must be 1 or -1, got 0.")
    return Member(seed, sign)


def _record(record, step: int, penalty: str, what: str) -> dict:
    """A seed-log record checked and cast (``step``, ``members``, ``coefficients``, ``learning_rate``,
    ``awd_shrink``): every number finite and in its range, ``step`` the expected one.

    Raises:
        ValueError: naming ``what`` and the field.
    """
    if not isinstance(record, dict):
        raise ValueError(f"{what}: a record must be an object, got {str(record)[:80]!r}.")
    got = record.get("step")
    if isinstance(got, bool) or got != step:
        raise ValueError(f"{what}: this server is at step {step - 1}, so it takes the record of step {step}; got "
                         f"step {got!r}.")
    members, coefficients = record.get("members"), record.get("coefficients")
    if not (isinstance(members, list) and isinstance(coefficients, list) and len(members) == len(coefficients)
            and members and "learning_rate" in record
            and all(isinstance(m, (list, tuple)) and len(m) == 2 for m in members)):
        raise ValueError(f"{what}: the record of step {step} needs 'members' ([seed, sign] pairs), as many "
                         "'coefficients' and a 'learning_rate'.")
    shrink_high = 1.0 if penalty == "l2" else math.inf  # l2 AWD: 0 <= learning_rate * awd_lambda < 1
    return {"step": step,
            "members": [[m.seed, m.sign] for m in (_member(seed, sign, f"{what}: members[{i}]")
                                                   for i, (seed, sign) in enumerate(members))],
            "coefficients": [_real(c, f"{what}: coefficients[{i}]", -math.inf) for i, c in enumerate(coefficients)],
            "learning_rate": _real(record["learning_rate"], f"{what}: learning_rate", 0.0),
            "awd_shrink": _real(record.get("awd_shrink", 0.0), f"{what}: awd_shrink", 0.0, shrink_high,
                                high_open=penalty == "l2")}


def _noise(header: dict):
    """The noise source of a seed log's header, its numbers checked (``ValueError`` naming ``header.noise``)."""
    noise = header.get("noise")
    if not isinstance(noise, dict) or noise.get("type") not in ("table", "gaussian", "device_gaussian"):
        raise ValueError(f"es_server_init: header.noise must describe a noise source ('type' 'table', 'gaussian' or "
                         f"'device_gaussian'), got {str(noise)[:120]!r}.")
    if noise["type"] == "table":
        noise = {**noise, "size": _integer(noise.get("size"), "es_server_init: header.noise.size", 1, 2**40),
                 "seed": _integer(noise.get("seed"), "es_server_init: header.noise.seed", 0, 2**63)}
    try:
        return noise_source_from_description(noise)
    except (KeyError, TypeError) as error:
        raise ValueError(f"es_server_init: header.noise is malformed ({error!r}): {str(noise)[:120]!r}.") from None


def _reload(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load ``weights`` into the engine (vLLM's in-place reload, then the tied heads; see
    :meth:`ESWorkerExtension._es_reload`)."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # in place
    ESWorkerExtension._es_reprocess_tied_heads(worker)


_COLOCATED_ONLY = ("{} is a colocated engine's call; an ES server takes es_server_init, es_server_perturb, "
                   "es_server_restore, es_server_update, es_server_checksum and es_server_step.")


class ESServerWorkerExtension(ESWorkerExtension):
    """Methods mixed into the worker of a ``vllm serve`` process (``--worker-extension-cls
    trl_es.generation.vllm_server_worker.ESServerWorkerExtension``); called through ``POST /collective_rpc``.

    Every ``es_server_*`` call takes ``api_key`` (keyword). The colocated engine's calls are refused here; the state
    changing helpers are module functions, so ``/collective_rpc`` cannot reach them by name.
    """

    def es_server_init(self, spec, api_key: str | None = None) -> dict:
        """Build the ES state from the served checkpoint and ``spec``, a JSON ``{"header": <seed-log header>,
        "weights": [<name>, ...] (named_parameters order), "records": [<records of steps 1..k>]}`` (optional
        ``"checkpoint"``, ``"awd": true``); returns ``{"step", "checksum", "num_parameters"}``.

        Raises:
            ValueError: for a malformed spec (named), a low-rank perturbation, a tensor the checkpoint lacks (state
                unchanged). Also ``PermissionError``, ``FileNotFoundError``."""
        _authorize(api_key, "es_server_init")
        state = self._es_build(_load(spec, "es_server_init's spec"))  # built aside, swapped in when complete
        self._es_params = None  # no ES state (step -1) unless the engine takes the new weights
        _reload(self, state["_es_weights"].items())
        for name, value in state.items():
            setattr(self, name, value)
        return {"step": self._es_step, "checksum": server_checksum(self._es_weights),
                "num_parameters": len(self._es_params.entries)}

    def es_server_perturb(self, seed, sign, sigma, api_key: str | None = None) -> None:
        """Load member ``(seed, sign)`` at ``sigma`` into the engine; undo with :meth:`es_server_restore`.

        Raises:
            ValueError: for a bad seed, sign or sigma (named; nothing is loaded). Also ``PermissionError``, and
                ``RuntimeError`` before :meth:`es_server_init`.
        """
        _authorize(api_key, "es_server_perturb")
        self._es_require_init()
        member = _member(seed, sign)
        sigma = _real(sigma, "es_server_perturb: sigma", 0.0, low_open=True)
        _reload(self, self._es_member_weights(member, sigma))  # bitwise what the trainer's population writes

    def es_server_restore(self, api_key: str | None = None) -> None:
        """Load the current weights again: the exact restore after :meth:`es_server_perturb`."""
        _authorize(api_key, "es_server_restore")
        self._es_require_init()
        _reload(self, self._es_weights.items())  # exact: no subtraction of noise

    def es_server_update(self, record, api_key: str | None = None) -> dict:
        """Apply one seed-log record to the masters and load the new weights; returns ``{"step", "checksum"}``.

        Raises:
            ValueError: if the step is not the next one (re-init the server) or a field is malformed (the weights are
                then unchanged). Also ``PermissionError``.
        """
        _authorize(api_key, "es_server_update")
        self._es_require_init()
        record = _record(_load(record, "es_server_update's record"), self._es_step + 1, self._es_penalty,
                         "es_server_update")
        if record["awd_shrink"] > 0 and self._es_anchor is None:
            raise ValueError("es_server_update: the record has awd_shrink > 0 but this server keeps no anchor "
                             "(theta_0): initialise it with spec 'awd': true.")
        apply_record(self._es_params, self._es_noise, record, self._es_anchor, self._es_penalty)  # replay's arithmetic
        self._es_step = record["step"]
        _reload(self, self._es_weights.items())
        return {"step": self._es_step, "checksum": server_checksum(self._es_weights)}

    def es_server_checksum(self, api_key: str | None = None) -> str:
        """:func:`server_checksum` of the current weights (HF names, served dtype)."""
        _authorize(api_key, "es_server_checksum")
        self._es_require_init()
        return server_checksum(self._es_weights)

    def es_server_step(self, api_key: str | None = None) -> int:
        """The last applied step (``-1`` before :meth:`es_server_init`, e.g. a server that restarted)."""
        _authorize(api_key, "es_server_step")
        return self._es_step if getattr(self, "_es_params", None) is not None else -1

    # ------------------------------------------------------------------ the colocated engine's calls: refused
    def es_bind(self, *args, **kwargs):
        raise RuntimeError(_COLOCATED_ONLY.format("es_bind"))

    def es_perturb(self, *args, **kwargs):
        raise RuntimeError(_COLOCATED_ONLY.format("es_perturb"))

    def es_load_current(self, *args, **kwargs):
        raise RuntimeError(_COLOCATED_ONLY.format("es_load_current"))

    def es_read_weights(self, api_key: str | None = None) -> dict[str, torch.Tensor]:
        """The engine model's own parameters (see :meth:`ESWorkerExtension.es_read_weights`), for tests."""
        _authorize(api_key, "es_read_weights")
        return super().es_read_weights()

    def _es_reload(self, *args, **kwargs):
        raise RuntimeError(_COLOCATED_ONLY.format("_es_reload"))

    def _es_reprocess_tied_heads(self, *args, **kwargs):
        raise RuntimeError(_COLOCATED_ONLY.format("_es_reprocess_tied_heads"))

    # -------------------------------------------------------------------------------------------- internals
    def _es_build(self, spec) -> dict:
        """The ES state of ``spec`` (see :meth:`es_server_init`) as attributes to set, records replayed; the server's
        current state is not touched."""
        if not isinstance(spec, dict):
            raise ValueError(f"es_server_init's spec must be an object, got {str(spec)[:80]!r}.")
        header, records = spec.get("header"), spec.get("records", [])
        if not isinstance(header, dict) or not isinstance(records, list):
            raise ValueError("es_server_init's spec needs a 'header' object (a seed log's header) and a 'records' "
                             f"list; got keys {sorted(spec)}.")
        try:
            perturbation = header_perturbation(header)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"es_server_init: header.perturbation is malformed: {error}") from None
        if not isinstance(perturbation, GaussianPerturbation):  # low-rank members need adapters, not in-place writes
            raise ValueError(f"An ES server applies full-rank members in place; the run's perturbation is "
                             f"{header['perturbation']}. Use population_backend='sequential' with vllm_mode='server'.")
        penalty = header.get("awd_penalty", "l2")
        if penalty not in AWD_PENALTIES:
            raise ValueError(f"es_server_init: header.awd_penalty must be one of {AWD_PENALTIES}, got {penalty!r}.")
        steps = [r.get("step") if isinstance(r, dict) else r for r in records]
        if steps != list(range(1, len(records) + 1)) or any(isinstance(s, bool) for s in steps):
            raise ValueError(f"es_server_init replays records of steps 1..k in order; got steps {steps}.")
        records = [_record(r, k, penalty, f"es_server_init: records[{k - 1}]") for k, r in enumerate(records, 1)]
        names = spec.get("weights")
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            raise ValueError("es_server_init's spec needs 'weights': the names of the model's weights in the "
                             "trainer's order (`[n for n, _ in model.named_parameters()]`).")
        trained = header.get("parameters")
        if not (isinstance(trained, list) and trained and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in trained)):
            raise ValueError("es_server_init: header.parameters must be the trained tensors as [name, numel] pairs, "
                             f"got {str(trained)[:120]!r}.")
        noise = _noise(header)
        config = self.model_runner.model_config
        # the base weights under their HF names, from the served folder (a restarted server catches up from seeds)
        checkpoint = read_checkpoint(spec.get("checkpoint") or config.model, config.dtype)
        absent = [n for n in names if n not in checkpoint]
        wrong = [(n, k) for n, k in trained if n not in names or n not in checkpoint or checkpoint[n].numel() != k]
        if absent or wrong:
            raise ValueError(f"The served checkpoint does not hold the trainer's weights: missing {absent[:3]}, "
                             f"trained tensors absent or of another size {wrong[:3]}; serve the trainer's base model.")
        weights = {n: checkpoint[n] for n in names}  # the trainer's names and order (a tied weight once)
        # None: masters in the parameters' own dtype
        master_dtype = torch.float32 if header.get("master_dtype", "float32") == "float32" else None
        params = TrainedParameters([(n, weights[n]) for n, _ in trained], master_dtype)
        awd = bool(spec.get("awd", False)) or any(r["awd_shrink"] > 0 for r in records)
        anchor = {n: t.clone() for n, t in params.master_state_dict().items()} if awd else None  # theta_0
        for record in records:  # replay: bitwise the trainer's update
            apply_record(params, noise, record, anchor, penalty)
        return {"_es_noise": noise, "_es_params": params, "_es_anchor": anchor, "_es_penalty": penalty,
                "_es_weights": weights, "_es_masters": params.master_state_dict(), "_es_step": len(records)}

    def _es_require_init(self) -> None:
        if getattr(self, "_es_params", None) is None:
            raise RuntimeError("This ES server has no ES state: call es_server_init first (a server that restarted "
                               "is re-initialised from the base checkpoint and the seed log).")
