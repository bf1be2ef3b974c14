"""examples/agent.py (a model learns to call a calculator, issue #50): the task's reward columns, the
prompt it renders, and the script end to end on the kit's tiny Llama (a few seconds; the real run on
SmolLM2 is in docs/agents.md, "Example: learning to use a calculator")."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_example():
    spec = importlib.util.spec_from_file_location("agent_example", REPO_ROOT / "examples" / "agent.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


agent = _load_example()


def _call(a, b):
    return {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}


def _episode(answer: str, tool_content: str | None = None, a: int = 347, b: int = 86):
    """An episode's messages: optionally a call and its result, then the final answer."""
    if tool_content is None:
        return [{"role": "assistant", "content": answer}]
    return [
        {"role": "assistant", "content": "", "tool_calls": [_call(a, b)]},
        {"role": "tool", "name": "multiply", "content": tool_content},
        {"role": "assistant", "content": answer},
    ]


def test_success_reads_the_last_number_of_the_final_turn():
    right = str(347 * 86)  # 29842
    episodes = [
        _episode(f"347 * 86 = {right}", right),  # the tool, then the right answer
        _episode(f"The answer is {right}."),  # right without the tool (counts: success is the task)
        _episode("347 * 86 = 29,842", right),  # thousands separator
        _episode(f"{right}? No: 30000", right),  # the last number is the answer, not any number
        _episode("I think it is 2984", right),
        _episode("", right),  # called the tool, never answered
        [{"role": "assistant", "content": right}, {"role": "tool", "name": "multiply", "content": "1"}],
        f"text episode: {right}",
    ]
    scores = agent.success(episodes, a=[347] * len(episodes), b=[86] * len(episodes))
    assert scores == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_tool_use_counts_calls_that_ran_without_an_error():
    episodes = [
        _episode("29842", "29842"),
        _episode("29842"),  # no call
        _episode("?", "{'error': 'Tool multiply not found. Available tools: multiply.'}"),
        "a text episode has no tool turns",
    ]
    assert agent.tool_use(episodes) == [1.0, 0.0, 0.0, 0.0]


def test_questions_are_reproducible_and_multi_digit():
    rows = agent.agent_dataset(64, seed=3)
    again = agent.agent_dataset(64, seed=3)
    assert rows["a"] == again["a"] and rows["b"] == again["b"]
    assert rows["a"] != agent.agent_dataset(64, seed=4)["a"]
    assert all(100 <= a <= 999 and 10 <= b <= 99 for a, b in zip(rows["a"], rows["b"], strict=True))
    # Arrow gives every message every key (None where absent), which the chat template reads as absent.
    prompt = [{k: v for k, v in message.items() if v is not None} for message in rows[0]["prompt"]]
    assert prompt[:-1] == agent.WORKED_EXAMPLE
    assert prompt[-1] == {"role": "user", "content": f"What is {rows[0]['a']} * {rows[0]['b']}?"}


def test_the_prompt_shows_the_tool_and_a_worked_call(kit):
    """Rendered with the example's template, the prompt lists the tool's schema, the instruction and the
    worked example's call, which the parser reads back as multiply(123, 45)."""
    from transformers import AutoTokenizer

    from rlhf_trainers.agents import Toolbox, install_tool_chat_template, parse_tool_calls

    tokenizer = install_tool_chat_template(
        AutoTokenizer.from_pretrained(kit.tokenizer_path),
        system_prompt=agent.SYSTEM_PROMPT,
        tools_instruction=agent.TOOLS_INSTRUCTION,
    )
    schemas = Toolbox([agent.multiply]).schemas
    text = tokenizer.apply_chat_template(
        agent.prompt_messages(347, 86), tools=schemas, add_generation_prompt=True, tokenize=False
    )
    assert agent.TOOLS_INSTRUCTION in text and '"name": "multiply"' in text
    assert text.index("</tool_call>") < text.index("What is 347 * 86?")  # the example, then the question
    # The last block is the worked example's (the instruction shows one too).
    worked = text[text.rindex("<tool_call>") : text.rindex("</tool_call>") + len("</tool_call>")]
    calls = parse_tool_calls(worked).tool_calls
    assert [(call.name, call.arguments, call.error) for call in calls] == [
        ("multiply", {"a": 123, "b": 45}, None)
    ]


def test_bad_flags_fail_early():
    with pytest.raises(ValueError, match="--tool_reward -1"):
        agent.AgentArguments(tool_reward=-1)
    with pytest.raises(ValueError, match="--algorithm 'dpo'"):
        agent.AgentArguments(algorithm="dpo")


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "rloo"])
def test_example_writes_the_curve_on_the_kit_model(kit, tmp_path, algorithm):
    """examples/agent.py end to end on the kit's tiny Llama (our template in its 'tags' style, LoRA on):
    2 updates, one curve row per update with success, tool use and TRL's tool metrics."""
    curve_file = tmp_path / "curve.json"
    length = "--max_completion_length" if algorithm == "grpo" else "--response_length"
    results = agent.main(
        [
            "--algorithm",
            algorithm,
            "--model_name_or_path",
            str(kit.model_path("llama-sft")),
            "--output_dir",
            str(tmp_path / "out"),
            "--curve_file",
            str(curve_file),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "8",
            "--gradient_accumulation_steps",
            "1",
            "--max_prompt_length",
            "96",  # the kit has 256 positions; keep the question (the end of the prompt)
            length,
            "24",
            "--tool_reward",
            "0.1",
            "--use_cpu",
            "true",
        ]
    )
    written = json.loads(curve_file.read_text())
    assert written == json.loads(json.dumps(results))
    assert (written["algorithm"], written["updates"]) == (algorithm, 2)
    assert [row["update"] for row in written["curve"]] == [1, 2]
    assert [row["episode"] for row in written["curve"]] == [8, 16]
    for row in written["curve"]:
        assert 0.0 <= row["success"] <= 1.0 and 0.0 <= row["tool_use"] <= 1.0
        assert row["call_frequency"] is not None and row["seconds"] >= 0  # a kit update can take < 1 ms
    assert written["curve"][-1]["seconds"] > 0
    assert written["settings"]["tool_reward"] == 0.1 and written["settings"]["lora_r"] == 16


def test_defaults_follow_the_algorithm_and_give_way_to_flags():
    grpo = agent._with_defaults([], "grpo")
    assert "--num_generations=8" in grpo and "--max_completion_length=96" in grpo
    assert "--per_device_train_batch_size=8" in grpo and "--gradient_accumulation_steps=2" in grpo
    ppo = agent._with_defaults(["--learning_rate", "1e-4"], "ppo")
    assert "--response_length=96" in ppo and "--kl_coef=0.0" in ppo and "--num_mini_batches=1" in ppo
    assert not any(flag.startswith(("--rloo_k", "--num_generations", "--learning_rate=")) for flag in ppo)
    assert "--learning_rate=0.0005" in agent._with_defaults([], "ppo")
    assert "--per_device_train_batch_size=4" in ppo and "--gradient_accumulation_steps=4" in ppo
    rloo = agent._with_defaults([], "rloo")
    assert "--rloo_k=8" in rloo and "--learning_rate=0.001" in rloo
    assert agent.AgentArguments().tool_reward == 0.0  # success only unless asked (docs/agents.md)
