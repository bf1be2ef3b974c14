"""Multi-turn tool rollouts for GRPO (``GRPOTrainer(tools=[...])``, ``max_tool_calling_iterations``) on the
offline kit, with the builtin generation loop.

The kit's tiny policy never writes a tool call by itself, so the tests that need calls script the first
turn of some rows (:func:`_script`): the sampler's output for those rows is replaced by a fixed call
(the rest of each episode, after the tool result, is sampled by the policy). The rollout's log-probs
then come from the policy's forward pass (``rollout_logprobs='forward'``), as for any sampled tokens.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers.agents import install_tool_chat_template
from rlhf_trainers.agents.producer import MultiTurnProducer
from rlhf_trainers.onpolicy.producer import SingleTurnProducer
from rlhf_trainers.onpolicy.rollout import LossNormalization


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: A.
        b: B.
    """
    return a + b


def boom(x: int) -> int:
    """Fail.

    Args:
        x: X.
    """
    raise RuntimeError("tool exploded")


ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _tokenizer(kit):
    tokenizer = kit.load_tokenizer()
    install_tool_chat_template(tokenizer, tools_instruction="Tools:")  # short: the kit has 256 positions
    return tokenizer


def _config(tmp_path, **overrides) -> GRPOConfig:
    fields = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 120,
        "max_prompt_length": 48,  # the tools' schemas make long prompts: keep their end
        "learning_rate": 1e-3,
        "max_steps": 1,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "num_sample_generations": 0,
        "disable_tqdm": True,
        "rollout_logprobs": "forward",
    }
    fields.update(overrides)
    return GRPOConfig(**fields)


def _length_reward(completions, **kwargs):
    """A reward that differs between completions (so advantages are not 0)."""
    return [float(len(str(c)) % 7) for c in completions]


def _trainer(kit, tmp_path, tools=(add,), reward_funcs=_length_reward, **overrides) -> GRPOTrainer:
    return GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=reward_funcs,
        args=_config(tmp_path, **overrides),
        train_dataset=kit.prompt_dataset("train", n=32, chat=True),
        processing_class=_tokenizer(kit),
        tools=list(tools) if tools is not None else None,
    )


def _script(trainer, calls: list[str | None], every_turn: bool = False) -> None:
    """Make row ``k`` of the sampler's first call in each rollout write ``calls[k % len(calls)]`` (None:
    leave the row as sampled), followed by the end-of-turn token; with ``every_turn`` every turn of those
    rows does (an agent that never stops calling)."""
    tokenizer = trainer.processing_class
    scripted = [
        None if c is None else [*tokenizer(c, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        for c in calls
    ]
    real = trainer.sampler.generate
    R = trainer.args.response_length

    def generate(query, query_mask, with_logprobs=False, *, max_new_tokens=None, stop_ids=None, **limits):
        out, extras = real(
            query, query_mask, with_logprobs, max_new_tokens=max_new_tokens, stop_ids=stop_ids, **limits
        )
        first = max_new_tokens in (None, R)
        if not (first or every_turn):
            return out, extras
        out = out.clone()
        for k in range(out.shape[0]):
            ids = scripted[k % len(scripted)]
            if ids is None or len(ids) > out.shape[1]:
                continue
            out[k] = tokenizer.pad_token_id
            out[k, : len(ids)] = torch.tensor(ids)
        return out, extras

    trainer.sampler.generate = generate


def _tool_positions(rollout) -> torch.Tensor:
    """The response tokens the producer marked as not the policy's (the tool turns)."""
    return rollout.response_mask & ~rollout.loss_mask


def train_and_check_it_moved(trainer) -> list[dict]:
    """Train `trainer`, check that the policy's weights changed, and return the logged updates' entries
    (those with tool metrics)."""
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.train()
    after = trainer.policy.parameters()
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, after, strict=True))
    return [h for h in trainer.state.log_history if "tools/call_frequency" in h]


def assert_tool_tokens_out_of_the_loss(trainer, rollout, tool: torch.Tensor) -> None:
    """The loss's gradient with respect to the log-probs is 0 at the ``tool`` positions and not elsewhere,
    and changing the rollout's old and reference log-probs there changes neither the loss, its gradient
    nor the advantages (``rollout`` is modified). Shared with tests/test_vllm_agents.py."""
    advantages = trainer.compute_advantages(rollout, trainer.token_rewards(rollout))
    assert advantages.advantages.abs().sum() > 0
    rows = torch.arange(rollout.response.shape[0])
    normalization = LossNormalization.local(rollout.policy_mask, trainer.args.response_length)

    def loss_and_grad():
        logprobs, values, _ = trainer.loop.training_forward(trainer.model, rollout, rows)
        logprobs = logprobs.detach().requires_grad_()
        loss, _ = trainer.compute_policy_loss(rollout, advantages, rows, logprobs, values, normalization)
        (grad,) = torch.autograd.grad(loss, logprobs)
        return loss.detach(), grad

    loss, grad = loss_and_grad()
    assert torch.all(grad[tool] == 0)
    assert grad[rollout.policy_mask].abs().sum() > 0
    rollout.logprobs = rollout.logprobs + 0.5 * tool
    rollout.ref_logprobs = rollout.ref_logprobs - 0.5 * tool
    loss2, grad2 = loss_and_grad()
    assert loss2 == loss
    torch.testing.assert_close(grad2, grad)
    again = trainer.compute_advantages(rollout, trainer.token_rewards(rollout))
    torch.testing.assert_close(again.advantages, advantages.advantages)


# ---- construction ------------------------------------------------------------------------------------


def test_tools_need_a_template_with_tool_support(kit, tmp_path):
    with pytest.raises(ValueError, match="cannot hold a tool-calling conversation"):
        GRPOTrainer(
            model=kit.load_model("llama-sft"),
            reward_funcs=_length_reward,
            args=_config(tmp_path),
            train_dataset=kit.prompt_dataset("train", n=8, chat=True),
            processing_class=kit.load_tokenizer(),  # the kit's own template drops tools
            tools=[add],
        )


def test_unsupported_settings_and_bad_iterations_are_refused(kit, tmp_path):
    with pytest.raises(ValueError, match=r"does not support dynamic_sampling=True"):
        _trainer(kit, tmp_path, dynamic_sampling=True)
    with pytest.raises(ValueError, match=r"max_tool_calling_iterations=-1"):
        _config(tmp_path, max_tool_calling_iterations=-1)


# ---- training ------------------------------------------------------------------------------------------


def test_a_grpo_run_with_a_tool_trains_and_logs_trls_tool_metrics(kit, tmp_path):
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(completions)
        # the reward needs the tool: 1 when the conversation holds the calculator's answer
        return [float(any(m.get("role") == "tool" and m["content"] == "5" for m in c)) for c in completions]

    trainer = _trainer(kit, tmp_path, reward_funcs=reward, max_steps=2)
    assert isinstance(trainer.producer, MultiTurnProducer)
    _script(trainer, [ADD_CALL, ADD_CALL, None, None])  # half of each group calls the calculator
    logged = train_and_check_it_moved(trainer)
    assert len(logged) == 2
    for h in logged:
        assert h["tools/call_frequency"] == pytest.approx(0.5)
        assert h["tools/failure_frequency"] == 0.0
        assert h["objective/scores"] == pytest.approx(0.5)  # exactly the rows that called the tool
        assert 1.0 < h["tools/turns_per_episode"] <= 1.5
        assert 0.0 < h["tools/inserted_token_frequency"] < 1.0
    # reward functions receive the conversation as TRL passes it: assistant turns and tool results
    called = [c for c in seen if len(c) > 1]
    assert called
    first = called[0]
    assert first[0]["role"] == "assistant"
    assert first[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    ]
    assert first[1] == {"role": "tool", "name": "add", "content": "5"}
    assert first[2]["role"] == "assistant"


def test_tool_tokens_carry_no_gradient_no_kl_and_no_advantage(kit, tmp_path):
    """The tokens of the tool turns are in the sequence but out of the loss: the loss's gradient with
    respect to their log-probs is 0, their KL is 0, and changing their old / reference log-probs changes
    nothing. (With ``response_mask`` instead of the loss mask, every one of these fails.)"""
    trainer = _trainer(kit, tmp_path, beta=0.04)
    _script(trainer, [ADD_CALL, ADD_CALL, None, None])
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    tool = _tool_positions(rollout)
    assert tool.any(1).sum() >= 2, "some rows must hold a tool turn"
    suffix = trainer.producer.tool_turn_ids([{"role": "tool", "name": "add", "content": "5"}])
    row = int(tool.any(1).nonzero()[0])
    start = int(tool[row].nonzero()[0])
    assert rollout.response[row, start : start + len(suffix)].tolist() == suffix
    assert torch.all(rollout.kl[tool] == 0)
    assert_tool_tokens_out_of_the_loss(trainer, rollout, tool)


def test_an_episode_without_tool_calls_is_the_single_turn_rollout(kit, tmp_path):
    """With tools offered but never called, the multi-turn producer's rollout (and so the update) is the
    single-turn producer's, token for token."""

    def ids_reward(completion_ids, **kwargs):  # the same input on both paths
        return [float(sum(ids) % 7) for ids in completion_ids]

    trainer = _trainer(kit, tmp_path, reward_funcs=ids_reward, rollout_logprobs="auto", beta=0.04)
    batch = trainer.producer.prompt_batch(0)
    torch.manual_seed(1)
    multi = trainer.producer.rollout(batch)
    torch.manual_seed(1)
    single = SingleTurnProducer(trainer).rollout(batch)
    assert not _tool_positions(multi).any()
    for name in (
        "response",
        "response_mask",
        "lengths",
        "logprobs",
        "ref_logprobs",
        "kl",
        "scores",
        "found_stop",
    ):
        torch.testing.assert_close(getattr(multi, name), getattr(single, name), msg=name)
    torch.testing.assert_close(multi.policy_mask, single.policy_mask)
    a = trainer.compute_advantages(multi, trainer.token_rewards(multi))
    b = trainer.compute_advantages(single, trainer.token_rewards(single))
    torch.testing.assert_close(a.advantages, b.advantages)
    rows = torch.arange(multi.response.shape[0])
    logprobs, values, _ = trainer.loop.training_forward(trainer.model, multi, rows)
    loss_a, _ = trainer.compute_policy_loss(multi, a, rows, logprobs, values)
    loss_b, _ = trainer.compute_policy_loss(single, b, rows, logprobs, values)
    torch.testing.assert_close(loss_a, loss_b)


def test_tool_faults_are_recorded_and_the_run_goes_on(kit, tmp_path):
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    calls = [
        '<tool_call>\n{"name": "boom", "arguments": {"x": 1}}\n</tool_call>',
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
        None,
    ]
    # room for the malformed call's long error message (a result that does not fit ends the episode)
    trainer = _trainer(
        kit, tmp_path, tools=(add, boom), reward_funcs=reward, max_completion_length=200, max_prompt_length=40
    )
    _script(trainer, calls)
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logged["tools/call_frequency"] == pytest.approx(0.75)
    assert logged["tools/failure_frequency"] == 1.0
    tool_turns = [m["content"] for c in seen for m in c if m.get("role") == "tool"]
    assert "{'error': 'tool exploded'}" in tool_turns
    assert any("Tool nope not found" in t for t in tool_turns)
    assert any("Malformed tool call" in t for t in tool_turns)


def test_max_tool_calling_iterations_bounds_the_tool_turns(kit, tmp_path):
    trainer = _trainer(
        kit, tmp_path, max_tool_calling_iterations=1, max_completion_length=200, max_prompt_length=40
    )
    _script(trainer, [ADD_CALL], every_turn=True)  # an agent that calls in every turn
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    metrics = trainer.rollout_metrics(
        rollout, trainer.compute_advantages(rollout, trainer.token_rewards(rollout))
    )
    assert metrics["tools/call_frequency"] == 1.0  # one tool turn each; the second turn's call is not run
    assert metrics["tools/turns_per_episode"] == 2.0
    assert metrics["tools/iteration_limit_frequency"] == 1.0


def test_the_completion_length_limit_cuts_episodes_cleanly(kit, tmp_path):
    """An agent that always calls: episodes end where the next tool turn would not fit, never past
    max_completion_length, and the tokens after the last policy token are padding."""
    trainer = _trainer(kit, tmp_path, max_completion_length=150)
    _script(trainer, [ADD_CALL], every_turn=True)
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    assert int(rollout.lengths.max()) <= 150
    assert torch.all(rollout.response_mask.sum(1) == rollout.lengths)
    # every episode ends with a policy token (a tool turn is never the last thing, nor cut)
    last = (rollout.lengths - 1).clamp_min(0)
    assert torch.all(rollout.policy_mask[torch.arange(len(last)), last])


def test_evaluation_samples_whole_episodes(kit, tmp_path):
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=reward,
        args=_config(tmp_path, per_device_eval_batch_size=4),
        train_dataset=kit.prompt_dataset("train", n=16, chat=True),
        eval_dataset=kit.prompt_dataset("test", n=8, chat=True),
        processing_class=_tokenizer(kit),
        tools=[add],
    )
    _script(trainer, [ADD_CALL, None])
    metrics = trainer.evaluate()
    assert "eval_objective/scores" in metrics
    roles = [[m["role"] for m in c] for c in seen]
    assert len(roles) == 8
    assert sum(r[:3] == ["assistant", "tool", "assistant"] for r in roles) == 4  # the scripted half


def test_trls_length_metrics_count_the_policys_tokens_only(kit, tmp_path):
    """As TRL documents: with tools, ``completions/*_length`` and ``num_tokens`` count the tokens the policy
    wrote, not the tool turns."""
    trainer = _trainer(kit, tmp_path)
    _script(trainer, [ADD_CALL, ADD_CALL, None, None])
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    tool = _tool_positions(rollout)
    assert tool.any()
    written = rollout.lengths - tool.sum(1)
    assert torch.equal(rollout.inserted_tokens, tool.sum(1))
    metrics = trainer.rollout_metrics(
        rollout, trainer.compute_advantages(rollout, trainer.token_rewards(rollout))
    )
    assert metrics["completions/mean_length"] == pytest.approx(float(written.float().mean()))
    assert metrics["completions/max_length"] == float(written.max())
    prompt_tokens = int(rollout.query_mask.sum())
    assert trainer.state.num_input_tokens_seen == prompt_tokens + int(written.sum())


def test_row_limits_outside_the_calls_limit_are_refused():
    """A multi-turn producer gives each row its room (``row_max_new_tokens``); one outside 1..max_new_tokens
    is a caller's bug, refused when the settings are built."""
    from rlhf_trainers.generation import SamplingSettings

    assert SamplingSettings(max_new_tokens=8, pad_token_id=0, row_max_new_tokens=(1, 8)).row_max_new_tokens
    for limits in [(0, 8), (9,)]:
        with pytest.raises(ValueError, match=r"row_max_new_tokens=.*between 1 and max_new_tokens=8"):
            SamplingSettings(max_new_tokens=8, pad_token_id=0, row_max_new_tokens=limits)
