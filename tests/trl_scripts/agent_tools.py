# TRL's agent training with tools (docs/source/grpo_trainer.md, "Tools"; the rewards in the style of
# examples/scripts/grpo_agent.py): typed functions with Google-style docstrings, one sync and one async,
# a correctness reward on the last turn and a structure reward on the tool calls. Offline: the model
# folder's chat template supports tool calling (TOOL_MODEL: the test saves one, as a Qwen3 checkpoint
# ships one).
import re

from _offline import TOOL_MODEL, load_dataset, output_dir, size

from rlhf_trainers import GRPOConfig, GRPOTrainer


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def correctness_reward(completions, answer, **kwargs):
    """1 when the last turn states the answer, else 0."""
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        numbers = re.findall(r"-?\d+", completion[-1]["content"])
        rewards.append(1.0 if numbers and numbers[-1] == ans else 0.0)
    return rewards


def structure_reward(completions, **kwargs):
    """A small bonus for a tool call that got a response."""
    rewards = []
    for completion in completions:
        has_call = any(turn.get("tool_calls") for turn in completion if turn.get("role") == "assistant")
        has_response = any(turn.get("role") == "tool" for turn in completion)
        rewards.append(0.1 if has_call and has_response else 0.0)
    return rewards


dataset = load_dataset("offline/arithmetic-tools", split="train")

training_args = GRPOConfig(
    output_dir=output_dir("agent_tools"), max_tool_calling_iterations=2, **size("agent")
)
trainer = GRPOTrainer(
    model=TOOL_MODEL,
    reward_funcs=[correctness_reward, structure_reward],
    args=training_args,
    train_dataset=dataset,
    tools=[multiply, async_add],
)
trainer.train()
