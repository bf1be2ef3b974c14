"""The multi-process test infrastructure (``tests/distributed.py``), proven with a plain
``transformers.Trainer`` before the trainers of this package rely on it.

The DDP test launches ``tests/scripts/plain_trainer.py`` on 2 CPU ranks (gloo) through the user-facing
accelerate config ``examples/accelerate_configs/multi_gpu.yaml`` and checks what the ranks report: both
saw a world of 2, the loss went down, the weights are bitwise identical on both ranks, and the saved
checkpoint, reloaded here with ``from_pretrained``, holds exactly those weights.

The DeepSpeed configs are proven by the trainers' own launches: ``tests/test_reward_distributed.py``
(a ``transformers.Trainer`` subclass) checks DeepSpeed's engine, its ZeRO stage, the weights partitioned
as ``from_pretrained`` loads them under ZeRO-3 and the full tensors in the saved checkpoint; the
plain-Trainer launches of ZeRO-2 and ZeRO-3 that stood here checked the same and were removed to keep
CI's time.

The DDP launch uses ``accelerate launch`` itself; the trainer tests start the same ranks as forks of a
preloaded server (``run_script(launcher="forked")``, the default), and the launcher tests below check both
ways: a failure's output, a failing rank stopping the others, a timeout killing every rank. What the
forked ranks' environments hold is checked against accelerate's own launch code by
``test_forked_ranks_get_the_environment_of_accelerate_launch``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import distributed
import psutil
import pytest
from distributed import (
    ACCELERATE_CONFIGS,
    LAUNCHERS,
    launch_command,
    parameter_digest,
    read_rank_results,
    run_script,
)
from transformers import AutoModelForSequenceClassification

from rlhf_trainers.testing import OfflineKit

NUM_PROCESSES = 2
MAX_STEPS = 8


def _run_plain_trainer(kit: OfflineKit, tmp_path, deepspeed: str | None) -> list[dict]:
    # The kit fixture builds the kit once here, so the ranks never race to build it.
    out = tmp_path / "out"
    run_script(
        "plain_trainer.py",
        ["--output_dir", str(out), "--max_steps", str(MAX_STEPS)],
        num_processes=NUM_PROCESSES,
        deepspeed=deepspeed,
        env={"RLHF_TRAINERS_KIT_DIR": str(kit.root)},
        timeout=600,
        launcher="accelerate",  # the harness's proof: the real launcher (the trainer tests fork their ranks)
    )
    results = read_rank_results(out, NUM_PROCESSES)

    for r in results:
        assert r["torch_world_size"] == NUM_PROCESSES
        assert r["backend"] == "gloo"
        assert r["device"].startswith("cpu")
        assert r["global_step"] == MAX_STEPS
        assert len(r["train_losses"]) == MAX_STEPS
        # Labels are 1 + true_reward and the untrained head scores ~0: the loss starts near 1.
        assert r["loss_before"] > 0.5
        assert r["loss_after"] < 0.25 * r["loss_before"], r
        # Trainer's distributed evaluation (half the rows per rank, gathered) agrees with the
        # single-rank computation over all rows: no loss scaling by the world size, no dropped rows.
        assert r["eval_loss"] == pytest.approx(r["loss_after"], rel=1e-4)
    # Every rank ends with the same weights (gradients were all-reduced, ZeRO shards re-gathered) and
    # evaluated the same model.
    assert len({r["param_digest"] for r in results}) == 1, [r["param_digest"] for r in results]
    assert len({r["loss_after"] for r in results}) == 1

    # The checkpoint reloads, in this process, into exactly the trained weights.
    reloaded = AutoModelForSequenceClassification.from_pretrained(out)
    original = kit.load_model("gpt2-seqcls")
    assert parameter_digest(reloaded) == (results[0]["param_digest"], results[0]["param_numel"])
    assert results[0]["param_numel"] == sum(p.numel() for p in original.parameters())
    assert parameter_digest(original)[0] != results[0]["param_digest"]
    return results


@pytest.mark.multiprocess
def test_ddp_two_ranks_gloo(kit, tmp_path):
    results = _run_plain_trainer(kit, tmp_path, deepspeed=None)
    for r in results:
        assert r["distributed_type"] == "MULTI_CPU"
        assert r["engine"] == "DistributedDataParallel"
        assert r["deepspeed_zero_stage"] is None


def test_launch_command_uses_the_example_configs(tmp_path):
    """Cheap checks of the launcher itself (no processes started)."""
    for deepspeed, config in ACCELERATE_CONFIGS.items():
        command = launch_command("s.py", ["--a", 1], deepspeed=deepspeed, port=12345)
        assert command[command.index("--config_file") + 1].endswith(config)
        assert command[command.index("--num_processes") + 1] == "2"
        assert command[command.index("--main_process_port") + 1] == "12345"
        assert command[-3:] == ["s.py", "--a", "1"]
        assert "--cpu" not in command  # it would start a single process
    single = launch_command("s.py", num_processes=1)
    assert single[single.index("--config_file") + 1].endswith("single_gpu.yaml")
    with pytest.raises(ValueError, match="zero1"):
        launch_command("s.py", deepspeed="zero1")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_run_script_failure_shows_the_output_tail(tmp_path, launcher):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('about to fail')\nsys.exit('the reason it failed')\n")
    with pytest.raises(AssertionError, match=r"(?s)exited with 1.*about to fail.*the reason it failed"):
        run_script(script, num_processes=1, timeout=120, launcher=launcher)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failing_rank_stops_the_others(tmp_path, launcher):
    """As torch's elastic agent does: once rank 1 fails, rank 0 (which would wait 10 minutes) is stopped
    with SIGTERM and the launch reports the failure. (At the timeout the forked launcher would SIGKILL
    rank 0, and an accelerate launch would report "timed out": neither leaves rank 0's mark.)"""
    ready, stopped = tmp_path / "rank0-ready", tmp_path / "rank0-got-sigterm"
    script = tmp_path / "one_fails.py"
    script.write_text(
        "import os, pathlib, signal, sys, time\n"
        f"ready, stopped = pathlib.Path({str(ready)!r}), pathlib.Path({str(stopped)!r})\n"
        "if os.environ['RANK'] == '1':\n"
        "    while not ready.exists():  # fail once rank 0 can record its SIGTERM\n"
        "        time.sleep(0.05)\n"
        "    sys.exit('rank 1 gives up')\n"
        "def on_sigterm(signum, frame):\n"
        "    stopped.touch()\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "signal.signal(signal.SIGTERM, on_sigterm)\n"
        "ready.touch()\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(AssertionError, match=r"(?s)exited with 1.*rank 1 gives up"):
        run_script(script, timeout=300, launcher=launcher)
    assert stopped.exists(), "rank 0 was not stopped once rank 1 failed"


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_run_script_timeout_kills_the_ranks_too(tmp_path, launcher):
    script = tmp_path / "hangs.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(tmp_path)!r}, 'pid-' + os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(AssertionError, match="timed out"):
        run_script(script, timeout=12, launcher=launcher)  # the ranks start within ~3 s
    for rank in range(2):  # killed with their launcher: nothing left running
        pid = int((tmp_path / f"pid-{rank}").read_text())
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"rank {rank} (pid {pid}) still runs"


@pytest.mark.multiprocess
@pytest.mark.parametrize("deepspeed", [None, "zero3"])
def test_forked_ranks_get_the_environment_of_accelerate_launch(tmp_path, deepspeed):
    """Each forked rank's environment is that of the rank ``accelerate launch`` starts for the same
    command (accelerate's variables, the DeepSpeed config and fields, the rank variables, PYTHONPATH),
    except the rendezvous port and the variables of torch's elastic agent, which does not run."""
    script = tmp_path / "dump.py"
    script.write_text(
        "import json, os, pathlib, sys\n"
        "pathlib.Path(sys.argv[1], os.environ['RANK'] + '.json').write_text(json.dumps(dict(os.environ)))\n"
    )
    seen = {}
    for launcher in LAUNCHERS:
        (tmp_path / launcher).mkdir()
        run_script(script, [str(tmp_path / launcher)], deepspeed=deepspeed, launcher=launcher, timeout=300)
        seen[launcher] = [json.loads((tmp_path / launcher / f"{r}.json").read_text()) for r in range(2)]
    agent_only = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
    for rank in range(2):
        real, ours = seen["accelerate"][rank], seen["forked"][rank]
        assert real.keys() - ours.keys() == agent_only
        assert ours.keys() <= real.keys()
        differ = {k for k in ours if ours[k] != real[k]}
        assert differ == {"MASTER_PORT"}, {k: (real[k], ours[k]) for k in differ}
    assert seen["forked"][0]["RANK"] == "0" and seen["forked"][1]["WORLD_SIZE"] == "2"
    if deepspeed:
        assert seen["forked"][0]["ACCELERATE_USE_DEEPSPEED"] == "true"
        assert seen["forked"][0]["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"


def test_a_build_lock_left_by_a_killed_build_is_removed_before_a_deepspeed_launch(tmp_path, monkeypatch):
    # torch's JIT build of DeepSpeed's comm op waits forever on <build folder>/lock; a build killed mid-way
    # leaves it, and every DeepSpeed test then hangs into its timeout
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - distributed.STALE_BUILD_LOCK_S - 60
    os.utime(stale, (old, old))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert distributed.torch_extensions_root() == tmp_path
    assert distributed.clear_stale_build_locks() == [stale]
    assert not stale.exists() and fresh.exists()  # a young lock may be a build in progress: kept
    # run_script clears them before a DeepSpeed launch (a rank that would wait on it sees it gone)
    stale.touch()
    os.utime(stale, (old, old))
    script = tmp_path / "sees_lock.py"
    script.write_text(f"import pathlib, sys\nsys.exit(3 if pathlib.Path({str(stale)!r}).exists() else 0)\n")
    run_script(script, num_processes=1, deepspeed="zero2", timeout=120)
    assert not stale.exists() and fresh.exists()


def test_torch_extensions_root_follows_torchs_rule(monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    root = distributed.torch_extensions_root()
    assert Path(_get_build_directory("probe_op", verbose=False)) == root / "probe_op"
