"""One batch of on-policy experience (:class:`Rollout`) and the steps that build it.

Rows: N = prompts x ``completions_per_prompt`` (k). The prompt batch of B prompts is repeated k times,
so completion j of prompt i sits at row ``j * B + i`` (the RLOO blog's layout; k = 1 for PPO). Columns:
Q prompt tokens (left-padded) and R = ``response_length`` response tokens (right-padded).

The steps, in the order :meth:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer._update` calls them:
:meth:`RolloutSteps.sample_responses` (2. sample), :meth:`RolloutSteps.score_samples` (3. score),
:meth:`RolloutSteps.rollout_logprobs` (4. log-probs of policy and reference, + values),
:meth:`RolloutSteps.assemble_rollout` and :meth:`RolloutSteps.token_rewards` (5. rewards and KL).
Evaluation runs 2 and 3 (:meth:`RolloutSteps.sample_and_score`).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import functional as F
from .forward import (
    PackedSequences,
    pack_sequences,
    pad_columns,
    response_logprobs,
    response_values,
    sequence_inputs,
    trim_bounds,
)


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


@dataclass
class Scores:
    """What the reward sources say about :class:`SampledResponses` (step 3)."""

    completions: list[str]
    """N decoded responses (special tokens skipped), what the reward functions scored."""
    total: torch.Tensor
    """(N,) weighted sum of the reward sources, before shaping; NaN where a function gave no reward."""
    per_source: dict[str, torch.Tensor]
    """(N,) score of each reward source, by name."""
    found_stop: torch.Tensor
    """(N,) bool, whether the response has a stop token (at index >= ``truncate_after``); all True
    without a stop token."""
    reward_func_errors: torch.Tensor
    """() float, the reward-function calls that raised (``reward_func_errors='nan'``) in this batch."""


@dataclass
class FirstMicroBatch:
    """Step 7's first micro-batch (epoch 0, mini-batch 0), known before step 7 (step 6a)."""

    rows: torch.Tensor
    """(M,) long, on the host: its rollout rows, in step 7's order."""
    bounds: tuple[int, int]
    """The columns its forward pass covers (first prompt column, end of the response columns)."""
    last: bool
    """Whether it is also its mini-batch's last micro-batch (gradients synchronised at its backward)."""


@dataclass
class HeldForward:
    """A training forward pass run ahead of its backward pass (step 6a of the update,
    ``rollout_values='auto'``): step 7's first micro-batch, whose values are the rollout's for its rows."""

    rows: torch.Tensor
    """(M,) long, on the host: the rollout rows of the micro-batch, in step 7's order."""
    logprobs: torch.Tensor
    """(M, R) log-probs with gradient."""
    values: torch.Tensor
    """(M, R) float32 values with gradient."""
    entropy: torch.Tensor
    """(M, R) entropy (with gradient where the loss reads it)."""


@dataclass
class ForwardPasses:
    """The no-grad forward passes of a rollout (step 4), (N, R) each, 0 at masked response positions."""

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
    for the row layout. Built by :meth:`RolloutSteps.assemble_rollout`; read by the advantage and loss
    hooks and the metrics."""

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
    completions: list[str]
    """N decoded responses."""
    values: torch.Tensor | None = None
    """(N, R) float32 value-model estimates V(s_t) (PPO); None without a value model."""
    generation_logprobs: torch.Tensor | None = None
    """(N, R) float32 the sampling loop's own log-probs, kept when ``needs_generation_logprobs``
    (RLOO's truncated importance sampling, and always with ``use_vllm``: vLLM's log-probs)."""
    sampling_weights: torch.Tensor | None = None
    """Truncated importance weights pi_train / pi_vllm of the sampled tokens
    (:func:`~rlhf_trainers.functional.truncated_importance_weights`), (N, R) for the token modes of
    ``vllm_importance_sampling_mode``, (N, 1) for the sequence modes; None unless ``use_vllm`` with
    ``vllm_importance_sampling_correction``."""


@dataclass
class Advantages:
    """What :meth:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer.compute_advantages` returns (step 6):
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


class RolloutSteps:
    """The steps that build a :class:`Rollout`, mixed into
    :class:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer` (they use its args, models, tokenizer,
    reward sources and generation)."""

    # ---- 1. prompts ---------------------------------------------------------------------------

    def _prompt_batch(self, update: int) -> dict[str, Any]:
        """This process's prompts of update ``update``: a fixed permutation per pass over the data (from
        ``seed`` and the pass number), so the order depends only on the update index (resume-safe)."""
        epoch, slot = divmod(update, self.updates_per_data_epoch)
        generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.train_dataset), generator=generator)
        start = slot * self.prompts_per_update + self.accelerator.process_index * self.local_prompts
        indices = perm[start : start + self.local_prompts].tolist()
        return self.data_collator([self.train_dataset[i] for i in indices])

    def _prompts_and_columns(self, batch: dict[str, Any]) -> tuple[list[Any], dict[str, list[Any]]]:
        columns = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
        if "prompt" in columns:
            prompts = columns.pop("prompt")
        elif "messages" in columns:
            prompts = columns.pop("messages")
        else:
            prompts = self.processing_class.batch_decode(batch["input_ids"], skip_special_tokens=True)
        return list(prompts), columns

    # ---- 2. sample ----------------------------------------------------------------------------

    def _response_lengths(self, response: torch.Tensor) -> torch.Tensor:
        """Valid tokens per response: up to and including the first stop token (at index >=
        truncate_after); a response without one keeps every generated token."""
        R = response.shape[1]
        if not self._stop_ids:
            return torch.full((response.shape[0],), R, dtype=torch.long, device=response.device)
        idx = torch.arange(R, device=response.device)
        hits = torch.isin(response, torch.tensor(self._stop_ids, device=response.device)) & (
            idx >= self.args.truncate_after
        )
        first = F.first_true_indices(hits)
        return torch.where(first < R, first + 1, torch.full_like(first, R))

    def sample_responses(
        self,
        batch: dict[str, Any],
        copies: int = 1,
        with_logprobs: bool = False,
        timings: dict[str, float] | None = None,
    ) -> SampledResponses:
        """Step 2: ``copies`` responses to each prompt of a collated ``batch`` (the batch repeated
        ``copies`` times, completion j of prompt i at row ``j * B + i``), generated in chunks of
        ``local_rollout_forward_batch_size`` rows and cut after the stop token. With ``with_logprobs``
        also the sampling loop's own log-probs and entropy."""
        timings = timings if timings is not None else defaultdict(float)
        device = self.accelerator.device
        query = batch["input_ids"].to(device).repeat(copies, 1)
        query_mask = batch["attention_mask"].to(device).repeat(copies, 1)
        prompts, columns = self._prompts_and_columns(batch)
        pad = self.processing_class.pad_token_id
        step = self.args.local_rollout_forward_batch_size
        if self.generation_backend.batches_internally:
            step = query.shape[0]  # one call: the engine (vLLM) schedules its own batches
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        for start in range(0, query.shape[0], step):
            began = time.perf_counter()
            generated, extras = self._generate(
                query[start : start + step], query_mask[start : start + step], with_logprobs=with_logprobs
            )
            timings["timing/generate"] += time.perf_counter() - began
            lengths = self._response_lengths(generated)
            mask = torch.arange(generated.shape[1], device=device)[None, :] < lengths[:, None]
            parts["response"].append(generated.masked_fill(~mask, pad))
            parts["response_mask"].append(mask)
            parts["lengths"].append(lengths)
            if extras is not None:
                parts["generation_logprobs"].append(extras["logprobs"].float())
                if extras["entropy"] is not None:  # vLLM gives no entropies
                    parts["generation_entropy"].append(extras["entropy"].float())
        joined = {name: torch.cat(values) for name, values in parts.items()}
        return SampledResponses(
            query=query,
            query_mask=query_mask.bool(),
            prompts=list(prompts) * copies,
            columns={name: list(values) * copies for name, values in columns.items()},
            **joined,
        )

    # ---- 3. score -----------------------------------------------------------------------------

    def score_samples(self, samples: SampledResponses, timings: dict[str, float] | None = None) -> Scores:
        """Step 3: score the decoded responses with every reward source (the reward model reads the
        policy's ids when it shares the tokenizer, else the text), and note which found a stop token."""
        began = time.perf_counter()
        device = samples.response.device
        completions = self.processing_class.batch_decode(samples.response, skip_special_tokens=True)
        total, per_source = self.reward_sources(
            query_response_ids=torch.cat([samples.query, samples.response], dim=1),
            prompts=samples.prompts,
            completions=completions,
            columns=samples.columns,
            reward_model_forward=self._reward_forward,
            prompt_width=samples.query.shape[1],
        )
        errors = torch.tensor(float(self.reward_sources.last_errors), device=device)
        found_stop = (
            F.stop_token_found(samples.response, self._stop_ids, self.args.truncate_after)
            if self._stop_ids
            else torch.ones(samples.response.shape[0], dtype=torch.bool, device=device)
        )
        if timings is not None:
            timings["timing/reward"] += time.perf_counter() - began
        return Scores(completions, total.to(device), per_source, found_stop, errors)

    # ---- 3b. dynamic sampling (DAPO) --------------------------------------------------------------

    def dynamic_sampling(
        self,
        batch: dict[str, Any],
        samples: SampledResponses,
        scores: Scores,
        update: int,
        timings: dict[str, float] | None = None,
    ) -> tuple[SampledResponses, Scores]:
        """DAPO's dynamic sampling: keep the prompts whose completions' shaped scores differ (a group of
        equal scores has zero advantage), and generate for more prompts (drawn at random, reproducibly
        from ``seed``, the update and the round) until this process has ``local_prompts`` such groups or
        ``dynamic_sampling_max_rounds`` generations were made; dropped groups fill what is still missing.
        Every process runs the same number of rounds (one all-reduce per round), since generation and
        scoring may be collective (ZeRO-3). Returns the samples and scores of the chosen groups, in the
        engine's layout (completion j of group g at row ``j * B + g``)."""
        k, B = self.completions_per_prompt, self.local_prompts
        pieces = [(samples, scores)]
        signal = [self._group_signal(samples, scores, k)]
        while len(pieces) < self.args.dynamic_sampling_max_rounds:
            missing = torch.tensor(
                [float(sum(int(s.sum()) for s in signal) < B)], device=samples.response.device
            )
            if self.accelerator.num_processes > 1:
                missing = self.accelerator.reduce(missing, reduction="sum")
            if not float(missing):
                break
            extra = self._extra_prompt_batch(update, len(pieces))
            more = self.sample_responses(extra, k, self._wants_generation_logprobs(), timings)
            more_scores = self.score_samples(more, timings)
            pieces.append((more, more_scores))
            signal.append(self._group_signal(more, more_scores, k))
        chosen = [(a, int(g)) for a, s in enumerate(signal) for g in s.nonzero().flatten()][:B]
        short = B - len(chosen)
        chosen += [(a, int(g)) for a, s in enumerate(signal) for g in (~s).nonzero().flatten()][:short]
        self._dynamic_sampling_stats = torch.tensor(
            [float(len(pieces)), float(sum(int((~s).sum()) for s in signal)), float(short)]
        )
        return _take_groups(pieces, chosen, k, self.processing_class.pad_token_id)

    def _group_signal(self, samples: SampledResponses, scores: Scores, k: int) -> torch.Tensor:
        """(B,) bool: the prompt's valid completions (2 or more) got different shaped scores."""
        shaped, valid = self._shape_scores(scores.total, samples.lengths, scores.found_stop)
        grouped, ok = shaped.reshape(k, -1), valid.reshape(k, -1)
        high = torch.where(ok, grouped, torch.full_like(grouped, -torch.inf)).amax(0)
        low = torch.where(ok, grouped, torch.full_like(grouped, torch.inf)).amin(0)
        return (ok.sum(0) >= 2) & (high > low)

    def _extra_prompt_batch(self, update: int, round_: int) -> dict[str, Any]:
        """``local_prompts`` prompts drawn at random for a further round of dynamic sampling; the draw
        depends on the seed, the update, the round and the process only (resume-safe)."""
        seed = hash((self.args.seed, update, round_, self.accelerator.process_index)) % (2**63)
        perm = torch.randperm(len(self.train_dataset), generator=torch.Generator().manual_seed(seed))
        return self.data_collator([self.train_dataset[i] for i in perm[: self.local_prompts].tolist()])

    def sample_and_score(self, batch: dict[str, Any]) -> tuple[SampledResponses, Scores]:
        """Steps 2 and 3 for one collated prompt batch, one response each (what evaluation runs)."""
        samples = self.sample_responses(batch)
        return samples, self.score_samples(samples)

    # ---- 4. log-probs of policy and reference (+ values) --------------------------------------

    def _logprob_options(self) -> dict[str, Any]:
        """Temperature, chunking and precision of every log-prob computation of the engine."""
        args = self.args
        return {
            "temperature": args.temperature,
            "chunk_size": args.logprob_chunk_size,
            "compute_dtype": torch.float32 if args.logprobs_in_fp32 else None,
            "keep_logits_bytes": args.fused_lm_head_kept_logits_mib * 2**20,
        }

    def _sequence_inputs(
        self,
        query: torch.Tensor,
        query_mask: torch.Tensor,
        response: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return sequence_inputs(query, query_mask, response, response_mask, self._input_pad_id)

    def _packed(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        response_mask: torch.Tensor,
        training: bool = False,
    ) -> PackedSequences | None:
        """The inputs of :meth:`_sequence_inputs` packed for the padding-free passes
        (:func:`~rlhf_trainers.onpolicy.forward.pack_sequences`); None when no model's passes are packed
        (``padding_free`` off, or no model passed the check) or no row has a valid response token.

        In one row when every packed model takes it, except for a ``training`` pass of a model under
        gradient checkpointing: its backward pass recomputes the forward outside the pass's
        :func:`~rlhf_trainers.packing.one_row_attention`, so it keeps rows of the longest sequence."""
        if not (self._pack_policy or self._pack_ref or self._pack_values):
            return None
        one_row = getattr(self, "_pack_one_row", False)
        if one_row and training:
            one_row = not any(
                getattr(module, "gradient_checkpointing", False) is True
                for model in (self.policy, self.value_model)
                if model is not None
                for module in model.modules()
            )
        return pack_sequences(ids, mask, positions, response_mask, self._input_pad_id, one_row=one_row)

    @torch.no_grad()
    def _reference_logprobs(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        response: torch.Tensor,
        packing: PackedSequences | None = None,
    ) -> torch.Tensor:
        options = self._logprob_options()
        packing = packing if self._pack_ref else None
        if self.ref_model is None:
            # PEFT: the reference is the same weights with the adapter disabled (no second copy).
            forward, context = self.policy, self.policy.disable_adapter()
        else:
            forward, context = self._ref_forward or self.ref_model, contextlib.nullcontext()
        with context:
            return response_logprobs(
                forward,
                ids,
                mask,
                positions,
                response,
                options,
                fused_head=self._fused_ref,
                with_entropy=False,
                packing=packing,
            )[0]

    def _pass_inputs(
        self,
        query: torch.Tensor,
        query_mask: torch.Tensor,
        response: torch.Tensor,
        response_mask: torch.Tensor,
        bounds: tuple[int, int] | None = None,
        training: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PackedSequences | None]:
        """The inputs of a forward pass over rows of a rollout (the no-grad passes' and the training
        pass's): the columns some row uses (``bounds``: first prompt column, end of the response columns;
        :func:`trim_bounds` of the masks when None), as ``(ids, mask, positions, response, packing)``;
        ``response`` holds the trimmed response columns as the passes read them (padding as an id the model
        has), ``packing`` the real tokens packed (:meth:`_packed`, `training` passed on)."""
        first, end = trim_bounds(query_mask, response_mask) if bounds is None else bounds
        query = query[:, first:]
        ids, mask, positions = self._sequence_inputs(
            query, query_mask[:, first:], response[:, :end], response_mask[:, :end]
        )
        packing = self._packed(ids, mask, positions, response_mask[:, :end], training=training)
        return ids, mask, positions, ids[:, query.shape[1] :], packing

    def rollout_logprobs(
        self, samples: SampledResponses, timings: dict[str, float] | None = None, with_values: bool = True
    ) -> ForwardPasses:
        """Step 4: per chunk of ``local_rollout_forward_batch_size`` rows, the policy's log-probs and
        entropy (a training-mode forward pass, or the sampling loop's own where
        :attr:`logprobs_from_generation`), the reference's log-probs and the value model's values (unless
        ``with_values`` is False: the update then takes them from :meth:`rollout_values`).

        The forward passes see the prompt columns some row of the chunk uses and the response columns up
        to its longest response; what they leave out is padding in every row, and the results are padded
        back to R with zeros (at masked positions). With ``padding_free`` the passes of the models that
        allow it run on the chunk's real tokens packed (:meth:`_packed`)."""
        timings = timings if timings is not None else defaultdict(float)
        R = samples.response.shape[1]
        step = self.args.local_rollout_forward_batch_size
        from_generation = self.logprobs_from_generation and samples.generation_logprobs is not None
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        for start in range(0, samples.response.shape[0], step):
            rows = slice(start, start + step)
            response_mask = samples.response_mask[rows]
            ids, mask, positions, response, packing = self._pass_inputs(
                samples.query[rows], samples.query_mask[rows], samples.response[rows], response_mask
            )
            if from_generation:
                # The sampling loop's own log-probs (rollout_logprobs): no policy forward pass.
                parts["logprobs"].append(samples.generation_logprobs[rows].masked_fill(~response_mask, 0.0))
                if samples.generation_entropy is not None:  # vLLM gives none
                    parts["entropy"].append(samples.generation_entropy[rows].masked_fill(~response_mask, 0.0))
                timings["timing/policy"] += 0.0  # logged as 0: the pass was skipped
            else:
                began = time.perf_counter()
                logprobs, entropy = response_logprobs(
                    self.policy,
                    ids,
                    mask,
                    positions,
                    response,
                    self._logprob_options(),
                    fused_head=self._fused_policy,
                    packing=packing if self._pack_policy else None,
                )
                parts["logprobs"].append(pad_columns(logprobs, R))
                parts["entropy"].append(pad_columns(entropy, R))
                timings["timing/policy"] += time.perf_counter() - began
            if self.args.uses_reference_model:
                began = time.perf_counter()
                parts["ref_logprobs"].append(
                    pad_columns(self._reference_logprobs(ids, mask, positions, response, packing), R)
                )
                timings["timing/ref"] += time.perf_counter() - began
            else:
                # No KL term reads a reference: none is run; its log-probs are the policy's (KL 0).
                parts["ref_logprobs"].append(parts["logprobs"][-1])
            if with_values and self.value_model is not None:
                began = time.perf_counter()
                values = response_values(
                    self.value_model,
                    ids,
                    mask,
                    positions,
                    response.shape[1],
                    packing=packing if self._pack_values else None,
                )
                parts["values"].append(pad_columns(values.float(), R))
                timings["timing/values"] += time.perf_counter() - began
        joined = {name: torch.cat(values) for name, values in parts.items()}
        return ForwardPasses(values=joined.pop("values", None), entropy=joined.pop("entropy", None), **joined)

    def rollout_values(
        self,
        rollout: Rollout,
        skip_rows: torch.Tensor,
        timings: dict[str, float] | None = None,
    ) -> torch.Tensor:
        """(N, R) float32 values of the value model for the rollout rows, 0 at masked positions and in the
        rows ``skip_rows`` (indices: those whose values come from their first training pass, step 6a of
        :meth:`_update`): a no-grad pass in chunks of ``local_rollout_forward_batch_size`` rows over the
        rollout's prompt and response tokens, trimmed and packed as step 4's value pass is."""
        timings = timings if timings is not None else defaultdict(float)
        N, R = rollout.response.shape
        values = rollout.response.new_zeros((N, R), dtype=torch.float32)
        rest = torch.ones(N, dtype=torch.bool, device=values.device)
        rest[skip_rows.to(values.device)] = False
        rest = rest.nonzero().squeeze(1)
        began = time.perf_counter()
        with torch.no_grad(), self.accelerator.autocast():
            for rows in rest.split(self.args.local_rollout_forward_batch_size) if rest.numel() else ():
                response_mask = rollout.response_mask[rows]
                ids, mask, positions, response, packing = self._pass_inputs(
                    rollout.query[rows], rollout.query_mask[rows], rollout.response[rows], response_mask
                )
                part = response_values(
                    self.value_model,
                    ids,
                    mask,
                    positions,
                    response.shape[1],
                    packing=packing if self._pack_values else None,
                )
                values[rows] = pad_columns(part.float(), R).masked_fill(~response_mask, 0.0)
        timings["timing/values"] += time.perf_counter() - began
        return values

    # ---- 5. per-token rewards and KL ----------------------------------------------------------

    def assemble_rollout(self, samples: SampledResponses, scores: Scores, passes: ForwardPasses) -> Rollout:
        """Step 5a: the per-token KL, the shaped scores (:meth:`_shape_scores`), and the rows whose reward
        is not finite (a function returned None / NaN) masked out of the update."""
        kl = (
            F.kl_penalty(passes.logprobs, passes.ref_logprobs, self.args.kl_estimator) * samples.response_mask
        )
        shaped, valid = self._shape_scores(scores.total, samples.lengths, scores.found_stop)
        args = self.args
        # Tokens in the loss: the valid rows', without the truncated completions' (mask_truncated_completions).
        in_loss = valid & scores.found_stop if args.mask_truncated_completions else valid
        sampling_weights = None
        if (
            args.use_vllm
            and args.vllm_importance_sampling_correction
            and samples.generation_logprobs is not None
            and not self.logprobs_from_generation  # vLLM's are the rollout's: the ratio itself corrects
        ):
            sampling_weights = F.truncated_importance_weights(
                passes.logprobs,
                samples.generation_logprobs,
                samples.response_mask & valid[:, None],
                args.vllm_importance_sampling_cap,
                args.vllm_importance_sampling_mode,
            )
        return Rollout(
            query=samples.query,
            query_mask=samples.query_mask,
            response=samples.response,
            response_mask=samples.response_mask & in_loss[:, None],
            lengths=samples.lengths,
            logprobs=passes.logprobs,
            entropy=passes.entropy,
            ref_logprobs=passes.ref_logprobs,
            kl=kl * valid[:, None],
            raw_scores=scores.total,
            scores=shaped,
            valid_rows=valid,
            found_stop=scores.found_stop,
            per_source=scores.per_source,
            reward_func_errors=scores.reward_func_errors,
            prompts=samples.prompts,
            completions=scores.completions,
            values=passes.values,
            generation_logprobs=samples.generation_logprobs if self.needs_generation_logprobs else None,
            sampling_weights=sampling_weights,
        )

    def _shape_scores(
        self, scores: torch.Tensor, lengths: torch.Tensor, found: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores -> rewards of the sequences, in this order: scaling to the target range, clipping,
        overlong shaping, the missing-stop-token penalty (so a penalty is in the final units, as LHPD's
        -1)."""
        args = self.args
        valid = torch.isfinite(scores)
        scores = torch.where(valid, scores, torch.zeros_like(scores)).float()
        if args.reward_scaling is not None:
            scores = F.scale_rewards(scores, *args.reward_scaling)
        if args.reward_clip is not None:
            scores = scores.clamp(-args.reward_clip, args.reward_clip)
        if args.overlong_buffer_length is not None:
            scores = scores + F.overlong_penalty(
                lengths, args.response_length, args.overlong_buffer_length, args.overlong_penalty
            ).to(scores)
        if args.missing_eos_penalty is not None:
            scores = F.apply_rejection_penalty(scores, found, args.missing_eos_penalty, "subtract")
        if args.rejection_penalty is not None:
            scores = F.apply_rejection_penalty(scores, found, args.rejection_penalty, "replace")
        return torch.where(valid, scores, torch.zeros_like(scores)), valid

    def token_rewards(self, rollout: Rollout) -> torch.Tensor:
        """Step 5b: (N, R) per-token rewards: ``-kl_coef * kl`` at every response token and the sequence's
        score added at its last token (LHPD, "Per-token KL penalty"); whitened over all processes with
        ``shift_mean=False`` when ``whiten_rewards``."""
        mask = rollout.response_mask
        rewards = -self.kl_ctl.value * rollout.kl
        last = (rollout.lengths - 1).clamp_min(0)
        rewards = rewards.clone()
        rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += (
            rollout.scores * rollout.valid_rows.float()
        )
        if self.args.whiten_rewards:
            rewards = F.whiten(rewards, mask, shift_mean=False, all_reduce=self._all_reduce)
        return rewards

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor | None:
        if self.accelerator.num_processes == 1:
            return tensor
        return self.accelerator.reduce(tensor, reduction="sum")


def _take_groups(
    pieces: list[tuple[SampledResponses, Scores]], chosen: list[tuple[int, int]], k: int, pad: int
) -> tuple[SampledResponses, Scores]:
    """The ``chosen`` groups ``(piece, prompt index)`` of several rounds of samples and scores, as one
    batch in the engine's layout: completion j of the g-th chosen group at row ``j * len(chosen) + g``.
    Prompts are left-padded (and responses right-padded) to the widest piece."""
    sizes = [p[0].response.shape[0] // k for p in pieces]
    offsets = [sum(p[0].response.shape[0] for p in pieces[:a]) for a in range(len(pieces))]
    rows = torch.tensor([offsets[a] + j * sizes[a] + g for j in range(k) for a, g in chosen])
    Q = max(p[0].query.shape[1] for p in pieces)
    R = max(p[0].response.shape[1] for p in pieces)

    def cat(tensors: list[torch.Tensor], width: int | None, fill: float, left: bool) -> torch.Tensor:
        if width is not None:
            tensors = [
                torch.nn.functional.pad(
                    t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=fill
                )
                for t in tensors
            ]
        return torch.cat(tensors)[rows.to(tensors[0].device)]

    def listed(values: list[list[Any]]) -> list[Any]:
        flat = [v for part in values for v in part]
        return [flat[i] for i in rows.tolist()]

    first, first_scores = pieces[0]
    optional = {}
    for name in ("generation_logprobs", "generation_entropy"):
        parts = [getattr(p[0], name) for p in pieces]
        optional[name] = None if any(x is None for x in parts) else cat(parts, R, 0.0, left=False)
    samples = SampledResponses(
        query=cat([p[0].query for p in pieces], Q, pad, left=True),
        query_mask=cat([p[0].query_mask for p in pieces], Q, False, left=True),
        response=cat([p[0].response for p in pieces], R, pad, left=False),
        response_mask=cat([p[0].response_mask for p in pieces], R, False, left=False),
        lengths=cat([p[0].lengths for p in pieces], None, 0, left=False),
        prompts=listed([p[0].prompts for p in pieces]),
        columns={name: listed([p[0].columns[name] for p in pieces]) for name in first.columns},
        **optional,
    )
    scores = Scores(
        completions=listed([p[1].completions for p in pieces]),
        total=cat([p[1].total for p in pieces], None, 0.0, left=False),
        per_source={
            name: cat([p[1].per_source[name] for p in pieces], None, 0.0, left=False)
            for name in first_scores.per_source
        },
        found_stop=cat([p[1].found_stop for p in pieces], None, False, left=False),
        reward_func_errors=sum(
            (p[1].reward_func_errors for p in pieces), torch.zeros_like(first_scores.reward_func_errors)
        ),
    )
    return samples, scores
