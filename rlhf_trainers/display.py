"""What a training run prints: one progress bar with a few key figures, and a summary at the end.

:class:`TrainingDisplay` is a ``transformers.TrainerCallback`` that takes the place of transformers'
``ProgressCallback`` (a bar that writes every logged dict under it) for the on-policy trainers
(:func:`install_display`) and of the demo's stages. It only *shows* the logs: the full metrics still go to
``trainer.state.log_history``, ``report_to`` and every other callback's ``on_log``, unchanged. Only the
world's main process prints.

With ``disable_tqdm=True`` nothing is installed: transformers' ``PrinterCallback`` prints every log as a
dict, as it does for any ``Trainer``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

__all__ = ["TrainingDisplay", "format_value", "install_display", "use_display"]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def format_value(value: Any) -> str:
    """A logged value as the display shows it: 3 significant digits for a float (0 for a magnitude below
    1e-6, float32 round-off such as the first update's KL), as it is otherwise."""
    if isinstance(value, float):
        return "0" if abs(value) < 1e-6 else f"{value:.3g}"
    return str(value)


class TrainingDisplay(TrainerCallback):
    """One tqdm bar per ``train()`` with the latest values of a few logged metrics in its postfix, one line
    per evaluation during training, and (``summary=True``) a summary when ``train()`` ends: time, steps,
    each figure's first and last logged value, the evaluation's, and what is in ``output_dir``.

    Args:
        desc: the bar's label (e.g. ``"PPO"``).
        metrics: the figures shown, as ``{logged name: short label}`` (or such pairs), in order; a name missing from a log
            is left out (e.g. ``objective/kl`` without a reference model). The evaluation's are the same
            names with the ``eval_`` prefix.
        steps_per_update: Trainer steps (optimizer steps) per update, to count updates in the summary.
        summary: print the summary at the end of ``train()``.
    """

    def __init__(
        self,
        desc: str,
        metrics: Mapping[str, str] | Iterable[tuple[str, str]],
        *,
        steps_per_update: int = 1,
        summary: bool = True,
    ) -> None:
        if steps_per_update < 1:
            raise ValueError(f"steps_per_update must be >= 1, got {steps_per_update}.")
        self.desc = desc
        self.metrics = dict(metrics)
        self.steps_per_update = steps_per_update
        self.summary = summary
        self.bar: Any = None
        self._reset()

    def _reset(self) -> None:
        self.first: dict[str, tuple[int, float]] = {}  # name -> (step, value) of the first log
        self.last: dict[str, tuple[int, float]] = {}
        self.evals: list[tuple[int, dict[str, float]]] = []
        self.runtime: float | None = None
        self.start_step = 0
        self.tables = 0
        self.last_table: str | None = None

    # ---- what the trainer calls -------------------------------------------------------------------

    def show_samples(self, text: str) -> None:
        """A table of sample completions (already formatted): the first of a run is printed when it
        comes, the latest in the summary; outside ``train()`` each one is printed."""
        self.tables += 1
        if self.bar is None or self.tables == 1:
            self._write(text)
        else:
            self.last_table = text

    # ---- the callback -----------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._reset()
        if not state.is_world_process_zero:
            return
        from tqdm.auto import tqdm

        self.start_step = state.global_step
        self.bar = tqdm(
            total=state.max_steps,
            initial=state.global_step,
            desc=self.desc,
            unit="step",
            dynamic_ncols=True,
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.bar is None:
            return
        if control.should_log:
            # a log follows, whose figures redraw the bar: one line per update where the output is a file
            self.bar.n = state.global_step
        else:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero or not logs or self.bar is None:
            return  # (outside train(): the caller has the returned metrics; nothing is printed)
        step = state.global_step
        if "train_runtime" in logs:
            self.runtime = float(logs["train_runtime"])
            return
        if any(key.startswith("eval_") for key in logs):
            shown = {
                label: logs[f"eval_{name}"] for name, label in self.metrics.items() if f"eval_{name}" in logs
            }
            self.evals.append((step, shown))
            figures = ", ".join(f"{label} {format_value(v)}" for label, v in shown.items())
            self._write(f"eval at step {step}: {figures or 'done'}")
            return
        for name in self.metrics:
            value = logs.get(name)
            if isinstance(value, int | float):
                self.first.setdefault(name, (step, float(value)))
                self.last[name] = (step, float(value))
        shown_now = {label: format_value(logs[name]) for name, label in self.metrics.items() if name in logs}
        if shown_now:
            self.bar.set_postfix(shown_now, refresh=True)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.bar is None:
            return
        self.bar.close()
        self.bar = None
        if self.summary:
            print(self.summary_text(args, state), flush=True)

    # ---- the summary ------------------------------------------------------------------------------

    def summary_text(self, args: TrainingArguments, state: TrainerState) -> str:
        """The end-of-run summary: a headline (steps, updates, time), one line per figure (first -> last
        logged), the evaluations during training, ``output_dir`` and the latest sample table."""
        steps = state.global_step - self.start_step
        headline = f"{self.desc} finished: {steps} step(s)"
        if self.steps_per_update > 1:
            headline += f" = {steps // self.steps_per_update} update(s)"
        if self.runtime is not None:
            headline += f" in {_duration(self.runtime)}"
        if state.max_steps and state.global_step < state.max_steps:
            headline += f" (stopped at step {state.global_step} of {state.max_steps})"
        lines = [headline]
        width = max((len(label) for label in self.metrics.values()), default=0)
        for name, label in self.metrics.items():
            if name not in self.first:
                continue
            lines.append(f"  {label:<{width}}  {_change(self.first[name], self.last[name])}")
        if self.evals:
            (s0, e0), (s1, e1) = self.evals[0], self.evals[-1]
            for label, value in e1.items():
                first = (s0, e0[label]) if label in e0 else (s1, value)
                lines.append(f"  eval {label}: {_change(first, (s1, value))}")
        lines.append(f"  saved in {os.path.abspath(args.output_dir)}: {_saved(args)}")
        if self.last_table is not None:
            lines.append(self.last_table)
        return "\n".join(lines)

    def _write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)


def _change(first: tuple[int, float], last: tuple[int, float]) -> str:
    """``value (step s) -> value (step s)``, or one of them when both are the same log."""
    (s0, v0), (s1, v1) = first, last
    if s0 == s1:
        return f"{format_value(v1)} (step {s1})"
    return f"{format_value(v0)} (step {s0}) -> {format_value(v1)} (step {s1})"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def _saved(args: TrainingArguments) -> str:
    """What ``output_dir`` holds after training: its newest checkpoint and the sample file."""
    try:
        names = os.listdir(args.output_dir)
    except OSError:
        names = []
    checkpoints = sorted((int(m.group(1)), n) for n in names if (m := _CHECKPOINT.match(n)))
    parts = []
    if checkpoints:
        more = f" (and {len(checkpoints) - 1} older)" if len(checkpoints) > 1 else ""
        parts.append(f"{checkpoints[-1][1]}{more}")
    if "samples.jsonl" in names:
        parts.append("samples.jsonl")
    if not checkpoints:
        strategy = getattr(args.save_strategy, "value", args.save_strategy)
        parts.append(f"no checkpoint (save_strategy={strategy!r}): trainer.save_model() writes the model")
    return ", ".join(parts)


def install_display(
    trainer: Trainer,
    desc: str,
    metrics: Mapping[str, str] | Iterable[tuple[str, str]],
    *,
    summary: bool = True,
) -> TrainingDisplay | None:
    """Show `trainer`'s runs with a :class:`TrainingDisplay` labelled `desc` showing `metrics` (logged name
    -> label, or such pairs) in place of transformers' progress and printer callbacks (and of a display
    installed before); returns it. Updates are counted with the trainer's ``steps_per_update`` (1 where it
    has none). With ``disable_tqdm=True`` it changes nothing and returns None: transformers'
    ``PrinterCallback`` prints every log as a dict."""
    if trainer.args.disable_tqdm:
        return None
    steps_per_update = getattr(trainer, "steps_per_update", 1)
    return use_display(
        trainer, TrainingDisplay(desc, metrics, steps_per_update=steps_per_update, summary=summary)
    )


def use_display(trainer: Trainer, display: TrainingDisplay) -> TrainingDisplay:
    """Add `display` to `trainer`'s callbacks in place of whatever else prints its logs: transformers'
    ``ProgressCallback``, its ``NotebookProgressCallback`` (in Jupyter), ``PrinterCallback``, and a
    :class:`TrainingDisplay` added before. Returns `display`."""
    from transformers.trainer import DEFAULT_PROGRESS_CALLBACK
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for kind in (ProgressCallback, DEFAULT_PROGRESS_CALLBACK, PrinterCallback, TrainingDisplay):
        while any(isinstance(callback, kind) for callback in trainer.callback_handler.callbacks):
            trainer.remove_callback(kind)
    trainer.add_callback(display)
    return display
