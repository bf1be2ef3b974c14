"""GRPOTrainer on N CPU ranks (DDP by the accelerate config it is launched with): the offline kit's
``llama-sft`` learns the task's hidden true reward with the kit settings of ``rlhf-trainers grpo`` (per
rank 8 prompts x 4 completions per generation, 2 iterations x 2 optimizer steps), ``beta > 0`` (a
reference model on every rank). Writes ``result-rank<R>.json`` (evaluation before and after, the policy's
digest, the logged steps) for ``tests/test_grpo_distributed.py``.
"""

from __future__ import annotations

import argparse

from distributed import parameter_digest, write_rank_result

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers.scripts.grpo import KIT_DEFAULTS
from rlhf_trainers.testing import get_kit, true_reward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    out = parser.parse_args().output_dir
    kit = get_kit()
    args = GRPOConfig(
        output_dir=out,
        **KIT_DEFAULTS,
        beta=0.01,
        max_steps=24,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        num_sample_generations=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=true_reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=512),
        eval_dataset=kit.prompt_dataset("test", n=64),
        processing_class=kit.load_tokenizer(),
    )
    before = trainer.evaluate()["eval_objective/scores"]
    trainer.train()
    after = trainer.evaluate()["eval_objective/scores"]
    logged = [h for h in trainer.state.log_history if "objective/scores" in h]
    write_rank_result(
        out,
        trainer.accelerator.process_index,
        {
            "world_size": trainer.accelerator.num_processes,
            "before": before,
            "after": after,
            "digest": parameter_digest(trainer.policy)[0],
            "steps": [h["step"] for h in logged],
            "completions_kept": [h["rollout/num_completions_kept"] for h in logged],
            "global_step": trainer.state.global_step,
        },
    )


if __name__ == "__main__":
    main()
