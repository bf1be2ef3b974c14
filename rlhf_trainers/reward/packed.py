"""Padding-free passes of :class:`~rlhf_trainers.RewardTrainer` (``RewardConfig.padding_free``): the real
tokens of a batch's 2B sequences packed (:func:`rlhf_trainers.packing.pack_rows`), one forward pass of the
whole model (through its DDP / DeepSpeed wrapper, so gradients are reduced as for a padded pass), the
score head's per-token output read at each sequence's last real token.

The packed layouts, the probes that decide whether a model keeps packed sequences apart and the one-row
attention are :mod:`rlhf_trainers.packing`'s, shared with the on-policy trainers and reward scoring."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models import _base, embedding_rows, score_head_module
from ..packing import (
    attention_head_size,
    one_row_fits,
    pack_rows,
    packed_context,
    packed_score_head,
    packing_layout,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardPacking:
    """How a reward model's passes are packed (:func:`resolve_reward_packing`)."""

    one_row: bool
    """All real tokens of a batch in a single row (:func:`rlhf_trainers.packing.one_row_attention`), else
    rows as wide as the longest sequence. A training pass under gradient checkpointing always takes rows
    (its recomputed forward runs outside the one-row attention)."""
    fill_id: int
    """The id the free tails of packed rows hold: any id of the embedding table but the model's
    ``config.pad_token_id`` (a pad id at a row's end without an attention mask makes transformers warn);
    their outputs are never read."""


def per_token_linear_head(model: nn.Module) -> bool:
    """Whether the model's score head is a plain ``nn.Linear`` applied to each hidden state
    (:func:`rlhf_trainers.packing.packed_score_head`), also when PEFT wraps it for training
    (``modules_to_save``: the wrapper's copies are such heads)."""
    if packed_score_head(model) is not None:
        return True
    try:
        _, module = score_head_module(model)
    except ValueError:
        return False
    original = getattr(module, "original_module", None)
    return type(original) is nn.Linear


def resolve_reward_packing(
    model: nn.Module, device: torch.device, dtype: torch.dtype | None, zero3: bool
) -> RewardPacking | None:
    """The packing of ``model``'s passes, or None where they stay padded, with an info line saying why:
    under DeepSpeed ZeRO-3 (not tried with packing), a model that fails both probes of
    :func:`rlhf_trainers.packing.packing_layout`, or a score head that is not a per-token linear layer
    (:func:`per_token_linear_head`). ``dtype``: the mixed-precision dtype (bf16/fp16) if any, else the
    model's own is used; with ``device`` it decides between one row and rows
    (:func:`rlhf_trainers.packing.one_row_fits`)."""
    name = type(_base(model)).__name__
    if zero3:
        logger.info("padding_free: not under DeepSpeed ZeRO-3; the reward model's passes stay padded.")
        return None
    if not per_token_linear_head(model):
        logger.info(
            "padding_free: the reward model's (%s) score head is not a linear layer applied to every token; "
            "its passes stay padded.",
            name,
        )
        return None
    layout = packing_layout(model)
    if layout is None:
        logger.info(
            "padding_free: the reward model (%s) does not keep attention within packed sequences (checked "
            "on a probe at construction); its passes stay padded.",
            name,
        )
        return None
    dtype = dtype or next(model.parameters()).dtype
    one_row = layout == "one_row" and one_row_fits(device, dtype, attention_head_size(model))
    pad = getattr(_base(model).config, "pad_token_id", None)
    rows = embedding_rows(model)
    fill = 1 if pad == 0 and rows > 1 else 0
    return RewardPacking(one_row=one_row, fill_id=fill)


def gradient_checkpointing_on(model: nn.Module) -> bool:
    """Whether any module of ``model`` recomputes its forward in the backward pass."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def packed_reward_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packing: RewardPacking,
    *,
    call: Any = None,
    one_row: bool | None = None,
) -> torch.Tensor:
    """Pooled logits (N, num_labels) of a sequence-classification model for a padded batch (N, T), from one
    packed pass: the real tokens (``attention_mask``, either padding side; every row must hold one) packed,
    the whole model called on them (``call``: its DDP / DeepSpeed wrapper, default ``model``) without an
    attention mask, and its score head's per-token output (a forward hook) taken at each row's last real
    token: the value the padded pass pools there, up to float rounding. Differentiable.

    ``one_row``: overrides ``packing.one_row`` (False for a training pass under gradient checkpointing)."""
    call = call if call is not None else model
    mask = attention_mask.bool()
    if not bool(mask.any(1).all()):
        raise ValueError("packed_reward_logits: every sequence of the batch needs a real token.")
    positions = (mask.long().cumsum(1) - mask.long()).masked_fill(~mask, 0)
    rows = pack_rows(
        input_ids,
        mask,
        positions,
        packing.fill_id,
        one_row=packing.one_row if one_row is None else one_row,
    )
    _, head = score_head_module(model)
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _module, _args, output: captured.append(output))
    config = _base(model).config
    # transformers refuses several rows without config.pad_token_id; the pooled output is not used.
    unset = getattr(config, "pad_token_id", None) is None
    try:
        if unset:
            config.pad_token_id = packing.fill_id
        with packed_context(model, rows.segments):
            call(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False)
    finally:
        handle.remove()
        if unset:
            config.pad_token_id = None
    per_token = captured[-1] if captured else None
    if not isinstance(per_token, torch.Tensor) or per_token.shape[:2] != rows.input_ids.shape:
        raise ValueError(
            f"padding_free: the score head of {type(_base(model)).__name__} gave "
            f"{None if per_token is None else tuple(per_token.shape)} for packed rows of shape "
            f"{tuple(rows.input_ids.shape)}, not one output per token; set padding_free=False."
        )
    last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)
    index = rows.destinations[torch.arange(mask.shape[0], device=mask.device), last]
    return per_token.reshape(-1, per_token.shape[-1])[index]
