"""One PPO run on the offline kit, on CPU or CUDA, in fp32 or bf16: learning, speed, memory, numerics.

Reports the held-out true reward before and after, seconds per update (median, first excluded),
episodes/s, tokens/s, peak memory (RSS; and CUDA max allocated), and the policy ratio at the start of
each update (``policy/ratio_at_start``, which must stay ~0 when the rollout and training forward passes
agree; with bf16 this is what ``logprobs_in_fp32`` is about).

    python benchmarks/ppo_run.py --out bench-out                       # CPU, fp32
    python benchmarks/ppo_run.py --device cuda --bf16 --out bench-out  # GPU, bf16 autocast
    python benchmarks/ppo_run.py --device cuda --bf16 --no-logprobs-fp32 --out bench-out

Writes ``<out>/ppo_run<tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="TrainingArguments.bf16 (autocast)")
    parser.add_argument("--no-logprobs-fp32", action="store_true", help="logprobs_in_fp32=False")
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size")
    parser.add_argument("--response-length", type=int, default=12)
    parser.add_argument("--model", default="llama-sft", help="kit model name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()

    import torch
    from transformers import TrainerCallback

    from rlhf_trainers import PPOConfig, PPOTrainer
    from rlhf_trainers.testing import get_kit, true_reward

    kit = get_kit()
    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            step_times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as tmp:
        config = PPOConfig(
            output_dir=tmp,
            learning_rate=2e-3,
            per_device_train_batch_size=args.batch,
            num_mini_batches=2,
            num_ppo_epochs=2,
            response_length=args.response_length,
            temperature=1.0,
            kl_coef=0.05,
            max_steps=args.updates,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=args.device == "cpu",
            bf16=args.bf16,
            logprobs_in_fp32=not args.no_logprobs_fp32,
            num_sample_generations=0,
            disable_tqdm=True,
            seed=args.seed,
        )
        trainer = PPOTrainer(
            model=kit.load_model(args.model),
            processing_class=kit.load_tokenizer(),
            reward_funcs=true_reward,
            args=config,
            train_dataset=kit.prompt_dataset("train", n=1024),
            eval_dataset=kit.prompt_dataset("test", n=256),
            callbacks=[Timer()],
        )
        before = trainer.evaluate()["eval_objective/scores"]
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        after = trainer.evaluate()["eval_objective/scores"]
    logs = [h for h in trainer.state.log_history if "objective/kl" in h]
    steady = step_times[1:] or step_times
    median = statistics.median(steady)
    result = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "bf16": args.bf16,
        "logprobs_in_fp32": not args.no_logprobs_fp32,
        "updates": args.updates,
        "completions_per_update": trainer.batch_size,
        "true_reward_before": before,
        "true_reward_after": after,
        "seconds_per_update_median": median,
        "episodes_per_sec": trainer.batch_size / median,
        "tokens_per_sec_median": statistics.median(h["perf/tokens_per_sec"] for h in logs[1:] or logs),
        "ratio_at_start_max": max(h["policy/ratio_at_start"] for h in logs),
        "ratio_at_start_first": logs[0]["policy/ratio_at_start"],
        "final_kl": logs[-1]["objective/kl"],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20
        if args.device == "cuda"
        else None,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ppo_run{args.tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
