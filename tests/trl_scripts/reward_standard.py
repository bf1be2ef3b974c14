# TRL's reward modeling quick start (docs/source/reward_trainer.md), on standard preferences
# ("Expected dataset type and format"): a causal LM gets a scalar head and learns chosen > rejected.
from _offline import MODEL, load_dataset, output_dir, size

from rlhf_trainers import RewardConfig, RewardTrainer

dataset = load_dataset("offline/standard-preference", split="train")

training_args = RewardConfig(output_dir=output_dir("reward_standard"), **size("reward"))
trainer = RewardTrainer(
    model=MODEL,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
