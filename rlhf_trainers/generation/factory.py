"""Choosing the generation backend, once, when a trainer is built."""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any

from torch import nn

from .base import ContextFactory, DecodingSpeedups, GenerationBackend
from .builtin import BuiltinSampling
from .transformers_generate import TransformersGenerate

__all__ = ["GENERATION_LOOPS", "make_generation_backend"]

#: The values of ``generation_loop`` (a new backend adds its name here and a branch below).
GENERATION_LOOPS = ("builtin", "transformers")


def make_generation_backend(
    model: nn.Module,
    config: Any = None,
    *,
    speedups: DecodingSpeedups | None = None,
    synced_ranks: bool = False,
    context: ContextFactory | None = None,
    weights_version: Callable[[], Hashable] | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    longest_sequence: int | None = None,
) -> GenerationBackend:
    """The backend that samples from ``model``.

    Args:
        model: the policy (unwrapped from DDP/DeepSpeed), sampled in eval mode.
        config: an :class:`~rlhf_trainers.OnPolicyConfig`: its ``generation_loop`` picks the backend. None:
            the builtin loop as it is (what reward normalization samples with).
        speedups: what the builtin loop or ``generate`` may run with besides the model (the trainers give
            :func:`rlhf_trainers.cpu.decoding_speedups`); default: nothing more. Not used by vLLM.
        synced_ranks: processes must run generation in step (multi-process ZeRO-3 without gathered
            weights): ``generate(synced_gpus=True)``, whatever ``generation_loop`` says.
        context: the context every sampling call runs in first (e.g.
            :func:`rlhf_trainers.distributed.generation_context`).
        weights_version: with ``config.use_vllm``: what changes when the policy's weights may have changed
            (the engine re-syncs them before the next generation); default: re-sync at every call.
        process_index: with ``config.use_vllm``: this process's rank (the engine's seed is offset by it; in
            server mode the first process syncs the servers' weights).
        num_processes: with ``vllm_mode='server'``: the training processes (the others wait for a sync).
        longest_sequence: with ``config.use_vllm``: the longest prompt + response the engine must hold
            (checked against its context length before it is built).

    Raises:
        ValueError: for an unknown ``generation_loop``.
    """
    loop = getattr(config, "generation_loop", "builtin")
    if loop not in GENERATION_LOOPS:
        raise ValueError(f"generation_loop={loop!r}: expected one of {GENERATION_LOOPS}.")
    if config is None:
        return BuiltinSampling(model, contexts=(context,))
    if getattr(config, "use_vllm", False) and getattr(config, "vllm_mode", "colocate") == "server":
        return _vllm_server_backend(
            model, config, weights_version, process_index, num_processes, longest_sequence
        )
    if getattr(config, "use_vllm", False):
        return _vllm_backend(model, config, weights_version, process_index, longest_sequence)
    if speedups is None:
        speedups = DecodingSpeedups()
    contexts = (context, speedups.context)
    if synced_ranks or loop == "transformers":
        backend: GenerationBackend = TransformersGenerate(model, synced_ranks=synced_ranks, contexts=contexts)
        extras = [speedups.context_name]
    else:
        draw = {} if speedups.draw is None else {"draw": speedups.draw}
        backend = BuiltinSampling(
            model,
            contexts=contexts,
            fast_steps=speedups.fast_steps,
            drop_finished_rows=speedups.drop_finished_rows,
            **draw,
        )
        extras = [speedups.fast_steps_name, speedups.context_name, speedups.draw_name]
    extras = [name for name in extras if name]
    plain = "builtin generation" if isinstance(backend, BuiltinSampling) else backend.name
    backend.summary = f"{plain}, {CPU_SPEEDUPS_ON}" if extras else plain
    if extras:
        backend.name = f"{backend.name} ({', '.join(extras)})"
    return backend


#: What the batch accounting says where the generation backend runs with any of the CPU speed-ups (the
#: backend's ``name`` lists them: "builtin (lean Llama steps on MKL-prepacked weights, inverse-CDF draws)").
CPU_SPEEDUPS_ON = "CPU speed-ups on (docs/cpu.md)"


def backend_summary(backend: GenerationBackend) -> str:
    """The generation backend in plain words, as the batch accounting prints it: "builtin generation",
    "transformers.generate", "vllm 0.32.0 (colocated, float32)"..., with ", CPU speed-ups on
    (docs/cpu.md)" where any is on. A backend made elsewhere (a user's own) says its ``name``."""
    return getattr(backend, "summary", None) or backend.name


def _vllm_server_backend(
    model: nn.Module,
    config: Any,
    weights_version: Callable[[], Hashable] | None,
    process_index: int,
    num_processes: int,
    longest_sequence: int | None,
) -> GenerationBackend:
    """The client of the vLLM servers that ``config``'s ``vllm_server_*`` settings name."""
    from .vllm_server import VLLMServer, server_urls

    urls = server_urls(config.vllm_server_base_url, config.vllm_server_host, config.vllm_server_port)
    return VLLMServer(
        model,
        urls,
        weights_version=weights_version if weights_version is not None else object,
        timeout_s=config.vllm_server_timeout,
        group_port=config.vllm_group_port,
        process_index=process_index,
        num_processes=num_processes,
        longest_sequence=longest_sequence,
        lora_sync=config.vllm_lora_sync,
        lora_dir=config.vllm_lora_dir or os.path.join(config.output_dir, "vllm-lora"),
    )


def _vllm_backend(
    model: nn.Module,
    config: Any,
    weights_version: Callable[[], Hashable] | None,
    process_index: int,
    longest_sequence: int | None,
) -> GenerationBackend:
    """The colocated vLLM engine for ``config``'s ``vllm_*`` settings (imported only here)."""
    from ..models import context_length
    from .vllm_colocated import VLLMColocated

    limit = context_length(model)
    max_model_len = config.vllm_max_model_length
    if max_model_len is None:
        # The prompts fit max_prompt_length, and prompt + response fit the policy's positions (checked
        # when the trainer is built): the smaller of the two bounds.
        wanted = (
            None if config.max_prompt_length is None else config.max_prompt_length + config.response_length
        )
        candidates = [n for n in (wanted, limit) if n is not None]
        if not candidates:
            raise ValueError(
                "use_vllm=True: the engine's context length cannot be derived (max_prompt_length=None and the "
                "model's config gives no max_position_embeddings); set vllm_max_model_length."
            )
        max_model_len = min(candidates)
    elif limit is not None and max_model_len > limit:
        raise ValueError(
            f"vllm_max_model_length={max_model_len} exceeds the model's {limit} positions "
            "(config.max_position_embeddings); set at most that."
        )
    if longest_sequence is not None and longest_sequence > max_model_len:
        raise ValueError(
            f"use_vllm=True: the longest prompt + response_length = {longest_sequence} tokens exceeds the vLLM "
            f"engine's context of {max_model_len} tokens (vllm_max_model_length); raise vllm_max_model_length "
            f"to at least {longest_sequence} (at most the model's positions) or lower max_prompt_length."
        )
    version = weights_version if weights_version is not None else object
    return VLLMColocated(
        model,
        weights_version=version,
        dtype=config.vllm_dtype,
        max_model_len=max_model_len,
        seed=config.seed + process_index,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        kv_cache_space_gib=config.vllm_kv_cache_space_gib,
        enable_sleep_mode=config.vllm_enable_sleep_mode,
    )
