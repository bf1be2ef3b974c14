"""Responses: stop-token truncation, the rejection-sampling test and penalty, first/last true indices
and position ids that skip left padding."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._common import _check_dim_int

__all__ = [
    "REJECTION_MODES",
    "apply_rejection_penalty",
    "first_true_indices",
    "last_true_indices",
    "position_ids_from_mask",
    "stop_token_found",
    "truncate_response",
]

#: Valid ``mode`` names of :func:`apply_rejection_penalty`.
REJECTION_MODES = ("replace", "subtract")


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

    LHPD's token truncation: "truncate at the first occurrence of truncate_token that appears at or
    after position truncate_after"; OpenAI's comment: "replace all tokens after truncate_token with
    padding_token".  The stop token itself is kept.  Rows without such a stop token are unchanged.

    Args:
        responses: (B, R) generated token ids (response part only).
        stop_token_id: the stop token (e.g. EOS or LHPD's period), or several ids (any of them stops).
        pad_token_id: the id written after the stop token.  It may equal the stop token id; the
            truncation is still idempotent.
        truncate_after: only stop tokens at index >= this count (LHPD uses 16 with a period).

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

    LHPD's rejection-sampling test ("ensure that the sample contains truncate_token"); feed the
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

    * ``"replace"``: their score becomes ``penalty`` -- LHPD's rejection sampling, "we penalize
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

    LHPD, "Adjust position indices correspondingly for padding tokens": with left
    padding the first real token must get position 0, e.g. mask ``[0, 0, 1, 1, 1, 1]`` gives
    ``[0, 0, 0, 1, 2, 3]`` (padding positions are 0 and masked out anyway).

    Args:
        attention_mask: (B, T), bool or 0/1.

    Returns:
        (B, T) long.
    """
    m = (attention_mask != 0).long()
    return m.cumsum(-1) - m
