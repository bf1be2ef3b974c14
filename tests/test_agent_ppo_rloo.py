"""Multi-turn tool rollouts for PPO (with its critic) and RLOO (``PPOTrainer(tools=)``,
``RLOOTrainer(tools=)``), and ``tool_timeout``, on the offline kit with the builtin generation loop.

The scripted first turns are test_agent_rollouts.py's (the kit's policy never writes a call itself).
PPO's GAE treats an episode as one sequence of the policy's tokens: the tool turns are skipped by the
carry-forward masking (docs/agents.md, "PPO: GAE across a tool turn"), which these tests pin down by
comparing with GAE over the same episode with its tool tokens cut out.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_agent_rollouts import ADD_CALL, _length_reward, _script, _tokenizer, _tool_positions, add

from rlhf_trainers import PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers import functional as F
from rlhf_trainers.agents.producer import MultiTurnProducer
from rlhf_trainers.onpolicy.producer import SingleTurnProducer

COMMON = {
    "per_device_train_batch_size": 8,
    "num_mini_batches": 1,
    "num_ppo_epochs": 1,
    "response_length": 120,
    "max_prompt_length": 48,  # the tools' schemas make long prompts: keep their end (the kit has 256 positions)
    "temperature": 1.0,
    "learning_rate": 1e-3,
    "max_steps": 1,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "seed": 0,
    "num_sample_generations": 0,
    "disable_tqdm": True,
    "rollout_logprobs": "forward",  # the scripted rows' log-probs come from the forward pass
}


def _trainer(kit, tmp_path, cls=PPOTrainer, tools=(add,), reward_funcs=_length_reward, **overrides):
    config = PPOConfig if cls is PPOTrainer else RLOOConfig
    fields = {**COMMON, "output_dir": str(tmp_path / "out"), **overrides}
    if cls is RLOOTrainer:
        fields.setdefault("rloo_k", 4)
    return cls(
        model=kit.load_model("llama-sft"),
        reward_funcs=reward_funcs,
        args=config(**fields),
        train_dataset=kit.prompt_dataset("train", n=32, chat=True),
        processing_class=_tokenizer(kit),
        tools=list(tools) if tools is not None else None,
    )


def _tool_reward(prompts, completions, **kwargs):
    """1 when the conversation holds the calculator's answer."""
    return [float(any(m.get("role") == "tool" and m["content"] == "5" for m in c)) for c in completions]


@pytest.mark.parametrize("cls", [PPOTrainer, RLOOTrainer])
def test_ppo_and_rloo_train_with_a_tool(kit, tmp_path, cls):
    trainer = _trainer(kit, tmp_path, cls, reward_funcs=_tool_reward, max_steps=2)
    assert isinstance(trainer.producer, MultiTurnProducer)
    _script(trainer, [ADD_CALL, ADD_CALL, None, None])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(logged) == 2
    for h in logged:
        assert h["tools/call_frequency"] == pytest.approx(0.5)
        assert h["objective/scores"] == pytest.approx(0.5)  # exactly the rows that called the tool
        assert 0.0 < h["tools/inserted_token_frequency"] < 1.0
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert any(n.startswith("policy.") for n in changed)
    if cls is PPOTrainer:
        assert any(n.startswith("value_model.") for n in changed)  # the critic learns too


def test_ppo_gae_skips_the_tool_turns(kit, tmp_path):
    """PPO's advantages and returns of an episode with tool turns are GAE over the episode with the tool
    tokens cut out (the last token of an assistant turn bootstraps from the first token of the next), 0 at
    the tool tokens; the value loss has no gradient there. With ``response_mask`` (the tool tokens as
    steps, discounted by gamma and lam) every assertion here fails."""
    trainer = _trainer(kit, tmp_path, gamma=0.9, lam=0.8, whiten_advantages=False, kl_coef=0.1)
    _script(trainer, [ADD_CALL, ADD_CALL, None, None])
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    tool = _tool_positions(rollout)
    assert tool.any(1).sum() >= 2, "some rows must hold a tool turn"
    rollout.values = torch.randn_like(rollout.values) * rollout.response_mask  # a critic with opinions
    rewards = trainer.token_rewards(rollout)
    assert torch.all(rewards[tool] == 0)  # no KL at the tool tokens; the score sits at the last policy token
    out = trainer.compute_advantages(rollout, rewards)
    assert torch.all(out.advantages[tool] == 0) and torch.all(out.returns[tool] == 0)
    for i in tool.any(1).nonzero().flatten().tolist():
        kept = rollout.policy_mask[i].nonzero().flatten()
        advantages, returns = F.gae_advantages(
            rewards[i, kept][None],
            rollout.values[i, kept][None],
            torch.ones(1, len(kept)),
            gamma=0.9,
            lam=0.8,
        )
        torch.testing.assert_close(out.advantages[i, kept], advantages[0].float())
        torch.testing.assert_close(out.returns[i, kept], returns[0].float())
    # whitened over the policy's tokens only (the tool tokens' zeros are not in the mean and variance)
    trainer.args.whiten_advantages = True
    whitened = trainer.compute_advantages(rollout, rewards).advantages
    expected = F.whiten(out.advantages, rollout.policy_mask, shift_mean=True) * rollout.policy_mask
    torch.testing.assert_close(whitened, expected)

    trainer.args.cliprange_value = None  # the plain squared error: a gradient wherever the loss reads
    rows = torch.arange(rollout.response.shape[0])
    logprobs, _, _ = trainer.loop.training_forward(trainer.model, rollout, rows)
    values = torch.randn_like(rollout.values).requires_grad_()  # (the fresh critic's head is all zeros)
    loss, _ = trainer.compute_policy_loss(rollout, out, rows, logprobs, values)
    (grad,) = torch.autograd.grad(loss, values)
    assert torch.all(grad[tool] == 0)
    assert grad[rollout.policy_mask].abs().sum() > 0


@pytest.mark.parametrize("cls", [PPOTrainer, RLOOTrainer])
def test_an_episode_without_tool_calls_is_the_single_turn_update(kit, tmp_path, cls):
    """Tools offered but never called: the multi-turn producer's rollout, advantages (PPO: and returns)
    and loss are the single-turn producer's."""

    def ids_reward(completion_ids, **kwargs):  # the same input on both paths
        return [float(sum(ids) % 7) for ids in completion_ids]

    trainer = _trainer(kit, tmp_path, cls, reward_funcs=ids_reward, rollout_logprobs="auto")
    batch = trainer.producer.prompt_batch(0)
    torch.manual_seed(1)
    multi = trainer.producer.rollout(batch)
    torch.manual_seed(1)
    single = SingleTurnProducer(trainer).rollout(batch)
    assert not _tool_positions(multi).any()
    for name in ("response", "response_mask", "logprobs", "ref_logprobs", "kl", "scores"):
        torch.testing.assert_close(getattr(multi, name), getattr(single, name), msg=name)
    if cls is PPOTrainer:
        torch.testing.assert_close(multi.values, single.values)
    a = trainer.compute_advantages(multi, trainer.token_rewards(multi))
    b = trainer.compute_advantages(single, trainer.token_rewards(single))
    torch.testing.assert_close(a.advantages, b.advantages)
    if cls is PPOTrainer:
        torch.testing.assert_close(a.returns, b.returns)
    rows = torch.arange(multi.response.shape[0])
    logprobs, values, _ = trainer.loop.training_forward(trainer.model, multi, rows)
    loss_a, _ = trainer.compute_policy_loss(multi, a, rows, logprobs, values)
    loss_b, _ = trainer.compute_policy_loss(single, b, rows, logprobs, values)
    torch.testing.assert_close(loss_a, loss_b)


def slow(x: int) -> int:
    """Take a while.

    Args:
        x: X.
    """
    time.sleep(5)
    return x


def test_tool_timeout_records_the_call_as_the_tools_error(kit, tmp_path):
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    call = '<tool_call>\n{"name": "slow", "arguments": {"x": 1}}\n</tool_call>'
    trainer = _trainer(
        kit, tmp_path, RLOOTrainer, tools=(slow,), reward_funcs=reward, tool_timeout=0.2, response_length=200
    )
    assert trainer.toolbox.timeout == 0.2
    _script(trainer, [call, None, None, None])
    began = time.perf_counter()
    trainer.train()
    assert time.perf_counter() - began < 20  # 2 calls of 5 s would not fit if they were waited for
    contents = [m["content"] for c in seen for m in c if m.get("role") == "tool"]
    assert contents and all("Tool slow timed out after 0.2 s" in c for c in contents)
    (logged,) = [h for h in trainer.state.log_history if "tools/failure_frequency" in h]
    assert logged["tools/failure_frequency"] == 1.0


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "5"])
def test_bad_tool_timeout_is_refused_at_construction(tmp_path, value):
    with pytest.raises(ValueError, match=r"tool_timeout="):
        RLOOConfig(output_dir=str(tmp_path), tool_timeout=value, use_cpu=True, report_to="none")


def test_bad_iterations_are_refused_for_ppo(tmp_path):
    with pytest.raises(ValueError, match=r"max_tool_calling_iterations=1.5"):
        PPOConfig(output_dir=str(tmp_path), max_tool_calling_iterations=1.5, use_cpu=True, report_to="none")


def test_truncated_tool_prompts_say_the_tools_were_cut(kit, tmp_path, caplog):
    """Our max_prompt_length truncates from the left, where a tool run's prompt describes the tools: the
    warning says so and names the fix (TRL keeps prompts whole)."""
    with caplog.at_level("WARNING", logger="rlhf_trainers"):
        _trainer(kit, tmp_path, RLOOTrainer)  # max_prompt_length=48: every prompt is cut
    assert any(
        "truncated from the left" in r.message and "max_prompt_length=None" in r.message
        for r in caplog.records
    ), [r.message for r in caplog.records]
