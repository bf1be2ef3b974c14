"""Rollout producers: what turns the update index into a :class:`~rlhf_trainers.onpolicy.rollout.Rollout`.

A producer is the seam where the way experience is collected changes (one turn or several, with tools
or an environment; generated in process, on a server, or ahead of time): it implements
:class:`RolloutProducer`, and the engine's update (``OnPolicyTrainer._update``) takes the rollout it
returns, whatever made it. :class:`SingleTurnProducer` is today's: one completion per row, from the
policy's sampler, scored by the reward sources.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .. import functional as F
from ..rewards import RewardLog
from .rollout import ForwardPasses, Rollout, SampledResponses, Scores
from .rollouts_ahead import RolloutsAhead


@runtime_checkable
class RolloutProducer(Protocol):
    """Makes the rollout of an update; evaluation asks it for samples and scores of held-out prompts."""

    def produce(self, update: int, timings: dict[str, float], with_values: bool = True) -> Rollout:
        """This process's rollout of update ``update``: rows of prompt and response with the log-probs of
        policy and reference (and, with ``with_values`` and a value model, the values), the per-token KL,
        the shaped scores and the loss mask. Runs without gradient. Adds its phases' seconds to
        ``timings`` (``timing/generate``, ``timing/reward``, ...)."""
        ...

    def sample_and_score(self, batch: dict[str, Any]) -> tuple[SampledResponses, Scores]:
        """One response to each prompt of a collated ``batch``, scored (what evaluation runs)."""
        ...


class SingleTurnProducer:
    """One turn: k completions per prompt of the update's prompt batch, sampled by the trainer
    ``engine``'s sampler, cut after the stop token, scored by its reward sources, with the log-probs of
    its models' passes (:class:`~rlhf_trainers.onpolicy.passes.ModelPasses`).

    Rows: the prompt batch of B prompts repeated k times (completion j of prompt i at row ``j * B + i``,
    the RLOO blog's layout), so each row's group is ``row % B`` (``Rollout.group_ids``).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        if engine.args.async_rollouts and type(self) is not SingleTurnProducer:
            raise ValueError(
                "async_rollouts=True works with single-turn rollouts so far, not with tools=, "
                "environment_factory= or rollout_func=; set async_rollouts=False."
            )
        #: With ``async_rollouts``: the generation one update ahead (:mod:`.rollouts_ahead`), else None.
        self.ahead: RolloutsAhead | None = RolloutsAhead(self, engine) if engine.args.async_rollouts else None

    def produce(self, update: int, timings: dict[str, float], with_values: bool = True) -> Rollout:
        """The rollout of update ``update``, in the steps of LHPD's reference loop."""
        engine = self.engine
        # a. prompts: this process's share of the update's prompts, from a permutation fixed by `seed` and
        #    the pass over the data, so the order depends on the update index only (resume-safe).
        batch = self.prompt_batch(update)
        # Everything below takes no gradient and runs in the training precision: under bf16/fp16 the same
        # autocast as the training forward pass, so its first step recomputes these log-probs (ratio 1).
        with torch.no_grad(), engine.accelerator.autocast():
            # b. sample: k completions per prompt, cut after the stop token (LHPD's truncation); the
            #    sampling loop's own log-probs when the rollout or the loss reads them.
            k, with_logprobs = engine.completions_per_prompt, engine.wants_generation_logprobs
            if self.ahead is not None:  # generated while the previous update trained (async_rollouts)
                samples = self.ahead.samples(update, batch, k, with_logprobs, timings)
            else:
                samples = self.sample(batch, k, with_logprobs, timings)
            # c. score: every reward source on the completions; the reward model reads the policy's ids when
            #    it shares the tokenizer, the decoded text otherwise.
            scores = self.score(samples, timings)
            if engine.args.dynamic_sampling:
                # DAPO: groups whose completions scored alike are replaced by new prompts' groups.
                samples, scores = self.dynamic_sampling(batch, samples, scores, update, timings)
            # d. log-probs of policy and reference (+ values): the "old" log-probs of the clipped ratio,
            #    the KL's other side, PPO's V(s_t); padding columns trimmed out of each forward pass.
            passes = engine.passes.logprobs(samples, timings, with_values=with_values)
            # e. the shaped scores (scaling, clipping, overlong and stop-token penalties, in that order),
            #    the per-token KL, and rows without a finite reward masked out of the update.
            return self.assemble(samples, scores, passes)

    def rollout(self, batch: dict[str, Any], timings: dict[str, float] | None = None) -> Rollout:
        """Steps b-e of :meth:`produce` for a collated prompt ``batch`` (this process's share)."""
        engine = self.engine
        timings = timings if timings is not None else defaultdict(float)
        with torch.no_grad(), engine.accelerator.autocast():
            samples = self.sample(
                batch, engine.completions_per_prompt, engine.wants_generation_logprobs, timings
            )
            scores = self.score(samples, timings)
            return self.assemble(samples, scores, engine.passes.logprobs(samples, timings))

    def prompt_batch(self, update: int) -> dict[str, Any]:
        """This process's prompts of update ``update``: a fixed permutation per pass over the data (from
        ``seed`` and the pass number), so the order depends only on the update index (resume-safe)."""
        epoch, slot = divmod(update, self.engine.updates_per_data_epoch)
        generator = torch.Generator().manual_seed(self.engine.args.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.engine.train_dataset), generator=generator)
        start = (
            slot * self.engine.prompts_per_update
            + self.engine.accelerator.process_index * self.engine.local_prompts
        )
        indices = perm[start : start + self.engine.local_prompts].tolist()
        return self.engine.data_collator([self.engine.train_dataset[i] for i in indices])

    def _prompts_and_columns(self, batch: dict[str, Any]) -> tuple[list[Any], dict[str, list[Any]]]:
        columns = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
        if "prompt" in columns:
            prompts = columns.pop("prompt")
        elif "messages" in columns:
            prompts = columns.pop("messages")
        else:
            prompts = self.engine.processing_class.batch_decode(batch["input_ids"], skip_special_tokens=True)
        return list(prompts), columns

    def _response_lengths(self, response: torch.Tensor) -> torch.Tensor:
        """Valid tokens per response: up to and including the first stop token (at index >=
        truncate_after); a response without one keeps every generated token."""
        R = response.shape[1]
        if not self.engine.sampler.stop_ids:
            return torch.full((response.shape[0],), R, dtype=torch.long, device=response.device)
        idx = torch.arange(R, device=response.device)
        hits = torch.isin(response, torch.tensor(self.engine.sampler.stop_ids, device=response.device)) & (
            idx >= self.engine.args.truncate_after
        )
        first = F.first_true_indices(hits)
        return torch.where(first < R, first + 1, torch.full_like(first, R))

    def sample(
        self,
        batch: dict[str, Any],
        copies: int = 1,
        with_logprobs: bool = False,
        timings: dict[str, float] | None = None,
    ) -> SampledResponses:
        """``copies`` responses to each prompt of a collated ``batch`` (the batch repeated
        ``copies`` times, completion j of prompt i at row ``j * B + i``), generated in chunks of
        ``local_rollout_forward_batch_size`` rows and cut after the stop token. With ``with_logprobs``
        also the sampling loop's own log-probs and entropy."""
        timings = timings if timings is not None else defaultdict(float)
        query, query_mask = self.queries(batch, copies)
        step = self.engine.args.local_rollout_forward_batch_size
        if self.engine.sampler.backend.batches_internally:
            step = query.shape[0]  # one call: the engine (vLLM) schedules its own batches
        chunks = []
        for start in range(0, query.shape[0], step):
            began = time.perf_counter()
            chunks.append(
                self.engine.sampler.generate(
                    query[start : start + step], query_mask[start : start + step], with_logprobs=with_logprobs
                )
            )
            timings["timing/generate"] += time.perf_counter() - began
        return self._sampled(batch, copies, query, query_mask, chunks)

    def queries(self, batch: dict[str, Any], copies: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt ids and mask of a collated ``batch`` repeated ``copies`` times, on the device."""
        device = self.engine.accelerator.device
        return (
            batch["input_ids"].to(device).repeat(copies, 1),
            batch["attention_mask"].to(device).repeat(copies, 1),
        )

    def samples_from(
        self,
        batch: dict[str, Any],
        copies: int,
        generated: torch.Tensor,
        extras: dict[str, torch.Tensor] | None,
    ) -> SampledResponses:
        """:meth:`sample`'s result for responses generated elsewhere (asynchronous rollouts): the response
        ids ``generated`` of the whole batch and their ``extras`` (log-probs) as the sampler returns them."""
        query, query_mask = self.queries(batch, copies)
        return self._sampled(batch, copies, query, query_mask, [(generated, extras)])

    def _sampled(
        self,
        batch: dict[str, Any],
        copies: int,
        query: torch.Tensor,
        query_mask: torch.Tensor,
        chunks: list[tuple[torch.Tensor, dict[str, torch.Tensor] | None]],
    ) -> SampledResponses:
        """The chunks' responses cut after the stop token, with their masks, lengths and log-probs."""
        device = self.engine.accelerator.device
        prompts, columns = self._prompts_and_columns(batch)
        pad = self.engine.processing_class.pad_token_id
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        for generated, extras in chunks:
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

    def score(self, samples: SampledResponses, timings: dict[str, float] | None = None) -> Scores:
        """Score the decoded responses with every reward source (the reward model reads the
        policy's ids when it shares the tokenizer, else the text), and note which found a stop token."""
        began = time.perf_counter()
        device = samples.response.device
        completions = self.engine.processing_class.batch_decode(samples.response, skip_special_tokens=True)
        total, per_source = self.engine.reward_sources(
            query_response_ids=torch.cat([samples.query, samples.response], dim=1),
            prompts=samples.prompts,
            completions=completions,
            columns=samples.columns,
            reward_model_forward=self.engine.passes.reward_forward,
            prompt_width=samples.query.shape[1],
            completion_lengths=samples.lengths.tolist(),
            trainer_state=self.engine.state,
            conversations=samples.conversations,
        )
        errors = torch.tensor(float(self.engine.reward_sources.last_errors), device=device)
        reward_log = self.engine.reward_sources.last_log if self.engine.reward_sources.may_log else None
        found_stop = (
            F.stop_token_found(
                samples.response, self.engine.sampler.stop_ids, self.engine.args.truncate_after
            )
            if self.engine.sampler.stop_ids
            else torch.ones(samples.response.shape[0], dtype=torch.bool, device=device)
        )
        if timings is not None:
            timings["timing/reward"] += time.perf_counter() - began
        return Scores(completions, total.to(device), per_source, found_stop, errors, reward_log=reward_log)

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
        k, B = self.engine.completions_per_prompt, self.engine.local_prompts
        pieces = [(samples, scores)]
        signal = [self._group_signal(samples, scores, k)]
        while len(pieces) < self.engine.args.dynamic_sampling_max_rounds:
            missing = torch.tensor(
                [float(sum(int(s.sum()) for s in signal) < B)], device=samples.response.device
            )
            if self.engine.accelerator.num_processes > 1:
                missing = self.engine.accelerator.reduce(missing, reduction="sum")
            if not float(missing):
                break
            extra = self._extra_prompt_batch(update, len(pieces))
            more = self.sample(extra, k, self.engine.wants_generation_logprobs, timings)
            more_scores = self.score(more, timings)
            pieces.append((more, more_scores))
            signal.append(self._group_signal(more, more_scores, k))
        chosen = [(a, int(g)) for a, s in enumerate(signal) for g in s.nonzero().flatten()][:B]
        short = B - len(chosen)
        chosen += [(a, int(g)) for a, s in enumerate(signal) for g in (~s).nonzero().flatten()][:short]
        samples, scores = _take_groups(pieces, chosen, k, self.engine.processing_class.pad_token_id)
        scores.dynamic_sampling = torch.tensor(
            [float(len(pieces)), float(sum(int((~s).sum()) for s in signal)), float(short)]
        )
        return samples, scores

    def _group_signal(self, samples: SampledResponses, scores: Scores, k: int) -> torch.Tensor:
        """(B,) bool: the prompt's valid completions (2 or more) got different shaped scores."""
        shaped, valid = self.shape_scores(scores.total, samples.lengths, scores.found_stop)
        grouped, ok = shaped.reshape(k, -1), valid.reshape(k, -1)
        high = torch.where(ok, grouped, torch.full_like(grouped, -torch.inf)).amax(0)
        low = torch.where(ok, grouped, torch.full_like(grouped, torch.inf)).amin(0)
        return (ok.sum(0) >= 2) & (high > low)

    def _extra_prompt_batch(self, update: int, round_: int) -> dict[str, Any]:
        """``local_prompts`` prompts drawn at random for a further round of dynamic sampling; the draw
        depends on the seed, the update, the round and the process only (resume-safe)."""
        seed = hash((self.engine.args.seed, update, round_, self.engine.accelerator.process_index)) % (2**63)
        perm = torch.randperm(len(self.engine.train_dataset), generator=torch.Generator().manual_seed(seed))
        return self.engine.data_collator(
            [self.engine.train_dataset[i] for i in perm[: self.engine.local_prompts].tolist()]
        )

    def sample_and_score(self, batch: dict[str, Any]) -> tuple[SampledResponses, Scores]:
        """Samples and scores for one collated prompt batch, one response each (what evaluation runs)."""
        samples = self.sample(batch)
        return samples, self.score(samples)

    def assemble(self, samples: SampledResponses, scores: Scores, passes: ForwardPasses) -> Rollout:
        """The per-token KL, the shaped scores (:meth:`shape_scores`), and the rows whose reward
        is not finite (a function returned None / NaN) masked out of the update."""
        # The tokens the policy wrote: the KL, the loss and the advantages read these only (a multi-turn
        # producer's tool results are in the sequence, out of this mask).
        written = samples.response_mask if samples.loss_mask is None else samples.loss_mask
        kl = F.kl_penalty(passes.logprobs, passes.ref_logprobs, self.engine.args.kl_estimator) * written
        shaped, valid = self.shape_scores(scores.total, samples.lengths, scores.found_stop)
        args = self.engine.args
        # Tokens in the loss: the valid rows', without the truncated completions' (mask_truncated_completions).
        in_loss = valid & scores.found_stop if args.mask_truncated_completions else valid
        sampling_weights = None
        if (
            args.use_vllm
            and args.vllm_importance_sampling_correction
            and samples.generation_logprobs is not None
            and not self.engine.sampler.logprobs_from_generation  # vLLM's are the rollout's: the ratio itself corrects
        ):
            sampling_weights = F.truncated_importance_weights(
                passes.logprobs,
                samples.generation_logprobs,
                written & valid[:, None],
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
            loss_mask=written & in_loss[:, None],
            inserted_tokens=None
            if samples.loss_mask is None
            else (samples.response_mask & ~samples.loss_mask).sum(1),
            group_ids=torch.arange(samples.response.shape[0], device=samples.response.device)
            % (samples.response.shape[0] // self.engine.completions_per_prompt),
            dynamic_sampling=scores.dynamic_sampling,
            reward_metrics=_logged_metrics(scores.reward_log, samples.extra_metrics),
            reward_columns={} if scores.reward_log is None else scores.reward_log.columns,
            prompts=samples.prompts,
            completions=scores.completions,
            values=passes.values,
            generation_logprobs=samples.generation_logprobs
            if self.engine.needs_generation_logprobs
            else None,
            sampling_weights=sampling_weights,
        )

    def shape_scores(
        self, scores: torch.Tensor, lengths: torch.Tensor, found: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores -> rewards of the sequences, in this order: scaling to the target range, clipping,
        overlong shaping, the missing-stop-token penalty (so a penalty is in the final units, as LHPD's
        -1)."""
        args = self.engine.args
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
        reward_log=_join_reward_logs(pieces, rows.tolist()),
    )
    return samples, scores


def _join_reward_logs(pieces: list[tuple[SampledResponses, Scores]], rows: list[int]) -> RewardLog | None:
    """The reward functions' logs of several rounds of dynamic sampling as one: every metric value of every
    round; a column's values at the chosen ``rows`` when each round logged one value per row of it, else
    all of them in order."""
    logs = [p[1].reward_log for p in pieces]
    if any(log is None for log in logs):
        return None
    joined = RewardLog()
    for log in logs:
        for name, values in log.metrics.items():
            joined.metrics.setdefault(name, []).extend(values)
    for name in dict.fromkeys(n for log in logs for n in log.columns):
        parts = [log.columns.get(name) for log in logs]
        if all(v is not None and len(v) == len(p[0].prompts) for v, p in zip(parts, pieces, strict=True)):
            flat = [value for part in parts for value in part]
            joined.columns[name] = [flat[i] for i in rows]
        else:
            joined.columns[name] = [value for part in parts if part is not None for value in part]
    return joined


def _logged_metrics(
    reward_log: RewardLog | None, extra: dict[str, list[float]] | None
) -> dict[str, list[float]] | None:
    """The reward functions' logged metrics with the producer's own (``SampledResponses.extra_metrics``);
    None when there are neither."""
    if extra is None:
        return None if reward_log is None else reward_log.metrics
    merged = {} if reward_log is None else dict(reward_log.metrics)
    for name, values in extra.items():
        merged.setdefault(name, []).extend(values)
    return merged


class ProducerHooks:
    """The engine's hooks where a trainer changes how experience is collected, with the engine's own
    behaviour (one turn per row; no tools, environments or ``rollout_func``). A mixin before the engine
    overrides them (:class:`rlhf_trainers.agents.trainer.AgentRollouts` gives PPO, RLOO and GRPO theirs).
    Before any model loads the engine calls ``default_train_dataset``, ``setup_rollouts`` and
    ``extra_reward_sources``; ``make_producer`` once its parts exist."""

    def default_train_dataset(self, train_dataset: Any, args: Any, environment_factory: Any) -> Any:
        """The train dataset to use: ``train_dataset`` here (environments that own their data make one)."""
        return train_dataset

    def setup_rollouts(
        self,
        args: Any,
        model: Any,
        processing_class: Any,
        *,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Any = None,
        rollout_func: Callable[..., Any] | None = None,
    ) -> Any:
        """Check ``tools=``, ``environment_factory=`` and ``rollout_func=`` before the models load; returns
        the policy's tokenizer. The engine alone takes none of them."""
        given = {"tools=": bool(tools), "environment_factory=": environment_factory is not None}
        given["rollout_func="] = rollout_func is not None
        if any(given.values()):
            names = ", ".join(name for name, value in given.items() if value)
            raise ValueError(
                f"{type(self).__name__} takes no {names}; use PPOTrainer, RLOOTrainer or GRPOTrainer."
            )
        return processing_class

    def extra_reward_sources(self, args: Any) -> list[Any]:
        """Reward sources the run adds after ``reward_funcs`` (weight 1 each): none here (environments'
        ``get_reward`` with :class:`rlhf_trainers.agents.trainer.AgentRollouts`)."""
        return []

    def make_producer(self) -> RolloutProducer:
        """The rollout producer of this run: one turn per row."""
        return SingleTurnProducer(self)  # type: ignore[arg-type]
