# trl_es: TRL docs, docs/source/grpo_trainer.md: "Example 2: Reward completions with a specific format", then the
# trl_es: trainer call of "Passing the reward function to the trainer". The TRL text verbatim, except the import and
# trl_es: the trainer class (GRPOTrainer -> ESTrainer); what the docs leave out (the "..." of the trainer call, its
# trl_es: dataset, the call to train) is filled in between "trl_es: begin" and "trl_es: end" lines.
import re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]

# trl_es: begin added: the dataset of "Quick start" (conversational, as this example needs); the name the call uses
from datasets import load_dataset

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
reward_func = format_reward_func
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
