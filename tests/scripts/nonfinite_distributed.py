"""Non-finite steps on N CPU ranks (DDP, or DeepSpeed ZeRO-2/3 by the accelerate config it is launched with).

Trains RLOO (``--trainer rloo``: the kit's ``llama-sft`` policy, 4 prompts x ``rloo_k=4`` per rank, 2 epochs x
2 mini-batches = 4 optimizer steps per update) or a reward model (``--trainer reward``: one optimizer step per
step) for ``--max_steps`` steps, with NaN logits in the training forward passes of RANK 0 ONLY during the
steps listed in ``--nan_at`` (1-based; the rollouts and the other ranks' passes stay finite), so the gradients
are finite on the other ranks until they are reduced. Expected to stop with ``FloatingPointError`` when more
than ``--max_nonfinite_steps`` consecutive optimizer steps were non-finite; the error is caught and reported.

Writes ``<output_dir>/result-rank<R>.json`` per rank for ``tests/test_nonfinite_distributed.py``: the digest of
the trained weights after every step (gathered under ZeRO-3), whether they are finite, the logged
``train/nonfinite_steps_skipped`` and learning rate per step, the error raised (if any) and the step it was
raised at.

Launched by ``distributed.run_script("nonfinite_distributed.py", [...], deepspeed=...)``.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
from typing import Any

import torch
from distributed import gathered, parameter_digest, write_rank_result
from transformers import TrainerCallback

from rlhf_trainers import RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.compat import deepspeed_training_engine
from rlhf_trainers.testing import get_kit, true_reward


class Digests(TrainerCallback):
    """The weights of ``module`` (a digest, and whether they are finite) after every step."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.after: dict[int, list[Any]] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.after[state.global_step] = _weights(self.module)


def _weights(module: torch.nn.Module) -> list[Any]:
    digest = parameter_digest(module)[0]
    with gathered(module), torch.no_grad():
        finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    return [digest, finite]


def _poison(module: torch.nn.Module, trainer: Any, steps: set[int]) -> None:
    """NaN outputs of `module` in the training forward passes of steps `steps`, on rank 0 only."""
    if trainer.accelerator.process_index != 0:
        return

    def hook(mod, inputs, output):
        # global_step counts the finished steps: step s runs while it equals s - 1 (an on-policy update
        # counts one step per update here: steps_per_update is 1 with the default settings).
        if torch.is_grad_enabled() and trainer.state.global_step + 1 in steps:
            return output * math.nan
        return output

    module.register_forward_hook(hook)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--trainer", choices=["rloo", "reward"], required=True)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--nan_at", default="", help="comma-separated 1-based steps with NaN on rank 0")
    parser.add_argument("--max_nonfinite_steps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (TrainingArguments.bf16)")
    parser.add_argument("--dump_stacks_after", type=float, default=300)
    cli = parser.parse_args()
    faulthandler.dump_traceback_later(cli.dump_stacks_after, exit=True)  # a deadlock shows where it waits
    steps = {int(s) for s in cli.nan_at.split(",") if s}

    kit = get_kit()
    common = {
        "output_dir": cli.output_dir,
        "learning_rate": 2e-3,
        "max_steps": cli.max_steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
        "use_cpu": True,
        "max_nonfinite_steps": cli.max_nonfinite_steps,
        "bf16": cli.bf16,
    }
    if cli.trainer == "rloo":
        trainer = RLOOTrainer(
            model=str(kit.model_path("llama-sft")),
            processing_class=kit.load_tokenizer(),
            reward_funcs=true_reward,
            args=RLOOConfig(
                **common,
                per_device_train_batch_size=8,
                num_mini_batches=2,
                num_ppo_epochs=2,
                response_length=12,
                rloo_k=4,
                num_sample_generations=0,
            ),
            train_dataset=kit.prompt_dataset("train", n=128),
        )
        module = trainer.policy
        _poison(module.lm_head, trainer, steps)
    else:
        trainer = RewardTrainer(
            model=str(kit.model_path("llama-sft")),
            args=RewardConfig(**common, per_device_train_batch_size=8, max_length=64),
            train_dataset=kit.preference_dataset("train", n=256),
        )
        module = trainer.model
        _poison(module.score, trainer, steps)
    digests = Digests(module)
    trainer.add_callback(digests)
    before = _weights(module)
    error = None
    try:
        trainer.train()
    except FloatingPointError as exc:
        error = str(exc)
    history = [h for h in trainer.state.log_history if "train/nonfinite_steps_skipped" in h]
    engine = deepspeed_training_engine(trainer.accelerator)
    state = trainer.accelerator.state
    write_rank_result(
        cli.output_dir,
        state.process_index,
        {
            "world_size": state.num_processes,
            "distributed_type": str(state.distributed_type),
            "zero_stage": state.deepspeed_plugin.zero_stage if state.deepspeed_plugin else None,
            "before": before,
            "after": {str(k): v for k, v in digests.after.items()},
            "final": _weights(module),
            "skipped": {str(h["step"]): h["train/nonfinite_steps_skipped"] for h in history},
            "lr": {str(h["step"]): h.get("lr", h.get("learning_rate")) for h in history},
            "error": error,
            "global_step": trainer.state.global_step,
            "engine_bf16": engine.bfloat16_enabled() if engine is not None else None,
        },
    )


if __name__ == "__main__":
    main()
