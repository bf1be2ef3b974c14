"""The resident memory that ``mkl_prepacked_decoding`` costs while sampling: every plain ``nn.Linear`` weight
of SmolLM2-135M-Instruct packed for MKL's GEMM at a batch size (what the lean decoding steps hold for one
sampling call), against the weights' own size, in a fresh process, twice (the first call, then a second
one after the first's packed copies were freed), with glibc's defaults or ``reuse_host_memory``.

    python benchmarks/prepacked_memory.py                  # glibc's defaults
    python benchmarks/prepacked_memory.py --reuse-host-memory

Writes ``<out>/prepacked_memory[_reuse].json``.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def rss_mib() -> float:
    """Resident set size of this process now (``/proc/self/statm``), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="the batch size the weights are packed for")
    parser.add_argument("--reuse-host-memory", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.reuse_host_memory:
        from rlhf_trainers.cpu import reuse_freed_host_memory

        reuse_freed_host_memory()
    from transformers import AutoModelForCausalLM

    from rlhf_trainers.testing.smollm2 import smollm2_folder

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_folder()), dtype=torch.float32)
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    calls = []
    for _ in range(2):
        before = rss_mib()
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, args.rows) for w in weights]
        calls.append(
            {
                "rss_added_mib": rss_mib() - before,
                "packed_tensors_mib": sum(p.numel() * p.element_size() for p in packed) / 2**20,
            }
        )
        del packed
    result = {
        "benchmark": "prepacked_memory",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
        },
        "settings": vars(args) | {"out": str(args.out)},
        "linear_weights_mib": sum(w.numel() * w.element_size() for w in weights) / 2**20,
        "calls": calls,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("prepacked_memory_reuse.json" if args.reuse_host_memory else "prepacked_memory.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("linear_weights_mib", "calls")}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
