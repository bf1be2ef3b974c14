"""A reward model for the offline kit's task, trained with :class:`~rlhf_trainers.RewardTrainer`: the recipe
the tests and benchmarks share (``llama-sft``'s backbone with a new scalar head, one epoch over the kit's
synthetic preference pairs, batch 32, lr 3e-3, seed 0; held-out pair accuracy about 1.0)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..reward import RewardTrainer
    from .kit import OfflineKit

__all__ = ["train_kit_reward_model"]


def train_kit_reward_model(
    kit: OfflineKit, output_dir: str | os.PathLike[str], *, seed: int = 0
) -> RewardTrainer:
    """Train the kit's reward model and save it (with its tokenizer) to ``output_dir``; returns the trainer."""
    from ..reward import RewardConfig, RewardTrainer

    trainer = RewardTrainer(
        model=str(kit.model_path("llama-sft")),
        args=RewardConfig(
            output_dir=str(output_dir),
            per_device_train_batch_size=32,
            learning_rate=3e-3,
            num_train_epochs=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=seed,
            max_length=64,
            disable_tqdm=True,
        ),
        train_dataset=kit.preference_dataset("train"),
    )
    trainer.train()
    trainer.save_model(str(output_dir))
    kit.load_tokenizer().save_pretrained(str(output_dir))
    return trainer
