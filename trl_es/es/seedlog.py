"""The seed log: every iteration's member seeds and coefficients (JSON Lines, a header then a line per
iteration), and :func:`replay`, which rebuilds the trained weights from the base model and the log.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..quantized import HEADER_KEY, check_same_quantization
from .noise import PORTABLE_GENERATOR, NoiseSource, noise_source_from_description
from .perturbation import (
    GaussianPerturbation,
    LowRankPerturbation,
    Member,
    Perturbation,
    TrainedParameters,
    es_update_,
    perturbation_from_description,
)


SEED_LOG_NAME = "es_seed_log.jsonl"
FORMAT = "trl_es.seedlog"
#: The versions of the format ``load`` reads, and the generator and arithmetic each says the run was trained with.
VERSIONS = {
    1: "the noise description's 'generator' says: 'numpy-pcg64' (NumPy PCG64 noise, the portable arithmetic of "
       "trl_es.es.perturbation) or, where the key is absent, 'torch' (torch.randn noise, torch's fused kernels)",
    2: "NumPy PCG64 noise ('numpy-pcg64') and the portable arithmetic of trl_es.es.perturbation",
}
VERSION = 2  # what a new log is written as


@dataclass
class SeedLog:
    """In-memory seed log: ``header`` (:meth:`EvolutionStrategy.describe
    <trl_es.es.strategy.EvolutionStrategy.describe>` plus ``run_settings``), one record per iteration, and the
    format ``version`` (:data:`VERSIONS`).
    """

    header: dict  # older logs name the perturbation through population_backend (header_perturbation reads both)
    # per record: step (1-based, contiguous from the base model), members ([seed, sign]), coefficients,
    # learning_rate, awd_shrink (alpha * lambda), and global_step where a second train() restarted Trainer's count
    records: list[dict] = field(default_factory=list)
    version: int = VERSION  # a loaded log is saved again as the version it was read

    def append(self, global_step: int, members, coefficients, learning_rate: float, awd_shrink: float = 0.0,
               extra: dict | None = None) -> None:
        """Record one iteration as the log's next step; ``global_step`` is kept only where it differs from it;
        ``extra``: further JSON keys (``sigma``, the collapse guard's; replay reads none of them)."""
        record = {
            "step": len(self.records) + 1,
            "members": [[int(m.seed), int(m.sign)] for m in members],
            "coefficients": [float(c) for c in coefficients],
            "learning_rate": float(learning_rate),
            "awd_shrink": float(awd_shrink),
        }
        if int(global_step) != record["step"]:  # a second train() on the same trainer restarts Trainer's count
            record["global_step"] = int(global_step)
        record.update(extra or {})
        self.records.append(record)

    def truncate(self, step: int) -> None:
        """Drop records after ``step``."""
        self.records = [r for r in self.records if r["step"] <= step]

    @property
    def global_step(self) -> int:
        """``Trainer``'s ``global_step`` after the last recorded iteration (0 for an empty log)."""
        if not self.records:
            return 0
        return int(self.records[-1].get("global_step", self.records[-1]["step"]))

    def save(self, path: str) -> None:
        """Write the log as JSON Lines, atomically (:func:`trl_es.files.write_text`)."""
        from ..files import write_text

        lines = [json.dumps({"format": FORMAT, "version": self.version, **self.header})]
        lines += [json.dumps(record) for record in self.records]
        write_text(path, "".join(line + "\n" for line in lines))

    @classmethod
    def load(cls, path: str) -> SeedLog:
        """Read a log written by :meth:`save`; a directory is read as ``<dir>/es_seed_log.jsonl``.

        Raises:
            ValueError: if the file is not a trl_es seed log, has a version not in :data:`VERSIONS`, a version-2 header
                names another noise generator, or its steps are not ``1, 2, ..., N`` (:func:`check_steps`).
        """
        if os.path.isdir(path):
            path = os.path.join(path, SEED_LOG_NAME)
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        if not lines or lines[0].get("format") != FORMAT:
            raise ValueError(f"{path} is not a trl_es seed log (missing header with format={FORMAT!r}).")
        version = lines[0].get("version", 1)  # version-1 headers name no version
        if version not in VERSIONS or isinstance(version, bool):
            raise ValueError(f"{path} is a trl_es seed log of version {version!r}; this trl_es reads versions "
                             f"{sorted(VERSIONS)}: {'; '.join(f'{v}: {text}' for v, text in VERSIONS.items())}.")
        header = {k: v for k, v in lines[0].items() if k not in ("format", "version")}
        if version >= 2 and "noise" in header:  # the generator is the version's, named or not
            header["noise"] = {**header["noise"], "generator": header["noise"].get("generator", PORTABLE_GENERATOR)}
            if header["noise"]["generator"] != PORTABLE_GENERATOR:
                raise ValueError(f"{path}: a version-{version} seed log is trained with noise generator "
                                 f"{PORTABLE_GENERATOR!r}, but its header names {header['noise']['generator']!r}.")
        check_steps([record.get("step") for record in lines[1:]], path)
        return cls(header=header, records=lines[1:], version=version)


def check_steps(steps: list, where: str) -> None:
    """Check that ``steps`` (the records', in file order) are ``1, 2, ..., N``, each once, in order.

    Raises:
        ValueError: naming ``where`` and the steps that are missing, repeated, or out of order.
    """
    if steps == list(range(1, len(steps) + 1)):  # a log replays from the base model
        return
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps):
        raise ValueError(f"{where}: every seed-log record needs an integer step >= 1, got steps {steps}.")
    seen = set(steps)
    missing = [s for s in range(1, max(steps) + 1) if s not in seen]  # e.g. a log that starts at step 3
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    problems = []
    if missing:
        problems.append(f"missing steps {missing}" + (" (the log does not start at step 1, the base model)"
                                                      if steps[0] != 1 else ""))
    if repeated:
        problems.append(f"repeated steps {repeated}")
    if not problems:
        problems.append(f"steps out of order: {steps}")
    raise ValueError(f"{where}: a seed log must hold steps 1..N, each once and in order, to replay from the base "
                     f"model; this one has {'; '.join(problems)}. It is incomplete or was assembled from several runs.")


def header_perturbation(header: dict) -> Perturbation:
    """The perturbation a seed log was written with (its ``perturbation`` key, else ``population_backend``)."""
    if "perturbation" in header:
        return perturbation_from_description(header["perturbation"])
    backend = header.get("population_backend", {"name": "sequential"})
    if backend.get("name") == "batched_lowrank":
        return LowRankPerturbation(backend.get("noise_rank", 1))
    return GaussianPerturbation()


def apply_record(
    params: TrainedParameters, noise: NoiseSource, record: dict, anchor=None, penalty="l2",
    perturbation: Perturbation | None = None,
) -> None:
    """Apply one logged iteration to ``params``: the ES step along ``perturbation`` (default full-rank), then AWD."""
    members = [Member(seed, sign) for seed, sign in record["members"]]
    es_update_(params, perturbation or GaussianPerturbation(), noise, members, record["coefficients"],
               record["learning_rate"])
    if record.get("awd_shrink", 0.0) > 0:
        params.anchored_weight_decay_(anchor, record["awd_shrink"], penalty)


def replay(model: nn.Module, log_path: str, max_step: int | None = None) -> nn.Module:
    """Rebuild trained weights from the base model (with PEFT: its initial PeftModel) and a seed log (a file or a
    folder holding one) in place, up to ``max_step``; bitwise the trained model for ``es_optimizer="es"``.

    A run on a quantized base (the header's ``quantization_config``) replays onto that base only: its PeftModel over
    the base loaded with :func:`trl_es.quantized.quantization_config_from_header`.

    Raises:
        ValueError: for a torch-optimizer or ``not_replayable`` log, parameters the model lacks, steps that are not
            ``1..N`` (:meth:`SeedLog.load`), a log that ends before ``max_step``, or a base quantized otherwise than
            the header records.
    """
    log = SeedLog.load(log_path)  # the same fp32 master arithmetic then runs in the same order
    if max_step is not None and max_step > len(log.records):
        raise ValueError(f"max_step={max_step} is beyond the seed log {log_path!r}, which ends at step "
                         f"{len(log.records)}: steps {list(range(len(log.records) + 1, max_step + 1))} are missing.")
    if log.header.get("not_replayable"):
        raise ValueError(f"This seed log cannot be replayed: {log.header['not_replayable']}")
    if log.header.get("optimizer", "es") != "es":  # a torch optimizer's state is not in the log
        raise ValueError("replay reproduces es_optimizer='es' runs only; this log was written with a torch optimizer.")
    check_same_quantization(log.header.get(HEADER_KEY), model, "replay")
    named = dict(model.named_parameters())
    missing = [name for name, _ in log.header["parameters"] if name not in named]
    if missing:
        raise ValueError(f"The model has no parameters named {missing[:3]} (and {max(0, len(missing) - 3)} more).")
    # null: the master was kept in each parameter's own dtype
    master_dtype = torch.float32 if log.header.get("master_dtype", "float32") == "float32" else None
    perturbation = header_perturbation(log.header)
    # Low-rank noise never writes into the weights, so an entry already in the master dtype needs no copy; the
    # arithmetic (fp32 sums added into fp32 values) is the same either way.
    params = TrainedParameters([(name, named[name]) for name, _ in log.header["parameters"]], master_dtype,
                               share_params=isinstance(perturbation, LowRankPerturbation))
    # theta_0 for AWD: the base model's values, taken before the first record
    needs_anchor = any(record.get("awd_shrink", 0.0) > 0 for record in log.records)
    anchor = {n: t.detach().clone() for n, t in params.master_state_dict().items()} if needs_anchor else None
    noise = noise_source_from_description(log.header["noise"])
    penalty = log.header.get("awd_penalty", "l2")
    for record in log.records:
        if max_step is not None and record["step"] > max_step:  # records are steps 1..N in order
            break
        apply_record(params, noise, record, anchor, penalty, perturbation)
    return model
