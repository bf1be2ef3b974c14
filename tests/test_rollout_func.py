"""TRL's ``rollout_func`` (``GRPOTrainer(rollout_func=...)``, and PPO's and RLOO's): a user's function
makes the completions, on the offline kit.

The functions here generate with the trainer's own sampler (``trainer.sampler.generate``), or replay the
completions the builtin sampler made in another run, so their rollouts are real policy samples.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from rlhf_trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.agents.user_rollouts import UserRolloutProducer, read_rollout

K = 4  # num_generations


def _config(tmp_path, cls=GRPOConfig, **overrides):
    fields: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
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
    if cls is GRPOConfig:
        fields.update(num_generations=K, max_completion_length=12)
    else:
        fields.update(response_length=12)
    fields.update(overrides)
    return cls(**fields)


def _length_reward(completions, **kwargs):
    return [float(len(c) % 7) for c in completions]


def _sampled(prompts: list[str], trainer) -> dict[str, Any]:
    """``prompts`` tokenized and sampled with the trainer's sampler, cut after the first EOS token, with
    the sampler's log-probs: what a rollout_func built on the policy returns."""
    tokenizer = trainer.processing_class
    ids = [tokenizer(p).input_ids for p in prompts]
    width = max(map(len, ids))
    query = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    generated, extras = trainer.sampler.generate(query, mask, with_logprobs=True)
    completions, logprobs = [], []
    for row, row_logprobs in zip(generated.tolist(), extras["logprobs"].tolist(), strict=True):
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        completions.append(row[:end])
        logprobs.append(row_logprobs[:end])
    return {"prompt_ids": ids, "completion_ids": completions, "logprobs": logprobs}


def _grpo(kit, tmp_path, rollout_func, n=16, **overrides) -> GRPOTrainer:
    return GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=overrides.pop("reward_funcs", _length_reward),
        args=_config(tmp_path, **overrides),
        train_dataset=kit.prompt_dataset("train", n=n),
        processing_class=kit.load_tokenizer(),
        rollout_func=rollout_func,
    )


def _params(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}


# ---- training with a rollout_func ----------------------------------------------------------------------


def test_a_rollout_func_trains_and_its_fields_reach_the_reward_functions(kit, tmp_path):
    given: list[list[Any]] = []
    seen: list[dict[str, Any]] = []

    def rollout_func(prompts, trainer):
        given.append(list(prompts))
        out = _sampled(prompts, trainer)
        texts = trainer.processing_class.batch_decode(out["completion_ids"], skip_special_tokens=True)
        # per completion: the prompt and text it was made for (checks the rows' order); shared: one value
        return {**out, "made_for": list(zip(prompts, texts, strict=True)), "episode_id": "shared"}

    def reward(prompts, completions, made_for, episode_id, **kwargs):
        seen.append({"prompts": prompts, "completions": completions, "made_for": made_for, "id": episode_id})
        return [float(len(c) % 5) for c in completions]

    trainer = _grpo(kit, tmp_path, rollout_func, reward_funcs=reward, max_steps=2)
    assert isinstance(trainer.producer, UserRolloutProducer)
    before = _params(trainer)
    trainer.train()
    assert trainer.state.global_step == 2 and len(given) == 2
    for prompts in given:  # TRL's order: each prompt num_generations times in a row
        assert len(prompts) == 8
        assert all(prompts[i] == prompts[i - i % K] for i in range(8)) and prompts[0] != prompts[K]
    for call in seen:
        assert list(zip(call["prompts"], call["completions"], strict=True)) == call["made_for"]
        assert call["id"] == ["shared"] * 8
    after = _params(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before), "no parameter moved"
    logged = trainer.state.log_history[0]
    assert "reward" in logged and torch.isfinite(torch.tensor(logged["loss"]))


@pytest.mark.parametrize("mode", ["forward", "generation"])
def test_replaying_the_builtin_samples_gives_the_builtin_update(kit, tmp_path, mode):
    """A rollout_func that returns exactly the builtin sampler's completions (and log-probs) gives the
    same update as the builtin path: same rollout, same loss, same weights after the step."""
    # 6 tokens: some completions end with EOS, some are cut (found_stop differs between rows)
    builtin = _grpo(kit, tmp_path / "a", None, rollout_logprobs=mode, max_completion_length=6)
    captured: dict[str, Any] = {}
    real = builtin.producer.sample

    def capture(batch, copies=1, with_logprobs=False, timings=None):
        captured["samples"] = real(batch, copies, with_logprobs, timings)
        captured["B"] = batch["input_ids"].shape[0]
        return captured["samples"]

    builtin.producer.sample = capture
    builtin.train()

    def replay(prompts, trainer):
        s, B = captured["samples"], captured["B"]
        rows = [(u % K) * B + u // K for u in range(len(prompts))]  # prompt i's j-th copy: row j * B + i
        assert [s.prompts[r] for r in rows] == prompts
        n = [int(s.lengths[r]) for r in rows]
        return {
            "prompt_ids": [s.query[r][s.query_mask[r]].tolist() for r in rows],
            "completion_ids": [s.response[r, : n[i]].tolist() for i, r in enumerate(rows)],
            "logprobs": None
            if s.generation_logprobs is None
            else [s.generation_logprobs[r, : n[i]].tolist() for i, r in enumerate(rows)],
        }

    replayed = _grpo(kit, tmp_path / "b", replay, rollout_logprobs=mode, max_completion_length=6)
    replayed.train()
    a, b = builtin._last_rollout, replayed._last_rollout
    valid = a.response_mask
    assert a.found_stop.any() and not a.found_stop.all()
    assert torch.equal(valid, b.response_mask) and torch.equal(a.found_stop, b.found_stop)
    assert torch.allclose(a.logprobs[valid], b.logprobs[valid], atol=1e-6)
    assert torch.equal(a.raw_scores, b.raw_scores)
    for name, value in _params(builtin).items():
        assert torch.allclose(value, _params(replayed)[name], atol=1e-6), name
    la, lb = builtin.state.log_history[0], replayed.state.log_history[0]
    assert la["loss"] == pytest.approx(lb["loss"], abs=1e-6) and la["reward"] == lb["reward"]


def test_env_mask_keeps_inserted_tokens_out_of_the_loss(kit, tmp_path):
    def rollout_func(prompts, trainer):
        out = _sampled(prompts, trainer)
        # the first two tokens of every completion "inserted by an environment"
        out["env_mask"] = [[0] * min(2, len(c)) + [1] * max(0, len(c) - 2) for c in out["completion_ids"]]
        return out

    trainer = _grpo(kit, tmp_path, rollout_func, rollout_logprobs="forward")
    rollout = trainer.producer.produce(0, defaultdict(float))
    inserted = rollout.response_mask & ~rollout.policy_mask
    assert inserted[:, :2][rollout.lengths[:, None].expand(-1, 2) > torch.arange(2)].all()
    assert not inserted[:, 2:].any()
    assert (rollout.kl[inserted] == 0).all()


def test_logprobs_follow_rollout_logprobs(kit, tmp_path):
    def constant(prompts, trainer):
        out = _sampled(prompts, trainer)
        out["logprobs"] = [[-0.5] * len(c) for c in out["completion_ids"]]
        return out

    generation = _grpo(kit, tmp_path / "g", constant, rollout_logprobs="generation")
    rollout = generation.producer.produce(0, defaultdict(float))
    assert (rollout.logprobs[rollout.response_mask] == -0.5).all()  # the ratio's denominator: returned ones
    forward = _grpo(kit, tmp_path / "f", constant, rollout_logprobs="forward")
    rollout = forward.producer.produce(0, defaultdict(float))
    assert not (rollout.logprobs[rollout.response_mask] == -0.5).any()  # recomputed by the policy

    def no_logprobs(prompts, trainer):
        return {**_sampled(prompts, trainer), "logprobs": None}

    forward.producer.rollout_func = no_logprobs
    forward.producer.produce(0, defaultdict(float))  # fine: the policy's forward pass gives them
    generation.producer.rollout_func = no_logprobs
    with pytest.raises(ValueError, match=r"rollout_logprobs='generation'.*returned logprobs=None"):
        generation.producer.produce(0, defaultdict(float))


def test_rloo_importance_sampling_reads_the_returned_logprobs(kit, tmp_path):
    def rollout_func(prompts, trainer):
        out = _sampled(prompts, trainer)
        out["logprobs"] = [[-0.25] * len(c) for c in out["completion_ids"]]
        return out

    trainer = RLOOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=_length_reward,
        args=_config(tmp_path, RLOOConfig, num_generations=2, truncated_is_cap=2.0),
        train_dataset=kit.prompt_dataset("train", n=16),
        processing_class=kit.load_tokenizer(),
        rollout_func=rollout_func,
    )
    rollout = trainer.producer.produce(0, defaultdict(float))
    assert (rollout.generation_logprobs[rollout.response_mask] == -0.25).all()
    assert not (rollout.logprobs[rollout.response_mask] == -0.25).any()  # 'auto': recomputed

    def unknown_first(prompts, trainer):  # vLLM's None: a token it could not score
        out = rollout_func(prompts, trainer)
        out["logprobs"] = [[None, *row[1:]] for row in out["logprobs"]]
        return out

    trainer.producer.rollout_func = unknown_first
    rollout = trainer.producer.produce(0, defaultdict(float))
    assert torch.equal(rollout.generation_logprobs[:, 0], rollout.logprobs[:, 0])  # ratio 1 there
    assert (rollout.generation_logprobs[:, 1:][rollout.response_mask[:, 1:]] == -0.25).all()
    trainer.producer.rollout_func = lambda prompts, trainer: {
        **rollout_func(prompts, trainer),
        "logprobs": None,
    }
    with pytest.raises(ValueError, match=r"truncated importance sampling.*returned logprobs=None"):
        trainer.producer.produce(0, defaultdict(float))


# ---- bad returns --------------------------------------------------------------------------------------


def _good(n=8, length=3):
    return {
        "prompt_ids": [[5, 6]] * n,
        "completion_ids": [[7] * length] * n,
        "logprobs": [[-1.0] * length] * n,
    }


BAD = {
    "not a dict": ([1, 2], TypeError, r"returned list; it must return a dict with the keys"),
    "missing key": (
        {"prompt_ids": [[5]] * 8, "completion_ids": [[7]] * 8},
        ValueError,
        r"must also return \['logprobs'\]",
    ),
    "rows": (
        {**_good(), "completion_ids": [[7]] * 2},
        ValueError,
        r"2 entries in 'completion_ids' for the 8 prompts",
    ),
    "logprob length": (
        {**_good(), "logprobs": [[-1.0]] * 8},
        ValueError,
        r"logprobs\[0\] with 1 values for a completion of 3",
    ),
    "too long": (_good(length=13), ValueError, r"13 tokens, more than max_completion_length=12"),
    "vocabulary": (
        {**_good(), "prompt_ids": [[5, 10**9]] * 8},
        ValueError,
        r"outside the policy's vocabulary",
    ),
    "float ids": ({**_good(), "completion_ids": [[7.0] * 3] * 8}, TypeError, r"non-integer ids"),
    "empty prompt": ({**_good(), "prompt_ids": [[]] * 8}, ValueError, r"empty prompt_ids\[0\]"),
    "mask values": ({**_good(), "env_mask": [[0, 2, 1]] * 8}, ValueError, r"env_mask\[0\] with the value 2"),
    "mask length": ({**_good(), "env_mask": [[1]] * 8}, ValueError, r"env_mask\[0\] with 1 values"),
    "field rows": ({**_good(), "answer": [1, 2, 3]}, ValueError, r"3 entries in 'answer'"),
    "reserved field": ({**_good(), "completions": ["x"] * 8}, ValueError, r"already get completions="),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_wrong_returns_are_refused(case):
    output, error, message = BAD[case]
    with pytest.raises(error, match=message):
        read_rollout(output, 8, max_completion_length=12, vocab_size=1000, copies=K)


def test_wrong_returns_are_refused_in_training(kit, tmp_path):
    trainer = _grpo(kit, tmp_path, lambda prompts, trainer: _good(n=len(prompts) // 2))
    with pytest.raises(
        ValueError, match=r"4 entries in 'prompt_ids' for the 8 prompts it was given, each prompt 4"
    ):
        trainer.train()
    got = read_rollout(_good(), 8, max_completion_length=12, vocab_size=1000)  # the well-formed one passes
    assert got.completion_ids == [[7, 7, 7]] * 8 and got.env_mask is None and got.extra == {}
    arrays = {key: torch.tensor(value) for key, value in _good().items()}  # tensors (or numpy arrays)
    arrays["shared"] = "one value"
    got = read_rollout(arrays, 8, max_completion_length=12, vocab_size=1000)
    assert got.prompt_ids == [[5, 6]] * 8 and got.extra == {"shared": ["one value"] * 8}


def test_rollout_func_is_checked_at_construction(kit, tmp_path):
    with pytest.raises(TypeError, match="rollout_func must be a function"):
        _grpo(kit, tmp_path, rollout_func="generate.py")
    with pytest.raises(ValueError, match=r"does not go with dynamic_sampling=True"):
        _grpo(kit, tmp_path, _sampled, dynamic_sampling=True)
    with pytest.raises(ValueError, match=r"does not go with tools="):
        GRPOTrainer(
            model=kit.load_model("llama-sft"),
            reward_funcs=_length_reward,
            args=_config(tmp_path),
            train_dataset=kit.prompt_dataset("train", n=8),
            rollout_func=_sampled,
            tools=[len],
        )


# ---- PPO, RLOO, evaluation ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ["ppo", "rloo"])
def test_ppo_and_rloo_take_a_rollout_func(kit, tmp_path, cls):
    calls: list[int] = []

    def rollout_func(prompts, trainer):
        calls.append(len(prompts))
        out = _sampled(prompts, trainer)
        out["env_mask"] = [[1] * len(c) for c in out["completion_ids"]]
        return out

    trainer_cls, config_cls = {"ppo": (PPOTrainer, PPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}[cls]
    trainer = trainer_cls(
        model=kit.load_model("llama-sft"),
        reward_funcs=_length_reward,
        args=_config(tmp_path, config_cls),
        train_dataset=kit.prompt_dataset("train", n=16),
        processing_class=kit.load_tokenizer(),
        rollout_func=rollout_func,
    )
    before = _params(trainer)
    trainer.train()
    assert calls and isinstance(trainer.producer, UserRolloutProducer)
    assert any(not torch.equal(before[n], p) for n, p in _params(trainer).items())


def test_evaluation_asks_the_rollout_func_once_per_prompt(kit, tmp_path):
    given: list[list[str]] = []

    def rollout_func(prompts, trainer):
        given.append(list(prompts))
        return _sampled(prompts, trainer)

    trainer = _grpo(kit, tmp_path, rollout_func)
    metrics = trainer.evaluate(kit.prompt_dataset("test", n=6))
    assert sum(map(len, given)) == 6 and len({p for call in given for p in call}) == 6
    assert "eval_reward" in metrics
