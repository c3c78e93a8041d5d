# trl_es: TRL docs, docs/source/grpo_trainer.md: "Example 3: Reward completions based on a reference", then the
# trl_es: trainer call of "Passing the reward function to the trainer". The TRL text verbatim, except the import and
# trl_es: the trainer class (GRPOTrainer -> ESTrainer); what the docs leave out (the "..." of the trainer call, a
# trl_es: dataset, the call to train) is filled in between "trl_es: begin" and "trl_es: end" lines.
import re

def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

# trl_es: begin added: a dataset in standard format with a "ground_truth" column (the example's), the prompts and
# trl_es: ground truths of the docs' own test of the function
from datasets import Dataset

dataset = Dataset.from_list(
    [
        {"prompt": "Problem: Solve the equation $2x + 3 = 7$. Solution:", "ground_truth": "2"},
        {"prompt": "Problem: Solve the equation $3x - 5 = 10$.", "ground_truth": "5"},
    ]
)
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
