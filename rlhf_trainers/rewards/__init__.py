"""Reward sources: everything that scores a rollout's completions, behind one protocol.

A reward source (:class:`RewardSource`) has a ``name`` and a ``score(batch)`` method that takes a
:class:`RewardBatch` (prompts, decoded completions, the policy's token ids, the other dataset columns) and
returns one float per completion (NaN: no reward). The implementations:

- :class:`RewardModelSource`: a one-label sequence-classification reward model, scoring the policy's token
  ids when it shares the policy's tokenizer and the re-tokenized text otherwise (:func:`score_ids`,
  :func:`score_texts`);
- :class:`RewardFunctionSource`: a Python function, sync or async, called as TRL 1.16 calls reward
  functions: ``f(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
  log_metric=..., **columns)``, the completions as assistant messages for conversational prompts (its
  signature inspected, the arguments it names passed, its failures handled per :data:`REWARD_ERROR_MODES`;
  what it logs collected in a :class:`RewardLog`);
- the RLVR graders of :mod:`rlhf_trainers.rewards.rlvr` (:func:`~rlhf_trainers.rewards.rlvr.reward_source`);
- any class of yours with a ``name`` and a ``score`` method.

:class:`RewardSources` combines them with weights; the on-policy trainers (PPO, RLOO, GRPO) build one from
their ``reward_model``, ``reward_funcs`` and ``reward_weights`` arguments and log each source as
``objective/scores/<name>``. TRL 1.16's ready-made reward functions (``trl.rewards``: :func:`accuracy_reward`,
:func:`reasoning_accuracy_reward`, :func:`think_format_reward`, :func:`get_cosine_scaled_reward`,
:func:`get_soft_overlong_punishment`, :func:`get_repetition_penalty_reward`) are in
:mod:`rlhf_trainers.rewards.library`, exported here. LHPD's reward normalization is :func:`compute_reward_normalization`. The reward
model *trainer* is :mod:`rlhf_trainers.reward`.
"""

from ..data.common import Prompt
from .base import RewardBatch, RewardLog, RewardSource, is_reward_source
from .functions import (
    REWARD_ERROR_MODES,
    REWARD_FUNC_ARGS,
    RewardFunc,
    RewardFunctionSource,
    is_async_reward_func,
)
from .library import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)
from .model import RewardModelSource, join_prompt_completion, score_ids, score_texts
from .normalization import compute_reward_normalization
from .sources import RewardSources, split_reward_funcs

__all__ = [
    "REWARD_ERROR_MODES",
    "REWARD_FUNC_ARGS",
    "Prompt",
    "RewardBatch",
    "RewardFunc",
    "RewardFunctionSource",
    "RewardLog",
    "RewardModelSource",
    "RewardSource",
    "RewardSources",
    "accuracy_reward",
    "compute_reward_normalization",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "is_async_reward_func",
    "is_reward_source",
    "join_prompt_completion",
    "reasoning_accuracy_reward",
    "score_ids",
    "score_texts",
    "split_reward_funcs",
    "think_format_reward",
]
