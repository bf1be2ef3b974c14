"""Advantage estimators and policy losses registered by name (the model is verl's ``core_algos.py``).

A new estimator or policy loss is one decorated function; the configs select it by name
(``GRPOConfig.advantage_estimator``, ``OnPolicyConfig.policy_loss``), and the names are checked at
construction against what is registered then. A sketch::

    from rlhf_trainers.functional import register_advantage_estimator

    @register_advantage_estimator("median_baseline")
    def median_baseline(inputs):
        grouped = inputs.sequence_rewards.reshape(inputs.group_size, -1)
        return (grouped - grouped.median(0).values).reshape(-1, 1), None

    GRPOConfig(..., advantage_estimator="median_baseline")

Rows follow the engine's layout: completion j of prompt i at row ``j * B + i`` (so
``reshape(group_size, -1)`` puts a prompt's completions in one column).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .advantages import gae_advantages, group_advantages, reinforce_plus_plus_advantages, rloo_advantages
from .losses import clipped_policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "get_advantage_estimator",
    "get_policy_loss",
    "register_advantage_estimator",
    "register_policy_loss",
]


@dataclass
class AdvantageInputs:
    """What an advantage estimator may read about one update's rollout (this process's rows)."""

    token_rewards: Tensor
    """(N, R) per-token rewards: ``-kl_coef * KL`` at every response token, the shaped score added at the
    last one (LHPD's layout; whitened with ``whiten_rewards``)."""
    sequence_rewards: Tensor
    """(N,) the shaped score minus ``kl_coef`` x the sequence's summed KL (RLOO's and GRPO's reward)."""
    response_mask: Tensor
    """(N, R) bool, the response tokens in the update."""
    valid: Tensor
    """(N,) bool, rows with a finite reward; an estimator gives the others 0 and leaves them out of every
    baseline."""
    group_size: int
    """Completions per prompt (k)."""
    config: Any
    """The trainer's config (``gamma``, ``lam``, ``scale_rewards``, ...)."""
    values: Tensor | None = None
    """(N, R) float32 value estimates V(s_t) (PPO); None without a value model."""
    all_reduce: Callable[[Tensor], Tensor | None] | None = None
    """Sum over processes (None, or the identity, on one process), for batch statistics."""


#: An estimator returns ``(advantages, returns)``: advantages (N, R) per token or (N, 1) per sequence,
#: 0 where masked; returns (N, R) value targets, or None when there is no critic.
AdvantageEstimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]

#: A policy loss takes ``(logprobs, old_logprobs, advantages, mask, config, **aggregation)`` with the
#: keywords of :func:`~rlhf_trainers.functional.clipped_policy_loss` (``importance_weights``,
#: ``extra_loss``, ``loss_agg_mode``, ``denominator``, ``max_length``) and returns ``(loss, metrics)`` with
#: at least the metrics ``approxkl``, ``clipfrac``, ``dual_clipfrac``, ``ratio_mean``, ``ratio_var``.
PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def _register(table: dict[str, Any], kind: str, name: str) -> Callable[[Any], Any]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {kind} needs a non-empty name, got {name!r}.")

    def decorator(fn: Any) -> Any:
        if name in table and table[name] is not fn:
            raise ValueError(
                f"{kind} {name!r} is already registered ({table[name].__qualname__}); pick another name."
            )
        table[name] = fn
        return fn

    return decorator


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register ``fn(inputs: AdvantageInputs) -> (advantages, returns)`` under ``name``."""
    return _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a policy loss (see :data:`PolicyLoss`) under ``name``."""
    return _register(POLICY_LOSSES, "policy loss", name)


def _lookup(table: dict[str, Any], kind: str, name: str, field: str) -> Any:
    if name not in table:
        raise ValueError(
            f"{field}={name!r}: no {kind} of that name; registered: {sorted(table)}. Register yours with "
            f"@register_{kind.replace(' ', '_')}({name!r}) (rlhf_trainers.functional) before building the config."
        )
    return table[name]


def get_advantage_estimator(name: str, field: str = "advantage_estimator") -> AdvantageEstimator:
    """The estimator registered as ``name``; a ValueError naming the registered ones otherwise."""
    return _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name, field)


def get_policy_loss(name: str, field: str = "policy_loss") -> PolicyLoss:
    """The policy loss registered as ``name``; a ValueError naming the registered ones otherwise."""
    return _lookup(POLICY_LOSSES, "policy loss", name, field)


# ---- the built-in estimators -----------------------------------------------------------------------


@register_advantage_estimator("gae")
def _gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """PPO's GAE over the value estimates (``gamma``, ``lam``, ``lam_value``, length-adaptive lam)."""
    if inputs.values is None:
        raise ValueError("advantage_estimator='gae' needs a value model (PPO).")
    c = inputs.config
    return gae_advantages(
        inputs.token_rewards,
        inputs.values,
        inputs.response_mask,
        gamma=c.gamma,
        lam=c.lam,
        lam_value=c.lam_value,
        length_adaptive_alpha=c.length_adaptive_alpha,
    )


@register_advantage_estimator("grpo")
def _grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """Group-relative: the sequence reward minus its group's mean, scaled per ``scale_rewards``."""
    advantages = group_advantages(
        inputs.sequence_rewards,
        inputs.group_size,
        inputs.config.scale_rewards,
        valid=inputs.valid,
        all_reduce=inputs.all_reduce,
    )
    return advantages[:, None], None


@register_advantage_estimator("rloo")
def _rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """Leave-one-out: the sequence reward minus the mean of the other completions of its prompt."""
    return rloo_advantages(inputs.sequence_rewards, inputs.group_size, valid=inputs.valid)[:, None], None


@register_advantage_estimator("reinforce_plus_plus")
def _reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """REINFORCE++: per-token returns of the per-token rewards, whitened over the batch."""
    return (
        reinforce_plus_plus_advantages(
            inputs.token_rewards, inputs.response_mask, valid=inputs.valid, all_reduce=inputs.all_reduce
        ),
        None,
    )


@register_advantage_estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    """REINFORCE++ with its group's mean reward as the baseline."""
    return (
        reinforce_plus_plus_advantages(
            inputs.token_rewards,
            inputs.response_mask,
            k=inputs.group_size,
            valid=inputs.valid,
            all_reduce=inputs.all_reduce,
        ),
        None,
    )


# ---- the built-in policy loss ----------------------------------------------------------------------


@register_policy_loss("vanilla")
def _vanilla(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, config: Any, **aggregation: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (``cliprange``, ``cliprange_high``, ``dual_clip``): verl's "vanilla"."""
    return clipped_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=config.cliprange,
        clip_high=config.cliprange_high,
        dual_clip=config.dual_clip,
        **aggregation,
    )
