"""RLOOConfig: the on-policy fields plus what only RLOO has (k completions, leave-one-out baseline)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..config_problems import ConfigProblems
from ..onpolicy.config import OnPolicyConfig, named_as_given
from ..trl_compat import (
    TRLGenerationFields,
    fold_trust_remote_code,
    refuse_unsupported,
    resolve_min_p,
    resolve_steps_per_generation,
)


@dataclass
class RLOOConfig(TRLGenerationFields, OnPolicyConfig):
    """Configuration of :class:`~rlhf_trainers.RLOOTrainer`: every :class:`OnPolicyConfig` (and
    ``TrainingArguments``) field, plus the fields below. Defaults follow TRL 0.x's RLOOConfig and the RLOO
    blog (``rloo_k=2``, ``kl_coef=0.05``, ``num_ppo_epochs=4``, sequence-level KL).

    **Two step semantics** (``trl_semantics``). With the blog's / TRL 0.x's names a Trainer *step* is one
    update (a rollout, then ``num_ppo_epochs`` x ``num_mini_batches`` optimizer steps), as in
    :class:`OnPolicyConfig`. With TRL 1.x's names (``num_generations``, ``beta``, ``num_iterations``,
    ``steps_per_generation``, ...; or ``trl_semantics=True``) the config counts as TRL 1.x's RLOOTrainer
    does, which is GRPOConfig's way: a step is one optimizer step of ``gradient_accumulation_steps``
    micro-batches of ``per_device_train_batch_size`` completions; one generation is
    ``per_device_train_batch_size x steps_per_generation`` completions per process (``steps_per_generation``
    default ``gradient_accumulation_steps``), trained ``num_iterations`` times (default 1), i.e.
    ``num_iterations x steps_per_generation / gradient_accumulation_steps`` optimizer steps. So ``max_steps``,
    ``logging_steps``, ``save_steps``, ``eval_steps`` and the learning-rate schedule count optimizer steps,
    and a TRL 1.x script takes the same number of them here as in TRL.

    **TRL's other fields** (:mod:`rlhf_trainers.trl_compat`): every field of TRL 1.16's ``RLOOConfig`` is
    accepted; those not implemented here only at TRL's default. docs/coming-from-trl.md lists them.
    """

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
    num_iterations: int | None = field(
        default=None, metadata={"help": "TRL 1.x name of num_ppo_epochs (TRL's default with its names: 1)."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "TRL 1.x name of response_length."}
    )
    normalize_advantages: bool | None = field(
        default=None, metadata={"help": "TRL 1.x name of normalize_advantage."}
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "TRL 1.x: micro-batches per process produced by one generation (a multiple of "
            "gradient_accumulation_steps; sets num_mini_batches = steps_per_generation / "
            "gradient_accumulation_steps). None: num_mini_batches x gradient_accumulation_steps."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "TRL 1.x: completions per generation over all processes; sets steps_per_generation = "
            "generation_batch_size / (per_device_train_batch_size x processes). Give one of the two."
        },
    )
    reward_clip_range: list[float] | None = field(
        default=None,
        metadata={
            "help": "TRL 1.x: clip the scores to [low, high]; here a symmetric range [-c, c], which sets "
            "reward_clip=c."
        },
    )
    trl_semantics: bool | None = field(
        default=None,
        metadata={
            "help": "True: TRL 1.x's step semantics (a step is one optimizer step; num_iterations, default 1, "
            "passes per generation). False: TRL 0.x's and the RLOO blog's (a step is one update of "
            "num_ppo_epochs, default 4, epochs). None: True when a TRL 1.x name is given, else False."
        },
    )

    # ---- engine fields whose default depends on the step semantics --------------------------------
    num_ppo_epochs: int | None = field(  # type: ignore[assignment]
        default=None,
        metadata={
            "help": "Optimisation epochs over each rollout. None: num_iterations with TRL 1.x's semantics "
            "(default 1), else 4 (TRL 0.x, the RLOO blog)."
        },
    )

    def __post_init__(self) -> None:
        # Every check records its problems; one ConfigError lists them all at the end.
        problems = ConfigProblems(self)
        resolve_min_p(self)
        with problems.collect():
            refuse_unsupported(self)
        applied = False
        with problems.collect():
            self._apply_trl_names()
            applied = True
        if applied:  # the engine's fields are set: check them too (named by the TRL field they came from)
            aliases = {ours: trl for trl, ours in TRL_NAMES.items()}
            with problems.collect(reword=lambda err: named_as_given(err, self, aliases)):
                super().__post_init__()
            self._check_max_steps(problems)
        with problems.collect():
            fold_trust_remote_code(self)
        if isinstance(self.rloo_k, bool) or not isinstance(self.rloo_k, int) or self.rloo_k < 2:
            problems.add(
                f"rloo_k={self.rloo_k!r}: the leave-one-out baseline needs at least 2 completions per prompt; "
                "set rloo_k=2 or more."
            )
        if self.importance_sampling_level == "sequence" and not self.token_level_kl:
            problems.add(
                "importance_sampling_level='sequence' with token_level_kl=False: RLOO's sequence-level loss "
                "already uses the ratio of whole completions (of their summed log-probs). Set "
                "token_level_kl=True for GSPO's length-normalized sequence ratio per token."
            )
        if self.whiten_rewards and not self.token_level_kl:
            problems.add(
                "whiten_rewards=True whitens per-token rewards, which only the token-level reward uses "
                "(token_level_kl=True); the sequence-level reward would silently ignore it. Set "
                "token_level_kl=True, or use normalize_advantage=True to whiten the sequence advantages."
            )
        if self.truncated_is_cap is not None and not self.truncated_is_cap >= 1:
            problems.add(
                f"truncated_is_cap={self.truncated_is_cap}: expected a cap >= 1 (e.g. 2.0), or None."
            )
        if self.truncated_is_cap is not None and self.use_vllm:
            problems.add(
                "truncated_is_cap with use_vllm=True: with vLLM the importance-sampling correction is "
                "vllm_importance_sampling_correction / _mode / _cap (on by default); drop truncated_is_cap."
            )
        if self.truncated_is_cap is not None and self.rollout_logprobs == "generation":
            problems.add(
                "truncated_is_cap with rollout_logprobs='generation': the correction weighs the training "
                "forward pass's log-probs against the generation's, which would then be the same numbers "
                "(every weight 1). Use rollout_logprobs='forward' (or 'auto', which picks it here)."
            )
        problems.raise_if_any()

    def _apply_trl_names(self) -> None:
        """Set today's fields from the TRL 1.x names given, and resolve the step semantics. A field that
        differs from its default and from the TRL name's value is a conflict (a field left at its default
        cannot be told apart from one set to it, so only the TRL value counts then)."""
        given = [name for name in (*TRL_NAMES, *TRL_BATCH_NAMES) if getattr(self, name) is not None]
        if self.trl_semantics is None:
            self.trl_semantics = bool(given)
        if self.reward_clip_range is not None:
            self._apply_reward_clip_range()
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
        if not self.trl_semantics:
            batch = [name for name in ("steps_per_generation", "generation_batch_size") if name in given]
            if batch:
                raise ValueError(
                    f"{batch[0]}={getattr(self, batch[0])!r} with trl_semantics=False: TRL 1.x's batch names count "
                    "optimizer steps; set num_mini_batches instead, or trl_semantics=True (or leave it None)."
                )
            if self.num_ppo_epochs is None:
                self.num_ppo_epochs = 4
            return
        if self.num_ppo_epochs is None:
            self.num_ppo_epochs = 1  # TRL 1.x's num_iterations default
        self._apply_trl_batch()

    def _apply_reward_clip_range(self) -> None:
        """TRL 1.x's ``reward_clip_range=(low, high)``: a symmetric range sets ``reward_clip``."""
        clip_range = self.reward_clip_range
        if clip_range is None or len(clip_range) != 2 or not -clip_range[0] == clip_range[1] > 0:
            raise ValueError(
                f"reward_clip_range={clip_range!r}: only a symmetric range (-c, c) with c > 0 is supported "
                "(it sets reward_clip=c); use reward_clip, or reward_scaling to map scores onto a range."
            )
        if self.reward_clip is not None and self.reward_clip != clip_range[1]:
            raise ValueError(
                f"reward_clip_range={clip_range!r} and reward_clip={self.reward_clip} name the same setting; "
                "give one of them."
            )
        self.reward_clip = float(clip_range[1])

    def _apply_trl_batch(self) -> None:
        """TRL 1.x's batch: ``steps_per_generation`` (or ``generation_batch_size``) -> ``num_mini_batches``,
        and ``max_steps`` a whole number of generations."""
        accumulation = self.gradient_accumulation_steps
        steps = resolve_steps_per_generation(self, self.num_mini_batches * accumulation)
        if steps % accumulation:
            raise ValueError(
                f"steps_per_generation={steps} must be a multiple of gradient_accumulation_steps={accumulation}: "
                "each optimizer step takes gradient_accumulation_steps micro-batches of one generation."
            )
        if self.num_mini_batches not in (1, steps // accumulation):
            raise ValueError(
                f"num_mini_batches={self.num_mini_batches} conflicts with steps_per_generation={steps} (which "
                f"sets num_mini_batches={steps // accumulation} with gradient_accumulation_steps={accumulation}); "
                "give one of them."
            )
        self.num_mini_batches = steps // accumulation
        self.steps_per_generation = steps

    def _check_max_steps(self, problems: ConfigProblems) -> None:
        """With TRL 1.x's semantics a run ends after a whole generation: ``max_steps`` must be a multiple
        of its optimizer steps."""
        per_generation = self.optimizer_steps_per_generation
        if (
            self.trl_semantics
            and per_generation > 1
            and self.max_steps > 0
            and self.max_steps % per_generation
        ):
            problems.add(
                f"max_steps={self.max_steps}: with TRL 1.x's semantics a step is an optimizer step, one generation "
                f"here is {per_generation} of them (num_iterations={self.num_ppo_epochs} x steps_per_generation / "
                f"gradient_accumulation_steps = {self.num_mini_batches}) and a run ends after a whole generation; "
                f"use a multiple of {per_generation}."
            )

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps per generation (update): ``num_ppo_epochs x num_mini_batches``."""
        return (self.num_ppo_epochs or 1) * self.num_mini_batches

    @property
    def steps_per_update(self) -> int:
        """Trainer steps one update counts: its optimizer steps with TRL 1.x's semantics, else 1."""
        return self.optimizer_steps_per_generation if self.trl_semantics else 1


#: TRL 1.x's RLOOConfig names -> the fields they set (giving one switches to TRL's step semantics, which
#: are GRPOConfig's: see RLOOConfig's docstring).
TRL_NAMES = {
    "num_generations": "rloo_k",
    "beta": "kl_coef",
    "epsilon": "cliprange",
    "epsilon_high": "cliprange_high",
    "num_iterations": "num_ppo_epochs",
    "max_completion_length": "response_length",
    "normalize_advantages": "normalize_advantage",
}

#: TRL 1.x's batch names (no blog counterpart of their own; they set num_mini_batches).
TRL_BATCH_NAMES = ("steps_per_generation", "generation_batch_size", "reward_clip_range")
