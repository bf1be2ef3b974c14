"""A run started as two "machines" on this one (``accelerate launch --num_machines 2 --machine_rank 0/1
--main_process_ip 127.0.0.1``, one process each), as a multi-node job starts: RLOO on the kit
(tests/scripts/rloo_distributed.py), DDP and ZeRO-3, checkpoints written with and without
``save_on_each_node``, and a resume that ends where the uninterrupted run ends.

A node-local disk is stood for by a folder per machine (each machine's ``--output_dir``); a shared
filesystem by one folder for both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import requires_deepspeed
from machines import launch_machines

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SCRIPT = "rloo_distributed.py"
BASE = ["--max_steps", "4", "--num_eval_prompts", "16"]


def _result(folder: Path, rank: int) -> dict:
    return json.loads((folder / f"result-rank{rank}.json").read_text())


def _run(
    folders: list[Path], *extra: str, deepspeed: str | None = None, resume: str | None = None
) -> list[dict]:
    """One launch on two machines, machine R writing to ``folders[R]`` (and resuming from its checkpoint
    ``resume`` there); each machine's rank result."""
    args = [[*BASE, "--output_dir", str(folder), *extra] for folder in folders]
    if resume is not None:
        args = [
            [*a, "--resume_from_checkpoint", str(folder / resume)]
            for a, folder in zip(args, folders, strict=True)
        ]
    launch_machines(SCRIPT, args, deepspeed=deepspeed)
    return [_result(folder, rank) for rank, folder in enumerate(folders)]


def test_node_local_checkpoints_with_save_on_each_node_resume_where_the_run_ends(tmp_path):
    """DDP over two machines with node-local disks: with save_on_each_node each machine writes a whole
    checkpoint to its own disk (the model, its process's RNG state), and resuming each machine from its
    own checkpoint of update 2 ends with the uninterrupted run's weights; without it only the first
    machine's disk gets a checkpoint."""
    local = [tmp_path / "node0", tmp_path / "node1"]
    full = _run(local, "--save_steps", "2", "--save_on_each_node")
    assert [r["world_size"] for r in full] == [2, 2] and full[0]["global_step"] == 4
    assert full[0]["policy_digest"] == full[1]["policy_digest"]  # DDP: both machines hold the same weights
    for rank, folder in enumerate(local):
        checkpoint = folder / "checkpoint-2"
        assert (checkpoint / "model.safetensors").is_file(), sorted(p.name for p in checkpoint.iterdir())
        assert (checkpoint / "config.json").is_file() and (checkpoint / "onpolicy_state.json").is_file()
        assert (checkpoint / f"rng_state_{rank}.pth").is_file()
    resumed = _run(local, "--save_on_each_node", resume="checkpoint-2")  # each from its own disk
    assert [r["updates_run"] for r in resumed] == [2, 2] and resumed[0]["global_step"] == 4
    assert resumed[0]["policy_digest"] == resumed[1]["policy_digest"] == full[0]["policy_digest"]

    first_only = [tmp_path / "plain0", tmp_path / "plain1"]
    _run(first_only, "--max_steps", "2", "--save_steps", "2")
    assert (first_only[0] / "checkpoint-2" / "model.safetensors").is_file()
    assert not (first_only[1] / "checkpoint-2").exists()  # the second machine's disk gets none


@pytest.mark.deepspeed
@requires_deepspeed
def test_zero3_on_two_machines_resumes_from_a_shared_checkpoint_where_the_run_ends(tmp_path):
    """ZeRO-3 across two machines sharing one filesystem: each writes its shards of checkpoint-2 into the
    shared folder, and the run resumed from it ends with the uninterrupted run's weights."""
    shared = [tmp_path / "shared"] * 2
    full = _run(shared, "--save_steps", "2", deepspeed="zero3")
    assert full[0]["zero_stage"] == 3 and full[0]["world_size"] == 2
    assert (shared[0] / "checkpoint-2" / "onpolicy_state.json").is_file()
    resumed = _run(shared, deepspeed="zero3", resume="checkpoint-2")
    assert [r["updates_run"] for r in resumed] == [2, 2]
    assert resumed[0]["policy_digest"] == full[0]["policy_digest"]
