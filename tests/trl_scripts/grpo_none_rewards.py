# Task-specific reward functions that return None where they do not apply (TRL's GRPO docs, Example 4:
# multi-task reward functions). The trainer ignores the None entries.
import re

from _offline import MODEL, load_dataset, output_dir, size

from rlhf_trainers import GRPOConfig, GRPOTrainer

# A dataset that contains both math and coding problems (a `task` column)
dataset = load_dataset("offline/math-and-code", split="train")


def check_math_solution(prompt, completion):
    a, b = (int(x) for x in re.findall(r"\d+", prompt)[:2])
    return str(a + b) in completion


def test_code_solution(prompt, completion):
    return "def " in completion and "return" in completion


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
        if t == "code":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards


training_args = GRPOConfig(output_dir=output_dir("grpo_none_rewards"), **size("grpo"))
# Use both task-specific reward functions
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=[math_reward_func, coding_reward_func],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
