"""An agent learns on the kit: GRPO raises the share of episodes that call the calculator, and of
answers that are right, for the kit agent (``rlhf_trainers.testing.agent_kit``: the kit's policy taught
the call format of TRL's tools example, calling in about half of its episodes and answering right in
about 40 %, almost never right without the tool).

The kit agent is built once (about 2-4 minutes on 2 cores) and cached beside the kit.
"""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

import datasets
import pytest
import torch

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers.agents import Toolbox
from rlhf_trainers.agents.tools import environment_tools
from rlhf_trainers.testing import agent_kit

SCRIPT = Path(__file__).resolve().parent / "trl_scripts" / "agent_tools.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kit_agent(kit) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the build is many small steps: one thread is faster beside other workers
    try:
        return str(agent_kit.kit_agent_folder(kit))
    finally:
        torch.set_num_threads(threads)


def test_the_kit_agent_was_taught_the_scripts_tools():
    """The kit agent's tools are those of TRL's tools example (tests/trl_scripts/agent_tools.py): the
    same names, arguments and descriptions, so the prompts it was taught are the script's prompts."""
    tree = ast.parse(SCRIPT.read_text())
    functions = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    namespace: dict = {}
    exec(compile(ast.Module(body=functions, type_ignores=[]), str(SCRIPT), "exec"), namespace)
    script = Toolbox([namespace["multiply"], namespace["async_add"]]).schemas
    assert Toolbox([agent_kit.multiply, agent_kit.async_add]).schemas == script


def test_the_kit_agent_was_taught_the_environment_scripts_tools():
    """...and those of the environment script (tests/trl_scripts/agent_environment.py), whose methods are
    offered in name order: the kit agent was taught both orders."""
    path = SCRIPT.with_name("agent_environment.py")
    classes = [node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)]
    namespace: dict = {}
    exec(compile(ast.Module(body=classes, type_ignores=[]), str(path), "exec"), namespace)
    methods = environment_tools(namespace["CalculatorEnv"]())
    assert Toolbox([agent_kit.async_add, agent_kit.multiply]).schemas == Toolbox(methods).schemas


def _correctness_reward(completions, answer, **kwargs):
    """TRL's example's reward: 1 when the last turn's last number is the answer."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", completion[-1]["content"])
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return rewards


def test_grpo_learns_to_use_the_calculator(kit_agent, tmp_path):
    rng = random.Random(0)
    rows = [agent_kit.kit_question(rng, i) for i in range(512)]
    dataset = datasets.Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})
    trainer = GRPOTrainer(
        model=kit_agent,
        reward_funcs=_correctness_reward,
        args=GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=16,
            num_generations=4,
            max_completion_length=128,
            max_prompt_length=None,  # the tools' schemas fill ~600 tokens: keep them whole, as TRL does
            max_steps=100,
            learning_rate=1e-4,
            temperature=1.0,
            logging_steps=1,
            seed=0,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=dataset,
        tools=[agent_kit.multiply, agent_kit.async_add],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(logs) == 100

    def mean(key: str, part: list[dict]) -> float:
        return sum(h[key] for h in part) / len(part)

    first, last = logs[:20], logs[-20:]
    # measured (seed 0): reward 0.46 -> 0.73, calls 0.53 -> 0.86 over 100 updates of 16 episodes
    assert mean("reward", last) > mean("reward", first) + 0.1, (mean("reward", first), mean("reward", last))
    calls = mean("tools/call_frequency", first), mean("tools/call_frequency", last)
    assert calls[1] > calls[0] + 0.15, calls
