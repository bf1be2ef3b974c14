"""What GRPO's ``beta=0`` saves: peak memory and seconds per update of GRPOTrainer without a KL term (no
reference model built, loaded or run) against ``beta > 0`` (a frozen copy of the policy, run at every
rollout), everything else equal (issue #23).

Same job as ``onpolicy_memory.py`` (whose loading and memory probes it reuses): the policy and a reward
*model* of ``--size`` (the kit's tiny Llama, or SmolLM2-135M-Instruct with a fresh one-label head), the
kit's prompts, ``--batch`` completions per update of ``--k`` per prompt, fixed-length responses, fp32 on
CPU, one optimizer step per update. Each run is its own subprocess, so each peak is its own.

    python benchmarks/reference_memory.py --size smollm2-135m --updates 4 --out benchmarks/results

Writes ``<out>/reference_memory_<size>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from onpolicy_memory import (  # noqa: E402
    DEFAULT_CACHE,
    SIZES,
    _load,
    _materialize,
    _maxrss_bytes,
    _reset_rss_high_water,
    _rss_bytes,
    prepare_smollm2,
)

BETAS = {"beta=0": 0.0, "beta=0.04": 0.04}


def child(args: argparse.Namespace) -> dict:
    from rlhf_trainers import GRPOConfig, GRPOTrainer
    from rlhf_trainers.testing import get_kit

    policy, reward, tokenizer, _ = _load(args.size, Path(args.cache_dir))
    _materialize(policy, reward)
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            beta=args.beta,
            num_generations=args.k,
            per_device_train_batch_size=args.batch,
            max_completion_length=args.response_length,
            stop_token=None,
            temperature=1.0,
            learning_rate=1e-6,
            max_steps=args.updates,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            num_sample_generations=0,
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=policy,
            reward_model=reward,
            processing_class=tokenizer,
            args=config,
            train_dataset=get_kit().prompt_dataset("train", n=1024),
        )
        del policy, reward
        has_reference = trainer.ref_model is not None
        rss_before = _rss_bytes()
        peak_before = _maxrss_bytes()
        reset = _reset_rss_high_water()
        trainer.train()
        train_peak = _maxrss_bytes()
    logs = [h for h in trainer.state.log_history if "timing/step" in h]
    mib = 2**20
    return {
        "beta": args.beta,
        "reference_model_built": has_reference,
        "rss_before_train_mib": rss_before / mib,
        "peak_rss_mib": max(peak_before, train_peak) / mib,
        "train_peak_rss_mib": train_peak / mib if reset else None,
        "seconds_per_update_median": statistics.median(h["timing/step"] for h in logs[1:] or logs),
        "timing_ref_median": statistics.median(h.get("timing/ref", 0.0) for h in logs[1:] or logs),
        "load_average_after": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--beta", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.beta is not None:
        print("RESULT " + json.dumps(child(args)))
        return
    if args.size == "smollm2-135m":
        prepare_smollm2(Path(args.cache_dir))
    results = {}
    for name, beta in BETAS.items():
        began = time.perf_counter()
        cmd = [sys.executable, __file__, f"--beta={beta}", f"--size={args.size}", f"--batch={args.batch}"]
        cmd += [f"--k={args.k}", f"--response-length={args.response_length}", f"--updates={args.updates}"]
        cmd += [f"--cache-dir={args.cache_dir}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
        line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
        results[name] = json.loads(line[len("RESULT ") :]) | {"wall_s": time.perf_counter() - began}
        print(name, json.dumps(results[name]), flush=True)
    report = {
        "size": args.size,
        "settings": vars(args),
        "results": results,
        "peak_rss_saved_mib": results["beta=0.04"]["peak_rss_mib"] - results["beta=0"]["peak_rss_mib"],
        "peak_rss_ratio": results["beta=0"]["peak_rss_mib"] / results["beta=0.04"]["peak_rss_mib"],
        "seconds_ratio": results["beta=0"]["seconds_per_update_median"]
        / results["beta=0.04"]["seconds_per_update_median"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"reference_memory_{args.size}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
