"""Saving and resuming the on-policy engine: the policy (full weights or PEFT adapter), the value
model in ``value_model/``, and the KL controller's state, inside the checkpoints that
``transformers.Trainer`` writes and rotates. Functions of the trainer, whose ``Trainer`` hooks call them."""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from ..compat import saving_where_trainer_saves
from ..models import _is_peft_model
from ..reliability import check_resume_process_count
from .rollouts_ahead import rollouts_ahead

logger = logging.getLogger(__name__)

ONPOLICY_STATE_FILE = "onpolicy_state.json"
VALUE_MODEL_DIR = "value_model"


def write_model(trainer: Any, output_dir: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write the policy in a loadable form (``from_pretrained`` / PEFT adapter folder) into
    ``output_dir``, the value model (if any) into ``output_dir/value_model``, and the tokenizer.
    ``state_dict`` is the full state of the trained module when the caller gathered it (DeepSpeed)."""
    if not trainer.args.should_save:
        return
    os.makedirs(output_dir, exist_ok=True)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if state_dict is None:
        state_dict = unwrapped.state_dict()
    policy_sd = {k[len("policy.") :]: v for k, v in state_dict.items() if k.startswith("policy.")}
    with saving_where_trainer_saves(trainer.args, unwrapped.policy, unwrapped.value_model):
        unwrapped.policy.save_pretrained(output_dir, state_dict=policy_sd or None)
        if unwrapped.value_model is not None:
            value_sd = {
                k[len("value_model.") :]: v for k, v in state_dict.items() if k.startswith("value_model.")
            }
            unwrapped.value_model.save_pretrained(
                os.path.join(output_dir, VALUE_MODEL_DIR), state_dict=value_sd or None
            )
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(output_dir)
    torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))


def write_extra_checkpoint_state(trainer: Any, folder: str) -> None:
    """In ``onpolicy_state.json``: the KL controller's state, the update count, the metrics of the
    updates since the last log entry (a checkpoint written between two entries, e.g. on an
    interruption, hands them to the resumed run's next entry, which then averages the same updates as
    an uninterrupted run's), and the non-finite step counts (``train/nonfinite_steps_skipped`` and
    the consecutive ones that ``max_nonfinite_steps`` limits)."""
    ahead = rollouts_ahead(trainer)
    if ahead is not None:  # every process: its responses in flight
        ahead.save(folder)
    if trainer.args.should_save:
        path = os.path.join(folder, ONPOLICY_STATE_FILE)
        guard = trainer._reliability.guard
        state = {
            "kl_controller": trainer.kl_ctl.state_dict(),
            "global_step": trainer.state.global_step,
            "pending_logs": {
                name: [v if isinstance(v, int) else float(v) for v in values]
                for name, values in trainer._log_buffer.items()
            },
            "nonfinite_steps": {"skipped": guard.skipped, "consecutive": guard.consecutive},
            # a resume on another number of processes is refused (check_resume_process_count)
            "num_processes": trainer.accelerator.num_processes,
        }
        with open(path, "w") as fh:
            json.dump(state, fh, indent=2)


def check_resume(trainer: Any, checkpoint: str) -> None:
    """ValueError, before anything is loaded, when ``checkpoint`` was saved on another number of
    processes (``num_processes`` of ``onpolicy_state.json``, or for checkpoints without it the RNG-state
    files): see :func:`~rlhf_trainers.reliability.check_resume_process_count`."""
    saved = None
    path = os.path.join(checkpoint, ONPOLICY_STATE_FILE)
    if os.path.isfile(path):
        with open(path) as fh:
            saved = json.load(fh).get("num_processes")
    fresh_start = "model=<checkpoint>"
    if trainer.value_model is not None:
        fresh_start += f", value_model=os.path.join(<checkpoint>, {VALUE_MODEL_DIR!r})"
    check_resume_process_count(
        checkpoint,
        trainer.accelerator.num_processes,
        saved=saved,
        save_on_each_node=trainer.args.save_on_each_node,
        fresh_start=fresh_start,
    )


def load_onpolicy_state(trainer: Any, checkpoint: str) -> None:
    ahead = rollouts_ahead(trainer)
    if ahead is not None:
        ahead.load(checkpoint)
    path = os.path.join(checkpoint, ONPOLICY_STATE_FILE)
    if not os.path.isfile(path):
        logger.warning(
            "%s has no %s; the KL controller starts from its initial value.",
            checkpoint,
            ONPOLICY_STATE_FILE,
        )
        return
    with open(path) as fh:
        state = json.load(fh)
    trainer.kl_ctl.load_state_dict(state["kl_controller"])
    # (checkpoints of older versions hold neither: the run then logs as it did before)
    trainer._log_buffer.clear()
    for name, values in state.get("pending_logs", {}).items():
        trainer._log_buffer[name].extend(values)
    counts = state.get("nonfinite_steps")
    if counts:
        guard = trainer._reliability.guard
        guard.skipped, guard.consecutive = int(counts["skipped"]), int(counts["consecutive"])


def load_weights_from_checkpoint(trainer: Any, checkpoint: str, model: nn.Module | None = None) -> None:
    """Load the policy (full weights or PEFT adapter) and value model saved by :func:`write_model`."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model if model is None else model)
    _load_pretrained_into(unwrapped.policy, checkpoint)
    if unwrapped.value_model is not None:
        _load_pretrained_into(unwrapped.value_model, os.path.join(checkpoint, VALUE_MODEL_DIR))


def _load_pretrained_into(model: nn.Module, folder: str) -> None:
    """Load weights saved by ``save_pretrained`` (safetensors, full model or PEFT adapter) into ``model``."""
    from safetensors.torch import load_file

    if _is_peft_model(model):
        from peft import set_peft_model_state_dict

        path = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(f"No adapter weights ({path}) to resume the PEFT policy from.")
        set_peft_model_state_dict(model, load_file(path))
        return
    path = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(path):
        raise ValueError(f"No model.safetensors in {folder} to resume from.")
    # Through from_pretrained, not the raw file: transformers renames some weights when it saves and
    # back when it loads (GPT-NeoX's lm_head is stored as embed_out), and it restores tied copies.
    loaded, info = type(model).from_pretrained(
        folder,
        config=copy.deepcopy(model.config),
        dtype=next(model.parameters()).dtype,
        output_loading_info=True,
    )
    missing = list(info.get("missing_keys", []))
    unexpected = list(info.get("unexpected_keys", []))
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}."
        )
    model.load_state_dict(loaded.state_dict())
