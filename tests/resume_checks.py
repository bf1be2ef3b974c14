"""Resume a trainer from the checkpoints of an uninterrupted run and compare the two, log entry by log entry.

Not a test module: tests/test_rloo.py and tests/test_grpo.py use it for the resumes at an epoch boundary of
the prompt dataset (issue #25; a known failure elsewhere: the resumed run trained zero steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

#: Logged values that measure time, not training, and Trainer's end-of-run summary: its train_loss is the
#: mean over the steps of one train() call, so it is not comparable across a resume.
TIME_KEYS = (
    "timing/",
    "perf/",
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "train_loss",
)


class CountSteps(TrainerCallback):
    """The Trainer steps this ``train()`` call ran (``on_step_end`` calls; one per on-policy update), and
    the epoch events it heard: ``("begin" | "end", global_step)``."""

    def __init__(self) -> None:
        self.steps = 0
        self.epochs: list[tuple[str, int]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epochs.append(("begin", state.global_step))

    def on_epoch_end(self, args, state, control, **kwargs):
        self.epochs.append(("end", state.global_step))


def logged_steps(trainer: Any) -> dict[int, dict[str, float]]:
    """Per logged step, the numeric values of the training log (not time measurements), merged."""
    merged: dict[int, dict[str, float]] = {}
    for entry in trainer.state.log_history:
        values = {
            k: v
            for k, v in entry.items()
            if isinstance(v, (int, float)) and k != "step" and not k.startswith(TIME_KEYS)
        }
        merged.setdefault(entry["step"], {}).update(values)
    return merged


def resume_from_each(
    build: Callable[..., Any], root: Path, checkpoints: Sequence[int]
) -> tuple[Any, dict[int, tuple[Any, CountSteps]]]:
    """Train ``build(root / "full")`` uninterrupted (it must save ``checkpoint-<step>`` for every step of
    ``checkpoints`` on its way), then, for each of them, a fresh ``build(root / "from-<step>", callbacks=...)``
    resumed from that checkpoint (in its own output folder). Returns the uninterrupted trainer and, per
    step, the resumed trainer and its :class:`CountSteps`."""
    full = build(root / "full")
    full.train()
    resumed = {}
    for step in checkpoints:
        checkpoint = root / "full" / "out" / f"checkpoint-{step}"
        assert checkpoint.is_dir(), sorted(p.name for p in checkpoint.parent.iterdir())
        counter = CountSteps()
        trainer = build(root / f"from-{step}", callbacks=[counter])
        trainer.train(resume_from_checkpoint=str(checkpoint))
        resumed[step] = (trainer, counter)
    return full, resumed


def assert_resumed_like_uninterrupted(full: Any, resumed: Any, checkpoint_step: int) -> None:
    """``resumed`` (resumed at ``checkpoint_step``) reached the same final step and epoch, logged at the
    same steps after ``checkpoint_step`` the same values (fp32 tolerance; every numeric key, and at least
    one score and one loss) and ends with the same policy weights, bitwise."""
    assert resumed.state.global_step == full.state.global_step
    assert resumed.state.epoch == pytest.approx(full.state.epoch)
    a, b = logged_steps(full), logged_steps(resumed)
    after = sorted(s for s in a if s > checkpoint_step)
    assert after and after == sorted(s for s in b if s > checkpoint_step), (sorted(a), sorted(b))
    for step in after:
        assert sorted(a[step]) == sorted(b[step]), step
        assert any(k.startswith("objective/scores") for k in a[step]) and any(
            k.startswith("loss/") for k in a[step]
        )
        for key, value in a[step].items():
            assert b[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key, value, b[step][key])
    assert torch.equal(_digest(full.policy), _digest(resumed.policy))


def _digest(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])
