"""The policy's weights as an inference engine loads them: checkpoint names, adapters merged.

:func:`inference_weights` walks the policy module by module and yields ``(name, tensor)`` pairs under the
names ``save_pretrained`` writes (what vLLM's loaders read). A LoRA layer (PEFT, or an adapter loaded into a
transformers model) yields its base weight with the active adapters' delta added, computed for that one
layer at a time, so no second full copy of the model ever exists; under ZeRO-3 each module's parameters
are gathered only while that module is read. Tied weights (e.g. an lm head tied to the input embedding)
appear once, under the first name, as in a checkpoint.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch import nn

from ..distributed import gathered

__all__ = ["AdapterNotMergeableError", "inference_weights", "merged_adapter_weights", "untied_by_adapters"]


def _lora_layer_types() -> tuple[type, ...]:
    if "peft" not in sys.modules:  # never imported: no LoRA layer can exist
        return ()
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - a broken install
        return ()
    return (LoraLayer,)


def _modules_to_save_types() -> tuple[type, ...]:
    if "peft" not in sys.modules:
        return ()
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # pragma: no cover
        return ()
    return (ModulesToSaveWrapper,)


def _checkpoint_root(model: nn.Module) -> nn.Module:
    """The transformers model whose parameter names are the checkpoint's (the base of a PEFT model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class AdapterNotMergeableError(ValueError):
    """A LoRA adapter whose effect cannot be written into the layer's weights (e.g. PEFT's aLoRA, whose
    adapter acts only after its invocation tokens, or an Arrow router)."""


@torch.no_grad()
def merged_adapter_weights(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias that ``layer`` (a PEFT LoRA layer) computes with: its base layer's weight with
    every active, unmerged adapter merged in, as PEFT's ``merge(safe_merge=True)`` would write it, into new
    tensors (the layer and its base weight are left as they are).

    Covers vanilla LoRA (rsLoRA's scaling included: it is in the layer's ``scaling``), LoRA on an
    embedding (``lora_embedding_A``/``B``), LoRA variants that PEFT can merge (DoRA: the magnitude
    rescaling; PEFT's ``lora_variant`` registry) and ``lora_bias`` (the bias is then returned merged; else
    a copy of the base bias, or None). Raises :class:`AdapterNotMergeableError` for an adapter PEFT cannot
    merge (aLoRA, Arrow routers, ...), with PEFT's reason.
    """
    base = layer.get_base_layer()
    weight = base.weight.detach().clone()
    bias = getattr(base, "bias", None)
    bias = bias.detach().clone() if isinstance(bias, torch.Tensor) else None
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return weight, bias  # adapters off, or already merged into the base weights
    variants = getattr(layer, "lora_variant", {})
    adapters = [
        adapter
        for adapter in layer.active_adapters
        if adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {})
    ]
    if len(adapters) > 1 and any(adapter in variants for adapter in adapters):
        # PEFT merges a variant (DoRA) from the base layer's weight as its in-place merges left it, which a
        # merge into copies cannot replay.
        raise AdapterNotMergeableError(
            f"the active adapters {adapters} include a LoRA variant "
            f"({', '.join(sorted({type(variants[a]).__name__ for a in adapters if a in variants}))}) among "
            "several on one layer, which cannot be merged into a copy of the weights; activate one of them"
        )
    for adapter in adapters:
        variant = variants.get(adapter)
        if variant is not None:
            try:
                weight = variant.merge_safe(layer, adapter, weight)
            except (NotImplementedError, RuntimeError) as err:
                raise AdapterNotMergeableError(
                    f"the LoRA adapter {adapter!r} ({type(variant).__name__}) cannot be merged into the weights of "
                    f"its {type(base).__name__} layer: {str(err).rstrip('.')}"
                ) from err
        elif getattr(layer, "use_dora", {}).get(adapter, False):  # a PEFT without the variant registry
            raise AdapterNotMergeableError(
                f"the DoRA adapter {adapter!r} cannot be merged with this PEFT version ({_peft_version()}); "
                "install peft>=0.15"
            )
        else:
            weight += layer.get_delta_weight(adapter).to(weight.dtype)
        if getattr(layer, "lora_bias", {}).get(adapter, False):
            lora_b_bias = layer.lora_B[adapter].bias.detach() * layer.scaling[adapter]
            bias = (lora_b_bias if bias is None else bias + lora_b_bias).to(weight.dtype)
    return weight, bias


def _peft_version() -> str:
    peft = sys.modules.get("peft")
    return getattr(peft, "__version__", "unknown")


@torch.no_grad()
def inference_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the checkpoint-named weights of ``model`` (a transformers model, or a PEFT model around one),
    LoRA adapters merged in, one module at a time (ZeRO-3: gathered per module, a collective).

    The tensors are detached; those of merged and gathered modules are new tensors, the others share
    storage with the model (read them before the next optimizer step).
    """
    root = _checkpoint_root(model)
    lora_types = _lora_layer_types()
    wrapper_types = _modules_to_save_types()
    seen: set[int] = set()
    skip_prefixes: list[str] = []

    def emit(name: str, tensor: torch.Tensor, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if id(param) in seen:
            return
        seen.add(id(param))
        yield name, tensor

    for module_name, module in root.named_modules():
        if any(module_name.startswith(prefix) for prefix in skip_prefixes):
            continue
        prefix = f"{module_name}." if module_name else ""
        if lora_types and isinstance(module, lora_types):
            skip_prefixes.append(prefix)
            base = module.get_base_layer()
            with gathered(module):
                try:
                    weight, bias = merged_adapter_weights(module)
                except AdapterNotMergeableError as err:
                    raise AdapterNotMergeableError(
                        f"{module_name}: {err}. An inference engine holds merged weights; train with an adapter "
                        "PEFT can merge (LoRA, DoRA), or sample without the engine."
                    ) from err
                # Always emitted: the merged weight is the module's own even where the base weight is
                # tied to another (an adapter on a tied embedding or lm head unties them; see
                # untied_by_adapters).
                yield f"{prefix}weight", weight
                base_bias = getattr(base, "bias", None)
                if bias is not None and isinstance(base_bias, torch.Tensor):
                    yield from emit(f"{prefix}bias", bias, base_bias)
                elif bias is not None:  # lora_bias on a layer without a bias of its own
                    yield f"{prefix}bias", bias
            continue
        if wrapper_types and isinstance(module, wrapper_types):
            # PEFT's modules_to_save: the trained copy replaces the original under the original's names.
            skip_prefixes.append(prefix)
            names = [a for a in module.active_adapters if a in module.modules_to_save]
            use_copy = names and not module.disable_adapters
            source = module.modules_to_save[names[0]] if use_copy else module.original_module
            with gathered(source):
                for name, param in source.named_parameters():
                    yield from emit(f"{prefix}{name}", param.detach().clone(), param)
            continue
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        partitioned = any(hasattr(p, "ds_id") for _, p in params)
        with gathered(*[p for _, p in params]):
            for name, param in params:
                tensor = param.detach()
                yield from emit(f"{prefix}{name}", tensor.clone() if partitioned else tensor, param)


def untied_by_adapters(model: nn.Module) -> bool:
    """Whether ``model`` ties its output embedding to its input embedding (``tie_word_embeddings``) but
    carries a LoRA adapter on either of them, so that the model computes with two different matrices (the
    adapted one merged, the other the shared base weight) and an inference engine must hold them as two
    weights."""
    root = _checkpoint_root(model)
    if not getattr(getattr(root, "config", None), "tie_word_embeddings", False):
        return False
    lora_types = _lora_layer_types()
    if not lora_types:
        return False
    head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    embedding = root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
    return isinstance(head, lora_types) or isinstance(embedding, lora_types)
