"""RewardTrainer on 2 CPU ranks: DDP, DeepSpeed ZeRO-2 and ZeRO-3, launched with ``accelerate launch``
through the user-facing configs of ``examples/accelerate_configs/`` (see ``tests/distributed.py``).

The reference is the same job on 1 process with the same global batch (32 pairs): accelerate splits
each global batch between the ranks, so the training losses must agree to float rounding, and the
held-out accuracy with them. Each distributed run also has to leave bitwise-identical weights and the
same reward normalization on both ranks, and save a checkpoint that reloads here with exactly those
weights (ZeRO-3: gathered full tensors, not shards) and scores the held-out pairs as the run reported.

Every run calls ``evaluate()`` before ``train()`` (a baseline, as users do), which plain
``transformers.Trainer`` gets wrong on all three paths (see ``rlhf_trainers/compat.py``).
"""

from __future__ import annotations

import json

import pytest
import torch
from distributed import REPO_ROOT, parameter_digest, read_rank_results, requires_deepspeed, run_script

from rlhf_trainers.generation import sample_completions
from rlhf_trainers.models import get_reward_normalization, load_reward_model
from rlhf_trainers.rewards import join_prompt_completion, score_texts
from rlhf_trainers.testing import OfflineKit

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

GLOBAL_BATCH = 32


def _launch(kit: OfflineKit, out, num_processes: int, deepspeed: str | None = None) -> list[dict]:
    run_script(
        "reward_distributed.py",
        [
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            str(GLOBAL_BATCH // num_processes),
            "--normalize",
            "--evaluate_first",
        ],
        num_processes=num_processes,
        deepspeed=deepspeed,
        env={"RLHF_TRAINERS_KIT_DIR": str(kit.root)},
        timeout=600,
    )
    return read_rank_results(out, num_processes)


@pytest.fixture(scope="module")
def one_process(kit, tmp_path_factory) -> dict:
    """The reference run: the same script on 1 process."""
    return _launch(kit, tmp_path_factory.mktemp("rm1") / "out", 1)[0]


def _pair_accuracy(model, tokenizer, pairs) -> float:
    texts = [
        join_prompt_completion(p, c, tokenizer) for p, c in zip(pairs["prompt"], pairs["chosen"], strict=True)
    ]
    texts += [
        join_prompt_completion(p, r, tokenizer)
        for p, r in zip(pairs["prompt"], pairs["rejected"], strict=True)
    ]
    scores = score_texts(model, tokenizer, texts, batch_size=256)
    half = len(texts) // 2
    return (scores[:half] > scores[half:]).double().mean().item()


def _check_distributed_run(kit: OfflineKit, out, results: list[dict], reference: dict, mode: str) -> None:
    rank0, rank1 = results
    for r in results:
        assert r["torch_world_size"] == 2 and r["distributed_type"] == mode
        assert r["global_step"] == reference["global_step"]  # 2048 pairs / 32 per global batch
        # evaluate() before train() saw the untrained model (and must not break training, see below)
        assert r["metrics_before"]["eval_accuracy"] < 0.75
    # Same global batches as the 1-process run: the same losses, up to float rounding.
    assert rank0["train_losses"] == pytest.approx(reference["train_losses"], rel=2e-3, abs=1e-4)
    assert rank0["metrics"]["eval_accuracy"] >= 0.9
    assert rank0["metrics"]["eval_accuracy"] == pytest.approx(reference["metrics"]["eval_accuracy"], abs=0.02)
    # Distributed evaluation gathers every rank's rows: both ranks report the same metrics.
    for key, value in rank0["metrics"].items():
        if not key.endswith(("_runtime", "_per_second", "_time")):
            assert rank1["metrics"][key] == value, key
    # Gradients were all-reduced (ZeRO shards re-gathered): the same weights and normalization everywhere.
    assert rank0["digest"] == rank1["digest"], "ranks ended with different weights"
    assert (rank0["gain"], rank0["bias"]) == (rank1["gain"], rank1["bias"])
    assert rank0["gain"] != 1.0

    # The checkpoint holds those full weights and the normalization, and scores as the run said.
    model, head_is_new = load_reward_model(str(out))
    assert not head_is_new
    assert parameter_digest(model) == (rank0["digest"], rank0["numel"])
    assert get_reward_normalization(model) == (rank0["gain"], rank0["bias"])
    assert json.loads((out / "reward_normalization.json").read_text()) == {
        "gain": rank0["gain"],
        "bias": rank0["bias"],
    }
    tokenizer = kit.load_tokenizer()
    accuracy = _pair_accuracy(model, tokenizer, kit.preference_dataset("test"))
    assert accuracy == pytest.approx(rank0["metrics"]["eval_accuracy"], abs=1 / 256 + 1e-9)

    # The normalization was fitted on the reference policy's samples drawn by both ranks (1024 in all):
    # fresh samples score mean ~0, std ~1 (looser than the 0.05 of the 1-process test, with 4x fewer
    # fitting samples).
    policy = kit.load_model("llama-sft")
    prompts = list(kit.prompt_dataset("train")["prompt"]) * 4
    torch.manual_seed(123)
    completions = sample_completions(policy, tokenizer, prompts, response_length=16, batch_size=256)
    texts = [join_prompt_completion(p, c, tokenizer) for p, c in zip(prompts, completions, strict=True)]
    scores = score_texts(model, tokenizer, texts, batch_size=256)
    assert abs(scores.mean().item()) < 0.15, scores.mean()
    assert abs(scores.std().item() - 1) < 0.15, scores.std()


def test_two_processes_train_like_one(kit, tmp_path, one_process):
    out = tmp_path / "out"
    results = _launch(kit, out, 2)
    _check_distributed_run(kit, out, results, one_process, "DistributedType.MULTI_CPU")
    for r in results:
        assert (r["backend"], r["engine"], r["deepspeed_zero_stage"]) == (
            "gloo",
            "DistributedDataParallel",
            None,
        )


@pytest.mark.deepspeed
@requires_deepspeed
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_trains_like_one_process_and_saves_full_weights(kit, tmp_path, one_process, stage):
    out = tmp_path / "out"
    results = _launch(kit, out, 2, deepspeed=stage)
    _check_distributed_run(kit, out, results, one_process, "DistributedType.DEEPSPEED")
    for r in results:
        # accelerate's DeepSpeed plugin at the config's stage wrapped the model in its engine; under
        # ZeRO-3 with zero3_init_flag the weights were partitioned as from_pretrained loaded them
        assert (r["engine"], r["deepspeed_zero_stage"]) == ("DeepSpeedEngine", int(stage[-1]))
        assert r["partitioned_at_load"] == (stage == "zero3")
    # under ZeRO-3 each rank held half of the parameters; the checkpoint has them all
    assert (out / "model.safetensors").stat().st_size > 4 * results[0]["numel"]


def test_example_script_on_two_processes(kit, tmp_path):
    """``examples/reward_modeling.py`` as a user runs it with ``accelerate launch`` (multi_gpu.yaml)."""
    out, results_file = tmp_path / "out", tmp_path / "results.json"
    run_script(
        REPO_ROOT / "examples" / "reward_modeling.py",
        [
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            "16",
            "--learning_rate",
            "3e-3",
            "--max_length",
            "64",
            "--use_cpu",
            "true",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--results_file",
            str(results_file),
        ],
        env={"RLHF_TRAINERS_KIT_DIR": str(kit.root)},
        timeout=600,
    )
    metrics = json.loads(results_file.read_text())
    assert metrics["world_size"] == 2
    assert metrics["global_step"] == 2048 // 32
    assert metrics["eval_accuracy"] >= 0.9
    model, _ = load_reward_model(str(out))
    accuracy = _pair_accuracy(model, kit.load_tokenizer(), kit.preference_dataset("test"))
    assert accuracy == pytest.approx(metrics["eval_accuracy"], abs=1 / 256 + 1e-9)
