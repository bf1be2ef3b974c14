"""RLOOTrainer on N CPU ranks (DDP, or DeepSpeed ZeRO-2/3 by the accelerate config it is launched with).

Trains the offline kit's ``llama-sft`` policy with RLOO (``rloo_k=4``: 4 prompts x 4 completions per
rank and update) against :func:`rlhf_trainers.testing.true_reward`, optionally as a LoRA adapter
(``--lora``), evaluates before and after, optionally saves checkpoints, resumes from one, or saves the
final model, and writes ``<output_dir>/result-rank<R>.json`` per rank for
``tests/test_rloo_distributed.py``: what every on-policy script reports (see
``distributed.train_and_report``), plus for every update of this launch the dataset index of the prompt
of each rollout row, the rows' ``rlhf_reward``, validity and leave-one-out advantages, so the test can
check that a prompt's k completions never leave their rank and recompute the baseline over all ranks.

Launched by ``distributed.run_script("rloo_distributed.py", [...], deepspeed=...)``.
"""

from __future__ import annotations

from typing import Any

import torch
from distributed import (
    onpolicy_config_kwargs,
    onpolicy_parser,
    parse_onpolicy_args,
    train_and_report,
    write_rank_result,
)

from rlhf_trainers import RLOOConfig, RLOOTrainer
from rlhf_trainers import functional as F
from rlhf_trainers.onpolicy.rollout import Advantages, Rollout
from rlhf_trainers.testing import get_kit, true_reward

#: Token ids the reference model scores at the end (``--lora``): a prompt of 3 and a response of 5.
PROBE_IDS = [[5, 6, 7, 8, 9, 10, 11, 12]]
PROBE_PROMPT_LENGTH = 3


class RecordingRLOOTrainer(RLOOTrainer):
    """Records the leave-one-out inputs and outputs of every update this process computes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict[str, list]] = []
        self._prompt_index: list[int] = []
        prompt_batch = self.producer.prompt_batch

        def recording(update: int) -> dict[str, Any]:
            # The "idx" column reaches the collated batch like any extra column (it goes to the reward
            # functions too, which ignore it); rows are the k copies of the batch, as in the engine.
            batch = prompt_batch(update)
            self._prompt_index = [int(i) for i in batch["idx"]] * self.args.rloo_k
            return batch

        self.producer.prompt_batch = recording  # type: ignore[method-assign]

    def compute_advantages(self, rollout: Rollout, rewards: torch.Tensor) -> Advantages:
        advantages = super().compute_advantages(rollout, rewards)
        self.records.append(
            {
                "prompt_index": self._prompt_index,
                "rlhf_reward": advantages.rlhf_reward.double().tolist(),
                "valid": rollout.valid_rows.tolist(),
                "advantages": advantages.advantages.reshape(-1).double().tolist(),
            }
        )
        return advantages


def main() -> None:
    parser = onpolicy_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--lora", action="store_true", help="train a LoRA adapter (r=8 on q_proj, v_proj and lm_head)"
    )
    cli = parse_onpolicy_args(parser)

    kit = get_kit()
    peft_config = None
    if cli.lora:
        from peft import LoraConfig

        # The kit's tiny model ties its output head to the embeddings: without an adapter on lm_head it
        # barely learns the task in 20 updates (docs/ppo.md, LoRA); with it, as fast as full training.
        peft_config = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0
        )
    train_dataset = kit.prompt_dataset("train", n=512)
    trainer = RecordingRLOOTrainer(
        model=str(kit.model_path("llama-sft")),
        processing_class=kit.load_tokenizer(),
        reward_funcs=true_reward,
        args=RLOOConfig(**onpolicy_config_kwargs(cli), rloo_k=4),
        train_dataset=train_dataset.add_column("idx", list(range(len(train_dataset)))),
        eval_dataset=kit.prompt_dataset("test", n=cli.num_eval_prompts),
        peft_config=peft_config,
    )
    result = train_and_report(
        trainer,
        cli,
        models={"policy": "policy"},
        logs={
            "scores": "objective/scores",
            "lr": "lr",
            "rlhf_reward": "objective/rlhf_reward",
            "reward_std_per_prompt": "objective/reward_std_per_prompt",
            "num_completions_kept": "rollout/num_completions_kept",
            "kl": "objective/kl",
            "ratio_at_start": "policy/ratio_at_start",
            "seq_ratio_at_start_max": "policy/seq_ratio_at_start_max",
            "policy_loss": "loss/policy_avg",
            "grad_norm": "grad_norm",
        },
    )
    result["records"] = trainer.records
    result["batch_accounting"] = trainer.batch_accounting()
    if cli.lora:
        policy = trainer.policy
        named = dict(policy.named_parameters())
        result["lora_trainable"] = sorted(n for n, p in named.items() if p.requires_grad)
        result["ref_model_is_none"] = trainer.ref_model is None
        result["causal_lm_modules"] = sum(type(m).__name__.endswith("ForCausalLM") for m in policy.modules())
        # The reference log-probs of a fixed sequence, through the trainer's reference path (the policy
        # with its adapter disabled): the test compares them with the untouched kit model's.
        ids = torch.tensor(PROBE_IDS)
        mask = torch.ones_like(ids)
        ref = trainer.passes.reference_logprobs(
            ids, mask, F.position_ids_from_mask(mask), ids[:, PROBE_PROMPT_LENGTH:]
        )
        result["probe_ref_logprobs"] = ref.tolist()
        result["probe_ids"], result["probe_prompt_length"] = PROBE_IDS, PROBE_PROMPT_LENGTH
    write_rank_result(cli.output_dir, trainer.accelerator.process_index, result)


if __name__ == "__main__":
    main()
