"""TRL 1.16's documented scripts run here with the import changed (issue #48).

Each script of ``tests/trl_scripts/`` is written as TRL's documentation writes it (the GRPO quick start
with conversational prompts, several weighted reward functions with an extra column, ``None`` rewards,
async reward functions, LoRA, RLOO with TRL 1.x's names, reward modeling on standard, implicit-prompt
and conversational preferences, a callback with an evaluation dataset, a custom ``rollout_func``),
importing ``rlhf_trainers`` where TRL's imports ``trl``. Here each runs on the offline kit's SFT model in a subprocess, exactly as a
user runs it (``python script.py``), and the test checks what a TRL user reads: the number of optimizer
steps, TRL's logged keys, the final ``train_runtime``/``train_loss`` entry and the script's own
output. ``benchmarks/trl_scripts_real.py`` runs the same scripts on SmolLM2-135M-Instruct with TRL 1.16
and ours side by side.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "trl_scripts"
sys.path.insert(0, str(SCRIPTS))

from run_script import as_trl  # noqa: E402

STEPS = 2
GRPO_KEYS = {
    "loss", "learning_rate", "grad_norm", "num_tokens", "reward", "reward_std", "frac_reward_zero_std",
    "entropy", "completions/mean_length", "completions/clipped_ratio", "completions/mean_terminated_length",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
}  # fmt: skip
REWARD_KEYS = {"loss", "learning_rate", "grad_norm", "accuracy", "margin"}
ALL = sorted(p.stem for p in SCRIPTS.glob("*.py") if not p.name.startswith(("_", "run_")))


def test_every_script_differs_from_trl_by_its_imports_only() -> None:
    """``run_script.py --trl`` (the benchmark's TRL side) changes the import lines and nothing else."""
    assert len(ALL) >= 13, ALL  # the glob found the scripts
    for name in ALL:
        text = (SCRIPTS / f"{name}.py").read_text()
        changed = [
            line
            for line in difflib.ndiff(text.splitlines(), as_trl(text).splitlines())
            if line.startswith(("- ", "+ "))
        ]
        assert changed, name
        assert all(" import " in line and ("rlhf_trainers" in line or "trl" in line) for line in changed), (
            changed
        )
        assert any(line.startswith("+ from trl import ") for line in changed), name
    with pytest.raises(ValueError, match="only by"):
        as_trl("import rlhf_trainers\n")


@pytest.fixture(scope="module")
def kit_model() -> str:
    from rlhf_trainers.testing import get_kit

    return str(get_kit().model_path("llama-sft"))


@pytest.fixture(scope="module")
def kit_tool_model(kit_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The kit's SFT model with our tool chat template (its own renders no tools) and 1024 positions in its
    config (the kit's 256 hold no tool schema and a response; its rotary positions extend), for the
    scripts with tools or environments (``_offline.TOOL_MODEL``)."""
    import shutil

    from transformers import AutoTokenizer

    from rlhf_trainers.agents import install_tool_chat_template

    folder = tmp_path_factory.mktemp("tool-model") / "llama-sft-tools"
    shutil.copytree(kit_model, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    install_tool_chat_template(tokenizer, tools_instruction="Tools:")
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return str(folder)


def run(
    name: str, model: str, tmp_path: Path, tool_model: str | None = None, steps: int = STEPS
) -> tuple[dict, str]:
    """Run script `name` on the kit as a user does; its log record and its output."""
    env = {**os.environ, "TRL_SCRIPTS_MODEL": model, "TRL_SCRIPTS_SCALE": "kit"}
    if tool_model is not None:
        env["TRL_SCRIPTS_TOOL_MODEL"] = tool_model
    env.update(TRL_SCRIPTS_STEPS=str(steps), TRL_SCRIPTS_OUTPUT=str(tmp_path / "out"))
    log = tmp_path / "log.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "run_script.py"), f"{name}.py", "--log", str(log)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    record = json.loads(log.read_text())
    assert record["global_step"] == steps
    assert len(record["step_s"]) == steps
    finals = [e for e in record["log_history"] if "train_runtime" in e]
    assert len(finals) == 1 and "train_loss" in finals[0], record["log_history"]
    return record, proc.stdout


def steps(record: dict) -> list[dict]:
    """The per-step training logs (not the final summary, not evaluations)."""
    return [e for e in record["log_history"] if "loss" in e and "train_runtime" not in e]


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith(("grpo", "rloo"))])
def test_grpo_and_rloo_scripts(
    name: str, kit_model: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tool_model = request.getfixturevalue("kit_tool_model") if name == "grpo_environment" else None
    record, out = run(name, kit_model, tmp_path, tool_model)
    logs = steps(record)
    assert len(logs) == STEPS
    for entry in logs:
        missing = GRPO_KEYS - set(entry)
        assert not missing, f"{name}: TRL's keys missing: {sorted(missing)}"
        assert math.isfinite(entry["reward"]) and math.isfinite(entry["loss"]), entry
    funcs = sorted(k.split("/")[1] for k in logs[0] if k.startswith("rewards/") and k.endswith("/mean"))
    expected = {
        "grpo_quickstart": ["accuracy_reward"],
        "rloo_trl_names": ["accuracy_reward"],
        "grpo_callback_eval": ["accuracy_reward"],
        "grpo_reward_weights": ["format_reward_func", "reward_func"],
        "grpo_none_rewards": ["coding_reward_func", "math_reward_func"],
        "grpo_async_rewards": ["async_reward_func", "async_unique_chars", "reward_func"],
        "grpo_lora": ["reward_func"],
        "grpo_rollout_func": ["reward_from_env"],
        "grpo_environment": ["IncrementEnv", "format_reward"],  # get_reward, named after the class
    }[name]
    assert funcs == expected, funcs
    if name == "grpo_reward_weights":
        for entry in logs:  # no None here: the weighted sum of the means is the mean reward
            weighted = entry["rewards/reward_func/mean"] + 0.5 * entry["rewards/format_reward_func/mean"]
            assert entry["reward"] == pytest.approx(weighted, abs=1e-5)
    if name == "grpo_environment":
        for entry in logs:  # TRL's: get_reward has weight 1 beside reward_funcs; the kit never calls the tool
            assert entry["tools/call_frequency"] == 0.0 and entry["rewards/IncrementEnv/mean"] == 0.0
            assert entry["reward"] == pytest.approx(entry["rewards/format_reward/mean"], abs=1e-6)
        assert any(entry["reward"] > 0 for entry in logs)  # the sum is not trivially 0 + 0
    if name == "grpo_async_rewards":
        assert all(
            entry["rewards/async_reward_func/mean"] == 1.0 for entry in logs
        )  # awaited, not a coroutine
    if name == "grpo_rollout_func":  # TRL's call: 2 prompts x num_generations=4, each prompt 4 times
        assert record["metrics"] == {"prompts_per_call": [8, 8]}, record["metrics"]
        assert all(-1.0 <= entry["rewards/reward_from_env/mean"] <= 0.0 for entry in logs)  # env_reward's
    if name == "rloo_trl_names":  # TRL 1.x's steps: one optimizer step per generation of 8 completions
        assert [e["episode"] for e in logs] == [8, 16]
    if name == "grpo_callback_eval":
        evaluations = [e for e in record["log_history"] if "eval_reward" in e]
        assert len(evaluations) == 2, record["log_history"]  # eval_steps=2 over 2 steps, then evaluate()
        metrics = record["metrics"]
        assert isinstance(metrics, dict), metrics
        assert {"eval_reward", "eval_reward_std", "eval_runtime", "eval_rewards/accuracy_reward/mean"} <= set(
            metrics
        )
        assert "rewards seen by the callback: [" in out and "evaluations during training: 1\n" in out


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith("reward")])
def test_reward_modeling_scripts(name: str, kit_model: str, tmp_path: Path) -> None:
    record, _ = run(name, kit_model, tmp_path)
    logs = steps(record)
    assert len(logs) == STEPS
    for entry in logs:
        assert REWARD_KEYS <= set(entry), entry
        assert math.isfinite(entry["loss"]) and 0.0 <= entry["accuracy"] <= 1.0


@pytest.mark.parametrize(
    ("name", "second"),
    [
        ("agent_tools", "structure_reward"),  # TRL's tools example: a reward function on the tool calls
        ("agent_environment", "CalculatorEnv"),  # the environment's get_reward, named after its class
    ],
)
def test_agent_scripts(name: str, second: str, kit_model: str, kit_tool_model: str, tmp_path: Path) -> None:
    """TRL's tools example and the same task as an environment (its methods the tools, one sync and one
    async; its ``get_reward`` a reward source with weight 1 beside the script's reward function): the
    episodes are conversations the rewards read as TRL passes them, and TRL's tool metrics are logged."""
    record, _ = run(name, kit_model, tmp_path, kit_tool_model)
    logs = steps(record)
    assert len(logs) == STEPS
    for entry in logs:
        missing = (GRPO_KEYS | {"tools/call_frequency", "tools/failure_frequency"}) - set(entry)
        assert not missing, f"TRL's keys missing: {sorted(missing)}"
        weighted = entry["rewards/correctness_reward/mean"] + entry[f"rewards/{second}/mean"]
        assert entry["reward"] == pytest.approx(weighted, abs=1e-5)
        # the kit's policy never learned the call format: no call, so neither a bonus nor a computed answer
        assert entry["tools/call_frequency"] == 0.0 and entry[f"rewards/{second}/mean"] == 0.0


def _kit_agent() -> str:
    """The kit agent's folder, built with one torch thread if it is not cached (tests run side by side)."""
    import torch

    from rlhf_trainers.testing import agent_kit

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return str(agent_kit.kit_agent_folder())
    finally:
        torch.set_num_threads(threads)


def _first_and_last(logs: list[dict], key: str, n: int = 20) -> tuple[float, float]:
    """The mean of `key` over the first and the last `n` logged updates."""
    return (
        sum(entry[key] for entry in logs[:n]) / n,
        sum(entry[key] for entry in logs[-n:]) / n,
    )


#: What must rise over 100 updates on the kit agent, and by how much (first vs last 20 updates). Measured:
#: agent_tools calls 0.53 -> 0.84, correctness 0.41 -> 0.65; agent_environment calls 0.53 -> 0.86, the
#: environment's reward (a tool computed the answer) 0.51 -> 0.82, correctness 0.38 -> 0.67.
LEARNS = {
    "agent_tools": {"tools/call_frequency": 0.15, "rewards/correctness_reward/mean": 0.1},
    "agent_environment": {
        "tools/call_frequency": 0.15,
        "rewards/CalculatorEnv/mean": 0.1,
        "rewards/correctness_reward/mean": 0.1,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LEARNS))
def test_agent_scripts_learn_on_the_kit_agent(name: str, kit_model: str, tmp_path: Path) -> None:
    """TRL's tools example and the environment script, unchanged but for the import, on the kit agent (the
    kit's policy taught the call format, rlhf_trainers.testing.agent_kit, with the tools in either order:
    an environment's methods are offered in name order): over 100 updates the share of episodes that call
    a tool and the rewards rise (:data:`LEARNS`). GRPOConfig keeps the ~620-token prompts whole, as TRL
    does."""
    record, _ = run(name, kit_model, tmp_path, _kit_agent(), steps=100)
    logs = steps(record)
    for key, gain in LEARNS[name].items():
        first, last = _first_and_last(logs, key)
        assert last > first + gain, (key, first, last)
