"""CPU-only speed switches, behind one boundary.

:class:`CPUOptions` holds the switches (an argument group of their own, not fields of the algorithm
configs); the trainers take it as ``cpu_options=``. :func:`decoding_speedups` turns it, once per trainer,
into what the generation backend may sample with (a :class:`~rlhf_trainers.generation.DecodingSpeedups`),
and :func:`apply_host_memory_settings` applies ``reuse_host_memory`` when ``train()`` starts. Nothing in
:mod:`rlhf_trainers.generation` imports this package. docs/cpu.md describes every switch and its measured
effect.

Modules: :mod:`.options` (the switches), :mod:`.decoding` (the boundary), :mod:`.lean_llama` (the lean
decoding steps, MKL-prepacked and merged-adapter weights), :mod:`.linear` (oneDNN linear, the autocast
weight cache), :mod:`.host_memory` (glibc's malloc settings).
"""

from __future__ import annotations

from .decoding import PREPACKING_VENDORS, cpu_vendor, decoding_speedups, prepacking_wanted
from .host_memory import apply_host_memory_settings, reuse_freed_host_memory
from .lean_llama import (
    LeanLlamaSteps,
    PreparedWeights,
    keep_prepared_weights,
    lean_llama_steps,
    lean_llama_steps_merged,
    lean_llama_steps_prepacked,
    lean_llama_steps_prepacked_merged,
    mkl_prepacked_linear_available,
)
from .linear import AutocastWeightCache, OneDNNLinear, onednn_linear_available
from .options import CPUOptions, resolve_cpu_options

__all__ = [
    "PREPACKING_VENDORS",
    "AutocastWeightCache",
    "CPUOptions",
    "LeanLlamaSteps",
    "OneDNNLinear",
    "PreparedWeights",
    "apply_host_memory_settings",
    "cpu_vendor",
    "decoding_speedups",
    "keep_prepared_weights",
    "lean_llama_steps",
    "lean_llama_steps_merged",
    "lean_llama_steps_prepacked",
    "lean_llama_steps_prepacked_merged",
    "mkl_prepacked_linear_available",
    "onednn_linear_available",
    "prepacking_wanted",
    "resolve_cpu_options",
    "reuse_freed_host_memory",
]
