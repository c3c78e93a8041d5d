"""``benchmarks/gpu_acceptance.sh`` runs end to end on CPU (``--device cpu --quick``: tiny models, the eager engine,
one repeat) and writes every JSON file the GPU run writes, so that on the GPU it fails only for real reasons. Six
interpreters end to end (about 80 CPU-s): marked ``slow``, it runs in ``scripts/check_main_job.sh`` (CI), not in the
suite."""

import json
import os
import subprocess
import sys

import pytest
from paths import REPO

ROOT = REPO
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_acceptance.sh")
FILES = ("summary.json", "tests.json", "throughput_smollm2_135m.json", "throughput_qwen2_5_0_5b.json",
         "memory_smollm2_135m.json")


@pytest.mark.slow
def test_gpu_acceptance_cpu_quick_writes_every_result(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, WHEELS=str(tmp_path / "no-wheels"), SCRATCH=str(tmp_path),
               OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    proc = subprocess.run(["bash", SCRIPT, "--device", "cpu", "--quick", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert sorted(os.listdir(out)) == sorted(FILES)  # one folder, nothing else (at most 8 files travel back)
    results = {}
    for name in FILES:
        with open(out / name) as f:
            results[name] = json.load(f)
    summary = results["summary.json"]
    assert summary["ok"] and summary["device"] == "cpu" and sorted(summary["files"]) == sorted(FILES)
    assert "torch" in summary["environment"]["packages"] and "trl_es_error" not in summary["environment"]
    assert set(summary["steps"]) == {"tests_cuda", "throughput_smollm2_135m/eager", "memory_smollm2_135m",
                                     "throughput_qwen2_5_0_5b/eager", "tests_device_agnostic"}
    assert all(step["status"] == "ok" and step["seconds"] <= step["timeout_s"] for step in summary["steps"].values())
    tests = results["tests.json"]
    assert tests["cuda_only"]["counts"]["skipped"] >= 4 and tests["cuda_only"]["counts"]["failed"] == 0  # no CUDA
    assert tests["device_agnostic"]["counts"]["passed"] >= 1 and not tests["device_agnostic"]["failures"]
    for name in ("throughput_smollm2_135m.json", "throughput_qwen2_5_0_5b.json"):
        rates = results[name]["eager"]["result"]["completions_per_second"]
        assert set(rates) == {"(a) plain generate", "(b) sequential full-rank", "(c) batched low-rank"}
        assert all(rate > 0 for rate in rates.values())
    assert results["throughput_qwen2_5_0_5b.json"]["config"]["model_type"] == "qwen2"
    memory = results["memory_smollm2_135m.json"]["result"]
    assert {"es_lean/float32", "grpo/float32"} <= set(memory)
    assert all(memory[k]["peak_mib"] > 0 for k in ("es_lean/float32", "grpo/float32"))
