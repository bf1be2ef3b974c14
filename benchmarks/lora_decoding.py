"""The builtin sampling loop on a LoRA policy with ``merged_adapter_decoding`` (the decoding steps on copies of
the weights with the adapters merged) against the adapter's own forward at every step: seconds per sampling
call, the same draws, log-prob differences, on SmolLM2-135M-Instruct with LoRA on every linear layer.

Both ways run the lean Llama decoding steps in this process, alternating, from the same seed and prompts;
in float32 both multiply by MKL-prepacked weights (``mkl_prepacked_decoding``: the plain layers, and with
merging the LoRA layers' merged copies), in bf16 both run under CPU autocast with the frozen weights cast
once per call (:class:`~rlhf_trainers.cpu.AutocastWeightCache`), as the trainers sample. The
adapter is randomly initialised (``init_lora_weights=False``) so that merging changes the weights.

    python benchmarks/lora_decoding.py --dtype float32 --threads 1
    python benchmarks/lora_decoding.py --dtype bfloat16 --threads 1

Writes ``<out>/lora_decoding_<dtype>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--completions", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per completion (no stop token)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="sampling calls per way, alternating")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlhf_trainers import cpu as cpu_switches
    from rlhf_trainers.generation.base import SamplingSettings
    from rlhf_trainers.generation.builtin import sample_with_kv_cache
    from rlhf_trainers.testing.smollm2 import load_smollm2_tokenizer, smollm2_folder

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_folder()), dtype=torch.float32)
    lora = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", init_lora_weights=False
    )
    model = get_peft_model(model, lora).eval()
    tokenizer = load_smollm2_tokenizer()
    tokenizer.padding_side = "left"
    texts = [f"Write a short story, number {i}, about a cat and a dog." for i in range(args.completions)]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    settings = SamplingSettings(
        max_new_tokens=args.tokens,
        temperature=1.0,
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=[],
        return_logprobs=True,
    )
    if args.dtype == "float32":
        ways = {
            "adapter": cpu_switches.lean_llama_steps_prepacked,
            "merged": cpu_switches.lean_llama_steps_prepacked_merged,
        }
    else:
        ways = {"adapter": cpu_switches.lean_llama_steps, "merged": cpu_switches.lean_llama_steps_merged}

    def context() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if args.dtype == "bfloat16":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            stack.enter_context(cpu_switches.AutocastWeightCache())
        return stack

    seconds: dict[str, list[float]] = {name: [] for name in ways}
    samples: dict[str, Any] = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, steps in ways.items():
            torch.manual_seed(0)
            with context():
                started = time.perf_counter()
                samples[name] = sample_with_kv_cache(
                    model, batch.input_ids, batch.attention_mask, settings, steps
                )
                seconds[name].append(time.perf_counter() - started)
    adapter, merged = samples["adapter"], samples["merged"]
    same = adapter.tokens == merged.tokens
    first_difference = int((~same).any(0).nonzero()[0]) if not bool(same.all()) else None
    agree = slice(None, first_difference)  # the columns before the first differing draw
    result = {
        "benchmark": "lora_decoding",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "loadavg_end": os.getloadavg(),
        },
        "settings": vars(args) | {"out": str(args.out)},
        "seconds": {name: times[1:] for name, times in seconds.items()},
        "median_seconds": {name: statistics.median(times[1:]) for name, times in seconds.items()},
        "speedup": statistics.median(seconds["adapter"][1:]) / statistics.median(seconds["merged"][1:]),
        "same_draws": bool(same.all()),
        "first_differing_column": first_difference,
        "max_abs_logprob_difference_before_it": float(
            (adapter.logprobs[:, agree] - merged.logprobs[:, agree]).abs().max()
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"lora_decoding_{args.dtype}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_seconds", "speedup", "same_draws")}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
