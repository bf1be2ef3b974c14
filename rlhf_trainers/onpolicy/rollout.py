"""The typed data of one on-policy update: a :class:`Rollout` (one batch of experience) and what is
built on the way to it and from it.

Rows: N = prompts x ``completions_per_prompt`` (k). The single-turn producer repeats the prompt batch of
B prompts k times, so completion j of prompt i sits at row ``j * B + i`` (the RLOO blog's layout; k = 1
for PPO); every row also names its prompt group (``Rollout.group_ids``). Columns: Q prompt tokens
(left-padded) and R = ``response_length`` response tokens (right-padded).

Who builds what: a rollout producer (:mod:`~rlhf_trainers.onpolicy.producer`) builds
:class:`SampledResponses`, :class:`Scores`, :class:`ForwardPasses` and the :class:`Rollout`; the
algorithm's objective the :class:`Advantages`; the optimization loop the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..rewards import RewardLog


@dataclass
class SampledResponses:
    """Responses sampled for a batch of prompts (step 2), cut after the stop token."""

    query: torch.Tensor
    """(N, Q) left-padded prompt ids."""
    query_mask: torch.Tensor
    """(N, Q) bool, True at prompt tokens."""
    response: torch.Tensor
    """(N, R) response ids; the pad token after a row's stop token (at index >= ``truncate_after``)."""
    response_mask: torch.Tensor
    """(N, R) bool, True at the response's tokens (up to and including its stop token)."""
    lengths: torch.Tensor
    """(N,) long, valid response tokens per row (a row without a stop token keeps all R)."""
    prompts: list[Any]
    """N prompts (text or chat messages) as the reward functions receive them."""
    columns: dict[str, list[Any]]
    """The dataset's other columns, N values each, passed to the reward functions."""
    generation_logprobs: torch.Tensor | None = None
    """(N, R) float32 log-probs of the sampled tokens as the sampling loop computed them (0 after a stop
    token, padding not masked); None unless asked for."""
    generation_entropy: torch.Tensor | None = None
    """(N, R) float32 entropy of each sampling step's distribution; None unless asked for."""
    loss_mask: torch.Tensor | None = None
    """(N, R) bool, the response tokens the policy wrote (a multi-turn producer's: not the tool results it
    inserted); None: all of ``response_mask``."""
    conversations: list[list[dict[str, Any]]] | None = None
    """N conversations of the completion (assistant and tool messages, TRL's ``completions`` of a tool
    run), given to the reward functions instead of the decoded text; None for single-turn samples."""
    extra_metrics: dict[str, list[float]] | None = None
    """Values a producer logs beside the update's metrics (e.g. ``tools/call_frequency``), by name; each
    is logged as its mean over all processes."""


@dataclass
class Scores:
    """What the reward sources say about :class:`SampledResponses` (step 3)."""

    completions: list[Any]
    """N decoded responses (special tokens skipped), what the reward functions scored; for a tool episode
    its conversation (assistant and tool messages), what the sample tables show."""
    total: torch.Tensor
    """(N,) weighted sum of the reward sources, before shaping; NaN where a function gave no reward."""
    per_source: dict[str, torch.Tensor]
    """(N,) score of each reward source, by name."""
    found_stop: torch.Tensor
    """(N,) bool, whether the response has a stop token (at index >= ``truncate_after``); all True
    without a stop token."""
    reward_func_errors: torch.Tensor
    """() float, the reward-function calls that raised (``reward_func_errors='nan'``) in this batch."""
    dynamic_sampling: torch.Tensor | None = None
    """(3,) DAPO's dynamic sampling on this process: rounds, groups dropped, groups that still had to
    fill the batch; None when it is off."""
    reward_log: RewardLog | None = None
    """What the reward functions logged while scoring (``log_metric``, ``log_extra``); None when no
    reward source can log (``RewardSources.may_log``, the same on every process)."""


@dataclass
class FirstMicroBatch:
    """The optimization loop's first micro-batch (epoch 0, mini-batch 0), known before the loop runs (step 3
    of the update, ``rollout_values='auto'``)."""

    rows: torch.Tensor
    """(M,) long, on the host: its rollout rows, in the loop's order."""
    bounds: tuple[int, int]
    """The columns its forward pass covers (first prompt column, end of the response columns)."""
    last: bool
    """Whether it is also its mini-batch's last micro-batch (gradients synchronised at its backward)."""


@dataclass
class HeldForward:
    """A training forward pass run ahead of its backward pass (step 3 of the update,
    ``rollout_values='auto'``): the loop's first micro-batch, whose values are the rollout's for its rows."""

    rows: torch.Tensor
    """(M,) long, on the host: the rollout rows of the micro-batch, in the loop's order."""
    logprobs: torch.Tensor
    """(M, R) log-probs with gradient."""
    values: torch.Tensor
    """(M, R) float32 values with gradient."""
    entropy: torch.Tensor
    """(M, R) entropy (with gradient where the loss reads it)."""


@dataclass
class ForwardPasses:
    """The no-grad forward passes of a rollout (the producer's step d), (N, R) each, 0 at masked response positions."""

    logprobs: torch.Tensor
    """float32 log-probs of the response under the policy (logits / temperature): the 'old' log-probs
    of the clipped ratio."""
    entropy: torch.Tensor | None
    """float32 entropy of the policy's distribution at each response position (a metric); None where the
    log-probs are vLLM's (``rollout_logprobs='generation'`` with ``use_vllm``), which gives no entropies."""
    ref_logprobs: torch.Tensor
    """log-probs of the response under the reference model (the policy without adapter under PEFT); the
    policy's own when no KL term reads a reference (``uses_reference_model`` False)."""
    values: torch.Tensor | None
    """float32 V(s_t) of the value model at each response position (PPO); None without one."""


@dataclass
class Rollout:
    """One update's experience on this process: N rows of (prompt, response), see the module docstring
    for the row layout. Built by a rollout producer (:mod:`~rlhf_trainers.onpolicy.producer`); read by the
    objective's advantages and loss, and the metrics."""

    query: torch.Tensor
    """(N, Q) left-padded prompt ids."""
    query_mask: torch.Tensor
    """(N, Q) bool, True at prompt tokens."""
    response: torch.Tensor
    """(N, R) response ids, the pad token after the stop token."""
    response_mask: torch.Tensor
    """(N, R) bool, the tokens that take part in the update: the response's tokens, in rows whose reward
    is finite (``valid_rows``)."""
    lengths: torch.Tensor
    """(N,) long, response tokens up to and including the stop token."""
    logprobs: torch.Tensor
    """(N, R) float32 policy log-probs at sampling time (the ratio's denominator): the trainer's forward
    pass, the sampling loop's own, or vLLM's (``rollout_logprobs``)."""
    entropy: torch.Tensor | None
    """(N, R) float32 entropy of the policy at each response position; None when the rollout's log-probs
    are vLLM's (``rollout_logprobs='generation'`` with ``use_vllm``: vLLM gives no entropies)."""
    ref_logprobs: torch.Tensor
    """(N, R) reference-model log-probs of the response (the policy's when no reference is used, so the
    KL is 0)."""
    kl: torch.Tensor
    """(N, R) per-token KL estimate (``kl_estimator``) between policy and reference, 0 where masked."""
    raw_scores: torch.Tensor
    """(N,) reward sources' weighted score before shaping; NaN where no reward was given."""
    scores: torch.Tensor
    """(N,) the shaped sequence reward: scaling, clipping, overlong and stop-token penalties; 0 in
    invalid rows."""
    valid_rows: torch.Tensor
    """(N,) bool, rows with a finite reward (the others take no part in the update)."""
    found_stop: torch.Tensor
    """(N,) bool, whether the response has a stop token."""
    per_source: dict[str, torch.Tensor]
    """(N,) score of each reward source, by name."""
    reward_func_errors: torch.Tensor
    """() float, reward-function calls that raised in this rollout."""
    prompts: list[Any]
    """N prompts as given to the reward functions."""
    completions: list[Any]
    """N decoded responses; for a tool episode its conversation (assistant and tool messages)."""
    values: torch.Tensor | None = None
    """(N, R) float32 value-model estimates V(s_t) (PPO); None without a value model."""
    generation_logprobs: torch.Tensor | None = None
    """(N, R) float32 the sampling loop's own log-probs, kept when ``needs_generation_logprobs``
    (RLOO's truncated importance sampling, and always with ``use_vllm``: vLLM's log-probs)."""
    loss_mask: torch.Tensor | None = None
    """(N, R) bool, the response tokens the policy wrote and the loss and the KL read; the producer sets it.
    In a single-turn rollout it is ``response_mask``; a multi-turn producer leaves the tokens it inserted
    (a tool's output, an environment's reply) out of it while they stay in the sequence."""
    inserted_tokens: torch.Tensor | None = None
    """(N,) long, the response tokens a producer inserted (tool turns), counted in ``lengths``; None: none.
    TRL's length metrics (``completions/*_length``, ``num_tokens``) leave them out."""
    group_ids: torch.Tensor | None = None
    """(N,) long, the prompt group of each row (the completions of one prompt share it): ``i`` for row
    ``j * B + i`` in the single-turn layout."""
    dynamic_sampling: torch.Tensor | None = None
    """(3,) DAPO's dynamic-sampling counts on this process (see :class:`Scores`); None when off."""
    reward_metrics: dict[str, list[float]] | None = None
    """The values the reward functions logged with ``log_metric(name, value)`` on this process, by name;
    the update logs each name's mean over all processes beside its own metrics. None when no reward
    source can log (then no collective is spent on them)."""
    reward_columns: dict[str, list[Any]] = field(default_factory=dict)
    """The columns the reward functions logged with ``log_extra(column, values)`` on this process, by name,
    for the completions table: one value per row in the rollout's row order when each function logs one
    per completion of its batch (dynamic sampling keeps the values of the rows it keeps)."""
    sampling_weights: torch.Tensor | None = None
    """Truncated importance weights pi_train / pi_vllm of the sampled tokens
    (:func:`~rlhf_trainers.functional.truncated_importance_weights`), (N, R) for the token modes of
    ``vllm_importance_sampling_mode``, (N, 1) for the sequence modes; None unless ``use_vllm`` with
    ``vllm_importance_sampling_correction``."""

    @property
    def policy_mask(self) -> torch.Tensor:
        """(N, R) bool, the tokens the policy wrote that take part in the update: :attr:`loss_mask`, or
        :attr:`response_mask` when no producer set one. The policy loss, the KL (term and penalty), the
        entropy and the advantages read it; tokens a producer inserted (a tool's result) are in
        ``response_mask`` (the sequence the forward passes read) but not in it."""
        return self.response_mask if self.loss_mask is None else self.loss_mask


@dataclass
class Advantages:
    """What :meth:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer.compute_advantages` returns (step 4):
    the advantages and whatever else the algorithm's loss and metrics read."""

    advantages: torch.Tensor
    """(N, R) per token, or (N, 1) one per sequence (RLOO's default); 0 where masked."""
    returns: torch.Tensor | None = None
    """(N, R) value targets (PPO's GAE returns)."""
    rewards: torch.Tensor | None = None
    """(N, R) the per-token rewards the advantages were computed from (PPO)."""
    rlhf_reward: torch.Tensor | None = None
    """(N,) the reward a completion's baseline is computed from (RLOO: score - KL term)."""
    importance_weights: torch.Tensor | None = None
    """(N, R) or (N, 1) capped training/generation probability ratios (RLOO's ``truncated_is_cap``)."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Anything else a subclass computes for its loss."""


@dataclass
class LossNormalization:
    """The denominators of one optimizer step's loss, so that the loss (and its gradient) is the same
    whether the mini-batch is one micro-batch, several accumulated ones, or split over processes: each
    count covers the whole mini-batch (all its micro-batches on all processes), divided by the number of
    processes (whose gradients are averaged)."""

    tokens: torch.Tensor
    """() float, valid response tokens of the mini-batch / processes."""
    sequences: torch.Tensor
    """() float, sequences with at least one valid token in the mini-batch / processes."""
    max_length: int
    """The response length (the constant of ``'seq-mean-token-sum-norm'``)."""

    @classmethod
    def local(cls, mask: torch.Tensor, max_length: int) -> LossNormalization:
        """The counts of the (M, R) ``mask`` alone: a micro-batch taken as the whole mini-batch."""
        return cls(tokens=mask.sum().float(), sequences=mask.any(1).sum().float(), max_length=max_length)

    def denominator(self, loss_agg_mode: str) -> torch.Tensor:
        """The count ``loss_agg_mode`` divides by: tokens for ``'token-mean'``, else sequences."""
        return self.tokens if loss_agg_mode == "token-mean" else self.sequences

    def aggregation(self, loss_agg_mode: str) -> dict[str, Any]:
        """Keyword arguments of :func:`~rlhf_trainers.functional.clipped_policy_loss` and
        :func:`~rlhf_trainers.functional.clipped_value_loss` for ``loss_agg_mode``."""
        return {
            "loss_agg_mode": loss_agg_mode,
            "denominator": self.denominator(loss_agg_mode),
            "max_length": self.max_length,
        }
