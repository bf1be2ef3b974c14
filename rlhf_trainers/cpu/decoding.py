"""The boundary between the CPU speed switches and the generation backends: :func:`decoding_speedups`
decides, once per trainer, what the sampling of one model may use (a
:class:`~rlhf_trainers.generation.DecodingSpeedups`), which the generation factory passes on without
knowing what it is. Nothing in :mod:`rlhf_trainers.generation` imports this package.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..generation.base import DecodingSpeedups
from ..generation.builtin import draw_inverse_cdf
from .lean_llama import (
    _lora_linear_class,
    _plain_llama,
    lean_llama_steps,
    lean_llama_steps_merged,
    lean_llama_steps_prepacked,
    lean_llama_steps_prepacked_merged,
    mkl_prepacked_linear_available,
)
from .linear import AutocastWeightCache, OneDNNLinear, onednn_linear_available
from .options import CPUOptions

__all__ = ["PREPACKING_VENDORS", "cpu_vendor", "decoding_speedups", "prepacking_wanted"]

#: The CPU vendors on which MKL-prepacked decoding earned its place (``benchmarks/decoding_linear.py``;
#: figures in docs/cpu.md): Intel's. Elsewhere the packed products ran no faster than MKL's own while the
#: packed copy cost memory.
PREPACKING_VENDORS = ("GenuineIntel",)


def decoding_speedups(
    model: nn.Module,
    options: CPUOptions | None = None,
    *,
    device: torch.device,
    deepspeed: bool = False,
    half_precision: bool = False,
) -> DecodingSpeedups:
    """What sampling from ``model`` on ``device`` may use under ``options`` (None: the defaults, the
    automatic choices); decided once, when the trainer is built.

    The lean steps (``lean_decoding``) are offered where ``model`` is a plain Llama now (the provider checks
    again at every call, since hooks or partitioned weights may come later), on MKL-prepacked weights
    (``mkl_prepacked_decoding``) in a float32 CPU run without DeepSpeed and without oneDNN, with merged
    LoRA adapters (``merged_adapter_decoding``) on CPU without DeepSpeed for a policy with PEFT LoRA layers;
    oneDNN (``onednn_linear``) where it pays and is safe: CPU, float32 weights, no bf16/fp16 autocast
    (``half_precision``), no DeepSpeed, a torch build with oneDNN, a largest linear layer of at least
    ``onednn_linear_min_weights`` weights; inverse-CDF draws (``inverse_cdf_sampling``) on CPU. Under CPU
    bf16/fp16 autocast without oneDNN, frozen weights are cast once per sampling call
    (:class:`~rlhf_trainers.cpu.linear.AutocastWeightCache`).
    """
    options = CPUOptions() if options is None else options
    run = _Run(model, device, deepspeed, half_precision)
    speedups: dict[str, Any] = {"drop_finished_rows": options.drop_finished_rows}
    if options.inverse_cdf_sampling and device.type == "cpu":
        speedups.update(draw=draw_inverse_cdf, draw_name="inverse-CDF draws")
    onednn = _onednn_pays(run, options)
    if options.lean_decoding and _plain_llama(model) is not None:
        prepack = not onednn and _prepacking_pays(run, options)
        merge = _merging_pays(run, options)
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
    elif run.cpu and half_precision:
        speedups.update(context=AutocastWeightCache, context_name="frozen weights cast once per call")
    return DecodingSpeedups(**speedups)


class _Run:
    """Where and how the model samples: ``cpu`` (a CPU device, no DeepSpeed), ``float32`` (that, without
    bf16/fp16 autocast, on float32 weights)."""

    def __init__(self, model: nn.Module, device: torch.device, deepspeed: bool, half_precision: bool) -> None:
        self.model = model
        self.cpu = device.type == "cpu" and not deepspeed
        self.float32 = (
            self.cpu
            and not half_precision
            and all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())
        )


def _prepacking_pays(run: _Run, options: CPUOptions) -> bool:
    """``mkl_prepacked_decoding`` on (None: on an Intel CPU, :func:`prepacking_wanted`), a float32 CPU run
    without DeepSpeed, and MKL's packed GEMM in this torch build."""
    return (
        prepacking_wanted(options.mkl_prepacked_decoding) and run.float32 and mkl_prepacked_linear_available()
    )


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


def _merging_pays(run: _Run, options: CPUOptions) -> bool:
    """``merged_adapter_decoding`` on, CPU (a merged copy of the adapted weights on a GPU would be memory
    the user did not plan for), no DeepSpeed, and a PEFT LoRA ``Linear`` layer in the model."""
    if not options.merged_adapter_decoding or not run.cpu:
        return False
    lora_linear = _lora_linear_class()
    return lora_linear is not None and any(type(m) is lora_linear for m in run.model.modules())


def _onednn_pays(run: _Run, options: CPUOptions) -> bool:
    if not options.onednn_linear or not run.float32:
        return False
    largest = max((m.weight.numel() for m in run.model.modules() if isinstance(m, nn.Linear)), default=0)
    return largest >= options.onednn_linear_min_weights and onednn_linear_available()
