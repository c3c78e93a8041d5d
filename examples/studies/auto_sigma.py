"""sigma="auto" and the collapse guard on the main job's task (docs/es_trainer.md, "sigma='auto'" and "The collapse
guard").

Three subcommands, each resumable (a finished arm's ``results.json`` is kept, rerunning the command continues):

- ``effect``: the effect of sigma on the first calibration's prompts (the first batch and the prompts drawn up to
  ``sigma_calibration_prompts``; ``--extra "--sigma_calibration_prompts 0"``: the batch alone), before any step: for
  each sigma, the fraction of (member, prompt) greedy completions of the first ``PROBE_MEMBERS`` members that differ
  from the unperturbed model's (and of their rewards that differ), and the sigma that ``sigma="auto"`` picks. Writes ``<output_dir>/effect_<setting>.json``
  (training seed 0; ``effect_<setting>_seed<k>.json`` for the others of ``--seeds``); with ``--model <a trained arm's
  folder>``, the same measure on that arm's final weights (the same first batch and probe members), written to
  ``<folder>/effect.json`` (``effect_seed<k>.json``): whether the effect of a sigma drifts as the run trains.
- ``transfer``: ``sigma="auto"`` against a sigma grid, nothing else changed (alpha is the recipe's), one ``trl-es
  train`` per arm, test accuracy after ``--max_steps`` iterations; ``--adapt_steps k`` adds the arm ``auto_adapt<k>``
  (auto, chosen again every k iterations). Writes ``<output_dir>/<setting>/seed<k>/<arm>/``.
- ``collapse``: alpha at ``--alpha_factor`` x the recipe's, with and without ``collapse_guard``, and the recipe itself
  with the guard (it must not fire). Writes ``<output_dir>/collapse/seed<k>/<arm>/``.

``table`` gathers every arm under ``--output_dir`` (finished or not) into ``<output_dir>/auto_sigma.md``, ``curves``
plots the collapse arms (``<output_dir>/collapse_curves.png``);
``guard_rates`` runs the collapse guard on made-up runs (false alarms on flat runs, collapses caught).
Settings: ``rank1`` is the main job's (rank-1 batched members); ``fullrank`` the same recipe with full-rank members
written in place (``population_backend=sequential``); ``llama`` and ``llama_fullrank`` the same recipe's ES keys on
the small Llama of ``pretrain_from_scratch.py`` (``--llama_dir``, checkpoint ``--llama_step``), rank-1 and full-rank
members, trained in this process on its pre-training run's problem split (plain-text prompts; training prompts seen in
pre-training, validation and test held out of it). ``--alphas`` adds alpha to the grid (the arms ``sigma_<s>_lr<a>``);
``auto`` keeps the recipe's alpha. ``summary`` picks each grid sigma's alpha on validation (mean over the seeds run
at every alpha; the arms found under ``--output_dir``) and reports test accuracy, mean +- std over seeds.

    python examples/studies/auto_sigma.py effect --setting rank1 --output_dir runs/auto_sigma
    python examples/studies/auto_sigma.py transfer --setting rank1 --seeds 0 --max_steps 8 --output_dir runs/auto_sigma
    python examples/studies/auto_sigma.py collapse --seeds 0 --max_steps 12 --output_dir runs/auto_sigma
    python examples/studies/auto_sigma.py table --output_dir runs/auto_sigma
    python examples/studies/auto_sigma.py curves --output_dir runs/auto_sigma
    python examples/studies/pretrain_from_scratch.py --output_dir runs/pretrain_from_scratch
    python examples/studies/auto_sigma.py transfer --setting llama --seeds 0 --alphas 0.005 0.01 0.02 \
        --output_dir runs/auto_sigma
    python examples/studies/auto_sigma.py summary --setting llama --output_dir runs/auto_sigma
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import subprocess
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
RECIPE = os.path.normpath(os.path.join(HERE, "..", "recipes", "arithmetic_smollm2.yaml"))
SETTINGS = {"rank1": [], "fullrank": ["--population_backend", "sequential"], "llama": [],
            "llama_fullrank": ["--population_backend", "sequential"]}
GRID = dict.fromkeys(SETTINGS, [0.00125, 0.0025, 0.005, 0.01, 0.02])
#: Reduced evaluation: no evaluation during training; accuracy after training only. The splits stay the recipe's (the
#: train split starts after test and validation, so a smaller validation split would change the training prompts).
REDUCED = ["--eval_strategy", "no", "--eval_before_training", "false", "--plot", "false", "--save_strategy", "no",
           "--time_budget_minutes", "0"]


def effect(args) -> dict:
    """The effect table of one setting on the first batch of each training seed of ``--seeds`` (see the module
    docstring); returns the last seed's."""
    from trl_es.cli.loading import load_model_and_tokenizer
    from trl_es.cli.splits import task_splits
    from trl_es.cli.train_command import parse_train_arguments
    from trl_es.trainer.es.es_trainer import ESTrainer

    for seed in args.seeds:  # the training seed: the first batch and the probe members
        argv = ["--config", args.recipe, *SETTINGS[args.setting], "--output_dir", os.path.join(args.output_dir, "tmp"),
                "--sigma", "auto", "--task_seed", str(args.seed), "--seed", str(seed), "--report_to", "none",
                "--eval_strategy", "no", *(["--sigma_target", str(args.sigma_target)] if args.sigma_target else []),
                *(["--model_name_or_path", args.model] if args.model else []), *args.extra.split()]
        task_args, es_args, model_args = parse_train_arguments(argv)
        task, splits = task_splits(task_args)
        model, tokenizer = load_model_and_tokenizer(model_args)
        es_args.reward_weights = task.reward_weights
        trainer = ESTrainer(model, task.reward_funcs, args=es_args, train_dataset=splits["train"],
                            processing_class=tokenizer)
        result = {"setting": args.setting, "model": model_args.model_name_or_path, "seed": seed,
                  **trainer.measure_sigma_effect(args.sigmas)}
        os.makedirs(args.output_dir, exist_ok=True)
        suffix = "" if seed == 0 else f"_seed{seed}"
        path = os.path.join(args.model, f"effect{suffix}.json") if args.model else \
            os.path.join(args.output_dir, f"effect_{args.setting}{suffix}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result, indent=1))
    return result


def run_arm(out: str, extra: list[str], args) -> None:
    """One ``trl-es train`` run (a llama setting: :func:`run_llama_arm`) into ``out`` unless its ``results.json``
    exists."""
    if os.path.exists(os.path.join(out, "results.json")):
        print(f"[auto_sigma] kept {out}", flush=True)
        return
    os.makedirs(out, exist_ok=True)
    if args.setting.startswith("llama"):
        run_llama_arm(out, [*extra, *args.extra.split()], args)
        return
    command = [sys.executable, "-m", "trl_es.cli", "train", "--config", args.recipe, *REDUCED,
               "--num_eval_prompts", str(args.num_test), "--max_steps", str(args.max_steps), "--logging_steps", "1",
               "--output_dir", out, *extra, *args.extra.split()]
    print(f"[auto_sigma] start {out}: {' '.join(command)}", flush=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    with open(os.path.join(out, "log.txt"), "w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    print(f"[auto_sigma] done {out}: exit {code}", flush=True)


def run_llama_arm(out: str, flags: list[str], args) -> None:
    """ES on the small Llama's checkpoint with the recipe's ES keys and ``flags`` (``--key value`` pairs of
    ``ESConfig`` fields), then greedy accuracy on its validation and test problems; writes ``out/results.json``
    (accuracies before and after, the picked sigma, the trainer's log history)."""
    import time

    from trl_es import ESConfig, ESTrainer
    from trl_es.analysis import greedy_accuracy
    from trl_es.cli import es_config_kwargs, load_recipe
    from trl_es.files import write_json
    from trl_es.models import load_model_and_tokenizer
    from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset_dict

    with open(os.path.join(args.llama_dir, "pretraining.json")) as f:
        pretraining = json.load(f)
    checkpoint = next((c for c in pretraining["checkpoints"] if c["step"] == args.llama_step), None)
    if checkpoint is None:
        raise ValueError(f"--llama_step {args.llama_step} is not a checkpoint of {args.llama_dir} "
                         f"({[c['step'] for c in pretraining['checkpoints']]}).")
    split = pretraining["arithmetic_splits"]["kwargs"]
    splits = make_arithmetic_dataset_dict(args.llama_train_prompts, split["num_validation"], split["num_test"],
                                          seed=split["seed"], low=split["low"], high=split["high"], ops=split["ops"],
                                          conversational=False)
    overrides = [f"{key[2:]}={value}" for key, value in zip(flags[::2], flags[1::2], strict=True)]
    kwargs = es_config_kwargs(load_recipe(args.recipe), overrides)
    kwargs.update(output_dir=out, max_steps=args.max_steps, eval_strategy="no", save_strategy="no", report_to="none",
                  logging_steps=1, disable_tqdm=True, reward_weights=[1.0])
    model, tokenizer = load_model_and_tokenizer(checkpoint["path"])
    tokens = kwargs["max_completion_length"]

    def accuracy(name):
        rows = [splits[name][i] for i in range(len(splits[name]))]
        return greedy_accuracy(model, tokenizer, rows, [arithmetic_reward], tokens, progress=False)

    result = {"setting": args.setting, "checkpoint": checkpoint["path"], "flags": flags,
              "validation_accuracy_before": accuracy("validation"), "test_accuracy_before": accuracy("test")}
    print(f"[auto_sigma] start {out}: {' '.join(overrides)}", flush=True)
    start = time.monotonic()
    trainer = ESTrainer(model, [arithmetic_reward], args=ESConfig(**kwargs), train_dataset=splits["train"],
                        processing_class=tokenizer)
    trainer.train()
    history = trainer.state.log_history
    result.update(train_seconds=time.monotonic() - start, log_history=history,
                  sigma=next((h["sigma"] for h in history if "sigma" in h), kwargs.get("sigma")),
                  validation_accuracy_after=accuracy("validation"), test_accuracy_after=accuracy("test"))
    write_json(os.path.join(out, "results.json"), result)
    print(f"[auto_sigma] done {out}: validation {result['validation_accuracy_after']:.3f}, "
          f"test {result['test_accuracy_after']:.3f}", flush=True)


def grid_arms(args) -> dict[str, list[str]]:
    """The transfer arms: ``auto`` (the recipe's alpha) and every grid sigma, at every ``--alphas`` value if given."""
    arms = {"auto": ["--sigma", "auto"]}
    for k in args.adapt_steps:  # auto, chosen again every k iterations
        arms[f"auto_adapt{k}"] = ["--sigma", "auto", "--sigma_adapt_steps", str(k)]
    for s in GRID[args.setting]:
        for a in args.alphas or [None]:
            arms[f"sigma_{s:g}" + ("" if a is None else f"_lr{a:g}")] = \
                ["--sigma", str(s)] + ([] if a is None else ["--learning_rate", str(a)])
    return arms


def transfer(args) -> None:
    for seed in args.seeds:
        arms = grid_arms(args)
        for name, extra in arms.items():
            if args.only and name not in args.only:
                continue
            out = os.path.join(args.output_dir, args.setting, f"seed{seed}", name)
            run_arm(out, [*SETTINGS[args.setting], "--seed", str(seed), *extra], args)


def collapse(args) -> None:
    alpha = str(0.01 * args.alpha_factor)
    arms = {"alpha_x10": ["--learning_rate", alpha], "alpha_x10_guard": ["--learning_rate", alpha,
                                                                           "--collapse_guard", "true"],
            "recipe_guard": ["--collapse_guard", "true"]}
    study = "collapse" if args.setting == "rank1" else f"collapse_{args.setting}"
    for seed in args.seeds:
        for name, extra in arms.items():
            if args.only and name not in args.only:
                continue
            run_arm(os.path.join(args.output_dir, study, f"seed{seed}", name), ["--seed", str(seed), *extra], args)


def printed_logs(path: str) -> list[dict]:
    """The per-iteration dicts ``trl-es train`` printed into ``path`` (each after tqdm's bar on its line)."""
    with open(path) as f:
        return [ast.literal_eval(line[line.index("{'loss'"):].split("}")[0] + "}") for line in f if "{'loss'" in line]


def arm_logs(folder: str) -> tuple[list[dict], float] | None:
    """(per-iteration logs, sigma) of one arm: a llama arm's ``results.json``, else the ``log.txt`` of ``trl-es
    train`` (None when neither exists yet)."""
    results = os.path.join(folder, "results.json")
    if os.path.exists(results):
        with open(results) as f:
            result = json.load(f)
        if "log_history" in result:
            return [h for h in result["log_history"] if "reward" in h], float(result["sigma"])
    path = os.path.join(folder, "log.txt")
    if not os.path.exists(path):
        return None
    logs = printed_logs(path)
    with open(path) as f:  # the ES plan's "Sigma = ..." line: a number, or auto (then the logged sigma)
        planned = next((line.split("=")[1].strip() for line in f if line.strip().startswith("Sigma =")), "nan")
    return logs, next((float(h["sigma"]) for h in logs if "sigma" in h),
                      float("nan") if planned == "auto" else float(planned))


def rollback_iterations(logs: list[dict]) -> list[int]:
    """The iterations (1-based) whose ``es/rollbacks`` count rose: the rollbacks of a guarded run."""
    counts = [float(h["es/rollbacks"]) for h in logs if "es/rollbacks" in h]
    return [k + 1 for k in range(len(counts)) if counts[k] > (counts[k - 1] if k else 0)]


def curves(args) -> dict:
    """The collapse arms' curves: the members' mean reward per iteration, one panel per seed, each arm a line, the
    guarded arm's rollbacks as dotted verticals. Writes ``<output_dir>/<study>_curves.png``; returns
    ``{seed: {arm: {"reward": [...], "rollbacks": [...]}}}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trl_es.files import save_figure

    study = "collapse" if args.setting == "rank1" else f"collapse_{args.setting}"
    found: dict[str, dict] = {}
    for folder in sorted(glob.glob(os.path.join(args.output_dir, study, "seed*", "*"))):
        logs = arm_logs(folder)
        if logs is not None:
            seed, arm = folder.split(os.sep)[-2:]
            found.setdefault(seed, {})[arm] = {"reward": [float(h["reward"]) for h in logs[0] if "reward" in h],
                                               "rollbacks": rollback_iterations(logs[0])}
    if not found:
        raise FileNotFoundError(f"no collapse arm under {os.path.join(args.output_dir, study)}")
    colors = {arm: f"C{k}" for k, arm in enumerate(sorted({a for arms in found.values() for a in arms}))}
    fig, axes = plt.subplots(1, len(found), figsize=(4.5 * len(found), 3.4), sharey=True, squeeze=False)
    for ax, (seed, arms) in zip(axes[0], found.items(), strict=True):
        for arm, curve in arms.items():
            ax.plot(range(1, len(curve["reward"]) + 1), curve["reward"], marker=".", label=arm, color=colors[arm])
            for k in curve["rollbacks"]:
                ax.axvline(k, color=colors[arm], linestyle=":", linewidth=1)
        ax.set_title(f"{seed}, alpha x{args.alpha_factor:g}")
        ax.set_xlabel("iteration (dotted: rollback)")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("members' mean reward")
    fig.tight_layout()
    save_figure(fig, os.path.join(args.output_dir, f"{study}_curves.png"), dpi=110)
    plt.close(fig)
    return found


def table(args) -> str:
    """Markdown rows of every arm (finished or not): sigma, the mean reward per iteration, rollbacks, test accuracy."""
    lines = ["| study | seed | arm | sigma | mean reward per iteration | rollbacks (iterations) | test accuracy |",
             "|---|---|---|---|---|---|---|"]
    for folder in sorted(glob.glob(os.path.join(args.output_dir, "*", "seed*", "*"))):
        study, seed, arm = folder.split(os.sep)[-3:]
        found = arm_logs(folder)
        if found is None:
            continue
        logs, sigma = found
        rewards = " ".join(f"{float(h['reward']):.2f}" for h in logs if "reward" in h)
        guarded = any("es/rollbacks" in h for h in logs)
        rolled = rollback_iterations(logs)
        accuracy = "not finished"
        if os.path.exists(os.path.join(folder, "results.json")):
            with open(os.path.join(folder, "results.json")) as f:
                accuracy = f"{json.load(f)['test_accuracy_after']:.3f}"
        lines.append(f"| {study} | {seed} | {arm} | {sigma:.4g} | {rewards} | "
                     f"{(rolled or 'none') if guarded else '-'} | {accuracy} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.output_dir, "auto_sigma.md"), "w") as f:
        f.write(text)
    print(text)
    return text


def summary(args) -> str:
    """The transfer table of ``--setting``: per grid sigma, the alpha with the best mean validation accuracy over the
    seeds that ran every alpha, then test (and validation) accuracy at that alpha, mean +- std over seeds; ``auto``
    beside it. Writes ``<output_dir>/<setting>/summary.md``."""
    import statistics

    def scores(arm):
        found = {}
        for path in glob.glob(os.path.join(args.output_dir, args.setting, "seed*", arm, "results.json")):
            with open(path) as f:
                result = json.load(f)
            if "validation_accuracy_after" not in result:  # a `trl-es train` arm: its eval split is validation
                result.update(validation_accuracy_after=result["accuracy_after"],
                              sigma=arm_logs(os.path.dirname(path))[1])
            found[int(path.split(os.sep)[-3][4:])] = result
        return found

    def spread(values):
        return (f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1
                else f"{values[0]:.3f}") if values else "-"

    lines = ["| sigma | alpha (picked on validation) | seeds | validation accuracy | test accuracy | test, per seed "
             "| sigma used |", "|---|---|---|---|---|---|---|"]
    ran = {path.split(os.sep)[-2] for path in glob.glob(os.path.join(args.output_dir, args.setting, "seed*", "*",
                                                                       "results.json"))}  # the arms run, any alpha
    auto = [n for n in ran if n.startswith("auto")]  # auto, auto_adapt<k>: first, then the grid by sigma
    arms = sorted(auto) + sorted(set(ran) - set(auto), key=lambda n: (float(n.split("_")[1]), n))
    by_sigma: dict[str, list[str]] = {}
    for name in arms:
        by_sigma.setdefault(name.split("_lr")[0], []).append(name)
    for sigma, names in by_sigma.items():
        found = {name: scores(name) for name in names}
        common = set.intersection(*(set(f) for f in found.values())) if found else set()
        if not common:
            continue
        best = max(names, key=lambda n: statistics.mean(found[n][k]["validation_accuracy_after"] for k in common))
        runs = [found[best][k] for k in sorted(found[best])]
        used = sorted({f"{r['sigma']:.3g}" for r in runs})
        alpha = best.split("_lr")[1] if "_lr" in best else "recipe's"
        per_seed = ", ".join(f"{r['test_accuracy_after']:.3f}" for r in runs)
        lines.append(f"| {sigma} | {alpha} | {len(runs)} | "
                     f"{spread([r['validation_accuracy_after'] for r in runs])} | "
                     f"{spread([r['test_accuracy_after'] for r in runs])} | "
                     f"{per_seed} | {', '.join(used)} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.join(args.output_dir, args.setting), exist_ok=True)
    with open(os.path.join(args.output_dir, args.setting, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return text


def guard_rates(args) -> str:
    """The collapse guard (``trl_es.es.guard.CollapseGuard`` itself) on made-up runs of binary rewards: the share of
    flat runs it fires on, and of collapsing runs it catches, for a few thresholds (``--runs`` runs each, numpy seed 0).
    A run is ``iterations`` batch means of ``--prompts`` rewards at a success rate per iteration."""
    import numpy as np

    from trl_es.es.guard import CollapseGuard

    rng = np.random.default_rng(0)
    cases = {"flat 0.4, 26 iterations": [0.4] * 26, "flat 0.65, 26 iterations": [0.65] * 26,
             "0.31 then 0 from iteration 2, 6 iterations": [0.31] + [0.0] * 5,
             "0.6 then 0.02 from iteration 6, 12 iterations": [0.6] * 5 + [0.02] * 7}
    settings = [(3.0, 3), (2.5, 3), (2.0, 3)]
    lines = ["| made-up run | " + " | ".join(f"threshold {k:g}, patience {p}" for k, p in settings) + " |",
             "|---|" + "---|" * len(settings)]
    for name, rates in cases.items():
        row = []
        for threshold, patience in settings:
            fired = 0
            for _ in range(args.runs):
                means = (rng.random((len(rates), args.prompts)) < np.array(rates)[:, None]).mean(1)
                guard = CollapseGuard(threshold=threshold, patience=patience)
                hit = False
                for t, mean in enumerate(means):
                    if guard.observe(t, float(mean), float(np.sqrt(mean * (1 - mean) / args.prompts))):
                        hit = True
                        break
                    guard.applied(t + 1)
                fired += hit
            row.append(f"{fired / args.runs:.3f}")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("effect", "transfer", "collapse", "table", "curves", "summary",
                                            "guard_rates"))
    parser.add_argument("--setting", choices=tuple(SETTINGS), default="rank1")
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--output_dir", default="runs/auto_sigma")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--seed", type=int, default=0, help="effect: the task seed of the first batch.")
    parser.add_argument("--model", default=None,
                        help="effect: measure on these weights (a trained arm's folder) instead of the recipe's model.")
    parser.add_argument("--sigma_target", type=float, default=None,
                        help="effect: the target of the auto search (default: ESConfig's).")
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.00125, 0.0025, 0.005, 0.01, 0.02])
    parser.add_argument("--max_steps", type=int, default=26)
    parser.add_argument("--num_test", type=int, default=200, help="Test prompts scored after training.")
    parser.add_argument("--only", nargs="*", default=None, help="transfer / collapse: run only these arms.")
    parser.add_argument("--extra", default="", help="Further `trl-es train` flags for every arm (one string), e.g. "
                        "'--population_size 8' for a reduced run.")
    parser.add_argument("--runs", type=int, default=1000, help="guard_rates: made-up runs per case.")
    parser.add_argument("--prompts", type=int, default=12, help="guard_rates: rewards per iteration.")
    parser.add_argument("--adapt_steps", type=int, nargs="*", default=[],
                        help="transfer: add an arm auto_adapt<k> (sigma='auto', sigma_adapt_steps=k) per value.")
    parser.add_argument("--alphas", type=float, nargs="*", default=None,
                        help="transfer: alpha values of the grid arms (default: the recipe's only).")
    parser.add_argument("--llama_dir", default="runs/pretrain_from_scratch",
                        help="llama settings: pretrain_from_scratch.py's output folder.")
    parser.add_argument("--llama_step", type=int, default=2000, help="llama settings: the checkpoint's step.")
    parser.add_argument("--llama_train_prompts", type=int, default=400,
                        help="llama settings: training problems (seen in pre-training), as pretraining_excursions.py.")
    parser.add_argument("--alpha_factor", type=float, default=10.0, help="collapse: alpha = this x the recipe's.")
    args = parser.parse_args(argv)
    parser_commands = {"effect": effect, "transfer": transfer, "collapse": collapse, "table": table,
                       "curves": curves, "summary": summary, "guard_rates": guard_rates}
    return parser_commands[args.command](args)


if __name__ == "__main__":
    main()
