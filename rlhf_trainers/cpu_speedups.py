"""Speed switches for one kind of machine (CPU), kept apart from the algorithm code behind one boundary.

Six switches of the on-policy configs live here, and nothing outside this module names them (plus one
cache without a switch, :class:`AutocastWeightCache`, below):

- ``lean_decoding``: :class:`LeanLlamaSteps`, faster decoding steps for Llama-architecture policies that
  the builtin sampling loop takes as its optional "fast steps" provider.
- ``mkl_prepacked_decoding``: the lean steps' linear layers on weights packed once per sampling call for
  MKL's GEMM (:func:`lean_llama_steps_prepacked`).
- ``merged_adapter_decoding``: the lean steps' LoRA layers on their weights with the adapters merged into
  copies, once per sampling call (:func:`lean_llama_steps_merged`, :func:`lean_llama_steps_prepacked_merged`).
- ``onednn_linear``: :class:`OneDNNLinear`, a context the generation backends run in.
- ``inverse_cdf_sampling``: the builtin loop draws its tokens by inverting each row's cumulative
  distribution (:func:`~rlhf_trainers.generation.builtin.draw_inverse_cdf`) instead of
  ``torch.multinomial``.
- ``reuse_host_memory``: :func:`reuse_freed_host_memory`, glibc's malloc keeping freed memory
  (process-wide, so off unless the user asks for it), applied by :func:`apply_host_memory_settings` at the
  start of ``train()``.

The boundary is :func:`decoding_speedups`: the generation factory asks it, once per trainer, what the
sampling of a given model may use (:class:`DecodingSpeedups`), and passes that on without knowing what
it is.

**Lean decoding steps** (``lean_decoding``). For a ``transformers`` ``LlamaForCausalLM`` (Llama, SmolLM and
their fine-tunes; also under a PEFT adapter), the decoding steps after the prompt pass call the model's own
modules directly (embedding, rotary embedding, norms, projections, MLP, lm head) with a KV cache
preallocated for the whole response and PyTorch's ``scaled_dot_product_attention``, instead of the model's
``forward``. That is the arithmetic of the model's forward, without what it does around it at every step
(attention-mask building, cache objects, keyword-argument handling, output classes), which is most of a
decoding step for small models: the offline kit's 2-layer Llama samples 32 tokens in 33 instead of 59 ms
on 2 CPU cores; for SmolLM2-135M on CPU the matmuls dominate and both take the same time. Logits agree with
the forward's to float32 rounding (~1e-6 relative). Anything else (other architectures, a subclass, forward
hooks on the skipped modules, accelerate's device-map hooks, DeepSpeed's partitioned weights, attention
dropout in training mode, a torch without grouped-query SDPA) takes the model's ``forward``.

**MKL-prepacked weights** (``mkl_prepacked_decoding``). MKL's float32 GEMM copies ("packs") its right-hand
matrix into a cache-friendly layout at every call. A decoding step multiplies B rows (16 in the 135M
benchmark) by every weight of the model, so that copy of the weight, not the arithmetic, is most of each
product: 9.7 % of a whole SmolLM2-135M PPO update's CPU samples were MKL's packing copies. PyTorch exposes
MKL's pack-once API (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, what its compiler uses
for frozen linear layers on CPU): the lean steps pack each plain ``nn.Linear`` weight once per sampling
call for its batch size and multiply by the packed copy at every step. Measured on the 2-core Intel Xeon
(one thread): a 16 x 576 by 576 x 1536 product 0.69 -> 0.47 ms, the 49152 x 576 lm head 23.2 -> 14.3 ms,
16 rows x 64 tokens of SmolLM2-135M 10.8 -> 9.3 s, with draws, log-probs and entropies identical bit for
bit. The packed copies live for the sampling call only, and MKL's packed form is larger than the weights:
SmolLM2-135M's 513 MiB of float32 linear weights packed for 16 rows added 1016 MiB of resident memory at
the first call, in tensors that reserve 2.6 GB of address space (``benchmarks/prepacked_memory.py``;
``_mkl_reorder_linear_weight`` returns 2-5x the weight's element count). LoRA layers and other
``nn.Linear`` subclasses keep their own forward (unless ``merged_adapter_decoding`` merges them, below).
It earned its place on Intel's CPUs only: on the 2-core AMD EPYC (Zen 4) a 16-row step's linear products
took 99.2 ms on the packed weights against 97.1 ms without, and the packed copy raised a 135M GRPO run's
peak resident memory by ~900 MiB, so the default (``None``, :func:`prepacking_wanted`) packs only where
:func:`cpu_vendor` is ``GenuineIntel``.

**LoRA adapters merged for the decoding steps** (``merged_adapter_decoding``). A PEFT LoRA layer computes
``base(x) + scale * B(A(dropout(x)))``: three products per linear layer at every decoding step, where
the first alone would do with the adapter merged into the weight. At the start of a sampling call the lean
steps merge each LoRA layer's active adapters into a copy of its weight (PEFT's own merge arithmetic,
:func:`~rlhf_trainers.generation.weights.merged_adapter_weights`, so DoRA's magnitudes and ``lora_bias``
too; the model stays unmerged, and the prompt pass, training and scoring keep the adapter's forward), and
multiply by the copy at every step: packed for MKL with ``mkl_prepacked_decoding`` in float32, cast once
to the autocast dtype under CPU bf16/fp16 autocast. Float32 results equal the adapter's to rounding
(another order of the same sums: SmolLM2-135M with LoRA r 16 on every linear layer, 32 completions x 32
tokens, the same draws and log-probs within 4e-5); in bf16 the merged weight is rounded once instead of
the base weight and the adapter's product separately, so draws differ as any two bf16 kernels' do.
Measured on the 2-core Intel Xeon, one thread, that job (``benchmarks/lora_decoding.py``, medians of 5
alternating calls on a noisy day): 12.2 -> 9.8 s per sampling call in float32, 8.8 -> 7.6 s in bf16;
inside a PPO update's generation 1.03x and 1.06x, within that day's noise. The copies (the adapted
weights once more, and their packed form in float32) live for the sampling call only. CPU only: on a GPU the copy would be memory the user did not plan for, and
the adapter's small products cost little there. Layers it does not apply to (an adapter PEFT cannot merge,
such as aLoRA; hooks; training mode, where the adapter's dropout acts) keep their own forward.

**Inverse-CDF draws** (``inverse_cdf_sampling``). On CPU, ``torch.multinomial(probs, 1)`` draws one
exponential variate per vocabulary entry and takes the row's largest ``probs / variate`` (the exponential
race), generating and transforming them one element at a time: 22-32 ms per decoding step for 16 rows of
SmolLM2's 49,152 entries on one thread, ~1.4-2.0 s of a 64-token rollout, and 200-230 ms per step at
128 rows. Inverting the cumulative distribution needs one uniform variate per row and a float64 running sum
(:func:`~rlhf_trainers.generation.builtin.draw_inverse_cdf`): 1.4-2.1 ms at 16 rows, 12-14 ms at 128 (``benchmarks/sampler_draws.py``). The
distribution is the same (each token with its probability; never one that top-k / top-p / min-p
excluded), the draws for a seed are not: with the switch the builtin loop no longer reproduces
``generate(do_sample=True)``'s tokens for the same seed (on a GPU, where ``torch.multinomial`` is one
kernel and cheap, the loop keeps its draws). Log-probs and entropies are those of the drawn tokens, as
before.

**oneDNN linear** (``onednn_linear``): oneDNN for the token-by-token sampling steps of the trainers'
models on CPU.

Why: PyTorch's CPU build sends every float32 ``F.linear`` to the BLAS it was built with (MKL on x86). For
the skinny matmuls of a decoding step (one position per row: 8 rows against every weight of the model)
oneDNN, also inside every x86 torch wheel (``torch.ops.mkldnn``), streams the weights much faster on the
AMD EPYC machines this project is measured on: the 49152 x 576 lm head of SmolLM2-135M takes 37 ms with
MKL and 8 ms with oneDNN for 8 rows, and a 32-token rollout of that model 3.6 -> 2.5 s.

Why only there: oneDNN generates machine code for every distinct matrix shape it meets (about 0.4-0.7 MiB
per (rows, in, out) shape, measured with torch 2.13 / oneDNN 3.12), and two caches of 1024 entries each
keep it: oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and the one ideep, PyTorch's
oneDNN wrapper, keeps in front of it (``LRU_CACHE_CAPACITY``); both are read once, at the process's first
oneDNN call, and lowering only one of them releases little. A decoding step has a fixed number of rows
(the rollout chunk), so its shapes are few and the memory bounded (a few MiB). The training and scoring
passes have as many row counts as micro-batch lengths: routed through oneDNN with the default capacities,
resident memory grew with every new length (+490 MiB for 300 row counts x 3 weight shapes). Capping both
caches at 32 entries before the first call bounds that growth (+38 MiB for the same shapes), but it is a
process-wide setting, and on the machine instance measured last the gain it would buy was small: oneDNN
ran a micro-batch's forward and input-gradient GEMMs 8-36 % faster than MKL, and a forward and backward
pass of SmolLM2-135M on 4 x 60 tokens took 1.52-1.63 s against MKL's 1.58 s (an earlier A/B of whole
updates, on another instance, had shown 1.3x). So training stays on PyTorch's default.
``benchmarks/onednn_shapes.py`` measures both: the GEMM rates and the memory growth.

How: :class:`OneDNNLinear` is a ``TorchFunctionMode`` that the generation backends enter around every
sampling call (the rollout's and evaluation's). Inside it, an ``F.linear`` whose input has one position
per row (``(..., 1, in)``: a decoding step of the sampling loop, and its lm head), in float32 on CPU, without autograd and without autocast,
runs as oneDNN's linear; everything else passes through untouched. Nothing is changed in the models (no
module replaced, no weight copied), and leaving the context restores plain PyTorch. The arithmetic is IEEE
float32 in both libraries (oneDNN's default ``strict`` math mode); results differ from MKL's by the
rounding of another summation order (about 1e-6 relative).

**Frozen weights cast once per sampling call under CPU autocast** (:class:`AutocastWeightCache`, no
switch: the results are autocast's, bit for bit). Autocast keeps the half-precision copy of a weight for
the rest of its region only for leaf tensors that require a gradient; a frozen weight (the base model
under a LoRA adapter, a frozen lm head) is cast again at every call, so under ``bf16=True`` the sampling
loop cast every frozen weight once per decoding step (SmolLM2-135M with a LoRA adapter on every linear
layer, 32 completions x 32 tokens, one thread: 12.1-13.8 s per sampling call, 9.0-9.8 s with the cache,
the same tokens). Inside a sampling
call on CPU under autocast, the context casts each frozen float32 weight (and bias) of an ``F.linear`` to
autocast's dtype once and hands the copy to every later call; autocast then has nothing left to cast. The
copies (half the size of the frozen float32 weights) live for the sampling call only. GPUs are left to
autocast (a copy of a large frozen model there would cost memory the user did not plan for).

**Host memory** (``reuse_host_memory``, off by default): see :func:`reuse_freed_host_memory`. Measured
gain: a 135M-parameter PPO update on 2 CPU threads took 20.5 s with it and 25.6 s without.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .compat import sdpa_has_gqa

__all__ = [
    "AutocastWeightCache",
    "DecodingSpeedups",
    "LeanLlamaSteps",
    "OneDNNLinear",
    "apply_host_memory_settings",
    "decoding_speedups",
    "lean_llama_steps",
    "lean_llama_steps_merged",
    "lean_llama_steps_prepacked",
    "lean_llama_steps_prepacked_merged",
    "mkl_prepacked_linear_available",
    "onednn_linear_available",
    "reuse_freed_host_memory",
]


# --------------------------------------------------------------------------------------------------
# the boundary: what the sampling of one model may use
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodingSpeedups:
    """What :func:`decoding_speedups` allows the sampling of one model."""

    #: The builtin loop's provider of faster decoding steps (:func:`lean_llama_steps`), or None.
    fast_steps: Callable[[nn.Module, Any, Tensor, int], LeanLlamaSteps | None] | None = None
    #: What ``fast_steps`` is called in the batch accounting ("" when None).
    fast_steps_name: str = ""
    #: A factory of the context every generation call runs in (:class:`OneDNNLinear`,
    #: :class:`AutocastWeightCache`), or None.
    context: Callable[[], Any] | None = None
    #: What ``context`` is called in the batch accounting ("" when None).
    context_name: str = ""
    #: How the builtin loop draws its tokens (:func:`~rlhf_trainers.generation.builtin.draw_inverse_cdf`),
    #: or None for its default (``torch.multinomial``).
    draw: Callable[[Tensor], Tensor] | None = None
    #: What ``draw`` is called in the batch accounting ("" when None).
    draw_name: str = ""


def decoding_speedups(
    model: nn.Module, config: Any, *, device: torch.device, deepspeed: bool
) -> DecodingSpeedups:
    """The CPU speed switches of ``config`` (an :class:`~rlhf_trainers.OnPolicyConfig`: ``lean_decoding``,
    ``onednn_linear``, ``onednn_linear_min_weights``, ``bf16``/``fp16``) that apply to sampling from
    ``model`` on ``device``; decided once, when the trainer is built.

    The lean steps are offered where ``model`` is a plain Llama now (the provider checks again at every
    call, since hooks or partitioned weights may come later); oneDNN where it pays and is safe: CPU,
    float32 weights, no bf16/fp16 autocast, no DeepSpeed, a torch build with oneDNN (checked once), and a
    largest linear layer of at least ``onednn_linear_min_weights`` weights; merged LoRA adapters
    (``merged_adapter_decoding``) on CPU without DeepSpeed for a policy with PEFT LoRA layers;
    inverse-CDF draws (``inverse_cdf_sampling``) on CPU.
    """
    speedups: dict[str, Any] = {}
    if getattr(config, "inverse_cdf_sampling", False) and device.type == "cpu":
        from .generation.builtin import draw_inverse_cdf

        speedups.update(draw=draw_inverse_cdf, draw_name="inverse-CDF draws")
    onednn = _onednn_pays(model, config, device=device, deepspeed=deepspeed)
    if getattr(config, "lean_decoding", False) and _plain_llama(model) is not None:
        prepack = not onednn and _prepacking_pays(model, config, device=device, deepspeed=deepspeed)
        merge = _merging_pays(model, config, device=device, deepspeed=deepspeed)
        steps, name = {
            (False, False): (lean_llama_steps, "lean Llama steps"),
            (True, False): (lean_llama_steps_prepacked, "lean Llama steps on MKL-prepacked weights"),
            (False, True): (lean_llama_steps_merged, "lean Llama steps, LoRA adapters merged"),
            (True, True): (
                lean_llama_steps_prepacked_merged,
                "lean Llama steps on MKL-prepacked weights, LoRA adapters merged",
            ),
        }[prepack, merge]
        speedups.update(fast_steps=steps, fast_steps_name=name)
    if onednn:
        speedups.update(context=OneDNNLinear, context_name="oneDNN linear")
    elif _half_autocast_cpu_run(config, device=device, deepspeed=deepspeed):
        speedups.update(context=AutocastWeightCache, context_name="frozen weights cast once per call")
    return DecodingSpeedups(**speedups)


def _half_autocast_cpu_run(config: Any, *, device: torch.device, deepspeed: bool) -> bool:
    """CPU, no DeepSpeed, bf16/fp16 autocast (:class:`AutocastWeightCache`)."""
    half = bool(getattr(config, "bf16", False) or getattr(config, "fp16", False))
    return device.type == "cpu" and not deepspeed and half


def _float32_cpu_run(model: nn.Module, config: Any, *, device: torch.device, deepspeed: bool) -> bool:
    """CPU, no DeepSpeed, no bf16/fp16 autocast, float32 weights."""
    if device.type != "cpu" or deepspeed:
        return False
    if getattr(config, "bf16", False) or getattr(config, "fp16", False):
        return False
    return all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())


def _prepacking_pays(model: nn.Module, config: Any, *, device: torch.device, deepspeed: bool) -> bool:
    """``mkl_prepacked_decoding`` on (None: on an Intel CPU, :func:`prepacking_wanted`), a float32 CPU run
    without DeepSpeed, and MKL's packed GEMM in this torch build."""
    return (
        prepacking_wanted(getattr(config, "mkl_prepacked_decoding", False))
        and _float32_cpu_run(model, config, device=device, deepspeed=deepspeed)
        and mkl_prepacked_linear_available()
    )


#: The CPU vendors on which MKL-prepacked decoding earned its place (``benchmarks/decoding_linear.py``):
#: Intel's. On the AMD EPYC (Zen 4) the prepacked products ran no faster than MKL's own (a 16-row
#: SmolLM2-135M step's linear products: 99.2 ms prepacked, 97.1 ms without) while the packed copy added
#: ~900 MiB to a 135M GRPO run's peak.
PREPACKING_VENDORS = ("GenuineIntel",)


def prepacking_wanted(setting: bool | None) -> bool:
    """``mkl_prepacked_decoding`` resolved: True/False as given; None (the default) on where the CPU's vendor
    is one of :data:`PREPACKING_VENDORS` (:func:`cpu_vendor`), off elsewhere and where it is unknown."""
    if setting is None:
        return cpu_vendor() in PREPACKING_VENDORS
    return bool(setting)


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str | None:
    """The CPU's vendor string as the CPUID instruction gives it (``GenuineIntel``, ``AuthenticAMD``, ...):
    ``vendor_id`` of ``/proc/cpuinfo`` on Linux, else what :func:`platform.processor` names (Windows
    includes it; macOS does not); None where neither says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id" and value.strip():
                    return value.strip()
    except OSError:
        pass
    import platform

    processor = platform.processor()
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        if vendor in processor:
            return vendor
    return None


def _merging_pays(model: nn.Module, config: Any, *, device: torch.device, deepspeed: bool) -> bool:
    """``merged_adapter_decoding`` on, CPU (a merged copy of the adapted weights on a GPU would be memory
    the user did not plan for), no DeepSpeed, and a PEFT LoRA ``Linear`` layer in ``model``."""
    if not getattr(config, "merged_adapter_decoding", False) or device.type != "cpu" or deepspeed:
        return False
    lora_linear = _lora_linear_class()
    return lora_linear is not None and any(type(m) is lora_linear for m in model.modules())


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


def _onednn_pays(model: nn.Module, config: Any, *, device: torch.device, deepspeed: bool) -> bool:
    if not getattr(config, "onednn_linear", False):
        return False
    if not _float32_cpu_run(model, config, device=device, deepspeed=deepspeed):
        return False
    largest = max((m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)), default=0)
    return largest >= config.onednn_linear_min_weights and onednn_linear_available()


# --------------------------------------------------------------------------------------------------
# lean decoding steps (lean_decoding)
# --------------------------------------------------------------------------------------------------


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
        prepack = prepack and mkl_prepacked_linear_available()
        half = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        for module in lm.modules():
            if prepack and _packable(module):
                packed = torch.ops.mkl._mkl_reorder_linear_weight(module.weight, B)
                steps.packed[module] = (packed, module.weight, module.bias)
            elif merge_adapters and (merged := _merged_lora(module)) is not None:
                weight, bias = merged
                if prepack and half is None and _plain(weight) and (bias is None or _plain(bias)):
                    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, B)
                    steps.packed[module] = (packed, weight, bias)
                else:  # under CPU autocast: cast once, here, instead of at every step
                    steps.merged[module] = (weight if half is None else weight.to(half), bias)
        return steps

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
    from .generation.weights import AdapterNotMergeableError, merged_adapter_weights

    try:
        return merged_adapter_weights(module)
    except AdapterNotMergeableError:
        return None


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


def _matches_linear(linear: Callable[[Tensor, Tensor, Tensor], Tensor]) -> bool:
    """Whether ``linear(x, weight, bias)`` gives ``F.linear``'s result to float32 rounding on a small 5-row
    product (False where it raises: a private op changed or missing)."""
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(5, 48, generator=generator)
        w = torch.randn(24, 48, generator=generator)
        b = torch.randn(24, generator=generator)
        got = linear(x, w, b)
        want = _LINEAR(x.double(), w.double(), b.double()).float()
        return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-4))
    except Exception:
        return False


# --------------------------------------------------------------------------------------------------
# oneDNN for the decoding steps' linear layers (onednn_linear)
# --------------------------------------------------------------------------------------------------

_LINEAR = torch.nn.functional.linear


def _op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's ``x @ weight.T + bias`` for a 2-D ``x``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build runs oneDNN's float32 linear on CPU, with results equal to ``F.linear``
    up to float32 rounding (checked once, on a small product, with the fallback ``False`` for builds
    without oneDNN or where the private op has changed)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return _matches_linear(_op)


def _plain(t: Any) -> bool:
    # Plain tensors and parameters only: subclasses (DTensor, FakeTensor, ...) keep their own dispatch.
    return type(t) in (Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32


def _eligible(x: Any, weight: Any, bias: Any) -> bool:
    """A decoding step's linear: input ``(..., 1, in)``, float32 CPU tensors, no autograd, no autocast."""
    if not (_plain(x) and _plain(weight)) or (bias is not None and not (_plain(bias) and bias.dim() == 1)):
        return False
    if x.dim() < 3 or x.shape[-2] != 1 or x.numel() == 0 or x.layout != torch.strided:
        return False
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or not weight.is_contiguous():
        return False
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return False
    # Under CPU autocast, F.linear runs in the autocast dtype: leave it to PyTorch.
    return not torch.is_autocast_enabled("cpu")


class OneDNNLinear(TorchFunctionMode):
    """Inside this context, the float32 ``F.linear`` calls of decoding steps on CPU (one position per row,
    no autograd) run through oneDNN (see the module docstring); everything else runs as usual. Enter it
    only where :func:`onednn_linear_available`."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _LINEAR:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _eligible(x, weight, bias):
                flat = x.reshape(-1, x.shape[-1]).contiguous()
                return _op(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


def _frozen_float32(t: Any) -> bool:
    return _plain(t) and not t.requires_grad


class AutocastWeightCache(TorchFunctionMode):
    """Inside this context (one sampling call), under CPU autocast, an ``F.linear`` whose weight (and bias)
    is a frozen float32 CPU tensor gets the weight cast to autocast's dtype once per context, not once per
    call (see the module docstring); autocast then computes exactly what it would have. Everything else
    runs as usual."""

    def __init__(self) -> None:
        super().__init__()
        # id -> (the tensor, kept alive so that its id is not reused; its copy)
        self._copies: dict[int, tuple[Tensor, Tensor]] = {}

    def _copy(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        held = self._copies.get(id(t))
        if held is None or held[0] is not t or held[1].dtype != dtype:
            held = (t, t.to(dtype))
            self._copies[id(t)] = held
        return held[1]

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _LINEAR and len(args) >= 2 and torch.is_autocast_enabled("cpu"):
            weight = args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _frozen_float32(weight) and (bias is None or _frozen_float32(bias)):
                dtype = torch.get_autocast_dtype("cpu")
                bias = None if bias is None else self._copy(bias, dtype)
                return func(args[0], self._copy(weight, dtype), bias)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# host memory (reuse_host_memory)
# --------------------------------------------------------------------------------------------------

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_host_memory_reuse_applied = False


def reuse_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process for reuse: large blocks come from the heap
    instead of fresh ``mmap`` regions (``M_MMAP_MAX=0``) and the heap is never trimmed back to the system
    (``M_TRIM_THRESHOLD`` at its maximum). What ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:...`` would set at
    process start, applied from inside the process.

    Why: PyTorch's CPU allocator calls ``malloc``/``free`` for every tensor, and glibc serves blocks above
    its mmap threshold (at most 32 MiB) with new mappings that are unmapped on ``free``. A training step
    that allocates the same 100 MiB gradient or logits tensor every micro-batch then pays one page fault
    per 4 KiB page every time, each zeroed by the kernel. Blocks larger than the heap's free space still
    come from the system (glibc falls back to ``mmap`` when the heap cannot grow).

    Process-wide and permanent (glibc has no undo); idempotent. Returns True when the settings are in
    effect, False where they do not apply (not Linux, not glibc, ``mallopt`` refused them).
    """
    global _host_memory_reuse_applied
    if _host_memory_reuse_applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        # glibc only (musl's mallopt is a no-op stub and has no gnu_get_libc_version).
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        return False
    _host_memory_reuse_applied = True
    return True


def apply_host_memory_settings(trainer: Any) -> None:
    """Apply ``args.reuse_host_memory`` (see :func:`reuse_freed_host_memory`) when ``trainer`` trains on
    CPU. Called at the start of ``train()``."""
    if getattr(trainer.args, "reuse_host_memory", False) and trainer.args.device.type == "cpu":
        reuse_freed_host_memory()
