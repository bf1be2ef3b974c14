"""PPO: the value model, GAE, the value loss and critic warmup, on the on-policy engine."""

from .config import PPOConfig
from .trainer import PPOTrainer

__all__ = ["PPOConfig", "PPOTrainer"]
