"""Scoring text with a reward model, and the seed's reward normalization.

N-implementation-details, "Reward model normalization before and after": sample completions from the
reference (pretrained) policy, score them, and choose a gain ``g`` and bias ``b`` so that
``raw * g + b`` has the target mean and std (0 and 1 in the seed). The gain and bias live in the
reward model's config (:mod:`rlhf_trainers.models`) and are applied wherever the model scores.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import functional as F
from .models import get_reward_normalization

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Prompt = str | list[dict[str, str]]


def _full_params(*models: Any):
    """Gather ZeRO-3 partitioned weights for a forward/generate outside the DeepSpeed engine."""
    params = [p for m in models for p in m.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


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


def join_prompt_completion(prompt: Prompt, completion: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """The text a reward model scores: ``prompt + completion``, or for chat prompts the conversation
    with the completion as the assistant's message, rendered by ``tokenizer``'s chat template."""
    if isinstance(prompt, str):
        return prompt + completion
    messages = [*list(prompt), {"role": "assistant", "content": completion.strip()}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


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
    """Sample one completion per prompt with the seed's settings (top-k 0, top-p 1, ``temperature``),
    stopping at EOS; returns the decoded completions without special tokens."""
    texts = render_prompts(prompts, tokenizer)
    device = next(policy.parameters()).device
    completions: list[str] = []
    was_training = policy.training
    policy.eval()
    with _full_params(policy):
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(
                texts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=False,
            ).to(device)
            out = policy.generate(
                **enc,
                max_new_tokens=response_length,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            response = F.truncate_response(
                out[:, enc["input_ids"].shape[1] :], tokenizer.eos_token_id, tokenizer.pad_token_id
            )
            completions += tokenizer.batch_decode(response, skip_special_tokens=True)
    policy.train(was_training)
    return completions


@torch.no_grad()
def score_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    batch_size: int = 64,
    max_length: int | None = None,
    add_eos: bool = True,
    normalize: bool = True,
    forward: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """Rewards (N,) float32 of full texts (prompt + completion), read at the last real token.

    The texts are tokenized as the reward trainer tokenizes its pairs (EOS appended when missing if
    ``add_eos``, the start cut when longer than ``max_length``). With ``normalize`` the stored gain and
    bias are applied. ``forward`` replaces ``model.__call__`` (e.g. a DeepSpeed engine).
    """
    device = next(model.parameters()).device
    gain, bias = get_reward_normalization(model) if normalize else (1.0, 0.0)
    call = forward or model
    gather = _full_params(model) if forward is None else contextlib.nullcontext()
    with gather:
        scores = _score_batches(call, tokenizer, texts, batch_size, max_length, add_eos, device)
    raw = torch.cat(scores) if scores else torch.zeros(0)
    return raw * gain + bias


def _score_batches(
    call: Callable[..., Any],
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    batch_size: int,
    max_length: int | None,
    add_eos: bool,
    device: torch.device,
) -> list[torch.Tensor]:
    eos = tokenizer.eos_token_id
    scores = []
    for start in range(0, len(texts), batch_size):
        ids = tokenizer(list(texts[start : start + batch_size]), add_special_tokens=False)["input_ids"]
        if add_eos:
            ids = [x if x and x[-1] == eos else [*x, eos] for x in ids]
        if max_length is not None:
            ids = [x[-max_length:] for x in ids]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(ids), width), dtype=torch.long)
        for row, x in enumerate(ids):
            input_ids[row, : len(x)] = torch.tensor(x)
            attention[row, : len(x)] = 1
        logits = call(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
        scores.append(logits[:, 0].float().cpu())
    return scores


def compute_reward_normalization(
    reward_model: PreTrainedModel,
    reward_tokenizer: PreTrainedTokenizerBase,
    policy: PreTrainedModel,
    policy_tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    num_samples: int = 1024,
    response_length: int = 53,
    temperature: float = 1.0,
    batch_size: int = 64,
    target_mean: float = 0.0,
    target_std: float = 1.0,
    max_length: int | None = None,
    add_eos: bool = True,
    rank: int = 0,
    world_size: int = 1,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    forward: Callable[..., Any] | None = None,
) -> tuple[float, float, torch.Tensor]:
    """Gain and bias that give rewards of reference-policy samples the target mean and std.

    ``num_samples`` prompts are drawn in order from ``prompts`` (cycling when fewer), split between the
    ``world_size`` processes (every process runs the same number of batches, as ZeRO-3 requires), one
    completion sampled per prompt from ``policy``, scored raw by ``reward_model``, and the statistics
    summed over processes with ``all_reduce``.

    Returns:
        ``(gain, bias, raw_scores_of_this_process)``.
    """
    if len(prompts) == 0:
        raise ValueError("reward normalization needs prompts, got none.")
    per_rank = math.ceil(num_samples / world_size)
    picked = [prompts[(rank + i * world_size) % len(prompts)] for i in range(per_rank)]
    completions = sample_completions(
        policy,
        policy_tokenizer,
        picked,
        response_length=response_length,
        temperature=temperature,
        batch_size=batch_size,
    )
    texts = [join_prompt_completion(p, c, reward_tokenizer) for p, c in zip(picked, completions, strict=True)]
    raw = score_texts(
        reward_model,
        reward_tokenizer,
        texts,
        batch_size=batch_size,
        max_length=max_length,
        add_eos=add_eos,
        normalize=False,
        forward=forward,
    )
    gain, bias = F.normalize_rewards_gain_bias(raw, target_mean, target_std, all_reduce=all_reduce)
    return gain, bias, raw
