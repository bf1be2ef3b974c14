# TRL's GRPO quick start (docs/source/grpo_trainer.md, "Quick start"): conversational prompts, a
# `solution` column, TRL's ready-made accuracy reward. Offline: the model and the dataset come from
# _offline (no Hub here); the config sizes the run for this machine.
from _offline import MODEL, load_dataset, output_dir, size

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

training_args = GRPOConfig(output_dir=output_dir("grpo_quickstart"), **size("grpo"))
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=accuracy_reward,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
