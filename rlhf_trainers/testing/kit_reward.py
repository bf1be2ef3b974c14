"""A reward model for the offline kit's task, trained with :class:`~rlhf_trainers.RewardTrainer`: the recipe
the tests and benchmarks share (``llama-sft``'s backbone with a new scalar head, one epoch over the kit's
synthetic preference pairs plus :func:`edge_case_pairs`, batch 32, lr 3e-3, seed 0; held-out pair accuracy
about 0.98).

Why the edge cases: the kit's preference pairs are all complete sentences, so a reward model trained on
them alone never sees an empty completion, and it extrapolates: it scored ``prompt + EOS`` at 9.05, as high
as " good and nice ." (9.55), on all 96 held-out prompts. A GRPO policy scored on token ids found that hole
(it learned to stop at once; held-out true reward +0.71 against +0.98 when scored on the text). The empty
completion's true reward is 0, so it belongs in the pairs like any other completion."""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING

from .task import (
    _NEGATIVE,
    _POOLS,
    _POSITIVE,
    INTENSIFIERS,
    NEUTRAL_WORDS,
    _check_split,
    _sample_completion,
    true_reward,
)

if TYPE_CHECKING:  # pragma: no cover
    import datasets

    from ..reward import RewardTrainer
    from .kit import OfflineKit

__all__ = ["edge_case_pairs", "train_kit_reward_model"]

_EDGE_SEEDS = {"train": 3003, "test": 4004}
#: Extra pairs the kit's reward model is trained on, next to the kit's 2048 preference pairs.
EDGE_CASE_ROWS = 1024


def edge_case_pairs(split: str = "train", n: int = EDGE_CASE_ROWS) -> datasets.Dataset:
    """`n` preference pairs (columns prompt, chosen, rejected, as ``kit.preference_dataset(shape="explicit")``)
    that pair a generated completion with a degenerate one, in turn: the empty completion (true reward
    0); the same completion cut after some of its words, without its final " ." (a completion stopped by
    the length limit); two sentences in a row; a sentence followed by 1-4 stray " ."; the same sentence
    diluted by words that count 0 next to one of its sentiment words (an intensifier before it, " and "
    and the word again, or " and " and a neutral adjective: " great ." against " great and great ."). The
    one with the higher :func:`~rlhf_trainers.testing.true_reward` is "chosen"; pairs that tie are
    resampled. Deterministic per split; the first `n` rows do not depend on `n`."""
    import datasets

    _check_split(split)
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0.")
    rng = random.Random(_EDGE_SEEDS[split])
    pool = _POOLS[split]
    rows: list[tuple[str, str, str]] = []
    while len(rows) < n:
        prompt = rng.choice(pool)
        completion = _sample_completion(rng)
        kind = len(rows) % 5
        if kind == 0:  # the empty completion
            other = ""
        elif kind == 1:  # cut by the length limit
            words = completion.split()[:-1]  # the final "." dropped
            other = " " + " ".join(words[: rng.randint(1, len(words))])
        elif kind == 2:  # a run-on: a second sentence after the first
            other = _sample_completion(rng) + _sample_completion(rng)
        elif kind == 3:  # stray periods after a sentence (not words: the rule scores it as the sentence)
            other = _sample_completion(rng) + " ." * rng.randint(1, 4)
        else:  # diluted: the rule averages over the words, so words that count 0 move it towards 0
            words = completion.split()
            found = [i for i, w in enumerate(words) if w in _POSITIVE or w in _NEGATIVE]
            if not found:
                continue
            i = rng.choice(found)
            how = rng.randrange(3)
            if how == 0:
                words.insert(i, rng.choice(INTENSIFIERS))
            elif how == 1:
                words[i + 1 : i + 1] = ["and", words[i]]
            else:
                words[i + 1 : i + 1] = ["and", rng.choice(NEUTRAL_WORDS)]
            other = " " + " ".join(words)
        first, second = true_reward(None, [completion, other])
        if first == second:
            continue
        rows.append((prompt, completion, other) if first > second else (prompt, other, completion))
    return datasets.Dataset.from_dict(
        {
            "prompt": [r[0] for r in rows],
            "chosen": [r[1] for r in rows],
            "rejected": [r[2] for r in rows],
        }
    )


def train_kit_reward_model(
    kit: OfflineKit, output_dir: str | os.PathLike[str], *, seed: int = 0, edge_cases: int = EDGE_CASE_ROWS
) -> RewardTrainer:
    """Train the kit's reward model and save it (with its tokenizer) to ``output_dir``; returns the trainer.

    Args:
        kit: the offline kit (:func:`~rlhf_trainers.testing.get_kit`).
        output_dir: where the model and tokenizer are saved.
        seed: the training seed.
        edge_cases: how many :func:`edge_case_pairs` are added to the kit's preference pairs (0: none, the
            recipe before they were added, whose model scores the empty completion near the top).
    """
    import datasets

    from ..reward import RewardConfig, RewardTrainer

    train = kit.preference_dataset("train")
    if edge_cases:
        train = datasets.concatenate_datasets([train, edge_case_pairs("train", edge_cases)])
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
        train_dataset=train,
    )
    trainer.train()
    trainer.save_model(str(output_dir))
    kit.load_tokenizer().save_pretrained(str(output_dir))
    return trainer
