"""The forward passes of the on-policy engine: the trained module (policy + value model), response
log-probs (through the fused lm head where the model allows it), per-token values, and the column
trimming that keeps padding out of every forward pass."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import functional as F
from ..models import _base, embedding_rows


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
    ) -> tuple[torch.Tensor, ...]:
        """``(logits, values)``; with ``response`` (B, R), the response's log-probs and entropy instead of
        the logits: ``(logprobs, values, entropy)`` (see :func:`response_logprobs`)."""
        values = None
        if with_values and self.value_model is not None:
            values = token_values(self.value_model, input_ids, attention_mask, position_ids)
        if response is not None:
            logprobs, entropy = response_logprobs(
                self.policy,
                input_ids,
                attention_mask,
                position_ids,
                response,
                logprob_options or {},
                fused_head=fused_head,
            )
            return logprobs, values, entropy
        logits = policy_logits(self.policy, input_ids, attention_mask, position_ids, logits_to_keep)
        return logits, values


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of ``response``, the last R columns of ``input_ids``, and (when asked) the float32
    entropy metric. ``options``: temperature, chunk_size, compute_dtype (the engine's log-prob options).

    With ``fused_head`` (see :func:`fused_head_matches`; ignored while the lm head has forward hooks,
    which the fused path would not run) the backbone's hidden states go through
    :func:`rlhf_trainers.functional.logprobs_and_entropy_from_hidden`, which never holds the (B, R, V)
    logits or their gradient; otherwise the lm head's logits go through the chunked log-softmax."""
    R = response.shape[1]
    temperature = options.get("temperature", 1.0)
    chunk = options.get("chunk_size")
    compute_dtype = options.get("compute_dtype")
    parts = fused_head_parts(model) if fused_head else None
    if parts is not None:  # None also when a hook was put on the lm head after construction
        backbone, head = parts
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state[:, -(R + 1) : -1]
        logprobs, entropy = F.logprobs_and_entropy_from_hidden(
            hidden,
            head.weight,
            response,
            temperature,
            bias=head.bias,
            row_chunk_size=chunk or max(hidden.shape[0] * hidden.shape[1], 1),
            compute_dtype=compute_dtype,
            with_entropy=with_entropy,
        )
        return logprobs, (entropy.float() if entropy is not None else None)
    logits = policy_logits(model, input_ids, attention_mask, position_ids, R + 1)[:, :-1]
    if with_entropy:
        return F.logprobs_and_entropy_from_logits(
            logits,
            response,
            temperature,
            chunk_size=chunk,
            compute_dtype=compute_dtype,
            entropy_dtype=torch.float32,
        )
    return F.logprobs_from_logits(
        logits, response, temperature, chunk_size=chunk, compute_dtype=compute_dtype
    ), None


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
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Per-token outputs (B, T) of a one-label sequence-classification model: its head applied to every
    hidden state, not only the last one (the value of each prefix), with the reward normalization its
    config stores (``raw * gain + bias``; none for a value model built from the policy). A value model
    initialised from a normalized reward model (``value_model_init='reward_model'``, LHPD) thus starts in the
    units of the rewards PPO optimises, as LHPD's value head starts from the reward model's normalized
    output, instead of the raw score (measured on the SmolLM2 demo's reward model, gain 0.148 and bias
    -1.007: first values 7x too large, first value loss 47)."""
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
