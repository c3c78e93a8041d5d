"""GPU acceptance run: the CUDA tests, population throughput and ES vs GRPO peak memory, every result as JSON.

Made for one H200 lent for 10 minutes with no network (see ``benchmarks/gpu_acceptance.sh``, which installs the
wheels that travel with the tree and then runs this driver), and runnable end to end on CPU with ``--device cpu``
(tiny models, fewer repeats) so that on the GPU it fails only for real reasons. Every step runs in its own
subprocess under a timeout (``timeout N`` semantics: killed at N seconds, recorded as ``"timeout"``); the run as a
whole keeps to ``--budget_s`` and skips what no longer fits (recorded as ``"skipped"``).

Files written into ``--out`` (default ``$OUT``, else ``gpu_acceptance_out``), at most 8, one folder:

- ``summary.json``: the environment (torch, CUDA, the GPU, package versions, what is missing) and every step:
  status (``ok`` / ``failed`` / ``timeout`` / ``skipped``), exit code, seconds, its timeout, the tail of its output;
- ``tests.json``: (1) the tests: the CUDA-only tests (``-k cuda``: they skip without CUDA; no ``cuda`` marker exists
  in pyproject.toml) and a device-agnostic selection run with CUDA visible (the trainers then place their models on
  the GPU), as counts and failures parsed from JUnit XML;
- ``throughput_smollm2_135m.json``, ``throughput_qwen2_5_0_5b.json``: (2) ``benchmarks/population_throughput.py``
  on random weights from the SmolLM2-135M config (``smollm2_135m_config.json``) and a Qwen2.5-0.5B-shaped config
  (``QWEN2_5_0_5B`` below), eager and compiled engines: plain batch, sequential full-rank members, batched low-rank
  members; bf16 on CUDA, each variant warmed up once, then several interleaved repeats (best reported);
- ``memory_smollm2_135m.json``: (3) ``benchmarks/es_memory.py --device cuda --random_init``: peak memory of ES
  (defaults, lean mode) and TRL's GRPOTrainer, and of the loaded model alone.

Usage::

    bash benchmarks/gpu_acceptance.sh --out /tmp/acceptance          # CUDA, full sizes (about 9 minutes)
    bash benchmarks/gpu_acceptance.sh --device cpu --quick           # this machine: a minute or two
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Qwen2.5-0.5B's shape (its published config.json, no weights), built with random weights: no download.
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

#: On CPU (``--device cpu``) the same architectures, shrunk: the code paths, not the figures.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_window_layers": 2}

#: Python packages trl_es needs on the GPU image (see ../shared/gpu_notes.md); absent ones are listed in summary.json.
PACKAGES = ("torch", "transformers", "accelerate", "trl", "peft", "datasets", "dill", "multiprocess", "cma",
            "safetensors", "tokenizers", "numpy", "pytest", "deepspeed", "gguf", "vllm")

#: The throughput and memory sizes per device.
SIZES = {
    "cuda": {"population": 32, "prompts": 8, "new_tokens": 16, "repeats": 3, "dtype": "bfloat16",
             "memory_dtypes": ["bfloat16", "float32"], "memory_completions": 8, "memory_population": 4},
    "cpu": {"population": 4, "prompts": 2, "new_tokens": 4, "repeats": 2, "dtype": "float32",
            "memory_dtypes": ["float32"], "memory_completions": 2, "memory_population": 2},
}
#: Step timeouts in seconds: (CUDA, CPU).
TIMEOUTS = {
    "tests_cuda": (120, 90),
    "throughput_smollm2_135m/eager": (75, 60),
    "throughput_smollm2_135m/compiled": (150, 120),
    "memory_smollm2_135m": (150, 150),
    "throughput_qwen2_5_0_5b/eager": (75, 60),
    "throughput_qwen2_5_0_5b/compiled": (150, 120),
    "tests_device_agnostic": (150, 120),
}
#: The device-agnostic selection (not slow, not distributed): ES core, low-rank members, generation engines, trainer.
AGNOSTIC_TESTS = ["tests/es/test_es_core.py", "tests/es/test_lowrank.py", "tests/generation/test_generation.py",
                  "tests/trainer/test_es_trainer.py"]
CUDA_TESTS = ["tests/es/test_es_core.py", "tests/generation/test_generation.py", "tests/trainer/test_es_trainer.py"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_acceptance_out")
    parser.add_argument("--budget_s", type=float, default=540.0,
                        help="The steps, all together (10 minutes less the wheel install and a margin).")
    parser.add_argument("--quick", action="store_true",
                        help="Reduced run (the test of this script): no compiled engine, one repeat, CUDA-only tests "
                             "and a small device-agnostic selection.")
    parser.add_argument("--steps", nargs="+", default=None, choices=list(TIMEOUTS), help="Only these steps.")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------- helpers
def tail(text: str, chars: int = 4000) -> str:
    return text[-chars:] if text else ""


def run_step(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run ``cmd`` as ``timeout N cmd`` would: killed (the whole process group) after ``timeout`` seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        status = "timeout"
    return {"status": status, "returncode": proc.returncode, "seconds": round(time.monotonic() - start, 2),
            "timeout_s": round(timeout, 1), "command": " ".join(cmd), "output_tail": tail(out)}


def environment(device: str) -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "requested_device": device, "packages": {}, "missing": []}
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
            info["packages"][name] = getattr(module, "__version__", "?")
        except Exception as error:  # noqa: BLE001 - any import failure is a missing package here
            info["missing"].append(f"{name}: {type(error).__name__}: {str(error)[:200]}")
    try:
        import torch

        info["cuda_available"] = torch.cuda.is_available()
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception as error:  # noqa: BLE001
        info["torch_error"] = repr(error)
    try:
        import trl_es

        info["trl_es"] = os.path.dirname(trl_es.__file__)
        from trl_es import ESConfig, ESTrainer  # noqa: F401
    except Exception as error:  # noqa: BLE001
        info["trl_es_error"] = f"{type(error).__name__}: {str(error)[:500]}"
    return info


def junit_summary(path: str) -> dict:
    """Counts and failures from a pytest JUnit XML file."""
    if not os.path.exists(path):
        return {"error": "no JUnit XML written"}
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skipped = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                failures.append({"test": name, "message": (child.get("message") or "")[:500],
                                 "details": tail(child.text or "", 1500)})
            elif child.tag == "skipped":
                outcome = "skipped"
                skipped.append({"test": name, "reason": (child.get("message") or "")[:200]})
        counts[outcome] += 1
    return {"counts": counts, "failures": failures, "skipped": skipped}


def write(out: str, name: str, payload: dict) -> str:
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return name


# ---------------------------------------------------------------------------------------------- model configs
def model_config(name: str, device: str) -> dict:
    if name == "smollm2_135m":
        with open(os.path.join(HERE, "smollm2_135m_config.json")) as f:
            config = json.load(f)
    else:
        config = dict(QWEN2_5_0_5B)
    if device == "cpu":
        config.update({k: v for k, v in TINY.items() if k in config or k != "max_window_layers"})
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if config.get(key) is not None and config[key] >= config["vocab_size"]:
                config[key] = 2
    return config


def throughput_child(config_path: str, argv: list[str]) -> None:
    """``population_throughput.py --random_init`` with its model config replaced by ``config_path``."""
    sys.path.insert(0, HERE)
    import population_throughput

    population_throughput.CONFIG = config_path
    sys.argv = ["population_throughput.py", *argv]
    population_throughput.main()


# ---------------------------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "_throughput":  # a step's subprocess
        throughput_child(sys.argv[2], sys.argv[3:])
        return 0
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    device = args.device
    column = 0 if device == "cuda" else 1
    sizes = SIZES[device]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path stays on CPU even where a GPU is present
        env.setdefault("OMP_NUM_THREADS", "1")
    summary = {"device": device, "quick": args.quick, "budget_s": args.budget_s, "out": os.path.abspath(args.out),
               "environment": environment(device), "steps": {}, "files": ["summary.json"]}
    if device == "cuda" and not summary["environment"].get("cuda_available"):
        summary["error"] = "--device cuda but torch.cuda.is_available() is False"
    write(args.out, "summary.json", summary)
    scratch = tempfile.mkdtemp(prefix="gpu_acceptance_")
    results: dict[str, dict] = {}  # output file -> payload

    def budget_left() -> float:
        return args.budget_s - (time.monotonic() - started)

    def step(name: str, cmd: list[str], minimum: float = 20.0) -> dict:
        timeout = min(TIMEOUTS[name][column], budget_left())
        if (args.steps and name not in args.steps) or timeout < minimum:
            record = {"status": "skipped", "reason": "not selected" if args.steps and name not in args.steps
                      else f"budget: {budget_left():.0f} s left"}
        else:
            print(f"[gpu_acceptance] {name} (timeout {timeout:.0f} s)", flush=True)
            record = run_step(cmd, timeout, env)
            print(f"[gpu_acceptance] {name}: {record['status']} in {record['seconds']} s", flush=True)
        summary["steps"][name] = {k: v for k, v in record.items()}
        write(args.out, "summary.json", summary)
        return record

    python = sys.executable

    # (1) tests --------------------------------------------------------------------------------------------
    tests = {"note": "no 'cuda' pytest marker exists (pyproject.toml: slow, distributed); the CUDA-only tests are "
                     "selected with -k cuda (they skip without CUDA); the device-agnostic selection runs with CUDA "
                     "visible (ESTrainer/Trainer place models on the GPU)."}
    xml = os.path.join(scratch, "cuda.xml")
    record = step("tests_cuda", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda",
                                 "-m", "not slow and not distributed", f"--junitxml={xml}", *CUDA_TESTS])
    tests["cuda_only"] = {**record, **junit_summary(xml)} if record["status"] != "skipped" else record

    # (2) throughput ---------------------------------------------------------------------------------------
    engines = ["eager"] if args.quick else ["eager", "compiled"]
    for model_name in ("smollm2_135m", "qwen2_5_0_5b"):
        config_path = os.path.join(scratch, f"{model_name}.json")
        with open(config_path, "w") as f:
            json.dump(model_config(model_name, device), f)
        payload = {"config": model_config(model_name, device), "sizes": sizes}
        for engine in engines:
            name = f"throughput_{model_name}/{engine}"
            json_path = os.path.join(scratch, f"{model_name}-{engine}.json")
            repeats = 1 if args.quick else sizes["repeats"]
            cmd = [python, os.path.abspath(__file__), "_throughput", config_path, "--random_init",
                   "--device", device, "--dtype", sizes["dtype"], "--engine", engine,
                   "--population", str(sizes["population"]), "--prompts", str(sizes["prompts"]),
                   "--new_tokens", str(sizes["new_tokens"]), "--prompt_tokens", "16", "--shared_prefix_tokens", "8",
                   "--repeats", str(repeats), "--output_json", json_path]
            if device == "cpu":
                cmd += ["--threads", "1"]
            record = step(name, cmd)
            if os.path.exists(json_path):
                with open(json_path) as f:
                    record["result"] = json.load(f)
            payload[engine] = record
        results[f"throughput_{model_name}.json"] = payload
        write(args.out, f"throughput_{model_name}.json", payload)
        summary["files"].append(f"throughput_{model_name}.json")

        if model_name == "smollm2_135m":  # (3) memory, before the bigger model's throughput
            json_path = os.path.join(scratch, "memory.json")
            cmd = [python, os.path.join(HERE, "es_memory.py"), "--device", device, "--random_init",
                   "--dtypes", *sizes["memory_dtypes"][: 1 if args.quick else None],
                   "--completions", str(sizes["memory_completions"]), "--num_generations", "2",
                   "--population_size", str(sizes["memory_population"]),
                   "--new_tokens", str(sizes["new_tokens"]), "--output_json", json_path]
            if device == "cpu":  # a small model; no "load" variant: with imports dominating the resident set, its
                # peak can equal GRPO's, and es_memory.py then divides by zero (its ratio "above the loaded model")
                cmd += ["--scale", "0.05", "--threads", "1", "--variants",
                        *(("es_lean", "grpo") if args.quick else ("es_default", "es_lean", "grpo"))]
            record = step("memory_smollm2_135m", cmd)
            if os.path.exists(json_path):
                with open(json_path) as f:
                    record["result"] = json.load(f)
            results["memory_smollm2_135m.json"] = record
            write(args.out, "memory_smollm2_135m.json", record)
            summary["files"].append("memory_smollm2_135m.json")

    # (1b) device-agnostic tests, last: what is left of the budget ---------------------------------------------
    xml = os.path.join(scratch, "agnostic.xml")
    selection = ["tests/es/test_es_core.py", "-k", "restore"] if args.quick else AGNOSTIC_TESTS
    record = step("tests_device_agnostic", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                            "-m", "not slow and not distributed", f"--junitxml={xml}", *selection],
                  minimum=30.0)
    tests["device_agnostic"] = {**record, **junit_summary(xml)} if record["status"] != "skipped" else record
    write(args.out, "tests.json", tests)
    summary["files"].append("tests.json")

    summary["seconds"] = round(time.monotonic() - started, 1)
    statuses = [s["status"] for s in summary["steps"].values()]
    summary["ok"] = all(s in ("ok", "skipped") for s in statuses) and "error" not in summary
    write(args.out, "summary.json", summary)
    print(f"[gpu_acceptance] {summary['seconds']} s; " + ", ".join(f"{k}: {v['status']}"
                                                                   for k, v in summary["steps"].items()))
    print(f"[gpu_acceptance] results in {os.path.abspath(args.out)}: {', '.join(summary['files'])}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
