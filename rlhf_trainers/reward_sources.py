"""Reward sources: scoring text or token ids with a reward model, rule-based reward functions, their
weights and penalties, and LHPD's reward normalization (not the reward-model trainer, which is
:mod:`rlhf_trainers.reward`).

LHPD (the lm-human-preferences details), "Reward model normalization before and after": sample completions from the
reference (pretrained) policy, score them, and choose a gain ``g`` and bias ``b`` so that
``raw * g + b`` has the target mean and std (0 and 1 in LHPD). The gain and bias live in the
reward model's config (:mod:`rlhf_trainers.models`) and are applied wherever the model scores.

:class:`RewardSources` is what the on-policy trainers (PPO, RLOO) call once per rollout batch: a reward
model (scoring the policy's token ids directly when it shares the policy's tokenizer, re-tokenizing the
text otherwise) and rule-based reward functions, each giving one reward per sequence, combined with
weights.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import functional as F
from .distributed import gathered
from .generation import SamplingSettings, make_generation_backend
from .models import (
    align_pad_token,
    check_one_label,
    embedding_rows,
    get_reward_normalization,
    pooled_scores,
    readable_pad_id,
)
from .packing import packed_pooled_scores, packed_score_head, packing_layout

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Prompt = str | list[dict[str, str]]


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
    """Sample one completion per prompt from ``softmax(logits / temperature)`` (LHPD's settings: no top-k,
    no top-p), stopping at EOS; returns the decoded completions without special tokens.

    The samples come from the trainers' generation interface (:mod:`rlhf_trainers.generation`, the builtin
    loop), so nothing comes from the model's own ``generation_config`` either; ZeRO-3 partitioned weights
    are gathered for the call.
    """
    texts = render_prompts(prompts, tokenizer)
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    responses = sample_responses(
        policy,
        tokenizer,
        prompt_ids,
        response_length=response_length,
        temperature=temperature,
        batch_size=batch_size,
    )
    return tokenizer.batch_decode(responses, skip_special_tokens=True)


@torch.no_grad()
def sample_responses(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    *,
    response_length: int,
    temperature: float = 1.0,
    batch_size: int = 64,
) -> list[list[int]]:
    """One response per prompt (token ids), sampled as :func:`sample_completions` samples: the prompts
    left-padded, the full distribution at ``temperature``, at most ``response_length`` tokens. A response
    ends at its first EOS, which it keeps, or at the length limit; no padding is returned."""
    backend = make_generation_backend(policy, context=lambda: gathered(policy))
    settings = SamplingSettings(
        max_new_tokens=response_length,
        temperature=temperature,
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
    )
    device = next(policy.parameters()).device
    pad = tokenizer.pad_token_id
    responses: list[list[int]] = []
    for start in range(0, len(prompt_ids), batch_size):
        batch = prompt_ids[start : start + batch_size]
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        tokens = backend.sample(ids.to(device), mask.to(device), settings).tokens
        if tokenizer.eos_token_id is not None:
            tokens = F.truncate_response(tokens, tokenizer.eos_token_id, pad)
        # The lengths come from the padding the truncation wrote after EOS (the pad id may also be a
        # token the model sampled only if pad == EOS, which the truncation has already cut at).
        for row in tokens.cpu().tolist():
            end = len(row)
            while end and row[end - 1] == pad:
                end -= 1
            responses.append(row[:end])
    return responses


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
    padding_free: bool = False,
) -> torch.Tensor:
    """Rewards (N,) float32 of full texts (prompt + completion), read at the last real token.

    The texts are tokenized as the reward trainer tokenizes its pairs (EOS appended when missing if
    ``add_eos``, the start cut when longer than ``max_length``). With ``normalize`` the stored gain and
    bias are applied. ``forward`` replaces ``model.__call__`` (e.g. a DeepSpeed engine). A tokenizer pad id
    past the model's embedding table is replaced by 0 (:func:`rlhf_trainers.models.pooled_scores`).
    ``padding_free`` runs each batch's real tokens packed, as :func:`score_ids` does (for a model that
    passes :func:`rlhf_trainers.packing.packing_layout` and has a
    :func:`rlhf_trainers.packing.packed_score_head`; ignored with ``forward``).
    """
    device = next(model.parameters()).device
    gain, bias = get_reward_normalization(model) if normalize else (1.0, 0.0)
    call = forward or model
    gather = gathered(model) if forward is None else contextlib.nullcontext()
    packed = padding_free and forward is None
    with gather:
        scores = _score_batches(
            model, call, tokenizer, texts, batch_size, max_length, add_eos, device, packed
        )
    raw = torch.cat(scores) if scores else torch.zeros(0)
    return raw * gain + bias


def _score_batches(
    model: PreTrainedModel,
    call: Callable[..., Any],
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    batch_size: int,
    max_length: int | None,
    add_eos: bool,
    device: torch.device,
    packed: bool = False,
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
        input_ids, attention = input_ids.to(device), attention.to(device)
        if packed and bool(attention.any(1).all()):
            # The packed rows' free tails read id 0 (their outputs are not used).
            logits = packed_pooled_scores(model, input_ids, attention, 0)
        else:
            logits = pooled_scores(model, input_ids, attention, tokenizer.pad_token_id, call=call)
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


# --------------------------------------------------------------------------------------------------
# token ids scored directly, and the reward sources of the on-policy trainers
# --------------------------------------------------------------------------------------------------

RewardFunc = Callable[..., Sequence[float | None]]
"""A rule-based reward: called as ``f(prompts=[...], completions=[...], **columns)``, it returns one
float (or ``None``, "no reward for this row") per completion."""

_FIXED_ARGS = ("prompts", "completions")
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _keep_last_tokens(ids: torch.Tensor, pad_token_id: int, max_length: int) -> torch.Tensor:
    """Each row cut to its last ``max_length`` tokens ending at its last non-pad token, left-padded.

    Rows whose span (first to last non-pad token) fits are kept whole; the result is at most
    ``max_length`` wide. Rows without any non-pad token become all padding.
    """
    width = ids.shape[1]
    if width <= max_length:
        return ids
    positions = torch.arange(width, device=ids.device)
    last = torch.where(ids != pad_token_id, positions, -1).max(-1).values
    end = last + 1
    start = (end - max_length).clamp(min=0)
    new_width = max(int((end - start).max()), 1)
    index = end.unsqueeze(-1) - new_width + torch.arange(new_width, device=ids.device)
    kept = index >= start.unsqueeze(-1)
    gathered = ids.gather(1, index.clamp(min=0))
    return torch.where(kept, gathered, torch.full_like(gathered, pad_token_id))


@torch.no_grad()
def score_ids(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    pad_token_id: int,
    *,
    batch_size: int = 64,
    max_length: int | None = None,
    normalize: bool = True,
    forward: Callable[..., Any] | None = None,
    padding_free: bool = False,
) -> torch.Tensor:
    """Rewards (B,) float32 on CPU of padded token ids, read at the last non-pad token of each row.

    ``input_ids`` (B, T) may be padded on both sides with ``pad_token_id`` (a rollout's left-padded
    prompt followed by its right-padded response). The attention mask is ``input_ids != pad_token_id``
    and the position ids skip the left padding (:func:`rlhf_trainers.functional.position_ids_from_mask`),
    so a row scores as it would alone. The score itself is the pooled logit of the
    sequence-classification model, which transformers reads at the rightmost token that is not
    ``config.pad_token_id``: that is the last non-pad token whatever the padding side as long as
    ``config.pad_token_id == pad_token_id``, which is checked (:func:`rlhf_trainers.models.align_pad_token`
    sets it). If the pad id is also the EOS id, a final EOS counts as padding and the score is read at
    the token before it. A pad id past the model's embedding table (a ``[PAD]`` token added without
    resizing) never reaches the model: it is replaced by 0 and the score read at the last non-pad token
    from the head's per-token output (:func:`rlhf_trainers.models.pooled_scores`).

    Args:
        model: a one-label sequence-classification model (its parameters give the device).
        input_ids: (B, T) token ids, on any device.
        pad_token_id: the id the rows are padded with.
        batch_size: rows per forward pass.
        max_length: if given, each row keeps only its last ``max_length`` tokens (up to its last
            non-pad token), as :func:`score_texts` cuts the start of long texts.
        normalize: apply the gain and bias stored in the model's config.
        forward: replaces ``model.__call__`` (e.g. a DeepSpeed engine); without it, ZeRO-3 partitioned
            weights are gathered for the forward passes.
        padding_free: run each chunk's real tokens packed (:func:`rlhf_trainers.packing.packed_pooled_scores`;
            for a model that passes :func:`rlhf_trainers.packing.packing_layout` and has a
            :func:`rlhf_trainers.packing.packed_score_head`, without ``forward``); a chunk with a row
            without any real token is scored padded.

    Raises:
        ValueError: for ids that are not (B, T), or a model that pools at another pad id.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}.")
    config_pad = getattr(model.config, "pad_token_id", None)
    # A pad id past the embedding table is read by pooled_scores at the last real token itself.
    readable = readable_pad_id(pad_token_id, embedding_rows(model)) == pad_token_id
    if readable and config_pad != pad_token_id:
        raise ValueError(
            f"The reward model pools at config.pad_token_id={config_pad}, but the ids are padded with "
            f"{pad_token_id}: the reward would be read at the wrong token. Call "
            "rlhf_trainers.models.align_pad_token(model, tokenizer) first."
        )
    ids = input_ids.long()
    if max_length is not None:
        ids = _keep_last_tokens(ids, pad_token_id, max_length)
    device = next(model.parameters()).device
    gain, bias = get_reward_normalization(model) if normalize else (1.0, 0.0)
    call = forward or model
    gather = gathered(model) if forward is None else contextlib.nullcontext()
    scores = []
    with gather:
        for start in range(0, ids.shape[0], batch_size):
            chunk = ids[start : start + batch_size].to(device)
            mask = (chunk != pad_token_id).long()
            if padding_free and forward is None and bool(mask.any(1).all()):
                # The packed rows' free tails read id 0 (their outputs are not used): the pad id may have
                # no embedding row.
                logits = packed_pooled_scores(model, chunk, mask, 0)
            else:
                logits = pooled_scores(
                    model, chunk, mask, pad_token_id, call=call, position_ids=F.position_ids_from_mask(mask)
                )
            if logits.dim() != 2 or logits.shape[-1] != 1:
                raise ValueError(
                    "The reward model must return pooled logits of shape (batch, 1), as a one-label "
                    f"sequence-classification model does; got shape {tuple(logits.shape)}."
                )
            scores.append(logits[:, 0].float().cpu())
    raw = torch.cat(scores) if scores else torch.zeros(0)
    return raw * gain + bias


def _func_name(func: Any) -> str:
    """A readable name for a reward function (``__name__``; a partial's function; the class name)."""
    if isinstance(func, functools.partial):
        return _func_name(func.func)
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) and name else type(func).__name__


def _unique_names(names: Sequence[str]) -> list[str]:
    """``names`` made unique in order: the first keeps its name, later ones get ``_2``, ``_3``, ..."""
    used: set[str] = set()
    out = []
    for name in names:
        candidate, n = name, 1
        while candidate in used:
            n += 1
            candidate = f"{name}_{n}"
        used.add(candidate)
        out.append(candidate)
    return out


class _FuncSpec:
    """What a reward function accepts: ``**kwargs`` or not, its keyword parameters, the required ones."""

    __slots__ = ("params", "required", "var_keyword")

    def __init__(self, var_keyword: bool, params: frozenset[str], required: tuple[str, ...]) -> None:
        self.var_keyword = var_keyword
        self.params = params
        self.required = required


def _inspect_reward_func(func: Any, index: int) -> _FuncSpec:
    """Check that ``func`` can be called as ``func(prompts=..., completions=..., **columns)``."""
    if not callable(func):
        raise TypeError(
            f"reward_funcs[{index}] must be callable, a function f(prompts, completions, **kwargs) that "
            f"returns one float per completion; got {type(func).__name__}: {func!r}."
        )
    name = _func_name(func)
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # some builtins: nothing to check, everything is passed
        return _FuncSpec(True, frozenset(), ())
    params = list(signature.parameters.values())
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    keyword = frozenset(p.name for p in params if p.kind in _KEYWORD_KINDS)
    positional_only = [
        p.name
        for p in params
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    missing = [arg for arg in _FIXED_ARGS if arg not in keyword]
    if positional_only or (missing and not var_keyword):
        example = (
            "lambda prompts, completions, **kwargs: ..."
            if name == "<lambda>"
            else (f"def {name}(prompts, completions, **kwargs): ...")
        )
        raise TypeError(
            f"reward function {name!r} (reward_funcs[{index}]) has the signature {signature}, but reward "
            "functions are called with keyword arguments only: f(prompts=[...], completions=[...], "
            "**dataset_columns). Name its parameters `prompts` and `completions` (and take the other "
            f"columns with **kwargs), e.g. `{example}`."
        )
    required = tuple(
        p.name
        for p in params
        if p.kind in _KEYWORD_KINDS and p.default is inspect.Parameter.empty and p.name not in _FIXED_ARGS
    )
    return _FuncSpec(var_keyword, keyword, required)


def _rewards_tensor(values: Any, name: str, batch: int) -> torch.Tensor:
    """A reward function's result as a float32 (B,) tensor, ``None`` and non-finite values as NaN."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise ValueError(
            f"reward function {name!r} returned {type(values).__name__}, expected a list of {batch} floats "
            "(one per completion, None where it has no reward)."
        )
    if len(values) != batch:
        raise ValueError(
            f"reward function {name!r} returned {len(values)} values for a batch of {batch} completions; "
            "it must return exactly one float (or None) per completion, in order."
        )
    out = torch.empty(batch, dtype=torch.float32)
    for i, value in enumerate(values):
        if value is None:
            out[i] = math.nan
            continue
        if isinstance(value, (str, bytes)):
            raise TypeError(
                f"reward function {name!r} returned {value!r} at index {i}; expected a float or None."
            )
        try:
            number = float(value)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"reward function {name!r} returned {value!r} ({type(value).__name__}) at index {i}; expected "
                "a float or None."
            ) from err
        out[i] = number if math.isfinite(number) else math.nan
    return out


#: What a failing reward function does (``RewardSources(on_error=...)``, ``reward_func_errors``).
REWARD_ERROR_MODES = ("raise", "skip")


class RewardSources:
    """The rewards of a rollout batch: a reward model and/or rule-based reward functions, weighted.

    The on-policy trainers call it once per rollout batch. Each source gives one float per sequence;
    the total is ``sum(weight * source)``.

    **Reward model.** ``same_tokenizer`` is true when ``reward_tokenizer`` is None or has the policy
    tokenizer's vocabulary (``get_vocab()``) and pad id. Then the rollout's ``query_response_ids`` are
    scored as they are (:func:`score_ids`: attention mask ``ids != pad``, position ids that skip the left
    padding, the score read at the last non-pad token). A response that did not stop (no EOS) is scored
    as it is, without an EOS. Otherwise each ``prompt`` and ``completion`` are joined into a text
    (:func:`join_prompt_completion`, chat prompts through the reward tokenizer's chat template) and
    scored by :func:`score_texts` with the reward trainer's tokenization (EOS appended when missing).
    Both paths apply the normalization gain and bias stored in the model, run without gradients, in
    eval mode (the previous mode is restored), on the model's device, through ``reward_model_forward``
    when given (a DeepSpeed engine) and else gathering ZeRO-3 partitioned weights. At construction the
    model's ``config.pad_token_id`` is set to the pad id it will see
    (:func:`rlhf_trainers.models.align_pad_token`): transformers pools at the rightmost token that is not
    ``config.pad_token_id``, which is the last real token with left and right padding alike only if
    the two ids agree.

    **Reward functions** are called as ``f(prompts=list(prompts), completions=list(completions),
    **columns)``. A function without ``**kwargs`` receives only the columns it names; a parameter without
    a default that is neither ``prompts``/``completions`` nor a column of the batch is an error at call
    time. A function must return one value per completion. ``None`` (no reward for that row) and
    non-finite values become NaN in its tensor. NaN is not dropped here: a row's ``total`` is NaN when
    any of its sources is NaN (even with weight 0), and what to do with such rows (skip, zero, combine
    the other sources with ``nansum`` over ``per_source``) is the caller's decision. A function that
    raises, or returns the wrong number or kind of values, is handled per ``on_error``: ``"raise"``
    raises a ``RuntimeError`` naming the function and the first prompt index whose row alone reproduces
    the error (the original exception is the cause); ``"skip"`` gives NaN for every row of that
    function in this batch (so they take no part in the update), logs a warning and counts the rows in
    ``last_errors``.

    Under ZeRO-3 every process must call this with the same number of rows (the same number of
    reward-model forward passes).

    Args:
        policy_tokenizer: the policy's tokenizer; its pad id pads ``query_response_ids``.
        reward_model: a one-label sequence-classification model (or None).
        reward_tokenizer: the reward model's tokenizer; None means the policy's.
        reward_funcs: one reward function or a sequence of them (or None).
        reward_weights: one finite weight per source (reward model first, then the functions);
            default 1.0 each.
        batch_size: rows per reward-model forward pass.
        max_length: if given, the reward model sees at most the last ``max_length`` tokens of each
            sequence (its end, where the score is read).
        on_error: ``"raise"`` (default) or ``"skip"``: what a failing reward function does (see above).
        padding_free: score with the real tokens packed, when the reward model allows it (checked once,
            at the first scoring): the policy's ids (``same_tokenizer``, see :func:`score_ids`) or the
            texts tokenized by the reward model's own tokenizer (:func:`score_texts`); scoring through
            ``reward_model_forward`` stays padded.

    Attributes:
        last_errors: rows of the last call whose reward function failed (``on_error="skip"``).
        names: one per source: ``"reward_model"`` first when there is one, then each function's
            ``__name__``, made unique (``name``, ``name_2``, ...).
        weights: one float per source, in the order of ``names``.
        same_tokenizer: whether the reward model scores the policy's token ids directly.

    Raises:
        ValueError: no source; a reward model that is not a one-label sequence-classification model; a
            reward tokenizer (or, with the policy's ids, a policy tokenizer) without a pad token; a
            reward tokenizer without a reward model; weights of the wrong number or not finite; a
            ``batch_size`` or ``max_length`` below 1.
        TypeError: a reward function that is not callable or cannot take ``prompts=`` and
            ``completions=`` as keyword arguments.
    """

    def __init__(
        self,
        *,
        policy_tokenizer: PreTrainedTokenizerBase,
        reward_model: PreTrainedModel | None = None,
        reward_tokenizer: PreTrainedTokenizerBase | None = None,
        reward_funcs: Sequence[RewardFunc] | RewardFunc | None = None,
        reward_weights: Sequence[float] | None = None,
        batch_size: int = 64,
        max_length: int | None = None,
        on_error: str = "raise",
        padding_free: bool = False,
    ) -> None:
        if on_error not in REWARD_ERROR_MODES:
            raise ValueError(f"on_error must be one of {REWARD_ERROR_MODES}, got {on_error!r}.")
        self.on_error = on_error
        self.last_errors = 0
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ValueError(f"max_length must be None or an integer >= 1, got {max_length!r}.")
        funcs = self._as_func_list(reward_funcs)
        if reward_model is None and not funcs:
            raise ValueError(
                "No reward source: got reward_model=None and no reward_funcs. Pass a reward model "
                "(reward_model=...), one or more reward functions (reward_funcs=[f, ...]), or both."
            )
        if reward_model is None and reward_tokenizer is not None:
            raise ValueError(
                "reward_tokenizer was given without a reward_model; it is only used to score with a reward "
                "model. Pass reward_model=... as well, or drop reward_tokenizer."
            )
        self._specs = [_inspect_reward_func(f, i) for i, f in enumerate(funcs)]
        self.policy_tokenizer = policy_tokenizer
        self.reward_model = reward_model
        self.reward_tokenizer = reward_tokenizer
        self.reward_funcs: list[RewardFunc] = funcs
        self.batch_size = batch_size
        self.max_length = max_length
        self.padding_free = padding_free
        #: Whether the reward model's scoring of the policy's ids runs packed; resolved at the first
        #: scoring (on the model's device), see :meth:`_packs_reward_model`.
        self._pack_reward: bool | None = None
        self.same_tokenizer: bool = self._is_same_tokenizer(policy_tokenizer, reward_tokenizer)
        if reward_model is not None:
            self._check_reward_model(reward_model, policy_tokenizer, reward_tokenizer)
        base_names = (["reward_model"] if reward_model is not None else []) + [_func_name(f) for f in funcs]
        self.names: list[str] = _unique_names(base_names)
        self.weights: list[float] = self._check_weights(reward_weights, self.names)

    @staticmethod
    def _as_func_list(reward_funcs: Sequence[RewardFunc] | RewardFunc | None) -> list[RewardFunc]:
        if reward_funcs is None:
            return []
        if callable(reward_funcs):
            return [reward_funcs]
        if isinstance(reward_funcs, (str, bytes)) or not isinstance(reward_funcs, Sequence):
            raise TypeError(
                "reward_funcs must be a callable or a list of callables f(prompts, completions, **kwargs), "
                f"got {type(reward_funcs).__name__}: {reward_funcs!r}."
            )
        return list(reward_funcs)

    @staticmethod
    def _is_same_tokenizer(
        policy_tokenizer: PreTrainedTokenizerBase, reward_tokenizer: PreTrainedTokenizerBase | None
    ) -> bool:
        if reward_tokenizer is None or reward_tokenizer is policy_tokenizer:
            return True
        return (
            reward_tokenizer.pad_token_id == policy_tokenizer.pad_token_id
            and reward_tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        )

    def _check_reward_model(
        self,
        reward_model: PreTrainedModel,
        policy_tokenizer: PreTrainedTokenizerBase,
        reward_tokenizer: PreTrainedTokenizerBase | None,
    ) -> None:
        check_one_label(reward_model)
        if reward_tokenizer is not None and reward_tokenizer.pad_token_id is None:
            raise ValueError(
                "reward_tokenizer has no pad token, which batched scoring needs. Give it one, e.g. "
                "reward_tokenizer.pad_token = reward_tokenizer.eos_token (or add a dedicated '<|pad|>' "
                "token and resize the reward model's embeddings), or pass the tokenizer saved with the "
                "reward model."
            )
        if self.same_tokenizer and policy_tokenizer.pad_token_id is None:
            raise ValueError(
                "policy_tokenizer has no pad token, but the reward model scores the policy's padded token "
                "ids with it. Give the policy tokenizer a pad token (a dedicated one, distinct from EOS, "
                "as the lm-human-preferences reference implementation does) before training."
            )
        align_pad_token(reward_model, policy_tokenizer if self.same_tokenizer else reward_tokenizer)

    @staticmethod
    def _check_weights(reward_weights: Sequence[float] | None, names: list[str]) -> list[float]:
        if reward_weights is None:
            return [1.0] * len(names)
        if isinstance(reward_weights, (str, bytes)) or not isinstance(reward_weights, Sequence):
            raise ValueError(
                f"reward_weights must be a list of {len(names)} floats (one per source: {names}), got "
                f"{type(reward_weights).__name__}: {reward_weights!r}."
            )
        if len(reward_weights) != len(names):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} values but there are {len(names)} reward "
                f"sources {names} (the reward model first, then the functions); give one weight per "
                "source, or none for 1.0 each."
            )
        weights = []
        for name, weight in zip(names, reward_weights, strict=True):
            try:
                value = float(weight) if not isinstance(weight, (str, bytes)) else math.nan
            except (TypeError, ValueError):
                value = math.nan
            if not math.isfinite(value):
                raise ValueError(
                    f"reward_weights must be finite floats; the weight of {name!r} is {weight!r}. Use 0.0 "
                    "to log a source without it counting in the reward."
                )
            weights.append(value)
        return weights

    def __repr__(self) -> str:
        sources = ", ".join(f"{n}={w:g}" for n, w in zip(self.names, self.weights, strict=True))
        return f"{type(self).__name__}({sources}, same_tokenizer={self.same_tokenizer})"

    def __call__(
        self,
        *,
        query_response_ids: torch.Tensor,
        prompts: Sequence[Prompt],
        completions: Sequence[str],
        columns: Mapping[str, Sequence[Any]] | None = None,
        reward_model_forward: Callable[..., Any] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score a rollout batch with every source.

        Args:
            query_response_ids: (B, T) left-padded prompt ids followed by the response ids, the response
                right-padded after it stops; both paddings use the policy tokenizer's pad id.
            prompts: the B prompts as in the dataset (strings or lists of ``{"role", "content"}``).
            completions: the B decoded responses (special tokens skipped).
            columns: the other dataset columns of these rows, each a sequence of length B, passed to
                the reward functions as keyword arguments.
            reward_model_forward: replaces ``reward_model.__call__`` (e.g. a DeepSpeed engine).

        Returns:
            ``(total, per_source)``: ``per_source[name]`` a float32 (B,) CPU tensor per source (in the
            order of ``names``, NaN where a function gave None or a non-finite value), and
            ``total = sum(weight * per_source[name])`` (NaN where any source is NaN).

        Raises:
            ValueError: inputs of mismatched lengths; a column named like a fixed argument; a reward
                function missing a column it requires or returning the wrong number of values.
            TypeError: a reward function returning something other than floats/None.
            RuntimeError: a reward function raised (the original exception is the cause).
        """
        prompts, completions = list(prompts), list(completions)
        batch = len(prompts)
        self._check_batch(query_response_ids, completions, columns, batch)
        columns = dict(columns or {})
        self._check_required_columns(columns)
        per_source: dict[str, torch.Tensor] = {}
        self.last_errors = 0
        names = iter(self.names)
        if self.reward_model is not None:
            per_source[next(names)] = self._score_with_model(
                query_response_ids, prompts, completions, reward_model_forward
            )
        for func, spec, name in zip(self.reward_funcs, self._specs, names, strict=True):
            per_source[name] = self._run_func(func, spec, name, prompts, completions, columns, batch)
        total = torch.zeros(batch, dtype=torch.float32)
        for name, weight in zip(self.names, self.weights, strict=True):
            total = total + weight * per_source[name]
        return total, per_source

    @staticmethod
    def _check_batch(
        query_response_ids: torch.Tensor,
        completions: list[str],
        columns: Mapping[str, Sequence[Any]] | None,
        batch: int,
    ) -> None:
        if len(completions) != batch:
            raise ValueError(
                f"got {batch} prompts but {len(completions)} completions; give one completion per prompt."
            )
        if not isinstance(query_response_ids, torch.Tensor) or query_response_ids.dim() != 2:
            shape = tuple(query_response_ids.shape) if isinstance(query_response_ids, torch.Tensor) else None
            raise ValueError(
                f"query_response_ids must be a (batch, length) tensor, got "
                f"{type(query_response_ids).__name__} of shape {shape}."
            )
        if query_response_ids.shape[0] != batch:
            raise ValueError(
                f"query_response_ids has {query_response_ids.shape[0]} rows but there are {batch} prompts; "
                "the rows must be the same sequences, in the same order."
            )
        for key, values in (columns or {}).items():
            if key in _FIXED_ARGS:
                raise ValueError(
                    f"columns must not contain {key!r}: reward functions get prompts= and completions= from "
                    "the rollout. Rename that dataset column."
                )
            if len(values) != batch:
                raise ValueError(
                    f"column {key!r} has {len(values)} values for a batch of {batch}; give one per row."
                )

    def _check_required_columns(self, columns: Mapping[str, Sequence[Any]]) -> None:
        """Every function's parameters without defaults are columns (checked before anything runs)."""
        func_names = self.names[len(self.names) - len(self.reward_funcs) :]
        for spec, name in zip(self._specs, func_names, strict=True):
            missing = [p for p in spec.required if p not in columns]
            if missing:
                raise ValueError(
                    f"reward function {name!r} requires the argument(s) {missing}, which are not columns of "
                    f"the batch (columns: {sorted(columns)}). Add those columns to the dataset or give the "
                    "parameters default values."
                )

    def _score_with_model(
        self,
        query_response_ids: torch.Tensor,
        prompts: list[Prompt],
        completions: list[str],
        forward: Callable[..., Any] | None,
    ) -> torch.Tensor:
        model = self.reward_model
        assert model is not None
        was_training = model.training
        model.eval()
        try:
            if self.same_tokenizer:
                return score_ids(
                    model,
                    query_response_ids,
                    self.policy_tokenizer.pad_token_id,
                    batch_size=self.batch_size,
                    max_length=self.max_length,
                    forward=forward,
                    padding_free=forward is None and self._packs_reward_model(),
                )
            texts = [
                join_prompt_completion(p, c, self.reward_tokenizer)
                for p, c in zip(prompts, completions, strict=True)
            ]
            return score_texts(
                model,
                self.reward_tokenizer,
                texts,
                batch_size=self.batch_size,
                max_length=self.max_length,
                add_eos=True,
                forward=forward,
                padding_free=forward is None and self._packs_reward_model(),
            )
        finally:
            model.train(was_training)

    def _packs_reward_model(self) -> bool:
        """``padding_free`` and a reward model that passes :func:`rlhf_trainers.packing.packing_layout`
        with a per-token linear head (:func:`rlhf_trainers.packing.packed_score_head`); checked once, with
        an info line when it does not."""
        if not self.padding_free or self.reward_model is None:
            return False
        if self._pack_reward is None:
            model = self.reward_model
            self._pack_reward = packed_score_head(model) is not None and packing_layout(model) is not None
            if not self._pack_reward:
                logger.info(
                    "padding_free: the reward model (%s) does not keep attention within packed sequences or "
                    "has no per-token linear score head; its scoring stays padded.",
                    type(model).__name__,
                )
        return self._pack_reward

    def _run_func(
        self,
        func: RewardFunc,
        spec: _FuncSpec,
        name: str,
        prompts: list[Prompt],
        completions: list[str],
        columns: dict[str, Sequence[Any]],
        batch: int,
    ) -> torch.Tensor:
        kwargs = {k: list(v) for k, v in columns.items() if spec.var_keyword or k in spec.params}
        try:
            return _rewards_tensor(
                func(prompts=list(prompts), completions=list(completions), **kwargs), name, batch
            )
        except Exception as err:
            if self.on_error == "skip":
                self.last_errors += batch
                logger.warning(
                    "reward function %r failed on a batch of %d (%s: %s); its rows are left out of this update "
                    "(reward_func_errors='skip').",
                    name,
                    batch,
                    type(err).__name__,
                    err,
                )
                return torch.full((batch,), math.nan)
            if isinstance(err, (ValueError, TypeError)) and str(err).startswith(f"reward function {name!r}"):
                raise  # a wrong return value: the message already says what was expected
            where = _first_failing_row(func, name, prompts, completions, kwargs)
            raise RuntimeError(
                f"reward function {name!r} raised {type(err).__name__}: {err} ({where}). Fix the function, or set "
                "reward_func_errors='skip' to leave the rows of a failing call out of the update."
            ) from err


def _first_failing_row(
    func: RewardFunc,
    name: str,
    prompts: list[Prompt],
    completions: list[str],
    kwargs: dict[str, list[Any]],
) -> str:
    """Where a failing batch call fails: the first row that raises when called alone."""
    for i in range(len(prompts)):
        row = {k: [v[i]] for k, v in kwargs.items()}
        try:
            func(prompts=[prompts[i]], completions=[completions[i]], **row)
        except Exception:
            text = repr(prompts[i])
            text = text if len(text) <= 80 else text[:77] + "..."
            return f"at prompt index {i} of the batch: prompt {text}, completion {completions[i][:80]!r}"
    return "on the whole batch; no single row reproduces it"


def _names_a_model(value: Any) -> bool:
    """A path or Hub id in ``reward_funcs``: an existing folder, or a string of the ``owner/name`` form.
    Other strings stay where they are and are refused as not callable, with the reward sources' message
    (e.g. a function's name given instead of the function)."""
    if isinstance(value, os.PathLike):
        return True
    return isinstance(value, str) and (os.path.isdir(value) or value.count("/") == 1)


def split_reward_funcs(
    reward_funcs: Any,
    reward_processing_classes: Any,
    reward_weights: list[float] | None,
) -> tuple[Any, list[Callable[..., Any]], Any, list[float] | None]:
    """TRL's ``reward_funcs`` (a function, a reward model, or its folder or Hub id ``owner/name``, or a list
    mixing them) as the engine's ``(reward_model, reward_funcs, reward_processing_class, reward_weights)``: at most one
    reward model, moved to the front of the weights (the engine's order: reward model first)."""
    from transformers import PreTrainedModel

    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs or any(f is None for f in funcs):
        raise ValueError(
            "reward_funcs must be a function f(prompts, completions, **columns) -> list[float], a "
            "one-label sequence-classification model (or its path), or a list of them."
        )
    tokenizers = (
        list(reward_processing_classes)
        if isinstance(reward_processing_classes, (list, tuple))
        else [reward_processing_classes] * len(funcs)
    )
    if len(tokenizers) != len(funcs):
        raise ValueError(
            f"reward_processing_classes has {len(tokenizers)} entries for {len(funcs)} reward_funcs; give one "
            "per reward function (None for plain functions)."
        )
    models = [i for i, f in enumerate(funcs) if isinstance(f, PreTrainedModel) or _names_a_model(f)]
    if len(models) > 1:
        raise ValueError(
            f"reward_funcs holds {len(models)} reward models (positions {models}); the trainers take at most "
            "one reward model next to any number of reward functions. Combine the models in a function, "
            "or train with one of them."
        )
    # Entries that are neither a model nor callable are refused by RewardSources, naming their index.
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(reward_weights)} values for {len(funcs)} reward_funcs; give one weight "
            "per reward function, in the same order."
        )
    if not models:
        return None, funcs, None, reward_weights
    index = models[0]
    functions = [f for i, f in enumerate(funcs) if i != index]
    weights = None
    if reward_weights is not None:
        weights = [reward_weights[index]] + [w for i, w in enumerate(reward_weights) if i != index]
    return funcs[index], functions, tokenizers[index], weights
