"""The rollout's sampling loop: ancestral sampling from ``softmax(logits / temperature)`` with a KV cache.

Why not ``model.generate()``: ``generate`` fills every sampling setting that its ``GenerationConfig``
leaves unset from the model's own ``generation_config.json`` (a ``repetition_penalty``, a
``no_repeat_ngram_size``, ``suppress_tokens``...), so a Hub checkpoint can silently sample from another
distribution than the one the trainer's forward passes score, and the rollout is off-policy without a
trace. This loop samples from exactly the distribution the log-probs describe, and it can return the
log-probability and entropy of each sampled token from the logits it already has, which spares the
rollout a separate forward pass of the policy (``rollout_logprobs``). Its draws are those of
``generate(do_sample=True, top_k=0, top_p=1.0, temperature=...)`` for the same seed (the same
``softmax`` and ``torch.multinomial`` calls, in the same order).

Lean decoding steps (``lean_decoding``): for a ``transformers`` ``LlamaForCausalLM`` (Llama, SmolLM and
their fine-tunes; also under a PEFT adapter), the decoding steps after the prompt pass call the model's own
modules directly (embedding, rotary embedding, norms, projections, MLP, lm head) with a KV cache
preallocated for the whole response and PyTorch's ``scaled_dot_product_attention``, instead of the model's
``forward``. That is the arithmetic of the model's forward, without what it does around it at every step
(attention-mask building, cache objects, keyword-argument handling, output classes), which is most of a
decoding step for small models: the offline kit's 2-layer Llama samples 32 tokens in 33 instead of 59 ms
on 2 CPU cores; for SmolLM2-135M on CPU the matmuls dominate and both take the same time. Logits agree with
the forward's to float32 rounding (~1e-6 relative). Anything else (other architectures, a subclass, forward
hooks on the skipped modules, accelerate's device-map hooks, DeepSpeed's partitioned weights, attention
dropout in training mode, a torch without grouped-query SDPA, several processes) takes the model's
``forward``. Several processes: 2-process CPU runs sometimes aborted at exit with the lean steps
("terminate called without an active exception"), for a reason not found yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Samples", "sample_completions"]


class Samples(NamedTuple):
    """What :func:`sample_completions` returns; ``n <= max_new_tokens`` columns (fewer when every row
    stopped early)."""

    #: (B, n) sampled token ids; ``pad_token_id`` after a row's stop token.
    tokens: torch.Tensor
    #: (B, n) float32 log-probability of each sampled token under ``softmax(logits / temperature)``, or
    #: None; 0 after a row's stop token.
    logprobs: torch.Tensor | None
    #: (B, n) float32 entropy of that distribution at each step, or None; 0 after a row's stop token.
    entropy: torch.Tensor | None


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    pad_token_id: int,
    stop_token_ids: Sequence[int] = (),
    return_logprobs: bool = False,
    lean_decoding: bool = True,
) -> Samples:
    """Sample up to ``max_new_tokens`` tokens after each (left-padded) prompt row.

    Args:
        model: a causal LM (a ``transformers`` model or a PEFT model around one) whose forward accepts
            ``attention_mask``, ``position_ids``, ``past_key_values``, ``use_cache`` and ``logits_to_keep``.
            Run it in eval mode (dropout off) for draws that match the trainer's forward passes.
        input_ids: (B, T) prompt ids; padding on the left.
        attention_mask: (B, T), 1 at real prompt tokens.
        max_new_tokens: tokens to sample per row.
        temperature: the logits are divided by it (> 0).
        pad_token_id: written after a row's stop token.
        stop_token_ids: a row stops after sampling one of these (it is kept); empty: every row samples
            ``max_new_tokens`` tokens, stop tokens like any other.
        return_logprobs: also return each sampled token's log-probability and the entropy of each step's
            distribution (float32, from the same logits; costs one log-softmax over the vocabulary per
            step).
        lean_decoding: run the decoding steps of a ``LlamaForCausalLM`` through its modules directly (see
            the module docstring); other models, and False, use the model's forward at every step.

    Returns:
        :class:`Samples`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    mask = attention_mask.long()
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    next_position = mask.sum(1, keepdim=True)
    stops = torch.tensor(list(stop_token_ids), dtype=input_ids.dtype, device=input_ids.device)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    lean = _LeanLlamaSteps.build(model, out, mask, max_new_tokens) if lean_decoding else None
    for step in range(max_new_tokens):
        # float32, as generate() does before its logits processors.
        scores = out.logits[:, -1, :].to(dtype=torch.float32, copy=True)
        if temperature != 1.0:
            scores = scores / temperature
        probs = torch.softmax(scores, dim=-1)
        token = torch.multinomial(probs, num_samples=1).squeeze(1)
        token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
        tokens.append(token)
        if return_logprobs:
            logp = torch.log_softmax(scores, dim=-1)
            chosen = logp.gather(1, token[:, None]).squeeze(1)
            entropy = -(probs * logp).nan_to_num().sum(-1)  # 0 * -inf at masked-out tokens counts 0
            logprobs.append(torch.where(unfinished, chosen, torch.zeros_like(chosen)))
            entropies.append(torch.where(unfinished, entropy, torch.zeros_like(entropy)))
        if stops.numel():
            unfinished = unfinished & ~torch.isin(token, stops)
            if not bool(unfinished.any()):
                break
        if step == max_new_tokens - 1:
            break
        if lean is not None:
            out = lean.step(token, next_position)
        else:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=next_position,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        next_position = next_position + 1
    return Samples(
        torch.stack(tokens, dim=1),
        torch.stack(logprobs, dim=1) if return_logprobs else None,
        torch.stack(entropies, dim=1) if return_logprobs else None,
    )


class _Logits(NamedTuple):
    logits: torch.Tensor  # (B, 1, V), as a model output's


class _LeanLlamaSteps:
    """The decoding steps of a ``LlamaForCausalLM`` through its modules (see the module docstring)."""

    def __init__(self, causal_lm: nn.Module, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.lm = causal_lm
        self.body = causal_lm.model
        self.keys, self.values = keys, values
        # Columns of the cache filled so far (the prompt's), and which are real tokens in each row.
        self.length = 0
        self.attend: torch.Tensor | None = None

    @staticmethod
    def build(model: nn.Module, out: Any, mask: torch.Tensor, max_new_tokens: int) -> _LeanLlamaSteps | None:
        """The lean steps for ``model`` after its prompt pass ``out`` (whose cache holds the prompt's keys and
        values) over ``mask``, or None where the model's forward must run the steps."""
        if max_new_tokens < 2:
            return None
        lm = _plain_llama(model)
        cache = getattr(out, "past_key_values", None)
        layers_cache = getattr(cache, "layers", None)
        if lm is None or layers_cache is None or len(layers_cache) != len(lm.model.layers):
            return None
        B, T = mask.shape
        keys, values = [], []
        for layer in layers_cache:
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
                return None
            if k.dim() != 4 or k.shape[0] != B or k.shape[2] != T or v.shape[:3] != k.shape[:3]:
                return None
            # Room for the whole response: the prompt's columns, then one per decoding step.
            kk = k.new_empty(B, k.shape[1], T + max_new_tokens - 1, k.shape[3])
            vv = v.new_empty(B, v.shape[1], T + max_new_tokens - 1, v.shape[3])
            kk[:, :, :T] = k
            vv[:, :, :T] = v
            keys.append(kk)
            values.append(vv)
        steps = _LeanLlamaSteps(lm, keys, values)
        steps.length = T
        attend = torch.ones(B, 1, 1, T + max_new_tokens - 1, dtype=torch.bool, device=mask.device)
        attend[:, 0, 0, :T] = mask.bool()
        steps.attend = attend
        return steps

    def step(self, token: torch.Tensor, position: torch.Tensor) -> _Logits:
        """Logits ``(B, 1, V)`` of the next position after ``token`` (B,) at ``position`` (B, 1)."""
        t = self.length
        self.length += 1
        body = self.body
        h = body.embed_tokens(token[:, None])
        cos, sin = body.rotary_emb(h, position)
        attend = self.attend[..., : t + 1]
        B = h.shape[0]
        for layer, keys, values in zip(body.layers, self.keys, self.values, strict=True):
            attention = layer.self_attn
            x = layer.input_layernorm(h)
            q = attention.q_proj(x).view(B, 1, -1, attention.head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(B, 1, -1, attention.head_dim).transpose(1, 2)
            v = attention.v_proj(x).view(B, 1, -1, attention.head_dim).transpose(1, 2)
            q, k = _apply_rotary(q, k, cos, sin)
            keys[:, :, t] = k[:, :, 0]
            values[:, :, t] = v[:, :, 0]
            o = torch.nn.functional.scaled_dot_product_attention(
                q,
                keys[:, :, : t + 1],
                values[:, :, : t + 1],
                attn_mask=attend,
                scale=attention.scaling,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            h = h + attention.o_proj(o.transpose(1, 2).reshape(B, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return _Logits(self.lm.lm_head(body.norm(h)))


def _apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def _plain_llama(model: nn.Module) -> nn.Module | None:
    """The ``LlamaForCausalLM`` inside ``model`` (itself, or under a PEFT wrapper) when its decoding steps can
    skip its forward: exactly transformers' Llama classes, no hooks that the skipped forwards would run and
    no forward replaced on an instance, no partitioned (DeepSpeed) or device-mapped (accelerate) weights, no
    attention dropout in play."""
    try:
        from transformers.models.llama import modeling_llama as llama
    except ImportError:  # pragma: no cover - transformers without Llama
        return None
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if type(lm) is not llama.LlamaForCausalLM or type(getattr(lm, "model", None)) is not llama.LlamaModel:
        return None
    body = lm.model
    if not all(
        type(layer) is llama.LlamaDecoderLayer and type(layer.self_attn) is llama.LlamaAttention
        for layer in body.layers
    ):
        return None
    if getattr(lm.config, "pretraining_tp", 1) not in (None, 1):
        return None
    if not _sdpa_has_gqa():
        return None
    # Several processes: with the lean steps, 2-process CPU runs (gloo, DDP or ZeRO-3) sometimes aborted
    # at exit ("terminate called without an active exception": 2 of the 25 multi-process tests, in each of
    # two runs; none in two runs without the lean steps). The cause is not found yet, so multi-process
    # runs keep the forward.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            return None
    from torch.nn.modules import module as module_state

    if any(
        getattr(module_state, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_forward_hooks_always_called",
        )
    ):
        return None
    skipped = [model, lm, body, *body.layers, *(layer.self_attn for layer in body.layers)]
    for module in skipped:
        # A forward replaced on the instance (accelerate's mixed-precision wrapper, a user's patch) would
        # be skipped too.
        if module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module):
            return None
    for module in lm.modules():
        if hasattr(module, "_hf_hook") or hasattr(module, "ds_id"):
            return None
    if any(hasattr(p, "ds_id") for p in lm.parameters()):
        return None
    if any(layer.self_attn.training and layer.self_attn.attention_dropout > 0 for layer in body.layers):
        return None
    return lm


def _sdpa_has_gqa() -> bool:
    """Whether this torch's ``scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5), from the
    version: no probing call (a grouped-query SDPA call on CPU was the one new kernel in the multi-process
    runs that aborted at exit)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)
