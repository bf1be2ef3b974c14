"""Reward math applied to scores: NeMo RL's range scaling, DAPO's overlong penalty, and the gain and
bias of reward-model normalization (LHPD)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._common import _AllReduce, _check_dim_int, _out_dtype, _work_dtype
from .stats import _global_moments, _moments, _var_from_moments

__all__ = ["normalize_rewards_gain_bias", "overlong_penalty", "scale_rewards"]


def scale_rewards(
    scores: Tensor, source_min: float, source_max: float, target_min: float, target_max: float
) -> Tensor:
    """NeMo RL ``reward_scaling``: clamp to [source_min, source_max], then map linearly onto
    [target_min, target_max] (the guide's example maps [0, 1] onto [-1, 1]).

    Args:
        scores: any shape.
        source_min, source_max: the expected range of the raw scores (source_max > source_min).
        target_min, target_max: the range to map onto (target_max >= target_min).

    Returns:
        Same shape, in ``scores``' floating dtype (float32 for integer scores).
    """
    if not source_max > source_min:
        raise ValueError(
            f"source_max must be > source_min, got source_min={source_min!r}, source_max={source_max!r}."
        )
    if not target_max >= target_min:
        raise ValueError(
            f"target_max must be >= target_min, got target_min={target_min!r}, target_max={target_max!r}."
        )
    work_dtype = _work_dtype(scores)
    clamped = scores.to(work_dtype).clamp(source_min, source_max)
    scaled = target_min + (clamped - source_min) * ((target_max - target_min) / (source_max - source_min))
    return scaled.to(_out_dtype(scores))


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer_length: int, penalty: float
) -> Tensor:
    """DAPO / NeMo RL overlong reward shaping (``reward_shaping.overlong_buffer_*``).

    With ``expected = max_response_length - buffer_length``: 0 for ``length <= expected``, then a
    linear ramp ``-penalty * (length - expected) / buffer_length`` that reaches ``-penalty`` at
    ``max_response_length`` and stays there beyond it.

    Args:
        response_lengths: (B,) number of response tokens.
        max_response_length: the generation limit (> 0).
        buffer_length: width of the ramp, 0 < buffer_length <= max_response_length.
        penalty: the largest penalty (>= 0; the guide's ``overlong_buffer_penalty: 1``).

    Returns:
        (B,) float32 (float64 for float64 lengths) rewards <= 0, to be added to the scores.
    """
    _check_dim_int("max_response_length", max_response_length, 1)
    _check_dim_int("buffer_length", buffer_length, 1)
    if buffer_length > max_response_length:
        raise ValueError(
            f"buffer_length ({buffer_length}) must be <= max_response_length ({max_response_length})."
        )
    if not penalty >= 0:
        raise ValueError(f"penalty must be >= 0 (it is subtracted), got {penalty!r}.")
    work_dtype = _work_dtype(response_lengths)
    expected = max_response_length - buffer_length
    excess = (response_lengths.to(work_dtype) - expected).clamp_min(0)
    return (-penalty * excess / buffer_length).clamp_min(-penalty)


def normalize_rewards_gain_bias(
    scores: Tensor,
    target_mean: float = 0.0,
    target_std: float = 1.0,
    *,
    all_reduce: _AllReduce | None = None,
) -> tuple[float, float]:
    """Gain and bias that give the reward model the target mean and std on ``scores``.

    LHPD, "Reward model normalization before and after": from
    ``g * N(mu_D, sigma_D) + b = N(mu_T, sigma_T)`` follow ``g = sigma_T / sigma_D`` and
    ``b = mu_T - g * mu_D``; then ``reward = reward * g + b``.

    Args:
        scores: raw scores of responses sampled from the reference policy, any shape.
        target_mean: mu_T (0 in LHPD).
        target_std: sigma_T (1 in LHPD), > 0.
        all_reduce: sum-across-processes function, to use the scores of all ranks.

    Returns:
        ``(gain, bias)`` as Python floats.  sigma_D is the empirical (biased, population) std, so
        ``scores * gain + bias`` has exactly mean ``target_mean`` and biased std ``target_std``.

    Raises:
        ValueError: if there are no scores or they are all equal (sigma_D = 0: no gain can fix that).
    """
    if not target_std > 0:
        raise ValueError(f"target_std must be > 0, got {target_std!r}.")
    valid = torch.ones_like(scores, dtype=torch.bool)
    if all_reduce is None:
        total, total_sq, count = _moments(scores, valid, None, False, torch.float64).unbind(0)
    else:
        total, total_sq, count = _global_moments(scores, valid, None, False, all_reduce)
    n_scores = float(count)
    if n_scores == 0:
        raise ValueError("normalize_rewards_gain_bias got no scores; sample some responses first.")
    mean = float(total) / n_scores
    std = math.sqrt(float(_var_from_moments(total, total_sq, count, unbiased=False)))
    if not std > 1e-12 * max(1.0, abs(mean)) or not math.isfinite(std):
        raise ValueError(
            f"the {int(n_scores)} scores have std {std!r} (mean {mean!r}): all equal, so no gain can give them "
            f"std {target_std}; sample more varied responses or check the reward model."
        )
    gain = target_std / std
    return gain, target_mean - gain * mean
