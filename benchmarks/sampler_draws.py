"""The builtin sampling loop's draw per decoding step: ``torch.multinomial`` (``generate``'s draws) against
inverse-CDF draws (``inverse_cdf_sampling=True``, :func:`rlhf_trainers.generation.draw_inverse_cdf`), at
SmolLM2's vocabulary (49,152 entries) and the row counts of the benchmarks' rollouts, one thread, the two
alternating; how far apart their token frequencies are on one skewed distribution (the same
distribution: the gap is sampling error); and, with ``--smollm2``, each method's frequencies against the
exact next-token distribution of SmolLM2-135M-Instruct after a chat prompt (temperatures 0.7 and 1.0):
total variation, and the probability mass outside the 50 likeliest tokens (the tail a biased sampler
would distort) with its standard error.

    python benchmarks/sampler_draws.py --smollm2 --out benchmarks/results

Writes ``<out>/sampler_draws_cpu.json``: per row count, the median milliseconds per step of each, and
the total-variation distance between the two methods' token frequencies over ``--draws`` draws together
with its expected size for two independent samples of that many draws; with ``--smollm2``, the
real-model checks.
"""

from __future__ import annotations

import argparse
import json
import math
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


def _real_model_checks(inverse_cdf_draws: int, multinomial_draws: int) -> list[dict]:
    """Each method's frequencies against SmolLM2-135M-Instruct's exact next-token distribution."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_trainers.testing.smollm2 import smollm2_folder

    folder = smollm2_folder()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "Write one sentence about the sea."}]
    ids = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), return_tensors="pt")
    with torch.no_grad():
        logits = model(ids.input_ids).logits[0, -1].float()
    checks = []
    for temperature in (0.7, 1.0):
        probs = torch.softmax(logits / temperature, dim=-1)
        exact = probs.double()
        block = probs.expand(1000, -1).contiguous()
        order = exact.argsort(descending=True)
        tail = exact[order[50:]].sum().item()
        for name, fn, draws in (
            ("inverse_cdf", draw_inverse_cdf, inverse_cdf_draws),
            ("multinomial", draw_multinomial, multinomial_draws),
        ):
            torch.manual_seed(0)
            drawn = torch.cat([fn(block) for _ in range(max(1, draws // 1000))])
            n = drawn.numel()
            freq = torch.bincount(drawn, minlength=probs.numel()).double() / n
            checks.append(
                {
                    "temperature": temperature,
                    "method": name,
                    "draws": n,
                    "total_variation_to_probs": 0.5 * (freq - exact).abs().sum().item(),
                    # E|freq - p| ~ sqrt(2 p (1 - p) / (pi n)) per token (an upper bound for rare tokens)
                    "expected_total_variation_at_most": 0.5
                    * torch.sqrt(2 * exact * (1 - exact) / (math.pi * n)).sum().item(),
                    "mass_outside_top50": freq[order[50:]].sum().item(),
                    "mass_outside_top50_exact": tail,
                    "mass_outside_top50_standard_error": math.sqrt(tail * (1 - tail) / n),
                    "top_token": freq[order[0]].item(),
                    "top_token_exact": exact[order[0]].item(),
                }
            )
            print(json.dumps(checks[-1]), flush=True)
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--draws", type=int, default=200_000, help="draws per method for the frequencies")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--smollm2",
        action="store_true",
        help="also check each method against SmolLM2-135M-Instruct's exact next-token distribution",
    )
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
    if args.smollm2:
        report["smollm2_next_token"] = _real_model_checks(400_000, 60_000)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler_draws_cpu.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
