"""oneDNN for the token-by-token sampling steps of the trainers' models on CPU (``onednn_linear``).

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

How: :class:`OneDNNLinear` is a ``TorchFunctionMode`` that the trainers enter around generation (the
rollout's and evaluation's). Inside it, an ``F.linear`` whose input has one position per row (``(..., 1, in)``: a decoding
step of the sampling loop, and its lm head), in float32 on CPU, without autograd and without autocast,
runs as oneDNN's linear; everything else passes through untouched. Nothing is changed in the models (no
module replaced, no weight copied), and leaving the context restores plain PyTorch. The arithmetic is IEEE
float32 in both libraries (oneDNN's default ``strict`` math mode); results differ from MKL's by the
rounding of another summation order (about 1e-6 relative).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["OneDNNLinear", "onednn_linear_available"]

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
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(5, 48, generator=generator)
        w = torch.randn(24, 48, generator=generator)
        b = torch.randn(24, generator=generator)
        got = _op(x, w, b)
        want = _LINEAR(x.double(), w.double(), b.double()).float()
        return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-4))
    except Exception:
        return False


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
