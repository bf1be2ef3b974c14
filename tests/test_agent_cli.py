"""``rlhf-trainers grpo|rloo|ppo --tools ... --tool_chat_template ...`` (rlhf_trainers/scripts/_tools.py):
tools named on the command line are imported before any model loads, each wrong name a clear usage
error; the policy tokenizer gets a tool-capable chat template when its own cannot hold tool calls; a
kit run with a tool trains, shows the conversations in its sample tables and logs the eval's tools/*.

The kit's policy never writes a tool call by itself, so the run test scripts the first turn of half of
the rows (the sampler's output replaced by a call of ``add``), as tests/test_agent_rollouts.py does.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from transformers import AutoTokenizer

from rlhf_trainers.agents import supports_tool_calling
from rlhf_trainers.cli import main
from rlhf_trainers.onpolicy.sampling import PolicySampler
from rlhf_trainers.scripts import _common
from rlhf_trainers.scripts._tools import prepare_tool_tokenizer

QUIET = ["--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0"]

TOOLS_FILE = '''
import os


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    with open(os.environ["TOOL_CALLS_LOG"], "a") as log:
        log.write(f"{a}+{b}\\n")
    return a + b


def undocumented(a: int) -> int:
    return a


NOT_A_FUNCTION = 3
'''

ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture
def tools_file(tmp_path, monkeypatch):
    """mytools.py in the current folder (tmp_path), whose ``add`` logs each call to a file."""
    path = tmp_path / "mytools.py"
    path.write_text(TOOLS_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mytools", raising=False)  # imported from this test's folder
    monkeypatch.setenv("TOOL_CALLS_LOG", str(tmp_path / "calls.log"))
    return path


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("no_such_module:add", "--tools no_such_module:add: no module named 'no_such_module'"),
        (
            "mytools:ad",
            "--tools mytools:ad: mytools has no attribute 'ad' (its functions: add, undocumented)",
        ),
        ("mytools:NOT_A_FUNCTION", "mytools.NOT_A_FUNCTION is not callable (its type is int)"),
        ("./missing.py:add", "--tools ./missing.py:add: no such file"),
        ("add", "--tools add: expected module:function (e.g. my_tools:add)"),
        ("mytools:undocumented", "--tools mytools:undocumented: "),
    ],
)
def test_a_wrong_tool_name_is_a_usage_error_before_anything_loads(
    spec, expected, tools_file, monkeypatch, capsys
):
    def no_models(*args, **kwargs):
        raise AssertionError("a model flag was checked (and models would load) before the tools")

    monkeypatch.setattr(_common, "check_model_flags", no_models)
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--tools", spec, "--output_dir", str(tools_file.parent / "out"), *QUIET])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhf-trainers grpo: error: --tools ") and expected in err, err
    assert "Traceback" not in err


def test_every_form_of_a_tool_name_imports_the_function(tools_file):
    from rlhf_trainers.scripts._tools import load_tools

    for forms in (["mytools:add"], ["mytools.add"], [f"{tools_file}:add"], [" mytools:add , "]):
        (tool,) = load_tools(forms)
        assert tool.__name__ == "add" and tool(2, 3) == 5, forms
    with pytest.raises(
        ValueError, match=re.escape("--tools mytools:add,mytools.add: Two tools are named 'add'")
    ):
        load_tools(["mytools:add,mytools.add"])  # commas separate tools (and so do spaces)
    assert load_tools(None) is None and load_tools([" , "]) is None


def test_tool_chat_template_installs_ours_only_where_needed(kit, capsys):
    tokenizer = kit.load_tokenizer()  # the kit's template drops tools
    assert not supports_tool_calling(tokenizer)
    with pytest.raises(ValueError, match="--tool_chat_template model: the chat template of kit cannot hold"):
        prepare_tool_tokenizer(tokenizer, "model", with_tools=True, model_name="kit")
    assert prepare_tool_tokenizer(tokenizer, "auto", with_tools=False, model_name="kit") is tokenizer
    assert not supports_tool_calling(tokenizer)  # no --tools: left as it is
    installed = prepare_tool_tokenizer(tokenizer, "auto", with_tools=True, model_name="kit")
    assert supports_tool_calling(installed)
    assert "using rlhf_trainers' tool chat template" in capsys.readouterr().err
    own = installed.chat_template  # now a template that holds tool calls: auto keeps it, quietly
    assert prepare_tool_tokenizer(installed, "auto", with_tools=True, model_name="kit").chat_template == own
    assert capsys.readouterr().err == ""
    ours = prepare_tool_tokenizer(kit.load_tokenizer(), "ours", with_tools=False, model_name="kit")
    assert supports_tool_calling(ours)


def _script_first_turns(monkeypatch) -> None:
    """Even rows of every first assistant turn write ``ADD_CALL`` and the end of the turn."""
    real = PolicySampler.generate

    def generate(self, query, query_mask, with_logprobs=False, *, max_new_tokens=None, stop_ids=None):
        out, extras = real(
            self, query, query_mask, with_logprobs, max_new_tokens=max_new_tokens, stop_ids=stop_ids
        )
        if max_new_tokens not in (None, self.engine.args.response_length):
            return out, extras
        tokenizer = self.engine.processing_class
        ids = [*tokenizer(ADD_CALL, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        out = out.clone()
        for k in range(0, out.shape[0], 2):
            out[k] = tokenizer.pad_token_id
            out[k, : len(ids)] = torch.tensor(ids)
        return out, extras

    monkeypatch.setattr(PolicySampler, "generate", generate)


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("grpo", ["--max_completion_length", "80", "--steps_per_generation", "1", "--num_iterations", "1"]),
        ("ppo", ["--response_length", "80", "--num_ppo_epochs", "1", "--num_mini_batches", "1"]),
    ],
)
def test_a_kit_run_with_a_tool_shows_conversations_and_logs_eval_tool_metrics(
    command, flags, tools_file, monkeypatch, capsys
):
    _script_first_turns(monkeypatch)
    out = tools_file.parent / "out"
    argv = [command, "--tools", f"{tools_file.name}:add", "--output_dir", str(out), "--max_steps", "1"]
    argv += ["--per_device_train_batch_size", "8", "--max_train_samples", "8", "--max_eval_samples", "4"]
    argv += ["--max_tool_calling_iterations", "1", "--num_sample_generations", "1", *flags, *QUIET]
    argv += ["--rollout_logprobs", "forward"]  # the scripted tokens have no generation log-probs
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "using rlhf_trainers' tool chat template" in captured.err  # the kit's template cannot hold tools
    results = json.loads(captured.out[captured.out.index("{\n") :])
    # evaluation logs the tool metrics as training does: half of the episodes called the tool once
    for when in ("before", "after"):
        assert results[when]["eval_tools/call_frequency"] == pytest.approx(0.5), results[when]
        assert results[when]["eval_tools/failure_frequency"] == 0.0
        assert results[when]["eval_tools/turns_per_episode"] == pytest.approx(1.5)
    assert (tools_file.parent / "calls.log").read_text().splitlines()[0] == "2+3"
    # the sample table shows the conversation: the call, the tool's result, the policy's next turn
    table = captured.out[captured.out.index("sample completions at update") :]
    assert '-> add({"a": 2, "b": 3}) | TOOL add: 5 | ASSISTANT:' in table
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    called = [row["completion"] for row in rows if isinstance(row["completion"], list)]
    assert called and called[0][1] == {"role": "tool", "name": "add", "content": "5"}
    # the tokenizer is saved with the template the run used
    assert supports_tool_calling(AutoTokenizer.from_pretrained(out))


CONVERSATION = [
    {
        "role": "assistant",
        "content": "Let me add.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    },
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]


def test_log_completions_shows_a_tool_episode_turn_by_turn(capsys, monkeypatch):
    """``log_completions``'s table (here its plain-text form, and what wandb gets) of a tool episode: each
    assistant turn with its calls, each tool result."""
    import types

    from rlhf_trainers.onpolicy import evaluation

    rollout = types.SimpleNamespace(
        prompts=[[{"role": "user", "content": "2 + 3?"}]],
        completions=[CONVERSATION],
        per_source={"f": torch.tensor([1.0])},
        response_mask=torch.ones(1, 2, dtype=torch.bool),
    )
    logged = []
    wandb = types.SimpleNamespace(
        run=object(), Table=lambda columns, data: data, log=lambda payload: logged.append(payload)
    )
    trainer = types.SimpleNamespace(
        _last_rollout=rollout,
        _last_advantages=types.SimpleNamespace(advantages=torch.tensor([[0.5]])),
        args=types.SimpleNamespace(
            num_completions_to_print=None, seed=0, report_to=["wandb"], log_unique_prompts=False
        ),
        state=types.SimpleNamespace(global_step=3),
        is_world_process_zero=lambda: True,
    )
    monkeypatch.setitem(sys.modules, "rich.console", None)  # the plain-text table
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    evaluation.log_completions(trainer)
    expected = 'ASSISTANT: Let me add. -> add({"a": 2, "b": 3})\nTOOL add: 5\nASSISTANT: It is 5.'
    printed = capsys.readouterr().out
    assert "Prompt: USER: 2 + 3?" in printed and f"Completion: {expected}" in printed
    assert logged[0]["completions"] == [[3, "USER: 2 + 3?", expected, 1.0, 0.5]]
