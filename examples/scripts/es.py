# /// script
# dependencies = [
#     "trl-es",
# ]
# ///

"""ES fine-tuning with ESTrainer: a dataset, reward functions, ESConfig, ESTrainer, train(), save.

TRL's GRPO script (``trl/scripts/grpo.py``) with ``GRPOTrainer`` swapped for ``ESTrainer``. Without ``--dataset_name``
it trains on trl_es's arithmetic task (splits generated locally, nothing downloaded) graded by ``arithmetic_reward``;
``--dataset_name`` takes a hub id or a local folder of data files (``datasets.load_dataset``) whose rows have a
``prompt`` column, and ``--reward_funcs`` names their reward functions.

    pip install -e .      # in a checkout of trl_es
    python examples/scripts/es.py --output_dir runs/es --max_steps 10
    accelerate launch examples/scripts/es.py --output_dir runs/es --population_size 32 --max_steps 10
    python examples/scripts/es.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \
        --reward_funcs accuracy_reward --output_dir runs/es-deepmath

Every ESConfig field and TRL's ModelConfig fields (``--use_peft``, ``--lora_r``, ...) are flags, or keys of a YAML
file passed as ``--config recipe.yaml``. The model defaults to the embedded SmolLM2-135M-Instruct.
"""

import importlib
import os
import sys
from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config
from trl.rewards import accuracy_reward, think_format_reward

from trl_es import ESConfig, ESTrainer
from trl_es.tasks import arithmetic_reward, countdown_reward, gsm_reward, make_arithmetic_dataset_dict

REWARD_FUNCS = {f.__name__: f for f in (arithmetic_reward, countdown_reward, gsm_reward, accuracy_reward,
                                        think_format_reward)}


@dataclass
class ESScriptArguments(ScriptArguments):
    """TRL's ScriptArguments (``--dataset_name``, ``--dataset_train_split``, ...) and the reward functions."""

    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": f"Reward functions: {', '.join(REWARD_FUNCS)} or a dotted import path (my_lib.rewards.my_reward). "
                "Default: arithmetic_reward when --dataset_name is not given."})
    reward_model_name_or_path: str | None = field(default=None, metadata={"help": "A reward model (hub id or path)."})
    num_train_prompts: int = field(default=400, metadata={"help": "Arithmetic task: training prompts."})
    num_test_prompts: int = field(default=100, metadata={"help": "Arithmetic task: held-out prompts (the test split)."})


def reward_function(name: str):
    """A reward function by its name in REWARD_FUNCS or by a dotted import path (found from the working directory)."""
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    if "." not in name:
        raise ValueError(f"unknown reward function {name!r}: choose one of {sorted(REWARD_FUNCS)} or an import path")
    module, attribute = name.rsplit(".", 1)
    sys.path.insert(0, os.getcwd())  # as TRL's scripts: my_rewards.py beside the command
    return getattr(importlib.import_module(module), attribute)


def main(script_args: ESScriptArguments, training_args: ESConfig, model_args: ModelConfig):
    # Model: loaded by ESTrainer from its name, as GRPOTrainer does
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    training_args.model_init_kwargs = dict(revision=model_args.model_revision, dtype=dtype,
                                           attn_implementation=model_args.attn_implementation)

    # Dataset: a hub id or local folder, else the arithmetic task's splits
    if script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                               streaming=script_args.dataset_streaming)
    else:
        dataset = make_arithmetic_dataset_dict(script_args.num_train_prompts, 0, script_args.num_test_prompts)

    # Rewards: functions by name, then a reward model
    names = script_args.reward_funcs or ([] if script_args.dataset_name else ["arithmetic_reward"])
    reward_funcs = [reward_function(name) for name in names]
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)
    if not reward_funcs:
        raise ValueError("--dataset_name needs --reward_funcs or --reward_model_name_or_path.")

    # Training
    trainer = ESTrainer(
        model=model_args.model_name_or_path or "embedded:SmolLM2-135M-Instruct",
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
    )
    trainer.train()

    # Save (the model and its seed log) and push to the Hub
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


def make_parser() -> TrlParser:
    return TrlParser((ESScriptArguments, ESConfig, ModelConfig))


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
