# Copyright 2026 The trl_es authors. Licensed under the Apache License, Version 2.0.
"""Hyper-ES on the arithmetic task: build a LoRA direction pool with GRPO, search its merge with CMA-ES, compare.

Steps:
  1. Disjoint arithmetic splits: pool training rows, a fitness split (what CMA-ES maximizes), optionally
     ``n_validation`` validation rows (what ``final_genome: validation`` chooses the final genome on) and held-out
     prompts (the test split of ``make_arithmetic_dataset_dict``: the same prompts as the main job's test split for
     the same ``task_seed`` and ``n_eval``).
  2. ``build_direction_pool``: K LoRA adapters, each a few GRPO steps on one bucket of the pool rows
     (skipped when ``<pool_dir>/direction_pool.json`` exists and ``--reuse_pool`` is on).
  3. ``HyperESTrainer``: CMA-ES over the layer-wise DARE-TIES coefficients, fitness = mean reward on the fitness split.
  4. Held-out mean reward of: the base model, every single adapter (the best one chosen on the fitness split),
     the uniform merge (the search's starting point) and the Hyper-ES merge; written to ``comparison.json``.

Run (the recipe is the documented default; any field can be overridden on the command line):

    python examples/scripts/hyper_es.py --config examples/recipes/hyper_es_arithmetic.yaml

Small CPU smoke (minutes):

    python examples/scripts/hyper_es.py --config examples/recipes/hyper_es_arithmetic.yaml \
        --output_dir /tmp/hyper_es_smoke --num_adapters 2 --pool_max_steps 1 --n_pool 16 --n_fitness 4 \
        --n_eval 8 --max_generations 2 --population_size 4 --genome_granularity global --max_completion_length 8
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

from accelerate import PartialState
from transformers import TrainerCallback

from trl_es.arguments import TrlESParser
from trl_es.files import is_main_process, save_figure, write_json
from trl_es.merging import build_direction_pool, sampled_success_rates
from trl_es.merging.direction_pool import POOL_NAME
from trl_es.models import load_model_and_tokenizer
from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset_dict
from trl_es import HyperESConfig, HyperESTrainer

POOL_ROWS_NAME = "pool_rows.json"  # beside direction_pool.json: the rows and settings the pool was trained with

logger = logging.getLogger("hyper_es")


@dataclass
class HyperESScriptArguments:
    """Arguments of this script (the search itself is configured by `HyperESConfig`)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; None = the embedded SmolLM2-135M-Instruct."}
    )
    dtype: str = field(default="float32", metadata={"help": "Model dtype: float32, bfloat16 or auto."})
    n_pool: int = field(
        default=256, metadata={"help": "Rows used to train the direction pool (split into K buckets)."}
    )
    n_fitness: int = field(default=64, metadata={"help": "Rows of the fitness split CMA-ES maximizes on."})
    n_eval: int = field(default=200, metadata={"help": "Held-out rows for the comparison."})
    n_validation: int = field(
        default=0,
        metadata={
            "help": "Validation rows (disjoint from the others), the trainer's eval_dataset: what "
            "final_genome='validation' chooses on (required then). 0 = none."
        },
    )
    low: int = field(default=1, metadata={"help": "Smallest operand."})
    high: int = field(default=50, metadata={"help": "Largest operand."})
    ops: list[str] = field(default_factory=lambda: ["+"], metadata={"help": "Operators, a subset of + - *."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the arithmetic splits."})
    num_adapters: int = field(default=4, metadata={"help": "K, the number of LoRA adapters in the pool."})
    pool_dir: str | None = field(
        default=None, metadata={"help": "Where the pool is saved; default <output_dir>/pool."}
    )
    reuse_pool: bool = field(default=True, metadata={"help": "Reuse a pool already in pool_dir instead of training."})
    pool_split: str = field(
        default="random",
        metadata={
            "help": "How the pool rows are cut into K buckets: 'random' (a seeded permutation), or contiguous "
            "quantiles of a difficulty key, bucket 0 the easiest: 'difficulty' (the answer's size |answer|), "
            "'carries' (the carries of the addition, or borrows of the subtraction, then |answer|: what the task "
            "defines), 'base_success' (the base model's sampled failure rate on the row, difficulty_samples samples "
            "at the pool's GRPO sampling: for any task)."
        },
    )
    difficulty_samples: int = field(
        default=4, metadata={"help": "With pool_split='base_success': samples per pool row to estimate its rate."}
    )

    pool_max_steps: int = field(default=10, metadata={"help": "GRPO steps per adapter."})
    pool_learning_rate: float = field(default=1e-4, metadata={"help": "GRPO learning rate."})
    lora_r: int = field(default=32, metadata={"help": "LoRA rank (paper: 32)."})
    lora_alpha: int = field(default=64, metadata={"help": "LoRA alpha (paper: 64)."})
    pool_batch_size: int = field(
        default=32,
        metadata={"help": "GRPO per_device_train_batch_size (completions per step, a multiple of the group)."},
    )
    pool_num_generations: int = field(default=8, metadata={"help": "GRPO completions per prompt (group size)."})
    pool_max_completion_length: int = field(default=32, metadata={"help": "GRPO max completion tokens."})
    grpo_lora_factors: list[float] = field(
        default_factory=list,
        metadata={
            "help": "GRPO-LoRA baselines (the paper's comparison): per factor f, one LoRA adapter (same rank, alpha, "
            "targets, learning rate and batch as the pool) trained with GRPO on all pool rows for round(f x K x "
            "pool_max_steps) steps. 1.0 = the pool's gradient updates; 1.1111 = the pool has 10% fewer. Saved in "
            "<pool_dir>/grpo_lora_<steps>steps (reused like the pool)."
        },
    )
    sampled_samples: int = field(
        default=0,
        metadata={
            "help": "Held-out Pass@K at the papers' protocol (T=0.6, top-p 0.95; trl_es.analysis.PAPER_PROTOCOL) "
            "with this many samples per prompt, K = 1, 2, 4, ... <= it, for the base model, the best single adapter, "
            "the uniform merge, Hyper-ES and each GRPO-LoRA baseline. 0 = greedy only."
        },
    )
    sampled_prompts: int | None = field(
        default=None, metadata={"help": "Pass@K on the first this many held-out prompts (default: all n_eval)."}
    )
    sample_batch_size: int = field(default=8, metadata={"help": "Prompts per sampled generate call."})
    choose_single_on: str = field(
        default="fitness",
        metadata={
            "help": "Rows the best single adapter is chosen on: 'fitness' (the whole fitness split) or 'validation' "
            "(the n_validation rows, as the final genome with final_genome='validation')."
        },
    )
    reference_arms: bool = field(
        default=True,
        metadata={
            "help": "Score the reference arms on the held-out rows: base, every single adapter, the GRPO-LoRA "
            "baselines (trained or reused). False: only the uniform merge and Hyper-ES, no baseline trained, for "
            "ablation runs whose reference arms are those of the run they vary (the same rows and seed)."
        },
    )
    track_validation: bool = field(
        default=False,
        metadata={
            "help": "After every generation, score the CMA-ES distribution mean's merge on the validation rows "
            "(needs n_validation; diagnostic, not part of the search) for search_curve.png and comparison.json."
        },
    )


POOL_SPLITS = ("random", "difficulty", "carries", "base_success")


def carries(a: int, b: int, op: str) -> int:
    """The carries of ``a + b`` (or the borrows of ``|a - b|``, larger minus smaller) in base 10, digit by digit.

    Raises:
        ValueError: for another operator.
    """
    if op not in ("+", "-"):
        raise ValueError(f"pool_split='carries' is defined for the operators + and -, got {op!r}; use "
                         "'difficulty' or 'base_success'.")
    a, b = abs(a), abs(b)
    if op == "-":
        a, b = max(a, b), min(a, b)
    count, carry = 0, 0
    while a or b:
        da, db = a % 10, b % 10
        if op == "+":
            carry = int(da + db + carry >= 10)
        else:
            carry = int(da - db - carry < 0)
        count += carry
        a, b = a // 10, b // 10
    return count


def pool_split_key(script_args, model, tokenizer, rows, seed: int):
    """The ``split_key`` of ``build_direction_pool`` for ``pool_split`` (``None``: random buckets).

    Raises:
        ValueError: for an unknown ``pool_split``.
    """
    if script_args.pool_split not in POOL_SPLITS:
        raise ValueError(f"pool_split must be one of {POOL_SPLITS}, got {script_args.pool_split!r}.")
    if script_args.pool_split == "difficulty":
        return lambda row: abs(row["answer"])
    if script_args.pool_split == "carries":
        return lambda row: (carries(row["a"], row["b"], row["op"]), abs(row["answer"]))
    if script_args.pool_split == "base_success":
        rates = sampled_success_rates(
            model, tokenizer, [rows[i] for i in range(len(rows))], [arithmetic_reward],
            num_samples=script_args.difficulty_samples,
            max_completion_length=script_args.pool_max_completion_length, seed=seed,
        )
        logger.info(f"Base success rates of the {len(rates)} pool rows: mean {sum(rates) / len(rates):.3f}")
        return [1.0 - rate for rate in rates]  # bucket 0: the rows the base model solves most often
    return None


def pool_adapters(script_args, training_args, model, tokenizer, rows, pool_dir: str, num_adapters: int,
                  steps: int) -> tuple[list[str], list[dict]]:
    """Train ``num_adapters`` GRPO-LoRA adapters of ``steps`` steps on ``rows`` into ``pool_dir``, or reuse the ones
    there (``--reuse_pool``) when ``pool_rows.json`` records exactly these rows and settings.

    Returns:
        `(list[str], list[dict])`: The adapter folders and their ``direction_pool.json`` records (steps, runtime,
        generated tokens).

    Raises:
        ValueError: if a reused pool was trained on other rows or settings.
    """
    # The pool's training rows and settings, recorded beside it: a reused pool must have been trained on exactly
    # these (the split sizes shift the train rows, and a pool trained on what is now validation or fitness would
    # leak into them).
    recipe = {"model": script_args.model_name_or_path or "embedded:SmolLM2-135M-Instruct",
              "task_seed": script_args.task_seed, "prompts": [str(row["prompt"]) for row in rows],
              "num_adapters": num_adapters, "max_steps": steps, "seed": training_args.seed,
              **{key: getattr(script_args, key) for key in (
                  "pool_split", "pool_learning_rate", "lora_r", "lora_alpha", "pool_batch_size",
                  "pool_num_generations", "pool_max_completion_length")}}
    if num_adapters == 1:  # one bucket: the split does not matter (a GRPO-LoRA baseline is shared across splits)
        recipe["pool_split"] = None
    elif script_args.pool_split == "base_success":
        recipe["difficulty_samples"] = script_args.difficulty_samples
    rows_file = os.path.join(pool_dir, POOL_ROWS_NAME)
    if script_args.reuse_pool and os.path.exists(os.path.join(pool_dir, POOL_NAME)):
        recorded = None
        if os.path.exists(rows_file):
            with open(rows_file) as f:
                recorded = json.load(f)
            if num_adapters == 1 and recorded.get("num_adapters") == 1:
                recorded["pool_split"] = None  # a baseline recorded with the split of its run: one bucket either way
        if recorded != recipe:
            differ = "no " + POOL_ROWS_NAME if recorded is None else "differing: " + ", ".join(
                sorted(k for k in {*recorded, *recipe} if recorded.get(k) != recipe.get(k)))
            raise ValueError(f"The direction pool in {pool_dir} was trained on other rows or settings than this run's "
                             f"({differ}; task_seed, n_pool, n_fitness, n_validation, n_eval, low/high/ops select the "
                             "rows; the model, num_adapters, pool_max_steps, seed and the pool_*/lora_* settings "
                             "train them). Use another pool_dir or --reuse_pool false.")
        with open(os.path.join(pool_dir, POOL_NAME)) as f:
            records = json.load(f)["adapters"]
        logger.info(f"Reusing the direction pool in {pool_dir}: {[r['adapter'] for r in records]}")
        return [r["adapter"] for r in records], records
    split_key = pool_split_key(script_args, model, tokenizer, rows, training_args.seed) if num_adapters > 1 else None
    adapters = build_direction_pool(
        model,
        rows,
        arithmetic_reward,
        num_adapters=num_adapters,
        output_dir=pool_dir,
        processing_class=tokenizer,
        split_key=split_key,
        max_steps=steps,
        learning_rate=script_args.pool_learning_rate,
        lora_r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        grpo_kwargs={
            "per_device_train_batch_size": script_args.pool_batch_size,
            "num_generations": script_args.pool_num_generations,
            "max_completion_length": script_args.pool_max_completion_length,
            "gradient_checkpointing": False,
            "use_cpu": training_args.use_cpu,
        },
        seed=training_args.seed,
    )
    if is_main_process():
        write_json(rows_file, recipe)
    PartialState().wait_for_everyone()  # direction_pool.json is written by the main process
    with open(os.path.join(pool_dir, POOL_NAME)) as f:
        records = json.load(f)["adapters"]
    return adapters, records


def sampled_figures(model, tokenizer, rows: list[dict], training_args: HyperESConfig, script_args) -> dict:
    """Pass@K (K = 1, 2, 4, ... <= ``sampled_samples``) and token entropy of ``model`` at the papers' protocol
    (:data:`trl_es.analysis.PAPER_PROTOCOL`) on ``rows``, completions of ``max_completion_length`` tokens, sampling
    seeded with ``seed`` (the same samples for the same model)."""
    from trl_es.analysis import PAPER_PROTOCOL, mean_pass_at_k, sample_policy
    from trl_es.rollout import build_generation_config

    protocol = PAPER_PROTOCOL.with_samples(script_args.sampled_samples)
    config = build_generation_config(tokenizer, training_args.max_completion_length, protocol.temperature,
                                     protocol.top_p, model_generation_config=model.generation_config)
    out = sample_policy(model, tokenizer, rows, [arithmetic_reward], config, protocol.num_samples,
                        script_args.sample_batch_size, seed=training_args.seed)
    figures = {f"pass@{k}": mean_pass_at_k(protocol.num_samples, out["correct"], k) for k in protocol.pass_k}
    figures["token_entropy"] = out["token_entropy"]
    return figures


def arm_costs(pool_records: list[dict], best_single: int, baselines: dict, search_metrics: dict,
              search_seconds: float) -> dict:
    """What each arm cost: ``gradient_updates`` (GRPO optimizer steps), ``generated_tokens`` (completion tokens
    generated to train or search: GRPO rollouts, and for Hyper-ES also the candidates' fitness scoring) and
    ``wall_seconds`` (GRPO training and the search, evaluations excluded). A pool reused from an older run without
    these records gives `None` for its tokens and seconds."""

    def total(records, key):
        values = [r.get(key) for r in records]
        return None if any(v is None for v in values) else sum(values)

    pool = {"gradient_updates": total(pool_records, "steps"), "generated_tokens": total(pool_records, "generated_tokens"),
            "wall_seconds": total(pool_records, "train_runtime_s")}
    single = pool_records[best_single]
    costs = {
        "base": {"gradient_updates": 0, "generated_tokens": 0, "wall_seconds": 0.0},
        "best_single_adapter": {"gradient_updates": single["steps"], "generated_tokens": single.get("generated_tokens"),
                                "wall_seconds": single.get("train_runtime_s")},
        "uniform_merge": pool,
        "hyper_es": {
            "gradient_updates": pool["gradient_updates"],
            "generated_tokens": None if pool["generated_tokens"] is None
            else pool["generated_tokens"] + int(search_metrics["train_generated_tokens"]),
            "wall_seconds": None if pool["wall_seconds"] is None else pool["wall_seconds"] + search_seconds,
            "search_generated_tokens": int(search_metrics["train_generated_tokens"]),
            "search_seconds": search_seconds,
        },
    }
    for name, (_, record) in baselines.items():
        costs[name] = {"gradient_updates": record["steps"], "generated_tokens": record.get("generated_tokens"),
                       "wall_seconds": record.get("train_runtime_s")}
    return costs


class MeanGenomeValidation(TrainerCallback):
    """After each CMA-ES generation, the mean reward on ``rows`` of the distribution mean's merge (pycma's favorite
    solution, what ``final_genome="mean"`` keeps). ``records``: ``{"generation", "validation_mean_genome"}``."""

    def __init__(self, rows: list[dict]):
        self.rows, self.records, self.trainer = rows, [], None
        self.seconds = 0.0  # time spent here (not a cost of the search: subtracted from its wall time)

    def on_step_end(self, args, state, control, **kwargs):
        start = time.time()
        trainer = self.trainer
        with trainer.merged(trainer.space.decode(trainer.search.mean)):
            reward = trainer.score_current_model(self.rows)
        self.records.append({"generation": state.global_step, "validation_mean_genome": reward})
        self.seconds += time.time() - start


def plot_search(history: list[dict], validation: list[dict], path: str) -> None:
    """Fitness (best and mean of each generation's candidates) and, if tracked, the mean genome's validation reward,
    by generation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    generations = [h["generation"] for h in history]
    ax.plot(generations, [h["fitness/best"] for h in history], "o-", label="fitness: best candidate")
    ax.plot(generations, [h["fitness/mean"] for h in history], "o-", label="fitness: candidates' mean")
    if validation:
        ax.plot([v["generation"] for v in validation], [v["validation_mean_genome"] for v in validation], "s-",
                label="validation: CMA-ES mean genome")
    ax.set_xlabel("CMA-ES generation")
    ax.set_ylabel("mean reward (accuracy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(script_args: HyperESScriptArguments, training_args: HyperESConfig) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model, tokenizer = load_model_and_tokenizer(script_args.model_name_or_path, dtype=script_args.dtype)
    if training_args.final_genome == "validation" and script_args.n_validation < 1:
        raise ValueError("final_genome='validation' needs validation rows: set n_validation (the test split is not "
                         "for choosing).")
    if script_args.pool_split not in POOL_SPLITS:
        raise ValueError(f"pool_split must be one of {POOL_SPLITS}, got {script_args.pool_split!r}.")
    if script_args.choose_single_on not in ("fitness", "validation"):
        raise ValueError(f"choose_single_on must be 'fitness' or 'validation', got {script_args.choose_single_on!r}.")
    if script_args.choose_single_on == "validation" and script_args.n_validation < 1:
        raise ValueError("choose_single_on='validation' needs validation rows: set n_validation.")
    if script_args.difficulty_samples < 1:
        raise ValueError(f"difficulty_samples must be >= 1, got {script_args.difficulty_samples}.")
    if script_args.track_validation and script_args.n_validation < 1:
        raise ValueError("track_validation needs validation rows: set n_validation.")
    splits = make_arithmetic_dataset_dict(
        script_args.n_pool + script_args.n_fitness,
        script_args.n_validation,
        script_args.n_eval,
        seed=script_args.task_seed,
        low=script_args.low,
        high=script_args.high,
        ops=tuple(script_args.ops),
    )
    train, held_out = splits["train"], splits["test"]  # held out: the test split (as `trl-es train` and `eval`)
    pool_rows = train.select(range(script_args.n_pool))
    fitness_rows = train.select(range(script_args.n_pool, len(train)))

    pool_dir = script_args.pool_dir or os.path.join(training_args.output_dir, "pool")
    adapters, pool_records = pool_adapters(
        script_args, training_args, model, tokenizer, pool_rows, pool_dir, script_args.num_adapters,
        script_args.pool_max_steps,
    )
    pool_updates = script_args.num_adapters * script_args.pool_max_steps
    baselines = {}  # GRPO-LoRA at f x the pool's gradient updates: name -> (adapter folder, record)
    for factor in script_args.grpo_lora_factors if script_args.reference_arms else ():
        if not factor > 0:
            raise ValueError(f"grpo_lora_factors must be > 0, got {factor}.")
        steps = max(1, round(factor * pool_updates))
        (folder,), (record,) = pool_adapters(
            script_args, training_args, model, tokenizer, pool_rows, os.path.join(pool_dir, f"grpo_lora_{steps}steps"),
            1, steps,
        )
        baselines[f"grpo_lora_{steps}steps"] = (folder, dict(record, factor=factor))

    trainer = HyperESTrainer(
        model,
        adapters,
        reward_funcs=arithmetic_reward,
        args=training_args,
        train_dataset=fitness_rows,
        eval_dataset=splits["validation"] if script_args.n_validation else held_out,
        processing_class=tokenizer,
    )
    tracker = None
    if script_args.track_validation:
        tracker = MeanGenomeValidation([splits["validation"][i] for i in range(len(splits["validation"]))])
        tracker.trainer = trainer
        trainer.add_callback(tracker)
    sampled_rows = [held_out[i] for i in range(min(script_args.sampled_prompts or len(held_out), len(held_out)))]

    def sampled(arm_trainer, genome) -> dict:
        """Pass@K and token entropy of a merge on the sampled held-out rows ({} without --sampled_samples)."""
        if not script_args.sampled_samples:
            return {}
        with arm_trainer.merged(genome):
            return sampled_figures(arm_trainer.model, tokenizer, sampled_rows, training_args, script_args)

    results, figures = {}, {}
    choice_rows = splits["validation"] if script_args.choose_single_on == "validation" else fitness_rows
    best_k = 0
    if script_args.reference_arms:
        results["base"] = trainer.evaluate(held_out, genome="base", metric_key_prefix="base")["base_reward"]
        figures["base"] = sampled(trainer, "base")
        singles_choice, singles_eval = [], []
        for k, name in enumerate(trainer.space.adapter_names):
            singles_choice.append(
                trainer.evaluate(choice_rows, genome=k, metric_key_prefix=f"fit_{name}")[f"fit_{name}_reward"]
            )
            singles_eval.append(trainer.evaluate(held_out, genome=k, metric_key_prefix=name)[f"{name}_reward"])
        best_k = max(range(len(singles_choice)), key=singles_choice.__getitem__)
        results["single_adapters"] = dict(zip(trainer.space.adapter_names, singles_eval, strict=True))
        results["best_single_adapter"] = {"name": trainer.space.adapter_names[best_k], "reward": singles_eval[best_k],
                                          "chosen_on": script_args.choose_single_on}
        figures["best_single_adapter"] = sampled(trainer, best_k)
    results["uniform_merge"] = trainer.evaluate(held_out, genome="uniform", metric_key_prefix="uniform")[
        "uniform_reward"
    ]
    figures["uniform_merge"] = sampled(trainer, "uniform")
    # Each GRPO-LoRA baseline is one adapter applied alone (W0 + Delta), scored before the search, while the model
    # holds the base weights (a trainer takes the weights it finds as W0).
    for name, (folder, _) in (baselines.items() if script_args.reference_arms else ()):
        arm = HyperESTrainer(model, [folder], reward_funcs=arithmetic_reward, args=training_args,
                             train_dataset=fitness_rows, eval_dataset=held_out, processing_class=tokenizer)
        results[name] = arm.evaluate(held_out, genome=0, metric_key_prefix=name)[f"{name}_reward"]
        figures[name] = sampled(arm, 0)
        del arm
    search_start = time.time()
    train_output = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    search_seconds = time.time() - search_start - (tracker.seconds if tracker else 0.0)
    results["hyper_es"] = trainer.evaluate(held_out, metric_key_prefix="hyper_es")["hyper_es_reward"]
    results["hyper_es_fitness"] = -train_output.training_loss
    figures["hyper_es"] = sampled(trainer, None)
    if script_args.sampled_samples:
        results["sampled"] = figures
    results["search_curve"] = [
        {"generation": h["generation"], "fitness_best": h["fitness/best"], "fitness_mean": h["fitness/mean"]}
        for h in trainer.history
    ]
    if tracker is not None:
        tracked = {r["generation"]: r["validation_mean_genome"] for r in tracker.records}
        for point in results["search_curve"]:
            if point["generation"] in tracked:
                point["validation_mean_genome"] = tracked[point["generation"]]
    results["costs"] = arm_costs(pool_records, best_k, baselines, train_output.metrics, search_seconds)
    if not script_args.reference_arms:
        results["costs"] = {arm: results["costs"][arm] for arm in ("uniform_merge", "hyper_es")}
    if training_args.resume_from_checkpoint:  # the tokens and seconds of the search before the resume are not known
        results["costs"]["hyper_es"]["partial"] = "resumed: search tokens and seconds since the resume only"
    results["settings"] = {
        "generations": trainer.search.generation,
        "population_size": trainer.search.popsize,
        "coefficients": trainer.space.dim,
        "n_eval": len(held_out),
        "n_fitness": len(fitness_rows),
        "n_validation": script_args.n_validation,
        "final_genome": training_args.final_genome,
        "genome_granularity": training_args.genome_granularity,
        "noise_handling": training_args.noise_handling,
        "pool_split": script_args.pool_split,
        "num_adapters": script_args.num_adapters,
        "pool_max_steps": script_args.pool_max_steps,
        "pool_batch_size": script_args.pool_batch_size,
        "prompt_batch_size": training_args.prompt_batch_size,
        "search_density": training_args.search_density,
        "weight_bounds": list(training_args.weight_bounds),
        "evaluations": trainer.search.num_told,
        "pool_gradient_updates": pool_updates,
        "sampled_samples": script_args.sampled_samples,
        "sampled_prompts": len(sampled_rows) if script_args.sampled_samples else 0,
    }
    trainer.save_model(training_args.output_dir)  # every process; checks the files where it writes them
    if trainer.is_world_process_zero():
        write_json(os.path.join(training_args.output_dir, "comparison.json"), results)
        if trainer.history:
            plot_search(trainer.history, tracker.records if tracker else [],
                        os.path.join(training_args.output_dir, "search_curve.png"))
        print("held-out mean reward:")
        if script_args.reference_arms:
            print(f"  base                 {results['base']:.4f}")
            best = results["best_single_adapter"]
            print(f"  best single adapter  {best['reward']:.4f} ({best['name']})")
        print(f"  uniform merge        {results['uniform_merge']:.4f}")
        print(f"  Hyper-ES             {results['hyper_es']:.4f}")
        for name in baselines if script_args.reference_arms else ():
            print(f"  {name:<20} {results[name]:.4f}")
    return results


if __name__ == "__main__":
    parser = TrlESParser((HyperESScriptArguments, HyperESConfig))
    script_args, training_args = parser.parse_args_and_config()
    main(script_args, training_args)
