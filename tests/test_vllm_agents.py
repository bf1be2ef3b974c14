"""Multi-turn tool rollouts with colocated vLLM (``GRPOTrainer(tools=[...], use_vllm=True)``).

Like tests/test_vllm.py these need vLLM: ``tests/test_vllm_env.py`` runs them in the vLLM environment
where the test interpreter has none. The policy is the kit's ``llama-hd32-sft`` (vLLM's CPU attention
refuses head size 16).

The kit's policy never writes a tool call by itself, so the tests that need calls script some rows'
assistant turns (:func:`_script`, the vLLM form of tests/test_agent_rollouts.py's): vLLM samples the turn,
then the row's tokens are replaced by a fixed call and its log-probs by the engine's own log-probs of
those tokens (``completion_logprobs``, at the trainer's temperature 1), as if vLLM had sampled them. The
turns after the tool result are vLLM's samples from the continued prompt.
"""

from __future__ import annotations

import pytest
import torch
from test_agent_rollouts import (
    ADD_CALL,
    _length_reward,
    _tokenizer,
    add,
    assert_tool_tokens_out_of_the_loss,
    train_and_check_it_moved,
)

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers import functional as F
from rlhf_trainers.agents.producer import MultiTurnProducer
from rlhf_trainers.onpolicy.metrics import rollout_sampling_metrics
from rlhf_trainers.onpolicy.producer import SingleTurnProducer

pytestmark = pytest.mark.vllm

POLICY = "llama-hd32-sft"
#: A call with some text before it: a longer first turn than ADD_CALL's.
LONG_CALL = "I will add the two numbers with the tool now.\n" + ADD_CALL


def _trainer(kit, tmp_path, reward_funcs=_length_reward, agent=None, **overrides) -> GRPOTrainer:
    """A GRPOTrainer with vLLM on the kit; its tools are ``[add]`` unless ``agent`` gives other keyword
    arguments (e.g. ``environment_factory``)."""
    fields = {
        "output_dir": str(tmp_path / "out"),
        "use_vllm": True,
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
    }
    fields.update(overrides)
    return GRPOTrainer(
        model=kit.load_model(POLICY),
        reward_funcs=reward_funcs,
        args=GRPOConfig(**fields),
        train_dataset=kit.prompt_dataset("train", n=32, chat=True),
        processing_class=_tokenizer(kit),
        **(agent if agent is not None else {"tools": [add]}),
    )


def _script(trainer, calls: list[str | None], every_turn: bool = False) -> list[dict]:
    """Make row ``k`` of the sampler's first call in each rollout write ``calls[k % len(calls)]`` (None:
    vLLM's sample) and the end-of-turn token, with vLLM's log-probs of those tokens; with ``every_turn``
    every turn of those rows does. Returns the record of every generation call (its arguments)."""
    tokenizer = trainer.processing_class
    scripted = [
        None if c is None else [*tokenizer(c, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        for c in calls
    ]
    real = trainer.sampler.generate
    backend = trainer.generation_backend
    R = trainer.args.response_length
    record: list[dict] = []

    def generate(query, query_mask, with_logprobs=False, *, max_new_tokens=None, stop_ids=None, **limits):
        out, extras = real(
            query, query_mask, with_logprobs, max_new_tokens=max_new_tokens, stop_ids=stop_ids, **limits
        )
        record.append(
            {"rows": out.shape[0], "max_new_tokens": max_new_tokens, "stop_ids": stop_ids, **limits}
        )
        if not (max_new_tokens in (None, R) or every_turn):
            return out, extras
        out = out.clone()
        extras = None if extras is None else {k: None if v is None else v.clone() for k, v in extras.items()}
        room = limits.get("row_max_new_tokens") or [out.shape[1]] * out.shape[0]
        changed = []
        for k in range(out.shape[0]):
            ids = scripted[k % len(scripted)]
            if ids is None or len(ids) > room[k]:
                continue
            out[k] = tokenizer.pad_token_id
            out[k, : len(ids)] = torch.tensor(ids)
            changed.append((k, query[k][query_mask[k].bool()].tolist(), ids))
        if extras is not None and changed:
            logprobs = backend.completion_logprobs([p for _, p, _ in changed], [c for _, _, c in changed])
            for (k, _, ids), values in zip(changed, logprobs, strict=True):
                extras["logprobs"][k] = 0.0
                extras["logprobs"][k, : len(ids)] = values
        return out, extras

    trainer.sampler.generate = generate
    return record


def _tool_positions(rollout) -> torch.Tensor:
    return rollout.response_mask & ~rollout.loss_mask


def _policy_turns_end_at_a_stop_token(rollout, stop_ids: list[int]) -> None:
    """Every policy turn followed by a tool turn ends with a stop token (vLLM stopped it there)."""
    stops = torch.tensor(stop_ids)
    for row in range(rollout.response.shape[0]):
        written, valid = rollout.loss_mask[row], rollout.response_mask[row]
        for t in range(1, int(rollout.lengths[row])):
            if valid[t] and not written[t] and written[t - 1]:
                assert torch.isin(rollout.response[row, t - 1], stops), (row, t)


# ---- training ------------------------------------------------------------------------------------------


def test_grpo_multi_turn_with_vllm_trains_on_the_kit(kit, tmp_path):
    """Two GRPO updates of tool episodes sampled by vLLM: half of each group calls the calculator, the
    turn after the result is vLLM's sample from the continued prompt (stopped at the turn-end token), the
    reward sees the conversation, the policy moves, and vLLM's and the trainer's log-probs agree on the
    policy's tokens (fp32: the mismatch metrics, which tool tokens would blow up, stay at rounding)."""

    def reward(prompts, completions, **kwargs):
        return [float(any(m.get("role") == "tool" and m["content"] == "5" for m in c)) for c in completions]

    trainer = _trainer(kit, tmp_path, reward_funcs=reward, max_steps=2)
    assert isinstance(trainer.producer, MultiTurnProducer)
    record = _script(trainer, [ADD_CALL, ADD_CALL, None, None])
    logged = train_and_check_it_moved(trainer)
    assert len(logged) == 2
    for h in logged:
        assert h["tools/call_frequency"] == pytest.approx(0.5)
        assert h["objective/scores"] == pytest.approx(0.5)
        assert 1.0 < h["tools/turns_per_episode"] <= 1.5
        assert h["sampling/sampling_logp_difference/max"] < 1e-3
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3
    # per update: the first turn (all rows) and the second turn (the 4 rows that called), each one call to
    # the engine with the turn-end tokens as its stop tokens
    assert [r["rows"] for r in record] == [8, 4, 8, 4]
    assert all(r["stop_ids"] == trainer.producer.stop_ids for r in record)
    assert all(r["max_new_tokens"] < trainer.args.response_length for r in record[1::2])


class _AddEnv:
    """``add`` as an environment's method; ``get_reward`` counts the episode's calls."""

    def reset(self, **row) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


def test_grpo_with_environments_and_vllm_trains_on_the_kit(kit, tmp_path):
    """environment_factory with vLLM: each episode's environment runs its calls (the scripted half of
    each group calls once, so ``get_reward`` is 1 there and 0 elsewhere), the turn after the result is
    vLLM's sample, and the log-probs of vLLM and of the trainer agree on the policy's tokens."""
    trainer = _trainer(kit, tmp_path, agent={"environment_factory": _AddEnv}, max_steps=2)
    record = _script(trainer, [ADD_CALL, ADD_CALL, None, None])
    logged = train_and_check_it_moved(trainer)
    assert len(logged) == 2
    for h in logged:
        assert h["tools/call_frequency"] == pytest.approx(0.5)
        assert h["rewards/_AddEnv/mean"] == pytest.approx(0.5)
        assert h["sampling/sampling_logp_difference/max"] < 1e-3
    assert [r["rows"] for r in record] == [8, 4, 8, 4]


def test_vllms_logprobs_as_the_old_ones_leave_the_tool_tokens_out(kit, tmp_path):
    """rollout_logprobs='generation': the episode's old log-probs are vLLM's, 0 at tool tokens; the ratio
    at the start of the update and the mismatch metrics (the first mini-batch's training pass against
    them) read the policy's tokens only, so they stay at fp32 rounding."""
    trainer = _trainer(kit, tmp_path, rollout_logprobs="generation")
    assert trainer.vllm_logprobs_are_old
    _script(trainer, [ADD_CALL, ADD_CALL, None, None])
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logged["tools/call_frequency"] == pytest.approx(0.5)
    assert 0 < logged["sampling/sampling_logp_difference/max"] < 1e-3
    assert logged["policy/ratio_at_start"] < 1e-3


def test_tool_tokens_carry_no_gradient_kl_advantage_nor_importance_weight(kit, tmp_path):
    """The tool turns are in the sequence but out of everything the loss reads: KL 0, gradient 0,
    perturbing their old/reference log-probs changes neither loss nor advantages, and vLLM's truncated
    importance weights are formed from the policy's tokens only: with the sequence ratio (which sums
    over the tokens it is given), a row with a tool turn keeps a weight of ~1 in fp32; the tool tokens,
    at which vLLM gives log-prob 0, would take it to ~0 (checked below on the same tensors)."""
    trainer = _trainer(kit, tmp_path, beta=0.04, vllm_importance_sampling_mode="sequence_truncate")
    _script(trainer, [ADD_CALL, ADD_CALL, None, None])
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    tool = _tool_positions(rollout)
    called = tool.any(1)
    assert called.sum() == 4
    _policy_turns_end_at_a_stop_token(rollout, trainer.producer.stop_ids)
    assert torch.all(rollout.kl[tool] == 0)
    # vLLM's log-probs: the policy's tokens only, 0 at tool tokens
    assert torch.all(rollout.generation_logprobs[tool] == 0)
    policy = rollout.policy_mask
    gap = (rollout.logprobs - rollout.generation_logprobs)[policy].abs()
    assert gap.max() < 1e-3, gap.max()

    weights = rollout.sampling_weights
    assert weights is not None and weights.shape == (rollout.response.shape[0], 1)
    torch.testing.assert_close(weights[called], torch.ones_like(weights[called]), atol=1e-3, rtol=0)
    with_tool_tokens = F.truncated_importance_weights(
        rollout.logprobs, rollout.generation_logprobs, rollout.response_mask, 3.0, "sequence_truncate"
    )
    assert with_tool_tokens[called].max() < 0.5  # what the weights would be if tool tokens entered
    metrics = rollout_sampling_metrics(rollout, trainer.collectives, 0.0)
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-3
    assert abs(metrics["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3

    assert_tool_tokens_out_of_the_loss(trainer, rollout, tool)


def test_a_one_turn_episode_is_the_single_turn_vllm_rollout(kit, tmp_path):
    """Tools offered but never called (the kit's policy writes no call): the multi-turn producer's
    rollout with vLLM is the single-turn producer's, token for token (the same requests, seeds and stop
    tokens go to the engine), log-probs, vLLM's log-probs and importance weights included."""

    def ids_reward(completion_ids, **kwargs):
        return [float(sum(ids) % 7) for ids in completion_ids]

    trainer = _trainer(kit, tmp_path, reward_funcs=ids_reward, beta=0.04, max_completion_length=24)
    batch = trainer.producer.prompt_batch(0)
    torch.manual_seed(1)
    multi = trainer.producer.rollout(batch)
    torch.manual_seed(1)
    single = SingleTurnProducer(trainer).rollout(batch)
    assert not _tool_positions(multi).any()
    assert multi.sampling_weights is not None
    for name in (
        "response",
        "response_mask",
        "lengths",
        "logprobs",
        "generation_logprobs",
        "sampling_weights",
        "ref_logprobs",
        "kl",
        "scores",
        "found_stop",
        "policy_mask",
    ):
        torch.testing.assert_close(getattr(multi, name), getattr(single, name), msg=name)
    a = trainer.compute_advantages(multi, trainer.token_rewards(multi))
    b = trainer.compute_advantages(single, trainer.token_rewards(single))
    torch.testing.assert_close(a.advantages, b.advantages)


# ---- the engine ------------------------------------------------------------------------------------------


def test_each_calls_stop_tokens_and_row_limits_reach_vllm_and_a_continued_prompt_hits_its_cache(
    kit, tmp_path
):
    """The sampler's per-call ``stop_ids`` become the requests' stop tokens (a frequent token here: every
    row that writes it stops there, keeping it), ``row_max_new_tokens`` each request's ``max_tokens``, and
    a prompt continued from an earlier request (prompt + its sample + more tokens: the next turn of an
    episode) is read from vLLM's prefix cache up to the last whole KV block of what was computed before."""
    trainer = _trainer(kit, tmp_path)
    backend = trainer.generation_backend
    tokenizer = trainer.processing_class
    batch = trainer.producer.prompt_batch(0)
    query, mask = batch["input_ids"].repeat(4, 1), batch["attention_mask"].repeat(4, 1)
    rows = query.shape[0]
    torch.manual_seed(0)
    plain, _ = trainer.sampler.generate(query, mask, max_new_tokens=24, stop_ids=[])
    common = torch.mode(plain.flatten()).values.item()  # a token the policy writes often
    torch.manual_seed(0)
    stopped, _ = trainer.sampler.generate(query, mask, max_new_tokens=24, stop_ids=[common])
    hits = 0
    for row in range(rows):
        where = (plain[row] == common).nonzero().flatten()
        if where.numel():
            end = int(where[0]) + 1
            hits += 1
            assert torch.equal(stopped[row, :end], plain[row, :end])  # same seed: same draws up to the stop
            assert torch.all(stopped[row, end:] == tokenizer.pad_token_id)
    assert hits > 0
    limits = [3 + row for row in range(rows)]
    limited, _ = trainer.sampler.generate(
        query, mask, max_new_tokens=24, stop_ids=[], row_max_new_tokens=limits
    )
    for row, limit in enumerate(limits):
        assert torch.all(limited[row, limit:] == tokenizer.pad_token_id)

    # an episode's next turn: its prompt is the earlier prompt, the sampled turn and a tool turn
    block = backend.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = query[0][mask[0].bool()].tolist()
    first, _ = trainer.sampler.generate(torch.tensor([prompt]), torch.ones(1, len(prompt)), max_new_tokens=40)
    turn = [t for t in first[0].tolist() if t != tokenizer.pad_token_id]
    suffix = trainer.producer.tool_turn_ids([{"role": "tool", "name": "add", "content": "5"}])
    continued = prompt + turn + suffix
    trainer.sampler.generate(torch.tensor([continued]), torch.ones(1, len(continued)), max_new_tokens=4)
    computed = len(prompt) + len(turn) - 1  # the last sampled token's keys were never computed
    assert backend.last_prompt_tokens == len(continued)
    assert backend.last_cached_tokens >= computed // block * block > 0


def test_episodes_that_outgrow_the_engines_context_end_cleanly(kit, tmp_path):
    """Agents that call in every turn, with first turns of different lengths: the rows of one engine call
    have different contexts and different room left, and each request asks for its own (before, the call
    asked for the largest room after the longest context and vLLM's context check failed the rollout).
    With an engine context shorter than prompt + response_length (simulated: the backend's limit lowered
    after construction), the episodes end where the context is full, every one with a policy token."""
    trainer = _trainer(kit, tmp_path, max_completion_length=200)
    record = _script(trainer, [ADD_CALL, LONG_CALL], every_turn=True)
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    assert any("row_max_new_tokens" in r for r in record)
    prompt_lengths = rollout.query_mask.sum(1)
    context = trainer.generation_backend.max_model_len
    assert torch.all(prompt_lengths + rollout.lengths <= context)
    shorter = 150
    assert int((prompt_lengths + rollout.lengths).max()) > shorter  # the episodes outgrow the context below
    assert int(rollout.lengths.max()) <= 200
    assert _tool_positions(rollout).any(1).all()
    last = (rollout.lengths - 1).clamp_min(0)
    assert torch.all(rollout.policy_mask[torch.arange(len(last)), last])

    trainer.generation_backend.max_model_len = shorter
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    assert torch.all(rollout.query_mask.sum(1) + rollout.lengths <= shorter)
    assert _tool_positions(rollout).any()  # ADD_CALL's rows got a tool turn in; LONG_CALL's had no room
    last = (rollout.lengths - 1).clamp_min(0)
    assert torch.all(rollout.policy_mask[torch.arange(len(last)), last])
    assert torch.isfinite(rollout.scores).all()


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_ppo_and_rloo_multi_turn_with_vllm_train_on_the_kit(kit, tmp_path, algorithm):
    """PPO (with its critic) and RLOO train on tool episodes sampled by vLLM: the tool metrics are TRL's,
    the reward is exactly the calling rows', and the policy (PPO: and the critic) moves."""
    from rlhf_trainers import PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer

    def reward(prompts, completions, **kwargs):
        return [float(any(m.get("role") == "tool" and m["content"] == "5" for m in c)) for c in completions]

    trainer_cls, config_cls = (PPOTrainer, PPOConfig) if algorithm == "ppo" else (RLOOTrainer, RLOOConfig)
    fields = {
        "output_dir": str(tmp_path / "out"), "use_vllm": True, "per_device_train_batch_size": 8,
        "num_mini_batches": 1, "num_ppo_epochs": 1, "response_length": 120, "max_prompt_length": 48,
        "temperature": 1.0, "learning_rate": 1e-3, "max_steps": 2, "logging_steps": 1, "save_strategy": "no",
        "report_to": "none", "use_cpu": True, "seed": 0, "num_sample_generations": 0, "disable_tqdm": True,
    }  # fmt: skip
    if algorithm == "rloo":
        fields["rloo_k"] = 4
    trainer = trainer_cls(
        model=kit.load_model(POLICY),
        reward_funcs=reward,
        args=config_cls(**fields),
        train_dataset=kit.prompt_dataset("train", n=32, chat=True),
        processing_class=_tokenizer(kit),
        tools=[add],
    )
    assert isinstance(trainer.producer, MultiTurnProducer)
    _script(trainer, [ADD_CALL, ADD_CALL, None, None])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(logged) == 2
    for h in logged:
        assert h["tools/call_frequency"] == pytest.approx(0.5)
        assert h["objective/scores"] == pytest.approx(0.5)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert any(n.startswith("policy.") for n in changed)
    if algorithm == "ppo":
        assert any(n.startswith("value_model.") for n in changed)
