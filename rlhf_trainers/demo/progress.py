"""Time, peak memory and a progress bar for each stage of the demo."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


def _progress_callback(desc: str, postfix: dict[str, str]) -> Any:
    """A TrainerCallback showing one tqdm bar for a training run, with the latest values of the logged
    metrics in ``postfix`` (log name -> short label). Replaces the Trainer's own bar, which would print
    every log dict (one per update here) under it."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class _Progress(TrainerCallback):
        bar: Any = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=state.max_steps, desc=desc, unit="step", dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs:
                shown = {label: f"{logs[key]:.3g}" for key, label in postfix.items() if key in logs}
                if shown:
                    self.bar.set_postfix(shown, refresh=False)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return _Progress()


def quiet(trainer: Trainer, desc: str, postfix: dict[str, str]) -> Trainer:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_progress_callback(desc, postfix))
    return trainer
