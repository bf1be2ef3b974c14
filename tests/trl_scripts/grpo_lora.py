# GRPO with a LoRA adapter (TRL's PEFT integration docs, "Group Relative Policy Optimization (GRPO)").
from _offline import MODEL, load_dataset, output_dir, size
from peft import LoraConfig

from rlhf_trainers import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")


def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to completions with more distinct characters."""
    return [len(set(completion)) / 20 for completion in completions]


# Configure LoRA
peft_config = LoraConfig(
    r=32,
    lora_alpha=16,
    lora_dropout=0.05,
    bias="none",
    task_type="CAUSAL_LM",
)

# Configure training with higher learning rate for LoRA
training_args = GRPOConfig(output_dir=output_dir("grpo_lora"), **{**size("grpo"), "learning_rate": 1e-4})

# Create trainer with PEFT config
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=reward_func,
    args=training_args,
    train_dataset=dataset,
    peft_config=peft_config,  # pass PEFT config here
)
trainer.train()
