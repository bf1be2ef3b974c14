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

Wall times per launch on 2 cores (DeepSpeed's comm op already compiled; the higher numbers with other
work on the machine): DDP 12-20 s, ZeRO-2 12-28 s, ZeRO-3 20-34 s, resumes 11-27 s, partitioned
generation with a reward model 23-52 s; 2.5-3.5 min for the file. DeepSpeed's first start on a machine
adds 45-90 s to compile its comm op, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import distributed
import pytest
import torch
from distributed import parameter_digest, read_rank_results, requires_deepspeed, run_script
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_trainers.models import load_reward_model
from rlhf_trainers.ppo.trainer import value_model_from_policy
from rlhf_trainers.rewards import RewardSources
from rlhf_trainers.testing import OfflineKit, true_reward

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

UPDATES = 20
SAVE_STEPS = 10
# A deadlocked launch prints every rank's stacks and exits after this long, before the timeout.
DUMP_STACKS_AFTER = 420

MODES = [
    pytest.param(None, id="ddp"),
    pytest.param("zero2", id="zero2", marks=[pytest.mark.deepspeed, requires_deepspeed]),
    pytest.param("zero3", id="zero3", marks=[pytest.mark.deepspeed, requires_deepspeed]),
]


@dataclass
class Run:
    out: Path
    results: list[dict]

    @property
    def rank0(self) -> dict:
        return self.results[0]


def _launch(kit: OfflineKit, out: Path, deepspeed: str | None, *args: str) -> Run:
    run_script(
        "ppo_distributed.py",
        [
            "--output_dir",
            str(out),
            "--max_steps",
            str(UPDATES),
            "--dump_stacks_after",
            str(DUMP_STACKS_AFTER),
            *args,
        ],
        deepspeed=deepspeed,
        env={"RLHF_TRAINERS_KIT_DIR": str(kit.root)},
        timeout=600,
    )
    return Run(out, read_rank_results(out, 2))


class Runs:
    """The training runs, launched on first use and shared by the tests of this module."""

    def __init__(self, kit: OfflineKit, root: Path) -> None:
        self.kit, self.root, self.cache = kit, root, {}

    def trained(self, deepspeed: str | None) -> Run:
        """20 updates with checkpoints every 10 and save_model() at the end."""
        key = deepspeed or "ddp"
        if key not in self.cache:
            self.cache[key] = _launch(
                self.kit, self.root / key, deepspeed, "--save_steps", str(SAVE_STEPS), "--save_model"
            )
        return self.cache[key]


@pytest.fixture(scope="module")
def runs(kit, tmp_path_factory) -> Runs:
    return Runs(kit, tmp_path_factory.mktemp("ppo-dist"))


@pytest.fixture(scope="module")
def start_digests(kit) -> tuple[str, str]:
    """Digests of the policy and of the value model built from it, as one process builds them."""
    policy = kit.load_model("llama-sft")
    return parameter_digest(policy)[0], parameter_digest(value_model_from_policy(policy))[0]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _check_consistent_and_learned(results: list[dict], mode: str | None, start_digests, key: str) -> None:
    rank0, rank1 = results
    for r in results:
        assert r["torch_world_size"] == 2
        assert r["distributed_type"] == ("DistributedType.DEEPSPEED" if mode else "DistributedType.MULTI_CPU")
        assert r["zero_stage"] == {None: None, "zero2": 2, "zero3": 3}[mode]
        assert r["global_step"] == UPDATES
        # Built from the same weights as on one process (under ZeRO-3: gathered from the partitions).
        assert (r["policy_before"], r["value_before"]) == start_digests
    # Both ranks hold the same policy and value weights, and both changed.
    assert rank0["policy_digest"] == rank1["policy_digest"], "ranks ended with different policies"
    assert rank0["value_digest"] == rank1["value_digest"], "ranks ended with different value models"
    assert rank0["policy_digest"] != rank0["policy_before"]
    assert rank0["value_digest"] != rank0["value_before"]
    # Metrics are reduced over the ranks: every rank logged and evaluated the same numbers.
    assert rank0["scores"] == rank1["scores"]
    assert rank0["metrics"] == rank1["metrics"]
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
    policy = AutoModelForCausalLM.from_pretrained(folder)
    assert parameter_digest(policy) == (rank0["policy_digest"], rank0["policy_numel"])
    value = AutoModelForSequenceClassification.from_pretrained(folder / "value_model")
    assert parameter_digest(value) == (rank0["value_digest"], rank0["value_numel"])
    # full tensors (fp32), not ZeRO-3 shards
    assert (folder / "model.safetensors").stat().st_size > 4 * rank0["policy_numel"]


@pytest.mark.parametrize("mode", MODES)
def test_learns_keeps_ranks_identical_and_saves(kit, runs, start_digests, mode):
    run = runs.trained(mode)
    _check_consistent_and_learned(run.results, mode, start_digests, key="")
    rank0 = run.rank0
    if mode is not None:
        # The first update is DDP's: the same samples (same weights and seeds), the same losses and
        # gradient norm up to the order of the reductions.
        ddp = runs.trained(None).rank0
        assert rank0["scores"][0] == ddp["scores"][0]
        assert rank0["value_loss"][0] == pytest.approx(ddp["value_loss"][0], rel=1e-4)
        assert rank0["grad_norm"][0] == pytest.approx(ddp["grad_norm"][0], rel=1e-4)
    # save_model() and the last checkpoint hold the final weights; the checkpoints carry the on-policy
    # state and, under DeepSpeed, the engine's own checkpoint (4 optimizer steps per update).
    _check_saved(run.out / "final", rank0)
    _check_saved(run.out / f"checkpoint-{UPDATES}", rank0)
    checkpoint = run.out / f"checkpoint-{SAVE_STEPS}"
    state = json.loads((checkpoint / "onpolicy_state.json").read_text())
    assert state["global_step"] == SAVE_STEPS
    if mode is not None:
        assert (checkpoint / f"global_step{SAVE_STEPS * 4}").is_dir()


@pytest.mark.parametrize("mode", MODES)
def test_resume_ends_like_the_uninterrupted_run(kit, runs, tmp_path, mode):
    uninterrupted = runs.trained(mode).rank0
    checkpoint = runs.trained(mode).out / f"checkpoint-{SAVE_STEPS}"
    results = _launch(kit, tmp_path / "out", mode, "--resume_from_checkpoint", str(checkpoint)).results
    for r in results:
        assert r["global_step"] == UPDATES
        assert r["updates_run"] == UPDATES - SAVE_STEPS
        # weights, optimizer state, scheduler, RNG and prompt order all restored: bitwise the same run
        assert r["policy_digest"] == uninterrupted["policy_digest"]
        assert r["value_digest"] == uninterrupted["value_digest"]
    assert results[0]["scores"][SAVE_STEPS:] == uninterrupted["scores"][SAVE_STEPS:]


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
    kit, tmp_path, start_digests, monkeypatch
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
    run = _launch(
        kit,
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
