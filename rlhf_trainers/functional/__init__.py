"""Pure tensor math of online RLHF (PPO / RLOO), with the details of the reference implementations
spelled out.

Nothing here knows about models, processes or files: every function takes tensors (and masks) and
returns tensors, so each detail can be tested against the numbers printed in the sources (LHPD, the
``n-implementation-details-of-rlhf-with-ppo`` write-up of OpenAI's lm-human-preferences; the RLOO blog;
the NeMo RL PPO guide).  Every public name is importable from this package, e.g.
``rlhf_trainers.functional.whiten``; the modules below only group them by subject.

Conventions
-----------
* Shapes: ``B`` batch (sequences), ``T`` tokens per sequence, ``V`` vocabulary, ``R`` response length.
* Masks may be ``bool`` or 0/1 integer/float tensors; any nonzero entry counts as valid.  Values at
  masked positions are never read arithmetically (they are selected away with ``torch.where``, not
  multiplied by 0), so padding that holds ``inf``/``NaN`` garbage cannot leak into valid tokens.
* Reductions run in at least float32 (float64 stays float64); results are returned in the input's
  floating dtype unless a function says otherwise.  bf16/fp16 inputs are upcast for the arithmetic.
* Empty or fully masked selections never produce NaN: means, variances and losses are 0 there.
* No function modifies its inputs in place.

Layout
------
The math of the reference implementations:

:mod:`~rlhf_trainers.functional.stats` -- masked statistics
    :func:`masked_mean`, :func:`masked_var`, :func:`masked_moments`, :func:`whiten`
    (all accept ``all_reduce=`` to make the statistics global across data-parallel ranks),
    :func:`explained_variance`.
:mod:`~rlhf_trainers.functional.kl` -- KL
    :func:`kl_penalty` (k1/k2/k3/abs estimators), :class:`AdaptiveKLController`,
    :class:`FixedKLController`.
:mod:`~rlhf_trainers.functional.advantages` -- advantages
    :func:`gae_advantages` (carry-forward masking, decoupled and length-adaptive lambda),
    :func:`rloo_advantages` (leave-one-out baseline, optionally over the valid completions only),
    :func:`group_advantages` (GRPO's group-normalized advantages, ``scale_rewards``),
    :func:`reinforce_plus_plus_advantages` (REINFORCE++, with and without the group baseline).
:mod:`~rlhf_trainers.functional.responses` -- responses
    :func:`first_true_indices`, :func:`last_true_indices`, :func:`truncate_response`,
    :func:`stop_token_found`, :func:`apply_rejection_penalty`, :func:`position_ids_from_mask`.
:mod:`~rlhf_trainers.functional.reward_shaping` -- reward scaling, shaping and normalization
    :func:`scale_rewards`, :func:`overlong_penalty`, :func:`normalize_rewards_gain_bias`.
:mod:`~rlhf_trainers.functional.losses` -- losses
    :func:`clipped_policy_loss`, :func:`clipped_value_loss`, :func:`truncated_importance_weights`.
:mod:`~rlhf_trainers.functional.registry` -- advantage estimators and policy losses by name
    :func:`register_advantage_estimator`, :func:`register_policy_loss` (decorators),
    :func:`get_advantage_estimator`, :func:`get_policy_loss`, :class:`AdvantageInputs`.

Apart from it, how log-probabilities are computed without large temporaries:

:mod:`~rlhf_trainers.functional.logprob_kernels` -- log-probabilities and entropy
    :func:`logprobs_from_logits`, :func:`entropy_from_logits`, :func:`logprobs_and_entropy_from_logits`
    (chunked, never materialise the full log-softmax); :func:`logprobs_and_entropy_from_hidden` (a fused
    lm head: never materialises the logits).  Custom autograd functions with chunked backward passes.
"""

from __future__ import annotations

from .advantages import (
    SCALE_REWARDS,
    gae_advantages,
    group_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from .logprob_kernels import (
    entropy_from_logits,
    logprobs_and_entropy_from_hidden,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
)
from .losses import (
    IMPORTANCE_SAMPLING_MODES,
    LOSS_AGG_MODES,
    clipped_policy_loss,
    clipped_value_loss,
    truncated_importance_weights,
)
from .registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from .responses import (
    REJECTION_MODES,
    apply_rejection_penalty,
    first_true_indices,
    last_true_indices,
    position_ids_from_mask,
    stop_token_found,
    truncate_response,
)
from .reward_shaping import normalize_rewards_gain_bias, overlong_penalty, scale_rewards
from .stats import explained_variance, masked_mean, masked_moments, masked_var, whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IMPORTANCE_SAMPLING_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "REJECTION_MODES",
    "SCALE_REWARDS",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "apply_rejection_penalty",
    "clipped_policy_loss",
    "clipped_value_loss",
    "entropy_from_logits",
    "explained_variance",
    "first_true_indices",
    "gae_advantages",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_advantages",
    "kl_penalty",
    "last_true_indices",
    "logprobs_and_entropy_from_hidden",
    "logprobs_and_entropy_from_logits",
    "logprobs_from_logits",
    "masked_mean",
    "masked_moments",
    "masked_var",
    "normalize_rewards_gain_bias",
    "overlong_penalty",
    "position_ids_from_mask",
    "register_advantage_estimator",
    "register_policy_loss",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "scale_rewards",
    "stop_token_found",
    "truncate_response",
    "truncated_importance_weights",
    "whiten",
]
