"""Packed rows for padding-free forward passes: the real tokens of a padded batch, whole sequences one
after the other in a few rows, position ids restarting at 0 at each sequence and no attention mask, which
transformers reads as packed sequences (``create_causal_mask`` keeps attention within each). The on-policy
engine's passes (:func:`rlhf_trainers.onpolicy.forward.pack_sequences`) and reward-model scoring
(:func:`packed_pooled_scores`) use it, for the models that pass :func:`padding_free_matches`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .models import _base, embedding_rows


@dataclass
class PackedRows:
    """The real tokens of a (B, T) batch packed into P rows of W tokens (:func:`pack_rows`)."""

    input_ids: torch.Tensor
    """(P, W) long, the packed token ids; a row's free tail holds the pad id."""
    position_ids: torch.Tensor
    """(P, W) long, each sequence's own positions (0, 1, ...); a row's free tail counts from 0 as well, a
    sequence of its own that no real token attends to."""
    destinations: torch.Tensor
    """(B, T) long, where each real token of the batch sits in the flat P x W layout (meaningless at the
    positions that are not real tokens)."""


def pack_rows(
    input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, pad_token_id: int
) -> PackedRows:
    """Pack the real tokens (``mask`` True, (B, T)) of each row of ``input_ids``, whole and in order, into
    rows as wide as the longest of them: first fit, longest first. Rows without a real token take no room.

    Rows as wide as the longest sequence, not one row for the whole batch: without a variable-length
    attention kernel (SDPA on CPU gets the packed layout as a dense (W, W) mask) attention grows with the
    square of a row's width. Forward + backward of a 64-sequence micro-batch of the kit model: 0.17 s
    padded, 0.09 s in rows of the longest sequence, 0.50 s in one row of 2,877 tokens; SmolLM2-135M, 16
    sequences: 11.2 s padded, 6.1 s in rows of the longest sequence, 8.4-10.4 s in rows of 256 tokens to one
    row (docs/ppo.md)."""
    mask = mask.bool()
    B = input_ids.shape[0]
    lengths = mask.sum(1)
    width = max(int(lengths.max()) if B else 0, 1)
    used: list[int] = []
    row_of = [0] * B
    start_of = [0] * B
    for b in torch.argsort(lengths, descending=True, stable=True).tolist():
        n = int(lengths[b])
        if n == 0:
            break
        for r, filled in enumerate(used):
            if filled + n <= width:
                row_of[b], start_of[b] = r, filled
                used[r] += n
                break
        else:
            row_of[b], start_of[b] = len(used), 0
            used.append(n)
    used = used or [0]
    P = len(used)
    device = input_ids.device
    base = torch.tensor(row_of, device=device, dtype=torch.long) * width + torch.tensor(
        start_of, device=device, dtype=torch.long
    )
    destinations = base[:, None] + mask.long().cumsum(1) - 1
    flat_ids = input_ids.new_full((P * width,), pad_token_id)
    flat_ids[destinations[mask]] = input_ids[mask]
    column = torch.arange(width, device=device)
    filled = torch.tensor(used, device=device)
    flat_positions = (column[None, :] - filled[:, None]).clamp_min(0).reshape(-1).to(position_ids.dtype)
    flat_positions[destinations[mask]] = position_ids[mask]
    return PackedRows(
        input_ids=flat_ids.view(P, width),
        position_ids=flat_positions.view(P, width),
        destinations=destinations,
    )


def backbone_of(model: nn.Module) -> nn.Module | None:
    """The transformer under a causal-LM or sequence-classification head (under PEFT too), or None."""
    try:
        base = _base(model)
        backbone = getattr(base, base.base_model_prefix, None)
    except AttributeError:
        return None
    return backbone if isinstance(backbone, nn.Module) else None


@torch.no_grad()
def padding_free_matches(model: nn.Module) -> bool:
    """Whether the model keeps attention within the sequences of packed rows (position ids restarting at
    0, no attention mask), checked once on a probe in eval mode: four sequences packed two by two into two
    rows (the layout of :func:`pack_sequences`) must give the final hidden states each gives alone.
    Models whose attention masks are not built from the position ids (transformers' ``create_causal_mask``)
    would let a row's second sequence attend to its first and fail it, and so does transformers' flash
    attention, which reads packed sequences from the position ids of a single row only; their passes stay
    padded."""
    backbone = backbone_of(model)
    if backbone is None:
        return False
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return False
    rows = embedding_rows(model)
    lengths = ((4, 5), (3, 6))
    sequences = [
        [(torch.arange(n, device=device) * 7 + 3 * i + j + 1) % max(rows, 1) for j, n in enumerate(row)]
        for i, row in enumerate(lengths)
    ]
    ids = torch.stack([torch.cat(row) for row in sequences])
    positions = torch.stack([torch.cat([torch.arange(n, device=device) for n in row]) for row in lengths])
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        alone = torch.stack(
            [
                torch.cat(
                    [backbone(input_ids=seq[None], use_cache=False).last_hidden_state[0] for seq in row]
                )
                for row in sequences
            ]
        )
        packed = backbone(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    except Exception:  # any failure means: keep the padded passes
        return False
    finally:
        for module, training in modes:  # each submodule's own mode back, as it was
            module.training = training
    if packed.shape != alone.shape:
        return False
    # fp32 rounding is ~1e-6 of the scale, half precision's ~1e-2; attention leaking across the sequences
    # changes the second ones' states by a large fraction of it.
    tolerance = 1e-3 if alone.dtype == torch.float32 else 3e-2
    alone, packed = alone.float(), packed.float()
    scale = float(alone.abs().max()) + 1e-6
    return float((packed - alone).abs().max()) <= tolerance * scale


def packed_score_head(model: nn.Module) -> nn.Linear | None:
    """The head of a one-label sequence-classification model when it is a plain ``nn.Linear`` applied to
    each hidden state (Llama's, GPT-2's, GPT-NeoX's ``score``), so that it can be applied to the gathered
    last tokens of packed rows; None otherwise (heads that pool or transform first keep padded scoring)."""
    from .models import find_score_head

    try:
        name, head = find_score_head(model)
    except ValueError:
        return None
    return head if getattr(_base(model), name, None) is head and type(head) is nn.Linear else None


@torch.no_grad()
def packed_pooled_scores(
    model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int
) -> torch.Tensor:
    """Pooled logits (B, num_labels) of a sequence-classification model that passes
    :func:`padding_free_matches` and has a :func:`packed_score_head`: each row's real tokens (``mask``,
    either padding side) packed (:func:`pack_rows`), the head applied to the final hidden state of each
    row's last real token, as the padded model reads it. Every row must hold a real token."""
    mask = mask.bool()
    positions = (mask.long().cumsum(1) - mask.long()).masked_fill(~mask, 0)
    rows = pack_rows(input_ids, mask, positions, pad_token_id)
    backbone = backbone_of(model)
    head = packed_score_head(model)
    assert backbone is not None and head is not None, "a model that packed_score_head accepts"
    hidden = backbone(
        input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False
    ).last_hidden_state
    last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)
    index = rows.destinations[torch.arange(mask.shape[0], device=mask.device), last]
    return head(hidden.reshape(-1, hidden.shape[-1])[index])
