"""vLLM (``use_vllm=True``, colocated) against the builtin sampling loop on SmolLM2-135M-Instruct: the seconds
of generation and the episodes per second of a whole update, for PPO and RLOO, on this machine.

The job is the RLVR ``word_count`` task of ``examples/rlvr.py`` with its defaults (LoRA r 16 on every
linear layer, lr 1e-3, temperature 0.7, one epoch of one mini-batch,
in micro-batches of ``--micro-batch`` completions), ``--completions`` completions per
update (RLOO: a quarter as many prompts x 4, PPO: one each) of exactly ``--response-length`` tokens (no
stop token, so both backends generate the same number of tokens), ``--updates`` updates per run. Each
(trainer, backend) run is a process of its own in the vLLM environment (vLLM's CPU build pins another
transformers than the main environment: :mod:`rlhf_trainers.testing.vllm_env`), both backends in the same
environment so that only the generation differs, one run at a time, with the torch threads of the machine.
The first update (vLLM's warm-up, allocator growth) is left out; the figures are medians over the others.
vLLM runs twice: with the rollout's log-probs recomputed by a policy forward pass (``vllm``, the default
``rollout_logprobs='auto'``) and with vLLM's own log-probs as the rollout's (``vllm-old``,
``rollout_logprobs='generation'``, no policy forward pass).

    python benchmarks/vllm_generation.py                      # writes benchmarks/results/vllm_generation_cpu.json
    python benchmarks/vllm_generation.py --updates 6 --trainers rloo
    python benchmarks/vllm_generation.py --backends builtin-adapter builtin --trainers ppo  # merged LoRA or not

Writes ``<out>/vllm_generation_<device>.json`` and ``.md`` (the table).
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRAINERS = ("ppo", "rloo")
#: builtin: the sampling loop (its own log-probs are the rollout's); builtin-adapter: the same with the
#: LoRA adapter's own forward at every decoding step (``merged_adapter_decoding=False``; not run by
#: default); vllm: vLLM, the rollout's log-probs recomputed by a policy forward pass (the default);
#: vllm-old: vLLM's log-probs as the rollout's (``rollout_logprobs='generation'``, no policy forward pass).
BACKENDS = ("builtin", "builtin-adapter", "vllm", "vllm-old")
DEFAULT_BACKENDS = ("builtin", "vllm", "vllm-old")
LOGPROBS = {
    "builtin": "sampling loop's",
    "builtin-adapter": "sampling loop's",
    "vllm": "forward pass",
    "vllm-old": "vLLM's",
}


def worker(
    trainer_name: str,
    backend: str,
    updates: int,
    response_length: int,
    seed: int,
    completions: int,
    micro_batch: int = 32,
    bf16: bool = False,
) -> dict[str, Any]:
    """One run in this process; its per-update timings. The update's one optimizer step accumulates
    gradients over micro-batches of ``micro_batch`` completions. ``bf16``: the trainer in bf16 autocast
    (``bf16=True``, float32 weights), so the builtin loop samples in bf16, and vLLM's engine in bf16
    (``vllm_dtype='bfloat16'``)."""
    import torch
    from peft import LoraConfig

    from rlhf_trainers import CPUOptions, PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
    from rlhf_trainers.rewards.rlvr import reward_function, task_dataset
    from rlhf_trainers.testing.smollm2 import load_smollm2_tokenizer, smollm2_folder

    common: dict[str, Any] = {
        "output_dir": f"/tmp/vllm-bench-{trainer_name}-{backend}",
        # One optimizer step per update over all completions, in micro-batches: the activations a
        # training forward pass keeps for its backward pass grow with its rows (SmolLM2-135M, ~70 tokens a
        # row: ~82 MiB per row, and glibc's heap about doubles that in resident memory), so 128 rows at
        # once needed ~20 GB and with vLLM's engine beside them overran a 24 GB machine.
        "per_device_train_batch_size": min(micro_batch, completions),
        "gradient_accumulation_steps": max(completions // micro_batch, 1),
        # Every completion is response_length tokens (no stop token): both backends generate the same
        # number of tokens, so their generation seconds compare directly.
        "stop_token": None,
        "num_mini_batches": 1,
        "num_ppo_epochs": 1,
        "learning_rate": 1e-3,
        "temperature": 0.7,
        "kl_coef": 0.03,
        "response_length": response_length,
        "max_steps": updates,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "num_sample_generations": 0,
        "use_cpu": not torch.cuda.is_available(),
        "seed": seed,
        "disable_tqdm": True,
        "use_vllm": backend.startswith("vllm"),
        "rollout_logprobs": "generation" if backend == "vllm-old" else "auto",
        "local_rollout_forward_batch_size": completions,
        "bf16": bf16,
    }
    if bf16 and backend.startswith("vllm"):
        common["vllm_dtype"] = "bfloat16"
    config = RLOOConfig(rloo_k=4, **common) if trainer_name == "rloo" else PPOConfig(**common)
    trainer_cls = RLOOTrainer if trainer_name == "rloo" else PPOTrainer
    started = time.perf_counter()
    trainer = trainer_cls(
        model=str(smollm2_folder()),
        processing_class=load_smollm2_tokenizer(),
        args=config,
        reward_funcs=[reward_function("word_count")],
        cpu_options=CPUOptions(merged_adapter_decoding=backend != "builtin-adapter"),
        train_dataset=task_dataset("word_count", "train"),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    build_seconds = time.perf_counter() - started
    trainer.train()
    rows = [h for h in trainer.state.log_history if "timing/step" in h]
    keep = (
        "timing/generate",
        "timing/step",
        "timing/update",
        "timing/policy",
        "timing/ref",
        "timing/weight_sync",
    )
    keep += ("perf/episodes_per_sec", "perf/tokens_per_sec", "val/response_length", "objective/scores")
    keep += ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
    return {
        "trainer": trainer_name,
        "backend": backend,
        "generation": trainer.generation_backend.name,
        # whether the rollout's log-probs are the sampler's (builtin in float32, vLLM's with vllm-old) or a
        # policy forward pass's (vLLM by default; the builtin loop in bf16)
        "logprobs_from_generation": trainer.logprobs_from_generation,
        "build_seconds": build_seconds,
        "threads": torch.get_num_threads(),
        "updates": [{k: h[k] for k in keep if k in h} for h in rows],
    }


def logprobs_label(run: dict[str, Any]) -> str:
    """Where the run's rollout log-probs came from: the sampler's own (the builtin loop's, or vLLM's) or a
    policy forward pass (vLLM by default, and the builtin loop in bf16)."""
    if not run.get("logprobs_from_generation", run["backend"] != "vllm"):
        return LOGPROBS["vllm"]
    return LOGPROBS["vllm-old" if run["backend"] == "vllm-old" else "builtin"]


def summarize(run: dict[str, Any]) -> dict[str, float]:
    """Medians over the updates after the first."""
    later = run["updates"][1:] or run["updates"]

    def median(key: str) -> float | None:
        values = [u[key] for u in later if key in u]
        return statistics.median(values) if values else None

    # timing/generate includes the weight sync that vLLM's first sample() call of an update runs
    syncs = [u.get("timing/weight_sync", 0.0) for u in later]
    sampling = [u["timing/generate"] - sync for u, sync in zip(later, syncs, strict=True)]
    return {
        "generate_s": median("timing/generate"),
        "sampling_s": statistics.median(sampling),
        "policy_s": median("timing/policy"),
        "step_s": median("timing/step"),
        "episodes_per_s": median("perf/episodes_per_sec"),
        "weight_sync_s": median("timing/weight_sync"),
        "response_length": median("val/response_length"),
        "logp_diff_max": median("sampling/sampling_logp_difference/max"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument(
        "--completions", type=int, default=32, help="completions per update (RLOO: / 4 prompts)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=32,
        help="completions per training micro-batch (gradient accumulation over the update's completions)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 autocast (the builtin loop samples in bf16) and vLLM's engine in bf16",
    )
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    parser.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS), choices=BACKENDS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--python", default=None, help="Interpreter with vLLM (default: the vLLM environment)."
    )
    parser.add_argument("--worker", nargs=2, metavar=("TRAINER", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.micro_batch < 1 or (args.completions > args.micro_batch and args.completions % args.micro_batch):
        parser.error(
            f"--completions {args.completions} must be a multiple of --micro-batch {args.micro_batch}"
        )
    if args.worker:
        result = worker(
            args.worker[0],
            args.worker[1],
            args.updates,
            args.response_length,
            args.seed,
            args.completions,
            args.micro_batch,
            args.bf16,
        )
        print("RESULT " + json.dumps(result))
        return

    if args.python is None:
        sys.path.insert(0, str(ROOT))
        from rlhf_trainers.testing.vllm_env import vllm_env_variables, vllm_python

        python, env = str(vllm_python()), vllm_env_variables(ROOT)
        env.pop("OMP_NUM_THREADS", None)  # the machine's threads: a benchmark, not a test
    else:
        python, env = args.python, dict(os.environ, PYTHONPATH=str(ROOT))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    runs = []
    for trainer_name in args.trainers:
        for backend in args.backends:
            command = [python, __file__, "--worker", trainer_name, backend, "--updates", str(args.updates)]
            command += ["--response-length", str(args.response_length), "--seed", str(args.seed)]
            command += ["--completions", str(args.completions), "--micro-batch", str(args.micro_batch)]
            command += ["--bf16"] if args.bf16 else []
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                raise SystemExit(f"{trainer_name}/{backend} failed:\n{(done.stdout + done.stderr)[-4000:]}")
            run = json.loads(lines[-1][len("RESULT ") :])
            run["summary"] = summarize(run)
            runs.append(run)
            print(trainer_name, backend, run["summary"], flush=True)

    ratios = {}
    for trainer_name in args.trainers:
        by = {r["backend"]: r["summary"] for r in runs if r["trainer"] == trainer_name}
        if "builtin" not in by:
            continue
        for backend in ("builtin-adapter", "vllm", "vllm-old"):
            if backend in by:
                ratios.setdefault(trainer_name, {})[backend] = {
                    "generation_speedup": by["builtin"]["generate_s"] / by[backend]["generate_s"],
                    "sampling_speedup": by["builtin"]["sampling_s"] / by[backend]["sampling_s"],
                    "episodes_per_s_ratio": by[backend]["episodes_per_s"] / by["builtin"]["episodes_per_s"],
                }
    device = "cuda" if "cuda" in runs[0]["generation"].lower() else "cpu"
    result = {
        "benchmark": "vllm_generation",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        },
        "settings": vars(args) | {"out": str(args.out), "python": python},
        "runs": runs,
        "ratios": ratios,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.completions}x{args.response_length}" + (
        f"_{args.threads}thread" if args.threads else ""
    )
    suffix += "_bf16" if args.bf16 else ""
    path = args.out / f"vllm_generation_{device}{suffix}.json"
    path.write_text(json.dumps(result, indent=1))
    lines = [
        "| trainer | backend | rollout log-probs | generation s / update | of which sampling (no sync) | "
        "policy forward s | update s | episodes/s | weight sync s | max abs logp diff |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        s = run["summary"]
        sync = f"{s['weight_sync_s']:.2f}" if s["weight_sync_s"] is not None else "-"
        diff = f"{s['logp_diff_max']:.1e}" if s["logp_diff_max"] is not None else "-"
        lines.append(
            f"| {run['trainer'].upper()} | {run['generation']} | {logprobs_label(run)} | "
            f"{s['generate_s']:.2f} | {s['sampling_s']:.2f} | {s['policy_s'] or 0:.2f} | {s['step_s']:.2f} | {s['episodes_per_s']:.2f} | "
            f"{sync} | {diff} |"
        )
    for trainer_name, by_backend in ratios.items():
        for backend, r in by_backend.items():
            lines.append(
                f"\n{trainer_name.upper()}, {backend} (rollout log-probs: {LOGPROBS[backend]}): generation "
                f"{r['generation_speedup']:.2f}x faster than the builtin loop (sampling alone, without the weight "
                f"sync: {r['sampling_speedup']:.2f}x), episodes/s {r['episodes_per_s_ratio']:.2f}x."
            )
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
