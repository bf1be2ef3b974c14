"""Reward sources: everything that scores a rollout's completions, behind one protocol.

A reward source (:class:`RewardSource`) has a ``name`` and a ``score(batch)`` method that takes a
:class:`RewardBatch` (prompts, decoded completions, the policy's token ids, the other dataset columns) and
returns one float per completion (NaN: no reward). The implementations:

- :class:`RewardModelSource`: a one-label sequence-classification reward model, scoring the policy's token
  ids when it shares the policy's tokenizer and the re-tokenized text otherwise (:func:`score_ids`,
  :func:`score_texts`);
- :class:`RewardFunctionSource`: a Python function ``f(prompts=..., completions=..., **columns)`` (its
  signature inspected, the columns it names passed, its failures handled per :data:`REWARD_ERROR_MODES`);
- the RLVR graders of :mod:`rlhf_trainers.rewards.rlvr` (:func:`~rlhf_trainers.rewards.rlvr.reward_source`);
- any class of yours with a ``name`` and a ``score`` method.

:class:`RewardSources` combines them with weights; the on-policy trainers (PPO, RLOO, GRPO) build one from
their ``reward_model``, ``reward_funcs`` and ``reward_weights`` arguments and log each source as
``objective/scores/<name>``. LHPD's reward normalization is :func:`compute_reward_normalization`. The reward
model *trainer* is :mod:`rlhf_trainers.reward`.
"""

from ..data.common import Prompt
from .base import RewardBatch, RewardSource, is_reward_source
from .functions import REWARD_ERROR_MODES, RewardFunc, RewardFunctionSource
from .model import RewardModelSource, join_prompt_completion, score_ids, score_texts
from .normalization import compute_reward_normalization
from .sources import RewardSources, split_reward_funcs

__all__ = [
    "REWARD_ERROR_MODES",
    "Prompt",
    "RewardBatch",
    "RewardFunc",
    "RewardFunctionSource",
    "RewardModelSource",
    "RewardSource",
    "RewardSources",
    "compute_reward_normalization",
    "is_reward_source",
    "join_prompt_completion",
    "score_ids",
    "score_texts",
    "split_reward_funcs",
]
