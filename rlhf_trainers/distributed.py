"""DeepSpeed ZeRO-3 helpers, written once: gathering partitioned weights (to read them, or to change them),
whole state dicts, copying a partitioned model, the context generation runs in, and the inference
engine of a frozen model.

Under ZeRO-3 (``zero3_init_flag``, or once a model is inside a DeepSpeed engine) each process holds a
flat shard of every parameter; a parameter's ``ds_id`` attribute marks it. Code that reads or writes
whole weights outside the engine's forward must gather them first, and every process must take part
(the gathers are collectives). Without DeepSpeed every helper here is a no-op around plain PyTorch.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .compat import register_zero3_hooks

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "copy_model",
    "deepspeed_inference_engine",
    "full_state_dict",
    "gathered",
    "generation_context",
    "load_full_state_dict",
    "partitioned_parameters",
]


def partitioned_parameters(*items: nn.Module | nn.Parameter) -> list[nn.Parameter]:
    """The ZeRO-3 partitioned parameters among ``items`` (modules contribute all their parameters)."""
    params: list[nn.Parameter] = []
    for item in items:
        candidates = item.parameters() if isinstance(item, nn.Module) else [item]
        params += [p for p in candidates if hasattr(p, "ds_id")]
    return params


def gathered(
    *items: nn.Module | nn.Parameter, modify: bool = False
) -> contextlib.AbstractContextManager[Any]:
    """Inside the context the partitioned parameters of ``items`` are whole on every process (a
    collective: every process must enter it). With ``modify`` the values rank 0 writes are partitioned
    back on exit; without it changes are discarded. No-op when nothing is partitioned."""
    params = partitioned_parameters(*items)
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s state dict with whole tensors (a collective under ZeRO-3)."""
    with gathered(model), torch.no_grad():
        return {name: value.detach().clone() for name, value in model.state_dict().items()}


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """``model.load_state_dict(state)`` that also fills ZeRO-3 partitioned parameters (a collective)."""
    with gathered(model, modify=True), torch.no_grad():
        return model.load_state_dict(state, strict=strict)


def copy_model(model: PreTrainedModel) -> PreTrainedModel:
    """A deep copy of ``model``. Under ZeRO-3 with ``zero3_init_flag`` a model loaded from a path is
    partitioned and ``copy.deepcopy`` would copy empty shards and DeepSpeed's bookkeeping: the copy is
    then built from the config (partitioned again under ``zero.Init``) and filled with the gathered
    weights."""
    if not partitioned_parameters(model):
        return copy.deepcopy(model)
    state = full_state_dict(model)
    dtype = next(iter(model.parameters())).dtype
    clone = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
    load_full_state_dict(clone, state)
    if getattr(model, "generation_config", None) is not None:
        clone.generation_config = copy.deepcopy(model.generation_config)
    clone.train(model.training)
    return clone


@contextlib.contextmanager
def generation_context(model: nn.Module, engine: Any, *, gather_weights: bool) -> Iterator[None]:
    """What generation needs around it under ZeRO-3 (nothing otherwise).

    ``engine`` is the DeepSpeed engine that trains ``model`` (or None / any other object before the
    engine exists). With ``gather_weights`` (``ds3_gather_for_generation``), or when no engine's hooks
    would fetch the shards, the weights are gathered whole and the engine's parameter hooks removed
    meanwhile, as DeepSpeed's own ``unwrap_model_for_generation`` does: with the hooks on, every
    generation step would still run the engine's fetch/trace bookkeeping, and ranks whose responses stop
    after different numbers of steps would then issue different collectives and deadlock at the next
    forward pass. Without gathering, the hooks fetch the shards layer by layer, and generation must keep
    the ranks in step (``generate(synced_gpus=True)``).
    """
    params = partitioned_parameters(model)
    if not params:
        yield
        return
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is not None and not gather_weights:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if offload is None:
            yield
            return
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            register_zero3_hooks(offload)


def deepspeed_inference_engine(model: nn.Module, accelerator: Any) -> Any:
    """A ZeRO-3 inference engine for a frozen model (weights partitioned across processes), built from
    the DeepSpeed config of ``accelerator`` without its optimizer, scheduler and optimizer offload."""
    import deepspeed

    plugin = accelerator.state.deepspeed_plugin
    config = copy.deepcopy(plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = dict(config.get("zero_optimization", {}))
    zero["stage"] = 3
    zero.pop("offload_optimizer", None)
    config["zero_optimization"] = zero
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        if config.get(key) == "auto" or key not in config:
            config[key] = 1
    config.pop("train_batch_size", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine
