"""``environment_factory=`` (TRL 1.16's): one environment per episode, on the offline kit.

The kit's policy never writes a tool call, so the tests that need calls script the first turn of some
rows (test_agent_rollouts.py's ``_script``); the rest of each episode is the policy's.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from resume_checks import assert_resumed_like_uninterrupted, resume_from_each
from test_agent_rollouts import _config, _script, _tokenizer

from rlhf_trainers import GRPOTrainer, PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.agents.environment_producer import RESET_FAILURES, EnvironmentProducer

INCREMENT = '<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call>'


class CounterEnv:
    """A counter the policy increments; it scores itself by its count."""

    def reset(self, **kwargs):
        self.counter = 0
        self.reset_kwargs = kwargs
        return None

    def get_reward(self) -> float:
        return float(self.counter)

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: How much to add.
        """
        self.counter += step
        return self.counter


class ObservingEnv(CounterEnv):
    """Returns the row's target from reset(), appended to the prompt."""

    def reset(self, target=None, **kwargs):
        super().reset(target=target, **kwargs)
        return f" Reach {target}."


class FlakyEnv(CounterEnv):
    """reset() raises for the rows whose target is 3."""

    def reset(self, target=None, **kwargs):
        if target == 3:
            raise ConnectionError("sandbox unreachable")
        return super().reset(target=target, **kwargs)


class EchoEnv:
    """A second kind of environment, without get_reward."""

    def reset(self, **kwargs):
        self.reset_kwargs = kwargs

    def shout(self, text: str) -> str:
        """Shout.

        Args:
            text: What to shout.
        """
        return text.upper()


def _dataset(kit, n=16, **columns):
    dataset = kit.prompt_dataset("train", n=n, chat=True)
    dataset = dataset.add_column("target", [1 + i % 4 for i in range(n)])
    for name, values in columns.items():
        dataset = dataset.add_column(name, values)
    return dataset


def _trainer(
    kit, tmp_path, factory=CounterEnv, reward_funcs=None, dataset=None, cls=GRPOTrainer, **overrides
):
    if cls is GRPOTrainer:
        args = _config(tmp_path, **{"max_prompt_length": 64, **overrides})
    else:
        config = PPOConfig if cls is PPOTrainer else RLOOConfig
        fields = dict(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_mini_batches=1, response_length=120,
            max_prompt_length=64, max_steps=1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
            seed=0, num_sample_generations=0, disable_tqdm=True, rollout_logprobs="forward",
            **({"rloo_k": 4} if cls is RLOOTrainer else {"num_generations": 4}),
        )  # fmt: skip
        args = config(**{**fields, **overrides})
    return cls(
        model=kit.load_model("llama-sft"),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset if dataset is not None else _dataset(kit),
        processing_class=_tokenizer(kit),
        environment_factory=factory,
    )


# ---- construction ------------------------------------------------------------------------------------


class NoMethods:
    pass


def _raises():
    raise OSError("no docker daemon")


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (CounterEnv(), r"environment_factory must be a callable .* got CounterEnv"),
        (lambda: 42, r"returned int \(42\), which has no reset\(\) method"),
        (NoMethods, r"returned NoMethods .* which has no reset\(\) method"),
        (_raises, r"environment_factory\(\) raised OSError: no docker daemon"),
        ({}, r"environment_factory is an empty dict"),
        ({"a": CounterEnv, 1: EchoEnv}, r"keys must be the environment names"),
        ({"a": "CounterEnv"}, r"environment_factory\['a'\] must be a callable"),
    ],
)
def test_bad_factories_are_refused_at_construction(kit, tmp_path, factory, message):
    with pytest.raises(ValueError, match=message):
        _trainer(kit, tmp_path, factory=factory)


def test_an_environment_without_get_reward_needs_reward_funcs(kit, tmp_path):
    with pytest.raises(
        ValueError, match=r"No reward: .* environment_factory whose environments define get_reward"
    ):
        _trainer(kit, tmp_path, factory=EchoEnv)
    trainer = _trainer(
        kit, tmp_path, factory=EchoEnv, reward_funcs=lambda completions, **kw: [0.0] * len(completions)
    )
    assert isinstance(trainer.producer, EnvironmentProducer)


def test_a_dict_of_factories_needs_an_environment_column_naming_them(kit, tmp_path):
    factories = {"count": CounterEnv, "echo": EchoEnv}
    with pytest.raises(ValueError, match=r"each row must name its environment in a column 'environment'"):
        _trainer(kit, tmp_path, factory=factories)
    dataset = _dataset(kit, environment=["count", "echo", "chess", "count"] * 4)
    with pytest.raises(ValueError, match=r"\['chess'\] .* expected one of \['count', 'echo'\]"):
        _trainer(kit, tmp_path, factory=factories, dataset=dataset)


# ---- episodes ------------------------------------------------------------------------------------------


def test_each_episode_has_its_own_environment_its_tools_and_its_reward(kit, tmp_path):
    made = []

    def factory():
        made.append(CounterEnv())
        return made[-1]

    seen = []

    def check(completions, environments, target, **kwargs):
        # (the instances are reused by the next step: read them now)
        states = [(e.counter, e.reset_kwargs) for e in environments]
        seen.append((completions, environments, states, target))
        return [None] * len(completions)  # only the environment scores

    trainer = _trainer(
        kit, tmp_path, factory=factory, reward_funcs=check, max_steps=2, max_completion_length=100
    )
    assert len(made) == 1  # the probe, made at construction
    _script(trainer, [INCREMENT, INCREMENT, None, None])
    trainer.train()
    assert len(made) == 8  # one per episode of a batch, reused (reset) by the next step, as TRL's pool
    logged = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(logged) == 2
    for h in logged:
        assert h["tools/call_frequency"] == pytest.approx(0.5)
        assert h["rewards/CounterEnv/mean"] == pytest.approx(1.0)  # 2 for the half that called, 0 else
        assert h["reward"] == pytest.approx(1.0)
        assert h[RESET_FAILURES] == 0.0
    assert len(seen) == 2
    for completions, environments, states, target in seen:
        assert len({id(e) for e in environments}) == len(environments) == 8
        for conversation, (counter, reset_kwargs), row_target in zip(
            completions, states, target, strict=True
        ):
            results = [m["content"] for m in conversation if m.get("role") == "tool"]
            assert counter == (2 if results else 0)
            assert results in ([], ["2"])  # each episode's call ran on its own counter
            # reset(**row): the row's columns, the prompt included (TRL's call)
            assert reset_kwargs["target"] == row_target
            assert reset_kwargs["prompt"][-1]["role"] == "user"


def test_reset_observation_is_appended_to_the_last_message_and_rendered(kit, tmp_path):
    prompts_seen = []

    def reward(prompts, completions, **kwargs):
        prompts_seen.extend(prompts)
        return [0.0] * len(prompts)

    trainer = _trainer(kit, tmp_path, factory=ObservingEnv, reward_funcs=reward)
    batch = trainer.producer.prompt_batch(0)
    rollout = trainer.rollout(batch)
    tokenizer = trainer.processing_class
    environments = trainer.producer.current
    for row in range(rollout.query.shape[0]):
        target = environments[row].reset_kwargs["target"]
        expected = [*batch["prompt"][row % 2][:-1]]
        last = batch["prompt"][row % 2][-1]
        expected.append({**last, "content": last["content"] + f" Reach {target}."})
        assert prompts_seen[row] == expected  # the reward functions get the observed prompt, as TRL's
        ids = tokenizer.apply_chat_template(
            expected, tools=trainer.environments.schemas[None], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        query = rollout.query[row][rollout.query_mask[row]].tolist()
        assert query == ids[-64:]  # rendered as the dataset's prompts are (max_prompt_length from the left)
        assert f"Reach {target}." in tokenizer.decode(query)


def test_a_reset_that_raises_is_recorded_and_the_run_goes_on(kit, tmp_path, caplog):
    trainer = _trainer(kit, tmp_path, factory=FlakyEnv, max_completion_length=100)
    _script(trainer, [INCREMENT])  # every episode calls
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    targets = [
        e.reset_kwargs.get("target") if hasattr(e, "reset_kwargs") else None for e in trainer.producer.current
    ]
    failed = sorted(trainer.producer.failed)
    assert failed, "some rows must have target 3"
    assert not rollout.valid_rows[failed].any()  # no reward: out of the update
    ok = [r for r in range(8) if r not in failed]
    assert rollout.valid_rows[ok].all() and torch.all(rollout.raw_scores[ok] == 2.0)
    assert not (rollout.response_mask & ~rollout.loss_mask)[failed].any()  # no tool ran for them
    assert all(targets[r] != 3 for r in ok)
    trainer.train()  # and a whole step goes through, logging the failures
    (logged,) = [h for h in trainer.state.log_history if RESET_FAILURES in h]
    assert 0.0 < logged[RESET_FAILURES] < 1.0
    assert "FlakyEnv.reset() raised ConnectionError: sandbox unreachable" in caplog.text


def test_a_dict_of_factories_routes_rows_and_offers_each_its_own_tools(kit, tmp_path):
    seen = {}

    def reward(completions, environment, environments, **kwargs):
        seen.update(environment=environment, environments=environments)
        return [0.5] * len(completions)

    dataset = _dataset(kit, environment=["count", "echo"] * 8)
    factories = {"count": CounterEnv, "echo": EchoEnv}
    # room for one environment's tools in a prompt (the kit has 256 positions)
    trainer = _trainer(
        kit, tmp_path, factory=factories, reward_funcs=reward, dataset=dataset, max_prompt_length=236,
        max_completion_length=16,
    )  # fmt: skip
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    tokenizer = trainer.processing_class
    for row, (name, environment) in enumerate(zip(seen["environment"], seen["environments"], strict=True)):
        text = tokenizer.decode(rollout.query[row][rollout.query_mask[row]])
        assert type(environment) is factories[name]
        assert ("increment" in text) == (name == "count") and ("shout" in text) == (name == "echo"), text
        assert "environment" not in environment.reset_kwargs  # TRL's: the routing column is not reset's
    # get_reward scores its own class's rows only; the others get the reward functions' alone
    count = torch.tensor([n == "count" for n in seen["environment"]])
    assert torch.all(rollout.per_source["CounterEnv"][count] == 0.0)
    assert torch.all(rollout.per_source["CounterEnv"][~count].isnan())
    assert torch.all(rollout.raw_scores == 0.5)


def test_get_reward_has_weight_1_next_to_the_weighted_reward_funcs(kit, tmp_path):
    def half(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = _trainer(kit, tmp_path, reward_funcs=[half], reward_weights=[0.5], max_completion_length=100)
    assert trainer.reward_sources.names == ["half", "CounterEnv"]
    assert trainer.reward_sources.weights == [0.5, 1.0]
    _script(trainer, [INCREMENT, None])
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    counts = rollout.per_source["CounterEnv"]
    assert set(counts.tolist()) == {0.0, 2.0}
    torch.testing.assert_close(rollout.raw_scores, 0.5 + counts)


@pytest.mark.parametrize("cls", [PPOTrainer, RLOOTrainer])
def test_ppo_and_rloo_take_environment_factory(kit, tmp_path, cls):
    trainer = _trainer(kit, tmp_path, cls=cls)
    assert isinstance(trainer.producer, EnvironmentProducer)
    _script(trainer, [INCREMENT, None])
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "objective/scores/CounterEnv" in h]
    assert logged["objective/scores/CounterEnv"] == pytest.approx(1.0)
    assert logged["tools/call_frequency"] == pytest.approx(0.5)


# ---- resume --------------------------------------------------------------------------------------------


class DiceEnv:
    """Self-samples its task with Python's random, as TRL's documented environments do; draws an id
    when it is made (as an environment naming its sandbox would)."""

    def __init__(self):
        self.id = random.getrandbits(32)

    def reset(self, **kwargs):
        self.target = random.randint(1, 6)
        return f" Roll {self.target}."

    def get_reward(self) -> float:
        return float(self.target) + random.random()

    def roll(self) -> int:
        """Roll a die."""
        return random.randint(1, 6)


def test_a_resumed_run_re_creates_the_environments_and_continues_exactly(kit, tmp_path):
    """The environments are not saved: they are re-created (the resumed run makes its instances at
    update 2, the uninterrupted one at update 0, and making them draws from ``random``), and what they
    draw from ``random`` during a rollout is seeded from ``seed`` and the update, so the run resumed from
    checkpoint-2 logs what the uninterrupted one logged (the prompts, and so the completions, depend on
    those draws) and ends with its weights."""

    def build(root, callbacks=None):
        random.seed(len(str(root)))  # the process's random state differs between the runs
        trainer = GRPOTrainer(
            model=kit.load_model("llama-sft"),
            args=_config(
                root,
                max_steps=4,
                save_strategy="steps",
                save_steps=2,
                max_completion_length=16,
                max_prompt_length=64,
                learning_rate=1e-2,
            ),
            train_dataset=_dataset(kit),
            processing_class=_tokenizer(kit),
            environment_factory=DiceEnv,
            callbacks=callbacks,
        )
        return trainer

    full, resumed = resume_from_each(build, tmp_path, checkpoints=(2,))
    trainer, counter = resumed[2]
    assert counter.steps == 2
    rewards = [h["rewards/DiceEnv/mean"] for h in full.state.log_history if "rewards/DiceEnv/mean" in h]
    assert len(set(rewards)) == 4 and all(math.isfinite(r) for r in rewards)
    assert_resumed_like_uninterrupted(full, trainer, 2)


def test_without_a_dataset_the_environment_owns_the_prompts(kit, tmp_path):
    """TRL's environment-owned data: no train_dataset, reset() returns the prompt, max_steps the length."""
    prompts = []

    class Seen(DiceEnv):
        def reset(self, **kwargs):
            observation = super().reset(**kwargs)
            prompts.append((kwargs, observation))
            return observation

    with pytest.raises(ValueError, match=r"max_steps sets the length of the run; got max_steps=-1"):
        GRPOTrainer(
            model=kit.load_model("llama-sft"),
            args=_config(tmp_path, max_steps=-1, num_train_epochs=1, max_prompt_length=64),
            processing_class=_tokenizer(kit),
            environment_factory=Seen,
        )
    with pytest.raises(ValueError, match=r"dict environment_factory .* needs a train_dataset"):
        GRPOTrainer(
            model=kit.load_model("llama-sft"),
            args=_config(tmp_path, max_steps=2, max_prompt_length=64),
            processing_class=_tokenizer(kit),
            environment_factory={"a": CounterEnv},
        )
    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        args=_config(tmp_path, max_steps=2, max_prompt_length=64),
        processing_class=_tokenizer(kit),
        environment_factory=Seen,
    )
    trainer.train()
    assert trainer.state.global_step == 2 and len(prompts) == 16
    assert all(kwargs == {"prompt": [{"role": "user", "content": ""}]} for kwargs, _ in prompts)
    rollout = trainer._last_rollout
    texts = [
        trainer.processing_class.decode(q[m]) for q, m in zip(rollout.query, rollout.query_mask, strict=True)
    ]
    assert [t.count("Roll ") for t in texts] == [1] * 8  # the prompt is what reset() returned
    assert {p[-1]["content"] for p in rollout.prompts} == {o for _, o in prompts[8:]}


def test_evaluation_runs_episodes_and_draws_the_same_on_the_same_prompts(kit, tmp_path):
    """evaluate() resets environments like training, and (its sampling forked from the seed) two
    evaluations of the same weights give the same metrics: the environments' draws depend on the prompts."""
    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        args=_config(tmp_path, max_prompt_length=64, max_completion_length=16, per_device_eval_batch_size=4),
        train_dataset=_dataset(kit),
        eval_dataset=kit.prompt_dataset("test", n=8, chat=True),
        processing_class=_tokenizer(kit),
        environment_factory=DiceEnv,
    )
    random.seed(1)
    first = trainer.evaluate()
    random.seed(2)
    second = trainer.evaluate()
    assert 1.0 <= first["eval_rewards/DiceEnv/mean"] <= 7.0
    assert first["eval_rewards/DiceEnv/std"] > 0
    for key, value in first.items():
        if "runtime" not in key and "per_second" not in key:
            assert second[key] == pytest.approx(value), key
