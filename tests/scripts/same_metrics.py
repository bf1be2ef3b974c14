"""PPO, RLOO and GRPO on the offline kit, with and without a LoRA adapter, for a few updates each: every
metric they log (times left out) and their evaluation afterwards, for ``tests/test_same_metrics.py``.

Run on 1 or 2 ranks (``tests/distributed.py``'s ``run_script``); each rank writes
``result-rank<R>.json`` with ``{"runs": {name: {"logs": [...], "eval": {...}}}}``. The test compares
rank 0's numbers with ``tests/data/same_metrics.json``, recorded from the code before the engine was
split into parts (issue #47): a restructure that changes no number a user sees passes it.

Each run exercises the engine's main paths: PPO with a reward model and a reward function, a value model,
GAE, rollout values from the first training pass, 2 epochs x 2 mini-batches; RLOO with k=4, sequence
KL, 2 epochs; GRPO with beta > 0 (a reference model), 2 iterations x 2 steps per generation.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from distributed import write_rank_result

from rlhf_trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.testing import get_kit, true_reward

#: Metric names left out of the comparison: wall times and rates, which no two runs share.
VOLATILE_PREFIXES = (
    "timing/",
    "perf/",
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
)
VOLATILE_NAMES = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "total_flos"}

COMMON: dict[str, Any] = {
    "learning_rate": 2e-3,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "seed": 0,
    "num_sample_generations": 0,
    "disable_tqdm": True,
}


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _trainer(algorithm: str, lora: bool, out: str, kit: Any) -> Any:
    tokenizer = kit.load_tokenizer()
    data = {
        "train_dataset": kit.prompt_dataset("train", n=64),
        "eval_dataset": kit.prompt_dataset("test", n=16),
        "processing_class": tokenizer,
        "peft_config": _lora() if lora else None,
    }
    if algorithm == "ppo":
        args = PPOConfig(
            output_dir=out,
            **COMMON,
            response_length=10,
            per_device_train_batch_size=8,
            num_mini_batches=2,
            num_ppo_epochs=2,
            gradient_accumulation_steps=2,
            max_steps=3,
            reward_weights=[1.0, 0.5],
        )
        return PPOTrainer(
            model=kit.load_model("llama-sft"),
            reward_model=kit.load_model("llama-seqcls"),
            reward_funcs=[true_reward],
            args=args,
            **data,
        )
    if algorithm == "rloo":
        args = RLOOConfig(
            output_dir=out,
            **COMMON,
            response_length=10,
            per_device_train_batch_size=16,
            rloo_k=4,
            num_ppo_epochs=2,
            num_mini_batches=2,
            max_steps=3,
        )
        return RLOOTrainer(model=kit.load_model("llama-sft"), reward_funcs=true_reward, args=args, **data)
    args = GRPOConfig(
        output_dir=out,
        **COMMON,
        num_generations=4,
        max_completion_length=10,
        per_device_train_batch_size=8,
        steps_per_generation=2,
        num_iterations=2,
        beta=0.02,
        max_steps=12,
    )
    return GRPOTrainer(model=kit.load_model("llama-sft"), reward_funcs=true_reward, args=args, **data)


def _kept(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float))
        and not name.startswith(VOLATILE_PREFIXES)
        and name not in VOLATILE_NAMES
        and not (isinstance(value, float) and math.isnan(value))
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--runs", default="ppo,ppo-lora,rloo,rloo-lora,grpo,grpo-lora")
    cli = parser.parse_args()
    kit = get_kit()
    runs: dict[str, Any] = {}
    rank, world = 0, 1
    for name in cli.runs.split(","):
        algorithm, _, variant = name.partition("-")
        trainer = _trainer(algorithm, variant == "lora", f"{cli.output_dir}/{name}", kit)
        trainer.train()
        runs[name] = {
            # (the updates' entries: not the end-of-run summary, train_runtime and train_loss, logged since)
            "logs": [_kept(log) for log in trainer.state.log_history if "train_runtime" not in log],
            "eval": _kept(trainer.evaluate()),
        }
        rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    write_rank_result(cli.output_dir, rank, {"world_size": world, "runs": runs})


if __name__ == "__main__":
    main()
