"""Memory over a long run: does a trainer's resident memory grow with the number of updates?

Runs many small updates of PPOTrainer, RLOOTrainer or GRPOTrainer on the offline kit (tiny Llama, the hidden true
reward as the reward function), or many optimizer steps of RewardTrainer on the kit's preference pairs
(the tiny Llama with a score head; the 2,048 pairs repeat as epochs), with a checkpoint every
``--save-steps`` updates and logging every update, so that the paths a real run takes all run many
times, and records the process's resident set size (RSS) after every update. Reports the peak RSS
over the first half of the updates and over the second half, and their ratio (issue #8: over 1,000
updates the second half's peak must be within 5 % of the first's).

    python benchmarks/long_run_memory.py --trainer ppo --updates 1000 --tag cpu --out benchmarks/results
    python benchmarks/long_run_memory.py --trainer rloo --updates 1000 --tag cpu --out benchmarks/results
    python benchmarks/long_run_memory.py --trainer reward --updates 1000 --tag cpu --out benchmarks/results
    python benchmarks/long_run_memory.py --trainer grpo --updates 1000 --tag cpu --out benchmarks/results

GRPO runs with TRL's batch semantics: 8 completions (4 prompts x ``num_generations=2``) per generation and
one optimizer step per generation, so an update is one step, as for the other trainers.

Writes ``<out>/long_run_memory_<trainer>[_<tag>].json``: the per-update RSS (MiB), both peaks, the
ratio, the seconds per update, the torch threads and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def rss_mib() -> float:
    """The current resident set size of this process (Linux /proc; ru_maxrss elsewhere, a high-water)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # pragma: no cover - not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(
    trainer_name: str, updates: int, save_steps: int, seed: int, progress: int = 0, vllm: bool = False
) -> dict:
    """Train ``updates`` updates and return the per-update RSS and timings (an RSS line on stderr every
    ``progress`` updates when > 0). ``vllm``: the on-policy trainers generate with a colocated vLLM engine
    (``use_vllm=True``, weights synced every update) from the kit's vLLM-compatible Llama
    (``llama-hd32-sft``: vLLM's CPU attention refuses the tiny Llama's head size 16)."""
    from transformers import PrinterCallback, TrainerCallback
    from transformers.utils import logging as hf_logging

    from rlhf_trainers import (
        GRPOConfig,
        GRPOTrainer,
        PPOConfig,
        PPOTrainer,
        RewardConfig,
        RewardTrainer,
        RLOOConfig,
        RLOOTrainer,
    )
    from rlhf_trainers.testing import get_kit, true_reward

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kit = get_kit()
    policy = "llama-hd32-sft" if vllm else "llama-sft"
    engine = {"use_vllm": True, "vllm_kv_cache_space_gib": 1} if vllm else {}
    samples: list[float] = []
    times: list[float] = []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "train_runtime" in logs:
                return  # Trainer's end-of-run summary (RewardTrainer), not an update
            samples.append(rss_mib())  # after the update and its logging (a save comes after the log)
            if progress and len(samples) % progress == 0:
                print(f"update {len(samples)}: RSS {samples[-1]:.1f} MiB", file=sys.stderr, flush=True)

    common = {
        "max_steps": updates,
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-4,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": save_steps,
        "save_total_limit": 1,
        "report_to": "none",
        "use_cpu": True,
        "seed": seed,
        "disable_tqdm": True,
    }
    with tempfile.TemporaryDirectory() as tmp:
        if trainer_name == "reward":
            trainer = RewardTrainer(
                model=str(kit.model_path("llama-sft")),
                args=RewardConfig(output_dir=tmp, max_length=64, **common),
                train_dataset=kit.preference_dataset("train"),
                callbacks=[Probe()],
            )
        elif trainer_name == "grpo":
            trainer = GRPOTrainer(
                model=kit.load_model(policy),
                processing_class=kit.load_tokenizer(),
                args=GRPOConfig(
                    output_dir=tmp, num_generations=2, max_completion_length=8, **common, **engine
                ),
                train_dataset=kit.prompt_dataset("train", n=512),
                reward_funcs=true_reward,
                callbacks=[Probe()],
            )
        else:
            config_class, trainer_class = (
                (PPOConfig, PPOTrainer) if trainer_name == "ppo" else (RLOOConfig, RLOOTrainer)
            )
            extra = {"rloo_k": 2} if trainer_name == "rloo" else {}
            args = config_class(
                output_dir=tmp,
                num_mini_batches=2,
                num_ppo_epochs=1,
                response_length=8,
                num_sample_generations=0,
                **common,
                **extra,
                **engine,
            )
            trainer = trainer_class(
                model=kit.load_model(policy),
                processing_class=kit.load_tokenizer(),
                args=args,
                train_dataset=kit.prompt_dataset("train", n=512),
                reward_funcs=true_reward,
                callbacks=[Probe()],
            )
        trainer.remove_callback(PrinterCallback)  # no per-update console dump
        trainer.train()
    return {"rss_mib": samples, "seconds_per_update": times}


def summarize(rss: list[float]) -> dict[str, float]:
    """Peak RSS of the first and the second half of the updates, and their ratio."""
    half = len(rss) // 2
    first, second = max(rss[:half]), max(rss[half:])
    return {"first_half_peak_mib": first, "second_half_peak_mib": second, "ratio": second / first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=["ppo", "rloo", "grpo", "reward"], default="ppo")
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--save-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--tag", default="", help="suffix of the result file's name (e.g. the machine: cpu)")
    parser.add_argument("--progress", type=int, default=0, help="print the RSS every N updates (0: never)")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="PPO/RLOO/GRPO generate with a colocated vLLM engine (run in the vLLM environment, see docs)",
    )
    args = parser.parse_args()
    if args.vllm and args.trainer == "reward":
        parser.error("--vllm applies to the on-policy trainers (ppo, rloo, grpo), not to reward")
    import torch

    torch.set_num_threads(args.threads)
    start = time.time()
    result = run(args.trainer, args.updates, args.save_steps, args.seed, args.progress, args.vllm)
    summary = summarize(result["rss_mib"])
    report = {
        "trainer": args.trainer,
        "vllm": args.vllm,
        "updates": args.updates,
        "save_steps": args.save_steps,
        **summary,
        "median_seconds_per_update": statistics.median(result["seconds_per_update"]),
        "wall_seconds": time.time() - start,
        "threads": args.threads,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "rss_mib": [round(x, 1) for x in result["rss_mib"]],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.trainer + ("_vllm" if args.vllm else "")
    path = out / f"long_run_memory_{name}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(report, indent=1))
    print(
        f"{name}: {args.updates} updates, peak RSS first half {summary['first_half_peak_mib']:.1f} MiB, "
        f"second half {summary['second_half_peak_mib']:.1f} MiB, ratio {summary['ratio']:.4f}; wrote {path}"
    )


if __name__ == "__main__":
    main()
