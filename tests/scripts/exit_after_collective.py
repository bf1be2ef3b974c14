"""Collectives up to the last moment of a script, then exit: the case of the exit-time abort of
multi-process runs (``rlhf_trainers.distributed_exit``; docs/notes-exit-abort.md).

Each rank all-reduces a fresh tensor a number of times and ends right after the last one, so a gloo
worker thread still holds that collective's tensors when the interpreter starts finalizing. Without the
teardown handler a rank often aborts at exit ("terminate called without an active exception", exit -6);
``--teardown`` registers :func:`rlhf_trainers.distributed_exit.tear_down_process_group_at_exit` first.

Launched by ``distributed.run_script("exit_after_collective.py", [...])`` on 2 CPU ranks.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import PartialState

from rlhf_trainers.distributed_exit import tear_down_process_group_at_exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teardown", action="store_true", help="register the library's exit handler")
    parser.add_argument("--collectives", type=int, default=50)
    cli = parser.parse_args()
    state = PartialState(cpu=True)
    assert state.num_processes > 1 and torch.distributed.get_backend() == "gloo"
    if cli.teardown:
        tear_down_process_group_at_exit()
    for _ in range(cli.collectives):
        torch.distributed.all_reduce(torch.ones(4096))


if __name__ == "__main__":
    main()
