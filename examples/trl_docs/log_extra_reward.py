# trl_es: TRL docs, docs/source/grpo_trainer.md: "Example 6: Logging extra columns and metrics", then the trainer call
# trl_es: of "Passing the reward function to the trainer". The TRL text verbatim, except the import and the trainer
# trl_es: class (GRPOTrainer -> ESTrainer); what the docs leave out (the "..." of the trainer call, a dataset, the call
# trl_es: to train) is filled in between "trl_es: begin" and "trl_es: end" lines.
import re

def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])

    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards

# trl_es: begin added: a dataset in standard format with a "ground_truth" column, the prompts and ground truths of
# trl_es: the docs' test of Example 3 (the same reward)
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
