"""The GRPO family's options on the real model: each one runs a few updates of ``examples/rlvr.py --trainer
grpo`` on SmolLM2-135M-Instruct with LoRA (the ``word_count`` task), and the options' own metrics show
that they acted there, not only on the kit.

    OMP_NUM_THREADS=1 python benchmarks/grpo_options_real.py --out benchmarks/results          # ~25 min, 1 thread

Each option runs in its own process (``examples/rlvr.py`` with the flags below on top of its defaults,
16 completions per update = 4 prompts x ``num_generations=4``, 3 updates, held-out strict success on 16
test prompts before and after). Writes ``<out>/grpo_options_real.json``: per option its flags, the
held-out success before/after, the seconds, and the means over the updates of the logged metrics that
show the option at work (e.g. ``rollout/dynamic_sampling_*`` for dynamic sampling, the entropy for
``entropy_coeff``, ``perf/micro_batches_per_step`` for a token budget). Three updates do not measure
learning: they show the path runs on a 135M model with LoRA, with finite losses, and what it costs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: option name -> (flags for examples/rlvr.py, metric prefixes that show the option at work)
OPTIONS: dict[str, tuple[list[str], list[str]]] = {
    "defaults (dapo, beta 0.03)": ([], []),
    "loss_type=grpo": (["--loss_type=grpo"], []),
    "loss_type=dr_grpo": (["--loss_type=dr_grpo"], []),
    "advantage_estimator=reinforce_plus_plus_baseline": (
        ["--advantage_estimator=reinforce_plus_plus_baseline"],
        [],
    ),
    "importance_sampling_level=sequence (GSPO)": (
        ["--importance_sampling_level=sequence", "--num_iterations=2"],
        ["policy/clipfrac"],
    ),
    "beta=0 (no reference model)": (["--beta=0"], []),
    "dynamic_sampling": (["--dynamic_sampling=true", "--dynamic_sampling_max_rounds=3"], ["rollout/dynamic"]),
    "mask_truncated_completions": (["--mask_truncated_completions=true"], []),
    "top_p=0.9 top_k=50": (["--top_p=0.9", "--top_k=50"], []),
    "entropy_coeff=0.01": (["--entropy_coeff=0.01"], ["policy/entropy"]),
    "max_tokens_per_microbatch=256": (["--max_tokens_per_microbatch=256"], ["perf/micro_batches"]),
}

#: Logged metrics every run reports (means over the updates).
COMMON = (
    "loss/policy_avg",
    "objective/scores",
    "objective/scores/success",
    "policy/entropy_avg",
    "policy/clipfrac_avg",
    "val/response_length",
    "timing/generation",
    "timing/update",
)


def run_option(name: str, flags: list[str], prefixes: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One option's run in its own process; its results and metric means."""
    with tempfile.TemporaryDirectory(prefix="grpo-options-") as tmp:
        curve = Path(tmp) / "curve.json"
        history = Path(tmp) / "history.json"
        # examples/rlvr.py's main() with its report() wrapped to keep the trainer's log history too
        code = (
            "import json, sys; sys.path.insert(0, 'examples'); import rlvr; shown = rlvr.report\n"
            "def report(trainer, results, path):\n"
            "    results['log_history'] = trainer.state.log_history; shown(trainer, results, path)\n"
            "rlvr.report = report\n"
            f"json.dump(rlvr.main(sys.argv[1:]), open({str(history)!r}, 'w'), default=str)"
        )
        cmd = [
            sys.executable,
            "-c",
            code,
            "--trainer=grpo",
            "--task=word_count",
            f"--output_dir={tmp}/out",
            f"--curve_file={curve}",
            f"--max_steps={args.updates}",
            f"--eval_steps={args.updates}",
            "--per_device_train_batch_size=16",
            f"--num_eval_prompts={args.eval_prompts}",
            f"--seed={args.seed}",
            *flags,
        ]
        # an update (one generation) is num_iterations optimizer steps, and max_steps counts steps
        iterations = next((int(f.split("=")[1]) for f in flags if f.startswith("--num_iterations=")), 1)
        steps = args.updates * iterations
        cmd = [c for c in cmd if not c.startswith(("--max_steps=", "--eval_steps="))]
        cmd += [f"--max_steps={steps}", f"--eval_steps={steps}"]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            return {
                "option": name,
                "flags": flags,
                "ok": False,
                "error": proc.stderr[-3000:],
                "seconds": seconds,
            }
        results = json.loads(history.read_text())
        log = results.get("log_history") or []
    means: dict[str, float] = {}
    keys = {k for entry in log for k in entry if k in COMMON or any(k.startswith(p) for p in prefixes)}
    for key in sorted(keys):
        values = [e[key] for e in log if key in e and not key.startswith("eval_")]
        if values:
            means[key] = sum(values) / len(values)
    finite = all(math.isfinite(v) for v in means.values())
    return {
        "option": name,
        "flags": flags,
        "ok": finite,
        "success_before": results.get("before"),
        "success_after": results.get("after"),
        "updates": results.get("updates"),
        "seconds": round(seconds, 1),
        "metric_means": means,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only",
        help="comma-separated option names (default: all); their runs replace those of an existing file",
    )
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    chosen = OPTIONS if not args.only else {k: OPTIONS[k] for k in args.only.split(",")}
    runs = []
    for name, (flags, prefixes) in chosen.items():
        result = run_option(name, flags, prefixes, args)
        runs.append(result)
        status = "ok" if result["ok"] else "FAILED"
        print(
            f"{name}: {status}, success {result.get('success_before')} -> {result.get('success_after')}, "
            f"{result['seconds']:.0f} s",
            flush=True,
        )
    report = {
        "benchmark": "grpo_options_real",
        "model": "SmolLM2-135M-Instruct + LoRA (examples/rlvr.py defaults)",
        "task": "word_count",
        "updates": args.updates,
        "completions_per_update": 16,
        "eval_prompts": args.eval_prompts,
        "seed": args.seed,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "grpo_options_real.json"
    if args.only and path.is_file():  # the other options' runs of the existing file stay, in their order
        fresh = {r["option"]: r for r in runs}
        kept = json.loads(path.read_text())["runs"]
        report["runs"] = [fresh.pop(r["option"], r) for r in kept] + list(fresh.values())
    (out / "grpo_options_real.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'grpo_options_real.json'}")


if __name__ == "__main__":
    main()
