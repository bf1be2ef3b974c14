"""Reward modeling: :class:`RewardConfig` and :class:`RewardTrainer` (Bradley-Terry loss, metrics,
the reward normalization of the reference implementation)."""

from .config import RewardConfig
from .trainer import RewardTrainer, reward_metrics

__all__ = ["RewardConfig", "RewardTrainer", "reward_metrics"]
