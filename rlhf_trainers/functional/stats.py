"""Masked statistics: mean, variance, sufficient moments, whitening and the critic's explained
variance, each optionally global over data-parallel processes through ``all_reduce=``."""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import _AllReduce, _Dim, _out_dtype, _valid, _work_dtype, _zero_invalid

__all__ = ["explained_variance", "masked_mean", "masked_moments", "masked_var", "whiten"]


def _moments(values: Tensor, valid: Tensor, dim: _Dim, keepdim: bool, dtype: torch.dtype) -> Tensor:
    zeroed = _zero_invalid(values, valid, dtype)
    count = valid.to(dtype).sum(dim=dim, keepdim=keepdim)
    return torch.stack(
        [zeroed.sum(dim=dim, keepdim=keepdim), (zeroed * zeroed).sum(dim=dim, keepdim=keepdim), count]
    )


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
        work_dtype = _work_dtype(values)
        total = _zero_invalid(values, valid, work_dtype).sum(dim=dim, keepdim=keepdim)
        count = valid.to(work_dtype).sum(dim=dim, keepdim=keepdim)
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
    lm-human-preferences used ("TensorFlow vs PyTorch note" of LHPD:
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
    work_dtype = _work_dtype(values)
    zeroed = _zero_invalid(values, valid, work_dtype)
    count = valid.to(work_dtype).sum(dim=dim, keepdim=True)
    mean = zeroed.sum(dim=dim, keepdim=True) / count.clamp_min(1)
    deviations = torch.where(valid, zeroed - mean, torch.zeros((), dtype=work_dtype, device=zeroed.device))
    squares = (deviations * deviations).sum(dim=dim, keepdim=keepdim)
    if not keepdim:
        count = count.sum(dim=dim) if dim is None else count.squeeze(dim)
    denom = count - 1 if unbiased else count
    var = torch.where(denom > 0, squares / denom.clamp_min(1), torch.zeros_like(squares))
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
    """LHPD's ``whiten``: ``(values - mean) * rsqrt(var + eps)``, plus ``mean`` again if not
    ``shift_mean``.

    OpenAI whitens the rewards with ``shift_mean=False`` and the advantages with ``shift_mean=True``
    (LHPD, "Per-minibatch reward and advantage whitening").  The variance is the
    biased one by default (``tf.nn.moments``); ``unbiased=True`` reproduces ``torch.var``'s default.

    Args:
        values: any shape, e.g. rewards or advantages (B, T).
        mask: broadcastable to ``values``; statistics use the valid entries only, and entries outside
            the mask are returned UNCHANGED, so padding neither shifts the statistics nor receives
            whitened numbers that later code might mistake for real ones.
        shift_mean: False adds the mean back after scaling.
        unbiased: Bessel's correction for the variance.
        eps: added to the variance before ``rsqrt`` (1e-8 in LHPD).
        all_reduce: sum-across-processes function; with it the mean/variance are global over all
            ranks (one collective on packed float64 moments) instead of per rank.

    Returns:
        Tensor of ``values``' shape and dtype.  With no valid entry the input is returned (a copy).
    """
    valid = _valid(mask, values)
    work_dtype = _work_dtype(values)
    upcast = values.to(work_dtype)
    if all_reduce is not None:
        total, total_sq, count = _global_moments(values, valid, None, False, all_reduce)
        mean = (total / count.clamp_min(1)).to(work_dtype)
        var = _var_from_moments(total, total_sq, count, unbiased).to(work_dtype)
    else:
        mean = masked_mean(upcast, valid)
        var = masked_var(upcast, valid, unbiased=unbiased)
    # Centre only valid entries: inf/NaN padding would otherwise reach the backward of the rsqrt
    # factor as 0 * inf = NaN even though torch.where drops it from the forward result.
    centered = torch.where(valid, upcast - mean, torch.zeros((), dtype=work_dtype, device=upcast.device))
    whitened = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, upcast).to(_out_dtype(values))


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
    work_dtype = _work_dtype(values, returns)
    valid = _valid(mask, returns)
    targets = returns.to(work_dtype)
    var_r = masked_var(targets, valid)
    var_res = masked_var(targets - values.to(work_dtype), valid)
    return torch.where(var_r > 0, 1 - var_res / torch.where(var_r > 0, var_r, 1), torch.zeros_like(var_r))
