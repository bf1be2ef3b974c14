"""LHPD's reward normalization (the lm-human-preferences details, "Reward model normalization before and
after"): sample completions from the reference (pretrained) policy, score them, and choose a gain ``g`` and
bias ``b`` so that ``raw * g + b`` has the target mean and std (0 and 1 in LHPD). The gain and bias live in
the reward model's config (:mod:`rlhf_trainers.models`) and are applied wherever the model scores
(:func:`~rlhf_trainers.rewards.score_ids`, :func:`~rlhf_trainers.rewards.score_texts`). The samples come
from the one sampling path outside the trainers, :func:`rlhf_trainers.generation.sample_completions`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import functional as F
from ..data.common import Prompt
from ..generation.standalone import sample_completions
from .model import join_prompt_completion, score_texts

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["compute_reward_normalization"]


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
