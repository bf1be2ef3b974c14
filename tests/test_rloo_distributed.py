"""RLOOTrainer on 2 CPU ranks: DDP, DeepSpeed ZeRO-2 and ZeRO-3, and a LoRA adapter under DDP, launched
with ``accelerate launch`` through the user-facing configs of ``examples/accelerate_configs/`` (see
``tests/distributed.py``).

Each run trains the kit's ``llama-sft`` for 20 updates of 32 completions (per rank 4 prompts x
``rloo_k=4``) against the task's true reward, with checkpoints every 10 updates and ``save_model()`` at
the end, and must:

- learn: eval true reward about 0 before, above 0.6 after; the logged ``rlhf_reward`` rises;
- stay consistent: both ranks end with bitwise-identical policy weights, which differ from the start;
  metrics are reduced over the ranks (32 completions kept per update); KL 0 at the first rollout and
  ratios 1 before each update's first step;
- keep a prompt's k completions together: each prompt of an update is sampled k times on one rank and on
  no other, so the leave-one-out baseline computed on each rank equals the one computed over the
  completions of all ranks (recomputed here from what the ranks recorded);
- agree with DDP on the first update (same scores exactly, same loss and gradient norm up to rounding);
- save what ``from_pretrained`` loads back with exactly those weights (ZeRO-3: gathered full tensors),
  and checkpoints from which a resumed run ends with the same weights, bitwise, as the uninterrupted one.

The LoRA run checks the adapter-disabled reference: no second copy of the model, only adapter weights
trained (identically on both ranks), and the reference log-probs after training equal the untouched
model's.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from distributed import (
    ONPOLICY_MODES,
    OnPolicyRuns,
    check_first_update_like_ddp,
    check_launch,
    check_resume,
    check_saved_policy,
    parameter_digest,
)

from rlhf_trainers import functional as F
from rlhf_trainers.testing import OfflineKit

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

UPDATES = 20
SAVE_STEPS = 10
K = 4
PROMPTS_PER_RANK = 4
ROWS_PER_RANK = K * PROMPTS_PER_RANK


@pytest.fixture(scope="module")
def runs(kit, tmp_path_factory) -> OnPolicyRuns:
    return OnPolicyRuns(
        "rloo_distributed.py",
        kit,
        tmp_path_factory.mktemp("rloo-dist"),
        updates=UPDATES,
        save_steps=SAVE_STEPS,
    )


@pytest.fixture(scope="module")
def start_digest(kit: OfflineKit) -> str:
    return parameter_digest(kit.load_model("llama-sft"))[0]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _check_consistent_and_learned(results: list[dict], mode: str | None) -> None:
    check_launch(results, mode, UPDATES)
    rank0, rank1 = results
    assert (
        "8 prompts x 4 completion(s) = 32 completions per update (16 per process x 2 processes)"
        in (rank0["batch_accounting"])
    )
    # Both ranks hold the same policy, and it changed.
    assert rank0["policy_digest"] == rank1["policy_digest"], "ranks ended with different policies"
    assert rank0["policy_digest"] != rank0["policy_before"]
    # Metrics are reduced over the ranks: every rank logged and evaluated the same numbers.
    for key in ("scores", "rlhf_reward", "reward_std_per_prompt", "num_completions_kept", "kl"):
        assert rank0[key] == rank1[key], key
    assert _untimed(rank0["metrics"]) == _untimed(rank1["metrics"])
    assert rank0["num_completions_kept"] == [2.0 * ROWS_PER_RANK] * UPDATES
    # The reference is the starting policy; the training forward pass reproduces the rollout's
    # log-probs, per token and per sequence, before each update's first optimizer step.
    assert rank0["kl"][0] == pytest.approx(0.0, abs=1e-5)
    assert max(rank0["ratio_at_start"]) < 1e-3
    assert max(rank0["seq_ratio_at_start_max"]) < 1.01
    # Learning: the true reward of fresh samples and the reward RLOO maximises rose.
    before, after = (
        rank0["metrics_before"]["eval_objective/scores"],
        rank0["metrics"]["eval_objective/scores"],
    )
    assert before < 0.2 and after > 0.6, (before, after)
    assert _mean(rank0["rlhf_reward"][-5:]) > _mean(rank0["rlhf_reward"][:5]) + 0.3, rank0["rlhf_reward"]


def _check_leave_one_out_across_ranks(results: list[dict]) -> int:
    """Every recorded update: each prompt's k completions are on one rank (rows ``j * B + i``), the ranks
    hold different prompts, and each rank's advantages equal the leave-one-out baseline computed over
    the completions of both ranks, grouped by prompt. Returns the number of updates checked."""
    updates = [r["records"] for r in results]
    assert len({len(u) for u in updates}) == 1 and len(updates[0]) > 0
    for update, per_rank in enumerate(zip(*updates, strict=True)):
        groups: dict[int, list[float]] = defaultdict(list)
        owner: dict[int, set[int]] = defaultdict(set)
        for rank, rec in enumerate(per_rank):
            index = rec["prompt_index"]
            assert len(index) == ROWS_PER_RANK
            # completion j of prompt i at row j * B + i
            assert index == index[:PROMPTS_PER_RANK] * K
            assert all(rec["valid"])
            for i, reward in zip(index, rec["rlhf_reward"], strict=True):
                groups[i].append(reward)
                owner[i].add(rank)
        assert all(len(ranks) == 1 for ranks in owner.values()), f"update {update}: a prompt on both ranks"
        assert len(groups) == 2 * PROMPTS_PER_RANK and all(len(g) == K for g in groups.values())
        for rec in per_rank:
            for i, reward, advantage in zip(
                rec["prompt_index"], rec["rlhf_reward"], rec["advantages"], strict=True
            ):
                others = (sum(groups[i]) - reward) / (K - 1)
                assert advantage == pytest.approx(reward - others, abs=1e-6), (update, i)
    return len(updates[0])


@pytest.mark.parametrize("mode", ONPOLICY_MODES)
def test_learns_keeps_ranks_identical_and_saves(runs, start_digest, mode):
    run = runs.trained(mode)
    _check_consistent_and_learned(run.results, mode)
    for r in run.results:
        # Built from the same weights as on one process (under ZeRO-3: gathered from the partitions).
        assert r["policy_before"] == start_digest
    assert _check_leave_one_out_across_ranks(run.results) == UPDATES
    rank0 = run.rank0
    if mode is not None:
        check_first_update_like_ddp(rank0, runs.trained(None).rank0, "policy_loss")
    # save_model() and the last checkpoint hold the final weights (no value model), the middle checkpoint
    # the on-policy state and, under DeepSpeed, the engine's own checkpoint (4 optimizer steps per update).
    for folder in (run.out / "final", run.out / f"checkpoint-{UPDATES}"):
        check_saved_policy(folder, rank0)
        assert not (folder / "value_model").exists()
    checkpoint = run.out / f"checkpoint-{SAVE_STEPS}"
    assert json.loads((checkpoint / "onpolicy_state.json").read_text())["global_step"] == SAVE_STEPS
    if mode is not None:
        assert (checkpoint / f"global_step{SAVE_STEPS * 4}").is_dir()


@pytest.mark.parametrize("mode", ONPOLICY_MODES)
def test_resume_ends_like_the_uninterrupted_run(runs, tmp_path, mode):
    results = check_resume(runs, mode, tmp_path / "out")
    # the resumed launch computed the last updates' advantages the same way
    assert _check_leave_one_out_across_ranks(results) == UPDATES - SAVE_STEPS
    uninterrupted = runs.trained(mode).rank0["records"][SAVE_STEPS:]
    assert results[0]["records"] == uninterrupted


@pytest.mark.parametrize("mode", ONPOLICY_MODES)
def test_its_checkpoint_is_refused_on_1_process_before_anything_is_loaded(kit, runs, tmp_path, mode):
    """Resuming a 2-process checkpoint (the trained run's middle one) on 1 process is refused with what
    was given and expected (docs/reliability.md, "Resuming on another number of processes"): without the
    check DDP resumes quietly with other batches and the RNG states not restored, and DeepSpeed fails
    later on its optimizer partitions. tests/test_resume_process_count.py has the other direction and
    the unit tests."""
    from test_resume_process_count import _rloo

    checkpoint = runs.trained(mode).out / f"checkpoint-{SAVE_STEPS}"
    assert json.loads((checkpoint / "onpolicy_state.json").read_text())["num_processes"] == 2
    refusal = r"saved by a run on 2 process\(es\), and this run has 1"
    if mode is None:
        trainer = _rloo(kit, tmp_path / "one", max_steps=SAVE_STEPS + 2)
        with pytest.raises(ValueError, match=refusal):
            trainer.train(resume_from_checkpoint=str(checkpoint))
        assert trainer.state.global_step == 0
        return
    # under DeepSpeed, launched as a user would: 1 process with the same ZeRO config
    with pytest.raises(AssertionError, match=refusal):
        runs.launch(
            tmp_path / "one",
            mode,
            "--resume_from_checkpoint",
            str(checkpoint),
            *("--num_eval_prompts", "8"),  # the script evaluates before train(), which refuses
            num_processes=1,
        )


def test_lora_under_ddp_trains_the_adapter_against_the_adapter_disabled_reference(kit, runs, tmp_path):
    run = runs.launch(tmp_path / "out", None, "--lora", "--learning_rate", "5e-3", "--save_model")
    _check_consistent_and_learned(run.results, None)
    rank0, rank1 = run.results
    for r in run.results:
        # the reference is the policy with its adapter disabled: one model in memory, no ref_model
        assert r["ref_model_is_none"] is True
        assert r["causal_lm_modules"] == 1
        assert r["lora_trainable"] and all("lora_" in name for name in r["lora_trainable"])
    # After training, the reference still gives the untouched model's log-probs: the base weights are
    # frozen and only the adapter learned.
    ids, prompt_length = torch.tensor(rank0["probe_ids"]), rank0["probe_prompt_length"]
    with torch.no_grad():
        logits = kit.load_model("llama-sft")(input_ids=ids).logits[:, prompt_length - 1 : -1]
    expected = F.logprobs_from_logits(logits, ids[:, prompt_length:], 1.0)
    for r in run.results:
        assert torch.allclose(torch.tensor(r["probe_ref_logprobs"]), expected, atol=1e-5)
    assert rank0["probe_ref_logprobs"] == rank1["probe_ref_logprobs"]
    assert (run.out / "final" / "adapter_model.safetensors").is_file()


def _untimed(metrics: dict) -> dict:
    """Evaluation metrics without Trainer's speed measurements (each rank times itself)."""
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second"))}
