"""The on-policy engine PPO and RLOO share: :class:`OnPolicyConfig` and :class:`OnPolicyTrainer`."""

from .config import OnPolicyConfig
from .forward import PolicyAndValue
from .trainer import OnPolicyTrainer

__all__ = ["OnPolicyConfig", "OnPolicyTrainer", "PolicyAndValue"]
