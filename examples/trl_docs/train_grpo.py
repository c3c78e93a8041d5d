# trl_es: TRL docs, docs/source/grpo_trainer.md, "Quick start".
# trl_es: The TRL text verbatim; only the import and the trainer class changed (GRPOTrainer -> ESTrainer).
# train_grpo.py
from datasets import load_dataset
from trl_es import ESTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = ESTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
