"""The vLLM *server* side of ES: a worker extension that holds the ES state itself, so only seeds travel.

A user starts vLLM's own server with it (``VLLM_SERVER_DEV_MODE=1 vllm serve DIR --worker-extension-cls
trl_es.generation.vllm_server_worker.ESServerWorkerExtension --no-enable-prefix-caching``); the trainer drives it
through ``POST /collective_rpc`` (``{"method", "args", "kwargs"}``, run on every worker). Unlike the colocated
:class:`~.vllm_worker.ESWorkerExtension`, which receives the trainer's tensors by reference, this one owns a copy:

- ``es_server_init(spec)``: reads the base weights under their Hugging Face names from the served checkpoint
  (``DIR/*.safetensors``), builds the fp32 master of every trained tensor and the noise source from the seed log's
  header, and replays the records it is given (a server that restarts catches up from seeds, not weights);
- ``es_server_perturb(seed, sign, sigma)``: member ``sign * eps(seed)`` written into the engine, bitwise what the
  trainer's population writes into its model (:meth:`GaussianPerturbation.perturbed_tensor`);
- ``es_server_restore()``: the current weights loaded again (exact: no subtraction of noise);
- ``es_server_update(record)``: one seed-log record applied by :func:`trl_es.es.seedlog.apply_record`, the
  arithmetic of the trainer's update and of ``replay``;
- ``es_server_checksum()``: the SHA-256 of the current weights, equal to the trainer's
  :func:`server_checksum` of its model exactly when the two hold the same weights bitwise.

Arguments arrive as JSON strings or numbers (vLLM's ``/collective_rpc`` passes them through); each is cast and
checked, and a bad one raises ``ValueError`` naming it, before any weight changes. Member operations must be
serialised per server by the client: vLLM runs utility calls between engine steps, so a perturbation sent while
requests are in flight would change the weights mid-generation.

This module imports no vLLM symbol, so it loads (and is tested) without vLLM.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Iterable, Mapping

import torch

from ..es.noise import noise_source_from_description
from ..es.perturbation import GaussianPerturbation
from ..es.seedlog import apply_record, header_perturbation
from ..es.update import Member, TrainedParameters
from ..fingerprint import tensors_fingerprint
from .vllm_worker import ESWorkerExtension


def server_checksum(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """The weights' checksum as a server reports it: SHA-256 (hex) of the tensors in the given order.

    Args:
        weights: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()`` of the unwrapped HF model (tied weights
            once), any dtype and device.

    Returns:
        `str`: 64 hexadecimal characters; equal for two sets of weights exactly when they hold the same names,
        dtypes, shapes and bytes (up to SHA-256 collisions).
    """
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


def _load(value, what: str):
    if isinstance(value, (dict, list)):
        return value
    try:
        return json.loads(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what} must be a JSON string (or an object), got {str(value)[:80]!r}: {error}") from None


def _member(seed, sign, sigma) -> tuple[Member, float]:
    try:
        seed, sign, sigma = int(seed), int(sign), float(sigma)
    except (TypeError, ValueError):
        raise ValueError(f"es_server_perturb takes an integer seed, a sign (1 or -1) and a float sigma; got "
                         f"seed={seed!r}, sign={sign!r}, sigma={sigma!r}.") from None
    if sign not in (1, -1) or not 0 <= seed < 2**63 or not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"es_server_perturb: seed must be in [0, 2**63), sign 1 or -1 and sigma a positive finite "
                         f"float; got seed={seed}, sign={sign}, sigma={sigma}.")
    return Member(seed, sign), sigma


class ESServerWorkerExtension(ESWorkerExtension):
    """Methods mixed into the worker of a ``vllm serve`` process (``--worker-extension-cls
    trl_es.generation.vllm_server_worker.ESServerWorkerExtension``); called through ``POST /collective_rpc``.

    State (after :meth:`es_server_init`): the current weights by HF name in the served dtype, the trained tensors'
    masters (:class:`~trl_es.es.update.TrainedParameters` over those weights), the noise source, the anchor of
    AWD, and the last applied step.
    """

    def es_server_init(self, spec) -> dict:
        """Build the ES state from the served checkpoint and a seed log's header, then replay ``records``.

        Args:
            spec (`str` or `dict`): JSON ``{"header": <seed-log header>, "weights": [<name>, ...], "records":
                [<seed-log record>, ...]}``: ``weights`` the HF model's weight names in ``named_parameters()``
                order (what the checksum covers, in that order); the header's ``noise``, ``parameters``
                (``[name, numel]``), ``master_dtype``, ``perturbation`` (full-rank Gaussian only) and
                ``awd_penalty``; the records of steps ``1..k`` (may be empty). The checkpoint is the served model's
                folder unless ``"checkpoint"`` names another; ``"awd": true`` keeps theta_0 of the trained tensors
                for Anchored Weight Decay (fp32, their size again).

        Returns:
            `dict`: ``{"step": k, "checksum": server_checksum(weights), "num_parameters": trained tensors}``.

        Raises:
            ValueError: for a malformed spec, a low-rank perturbation, a trained tensor the checkpoint lacks or of
                another size, or records that are not steps ``1..k``.
            FileNotFoundError: if the checkpoint has no ``.safetensors`` file.
        """
        spec = _load(spec, "es_server_init's spec")
        header, records = spec.get("header"), spec.get("records", [])
        if not isinstance(header, dict) or not isinstance(records, list):
            raise ValueError("es_server_init's spec needs a 'header' object (a seed log's header) and a 'records' "
                             f"list; got keys {sorted(spec)}.")
        if not isinstance(header_perturbation(header), GaussianPerturbation):
            raise ValueError(f"An ES server applies full-rank members in place; the run's perturbation is "
                             f"{header['perturbation']}. Use population_backend='sequential' with vllm_mode='server'.")
        steps = [r.get("step") for r in records]
        if steps != list(range(1, len(records) + 1)):
            raise ValueError(f"es_server_init replays records of steps 1..k in order; got steps {steps}.")
        names = spec.get("weights")
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            raise ValueError("es_server_init's spec needs 'weights': the names of the model's weights in the "
                             "trainer's order (`[n for n, _ in model.named_parameters()]`).")
        config = self.model_runner.model_config
        checkpoint = read_checkpoint(spec.get("checkpoint") or config.model, config.dtype)
        absent = [n for n in names if n not in checkpoint]
        wrong = [(n, k) for n, k in header["parameters"]
                 if n not in names or n not in checkpoint or checkpoint[n].numel() != k]
        if absent or wrong:
            raise ValueError(f"The served checkpoint does not hold the trainer's weights: missing {absent[:3]}, "
                             f"trained tensors absent or of another size {wrong[:3]}; serve the trainer's base model.")
        weights = {n: checkpoint[n] for n in names}  # the trainer's names and order (a tied weight once)
        master_dtype = torch.float32 if header.get("master_dtype", "float32") == "float32" else None
        params = TrainedParameters([(n, weights[n]) for n, _ in header["parameters"]], master_dtype)
        awd = bool(spec.get("awd", False)) or any(r.get("awd_shrink", 0.0) > 0 for r in records)
        anchor = {n: t.clone() for n, t in params.master_state_dict().items()} if awd else None  # theta_0
        self._es_noise = noise_source_from_description(header["noise"])
        self._es_params, self._es_anchor = params, anchor
        self._es_penalty = header.get("awd_penalty", "l2")
        self._es_weights = weights
        self._es_masters = params.master_state_dict()
        self._es_step = 0
        for record in records:
            self._es_apply(record)
        self.es_load_current()
        return {"step": self._es_step, "checksum": self.es_server_checksum(), "num_parameters": len(params.entries)}

    def es_server_perturb(self, seed, sign, sigma) -> None:
        """Load member ``(seed, sign)`` at ``sigma`` into the engine; undo with :meth:`es_server_restore`.

        Raises:
            ValueError: for a bad seed, sign or sigma (named; nothing is loaded).
            RuntimeError: before :meth:`es_server_init`.
        """
        self._es_require_init()
        member, sigma = _member(seed, sign, sigma)
        self._es_reload(self._es_member_weights(member, sigma))

    def es_server_restore(self) -> None:
        """Load the current weights again: the exact restore after :meth:`es_server_perturb`."""
        self._es_require_init()
        self.es_load_current()

    def es_server_update(self, record) -> dict:
        """Apply one iteration's seed-log record (``step``, ``members``, ``coefficients``, ``learning_rate``,
        ``awd_shrink``) to the masters, render and load the new weights.

        Returns:
            `dict`: ``{"step": step, "checksum": ...}``.

        Raises:
            ValueError: if the record's step is not the next one (the server missed or repeated an update: re-init
                it) or the record is malformed; the weights are unchanged then.
        """
        self._es_require_init()
        record = _load(record, "es_server_update's record")
        if record.get("step") != self._es_step + 1:
            raise ValueError(f"es_server_update: this server is at step {self._es_step}, so it takes the record of "
                             f"step {self._es_step + 1}; got step {record.get('step')!r}.")
        members, coefficients = record.get("members"), record.get("coefficients")
        if not (isinstance(members, list) and isinstance(coefficients, list) and len(members) == len(coefficients)
                and members and "learning_rate" in record):
            raise ValueError("es_server_update's record needs 'members' ([seed, sign] pairs), as many "
                             "'coefficients' and a 'learning_rate'.")
        for seed, sign in members:
            _member(seed, sign, 1.0)
        self._es_apply(record)
        self.es_load_current()
        return {"step": self._es_step, "checksum": self.es_server_checksum()}

    def es_server_checksum(self) -> str:
        """:func:`server_checksum` of the current weights (HF names, served dtype)."""
        self._es_require_init()
        return server_checksum(self._es_weights)

    def es_server_step(self) -> int:
        """The last applied step (``-1`` before :meth:`es_server_init`, e.g. a server that restarted)."""
        return getattr(self, "_es_step", -1)

    # -------------------------------------------------------------------------------------------- internals
    def _es_apply(self, record: dict) -> None:
        if record.get("awd_shrink", 0.0) > 0 and self._es_anchor is None:
            raise ValueError("es_server_update: the record has awd_shrink > 0 but this server keeps no anchor "
                             "(theta_0): initialise it with spec 'awd': true.")
        apply_record(self._es_params, self._es_noise, record, self._es_anchor, self._es_penalty)
        self._es_step = int(record["step"])

    def _es_require_init(self) -> None:
        if getattr(self, "_es_params", None) is None:
            raise RuntimeError("This ES server has no ES state: call es_server_init first (a server that restarted "
                               "is re-initialised from the base checkpoint and the seed log).")
