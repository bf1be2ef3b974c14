"""oneDNN against PyTorch's default float32 GEMM (MKL on x86) at a training micro-batch's shapes, and the
resident memory oneDNN keeps for the shapes it has met (issue #7: why ``onednn_linear`` covers the
decoding steps only; see ``rlhf_trainers/cpu_linear.py``).

Two measurements:

1. **rates**: GFLOP/s of a linear layer's forward (``x @ W.T``) and input gradient (``g @ W``) through
   oneDNN (``torch.ops.mkldnn._linear_pointwise``) and through ``F.linear`` / ``torch.matmul``, and of the
   weight gradient (``g.T @ x``, PyTorch's), for ``--rows`` rows against SmolLM2-135M's weight shapes
   (576 x 576, 1536 x 576, 576 x 1536 and an 8192 x 576 lm-head tile); median of ``--repeats`` timed calls.
2. **growth**: resident memory (RSS) added by ``--shapes`` row counts x 3 weight shapes through oneDNN,
   forward and input gradient, each configuration in a fresh process (the two cache capacities are read
   at a process's first oneDNN call): oneDNN's defaults, only ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` lowered,
   and both it and ideep's ``LRU_CACHE_CAPACITY`` lowered to ``--capacity``.

    python benchmarks/onednn_shapes.py --out benchmarks/results/onednn_shapes_cpu.json

Writes JSON (and prints a markdown table). Timings on a shared machine are noisy: compare within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WEIGHTS = ((576, 576), (1536, 576), (576, 1536), (8192, 576))


def rates(rows: list[int], repeats: int) -> list[dict[str, Any]]:
    """GFLOP/s of forward, input gradient and weight gradient at each (rows, weight shape)."""
    import torch

    op = torch.ops.mkldnn._linear_pointwise

    def median_seconds(fn: Any) -> float:
        fn()
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out = []
    for n in rows:
        for o, i in WEIGHTS:
            x, w, g = torch.randn(n, i), torch.randn(o, i), torch.randn(n, o)
            flops = 2.0 * n * o * i
            timed = {
                "forward_onednn": median_seconds(lambda: op(x, w, None, "none", [], "")),  # noqa: B023
                "forward_pytorch": median_seconds(lambda: torch.nn.functional.linear(x, w)),  # noqa: B023
                "input_grad_onednn": median_seconds(lambda: op(g, w.t(), None, "none", [], "")),  # noqa: B023
                "input_grad_pytorch": median_seconds(lambda: g @ w),  # noqa: B023
                "weight_grad_pytorch": median_seconds(lambda: g.t().mm(x)),  # noqa: B023
            }
            out.append(
                {"rows": n, "out": o, "in": i, **{k: round(flops / v / 1e9, 1) for k, v in timed.items()}}
            )
    return out


_GROWTH = r"""
import sys
import torch
op = torch.ops.mkldnn._linear_pointwise
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
weights = [torch.randn(o, i) for o, i in ((576, 576), (192, 576), (1536, 576))]
op(torch.randn(1, 576), weights[0], None, "none", [], "")
before = rss_mib()
for rows in range(100, 100 + int(sys.argv[1])):
    x = torch.randn(rows, 576)
    for w in weights:
        y = op(x, w, None, "none", [], "")
        op(y, w.t(), None, "none", [], "")
print(rss_mib() - before)
"""


def growth(shapes: int, capacity: int) -> dict[str, float]:
    """RSS growth (MiB) over ``shapes`` row counts x 3 weight shapes, per cache configuration."""
    names = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    base = {k: v for k, v in os.environ.items() if k not in names}
    configs = {
        "defaults (1024, 1024)": {},
        f"ONEDNN_PRIMITIVE_CACHE_CAPACITY={capacity} only": {names[0]: str(capacity)},
        f"both {capacity}": {names[0]: str(capacity), names[1]: str(capacity)},
    }
    out = {}
    for label, extra in configs.items():
        run = subprocess.run(
            [sys.executable, "-c", _GROWTH, str(shapes)],
            env={**base, **extra},
            capture_output=True,
            text=True,
            check=True,
        )
        out[label] = round(float(run.stdout.split()[-1]), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[240, 1024], help="rows of a micro-batch pass")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", type=int, default=300, help="row counts for the growth measurement")
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = {
        "benchmark": "onednn_shapes",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rates_gflops": rates(args.rows, args.repeats),
        "growth_mib": growth(args.shapes, args.capacity),
        "growth_shapes": f"{args.shapes} row counts x 3 weight shapes, forward + input gradient",
    }
    print(
        "| rows | weight | fwd oneDNN | fwd PyTorch | d input oneDNN | d input PyTorch | d weight PyTorch |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in result["rates_gflops"]:
        print(
            f"| {r['rows']} | {r['out']} x {r['in']} | {r['forward_onednn']} | {r['forward_pytorch']} | "
            f"{r['input_grad_onednn']} | {r['input_grad_pytorch']} | {r['weight_grad_pytorch']} |"
        )
    print(f"\nRSS growth, {result['growth_shapes']}:")
    for label, mib in result["growth_mib"].items():
        print(f"- {label}: +{mib} MiB")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
