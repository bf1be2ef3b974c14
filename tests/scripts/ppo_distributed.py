"""PPOTrainer on N CPU ranks (DDP, or DeepSpeed ZeRO-2/3 by the accelerate config it is launched with).

Trains the offline kit's ``llama-sft`` policy with PPO against :func:`rlhf_trainers.testing.true_reward`
(optionally plus the kit's ``llama-seqcls`` as a reward model), evaluates before and after, optionally
saves checkpoints, resumes from one, or saves the final model, and writes
``<output_dir>/result-rank<R>.json`` per rank for ``tests/test_ppo_distributed.py``: world size,
distributed mode, the updates run, the per-update training log, the eval metrics before and after,
digests of the policy and value weights before and after training (gathered under ZeRO-3), and, with
a reward model, its scores of fixed sequences computed the way the rollout computes them (through the
ZeRO-3 inference engine there).

Launched by ``distributed.run_script("ppo_distributed.py", [...], deepspeed=...)``.
"""

from __future__ import annotations

import argparse
import faulthandler
import time

import torch
from distributed import parameter_digest, write_rank_result
from transformers import TrainerCallback

from rlhf_trainers import PPOConfig, PPOTrainer
from rlhf_trainers.testing import get_kit, true_reward

#: Fixed prompt + completion texts the reward model scores at the end (``--reward_model``).
PROBE_TEXTS = [
    ("the movie was", " good and nice ."),
    ("my day was", " bad , sad and awful ."),
    ("the food here is", " fine"),
    ("i think the book", " was great , really great !"),
]


def probe_ids(tokenizer) -> torch.Tensor:
    """The probe texts as one batch of ids laid out as a rollout's: the prompt left-padded, the
    completion right-padded after it."""
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in PROBE_TEXTS]
    completions = [tokenizer(c, add_special_tokens=False)["input_ids"] for _, c in PROBE_TEXTS]
    lp, lc = max(map(len, prompts)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    rows = [
        [pad] * (lp - len(p)) + p + c + [pad] * (lc - len(c))
        for p, c in zip(prompts, completions, strict=True)
    ]
    return torch.tensor(rows)


class CountUpdates(TrainerCallback):
    """Counts the updates this launch ran (a resumed run starts at the checkpoint's step)."""

    def __init__(self) -> None:
        self.updates = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.updates += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--num_eval_prompts", type=int, default=64)
    parser.add_argument("--save_steps", type=int, default=0, help="checkpoint every N updates (0: none)")
    parser.add_argument("--save_model", action="store_true", help="trainer.save_model(<output_dir>/final)")
    parser.add_argument("--resume_from_checkpoint", default=None, help="train(resume_from_checkpoint=...)")
    parser.add_argument(
        "--no_gather_for_generation", action="store_true", help="ds3_gather_for_generation=False"
    )
    parser.add_argument(
        "--reward_model", action="store_true", help="also score with the kit's llama-seqcls (weight 0.1)"
    )
    parser.add_argument(
        "--policy_instance",
        action="store_true",
        help="pass the policy as a model loaded before the training arguments (under ZeRO-3 not partitioned "
        "until the engine starts) instead of as a path (partitioned while it loads, zero3_init_flag)",
    )
    parser.add_argument(
        "--dump_stacks_after",
        type=float,
        default=0,
        help="seconds after which every rank prints its Python stacks and exits (a deadlock shows where the "
        "ranks wait instead of running into the test's timeout); 0: never",
    )
    cli = parser.parse_args()
    if cli.dump_stacks_after:
        faulthandler.dump_traceback_later(cli.dump_stacks_after, exit=True)

    kit = get_kit()
    policy = kit.load_model("llama-sft") if cli.policy_instance else str(kit.model_path("llama-sft"))
    args = PPOConfig(
        output_dir=cli.output_dir,
        learning_rate=cli.learning_rate,
        per_device_train_batch_size=cli.per_device_train_batch_size,
        gradient_accumulation_steps=cli.gradient_accumulation_steps,
        num_mini_batches=2,
        num_ppo_epochs=2,
        response_length=12,
        temperature=1.0,
        kl_coef=0.05,
        max_steps=cli.max_steps,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="steps" if cli.save_steps else "no",
        save_steps=cli.save_steps or 500,
        report_to="none",
        disable_tqdm=True,
        num_sample_generations=0,
        seed=0,
        use_cpu=True,
        ds3_gather_for_generation=not cli.no_gather_for_generation,
        reward_weights=[0.1, 1.0] if cli.reward_model else None,
    )
    counter = CountUpdates()
    trainer = PPOTrainer(
        model=policy,
        processing_class=kit.load_tokenizer(),
        reward_model=str(kit.model_path("llama-seqcls")) if cli.reward_model else None,
        reward_funcs=true_reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=512),
        eval_dataset=kit.prompt_dataset("test", n=cli.num_eval_prompts),
        callbacks=[counter],
    )
    policy_before = parameter_digest(trainer.policy)
    value_before = parameter_digest(trainer.value_model)
    metrics_before = trainer.evaluate()
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=cli.resume_from_checkpoint)
    train_seconds = time.perf_counter() - started
    metrics = trainer.evaluate()
    if cli.save_model:
        trainer.save_model(f"{cli.output_dir}/final")

    result = {}
    if cli.reward_model:
        # On every rank (a collective under ZeRO-3): the probe scored through the rollout's reward path.
        ids = probe_ids(trainer.processing_class)
        _, per_source = trainer.reward_sources(
            query_response_ids=ids,
            prompts=[p for p, _ in PROBE_TEXTS],
            completions=[c for _, c in PROBE_TEXTS],
            reward_model_forward=trainer._reward_forward,
        )
        result["probe_ids"] = ids.tolist()
        result["probe_texts"] = PROBE_TEXTS
        result["probe_scores"] = {name: v.tolist() for name, v in per_source.items()}
    result["reward_forward"] = type(trainer._reward_forward).__name__
    result["ref_forward"] = type(trainer._ref_forward).__name__

    state = trainer.accelerator.state
    policy_digest, policy_numel = parameter_digest(trainer.policy)
    value_digest, value_numel = parameter_digest(trainer.value_model)
    logs = [log for log in trainer.state.log_history if "objective/scores" in log]
    result.update(
        {
            "world_size": state.num_processes,
            "torch_world_size": torch.distributed.get_world_size()
            if torch.distributed.is_initialized()
            else 1,
            "distributed_type": str(state.distributed_type),
            "zero_stage": state.deepspeed_plugin.zero_stage if state.deepspeed_plugin else None,
            "global_step": trainer.state.global_step,
            "updates_run": counter.updates,
            "train_seconds": train_seconds,
            "scores": [log["objective/scores"] for log in logs],
            "true_reward": [log["objective/scores/true_reward"] for log in logs],
            "kl": [log["objective/kl"] for log in logs],
            "ratio_at_start": [log["policy/ratio_at_start"] for log in logs],
            "value_loss": [log["loss/value_avg"] for log in logs],
            "grad_norm": [log["grad_norm"] for log in logs],
            "metrics_before": metrics_before,
            "metrics": metrics,
            "policy_before": policy_before[0],
            "value_before": value_before[0],
            "policy_digest": policy_digest,
            "policy_numel": policy_numel,
            "value_digest": value_digest,
            "value_numel": value_numel,
        }
    )
    write_rank_result(cli.output_dir, state.process_index, result)


if __name__ == "__main__":
    main()
