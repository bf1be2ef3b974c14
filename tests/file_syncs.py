"""Record the ``os.fsync`` and ``os.replace`` calls of a process, in order, and check from the record that a
checkpoint was made durable before it was renamed into place (issue #25's power-loss guarantee).

Not a test module: tests/test_reliability.py uses it in-process, and tests/distributed.py's
``train_and_report`` in each launched rank (``tests/`` is on their ``PYTHONPATH``), whose record the
distributed tests then check. Linux only: a file descriptor's path is read from ``/proc/self/fd``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: One call: ``["fsync", path]`` or ``["replace", source, destination]``, paths with symlinks resolved
#: (lists, so that a record survives a JSON round trip unchanged).
Event = list[str]


def can_record() -> bool:
    """Whether this system shows the paths of open file descriptors (``/proc/self/fd``)."""
    return os.path.isdir("/proc/self/fd")


@contextlib.contextmanager
def record_file_syncs() -> Iterator[list[Event]]:
    """Within the block, every ``os.fsync`` and ``os.replace`` of this process (any module that looks them
    up on ``os`` at call time) is appended to the yielded list, then performed as usual."""
    events: list[Event] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: Any) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        events.append(["fsync", os.readlink(f"/proc/self/fd/{number}")])
        real_fsync(fd)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        events.append(["replace", os.path.realpath(src), os.path.realpath(dst)])
        real_replace(src, dst, **kwargs)

    os.fsync, os.replace = fsync, replace
    try:
        yield events
    finally:
        os.fsync, os.replace = real_fsync, real_replace


def not_durable_before_rename(events: list[Event], checkpoint: Path) -> list[str]:
    """What the record ``events`` shows was not made durable around the rename of the complete
    ``checkpoint`` folder into place: every file and folder of it must have been fsync'ed at its staging
    path before the ``os.replace`` that moved it there, and so must the staging folder that held it; the
    folder that holds ``checkpoint`` must be fsync'ed after the rename. Empty when all of it was."""
    final = os.path.realpath(checkpoint)
    renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == final]
    if len(renames) != 1:
        return [f"{len(renames)} renames to {final} (expected 1)"]
    at = renames[0]
    staged = events[at][1]
    before = {e[1] for e in events[:at] if e[0] == "fsync"}
    after = {e[1] for e in events[at + 1 :] if e[0] == "fsync"}
    missing = []
    for folder, _dirs, files in os.walk(final):
        for name in [*files, ""]:  # "" : the folder itself
            relative = os.path.relpath(os.path.join(folder, name), final)
            if os.path.normpath(os.path.join(staged, relative)) not in before:
                missing.append(f"{relative} not fsync'ed before the rename")
    if os.path.dirname(staged) not in before:
        missing.append(f"the staging folder {os.path.dirname(staged)} not fsync'ed before the rename")
    if os.path.dirname(final) not in after:
        missing.append(f"{os.path.dirname(final)} not fsync'ed after the rename")
    return missing
