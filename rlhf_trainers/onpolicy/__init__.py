"""The on-policy engine PPO and RLOO share: :class:`OnPolicyConfig` and :class:`OnPolicyTrainer`."""

from .config import OnPolicyConfig
from .trainer import OnPolicyTrainer, PolicyAndValue

__all__ = ["OnPolicyConfig", "OnPolicyTrainer", "PolicyAndValue"]
