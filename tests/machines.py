"""Several "machines" on this one: ``accelerate launch --num_machines N --machine_rank R`` per machine, all
started together against one rendezvous at 127.0.0.1, as a multi-node job's launch script starts them on
its nodes (docs/distributed.md, "Several machines"). Each machine may get its own arguments (e.g. its own
``--output_dir``, standing for a node-local disk).

Not a test module: tests/test_two_machines.py imports it (``tests/`` is on ``sys.path`` under pytest).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from distributed import (
    ACCELERATE_CONFIGS,
    CONFIG_DIR,
    REPO_ROOT,
    TESTS_DIR,
    _kill_tree,
    _tail,
    free_port,
    launch_env,
)

__all__ = ["launch_machines", "machine_command"]


def machine_command(
    script: Path,
    args: Sequence[str],
    *,
    machine_rank: int,
    num_machines: int,
    port: int,
    deepspeed: str | None,
) -> list[str]:
    """The ``accelerate launch`` line of one machine: one process per machine, the rendezvous on
    127.0.0.1:``port`` (machine 0 hosts it)."""
    config = CONFIG_DIR / ACCELERATE_CONFIGS[deepspeed]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--num_machines", str(num_machines), "--machine_rank", str(machine_rank)]
    command += ["--num_processes", str(num_machines), "--main_process_ip", "127.0.0.1"]
    command += ["--main_process_port", str(port)]
    return [*command, str(script), *map(str, args)]


def launch_machines(
    script: str,
    args_per_machine: Sequence[Sequence[str]],
    *,
    deepspeed: str | None = None,
    timeout: float = 600,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``tests/scripts/<script>`` as ``len(args_per_machine)`` machines of one process each, machine
    R with ``args_per_machine[R]``; all must exit 0 within ``timeout`` seconds (else AssertionError with
    every machine's output tail, the others killed)."""
    path = TESTS_DIR / "scripts" / script
    port = free_port()
    count = len(args_per_machine)
    processes = []
    for rank, args in enumerate(args_per_machine):
        command = machine_command(
            path, args, machine_rank=rank, num_machines=count, port=port, deepspeed=deepspeed
        )
        processes.append(
            subprocess.Popen(
                command,
                cwd=str(REPO_ROOT),
                env=launch_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    done: list[subprocess.CompletedProcess[str]] = []
    failed = False
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failed = True
            for other in processes:
                _kill_tree(other.pid)
            stdout, stderr = process.communicate(timeout=60)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    if failed or any(c.returncode != 0 for c in done):
        report = "\n".join(
            f"--- machine {rank}: exit {c.returncode} ---\n{_tail(c.stdout, 30)}\n{_tail(c.stderr, 60)}"
            for rank, c in enumerate(done)
        )
        raise AssertionError(
            f"{script} on {count} machines, deepspeed={deepspeed!r}: failed or timed out\n{report}"
        )
    return done
