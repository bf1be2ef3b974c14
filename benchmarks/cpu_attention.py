"""Packed (one-row) attention on CPU in bf16: PyTorch's attention kernel in bf16 against float32, forward
only and forward + backward, and the engine's :func:`rlhf_trainers.packing.segment_attention` under bf16
autocast (which computes in float32 on CPU for what this measures).

The shapes are SmolLM2-135M's (9 query heads, 3 key/value heads of 64) over ``--sequences`` sequences of
10-110 tokens (seeded) packed into one row, one ``scaled_dot_product_attention`` call per sequence, as
the engine's padding-free passes run them. Four variants, each timed as the median of ``--repeats`` calls
after a warm-up, per layer:

- ``kernel_bf16``: the bf16 inputs straight to the kernel (what the engine did before);
- ``kernel_fp32``: the bf16 inputs cast to float32, the output cast back to bf16;
- ``segment_attention``: the engine's function under ``torch.autocast("cpu", torch.bfloat16)``.

    python benchmarks/cpu_attention.py --out benchmarks/results/cpu_attention.json

Writes JSON (and prints a markdown table). Timings on a shared machine are noisy: compare within a run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from floors import median_seconds  # noqa: E402

HEADS, KV_HEADS, HEAD_SIZE = 9, 3, 64


def timed(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn`` (after two more warm-up calls than :func:`floors.median_seconds`'s one)."""
    fn()
    fn()
    return median_seconds(fn, repeats)


def measure(sequences: int, repeats: int, seed: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from rlhf_trainers.packing import one_row_attention, segment_attention

    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(10, 111, (sequences,), generator=gen)]
    n = sum(lengths)
    q = torch.randn(1, HEADS, n, HEAD_SIZE, generator=gen).bfloat16()
    k = torch.randn(1, KV_HEADS, n, HEAD_SIZE, generator=gen).bfloat16()
    v = torch.randn(1, KV_HEADS, n, HEAD_SIZE, generator=gen).bfloat16()
    module = torch.nn.Module()

    def kernel(dtype: torch.dtype, grad: bool) -> Any:
        def run() -> None:
            leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
            with torch.set_grad_enabled(grad):
                qq, kk, vv = (t.to(dtype) for t in leaves)
                outs = [
                    F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True).transpose(1, 2)
                    for a, b, c in zip(
                        qq.split(lengths, 2), kk.split(lengths, 2), vv.split(lengths, 2), strict=True
                    )
                ]
                out = torch.cat(outs, 1).bfloat16()
                if grad:
                    out.float().sum().backward()

        return run

    def engine(grad: bool) -> Any:
        def run() -> None:
            leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
            with torch.set_grad_enabled(grad), torch.autocast("cpu", torch.bfloat16):
                with one_row_attention([], tuple(lengths)):
                    out, _ = segment_attention(module, *leaves, None)
            if grad:
                out.float().sum().backward()

        return run

    rows = []
    for grad in (False, True):
        pass_name = "forward + backward" if grad else "forward (no grad)"
        variants = {
            "kernel_bf16": kernel(torch.bfloat16, grad),
            "kernel_fp32": kernel(torch.float32, grad),
            "segment_attention": engine(grad),
        }
        for name, fn in variants.items():
            rows.append({"pass": pass_name, "variant": name, "ms_per_layer": 1e3 * timed(fn, repeats)})
    return {"lengths": lengths, "tokens": n, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result = {
        "benchmark": "cpu_attention",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE},
        **measure(args.sequences, args.repeats, args.seed),
    }
    lines = ["| pass | variant | ms per layer |", "|---|---|---:|"]
    lines += [f"| {r['pass']} | {r['variant']} | {r['ms_per_layer']:.2f} |" for r in result["rows"]]
    print("\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
