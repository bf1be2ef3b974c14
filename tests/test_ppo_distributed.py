"""PPOTrainer on 2 CPU ranks: DDP, DeepSpeed ZeRO-2 and ZeRO-3, launched with ``accelerate launch``
through the user-facing configs of ``examples/accelerate_configs/`` (see ``tests/distributed.py``).

Each run trains the kit's ``llama-sft`` for 20 updates of 32 completions (16 per rank) against the
task's true reward, with checkpoints every 10 updates and ``save_model()`` at the end, and must:

- learn: eval true reward about 0 before, above 0.6 after; the logged rollout scores rise;
- stay consistent: both ranks end with bitwise-identical policy AND value weights, which differ from
  the start; the KL to the reference is 0 at the first rollout and the PPO ratio is 1 before each
  update's first step;
- agree with DDP on the first update (same sampled scores exactly, same losses and gradient norm up to
  rounding): DeepSpeed computes the same update;
- save what ``from_pretrained`` loads back with exactly those weights (ZeRO-3: gathered full tensors),
  the value model in ``<dir>/value_model``, and checkpoints from which a resumed run ends with the
  same weights, bitwise, as the uninterrupted one.

A ZeRO-3 run generates with partitioned weights (``ds3_gather_for_generation=False``, so
``generate(synced_gpus=True)``), takes the policy as an instance, and adds the kit's ``llama-seqcls``
as a reward model: it and the reference model run as ZeRO-3 inference engines, and the reward model
must score fixed sequences exactly as the same model does here on one process. That run takes its
DeepSpeed settings from a config file with "auto" values, as the transformers docs write them.
"""

from __future__ import annotations

import json
from pathlib import Path

import distributed
import file_syncs
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
    requires_deepspeed,
)
from transformers import AutoModelForSequenceClassification

from rlhf_trainers.models import load_reward_model
from rlhf_trainers.ppo.trainer import value_model_from_policy
from rlhf_trainers.rewards import RewardSources
from rlhf_trainers.testing import true_reward

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

UPDATES = 20
SAVE_STEPS = 10


@pytest.fixture(scope="module")
def runs(kit, tmp_path_factory) -> OnPolicyRuns:
    return OnPolicyRuns(
        "ppo_distributed.py", kit, tmp_path_factory.mktemp("ppo-dist"), updates=UPDATES, save_steps=SAVE_STEPS
    )


@pytest.fixture(scope="module")
def start_digests(kit) -> tuple[str, str]:
    """Digests of the policy and of the value model built from it, as one process builds them."""
    policy = kit.load_model("llama-sft")
    return parameter_digest(policy)[0], parameter_digest(value_model_from_policy(policy))[0]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _check_consistent_and_learned(results: list[dict], mode: str | None, start_digests, key: str) -> None:
    check_launch(results, mode, UPDATES)
    rank0, rank1 = results
    for r in results:
        # Built from the same weights as on one process (under ZeRO-3: gathered from the partitions).
        assert (r["policy_before"], r["value_before"]) == start_digests
    # Both ranks hold the same policy and value weights, and both changed.
    assert rank0["policy_digest"] == rank1["policy_digest"], "ranks ended with different policies"
    assert rank0["value_digest"] == rank1["value_digest"], "ranks ended with different value models"
    assert rank0["policy_digest"] != rank0["policy_before"]
    assert rank0["value_digest"] != rank0["value_before"]
    # Metrics are reduced over the ranks: every rank logged and evaluated the same numbers.
    assert rank0["scores"] == rank1["scores"]
    assert _untimed(rank0["metrics"]) == _untimed(rank1["metrics"])
    # The reference is the starting policy (KL 0 at the first rollout); the training forward pass
    # reproduces the rollout log-probs before each update's first optimizer step.
    assert rank0["kl"][0] == pytest.approx(0.0, abs=1e-5)
    assert max(rank0["ratio_at_start"]) < 1e-3
    # Learning: the true reward of fresh samples and the rollout scores rose.
    before = rank0["metrics_before"][f"eval_objective/scores{key}"]
    after = rank0["metrics"][f"eval_objective/scores{key}"]
    assert before < 0.2 and after > 0.6, (before, after)
    logged = rank0["scores" if not key else "true_reward"]
    assert _mean(logged[-5:]) > _mean(logged[:5]) + 0.3, logged


def _check_saved(folder: Path, rank0: dict) -> None:
    """``folder`` holds the run's final policy and value model, loadable with from_pretrained."""
    check_saved_policy(folder, rank0)
    value = AutoModelForSequenceClassification.from_pretrained(folder / "value_model")
    assert parameter_digest(value) == (rank0["value_digest"], rank0["value_numel"])


@pytest.mark.parametrize("mode", ONPOLICY_MODES)
def test_learns_keeps_ranks_identical_and_saves(kit, runs, start_digests, mode):
    run = runs.trained(mode)
    _check_consistent_and_learned(run.results, mode, start_digests, key="")
    rank0 = run.rank0
    if mode is not None:
        check_first_update_like_ddp(rank0, runs.trained(None).rank0, "value_loss")
    # save_model() and the last checkpoint hold the final weights; the checkpoints carry the on-policy
    # state and, under DeepSpeed, the engine's own checkpoint (4 optimizer steps per update).
    _check_saved(run.out / "final", rank0)
    _check_saved(run.out / f"checkpoint-{UPDATES}", rank0)
    checkpoint = run.out / f"checkpoint-{SAVE_STEPS}"
    state = json.loads((checkpoint / "onpolicy_state.json").read_text())
    assert state["global_step"] == SAVE_STEPS
    if mode is not None:
        assert (checkpoint / f"global_step{SAVE_STEPS * 4}").is_dir()
    # Power loss: rank 0 fsync'ed every file of each checkpoint before renaming it into place, rank 1's
    # too (its RNG state; its ZeRO shards under DeepSpeed), after both had written them.
    if file_syncs.can_record():
        for step in (SAVE_STEPS, UPDATES):
            assert (
                file_syncs.not_durable_before_rename(rank0["file_syncs"], run.out / f"checkpoint-{step}")
                == []
            )
        assert (checkpoint / "rng_state_1.pth").is_file()
        assert not [e for e in run.results[1]["file_syncs"] if e[0] == "replace" and "checkpoint-" in e[2]]


def test_values_from_the_first_training_pass_under_ddp_accumulation(kit, runs, start_digests, tmp_path):
    """DDP with 2 micro-batches per optimizer step (``rollout_values='auto'``, the default): the first
    micro-batch's forward pass runs before the advantages, under DDP's ``no_sync``, and its backward pass
    waits for step 7. Both ranks stay identical and learn, and the first update is the one of the cached
    DDP run with one micro-batch of the same 8 rows (same samples, loss and gradient norm up to rounding)."""
    run = runs.launch(
        tmp_path / "accumulated",
        None,
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
    )
    _check_consistent_and_learned(run.results, None, start_digests, key="")
    check_first_update_like_ddp(run.rank0, runs.trained(None).rank0, "value_loss")


# ZeRO-2's resume from checkpoint-10 is the first launch of the interruption test below.
@pytest.mark.parametrize("mode", [m for m in ONPOLICY_MODES if m.id != "zero2"])
def test_resume_ends_like_the_uninterrupted_run(runs, tmp_path, mode):
    check_resume(runs, mode, tmp_path / "out", digests=("policy_digest", "value_digest"))


@pytest.mark.deepspeed
@requires_deepspeed
def test_sigterm_to_one_rank_under_zero2_stops_both_and_resumes_like_the_uninterrupted_run(runs, tmp_path):
    """Resume and interruption under DeepSpeed ZeRO-2 (issue #8; tests/test_reliability.py covers one
    process and DDP). A 2-rank launch resumes the ZeRO-2 run from its checkpoint-10; in the middle of
    update 15 rank 1 alone gets SIGTERM. Both ranks finish that update, write one complete checkpoint-15
    (with the engine's own checkpoint) and return from train(). A second 2-rank launch resumes from the
    newest checkpoint, logs exactly the uninterrupted run's metrics for updates 16-20 and ends with its
    weights, bitwise. The uninterrupted run is the cached ZeRO-2 run of the tests above: two launches of
    5 updates each (they replace test_resume_ends_like_the_uninterrupted_run's ZeRO-2 launch).

    Bitwise equality across launches needs the same code in every launch: a change to the package
    between the cached run and these launches (an edit while the session runs) moves the floats by
    rounding and fails the digest check, as it would fail check_resume."""
    from transformers.trainer_utils import get_last_checkpoint

    from rlhf_trainers.reliability import STAGING_PREFIX

    stop = 15
    uninterrupted = runs.trained("zero2")
    expected = uninterrupted.rank0
    out = tmp_path / "out"
    start = uninterrupted.out / f"checkpoint-{SAVE_STEPS}"
    # (8 eval prompts instead of 64: a resumed launch restores the RNG after its evaluation, so the size of
    # the evaluation does not change what it trains)
    small_eval = ("--num_eval_prompts", "8")
    stopped = runs.launch(
        out,
        "zero2",
        "--resume_from_checkpoint",
        str(start),
        "--sigterm_during_update",
        str(stop),
        *small_eval,
    )
    for r in stopped.results:
        assert (r["global_step"], r["updates_run"], r["interrupted"]) == (stop, stop - SAVE_STEPS, True)
        assert r["zero_stage"] == 2 and r["torch_world_size"] == 2
    # Resumed from checkpoint-10, updates 11-15 (the interrupted one too) are the uninterrupted run's.
    assert stopped.rank0["scores"] == expected["scores"][:stop]
    # One complete checkpoint, of the interrupted update, and nothing half-written: the one that
    # resume_from_checkpoint=True picks.
    names = sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", STAGING_PREFIX)))
    assert names == [f"checkpoint-{stop}"]
    checkpoint = out / f"checkpoint-{stop}"
    assert get_last_checkpoint(str(out)) == str(checkpoint)
    assert json.loads((checkpoint / "onpolicy_state.json").read_text())["global_step"] == stop
    assert (checkpoint / "trainer_state.json").is_file()
    assert (checkpoint / "value_model").is_dir()
    assert (checkpoint / f"global_step{stop * 4}").is_dir()  # the engine's checkpoint (4 steps/update)

    resumed = runs.launch(out, "zero2", "--resume_from_checkpoint", str(checkpoint), *small_eval)
    for r in resumed.results:
        assert (r["global_step"], r["updates_run"], r["interrupted"]) == (UPDATES, UPDATES - stop, False)
        for key in ("policy_digest", "value_digest"):
            assert r[key] == expected[key], key
    for key in ("scores", "true_reward", "kl", "ratio_at_start", "value_loss", "grad_norm", "lr"):
        assert len(resumed.rank0[key]) == UPDATES, key
        assert resumed.rank0[key][stop:] == expected[key][stop:], key


# ZeRO-3 as the transformers docs configure it: a DeepSpeed config file whose batch sizes, gradient
# clipping, precision and bucket sizes are "auto" (filled from the training arguments and the model).
DEEPSPEED_CONFIG_FILE = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


@pytest.mark.deepspeed
@requires_deepspeed
def test_zero3_partitioned_generation_with_reward_and_reference_engines(
    kit, runs, tmp_path, start_digests, monkeypatch
):
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps(DEEPSPEED_CONFIG_FILE))
    accelerate_config = tmp_path / "accelerate_config.yaml"
    accelerate_config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        f"  deepspeed_config_file: {ds_config}\n  zero3_init_flag: true\n"
        "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nrdzv_backend: static\nsame_network: true\n"
        "use_cpu: false\n"
    )
    # run_script takes its accelerate config from this table (an absolute path stays as it is)
    monkeypatch.setitem(distributed.ACCELERATE_CONFIGS, "zero3-config-file", str(accelerate_config))
    run = runs.launch(
        tmp_path / "out",
        "zero3-config-file",
        "--no_gather_for_generation",
        "--reward_model",
        "--policy_instance",
    )
    _check_consistent_and_learned(run.results, "zero3", start_digests, key="/true_reward")
    rank0, rank1 = run.results
    for r in run.results:
        assert r["reward_forward"] == r["ref_forward"] == "DeepSpeedEngine"
    # The reward model, partitioned in its inference engine, scores as the whole model does here.
    reward_model, _ = load_reward_model(str(kit.model_path("llama-seqcls")), init_head=False)
    sources = RewardSources(
        policy_tokenizer=kit.load_tokenizer(), reward_model=reward_model, reward_funcs=true_reward
    )
    _, per_source = sources(
        query_response_ids=torch.tensor(rank0["probe_ids"]),
        prompts=[p for p, _ in rank0["probe_texts"]],
        completions=[c for _, c in rank0["probe_texts"]],
    )
    expected = per_source["reward_model"].tolist()
    assert rank0["probe_scores"]["reward_model"] == pytest.approx(expected, abs=1e-5)
    assert rank1["probe_scores"]["reward_model"] == rank0["probe_scores"]["reward_model"]
    # the reward model's scores are part of the rollout scores (weight 0.1)
    assert rank0["scores"][0] != rank0["true_reward"][0]


def _untimed(metrics: dict) -> dict:
    """Evaluation metrics without Trainer's speed measurements (each rank times itself)."""
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second"))}
