"""GRPO's loss aggregation does not depend on how a batch is split, across processes (2 CPU ranks, DDP).

For every ``loss_type``, each rank builds the same rollout of 4 prompts x 4 completions (same seed), and
computes from it the gradient of the whole batch as one micro-batch (the single-process reference). Then
it trains one step in which the engine sees only its half of the prompts (rank r: prompts 2r and
2r + 1, their 8 completions), as 2 accumulated micro-batches of 4, with ``scale_rewards='batch'`` (whose
std is all-reduced) and ``beta > 0``, and once more for ``dapo`` with micro-batches by token budget
(``max_tokens_per_microbatch``, whose micro-batch counts differ between ranks), once with the
reference's forward pass padded while the ranks' are packed (``padding_free``), and once with balanced
ranks (``balance_batch``: the rows move between the ranks after the advantages): the gradient the
optimizer receives (after DDP's average) must be the reference's. The optimizer step itself is skipped.
Writes ``result-rank<R>.json`` with the largest
differences, for ``tests/test_grpo_distributed.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch
from distributed import write_rank_result

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers import functional as F
from rlhf_trainers.grpo import LOSS_TYPES
from rlhf_trainers.onpolicy import trainer as trainer_module
from rlhf_trainers.onpolicy.rollout import LossNormalization, Rollout
from rlhf_trainers.testing import get_kit, true_reward

K, PROMPTS = 4, 4


def select(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The rollout's `rows` (every per-row field)."""
    picked: dict[str, Any] = {}
    n = rollout.response.shape[0]
    for f in dataclasses.fields(rollout):
        value = getattr(rollout, f.name)
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            value = value[rows]
        elif isinstance(value, list) and len(value) == n:
            value = [value[i] for i in rows.tolist()]
        elif isinstance(value, dict):
            value = {k: v[rows] for k, v in value.items()}
        picked[f.name] = value
    return Rollout(**picked)


def gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters() if p.grad is not None])


def check(
    kit: Any,
    out: str,
    loss_type: str,
    budget: int | None = None,
    padded_reference: bool = False,
    balance: bool = False,
) -> tuple[int, int, dict[str, float]]:
    """One loss type (and micro-batch token budget, balanced ranks): (rank, world size, the differences to
    the single-process reference, and with ``balance`` the token imbalance before and after).
    ``padded_reference``: the reference's forward pass padded, the ranks' packed (``padding_free``, the
    default)."""
    args = GRPOConfig(
        output_dir=f"{out}/{loss_type}-{budget}-{padded_reference}-{balance}",
        max_tokens_per_microbatch=budget,
        balance_batch=balance,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=K,
        max_completion_length=8,
        max_steps=1,
        beta=0.04,
        loss_type=loss_type,
        scale_rewards="batch",
        max_grad_norm=0.0,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        num_sample_generations=0,
        disable_tqdm=True,
        temperature=1.0,
    )
    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=true_reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=64),
        processing_class=kit.load_tokenizer(),
    )
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    torch.manual_seed(1234)  # the same rollout on every rank
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(PROMPTS)])
    full = trainer.rollout(batch)
    assert full.response_mask.sum(1).unique().numel() > 1, "responses of different lengths make the test"
    full_advantages = trainer.compute_advantages(full, trainer.token_rewards(full))
    # the single-process reference: advantages over the whole batch (no all-reduce), one micro-batch
    full_advantages.advantages = F.group_advantages(full.scores, K, "batch")[:, None]
    wrapper = trainer.model
    wrapper.zero_grad()
    rows = torch.arange(K * PROMPTS)
    packed = (trainer.passes.pack_policy, trainer.passes.pack_ref, trainer.passes.pack_values)
    if padded_reference:
        assert trainer.passes.pack_policy, "the kit's policy packs"
        trainer.passes.pack_policy = trainer.passes.pack_ref = trainer.passes.pack_values = False
    logprobs, values, _ = trainer.loop.training_forward(wrapper, full, rows)
    trainer.passes.pack_policy, trainer.passes.pack_ref, trainer.passes.pack_values = packed
    whole = LossNormalization.local(full.response_mask, args.response_length)
    loss, _ = trainer.compute_policy_loss(full, full_advantages, rows, logprobs, values, whole)
    loss.backward()
    reference = gradient(wrapper)
    wrapper.zero_grad()

    # this rank's half: prompts 2r, 2r + 1 with their K completions (layout j * 2 + i kept)
    mine = torch.tensor([j * PROMPTS + i for j in range(K) for i in (2 * rank, 2 * rank + 1)])
    half = select(full, mine)
    trainer.producer.assemble = lambda samples, scores, passes: half  # type: ignore[method-assign]
    seen: list[torch.Tensor] = []
    create = trainer.create_optimizer

    def recording_optimizer(*a: Any, **kw: Any) -> torch.optim.Optimizer:
        optimizer = create(*a, **kw)

        def record(*_: Any, **__: Any) -> None:
            seen.append(gradient(trainer.model))

        optimizer.step = record  # type: ignore[method-assign]
        return optimizer

    trainer.create_optimizer = recording_optimizer  # type: ignore[method-assign]
    balanced: dict[str, float] = {}
    rebalance = trainer_module.rebalance

    def recording_rebalance(*a: Any, **kw: Any) -> Any:
        rollout, advantages, metrics = rebalance(*a, **kw)
        kept = (rollout.response[:, None, :] == half.response[None]).all(-1).any(1)  # rows it generated
        balanced.update(metrics, rows_kept=float(kept.sum()))
        return rollout, advantages, metrics

    trainer_module.rebalance = recording_rebalance
    try:
        trainer.train()
    finally:
        trainer_module.rebalance = rebalance
    assert len(seen) == 1, len(seen)
    difference = (seen[0] - reference).abs()
    return (
        rank,
        world,
        {
            "max_abs_difference": float(difference.max()),
            "max_abs_gradient": float(reference.abs().max()),
            "relative": float(difference.norm() / reference.norm()),
            **balanced,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    out = parser.parse_args().output_dir
    kit = get_kit()
    results: dict[str, Any] = {}
    rank = world = 0
    for loss_type in sorted(LOSS_TYPES):
        rank, world, results[loss_type] = check(kit, out, loss_type)
    # micro-batches by token budget: their number depends on each rank's lengths
    rank, world, results["dapo+token_budget"] = check(kit, out, "dapo", budget=30)
    # padding-free passes on the ranks against a padded single-process reference
    rank, world, results["dapo+packed_vs_padded"] = check(kit, out, "dapo", padded_reference=True)
    # balanced ranks: the rows move between the processes after the advantages
    rank, world, results["dapo+balance_batch"] = check(kit, out, "dapo", balance=True)
    write_rank_result(out, rank, {"world_size": world, "results": results})


if __name__ == "__main__":
    main()
