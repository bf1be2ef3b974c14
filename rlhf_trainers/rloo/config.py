"""RLOOConfig: the on-policy fields plus what only RLOO has (k completions, leave-one-out baseline)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..onpolicy.config import OnPolicyConfig, named_as_given


@dataclass
class RLOOConfig(OnPolicyConfig):
    """Configuration of :class:`~rlhf_trainers.RLOOTrainer`: every :class:`OnPolicyConfig` (and
    ``TrainingArguments``) field, plus the fields below. Defaults follow TRL's RLOOConfig (``rloo_k=2``,
    ``kl_coef=0.05``, ``num_ppo_epochs=4``, sequence-level KL)."""

    rloo_k: int = field(
        default=2,
        metadata={
            "help": "Completions sampled per prompt (>= 2); each one's baseline is the mean reward of the other "
            "k - 1. The rollout size (per_device_train_batch_size x gradient_accumulation_steps x "
            "num_mini_batches) counts completions and must be a multiple of rloo_k."
        },
    )
    token_level_kl: bool = field(
        default=False,
        metadata={
            "help": "False (the RLOO blog): the whole completion is one action: reward = score - kl_coef * "
            "sum of the per-token KL, one advantage per sequence and a sequence-level ratio. True "
            "(REINFORCE++-style): the KL penalty stays per token, each token's advantage is its reward-to-go "
            "minus the leave-one-out baseline of the other completions' returns, and the ratio is per token."
        },
    )
    normalize_advantage: bool = field(
        default=False,
        metadata={"help": "Whiten the advantages over the rollout of all processes."},
    )
    truncated_is_cap: float | None = field(
        default=None,
        metadata={
            "help": "Truncated importance sampling (the RLOO blog's bf16 'dark side'): weight each sequence's "
            "loss by min(exp(sum of training log-probs - sum of generation log-probs), cap), correcting for "
            "the generation and training forward passes disagreeing. E.g. 2.0. None: off."
        },
    )

    # ---- TRL 1.x names (RLOOTrainer rewritten in GRPO's style); None: not given ------------------
    num_generations: int | None = field(
        default=None, metadata={"help": "TRL 1.x name of rloo_k (completions per prompt)."}
    )
    beta: float | None = field(
        default=None, metadata={"help": "TRL 1.x name of kl_coef (the KL penalty in the reward)."}
    )
    epsilon: float | None = field(default=None, metadata={"help": "TRL 1.x name of cliprange."})
    epsilon_high: float | None = field(default=None, metadata={"help": "TRL 1.x name of cliprange_high."})
    num_iterations: int | None = field(default=None, metadata={"help": "TRL 1.x name of num_ppo_epochs."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "TRL 1.x name of response_length."}
    )
    normalize_advantages: bool | None = field(
        default=None, metadata={"help": "TRL 1.x name of normalize_advantage."}
    )

    def __post_init__(self) -> None:
        self._apply_trl_names()
        try:
            super().__post_init__()
        except ValueError as err:  # a field set from a TRL 1.x name: name the TRL field
            raise named_as_given(err, self, {ours: trl for trl, ours in TRL_NAMES.items()}) from err
        if isinstance(self.rloo_k, bool) or not isinstance(self.rloo_k, int) or self.rloo_k < 2:
            raise ValueError(
                f"rloo_k={self.rloo_k!r}: the leave-one-out baseline needs at least 2 completions per prompt; "
                "set rloo_k=2 or more."
            )
        if self.importance_sampling_level == "sequence" and not self.token_level_kl:
            raise ValueError(
                "importance_sampling_level='sequence' with token_level_kl=False: RLOO's sequence-level loss "
                "already uses the ratio of whole completions (of their summed log-probs). Set "
                "token_level_kl=True for GSPO's length-normalized sequence ratio per token."
            )
        if self.whiten_rewards and not self.token_level_kl:
            raise ValueError(
                "whiten_rewards=True whitens per-token rewards, which only the token-level reward uses "
                "(token_level_kl=True); the sequence-level reward would silently ignore it. Set "
                "token_level_kl=True, or use normalize_advantage=True to whiten the sequence advantages."
            )
        if self.truncated_is_cap is not None and not self.truncated_is_cap >= 1:
            raise ValueError(
                f"truncated_is_cap={self.truncated_is_cap}: expected a cap >= 1 (e.g. 2.0), or None."
            )
        if self.truncated_is_cap is not None and self.use_vllm:
            raise ValueError(
                "truncated_is_cap with use_vllm=True: with vLLM the importance-sampling correction is "
                "vllm_importance_sampling_correction / _mode / _cap (on by default); drop truncated_is_cap."
            )
        if self.truncated_is_cap is not None and self.rollout_logprobs == "generation":
            raise ValueError(
                "truncated_is_cap with rollout_logprobs='generation': the correction weighs the training "
                "forward pass's log-probs against the generation's, which would then be the same numbers "
                "(every weight 1). Use rollout_logprobs='forward' (or 'auto', which picks it here)."
            )

    def _apply_trl_names(self) -> None:
        """Set today's fields from the TRL 1.x names given. A field that differs from its default and from
        the TRL name's value is a conflict (a field left at its default cannot be told apart from one set
        to it, so only the TRL value counts then)."""
        defaults = {f.name: f.default for f in fields(RLOOConfig)}
        for trl_name, ours in TRL_NAMES.items():
            value = getattr(self, trl_name)
            if value is None:
                continue
            current = getattr(self, ours)
            if current != defaults[ours] and current != value:
                raise ValueError(
                    f"{trl_name}={value!r} and {ours}={current!r} name the same setting (TRL 1.x's name and "
                    f"the RLOO blog's) with different values; give one of them."
                )
            setattr(self, ours, value)


#: TRL 1.x's RLOOConfig names -> the fields they set (TRL's batch semantics are GRPOConfig's; here a step
#: stays one update, as in TRL 0.x's RLOOTrainer and the RLOO blog).
TRL_NAMES = {
    "num_generations": "rloo_k",
    "beta": "kl_coef",
    "epsilon": "cliprange",
    "epsilon_high": "cliprange_high",
    "num_iterations": "num_ppo_epochs",
    "max_completion_length": "response_length",
    "normalize_advantages": "normalize_advantage",
}
