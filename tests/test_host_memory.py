"""``reuse_host_memory``: freed tensor memory stays in the process, so re-allocating a large tensor costs no
page faults (glibc only). It changes malloc for the whole process, permanently, so it is opt-in: a trainer
applies it at ``train()`` on CPU only when asked."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import rlhf_trainers.cpu.host_memory as tu
from rlhf_trainers import CPUOptions, PPOConfig, RewardConfig, RLOOConfig

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "glibc" not in " ".join(__import__("platform").libc_ver()),
    reason="mallopt tuning applies to glibc's malloc only",
)

# A fresh interpreter (the setting is process-wide and permanent): allocate, write and free a 64 MiB tensor
# ten times, then count the minor page faults of five more rounds. The warm-up rounds matter with reuse: a
# small allocation can land in the freed block and split it, so the heap may grow for two or three rounds before it settles.
_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from rlhf_trainers.cpu import reuse_freed_host_memory

    applied = reuse_freed_host_memory() if sys.argv[1] == "reuse" else False
    n = 16 * 2**20  # 64 MiB of float32, above glibc's largest mmap threshold (32 MiB)
    for _ in range(10):
        torch.empty(n).fill_(1.0)  # allocated, written and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.empty(n).fill_(2.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"applied": applied, "faults": faults}))
    """
)


def _probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_a_reallocated_large_tensor_faults_its_pages_in_again_only_without_reuse():
    default = _probe("default")
    reuse = _probe("reuse")
    pages = 5 * 64 * 2**20 // 4096
    # glibc's default: each freed block was unmapped, so every page of the next one faults in again.
    assert default["faults"] >= pages // 2, default
    assert reuse["applied"] is True
    assert reuse["faults"] < pages // 20, reuse


@pytest.mark.parametrize(
    ("device", "reuse", "expected"), [("cpu", True, 1), ("cpu", False, 0), ("cuda", True, 0)]
)
def test_applied_only_on_cpu_and_only_when_asked(monkeypatch, device, reuse, expected):
    import torch

    calls = []
    monkeypatch.setattr(tu, "reuse_freed_host_memory", lambda: calls.append(1) or True)
    tu.apply_host_memory_settings(CPUOptions(reuse_host_memory=reuse), torch.device(device))
    tu.apply_host_memory_settings(None, torch.device(device))  # no options: the defaults, off
    assert len(calls) == expected


def test_off_by_default_and_in_no_config(tmp_path):
    # A library must not change process-wide behaviour the user did not ask for.
    assert CPUOptions().reuse_host_memory is False
    assert CPUOptions(reuse_host_memory=True).reuse_host_memory is True
    for cls in (RLOOConfig, PPOConfig, RewardConfig):  # a CPU switch, not an algorithm setting
        with pytest.raises(TypeError, match="reuse_host_memory"):
            cls(output_dir=str(tmp_path), report_to="none", reuse_host_memory=True)


@pytest.mark.parametrize("reuse", [True, False, None])
def test_train_applies_the_setting(kit, tmp_path, monkeypatch, reuse):
    from rlhf_trainers import RLOOTrainer

    calls = []
    monkeypatch.setattr(tu, "reuse_freed_host_memory", lambda: calls.append(1) or True)
    from rlhf_trainers.testing import true_reward

    config = RLOOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        rloo_k=2,
        response_length=4,
        max_steps=1,
        save_strategy="no",
        num_sample_generations=0,
        disable_tqdm=True,
    )
    trainer = RLOOTrainer(
        model=kit.load_model("llama-sft"),
        processing_class=kit.load_tokenizer(),
        args=config,
        reward_funcs=true_reward,
        train_dataset=kit.prompt_dataset("train", n=8),
        cpu_options=None if reuse is None else CPUOptions(reuse_host_memory=reuse),
    )
    trainer.train()
    assert len(calls) == (1 if reuse else 0)
