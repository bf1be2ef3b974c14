"""The generation protocol: what every backend takes (prompts and :class:`SamplingSettings`) and returns
(:class:`Samples`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "ContextFactory",
    "DecodingSpeedups",
    "GenerationBackend",
    "GenerationError",
    "Samples",
    "SamplingSettings",
    "WeightSyncs",
    "check_samples",
    "filtered_scores",
    "on_any_process",
    "request_seeds",
]

#: Called before every ``sample`` call for the context the sampling runs in (e.g. ZeRO-3 gathering).
ContextFactory = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class DecodingSpeedups:
    """What a backend may sample with besides the model: given to
    :func:`~rlhf_trainers.generation.make_generation_backend` by whoever builds it (the trainers take it
    from :func:`rlhf_trainers.cpu.decoding_speedups`); the backend uses it without knowing what it is.
    The default is the plain loop."""

    #: The builtin loop's provider of faster decoding steps
    #: (:data:`~rlhf_trainers.generation.builtin.FastStepsProvider`), or None.
    fast_steps: Callable[..., Any] | None = None
    #: What ``fast_steps`` is called in the batch accounting ("" when None).
    fast_steps_name: str = ""
    #: A factory of one more context every sampling call runs in, or None.
    context: ContextFactory | None = None
    #: What ``context`` is called in the batch accounting ("" when None).
    context_name: str = ""
    #: How the builtin loop draws its tokens from the probabilities
    #: (:data:`~rlhf_trainers.generation.builtin.Draw`), or None for ``torch.multinomial``.
    draw: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: What ``draw`` is called in the batch accounting ("" when None).
    draw_name: str = ""
    #: Whether the builtin loop's decoding steps go on without the rows that stopped
    #: (:func:`~rlhf_trainers.generation.builtin.sample_with_kv_cache`).
    drop_finished_rows: bool = True


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample: ancestral sampling from ``softmax(logits / temperature)``, optionally restricted to
    the top-k tokens, the top-p nucleus and the tokens of at least min-p times the top probability (in that
    order, as ``transformers.generate``); no penalties; at most ``max_new_tokens`` tokens per row. The
    log-probs and entropies a backend returns are those of the unrestricted ``softmax(logits /
    temperature)``: the distribution the trainer's forward pass computes and trains."""

    #: Tokens to sample per row (>= 1); the result always has this many columns.
    max_new_tokens: int
    #: Written after a row's stop token, and in the columns of rows that stopped.
    pad_token_id: int
    #: The logits are divided by it (> 0).
    temperature: float = 1.0
    #: A row stops after sampling one of these (the stop token is kept); empty: every row samples
    #: ``max_new_tokens`` tokens, stop tokens like any other.
    stop_token_ids: Sequence[int] = ()
    #: Also return each sampled token's log-probability and each step's entropy.
    return_logprobs: bool = False
    #: Sample among the k most likely tokens only; 0: all.
    top_k: int = 0
    #: Sample within the smallest set of most likely tokens whose probability reaches top_p; 1.0: all.
    top_p: float = 1.0
    #: Sample among tokens of probability >= min_p x the most likely token's; 0.0: all.
    min_p: float = 0.0
    #: Each row's own limit (1 to ``max_new_tokens``), or None: ``max_new_tokens`` for every row. A
    #: backend may stop a row at its limit (vLLM: each request's ``max_tokens``, so that a row whose context
    #: leaves less room than ``max_new_tokens`` still fits the engine) or sample on to ``max_new_tokens``
    #: (the builtin loop); the caller cuts each row at its limit. A multi-turn producer gives it: its
    #: episodes have different numbers of tokens left.
    row_max_new_tokens: tuple[int, ...] | None = None
    #: Where a backend that gives each request a seed of its own (vLLM) draws those seeds from: a generator
    #: seeded with it, or None: torch's global generator. Asynchronous rollouts draw it before handing the
    #: call to another thread (which must not draw from the global generator). The builtin loop samples
    #: from the global generator and ignores it.
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.row_max_new_tokens is not None and not all(
            1 <= n <= self.max_new_tokens for n in self.row_max_new_tokens
        ):
            raise ValueError(
                f"row_max_new_tokens={list(self.row_max_new_tokens)}: expected each between 1 and "
                f"max_new_tokens={self.max_new_tokens}."
            )
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError(
                f"top_k={self.top_k}, top_p={self.top_p}, min_p={self.min_p}: expected top_k >= 0, top_p in "
                "(0, 1] and min_p in [0, 1]."
            )

    @property
    def filters(self) -> bool:
        """Whether any of top-k, top-p and min-p restricts the sampling."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def filtered_scores(scores: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """``scores`` (B, V) (temperature-scaled logits) with the tokens that top-k, then top-p, then min-p
    exclude set to -inf; at least the most likely token always stays. The scores themselves when no
    filter is set."""
    if not settings.filters:
        return scores
    out = scores
    if 0 < settings.top_k < scores.shape[-1]:
        kth = torch.topk(out, settings.top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, -torch.inf)
    if settings.top_p < 1:
        ascending, order = torch.sort(out, dim=-1)
        # drop the least likely tokens while their cumulated probability stays within 1 - top_p
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - settings.top_p
        drop[..., -1] = False
        out = out.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    if settings.min_p > 0:
        probs = out.softmax(-1)
        drop = probs < settings.min_p * probs.amax(-1, keepdim=True)
        out = out.masked_fill(drop, -torch.inf)
    return out


@dataclass(frozen=True)
class Samples:
    """What a backend returns for B prompts; every tensor has ``max_new_tokens`` columns."""

    #: (B, max_new_tokens) sampled token ids; ``pad_token_id`` after a row's stop token.
    tokens: torch.Tensor
    #: (B, max_new_tokens) float32 log-probability of each sampled token under
    #: ``softmax(logits / temperature)``, as the generation computed it; 0 after a row's stop token. None
    #: unless ``return_logprobs``.
    logprobs: torch.Tensor | None = None
    #: (B, max_new_tokens) float32 entropy of that distribution at each step; 0 after a row's stop token.
    #: None unless ``return_logprobs``.
    entropy: torch.Tensor | None = None


class GenerationError(RuntimeError):
    """A generation backend failed: its engine could not run (e.g. vLLM's engine died, or a weight sync into it
    failed) or it returned something other than one completion of ``max_new_tokens`` columns per prompt. The
    on-policy trainers add what became of the run (the checkpoint of the last complete update) to the
    message."""


def check_samples(samples: Samples, rows: int, settings: SamplingSettings) -> None:
    """Raise :class:`GenerationError` unless ``samples`` holds one completion per prompt row (``rows``) with
    ``settings.max_new_tokens`` columns, and log-probs of the same shape when they were asked for."""
    expected = (rows, settings.max_new_tokens)
    tokens = samples.tokens
    if tokens.dim() != 2 or tuple(tokens.shape) != expected:
        raise GenerationError(
            f"The generation backend returned completions of shape {tuple(tokens.shape)} for {rows} prompts; "
            f"expected {expected} (one completion of max_new_tokens={settings.max_new_tokens} columns per "
            "prompt). Fewer rows mean the engine dropped requests."
        )
    if (
        settings.return_logprobs
        and samples.logprobs is not None
        and tuple(samples.logprobs.shape) != expected
    ):
        raise GenerationError(
            f"The generation backend returned log-probs of shape {tuple(samples.logprobs.shape)}; expected "
            f"{expected}, the shape of its completions."
        )


@runtime_checkable
class GenerationBackend(Protocol):
    """Samples completions of left-padded prompts. Built once per trainer
    (:func:`~rlhf_trainers.generation.make_generation_backend`) for one model, which it samples from in
    eval mode (restoring the model's mode afterwards)."""

    #: Short description of the backend and what it runs with, printed in the batch accounting.
    name: str
    #: Whether its log-probs may stand in for a policy forward pass in a float32 rollout
    #: (``rollout_logprobs='auto'``): True where they come from the same arithmetic as the forward's.
    logprobs_for_rollout: bool
    #: Whether the whole rollout goes to ``sample`` in one call (an engine that schedules its own batches,
    #: vLLM); False: the trainer calls it per chunk of ``local_rollout_forward_batch_size`` rows.
    batches_internally: bool

    def sample(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, settings: SamplingSettings
    ) -> Samples:
        """Sample after each prompt row.

        Args:
            query_ids: (B, T) prompt ids, padded on the left.
            query_mask: (B, T) 1 at real prompt tokens.
            settings: what to sample.

        Returns:
            :class:`Samples` with exactly ``settings.max_new_tokens`` columns.
        """
        ...


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (dropout off, as the trainers' forward passes score) inside the context; its
    mode restored on exit."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def on_any_process(flag: bool, collective: bool, device: torch.device | str = "cpu") -> bool:
    """``flag`` or'ed over every process (an all-reduce) when ``collective``, else ``flag``: a weight sync
    that needs every process (gathered ZeRO-3 weights, a barrier) runs on all of them or on none."""
    if not collective:
        return flag
    value = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def request_seeds(rows: int, seed: int | None) -> list[int]:
    """One seed per request: drawn from a generator seeded with ``seed``, or from torch's global generator
    when it is None (:attr:`SamplingSettings.seed`)."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 1, (rows,), generator=generator).tolist()


def padded_to(samples: Samples, width: int, pad_token_id: int) -> Samples:
    """``samples`` with ``width`` columns: tokens padded with ``pad_token_id``, log-probs and entropies
    with 0 (generation stops early when every row has stopped)."""
    missing = width - samples.tokens.shape[1]
    if missing <= 0:
        return samples
    tokens = samples.tokens
    pad = tokens.new_full((tokens.shape[0], missing), pad_token_id)

    def zeros_after(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        return torch.cat([values, values.new_zeros(values.shape[0], missing)], dim=1)

    return Samples(
        torch.cat([tokens, pad], dim=1), zeros_after(samples.logprobs), zeros_after(samples.entropy)
    )


@contextlib.contextmanager
def entered(contexts: Sequence[ContextFactory | None]) -> Iterator[None]:
    """Inside the context, every context the factories give (None: skipped), entered in order."""
    with contextlib.ExitStack() as stack:
        for make in contexts:
            if make is not None:
                stack.enter_context(make())
        yield


class WeightSyncs:
    """The sync bookkeeping of a backend whose engine holds its own copy of the policy's weights (the vLLM
    engines): how many syncs, their seconds, and whether the policy changed since the last one.

    Args:
        weights_version: returns a value that changes whenever the policy's weights may have changed.
    """

    def __init__(self, weights_version: Callable[[], Hashable]) -> None:
        self.weights_version = weights_version
        self.last_sync_seconds = 0.0
        self.sync_seconds = 0.0
        self.syncs = 0
        self._synced_version: Hashable = object()

    def is_stale(self) -> bool:
        """Whether the policy's weights may have changed since the last sync."""
        return self.weights_version() != self._synced_version

    @contextlib.contextmanager
    def syncing(self) -> Iterator[None]:
        """Around one sync: until it completes the engine holds a mix of old and new weights, so it matches
        no version (a sync that fails half way is redone in full before the next generation); on success
        the version read at the start is the synced one, and the seconds are counted."""
        started = time.perf_counter()
        version = self.weights_version()
        self._synced_version = object()
        yield
        self._synced_version = version
        self.last_sync_seconds = time.perf_counter() - started
        self.sync_seconds += self.last_sync_seconds
        self.syncs += 1
