"""Choosing the generation backend, once, when a trainer is built."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import ContextFactory, GenerationBackend
from .builtin import BuiltinSampling
from .transformers_generate import TransformersGenerate

__all__ = ["GENERATION_LOOPS", "make_generation_backend"]

#: The values of ``generation_loop`` (a new backend adds its name here and a branch below).
GENERATION_LOOPS = ("builtin", "transformers")


def make_generation_backend(
    model: nn.Module,
    config: Any = None,
    *,
    device: torch.device | None = None,
    deepspeed: bool = False,
    synced_ranks: bool = False,
    context: ContextFactory | None = None,
) -> GenerationBackend:
    """The backend that samples from ``model``.

    Args:
        model: the policy (unwrapped from DDP/DeepSpeed), sampled in eval mode.
        config: an :class:`~rlhf_trainers.OnPolicyConfig`: its ``generation_loop`` picks the backend, and its
            CPU speed switches (:func:`rlhf_trainers.cpu_speedups.decoding_speedups`) what the backend may
            run with. None: the builtin loop as it is (what reward normalization samples with).
        device: where the model runs (CPU speed switches apply on CPU only); default: the model's.
        deepspeed: whether the model trains under DeepSpeed.
        synced_ranks: processes must run generation in step (multi-process ZeRO-3 without gathered
            weights): ``generate(synced_gpus=True)``, whatever ``generation_loop`` says.
        context: the context every sampling call runs in first (e.g.
            :func:`rlhf_trainers.distributed.generation_context`).

    Raises:
        ValueError: for an unknown ``generation_loop``.
    """
    loop = getattr(config, "generation_loop", "builtin")
    if loop not in GENERATION_LOOPS:
        raise ValueError(f"generation_loop={loop!r}: expected one of {GENERATION_LOOPS}.")
    if config is None:
        return BuiltinSampling(model, contexts=(context,))
    from ..cpu_speedups import decoding_speedups

    if device is None:
        device = next(model.parameters()).device
    speedups = decoding_speedups(model, config, device=device, deepspeed=deepspeed)
    contexts = (context, speedups.context)
    if synced_ranks or loop == "transformers":
        backend: GenerationBackend = TransformersGenerate(model, synced_ranks=synced_ranks, contexts=contexts)
        extras = [speedups.context_name]
    else:
        backend = BuiltinSampling(model, contexts=contexts, fast_steps=speedups.fast_steps)
        extras = [speedups.fast_steps_name, speedups.context_name]
    extras = [name for name in extras if name]
    if extras:
        backend.name = f"{backend.name} ({', '.join(extras)})"
    return backend
