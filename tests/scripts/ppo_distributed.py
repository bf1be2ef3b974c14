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

import torch
from distributed import (
    onpolicy_config_kwargs,
    onpolicy_parser,
    parse_onpolicy_args,
    train_and_report,
    write_rank_result,
)

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


def main() -> None:
    parser = onpolicy_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--reward_model", action="store_true", help="also score with the kit's llama-seqcls (weight 0.1)"
    )
    parser.add_argument(
        "--policy_instance",
        action="store_true",
        help="pass the policy as a model loaded before the training arguments (under ZeRO-3 not partitioned "
        "until the engine starts) instead of as a path (partitioned while it loads, zero3_init_flag)",
    )
    cli = parse_onpolicy_args(parser)

    kit = get_kit()
    policy = kit.load_model("llama-sft") if cli.policy_instance else str(kit.model_path("llama-sft"))
    args = PPOConfig(
        **onpolicy_config_kwargs(cli),
        reward_weights=[0.1, 1.0] if cli.reward_model else None,
    )
    trainer = PPOTrainer(
        model=policy,
        processing_class=kit.load_tokenizer(),
        reward_model=str(kit.model_path("llama-seqcls")) if cli.reward_model else None,
        reward_funcs=true_reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=512),
        eval_dataset=kit.prompt_dataset("test", n=cli.num_eval_prompts),
    )
    result = train_and_report(
        trainer,
        cli,
        models={"policy": "policy", "value": "value_model"},
        logs={
            "scores": "objective/scores",
            "lr": "lr",
            "true_reward": "objective/scores/true_reward",
            "kl": "objective/kl",
            "ratio_at_start": "policy/ratio_at_start",
            "value_loss": "loss/value_avg",
            "grad_norm": "grad_norm",
        },
    )
    if cli.reward_model:
        # On every rank (a collective under ZeRO-3): the probe scored through the rollout's reward path.
        ids = probe_ids(trainer.processing_class)
        _, per_source = trainer.reward_sources(
            query_response_ids=ids,
            prompts=[p for p, _ in PROBE_TEXTS],
            completions=[c for _, c in PROBE_TEXTS],
            reward_model_forward=trainer.passes.reward_forward,
        )
        result["probe_ids"] = ids.tolist()
        result["probe_texts"] = PROBE_TEXTS
        result["probe_scores"] = {name: v.tolist() for name, v in per_source.items()}
    result["reward_forward"] = type(trainer.passes.reward_forward).__name__
    result["ref_forward"] = type(trainer.passes.ref_forward).__name__
    write_rank_result(cli.output_dir, trainer.accelerator.process_index, result)


if __name__ == "__main__":
    main()
