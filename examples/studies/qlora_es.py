"""Does ES on adapters learn? Full-parameter ES against LoRA-ES (fp32 base, 4-bit base) and TRL's GRPO with QLoRA.

The main job's task and recipe (``examples/recipes/arithmetic_smollm2.yaml``: SmolLM2-135M-Instruct, arithmetic,
greedy accuracy on the test split), one run per (arm, seed), each a ``trl-es train`` command (GRPO: TRL's
``GRPOTrainer`` in a worker process) and then ``trl-es eval`` on the test split (greedy accuracy, pass@k of sampled
completions). Arms:

- ``full``: the main job's recipe (full-parameter ES);
- ``lora``: the same recipe with ``--use_peft`` (TRL's ModelConfig LoRA: r 16, alpha 32, q_proj and v_proj),
  ``sigma`` / ``learning_rate`` from ``--adapter_sigmas`` (``learning_rate = 2 * sigma``, the main job's ratio);
- ``lora4bit``: ``lora`` on a 4-bit NF4 base (``--load_in_4bit``, compute dtype float32), at the sigma the
  ``lora`` arms scored best on the validation split (``--adapter_sigma`` to set it);
- ``grpo_qlora``: TRL's ``GRPOTrainer`` with the same 4-bit base and LoRA (TRL's QLoRA: its adapters cast to bf16),
  for the training minutes the ``lora4bit`` arm of the same seed took.

Every run writes ``<output_dir>/<arm>/seed<s>/`` (``results.json`` from ``trl-es train``, ``test_eval.json`` from
``trl-es eval``); a finished run is skipped on a rerun (resumable), so seeds can be added one at a time. The table,
mean and spread over the seeds run, goes to ``<output_dir>/results.md``.

    python examples/studies/qlora_es.py --output_dir runs/qlora_es --seeds 0 1 2
    python examples/studies/qlora_es.py --output_dir runs/qlora_es_small --seeds 0 --max_steps 4 \\
        --num_decay_steps 1 --eval_steps 100 --population_size 8 --prompt_batch_size 4 \\
        --num_eval_prompts 50 --num_validation_prompts 25 --num_samples 2 --pass_k 1 2 \\
        --adapter_sigmas 0.02 0.05                                         # the reduced budget in docs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _study.spread import mean_and_std


RECIPE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes",
                                       "arithmetic_smollm2.yaml"))
ARMS = ("full", "lora", "lora4bit", "grpo_qlora")  # lora before lora4bit (its sigma), lora4bit before grpo (minutes)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/qlora_es")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="ES / GRPO seeds (the splits stay).")
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--model_name_or_path", default=None, help="Default: the recipe's.")
    parser.add_argument("--max_steps", type=int, default=None, help="Default: the recipe's (26).")
    parser.add_argument("--num_decay_steps", type=int, default=None, help="Default: the recipe's (9).")
    parser.add_argument("--num_validation_prompts", type=int, default=None)
    parser.add_argument("--eval_steps", type=int, default=None, help="Default: the recipe's (5).")
    parser.add_argument("--population_size", type=int, default=None, help="Default: the recipe's (24).")
    parser.add_argument("--prompt_batch_size", type=int, default=None, help="Default: the recipe's (12).")
    parser.add_argument("--num_eval_prompts", type=int, default=None, help="The test split's size.")
    parser.add_argument("--adapter_sigmas", nargs="+", type=float, default=[0.01, 0.03],
                        help="The lora arm's sigmas (each a run; learning_rate = 2 * sigma).")
    parser.add_argument("--adapter_sigma", type=float, default=None,
                        help="lora4bit's sigma; default: the lora sigma with the best validation accuracy.")
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--lora_target_modules", nargs="+", default=None,
                        help="Default: peft's for the architecture (q_proj, v_proj), as TRL's --use_peft.")
    parser.add_argument("--grpo_learning_rate", type=float, default=1e-4)
    parser.add_argument("--grpo_num_generations", type=int, default=8)
    parser.add_argument("--grpo_prompts_per_step", type=int, default=2)
    parser.add_argument("--num_samples", type=int, default=4, help="Sampled completions per test prompt (pass@k).")
    parser.add_argument("--pass_k", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--dry_run", action="store_true", help="Print the commands only.")
    parser.add_argument("--report", action="store_true",
                        help="Run nothing: write and print the table over --seeds from the finished runs.")
    return parser.parse_args(argv)


def _run(command: list[str], log: str, dry_run: bool) -> None:
    print(" ".join(command), flush=True)
    if dry_run:
        return
    with open(log, "a") as f:
        subprocess.run(command, check=True, stdout=f, stderr=subprocess.STDOUT)


def _read(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def common_flags(args) -> list[str]:
    flags = []
    for name in ("model_name_or_path", "max_steps", "num_validation_prompts", "num_eval_prompts", "eval_steps",
                 "population_size", "prompt_batch_size"):
        if getattr(args, name) is not None:
            flags += [f"--{name}", str(getattr(args, name))]
    if args.num_decay_steps is not None:
        flags += ["--lr_scheduler_kwargs", json.dumps({"num_decay_steps": args.num_decay_steps})]
    return flags


def lora_flags(args) -> list[str]:
    modules = ["--lora_target_modules", *args.lora_target_modules] if args.lora_target_modules else []
    return ["--use_peft", "--lora_r", str(args.lora_r), "--lora_alpha", str(2 * args.lora_r), *modules]


def best_adapter_sigma(args, seed: int) -> float:
    """The ``lora`` sigma with the best validation accuracy (after training) for ``seed``, else seed 0's."""
    if args.adapter_sigma is not None:
        return args.adapter_sigma
    scores = {}
    for sigma in args.adapter_sigmas:
        for s in (seed, args.seeds[0]):
            results = _read(os.path.join(args.output_dir, f"lora_sigma{sigma:g}", f"seed{s}", "results.json"))
            if results is not None:
                scores[sigma] = results["accuracy_after"]
                break
    if not scores:
        raise ValueError("lora4bit needs a finished lora arm (or --adapter_sigma).")
    return max(scores, key=lambda s: (scores[s], -s))


def es_run(args, arm: str, seed: int, sigma: float | None = None) -> str:
    name = arm if sigma is None else f"{arm}_sigma{sigma:g}"
    out = os.path.join(args.output_dir, name, f"seed{seed}")
    if _read(os.path.join(out, "results.json")) is None:
        os.makedirs(out, exist_ok=True)
        command = [sys.executable, "-m", "trl_es.cli", "train", "--config", args.recipe, "--output_dir", out,
                   "--seed", str(seed), *common_flags(args)]
        if arm != "full":
            command += [*lora_flags(args), "--sigma", str(sigma), "--learning_rate", str(2 * sigma)]
        if arm == "lora4bit":
            command += ["--load_in_4bit"]
        _run(command, os.path.join(out, "train.log"), args.dry_run)
    return out


def grpo_run(args, seed: int) -> str:
    out = os.path.join(args.output_dir, "grpo_qlora", f"seed{seed}")
    budget = _read(os.path.join(args.output_dir, f"lora4bit_sigma{best_adapter_sigma(args, seed):g}", f"seed{seed}",
                                "results.json"))
    if _read(os.path.join(out, "results.json")) is None:
        if budget is None and not args.dry_run:
            raise ValueError("grpo_qlora takes the lora4bit arm's minutes: run that arm first.")
        os.makedirs(out, exist_ok=True)
        spec = {"output_dir": out, "seed": seed, "seconds": (budget or {}).get("train_seconds", 60.0),
                "recipe": args.recipe, "flags": common_flags(args), "lora_r": args.lora_r,
                "lora_target_modules": args.lora_target_modules, "learning_rate": args.grpo_learning_rate,
                "num_generations": args.grpo_num_generations, "prompts_per_step": args.grpo_prompts_per_step}
        _run([sys.executable, os.path.abspath(__file__), "--grpo_worker", json.dumps(spec)],
             os.path.join(out, "train.log"), args.dry_run)
    return out


def grpo_worker(spec: dict) -> None:
    """Train TRL's GRPOTrainer with QLoRA for ``spec["seconds"]`` of training time; save the adapter and results."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import GRPOConfig, GRPOTrainer

    from trl_es.cli import load_recipe
    from trl_es.cli.arguments import TaskArguments
    from trl_es.cli.splits import task_splits
    from trl_es.files import write_json
    from trl_es.models import resolve_model_path
    from trl_es.trainer.time_budget import TrainingClock

    recipe = load_recipe(spec["recipe"])
    flags = dict(zip(spec["flags"][::2], spec["flags"][1::2], strict=True))
    sizes = {k: int(flags.get(f"--{k}", recipe[k])) for k in ("num_train_prompts", "num_validation_prompts",
                                                              "num_eval_prompts")}
    _, splits = task_splits(TaskArguments(task=recipe["task"], task_seed=recipe["task_seed"], **sizes))
    path = resolve_model_path(flags.get("--model_name_or_path", recipe["model_name_or_path"]))
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    from trl_es.tasks.arithmetic import arithmetic_reward

    completions = spec["prompts_per_step"] * spec["num_generations"]
    args = GRPOConfig(output_dir=spec["output_dir"], learning_rate=spec["learning_rate"], lr_scheduler_type="constant",
                      num_generations=spec["num_generations"], per_device_train_batch_size=completions,
                      max_completion_length=int(recipe["max_completion_length"]), max_steps=1_000_000, bf16=False,
                      gradient_checkpointing=False, eval_strategy="no", save_strategy="no", logging_steps=1,
                      report_to="none", seed=spec["seed"], beta=0.0, dataloader_pin_memory=False)
    peft_config = LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], task_type="CAUSAL_LM",
                             target_modules=spec["lora_target_modules"])
    clock = TrainingClock(spec["seconds"])
    trainer = GRPOTrainer(model=model, reward_funcs=[arithmetic_reward], args=args, train_dataset=splits["train"],
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[clock])
    trainer.train()
    trainer.save_model(spec["output_dir"])
    write_json(os.path.join(spec["output_dir"], "results.json"),
               {"train_seconds": clock.training_seconds, "steps": clock.steps, "budget_seconds": spec["seconds"],
                "completions_per_step": completions})


def test_eval(args, out: str, quantized: bool) -> None:
    if args.dry_run or _read(os.path.join(out, "test_eval.json")) is not None:
        return
    command = [sys.executable, "-m", "trl_es.cli", "eval", "--config", args.recipe, "--model_name_or_path", out,
               "--split", "test", "--num_samples", str(args.num_samples), "--pass_k", *map(str, args.pass_k),
               "--output_file", os.path.join(out, "test_eval.json")]  # the recipe's task, splits and lengths
    for name in ("num_validation_prompts", "num_eval_prompts"):
        if getattr(args, name) is not None:
            command += [f"--{name}", str(getattr(args, name))]
    if quantized:
        command += ["--load_in_4bit"]
    _run(command, os.path.join(out, "eval.log"), args.dry_run)


def table(args) -> str:
    """Mean ± std over seeds per arm: validation and test greedy accuracy after training, test pass@k, iterations,
    training minutes (GRPO has no validation figure: ``-``)."""
    rows = ["| arm | seeds | validation greedy accuracy (after) | test greedy accuracy (after) | test, per seed | "
            + " | ".join(f"pass@{k}" for k in args.pass_k) + " | iterations | training minutes |",
            "|---|---|---|---|---|" + "---|" * len(args.pass_k) + "---|---|"]
    names = sorted(d for d in os.listdir(args.output_dir) if os.path.isdir(os.path.join(args.output_dir, d)))
    for name in names:
        runs = [os.path.join(args.output_dir, name, f"seed{s}") for s in args.seeds]
        done = [(r, _read(os.path.join(r, "results.json")), _read(os.path.join(r, "test_eval.json"))) for r in runs]
        done = [(r, res, ev) for r, res, ev in done if res is not None and ev is not None]
        if not done:
            continue
        acc = mean_and_std([ev["accuracy_greedy"] for _, _, ev in done])
        passes = [mean_and_std([ev[f"pass@{k}"] for _, _, ev in done]) for k in args.pass_k]
        steps = [res.get("iterations", res.get("steps")) for _, res, _ in done]
        minutes = mean_and_std([(res.get("train_seconds") or 0.0) / 60 for _, res, _ in done])
        validation = [res["accuracy_after"] for _, res, _ in done if "accuracy_after" in res]
        cells = [f"{m:.3f} ± {s:.3f}" for m, s in [acc, *passes]]
        cells.insert(0, "-" if len(validation) < len(done) else "{:.3f} ± {:.3f}".format(*mean_and_std(validation)))
        cells.insert(2, ", ".join(f"{ev['accuracy_greedy']:.3f}" for _, _, ev in done))
        rows.append(f"| {name} | {len(done)} | " + " | ".join(cells) + f" | {steps} | {minutes[0]:.1f} |")
    return "\n".join(rows) + "\n"


def write_table(args) -> str:
    """Write :func:`table` to ``<output_dir>/results.md`` and return it."""
    report = table(args)
    with open(os.path.join(args.output_dir, "results.md"), "w") as f:
        f.write(report)
    return report


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--grpo_worker":
        grpo_worker(json.loads(sys.argv[2]))
        return
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.report:
        print(write_table(args), end="")
        return
    start = time.time()
    for seed in args.seeds:  # one seed at a time: every arm of seed 0 first
        for arm in args.arms:
            if arm == "lora":
                for sigma in args.adapter_sigmas:
                    test_eval(args, es_run(args, "lora", seed, sigma), quantized=False)
            elif arm == "lora4bit":
                test_eval(args, es_run(args, "lora4bit", seed, best_adapter_sigma(args, seed)), quantized=True)
            elif arm == "grpo_qlora":
                test_eval(args, grpo_run(args, seed), quantized=True)
            else:
                test_eval(args, es_run(args, "full", seed), quantized=False)
            if not args.dry_run:
                write_table(args)
    print(f"done in {(time.time() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
