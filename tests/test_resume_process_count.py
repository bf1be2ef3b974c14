"""Resuming on another number of processes is refused, before anything is loaded, with a message that says
what was given, what is expected and how to fix it (docs/reliability.md, "Resuming on another number of
processes").

The unit tests read the process count of a checkpoint (recorded in ``onpolicy_state.json``, or told by the
RNG-state files ``Trainer`` writes per process) and check the refusal in one process. The launching test
resumes a real 1-process RLOO checkpoint on 2 DDP ranks; the other direction (2 DDP, ZeRO-2 and ZeRO-3 ranks
-> 1 process) resumes the checkpoints of tests/test_rloo_distributed.py's trained runs there (without the
check, DDP resumes quietly with the RNG states not restored and other batches, and DeepSpeed fails later
on its optimizer partitions).
"""

from __future__ import annotations

import json
import os

import pytest
from distributed import run_script

from rlhf_trainers import RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.reliability import check_resume_process_count, checkpoint_process_count
from rlhf_trainers.testing import true_reward


def _touch(folder, *names) -> None:
    os.makedirs(folder, exist_ok=True)
    for name in names:
        open(os.path.join(folder, name), "w").close()


def test_the_rng_state_files_tell_how_many_processes_wrote_a_checkpoint(tmp_path):
    _touch(tmp_path / "one", "rng_state.pth", "optimizer.pt")
    _touch(tmp_path / "two", "rng_state_0.pth", "rng_state_1.pth")
    _touch(tmp_path / "node1", "rng_state_2.pth", "rng_state_3.pth")  # save_on_each_node, second node
    _touch(tmp_path / "none", "model.safetensors")
    assert checkpoint_process_count(str(tmp_path / "one")) == 1
    assert checkpoint_process_count(str(tmp_path / "two")) == 2
    assert checkpoint_process_count(str(tmp_path / "node1")) == 4
    assert checkpoint_process_count(str(tmp_path / "none")) is None
    assert checkpoint_process_count(str(tmp_path / "missing")) is None


def test_another_process_count_is_refused_with_what_was_given_expected_and_the_fix(tmp_path):
    _touch(tmp_path / "two", "rng_state_0.pth", "rng_state_1.pth")
    checkpoint = str(tmp_path / "two")
    check_resume_process_count(checkpoint, 2)  # the same count: resumes
    check_resume_process_count(str(tmp_path / "missing"), 1)  # nothing to tell: left to the loaders
    with pytest.raises(ValueError) as error:
        check_resume_process_count(checkpoint, 1, fresh_start="model=<checkpoint>")
    message = str(error.value)
    assert "saved by a run on 2 process(es), and this run has 1" in message
    assert "accelerate launch --num_processes 2" in message and "torchrun --nproc_per_node 2" in message
    assert f"model={checkpoint!r}" in message and "without resume_from_checkpoint" in message
    # a count the checkpoint records wins over its files
    with pytest.raises(ValueError, match=r"saved by a run on 4 process\(es\), and this run has 2"):
        check_resume_process_count(checkpoint, 2, saved=4)
    # with save_on_each_node a node's files are a lower bound: fewer than the processes is fine
    check_resume_process_count(checkpoint, 4, save_on_each_node=True)
    with pytest.raises(ValueError, match=r"on 2 process\(es\), and this run has 1"):
        check_resume_process_count(checkpoint, 1, save_on_each_node=True)


def _rloo(kit, out, **overrides) -> RLOOTrainer:
    fields = {
        "output_dir": str(out),
        "per_device_train_batch_size": 8,
        "num_mini_batches": 1,
        "num_ppo_epochs": 1,
        "response_length": 8,
        "rloo_k": 4,
        "max_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "num_sample_generations": 0,
        "disable_tqdm": True,
    }
    fields.update(overrides)
    return RLOOTrainer(
        model=kit.load_model("llama-sft"),
        processing_class=kit.load_tokenizer(),
        reward_funcs=true_reward,
        args=RLOOConfig(**fields),
        train_dataset=kit.prompt_dataset("train", n=64),
    )


def test_the_on_policy_checkpoint_records_its_process_count_and_reward_trainer_checks_too(kit, tmp_path):
    trainer = _rloo(kit, tmp_path / "rloo", max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    checkpoint = tmp_path / "rloo" / "checkpoint-1"
    state = json.loads((checkpoint / "onpolicy_state.json").read_text())
    assert state["num_processes"] == 1
    state["num_processes"] = 2  # as a 2-process run writes it
    (checkpoint / "onpolicy_state.json").write_text(json.dumps(state))
    resumed = _rloo(kit, tmp_path / "rloo")
    with pytest.raises(ValueError, match=r"saved by a run on 2 process\(es\), and this run has 1"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 0  # refused before anything was loaded

    reward = RewardTrainer(
        model=str(kit.model_path("llama-sft")),
        args=RewardConfig(
            output_dir=str(tmp_path / "rm"),
            per_device_train_batch_size=8,
            max_steps=1,
            save_steps=1,
            report_to="none",
            use_cpu=True,
            max_length=64,
            disable_tqdm=True,
        ),
        train_dataset=kit.preference_dataset("train", n=16),
    )
    reward.train()
    saved = tmp_path / "rm" / "checkpoint-1"
    os.replace(saved / "rng_state.pth", saved / "rng_state_0.pth")  # as rank 0 of 2 writes it
    _touch(saved, "rng_state_1.pth")
    with pytest.raises(ValueError, match=r"saved by a run on 2 process\(es\), and this run has 1"):
        reward.train(resume_from_checkpoint=str(saved))


def _launch_rloo(kit, out, *args):
    return run_script(
        "rloo_distributed.py",
        ["--output_dir", str(out), "--max_steps", "2", "--num_eval_prompts", "8", *args],
        env={"RLHF_TRAINERS_KIT_DIR": str(kit.root)},
        timeout=400,
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_of_1_process_is_refused_on_2_ddp_ranks(kit, tmp_path):
    single = _rloo(kit, tmp_path / "single", max_steps=1, save_strategy="steps", save_steps=1)
    single.train()
    with pytest.raises(AssertionError) as failed:
        _launch_rloo(
            kit, tmp_path / "resumed", "--resume_from_checkpoint", tmp_path / "single" / "checkpoint-1"
        )
    assert "saved by a run on 1 process(es), and this run has 2" in str(failed.value)
