"""Tear the default process group down before the interpreter finalizes, so a multi-process run does not
abort at exit.

The abort: a rank finished its work, then died with ``terminate called without an active exception`` and
SIGABRT (exit -6). Backtrace of the aborting thread (docs/notes-exit-abort.md): a gloo worker thread
(``pt_gloo_runloop``, in ``ProcessGroupGloo::runLoop``) drops its reference to a finished collective,
whose tensors are the last owners of Python tensor objects, so ``TensorImpl::decref_pyobject`` takes the
GIL. When the main thread has meanwhile started interpreter finalization, CPython ends a thread that asks
for the GIL with ``pthread_exit``; its forced unwind reaches a ``noexcept`` destructor and libstdc++
calls ``std::terminate``. The window is a collective that ends within a few milliseconds of the end of
the script (the worker waits for the GIL that the main thread holds until finalization starts):
DeepSpeed's parameter gathers or a final metric gather followed by little else. Nothing in
``transformers.Trainer`` or accelerate destroys the process group, so every run leaves it to
finalization. PyTorch's own guard (``Py_IsInitialized``) is still true during finalization (pytorch
issue 190489).

:func:`tear_down_process_group_at_exit` registers an ``atexit`` handler that runs while the interpreter
is still whole: it destroys the default process group (``torch.distributed.destroy_process_group``, the
cleanup PyTorch asks for before exit; it joins the group's worker threads when nothing else holds the
group) and then gives the GIL away briefly, so a worker thread still finishing its last collective (one
that DDP or DeepSpeed keeps alive beyond the destroy) drops its tensors while that is still allowed.
"""

from __future__ import annotations

import atexit
import logging
import time

import torch

__all__ = ["tear_down_process_group_at_exit"]

logger = logging.getLogger(__name__)

#: Seconds the exit handler sleeps (GIL released) after destroying the group: a worker thread blocked on
#: the GIL to drop its last collective's tensors gets it at once; the rest covers its being descheduled.
EXIT_GRACE_SECONDS = 0.05

_registered = False


def tear_down_process_group_at_exit() -> None:
    """Register (once per process) the ``atexit`` handler that destroys the default process group before
    interpreter finalization. A no-op unless ``torch.distributed`` is initialized with several
    processes; the trainers call it after setting up their accelerator. The handler does nothing when
    the group is already gone (a script that called ``destroy_process_group`` or
    ``Accelerator.end_training`` itself)."""
    global _registered
    if _registered or not _several_processes():
        return
    atexit.register(_tear_down_process_group)
    _registered = True


def _several_processes() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def _tear_down_process_group() -> None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    try:
        torch.distributed.destroy_process_group()
    except Exception as error:  # the process is exiting: a failed teardown must not mask its exit status
        logger.warning("destroying the process group at exit failed: %r", error)
    time.sleep(EXIT_GRACE_SECONDS)
