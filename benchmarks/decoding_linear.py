"""The linear products of one decoding step of SmolLM2-135M on CPU through each of the three routes the
builtin sampling loop can take: PyTorch's default ``F.linear`` (MKL on x86, which packs every weight at
every call), MKL on weights packed once (``mkl_prepacked_decoding``) and oneDNN (``onednn_linear``).
Whether ``onednn_linear`` (off by default) could pay on a given CPU, measured on the products alone; a
decision needs the whole generation too (``benchmarks/vs_trl.py --impls ours --ours-config
'{"onednn_linear": true}'``): on a 2-core AMD EPYC (2026-11-27) oneDNN's products were ~10 %
faster here and the whole PPO generation was not (docs/benchmarks.md).

A step here is every linear layer of the 30 decoder layers (q, k, v, o, gate, up, down) and the 49,152 x
576 lm head, for ``--rows`` rows of one position each, in model order (each weight read once per step, as
a decoding step reads it; the 540 MB of float32 weights do not fit in cache, so a step streams them from
memory). The weights are random at SmolLM2-135M's shapes (the time of a float32 product does not depend
on the values). The three routes alternate within every round; the medians over ``--rounds`` rounds are
reported, with the resident memory the packed copies add.

    python benchmarks/decoding_linear.py --rows 8 16 32 --out benchmarks/results

Writes ``decoding_linear_<vendor>.json`` (vendor from ``/proc/cpuinfo``) and prints a markdown table.
One thread by default (``--threads``), as the benchmarks against TRL run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
#: (out, in) of each linear layer of one SmolLM2-135M decoder layer, in the order a forward reads them.
LAYER_SHAPES = (
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cpuinfo(key: str) -> str:
    """A field of ``/proc/cpuinfo`` (its first processor), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _model_name() -> str:
    return _cpuinfo("model name") or platform.processor()


def measure(rows: int, rounds: int) -> dict[str, Any]:
    """Seconds per step of each route at ``rows`` rows (medians over ``rounds`` alternating rounds)."""
    import torch
    import torch.nn.functional as F

    from rlhf_trainers.cpu import mkl_prepacked_linear_available, onednn_linear_available

    generator = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(out, inp, generator=generator) * 0.02 for _ in range(LAYERS) for out, inp in LAYER_SHAPES
    ]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02)
    inputs = {n: torch.randn(rows, n, generator=generator) for n in (HIDDEN, INTERMEDIATE)}

    def plain() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    routes = {"mkl": plain}
    packed_mib = None
    if mkl_prepacked_linear_available():
        before = _rss_mib()
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        packed_mib = _rss_mib() - before

        def prepacked() -> None:
            for w, p in zip(weights, packed, strict=True):
                torch.ops.mkl._mkl_linear(inputs[w.shape[1]], p, w, None, rows)

        routes["mkl_prepacked"] = prepacked
    if onednn_linear_available():

        def onednn() -> None:
            for w in weights:
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], w, None, "none", [], "")

        routes["onednn"] = onednn
    for route in routes.values():  # warm-up: packing caches, oneDNN's generated kernels
        route()
        route()
    seconds: dict[str, list[float]] = {name: [] for name in routes}
    for _ in range(rounds):
        for name, route in routes.items():
            start = time.perf_counter()
            route()
            seconds[name].append(time.perf_counter() - start)
    weight_bytes = sum(w.numel() for w in weights) * 4
    result: dict[str, Any] = {"rows": rows, "packed_copies_mib": packed_mib, "routes": {}}
    for name, values in seconds.items():
        median = statistics.median(values)
        result["routes"][name] = {
            "median_ms": round(median * 1e3, 2),
            "all_ms": [round(v * 1e3, 2) for v in values],
            "weights_gb_per_s": round(weight_bytes / median / 1e9, 2),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    vendor = _cpuinfo("vendor_id") or "unknown"
    report = {
        "benchmark": "decoding_linear",
        "machine": {
            "cpu": _model_name(),
            "vendor": vendor,
            "threads": args.threads,
            "torch": torch.__version__,
        },
        "results": [measure(rows, args.rounds) for rows in args.rows],
    }
    out = Path(args.out) / f"decoding_linear_{vendor}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['machine']['cpu']} ({vendor}), {args.threads} thread(s), torch {torch.__version__}")
    print("\n| rows | route | ms per step (median) | weights streamed GB/s |\n|---:|---|---:|---:|")
    for r in report["results"]:
        for name, v in r["routes"].items():
            print(f"| {r['rows']} | {name} | {v['median_ms']} | {v['weights_gb_per_s']} |")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
