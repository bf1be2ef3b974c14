"""Linear layers of the sampling loop on CPU: oneDNN for the decoding steps (``onednn_linear``) and frozen
weights cast once per sampling call under CPU autocast (:class:`AutocastWeightCache`, no switch).

See docs/cpu.md for what each does and what it was measured to gain.

**oneDNN linear.** PyTorch's CPU build sends every float32 ``F.linear`` to the BLAS it was built with (MKL
on x86). For the skinny products of a decoding step (one position per row against every weight of the
model) oneDNN, also inside every x86 torch wheel (``torch.ops.mkldnn``), can stream the weights faster on
some CPUs. oneDNN generates machine code for every distinct matrix shape it meets and keeps it in two
caches of 1024 entries each (oneDNN's primitive cache and ideep's in front of it). A decoding step has a
fixed number of rows (the rollout chunk), so its shapes are few and that memory bounded; the training and
scoring passes have as many row counts as micro-batch lengths, so they stay on PyTorch's default
(capping both caches would be a process-wide setting). ``benchmarks/onednn_shapes.py`` measures both the
GEMM rates and the memory growth.

:class:`OneDNNLinear` is a ``TorchFunctionMode`` that the generation backends enter around every sampling
call. Inside it, an ``F.linear`` whose input has one position per row (``(..., 1, in)``), in float32 on
CPU, without autograd and without autocast, runs as oneDNN's linear; everything else passes through
untouched. Nothing in the models changes. Both libraries compute IEEE float32 (oneDNN's default
``strict`` math mode); results differ by the rounding of another summation order (about 1e-6 relative).

**Frozen weights cast once per sampling call under CPU autocast.** Autocast keeps the half-precision copy
of a weight for the rest of its region only for leaf tensors that require a gradient; a frozen weight (the
base model under a LoRA adapter, a frozen lm head) is cast again at every call. Inside a sampling call on
CPU under autocast, :class:`AutocastWeightCache` casts each frozen float32 weight (and bias) of an
``F.linear`` to autocast's dtype once and hands the copy to every later call: autocast's results, bit for
bit. The copies live for the sampling call only; GPUs are left to autocast.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["AutocastWeightCache", "OneDNNLinear", "onednn_linear_available"]

_LINEAR = torch.nn.functional.linear


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
    no autograd) run through oneDNN (``onednn_linear``, see the module docstring); everything else runs as usual. Enter it
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
