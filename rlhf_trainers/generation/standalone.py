"""Sampling from a policy outside a trainer: one completion per prompt through the generation interface.

What reward normalization (:func:`rlhf_trainers.rewards.compute_reward_normalization`) and the demo's
preference labelling (:mod:`rlhf_trainers.demo.preferences`) sample with. Both use the builtin loop from
:func:`~rlhf_trainers.generation.make_generation_backend` (no ``config``: the full distribution at a
temperature, no CPU speed switches), so nothing comes from the model's own ``generation_config``, and
ZeRO-3 partitioned weights are gathered for each call. The trainers' rollouts sample through the same
backends (:mod:`rlhf_trainers.onpolicy.rollout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .. import functional as F
from ..data.common import Prompt
from ..distributed import gathered
from .base import SamplingSettings
from .factory import make_generation_backend

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["render_prompts", "sample_completions", "sample_responses"]


def render_prompts(prompts: Sequence[Prompt], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Prompt texts for generation: strings unchanged, message lists through the chat template
    (with the generation prompt)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append(prompt)
        else:
            out.append(
                tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            )
    return out


@torch.no_grad()
def sample_completions(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    response_length: int,
    temperature: float = 1.0,
    batch_size: int = 64,
) -> list[str]:
    """Sample one completion per prompt from ``softmax(logits / temperature)`` (LHPD's settings: no top-k,
    no top-p), stopping at EOS; returns the decoded completions without special tokens.

    The samples come from the trainers' generation interface (:mod:`rlhf_trainers.generation`, the builtin
    loop), so nothing comes from the model's own ``generation_config`` either; ZeRO-3 partitioned weights
    are gathered for the call.
    """
    texts = render_prompts(prompts, tokenizer)
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    responses = sample_responses(
        policy,
        tokenizer,
        prompt_ids,
        response_length=response_length,
        temperature=temperature,
        batch_size=batch_size,
    )
    return tokenizer.batch_decode(responses, skip_special_tokens=True)


@torch.no_grad()
def sample_responses(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    *,
    response_length: int,
    temperature: float = 1.0,
    batch_size: int = 64,
) -> list[list[int]]:
    """One response per prompt (token ids), sampled as :func:`sample_completions` samples: the prompts
    left-padded, the full distribution at ``temperature``, at most ``response_length`` tokens. A response
    ends at its first EOS, which it keeps, or at the length limit; no padding is returned."""
    backend = make_generation_backend(policy, context=lambda: gathered(policy))
    settings = SamplingSettings(
        max_new_tokens=response_length,
        temperature=temperature,
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
    )
    device = next(policy.parameters()).device
    pad = tokenizer.pad_token_id
    responses: list[list[int]] = []
    for start in range(0, len(prompt_ids), batch_size):
        batch = prompt_ids[start : start + batch_size]
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        tokens = backend.sample(ids.to(device), mask.to(device), settings).tokens
        if tokenizer.eos_token_id is not None:
            tokens = F.truncate_response(tokens, tokenizer.eos_token_id, pad)
        # The lengths come from the padding the truncation wrote after EOS (the pad id may also be a
        # token the model sampled only if pad == EOS, which the truncation has already cut at).
        for row in tokens.cpu().tolist():
            end = len(row)
            while end and row[end - 1] == pad:
                end -= 1
            responses.append(row[:end])
    return responses
