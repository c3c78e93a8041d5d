"""Try ES levers on the validation split: every arm is the main-job recipe plus overrides, run with ``trl-es train``.

Each arm runs as its own single-threaded process (``OMP_NUM_THREADS=1``), ``--parallel`` arms at a time, for a fixed
number of iterations with the held-out evaluations on the **validation** split (``eval_split: validation``,
``score_test_split: false``: no test figure is computed while tuning). Arms are compared at equal iterations (or at
iterations of equal cost, as the arms file says), so the comparison does not depend on what else runs on the
machine. Writes ``<output_dir>/<seed>/<arm>/results.json`` per arm and ``<output_dir>/levers.md`` / ``levers.json``
(validation accuracy at every evaluation, per arm and task seed).

    python examples/studies/tune_es_levers.py --arms examples/tuning/es_levers.yaml --task_seeds 1 \\
        --output_dir runs/levers --parallel 2
    python examples/studies/tune_es_levers.py --arms examples/tuning/es_levers.yaml --only base lowrank_r1 ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import yaml

from trl_es.files import is_main_process, write_json, write_text

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPE = os.path.normpath(os.path.join(HERE, "..", "recipes", "arithmetic_smollm2.yaml"))


def arm_command(recipe: str, overrides: dict, seed: int, output_dir: str) -> list[str]:
    """The ``trl-es train`` command of one arm."""
    command = [sys.executable, "-m", "trl_es.cli", "train", "--config", recipe, "--task_seed", str(seed),
               "--eval_split", "validation", "--score_test_split", "false", "--eval_before_training", "false",
               "--time_budget_minutes", "1000", "--plot", "false", "--output_dir", output_dir]
    for key, value in overrides.items():
        command += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return command


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", required=True, help="YAML file with `common` overrides and named `arms`.")
    parser.add_argument("--recipe", default=RECIPE, help="The base recipe (default: the main job's).")
    parser.add_argument("--task_seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--only", nargs="*", default=None, help="Run only these arms.")
    parser.add_argument("--output_dir", default="runs/levers")
    parser.add_argument("--parallel", type=int, default=2, help="Arms run at the same time (one thread each).")
    args = parser.parse_args(argv)
    with open(args.arms) as f:
        spec = yaml.safe_load(f)
    common, arms = spec.get("common", {}), spec["arms"]
    names = args.only or list(arms)
    unknown = [n for n in names if n not in arms]
    if unknown:
        raise ValueError(f"--only names arms that {args.arms} does not define: {unknown}")
    jobs = []
    for seed in args.task_seeds:
        for name in names:
            out = os.path.join(args.output_dir, f"seed{seed}", name)
            if os.path.exists(os.path.join(out, "results.json")):
                continue  # already done: rerunning the script resumes the sweep
            jobs.append((name, seed, out, arm_command(args.recipe, {**common, **(arms[name] or {})}, seed, out)))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    running = []
    while jobs or running:
        while jobs and len(running) < args.parallel:
            name, seed, out, command = jobs.pop(0)
            os.makedirs(out, exist_ok=True)
            log = open(os.path.join(out, "log.txt"), "w")
            print(f"[levers] start {name} seed {seed}", flush=True)
            running.append((name, seed, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(5)
        for item in list(running):
            name, seed, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                print(f"[levers] done {name} seed {seed}: exit {proc.returncode}", flush=True)
    summarize(args.output_dir)


def summarize(output_dir: str) -> dict:
    """Collect every arm's validation curve into levers.json and a markdown table levers.md."""
    table = {}
    for seed_dir in sorted(os.listdir(output_dir)):
        if not seed_dir.startswith("seed"):
            continue
        for arm in sorted(os.listdir(os.path.join(output_dir, seed_dir))):
            path = os.path.join(output_dir, seed_dir, arm, "results.json")
            if os.path.exists(path):
                with open(path) as f:
                    result = json.load(f)
                table.setdefault(arm, {})[seed_dir] = {
                    "curve": result.get("curve", []), "final": result["accuracy_after"],
                    "iterations": result["iterations"], "train_seconds": result.get("train_seconds")}
    lines = ["| arm | task seed | iterations | validation accuracy at each evaluation | final |", "|---|---|---|---|---|"]
    for arm, seeds in table.items():
        for seed, r in seeds.items():
            curve = ", ".join(f"{c['step']}: {c['accuracy']:.3f}" for c in r["curve"])
            lines.append(f"| {arm} | {seed[4:]} | {r['iterations']} | {curve} | {r['final']:.3f} |")
    if is_main_process():
        write_json(os.path.join(output_dir, "levers.json"), table)
        write_text(os.path.join(output_dir, "levers.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return table


if __name__ == "__main__":
    main()
