"""Fixes to ``transformers.Trainer`` behaviour that the trainers of this package share.

``trainer.evaluate()`` before ``trainer.train()`` (a baseline before training, as users often do) is
broken in ``transformers.Trainer`` on every distributed path we support (transformers 5.x with
accelerate 1.x, measured on 2 CPU ranks):

- **DDP**: ``evaluate`` prepares the model with ``prepare_model(model, evaluation_mode=True)``, which
  marks it prepared without wrapping it in DistributedDataParallel; ``train`` then finds the mark,
  keeps the bare model, and the ranks never all-reduce their gradients: each trains on its own shard
  and the weights drift apart silently.
- **DeepSpeed ZeRO-1/2**: ``evaluate`` asks for a ZeRO inference engine, which only ZeRO-3 has, and
  raises ``ValueError``.
- **DeepSpeed ZeRO-3**: ``evaluate`` builds an inference engine; ``train`` frees it at its start but the
  trainer keeps pointing at it, so no training engine is built and the first backward fails with
  ``'NoneType' object has no attribute 'backward'``. It also edits the shared DeepSpeed config in
  place (optimizer and scheduler sections removed, "auto" step counts set for 0 steps).

:class:`EvaluateBeforeTrainMixin` makes that sequence work; tests/test_reward_distributed.py runs it on
each path and checks the ranks end with identical weights.
"""

from __future__ import annotations

import copy
from typing import Any


class EvaluateBeforeTrainMixin:
    """Mix into a ``transformers.Trainer`` subclass (before ``Trainer``) and call
    :meth:`_prepare_model_for_training` at the start of ``train``."""

    _engine_from_evaluate: bool = False
    _deepspeed_config_snapshot: dict[str, Any] | None = None

    def _snapshot_deepspeed_config(self) -> None:
        """Keep a copy of the DeepSpeed config as built at construction (call after ``Trainer.__init__``)."""
        config = self._hf_deepspeed_config()
        self._deepspeed_config_snapshot = copy.deepcopy(config.config) if config is not None else None

    def _hf_deepspeed_config(self) -> Any:
        if not getattr(self, "is_deepspeed_enabled", False):
            return None
        plugin = self.accelerator.state.deepspeed_plugin
        return getattr(plugin, "hf_ds_config", None)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluation_loop``; before any training under ZeRO-1/2 it evaluates the plain model
        (every rank holds all of its weights) instead of asking DeepSpeed for an inference engine."""
        config = self._hf_deepspeed_config()
        if config is None or self.deepspeed is not None:
            return super().evaluation_loop(*args, **kwargs)
        if not config.is_zero3():
            self.is_deepspeed_enabled = False
            try:
                return super().evaluation_loop(*args, **kwargs)
            finally:
                self.is_deepspeed_enabled = True
        output = super().evaluation_loop(*args, **kwargs)
        self._engine_from_evaluate = self.deepspeed is not None
        return output

    def _prepare_model_for_training(self) -> None:
        """Undo what an ``evaluate()`` before training left behind, so ``train()`` prepares the model
        for training as if it had not run."""
        model = self.model
        if self._engine_from_evaluate:
            # ZeRO-3: train() frees the inference engine; forget it so train() builds a training engine
            # on the model, with the config as it was before evaluate() edited it.
            self.model_wrapped = model
            self.deepspeed = None
            self._engine_from_evaluate = False
            config = self._hf_deepspeed_config()
            if config is not None and self._deepspeed_config_snapshot is not None:
                config.config.clear()
                config.config.update(copy.deepcopy(self._deepspeed_config_snapshot))
        elif (
            getattr(model, "_is_accelerate_prepared", False)
            and self.model_wrapped is model
            and not self.is_fsdp_enabled
        ):
            # DDP / ZeRO-1/2: the model was prepared for evaluation only (not wrapped); drop the mark
            # so train() wraps it.
            del model._is_accelerate_prepared
            self.accelerator._models[:] = [m for m in self.accelerator._models if m is not model]
