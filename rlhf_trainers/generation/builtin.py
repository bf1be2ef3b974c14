"""The builtin sampling loop: ancestral sampling from ``softmax(logits / temperature)`` with a KV cache.

Why not ``model.generate()``: ``generate`` fills every sampling setting that its ``GenerationConfig``
leaves unset from the model's own ``generation_config.json`` (a ``repetition_penalty``, a
``no_repeat_ngram_size``, ``suppress_tokens``...), so a Hub checkpoint can silently sample from another
distribution than the one the trainer's forward passes score, and the rollout is off-policy without a
trace. This loop samples from exactly the distribution the log-probs describe, and it can return the
log-probability and entropy of each sampled token from the logits it already has, which spares the
rollout a separate forward pass of the policy (``rollout_logprobs``). Its draws are those of
``generate(do_sample=True, top_k=0, top_p=1.0, temperature=...)`` for the same seed (the same
``softmax`` and ``torch.multinomial`` calls, in the same order), unless it is given another way to draw
(:func:`draw_inverse_cdf`, which the trainers use on CPU: ``CPUOptions.inverse_cdf_sampling``).

The loop runs the model's forward at every step, unless it is given a provider of faster decoding steps
(:data:`FastStepsProvider`) that takes over after the prompt pass for the models it can reproduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ..compat import cache_keyword, output_cache
from ..models import embedding_rows, readable_ids
from .base import ContextFactory, Samples, SamplingSettings, entered, eval_mode, filtered_scores, padded_to

__all__ = [
    "BuiltinSampling",
    "Draw",
    "FastDecodingSteps",
    "FastStepsProvider",
    "draw_inverse_cdf",
    "draw_multinomial",
    "sample_with_kv_cache",
    "shared_prompt_rows",
]


class FastDecodingSteps(Protocol):
    """Decoding steps that replace the model's forward after the prompt pass. Steps that can also drop rows
    have a ``select_rows(index)`` method (:func:`sample_with_kv_cache`'s ``drop_finished_rows``): keep only
    the rows ``index`` (A,) of their state, in that order."""

    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of the position after ``token`` (B,), which sits at ``position`` (B, 1)."""
        ...


#: ``provider(model, prompt_output, prompt_mask, max_new_tokens)``: faster decoding steps for ``model``
#: after its prompt pass (``prompt_output``, a model output whose cache holds the prompt's keys and
#: values, over ``prompt_mask`` (B, T)), or None where the model's forward must run the steps.
FastStepsProvider = Callable[[nn.Module, Any, torch.Tensor, int], "FastDecodingSteps | None"]

#: ``draw(probs)``: one token id per row (B,) drawn from the categorical distributions ``probs`` (B, V)
#: (float32, rows summing to 1 up to rounding, zeros at excluded tokens), from torch's default generator.
Draw = Callable[[torch.Tensor], torch.Tensor]

#: Rows per block of :func:`draw_inverse_cdf`: a block's float64 running sums stay in the CPU's cache.
_INVERSE_CDF_ROWS = 16

#: ``drop_finished_rows`` drops the stopped rows once at least 1 / this of the running rows have stopped:
#: each drop copies the cache, so it waits for a few (SmolLM2-135M, 16 rows: 4, 8 and every row
#: measured alike within noise).
_DROP_DIVISOR = 4


def draw_multinomial(probs: torch.Tensor) -> torch.Tensor:
    """``torch.multinomial(probs, 1)``: the draws of ``generate(do_sample=True)`` for the same seed. On CPU,
    PyTorch draws one exponential variate per vocabulary entry (the exponential race), ~1.8 us per row
    per 1,000 entries: 22-32 ms per step for 16 rows of SmolLM2's 49,152 entries on one thread."""
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def draw_inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """One exact draw per row from ``probs`` (B, V) by inverting its cumulative distribution: a single
    uniform variate ``u`` per row (``torch.rand``, float64, from the default generator), and the first
    token whose running sum exceeds ``u`` times the row's total.

    The same distribution as :func:`draw_multinomial` (not the same draws for a seed): token ``i`` is drawn
    with probability ``probs[i] / sum(probs)``, computed from float64 running sums (their rounding, ~1e-16
    of the total, is far below float32's resolution of the probabilities themselves); a token of
    probability 0 (filtered out by top-k / top-p / min-p) is never drawn. One variate per row instead of
    one per vocabulary entry: on one CPU thread, 16 rows x 49,152 entries take 1.4-2.1 ms against
    ``torch.multinomial``'s 22-32 ms. The rows go in blocks of 16, whose float64 sums stay in cache.

    Raises:
        ValueError: a row whose probabilities are not finite or sum to zero (as ``torch.multinomial``).
    """
    if probs.dim() != 2:
        raise ValueError(f"draw_inverse_cdf takes probabilities of shape (B, V); got {tuple(probs.shape)}.")
    uniform = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    drawn = []
    for start in range(0, probs.shape[0], _INVERSE_CDF_ROWS):
        sums = probs[start : start + _INVERSE_CDF_ROWS].to(torch.float64).cumsum_(-1)
        total = sums[:, -1:]
        if not bool(torch.isfinite(total).all() and (total > 0).all()):
            raise ValueError(
                "draw_inverse_cdf: a row of the probability tensor contains inf or nan, or sums to zero "
                "(the model's logits were not finite)."
            )
        # u <= 1 - 2**-53, so u x total < total after float64 rounding (the product falls short of total by
        # at least half its spacing): the first running sum above the point is a token's of nonzero share.
        point = uniform[start : start + _INVERSE_CDF_ROWS] * total
        drawn.append(torch.searchsorted(sums, point, right=True).squeeze(1))
    return torch.cat(drawn) if len(drawn) > 1 else drawn[0]


def shared_prompt_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where rows of a left-padded prompt batch (B, T) repeat one another (RLOO's and GRPO's k completions of
    one prompt): ``(first, inverse)``, the index of one row of each distinct prompt (U,) and, for every row,
    the position of its prompt in ``first`` (B,), so that ``rows[first][inverse]`` equals ``rows``; None
    when all B rows differ. Two rows are the same prompt when their masks and their tokens under the mask
    agree (what sits under the padding does not matter)."""
    B = input_ids.shape[0]
    if B < 2:
        return None
    mask = attention_mask.to(input_ids.dtype)
    distinct, inverse = torch.unique(torch.cat([mask, input_ids * mask], dim=1), dim=0, return_inverse=True)
    if distinct.shape[0] == B:
        return None
    rows = torch.arange(B, device=input_ids.device)
    first = torch.full((distinct.shape[0],), B, dtype=rows.dtype, device=rows.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


def _prompt_pass(
    model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, share: bool
) -> tuple[Any, torch.Tensor]:
    """The prompt pass of :func:`sample_with_kv_cache`: the model output (its cache holding the prompt's keys
    and values for all B rows) and the last position's logits (B, V). With ``share``, a prompt that several
    rows repeat runs once (:func:`shared_prompt_rows`) and its keys, values and logits are copied to its
    rows (the cache's ``batch_select_indices``); a cache without that method gets the full pass instead."""
    shared = shared_prompt_rows(input_ids, mask) if share else None
    if shared is not None:
        first, inverse = shared
        out = model(
            input_ids=input_ids[first],
            attention_mask=mask[first],
            position_ids=positions[first],
            use_cache=True,
            logits_to_keep=1,
        )
        cache = output_cache(out)
        if hasattr(cache, "batch_select_indices"):
            cache.batch_select_indices(inverse)
            return out, out.logits[inverse, -1, :]
    out = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    return out, out.logits[:, -1, :]


@torch.no_grad()
def sample_with_kv_cache(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: SamplingSettings,
    fast_steps: FastStepsProvider | None = None,
    draw: Draw = draw_multinomial,
    share_prompt_pass: bool = True,
    drop_finished_rows: bool = True,
) -> Samples:
    """The loop itself (the model as it is, no context): ``n <= max_new_tokens`` columns, fewer when every
    row stopped early. ``model`` is a causal LM (or a PEFT model around one) whose forward accepts ``attention_mask``,
    ``position_ids``, a KV cache (:func:`~rlhf_trainers.compat.cache_keyword`: ``cache``, or
    ``past_key_values`` before transformers renamed it), ``use_cache`` and ``logits_to_keep``;
    ``input_ids`` and ``attention_mask`` (B, T) hold left-padded prompts. A ``settings.pad_token_id`` past
    the model's embedding table never reaches it: the model reads 0 at the prompt's padding and after a
    row's stop token (:func:`rlhf_trainers.models.readable_ids`); the returned tokens hold the pad id.
    ``draw`` picks each step's tokens from the probabilities (:func:`draw_multinomial`: ``generate``'s
    draws; :func:`draw_inverse_cdf`: the same distribution, faster on CPU).

    ``share_prompt_pass``: rows that repeat a prompt (RLOO's and GRPO's k completions) share its prompt
    pass: each distinct prompt runs once, and its keys, values and last logits are copied to every row
    that repeats it (:func:`shared_prompt_rows`): the same distribution, up to the float rounding of a
    smaller batch, which can very rarely move a draw. Off: all B rows, as ``generate`` does.

    ``drop_finished_rows``: once a quarter or more of the rows the model runs have stopped, the decoding
    steps go on without them (dropped from the cache by the fast steps' ``select_rows`` or the cache's
    ``batch_select_indices``; without one, every row runs to the end, as ``generate`` does). ``draw`` is
    still given all B rows' probabilities, so the random numbers it consumes and the tokens drawn are
    those of the loop without dropping, up to the rounding of products over fewer rows.
    """
    rows = embedding_rows(model)
    input_ids = readable_ids(input_ids, settings.pad_token_id, rows)
    mask = attention_mask.long()
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    next_position = mask.sum(1, keepdim=True)
    stops = torch.tensor(list(settings.stop_token_ids), dtype=input_ids.dtype, device=input_ids.device)
    B = input_ids.shape[0]
    # The rows the model still runs: `unfinished` and the step's tensors have one entry per such row;
    # `active` holds their rows of the batch (None: all B, in order).
    unfinished = torch.ones(B, dtype=torch.bool, device=input_ids.device)
    active: torch.Tensor | None = None
    # Once rows are dropped: the probabilities of all B rows that `draw` is given (a dropped row's last).
    all_probs: torch.Tensor | None = None
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    out, logits = _prompt_pass(model, input_ids, mask, positions, share_prompt_pass)
    steps = fast_steps(model, out, mask, settings.max_new_tokens) if fast_steps is not None else None
    if steps is not None:
        droppable = hasattr(steps, "select_rows")
    else:
        droppable = hasattr(output_cache(out), "batch_select_indices")
    droppable = droppable and drop_finished_rows and bool(stops.numel())
    for step in range(settings.max_new_tokens):
        scores, probs, drawn_from = _step_distribution(logits, settings)
        if active is None:
            token = draw(drawn_from)
        else:
            token = draw(all_probs.index_copy_(0, active, drawn_from)).index_select(0, active)
        token = torch.where(unfinished, token, torch.full_like(token, settings.pad_token_id))
        tokens.append(_all_rows(token, active, B, settings.pad_token_id))
        # What the model reads back: a stopped row's pad id as an id it has (its outputs are unused).
        fed = readable_ids(token, settings.pad_token_id, rows)
        if settings.return_logprobs:
            chosen, entropy = _step_logprobs(scores, probs, fed, unfinished)
            logprobs.append(_all_rows(chosen, active, B, 0))
            entropies.append(_all_rows(entropy, active, B, 0))
        if stops.numel():
            unfinished = unfinished & ~torch.isin(token, stops)
            if not bool(unfinished.any()):
                break
        if step == settings.max_new_tokens - 1:
            break
        if droppable:
            running = unfinished.shape[0]
            stopped = running - int(unfinished.sum())
            if stopped and _DROP_DIVISOR * stopped >= running:
                keep = unfinished.nonzero().squeeze(1)
                if all_probs is None:
                    all_probs = drawn_from.clone()
                active = keep if active is None else active.index_select(0, keep)
                fed, unfinished = fed.index_select(0, keep), unfinished.index_select(0, keep)
                next_position = next_position.index_select(0, keep)
                if steps is not None:
                    steps.select_rows(keep)
                else:
                    output_cache(out).batch_select_indices(keep)
                    mask = mask.index_select(0, keep)
        if steps is not None:
            logits = steps.step(fed, next_position)
        else:
            logits, out, mask = _forward_step(model, out, mask, fed, next_position)
        next_position = next_position + 1
    return Samples(
        torch.stack(tokens, dim=1),
        torch.stack(logprobs, dim=1) if settings.return_logprobs else None,
        torch.stack(entropies, dim=1) if settings.return_logprobs else None,
    )


def _step_distribution(
    logits: torch.Tensor, settings: SamplingSettings
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoding step's ``(scores, probs, drawn_from)``: the float32 logits / temperature (as generate()
    computes them before its logits processors), their softmax, and the distribution tokens are drawn
    from (top-k / top-p / min-p applied; the log-probs stay those of ``scores``)."""
    scores = logits.to(dtype=torch.float32, copy=True)
    if settings.temperature != 1.0:
        scores = scores / settings.temperature
    probs = torch.softmax(scores, dim=-1)
    drawn_from = torch.softmax(filtered_scores(scores, settings), dim=-1) if settings.filters else probs
    return scores, probs, drawn_from


def _step_logprobs(
    scores: torch.Tensor, probs: torch.Tensor, fed: torch.Tensor, unfinished: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-prob of each row's token ``fed`` and the entropy of its step's distribution; 0 in rows
    that stopped."""
    log_probs = torch.log_softmax(scores, dim=-1)
    chosen = log_probs.gather(1, fed[:, None]).squeeze(1)
    entropy = -(probs * log_probs).nan_to_num().sum(-1)  # 0 * -inf at masked-out tokens counts 0
    chosen = torch.where(unfinished, chosen, torch.zeros_like(chosen))
    entropy = torch.where(unfinished, entropy, torch.zeros_like(entropy))
    return chosen, entropy


def _forward_step(
    model: nn.Module, out: Any, mask: torch.Tensor, fed: torch.Tensor, next_position: torch.Tensor
) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """One decoding step through the model's forward with its KV cache: ``(logits, out, mask)``."""
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    cache = {cache_keyword(model): output_cache(out)}
    out = model(
        input_ids=fed[:, None], attention_mask=mask, position_ids=next_position, use_cache=True, **cache
    )
    return out.logits[:, -1, :], out, mask


def _all_rows(values: torch.Tensor, active: torch.Tensor | None, rows: int, fill: float) -> torch.Tensor:
    """``values`` of the rows the model still runs (``active``, None: all) as a (rows,) tensor, ``fill`` at
    the rows dropped."""
    if active is None:
        return values
    return values.new_full((rows,), fill).index_copy_(0, active, values)


class BuiltinSampling:
    """The builtin loop (:func:`sample_with_kv_cache`) as a :class:`~rlhf_trainers.generation.GenerationBackend`.

    Args:
        model: the causal LM to sample from.
        contexts: factories of the contexts every ``sample`` call runs in (e.g. ZeRO-3 gathering, a
            faster matmul library), entered in order.
        fast_steps: a provider of faster decoding steps, asked at every call (it may decline).
        draw: how each step's tokens are drawn from the probabilities (default :func:`draw_multinomial`,
            ``generate``'s draws for a seed).
        share_prompt_pass: rows that repeat a prompt share its prompt pass (see
            :func:`sample_with_kv_cache`; default True).
        drop_finished_rows: the decoding steps go on without the rows that stopped (see
            :func:`sample_with_kv_cache`; default True).
        name: what the batch accounting prints.
    """

    logprobs_for_rollout = True
    batches_internally = False

    def __init__(
        self,
        model: nn.Module,
        *,
        contexts: tuple[ContextFactory | None, ...] = (),
        fast_steps: FastStepsProvider | None = None,
        draw: Draw = draw_multinomial,
        share_prompt_pass: bool = True,
        drop_finished_rows: bool = True,
        name: str = "builtin",
    ) -> None:
        self.model = model
        self.contexts = contexts
        self.fast_steps = fast_steps
        self.draw = draw
        self.share_prompt_pass = share_prompt_pass
        self.drop_finished_rows = drop_finished_rows
        self.name = name

    @torch.no_grad()
    def sample(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, settings: SamplingSettings
    ) -> Samples:
        """See :meth:`GenerationBackend.sample`."""
        with entered(self.contexts), eval_mode(self.model):
            samples = sample_with_kv_cache(
                self.model,
                query_ids,
                query_mask,
                settings,
                self.fast_steps,
                draw=self.draw,
                share_prompt_pass=self.share_prompt_pass,
                drop_finished_rows=self.drop_finished_rows,
            )
        return padded_to(samples, settings.max_new_tokens, settings.pad_token_id)
