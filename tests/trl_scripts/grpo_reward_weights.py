# Several reward functions with weights and an extra dataset column (TRL's GRPO docs, "Using a custom
# reward function": Example 3, a reference answer in `ground_truth`; Example 2, a format reward), summed
# with `reward_weights`.
import re

from _offline import MODEL, load_dataset, output_dir, size

from rlhf_trainers import GRPOConfig, GRPOTrainer

dataset = load_dataset("offline/boxed-arithmetic", split="train")


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a \\boxed{} answer."""
    return [1.0 if re.search(r"\\boxed\{.+?\}", completion) else 0.0 for completion in completions]


training_args = GRPOConfig(
    output_dir=output_dir("grpo_reward_weights"), reward_weights=[1.0, 0.5], **size("grpo")
)
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=[reward_func, format_reward_func],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
