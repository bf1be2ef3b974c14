"""Packed rows for padding-free forward passes: the real tokens of a padded batch, whole sequences one
after the other, position ids restarting at 0 at each sequence and no attention mask. The on-policy
engine's passes (:func:`rlhf_trainers.onpolicy.forward.pack_sequences`) and reward-model scoring
(:func:`packed_pooled_scores`) use it, in one of two layouts:

- **One row** (:func:`one_row_matches`): every real token of the batch in a single row, not one position
  of padding. Attention runs per sequence: for a model on transformers' ``sdpa`` or ``eager`` attention,
  :func:`one_row_attention` switches it, for the duration of the pass, to :data:`SEGMENT_ATTENTION`, which
  calls PyTorch's ``scaled_dot_product_attention`` once per sequence (causal, no mask, each sequence's own
  keys: the work of the real tokens only), or, on a GPU in fp16/bf16, PyTorch's variable-length flash
  attention once for all of them (:func:`varlen_kernel`); on a GPU without that kernel the passes take
  rows of the longest sequence instead (:func:`one_row_fits`). A model on another implementation is left
  as it is: the probe decides whether it keeps the sequences apart (transformers' flash-attention path
  reads packed sequences from the position ids of a single row; not run here, no GPU with flash-attn was
  available).
- **Rows of the longest sequence** (:func:`padding_free_matches`): whole sequences first-fit into rows as
  wide as the longest, attention kept within each by the block-diagonal mask that transformers'
  ``create_causal_mask`` builds from the position ids. The free tail of each row is computed like a
  sequence: measured on the SmolLM2-135M job of docs/benchmarks.md, 12-20 % of the positions of a pass.
  Used for models that the one-row probe refuses, and for training passes under gradient checkpointing
  (whose recomputation in the backward pass runs outside :func:`one_row_attention`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .compat import sdpa_has_gqa
from .compilation import uncompiled
from .models import _base, embedding_rows


@dataclass
class PackedRows:
    """The real tokens of a (B, T) batch packed into P rows of W tokens (:func:`pack_rows`)."""

    input_ids: torch.Tensor
    """(P, W) long, the packed token ids; a row's free tail holds the pad id."""
    position_ids: torch.Tensor
    """(P, W) long, each sequence's own positions (0, 1, ...); a row's free tail counts from 0 as well, a
    sequence of its own that no real token attends to."""
    destinations: torch.Tensor
    """(B, T) long, where each real token of the batch sits in the flat P x W layout (meaningless at the
    positions that are not real tokens)."""
    segments: tuple[int, ...] | None = None
    """One-row layout (``pack_rows(one_row=True)``): the length of each sequence of the single row, in
    order (their sum is W); None for rows of the longest sequence."""


def pack_rows(
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    pad_token_id: int,
    one_row: bool = False,
) -> PackedRows:
    """Pack the real tokens (``mask`` True, (B, T)) of each row of ``input_ids``, whole and in order, into
    rows as wide as the longest of them: first fit, longest first. Rows without a real token take no room.

    ``one_row``: all of them in a single row instead, in batch order, no padding at all (a batch without a
    real token gets one padding position); the row needs :func:`one_row_attention` (or a flash-attention
    kernel) to keep attention within each sequence.

    Rows as wide as the longest sequence, not one row for the whole batch: without a variable-length
    attention kernel (SDPA on CPU gets the packed layout as a dense (W, W) mask) attention grows with the
    square of a row's width. Forward + backward of a 64-sequence micro-batch of the kit model: 0.17 s
    padded, 0.09 s in rows of the longest sequence, 0.50 s in one row of 2,877 tokens; SmolLM2-135M, 16
    sequences: 11.2 s padded, 6.1 s in rows of the longest sequence, 8.4-10.4 s in rows of 256 tokens to one
    row (docs/ppo.md)."""
    mask = mask.bool()
    B = input_ids.shape[0]
    lengths = mask.sum(1)
    if one_row:
        counts = [n for n in lengths.tolist() if n]
        width = max(sum(counts), 1)
        destinations = mask.long().reshape(-1).cumsum(0).view_as(mask) - 1
        flat_ids = input_ids.new_full((width,), pad_token_id)
        flat_ids[destinations[mask]] = input_ids[mask]
        flat_positions = torch.zeros(width, dtype=position_ids.dtype, device=position_ids.device)
        flat_positions[destinations[mask]] = position_ids[mask]
        return PackedRows(
            input_ids=flat_ids.view(1, width),
            position_ids=flat_positions.view(1, width),
            destinations=destinations,
            segments=tuple(counts) or (1,),
        )
    width = max(int(lengths.max()) if B else 0, 1)
    used: list[int] = []
    row_of = [0] * B
    start_of = [0] * B
    for b in torch.argsort(lengths, descending=True, stable=True).tolist():
        n = int(lengths[b])
        if n == 0:
            break
        for r, filled in enumerate(used):
            if filled + n <= width:
                row_of[b], start_of[b] = r, filled
                used[r] += n
                break
        else:
            row_of[b], start_of[b] = len(used), 0
            used.append(n)
    used = used or [0]
    P = len(used)
    device = input_ids.device
    base = torch.tensor(row_of, device=device, dtype=torch.long) * width + torch.tensor(
        start_of, device=device, dtype=torch.long
    )
    destinations = base[:, None] + mask.long().cumsum(1) - 1
    flat_ids = input_ids.new_full((P * width,), pad_token_id)
    flat_ids[destinations[mask]] = input_ids[mask]
    column = torch.arange(width, device=device)
    filled = torch.tensor(used, device=device)
    flat_positions = (column[None, :] - filled[:, None]).clamp_min(0).reshape(-1).to(position_ids.dtype)
    flat_positions[destinations[mask]] = position_ids[mask]
    return PackedRows(
        input_ids=flat_ids.view(P, width),
        position_ids=flat_positions.view(P, width),
        destinations=destinations,
    )


#: The name under which :func:`segment_attention` is registered in transformers' ``AttentionInterface``
#: (a name of its own: no existing implementation is replaced, and nothing uses it outside
#: :func:`one_row_attention`).
SEGMENT_ATTENTION = "rlhf_trainers_segments"

# The sequence lengths of the one-row pass in progress (one_row_attention); None outside one.
_SEGMENTS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar(
    "rlhf_trainers_segments", default=None
)
# The attention implementations whose arithmetic segment_attention reproduces.
_SWITCHABLE = ("sdpa", "eager")


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention of a one-row packed pass, one ``scaled_dot_product_attention`` call per sequence
    (the lengths of :func:`one_row_attention`): each query attends to the earlier keys of its own sequence
    only, without a mask, so the work is that of the real tokens. On a GPU in fp16/bf16 (autocast's or the
    model's dtype) the sequences go to one variable-length flash-attention call instead
    (:func:`varlen_kernel`, torch >= 2.10), the same arithmetic in one kernel per layer.
    transformers' attention-function signature: ``query`` (1, H, N, D), ``key``/``value`` (1, H_kv, N, D);
    returns (1, N, H, D).

    Refuses what it does not compute: a mask, a non-causal call, logit soft-capping, a sliding window,
    attention sinks or a position bias, and a call outside :func:`one_row_attention`."""
    segments = _SEGMENTS.get()
    if segments is None:
        raise RuntimeError(
            f"The {SEGMENT_ATTENTION!r} attention runs only inside rlhf_trainers.packing.one_row_attention "
            "(a one-row packed pass); this model's config still names it outside one."
        )
    unsupported = [
        name
        for name in ("softcap", "sliding_window", "s_aux", "position_bias")
        if kwargs.get(name) is not None
    ]
    if attention_mask is not None or is_causal is False or unsupported:
        raise ValueError(
            f"{SEGMENT_ATTENTION!r} computes plain causal attention per sequence; this call also has "
            f"{unsupported or ['an attention mask' if attention_mask is not None else 'is_causal=False']}."
        )
    if query.shape[0] != 1 or query.shape[2] != sum(segments) or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{SEGMENT_ATTENTION!r}: the sequence lengths {list(segments)} (sum {sum(segments)}) do not "
            f"describe this pass's one row (query {tuple(query.shape)}, key {tuple(key.shape)})."
        )
    p = dropout if module.training else 0.0
    if p == 0.0 and _varlen_applies(query):
        return _varlen_segments(query, key, value, segments, scaling), None
    groups = query.shape[1] // key.shape[1]
    gqa: dict[str, Any] = {}
    if groups > 1:
        if sdpa_has_gqa():
            gqa["enable_gqa"] = True
        else:  # torch < 2.5: the key/value heads repeated for their query heads
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
    half = _cpu_half_dtype(query)
    with contextlib.ExitStack() as stack:
        if half is not None:
            # CPU in bf16/fp16: attention in float32, the output back in the half dtype
            # (:func:`_cpu_half_dtype` says why).
            stack.enter_context(torch.autocast("cpu", enabled=False))
            query, key, value = query.float(), key.float(), value.float()
        # split (not slices): its backward writes each sequence's gradient into one buffer (a cat), where
        # a slice's backward zero-fills a whole-row buffer per sequence.
        outputs = [
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, scale=scaling, **gqa
            ).transpose(1, 2)
            for q, k, v in zip(
                query.split(segments, dim=2),
                key.split(segments, dim=2),
                value.split(segments, dim=2),
                strict=True,
            )
        ]
    # (1, N, H, D), contiguous: one copy of the outputs instead of a cat and a transposed copy
    out = outputs[0].contiguous() if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return (out if half is None else out.to(half)), None


def _cpu_half_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half dtype (bf16/fp16) a CPU pass computes in (autocast's or the query's), else None.

    :func:`segment_attention` runs such passes' attention in float32: PyTorch's CPU attention kernel in
    bf16 is ~1.5x faster than in float32 forward only but ~2.7x slower forward + backward (SmolLM2-135M's
    9 heads of 64 on 16 sequences of 10-110 tokens, one thread, torch 2.13; ``benchmarks/cpu_attention.py``),
    and one kernel for the rollout's and the training's passes keeps their log-probs equal (the policy
    ratio at the first mini-batch). Attention is a small share of the FLOPs, and float32 only adds
    precision (the bf16 kernel also accumulates in float32)."""
    if query.device.type != "cpu":
        return None
    dtype = _compute_dtype(query)
    return dtype if dtype in _HALF else None


_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """PyTorch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10,
    CUDA, fp16/bf16) as ``kernel(q, k, v, cu_seqlens, max_len, scale)`` on (N, H, D) / (N, H_kv, D)
    tensors, causal within each sequence, with this torch's spelling of it (``is_causal`` in 2.10,
    ``window_size=(-1, 0)`` after; ``enable_gqa`` where it exists, else the key/value heads repeated);
    None where this torch has none. Used by :func:`segment_attention` for one-row passes on a GPU: one
    kernel call per layer instead of one ``scaled_dot_product_attention`` call per sequence."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:  # pragma: no cover - an API this code does not know
        return None
    takes_gqa, takes_scale = "enable_gqa" in params, "scale" in params

    def kernel(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
    ) -> torch.Tensor:
        extra: dict[str, Any] = {}
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            if takes_gqa:
                extra["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if scale is not None:
            if takes_scale:
                extra["scale"] = scale
            else:  # the kernel's own scale is 1/sqrt(D): fold the difference into the queries
                q = q * (scale * q.shape[-1] ** 0.5)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal, **extra)

    return kernel


@functools.lru_cache(maxsize=8)
def _flash_capable(device: torch.device) -> bool:
    # flash attention's kernels need an Ampere or newer GPU (compute capability 8.0)
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype that attention computes in: autocast's (as ``scaled_dot_product_attention`` would cast
    its inputs to it) or the query's own."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def _varlen_supports(device: torch.device, dtype: torch.dtype, head_size: int | None) -> bool:
    """A CUDA device that flash attention supports, fp16/bf16 compute, a head size it takes (a multiple of
    8, at most 256; None: not known, not refused) and a torch that has :func:`varlen_kernel`."""
    return (
        device.type == "cuda"
        and dtype in _HALF
        and (head_size is None or (head_size % 8 == 0 and head_size <= 256))
        and varlen_kernel() is not None
        and _flash_capable(device)
    )


def _varlen_applies(query: torch.Tensor) -> bool:
    """Whether :func:`segment_attention` runs on :func:`varlen_kernel` (:func:`_varlen_supports` for this
    query). Elsewhere (CPU, fp32) each sequence gets its own ``scaled_dot_product_attention``."""
    return _varlen_supports(query.device, _compute_dtype(query), query.shape[-1])


def one_row_fits(device: torch.device | str, dtype: torch.dtype, head_size: int | None = None) -> bool:
    """Whether the one-row layout is the fast one for passes computing in ``dtype`` on ``device``. On a CPU,
    yes: one ``scaled_dot_product_attention`` call per sequence does the real tokens' work only. On a GPU,
    only where :func:`segment_attention` runs on :func:`varlen_kernel` (fp16/bf16, flash-attention capable
    device, a torch with the kernel): there per-sequence calls are bound by kernel launches, measured on an
    H200 at ~10x slower than the padded passes (docs/benchmarks.md), so such passes use rows of the longest
    sequence instead (one masked attention call per layer)."""
    device = torch.device(device)
    return device.type == "cpu" or _varlen_supports(device, dtype, head_size)


def attention_head_size(model: nn.Module) -> int | None:
    """The model's attention head size from its config (``head_dim``, else hidden size / heads), or None."""
    config = _config_of(model)
    if config is None:
        return None
    text = getattr(config, "get_text_config", lambda: config)()
    head = getattr(text, "head_dim", None)
    if isinstance(head, int):
        return head
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _pass_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype a pass of ``model`` computes in right now: autocast's on ``device`` if enabled, else the
    model's floating-point parameters'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


@functools.lru_cache(maxsize=16)
def _cumulative_lengths(segments: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(S + 1,) int32 on ``device``: 0 and the running sums of the sequence lengths (cached: every layer of
    a pass asks for the same)."""
    ends = [0]
    for n in segments:
        ends.append(ends[-1] + n)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _varlen_segments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: tuple[int, ...],
    scaling: float | None,
) -> torch.Tensor:
    """:func:`segment_attention` as one :func:`varlen_kernel` call: (1, H, N, D) inputs in the compute
    dtype (autocast's, as SDPA casts them), (N, H, D) views of them to the kernel, (1, N, H, D) out."""
    kernel = varlen_kernel()
    assert kernel is not None, "_varlen_applies checked it"
    dtype = _compute_dtype(query)
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
    out = kernel(q, k, v, _cumulative_lengths(segments, query.device), max(segments), scaling)
    return out.unsqueeze(0)


def _register_segment_attention() -> bool:
    """Register :func:`segment_attention` under :data:`SEGMENT_ATTENTION` (once); False where this
    transformers has no ``AttentionInterface``."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers < 4.48
        return False
    if SEGMENT_ATTENTION not in AttentionInterface._global_mapping:
        # Run eager inside compiled blocks (torch_compile=True): a loop over this pass's lengths, read
        # from a context variable, is nothing the compiler should trace.
        AttentionInterface.register(SEGMENT_ATTENTION, uncompiled(segment_attention))
    return True


def _config_of(model: nn.Module) -> Any:
    try:
        return _base(model).config
    except AttributeError:
        return None


@contextlib.contextmanager
def one_row_attention(
    models: nn.Module | Iterable[nn.Module | None], segments: tuple[int, ...]
) -> Iterator[None]:
    """Inside the context, the forward passes of ``models`` (on ``sdpa`` or ``eager`` attention) keep
    attention within the sequences of a one-row packed pass whose sequences have these lengths
    (:func:`segment_attention`); after it, each model's attention is what it was. Models on another
    implementation (e.g. a flash-attention kernel, which transformers feeds the sequences read from the
    position ids) are left as they are; :func:`one_row_matches` decides whether they keep them apart. Backward passes need no context: autograd does not call the attention function again
    (unless gradient checkpointing recomputes the forward: keep such passes in the rows layout)."""
    if isinstance(models, nn.Module):
        models = [models]
    switched = []
    token = _SEGMENTS.set(tuple(segments))
    try:
        for model in models:
            config = _config_of(model) if model is not None else None
            if config is not None and getattr(config, "_attn_implementation", None) in _SWITCHABLE:
                if not _register_segment_attention():
                    continue
                switched.append((config, config._attn_implementation))
                config._attn_implementation = SEGMENT_ATTENTION
        yield
    finally:
        for config, implementation in reversed(switched):
            config._attn_implementation = implementation
        _SEGMENTS.reset(token)


# one_row_matches' answers: per model, per attention implementation (weak keys: no model kept alive).
_ONE_ROW_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[str, bool]] = weakref.WeakKeyDictionary()


def one_row_matches(model: nn.Module) -> bool:
    """Whether the model's passes can run in the one-row layout (:func:`pack_rows` ``one_row``): four
    sequences in a single row, each with its own positions, under :func:`one_row_attention`, must give the
    final hidden states each gives alone (the probe of :func:`padding_free_matches`, in eval mode; checked
    once per model and attention implementation). Refused without a probe: attention with logit
    soft-capping or a sliding window (not computed by :func:`segment_attention`)."""
    config = _config_of(model)
    if config is None:
        return False
    implementation = str(getattr(config, "_attn_implementation", None))
    known = _ONE_ROW_CHECKED.get(model, {})
    if implementation not in known:
        text = getattr(config, "get_text_config", lambda: config)()
        windowed = any(
            getattr(text, name, None) is not None
            for name in ("attn_logit_softcapping", "final_logit_softcapping")
        ) or (getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True))
        known[implementation] = not windowed and _probe_packed(model, one_row=True)
        _ONE_ROW_CHECKED[model] = known
    return known[implementation]


def backbone_of(model: nn.Module) -> nn.Module | None:
    """The transformer under a causal-LM or sequence-classification head (under PEFT too), or None."""
    try:
        base = _base(model)
        backbone = getattr(base, base.base_model_prefix, None)
    except AttributeError:
        return None
    return backbone if isinstance(backbone, nn.Module) else None


def padding_free_matches(model: nn.Module) -> bool:
    """Whether the model keeps attention within the sequences of packed rows (position ids restarting at
    0, no attention mask), checked once on a probe in eval mode: four sequences packed two by two into two
    rows (the layout of :func:`pack_sequences`) must give the final hidden states each gives alone.
    Models whose attention masks are not built from the position ids (transformers' ``create_causal_mask``)
    would let a row's second sequence attend to its first and fail it, and so does transformers' flash
    attention, which reads packed sequences from the position ids of a single row only (it passes
    :func:`one_row_matches` instead); their passes stay padded."""
    return _probe_packed(model, one_row=False)


def _probe_ids(ids: torch.Tensor, model: nn.Module, rows: int) -> torch.Tensor:
    """``ids`` taken into the embedding table, with the model's pad id (if any) replaced: a forward without
    an attention mask whose first or last id is the pad id logs transformers' "We strongly recommend
    passing in an `attention_mask`" warning."""
    ids = ids % max(rows, 1)
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if isinstance(pad, int) and rows > 1:
        ids = torch.where(ids == pad, (pad + 1) % rows, ids)
    return ids


@torch.no_grad()
def _probe_packed(model: nn.Module, one_row: bool) -> bool:
    """Four sequences packed (two rows of two, or one row of four under :func:`one_row_attention`) must
    give the final hidden states each gives alone, in eval mode."""
    backbone = backbone_of(model)
    if backbone is None:
        return False
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return False
    rows = embedding_rows(model)
    lengths = ((4, 5), (3, 6))
    sequences = [
        [
            _probe_ids(torch.arange(n, device=device) * 7 + 3 * i + j + 1, model, rows)
            for j, n in enumerate(row)
        ]
        for i, row in enumerate(lengths)
    ]
    ids = torch.stack([torch.cat(row) for row in sequences])
    positions = torch.stack([torch.cat([torch.arange(n, device=device) for n in row]) for row in lengths])
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        alone = torch.stack(
            [
                torch.cat(
                    [backbone(input_ids=seq[None], use_cache=False).last_hidden_state[0] for seq in row]
                )
                for row in sequences
            ]
        )
        if one_row:
            with one_row_attention(model, tuple(n for row in lengths for n in row)):
                packed = backbone(
                    input_ids=ids.reshape(1, -1), position_ids=positions.reshape(1, -1), use_cache=False
                ).last_hidden_state.view_as(alone)
        else:
            packed = backbone(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    except Exception:  # any failure means: keep the padded passes
        return False
    finally:
        for module, training in modes:  # each submodule's own mode back, as it was
            module.training = training
    if packed.shape != alone.shape:
        return False
    # fp32 rounding is ~1e-6 of the scale, half precision's ~1e-2; attention leaking across the sequences
    # changes the second ones' states by a large fraction of it.
    tolerance = 1e-3 if alone.dtype == torch.float32 else 3e-2
    alone, packed = alone.float(), packed.float()
    scale = float(alone.abs().max()) + 1e-6
    return float((packed - alone).abs().max()) <= tolerance * scale


def packed_score_head(model: nn.Module) -> nn.Linear | None:
    """The head of a one-label sequence-classification model when it is a plain ``nn.Linear`` applied to
    each hidden state (Llama's, GPT-2's, GPT-NeoX's ``score``), so that it can be applied to the gathered
    last tokens of packed rows; None otherwise (heads that pool or transform first keep padded scoring)."""
    from .models import find_score_head

    try:
        name, head = find_score_head(model)
    except ValueError:
        return None
    return head if getattr(_base(model), name, None) is head and type(head) is nn.Linear else None


def packing_layout(model: nn.Module) -> str | None:
    """How the model's passes are packed: ``"one_row"`` (:func:`one_row_matches`), else ``"rows"``
    (:func:`padding_free_matches`), else None (padded passes)."""
    if one_row_matches(model):
        return "one_row"
    return "rows" if padding_free_matches(model) else None


def packed_context(
    models: nn.Module | Iterable[nn.Module | None], segments: tuple[int, ...] | None
) -> contextlib.AbstractContextManager[None]:
    """:func:`one_row_attention` for a one-row packed pass (``segments``, :attr:`PackedRows.segments`);
    nothing for rows of the longest sequence (None)."""
    return one_row_attention(models, segments) if segments is not None else contextlib.nullcontext()


@torch.no_grad()
def packed_pooled_scores(
    model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int
) -> torch.Tensor:
    """Pooled logits (B, num_labels) of a sequence-classification model with a :func:`packing_layout` and
    a :func:`packed_score_head`: each row's real tokens (``mask``, either padding side) packed
    (:func:`pack_rows`, in the model's layout), the head applied to the final hidden state of each row's
    last real token, as the padded model reads it. Every row must hold a real token."""
    mask = mask.bool()
    positions = (mask.long().cumsum(1) - mask.long()).masked_fill(~mask, 0)
    one_row = one_row_matches(model) and one_row_fits(
        input_ids.device, _pass_dtype(model, input_ids.device), attention_head_size(model)
    )
    rows = pack_rows(input_ids, mask, positions, pad_token_id, one_row=one_row)
    backbone = backbone_of(model)
    head = packed_score_head(model)
    assert backbone is not None and head is not None, "a model that packed_score_head accepts"
    with packed_context(model, rows.segments):
        hidden = backbone(
            input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False
        ).last_hidden_state
    last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)
    index = rows.destinations[torch.arange(mask.shape[0], device=mask.device), last]
    return head(hidden.reshape(-1, hidden.shape[-1])[index])
