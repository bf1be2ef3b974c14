"""KL between the policy and the reference: per-token estimators and the adaptive/fixed controllers of
the penalty coefficient."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._common import _out_dtype, _work_dtype

__all__ = ["KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "kl_penalty"]

#: Valid ``estimator`` names of :func:`kl_penalty`.
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "low_var_kl")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probabilities.

    Estimators from Schulman, "Approximating KL divergence" (with ``d = logprobs - ref_logprobs``):

    * ``"k1"``: ``d`` -- unbiased, can be negative per token; what OpenAI adds to the rewards
      (LHPD, "Per-token KL penalty": ``kl = new_logprobs - logprobs``).
    * ``"k2"``: ``0.5 * d**2`` -- always >= 0, low variance, biased.
    * ``"k3"``: ``exp(-d) - 1 + d`` -- always >= 0 and unbiased.
    * ``"abs"``: ``|d|``.
    * ``"low_var_kl"``: k3 clamped to at most 10 per token (verl's name for it).

    Args:
        logprobs: (B, T) log-probabilities of the sampled tokens under the policy.
        ref_logprobs: (B, T) same tokens under the reference policy.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``, ``"low_var_kl"``.

    Returns:
        (B, T) in the promoted dtype of the inputs, computed in at least float32.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}.")
    out_dtype = torch.promote_types(_out_dtype(logprobs), _out_dtype(ref_logprobs))
    work_dtype = _work_dtype(logprobs, ref_logprobs)
    diff = logprobs.to(work_dtype) - ref_logprobs.to(work_dtype)
    if estimator == "k1":
        kl = diff
    elif estimator == "k2":
        kl = 0.5 * diff.square()
    elif estimator == "abs":
        kl = diff.abs()
    else:
        # exp(ref - logp) overflows when the policy puts far more mass on a token than the reference
        # (ref logprob -1e4 for a masked vocab entry, or -inf), giving inf -> NaN gradients.  Clamping
        # the log-ratio keeps it finite; 20 nats (ratio 5e8) is far past any meaningful KL (beyond it
        # the gradient is 0), and the bound is lowered for fp16 outputs so the cast back cannot
        # overflow either.
        bound = min(20.0, math.log(torch.finfo(out_dtype).max) - 1.0)
        log_ratio = (-diff).clamp(-bound, bound)
        # expm1, not exp(x) - 1: for |x| < ~1e-8 the latter is 0 - x, a NEGATIVE "KL" (cancellation);
        # the final clamp absorbs the last ulp of rounding so that k3 >= 0 holds exactly.
        kl = (torch.expm1(log_ratio) - log_ratio).clamp_min(0)
        if estimator == "low_var_kl":
            kl = kl.clamp_max(10.0)
    return kl.to(out_dtype)


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), exactly as lm-human-preferences writes it
    (LHPD, "Adaptive KL")::

        proportional_error = clip(current / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / horizon
        value *= mult

    LHPD's settings for the stylistic tasks are ``init_kl_coef=0.15, target=6, horizon=10000``.

    Args:
        init_kl_coef: starting coefficient beta (>= 0).
        target: the KL (nats per sequence) to steer towards (> 0).
        horizon: number of steps over which a 20 % error changes beta by 20 % (> 0).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        _check_kl_coef("init_kl_coef", init_kl_coef)
        _check_positive("target", target, "the KL value the controller steers towards, e.g. 6.0")
        _check_positive("horizon", horizon, "a number of steps, e.g. 10000")
        self.init_kl_coef = float(init_kl_coef)
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current: float, n_steps: int) -> None:
        """Move ``value`` towards keeping the measured KL ``current`` at ``target``.

        Args:
            current: the KL measured on the last batch (a float or a one-element tensor).
            n_steps: how many samples/steps that batch represents (LHPD passes the batch size).
        """
        current = float(current)
        # A NaN/inf KL would make value NaN forever (and every later reward with it); fail loudly.
        if not math.isfinite(current):
            raise ValueError(f"AdaptiveKLController.update got a non-finite KL value current={current!r}.")
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps!r}.")
        proportional_error = min(max(current / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        self.value *= mult

    def state_dict(self) -> dict[str, float]:
        """Everything needed to resume: the current coefficient and the hyperparameters."""
        return {
            "value": self.value,
            "init_kl_coef": self.init_kl_coef,
            "target": self.target,
            "horizon": self.horizon,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; keys that are absent keep their current values."""
        if "value" not in state:
            raise KeyError(f"KL controller state has no 'value' entry (keys: {sorted(state)}).")
        if "target" in state:
            _check_positive("target", state["target"], "a positive KL target")
            self.target = float(state["target"])
        if "horizon" in state:
            _check_positive("horizon", state["horizon"], "a positive number of steps")
            self.horizon = state["horizon"]
        if "init_kl_coef" in state:
            self.init_kl_coef = float(state["init_kl_coef"])
        _check_kl_coef("value", state["value"])
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value!r}, target={self.target!r}, horizon={self.horizon!r})"


class FixedKLController:
    """A constant KL coefficient with the :class:`AdaptiveKLController` interface (update is a no-op).

    Args:
        kl_coef: the coefficient beta (>= 0).
    """

    def __init__(self, kl_coef: float) -> None:
        _check_kl_coef("kl_coef", kl_coef)
        self.value = float(kl_coef)

    def update(self, current: float, n_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        """``{"value": kl_coef}``, the same key as :meth:`AdaptiveKLController.state_dict`."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient from a :meth:`state_dict`."""
        if "value" not in state:
            raise KeyError(f"KL controller state has no 'value' entry (keys: {sorted(state)}).")
        _check_kl_coef("value", state["value"])
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value!r})"


def _check_kl_coef(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value >= 0
        or not math.isfinite(value)
    ):
        raise ValueError(f"{name} must be a finite number >= 0 (a KL penalty coefficient), got {value!r}.")


def _check_positive(name: str, value: Any, expected: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or not math.isfinite(value)
    ):
        raise ValueError(f"{name} must be > 0 ({expected}), got {value!r}.")
