"""Lean decoding steps for Llama-architecture policies (``lean_decoding``), on MKL-prepacked weights
(``mkl_prepacked_decoding``) and with LoRA adapters merged into copies (``merged_adapter_decoding``).

See docs/cpu.md for what each does and what it was measured to gain.

**Lean decoding steps.** For a ``transformers`` ``LlamaForCausalLM`` (Llama, SmolLM and their fine-tunes;
also under a PEFT adapter), the decoding steps after the prompt pass call the model's own modules directly
(embedding, rotary embedding, norms, projections, MLP, lm head) with a KV cache preallocated for the whole
response and PyTorch's ``scaled_dot_product_attention``, instead of the model's ``forward``: the same
arithmetic (logits equal to float32 rounding) without the per-step work around it (attention-mask
building, cache objects, keyword handling, output classes). Anything else (other architectures, a
subclass, forward hooks on the skipped modules, accelerate's device-map hooks, DeepSpeed's partitioned
weights, attention dropout in training mode, a torch without grouped-query SDPA) takes the forward.

**MKL-prepacked weights.** MKL's float32 GEMM copies ("packs") its right-hand matrix into a cache-friendly
layout at every call; a decoding step multiplies few rows by every weight, so that copy is most of each
product. PyTorch exposes MKL's pack-once API (``torch.ops.mkl._mkl_reorder_linear_weight`` /
``_mkl_linear``): the lean steps pack each plain float32 ``nn.Linear`` weight once for the call's batch size
and multiply by the packed copy at every step, with identical results. MKL's packed form is larger than
the weights (2-5x the weight's element count). The default (``None``) packs only where
:func:`~rlhf_trainers.cpu.decoding.cpu_vendor` is one of
:data:`~rlhf_trainers.cpu.decoding.PREPACKING_VENDORS`.

**LoRA adapters merged for the decoding steps.** A PEFT LoRA layer computes
``base(x) + scale * B(A(dropout(x)))``: three products per layer and step where one would do. The lean
steps merge each LoRA layer's active adapters into a copy of its weight (PEFT's own merge arithmetic,
:func:`~rlhf_trainers.generation.weights.merged_adapter_weights`, so DoRA's magnitudes and ``lora_bias``
too; the model stays unmerged, and the prompt pass, training and scoring keep the adapter's forward) and
multiply by the copy: packed for MKL with ``mkl_prepacked_decoding`` in float32, cast once to the autocast
dtype under CPU bf16/fp16 autocast. Float32 results equal the adapter's to rounding. CPU only. Layers it
does not apply to (an adapter PEFT cannot merge, such as aLoRA; hooks; training mode) keep their forward.

**Once per weight version.** The packed and merged copies depend on the weights alone
(:class:`PreparedWeights`). Outside :func:`keep_prepared_weights` they are made at every sampling call and
freed after it, as before; inside it (the trainers' ``evaluate()``) they are made once per weight version
and batch size and reused by every sampling call, then freed when the context exits.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Hashable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..compat import output_cache, sdpa_has_gqa
from .linear import _LINEAR, _matches_linear, _plain

__all__ = [
    "LeanLlamaSteps",
    "PreparedWeights",
    "keep_prepared_weights",
    "lean_llama_steps",
    "lean_llama_steps_merged",
    "lean_llama_steps_prepacked",
    "lean_llama_steps_prepacked_merged",
    "mkl_prepacked_linear_available",
]


def lean_llama_steps(model: nn.Module, out: Any, mask: Tensor, max_new_tokens: int) -> LeanLlamaSteps | None:
    """The lean steps for ``model`` after its prompt pass ``out`` (whose cache holds the prompt's keys and
    values) over ``mask``, or None where the model's forward must run the steps (the builtin loop's
    :data:`~rlhf_trainers.generation.builtin.FastStepsProvider`)."""
    return LeanLlamaSteps.build(model, out, mask, max_new_tokens)


def lean_llama_steps_prepacked(
    model: nn.Module, out: Any, mask: Tensor, max_new_tokens: int
) -> LeanLlamaSteps | None:
    """:func:`lean_llama_steps` whose linear layers run on weights packed once for MKL's GEMM
    (``mkl_prepacked_decoding``, see the module docstring)."""
    return LeanLlamaSteps.build(model, out, mask, max_new_tokens, prepack=True)


def lean_llama_steps_merged(
    model: nn.Module, out: Any, mask: Tensor, max_new_tokens: int
) -> LeanLlamaSteps | None:
    """:func:`lean_llama_steps` whose LoRA layers run on their weights with the adapters merged into copies
    made once per sampling call (``merged_adapter_decoding``, see the module docstring); under CPU
    autocast the copies are in autocast's dtype."""
    return LeanLlamaSteps.build(model, out, mask, max_new_tokens, merge_adapters=True)


def lean_llama_steps_prepacked_merged(
    model: nn.Module, out: Any, mask: Tensor, max_new_tokens: int
) -> LeanLlamaSteps | None:
    """:func:`lean_llama_steps_prepacked` with the LoRA layers' merged weights packed too
    (``merged_adapter_decoding``)."""
    return LeanLlamaSteps.build(model, out, mask, max_new_tokens, prepack=True, merge_adapters=True)


class LeanLlamaSteps:
    """The decoding steps of a ``LlamaForCausalLM`` through its modules (``lean_decoding``, see the module
    docstring); a :class:`~rlhf_trainers.generation.builtin.FastDecodingSteps`."""

    def __init__(self, causal_lm: nn.Module, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.lm = causal_lm
        self.body = causal_lm.model
        self.keys, self.values = keys, values
        # Columns of the cache filled so far (the prompt's), and which are real tokens in each row.
        self.length = 0
        self.attend: torch.Tensor | None = None
        # mkl_prepacked_decoding: each plain float32 nn.Linear's weight packed for MKL's GEMM at this batch
        # size (held for this sampling call only), keyed by the module: (packed, weight, bias), the weight
        # (the module's, or a LoRA layer's merged one) being what MKL falls back to for another row count.
        self.packed: dict[nn.Module, tuple[Tensor, Tensor, Tensor | None]] = {}
        # merged_adapter_decoding where the weights are not packed: a LoRA layer's merged (weight, bias),
        # the weight in autocast's dtype under CPU autocast.
        self.merged: dict[nn.Module, tuple[Tensor, Tensor | None]] = {}
        self.rows = 0
        # The row count the packed weights were packed for: MKL's packed product needs exactly that many
        # rows; after select_rows() drops some, the steps multiply by the weights themselves.
        self.packed_rows = 0
        # Whether the MLPs are exactly transformers' LlamaMLP (their arithmetic is spelled out in step()).
        self.llama_mlp = False

    @staticmethod
    def build(
        model: nn.Module,
        out: Any,
        mask: torch.Tensor,
        max_new_tokens: int,
        prepack: bool = False,
        merge_adapters: bool = False,
    ) -> LeanLlamaSteps | None:
        """The lean steps for ``model`` after its prompt pass ``out`` (whose cache holds the prompt's keys and
        values) over ``mask``, or None where the model's forward must run the steps. ``prepack``: the
        linear layers' weights packed for MKL's GEMM once, here (:func:`mkl_prepacked_linear_available`).
        ``merge_adapters``: each PEFT LoRA layer runs on its weight with the adapters merged into a copy,
        made here (``merged_adapter_decoding``, see the module docstring), packed too with ``prepack``."""
        if max_new_tokens < 2:
            return None
        lm = _plain_llama(model)
        cache = output_cache(out)
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
        steps = LeanLlamaSteps(lm, keys, values)
        steps.length = T
        attend = torch.ones(B, 1, 1, T + max_new_tokens - 1, dtype=torch.bool, device=mask.device)
        attend[:, 0, 0, :T] = mask.bool()
        steps.attend = attend
        if torch.is_grad_enabled():
            return steps
        from transformers.models.llama import modeling_llama as llama

        steps.rows = steps.packed_rows = B
        steps.llama_mlp = all(type(layer.mlp) is llama.LlamaMLP for layer in lm.model.layers)
        steps._use_prepared_weights(prepack and mkl_prepacked_linear_available(), merge_adapters)
        return steps

    def _use_prepared_weights(self, prepack: bool, merge_adapters: bool) -> None:
        """Fill :attr:`packed` and :attr:`merged` from the weights' prepared copies
        (:class:`PreparedWeights`: made here, or reused inside :func:`keep_prepared_weights`)."""
        lm = self.lm
        half = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        prepared = _prepared_weights(lm, self.rows, half)
        for module in lm.modules():
            if prepack and _packable(module):
                self.packed[module] = prepared.packed(module, module.weight, module.bias)
            elif merge_adapters and (merged := prepared.merged(module)) is not None:
                weight, bias = merged
                if prepack and half is None and _plain(weight) and (bias is None or _plain(bias)):
                    self.packed[module] = prepared.packed(module, weight, bias)
                else:  # under CPU autocast: cast once, here, instead of at every step
                    self.merged[module] = (
                        weight if half is None else prepared.cast(module, weight, half),
                        bias,
                    )

    def _linear(self, module: nn.Module, x: Tensor) -> Tensor:
        """``module(x)`` for ``x`` (B, 1, in): through its prepacked or merged weight when it has one."""
        packed = self.packed.get(module)
        if packed is not None:
            weights, weight, bias = packed
            if self.rows != self.packed_rows:
                return _LINEAR(x, weight, bias)
            y = torch.ops.mkl._mkl_linear(x.reshape(self.rows, -1), weights, weight, bias, self.rows)
            return y.view(self.rows, 1, -1)
        merged = self.merged.get(module)
        if merged is not None:
            return _LINEAR(x, *merged)
        return module(x)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (A,) of the cache, in that order (the builtin loop's
        ``drop_finished_rows``)."""
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.attend = self.attend.index_select(0, index)
        self.rows = int(index.numel())

    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of the next position after ``token`` (B,) at ``position`` (B, 1)."""
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
            linear = self._linear
            q = linear(attention.q_proj, x).view(B, 1, -1, attention.head_dim).transpose(1, 2)
            k = linear(attention.k_proj, x).view(B, 1, -1, attention.head_dim).transpose(1, 2)
            v = linear(attention.v_proj, x).view(B, 1, -1, attention.head_dim).transpose(1, 2)
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
            h = h + linear(attention.o_proj, o.transpose(1, 2).reshape(B, 1, -1))
            x = layer.post_attention_layernorm(h)
            mlp = layer.mlp
            if (self.packed or self.merged) and self.llama_mlp:  # LlamaMLP's: down(act(gate(x)) * up(x))
                h = h + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x))
            else:
                h = h + mlp(x)
        return self._linear(self.lm.lm_head, body.norm(h))[:, -1, :]


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
    if not sdpa_has_gqa():
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


def _packable(module: nn.Module) -> bool:
    """A plain float32 CPU ``nn.Linear`` (not a subclass such as a LoRA layer) without hooks."""
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and not (module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module))
        and type(weight) in (Tensor, nn.Parameter)
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and (module.bias is None or module.bias.dtype == torch.float32)
    )


def _merged_lora(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """A PEFT LoRA ``Linear`` layer's weight and bias with its adapters merged into copies
    (:func:`~rlhf_trainers.generation.weights.merged_adapter_weights`), for a layer whose forward is
    exactly that product: PEFT's own ``Linear`` class, over a plain CPU ``nn.Linear``, in eval mode (no
    adapter dropout), no hooks on either. None for anything else, and for an adapter PEFT cannot merge
    (those layers keep their own forward)."""
    lora_linear = _lora_linear_class()
    if lora_linear is None or type(module) is not lora_linear or module.training:
        return None
    base = module.get_base_layer()
    if type(base) is not nn.Linear or base.weight.device.type != "cpu":
        return None
    if any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in (module, base)):
        return None
    from ..generation.weights import AdapterNotMergeableError, merged_adapter_weights

    try:
        return merged_adapter_weights(module)
    except AdapterNotMergeableError:
        return None


def _lora_linear_class() -> type | None:
    """PEFT's LoRA ``Linear`` layer class, or None where PEFT was never imported (no such layer can
    exist then) or cannot be."""
    if "peft" not in sys.modules:
        return None
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # pragma: no cover - a broken install
        return None
    return LoraLinear


@functools.cache
def mkl_prepacked_linear_available() -> bool:
    """Whether this torch build has MKL's packed float32 GEMM (``torch.ops.mkl._mkl_linear``, what
    PyTorch's compiler uses for frozen CPU linear layers) and it gives ``F.linear``'s results to float32
    rounding; checked once on a small product (False for builds without MKL, e.g. ARM, or where the
    private op has changed)."""
    if not torch.backends.mkl.is_available():
        return False
    return _matches_linear(
        lambda x, w, b: torch.ops.mkl._mkl_linear(x, torch.ops.mkl._mkl_reorder_linear_weight(w, 5), w, b, 5)
    )


def _mkl_reorder(weight: Tensor, rows: int) -> Tensor:
    """``weight`` packed for MKL's GEMM with ``rows`` rows on the left (what :class:`PreparedWeights` makes)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)


class PreparedWeights:
    """What the lean steps derive from the weights alone, for one weight version (:attr:`key`): LoRA layers'
    merged weights, their copies cast to autocast's dtype, and weights packed for MKL at :attr:`rows` rows.
    Each is made on first use and then reused."""

    def __init__(self, key: Hashable, rows: int) -> None:
        self.key = key
        self.rows = rows
        self._packed: dict[nn.Module, tuple[Tensor, Tensor, Tensor | None]] = {}
        self._merged: dict[nn.Module, tuple[Tensor, Tensor | None] | None] = {}
        self._cast: dict[nn.Module, Tensor] = {}

    def for_rows(self, rows: int) -> PreparedWeights:
        """These weights for a batch of ``rows`` rows: the packed copies are dropped if they were packed
        for another row count (MKL's packed product takes exactly that many rows)."""
        if rows != self.rows:
            self._packed.clear()
            self.rows = rows
        return self

    def packed(
        self, module: nn.Module, weight: Tensor, bias: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(packed, weight, bias)``: ``module``'s ``weight`` packed for MKL at :attr:`rows` rows."""
        held = self._packed.get(module)
        if held is None:
            held = self._packed[module] = (_mkl_reorder(weight, self.rows), weight, bias)
        return held

    def merged(self, module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
        """``module``'s weight and bias with its LoRA adapters merged (:func:`_merged_lora`), or None."""
        if module not in self._merged:
            self._merged[module] = _merged_lora(module)
        return self._merged[module]

    def cast(self, module: nn.Module, weight: Tensor, dtype: torch.dtype) -> Tensor:
        """``weight`` (``module``'s merged one) in ``dtype``."""
        held = self._cast.get(module)
        if held is None or held.dtype != dtype:
            held = self._cast[module] = weight.to(dtype)
        return held


#: The :func:`keep_prepared_weights` contexts entered (innermost last): each holds one PreparedWeights.
_KEPT: list[list[PreparedWeights | None]] = []


@contextlib.contextmanager
def keep_prepared_weights() -> Iterator[None]:
    """Inside this context, the lean steps' prepared weights (:class:`PreparedWeights`) are made once per
    weight version (and batch size) and reused by every sampling call; they are freed on exit. Outside it,
    every sampling call makes its own. The trainers enter it around ``evaluate()`` (several sampling calls on
    the same weights; training changes them between two rollouts and holds no copies meanwhile).
    Re-entrant: inside another such context it shares that one's copies."""
    if _KEPT:
        yield
        return
    _KEPT.append([None])
    try:
        yield
    finally:
        _KEPT.pop()


def _weights_key(lm: nn.Module, half: torch.dtype | None) -> Hashable:
    """Changes whenever what :class:`PreparedWeights` derives may change: a parameter replaced or modified
    in place (an optimizer step, a loaded checkpoint: its version counter), a LoRA layer's active
    adapters, scaling, merge or training state, the autocast dtype."""
    params = tuple((id(p), p._version) for p in lm.parameters())
    lora_linear = _lora_linear_class()
    lora = tuple(
        (
            id(m),
            m.training,
            tuple(m.active_adapters),
            bool(m.disable_adapters),
            bool(m.merged),
            tuple(sorted(m.scaling.items())),
        )
        for m in (lm.modules() if lora_linear is not None else ())
        if type(m) is lora_linear
    )
    return (id(lm), params, lora, half)


def _prepared_weights(lm: nn.Module, rows: int, half: torch.dtype | None) -> PreparedWeights:
    """The prepared weights of ``lm`` for a batch of ``rows``: new, or inside :func:`keep_prepared_weights`
    the ones of its current weight version."""
    if not _KEPT:
        return PreparedWeights(None, rows)
    key = _weights_key(lm, half)
    slot = _KEPT[-1]
    held = slot[0]
    if held is None or held.key != key:
        slot[0] = None  # the previous version's copies are freed before the new ones are made
        held = slot[0] = PreparedWeights(key, rows)
    return held.for_rows(rows)
