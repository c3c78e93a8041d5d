# trl_es: TRL docs, docs/source/grpo_trainer.md: "Example 5: Asynchronous reward functions", then the trainer call of
# trl_es: "Passing the reward function to the trainer". The TRL text verbatim, except the import and the trainer class
# trl_es: (GRPOTrainer -> ESTrainer); what the docs leave out (the "..." of the trainer call, its dataset, the call to
# trl_es: train) is filled in between "trl_es: begin" and "trl_es: end" lines.
import asyncio

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]

# trl_es: begin added: the dataset of "Quick start"; the name the call uses
from datasets import load_dataset

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
reward_func = async_reward_func
# trl_es: end

from trl_es import ESTrainer

trainer = ESTrainer(
    reward_funcs=reward_func,
    # trl_es: begin instead of: ...,
    model="Qwen/Qwen2.5-0.5B-Instruct",  # the model of "Quick start"
    train_dataset=dataset,
    # trl_es: end
)
# trl_es: begin added: train, as "Quick start" does
trainer.train()
# trl_es: end
