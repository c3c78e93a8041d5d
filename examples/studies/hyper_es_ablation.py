"""Which element of the paper's protocol moves Hyper-ES relative to GRPO-LoRA: each element changed alone from
``examples/recipes/hyper_es_paper_protocol_cpu.yaml``, per seed, against that seed's run of the recipe itself.

The recipe's own runs (``<out>/seed<N>/comparison.json``, from ``hyper_es_seeds.sh``) hold the reference arms (base,
best single direction, uniform merge, GRPO-LoRA). Each ablation arm is ``hyper_es.py`` with the recipe and a few
overrides, without reference arms (``--reference_arms false``: only its uniform merge and Hyper-ES are scored on the
test rows, no GRPO-LoRA trained) into ``<out>/ablation/<arm>/seed<N>``. Arms that change only the search reuse the
recipe run's pool (``--pool_dir <out>/seed<N>/pool``, so that run's pool must exist); arms that change the pool train
their own with the same pool rows and 20 gradient updates, so the recipe run's GRPO-LoRA stays the equal-updates
reference. A run with a ``comparison.json`` is skipped, so the command can be stopped and run again.

    python examples/studies/hyper_es_ablation.py --out runs/hyper_es_paper --seeds 0 [--arms split_random ...]
    python examples/studies/hyper_es_ablation.py --out runs/hyper_es_paper --seeds 0 1 2 --table_only
    python examples/studies/hyper_es_ablation.py --out runs/hyper_es_paper --seeds 0 --scaled_uniform 1 2 5 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from trl_es.files import write_text


RECIPE = "examples/recipes/hyper_es_paper_protocol_cpu.yaml"
# arm -> (what it changes, whether it trains its own pool, overrides of the recipe)
ARMS = {
    "split_random": ("pool split: random instead of carries", True, ["--pool_split", "random"]),
    "split_base_success": ("pool split: the base model's sampled success rate", True,
                           ["--pool_split", "base_success"]),
    "k4_steps5": ("K = 4 directions of 5 steps (same 20 updates)", True,
                  ["--num_adapters", "4", "--pool_max_steps", "5"]),
    "weights_to_2": ("weights in [0, 2] instead of [0, K]", False, ["--weight_bounds", "0", "2"]),
    "budget_3n": ("search budget 3 x n (3 generations) instead of 10 x n", False, ["--max_generations", "3"]),
    "fitness_16": ("16 fitness prompts per generation instead of 64", False, ["--prompt_batch_size", "16"]),
    "noise_handler": ("pycma's NoiseHandler (up to 2 prompt batches per fitness)", False,
                      ["--noise_handling", "true", "--noise_max_evaluations", "2"]),
    "density_searched": ("the DARE density in the genome (n = 11)", False, ["--search_density", "true"]),
    "layer_genome": ("layer-wise genome (n = 300), same 100 evaluations", False,
                     ["--genome_granularity", "layer"]),
}


def run_arm(out: str, arm: str, seed: int, python: str = sys.executable) -> str:
    """Run one ablation arm for one seed (skipped when its ``comparison.json`` exists); returns that file.

    Raises:
        ValueError: for an unknown arm, or when an arm that reuses the recipe run's pool finds none.
        subprocess.CalledProcessError: if the run fails.
    """
    if arm not in ARMS:
        raise ValueError(f"unknown ablation arm {arm!r}; one of {sorted(ARMS)}.")
    _, own_pool, overrides = ARMS[arm]
    folder = os.path.join(out, "ablation", arm, f"seed{seed}")
    result = os.path.join(folder, "comparison.json")
    if os.path.exists(result):
        return result
    pool = os.path.join(out, f"seed{seed}", "pool")
    if not own_pool and not os.path.exists(os.path.join(pool, "direction_pool.json")):
        raise ValueError(f"arm {arm!r} reuses the recipe run's pool, and {pool} has none: run hyper_es_seeds.sh "
                         f"for seed {seed} first.")
    command = [python, "examples/scripts/hyper_es.py", "--config", RECIPE, "--output_dir", folder,
               "--task_seed", str(seed), "--seed", str(42 + seed), "--reference_arms", "false",
               "--track_validation", "false", *([] if own_pool else ["--pool_dir", pool]), *overrides]
    checkpoints = sorted((d for d in os.listdir(folder) if d.startswith("checkpoint-")),
                         key=lambda d: int(d.split("-")[1])) if os.path.isdir(folder) else []
    if checkpoints:
        command += ["--resume_from_checkpoint", os.path.join(folder, checkpoints[-1])]
    print(" ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True)
    return result


def scaled_uniform(out: str, seed: int, weights: list[float], arm: str | None = None, recipe: str = RECIPE,
                   extra: tuple[str, ...] = ()) -> dict:
    """Validation accuracy of the uniform merge with every weight ``w`` (``w = 1``: the search's start, the disjoint
    mean; ``w = K``: about the directions' sum where they agree), for each ``w`` in ``weights``: the space's element
    measured without a search. The pool is the recipe run's for ``seed`` (or ``arm``'s own); only validation rows are
    scored. ``extra``: more overrides of ``recipe``. Written to ``<pool folder>/../scaled_uniform.json`` (added to the
    weights it already holds for the same pool).

    Raises:
        ValueError: when the pool is missing or was trained on other rows than this seed's recipe selects.
    """
    import importlib.util

    from trl_es import HyperESConfig, HyperESTrainer
    from trl_es.arguments import TrlESParser
    from trl_es.models import load_model_and_tokenizer
    from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset_dict

    spec = importlib.util.spec_from_file_location("hyper_es_script", "examples/scripts/hyper_es.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # dataclasses resolve their module by name
    spec.loader.exec_module(script)
    folder = os.path.join(out, f"seed{seed}") if arm is None else os.path.join(out, "ablation", arm, f"seed{seed}")
    overrides = ARMS[arm][2] if arm is not None else []
    script_args, config = TrlESParser((script.HyperESScriptArguments, HyperESConfig)).parse_args_and_config(
        ["--config", recipe, "--output_dir", folder, "--task_seed", str(seed), "--seed", str(42 + seed), *overrides,
         *extra, "--weight_bounds", "0", str(max(max(weights), 1.0)),
         "--cache_pruned_deltas", "false"])  # a few merges: K fp32 copies of the weights are not worth their memory
    pool = os.path.join(folder, "pool")
    recorded = load(os.path.join(pool, script.POOL_ROWS_NAME))
    splits = make_arithmetic_dataset_dict(script_args.n_pool + script_args.n_fitness, script_args.n_validation,
                                          script_args.n_eval, seed=seed, low=script_args.low, high=script_args.high,
                                          ops=tuple(script_args.ops))
    prompts = [str(splits["train"][i]["prompt"]) for i in range(script_args.n_pool)]
    if recorded is None or recorded["prompts"] != prompts:
        raise ValueError(f"no pool in {pool} trained on this seed's pool rows: run the recipe (or the arm) first.")
    adapters = [r["adapter"] for r in load(os.path.join(pool, "direction_pool.json"))["adapters"]]
    model, tokenizer = load_model_and_tokenizer(script_args.model_name_or_path, dtype=script_args.dtype)
    trainer = HyperESTrainer(model, adapters, reward_funcs=arithmetic_reward, args=config,
                             train_dataset=splits["train"].select(range(script_args.n_pool, len(splits["train"]))),
                             eval_dataset=splits["validation"], processing_class=tokenizer)
    result = {"pool": pool, "num_adapters": len(adapters), "validation_rows": len(splits["validation"]),
              "validation": {}}
    previous = load(os.path.join(folder, "scaled_uniform.json"))
    if previous is not None and previous["pool"] == pool:  # add to the weights scored before
        result["validation"] = previous["validation"]
    for weight in weights:
        genome = trainer.space.decode(trainer.space.x0(weight))
        result["validation"][str(weight)] = trainer.evaluate(genome=genome, metric_key_prefix="val")["val_reward"]
        print(f"uniform merge, every weight {weight:g}: validation {result['validation'][str(weight)]:.3f}",
              file=sys.stderr, flush=True)
    with open(os.path.join(folder, "scaled_uniform.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def table(out: str, seeds: list[int], arms: list[str]) -> str:
    """Markdown: per arm and seed, Hyper-ES test accuracy, its distance to the same seed's GRPO-LoRA at equal
    updates and to the recipe's own Hyper-ES; '-' where a run is missing."""
    mains = {s: load(os.path.join(out, f"seed{s}", "comparison.json")) for s in seeds}

    def equal_updates(result):
        updates = result["settings"]["pool_gradient_updates"]
        return result.get(f"grpo_lora_{updates}steps")

    head = ["arm", "changes", "seeds", "Hyper-ES (test) per seed", "uniform merge per seed",
            "Hyper-ES - GRPO-LoRA (equal updates)", "Hyper-ES - recipe's Hyper-ES", "evaluations"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [("recipe", "-", mains)] + [
        (arm, ARMS[arm][0], {s: load(os.path.join(out, "ablation", arm, f"seed{s}", "comparison.json"))
                             for s in seeds}) for arm in arms]
    for name, what, results in rows:
        done = [s for s in seeds if results.get(s) is not None]
        hyper = [results[s]["hyper_es"] for s in done]
        uniform = [results[s]["uniform_merge"] for s in done]
        to_grpo = [results[s]["hyper_es"] - equal_updates(mains[s]) for s in done
                   if mains.get(s) is not None and equal_updates(mains[s]) is not None]
        to_recipe = [results[s]["hyper_es"] - mains[s]["hyper_es"] for s in done if mains.get(s) is not None]

        def cell(values):
            return ", ".join(f"{v:+.3f}" for v in values) if values else "-"

        evaluations = sorted({results[s]["settings"].get("evaluations") for s in done} - {None})
        lines.append("| " + " | ".join([
            name, what, ", ".join(map(str, done)) or "-", ", ".join(f"{v:.3f}" for v in hyper) or "-",
            ", ".join(f"{v:.3f}" for v in uniform) or "-", cell(to_grpo),
            "-" if name == "recipe" else cell(to_recipe), ", ".join(map(str, evaluations)) or "-"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/hyper_es_paper")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--table_only", action="store_true", help="Write the table of the runs there are.")
    parser.add_argument("--scaled_uniform", type=float, nargs="+", default=None, metavar="W",
                        help="Only score the uniform merge with every weight W on the validation rows, for each seed "
                        "(the recipe run's pool; with one --arms, that arm's pool), and stop.")
    args = parser.parse_args(argv)
    if args.scaled_uniform:
        arm = args.arms[0] if len(args.arms) == 1 else None
        return json.dumps([scaled_uniform(args.out, seed, args.scaled_uniform, arm) for seed in args.seeds])
    if not args.table_only:
        for seed in args.seeds:
            for arm in args.arms:
                run_arm(args.out, arm, seed)
    text = table(args.out, args.seeds, args.arms)
    write_text(os.path.join(args.out, "ablation.md"), text)
    print(text)
    return text


if __name__ == "__main__":
    main()
