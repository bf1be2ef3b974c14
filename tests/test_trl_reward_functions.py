"""Reward functions called exactly as TRL 1.16 calls them (issue #48), for GRPO, RLOO and PPO alike.

TRL's convention: for conversational prompts (a "prompt" column of ``[{"role": "user", "content": ...}]``)
each completion reaches a reward function as ``[{"role": "assistant", "content": text}]``, and ``prompts``
as the dataset's message lists; for text prompts both are strings. Every function may take
``completion_ids`` (each completion's token ids, without padding), ``trainer_state`` (the trainer's
``TrainerState``), ``log_metric`` / ``log_extra`` and every other dataset column. ``async def``
functions run concurrently; ``None`` leaves a function out of that row's weighted sum (NaN-safe, as TRL's
``nansum``), and a row no function scored leaves the update.

The functions below are written as TRL's documentation writes them; the scripts change only the import.
"""

from __future__ import annotations

import asyncio
import functools
import math

import datasets
import pytest
import torch

from rlhf_trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.rewards import (
    REWARD_FUNC_ARGS,
    RewardBatch,
    RewardFunctionSource,
    RewardLog,
    RewardSources,
    is_async_reward_func,
)
from rlhf_trainers.testing import true_reward

PROMPTS = ["the movie was", "we found the room", "i think the song is", "my city was"]
COMPLETIONS = [" good .", " really awful but warm .", "", " calm"]


def reward_len(completions, **kwargs):
    """TRL's quickstart reward: completions of 20 characters are best (conversational format)."""
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


def conversational(kit, n=32, **columns):
    """The kit's training prompts as TRL's conversational format, with optional extra columns."""
    prompts = kit.prompt_dataset("train", n=n)["prompt"]
    data = {"prompt": [[{"role": "user", "content": p}] for p in prompts]}
    data.update({name: [make(i) for i in range(n)] for name, make in columns.items()})
    return datasets.Dataset.from_dict(data)


COMMON = {
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


def grpo(kit, tmp_path, reward_funcs, train_dataset=None, **overrides):
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        **{**COMMON, **overrides},
    )
    return GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=conversational(kit) if train_dataset is None else train_dataset,
        processing_class=kit.load_tokenizer(),
    )


# ---- the call, without a trainer ---------------------------------------------------------------


def _batch(tok, prompts, completions, **kwargs):
    """``query_response_ids`` of prompts and completions as a rollout makes them (each completion + EOS)."""
    from rlhf_trainers.generation import render_prompts

    query = tok(render_prompts(prompts, tok), return_tensors="pt", padding=True, padding_side="left")
    responses = [tok(c)["input_ids"] + [tok.eos_token_id] for c in completions]
    width = max(len(r) for r in responses) + 2
    response = torch.full((len(responses), width), tok.pad_token_id)
    for row, ids in enumerate(responses):
        response[row, : len(ids)] = torch.tensor(ids)
    ids = torch.cat([query["input_ids"], response], dim=1)
    return ids, query["input_ids"].shape[1], [len(r) for r in responses], responses


@pytest.fixture(scope="module")
def tok(kit):
    return kit.load_tokenizer()


@pytest.mark.parametrize("chat", [True, False])
def test_the_arguments_trl_passes(tok, chat):
    seen = {}

    def everything(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
        seen.update(
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            state=trainer_state,
            **kwargs,
        )
        log_metric("my_metric", 2.0)
        log_metric("my_metric", 4.0)
        log_extra("note", [f"n{i}" for i in range(len(prompts))])
        return [1.0] * len(prompts)

    def named(completions, completion_ids, label, prompts):  # no **kwargs: gets only what it names
        seen["named"] = (completion_ids, label)
        return [float(len(ids)) for ids in completion_ids]

    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] if chat else PROMPTS
    ids, width, lengths, responses = _batch(tok, prompts, COMPLETIONS)
    state = object()
    sources = RewardSources(policy_tokenizer=tok, reward_funcs=[everything, named])
    _, per_source = sources(
        query_response_ids=ids,
        prompts=prompts,
        completions=COMPLETIONS,
        columns={"label": [0, 1, 0, 1]},
        prompt_width=width,
        completion_lengths=lengths,
        trainer_state=state,
    )
    expected = [[{"role": "assistant", "content": c}] for c in COMPLETIONS] if chat else COMPLETIONS
    assert seen["completions"] == expected and seen["prompts"] == prompts
    assert seen["completion_ids"] == responses  # the stop token included, no padding
    assert seen["state"] is state and seen["label"] == [0, 1, 0, 1]
    assert seen["named"] == (responses, [0, 1, 0, 1])
    torch.testing.assert_close(per_source["named"], torch.tensor([float(len(r)) for r in responses]))
    assert sources.last_log.metrics == {"my_metric": [2.0, 4.0]}
    assert sources.last_log.columns == {"note": ["n0", "n1", "n2", "n3"]}
    assert sources.may_log


def test_completion_ids_without_lengths_cut_the_padding(tok):
    ids, width, _, responses = _batch(tok, PROMPTS, COMPLETIONS)
    batch = RewardBatch(
        prompts=PROMPTS, completions=COMPLETIONS, query_response_ids=ids, pad_token_id=-1, prompt_width=width
    )
    assert [len(row) for row in batch.completion_id_lists()] == [ids.shape[1] - width] * 4
    pad = tok.pad_token_id
    batch = RewardBatch(
        prompts=PROMPTS, completions=COMPLETIONS, query_response_ids=ids, pad_token_id=pad, prompt_width=width
    )
    expected = [r if r[-1] != pad else r[:-1] for r in responses]  # a stop token equal to pad goes too
    assert batch.completion_id_lists() == expected


def test_a_function_that_only_names_completion_ids_is_accepted_and_refused_without_ids():
    def by_ids(prompts, completions, completion_ids):
        return [float(len(x)) for x in completion_ids]

    source = RewardFunctionSource(by_ids)  # before issue #48: refused at the first batch
    batch = RewardBatch(prompts=["a"], completions=["b"])  # no ids
    with pytest.raises(
        ValueError, match=r"requires the argument\(s\) \['completion_ids'\].*no completion ids"
    ):
        source.score(batch)


def test_reserved_argument_names_are_not_columns(tok):
    ids, *_ = _batch(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_funcs=true_reward)
    for name in REWARD_FUNC_ARGS:
        with pytest.raises(ValueError, match=f"columns must not contain '{name}'"):
            sources(query_response_ids=ids, prompts=PROMPTS, completions=COMPLETIONS, columns={name: [0] * 4})


def test_async_functions_run_concurrently(tok):
    """Two async functions that each wait for the other to have started finish only when run together."""
    started: dict[str, asyncio.Event] = {}

    def waiter(me, other):
        async def reward(prompts, completions, **kwargs):
            started.setdefault(me, asyncio.Event()).set()
            event = started.setdefault(other, asyncio.Event())
            await asyncio.wait_for(event.wait(), timeout=10)
            return [1.0 if me == "a" else None] * len(completions)

        reward.__name__ = f"waits_{me}"
        return reward

    class AsyncCallable:
        async def __call__(self, prompts, completions, **kwargs):
            await asyncio.sleep(0)
            return [0.5] * len(completions)

    assert is_async_reward_func(AsyncCallable()) and is_async_reward_func(functools.partial(waiter("x", "y")))
    assert not is_async_reward_func(true_reward)
    ids, *_ = _batch(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(
        policy_tokenizer=tok, reward_funcs=[waiter("a", "b"), true_reward, waiter("b", "a"), AsyncCallable()]
    )
    total, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=COMPLETIONS)
    assert list(per_source) == ["waits_a", "true_reward", "waits_b", "AsyncCallable"]
    assert per_source["waits_a"].tolist() == [1.0] * 4 and per_source["waits_b"].isnan().all()
    expected = 1.0 + torch.tensor(true_reward(PROMPTS, COMPLETIONS)) + 0.5
    torch.testing.assert_close(total, expected)
    # alone (score), an async function runs on the reward functions' event loop
    assert (
        RewardFunctionSource(AsyncCallable())
        .score(RewardBatch(prompts=PROMPTS, completions=COMPLETIONS))
        .tolist()
        == [0.5] * 4
    )


def test_a_failing_async_function_follows_reward_func_errors(tok):
    async def broken(prompts, completions, **kwargs):
        if any(c == "" for c in completions):
            raise KeyError("empty")
        return [1.0] * len(completions)

    ids, *_ = _batch(tok, PROMPTS, COMPLETIONS)
    with pytest.raises(RuntimeError, match=r"'broken' raised KeyError.*at prompt index 2"):
        RewardSources(policy_tokenizer=tok, reward_funcs=broken)(
            query_response_ids=ids, prompts=PROMPTS, completions=COMPLETIONS
        )
    sources = RewardSources(policy_tokenizer=tok, reward_funcs=[broken, true_reward], on_error="skip")
    total, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=COMPLETIONS)
    # the failed call's rows leave the update, whatever the other functions gave them
    assert per_source["broken"].isnan().all() and total.isnan().all() and sources.last_errors == 4


def test_none_is_left_out_of_the_weighted_sum(tok):
    def sometimes(prompts, completions, **kwargs):
        return [None, 2.0, None, 3.0]

    def never_for_the_first(prompts, completions, **kwargs):
        return [None, 1.0, 1.0, None]

    ids, *_ = _batch(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(
        policy_tokenizer=tok, reward_funcs=[sometimes, never_for_the_first], reward_weights=[1.0, 10.0]
    )
    total, _ = sources(query_response_ids=ids, prompts=PROMPTS, completions=COMPLETIONS)
    assert math.isnan(total[0]) and total[1:].tolist() == [12.0, 10.0, 3.0]


def test_reward_log_checks_its_arguments():
    log = RewardLog()
    log.log_metric("a", torch.tensor(1.5))
    with pytest.raises(TypeError, match="one real number"):
        log.log_metric("a", "high")
    with pytest.raises(TypeError, match="one value per completion"):
        log.log_extra("b", "text")
    assert log.metrics == {"a": [1.5]} and not log.columns


# ---- trainers --------------------------------------------------------------------------------------


def test_grpo_quickstart_conversational(kit, tmp_path):
    """TRL's GRPO quickstart (conversational prompts, ``reward_len``) with the import changed."""
    trainer = grpo(kit, tmp_path, reward_len)
    trainer.train()
    rollout = trainer._last_rollout
    assert isinstance(rollout.prompts[0], list) and rollout.prompts[0][0]["role"] == "user"
    expected = torch.tensor([-abs(20 - len(c)) for c in rollout.completions], dtype=torch.float32)
    torch.testing.assert_close(
        rollout.per_source["reward_len"], expected.to(rollout.per_source["reward_len"])
    )
    assert any("objective/scores/reward_len" in h for h in trainer.state.log_history)


def test_grpo_ids_state_async_none_and_logging(kit, tmp_path):
    """In one GRPO run: a function reading ``completion_ids`` and ``trainer_state``, an async one, one
    returning None for some rows, and ``log_metric`` / ``log_extra``."""
    calls = []

    def ids_and_state(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
        calls.append((trainer_state, trainer_state.global_step, completion_ids, completions))
        log_metric("ids/mean_length", sum(len(x) for x in completion_ids) / len(completion_ids))
        log_extra("n_ids", [len(x) for x in completion_ids])
        return [len(x) / 10 for x in completion_ids]

    async def judge(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    def half(prompts, completions, topic, **kwargs):  # `topic`: a dataset column
        assert len(topic) == len(completions) and set(topic) <= {"a", "b"}
        return [None if i % 2 else 0.25 for i in range(len(completions))]

    data = conversational(kit, topic=lambda i: "ab"[i % 2])
    trainer = grpo(kit, tmp_path, [reward_len, ids_and_state, judge, half], train_dataset=data, max_steps=2)
    trainer.train()
    assert len(calls) >= 2
    state, _, completion_ids, completions = calls[-1]
    assert state is trainer.state  # the trainer's own TrainerState, read at each call
    assert [c[1] for c in calls] == [0, 1]  # global_step when each update scored
    rollout = trainer._last_rollout
    response = rollout.response.cpu()
    assert completion_ids == [response[i, : int(n)].tolist() for i, n in enumerate(rollout.lengths)]
    assert completions == [[{"role": "assistant", "content": c}] for c in rollout.completions]
    assert rollout.per_source["judge"].tolist() == [1.0] * len(completions)
    assert rollout.per_source["half"].isnan().any() and not rollout.per_source["half"].isnan().all()
    assert bool(rollout.valid_rows.all())  # None from one function does not invalidate a row
    assert rollout.reward_columns["n_ids"] == [len(x) for x in completion_ids]
    logged = [h for h in trainer.state.log_history if "ids/mean_length" in h]
    assert len(logged) == 2
    assert logged[-1]["ids/mean_length"] == pytest.approx(float(rollout.lengths.float().mean()))


def test_a_row_that_no_function_scored_leaves_the_update(kit, tmp_path):
    def only_even(prompts, completions, **kwargs):
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    async def never(prompts, completions, **kwargs):
        return [None] * len(completions)

    trainer = grpo(kit, tmp_path, [only_even, never])
    trainer.train()
    rollout = trainer._last_rollout
    assert rollout.valid_rows.tolist() == [i % 2 == 0 for i in range(len(rollout.completions))]
    invalid = next(h for h in trainer.state.log_history if "rollout/invalid_rewards" in h)
    assert invalid["rollout/invalid_rewards"] == float((~rollout.valid_rows).sum())


def test_rloo_and_ppo_use_the_same_convention(kit, tmp_path):
    seen = {}

    def reward_len_logged(completions, completion_ids, trainer_state, log_metric, **kwargs):
        seen[type(trainer_state).__name__] = True
        log_metric("len_metric", 1.0)
        return reward_len(completions)

    for cls, config in (
        (
            RLOOTrainer,
            RLOOConfig(
                output_dir=str(tmp_path / "rloo"), per_device_train_batch_size=8, response_length=8, **COMMON
            ),
        ),
        (
            PPOTrainer,
            PPOConfig(
                output_dir=str(tmp_path / "ppo"), per_device_train_batch_size=8, response_length=8, **COMMON
            ),
        ),
    ):
        trainer = cls(
            model=kit.load_model("llama-sft"),
            processing_class=kit.load_tokenizer(),
            reward_funcs=reward_len_logged,
            args=config,
            train_dataset=conversational(kit),
        )
        trainer.train()
        rollout = trainer._last_rollout
        expected = torch.tensor([-abs(20 - len(c)) for c in rollout.completions], dtype=torch.float32)
        torch.testing.assert_close(rollout.per_source["reward_len_logged"].cpu(), expected)
        assert any(h.get("len_metric") == 1.0 for h in trainer.state.log_history), cls.__name__
        metrics = trainer.evaluate(conversational(kit, n=4))
        assert metrics["eval_len_metric"] == 1.0 and "eval_objective/scores/reward_len_logged" in metrics
    assert seen == {"TrainerState": True}


def test_dynamic_sampling_keeps_the_logged_columns_of_the_rows_it_keeps(kit, tmp_path):
    """With DAPO's dynamic sampling (several scoring calls per update), a ``log_extra`` column stays aligned
    with the rollout's rows and every call's ``log_metric`` values are averaged."""

    def constant(completions, log_extra, log_metric, **kwargs):  # no signal: every round is drawn
        log_extra("text", [c[0]["content"] for c in completions])
        log_metric("calls", 1.0)
        return [1.0] * len(completions)

    trainer = grpo(kit, tmp_path, constant, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    trainer.train()
    rollout = trainer._last_rollout
    assert rollout.reward_columns["text"] == rollout.completions
    assert rollout.reward_metrics == {"calls": [1.0, 1.0, 1.0]}
    logged = next(h for h in trainer.state.log_history if "calls" in h)
    assert logged["calls"] == 1.0 and logged["rollout/dynamic_sampling_rounds"] == 3
