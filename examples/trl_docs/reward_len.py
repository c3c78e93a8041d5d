# trl_es: TRL docs, docs/source/grpo_trainer.md: "Example 1: Reward longer completions", then the trainer call of
# trl_es: "Passing the reward function to the trainer". The TRL text verbatim, except the import and the trainer
# trl_es: class (GRPOTrainer -> ESTrainer); what the docs leave out (the "..." of the trainer call, a dataset, the
# trl_es: call to train) is filled in between "trl_es: begin" and "trl_es: end" lines.
def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]

# trl_es: begin added: a dataset in standard format (the example's), the prompts of the docs' own test of the function
from datasets import Dataset

dataset = Dataset.from_list([{"prompt": "The sky is"}, {"prompt": "The sun is"}])
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
