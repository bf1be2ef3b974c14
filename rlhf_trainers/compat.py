"""Every use of a private ``transformers.Trainer``, ``transformers``, ``accelerate`` or DeepSpeed API in this
package, in one place.

Tested with transformers 5.x and accelerate 1.x; setup.cfg caps both below their next major version.
Private methods can change in any release, so each one we rely on has a test in tests/test_compat.py that
fails when it changes: the method still exists, takes the parameters we pass, and (where we override it)
``Trainer`` still calls it.

Four kinds of use:

- **Calls.** The functions below (:func:`init_training_state`, :func:`prepare_for_training`, ...) are
  what our trainers call instead of a private method of ``Trainer`` or ``accelerate``.
- **Overrides.** :class:`TrainerHooksMixin` overrides ``Trainer``'s private hooks (``_save``,
  ``_load_from_checkpoint``, ``_get_output_dir``, ``_save_checkpoint``) and forwards each one to a public
  method of ours (:meth:`~TrainerHooksMixin.write_model`, ...), which subclasses override instead.
- **Renamed names.** transformers renamed the KV cache (``past_key_values`` -> ``cache``, the output field
  and the forward's keyword) and gradient checkpointing (``gradient_checkpointing_enable`` ->
  ``activation_checkpointing_enable``); 5.24 warns at every use of an old name. :func:`output_cache`,
  :func:`cache_keyword` and :func:`enable_activation_checkpointing` use the new name where the installed
  transformers has it and the old one on the older 5.x releases; :func:`quiet_peft_model_init` (and
  :func:`peft_wrap`) keep peft's read of the deprecated ``is_gradient_checkpointing`` quiet (peft's
  warning, not the user's to act on).
- **A fix.** :class:`EvaluateBeforeTrainMixin` makes ``trainer.evaluate()`` before ``trainer.train()``
  work; it resets state that ``Trainer`` and ``accelerate`` keep in private attributes.

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

tests/test_reward_distributed.py runs that sequence on each path and checks the ranks end with
identical weights.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from torch import nn
    from transformers import Trainer


# ---- calls ------------------------------------------------------------------------------------------------


def sdpa_has_gqa() -> bool:
    """Whether this torch's ``scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5), from the
    version, without a probing call."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def init_training_state(
    trainer: Trainer,
    max_steps: int,
    num_update_steps_per_epoch: int,
    num_train_epochs: int,
    resume_from_checkpoint: str | None,
    trial: Any = None,
) -> tuple[int, int]:
    """``Trainer._init_training_state``: set up ``trainer.state`` (step counts, logging/eval/save
    cadence, callbacks' view of the run) for ``max_steps`` steps, loading the trainer state of
    ``resume_from_checkpoint`` when given. Returns ``(epochs_trained, steps_trained_in_current_epoch)``."""
    return trainer._init_training_state(
        max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    )


def prepare_for_training(
    trainer: Trainer, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
) -> tuple[nn.Module, Any]:
    """``Trainer._prepare_for_training``: create the optimizer and scheduler, wrap the model
    (DDP/DeepSpeed) with ``accelerator.prepare``, and load the optimizer, scheduler and DeepSpeed state
    of ``resume_from_checkpoint``. Returns ``(model, train_dataloader)``, the model as wrapped."""
    return trainer._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)


def load_rng_state(trainer: Trainer, checkpoint: str | None) -> None:
    """``Trainer._load_rng_state``: restore the Python, NumPy and torch RNG states of this process
    saved in ``checkpoint`` (nothing when ``None``)."""
    trainer._load_rng_state(checkpoint)


def save_checkpoint(trainer: Trainer, model: nn.Module, trial: Any = None) -> None:
    """``Trainer._save_checkpoint``: write ``checkpoint-<global_step>`` (model, optimizer, scheduler,
    RNG and trainer state) the way ``Trainer.train`` does at a save step, through the trainer's
    overrides (e.g. the atomic checkpoints of :class:`~rlhf_trainers.reliability.AtomicCheckpointMixin`)."""
    trainer._save_checkpoint(model, trial)


def get_learning_rate(trainer: Trainer) -> float:
    """``Trainer._get_learning_rate``: the learning rate the next optimizer step uses (it also covers
    DeepSpeed's scheduler before its first step)."""
    return trainer._get_learning_rate()


def clip_grad_norm(trainer: Trainer, model: nn.Module) -> torch.Tensor | float:
    """``Trainer._clip_grad_norm``: clip the gradients of ``model`` to ``args.max_grad_norm`` as
    ``Trainer.train`` does (through accelerate, so DDP, DeepSpeed and FSDP are handled); returns the
    total norm before clipping."""
    return trainer._clip_grad_norm(model)


def prepare_inputs(trainer: Trainer, inputs: dict[str, Any]) -> dict[str, Any]:
    """``Trainer._prepare_inputs``: move a batch to the trainer's device (and dtype where DeepSpeed
    asks for it) as ``Trainer.prediction_step`` does."""
    return trainer._prepare_inputs(inputs)


def load_from_checkpoint(trainer: Trainer, checkpoint: str, model: nn.Module | None = None) -> None:
    """``Trainer._load_from_checkpoint``: load the model weights saved in ``checkpoint``, through the
    trainer's overrides (:meth:`TrainerHooksMixin.load_weights_from_checkpoint`)."""
    trainer._load_from_checkpoint(checkpoint, model)


def set_sync_gradients(accelerator: Accelerator, sync: bool) -> None:
    """Tell accelerate whether the next backward is the last one before an optimizer step
    (``GradientState._set_sync_gradients``). Under DDP only that backward all-reduces the gradients
    (the others run in ``no_sync``), and DeepSpeed steps its engine only then; the on-policy engine
    accumulates micro-batches without ``accelerator.accumulate``, whose step counter it cannot use."""
    accelerator.gradient_state._set_sync_gradients(sync)


def forget_evaluation_preparation(accelerator: Accelerator, model: nn.Module) -> None:
    """Undo ``accelerator.prepare_model(model, evaluation_mode=True)``: drop the mark that makes a later
    ``prepare_model`` return the model unwrapped, and accelerate's reference to it."""
    if hasattr(model, "_is_accelerate_prepared"):
        del model._is_accelerate_prepared
    accelerator._models[:] = [m for m in accelerator._models if m is not model]


def deepspeed_training_engine(accelerator: Accelerator) -> Any:
    """The ``DeepSpeedEngine`` that ``accelerator.prepare`` made for training (accelerate keeps it in
    ``deepspeed_engine_wrapped``), or None before that or without DeepSpeed."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return getattr(wrapped, "engine", None)


def zero_optimizer_skips_nonfinite_steps(optimizer: Any) -> bool:
    """Whether DeepSpeed's ``optimizer`` (the one its engine steps) skips a step with NaN or inf gradients
    by itself, and reports it in its ``overflow`` flag (the engine's ``was_step_applied()``): the ZeRO
    optimizers of stages 1-3 and the fp16 ones do. ZeRO-1/2 finds such a step through its global gradient
    norm, except in bf16, or through its scan of the partitioned gradients (``check_grad_overflow``, on for
    fp16 and, by default, bf16). Where neither would run (``zero_optimization.compute_grad_norm=false``, or
    bf16 with ``bf16.check_grad_overflow=false``) the scan is turned on here."""
    if not hasattr(optimizer, "overflow"):
        return False
    if getattr(optimizer, "check_grad_overflow", True) is False:
        import torch

        norm_decides = getattr(optimizer, "compute_grad_norm", True) and (
            getattr(optimizer, "dtype", None) != torch.bfloat16
        )
        if not norm_decides:
            optimizer.check_grad_overflow = True
    return True


def is_prepared(model: nn.Module) -> bool:
    """Whether accelerate has marked ``model`` as prepared (for training or, after ``evaluate()``, for
    evaluation only)."""
    return bool(getattr(model, "_is_accelerate_prepared", False))


def register_zero3_hooks(offload: Any) -> None:
    """Put back the parameter fetch/release hooks of a ZeRO-3 engine's parameter offload
    (``DeepSpeedZeRoOffload._register_deepspeed_module``) after they were removed to run with the
    weights gathered whole (as DeepSpeed's own ``unwrap_model_for_generation`` does)."""
    offload._register_deepspeed_module(offload.module)


def has_loaded_adapter(model: Any) -> bool:
    """Whether a PEFT adapter was loaded into the transformers ``model`` itself (``load_adapter``, or
    ``from_pretrained`` of an adapter folder), which leaves it a plain ``PreTrainedModel``; transformers
    records it only in the private ``_hf_peft_config_loaded``."""
    return bool(getattr(model, "_hf_peft_config_loaded", False))


# ---- renamed names ----------------------------------------------------------------------------------------


def output_cache(out: Any) -> Any:
    """The KV cache of a model output ``out`` (None where it has none): its ``cache`` field where the
    output class has one (transformers' new name), else ``past_key_values``. Reading ``past_key_values``
    of a 5.24 output still works but logs "`past_key_values`/`cache_params` are deprecated"."""
    fields = getattr(type(out), "__dataclass_fields__", None)
    if fields is not None and "cache" in fields:
        return out.cache
    return getattr(out, "past_key_values", None)


def cache_keyword(model: nn.Module) -> str:
    """The keyword under which ``model``'s forward takes a KV cache: ``"cache"`` where the forward of the
    transformers model (inside a PEFT wrapper too) declares it, else ``"past_key_values"`` (older 5.x
    releases, custom models). Passing ``past_key_values`` to a forward that declares ``cache`` raises a
    FutureWarning at every call in transformers 5.24."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return _cache_keyword_of(type(base))


@functools.cache
def _cache_keyword_of(cls: type) -> str:
    try:
        parameters = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def enable_activation_checkpointing(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Turn on gradient (activation) checkpointing in ``module`` with ``kwargs`` for
    ``torch.utils.checkpoint`` (e.g. ``{"use_reentrant": False}``): ``activation_checkpointing_enable`` where
    the model has it (the new name), else ``gradient_checkpointing_enable``."""
    if hasattr(module, "activation_checkpointing_enable"):
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_kwargs(args: Any) -> dict[str, Any] | None:
    """The ``torch.utils.checkpoint`` kwargs a ``TrainingArguments`` asks for, by either name
    (``activation_checkpointing_kwargs``, or the older ``gradient_checkpointing_kwargs``); None where unset."""
    kwargs = getattr(args, "activation_checkpointing_kwargs", None)
    return kwargs if kwargs is not None else getattr(args, "gradient_checkpointing_kwargs", None)


@contextlib.contextmanager
def quiet_peft_model_init() -> Iterator[None]:
    """Inside: no FutureWarning from peft's own read of ``model.is_gradient_checkpointing`` (deprecated in
    transformers for ``is_activation_checkpointing``) when a ``PeftModel`` is built (``get_peft_model``,
    ``AutoPeftModel*.from_pretrained``) in transformers 5.24; every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def peft_wrap(model: nn.Module, peft_config: Any) -> nn.Module:
    """``peft.get_peft_model(model, peft_config)`` under :func:`quiet_peft_model_init`."""
    from peft import get_peft_model

    with quiet_peft_model_init():
        return get_peft_model(model, peft_config)


# ---- overrides --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def saving_where_trainer_saves(args: Any, *models: Any) -> Iterator[None]:
    """Inside, ``save_pretrained`` of ``models`` (and of the models they wrap) writes on every process
    where ``args.should_save``.

    transformers' ``save_pretrained`` writes only on the process of ``torch.distributed`` rank 0
    (``should_save_on_this_rank``), whatever its ``is_main_process`` says, so with ``save_on_each_node``
    the first process of every other node wrote a checkpoint without the model's weights and config
    (found by tests/test_two_machines.py: node-local disks could not resume). Where ``should_save`` says
    this process saves, the rank check is set aside for the call."""
    if not getattr(args, "should_save", False):
        yield
        return
    targets: list[Any] = []
    for model in models:
        while model is not None and model not in targets:
            if hasattr(model, "should_save_on_this_rank"):
                targets.append(model)
            inner = getattr(model, "get_base_model", None)
            model = inner() if callable(inner) else getattr(model, "module", None)
    for model in targets:
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        for model in targets:
            model.__dict__.pop("should_save_on_this_rank", None)


class TrainerHooksMixin:
    """Mix into a ``transformers.Trainer`` subclass (before ``Trainer``): ``Trainer``'s private hooks
    forward to the public methods below, which subclasses override instead of the private names.

    ============================  =====================================================
    ``Trainer`` calls             and this mixin forwards to
    ============================  =====================================================
    ``_save``                     :meth:`write_model` (``save_model``, checkpoints)
    ``_load_from_checkpoint``     :meth:`load_weights_from_checkpoint` (resuming)
    ``_get_output_dir``           :meth:`checkpoint_run_dir` (where checkpoints go)
    ``_save_checkpoint``          :meth:`write_checkpoint` (a save step)
    ``_build_accelerator_args``   :meth:`accelerator_arguments` (the ``Accelerator``'s
                                  keyword arguments)
    ============================  =====================================================
    """

    # The private hooks, as Trainer calls them.

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        self.write_model(output_dir if output_dir is not None else self.args.output_dir, state_dict)  # type: ignore[attr-defined]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self.load_weights_from_checkpoint(resume_from_checkpoint, model)

    def _get_output_dir(self, trial: Any) -> str:
        return self.checkpoint_run_dir(trial)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self.write_checkpoint(model, trial)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        return self.accelerator_arguments(**kwargs)

    # The public methods, with Trainer's behaviour by default.

    def write_model(self, output_dir: str, state_dict: dict[str, Any] | None = None) -> None:
        """Write the model (and tokenizer, training arguments) into ``output_dir``; ``state_dict`` is
        the full state to save when the caller gathered it (DeepSpeed, FSDP). Called by
        ``save_model`` and by every checkpoint. Default: ``Trainer``'s, with ``save_on_each_node`` honoured
        (:func:`saving_where_trainer_saves`)."""
        with saving_where_trainer_saves(self.args, self.model):  # type: ignore[attr-defined]
            super()._save(output_dir, state_dict)  # type: ignore[misc]

    def load_weights_from_checkpoint(self, checkpoint: str, model: nn.Module | None = None) -> None:
        """Load the weights that :meth:`write_model` saved in ``checkpoint`` into ``model`` (default:
        the trainer's). Default: ``Trainer``'s."""
        super()._load_from_checkpoint(checkpoint, model)  # type: ignore[misc]

    def checkpoint_run_dir(self, trial: Any) -> str:
        """The folder that holds the ``checkpoint-<step>`` folders (``output_dir``, or a per-trial
        folder in a hyperparameter search). Default: ``Trainer``'s."""
        return super()._get_output_dir(trial)  # type: ignore[misc]

    def accelerator_arguments(self, **kwargs: Any) -> dict[str, Any]:
        """The keyword arguments of the trainer's ``Accelerator`` (built in ``Trainer.__init__``).
        Default: ``Trainer``'s."""
        return super()._build_accelerator_args(**kwargs)  # type: ignore[misc]

    def write_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Write ``checkpoint-<global_step>`` into :meth:`checkpoint_run_dir` (model, optimizer,
        scheduler, RNG and trainer state) and rotate old ones. Default: ``Trainer``'s."""
        super()._save_checkpoint(model, trial)  # type: ignore[misc]


class EvaluateBeforeTrainMixin:
    """Mix into a ``transformers.Trainer`` subclass (before ``Trainer``) so that ``evaluate()`` before
    ``train()`` works under DDP and DeepSpeed (see the module docstring): the DeepSpeed config is kept as
    built at construction, ``evaluation_loop`` evaluates the plain model before training under ZeRO-1/2,
    and ``train()`` first undoes what such an evaluation left behind."""

    _engine_from_evaluate: bool = False
    _deepspeed_config_snapshot: dict[str, Any] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self._hf_deepspeed_config()
        self._deepspeed_config_snapshot = copy.deepcopy(config.config) if config is not None else None

    def _hf_deepspeed_config(self) -> Any:
        if not getattr(self, "is_deepspeed_enabled", False):
            return None
        plugin = self.accelerator.state.deepspeed_plugin  # type: ignore[attr-defined]
        return getattr(plugin, "hf_ds_config", None)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluation_loop``; before any training under ZeRO-1/2 it evaluates the plain model
        (every rank holds all of its weights) instead of asking DeepSpeed for an inference engine."""
        config = self._hf_deepspeed_config()
        if config is None or self.deepspeed is not None:  # type: ignore[attr-defined]
            return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]
        if not config.is_zero3():
            self.is_deepspeed_enabled = False
            try:
                return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]
            finally:
                self.is_deepspeed_enabled = True
        output = super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]
        self._engine_from_evaluate = self.deepspeed is not None  # type: ignore[attr-defined]
        return output

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, after undoing what an ``evaluate()`` before it left behind."""
        self._undo_evaluation_preparation()
        return super().train(*args, **kwargs)  # type: ignore[misc]

    def _undo_evaluation_preparation(self) -> None:
        model = self.model  # type: ignore[attr-defined]
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
        elif is_prepared(model) and self.model_wrapped is model and not self.is_fsdp_enabled:  # type: ignore[attr-defined]
            # DDP / ZeRO-1/2: the model was prepared for evaluation only (not wrapped); drop the mark
            # so train() wraps it.
            forget_evaluation_preparation(self.accelerator, model)  # type: ignore[attr-defined]
