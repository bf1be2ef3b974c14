"""Losses: PPO's clipped policy loss (asymmetric and dual clip, importance weights) and clipped value
loss, with their aggregation over tokens and sequences."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._common import _valid, _work_dtype, _zero_invalid
from .stats import masked_mean, masked_var

__all__ = [
    "IMPORTANCE_SAMPLING_MODES",
    "LOSS_AGG_MODES",
    "clipped_policy_loss",
    "clipped_value_loss",
    "truncated_importance_weights",
]

#: Valid ``loss_agg_mode`` names of :func:`clipped_policy_loss` / :func:`clipped_value_loss`.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

#: Valid ``mode`` names of :func:`truncated_importance_weights`.
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def truncated_importance_weights(
    logprobs: Tensor, sampling_logprobs: Tensor, mask: Tensor, cap: float, mode: str
) -> Tensor:
    """Bounded importance weights ``pi(y) / q(y)`` between the distribution being trained (``logprobs``, the
    trainer's forward pass) and the one the tokens were sampled from (``sampling_logprobs``, e.g. vLLM's),
    truncated importance sampling (TIS) for the mismatch between a generation engine and the trainer.

    Token modes use the per-token ratio ``r_t = exp(logprobs_t - sampling_logprobs_t)``; sequence modes
    use the sequence ratio ``exp(sum_t (logprobs_t - sampling_logprobs_t))`` over the valid tokens (the
    product of the token ratios). ``*_truncate`` bounds a ratio by ``min(r, cap)``; ``*_mask`` keeps it
    where ``r <= cap`` and sets it to 0 above (the token or sequence drops out of the loss).

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the trained policy.
        sampling_logprobs: (B, T) their log-probs under the sampling distribution.
        mask: (B, T) valid tokens.
        cap: the bound C (> 0).
        mode: one of :data:`IMPORTANCE_SAMPLING_MODES`.

    Returns:
        Detached float32 weights: (B, T) for token modes (0 at invalid tokens), (B, 1) for sequence modes.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(
            f"unknown importance sampling mode {mode!r}; expected one of {IMPORTANCE_SAMPLING_MODES}."
        )
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}.")
    valid = _valid(mask, logprobs)
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs.detach().float() - sampling_logprobs.detach().float(), zero)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    ratio = log_ratio.exp()
    if mode.endswith("truncate"):
        weights = ratio.clamp(max=cap)
    else:
        weights = torch.where(ratio <= cap, ratio, zero)
    if mode.startswith("token"):
        weights = torch.where(valid, weights, zero)
    return weights


def _aggregate(
    per_token: Tensor,
    valid: Tensor,
    mode: str,
    denominator: float | Tensor | None,
    max_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss with ``loss_agg_mode``; invalid tokens must already be 0."""
    if mode == "token-mean":
        count = valid.sum() if denominator is None else torch.as_tensor(denominator, device=per_token.device)
        return per_token.sum() / count.to(per_token.dtype).clamp_min(1)
    if per_token.dim() < 1:
        raise ValueError(f"loss_agg_mode={mode!r} needs (B, T) inputs, got a scalar.")
    n_tokens = valid.sum(dim=-1).to(per_token.dtype)
    seq = per_token.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq = seq / n_tokens.clamp_min(1)
    elif mode == "seq-mean-token-sum-norm":
        seq = seq / float(per_token.shape[-1] if max_length is None else max_length)
    # Sequences without a valid token (fully masked / filtered rows) do not dilute the mean.
    has_tokens = n_tokens > 0
    n_seq = has_tokens.sum() if denominator is None else torch.as_tensor(denominator, device=seq.device)
    return torch.where(has_tokens, seq, torch.zeros_like(seq)).sum() / n_seq.to(seq.dtype).clamp_min(1)


def _check_agg_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}.")


def _masked_extreme(values: Tensor, valid: Tensor, largest: bool) -> Tensor:
    fill = -math.inf if largest else math.inf
    # one sentinel entry so that empty tensors reduce too (amax of a 0-element tensor raises)
    flat = torch.cat([torch.where(valid, values, fill).flatten(), values.new_full((1,), fill)])
    return flat.amax() if largest else flat.amin()


def _frac(flags: Tensor, valid: Tensor) -> Tensor:
    return (flags & valid).sum().float() / valid.sum().float().clamp_min(1)


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    *,
    loss_agg_mode: str = "token-mean",
    importance_weights: Tensor | None = None,
    denominator: float | Tensor | None = None,
    max_length: int | None = None,
    extra_loss: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss (negated objective, to minimise).

    ``ratio = exp(logprobs - old_logprobs)``; per token ``max(-A * ratio, -A * clip(ratio, 1 - clip_low,
    1 + clip_high))`` (asymmetric clip: DAPO / NeMo ``ratio_clip_min``/``ratio_clip_max``).  With
    ``dual_clip = c > 1`` (Ye et al. 2020, NeMo ``ratio_clip_c``), tokens with ``A < 0`` are further
    capped at ``-A * c`` so a huge ratio on a bad token cannot produce an unbounded loss.  At ratio 1 the
    gradient equals REINFORCE's (RLOO blog: PPO's loss contains the log-prob implicitly).

    Args:
        logprobs: (B, T) log-probs under the current policy (the only input that receives gradients).
        old_logprobs: (B, T) log-probs at rollout time (detached).
        advantages: (B, T), or broadcastable to it, e.g. (B, 1) for sequence-level RLOO (detached).
        mask: (B, T) nonzero = token in the loss; other tokens contribute nothing, whatever their values.
        clip_low: epsilon below 1, in (0, 1).
        clip_high: epsilon above 1 (> 0); None = ``clip_low``.
        dual_clip: c > 1 or None (off).
        loss_agg_mode: ``"token-mean"`` (mean over all valid tokens of the batch; DAPO's token-level
            normalization, TRL's ``loss_type="dapo"``), ``"seq-mean-token-mean"`` (mean per sequence,
            then over sequences with >= 1 valid token; GRPO's), ``"seq-mean-token-sum"`` (sum per
            sequence, then mean over sequences with >= 1 valid token) or ``"seq-mean-token-sum-norm"``
            (sum per sequence divided by the constant ``max_length``, then the mean over sequences:
            Dr. GRPO's length-unbiased normalization).
        importance_weights: (B, T) per-token multipliers of the loss, detached -- e.g. a truncated
            importance-sampling correction for the generation/training log-prob mismatch.
        denominator: divide by this instead of the local token count ("token-mean") or sequence count
            (seq modes), e.g. the count over all micro-batches of a gradient-accumulation step.
        max_length: the constant of ``"seq-mean-token-sum-norm"`` (the generation's maximum response
            length); None: ``T``.
        extra_loss: (B, T) a per-token term added to the clipped loss after the importance weights and
            before the aggregation, e.g. ``beta * KL(policy || reference)`` as a loss (GRPO's ``beta``).

    Returns:
        ``(loss, metrics)``: a scalar in at least float32; metrics of detached float32 scalars over the
        valid tokens: ``clipfrac``, ``dual_clipfrac``, ``approxkl`` (``0.5 * mean(d^2)``, TRL's
        policy/approxkl), ``ratio_mean``, ``ratio_var`` (biased), ``ratio_max``, ``ratio_min``.  All 0
        when no token is valid.
    """
    clip_high = _check_clip(clip_low, clip_high, dual_clip)
    _check_agg_mode(loss_agg_mode)

    work_dtype = _work_dtype(logprobs, old_logprobs, advantages)
    valid = _valid(mask, logprobs)
    zero = torch.zeros((), dtype=work_dtype, device=logprobs.device)
    # Masked tokens get log-ratio 0 before exp: padding log-probs may be garbage (a large difference
    # would overflow exp, and inf * 0 = NaN in the gradient).
    log_ratio = torch.where(valid, logprobs.to(work_dtype) - old_logprobs.detach().to(work_dtype), zero)
    valid_advantages = torch.where(
        valid, torch.broadcast_to(advantages.detach().to(work_dtype), valid.shape), zero
    )
    ratio = torch.exp(log_ratio)
    pg1 = -valid_advantages * ratio
    pg2 = -valid_advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual_active = torch.zeros_like(valid)
    if dual_clip is not None:
        cap = -valid_advantages * dual_clip
        dual_active = (valid_advantages < 0) & (per_token > cap)
        per_token = torch.where(valid_advantages < 0, torch.minimum(per_token, cap), per_token)
    if importance_weights is not None:
        per_token = per_token * _zero_invalid(importance_weights.detach(), valid, work_dtype)
    if extra_loss is not None:
        per_token = per_token + torch.where(
            valid, torch.broadcast_to(extra_loss, valid.shape).to(work_dtype), zero
        )
    per_token = torch.where(valid, per_token, zero)
    loss = _aggregate(per_token, valid, loss_agg_mode, denominator, max_length)

    return loss, _ratio_metrics(log_ratio, ratio, clipped, dual_active, valid)


def _check_clip(clip_low: float, clip_high: float | None, dual_clip: float | None) -> float:
    """``clip_high`` (``clip_low`` when None), after checking the three clip constants."""
    if not 0.0 < clip_low < 1.0:
        raise ValueError(
            f"clip_low must be in (0, 1) (the ratio's lower bound is 1 - clip_low), got {clip_low!r}."
        )
    clip_high = clip_low if clip_high is None else clip_high
    if not clip_high > 0.0:
        raise ValueError(f"clip_high must be > 0, got {clip_high!r}.")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip (ratio_clip_c) must be > 1 or None to disable it, got {dual_clip!r}.")
    return clip_high


@torch.no_grad()
def _ratio_metrics(
    log_ratio: Tensor, ratio: Tensor, clipped: Tensor, dual_active: Tensor, valid: Tensor
) -> dict[str, Tensor]:
    """The metrics of :func:`clipped_policy_loss`, detached float32 scalars over the valid tokens."""
    ratio_float = ratio.detach().float()
    has = valid.any()  # stays a tensor: no host sync per micro-batch just for logging
    return {
        "clipfrac": _frac(clipped, valid),
        "dual_clipfrac": _frac(dual_active, valid),
        "approxkl": 0.5 * masked_mean(log_ratio.detach().float().square(), valid),
        "ratio_mean": masked_mean(ratio_float, valid),
        "ratio_var": masked_var(ratio_float, valid),
        "ratio_max": torch.where(has, _masked_extreme(ratio_float, valid, largest=True), 0.0),
        "ratio_min": torch.where(has, _masked_extreme(ratio_float, valid, largest=False), 0.0),
    }


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cliprange_value: float | None = 0.2,
    *,
    loss_agg_mode: str = "token-mean",
    denominator: float | Tensor | None = None,
    max_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss of PPO (baselines ppo2; NeMo ``MseValueLossFn``).

    ``L = 0.5 * max((V - R)^2, (V_clipped - R)^2)`` with ``V_clipped = old + clamp(V - old, -eps, eps)``
    (LHPD, "Clipped value function").  ``cliprange_value=None`` gives the unclipped
    ``0.5 * (V - R)^2`` (NeMo's default).

    Args:
        values: (B, T) current critic values (receive gradients).
        old_values: (B, T) values at rollout time (detached).
        returns: (B, T) targets, e.g. GAE returns (detached).
        mask: (B, T) nonzero = token in the loss.
        cliprange_value: eps > 0, or None for no clipping.
        loss_agg_mode, denominator, max_length: as in :func:`clipped_policy_loss`.

    Returns:
        ``(loss, metrics)``; metrics (detached float32 scalars over valid tokens): ``vf_clipfrac``
        (fraction where the clipped term is strictly larger), ``values_mean``, ``values_min``,
        ``values_max`` and ``returns_mean`` (NeMo's critic/* metrics); all 0 when no token is valid.
    """
    if cliprange_value is not None and not cliprange_value > 0:
        raise ValueError(
            f"cliprange_value must be > 0 or None to disable value clipping, got {cliprange_value!r}."
        )
    _check_agg_mode(loss_agg_mode)
    work_dtype = _work_dtype(values, old_values, returns)
    valid = _valid(mask, values)
    zero = torch.zeros((), dtype=work_dtype, device=values.device)
    valid_values = torch.where(valid, values.to(work_dtype), zero)
    valid_returns = torch.where(valid, returns.detach().to(work_dtype), zero)
    err = (valid_values - valid_returns).square()
    if cliprange_value is None:
        per_token = 0.5 * err
        clipped = torch.zeros_like(valid)
    else:
        valid_old = torch.where(valid, old_values.detach().to(work_dtype), zero)
        v_clipped = valid_old + torch.clamp(valid_values - valid_old, -cliprange_value, cliprange_value)
        err_clipped = (v_clipped - valid_returns).square()
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clipped = err_clipped > err
    per_token = torch.where(valid, per_token, zero)
    loss = _aggregate(per_token, valid, loss_agg_mode, denominator, max_length)
    with torch.no_grad():
        has = valid.any()
        metrics = {
            "vf_clipfrac": _frac(clipped, valid),
            "values_mean": masked_mean(valid_values.detach().float(), valid),
            "values_min": torch.where(
                has, _masked_extreme(valid_values.detach().float(), valid, largest=False), 0.0
            ),
            "values_max": torch.where(
                has, _masked_extreme(valid_values.detach().float(), valid, largest=True), 0.0
            ),
            "returns_mean": masked_mean(valid_returns.float(), valid),
        }
    return loss, metrics
