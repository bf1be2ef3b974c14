"""PPOConfig: the on-policy fields plus what only PPO has (value model, GAE, value loss)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config_problems import ConfigProblems
from ..onpolicy.config import OnPolicyConfig

VALUE_MODEL_INITS = ("policy", "reward_model")
#: :attr:`PPOConfig.rollout_values`.
ROLLOUT_VALUES = ("auto", "forward")


@dataclass
class PPOConfig(OnPolicyConfig):
    """Configuration of :class:`~rlhf_trainers.PPOTrainer`: every :class:`OnPolicyConfig` (and
    ``TrainingArguments``) field, plus the value model and GAE. Defaults follow TRL's PPOConfig where TRL
    has the field, and the reference implementations elsewhere (gamma 1, lam 0.95, value clip 0.2)."""

    num_generations: int = field(
        default=1,
        metadata={
            "help": "Completions sampled per prompt (the prompt batch repeated, completion j of prompt i at row "
            "j x prompts + i); each is its own episode for GAE. The rollout per process must be a multiple of it."
        },
    )
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss in the total loss."})
    cliprange_value: float | None = field(
        default=0.2,
        metadata={"help": "Clip of the value update around the rollout values (LHPD). None: unclipped."},
    )
    gamma: float = field(default=1.0, metadata={"help": "Discount factor (LHPD uses 1)."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    lam_value: float | None = field(
        default=None,
        metadata={"help": "Decoupled lambda of the value targets (VAPO uses 1.0). None: lam."},
    )
    length_adaptive_alpha: float = field(
        default=0.0,
        metadata={
            "help": "Length-adaptive policy lambda 1 - 1/(alpha * length) per response (VAPO, alpha 0.05). 0: off."
        },
    )
    whiten_advantages: bool = field(
        default=True,
        metadata={"help": "Whiten the advantages over the rollout of all processes (LHPD does)."},
    )
    critic_warmup_steps: int = field(
        default=0,
        metadata={"help": "First updates that train only the value model (NeMo RL critic warmup)."},
    )
    critic_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the value model. None: learning_rate."}
    )
    value_model_init: str = field(
        default="policy",
        metadata={
            "help": "Where a value model that is not given starts: 'policy' (LHPD: the policy's weights with "
            "a zero-initialised scalar head) or 'reward_model' (TRL: a copy of the reward model)."
        },
    )

    rollout_values: str = field(
        default="auto",
        metadata={
            "help": "Where the rollout's values V(s_t) come from. 'forward': a separate no-grad pass of the value "
            "model. 'auto': the first micro-batch of the first optimizer step takes its values from its own "
            "training forward pass (same weights, before any step): one value pass less per update, equal up "
            "to rounding. Falls back to 'forward' under dropout, DeepSpeed or multi-process balance_batch."
        },
    )

    def __post_init__(self) -> None:
        problems = ConfigProblems(self)  # the engine's problems and PPO's, listed together
        with problems.collect():
            super().__post_init__()
        value = self.num_generations
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.add(f"num_generations={value!r}: expected an integer >= 1 (completions per prompt).")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            problems.add(f"gamma={self.gamma}, lam={self.lam}: both must be in [0, 1].")
        if self.lam_value is not None and not 0 <= self.lam_value <= 1:
            problems.add(f"lam_value={self.lam_value}: must be in [0, 1] or None.")
        if self.vf_coef < 0:
            problems.add(f"vf_coef={self.vf_coef}: must be >= 0.")
        if self.cliprange_value is not None and not self.cliprange_value > 0:
            problems.add(f"cliprange_value={self.cliprange_value}: must be > 0, or None for no clipping.")
        if self.length_adaptive_alpha < 0:
            problems.add(f"length_adaptive_alpha={self.length_adaptive_alpha}: must be >= 0 (0 disables it).")
        if self.critic_warmup_steps < 0:
            problems.add(f"critic_warmup_steps={self.critic_warmup_steps}: must be >= 0.")
        if self.critic_learning_rate is not None and not self.critic_learning_rate > 0:
            problems.add(f"critic_learning_rate={self.critic_learning_rate}: must be > 0, or None.")
        if self.rollout_values not in ROLLOUT_VALUES:
            problems.add(
                f"rollout_values={self.rollout_values!r}: expected one of {ROLLOUT_VALUES} ('forward': a "
                "separate no-grad value pass over every completion; 'auto': the first micro-batch's values "
                "from its training pass)."
            )
        if self.value_model_init not in VALUE_MODEL_INITS:
            problems.add(f"value_model_init={self.value_model_init!r}: expected one of {VALUE_MODEL_INITS}.")
        problems.raise_if_any()

    def check_deepspeed_config(self, ds_config: dict[str, Any]) -> None:
        """:meth:`OnPolicyConfig.check_deepspeed_config`, plus: an ``"optimizer"`` section (DeepSpeed's
        own optimizer, one learning rate for every parameter) would silently ignore
        ``critic_learning_rate``."""
        super().check_deepspeed_config(ds_config)
        if "optimizer" in ds_config and self.critic_learning_rate is not None:
            raise ValueError(
                f"critic_learning_rate={self.critic_learning_rate}, but the DeepSpeed config has an 'optimizer' "
                f"section ({ds_config['optimizer']!r}): DeepSpeed then builds that optimizer itself with one "
                "learning rate for every parameter, and the value model's would silently be learning_rate. "
                "Remove the 'optimizer' section (DeepSpeed then wraps the trainer's optimizer, which has the "
                "critic's parameter group), or set critic_learning_rate=None."
            )
