"""The builtin sampling loop's draw per decoding step: ``torch.multinomial`` (``generate``'s draws) against
inverse-CDF draws (``inverse_cdf_sampling=True``, :func:`rlhf_trainers.generation.draw_inverse_cdf`), at
SmolLM2's vocabulary (49,152 entries) and the row counts of the benchmarks' rollouts, one thread, the two
alternating; and how far apart their token frequencies are on one skewed distribution (the same
distribution: the gap is sampling error).

    python benchmarks/sampler_draws.py --out benchmarks/results

Writes ``<out>/sampler_draws_cpu.json``: per row count, the median milliseconds per step of each, and
the total-variation distance between the two methods' token frequencies over ``--draws`` draws together
with its expected size for two independent samples of that many draws.
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

from rlhf_trainers.generation import draw_inverse_cdf, draw_multinomial


def _median_ms(fn, probs: torch.Tensor, repeats: int) -> float:
    fn(probs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(probs)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--draws", type=int, default=200_000, help="draws per method for the frequencies")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # logits of a trained model's spread: a few likely tokens, a long tail (scale 3 of a standard normal)
    methods = {"multinomial": draw_multinomial, "inverse_cdf": draw_inverse_cdf}
    timings = []
    for rows in args.rows:
        probs = torch.softmax(torch.randn(rows, args.vocab) * 3, dim=-1)
        ms: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(3):  # alternate, so that the machine's drift hits both alike
            for name, fn in methods.items():
                ms[name].append(_median_ms(fn, probs, args.repeats))
        entry = {"rows": rows, **{f"{name}_ms": statistics.median(v) for name, v in ms.items()}}
        entry["speedup"] = entry["multinomial_ms"] / entry["inverse_cdf_ms"]
        timings.append(entry)
        print(json.dumps(entry), flush=True)
    # the same distribution: frequencies of one skewed 1,000-entry row, drawn by both methods
    probs = torch.softmax(torch.randn(1, 1000) * 3, dim=-1)
    block = probs.expand(10_000, -1).contiguous()
    counts = {}
    for name, fn in methods.items():
        drawn = torch.cat([fn(block) for _ in range(max(1, args.draws // 10_000))])
        counts[name] = torch.bincount(drawn, minlength=1000).double() / drawn.numel()
    n = max(1, args.draws // 10_000) * 10_000
    tv = 0.5 * (counts["multinomial"] - counts["inverse_cdf"]).abs().sum().item()
    tv_to_probs = {name: 0.5 * (c - probs[0].double()).abs().sum().item() for name, c in counts.items()}
    # E|X - Y| for two independent binomial frequencies ~ sqrt(2 p (1 - p) / n) * sqrt(2 / pi)
    p = probs[0].double()
    expected = 0.5 * (torch.sqrt(2 * p * (1 - p) / n) * (2 / torch.pi) ** 0.5).sum().item()
    report = {
        "benchmark": "sampler_draws",
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": args.threads,
        "vocab": args.vocab,
        "timings": timings,
        "frequencies": {
            "draws_per_method": n,
            "total_variation_between_methods": tv,
            "expected_for_independent_samples": expected,
            "total_variation_to_probs": tv_to_probs,
        },
    }
    print(json.dumps(report["frequencies"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler_draws_cpu.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
