"""Balanced ranks (``balance_batch``, verl's name): before the optimizer steps of an update, the rollout's
rows are redistributed over the processes so that each holds about the same number of real tokens,
instead of the rows its own prompts produced.

Why it is safe where it runs: the rows move after step 4, once the advantages exist, so a prompt's
completions (RLOO's and GRPO's groups) were all on one process when their baseline was computed; after
that every row's loss terms are its own, and the loss denominators are the whole optimizer step's,
summed over the processes (:class:`~rlhf_trainers.onpolicy.rollout.LossNormalization`), so the update
does not depend on which process trains which row. Every process keeps the same number of rows (DDP runs
the same number of backward passes on every process), and the update's metrics are computed from the
rollout as it was generated.

Why it pays: with responses that stop at EOS the processes' token counts differ, and every optimizer step
waits for the slowest process's micro-batches. The assignment is the longest-processing-time rule with
equal row counts: rows heaviest first, each to the process with the fewest tokens among those with room.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

__all__ = ["balanced_assignment", "rebalance", "token_imbalance"]

T = TypeVar("T")


def balanced_assignment(tokens: Sequence[int], processes: int) -> list[list[int]]:
    """Global row indices for each process: ``len(tokens) / processes`` rows each (``len(tokens)`` must be a
    multiple), rows heaviest first to the process with the fewest tokens that still has room (ties: the
    lowest process index; rows of equal tokens in index order), so the result is the same on every
    process. Each process's rows are returned in increasing index order."""
    if processes < 1 or len(tokens) % processes:
        raise ValueError(f"{len(tokens)} rows cannot be split evenly over {processes} processes.")
    room = len(tokens) // processes
    order = sorted(range(len(tokens)), key=lambda i: (-int(tokens[i]), i))
    loads = [0] * processes
    rows: list[list[int]] = [[] for _ in range(processes)]
    for i in order:
        target = min((p for p in range(processes) if len(rows[p]) < room), key=lambda p: (loads[p], p))
        rows[target].append(i)
        loads[target] += int(tokens[i])
    return [sorted(r) for r in rows]


def token_imbalance(per_process: Sequence[float]) -> float:
    """The busiest process's tokens over the mean (1.0: balanced)."""
    mean = sum(per_process) / max(len(per_process), 1)
    return max(per_process) / mean if mean > 0 else 1.0


def _row_fields(obj: Any, rows: int) -> dict[str, Any]:
    """The fields of dataclass ``obj`` with one entry per row: tensors whose first dimension is ``rows``,
    lists of ``rows`` items, dicts of such tensors (moved to the CPU for the exchange)."""
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            fields[field.name] = value.cpu()
        elif isinstance(value, list) and len(value) == rows:
            fields[field.name] = value
        elif (
            isinstance(value, dict)
            and value
            and all(isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows for v in value.values())
        ):
            fields[field.name] = {k: v.cpu() for k, v in value.items()}
    return fields


def _take(parts: list[Any], picks: list[tuple[int, int]], pad_left: dict[int, Any]) -> Any:
    """Rows ``picks`` ((process, local row) pairs) of the processes' ``parts`` (tensors, lists or dicts of
    tensors) joined into one; tensors whose widths differ between processes are padded on the left with
    ``pad_left[id of the part list]``'s value (the prompt columns) so that they stack."""
    first = parts[0]
    if isinstance(first, list):
        return [parts[p][i] for p, i in picks]
    if isinstance(first, dict):
        return {k: _take([part[k] for part in parts], picks, pad_left) for k in first}
    width = max(part.shape[1] for part in parts) if first.dim() > 1 else 0
    if first.dim() > 1 and any(part.shape[1] != width for part in parts):
        fill = pad_left.get(id(parts))
        if fill is None:
            raise ValueError("rows of different widths can only be balanced for the prompt columns")
        parts = [
            torch.cat([part.new_full((part.shape[0], width - part.shape[1], *part.shape[2:]), fill), part], 1)
            for part in parts
        ]
    return torch.stack([parts[p][i] for p, i in picks]) if picks else first[:0]


def rebalance(
    rollout: T, advantages: Any, *, pad_token_id: int, device: torch.device
) -> tuple[T, Any, dict[str, float]]:
    """This process's rows of the update after balancing (see the module docstring): the rollout and
    advantages with the rows :func:`balanced_assignment` gives this process, from every process, and the
    metrics ``perf/token_imbalance`` (after) and ``perf/token_imbalance_generated`` (before). A collective:
    every process calls it. Real tokens of a row: its prompt's and its response's (``query_mask``,
    ``response_mask``)."""
    import torch.distributed as dist

    rows = rollout.response.shape[0]
    mine = {"rollout": _row_fields(rollout, rows), "advantages": _row_fields(advantages, rows)}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    tokens = [
        int(q + r)
        for part in gathered
        for q, r in zip(
            part["rollout"]["query_mask"].sum(1).tolist(),
            part["rollout"]["response_mask"].sum(1).tolist(),
            strict=True,
        )
    ]
    processes = len(gathered)
    assignment = balanced_assignment(tokens, processes)
    per_process_before = [sum(tokens[p * rows : (p + 1) * rows]) for p in range(processes)]
    per_process_after = [sum(tokens[i] for i in part) for part in assignment]
    picks = [divmod(i, rows) for i in assignment[dist.get_rank()]]

    def rebuilt(obj: Any, key: str) -> Any:
        changes: dict[str, Any] = {}
        for name in mine[key]:
            parts = [part[key][name] for part in gathered]
            pads = {id(parts): pad_token_id if name == "query" else False} if name.startswith("query") else {}
            taken = _take(parts, picks, pads)
            if isinstance(taken, torch.Tensor):
                taken = taken.to(device)
            elif isinstance(taken, dict):
                taken = {k: v.to(device) for k, v in taken.items()}
            changes[name] = taken
        return dataclasses.replace(obj, **changes)

    metrics = {
        "perf/token_imbalance": token_imbalance(per_process_after),
        "perf/token_imbalance_generated": token_imbalance(per_process_before),
    }
    return rebuilt(rollout, "rollout"), rebuilt(advantages, "advantages"), metrics
