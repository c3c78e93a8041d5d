"""The same bits on every CPU: the noise, the ES arithmetic and whole ES runs, checked against pinned values and
independent computations here, and in subprocesses with torch's CPU dispatch forced to ``default`` and ``avx2``
(what a CPU without AVX2, or with AVX-512, runs: ``torch.randn`` and the fused ``add(alpha=)`` kernels differ there).
"""

import hashlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from trl_es.es import GaussianNoise, NoiseTable, make_noise_source
from trl_es.es.perturbation import add_scaled_, added_scaled, exact_mean, zscore
from trl_es.es.noise import (LEGACY_GENERATOR, PORTABLE_GENERATOR, TABLE_SEED, DeviceGaussianNoise,
                             noise_source_from_description, standard_normal)
from trl_es.es.fitness import shape_fitness
from paths import TESTS

HERE = TESTS
ROOT = os.path.dirname(HERE)


def sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def test_portable_noise_values_are_pinned():
    """The values every seed log from 2026-12-02 on was trained with (recorded on an AVX2 CPU and equal with
    ATEN_CPU_CAPABILITY=default): a change of generator, or a CPU that draws other values, fails here."""
    table = standard_normal(1 << 20, TABLE_SEED)
    assert table.dtype == torch.float32 and table.shape == (1 << 20,)
    assert sha(table) == "47d2bb81623a436c77921db9f401b8230c8c1f3b9f424aff424457b8a4093daa"
    assert sha(standard_normal(1000, 5)) == "0786b337fd54161441661cbc44bcfc87a6bbceed9a56deeb6adcb6c6c0fab22b"
    assert abs(float(table.mean())) < 5e-3 and abs(float(table.std()) - 1) < 5e-3
    # the sources draw from it: the table is the generator's stream, a fresh block its own stream
    source = NoiseTable(1 << 20)
    assert torch.equal(source.values("cpu"), table)
    assert source.describe()["generator"] == PORTABLE_GENERATOR
    block = GaussianNoise().block(3, "w", 0, 100, "cpu")
    assert torch.equal(block, DeviceGaussianNoise().block(3, "w", 0, 100, "cpu"))
    assert isinstance(make_noise_source(0, "auto", "cpu"), GaussianNoise)


def test_legacy_descriptions_replay_with_torch_randn():
    """A noise description without "generator" (seed logs before 2026-12-02) rebuilds the torch.randn source; a new
    one the portable source; an unknown generator is refused by name."""
    legacy = noise_source_from_description({"type": "table", "size": 1 << 20, "seed": TABLE_SEED,
                                            "block_size": 1 << 20})
    assert legacy.generator == LEGACY_GENERATOR and not legacy.portable
    assert "generator" not in legacy.describe()  # compares equal with the old checkpoints' headers
    expected = torch.randn(1 << 20, generator=torch.Generator().manual_seed(TABLE_SEED))
    assert torch.equal(legacy.values("cpu"), expected)
    new = noise_source_from_description(NoiseTable(1 << 20).describe())
    assert new.portable and new.generator == PORTABLE_GENERATOR
    with pytest.raises(ValueError, match="Unknown noise generator 'mt19937'"):
        noise_source_from_description({"type": "gaussian", "generator": "mt19937"})


def test_add_scaled_is_a_multiply_then_an_add():
    """The portable ``y + alpha * x``: bitwise what NumPy computes with one rounding per operation (no FMA); the
    legacy mode is torch's one-pass kernel."""
    generator = torch.Generator().manual_seed(0)
    y, x = torch.randn(10_001, generator=generator), torch.randn(10_001, generator=generator)
    alpha = 0.1234567
    expected = y.numpy() + x.numpy() * np.float32(alpha)
    assert np.array_equal(add_scaled_(y.clone(), x, alpha).numpy(), expected)
    assert np.array_equal(added_scaled(y, x, alpha).numpy(), expected)
    out = torch.empty_like(y)
    added_scaled(y, x, alpha, out=out)
    assert np.array_equal(out.numpy(), expected)
    assert torch.equal(add_scaled_(y.clone(), x, alpha, portable=False), torch.add(y, x, alpha=alpha))


def test_zscore_is_exactly_rounded():
    """Fitness shaping's mean and variance are exactly rounded sums (math.fsum), not reductions whose order depends
    on the SIMD width."""
    values = torch.tensor([0.1, 0.7, 1e-3, 0.3333333333333333, 0.9, 0.25], dtype=torch.float64)
    plain = values.tolist()
    mean = math.fsum(plain) / len(plain)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in plain) / len(plain))
    assert exact_mean(values) == mean
    assert zscore(values).tolist() == [(v - mean) / std for v in plain]
    assert torch.equal(shape_fitness(values, "zscore"), zscore(values))
    with pytest.raises(ValueError, match="empty"):
        exact_mean(torch.zeros(0))


RUN_AND_HASH = r"""
import hashlib, os, sys
import torch
sys.path.insert(0, {tests!r})
sys.path.insert(0, {data!r})
torch.set_num_threads(1)
import make_runs
for name in sys.argv[2:]:
    out = os.path.join(sys.argv[1], name)
    _, trained = make_runs.train(name, out)
    digest = hashlib.sha256(b"".join(trained[k].numpy().tobytes() for k in sorted(trained))).hexdigest()
    log = open(os.path.join(out, "es_seed_log.jsonl")).read().splitlines()[1:]
    print("RESULT", name, torch.backends.cpu.get_cpu_capability(), digest,
          hashlib.sha256("\n".join(log).encode()).hexdigest())
"""
RUNS = ["sequential_awd_antithetic", "lowrank_rank2"]


@pytest.fixture(scope="module")
def dispatch_results(tmp_path_factory):
    """``{capability: {name: (dispatch, weights sha256, seed log sha256)}}``: every run of ``RUNS`` trained in one
    subprocess per forced CPU dispatch (one interpreter start per dispatch, not per run)."""
    script = RUN_AND_HASH.format(tests=HERE, data=os.path.join(HERE, "data", "recorded_runs"))
    results = {}
    for capability in ("default", "avx2"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        out = tmp_path_factory.mktemp(capability)
        done = subprocess.run([sys.executable, "-c", script, str(out), *RUNS], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RESULT")]
        results[capability] = {name: tuple(rest) for name, *rest in lines}
    return results


@pytest.mark.parametrize("name", RUNS)
def test_es_runs_are_bitwise_equal_under_every_cpu_dispatch(name, dispatch_results):
    """The recorded ES runs trained in subprocesses with torch's CPU dispatch forced to ``default`` (no AVX2, no FMA:
    what the oldest x86-64 CPUs run) and to ``avx2``: the same weights and seed logs, and the recorded weights (this
    CPU's own dispatch trains them in-process in test_training_matches_recorded_runs.py)."""
    from safetensors.torch import load_file

    results = {}
    for capability in ("default", "avx2"):
        dispatch, weights, log = dispatch_results[capability][name]
        results[capability] = (weights, log)
        assert dispatch == capability.upper()
    assert results["default"] == results["avx2"]
    recorded = load_file(os.path.join(HERE, "data", "recorded_runs", name, "trained.safetensors"))
    digest = hashlib.sha256(b"".join(recorded[k].numpy().tobytes() for k in sorted(recorded))).hexdigest()
    assert results["avx2"][0] == digest
