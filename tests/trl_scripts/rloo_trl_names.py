# TRL 1.x's RLOO (docs/source/rloo_trainer.md, "Quick start") with an RLOOConfig in TRL 1.x's names
# (num_generations, beta, max_completion_length): max_steps counts optimizer steps, as in TRL.
from _offline import MODEL, load_dataset, output_dir, size

from rlhf_trainers import RLOOConfig, RLOOTrainer
from rlhf_trainers.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

training_args = RLOOConfig(output_dir=output_dir("rloo_trl_names"), **size("rloo"))
trainer = RLOOTrainer(
    model=MODEL,
    reward_funcs=accuracy_reward,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
