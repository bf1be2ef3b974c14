"""Tools for agent rollouts (rlhf_trainers.agents): schemas from functions, parsing tool calls from generated
text, running them (faults, timeouts, async), and the tool-capable chat template on the offline tokenizers."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from transformers import AutoTokenizer

from rlhf_trainers.agents import (
    Toolbox,
    ToolCall,
    check_tool_calling,
    environment_tools,
    install_tool_chat_template,
    parse_tool_calls,
    parse_tool_calls_in_tags,
    supports_tool_calling,
    tool_calling_problems,
    tool_chat_template,
    tool_schema,
)
from rlhf_trainers.testing.smollm2 import smollm2_available, smollm2_folder

# ---------------------------------------------------------------- tools used by the tests


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def lookup(key: str, default: str | None = None) -> str:
    """Look a fact up.

    Args:
        key: What to look up.
        default: The answer when nothing is known.
    """
    return {"capital of France": "Paris"}.get(key, default or "unknown")


async def slow_add(a: int, b: int, delay: float = 0.3) -> int:
    """Add two integers, slowly.

    Args:
        a: The first integer.
        b: The second integer.
        delay: Seconds to wait first.
    """
    await asyncio.sleep(delay)
    return a + b


def hang(seconds: float) -> str:
    """Sleep (a tool that hangs).

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


async def async_hang(seconds: float) -> str:
    """Sleep without blocking the loop.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "done"


async def loop_blocker(seconds: float) -> str:
    """An async tool that blocks its event loop (a bug in the tool).

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def broken() -> str:
    """A tool that raises."""
    raise RuntimeError("the database is down")


def silent_failure() -> str:
    """A tool that raises an exception without a message."""
    raise KeyError


def returns(kind: str) -> object:
    """Return a value that is not a string.

    Args:
        kind: Which value.
    """
    return {
        "int": 42,
        "none": None,
        "dict": {"a": 1},
        "ints": [1, 2],
        "blocks": [{"type": "text", "text": "hi"}],
    }[kind]


class Counter:
    """An environment: its public methods are tools that share its state."""

    def __init__(self) -> None:
        self.total = 0

    def reset(self) -> None:
        self.total = 0

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return float(self.total)

    def _private(self) -> None:
        pass


# ---------------------------------------------------------------- schemas and the toolbox


def test_schema_from_type_hints_and_docstring():
    schema = tool_schema(add)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "add" and function["description"] == "Add two integers."
    assert function["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "The first integer.",
    }
    assert function["parameters"]["required"] == ["a", "b"]
    # async functions and bound methods are described the same way (no `self`)
    assert tool_schema(slow_add)["function"]["parameters"]["required"] == ["a", "b"]
    method = tool_schema(Counter().increment)["function"]
    assert method["name"] == "increment" and list(method["parameters"]["properties"]) == ["by"]


def no_docstring(a: int) -> int:
    return a


def no_hint(a):
    """Echo.

    Args:
        a: A value.
    """
    return a


def undocumented_argument(a: int) -> int:
    """Echo."""
    return a


@pytest.mark.parametrize(
    ("func", "missing"),
    [
        (no_docstring, "no docstring"),
        (no_hint, "missing a type hint"),
        (undocumented_argument, "argument 'a'"),
    ],
)
def test_undescribable_tool_fails_at_construction(func, missing):
    with pytest.raises(ValueError) as error:
        Toolbox([add, func])
    message = str(error.value)
    assert repr(func.__name__) in message and missing in message and "Args:" in message


def test_toolbox_rejects_bad_input():
    with pytest.raises(ValueError, match="no usable name"):
        Toolbox([lambda a: a])
    with pytest.raises(ValueError, match="must be a function"):
        Toolbox(["add"])
    with pytest.raises(ValueError, match="list of functions"):
        Toolbox(add)
    with pytest.raises(ValueError, match="Two tools are named 'add'"):
        Toolbox([add, add])
    with pytest.raises(ValueError, match="positive number of seconds"):
        Toolbox([add], timeout=0)


def test_toolbox_holds_tools_by_name():
    box = Toolbox([add, slow_add])
    assert box.names == ["add", "slow_add"] and "add" in box and "mul" not in box and len(box) == 2
    assert box["add"] is add and box.is_async("slow_add") and not box.is_async("add")
    assert [schema["function"]["name"] for schema in box.schemas] == ["add", "slow_add"]


def test_environment_methods_are_its_tools_and_share_its_state():
    env = Counter()
    tools = environment_tools(env)
    assert [tool.__name__ for tool in tools] == ["increment"]  # not reset, get_reward or _private
    box = Toolbox(tools)
    results = box.execute([ToolCall("increment", {"by": 2}), ToolCall("increment", {"by": 3})])
    assert [result.content for result in results] == ["2", "5"] and env.total == 5


# ---------------------------------------------------------------- parsing


def test_tags_several_calls_and_content():
    text = (
        'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "lookup", "parameters": {"key": "x"}}</tool_call>\n'
        '<tool_call>{"type": "function", "function": {"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}}'
        "</tool_call> done"
    )
    parsed = parse_tool_calls(text)
    assert parsed.parser == "tags" and parsed.content == "I will add.\ndone"
    assert [(call.name, call.arguments, call.error) for call in parsed.tool_calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("lookup", {"key": "x"}, None),
        ("add", {"a": 3, "b": 4}, None),
    ]
    assert parsed.to_message()["tool_calls"][0] == {
        "type": "function",
        "function": {"name": "add", "arguments": {"a": 1, "b": 2}},
    }
    plain = parse_tool_calls("The answer is 4.")
    assert (
        plain.content == "The answer is 4."
        and plain.tool_calls == []
        and "tool_calls" not in plain.to_message()
    )


@pytest.mark.parametrize(
    ("body", "name", "reason"),
    [
        ('{"name": "add", "arguments": {"a": 1,}}', "add", "invalid JSON"),
        ('["add", 1, 2]', "", "expected a JSON object"),
        ('{"arguments": {"a": 1}}', "", 'no "name"'),
        ('{"name": "add", "arguments": [1, 2]}', "add", "must be a JSON object, got list"),
        ('{"name": "add", "arguments": "{a: 1}"}', "add", "not valid JSON"),
    ],
)
def test_malformed_call_is_kept_with_its_error(body, name, reason):
    parsed = parse_tool_calls(
        f"<tool_call>{body}</tool_call><tool_call>" + '{"name": "add", "arguments": {}}</tool_call>'
    )
    bad, good = parsed.tool_calls
    assert bad.error is not None and reason in bad.error and bad.error.startswith("Malformed tool call")
    assert (bad.name or "") == name and not bad.ok and bad.text == body
    assert good.ok  # one bad call does not spoil the others
    assert len(parsed.to_message()["tool_calls"]) == 1


def test_cut_off_call():
    cut = parse_tool_calls('Sure <tool_call>{"name": "add", "arguments": {"a": 1')
    assert "not closed" in cut.tool_calls[0].error and cut.content == "Sure"
    # complete JSON without the closing tag (the response ended there) is read, as transformers reads it
    complete = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert complete.tool_calls[0].ok


@pytest.fixture
def kit_tokenizer(kit):
    return AutoTokenizer.from_pretrained(kit.tokenizer_path)


def test_response_template_reads_calls_and_types_arguments(kit_tokenizer):
    install_tool_chat_template(kit_tokenizer)
    prompt = kit_tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2?"}], tools=[add], add_generation_prompt=True, tokenize=False
    )
    text = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": "1", "b": 2}}\n</tool_call><|endoftext|>'
    parsed = parse_tool_calls(text, kit_tokenizer, prefix=prompt, tools=[add])
    assert parsed.parser == "response_template" and parsed.content == "Adding."
    assert parsed.tool_calls[0].arguments == {"a": 1, "b": 2}  # typed from the schema
    ids = kit_tokenizer(text, add_special_tokens=False)["input_ids"]
    prefix_ids = kit_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert (
        parse_tool_calls(ids, kit_tokenizer, prefix=prefix_ids, tools=[add]).tool_calls == parsed.tool_calls
    )
    # JSON the template's parser rejects: the tags reader records the malformed call instead of raising
    bad = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": }</tool_call><|endoftext|>', kit_tokenizer
    )
    assert bad.parser == "tags" and bad.parse_error is not None and "invalid JSON" in bad.tool_calls[0].error
    with pytest.raises(ValueError, match="without a tokenizer"):
        parse_tool_calls(ids)


def test_tags_reader_drops_special_tokens_from_content(kit_tokenizer):
    parsed = parse_tool_calls(
        'Hi <tool_call>{"name": "add", "arguments": {}}</tool_call><|endoftext|>', kit_tokenizer
    )
    assert parsed.parser == "tags" and parsed.content == "Hi"
    assert parse_tool_calls_in_tags("a<|endoftext|>", ["<|endoftext|>"]).content == "a"


# ---------------------------------------------------------------- execution


def test_results_and_errors_are_recorded_as_trl_records_them():
    box = Toolbox([add, broken, silent_failure, returns])
    calls = [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("broken", {}),
        ToolCall("silent_failure", {}),
        ToolCall("returns", {"kind": "int"}),
        ToolCall("returns", {"kind": "none"}),
        ToolCall("returns", {"kind": "dict"}),
        ToolCall("returns", {"kind": "ints"}),
        ToolCall("returns", {"kind": "blocks"}),
    ]
    results = box.execute(calls)
    assert [result.content for result in results] == [
        "3",
        "{'error': 'the database is down'}",
        "{'error': 'KeyError'}",
        "42",
        "None",
        "{'a': 1}",
        "[1, 2]",
        [{"type": "text", "text": "hi"}],
    ]
    assert [result.ok for result in results] == [True, False, False, True, True, True, True, True]
    assert results[1].to_message() == {
        "role": "tool",
        "name": "broken",
        "content": "{'error': 'the database is down'}",
    }


def test_bad_calls_become_errors_without_running_anything():
    ran = []

    def record(x: int) -> int:
        """Record a call.

        Args:
            x: A value.
        """
        ran.append(x)
        return x

    box = Toolbox([record])
    results = box.execute(
        [
            ToolCall("nope", {"x": 1}),
            ToolCall("record", {}),
            ToolCall("record", {"x": 1, "y": 2}),
            ToolCall("record", "not a dict"),
            parse_tool_calls('<tool_call>{"name": "record", "arguments": {"x": }</tool_call>').tool_calls[0],
            ToolCall(None, None, error="Malformed tool call: the call has no name"),
            ToolCall("record", {"x": 7}),
        ]
    )
    assert ran == [7]
    assert [result.name for result in results] == [
        "nope",
        "record",
        "record",
        "record",
        "record",
        "unknown",
        "record",
    ]
    assert "Tool nope not found. Available tools: record." in results[0].content
    assert "missing a required argument: 'x'" in results[1].content
    assert "unexpected keyword argument 'y'" in results[2].content
    assert "must be a JSON object" in results[3].content
    assert "invalid JSON" in results[4].content
    assert [result.ok for result in results] == [False] * 6 + [True]


def test_a_hanging_tool_times_out_quickly_and_the_run_goes_on():
    box = Toolbox([hang, add], timeout=0.2)
    start = time.perf_counter()
    results = box.execute([ToolCall("hang", {"seconds": 30}), ToolCall("add", {"a": 1, "b": 1})])
    assert time.perf_counter() - start < 5
    assert results[0].timed_out and results[0].content == "{'error': 'Tool hang timed out after 0.2 s.'}"
    assert results[1].content == "2" and box.abandoned_calls == 1
    abandoned = [t for t in threading.enumerate() if t.name == "rlhf-trainers-tool-hang"]
    assert abandoned and all(t.daemon for t in abandoned)  # cannot keep the interpreter alive at exit


def test_async_tools_run_concurrently_in_call_order():
    box = Toolbox([slow_add, add])
    start = time.perf_counter()
    results = box.execute(
        [
            ToolCall("slow_add", {"a": 1, "b": 1, "delay": 0.5}),
            ToolCall("add", {"a": 2, "b": 2}),
            ToolCall("slow_add", {"a": 3, "b": 3, "delay": 0.5}),
        ]
    )
    assert [result.content for result in results] == ["2", "4", "6"]
    assert time.perf_counter() - start < 0.9  # two 0.5 s calls, concurrently (1 s one after the other)


def test_async_timeouts_cancel_or_give_up_on_a_blocked_loop():
    box = Toolbox([async_hang, loop_blocker, slow_add], timeout=0.2)
    start = time.perf_counter()
    (result,) = box.execute([ToolCall("async_hang", {"seconds": 60})])
    assert result.timed_out and time.perf_counter() - start < 1.5
    start = time.perf_counter()
    (result,) = box.execute([ToolCall("loop_blocker", {"seconds": 5})])
    assert result.timed_out and "timed out after 0.2 s" in result.content and time.perf_counter() - start < 3
    # the blocked loop was replaced: the next async call runs at once
    (result,) = box.execute([ToolCall("slow_add", {"a": 1, "b": 2, "delay": 0.01})])
    assert result.content == "3"


# ---------------------------------------------------------------- chat templates

CONVERSATION = [
    {"role": "user", "content": "What is 12 + 30, and the capital of France?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}},
            {"type": "function", "function": {"name": "lookup", "arguments": {"key": "capital of France"}}},
        ],
    },
    {"role": "tool", "name": "add", "content": "42"},
    {"role": "tool", "name": "lookup", "content": "Paris"},
    {"role": "assistant", "content": "42, and Paris."},
]


def test_template_without_tool_support_gets_a_clear_error(kit_tokenizer):
    assert not supports_tool_calling(kit_tokenizer)
    problems = tool_calling_problems(kit_tokenizer)
    assert "the tools offered (`tools=`) are not rendered" in problems
    assert "the assistant's tool call (its name) is not rendered" in problems
    with pytest.raises(
        ValueError, match=r"cannot hold a tool-calling conversation.*install_tool_chat_template\(tokenizer\)"
    ):
        check_tool_calling(kit_tokenizer)
    kit_tokenizer.chat_template = None
    assert tool_calling_problems(kit_tokenizer) == ["it has no chat template"]
    kit_tokenizer.chat_template = "{{ raise_exception('no tools here') }}"
    assert "fails" in tool_calling_problems(kit_tokenizer)[0]


def check_round_trip(tokenizer, box):
    """Render CONVERSATION with the tools; the parser reads back the calls the template rendered; the
    template is prefix-preserving and marks only the assistant's text as generated."""
    assert supports_tool_calling(tokenizer)
    check_tool_calling(tokenizer)
    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:1], tools=box.schemas, add_generation_prompt=True, tokenize=False
    )
    with_call = tokenizer.apply_chat_template(CONVERSATION[:2], tools=box.schemas, tokenize=False)
    continued = tokenizer.apply_chat_template(
        CONVERSATION[:4], tools=box.schemas, add_generation_prompt=True, tokenize=False
    )
    full = tokenizer.apply_chat_template(CONVERSATION, tools=box.schemas, tokenize=False)
    assert with_call.startswith(prompt) and continued.startswith(with_call) and full.startswith(continued)
    for schema in box.schemas:  # the tools are listed, one JSON schema per line
        assert json.dumps(schema["function"], ensure_ascii=False) in prompt
    response = with_call[len(prompt) :]
    for parsed in (
        parse_tool_calls(response, tokenizer, prefix=prompt, tools=box.schemas),  # response template
        parse_tool_calls_in_tags(response, tokenizer.all_special_tokens),  # JSON in tags
    ):
        assert parsed.content == "Let me check."
        assert parsed.to_message()["tool_calls"] == CONVERSATION[1]["tool_calls"]
        results = box.execute(parsed.tool_calls)
        assert [result.to_message() for result in results] == CONVERSATION[2:4]
    # the generated tokens: the assistant turns (calls and end of turn included), not the tool results
    out = tokenizer.apply_chat_template(
        CONVERSATION, tools=box.schemas, return_assistant_tokens_mask=True, return_dict=True
    )
    generated = tokenizer.decode(
        [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    )
    assert generated == response.removesuffix("\n") + full[len(continued) :].removesuffix("\n")
    assert '{"name": "lookup", "arguments": {"key": "capital of France"}}' in generated
    return prompt


def test_installed_template_round_trips_on_the_kit_tokenizer(kit_tokenizer, tmp_path):
    install_tool_chat_template(kit_tokenizer, system_prompt="Be brief.")
    box = Toolbox([add, lookup])
    prompt = check_round_trip(kit_tokenizer, box)
    assert prompt.startswith("<|system|>Be brief.\n\nTo call a tool") and prompt.endswith("<|assistant|>")
    assert tool_chat_template(kit_tokenizer).assistant_end == kit_tokenizer.eos_token
    # no tools, no system turn: the conversation as the kit's own template writes it
    plain = kit_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|system|>Be brief.\n<|user|>hi\n"
    kit_tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.chat_template == kit_tokenizer.chat_template
    assert reloaded.response_template == kit_tokenizer.response_template
    with pytest.raises(ValueError, match="style must be"):
        install_tool_chat_template(kit_tokenizer, style="llama")


@pytest.mark.skipif(not smollm2_available(), reason="the offline SmolLM2-135M-Instruct copy is not available")
def test_installed_template_round_trips_on_smollm2():
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    assert not supports_tool_calling(tokenizer)  # SmolLM2's own template drops tools and tool calls
    install_tool_chat_template(tokenizer)
    assert tool_chat_template(tokenizer).style == "chatml"
    prompt = check_round_trip(tokenizer, Toolbox([add, lookup]))
    assert prompt.startswith("<|im_start|>system\nTo call a tool") and prompt.endswith(
        "<|im_start|>assistant\n"
    )
    assert tool_chat_template(tokenizer).assistant_end == tokenizer.eos_token == "<|im_end|>"
