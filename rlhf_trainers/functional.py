"""Pure tensor math of online RLHF (PPO / RLOO), with the details of the seeds spelled out.

Nothing here knows about models, processes or files: every function takes tensors (and masks) and
returns tensors, so each detail can be tested against the numbers printed in the seeds
(``n-implementation-details-of-rlhf-with-ppo``, the RLOO blog, the NeMo RL PPO guide).

Conventions
-----------
* Shapes: ``B`` batch (sequences), ``T`` tokens per sequence, ``V`` vocabulary, ``R`` response length.
* Masks may be ``bool`` or 0/1 integer/float tensors; any nonzero entry counts as valid.  Values at
  masked positions are never read arithmetically (they are selected away with ``torch.where``, not
  multiplied by 0), so padding that holds ``inf``/``NaN`` garbage cannot leak into valid tokens.
* Reductions run in at least float32 (float64 stays float64); results are returned in the input's
  floating dtype unless a function says otherwise.  bf16/fp16 inputs are upcast for the arithmetic.
* Empty or fully masked selections never produce NaN: means, variances and losses are 0 there.
* No function modifies its inputs in place.

Contents
--------
Masked statistics
    :func:`masked_mean`, :func:`masked_var`, :func:`masked_moments`, :func:`whiten`
    (all accept ``all_reduce=`` to make the statistics global across data-parallel ranks),
    :func:`explained_variance`.
KL
    :func:`kl_penalty` (k1/k2/k3/abs estimators), :class:`AdaptiveKLController`,
    :class:`FixedKLController`.
Advantages
    :func:`gae_advantages` (carry-forward masking, decoupled and length-adaptive lambda),
    :func:`rloo_advantages` (leave-one-out baseline).
Responses and rewards
    :func:`first_true_indices`, :func:`last_true_indices`, :func:`truncate_response`,
    :func:`stop_token_found`, :func:`apply_rejection_penalty`, :func:`position_ids_from_mask`,
    :func:`scale_rewards`, :func:`overlong_penalty`, :func:`normalize_rewards_gain_bias`.
Log-probabilities
    :func:`logprobs_from_logits`, :func:`entropy_from_logits`, :func:`logprobs_and_entropy_from_logits`
    (chunked, never materialise the full log-softmax); :func:`logprobs_and_entropy_from_hidden` (a fused
    lm head: never materialises the logits).
Losses
    :func:`clipped_policy_loss`, :func:`clipped_value_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "REJECTION_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_rejection_penalty",
    "clipped_policy_loss",
    "clipped_value_loss",
    "entropy_from_logits",
    "explained_variance",
    "first_true_indices",
    "gae_advantages",
    "kl_penalty",
    "last_true_indices",
    "logprobs_and_entropy_from_hidden",
    "logprobs_and_entropy_from_logits",
    "logprobs_from_logits",
    "masked_mean",
    "masked_moments",
    "masked_var",
    "normalize_rewards_gain_bias",
    "overlong_penalty",
    "position_ids_from_mask",
    "rloo_advantages",
    "scale_rewards",
    "stop_token_found",
    "truncate_response",
    "whiten",
]

_AllReduce = Callable[[Tensor], Tensor]
_Dim = int | tuple[int, ...] | None

#: Valid ``estimator`` names of :func:`kl_penalty`.
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
#: Valid ``loss_agg_mode`` names of :func:`clipped_policy_loss` / :func:`clipped_value_loss`.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
#: Valid ``mode`` names of :func:`apply_rejection_penalty`.
REJECTION_MODES = ("replace", "subtract")


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _acc_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32: bf16/fp16 sums of a few thousand tokens lose
    whole digits, so every reduction is done in at least float32."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _out_dtype(values: Tensor) -> torch.dtype:
    return values.dtype if values.is_floating_point() else torch.float32


def _valid(mask: Tensor | None, values: Tensor) -> Tensor:
    """Boolean validity mask broadcast to ``values.shape`` (nonzero = valid)."""
    if mask is None:
        return torch.ones_like(values, dtype=torch.bool)
    valid = mask if mask.dtype == torch.bool else mask != 0
    try:
        return torch.broadcast_to(valid.to(values.device), values.shape)
    except RuntimeError as err:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} cannot be broadcast to values of shape "
            f"{tuple(values.shape)}; pass a mask with the same shape as the values (e.g. (B, T))."
        ) from err


def _zero_invalid(values: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    # torch.where, not values * mask: padding may hold inf/NaN (e.g. a reward model's output on pad
    # tokens) and inf * 0 = NaN would poison the whole reduction.
    return torch.where(valid, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))


def _moments(values: Tensor, valid: Tensor, dim: _Dim, keepdim: bool, dtype: torch.dtype) -> Tensor:
    v = _zero_invalid(values, valid, dtype)
    count = valid.to(dtype).sum(dim=dim, keepdim=keepdim)
    return torch.stack([v.sum(dim=dim, keepdim=keepdim), (v * v).sum(dim=dim, keepdim=keepdim), count])


def _global_moments(
    values: Tensor, valid: Tensor, dim: _Dim, keepdim: bool, all_reduce: _AllReduce
) -> tuple[Tensor, Tensor, Tensor]:
    # One collective per call: (sum, sum of squares, count) are packed into a single tensor, so the
    # trainer pays one all-reduce latency, not three.  float64 because the variance is later
    # recovered as sumsq - sum^2 / n, which cancels catastrophically in float32.
    packed = all_reduce(_moments(values, valid, dim, keepdim, torch.float64))
    total, total_sq, count = packed.unbind(0)
    return total, total_sq, count


def _var_from_moments(total: Tensor, total_sq: Tensor, count: Tensor, unbiased: bool) -> Tensor:
    mean = total / count.clamp_min(1)
    # Rounding can make sumsq - sum*mean slightly negative; rsqrt of a negative number is NaN.
    m2 = (total_sq - total * mean).clamp_min(0)
    denom = count - 1 if unbiased else count
    return torch.where(denom > 0, m2 / denom.clamp_min(1), torch.zeros_like(m2))


def _check_dim_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


# --------------------------------------------------------------------------------------------------
# masked statistics
# --------------------------------------------------------------------------------------------------


def masked_moments(
    values: Tensor, mask: Tensor | None = None, *, dim: _Dim = None, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    """Sufficient statistics ``(sum, sum_of_squares, count)`` of the valid entries of ``values``.

    Args:
        values: any shape, e.g. (B, T).
        mask: broadcastable to ``values``; nonzero = valid. None = all valid.
        dim: reduce over these dims (None = all), e.g. ``dim=1`` for per-row statistics (B,).
        dtype: dtype of the statistics, float64 by default so that ``var = sumsq/n - mean^2`` does not
            cancel catastrophically (use float32 on backends without float64).

    Returns:
        Three tensors of the reduced shape in ``dtype``.  Summed over data-parallel ranks they give the
        global mean and variance, which is how ``all_reduce=`` of :func:`whiten` works.  All zero for an
        empty selection.
    """
    valid = _valid(mask, values)
    total, total_sq, count = _moments(values, valid, dim, False, dtype).unbind(0)
    return total, total_sq, count


def masked_mean(
    values: Tensor,
    mask: Tensor | None = None,
    dim: _Dim = None,
    keepdim: bool = False,
    *,
    all_reduce: _AllReduce | None = None,
) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is nonzero.

    Args:
        values: any shape, e.g. (B, T).
        mask: broadcastable to ``values``; None = all positions.
        dim: None = one scalar over everything; an int/tuple = per-slice means, e.g. ``dim=1`` -> (B,).
        keepdim: keep the reduced dims with size 1.
        all_reduce: a function that sums a tensor across processes (e.g.
            ``lambda t: accelerator.reduce(t, "sum")``): the mean is then taken over the valid entries
            of all ranks, with a single collective call.

    Returns:
        The mean in ``values``' dtype (float32 for integer inputs), accumulated in at least float32.
        An empty or fully masked selection gives 0, never NaN.
    """
    valid = _valid(mask, values)
    out_dtype = _out_dtype(values)
    if all_reduce is not None:
        total, _, count = _global_moments(values, valid, dim, keepdim, all_reduce)
    else:
        acc = _acc_dtype(values)
        total = _zero_invalid(values, valid, acc).sum(dim=dim, keepdim=keepdim)
        count = valid.to(acc).sum(dim=dim, keepdim=keepdim)
    # count.clamp_min(1): an empty selection has total == 0, so it yields 0 instead of 0/0.
    return (total / count.clamp_min(1)).to(out_dtype)


def masked_var(
    values: Tensor,
    mask: Tensor | None = None,
    unbiased: bool = False,
    dim: _Dim = None,
    keepdim: bool = False,
    *,
    all_reduce: _AllReduce | None = None,
) -> Tensor:
    """Variance of ``values`` over the positions where ``mask`` is nonzero.

    Biased (divide by n) by default, like TensorFlow's ``tf.nn.moments`` that OpenAI's
    lm-human-preferences used ("TensorFlow vs PyTorch note" of the N-implementation-details seed:
    on the 3x3 example torch's default unbiased variance is 0.0750, the biased one 0.0667).
    ``unbiased=True`` applies Bessel's correction (divide by n - 1).

    Args:
        values, mask, dim, keepdim, all_reduce: as in :func:`masked_mean`.
        unbiased: divide by n - 1 instead of n.

    Returns:
        The variance in ``values``' dtype (float32 for integers).  0 (not NaN/inf) when there are fewer
        than 1 (biased) or 2 (unbiased) valid entries.  Without ``all_reduce`` it is computed in two
        passes (mean, then squared deviations) in at least float32; with ``all_reduce`` from float64
        sufficient statistics (one collective).
    """
    valid = _valid(mask, values)
    out_dtype = _out_dtype(values)
    if all_reduce is not None:
        total, total_sq, count = _global_moments(values, valid, dim, keepdim, all_reduce)
        return _var_from_moments(total, total_sq, count, unbiased).to(out_dtype)
    acc = _acc_dtype(values)
    v = _zero_invalid(values, valid, acc)
    count = valid.to(acc).sum(dim=dim, keepdim=True)
    mean = v.sum(dim=dim, keepdim=True) / count.clamp_min(1)
    dev = torch.where(valid, v - mean, torch.zeros((), dtype=acc, device=v.device))
    sq = (dev * dev).sum(dim=dim, keepdim=keepdim)
    if not keepdim:
        count = count.sum(dim=dim) if dim is None else count.squeeze(dim)
    denom = count - 1 if unbiased else count
    var = torch.where(denom > 0, sq / denom.clamp_min(1), torch.zeros_like(sq))
    return var.to(out_dtype)


def whiten(
    values: Tensor,
    mask: Tensor | None = None,
    shift_mean: bool = True,
    unbiased: bool = False,
    eps: float = 1e-8,
    *,
    all_reduce: _AllReduce | None = None,
) -> Tensor:
    """The seed's ``whiten``: ``(values - mean) * rsqrt(var + eps)``, plus ``mean`` again if not
    ``shift_mean``.

    OpenAI whitens the rewards with ``shift_mean=False`` and the advantages with ``shift_mean=True``
    (N-implementation-details, "Per-minibatch reward and advantage whitening").  The variance is the
    biased one by default (``tf.nn.moments``); ``unbiased=True`` reproduces ``torch.var``'s default.

    Args:
        values: any shape, e.g. rewards or advantages (B, T).
        mask: broadcastable to ``values``; statistics use the valid entries only, and entries outside
            the mask are returned UNCHANGED, so padding neither shifts the statistics nor receives
            whitened numbers that later code might mistake for real ones.
        shift_mean: False adds the mean back after scaling.
        unbiased: Bessel's correction for the variance.
        eps: added to the variance before ``rsqrt`` (1e-8 in the seed).
        all_reduce: sum-across-processes function; with it the mean/variance are global over all
            ranks (one collective on packed float64 moments) instead of per rank.

    Returns:
        Tensor of ``values``' shape and dtype.  With no valid entry the input is returned (a copy).
    """
    valid = _valid(mask, values)
    acc = _acc_dtype(values)
    v = values.to(acc)
    if all_reduce is not None:
        total, total_sq, count = _global_moments(values, valid, None, False, all_reduce)
        mean = (total / count.clamp_min(1)).to(acc)
        var = _var_from_moments(total, total_sq, count, unbiased).to(acc)
    else:
        mean = masked_mean(v, valid)
        var = masked_var(v, valid, unbiased=unbiased)
    # Centre only valid entries: inf/NaN padding would otherwise reach the backward of the rsqrt
    # factor as 0 * inf = NaN even though torch.where drops it from the forward result.
    centered = torch.where(valid, v - mean, torch.zeros((), dtype=acc, device=v.device))
    whitened = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, v).to(_out_dtype(values))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor | None = None) -> Tensor:
    """NeMo RL's ``critic/explained_var``: ``1 - Var(R - V) / Var(R)`` over the valid tokens.

    Args:
        values: critic predictions V, e.g. (B, T).
        returns: targets R (GAE returns), same shape.
        mask: nonzero = valid token.

    Returns:
        A scalar tensor (float32, or float64 for float64 inputs).  1 = perfect critic, 0 = no better
        than predicting the mean, negative = worse.  When ``Var(R) == 0`` (constant returns, or no
        valid token) the ratio is undefined and 0 is returned: a logged NaN would hide every later
        value of the metric's curve.
    """
    acc = _acc_dtype(values, returns)
    valid = _valid(mask, returns)
    r = returns.to(acc)
    var_r = masked_var(r, valid)
    var_res = masked_var(r - values.to(acc), valid)
    return torch.where(var_r > 0, 1 - var_res / torch.where(var_r > 0, var_r, 1), torch.zeros_like(var_r))


# --------------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------------


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probabilities.

    Estimators from Schulman, "Approximating KL divergence" (with ``d = logprobs - ref_logprobs``):

    * ``"k1"``: ``d`` -- unbiased, can be negative per token; what OpenAI adds to the rewards
      (N-implementation-details, "Per-token KL penalty": ``kl = new_logprobs - logprobs``).
    * ``"k2"``: ``0.5 * d**2`` -- always >= 0, low variance, biased.
    * ``"k3"``: ``exp(-d) - 1 + d`` -- always >= 0 and unbiased.
    * ``"abs"``: ``|d|``.

    Args:
        logprobs: (B, T) log-probabilities of the sampled tokens under the policy.
        ref_logprobs: (B, T) same tokens under the reference policy.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``.

    Returns:
        (B, T) in the promoted dtype of the inputs, computed in at least float32.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}.")
    out_dtype = torch.promote_types(_out_dtype(logprobs), _out_dtype(ref_logprobs))
    acc = _acc_dtype(logprobs, ref_logprobs)
    diff = logprobs.to(acc) - ref_logprobs.to(acc)
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
    return kl.to(out_dtype)


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), exactly as lm-human-preferences writes it
    (N-implementation-details, "Adaptive KL")::

        proportional_error = clip(current / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / horizon
        value *= mult

    The seed's settings for the stylistic tasks are ``init_kl_coef=0.15, target=6, horizon=10000``.

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
            n_steps: how many samples/steps that batch represents (the seed passes the batch size).
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


# --------------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------------


def _check_unit_interval(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}.")
    return float(value)


def _gae_recursion(rewards: Tensor, values: Tensor, valid: Tensor, gamma: float, lams: Tensor) -> Tensor:
    """Backward GAE with carry-forward masking for L lambdas at once.

    rewards/values (B, T) already zeroed at invalid positions, valid (B, T) bool, lams (L, B).
    Returns advantages (L, B, T), 0 at invalid positions.
    """
    B, T = rewards.shape
    if T == 0:
        return rewards.new_zeros((lams.shape[0], B, 0))
    # Carry-forward (NeMo RL): a masked position moves neither accumulator, so the bootstrap value
    # V_next of a token is the value of the next VALID token of its row (0 after the last one) and a
    # hole in the middle of a response (padding, multi-turn separators) adds no phantom TD error.
    # The carried next_value does not depend on lambda, so it is gathered for all t at once: the
    # sequential loop below then costs 2 kernels per token instead of ~10 (it is launch-bound on GPU).
    positions = torch.arange(T, device=rewards.device).expand(B, T)
    valid_pos = torch.where(valid, positions, T)
    # index of the first valid position strictly after t: a reversed running minimum, shifted by one
    next_pos = valid_pos.flip(1).cummin(1).values.flip(1)
    next_pos = torch.cat([next_pos[:, 1:], next_pos.new_full((B, 1), T)], dim=1)
    next_value = torch.cat([values, values.new_zeros(B, 1)], dim=1).gather(1, next_pos)
    deltas = rewards + gamma * next_value - values
    coef = gamma * lams
    last_gae = rewards.new_zeros(lams.shape)
    out = []
    for t in range(T - 1, -1, -1):
        last_gae = torch.where(valid[:, t], torch.addcmul(deltas[:, t], coef, last_gae), last_gae)
        out.append(last_gae)
    advantages = torch.stack(out[::-1], dim=-1)
    return torch.where(valid, advantages, torch.zeros((), dtype=advantages.dtype, device=advantages.device))


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    *,
    lam_value: float | None = None,
    lam_policy: float | None = None,
    length_adaptive_alpha: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation with carry-forward masking (NeMo RL PPO guide).

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, computed from
    the last token backwards, where "next" means the next VALID token: masked positions leave both
    running accumulators untouched, and their rewards/values are ignored entirely.  The seed's defaults
    are ``gamma=1`` (N-implementation-details, "Discount factor = 1") and ``lam=0.95``.

    VAPO decoupled lambdas (NeMo guide): the returns (value targets) use ``lam_value`` (default
    ``lam``); the policy advantages use, in priority order, the length-adaptive
    ``lam_policy = 1 - 1 / (alpha * l)`` per row when ``length_adaptive_alpha > 0`` (``l`` = number of
    valid tokens of the row; the lambda is clamped to [0, 1], so rows with ``alpha * l <= 1`` get
    lambda 0), else ``lam_policy``, else ``lam``.  When both lambdas coincide the recursion runs once.

    Args:
        rewards: (B, T) per-token rewards (KL penalty everywhere, score at the last token).
        values: (B, T) critic values V(s_t).
        mask: (B, T) nonzero = response token that takes part in the recursion.
        gamma: discount factor in [0, 1].
        lam: GAE lambda in [0, 1].
        lam_value: lambda for the returns (VAPO uses 1.0: Monte-Carlo returns).
        lam_policy: lambda for the advantages.
        length_adaptive_alpha: alpha of the length-adaptive policy lambda; 0 = off.

    Returns:
        ``(advantages, returns)``, both (B, T), 0 at masked positions; ``returns = GAE(lam_value) + V``
        on valid tokens.  Computed and returned in float32 (float64 if rewards or values are
        float64): bf16 inputs are NOT cast back, because a bf16 reward-to-go over hundreds of tokens
        keeps only ~3 significant digits and the advantages feed straight into the loss.  When
        ``gamma == 1`` and a lambda is exactly 1 that quantity is computed as an exact reward-to-go
        (reversed cumulative sum) instead of the recursion, which is the same up to rounding and
        avoids the V_{t+1} - V_t cancellations.
    """
    if rewards.dim() != 2 or rewards.shape != values.shape:
        raise ValueError(
            f"rewards and values must both be (B, T) with the same shape, got {tuple(rewards.shape)} "
            f"and {tuple(values.shape)}."
        )
    gamma = _check_unit_interval("gamma", gamma)
    lam = _check_unit_interval("lam", lam)
    if lam_value is not None:
        lam_value = _check_unit_interval("lam_value", lam_value)
    if lam_policy is not None:
        lam_policy = _check_unit_interval("lam_policy", lam_policy)
    if isinstance(length_adaptive_alpha, bool) or not length_adaptive_alpha >= 0:
        raise ValueError(
            f"length_adaptive_alpha must be >= 0 (0 disables it), got {length_adaptive_alpha!r}."
        )

    acc = _acc_dtype(rewards, values)
    valid = _valid(mask, rewards)
    r = _zero_invalid(rewards, valid, acc)
    v = _zero_invalid(values, valid, acc)
    B = r.shape[0]

    lam_ret: float | Tensor = lam if lam_value is None else lam_value
    lam_adv: float | Tensor
    if length_adaptive_alpha > 0:
        lengths = valid.sum(dim=1).to(acc)
        lam_adv = (1.0 - 1.0 / (length_adaptive_alpha * lengths).clamp_min(1.0)).clamp(0.0, 1.0)
    else:
        lam_adv = lam if lam_policy is None else lam_policy

    def is_exact_one(x: float | Tensor) -> bool:
        return gamma == 1.0 and isinstance(x, float) and x == 1.0

    specs: list[float | Tensor] = [lam_adv] if _same_lambda(lam_adv, lam_ret) else [lam_adv, lam_ret]
    results: list[Tensor | None] = [None] * len(specs)
    recurse = [i for i, s in enumerate(specs) if not is_exact_one(s)]
    for i, s in enumerate(specs):
        if is_exact_one(s):
            # gamma = lam = 1: the TD errors telescope to (reward-to-go over valid tokens) - V_t.
            reward_to_go = r.flip(1).cumsum(1).flip(1)
            results[i] = torch.where(valid, reward_to_go - v, torch.zeros_like(v))
    if recurse:
        lams = torch.stack([torch.as_tensor(specs[i], dtype=acc, device=r.device).expand(B) for i in recurse])
        advs = _gae_recursion(r, v, valid, gamma, lams)
        for j, i in enumerate(recurse):
            results[i] = advs[j]
    advantages = results[0]
    gae_ret = results[-1]
    assert advantages is not None and gae_ret is not None
    returns = torch.where(valid, gae_ret + v, torch.zeros_like(v))
    return advantages, returns


def _same_lambda(a: float | Tensor, b: float | Tensor) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    return a == b


def rloo_advantages(rewards: Tensor, k: int) -> Tensor:
    """REINFORCE Leave-One-Out advantages (RLOO blog, the vectorised implementation).

    The baseline of each completion is the mean reward of the OTHER ``k - 1`` completions of the same
    prompt: ``baseline = (sum_over_k - r) / (k - 1)`` and ``advantage = r - baseline``.

    Args:
        rewards: flat ``(k * B,)`` tensor (optionally with trailing dims, e.g. ``(k * B, T)``), laid out
            as in the blog: completion ``j`` of prompt ``i`` is at index ``j * B + i`` (the k copies of
            the batch are concatenated, e.g. ``prompts.repeat(k, 1)``).
        k: completions per prompt (``rloo_k``), >= 2.

    Returns:
        Advantages with the shape and dtype of ``rewards`` (computed in at least float32).  For every
        prompt they sum to 0 over its k completions, and adding a constant to a prompt's rewards leaves
        them unchanged.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ValueError(
            f"rloo_k must be an integer >= 2 (a leave-one-out baseline needs another completion of the "
            f"same prompt), got {k!r}."
        )
    if rewards.dim() == 0 or rewards.shape[0] % k != 0:
        raise ValueError(
            f"rewards must have a leading dimension divisible by rloo_k={k} (k completions of each of B "
            f"prompts, laid out as index j * B + i), got shape {tuple(rewards.shape)}; pass all k "
            f"completions of every prompt."
        )
    acc = _acc_dtype(rewards)
    r = rewards.to(acc).reshape(k, rewards.shape[0] // k, *rewards.shape[1:])
    baseline = (r.sum(0, keepdim=True) - r) / (k - 1)
    return (r - baseline).reshape(rewards.shape).to(_out_dtype(rewards))


# --------------------------------------------------------------------------------------------------
# responses: truncation, rejection sampling, positions
# --------------------------------------------------------------------------------------------------


def first_true_indices(bools: Tensor, dtype: torch.dtype = torch.long) -> Tensor:
    """Index of the first nonzero entry along the last dim, or the row length if there is none.

    Args:
        bools: (B, R) (any leading dims); bool or 0/1 values.
        dtype: dtype of the result.

    Returns:
        (B,) indices in ``dtype``; ``R`` for rows with no nonzero entry (so ``arange(R) <= index`` keeps
        the whole row).
    """
    hits = bools if bools.dtype == torch.bool else bools != 0
    length = hits.shape[-1]
    if length == 0:
        return torch.zeros(hits.shape[:-1], dtype=dtype, device=hits.device)
    positions = torch.arange(length, device=hits.device).expand_as(hits)
    return torch.where(hits, positions, length).amin(dim=-1).to(dtype)


def last_true_indices(mask: Tensor, *, empty_value: int = -1) -> Tensor:
    """Index of the last nonzero entry along the last dim (long).

    Used to read the reward model's output at the last real token of query + response (the
    summarize-from-feedback detail; TRL once read it at the first pad after EOS instead).

    Args:
        mask: (B, T) (any leading dims); bool or 0/1 values, e.g. an attention mask.
        empty_value: returned for rows with no nonzero entry; -1 by default so that such rows are
            visible rather than silently reading position 0 (pass 0 for a ``gather``-safe index).

    Returns:
        (B,) long.
    """
    hits = mask if mask.dtype == torch.bool else mask != 0
    length = hits.shape[-1]
    idx = length - 1 - first_true_indices(hits.flip(-1))
    if empty_value != -1:
        idx = torch.where(idx < 0, torch.full_like(idx, empty_value), idx)
    return idx


def _stop_hits(responses: Tensor, stop_token_id: int | Sequence[int], truncate_after: int) -> Tensor:
    _check_dim_int("truncate_after", truncate_after, 0)
    if isinstance(stop_token_id, int):
        hits = responses == stop_token_id
    else:
        hits = torch.isin(responses, torch.as_tensor(list(stop_token_id), device=responses.device))
    positions = torch.arange(responses.shape[-1], device=responses.device)
    return hits & (positions >= truncate_after)


def truncate_response(
    responses: Tensor,
    stop_token_id: int | Sequence[int],
    pad_token_id: int,
    truncate_after: int = 0,
) -> Tensor:
    """Replace everything after the first stop token (at position >= ``truncate_after``) with padding.

    The seed's token truncation: "truncate at the first occurrence of truncate_token that appears at or
    after position truncate_after"; OpenAI's comment: "replace all tokens after truncate_token with
    padding_token".  The stop token itself is kept.  Rows without such a stop token are unchanged.

    Args:
        responses: (B, R) generated token ids (response part only).
        stop_token_id: the stop token (e.g. EOS or the seed's period), or several ids (any of them stops).
        pad_token_id: the id written after the stop token.  It may equal the stop token id; the
            truncation is still idempotent.
        truncate_after: only stop tokens at index >= this count (the seed uses 16 with a period).

    Returns:
        A new (B, R) tensor of the same dtype; the input is not modified.
    """
    stop_at = first_true_indices(_stop_hits(responses, stop_token_id, truncate_after))
    positions = torch.arange(responses.shape[-1], device=responses.device)
    after_stop = positions > stop_at.unsqueeze(-1)
    return torch.where(after_stop, torch.full_like(responses, pad_token_id), responses)


def stop_token_found(
    responses: Tensor, stop_token_id: int | Sequence[int], truncate_after: int = 0
) -> Tensor:
    """Whether each response contains the stop token at an index >= ``truncate_after``.

    The seed's rejection-sampling test ("ensure that the sample contains truncate_token"); feed the
    result to :func:`apply_rejection_penalty`.

    Args:
        responses: (B, R) token ids.
        stop_token_id: one id or several.
        truncate_after: earliest index that counts.

    Returns:
        (B,) bool.
    """
    return _stop_hits(responses, stop_token_id, truncate_after).any(dim=-1)


def apply_rejection_penalty(scores: Tensor, found: Tensor, penalty: float, mode: str = "replace") -> Tensor:
    """Penalise responses that did not produce the stop token.

    * ``"replace"``: their score becomes ``penalty`` -- the seed's rejection sampling, "we penalize
      continuations that don't have such a period by giving them a fixed reward of -1" (penalty=-1).
    * ``"subtract"``: their score becomes ``scores - penalty`` (TRL's ``missing_eos_penalty``; pass a
      positive penalty).

    Args:
        scores: (B,) reward-model scores.
        found: (B,) bool or 0/1; nonzero = the stop token was found (no penalty).
        penalty: the fixed score ("replace") or the amount subtracted ("subtract").
        mode: ``"replace"`` or ``"subtract"``.

    Returns:
        A new (B,) tensor in ``scores``' dtype.
    """
    if mode not in REJECTION_MODES:
        raise ValueError(f"unknown rejection mode {mode!r}; expected one of {', '.join(REJECTION_MODES)}.")
    ok = found if found.dtype == torch.bool else found != 0
    penalised = torch.full_like(scores, penalty) if mode == "replace" else scores - penalty
    return torch.where(ok, scores, penalised)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids that skip left padding: the exclusive cumulative sum ``mask.cumsum(1) - mask``.

    N-implementation-details, "Adjust position indices correspondingly for padding tokens": with left
    padding the first real token must get position 0, e.g. mask ``[0, 0, 1, 1, 1, 1]`` gives
    ``[0, 0, 0, 1, 2, 3]`` (padding positions are 0 and masked out anyway).

    Args:
        attention_mask: (B, T), bool or 0/1.

    Returns:
        (B, T) long.
    """
    m = (attention_mask != 0).long()
    return m.cumsum(-1) - m


# --------------------------------------------------------------------------------------------------
# log-probabilities and entropy from logits, chunked
# --------------------------------------------------------------------------------------------------


def _as_rows(logits: Tensor) -> Tensor:
    """View (..., V) logits as (P, Q, V) without copying when possible.

    A contiguous tensor becomes (1, N, V).  The common ``logits[:, context_length - 1 : -1]`` slice
    cannot be flattened without a copy (as large as the logits themselves), so a 3-D tensor is
    kept as (B, T, V) and chunks never cross a batch row.
    """
    V = logits.shape[-1]
    try:
        return logits.view(1, -1, V)
    except RuntimeError:
        if logits.dim() >= 3:
            return logits.flatten(0, -3)
        return logits.reshape(1, -1, V)


def _chunks(rows: Tensor, chunk_size: int | None) -> list[tuple[int, int, int]]:
    P, Q = rows.shape[0], rows.shape[1]
    step = Q if chunk_size is None else chunk_size
    return [(p, q0, min(q0 + step, Q)) for p in range(P) for q0 in range(0, Q, max(step, 1))]


def _check_logits_args(
    logits: Tensor, chunk_size: int | None, temperature: float, compute_dtype: torch.dtype | None
) -> torch.dtype:
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be (..., V) with V >= 1, got shape {tuple(logits.shape)}.")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating tensor, got {logits.dtype}.")
    if chunk_size is not None:
        _check_dim_int("chunk_size", chunk_size, 1)
    if isinstance(temperature, bool) or not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}.")
    if compute_dtype is not None and not compute_dtype.is_floating_point:
        raise ValueError(f"compute_dtype must be a floating dtype, got {compute_dtype}.")
    return logits.dtype if compute_dtype is None else compute_dtype


def _entropy_terms(x: Tensor, lse: Tensor) -> Tensor:
    """Entropy ``lse - sum(softmax(x) * x)`` of (n, V) logits ``x`` with row logsumexp ``lse`` (n,)."""
    probs = torch.exp(x - lse.unsqueeze(-1))
    # -inf logits (top-k/top-p filtering) have probability 0: 0 * -inf is NaN, and masking the product
    # afterwards would still send NaN through its backward, so mask the factor first.
    x_finite = torch.where(probs > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return lse - (probs * x_finite).sum(-1)


def _logprob_grad(shifted: Tensor, g: Tensor, index: Tensor, hits: Tensor, temperature: float) -> Tensor:
    """Gradient of ``g * (z[tok] - lse(z)) / T`` w.r.t. the logits ``z`` of a chunk:
    ``(onehot(tok) - softmax(z)) * g / T``, built in place on ``shifted = z - lse`` (a temporary the caller
    owns). ``index`` (n, 1): the token's column in the chunk; ``hits`` (n, 1): ``g`` where the token lies in
    the chunk, 0 elsewhere (a vocabulary tile of the fused head may not contain it)."""
    grad = shifted.exp_().mul_(-g)
    grad.scatter_add_(-1, index, hits)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


class _TokenLogprob(torch.autograd.Function):
    """``logit[token] / T - logsumexp(logits / T)`` chunk by chunk, and optionally (no gradient) the
    entropy of ``softmax(logits / T)`` in the same pass over the logits.

    A custom backward saves only the per-row logsumexp: autograd through the chunks would save every
    upcast (chunk, V) copy, i.e. a full float32 copy of bf16 logits.  The gradient
    ``(onehot - softmax) * grad / T`` is rebuilt chunk by chunk in the backward pass.  The entropy
    reuses each chunk's upcast, temperature-scaled copy and (when computed in the same dtype) its
    logsumexp, so asking for it costs one ``exp`` and one product per chunk instead of a second pass.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        tokens: Tensor,
        temperature: float,
        chunk_size: int | None,
        cdt: torch.dtype,
        entropy_dtype: torch.dtype | None,
    ) -> tuple[Tensor, Tensor]:
        rows = _as_rows(logits)
        tok = tokens.reshape(rows.shape[0], rows.shape[1])
        out = torch.empty(tok.shape, dtype=cdt, device=logits.device)
        lse = torch.empty(tok.shape, dtype=cdt, device=logits.device)
        ent_shape = tok.shape if entropy_dtype is not None else (0,)
        ent = torch.empty(ent_shape, dtype=entropy_dtype or cdt, device=logits.device)
        for p, q0, q1 in _chunks(rows, chunk_size):
            x = rows[p, q0:q1].to(cdt)
            if temperature != 1.0:
                x = x / temperature  # a new tensor: the caller's logits are never scaled in place
            chunk_lse = torch.logsumexp(x, dim=-1)
            lse[p, q0:q1] = chunk_lse
            out[p, q0:q1] = x.gather(-1, tok[p, q0:q1].unsqueeze(-1)).squeeze(-1) - chunk_lse
            if entropy_dtype is not None:
                if entropy_dtype != cdt:
                    x = rows[p, q0:q1].to(entropy_dtype)
                    if temperature != 1.0:
                        x = x / temperature
                    chunk_lse = torch.logsumexp(x, dim=-1)
                ent[p, q0:q1] = _entropy_terms(x, chunk_lse)
        ctx.save_for_backward(logits, tok, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        if entropy_dtype is not None:
            ent = ent.reshape(tokens.shape)
        ctx.mark_non_differentiable(ent)
        return out.reshape(tokens.shape), ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: Tensor, _grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, None, None, None, None, None]:
        logits, tok, lse = ctx.saved_tensors
        temperature = ctx.temperature
        rows = _as_rows(logits)
        grad_rows = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        g_rows = grad_out.reshape(tok.shape).to(lse.dtype)
        for p, q0, q1 in _chunks(rows, ctx.chunk_size):
            x = rows[p, q0:q1].to(lse.dtype)
            if temperature != 1.0:
                x = x / temperature
            g = g_rows[p, q0:q1].unsqueeze(-1)
            shifted = x - lse[p, q0:q1].unsqueeze(-1)  # a chunk-sized temporary (x may be the logits)
            grad_rows[p, q0:q1] = _logprob_grad(shifted, g, tok[p, q0:q1].unsqueeze(-1), g, temperature)
        return grad_rows.view(logits.shape), None, None, None, None, None


def _check_tokens(logits: Tensor, tokens: Tensor) -> None:
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"tokens must have the shape of logits without the vocabulary dim, got tokens "
            f"{tuple(tokens.shape)} and logits {tuple(logits.shape)}."
        )


def logprobs_from_logits(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

    The logits are divided by the sampling temperature (N-implementation-details, "Scale the logits by
    sampling temperature"), on a copy: the caller's tensor is not modified.

    Memory: the (B, T, V) log-softmax is never materialised; each value is
    ``logit[token] - logsumexp(logits)``.  With ``chunk_size`` only that many rows of the flattened
    (B*T) are upcast/processed at a time, which bounds the temporaries (the OOM users hit in the
    log-prob path at long sequences).  The backward pass is also chunked and saves only one float per
    token, so a bf16 forward with ``compute_dtype=torch.float32`` never holds a float32 copy of the
    logits.

    Args:
        logits: (B, T, V) (any leading dims), floating.
        tokens: (B, T) integer ids in [0, V).
        temperature: > 0.
        chunk_size: rows of the flattened (B*T) per chunk (chunks do not cross batch rows of a
            non-contiguous slice); None = all at once.
        compute_dtype: dtype of the arithmetic and of the result, e.g. torch.float32 for bf16 logits
            (the RLOO blog's "numerical stability" section: bf16 log-probs make PPO ratios of 0.89-1.09
            at step 0).  None = the logits' dtype.

    Returns:
        (B, T) log-probabilities in ``compute_dtype``, differentiable w.r.t. ``logits`` (first order).
    """
    cdt = _check_logits_args(logits, chunk_size, temperature, compute_dtype)
    _check_tokens(logits, tokens)
    logprobs, _ = _TokenLogprob.apply(logits, tokens.long(), float(temperature), chunk_size, cdt, None)
    return logprobs


def logprobs_and_entropy_from_logits(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    entropy_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """:func:`logprobs_from_logits` and the (detached) :func:`entropy_from_logits` in one chunked pass.

    What a training step needs: the sampled tokens' log-probabilities with their gradient, and the
    policy entropy as a logged metric.  Each chunk of logits is upcast and divided by the temperature
    once, and its logsumexp serves both quantities when ``entropy_dtype`` equals the log-probs'
    compute dtype; calling the two functions one after the other reads, upcasts and reduces the logits
    twice.

    Args:
        logits, tokens, temperature, chunk_size, compute_dtype: as in :func:`logprobs_from_logits`.
        entropy_dtype: dtype of the entropy's arithmetic and result (float32 by default, as the trainers
            log it).

    Returns:
        ``(logprobs, entropy)``, both (B, T): ``logprobs`` in ``compute_dtype`` and differentiable w.r.t.
        ``logits`` (first order), exactly :func:`logprobs_from_logits`'s values; ``entropy`` in
        ``entropy_dtype``, carrying no gradient, the values of :func:`entropy_from_logits` with the same
        arguments.
    """
    cdt = _check_logits_args(logits, chunk_size, temperature, compute_dtype)
    _check_tokens(logits, tokens)
    if not entropy_dtype.is_floating_point:
        raise ValueError(f"entropy_dtype must be a floating dtype, got {entropy_dtype}.")
    return _TokenLogprob.apply(logits, tokens.long(), float(temperature), chunk_size, cdt, entropy_dtype)


class _HiddenTokenLogprob(torch.autograd.Function):
    """Log-probs of ``tokens`` under ``softmax((hidden @ weight.T + bias) / T)`` without the (N, V) logits.

    The forward pass walks (rows x vocabulary) tiles of the logits with an online logsumexp (running max
    ``m``, ``s = sum exp(z - m)``, ``t = sum exp(z - m) * z`` for the entropy), keeping one tile at a
    time; it saves ``hidden``, the weights and the per-row logsumexp. The backward pass recomputes each
    tile's logits (one more lm-head matmul) and accumulates ``d hidden = dz @ W_tile`` and
    ``d W_tile = dz.T @ hidden`` from ``dz = g * (onehot - softmax) / T``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        tokens: Tensor,
        temperature: float,
        row_chunk: int,
        vocab_chunk: int,
        cdt: torch.dtype,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        N, V = hidden.shape[0], weight.shape[0]
        out = torch.empty(N, dtype=cdt, device=hidden.device)
        lse = torch.empty(N, dtype=cdt, device=hidden.device)
        ent = torch.empty(N if with_entropy else 0, dtype=cdt, device=hidden.device)
        for r0 in range(0, N, row_chunk):
            r1 = min(r0 + row_chunk, N)
            h, tok = hidden[r0:r1], tokens[r0:r1]
            m = torch.full((r1 - r0,), -math.inf, dtype=cdt, device=hidden.device)
            s = torch.zeros_like(m)
            t = torch.zeros_like(m)
            target = torch.zeros_like(m)
            for v0 in range(0, V, vocab_chunk):
                v1 = min(v0 + vocab_chunk, V)
                z = _hidden_tile(h, weight, bias, v0, v1, cdt, temperature)
                m_new = torch.maximum(m, z.amax(dim=-1))
                scale = torch.exp(m - m_new)
                e = torch.exp(z - m_new.unsqueeze(-1))
                s = s * scale + e.sum(-1)
                if with_entropy:
                    t = t * scale + (e * z).sum(-1)
                m = m_new
                inside = (tok >= v0) & (tok < v1)
                local = (tok - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
                target = torch.where(inside, z.gather(-1, local).squeeze(-1), target)
            row_lse = m + torch.log(s)
            lse[r0:r1] = row_lse
            out[r0:r1] = target - row_lse
            if with_entropy:
                ent[r0:r1] = row_lse - t / s
        ctx.save_for_backward(hidden, weight, bias, tokens, lse)
        ctx.temperature, ctx.row_chunk, ctx.vocab_chunk = temperature, row_chunk, vocab_chunk
        # The backward pass rebuilds the tiles under the forward's autocast state (bf16 autocast: the
        # same bf16 matmul), so the recomputed softmax is the one the log-probs came from.
        device_type = hidden.device.type
        ctx.autocast = (
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: Tensor, _grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, tokens, lse = ctx.saved_tensors
        temperature, row_chunk, vocab_chunk = ctx.temperature, ctx.row_chunk, ctx.vocab_chunk
        device_type, autocast_on, autocast_dtype = ctx.autocast
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        N, V = hidden.shape[0], weight.shape[0]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # The first row chunk writes each vocabulary tile of d weight (mm into the slice), later ones add:
        # no zero-fill and re-read of a (V, H) buffer (113 MB at a 49K x 576 head) per backward pass.
        grad_w = (torch.empty_like(weight) if N else torch.zeros_like(weight)) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        g_all = grad_out.to(lse.dtype)
        for r0 in range(0, N, row_chunk):
            r1 = min(r0 + row_chunk, N)
            h, tok, g = hidden[r0:r1], tokens[r0:r1], g_all[r0:r1].unsqueeze(-1)
            row_lse = lse[r0:r1].unsqueeze(-1)
            for v0 in range(0, V, vocab_chunk):
                v1 = min(v0 + vocab_chunk, V)
                with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                    z = _hidden_tile(h, weight, bias, v0, v1, lse.dtype, temperature)
                inside = (tok >= v0) & (tok < v1)
                local = (tok - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
                hits = g * inside.unsqueeze(-1).to(g.dtype)
                dz = _logprob_grad(z.sub_(row_lse), g, local, hits, temperature).to(weight.dtype)
                if grad_h is not None:
                    grad_h[r0:r1].addmm_(dz, weight[v0:v1])
                if grad_w is not None:
                    if r0 == 0:
                        torch.mm(dz.t(), h, out=grad_w[v0:v1])
                    else:
                        grad_w[v0:v1].addmm_(dz.t(), h)
                if grad_b is not None:
                    grad_b[v0:v1] += dz.sum(0)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _hidden_tile(
    h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, v1: int, cdt: torch.dtype, temperature: float
) -> Tensor:
    """Logits ``(h @ weight[v0:v1].T + bias[v0:v1]) / T`` of one tile, in ``cdt`` (a new tensor)."""
    w = weight[v0:v1]
    z = torch.addmm(bias[v0:v1], h, w.t()) if bias is not None else h @ w.t()
    z = z.to(cdt) if z.dtype != cdt else z
    if temperature != 1.0:
        z = z / temperature
    return z


def logprobs_and_entropy_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    *,
    bias: Tensor | None = None,
    row_chunk_size: int = 1024,
    vocab_chunk_size: int = 8192,
    compute_dtype: torch.dtype | None = None,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """:func:`logprobs_and_entropy_from_logits` of the logits ``hidden @ weight.T + bias`` (an lm head)
    without ever holding those logits: a fused lm head.

    The logits are built one (``row_chunk_size`` x ``vocab_chunk_size``) tile at a time and reduced with
    an online logsumexp; the backward pass rebuilds each tile instead of keeping the (N, V) logits and
    their gradient. Memory: two tiles instead of 2 x N x V floats (at N = 4096 response tokens and a
    49K vocabulary, 1.6 GB of float32). Cost: one more lm-head matmul in the backward pass.

    Args:
        hidden: (..., H) final hidden states of the positions that predict ``tokens``.
        weight: (V, H) lm-head weight (tied or not); its dtype is the matmul's.
        tokens: (...) token ids, the leading shape of ``hidden``.
        temperature: divide the logits by this (> 0), as for the sampling distribution.
        bias: (V,) lm-head bias, if any.
        row_chunk_size, vocab_chunk_size: tile shape (>= 1).
        compute_dtype: dtype of the softmax arithmetic and of the results; None = ``weight``'s dtype.
        with_entropy: also return the entropy of ``softmax(logits / T)`` (no gradient); else None.

    Returns:
        ``(logprobs, entropy)`` of shape ``tokens.shape``; ``logprobs`` is differentiable w.r.t. ``hidden``,
        ``weight`` and ``bias`` (first order).
    """
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (..., H) and weight (V, H) with the same H, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}.")
    if tuple(tokens.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"tokens must have the leading shape of hidden {tuple(hidden.shape[:-1])}, got {tuple(tokens.shape)}."
        )
    _check_dim_int("row_chunk_size", row_chunk_size, 1)
    _check_dim_int("vocab_chunk_size", vocab_chunk_size, 1)
    if isinstance(temperature, bool) or not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}.")
    if compute_dtype is not None and not compute_dtype.is_floating_point:
        raise ValueError(f"compute_dtype must be a floating dtype, got {compute_dtype}.")
    cdt = weight.dtype if compute_dtype is None else compute_dtype
    H = hidden.shape[-1]
    flat_h = hidden.reshape(-1, H)
    flat_t = tokens.reshape(-1).long()
    out, ent = _HiddenTokenLogprob.apply(
        flat_h, weight, bias, flat_t, float(temperature), row_chunk_size, vocab_chunk_size, cdt, with_entropy
    )
    return out.reshape(tokens.shape), (ent.reshape(tokens.shape) if with_entropy else None)


def entropy_from_logits(
    logits: Tensor,
    *,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position: ``logsumexp(x) - sum(softmax(x) * x)``.

    Computed ``chunk_size`` rows of the flattened (B*T) at a time in ``compute_dtype``.  It is
    differentiable through ordinary autograd (which keeps each chunk's probabilities); for a logged
    metric call it under ``torch.no_grad()``.

    Args:
        logits: (B, T, V) (any leading dims).
        chunk_size: rows per chunk; None = all at once.
        compute_dtype: dtype of the arithmetic and result; None = the logits' dtype.
        temperature: divide the logits by this first (> 0), as for the sampling distribution.

    Returns:
        (B, T) entropies in nats, >= 0, in ``compute_dtype``.  Entries of ``-inf`` (top-k/top-p
        filtered vocabulary) contribute 0 rather than ``0 * -inf = NaN``.
    """
    cdt = _check_logits_args(logits, chunk_size, temperature, compute_dtype)
    rows = _as_rows(logits)
    if rows.shape[0] * rows.shape[1] == 0:
        return torch.zeros(logits.shape[:-1], dtype=cdt, device=logits.device)
    per_row: list[list[Tensor]] = [[] for _ in range(rows.shape[0])]
    for p, q0, q1 in _chunks(rows, chunk_size):
        x = rows[p, q0:q1].to(cdt)
        if temperature != 1.0:
            x = x / temperature
        per_row[p].append(_entropy_terms(x, torch.logsumexp(x, dim=-1)))
    return torch.stack([torch.cat(parts) for parts in per_row]).reshape(logits.shape[:-1])


# --------------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------------


def _aggregate(per_token: Tensor, valid: Tensor, mode: str, denominator: float | Tensor | None) -> Tensor:
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
        loss_agg_mode: ``"token-mean"`` (mean over all valid tokens of the batch),
            ``"seq-mean-token-mean"`` (mean per sequence, then over sequences with >= 1 valid token) or
            ``"seq-mean-token-sum"`` (sum per sequence, then mean over sequences with >= 1 valid token).
        importance_weights: (B, T) per-token multipliers of the loss, detached -- e.g. a truncated
            importance-sampling correction for the generation/training log-prob mismatch.
        denominator: divide by this instead of the local token count ("token-mean") or sequence count
            (seq modes), e.g. the count over all micro-batches of a gradient-accumulation step.

    Returns:
        ``(loss, metrics)``: a scalar in at least float32; metrics of detached float32 scalars over the
        valid tokens: ``clipfrac``, ``dual_clipfrac``, ``approxkl`` (``0.5 * mean(d^2)``, TRL's
        policy/approxkl), ``ratio_mean``, ``ratio_var`` (biased), ``ratio_max``, ``ratio_min``.  All 0
        when no token is valid.
    """
    if not 0.0 < clip_low < 1.0:
        raise ValueError(
            f"clip_low must be in (0, 1) (the ratio's lower bound is 1 - clip_low), got {clip_low!r}."
        )
    clip_high = clip_low if clip_high is None else clip_high
    if not clip_high > 0.0:
        raise ValueError(f"clip_high must be > 0, got {clip_high!r}.")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip (ratio_clip_c) must be > 1 or None to disable it, got {dual_clip!r}.")
    _check_agg_mode(loss_agg_mode)

    acc = _acc_dtype(logprobs, old_logprobs, advantages)
    valid = _valid(mask, logprobs)
    zero = torch.zeros((), dtype=acc, device=logprobs.device)
    # Masked tokens get log-ratio 0 before exp: padding log-probs may be garbage (a large difference
    # would overflow exp, and inf * 0 = NaN in the gradient).
    log_ratio = torch.where(valid, logprobs.to(acc) - old_logprobs.detach().to(acc), zero)
    adv = torch.where(valid, torch.broadcast_to(advantages.detach().to(acc), valid.shape), zero)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual_active = torch.zeros_like(valid)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    if importance_weights is not None:
        per_token = per_token * _zero_invalid(importance_weights.detach(), valid, acc)
    per_token = torch.where(valid, per_token, zero)
    loss = _aggregate(per_token, valid, loss_agg_mode, denominator)

    with torch.no_grad():
        r = ratio.detach().float()
        has = valid.any()  # stays a tensor: no host sync per micro-batch just for logging
        metrics = {
            "clipfrac": _frac(clipped, valid),
            "dual_clipfrac": _frac(dual_active, valid),
            "approxkl": 0.5 * masked_mean(log_ratio.detach().float().square(), valid),
            "ratio_mean": masked_mean(r, valid),
            "ratio_var": masked_var(r, valid),
            "ratio_max": torch.where(has, _masked_extreme(r, valid, largest=True), 0.0),
            "ratio_min": torch.where(has, _masked_extreme(r, valid, largest=False), 0.0),
        }
    return loss, metrics


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cliprange_value: float | None = 0.2,
    *,
    loss_agg_mode: str = "token-mean",
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss of PPO (baselines ppo2; NeMo ``MseValueLossFn``).

    ``L = 0.5 * max((V - R)^2, (V_clipped - R)^2)`` with ``V_clipped = old + clamp(V - old, -eps, eps)``
    (N-implementation-details, "Clipped value function").  ``cliprange_value=None`` gives the unclipped
    ``0.5 * (V - R)^2`` (NeMo's default).

    Args:
        values: (B, T) current critic values (receive gradients).
        old_values: (B, T) values at rollout time (detached).
        returns: (B, T) targets, e.g. GAE returns (detached).
        mask: (B, T) nonzero = token in the loss.
        cliprange_value: eps > 0, or None for no clipping.
        loss_agg_mode, denominator: as in :func:`clipped_policy_loss`.

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
    acc = _acc_dtype(values, old_values, returns)
    valid = _valid(mask, values)
    zero = torch.zeros((), dtype=acc, device=values.device)
    v = torch.where(valid, values.to(acc), zero)
    ret = torch.where(valid, returns.detach().to(acc), zero)
    err = (v - ret).square()
    if cliprange_value is None:
        per_token = 0.5 * err
        clipped = torch.zeros_like(valid)
    else:
        old = torch.where(valid, old_values.detach().to(acc), zero)
        v_clipped = old + torch.clamp(v - old, -cliprange_value, cliprange_value)
        err_clipped = (v_clipped - ret).square()
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clipped = err_clipped > err
    per_token = torch.where(valid, per_token, zero)
    loss = _aggregate(per_token, valid, loss_agg_mode, denominator)
    with torch.no_grad():
        has = valid.any()
        metrics = {
            "vf_clipfrac": _frac(clipped, valid),
            "values_mean": masked_mean(v.detach().float(), valid),
            "values_min": torch.where(has, _masked_extreme(v.detach().float(), valid, largest=False), 0.0),
            "values_max": torch.where(has, _masked_extreme(v.detach().float(), valid, largest=True), 0.0),
            "returns_mean": masked_mean(ret.float(), valid),
        }
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# reward scaling, shaping and normalization
# --------------------------------------------------------------------------------------------------


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
    acc = _acc_dtype(scores)
    s = scores.to(acc).clamp(source_min, source_max)
    scaled = target_min + (s - source_min) * ((target_max - target_min) / (source_max - source_min))
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
    acc = _acc_dtype(response_lengths)
    expected = max_response_length - buffer_length
    excess = (response_lengths.to(acc) - expected).clamp_min(0)
    return (-penalty * excess / buffer_length).clamp_min(-penalty)


def normalize_rewards_gain_bias(
    scores: Tensor,
    target_mean: float = 0.0,
    target_std: float = 1.0,
    *,
    all_reduce: _AllReduce | None = None,
) -> tuple[float, float]:
    """Gain and bias that give the reward model the target mean and std on ``scores``.

    N-implementation-details, "Reward model normalization before and after": from
    ``g * N(mu_D, sigma_D) + b = N(mu_T, sigma_T)`` follow ``g = sigma_T / sigma_D`` and
    ``b = mu_T - g * mu_D``; then ``reward = reward * g + b``.

    Args:
        scores: raw scores of responses sampled from the reference policy, any shape.
        target_mean: mu_T (0 in the seed).
        target_std: sigma_T (1 in the seed), > 0.
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
    n = float(count)
    if n == 0:
        raise ValueError("normalize_rewards_gain_bias got no scores; sample some responses first.")
    mean = float(total) / n
    std = math.sqrt(float(_var_from_moments(total, total_sq, count, unbiased=False)))
    if not std > 1e-12 * max(1.0, abs(mean)) or not math.isfinite(std):
        raise ValueError(
            f"the {int(n)} scores have std {std!r} (mean {mean!r}): all equal, so no gain can give them "
            f"std {target_std}; sample more varied responses or check the reward model."
        )
    gain = target_std / std
    return gain, target_mean - gain * mean
