# trl_es: TRL docs, docs/source/grpo_trainer.md: "Example 4: Multi-task reward functions". The TRL text verbatim,
# trl_es: except the import and the trainer class (GRPOTrainer -> ESTrainer); the two checks the docs call but leave
# trl_es: undefined are filled in between "trl_es: begin" and "trl_es: end" lines.
from datasets import Dataset
from trl_es import ESTrainer

# Define a dataset that contains both math and coding problems
dataset = Dataset.from_list(
    [
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
        {"prompt": "What is 3*4?", "task": "math"},
        {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
    ]
)

# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards

# trl_es: begin added: minimal stand-ins for the two checks the docs call but do not define
def check_math_solution(prompt, completion):
    """Whether the completion contains the answer to one of the dataset's math questions."""
    return {"What is 2+2?": "4", "What is 3*4?": "12"}[prompt] in completion


def test_code_solution(prompt, completion):
    """Whether the completion defines a Python function."""
    return "def " in completion
# trl_es: end

# Use both task-specific reward functions
trainer = ESTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=[math_reward_func, coding_reward_func],
    train_dataset=dataset,
)

trainer.train()
