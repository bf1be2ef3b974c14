"""Advantages: GAE over a critic's values (carry-forward masking, decoupled and length-adaptive
lambda), the leave-one-out baseline over the k completions of each prompt, and GRPO's group-normalized
advantages."""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import _AllReduce, _out_dtype, _valid, _work_dtype, _zero_invalid
from .stats import masked_var, whiten

__all__ = [
    "SCALE_REWARDS",
    "gae_advantages",
    "group_advantages",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
]

#: Valid ``scale`` names of :func:`group_advantages` (TRL's ``scale_rewards``).
SCALE_REWARDS = ("group", "batch", "none")


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
    running accumulators untouched, and their rewards/values are ignored entirely.  LHPD's defaults
    are ``gamma=1`` (LHPD, "Discount factor = 1") and ``lam=0.95``.

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

    work_dtype = _work_dtype(rewards, values)
    valid = _valid(mask, rewards)
    valid_rewards = _zero_invalid(rewards, valid, work_dtype)
    valid_values = _zero_invalid(values, valid, work_dtype)
    batch_size = valid_rewards.shape[0]

    lam_ret: float | Tensor = lam if lam_value is None else lam_value
    lam_adv: float | Tensor
    if length_adaptive_alpha > 0:
        lengths = valid.sum(dim=1).to(work_dtype)
        lam_adv = (1.0 - 1.0 / (length_adaptive_alpha * lengths).clamp_min(1.0)).clamp(0.0, 1.0)
    else:
        lam_adv = lam if lam_policy is None else lam_policy

    def is_exact_one(x: float | Tensor) -> bool:
        return gamma == 1.0 and isinstance(x, float) and x == 1.0

    specs: list[float | Tensor] = [lam_adv] if _same_lambda(lam_adv, lam_ret) else [lam_adv, lam_ret]
    results: list[Tensor | None] = [None] * len(specs)
    recurse = [i for i, spec in enumerate(specs) if not is_exact_one(spec)]
    for i, spec in enumerate(specs):
        if is_exact_one(spec):
            # gamma = lam = 1: the TD errors telescope to (reward-to-go over valid tokens) - V_t.
            reward_to_go = valid_rewards.flip(1).cumsum(1).flip(1)
            results[i] = torch.where(valid, reward_to_go - valid_values, torch.zeros_like(valid_values))
    if recurse:
        lams = torch.stack(
            [
                torch.as_tensor(specs[i], dtype=work_dtype, device=valid_rewards.device).expand(batch_size)
                for i in recurse
            ]
        )
        advs = _gae_recursion(valid_rewards, valid_values, valid, gamma, lams)
        for j, i in enumerate(recurse):
            results[i] = advs[j]
    advantages = results[0]
    gae_ret = results[-1]
    assert advantages is not None and gae_ret is not None
    returns = torch.where(valid, gae_ret + valid_values, torch.zeros_like(valid_values))
    return advantages, returns


def _same_lambda(a: float | Tensor, b: float | Tensor) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    return a == b


def rloo_advantages(rewards: Tensor, k: int, valid: Tensor | None = None) -> Tensor:
    """REINFORCE Leave-One-Out advantages (RLOO blog, the vectorised implementation).

    The baseline of each completion is the mean reward of the OTHER ``k - 1`` completions of the same
    prompt: ``baseline = (sum_over_k - r) / (k - 1)`` and ``advantage = r - baseline``.

    With ``valid``, only valid completions take part: the baseline of a valid completion is the mean
    reward of the OTHER valid completions of its prompt; an invalid completion (e.g. one whose reward
    could not be computed) gets advantage 0 and its reward is never read, so a NaN there changes
    nothing; a completion that is its prompt's only valid one gets 0 (it has no baseline).

    Args:
        rewards: flat ``(k * B,)`` tensor (optionally with trailing dims, e.g. ``(k * B, T)``), laid out
            as in the blog: completion ``j`` of prompt ``i`` is at index ``j * B + i`` (the k copies of
            the batch are concatenated, e.g. ``prompts.repeat(k, 1)``).
        k: completions per prompt (``rloo_k``), >= 2.
        valid: ``(k * B,)`` bool or 0/1, nonzero = the completion takes part (the whole row when
            ``rewards`` has trailing dims); None = all valid.

    Returns:
        Advantages with the shape and dtype of ``rewards`` (float32 for integer rewards).  Without
        ``valid`` computed in at least float32; for every prompt they sum to 0 over its k completions,
        and adding a constant to a prompt's rewards leaves them unchanged.  With ``valid`` computed in
        float64 (the baselines divide by a count that differs per prompt), and the same holds over each
        prompt's valid completions.
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
    grouped_shape = (k, rewards.shape[0] // k, *rewards.shape[1:])
    if valid is not None:
        return _masked_leave_one_out(rewards, valid, grouped_shape)
    work_dtype = _work_dtype(rewards)
    grouped = rewards.to(work_dtype).reshape(grouped_shape)
    baseline = (grouped.sum(0, keepdim=True) - grouped) / (k - 1)
    return (grouped - baseline).reshape(rewards.shape).to(_out_dtype(rewards))


def _masked_leave_one_out(rewards: Tensor, valid: Tensor, grouped_shape: tuple[int, ...]) -> Tensor:
    """:func:`rloo_advantages` over the valid completions only, in float64."""
    if tuple(valid.shape) != tuple(rewards.shape[:1]):
        raise ValueError(
            f"valid must be ({rewards.shape[0]},), one flag per completion like the rewards' first dim, "
            f"got shape {tuple(valid.shape)}."
        )
    trailing = (1,) * (len(grouped_shape) - 2)
    is_valid = (valid if valid.dtype == torch.bool else valid != 0).to(rewards.device)
    is_valid = torch.broadcast_to(is_valid.reshape(*grouped_shape[:2], *trailing), grouped_shape)
    grouped = rewards.to(torch.float64).reshape(grouped_shape)
    counted = is_valid.to(torch.float64)
    others = counted.sum(0, keepdim=True) - counted
    # torch.where, not grouped * counted: an invalid completion's reward may be NaN, and NaN * 0 = NaN
    # would reach the baselines of its prompt's valid completions.
    valid_rewards = _zero_invalid(grouped, is_valid, torch.float64)
    baseline = (valid_rewards.sum(0, keepdim=True) - valid_rewards) / others.clamp_min(1)
    has_baseline = (others > 0) & is_valid
    advantages = torch.where(has_baseline, grouped - baseline, torch.zeros_like(grouped))
    return advantages.reshape(rewards.shape).to(_out_dtype(rewards))


def group_advantages(
    rewards: Tensor,
    k: int,
    scale: str = "group",
    valid: Tensor | None = None,
    eps: float = 1e-4,
    *,
    all_reduce: _AllReduce | None = None,
) -> Tensor:
    """GRPO's group-relative advantages (Shao et al., 2024; TRL's ``scale_rewards``).

    Each completion's advantage is its reward minus the mean reward of its prompt's group of ``k``
    completions (itself included), divided by a standard deviation plus ``eps``:

    * ``"group"``: the std of the group's rewards (GRPO's);
    * ``"batch"``: the std of all rewards of the batch, over every process with ``all_reduce`` (a
      prompt whose completions are all rewarded alike is not blown up; Liu et al.'s critique of the
      group std);
    * ``"none"``: no division (Dr. GRPO's), the mean-centred reward.

    Standard deviations are unbiased (Bessel's correction), as ``torch.std`` that TRL uses.

    Args:
        rewards: ``(k * B,)`` sequence rewards, completion ``j`` of prompt ``i`` at index ``j * B + i``
            (the layout of :func:`rloo_advantages`).
        k: completions per prompt (``num_generations``), >= 1; with 1 every advantage is 0 under
            ``"group"`` / ``"none"``.
        scale: ``"group"``, ``"batch"`` or ``"none"``.
        valid: ``(k * B,)`` bool or 0/1; only valid completions enter the means and stds, invalid ones
            get 0 and their reward (possibly NaN) is never read. None: all valid.
        eps: added to the std before dividing (TRL's 1e-4).
        all_reduce: sums a tensor over processes, for the batch std of ``"batch"``; None: this process.

    Returns:
        ``(k * B,)`` advantages in the dtype of ``rewards`` (float32 for integers), computed in float64.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (num_generations) must be an integer >= 1, got {k!r}.")
    if scale not in SCALE_REWARDS:
        raise ValueError(f"unknown scale {scale!r}; expected one of {', '.join(SCALE_REWARDS)}.")
    if rewards.dim() != 1 or rewards.shape[0] % k != 0:
        raise ValueError(
            f"rewards must be (k * B,) with k={k} completions of each of B prompts (index j * B + i), got "
            f"shape {tuple(rewards.shape)}."
        )
    is_valid = _valid(valid, rewards) if valid is not None else torch.ones_like(rewards, dtype=torch.bool)
    if is_valid.shape != rewards.shape:
        raise ValueError(
            f"valid must be ({rewards.shape[0]},), one flag per completion, got shape {tuple(is_valid.shape)}."
        )
    values = _zero_invalid(rewards, is_valid, torch.float64)
    grouped, grouped_valid = values.reshape(k, -1), is_valid.reshape(k, -1)
    counted = grouped_valid.to(torch.float64)
    n = counted.sum(0, keepdim=True)
    mean = grouped.sum(0, keepdim=True) / n.clamp_min(1)
    centred = torch.where(grouped_valid, grouped - mean, torch.zeros_like(grouped))
    if scale == "group":
        var = centred.square().sum(0, keepdim=True) / (n - 1).clamp_min(1)
        var = torch.where(n > 1, var, torch.zeros_like(var))
        advantages = centred / (var.sqrt() + eps)
    elif scale == "batch":
        std = masked_var(values, is_valid, unbiased=True, all_reduce=all_reduce).sqrt()
        advantages = centred / (std + eps)
    else:
        advantages = centred
    advantages = torch.where(grouped_valid, advantages, torch.zeros_like(advantages))
    return advantages.reshape(rewards.shape).to(_out_dtype(rewards))


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    k: int | None = None,
    valid: Tensor | None = None,
    *,
    all_reduce: _AllReduce | None = None,
) -> Tensor:
    """REINFORCE++ advantages (Hu, 2025; verl's ``reinforce_plus_plus`` and
    ``reinforce_plus_plus_baseline``): no critic, the batch's statistics as the baseline.

    * Without ``k``: each token's discounted return ``sum_{s >= t} gamma^(s - t) r_s`` of the per-token
      rewards (the KL penalty per token, the score at the last token), whitened over the valid tokens of
      the batch (all processes with ``all_reduce``; unbiased variance, as verl).
    * With ``k`` (REINFORCE++-baseline): each sequence's total reward minus the mean of its prompt's group
      of ``k`` (completion j of prompt i at row ``j * B + i``), at every token of the sequence, whitened
      over the valid tokens of the batch.

    Args:
        rewards: (N, R) per-token rewards.
        mask: (N, R) valid response tokens.
        gamma: discount in [0, 1] of the returns (no ``k``).
        k: completions per prompt for the group baseline; None: the plain REINFORCE++.
        valid: (N,) rows that take part in the group means (with ``k``); None: rows with a valid token.
        all_reduce: sums a tensor over processes, for the whitening statistics.

    Returns:
        (N, R) float32 advantages, 0 at masked tokens.
    """
    gamma = _check_unit_interval("gamma", gamma)
    token_mask = _valid(mask, rewards)
    masked = torch.where(token_mask, rewards.to(torch.float64), torch.zeros((), dtype=torch.float64))
    if k is None:
        returns = torch.zeros_like(masked)
        running = torch.zeros_like(masked[:, 0])
        for t in range(masked.shape[1] - 1, -1, -1):
            running = masked[:, t] + gamma * running
            returns[:, t] = running
        centred = returns
    else:
        rows = token_mask.any(1) if valid is None else _valid(valid, rewards[:, 0]) & token_mask.any(1)
        totals = masked.sum(1)
        grouped, grouped_valid = totals.reshape(k, -1), rows.reshape(k, -1)
        counted = grouped_valid.to(torch.float64)
        mean = (grouped * counted).sum(0, keepdim=True) / counted.sum(0, keepdim=True).clamp_min(1)
        centred = (grouped - mean).reshape(-1)[:, None].expand_as(masked)
    advantages = whiten(centred, token_mask, shift_mean=True, unbiased=True, all_reduce=all_reduce)
    return torch.where(token_mask, advantages, torch.zeros_like(advantages)).float()
