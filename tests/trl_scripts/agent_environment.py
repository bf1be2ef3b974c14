# TRL's environments (docs/source/grpo_trainer.md, "Agent Training", "Environments"), on the task of
# TRL's tools example: the calculator as an environment class given as `environment_factory`, one
# instance per rollout. `reset(**row)` reads the row's `answer` column; the public methods `multiply`
# and `async_add` (the tools example's functions, one of them async) are the policy's tools; `get_reward`
# scores what the environment saw (a tool result equal to the answer; a little for any call that ran),
# beside a reward function on the last turn. Offline: the model (whose chat template renders tools)
# comes from _offline.
import re

from _offline import TOOL_MODEL, load_dataset, output_dir, size

from rlhf_trainers import GRPOConfig, GRPOTrainer


class CalculatorEnv:
    def reset(self, answer, **kwargs) -> None:  # the row's columns arrive as keyword arguments
        self.answer = answer
        self.results = []

    def multiply(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        self.results.append(a * b)
        return a * b

    async def async_add(self, a: int, b: int) -> int:
        """
        Asynchronously adds two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum of the two integers.
        """
        self.results.append(a + b)
        return a + b

    def get_reward(self) -> float:
        """1 when a tool computed the answer during the episode, 0.1 when a tool ran on other numbers (a
        call with a real tool name and well-formed arguments: a signal before the first right call)."""
        if any(str(result) == self.answer for result in self.results):
            return 1.0
        return 0.1 if self.results else 0.0


def correctness_reward(completions, answer, **kwargs):
    """1 when the last turn states the answer, else 0."""
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        numbers = re.findall(r"-?\d+", completion[-1]["content"])
        rewards.append(1.0 if numbers and numbers[-1] == ans else 0.0)
    return rewards


dataset = load_dataset("offline/arithmetic-tools", split="train")

trainer = GRPOTrainer(
    model=TOOL_MODEL,
    args=GRPOConfig(
        output_dir=output_dir("agent_environment"), max_tool_calling_iterations=2, **size("agent")
    ),
    train_dataset=dataset,
    reward_funcs=correctness_reward,  # trainer-owned: scores the last turn's text
    environment_factory=CalculatorEnv,  # env-owned: scores its own state via `get_reward`
)
trainer.train()
