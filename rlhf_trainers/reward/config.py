"""RewardConfig: the TrainingArguments of reward modeling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..config_problems import ConfigProblems, check_optimizer_fields, parse_json_field
from ..reliability import ReliabilityArguments
from ..trl_compat import TRLRewardFields, fold_trust_remote_code, refuse_unsupported

LONG_PAIRS = ("truncate", "drop")
NORMALIZATION_WHEN = ("no", "before", "after", "before_and_after")


@dataclass
class RewardConfig(TRLRewardFields, ReliabilityArguments, TrainingArguments):
    """Configuration of :class:`~rlhf_trainers.RewardTrainer`: every ``TrainingArguments`` field, plus
    the fields below. Defaults that differ from ``TrainingArguments``: ``num_train_epochs=1`` (as
    in the reference implementation), ``ddp_find_unused_parameters=False``, ``logging_steps=10`` and
    ``remove_unused_columns=False`` (the trainer prepares its own columns).

    The learning rate stays ``TrainingArguments``' 5e-5 and the schedule linear to zero, as the
    reference implementation trains its reward model (one epoch, learning rate annealed to zero).

    Every field of TRL 1.16's ``RewardConfig`` is accepted; those not implemented here only at TRL's default
    (:mod:`rlhf_trainers.trl_compat`; docs/coming-from-trl.md lists them).
    """

    max_length: int | None = field(
        default=1024,
        metadata={"help": "Maximum tokens of prompt + response per side of a pair; None disables the limit."},
    )
    long_pairs: str = field(
        default="truncate",
        metadata={
            "help": "What to do with a pair longer than max_length: 'truncate' drops tokens from the start "
            "(keeping the end of the response, where the reward is read) or 'drop' removes the pair. The "
            "count is logged and kept in trainer.preprocessing_stats."
        },
    )
    add_eos: bool = field(
        default=True,
        metadata={
            "help": "Append the EOS token to text that does not end with it, so the reward is read at the "
            "same token as on PPO/RLOO rollouts (which end with EOS)."
        },
    )
    center_rewards_coefficient: float | None = field(
        default=None,
        metadata={
            "help": "Weight of an extra loss term mean((r_chosen + r_rejected)^2) that pulls rewards towards "
            "zero mean (Eisenstein et al., 2023); e.g. 0.01. None disables it."
        },
    )
    init_reward_head: bool = field(
        default=True,
        metadata={
            "help": "Initialise a freshly created scalar head with weight ~ N(0, 1/sqrt(d_model + 1)) and bias 0 "
            "(the reference implementation's reward head). A head loaded from a checkpoint is never re-initialised."
        },
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Set every dropout probability to 0."})
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Run the training and evaluation passes on the real tokens of each batch only (packed, "
            "positions restarting per sequence), each reward read at its sequence's last token: the padded "
            "results up to float rounding. Used when the model passes a probe at construction and has a "
            "per-token linear score head; other models and ZeRO-3 stay padded (logged). False: padded."
        },
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes for tokenizing the datasets (datasets.map num_proc)."}
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for from_pretrained when `model` is a path or Hub id, e.g. "
            '\'{"dtype": "bfloat16"}\' (a JSON string on the command line).'
        },
    )
    reward_normalization: str = field(
        default="no",
        metadata={
            "help": "When to compute the reward normalization: 'no', 'before', 'after' or 'before_and_after' "
            "training. It samples the reference policy (normalization_policy=) on prompts "
            "(normalization_prompts=) and sets a gain and bias that give their rewards mean "
            "normalization_target_mean and std normalization_target_std, stored in the model config and "
            "reward_normalization.json and applied by the on-policy trainers."
        },
    )
    normalization_num_samples: int = field(
        default=1024,
        metadata={"help": "Completions sampled (over all processes) to compute the normalization."},
    )
    normalization_response_length: int = field(
        default=53,
        metadata={
            "help": "Maximum new tokens per sampled completion (the reference implementation uses 24 or 53)."
        },
    )
    normalization_temperature: float = field(
        default=1.0,
        metadata={"help": "Sampling temperature for the normalization samples (top-k 0, top-p 1)."},
    )
    normalization_batch_size: int = field(
        default=64,
        metadata={"help": "Prompts per generation / scoring batch during normalization, per process."},
    )
    normalization_target_mean: float = field(
        default=0.0, metadata={"help": "Target mean of normalized rewards."}
    )
    normalization_target_std: float = field(
        default=1.0, metadata={"help": "Target std of normalized rewards."}
    )

    num_train_epochs: float = field(
        default=1.0,
        metadata={
            "help": "Epochs over the pairs (the reference implementation trains its reward model for one)."
        },
    )
    logging_steps: float = field(default=10, metadata={"help": "Log every X updates steps (ratio if < 1)."})
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={
            "help": "DDP's find_unused_parameters. False: every parameter of a reward model takes part in the "
            "loss, and the search costs an extra graph traversal per step. Set True for a model that has "
            "parameters its sequence-classification forward does not use."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Kept False: the trainer tokenizes the pairs itself and needs its own columns."},
    )

    def __post_init__(self) -> None:
        # Every check records its problems; one ConfigError lists them all at the end.
        problems = ConfigProblems(self)
        if isinstance(self.model_init_kwargs, str):
            text, self.model_init_kwargs = self.model_init_kwargs, None  # stays None if not valid JSON
            with problems.collect():
                self.model_init_kwargs = parse_json_field("model_init_kwargs", text)
        with problems.collect():
            refuse_unsupported(self)
        with problems.collect():
            super().__post_init__()
        with problems.collect():
            fold_trust_remote_code(self)
        with problems.collect():
            self._check_reliability_fields()
        check_optimizer_fields(self, problems)
        if self.long_pairs not in LONG_PAIRS:
            problems.add(f"long_pairs={self.long_pairs!r}: expected one of {LONG_PAIRS}.")
        if self.max_length is not None and self.max_length < 2:
            problems.add(f"max_length={self.max_length}: must be >= 2 (or None for no limit).")
        if self.reward_normalization not in NORMALIZATION_WHEN:
            problems.add(
                f"reward_normalization={self.reward_normalization!r}: expected one of {NORMALIZATION_WHEN}."
            )
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            problems.add(
                f"center_rewards_coefficient={self.center_rewards_coefficient}: must be >= 0 or None."
            )
        for name in (
            "normalization_num_samples",
            "normalization_response_length",
            "normalization_batch_size",
        ):
            if getattr(self, name) < 1:
                problems.add(f"{name}={getattr(self, name)}: must be >= 1.")
        if not self.normalization_target_std > 0:
            problems.add(f"normalization_target_std={self.normalization_target_std}: must be > 0.")
        if not self.normalization_temperature > 0:
            problems.add(f"normalization_temperature={self.normalization_temperature}: must be > 0.")
        problems.raise_if_any()
