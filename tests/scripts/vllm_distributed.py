"""PPO or RLOO with ``use_vllm=True`` on N CPU ranks (DDP, or DeepSpeed ZeRO-2/3 by the accelerate config it
is launched with): one colocated vLLM engine per rank, synced from that rank's policy (ZeRO-3: gathered
module by module; ``--lora``: the adapter merged into the synced weights), or with
``--vllm_server_base_url`` one vLLM server for every rank, synced by the first.

Trains the offline kit's ``llama-hd32-sft`` (head size 32, which vLLM's CPU attention runs) against
:func:`rlhf_trainers.testing.true_reward`, evaluates before and after, and writes
``<output_dir>/result-rank<R>.json`` per rank for ``tests/test_vllm.py``: what every on-policy script
reports (``distributed.train_and_report``) plus the vLLM mismatch metrics of every update and the
engine's sync count.

Launched by ``distributed.run_script("vllm_distributed.py", [...], deepspeed=...)``.
"""

from __future__ import annotations

from distributed import (
    onpolicy_config_kwargs,
    onpolicy_parser,
    parse_onpolicy_args,
    train_and_report,
    write_rank_result,
)

from rlhf_trainers import PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.testing import get_kit, true_reward


def main() -> None:
    parser = onpolicy_parser(__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=("ppo", "rloo"), default="rloo")
    parser.add_argument(
        "--lora", action="store_true", help="train a LoRA adapter (r=8 on q_proj, v_proj and lm_head)"
    )
    parser.add_argument(
        "--rollout_logprobs",
        choices=("auto", "generation"),
        default="auto",
        help="'generation': vLLM's log-probs as the rollout's (no policy forward pass)",
    )
    parser.add_argument(
        "--vllm_server_base_url",
        default=None,
        help="generate on this vLLM server (vllm_mode='server'; the first process syncs it) instead of an "
        "engine per process",
    )
    cli = parse_onpolicy_args(parser)
    kit = get_kit()
    peft_config = None
    if cli.lora:
        from peft import LoraConfig

        # (the kit model ties its head to the embeddings: the adapter on lm_head makes the engine's head
        # untied, and the merged weights of both reach every rank's engine)
        peft_config = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0
        )
    fields = {**onpolicy_config_kwargs(cli), "use_vllm": True, "rollout_logprobs": cli.rollout_logprobs}
    if cli.vllm_server_base_url:
        fields.update(vllm_mode="server", vllm_server_base_url=cli.vllm_server_base_url)
    config = RLOOConfig(**fields, rloo_k=4) if cli.trainer == "rloo" else PPOConfig(**fields)
    trainer_cls = RLOOTrainer if cli.trainer == "rloo" else PPOTrainer
    trainer = trainer_cls(
        model=str(kit.model_path("llama-hd32-sft")),
        processing_class=kit.load_tokenizer(),
        reward_funcs=true_reward,
        args=config,
        train_dataset=kit.prompt_dataset("train", n=512),
        eval_dataset=kit.prompt_dataset("test", n=cli.num_eval_prompts),
        peft_config=peft_config,
    )
    result = train_and_report(
        trainer,
        cli,
        models={"policy": "policy"},
        logs={
            "scores": "objective/scores",
            "kl": "objective/kl",
            "logp_diff_max": "sampling/sampling_logp_difference/max",
            "weight_sync": "timing/weight_sync",
            "policy_seconds": "timing/policy",
            # no separate importance weights where vLLM's log-probs are the rollout's
            **(
                {"is_ratio_mean": "sampling/importance_sampling_ratio/mean"}
                if not trainer.vllm_logprobs_are_old
                else {}
            ),
        },
    )
    result["syncs"] = trainer.generation_backend.syncs
    result["generation"] = trainer.generation_backend.name
    write_rank_result(cli.output_dir, trainer.accelerator.process_index, result)


if __name__ == "__main__":
    main()
