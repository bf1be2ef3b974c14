"""RLOO: k completions per prompt and the leave-one-out baseline, on the on-policy engine."""

from .config import RLOOConfig
from .trainer import SIMPLE_QUERY_CHAT_TEMPLATE, RLOOTrainer, leave_one_out

__all__ = ["SIMPLE_QUERY_CHAT_TEMPLATE", "RLOOConfig", "RLOOTrainer", "leave_one_out"]
