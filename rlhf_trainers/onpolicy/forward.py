"""The forward passes of the on-policy engine: the trained module (policy + value model), response
log-probs (through the fused lm head where the model allows it), per-token values, the column
trimming that keeps padding out of every forward pass, and the packing of ``padding_free`` passes (the
real tokens of a batch in a few rows, :func:`pack_sequences`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import functional as F
from ..models import _base, embedding_rows
from ..packing import pack_rows, packed_context


class PolicyAndValue(nn.Module):
    """The trained models of an on-policy run in one module: one optimizer, one DDP wrapper, one
    DeepSpeed engine for both (PPO's value model is ``None`` for RLOO).

    ``forward`` returns the policy logits of the last ``logits_to_keep`` positions and, when asked, the
    value model's per-token values (its scalar head applied to every hidden state); given ``response``,
    the response's log-probs and entropy instead of the logits (what the training step uses, through
    the fused lm head where the model allows it).
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: int = 0,
        with_values: bool = False,
        response: torch.Tensor | None = None,
        logprob_options: dict[str, Any] | None = None,
        fused_head: bool = False,
        policy_packing: PackedSequences | None = None,
        value_packing: PackedSequences | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """``(logits, values)``, values (B, T) per token; with ``response`` (B, R), the response's log-probs
        and entropy instead of the logits, and the values of the positions that predict the response
        tokens, (B, R): ``(logprobs, values, entropy)`` (see :func:`response_logprobs` and
        :func:`response_values`). ``policy_packing`` / ``value_packing``: the same batch packed
        (:func:`pack_sequences`), for a padding-free pass of the policy / the value model."""
        values = None
        if response is not None:
            if with_values and self.value_model is not None:
                values = response_values(
                    self.value_model,
                    input_ids,
                    attention_mask,
                    position_ids,
                    response.shape[1],
                    packing=value_packing,
                )
            logprobs, entropy = response_logprobs(
                self.policy,
                input_ids,
                attention_mask,
                position_ids,
                response,
                logprob_options or {},
                fused_head=fused_head,
                packing=policy_packing,
            )
            return logprobs, values, entropy
        if with_values and self.value_model is not None:
            values = token_values(self.value_model, input_ids, attention_mask, position_ids)
        logits = policy_logits(self.policy, input_ids, attention_mask, position_ids, logits_to_keep)
        return logits, values


@dataclass
class PackedSequences:
    """The real tokens of a padded batch of prompts and responses (:func:`sequence_inputs`, (B, T)),
    packed into P rows of W tokens for a padding-free forward pass (:func:`pack_sequences`): each row
    holds whole sequences one after the other, position ids restarting at 0 at each, which transformers
    reads as packed sequences and keeps attention within each (no attention mask is passed). The tail of
    a row that no sequence fills is one more sequence of padding, whose outputs are not read."""

    input_ids: torch.Tensor
    """(P, W) long, the packed token ids."""
    position_ids: torch.Tensor
    """(P, W) long, each sequence's own positions (0, 1, ...)."""
    sources: torch.Tensor
    """(n,) long, flat indices into the P x W outputs of the positions that predict the batch's valid
    response tokens (the last prompt token and the response's own tokens but its last)."""
    targets: torch.Tensor
    """(n,) long, flat indices into the (B, R) response layout of the tokens they predict."""
    response_shape: tuple[int, int]
    """(B, R): the padded response layout the results are scattered back into."""
    segments: tuple[int, ...] | None = None
    """One-row layout (P = 1): the length of each packed sequence, for
    :func:`~rlhf_trainers.packing.one_row_attention`; None for rows of the longest sequence."""

    def context(self, model: nn.Module) -> Any:
        """The context ``model``'s pass on these rows runs in (:func:`rlhf_trainers.packing.packed_context`)."""
        return packed_context(model, self.segments)

    @property
    def num_tokens(self) -> int:
        """Positions of the packed rows, padding of their tails included (P x W)."""
        return int(self.input_ids.numel())

    def gather(self, outputs: torch.Tensor) -> torch.Tensor:
        """(P, W, ...) outputs of the packed rows -> (n, ...) those of the :attr:`sources` positions."""
        return outputs.reshape(-1, *outputs.shape[2:])[self.sources]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(n,) results of the :attr:`sources` positions -> (B, R) in the padded response layout, 0 where
        no valid response token is (differentiable w.r.t. ``values``)."""
        B, R = self.response_shape
        return values.new_zeros(B * R).scatter(0, self.targets, values).view(B, R)


def pack_sequences(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_mask: torch.Tensor,
    pad_token_id: int,
    one_row: bool = False,
) -> PackedSequences | None:
    """Pack the (B, Q + R) batch of :func:`sequence_inputs` (left-padded prompts, right-padded responses)
    for a padding-free pass (:func:`rlhf_trainers.packing.pack_rows`, in one row with ``one_row``): the
    real tokens of each row that has a valid response token (``response_mask`` (B, R)); the rows whose
    response has no valid token are left out (nothing of theirs is read). None when no row has one."""
    B, T = input_ids.shape
    R = response_mask.shape[1]
    Q = T - R
    mask = attention_mask.bool()
    response_mask = response_mask.bool()
    kept = response_mask.any(1)
    if not bool(kept.any()):
        return None
    mask = mask & kept[:, None]
    rows = pack_rows(input_ids, mask, position_ids, pad_token_id, one_row=one_row)
    dest = rows.destinations
    device = input_ids.device
    # Response token r of row b is predicted at column Q - 1 + r, a real token (the last prompt token or
    # the response's previous one) wherever the response token is valid and the prompt is not empty.
    predicting = mask[:, Q - 1 : T - 1] if Q > 0 else torch.zeros_like(response_mask)
    valid = response_mask & kept[:, None] & predicting
    sources = dest[:, Q - 1 : T - 1][valid] if Q > 0 else dest.new_zeros(0)
    targets = (torch.arange(B, device=device)[:, None] * R + torch.arange(R, device=device)[None, :])[valid]
    return PackedSequences(
        input_ids=rows.input_ids,
        position_ids=rows.position_ids,
        sources=sources,
        targets=targets,
        response_shape=(B, R),
        segments=rows.segments,
    )


def fused_head_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(backbone, lm_head)`` of a causal LM (under a PEFT wrapper too) whose lm head is a plain
    ``nn.Linear`` without forward hooks; None otherwise (an adapter on the lm head, no backbone
    attribute, a hook that the fused path would skip)."""

    try:
        base = _base(model)
        backbone = getattr(base, base.base_model_prefix, None)
        head = base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(backbone, nn.Module) or type(head) is not nn.Linear:
        return None
    # The fused head reads the weights without calling the module: hooks on it would not run.
    if head._forward_hooks or head._forward_pre_hooks or _global_forward_hooks_set():
        return None
    return backbone, head


def _global_forward_hooks_set() -> bool:
    """Whether ``nn.modules.module.register_module_forward_(pre_)hook`` hooks are registered."""
    from torch.nn.modules import module as _module

    return bool(
        getattr(_module, "_global_forward_hooks", None) or getattr(_module, "_global_forward_pre_hooks", None)
    )


@torch.no_grad()
def fused_head_matches(model: nn.Module) -> bool:
    """Whether the model's logits are exactly ``lm_head(backbone(...).last_hidden_state)``, checked on a
    three-token probe in eval mode: models that scale or soft-cap their logits (Gemma 2, Cohere,
    Granite) fail it and keep the logits path."""
    parts = fused_head_parts(model)
    if parts is None:
        return False
    backbone, head = parts
    device = head.weight.device
    ids = torch.arange(min(3, embedding_rows(model)), device=device).unsqueeze(0)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        logits = model(input_ids=ids, use_cache=False).logits
        fused = head(backbone(input_ids=ids, use_cache=False).last_hidden_state)
    except Exception:  # any failure means: use the logits path
        return False
    finally:
        for module, training in modes:  # each submodule's own mode back, as it was
            module.training = training
    return logits.shape == fused.shape and torch.allclose(logits.float(), fused.float(), rtol=1e-4, atol=1e-5)


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response: torch.Tensor,
    options: dict[str, Any],
    *,
    fused_head: bool = False,
    with_entropy: bool = True,
    packing: PackedSequences | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of ``response``, the last R columns of ``input_ids``, and (when asked) the float32
    entropy metric. ``options``: temperature, chunk_size, compute_dtype (the engine's log-prob options).

    With ``fused_head`` (see :func:`fused_head_matches`; ignored while the lm head has forward hooks,
    which the fused path would not run) the backbone's hidden states go through
    :func:`rlhf_trainers.functional.logprobs_and_entropy_from_hidden`, which never holds the (B, R, V)
    logits' gradient, nor the logits beyond ``options["keep_logits_bytes"]``; otherwise the lm head's logits go through the chunked log-softmax.

    With ``packing`` (:func:`pack_sequences` of these inputs; for a model that passes
    :func:`~rlhf_trainers.packing.padding_free_matches`) the model runs on the packed rows instead, and the results of the
    positions that predict valid response tokens are scattered back to (B, R), 0 elsewhere (the padded
    pass leaves whatever the padding gives there; both are masked out of every use)."""
    R = response.shape[1]
    temperature = options.get("temperature", 1.0)
    chunk = options.get("chunk_size")
    compute_dtype = options.get("compute_dtype")
    parts = fused_head_parts(model) if fused_head else None
    if (
        packing is not None
        and parts is None
        and not keeps_logits_by_mask()
        and packing.num_tokens > response.shape[0] * (R + 1)
    ):
        # Without transformers' boolean logits_to_keep the packed pass would hold the logits of every
        # packed position, prompts included: more than the padded pass's (B, R + 1) with long prompts.
        packing = None
    # Packed: one sequence of the n predicting positions (1, n), scattered back to (B, R) at the end.
    tokens = response if packing is None else response.reshape(-1)[packing.targets][None]
    if parts is not None:  # None also when a hook was put on the lm head after construction
        backbone, head = parts
        if packing is None:
            hidden = backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state[:, -(R + 1) : -1]
        else:
            with packing.context(model):
                packed_hidden = backbone(
                    input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False
                ).last_hidden_state
            hidden = packing.gather(packed_hidden)[None]
        logprobs, entropy = F.logprobs_and_entropy_from_hidden(
            hidden,
            head.weight,
            tokens,
            temperature,
            bias=head.bias,
            row_chunk_size=chunk or max(hidden.shape[0] * hidden.shape[1], 1),
            compute_dtype=compute_dtype,
            with_entropy=with_entropy,
            keep_logits_bytes=options.get("keep_logits_bytes", 0),
        )
        entropy = entropy.float() if entropy is not None else None
    else:
        if packing is None:
            logits = policy_logits(model, input_ids, attention_mask, position_ids, R + 1)[:, :-1]
        else:
            logits = packed_logits(model, packing)[None]
        if with_entropy:
            logprobs, entropy = F.logprobs_and_entropy_from_logits(
                logits,
                tokens,
                temperature,
                chunk_size=chunk,
                compute_dtype=compute_dtype,
                entropy_dtype=torch.float32,
            )
        else:
            logprobs = F.logprobs_from_logits(
                logits, tokens, temperature, chunk_size=chunk, compute_dtype=compute_dtype
            )
            entropy = None
    if packing is not None:
        logprobs = packing.scatter(logprobs[0])
        entropy = packing.scatter(entropy[0]) if entropy is not None else None
    return logprobs, entropy


@functools.cache
def keeps_logits_by_mask() -> bool:
    """Whether the installed transformers takes a boolean (B, T) ``logits_to_keep`` (the positions to
    compute logits at, output flattened to (kept, V), as for packed sequences); checked once on its
    slicing helper."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep

        out = slice_logits_to_keep(torch.zeros(1, 3, 2), torch.tensor([[True, False, True]]))
    except Exception:  # an older transformers without the helper or the boolean form
        return False
    return tuple(out.shape) == (2, 2)


def packed_logits(model: nn.Module, packing: PackedSequences) -> torch.Tensor:
    """(n, V) logits of the :attr:`PackedSequences.sources` positions (in their order), through the whole
    model (so logit scaling or soft-capping applies): only those positions' through a boolean
    ``logits_to_keep`` where transformers and the model take one (:func:`keeps_logits_by_mask`), else every
    packed position's, gathered."""
    kwargs: dict[str, Any] = {}
    n = packing.sources.numel()
    if keeps_logits_by_mask():
        keep = torch.zeros(packing.num_tokens, dtype=torch.bool, device=packing.input_ids.device)
        keep[packing.sources] = True
        kwargs["logits_to_keep"] = keep.view_as(packing.input_ids)
    with packing.context(model):
        logits = model(
            input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False, **kwargs
        ).logits
    if logits.dim() == 3 and logits.shape[:2] == packing.input_ids.shape:
        return packing.gather(logits)  # the model computed every position's
    if logits.dim() != 2 or logits.shape[0] != n:
        raise ValueError(
            f"{type(model).__name__} returned logits of shape {tuple(logits.shape)} for a boolean "
            f"logits_to_keep keeping {n} positions; set padding_free=False."
        )
    # The kept positions come out in the packed rows' order: back to the order of the sources.
    order = torch.argsort(packing.sources)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=order.device)
    return logits[rank]


def policy_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """Logits (B, logits_to_keep or T, V) of a causal LM; ``logits_to_keep`` spares the lm-head matmul
    over the prompt."""
    kwargs: dict[str, Any] = {}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    logits = out.logits
    if logits_to_keep and logits.shape[1] != logits_to_keep:
        logits = logits[:, -logits_to_keep:]
    return logits


def token_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """Per-token outputs (B, T) of a one-label sequence-classification model: its head applied to every
    hidden state, not only the last one (the value of each prefix), with the reward normalization its
    config stores (``raw * gain + bias``; none for a value model built from the policy). A value model
    initialised from a normalized reward model (``value_model_init='reward_model'``, LHPD) thus starts in the
    units of the rewards PPO optimises, as LHPD's value head starts from the reward model's normalized
    output, instead of the raw score (measured on the SmolLM2 demo's reward model, gain 0.148 and bias
    -1.007: first values 7x too large, first value loss 47). ``attention_mask`` None: packed rows
    (:class:`PackedSequences`)."""
    from ..models import find_score_head, get_reward_normalization

    base = _base(model)
    backbone = getattr(base, base.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    head_name, _ = find_score_head(base)
    values = getattr(base, head_name)(hidden).squeeze(-1)
    gain, bias = get_reward_normalization(base)
    if (gain, bias) != (1.0, 0.0):
        values = values * gain + bias
    return values


def response_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_width: int,
    *,
    packing: PackedSequences | None = None,
) -> torch.Tensor:
    """(B, R) :func:`token_values` of the positions that predict the R response columns (the last prompt
    token's, then each response token's but the last): V(s_t) of PPO. With ``packing`` (for a model that
    passes :func:`~rlhf_trainers.packing.padding_free_matches`) the pass runs on the packed rows and the values at invalid
    response positions are 0."""
    if packing is None:
        R = response_width
        return token_values(model, input_ids, attention_mask, position_ids)[:, -(R + 1) : -1]
    with packing.context(model):
        values = token_values(model, packing.input_ids, None, packing.position_ids)
    return packing.scatter(packing.gather(values))


def column_bounds(query_start: torch.Tensor, response_end: torch.Tensor, query_width: int) -> tuple[int, int]:
    """The columns a batch needs from per-row bounds: its earliest first prompt column (at most
    ``query_width - 1``: one prompt column always stays, the one whose output predicts the first
    response token), and its latest response end (at least 1: never an empty response)."""
    if query_start.numel() == 0:
        return 0, 1
    start = min(int(query_start.min()), max(query_width - 1, 0))
    return start, max(int(response_end.max()), 1)


def trim_bounds(query_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[int, int]:
    """``(start, end)``: the batch's prompt columns before ``start`` and response columns from ``end`` on
    are padding in every row (see :func:`column_bounds`)."""
    return column_bounds(
        F.first_true_indices(query_mask), F.last_true_indices(response_mask) + 1, query_mask.shape[1]
    )


def pad_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """(B, n) -> (B, width) with zeros appended (``values`` itself when ``n == width``)."""
    missing = width - values.shape[1]
    if missing <= 0:
        return values
    return torch.cat([values, values.new_zeros(values.shape[0], missing)], dim=1)


def sequence_inputs(
    query: torch.Tensor,
    query_mask: torch.Tensor,
    response: torch.Tensor,
    response_mask: torch.Tensor,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask, position_ids)`` (B, Q + R) of left-padded queries followed by responses;
    masked positions hold ``pad_token_id`` (the engine passes an id the models have an embedding row
    for: :func:`rlhf_trainers.models.readable_pad_id`), and the position ids skip the padding (LHPD N3)."""
    ids = torch.cat([query, response], dim=1)
    mask = torch.cat([query_mask.bool(), response_mask], dim=1)
    ids = ids.masked_fill(~mask, pad_token_id)
    return ids, mask.long(), F.position_ids_from_mask(mask)
