# trl_es: TRL docs, docs/source/grpo_trainer.md: "Example 1: Reward longer completions" and "Example 5: Asynchronous
# trl_es: reward functions", then the second trainer call of "Passing the reward function to the trainer" (a list
# trl_es: of sync and async reward functions). The TRL text verbatim, except the import and the trainer class
# trl_es: (GRPOTrainer -> ESTrainer); what the docs leave out (the two async functions the call names, the "..." of the
# trl_es: trainer call, its dataset, the call to train) is filled in between "trl_es: begin" and "trl_es: end" lines.
def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]

import asyncio

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]

# trl_es: begin added: the two async functions the call names (two calls of Example 5's), the dataset of "Quick start"
async def async_reward_func1(prompts, completions, **kwargs):
    return await async_reward_func(prompts, completions, **kwargs)


async def async_reward_func2(prompts, completions, **kwargs):
    return await async_reward_func(prompts, completions, **kwargs)


from datasets import load_dataset

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
# trl_es: end

from trl_es import ESTrainer

trainer = ESTrainer(
    reward_funcs=[reward_func, async_reward_func1, async_reward_func2],
    # trl_es: begin instead of: ...,
    model="Qwen/Qwen2.5-0.5B-Instruct",  # the model of "Quick start"
    train_dataset=dataset,
    # trl_es: end
)
# trl_es: begin added: train, as "Quick start" does
trainer.train()
# trl_es: end
