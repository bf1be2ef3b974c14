"""Non-finite optimizer steps on 2 CPU ranks: DDP, DeepSpeed ZeRO-2 and ZeRO-3, for RLOO (the on-policy
engine) and RewardTrainer (``transformers.Trainer``'s loop), launched through ``tests/distributed.py``.

``tests/scripts/nonfinite_distributed.py`` trains 6 steps with NaN logits in the training passes of rank 0
only at steps 2, 4 and 5, so only rank 0's local gradients are NaN before they are reduced (under ZeRO each
rank then holds only its partition of the reduced gradients). Every rank must skip the same steps: the
weights do not move over step 2 nor step 4, do move over steps 1 and 3, stay finite and identical across the
ranks; ``train/nonfinite_steps_skipped`` counts every skipped optimizer step (4 per RLOO update, 1 per reward
step); the learning-rate schedule moves on over skipped steps as on one process; and the run stops with
``max_nonfinite_steps``' ``FloatingPointError`` on every rank at the first optimizer step of step 5 past the
limit (RLOO: limit 4, the 5th consecutive step; reward: limit 1, the 2nd), with the weights of step 4.

ZeRO-2 and ZeRO-3 run in fp32 and in bf16 (the engine's bf16 mode, on the CPU too).
"""

from __future__ import annotations

import pytest
from distributed import read_rank_results, requires_deepspeed, run_script

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

_DEEPSPEED = [pytest.mark.deepspeed, requires_deepspeed]
#: (trainer, accelerate config, bf16): the on-policy engine under DDP, ZeRO-2, ZeRO-3 and ZeRO-2 in bf16
#: (whose DeepSpeed check is switched on by the guard); RewardTrainer (transformers.Trainer's loop) under
#: ZeRO-3 in fp32 and bf16. Six launches: the other pairs take the same code paths.
CASES = [
    pytest.param("rloo", None, False, id="rloo-ddp"),
    pytest.param("rloo", "zero2", False, id="rloo-zero2", marks=_DEEPSPEED),
    pytest.param("rloo", "zero3", False, id="rloo-zero3", marks=_DEEPSPEED),
    pytest.param("rloo", "zero2", True, id="rloo-zero2-bf16", marks=_DEEPSPEED),
    pytest.param("reward", "zero3", False, id="reward-zero3", marks=_DEEPSPEED),
    pytest.param("reward", "zero3", True, id="reward-zero3-bf16", marks=_DEEPSPEED),
]
#: trainer -> (optimizer steps per step, max_nonfinite_steps)
TRAINERS = {"rloo": (4, 4), "reward": (1, 1)}
LEARNING_RATE, MAX_STEPS = 2e-3, 6


@pytest.mark.parametrize(("trainer", "mode", "bf16"), CASES)
def test_nonfinite_steps_on_one_rank_are_skipped_on_every_rank_counted_and_limited(
    kit, tmp_path, trainer, mode, bf16
):
    per_step, limit = TRAINERS[trainer]
    out = tmp_path / "out"
    run_script(
        "nonfinite_distributed.py",
        [
            *("--output_dir", out, "--trainer", trainer, "--max_steps", MAX_STEPS),
            *("--nan_at", "2,4,5", "--max_nonfinite_steps", limit),
            *(["--bf16"] if bf16 else []),
        ],
        deepspeed=mode,
        env={"RLHF_TRAINERS_KIT_DIR": str(kit.root)},
        timeout=400,
    )
    results = read_rank_results(out, 2)
    for r in results:
        assert r["distributed_type"] == ("DistributedType.DEEPSPEED" if mode else "DistributedType.MULTI_CPU")
        assert r["zero_stage"] == {None: None, "zero2": 2, "zero3": 3}[mode]
        assert r["engine_bf16"] == (bf16 if mode else None)
        # stopped in step 5, at its optimizer step that went past the limit, with step 4's weights
        assert r["global_step"] == 4
        assert (
            r["error"] is not None
            and (
                f"{limit + 1} consecutive optimizer steps had NaN or inf gradients "
                f"(limit max_nonfinite_steps={limit})"
            )
            in r["error"]
        )
        after = {int(step): weights for step, weights in r["after"].items()}
        assert sorted(after) == [1, 2, 3, 4]
        assert all(finite for _, finite in [r["before"], *after.values(), r["final"]])
        assert after[1] != r["before"] and after[3] != after[2]  # the finite steps trained
        assert after[2] == after[1] and after[4] == after[3]  # the NaN steps changed nothing
        assert r["final"] == after[4]
        assert r["skipped"] == {"1": 0.0, "2": per_step, "3": per_step, "4": 2.0 * per_step}
        # a linear schedule over 6 steps, moving on over the skipped ones as on one process
        expected = {str(s): LEARNING_RATE * (1 - (s - 1) / MAX_STEPS) for s in range(1, 5)}
        assert r["lr"] == pytest.approx(expected, rel=1e-9)
    # the ranks made the same decisions and hold the same weights
    assert results[0]["after"] == results[1]["after"] and results[0]["final"] == results[1]["final"]
