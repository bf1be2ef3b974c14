"""Advantage estimators and policy losses registered by name (rlhf_trainers.functional.registry): a new one
is one decorated function, selected from the config, with no change to the engine."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainers import GRPOConfig, GRPOTrainer, PPOConfig
from rlhf_trainers import functional as F
from rlhf_trainers.functional import registry
from rlhf_trainers.testing import true_reward


@pytest.fixture
def clean_registry():
    """Whatever a test registers is removed afterwards (the tables are process-wide)."""
    estimators, losses = dict(registry.ADVANTAGE_ESTIMATORS), dict(registry.POLICY_LOSSES)
    yield
    registry.ADVANTAGE_ESTIMATORS.clear()
    registry.ADVANTAGE_ESTIMATORS.update(estimators)
    registry.POLICY_LOSSES.clear()
    registry.POLICY_LOSSES.update(losses)


def test_a_registered_estimator_and_policy_loss_train_grpo(kit, tmp_path, clean_registry):
    """A median baseline and an unclipped REINFORCE-style loss, each one registered function, selected by
    name in GRPOConfig: the update uses exactly them (the loss sees the estimator's advantages), and the
    policy learns the kit's hidden reward."""
    seen: dict[str, list[torch.Tensor]] = {"advantages": [], "loss_advantages": []}

    @F.register_advantage_estimator("median_baseline")
    def median_baseline(inputs: F.AdvantageInputs):
        grouped = inputs.sequence_rewards.reshape(inputs.group_size, -1)
        advantages = (grouped - grouped.median(0).values).reshape(-1, 1)
        advantages = advantages.masked_fill(~inputs.valid[:, None], 0.0)
        seen["advantages"].append(advantages)
        return advantages, None

    @F.register_policy_loss("unclipped")
    def unclipped(logprobs, old_logprobs, advantages, mask, config, **aggregation):
        seen["loss_advantages"].append(advantages)
        # the vanilla loss with a clip range so wide it never clips: -A * ratio, aggregated alike
        return F.clipped_policy_loss(
            logprobs, old_logprobs, advantages, mask, clip_low=0.999, clip_high=1e9, **aggregation
        )

    args = GRPOConfig(
        output_dir=str(tmp_path),
        advantage_estimator="median_baseline",
        policy_loss="unclipped",
        num_generations=4,
        per_device_train_batch_size=16,
        steps_per_generation=2,
        num_iterations=2,
        max_completion_length=12,
        learning_rate=2e-3,
        max_steps=24,
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        num_sample_generations=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=true_reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=256),
        eval_dataset=kit.prompt_dataset("test", n=64),
        processing_class=kit.load_tokenizer(),
    )
    before = trainer.evaluate()["eval_objective/scores"]
    trainer.train()
    after = trainer.evaluate()["eval_objective/scores"]
    assert len(seen["advantages"]) == 6  # one per generation (24 steps / 4 per generation)
    # the loss of every micro-batch read rows of the registered estimator's advantages
    first = seen["advantages"][0].flatten()
    assert any(set(a.flatten().tolist()) <= set(first.tolist()) for a in seen["loss_advantages"][:4])
    assert all(
        h["policy/clipfrac_avg"] == 0.0 for h in trainer.state.log_history if "policy/clipfrac_avg" in h
    )
    assert after - before > 0.2, (before, after)


def test_unknown_names_are_refused_at_construction_with_the_registered_ones(tmp_path):
    with pytest.raises(
        ValueError, match=r"advantage_estimator='median'.*registered: \[.*'grpo'.*register_advantage"
    ):
        GRPOConfig(output_dir=str(tmp_path), advantage_estimator="median", use_cpu=True)
    with pytest.raises(ValueError, match=r"policy_loss='clip_cov'.*registered: \['vanilla'\]"):
        PPOConfig(output_dir=str(tmp_path), policy_loss="clip_cov", use_cpu=True)
    with pytest.raises(ValueError, match="needs a value model"):
        GRPOConfig(output_dir=str(tmp_path), advantage_estimator="gae", use_cpu=True)


def test_a_name_cannot_be_registered_twice(clean_registry):
    with pytest.raises(ValueError, match="'grpo' is already registered"):

        @F.register_advantage_estimator("grpo")
        def other(inputs):  # pragma: no cover - never called
            return inputs.sequence_rewards[:, None], None


def test_the_builtin_estimators_are_the_functional_ones():
    """The registered names compute what the functions of rlhf_trainers.functional compute."""
    torch.manual_seed(0)
    k, B, R = 4, 3, 5
    scores = torch.randn(k * B)
    mask = torch.rand(k * B, R) > 0.2
    token_rewards = torch.randn(k * B, R) * mask
    valid = torch.ones(k * B, dtype=torch.bool)
    config = PPOConfig.__new__(PPOConfig)
    config.scale_rewards, config.gamma, config.lam, config.lam_value, config.length_adaptive_alpha = (
        "group",
        1.0,
        0.95,
        None,
        0.0,
    )
    inputs = F.AdvantageInputs(token_rewards, scores, mask, valid, k, config, values=torch.randn(k * B, R))
    adv, _ = F.get_advantage_estimator("grpo")(inputs)
    torch.testing.assert_close(adv, F.group_advantages(scores, k, "group", valid=valid)[:, None])
    adv, _ = F.get_advantage_estimator("rloo")(inputs)
    torch.testing.assert_close(adv, F.rloo_advantages(scores, k, valid=valid)[:, None])
    adv, returns = F.get_advantage_estimator("gae")(inputs)
    expected = F.gae_advantages(token_rewards, inputs.values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close((adv, returns), expected)
