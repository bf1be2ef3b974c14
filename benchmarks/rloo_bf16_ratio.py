"""The RLOO blog's bf16 "dark side", measured: sequence ratios at the start of each RLOO update.

Runs short RLOO trainings on the offline kit in fp32, in bf16 autocast with the log-softmax in fp32
(``logprobs_in_fp32=True``, the default) and in bf16 with the log-softmax in bf16, each with
``truncated_is_cap`` set so that the generation's own log-probs are kept. Per variant it reports the
held-out true reward before/after and, over the updates (mean and max):

- ``policy/ratio_at_start``: max |token ratio - 1| at the first micro-batch (0 when the rollout and the
  training forward pass agree);
- ``policy/seq_ratio_at_start_max`` / ``_clipfrac``: the whole-sequence ratio the RLOO loss clips (the
  blog's 12.19), and the fraction of sequences outside [1 - cliprange, 1 + cliprange] before any step
  (the blog's 20-40 %);
- ``policy/gen_ratio_max`` / ``policy/is_weight_mean``: generation vs training-forward sequence ratio,
  and the truncated importance weights.

    python benchmarks/rloo_bf16_ratio.py --device cuda --out bench-out
    python benchmarks/rloo_bf16_ratio.py --device cpu --updates 3 --response-lengths 8 --out bench-out

Writes ``<out>/rloo_bf16_ratio<tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

METRICS = (
    "policy/ratio_at_start",
    "policy/seq_ratio_at_start_max",
    "policy/seq_ratio_at_start_clipfrac",
    "policy/gen_ratio_max",
    "policy/is_weight_mean",
    "policy/clipfrac_avg",
)
VARIANTS = (
    ("fp32", False, True),
    ("bf16_fp32_logsoftmax", True, True),
    ("bf16_bf16_logsoftmax", True, False),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--rloo-k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (completions)")
    parser.add_argument(
        "--response-lengths",
        default="12,48",
        help="comma-separated; 12 stops at EOS (the kit's task), longer ones are fixed-length (stop_token=None), "
        "where small per-token differences multiply into the sequence ratio",
    )
    parser.add_argument("--truncated-is-cap", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()

    import torch

    from rlhf_trainers import RLOOConfig, RLOOTrainer
    from rlhf_trainers.testing import get_kit, true_reward

    kit = get_kit()
    results: dict = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "updates": args.updates,
        "rloo_k": args.rloo_k,
        "completions_per_update": args.batch * 2,
        "truncated_is_cap": args.truncated_is_cap,
        "runs": {},
    }
    for length in [int(x) for x in args.response_lengths.split(",")]:
        for name, bf16, logprobs_fp32 in VARIANTS:
            with tempfile.TemporaryDirectory() as tmp:
                trainer = RLOOTrainer(
                    model=str(kit.model_path("llama-sft")),
                    reward_funcs=true_reward,
                    args=RLOOConfig(
                        output_dir=tmp,
                        rloo_k=args.rloo_k,
                        per_device_train_batch_size=args.batch,
                        num_mini_batches=2,
                        num_ppo_epochs=2,
                        learning_rate=2e-3,
                        response_length=length,
                        stop_token="eos" if length <= 12 else None,
                        temperature=1.0,
                        max_steps=args.updates,
                        bf16=bf16,
                        logprobs_in_fp32=logprobs_fp32,
                        truncated_is_cap=args.truncated_is_cap,
                        use_cpu=args.device == "cpu",
                        seed=args.seed,
                        report_to="none",
                        disable_tqdm=True,
                        num_sample_generations=0,
                        logging_steps=1,
                        save_strategy="no",
                    ),
                    train_dataset=kit.prompt_dataset("train"),
                    eval_dataset=kit.prompt_dataset("test"),
                )
                start = time.perf_counter()
                before = trainer.evaluate()["eval_objective/scores"]
                trainer.train()
                after = trainer.evaluate()["eval_objective/scores"]
                logs = [h for h in trainer.state.log_history if "policy/ratio_at_start" in h]
                run = {
                    "response_length": length,
                    "bf16": bf16,
                    "logprobs_in_fp32": logprobs_fp32,
                    "true_reward_before": before,
                    "true_reward_after": after,
                    "seconds": time.perf_counter() - start,
                    "mean_over_updates": {k: sum(h[k] for h in logs) / len(logs) for k in METRICS},
                    "max_over_updates": {k: max(h[k] for h in logs) for k in METRICS},
                }
                results["runs"][f"{name}_R{length}"] = run
                print(f"{name}_R{length}", json.dumps(run), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rloo_bf16_ratio{args.tag}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
