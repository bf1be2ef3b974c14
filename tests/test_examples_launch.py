"""The example scripts and the installed command under ``accelerate launch`` on 2 CPU ranks (gloo), as a
user starts them: ``examples/ppo.py`` with ``examples/accelerate_configs/deepspeed_zero3.yaml``, and
``accelerate launch -m rlhf_trainers.cli rloo`` with ``multi_gpu.yaml`` (see ``tests/distributed.py`` for
what CPU ranks need: ``--use_cpu``, no ``ACCELERATE_USE_CPU``, a free port).

Each run trains a few updates on the offline kit and must: see 2 ranks, log every update, evaluate
before and after, and save a policy that ``from_pretrained`` loads and whose weights moved. ZeRO-3 PPO
runs 2 updates and DDP RLOO 3 (learning under ZeRO-3 is tests/test_ppo_distributed.py's to check).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from distributed import (
    REPO_ROOT,
    _kill_tree,
    launch_command,
    launch_env,
    requires_deepspeed,
    run_script,
)
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

COMMON = ["--use_cpu", "true", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
COMMON += ["--logging_steps", "1", "--num_sample_generations", "0", "--max_eval_samples", "32"]


def _check_trained(kit, out: Path, results_file: Path, stdout: str, updates: int) -> dict:
    results = json.loads(results_file.read_text())
    assert (results["world_size"], results["global_step"]) == (2, updates)
    for when in ("before", "after"):
        assert -1.0 <= results[when]["eval_objective/scores/true_reward"] <= 1.0
    # The main process logged every update (Trainer's PrinterCallback), once.
    logged = [line for line in stdout.splitlines() if "'objective/kl'" in line]
    assert len(logged) == updates, stdout[-3000:]
    policy = AutoModelForCausalLM.from_pretrained(out)
    initial = dict(kit.load_model("llama-sft").named_parameters())
    moved = [n for n, p in policy.named_parameters() if not torch.equal(p, initial[n])]
    assert len(moved) == len(initial), f"weights that did not change: {set(initial) - set(moved)}"
    return results


@pytest.mark.deepspeed
@requires_deepspeed
def test_ppo_example_with_the_zero3_config(kit, tmp_path):
    out, results_file = tmp_path / "out", tmp_path / "results.json"
    done = run_script(
        REPO_ROOT / "examples" / "ppo.py",
        ["--output_dir", str(out), "--max_steps", "2", "--results_file", str(results_file), *COMMON],
        deepspeed="zero3",
        env={"RLHF_TRAINERS_KIT_DIR": str(kit.root)},
        timeout=600,
        launcher="accelerate",  # the user's command, launcher and all
    )
    results = _check_trained(kit, out, results_file, done.stdout, updates=2)
    assert (results["distributed_type"], results["zero_stage"]) == ("DEEPSPEED", 3)
    # zero3_save_16bit_model in the config: save_model gathered full weights, for the value model too
    value = AutoModelForSequenceClassification.from_pretrained(out / "value_model")
    assert value.config.num_labels == 1


def test_cli_module_under_accelerate_launch(kit, tmp_path):
    """``accelerate launch --config_file multi_gpu.yaml -m rlhf_trainers.cli rloo ...``, run outside the
    repository."""
    out, results_file = tmp_path / "out", tmp_path / "results.json"
    args = [
        "rloo",
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--results_file",
        str(results_file),
        *COMMON,
    ]
    command = launch_command("rlhf_trainers.cli", args)
    command.insert(command.index("rlhf_trainers.cli"), "--module")
    env = launch_env({"RLHF_TRAINERS_KIT_DIR": str(kit.root)})
    with subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            _kill_tree(process.pid)
            stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, f"{' '.join(command)}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    results = _check_trained(kit, out, results_file, stdout, updates=3)
    assert results["distributed_type"] == "MULTI_CPU"
