# TRL's GRPO environments (docs/source/grpo_trainer.md, "Agent Training": "Environments" with "Providing
# an external dataset", and "Rewards"): an environment class as `environment_factory`, one instance per
# rollout; its public `increment` method is the policy's tool, `reset(target=...)` reads the row's
# `target` column, `get_reward` scores the episode from its state, beside a reward function on the text.
# Offline: the model (whose chat template renders tools) comes from _offline; the config sizes the run.
from _offline import TOOL_MODEL, output_dir, size
from datasets import Dataset

from rlhf_trainers import GRPOConfig, GRPOTrainer

# Each row carries the prompt and the task data (here, the counter target to reach).
dataset = Dataset.from_dict(
    {
        "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
        "target": list(range(1, 7)),
    }
)


class IncrementEnv:
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def format_reward(completions, **kwargs):  # trainer-owned: scores the completion text (a short last turn)
    return [1.0 if len(completion[-1]["content"].split()) <= 5 else 0.0 for completion in completions]


trainer = GRPOTrainer(
    model=TOOL_MODEL,
    args=GRPOConfig(output_dir=output_dir("grpo_environment"), **size("grpo")),
    train_dataset=dataset,  # the dataset owns the task; the "target" column reaches reset(target=...)
    reward_funcs=format_reward,  # trainer-owned: scores the completion
    environment_factory=IncrementEnv,  # env-owned: scores its internal state via `get_reward`
)
trainer.train()
