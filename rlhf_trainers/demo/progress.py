"""Time, peak memory and a progress bar for each stage of the demo."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Trainer


# ---- time and memory of a stage ---------------------------------------------------------------------


def _reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark to the current RSS (Linux ``/proc/self/clear_refs``), so
    that the next reading is the peak of one stage. False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float:
    """The RSS high-water mark (``resource.getrusage``: KiB on Linux, bytes on macOS) in MiB; where there
    is no ``resource`` module (Windows), the current RSS from psutil, or NaN without it."""
    try:
        import resource
    except ImportError:
        try:
            import psutil
        except ImportError:
            return math.nan
        return psutil.Process().memory_info().rss / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


@dataclass
class Stage:
    name: str
    seconds: float = 0.0
    peak_rss_mib: float = 0.0
    peak_scope: str = "stage"


@contextlib.contextmanager
def timed_stage(stages: list[Stage], number: int, total: int, title: str) -> Iterator[Stage]:
    print(f"\n[{number}/{total}] {title}", flush=True)
    stage = Stage(title)
    stage.peak_scope = "stage" if _reset_peak_rss() else "process"
    start = time.perf_counter()
    yield stage
    stage.seconds = time.perf_counter() - start
    stage.peak_rss_mib = _peak_rss_mib()
    stages.append(stage)
    print(f"    done in {stage.seconds:.1f} s, peak RSS {stage.peak_rss_mib:.0f} MiB", flush=True)


# ---- progress bar -----------------------------------------------------------------------------------


def quiet(trainer: Trainer, desc: str, postfix: dict[str, str]) -> Trainer:
    """Show `trainer`'s run as one bar labelled `desc` with the latest values of the logged metrics in
    ``postfix`` (log name -> short label), and no summary (the demo has its own report): the trainers'
    :class:`~rlhf_trainers.display.TrainingDisplay` in place of the Trainer's own bar or printer, which
    would print every log dict (one per update here)."""
    from ..display import TrainingDisplay, use_display

    use_display(trainer, TrainingDisplay(desc, postfix, summary=False))
    return trainer
