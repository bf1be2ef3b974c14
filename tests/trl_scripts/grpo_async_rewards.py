# Asynchronous reward functions (TRL's GRPO docs, Example 5), mixed with a synchronous one; the async
# ones are awaited concurrently. Rewards from token ids (Example 1) and characters (Example 1.1).
import asyncio

from _offline import MODEL, load_dataset, output_dir, size

from rlhf_trainers import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")


async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


async def async_unique_chars(completions, **kwargs):
    await asyncio.sleep(0.01)
    return [len(set(completion)) / 20 for completion in completions]


def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to shorter completions (in terms of token count)."""
    return [-len(ids) / 64 for ids in completion_ids]


training_args = GRPOConfig(output_dir=output_dir("grpo_async_rewards"), **size("grpo"))
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=[reward_func, async_reward_func, async_unique_chars],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
