"""The fused lm head's forward + backward (``functional.logprobs_and_entropy_from_hidden``) at SmolLM2-135M's
head (49,152 x 576, float32), with the backward pass's tiles reshaped to more rows (the default) or kept
those of the forward pass (``row_chunk_size`` x ``vocab_chunk_size``, as before issue #24's change), the
trainers' tile (``logprob_chunk_size=128`` rows x 8,192), one thread, the two alternating.

    python benchmarks/fused_head.py --out benchmarks/results

Writes ``<out>/fused_head_cpu.json``: per number of response tokens, the median seconds of each and the
largest gradient difference between them (summation order only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from rlhf_trainers.functional import logprob_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[330, 660, 1320])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--row-chunk", type=int, default=128)
    parser.add_argument("--vocab-chunk", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="leave glibc's malloc as it is (default: freed memory kept in the process, as the trainers' "
        "reuse_host_memory=True and benchmarks/vs_trl.py run, so a (V, H) gradient buffer is not fresh "
        "pages at every backward pass)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.glibc_defaults:
        from rlhf_trainers.cpu import reuse_freed_host_memory

        reuse_freed_host_memory()
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    reshaped = logprob_kernels._backward_tile
    variants = {"forward_tiles": lambda n, v, rows, columns: (rows, columns), "reshaped": reshaped}
    rows_out = []
    try:
        for n in args.tokens:
            hidden = torch.randn(n, args.hidden).requires_grad_()
            tokens = torch.randint(0, args.vocab, (n,))
            seconds: dict[str, list[float]] = {name: [] for name in variants}
            grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for round_ in range(args.repeats + 1):  # the first round warms up
                for name, tile in variants.items():
                    logprob_kernels._backward_tile = tile
                    began = time.perf_counter()
                    logprobs, _ = logprob_kernels.logprobs_and_entropy_from_hidden(
                        hidden,
                        weight,
                        tokens,
                        row_chunk_size=args.row_chunk,
                        vocab_chunk_size=args.vocab_chunk,
                        with_entropy=False,
                    )
                    logprobs.sum().backward()
                    seconds[name].append(time.perf_counter() - began)
                    if round_ == args.repeats:  # kept for the comparison: the last round's only
                        grads[name] = (hidden.grad, weight.grad)
                    hidden.grad = weight.grad = None
            medians = {name: statistics.median(times[1:]) for name, times in seconds.items()}
            difference = max(
                (a - b).abs().max().item()
                for a, b in zip(grads["forward_tiles"], grads["reshaped"], strict=True)
            )
            rows_out.append(
                {
                    "tokens": n,
                    "backward_tile": list(reshaped(n, args.vocab, args.row_chunk, args.vocab_chunk)),
                    "seconds": medians,
                    "speedup": medians["forward_tiles"] / medians["reshaped"],
                    "max_grad_difference": difference,
                }
            )
            print(json.dumps(rows_out[-1]), flush=True)
    finally:
        logprob_kernels._backward_tile = reshaped
    result = {
        "settings": vars(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "rows": rows_out,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fused_head_cpu.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
