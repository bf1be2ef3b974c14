"""Peak memory and time of per-token log-probabilities: ``functional.logprobs_from_logits`` vs the
usual ``log_softmax(logits / T).gather(...)``, forward and backward, on CPU or CUDA.

Each variant runs in its own subprocess so that its peak is its own (on CPU: peak RSS; on CUDA:
``torch.cuda.max_memory_allocated``). The figure reported is the peak *above* the memory that holds the
logits and their gradient, i.e. what the log-prob computation itself costs.

    python benchmarks/logprobs_memory.py --device cpu --batch 8 --seq 256 --vocab 49152 --out bench-out
    python benchmarks/logprobs_memory.py --device cuda --dtype bfloat16 --batch 32 --seq 1024 --vocab 49152

Writes ``<out>/logprobs_memory.json`` and ``<out>/logprobs_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "naive log_softmax+gather": {"naive": True},
    "logprobs_from_logits": {"naive": False, "chunk_size": None},
    "logprobs_from_logits chunk=128": {"naive": False, "chunk_size": 128},
}


def _peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _child(args: argparse.Namespace) -> None:
    """Run one variant and print a JSON line with its measurements."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlhf_trainers.functional import logprobs_from_logits

    spec = VARIANTS[args.variant]
    dtype = getattr(torch, args.dtype)
    compute = torch.float32
    torch.manual_seed(0)
    # A non-contiguous slice, as trainers take logits[:, context - 1 : -1] of the full forward.
    full = torch.randn(args.batch, args.seq + 1, args.vocab, device=args.device, dtype=dtype)
    logits = full[:, :-1].detach().requires_grad_(True)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)

    def run() -> None:
        if spec["naive"]:
            lp = torch.log_softmax(logits.to(compute) / args.temperature, dim=-1)
            lp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        else:
            lp = logprobs_from_logits(
                logits, tokens, args.temperature, chunk_size=spec["chunk_size"], compute_dtype=compute
            )
        lp.sum().backward()

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    # Baseline: the inputs plus the gradient buffer that any method must allocate for logits.grad.
    # (On CPU the high-water RSS keeps the freed gradient's pages, so both devices measure alike.)
    logits.grad = torch.ones_like(logits)
    sync()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = _peak_bytes(args.device)
    logits.grad = None
    times = []
    run()  # warm-up, and the measured peak
    sync()
    peak = _peak_bytes(args.device)
    for _ in range(args.repeats):
        logits.grad = None
        sync()
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    print(json.dumps({"extra_peak_mib": max(peak - base, 0) / 2**20, "median_s": statistics.median(times)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152, help="49152 is SmolLM2's vocabulary")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        _child(args)
        return

    import torch

    results = []
    for name in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", name] + [
            f"--{k}={v}" for k, v in vars(args).items() if k not in {"variant", "out"}
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"variant {name!r} failed:\n{proc.stderr}")
        results.append({"variant": name, **json.loads(proc.stdout.strip().splitlines()[-1])})
    logits_mib = (
        args.batch * args.seq * args.vocab * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    )
    report = {
        "benchmark": "logprobs_memory",
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "shape": [args.batch, args.seq, args.vocab],
        "dtype": args.dtype,
        "compute_dtype": "float32",
        "logits_mib": logits_mib / 2**20,
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logprobs_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"logits {tuple(report['shape'])} {args.dtype} on {args.device} ({report['logits_mib']:.0f} MiB), "
        "forward + backward, float32 arithmetic",
        "",
        "| variant | extra peak MiB | median s |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r['variant']} | {r['extra_peak_mib']:.0f} | {r['median_s']:.4f} |" for r in results]
    (out / "logprobs_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
