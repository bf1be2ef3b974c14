"""rlhf_trainers: online RLHF (PPO, RLOO, GRPO, reward modeling) for Hugging Face ``transformers``.

The package import is kept light: the pure math (:mod:`rlhf_trainers.functional`) and the
optimizer are imported eagerly (they only need ``torch``); everything that pulls in
``transformers``/``tokenizers``/``datasets`` (the offline kit, the trainers) is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

from . import functional
from .functional import (
    AdaptiveKLController,
    FixedKLController,
    gae_advantages,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    rloo_advantages,
    truncate_response,
    whiten,
)
from .optim import TFStyleAdam

# name -> module that defines it; imported lazily by ``__getattr__`` so that
# ``import rlhf_trainers`` does not import transformers.
_LAZY: dict[str, str] = {
    "testing": "rlhf_trainers.testing",
    "CPUOptions": "rlhf_trainers.cpu",
    "OnPolicyConfig": "rlhf_trainers.onpolicy",
    "OnPolicyTrainer": "rlhf_trainers.onpolicy",
    "GRPOConfig": "rlhf_trainers.grpo",
    "GRPOTrainer": "rlhf_trainers.grpo",
    "PPOConfig": "rlhf_trainers.ppo",
    "PPOTrainer": "rlhf_trainers.ppo",
    "RLOOConfig": "rlhf_trainers.rloo",
    "RLOOTrainer": "rlhf_trainers.rloo",
    "RewardConfig": "rlhf_trainers.reward",
    "RewardTrainer": "rlhf_trainers.reward",
}

if TYPE_CHECKING:  # pragma: no cover
    from . import testing
    from .cpu import CPUOptions
    from .grpo import GRPOConfig, GRPOTrainer
    from .onpolicy import OnPolicyConfig, OnPolicyTrainer
    from .ppo import PPOConfig, PPOTrainer
    from .reward import RewardConfig, RewardTrainer
    from .rloo import RLOOConfig, RLOOTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        value = module if _LAZY[name].endswith("." + name) else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlhf_trainers' has no attribute {name!r}")


__all__ = [
    "AdaptiveKLController",
    "CPUOptions",
    "FixedKLController",
    "GRPOConfig",
    "GRPOTrainer",
    "OnPolicyConfig",
    "OnPolicyTrainer",
    "PPOConfig",
    "PPOTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "TFStyleAdam",
    "__version__",
    "functional",
    "gae_advantages",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "rloo_advantages",
    "testing",
    "truncate_response",
    "whiten",
]
