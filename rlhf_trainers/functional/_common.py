"""Private helpers shared by the modules of :mod:`rlhf_trainers.functional`: accumulation dtypes,
validity masks and argument checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

#: A function that sums a tensor over data-parallel processes, e.g. ``lambda t: accelerator.reduce(t, "sum")``.
_AllReduce = Callable[[Tensor], Tensor]
#: The ``dim`` argument of a reduction: None = all dims.
_Dim = int | tuple[int, ...] | None


def _work_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32: bf16/fp16 sums of a few thousand tokens lose
    whole digits, so every reduction is done in at least float32."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _out_dtype(values: Tensor) -> torch.dtype:
    return values.dtype if values.is_floating_point() else torch.float32


def _valid(mask: Tensor | None, values: Tensor) -> Tensor:
    """Boolean validity mask broadcast to ``values.shape`` (nonzero = valid)."""
    if mask is None:
        return torch.ones_like(values, dtype=torch.bool)
    valid = mask if mask.dtype == torch.bool else mask != 0
    try:
        return torch.broadcast_to(valid.to(values.device), values.shape)
    except RuntimeError as err:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} cannot be broadcast to values of shape "
            f"{tuple(values.shape)}; pass a mask with the same shape as the values (e.g. (B, T))."
        ) from err


def _zero_invalid(values: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    # torch.where, not values * mask: padding may hold inf/NaN (e.g. a reward model's output on pad
    # tokens) and inf * 0 = NaN would poison the whole reduction.
    return torch.where(valid, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))


def _check_dim_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value
