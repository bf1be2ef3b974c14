"""Memory-lean log-probability and entropy kernels: chunked log-probs from logits, and a fused lm head
that never holds the logits.

These are not formulas of the reference implementations but ways to compute ``log_softmax(z)[token]``
and the entropy without materialising (B, T, V) tensors: custom autograd functions whose backward
passes rebuild each chunk or tile instead of saving it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._common import _check_dim_int

__all__ = [
    "entropy_from_logits",
    "logprobs_and_entropy_from_hidden",
    "logprobs_and_entropy_from_logits",
    "logprobs_from_logits",
]


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


def _logprob_and_entropy_grad(
    log_p: Tensor, g: Tensor, g_entropy: Tensor, index: Tensor, hits: Tensor, temperature: float
) -> Tensor:
    """Gradient w.r.t. the logits ``z`` of a chunk of ``g * log p[token] + g_entropy * H`` with ``log p =
    z / T - lse`` (``log_p``, a temporary the caller owns) and ``H = -sum p log p``:
    ``(onehot * g - p * (g + g_entropy * (log p + H))) / T``. ``g``, ``g_entropy`` (n, 1); ``index``,
    ``hits`` as in :func:`_logprob_grad`."""
    p = log_p.exp()
    kept = p > 0  # -inf logits (filtered vocabulary) have p = 0 and no gradient
    safe = torch.where(kept, log_p, torch.zeros((), dtype=log_p.dtype, device=log_p.device))
    entropy = -(p * safe).sum(-1, keepdim=True)
    grad = p.mul_(-(g + g_entropy * (safe + entropy)))
    grad.scatter_add_(-1, index, hits)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


def _logprob_grad(shifted: Tensor, g: Tensor, index: Tensor, hits: Tensor, temperature: float) -> Tensor:
    """Gradient of ``g * (z[token_ids] - lse(z)) / T`` w.r.t. the logits ``z`` of a chunk:
    ``(onehot(token_ids) - softmax(z)) * g / T``, built in place on ``shifted = z - lse`` (a temporary the caller
    owns). ``index`` (n, 1): the token's column in the chunk; ``hits`` (n, 1): ``g`` where the token lies in
    the chunk, 0 elsewhere (a vocabulary tile of the fused head may not contain it)."""
    grad = shifted.exp_().mul_(-g)
    grad.scatter_add_(-1, index, hits)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


class _TokenLogprob(torch.autograd.Function):
    """``logit[token] / T - logsumexp(logits / T)`` chunk by chunk, and optionally the entropy of
    ``softmax(logits / T)`` in the same pass over the logits (differentiable too: an entropy bonus).

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
        dtype: torch.dtype,
        entropy_dtype: torch.dtype | None,
    ) -> tuple[Tensor, Tensor]:
        rows = _as_rows(logits)
        token_ids = tokens.reshape(rows.shape[0], rows.shape[1])
        out = torch.empty(token_ids.shape, dtype=dtype, device=logits.device)
        lse = torch.empty(token_ids.shape, dtype=dtype, device=logits.device)
        entropy_shape = token_ids.shape if entropy_dtype is not None else (0,)
        entropy = torch.empty(entropy_shape, dtype=entropy_dtype or dtype, device=logits.device)
        for p, q0, q1 in _chunks(rows, chunk_size):
            x = rows[p, q0:q1].to(dtype)
            if temperature != 1.0:
                x = x / temperature  # a new tensor: the caller's logits are never scaled in place
            chunk_lse = torch.logsumexp(x, dim=-1)
            lse[p, q0:q1] = chunk_lse
            out[p, q0:q1] = x.gather(-1, token_ids[p, q0:q1].unsqueeze(-1)).squeeze(-1) - chunk_lse
            if entropy_dtype is not None:
                if entropy_dtype != dtype:
                    x = rows[p, q0:q1].to(entropy_dtype)
                    if temperature != 1.0:
                        x = x / temperature
                    chunk_lse = torch.logsumexp(x, dim=-1)
                entropy[p, q0:q1] = _entropy_terms(x, chunk_lse)
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)  # an unused output (the entropy, usually) gets None, not zeros
        if entropy_dtype is not None:
            entropy = entropy.reshape(tokens.shape)
        else:
            ctx.mark_non_differentiable(entropy)
        return out.reshape(tokens.shape), entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, None, None, None, None, None]:
        logits, token_ids, lse = ctx.saved_tensors
        temperature = ctx.temperature
        rows = _as_rows(logits)
        grad_rows = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        zeros = torch.zeros(token_ids.shape, dtype=lse.dtype, device=lse.device)
        g_rows = grad_out.reshape(token_ids.shape).to(lse.dtype) if grad_out is not None else zeros
        gh_rows = grad_entropy.reshape(token_ids.shape).to(lse.dtype) if grad_entropy is not None else None
        for p, q0, q1 in _chunks(rows, ctx.chunk_size):
            x = rows[p, q0:q1].to(lse.dtype)
            if temperature != 1.0:
                x = x / temperature
            g = g_rows[p, q0:q1].unsqueeze(-1)
            shifted = x - lse[p, q0:q1].unsqueeze(-1)  # a chunk-sized temporary (x may be the logits)
            index = token_ids[p, q0:q1].unsqueeze(-1)
            if gh_rows is None:
                grad_rows[p, q0:q1] = _logprob_grad(shifted, g, index, g, temperature)
            else:
                gh = gh_rows[p, q0:q1].unsqueeze(-1)
                grad_rows[p, q0:q1] = _logprob_and_entropy_grad(shifted, g, gh, index, g, temperature)
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

    The logits are divided by the sampling temperature (LHPD, "Scale the logits by
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
    dtype = _check_logits_args(logits, chunk_size, temperature, compute_dtype)
    _check_tokens(logits, tokens)
    logprobs, _ = _TokenLogprob.apply(logits, tokens.long(), float(temperature), chunk_size, dtype, None)
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
    """:func:`logprobs_from_logits` and :func:`entropy_from_logits` in one chunked pass.

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
        ``entropy_dtype``, the values of :func:`entropy_from_logits` with the same arguments, also
        differentiable (first order; its gradient is computed in ``compute_dtype``), for an entropy bonus.
    """
    dtype = _check_logits_args(logits, chunk_size, temperature, compute_dtype)
    _check_tokens(logits, tokens)
    if not entropy_dtype.is_floating_point:
        raise ValueError(f"entropy_dtype must be a floating dtype, got {entropy_dtype}.")
    return _TokenLogprob.apply(logits, tokens.long(), float(temperature), chunk_size, dtype, entropy_dtype)


class _HiddenTokenLogprob(torch.autograd.Function):
    """Log-probs of ``tokens`` under ``softmax((hidden @ weight.T + bias) / T)`` without the (N, V) logits.

    The forward pass walks (rows x vocabulary) tiles of the logits with an online logsumexp (running max
    ``m``, ``s = sum exp(z - m)``, ``t = sum exp(z - m) * z`` for the entropy), keeping one tile at a
    time; it saves ``hidden``, the weights and the per-row logsumexp (and entropy). The backward pass
    recomputes each tile's logits (one more lm-head matmul), or, with ``keep_logits``, reads them from the
    (N, V) logits that the forward pass wrote tile by tile (the same values: no matmul, N x V floats held
    from forward to backward), and accumulates ``d hidden = dz @ W_tile`` and
    ``d W_tile = dz.T @ hidden`` from ``dz = g * (onehot - softmax) / T`` (plus, when the entropy is in the
    loss, ``-g_H * p * (log p + H) / T``), over tiles of as many logits as the forward's but more rows
    (:func:`_backward_tile`).
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
        dtype: torch.dtype,
        with_entropy: bool,
        keep_logits: bool,
    ) -> tuple[Tensor, Tensor]:
        N, V = hidden.shape[0], weight.shape[0]
        kept = torch.empty(N, V, dtype=dtype, device=hidden.device) if keep_logits else None
        out = torch.empty(N, dtype=dtype, device=hidden.device)
        lse = torch.empty(N, dtype=dtype, device=hidden.device)
        entropy = torch.empty(N if with_entropy else 0, dtype=dtype, device=hidden.device)
        device_type = hidden.device.type
        autocast = (
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        h_mm, w_mm, b_mm = _matmul_operands(hidden, weight, bias, autocast)
        for r0 in range(0, N, row_chunk):
            r1 = min(r0 + row_chunk, N)
            h, token_ids = h_mm[r0:r1], tokens[r0:r1]
            m = torch.full((r1 - r0,), -math.inf, dtype=dtype, device=hidden.device)
            s = torch.zeros_like(m)
            t = torch.zeros_like(m)
            target = torch.zeros_like(m)
            for v0 in range(0, V, vocab_chunk):
                v1 = min(v0 + vocab_chunk, V)
                z = _hidden_tile(h, w_mm, b_mm, v0, v1, dtype, temperature)
                if kept is not None:
                    kept[r0:r1, v0:v1] = z
                m_new = torch.maximum(m, z.amax(dim=-1))
                scale = torch.exp(m - m_new)
                e = torch.exp(z - m_new.unsqueeze(-1))
                s = s * scale + e.sum(-1)
                if with_entropy:
                    t = t * scale + (e * z).sum(-1)
                m = m_new
                inside = (token_ids >= v0) & (token_ids < v1)
                local = (token_ids - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
                target = torch.where(inside, z.gather(-1, local).squeeze(-1), target)
            row_lse = m + torch.log(s)
            lse[r0:r1] = row_lse
            out[r0:r1] = target - row_lse
            if with_entropy:
                entropy[r0:r1] = row_lse - t / s
        # The kept logits (an intermediate, no gradient of its own) are freed with the other saved tensors.
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy, kept)
        ctx.temperature, ctx.row_chunk, ctx.vocab_chunk = temperature, row_chunk, vocab_chunk
        ctx.set_materialize_grads(False)  # an unused output (the entropy, usually) gets None, not zeros
        # The backward pass rebuilds the tiles under the forward's autocast state (bf16 autocast: the
        # same bf16 matmul), so the recomputed softmax is the one the log-probs came from.
        ctx.autocast = autocast
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, tokens, lse, entropy, kept = ctx.saved_tensors
        temperature = ctx.temperature
        row_chunk, vocab_chunk = _backward_tile(
            hidden.shape[0], weight.shape[0], ctx.row_chunk, ctx.vocab_chunk
        )
        device_type, autocast_on, autocast_dtype = ctx.autocast
        h_mm, w_mm, b_mm = _matmul_operands(hidden, weight, bias, ctx.autocast)
        # Under autocast the matmuls run in its dtype on operands cast once per pass (as autocast's
        # lm-head backward would: half-precision products, gradients stored in the parameters' dtype).
        cast = w_mm is not weight
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        N, V = hidden.shape[0], weight.shape[0]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # The first row chunk writes each vocabulary tile of d weight (mm into the slice), later ones add:
        # no zero-fill and re-read of a (V, H) buffer (113 MB at a 49K x 576 head) per backward pass.
        grad_w = (torch.empty_like(weight) if N else torch.zeros_like(weight)) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        g_all = grad_out.to(lse.dtype) if grad_out is not None else torch.zeros_like(lse)
        gh_all = grad_entropy.to(lse.dtype) if grad_entropy is not None else None
        for r0 in range(0, N, row_chunk):
            r1 = min(r0 + row_chunk, N)
            h, token_ids, g = h_mm[r0:r1], tokens[r0:r1], g_all[r0:r1].unsqueeze(-1)
            row_lse = lse[r0:r1].unsqueeze(-1)
            if gh_all is not None:
                # d(g_H * H)/dz = -g_H * p * (log p + H) / T, with the row's entropy H of the forward pass
                gh, row_h = gh_all[r0:r1].unsqueeze(-1), entropy[r0:r1].unsqueeze(-1).to(lse.dtype)
            for v0 in range(0, V, vocab_chunk):
                v1 = min(v0 + vocab_chunk, V)
                if kept is not None:  # the forward's logits: a new tensor holds z - lse
                    shifted = kept[r0:r1, v0:v1] - row_lse
                else:
                    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on and not cast):
                        z = _hidden_tile(h, w_mm, b_mm, v0, v1, lse.dtype, temperature)
                    shifted = z.sub_(row_lse)
                inside = (token_ids >= v0) & (token_ids < v1)
                local = (token_ids - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
                hits = g * inside.unsqueeze(-1).to(g.dtype)
                if gh_all is None:
                    dz = _logprob_grad(shifted, g, local, hits, temperature)
                else:
                    log_p = shifted
                    p = log_p.exp()
                    dz = p.mul_(-(g + gh * (log_p + row_h)))
                    dz.scatter_add_(-1, local, hits)
                    if temperature != 1.0:
                        dz.div_(temperature)
                if cast:
                    dz_mm = dz.to(w_mm.dtype)
                    if grad_h is not None:
                        grad_h[r0:r1] += dz_mm @ w_mm[v0:v1]
                    if grad_w is not None:
                        if r0 == 0:
                            grad_w[v0:v1] = dz_mm.t() @ h
                        else:
                            grad_w[v0:v1] += dz_mm.t() @ h
                else:
                    dz = dz.to(weight.dtype)
                    if grad_h is not None:
                        grad_h[r0:r1].addmm_(dz, weight[v0:v1])
                    if grad_w is not None:
                        if r0 == 0:
                            torch.mm(dz.t(), h, out=grad_w[v0:v1])
                        else:
                            grad_w[v0:v1].addmm_(dz.t(), h)
                if grad_b is not None:
                    grad_b[v0:v1] += dz.sum(0).to(grad_b.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


#: The narrowest vocabulary tile :func:`_backward_tile` gives up columns for (more rows per tile).
_MIN_BACKWARD_VOCAB_TILE = 2048


def _backward_tile(n: int, v: int, row_chunk: int, vocab_chunk: int) -> tuple[int, int]:
    """The (rows, vocabulary) tile of :class:`_HiddenTokenLogprob`'s backward pass: as many logits as the
    forward's ``row_chunk x vocab_chunk`` tile (the memory bound the caller chose), reshaped towards more
    rows, up to all ``n``, while the vocabulary tile keeps at least :data:`_MIN_BACKWARD_VOCAB_TILE`
    columns. The weight's gradient of a tile, ``dz.T @ h``, is a product whose inner dimension is the
    tile's rows: at 128 rows it ran at ~1/3 of the machine's matmul rate (SmolLM2-135M's 49K x 576 head,
    one CPU thread), and every further row chunk re-read and re-wrote the (V, H) gradient. With 330
    response tokens the head's forward + backward took 0.83 s instead of 0.92 s (660 tokens: 1.62 s
    instead of 1.75 s; ``benchmarks/fused_head.py``, a noisy day). Only the backward's summation order
    changes; the forward's tiles, and so the log-probs, stay those of the arguments (the rollout's and the
    training's passes agree bit for bit)."""
    budget = row_chunk * vocab_chunk
    rows = min(n, max(row_chunk, budget // _MIN_BACKWARD_VOCAB_TILE))
    if rows <= row_chunk:
        return row_chunk, vocab_chunk
    columns = budget // rows  # >= the minimum tile; whole multiples of 256 where that keeps it so
    return rows, min(v, columns // 256 * 256 if columns >= 256 else columns)


def _matmul_operands(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, autocast: tuple[str, bool, torch.dtype]
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The lm-head matmuls' operands: under autocast to a dtype other than the weight's, ``hidden``,
    ``weight`` and ``bias`` cast to it once (contiguous), which is what autocast would cast every tile's
    ``weight[v0:v1].T`` to, one strided copy per tile, in the forward pass and again in the backward
    pass (on CPU in bf16 such casts took ~0.7 s of a SmolLM2-135M PPO update's 25 s of training);
    otherwise the tensors themselves. The copy of the weight lives for one pass (V x H half-precision
    values: 57 MB at SmolLM2's 49K x 576 head; an unfused head under autocast casts the same)."""
    device_type, enabled, dtype = autocast
    if not enabled or weight.dtype == dtype or not weight.is_floating_point():
        return hidden, weight, bias
    with torch.autocast(device_type, enabled=False):
        return (
            hidden.to(dtype),
            weight.to(dtype, memory_format=torch.contiguous_format),
            None if bias is None else bias.to(dtype),
        )


def _hidden_tile(
    h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, v1: int, dtype: torch.dtype, temperature: float
) -> Tensor:
    """Logits ``(h @ weight[v0:v1].T + bias[v0:v1]) / T`` of one tile, in ``dtype`` (a new tensor)."""
    w = weight[v0:v1]
    z = torch.addmm(bias[v0:v1], h, w.t()) if bias is not None else h @ w.t()
    z = z.to(dtype) if z.dtype != dtype else z
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
    keep_logits_bytes: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """:func:`logprobs_and_entropy_from_logits` of the logits ``hidden @ weight.T + bias`` (an lm head)
    without holding those logits (unless ``keep_logits_bytes`` lets small ones be kept for the backward
    pass): a fused lm head.

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
        row_chunk_size, vocab_chunk_size: tile shape (>= 1) of the forward pass; the backward pass's tiles
            hold as many logits, in more rows where there are more (at least 2,048 vocabulary columns).
        compute_dtype: dtype of the softmax arithmetic and of the results; None = ``weight``'s dtype.
        with_entropy: also return the entropy of ``softmax(logits / T)``, differentiable like the log-probs
            (an entropy bonus in the loss); else None.
        keep_logits_bytes: when a gradient will be needed and the (N, V) logits in ``compute_dtype`` take at
            most this many bytes, the forward pass keeps them (written tile by tile, as computed) and the
            backward pass reads them instead of rebuilding each tile: one lm-head matmul less (2 N V H
            FLOPs), N x V floats held from forward to backward. 0 (default): always rebuild. The log-probs
            are the same either way; the gradients differ by float rounding only (the backward's tiles
            are wider than the forward's, and a product's rounding may depend on its shape).

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
    _check_dim_int("keep_logits_bytes", keep_logits_bytes, 0)
    if isinstance(temperature, bool) or not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}.")
    if compute_dtype is not None and not compute_dtype.is_floating_point:
        raise ValueError(f"compute_dtype must be a floating dtype, got {compute_dtype}.")
    dtype = weight.dtype if compute_dtype is None else compute_dtype
    H = hidden.shape[-1]
    flat_h = hidden.reshape(-1, H)
    flat_t = tokens.reshape(-1).long()
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    logits_bytes = flat_h.shape[0] * weight.shape[0] * torch.empty((), dtype=dtype).element_size()
    out, entropy = _HiddenTokenLogprob.apply(
        flat_h,
        weight,
        bias,
        flat_t,
        float(temperature),
        row_chunk_size,
        vocab_chunk_size,
        dtype,
        with_entropy,
        needs_grad and 0 < logits_bytes <= keep_logits_bytes,
    )
    return out.reshape(tokens.shape), (entropy.reshape(tokens.shape) if with_entropy else None)


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
    dtype = _check_logits_args(logits, chunk_size, temperature, compute_dtype)
    rows = _as_rows(logits)
    if rows.shape[0] * rows.shape[1] == 0:
        return torch.zeros(logits.shape[:-1], dtype=dtype, device=logits.device)
    per_row: list[list[Tensor]] = [[] for _ in range(rows.shape[0])]
    for p, q0, q1 in _chunks(rows, chunk_size):
        x = rows[p, q0:q1].to(dtype)
        if temperature != 1.0:
            x = x / temperature
        per_row[p].append(_entropy_terms(x, torch.logsumexp(x, dim=-1)))
    return torch.stack([torch.cat(parts) for parts in per_row]).reshape(logits.shape[:-1])
