"""Never lose a user's progress: atomic checkpoints, a clean stop on SIGTERM/SIGINT, and a guard that
skips optimizer steps with NaN or inf gradients.

:class:`ReliabilityArguments` holds the fields every config of this package shares
(``save_on_interrupt``, ``max_nonfinite_steps``, ...), :class:`AtomicCheckpointMixin` the checkpoint
writing, and :func:`reliability_callback` the signal handling and the guard for the duration of
``train()``. The DeepSpeed offload check (:func:`check_zero_offload_optimizer`) refuses at config
construction a config that ``deepspeed.initialize`` would refuse only when ``train()`` starts.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .compat import TrainerHooksMixin, deepspeed_training_engine, zero_optimizer_skips_nonfinite_steps

logger = logging.getLogger(__name__)

#: Whether :class:`AtomicCheckpointMixin` makes each checkpoint durable (:func:`fsync_tree`) before renaming
#: it into place. Always on in the library; ``benchmarks/checkpoint_fsync.py`` turns it off to measure
#: what the fsyncs cost. Not a setting: a checkpoint without them can be lost, or half-written, on power loss.
FSYNC_CHECKPOINTS = True

#: Prefix of the folder a checkpoint is written into before it is renamed to ``checkpoint-<step>``. It does
#: not match ``transformers.trainer_utils.get_last_checkpoint``'s pattern, so a checkpoint that was being
#: written when the process died is never picked for resuming.
STAGING_PREFIX = ".incomplete-"


def check_zero_offload_optimizer(ds_config: dict[str, Any]) -> None:
    """ValueError for a DeepSpeed config that offloads the optimizer without saying which one to run.

    With ``zero_optimization.offload_optimizer.device`` ``"cpu"`` or ``"nvme"`` and no ``"optimizer"``
    section, DeepSpeed is handed the trainer's torch optimizer, and ``deepspeed.initialize`` refuses it at
    the start of ``train()`` (ZeRO-Offload wants its own CPU Adam), after the models were loaded and the
    trainer built. Checked at config construction instead, unless ``"zero_force_ds_cpu_optimizer": false``
    asks DeepSpeed to accept the torch optimizer.
    """
    zero = ds_config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or {}
    device = offload.get("device") if isinstance(offload, dict) else None
    if device not in ("cpu", "nvme") or "optimizer" in ds_config:
        return
    if ds_config.get("zero_force_ds_cpu_optimizer", True) is False:
        return
    raise ValueError(
        f"The DeepSpeed config offloads the optimizer (zero_optimization.offload_optimizer.device={device!r}) but "
        "has no 'optimizer' section: DeepSpeed would then get the trainer's torch optimizer and refuse it when "
        "train() starts (ZeRO-Offload runs its own CPU Adam). Add an optimizer section, e.g. "
        '"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", '
        '"weight_decay": "auto"}} (with tf_style_adam=False for PPO/RLOO), or set '
        '"zero_force_ds_cpu_optimizer": false to run the torch optimizer on the CPU (slower).'
    )


@dataclass
class ReliabilityArguments:
    """Fields shared by every config of this package (mixed into the ``TrainingArguments`` subclasses)."""

    save_on_interrupt: bool = field(
        default=True,
        metadata={
            "help": "On SIGTERM or SIGINT during train() (a scheduler's preemption, Ctrl-C): finish the current step, "
            "write a checkpoint and return cleanly; train(resume_from_checkpoint=True) continues from it. A "
            "second signal stops at once. When the generation backend fails mid-run, a single-process run "
            "also saves the last complete update. False: Python's default behaviour."
        },
    )
    max_nonfinite_steps: int = field(
        default=3,
        metadata={
            "help": "An optimizer step whose gradients hold NaN or inf is skipped (weights and optimizer state "
            "untouched) and counted in train/nonfinite_steps_skipped; after this many consecutive skips, the "
            "next one stops training with an error naming the likely causes. 0: stop at the first. Under "
            "DeepSpeed ZeRO the engine's own check decides; fp16 loss-scaler skips are not counted."
        },
    )

    def _check_switches(self) -> None:
        """This package's on/off fields hold True or False: from Python, a string such as "false" would
        otherwise count as on (the command line's parser turns such strings into booleans first)."""
        for cls in type(self).__mro__:
            if not cls.__module__.startswith("rlhf_trainers."):
                continue
            for name, annotation in vars(cls).get("__annotations__", {}).items():
                value = getattr(self, name, None)
                if annotation == "bool" and not isinstance(value, bool):
                    raise ValueError(f"{name}={value!r}: expected True or False.")

    def _check_reliability_fields(self) -> None:
        """The checks every config of this package runs in ``__post_init__``: on/off fields, the
        DeepSpeed optimizer offload, ``max_nonfinite_steps``."""
        self._check_switches()
        plugin = getattr(self, "deepspeed_plugin", None)  # from deepspeed= or accelerate launch's config
        ds_config = getattr(plugin, "deepspeed_config", None)
        if isinstance(ds_config, dict):
            check_zero_offload_optimizer(ds_config)
        if not isinstance(self.max_nonfinite_steps, int) or isinstance(self.max_nonfinite_steps, bool):
            raise TypeError(f"max_nonfinite_steps must be an integer >= 0, got {self.max_nonfinite_steps!r}.")
        if self.max_nonfinite_steps < 0:
            raise ValueError(
                f"max_nonfinite_steps must be >= 0 (0: stop at the first non-finite step), got "
                f"{self.max_nonfinite_steps}."
            )


#: ``errno`` values of an ``fsync`` that the filesystem does not support (some FUSE and network filesystems
#: refuse it, on folders especially): nothing to make durable there, so the save goes on. Any other error
#: (EIO, ENOSPC: bytes that did not reach the disk) is raised.
FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF})

_fsync_unsupported_warned = False


def _fsync_path(path: str) -> None:
    global _fsync_unsupported_warned
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in FSYNC_UNSUPPORTED:
            raise
        if not _fsync_unsupported_warned:
            _fsync_unsupported_warned = True
            logger.warning(
                "fsync is not supported for %s (%s); checkpoints on this filesystem are not made durable "
                "against power loss.",
                path,
                os.strerror(error.errno),
            )
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """``fsync`` the directory ``path`` itself: its entries (files created, renamed or removed in it) reach
    the disk. A no-op where directories cannot be opened (Windows), or their filesystem does not support
    ``fsync`` (:data:`FSYNC_UNSUPPORTED`, warned once)."""
    if os.name == "nt":  # pragma: no cover - no directory fsync on Windows
        return
    _fsync_path(path)


def fsync_tree(path: str) -> int:
    """Make everything written under the directory ``path`` durable: ``fsync`` every regular file in it
    (any depth; symbolic links are skipped), then every directory, deepest first and ``path`` last, so
    that the data and the names of all files are on the disk once this returns. Returns the number of
    files and directories synced. An error of ``fsync`` is raised (the bytes may not be on the disk)
    unless the filesystem does not support it (:data:`FSYNC_UNSUPPORTED`, warned once).

    ``fsync`` acts on the file, not on the process that wrote it: one process can make the files that other
    processes of the same machine wrote (e.g. other ranks' shards) durable, once they have closed them."""
    count = 0
    for folder, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            file = os.path.join(folder, name)
            if os.path.islink(file) or not os.path.isfile(file):
                continue
            _fsync_path(file)
            count += 1
        fsync_dir(folder)
        count += 1
    return count


def checkpoint_process_count(checkpoint: str) -> int | None:
    """How many processes wrote ``checkpoint``, as its RNG-state files tell (``Trainer`` writes
    ``rng_state.pth`` on one process, ``rng_state_<process index>.pth`` on several): the highest index + 1;
    None when it holds neither. (With ``save_on_each_node`` a node's checkpoint holds only its own
    processes' files: the count is then a lower bound.)"""
    try:
        names = os.listdir(checkpoint)
    except OSError:
        return None
    indices = [int(m.group(1)) for m in (re.fullmatch(r"rng_state_(\d+)\.pth", n) for n in names) if m]
    if indices:
        return max(indices) + 1
    return 1 if "rng_state.pth" in names else None


def check_resume_process_count(
    checkpoint: str,
    num_processes: int,
    *,
    saved: int | None = None,
    save_on_each_node: bool = False,
    fresh_start: str = "model=<checkpoint>",
) -> None:
    """ValueError when ``checkpoint`` was saved by a run on another number of processes than
    ``num_processes``: ``saved`` where the checkpoint records it, else :func:`checkpoint_process_count`.

    A checkpoint holds state per process that does not map onto another number of them: each process's
    random-number state, each process's share of every batch (the global batch is per-device batch x
    processes, so the remaining steps would train on other batches, from another position in the data) and,
    under DeepSpeed ZeRO, each process's partition of the optimizer state. ``fresh_start`` says how to start
    a new run from the checkpoint's weights instead (the trainer's arguments)."""
    lower_bound_only = saved is None and save_on_each_node
    if saved is None:
        saved = checkpoint_process_count(checkpoint)
    if saved is None or saved == num_processes or (lower_bound_only and saved < num_processes):
        return
    fresh_start = fresh_start.replace("<checkpoint>", repr(checkpoint))
    raise ValueError(
        f"Cannot resume from {checkpoint}: it was saved by a run on {saved} process(es), and this run has "
        f"{num_processes}. A checkpoint holds state per process that does not carry over to another number of "
        "processes: each process's random-number state, each process's share of every batch (the global batch "
        f"is per_device_train_batch_size x processes: resuming on {num_processes} would train the remaining "
        "steps on other batches, from another position in the data) and, under DeepSpeed ZeRO, each process's "
        f"partition of the optimizer state. Relaunch on {saved} process(es) (accelerate launch --num_processes "
        f"{saved} ..., or torchrun --nproc_per_node {saved} ...) to resume it; or start a new run from its "
        f"weights ({fresh_start}, without resume_from_checkpoint): the optimizer state and the step count then "
        "start afresh."
    )


class AtomicCheckpoints:
    """Checkpoints written into a staging folder and renamed to ``checkpoint-<step>`` only once complete;
    older checkpoints rotated away (``save_total_limit``) only after the new one is in place. A process
    killed while saving leaves at most a ``.incomplete-checkpoint-<step>`` folder, which resuming ignores
    and the next save removes. Before the rename, the saving process fsyncs every file and directory of
    the checkpoint (:func:`fsync_tree`, after every process finished writing its part) and the staging
    folder; after it, the folder that holds the checkpoints, so a power loss leaves either no
    ``checkpoint-<step>`` or a complete one.

    A part of a ``transformers.Trainer`` subclass (``trainer``) built on
    :class:`~rlhf_trainers.compat.TrainerHooksMixin`: its ``checkpoint_run_dir`` returns
    :meth:`run_dir` and its ``write_checkpoint`` calls :meth:`write` (:class:`AtomicCheckpointMixin`
    does both).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        #: The staging folder while a checkpoint is being written, else None.
        self.staging: str | None = None

    def run_dir(self, run_dir: str) -> str:
        """Where ``Trainer`` writes ``checkpoint-<step>``: the staging folder while :meth:`write` runs,
        else ``run_dir`` (the run's folder)."""
        return self.staging or run_dir

    def write(
        self,
        run_dir: str,
        write_checkpoint: Callable[[], None],
        write_extra_state: Callable[[str], None],
    ) -> None:
        """Write a checkpoint of the current step atomically into ``run_dir``: ``write_checkpoint()`` is
        ``Trainer``'s (it writes into :meth:`run_dir`, the staging folder), then ``write_extra_state(folder)``
        adds the subclass's state to the staged checkpoint ``folder``; then the rename, the fsyncs and the
        rotation. A collective: every process calls it."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        try:
            from transformers.trainer_utils import rotate_checkpoints
        except ImportError:  # pragma: no cover - older transformers
            rotate_checkpoints = None
        trainer = self.trainer
        args = trainer.args
        name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        staging = os.path.join(run_dir, STAGING_PREFIX + name)
        if args.should_save:
            # Any staging folder here is left from a process that died while saving: remove them all.
            if os.path.isdir(run_dir):
                for entry in os.listdir(run_dir):
                    if entry.startswith(STAGING_PREFIX):
                        shutil.rmtree(os.path.join(run_dir, entry), ignore_errors=True)
            os.makedirs(staging, exist_ok=True)
        trainer.accelerator.wait_for_everyone()
        self.staging = staging
        try:
            write_checkpoint()
            write_extra_state(os.path.join(staging, name))
        finally:
            self.staging = None
        trainer.accelerator.wait_for_everyone()
        if args.should_save:
            final = os.path.join(run_dir, name)
            old = os.path.join(run_dir, STAGING_PREFIX + "old-" + name)
            if FSYNC_CHECKPOINTS:
                # Every process has written its part (the barrier above): make all of it durable, and
                # the staging folder's entry for it, before the rename can make it look complete.
                fsync_tree(os.path.join(staging, name))
                fsync_dir(staging)
            if os.path.exists(final):  # the same step saved again (e.g. an interrupt right after a save)
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(os.path.join(staging, name), final)
            if FSYNC_CHECKPOINTS:
                fsync_dir(run_dir)  # the rename itself
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
            state = trainer.state
            if state.best_model_checkpoint and state.best_model_checkpoint.startswith(staging):
                state.best_model_checkpoint = final
            if rotate_checkpoints is not None:
                rotate_checkpoints(
                    output_dir=run_dir,
                    save_total_limit=args.save_total_limit,
                    best_model_checkpoint=state.best_model_checkpoint,
                    use_mtime=False,
                )
        trainer.accelerator.wait_for_everyone()


class AtomicCheckpointMixin(TrainerHooksMixin):
    """Mix into a ``transformers.Trainer`` subclass (before ``Trainer``): its checkpoints are
    :class:`AtomicCheckpoints`. Subclasses that store more state in a checkpoint override
    :meth:`write_extra_checkpoint_state`."""

    @property
    def _atomic_checkpoints(self) -> AtomicCheckpoints:
        writer = self.__dict__.get("_atomic_checkpoints_writer")
        if writer is None:
            writer = self.__dict__["_atomic_checkpoints_writer"] = AtomicCheckpoints(self)
        return writer

    def checkpoint_run_dir(self, trial: Any) -> str:
        """The staging folder while a checkpoint is being written (``Trainer`` writes
        ``checkpoint-<step>`` into it), else the run's folder."""
        return self._atomic_checkpoints.run_dir(super().checkpoint_run_dir(trial))

    def write_extra_checkpoint_state(self, folder: str) -> None:
        """Write state of the subclass into the checkpoint ``folder`` (still in staging, after
        ``Trainer`` wrote the model, optimizer, scheduler, RNG and trainer state; on every process, so
        write only where ``args.should_save``). Default: nothing."""

    def write_checkpoint(self, model: Any, trial: Any) -> None:
        """``Trainer``'s checkpoint, written into a staging folder and then renamed into place."""
        self._atomic_checkpoints.write(
            super().checkpoint_run_dir(trial),
            lambda: super(AtomicCheckpointMixin, self).write_checkpoint(model, trial),
            self.write_extra_checkpoint_state,
        )


class InterruptHandler:
    """Turns SIGTERM/SIGINT into a request to stop after the current step (see ``save_on_interrupt``).

    Installed by :func:`reliability_callback` for the duration of ``train()``, in the main thread only
    (Python delivers signals there). A second signal restores the previous handlers and is handled by
    them (SIGINT raises ``KeyboardInterrupt``)."""

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            previous = self._previous.get(signum, signal.SIG_DFL)
            self.uninstall()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, previous)
                os.kill(os.getpid(), signum)
            return
        self.received = name
        print(
            f"\n{name} received: finishing the current step, then saving a checkpoint and stopping "
            f"(send {name} again to stop at once).",
            file=sys.stderr,
            flush=True,
        )


class NonFiniteStepGuard:
    """Skips optimizer steps whose gradients are not finite, counts them, and stops training after
    ``max_consecutive`` consecutive ones.

    Without DeepSpeed (:meth:`attach`): an optimizer step-pre-hook drops the gradients (``p.grad = None``)
    before ``step()``: torch optimizers leave a parameter without a gradient untouched (no update, no
    weight decay, no change to its moment estimates or step count). Under DDP the gradients are the same on
    every rank after their all-reduce, so every rank makes the same decision.

    Under DeepSpeed ZeRO (:meth:`attach_engine`): the gradients are partitioned between the ranks and the
    engine steps inside ``backward``. Its ZeRO optimizer already refuses a step whose global gradient norm
    (over every rank's partition, all-reduced) is NaN or inf, or whose partitions hold one (its overflow
    check, all-reduced too): it clears the gradients and leaves weights, moments and step counts as they
    were, on every rank alike. The guard reads that decision after each step
    (:meth:`after_engine_step`), counts it and applies the same limit. The learning-rate schedule moves on
    over a skipped step, as it does without DeepSpeed (see :func:`reliability_callback`)."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.skipped = 0
        self.consecutive = 0
        self._handle: Any = None
        self._norm_finite = False
        self._engine: Any = None
        self._engine_steps = 0

    def note_grad_norm(self, norm: float) -> None:
        """Tell the guard the total gradient norm of the step about to be taken (e.g. the one gradient
        clipping just computed over the same parameters): a finite norm proves every gradient entry
        finite, so the next ``step()`` skips its own pass over the gradients (at 135M parameters on one
        CPU thread that pass costs about as much as the AdamW update itself)."""
        self._norm_finite = math.isfinite(float(norm))

    @staticmethod
    def gradients_finite(grads: list[Any]) -> bool:
        """Whether every entry of ``grads`` is finite, exactly, in one cheap pass where possible.

        A sum with a NaN or infinite term is NaN or infinite, so a finite (at least float32) sum proves a gradient
        finite; only a gradient whose sum is not finite (a non-finite entry, or finite entries whose sum
        overflows) is checked entry by entry. ``isfinite`` on every gradient would allocate and scan
        several gradient-sized temporaries instead."""
        import torch

        if not grads:
            return True
        sums = torch.stack([g.sum(dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads])
        ok = torch.isfinite(sums)
        if bool(ok.all()):
            return True
        return all(
            bool(torch.isfinite(g).all()) for g, fine in zip(grads, ok.tolist(), strict=True) if not fine
        )

    def attach(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        if self._handle is None and hasattr(inner, "register_step_pre_hook"):
            self._handle = inner.register_step_pre_hook(self._pre_step)

    def attach_engine(self, engine: Any) -> str:
        """Apply the guard to the steps of the DeepSpeed ``engine`` (a ``DeepSpeedEngine``, prepared for
        training). Returns how: ``"engine"`` (a ZeRO optimizer or another that skips non-finite steps
        itself: its decisions are counted by :meth:`after_engine_step`), ``"optimizer"`` (the engine steps
        a plain torch optimizer on whole gradients, ZeRO stage 0: the step-pre-hook of :meth:`attach`),
        ``"loss_scaler"`` (fp16: the loss scaler skips overflowing steps and adjusts its scale; those
        skips are its calibration, not counted, as ``torch.amp.GradScaler``'s are not without DeepSpeed)
        or ``"none"`` (no way to see the decision; a warning is logged)."""
        optimizer = getattr(engine, "optimizer", None)
        if engine.fp16_enabled():
            return "loss_scaler"
        if zero_optimizer_skips_nonfinite_steps(optimizer):
            self._engine = engine
            self._engine_steps = engine.global_steps
            return "engine"
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self.attach(optimizer)
            return "optimizer"
        logger.warning(
            "max_nonfinite_steps does not apply to this DeepSpeed engine (its optimizer %s neither skips "
            "non-finite steps itself nor is a torch optimizer); steps with NaN or inf gradients are not "
            "skipped.",
            type(optimizer).__name__,
        )
        return "none"

    def after_engine_step(self) -> bool:
        """Count the step the engine of :meth:`attach_engine` just took, if it took one since the last
        call: skipped (``was_step_applied()`` false at a step boundary) or applied. Call it after each
        optimizer step (``on_optimizer_step``); every rank reads the same, all-reduced, decision. Returns
        whether a step was skipped (raises ``FloatingPointError`` past the limit instead)."""
        engine = self._engine
        if engine is None or engine.global_steps == self._engine_steps:
            return False
        self._engine_steps = engine.global_steps
        applied = bool(engine.was_step_applied())
        if not applied and getattr(engine, "lr_scheduler", None) is not None:
            # An engine that holds the schedule (a DeepSpeed "scheduler" section) holds it back over a
            # skipped step; without DeepSpeed it moves on.
            engine.lr_scheduler.step()
        self.record_step(applied)
        return not applied

    def record_step(self, finite: bool) -> None:
        """Count one optimizer step: ``finite`` resets the consecutive count; a skipped one adds to
        :attr:`skipped` and :attr:`consecutive` and raises ``FloatingPointError`` past the limit."""
        if finite:
            self.consecutive = 0
            return
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive > self.max_consecutive:
            raise FloatingPointError(
                f"{self.consecutive} consecutive optimizer steps had NaN or inf gradients (limit "
                f"max_nonfinite_steps={self.max_consecutive}); training stopped with the weights of the last "
                "finite step. Likely causes: a learning rate too high for this model; fp16 overflow (use bf16 or "
                "fp32); rewards of a very large scale (set reward_scaling or reward_clip, or normalize the "
                "reward model); NaN in the inputs or the reward model; max_grad_norm=0 with exploding "
                "gradients (set max_grad_norm=1.0)."
            )

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._engine = None

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        norm_finite, self._norm_finite = self._norm_finite, False
        if norm_finite:
            self.consecutive = 0
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        if self.gradients_finite(grads):
            self.consecutive = 0
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self.record_step(False)


def reliability_callback(trainer: Any, loop_holds_schedule_on_skip: bool = True) -> Any:
    """A ``TrainerCallback`` that gives ``trainer`` the behaviour of ``save_on_interrupt`` and
    ``max_nonfinite_steps`` (see :class:`ReliabilityArguments`).

    ``loop_holds_schedule_on_skip``: whether ``trainer``'s training loop leaves its learning-rate scheduler
    alone after a step DeepSpeed skipped (``Trainer``'s loop does: it asks
    ``accelerator.optimizer_step_was_skipped``, true then). The callback then steps the scheduler at the end
    of that step, after the step's learning rate was read for the log, so the schedule moves on over a
    skipped step under DeepSpeed as it does without it. A loop that steps its scheduler anyway (the
    on-policy engine's) passes False."""
    from transformers import TrainerCallback

    class ReliabilityCallback(TrainerCallback):
        """At every step end the signal flag is combined over processes (every rank stops at the same
        step); when set, the step is saved and training stops."""

        def __init__(self) -> None:
            self.interrupt = InterruptHandler()
            self.guard = NonFiniteStepGuard(getattr(trainer.args, "max_nonfinite_steps", 3))
            self.installed = False
            self.schedule_behind = 0  # scheduler steps the loop held back over skipped steps

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.interrupt.received = None
            if getattr(args, "save_on_interrupt", False):
                self.installed = self.interrupt.install()
            if trainer.optimizer is None:
                return
            if trainer.is_deepspeed_enabled:
                engine = deepspeed_training_engine(trainer.accelerator)
                if engine is not None:
                    self.guard.attach_engine(engine)
            else:
                self.guard.attach(trainer.optimizer)

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.guard.after_engine_step() and loop_holds_schedule_on_skip:
                self.schedule_behind += 1

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            while self.schedule_behind:
                self.schedule_behind -= 1
                trainer.lr_scheduler.step()
            if not self.installed:
                return
            stop = self.interrupt.received is not None
            if trainer.accelerator.num_processes > 1:
                import torch

                flag = torch.tensor([float(stop)], device=trainer.accelerator.device)
                stop = bool(trainer.accelerator.reduce(flag, reduction="sum").item() > 0)
            if stop:
                trainer.interrupted = True
                control.should_save = True
                control.should_training_stop = True
                if args.should_log:
                    print(
                        f"stopping at step {state.global_step} on {self.interrupt.received or 'a signal'}; "
                        f"checkpoint-{state.global_step} in {args.output_dir}. Resume with "
                        "trainer.train(resume_from_checkpoint=True).",
                        file=sys.stderr,
                        flush=True,
                    )

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.interrupt.uninstall()
            self.installed = False
            self.guard.detach()

    return ReliabilityCallback()
