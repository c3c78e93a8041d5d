# trl_es: TRL docs, docs/source/quickstart.md, "Quick Examples" > "Group Relative Policy Optimization".
# trl_es: The TRL text verbatim; only the import and the trainer class changed (GRPOTrainer -> ESTrainer).
from trl_es import ESTrainer
from datasets import load_dataset
from trl.rewards import accuracy_reward

trainer = ESTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    train_dataset=load_dataset("trl-lib/DeepMath-103K", split="train"),
    reward_funcs=accuracy_reward,
)
trainer.train()
