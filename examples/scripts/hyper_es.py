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
from dataclasses import dataclass, field

from trl_es.arguments import TrlESParser
from trl_es.files import is_main_process, write_json
from trl_es.merging import build_direction_pool
from trl_es.merging.direction_pool import POOL_NAME

POOL_ROWS_NAME = "pool_rows.json"  # beside direction_pool.json: the rows the pool was trained on
from trl_es.models import load_model_and_tokenizer
from trl_es.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset_dict
from trl_es.trainer.hyper_es_config import HyperESConfig
from trl_es.trainer.hyper_es_trainer import HyperESTrainer

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
        default="random", metadata={"help": "Buckets: 'random' or 'difficulty' (quantiles of the answer's size)."}
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


def main(script_args: HyperESScriptArguments, training_args: HyperESConfig) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model, tokenizer = load_model_and_tokenizer(script_args.model_name_or_path, dtype=script_args.dtype)
    if training_args.final_genome == "validation" and script_args.n_validation < 1:
        raise ValueError("final_genome='validation' needs validation rows: set n_validation (the test split is not "
                         "for choosing).")
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
    # The pool's training rows, recorded beside it: a reused pool must have been trained on exactly these (the split
    # sizes shift the train rows, and a pool trained on what is now validation or fitness would leak into them).
    pool_prompts = {"task_seed": script_args.task_seed, "prompts": [str(row["prompt"]) for row in pool_rows]}
    rows_file = os.path.join(pool_dir, POOL_ROWS_NAME)
    if script_args.reuse_pool and os.path.exists(os.path.join(pool_dir, POOL_NAME)):
        recorded = None
        if os.path.exists(rows_file):
            with open(rows_file) as f:
                recorded = json.load(f)
        if recorded != pool_prompts:
            raise ValueError(f"The direction pool in {pool_dir} was trained on other rows than this run's pool rows "
                             f"({'no ' + POOL_ROWS_NAME if recorded is None else 'they differ'}: task_seed, n_pool, "
                             "n_fitness, n_validation, n_eval, low/high/ops select them). Use another pool_dir or "
                             "--reuse_pool false.")
        with open(os.path.join(pool_dir, POOL_NAME)) as f:
            adapters = [a["adapter"] for a in json.load(f)["adapters"]]
        logger.info(f"Reusing the direction pool in {pool_dir}: {adapters}")
    else:
        if script_args.pool_split not in ("random", "difficulty"):
            raise ValueError(f"pool_split must be 'random' or 'difficulty', got {script_args.pool_split!r}.")
        adapters = build_direction_pool(
            model,
            pool_rows,
            arithmetic_reward,
            num_adapters=script_args.num_adapters,
            output_dir=pool_dir,
            processing_class=tokenizer,
            split_key=(lambda row: abs(row["answer"])) if script_args.pool_split == "difficulty" else None,
            max_steps=script_args.pool_max_steps,
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
            write_json(rows_file, pool_prompts)

    trainer = HyperESTrainer(
        model,
        adapters,
        reward_funcs=arithmetic_reward,
        args=training_args,
        train_dataset=fitness_rows,
        eval_dataset=splits["validation"] if script_args.n_validation else held_out,
        processing_class=tokenizer,
    )
    results = {"base": trainer.evaluate(held_out, genome="base", metric_key_prefix="base")["base_reward"]}
    singles_fitness, singles_eval = [], []
    for k, name in enumerate(trainer.space.adapter_names):
        singles_fitness.append(
            trainer.evaluate(fitness_rows, genome=k, metric_key_prefix=f"fit_{name}")[f"fit_{name}_reward"]
        )
        singles_eval.append(trainer.evaluate(held_out, genome=k, metric_key_prefix=name)[f"{name}_reward"])
    best_k = max(range(len(singles_fitness)), key=singles_fitness.__getitem__)
    results["single_adapters"] = dict(zip(trainer.space.adapter_names, singles_eval, strict=True))
    results["best_single_adapter"] = {"name": trainer.space.adapter_names[best_k], "reward": singles_eval[best_k]}
    results["uniform_merge"] = trainer.evaluate(held_out, genome="uniform", metric_key_prefix="uniform")[
        "uniform_reward"
    ]
    train_output = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    results["hyper_es"] = trainer.evaluate(held_out, metric_key_prefix="hyper_es")["hyper_es_reward"]
    results["hyper_es_fitness"] = -train_output.training_loss
    results["settings"] = {
        "generations": trainer.search.generation,
        "population_size": trainer.search.popsize,
        "coefficients": trainer.space.dim,
        "n_eval": len(held_out),
        "n_fitness": len(fitness_rows),
        "n_validation": script_args.n_validation,
        "final_genome": training_args.final_genome,
    }
    trainer.save_model(training_args.output_dir)  # every process; checks the files where it writes them
    if trainer.is_world_process_zero():
        write_json(os.path.join(training_args.output_dir, "comparison.json"), results)
        print("held-out mean reward:")
        print(f"  base                 {results['base']:.4f}")
        print(
            f"  best single adapter  {results['best_single_adapter']['reward']:.4f} ({results['best_single_adapter']['name']})"
        )
        print(f"  uniform merge        {results['uniform_merge']:.4f}")
        print(f"  Hyper-ES             {results['hyper_es']:.4f}")
    return results


if __name__ == "__main__":
    parser = TrlESParser((HyperESScriptArguments, HyperESConfig))
    script_args, training_args = parser.parse_args_and_config()
    main(script_args, training_args)
