"""oneDNN for the float32 linear layers of the trainers' models on CPU (``onednn_linear``).

Why: PyTorch's CPU build sends every float32 ``F.linear`` to the BLAS it was built with (MKL on x86), and
on the AMD EPYC machines this project is measured on MKL's single-precision GEMM reaches 60-80 % of
what oneDNN (also inside every x86 torch wheel, as ``torch.ops.mkldnn``) gets from the same cores. The gap
is largest where RLHF spends its time on CPU: the skinny matmuls of token-by-token sampling (8 rows
against a 49152 x 576 lm head: 37 ms with MKL, 8 ms with oneDNN) and the training passes of a
micro-batch (~200 rows: 150-190 vs 180-210 GFLOP/s).

How: :class:`OneDNNLinear` is a ``TorchFunctionMode`` that the trainers enter around an update (the
rollout's sampling and no-grad passes, the training forward and backward passes) and evaluation. Inside
it, every ``F.linear`` on float32 CPU tensors, without autocast, runs as oneDNN's linear, with a backward
pass of the same matmuls (``d input = g @ W`` through oneDNN, ``d W = g.T @ input`` and ``d bias``
through torch); anything else passes through untouched. Nothing is changed in the models: no module is
replaced, no weight is copied or re-laid-out, so the memory is the same, and leaving the context
restores plain PyTorch. The arithmetic is IEEE float32 in both libraries (oneDNN's default ``strict``
math mode: no bf16 or tf32 down-conversion); the results differ from MKL's by the rounding of a
different summation order (about 1e-6 relative), as two BLAS builds do.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["OneDNNLinear", "active_onednn_linear", "onednn_linear_available"]

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


class _OneDNNLinearFunction(torch.autograd.Function):
    """``F.linear`` through oneDNN, with the backward pass of a linear layer."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(flat, weight)
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        out = _op(flat, weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        flat, weight = ctx.saved_tensors
        g = grad.reshape(-1, weight.shape[0]).contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad
        # d input = g @ W: oneDNN's linear with the transposed weight (a view; no copy).
        grad_x = _op(g, weight.t(), None).reshape(ctx.x_shape) if need_x else None
        grad_w = g.t().mm(flat) if need_w else None
        grad_b = g.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b


def _eligible(x: Any, weight: Any, bias: Any) -> bool:
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor):
        return False
    # Plain tensors and parameters only: subclasses (DTensor, FakeTensor, ...) keep their own dispatch.
    if type(x) is not Tensor or type(weight) not in (Tensor, torch.nn.Parameter):
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    if x.dim() < 2 or x.shape[-1] != weight.shape[1] or x.numel() == 0 or weight.numel() == 0:
        return False
    if not weight.is_contiguous() or weight.layout != torch.strided or x.layout != torch.strided:
        return False
    if bias is not None and (
        type(bias) not in (Tensor, torch.nn.Parameter)
        or bias.dtype != torch.float32
        or bias.dim() != 1
        or bias.device.type != "cpu"
    ):
        return False
    # Under CPU autocast, F.linear runs in the autocast dtype: leave it to PyTorch.
    return not torch.is_autocast_enabled("cpu")


def active_onednn_linear() -> OneDNNLinear | None:
    """The innermost :class:`OneDNNLinear` in effect, or None. Functions with a backward pass of their own
    that rebuilds forward results (the fused lm head) capture it in the forward pass and re-enter it in
    the backward pass, which the autograd engine runs outside the context."""
    stack = getattr(torch.overrides, "_get_current_function_mode_stack", lambda: [])()
    return next((mode for mode in reversed(stack) if isinstance(mode, OneDNNLinear)), None)


class OneDNNLinear(TorchFunctionMode):
    """Inside this context, float32 ``F.linear`` calls on CPU tensors run through oneDNN (see the module
    docstring); everything else runs as usual. Enter it only where :func:`onednn_linear_available`."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _LINEAR:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _eligible(x, weight, bias):
                if torch.is_grad_enabled() and (
                    x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
                ):
                    return _OneDNNLinearFunction.apply(x, weight, bias)
                flat = x.reshape(-1, x.shape[-1]).contiguous()
                return _op(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)
