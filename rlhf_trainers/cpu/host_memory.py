"""Host memory (``reuse_host_memory``): glibc's malloc keeping freed memory in the process for reuse.

Process-wide and permanent, so off unless the user asks for it (:class:`~rlhf_trainers.CPUOptions`); applied
by :func:`apply_host_memory_settings` at the start of ``train()``. See docs/cpu.md for its measured effect.
"""

from __future__ import annotations

import ctypes
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .options import CPUOptions

__all__ = ["apply_host_memory_settings", "reuse_freed_host_memory"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_host_memory_reuse_applied = False


def reuse_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process for reuse: large blocks come from the heap
    instead of fresh ``mmap`` regions (``M_MMAP_MAX=0``) and the heap is never trimmed back to the system
    (``M_TRIM_THRESHOLD`` at its maximum). What ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:...`` would set at
    process start, applied from inside the process.

    Why: PyTorch's CPU allocator calls ``malloc``/``free`` for every tensor, and glibc serves blocks above
    its mmap threshold (at most 32 MiB) with new mappings that are unmapped on ``free``. A training step
    that allocates the same 100 MiB gradient or logits tensor every micro-batch then pays one page fault
    per 4 KiB page every time, each zeroed by the kernel. Blocks larger than the heap's free space still
    come from the system (glibc falls back to ``mmap`` when the heap cannot grow).

    Process-wide and permanent (glibc has no undo); idempotent. Returns True when the settings are in
    effect, False where they do not apply (not Linux, not glibc, ``mallopt`` refused them).
    """
    global _host_memory_reuse_applied
    if _host_memory_reuse_applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        # glibc only (musl's mallopt is a no-op stub and has no gnu_get_libc_version).
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        return False
    _host_memory_reuse_applied = True
    return True


def apply_host_memory_settings(options: CPUOptions | None, device: torch.device) -> bool:
    """Apply ``options.reuse_host_memory`` (see :func:`reuse_freed_host_memory`) when training runs on a CPU
    ``device``; called at the start of ``train()``. Returns whether the setting is in effect."""
    if options is None or not options.reuse_host_memory or device.type != "cpu":
        return False
    return reuse_freed_host_memory()
