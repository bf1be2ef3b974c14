"""GRPOConfig: TRL's GRPOConfig names and batch semantics, mapped onto the on-policy engine's fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..config_problems import ConfigProblems
from ..functional import SCALE_REWARDS, get_advantage_estimator
from ..onpolicy.config import OnPolicyConfig, named_as_given
from ..trl_compat import (
    TRLGenerationFields,
    TRLGRPOFields,
    fold_trust_remote_code,
    refuse_unsupported,
    resolve_grpo_aliases,
    resolve_min_p,
    resolve_steps_per_generation,
)

#: ``loss_type`` -> the engine's ``loss_agg_mode``. Every mode's counts cover the whole optimizer step
#: (all micro-batches and processes), so none depends on how the batch is split; TRL's "bnpo" divides by
#: the tokens of each micro-batch instead, which here is the same as "dapo".
LOSS_TYPES = {
    "grpo": "seq-mean-token-mean",
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}

#: The built-in ``advantage_estimator`` values; more can be registered (``register_advantage_estimator``).
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")

#: TRL name -> the engine field it sets (both may be given only with the same value).
_ENGINE_NAMES = {
    "num_iterations": "num_ppo_epochs",
    "max_completion_length": "response_length",
    "epsilon": "cliprange",
    "epsilon_high": "cliprange_high",
    "beta": "kl_loss_coef",
}


@dataclass
class GRPOConfig(TRLGRPOFields, TRLGenerationFields, OnPolicyConfig):
    """Configuration of :class:`~rlhf_trainers.GRPOTrainer`, with TRL's ``GRPOConfig`` names, defaults
    and batch semantics.

    **Batches, as TRL counts them.** ``per_device_train_batch_size`` counts completions (one forward /
    backward); an optimizer step takes ``gradient_accumulation_steps`` of them per process; one generation
    produces ``steps_per_generation`` (default ``gradient_accumulation_steps``) micro-batches per process,
    i.e. ``generation_batch_size = per_device_train_batch_size x processes x steps_per_generation``
    completions of ``generation_batch_size / num_generations`` prompts, which are trained on for
    ``num_iterations`` passes. A Trainer *step* is one optimizer step, so ``max_steps``,
    ``logging_steps``, ``save_steps``, ``eval_steps`` and the learning-rate schedule count optimizer steps,
    and one generation is ``num_iterations x steps_per_generation / gradient_accumulation_steps`` of them
    (1 with the defaults). Logging, evaluation and checkpoints happen between generations: at the end of
    the generation in which their step falls (``max_steps`` must be a whole number of generations). The completions of a prompt stay on one process, so
    ``per_device_train_batch_size x steps_per_generation`` must be a multiple of ``num_generations``.

    **Mapping onto the engine** (the engine's names are set from TRL's; giving both with different values
    is an error): ``num_iterations`` -> ``num_ppo_epochs``, ``steps_per_generation /
    gradient_accumulation_steps`` -> ``num_mini_batches``, ``max_completion_length`` ->
    ``response_length``, ``epsilon`` / ``epsilon_high`` -> ``cliprange`` / ``cliprange_high``, ``beta`` ->
    ``kl_loss_coef`` (the KL is a loss term, k3 by default: ``kl_loss_estimator``), ``loss_type`` ->
    ``loss_agg_mode``. There is no KL in the reward (``kl_coef=0``), and with ``beta=0`` (the default)
    no reference model is built, loaded or run.

    **TRL's other fields** (:mod:`rlhf_trainers.trl_compat`): every field of TRL 1.16's ``GRPOConfig`` is
    accepted; those not implemented here only at TRL's default (another value is refused at construction,
    naming what to use). docs/coming-from-trl.md lists them.
    """

    # ---- TRL's GRPO fields -----------------------------------------------------------------------
    num_generations: int = field(
        default=8,
        metadata={"help": "Completions sampled per prompt (the group G of GRPO); >= 2."},
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches per process produced by one generation (a multiple of "
            "gradient_accumulation_steps: one optimizer step each per iteration). None: "
            "gradient_accumulation_steps, or from generation_batch_size."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generation over all processes (TRL's); sets steps_per_generation = "
            "generation_batch_size / (per_device_train_batch_size x processes). Give one of the two."
        },
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Passes over each generation batch (GRPO's mu; PPO's epochs)."},
    )
    max_completion_length: int = field(
        default=256, metadata={"help": "Maximum tokens per completion (the engine's response_length)."}
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Coefficient of KL(policy || reference) as a loss term (k3 per token; "
            "kl_loss_estimator). 0: no KL, and no reference model at all."
        },
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower (and upper) clip epsilon of the ratio."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clip epsilon (DAPO's clip-higher, e.g. 0.28). None: epsilon."}
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "'dapo' (token mean over the optimizer step's completions; TRL's default), 'grpo' (mean "
            "per completion, then over completions), 'dr_grpo' (sum per completion / max_completion_length, "
            "mean over completions) or 'bnpo' (TRL's per-micro-batch token mean; here over the optimizer "
            "step, the same as 'dapo'). Counts cover the whole optimizer step on every process."
        },
    )
    scale_rewards: str = field(  # also True / False, TRL's older booleans
        default="group",
        metadata={
            "help": "Divide the group-centred rewards by the std of the group ('group'), of the whole batch "
            "('batch') or not at all ('none'; Dr. GRPO). True / False (or 'true' / 'false') mean 'group' / "
            "'none' (TRL's older booleans)."
        },
    )

    advantage_estimator: str = field(
        default="grpo",
        metadata={
            "help": "How the advantages are computed (verl's adv_estimator names): 'grpo' (the group-relative "
            "reward, scale_rewards), 'rloo' (the reward minus the mean of the group's other completions), "
            "'reinforce_plus_plus' (per-token returns of the rewards, KL in the reward per token with "
            "kl_coef, whitened over the batch), 'reinforce_plus_plus_baseline' (the reward minus its group's "
            "mean, whitened over the batch's tokens), or a name registered with register_advantage_estimator."
        },
    )

    # ---- engine fields set from TRL's (None: derived) --------------------------------------------
    num_ppo_epochs: int | None = field(  # type: ignore[assignment]
        default=None, metadata={"help": "Set from num_iterations; leave unset."}
    )
    num_mini_batches: int | None = field(  # type: ignore[assignment]
        default=None,
        metadata={"help": "Set from steps_per_generation / gradient_accumulation_steps; leave unset."},
    )
    response_length: int | None = field(  # type: ignore[assignment]
        default=None, metadata={"help": "Set from max_completion_length; leave unset."}
    )
    cliprange: float | None = field(  # type: ignore[assignment]
        default=None, metadata={"help": "Set from epsilon; leave unset."}
    )
    kl_loss_coef: float | None = field(  # type: ignore[assignment]
        default=None, metadata={"help": "Set from beta; leave unset."}
    )
    loss_agg_mode: str | None = field(  # type: ignore[assignment]
        default=None, metadata={"help": "Set from loss_type; leave unset."}
    )

    # ---- engine defaults that differ (TRL's GRPO defaults) ---------------------------------------
    kl_coef: float = field(
        default=0.0, metadata={"help": "KL penalty in the reward; GRPO has none (it uses beta)."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (TRL's GRPO: 1.0)."})
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "None (the default): prompts are kept whole, as TRL 1.16 keeps them (it has no such field). "
            "An int truncates longer prompts from the left (keeping a leading BOS), which bounds memory but "
            "cuts a tool run's system turn, where the tools are described."
        },
    )
    learning_rate: float = field(default=1e-6, metadata={"help": "Learning rate (TRL's GRPO: 1e-6)."})
    logging_steps: float = field(
        default=10, metadata={"help": "Log every X optimizer steps (ratio of the run if < 1)."}
    )
    save_steps: float = field(default=500, metadata={"help": "Save a checkpoint every X optimizer steps."})

    def __post_init__(self) -> None:
        # Every check records its problems; one ConfigError lists them all at the end.
        problems = ConfigProblems(self)
        resolve_min_p(self)
        with problems.collect():
            refuse_unsupported(self)
        with problems.collect():
            resolve_grpo_aliases(self)
        if self.num_generations == 1:  # other bad values: _map_trl_names
            problems.add(
                f"num_generations={self.num_generations}: GRPO's baseline is the mean of a prompt's group, "
                "so a group needs at least 2 completions; set num_generations=2 or more."
            )
        if self._map_trl_names(problems):  # the engine's fields are set: check them too
            # An engine field set from a TRL name is named by the TRL field.
            aliases = {ours: trl for trl, ours in _ENGINE_NAMES.items()}
            with problems.collect(reword=lambda err: named_as_given(err, self, aliases)):
                super().__post_init__()
            self._check_max_steps(problems)
        with problems.collect():
            fold_trust_remote_code(self)
        problems.raise_if_any()

    def _map_trl_names(self, problems: ConfigProblems) -> bool:
        """Check TRL's fields and set the engine's from them; False (problems recorded) when they cannot
        be set."""
        found = len(problems.problems)
        for name in (
            "num_generations",
            "num_iterations",
            "max_completion_length",
            "gradient_accumulation_steps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.add(f"{name}={value!r}: expected an integer >= 1.")
        with problems.collect():
            get_advantage_estimator(self.advantage_estimator)  # a ValueError naming the registered ones
        if self.advantage_estimator == "gae":
            problems.add(
                "advantage_estimator='gae' needs a value model, which GRPO has none of; use PPOTrainer for GAE."
            )
        if self.loss_type not in LOSS_TYPES and not problems.mentions("loss_type"):
            problems.add(f"loss_type={self.loss_type!r}: expected one of {tuple(LOSS_TYPES)}.")
        if self.scale_rewards is True or self.scale_rewards == "true":
            self.scale_rewards = "group"
        elif self.scale_rewards is False or self.scale_rewards == "false":
            self.scale_rewards = "none"
        if self.scale_rewards not in SCALE_REWARDS:
            problems.add(
                f"scale_rewards={self.scale_rewards!r}: expected one of {SCALE_REWARDS} (or True / False)."
            )
        if len(problems.problems) > found or self.loss_type not in LOSS_TYPES:
            return False
        accumulation = self.gradient_accumulation_steps
        try:
            steps = self._steps_per_generation()
        except ValueError as err:
            problems.add(str(err))
            return False
        if steps % accumulation:
            problems.add(
                f"steps_per_generation={steps} must be a multiple of gradient_accumulation_steps={accumulation}: "
                "each optimizer step takes gradient_accumulation_steps micro-batches of one generation."
            )
            return False
        self.steps_per_generation = steps
        derived: dict[str, Any] = {
            "num_ppo_epochs": self.num_iterations,
            "num_mini_batches": steps // accumulation,
            "response_length": self.max_completion_length,
            "cliprange": self.epsilon,
            "kl_loss_coef": self.beta,
            "loss_agg_mode": LOSS_TYPES[self.loss_type],
        }
        trl_name = {v: k for k, v in _ENGINE_NAMES.items()}
        trl_name.update(num_mini_batches="steps_per_generation", loss_agg_mode="loss_type")
        for engine, value in derived.items():
            given = getattr(self, engine)
            if given is not None and given != value:
                problems.add(
                    f"{engine}={given!r} conflicts with {trl_name[engine]}={getattr(self, trl_name[engine])!r} "
                    f"(which sets {engine}={value!r}); GRPOConfig takes TRL's names: set "
                    f"{trl_name[engine]} only."
                )
            setattr(self, engine, value)
        if self.epsilon_high is not None:
            if self.cliprange_high is not None and self.cliprange_high != self.epsilon_high:
                problems.add(
                    f"cliprange_high={self.cliprange_high!r} conflicts with epsilon_high={self.epsilon_high!r}; "
                    "set epsilon_high only."
                )
            self.cliprange_high = self.epsilon_high
        return len(problems.problems) == found

    def _check_max_steps(self, problems: ConfigProblems) -> None:
        """A run ends after a whole generation: ``max_steps`` must be a multiple of its optimizer steps."""
        steps_per_update = self.optimizer_steps_per_generation
        steps = self.steps_per_generation
        accumulation = self.gradient_accumulation_steps
        if steps_per_update > 1 and self.max_steps > 0 and self.max_steps % steps_per_update:
            problems.add(
                f"max_steps={self.max_steps}: one generation here is {steps_per_update} optimizer steps "
                f"(num_iterations={self.num_iterations} x steps_per_generation / gradient_accumulation_steps = "
                f"{steps // accumulation}) and a run ends after a whole generation; use a multiple of "
                f"{steps_per_update}."
            )

    def _steps_per_generation(self) -> int:
        """steps_per_generation, from itself, generation_batch_size or gradient_accumulation_steps."""
        return resolve_steps_per_generation(self, self.gradient_accumulation_steps)

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps (Trainer steps) per generation: ``num_iterations x steps_per_generation /
        gradient_accumulation_steps``."""
        return self.num_iterations * math.ceil(
            (self.steps_per_generation or self.gradient_accumulation_steps) / self.gradient_accumulation_steps
        )
