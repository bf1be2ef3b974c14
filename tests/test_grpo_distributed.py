"""GRPO on 2 CPU ranks (DDP): it learns with identical weights on both ranks (tests/scripts/grpo_distributed.py),
and every loss_type gives the gradient of the whole batch when each rank holds
half of it as 2 accumulated micro-batches, padding-free passes on the ranks giving a padded reference's
gradient too (tests/scripts/grpo_split_invariance.py, which documents the setup). Together with tests/test_grpo.py's 1 x 16 vs 4 x 4 check: 1 x 16 vs 4 x 4 vs 2 processes x 8."""

from __future__ import annotations

import pytest
from distributed import read_rank_results, run_script

from rlhf_trainers.grpo import LOSS_TYPES

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_every_loss_type_gives_the_whole_batch_gradient_on_two_processes(tmp_path):
    run_script("grpo_split_invariance.py", ["--output_dir", str(tmp_path)], timeout=900)
    for result in read_rank_results(tmp_path):
        assert sorted(result["results"]) == sorted(
            [*LOSS_TYPES, "dapo+token_budget", "dapo+packed_vs_padded", "dapo+balance_batch"]
        )
        for loss_type, r in result["results"].items():
            assert r["max_abs_gradient"] > 1e-4, loss_type  # a real gradient
            assert r["relative"] < 1e-4, (loss_type, r)
        balanced = result["results"]["dapo+balance_batch"]
        # the generated halves were unbalanced, and rows moved to balance them
        assert balanced["perf/token_imbalance_generated"] > balanced["perf/token_imbalance"] >= 1.0
        assert balanced["rows_kept"] < 8, balanced


def test_learns_on_two_processes_with_identical_weights(tmp_path):
    """DDP on 2 ranks: the eval true reward rises, both ranks end with the same weights, the metrics count
    both ranks' completions, and steps are optimizer steps (4 per generation with the kit settings)."""
    run_script("grpo_distributed.py", ["--output_dir", str(tmp_path)], timeout=900)
    rank0, rank1 = read_rank_results(tmp_path)
    assert rank0["digest"] == rank1["digest"]
    assert rank0["global_step"] == 24 and rank0["steps"] == [4, 8, 12, 16, 20, 24]
    assert set(rank0["completions_kept"]) == {64.0}  # 2 ranks x 8 prompts x 4 completions
    assert rank0["after"] - rank0["before"] > 0.25, (rank0["before"], rank0["after"])
