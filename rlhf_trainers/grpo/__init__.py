"""GRPO: group-relative advantages over num_generations completions per prompt, with TRL's GRPOTrainer
names and batch semantics, on the on-policy engine."""

from .config import ADVANTAGE_ESTIMATORS, LOSS_TYPES, GRPOConfig
from .trainer import GRPOTrainer

__all__ = ["ADVANTAGE_ESTIMATORS", "LOSS_TYPES", "GRPOConfig", "GRPOTrainer"]
