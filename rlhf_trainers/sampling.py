"""The rollout's sampling loop: ancestral sampling from ``softmax(logits / temperature)`` with a KV cache.

Why not ``model.generate()``: ``generate`` fills every sampling setting that its ``GenerationConfig``
leaves unset from the model's own ``generation_config.json`` (a ``repetition_penalty``, a
``no_repeat_ngram_size``, ``suppress_tokens``...), so a Hub checkpoint can silently sample from another
distribution than the one the trainer's forward passes score, and the rollout is off-policy without a
trace. This loop samples from exactly the distribution the log-probs describe, and it can return the
log-probability and entropy of each sampled token from the logits it already has, which spares the
rollout a separate forward pass of the policy (``rollout_logprobs``). Its draws are those of
``generate(do_sample=True, top_k=0, top_p=1.0, temperature=...)`` for the same seed (the same
``softmax`` and ``torch.multinomial`` calls, in the same order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["Samples", "sample_completions"]


class Samples(NamedTuple):
    """What :func:`sample_completions` returns; ``n <= max_new_tokens`` columns (fewer when every row
    stopped early)."""

    #: (B, n) sampled token ids; ``pad_token_id`` after a row's stop token.
    tokens: torch.Tensor
    #: (B, n) float32 log-probability of each sampled token under ``softmax(logits / temperature)``, or
    #: None; 0 after a row's stop token.
    logprobs: torch.Tensor | None
    #: (B, n) float32 entropy of that distribution at each step, or None; 0 after a row's stop token.
    entropy: torch.Tensor | None


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    pad_token_id: int,
    stop_token_ids: Sequence[int] = (),
    return_logprobs: bool = False,
) -> Samples:
    """Sample up to ``max_new_tokens`` tokens after each (left-padded) prompt row.

    Args:
        model: a causal LM (a ``transformers`` model or a PEFT model around one) whose forward accepts
            ``attention_mask``, ``position_ids``, ``past_key_values``, ``use_cache`` and ``logits_to_keep``.
            Run it in eval mode (dropout off) for draws that match the trainer's forward passes.
        input_ids: (B, T) prompt ids; padding on the left.
        attention_mask: (B, T), 1 at real prompt tokens.
        max_new_tokens: tokens to sample per row.
        temperature: the logits are divided by it (> 0).
        pad_token_id: written after a row's stop token.
        stop_token_ids: a row stops after sampling one of these (it is kept); empty: every row samples
            ``max_new_tokens`` tokens, stop tokens like any other.
        return_logprobs: also return each sampled token's log-probability and the entropy of each step's
            distribution (float32, from the same logits; costs one log-softmax over the vocabulary per
            step).

    Returns:
        :class:`Samples`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    mask = attention_mask.long()
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    next_position = mask.sum(1, keepdim=True)
    stops = torch.tensor(list(stop_token_ids), dtype=input_ids.dtype, device=input_ids.device)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    for step in range(max_new_tokens):
        # float32, as generate() does before its logits processors.
        scores = out.logits[:, -1, :].to(dtype=torch.float32, copy=True)
        if temperature != 1.0:
            scores = scores / temperature
        probs = torch.softmax(scores, dim=-1)
        token = torch.multinomial(probs, num_samples=1).squeeze(1)
        token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
        tokens.append(token)
        if return_logprobs:
            logp = torch.log_softmax(scores, dim=-1)
            chosen = logp.gather(1, token[:, None]).squeeze(1)
            entropy = -(probs * logp).nan_to_num().sum(-1)  # 0 * -inf at masked-out tokens counts 0
            logprobs.append(torch.where(unfinished, chosen, torch.zeros_like(chosen)))
            entropies.append(torch.where(unfinished, entropy, torch.zeros_like(entropy)))
        if stops.numel():
            unfinished = unfinished & ~torch.isin(token, stops)
            if not bool(unfinished.any()):
                break
        if step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=next_position,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        next_position = next_position + 1
    return Samples(
        torch.stack(tokens, dim=1),
        torch.stack(logprobs, dim=1) if return_logprobs else None,
        torch.stack(entropies, dim=1) if return_logprobs else None,
    )
