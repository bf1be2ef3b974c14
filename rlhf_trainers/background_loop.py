"""An asyncio event loop on a daemon thread, for the async functions users give the trainers (reward
functions, tools): one loop per use, so a client bound to a loop (e.g. an HTTP session created at the first
call) keeps working across calls, and calls work where the calling thread already runs a loop (Jupyter)."""

from __future__ import annotations

import asyncio
import os
import threading

__all__ = ["BackgroundLoop"]


class BackgroundLoop:
    """A lazily started event loop on a daemon thread named `name`; re-created after a fork, after
    :meth:`discard`, or when closed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = -1

    def get(self) -> asyncio.AbstractEventLoop:
        """The running loop (started on first use)."""
        with self._lock:
            if self._loop is None or self._pid != os.getpid() or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=self.name, daemon=True).start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    def discard(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop using ``loop`` (e.g. blocked by a call past its timeout): the next :meth:`get` starts a new
        one, and ``loop`` stops once the blocking call returns control to it."""
        with self._lock:
            if self._loop is loop:
                self._loop = None
        loop.call_soon_threadsafe(loop.stop)
