"""Multi-turn tool rollouts on 2 CPU ranks (tests/scripts/agent_distributed.py): the episodes of rank 0
take 3 assistant turns, those of rank 1 one, so the ranks need different numbers of generation rounds
(and of calls per round); each generation call is a collective (a shared failure check; under ZeRO-3 the
weights are gathered per call, or the forward passes run in step). The run must finish (not deadlock),
both ranks must end with the same weights, and the tool metrics must count both ranks' episodes, in
training and in evaluation. The same with the tool as an environment's method (``environment_factory``):
each episode has its own environment on its own rank, and its ``get_reward`` is gathered like a reward."""

from __future__ import annotations

import pytest
from distributed import deepspeed_available, read_rank_results, requires_deepspeed, run_script

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MODES = [
    pytest.param(None, [], id="ddp"),
    pytest.param(None, ["--environment"], id="ddp-environment"),
    pytest.param("zero3", [], id="zero3", marks=[pytest.mark.deepspeed, requires_deepspeed]),
    pytest.param(  # generation in step, the weights fetched layer by layer: slow on CPU, so 1 step
        "zero3",
        ["--no_gather_for_generation", "--max_steps", "1"],
        id="zero3-synced-generation",
        marks=[pytest.mark.deepspeed, requires_deepspeed],
    ),
]


@pytest.mark.parametrize(("deepspeed", "flags"), MODES)
def test_tool_episodes_of_different_lengths_on_two_processes(deepspeed, flags, tmp_path):
    assert deepspeed is None or deepspeed_available()
    run_script(
        "agent_distributed.py", ["--output_dir", str(tmp_path), *flags], deepspeed=deepspeed, timeout=600
    )
    rank0, rank1 = read_rank_results(tmp_path)
    assert rank0["zero_stage"] == (3 if deepspeed else None)
    steps = 1 if "--max_steps" in flags else 2
    assert rank0["global_step"] == steps
    assert rank0["digest"] == rank1["digest"] != rank0["before"]
    assert len(rank0["logged"]) == steps
    for metrics in [*rank0["logged"], rank0["eval"]]:
        prefix = "eval_" if "eval_tools/call_frequency" in metrics else ""
        # rank 0: 2 calls and 3 turns per episode; rank 1: no call, 1 turn
        assert metrics[f"{prefix}tools/call_frequency"] == pytest.approx(1.0), metrics
        assert metrics[f"{prefix}tools/turns_per_episode"] == pytest.approx(2.0), metrics
    assert rank1["logged"] == rank0["logged"] and rank1["eval"] == rank0["eval"]
    if "--environment" in flags:  # each episode's own environment: rank 0's counted 2 calls, rank 1's none
        assert all(m["rewards/AddEnv/mean"] == pytest.approx(1.0) for m in rank0["logged"]), rank0["logged"]
