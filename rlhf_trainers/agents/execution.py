"""Running tool calls: synchronous tools in the calling thread or, with a timeout, on a daemon thread;
``async`` tools on one background event loop. Used by :meth:`~rlhf_trainers.agents.Toolbox.execute`.

Why threads and not processes for the timeout: a tool is often a bound method of an environment whose
state the next call must see (``environment_factory``), or a closure over objects that cannot be
pickled; a child process would run it on a copy (its state changes lost) or not at all, and forking a
process that holds torch's thread pools and CUDA contexts is unsafe. A thread shares the state, costs
microseconds, and can be given up on: a call that overruns is recorded as an error and its daemon thread
is left to finish in the background (Python cannot kill a thread; a daemon thread does not keep the
interpreter alive at exit). ``async`` tools are cancelled at the timeout instead; an ``async`` tool that
blocks its event loop (a ``time.sleep`` inside ``async def``) is given up on the same way, and the loop
is replaced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..background_loop import BackgroundLoop
from .tools import ToolResult, error_content, exception_message, timed, tool_content

__all__ = ["run_async_calls", "run_sync_call"]

# How long past the timeout the caller waits for an ``async`` call's cancellation before giving up on
# the event loop (a coroutine that blocks the loop cannot be cancelled).
_ASYNC_GRACE_SECONDS = 1.0


def _failed(name: str, message: str, start: float, timed_out: bool = False) -> ToolResult:
    return ToolResult(name, error_content(message), error=message, seconds=timed(start), timed_out=timed_out)


def _returned(name: str, value: Any, start: float) -> ToolResult:
    try:
        content = tool_content(value)
    except Exception as error:  # a return value whose __str__ raises
        return _failed(name, f"Tool {name} returned a value that cannot be shown as text: {error}", start)
    return ToolResult(name, content, seconds=timed(start))


def _timed_out(name: str, timeout: float, start: float) -> ToolResult:
    return _failed(name, f"Tool {name} timed out after {timeout:g} s.", start, timed_out=True)


def run_sync_call(
    name: str, func: Callable[..., Any], arguments: dict[str, Any], timeout: float | None
) -> tuple[ToolResult, int]:
    """Call ``func(**arguments)``; return its result and 1 if the call overran ``timeout`` and was left
    running on its daemon thread (else 0). An exception becomes an error result."""
    start = time.perf_counter()
    if timeout is None:
        try:
            value = func(**arguments)
        except Exception as error:
            return _failed(name, exception_message(error), start), 0
        return _returned(name, value, start), 0

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = func(**arguments)
        except BaseException as error:  # reported to the caller; nothing else sees this thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name=f"rlhf-trainers-tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return _timed_out(name, timeout, start), 1
    if "error" in outcome:
        return _failed(name, exception_message(outcome["error"]), start), 0
    if "value" not in outcome:
        return _failed(name, f"Tool {name} ended without returning a value.", start), 0
    return _returned(name, outcome["value"], start), 0


#: The event loop (a daemon thread) of the async tools; replaced when a tool blocks it past its timeout.
_LOOP = BackgroundLoop("rlhf-trainers-async-tools")


async def _run_one(
    name: str, func: Callable[..., Any], arguments: dict[str, Any], timeout: float | None
) -> ToolResult:
    start = time.perf_counter()
    try:
        if timeout is None:
            value = await func(**arguments)
        else:
            value = await asyncio.wait_for(func(**arguments), timeout)
    except asyncio.TimeoutError:
        return _timed_out(name, timeout or 0.0, start)
    except Exception as error:
        return _failed(name, exception_message(error), start)
    return _returned(name, value, start)


def run_async_calls(
    calls: Sequence[tuple[str, Callable[..., Any], dict[str, Any]]], timeout: float | None
) -> list[ToolResult]:
    """Run ``async`` tool calls ``(name, func, arguments)`` concurrently on the tools' event loop and
    return their results in order. Each is cancelled at ``timeout``; one that cannot be (it blocks the
    loop) is recorded as timed out once the grace period has passed too, and the loop is replaced."""
    loop = _LOOP.get()
    start = time.perf_counter()
    futures = [
        asyncio.run_coroutine_threadsafe(_run_one(name, func, arguments, timeout), loop)
        for name, func, arguments in calls
    ]
    deadline = None if timeout is None else start + timeout + _ASYNC_GRACE_SECONDS
    results = []
    blocked = False
    for (name, _, _), future in zip(calls, futures, strict=True):
        wait = None if deadline is None else max(0.0, deadline - time.perf_counter())
        try:
            results.append(future.result(wait))
        except concurrent.futures.TimeoutError:
            future.cancel()
            blocked = True
            results.append(_timed_out(name, timeout or 0.0, start))
    if blocked:
        _LOOP.discard(loop)
    return results
