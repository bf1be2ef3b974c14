"""PPOTrainer and the on-policy engine on the offline kit's synthetic task (single process).

The task: complete a short prompt; the hidden true reward (:func:`rlhf_trainers.testing.true_reward`)
is the sentiment balance of the completion, in [-1, 1]. The kit's ``llama-sft`` policy starts near 0.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    TrainerCallback,
)

from rlhf_trainers import PPOConfig, PPOTrainer, RewardConfig, TFStyleAdam
from rlhf_trainers import functional as F
from rlhf_trainers.onpolicy.checkpoint import ONPOLICY_STATE_FILE, VALUE_MODEL_DIR
from rlhf_trainers.testing import true_reward

# Settings under which the tiny policy learns the task within a few dozen updates.
LEARN = {
    "learning_rate": 2e-3,
    "per_device_train_batch_size": 16,
    "num_mini_batches": 2,
    "num_ppo_epochs": 2,
    "response_length": 12,
    "temperature": 1.0,
    "kl_coef": 0.05,
}


def _config(tmp_path, **overrides) -> PPOConfig:
    fields = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "num_mini_batches": 1,
        "num_ppo_epochs": 1,
        "response_length": 8,
        "temperature": 1.0,
        "learning_rate": 1e-3,
        "max_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "num_sample_generations": 0,
        "disable_tqdm": True,
    }
    fields.update(overrides)
    return PPOConfig(**fields)


def _trainer(kit, tmp_path, *, train_n=64, eval_n=None, model="llama-sft", **kwargs) -> PPOTrainer:
    trainer_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _TRAINER_ARGS}
    trainer_kwargs.setdefault("reward_funcs", None if "reward_model" in trainer_kwargs else true_reward)
    return PPOTrainer(
        model=kit.load_model(model) if isinstance(model, str) else model,
        processing_class=kit.load_tokenizer(),
        args=_config(tmp_path, **kwargs),
        train_dataset=kit.prompt_dataset("train", n=train_n),
        eval_dataset=kit.prompt_dataset("test", n=eval_n) if eval_n else None,
        **trainer_kwargs,
    )


_TRAINER_ARGS = {
    "reward_funcs",
    "reward_model",
    "ref_model",
    "value_model",
    "peft_config",
    "reward_processing_class",
    "callbacks",
}


def _digest(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()]).clone()


class StopAt(TrainerCallback):
    """Stop training after update ``step`` (an interruption that leaves the checkpoint of that step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


# ---- learning -------------------------------------------------------------------------------------


def test_learns_the_hidden_reward_with_a_reward_function(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, train_n=512, eval_n=128, max_steps=30, **LEARN)
    before = trainer.evaluate()["eval_objective/scores"]
    trainer.train()
    after = trainer.evaluate()["eval_objective/scores"]
    assert after - before >= 0.3, (before, after)
    logged = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert logged[-1]["objective/scores"] > logged[0]["objective/scores"]


@pytest.mark.slow
def test_learns_the_hidden_reward_with_a_trained_reward_model(kit, tmp_path, reward_model_dir):
    # The reward model drives training (weight 1); the hidden rule is logged beside it with weight 0.
    trainer = _trainer(
        kit,
        tmp_path,
        train_n=512,
        eval_n=128,
        max_steps=40,
        reward_model=str(reward_model_dir),
        reward_funcs=true_reward,
        reward_weights=[1.0, 0.0],
        **LEARN,
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    gain = after["eval_objective/scores/true_reward"] - before["eval_objective/scores/true_reward"]
    assert gain >= 0.3, (before, after)
    assert after["eval_objective/scores/reward_model"] > before["eval_objective/scores/reward_model"]


# ---- resume ---------------------------------------------------------------------------------------


def test_resumed_run_logs_the_same_metrics_as_an_uninterrupted_one(kit, tmp_path):
    settings = {
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1,
        "num_mini_batches": 2,
        "num_ppo_epochs": 2,
        "adaptive_kl": True,  # the controller's state must come back too
        "kl_target": 0.5,
        "kl_horizon": 100,
        "seed": 3,
    }
    full = _trainer(kit, tmp_path / "full", **settings)
    full.train()
    interrupted = _trainer(kit, tmp_path / "resumed", callbacks=[StopAt(2)], **settings)
    interrupted.train()
    assert interrupted.state.global_step == 2
    checkpoint = tmp_path / "resumed" / "out" / "checkpoint-2"
    assert (checkpoint / ONPOLICY_STATE_FILE).is_file()
    assert (checkpoint / VALUE_MODEL_DIR / "model.safetensors").is_file()
    resumed = _trainer(kit, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=True)

    def update(trainer, step):
        return next(h for h in trainer.state.log_history if h.get("step") == step and "objective/kl" in h)

    for step in (3, 4):
        a, b = update(full, step), update(resumed, step)
        for key in (
            "objective/scores",
            "objective/kl",
            "loss/policy_avg",
            "loss/value_avg",
            "objective/kl_coef",
            "lr",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (step, key, a[key], b[key])
    assert torch.equal(_digest(full.policy), _digest(resumed.policy))
    assert torch.equal(_digest(full.value_model), _digest(resumed.value_model))


# ---- models ---------------------------------------------------------------------------------------


def test_peft_reference_is_the_adapter_disabled_policy_with_one_base_copy(kit, tmp_path):
    from peft import LoraConfig

    trainer = _trainer(
        kit,
        tmp_path,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        learning_rate=1e-2,
        max_steps=3,
    )
    assert trainer.ref_model is None
    causal_lms = [
        m
        for root in (trainer.model, trainer.reward_model)
        if root is not None
        for m in root.modules()
        if type(m).__name__.endswith("ForCausalLM")
    ]
    assert len(causal_lms) == 1, "the reference must not be a second copy of the base model"
    base_before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if "lora_" in n}
    trainer.train()
    params = dict(trainer.policy.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in base_before.items()), "base weights must stay frozen"
    assert any(not torch.equal(params[n], p) for n, p in lora_before.items()), "the adapter must train"
    # Reference log-probs are the untouched base model's.
    fresh = kit.load_model("llama-sft")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    mask = torch.ones_like(ids)
    pos = F.position_ids_from_mask(mask)
    response = ids[:, 3:]
    ref = trainer.passes.reference_logprobs(ids, mask, pos, response)
    expected = F.logprobs_from_logits(fresh(input_ids=ids).logits[:, 2:-1], response, 1.0)
    assert torch.allclose(ref, expected, atol=1e-5)
    # save_model writes the adapter folder.
    trainer.save_model()
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_value_model_starts_from_the_policy_with_a_zero_head(kit, tmp_path):
    trainer = _trainer(kit, tmp_path)
    value = trainer.value_model
    assert torch.count_nonzero(value.score.weight) == 0
    policy = kit.load_model("llama-sft")
    assert torch.equal(value.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert value.model.embed_tokens.weight.data_ptr() != trainer.policy.model.embed_tokens.weight.data_ptr()


def test_value_model_from_the_reward_model(kit, tmp_path):
    rm = kit.load_model("llama-seqcls")
    trainer = _trainer(kit, tmp_path, reward_model=rm, value_model_init="reward_model")
    assert torch.equal(_digest(trainer.value_model), _digest(rm))
    assert trainer.value_model is not trainer.reward_model
    with pytest.raises(ValueError, match="value_model_init='reward_model' needs a reward_model"):
        _trainer(kit, tmp_path, value_model_init="reward_model")


def test_a_value_model_from_a_normalized_reward_model_starts_in_normalized_units(kit, tmp_path):
    """LHPD's value head starts from the reward model's normalized output: the values of a value model
    copied from a reward model with gain g and bias b are g * raw + b, like the rewards PPO optimises."""
    from rlhf_trainers.models import set_reward_normalization
    from rlhf_trainers.onpolicy.forward import token_values

    rm = kit.load_model("llama-seqcls")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.ones_like(ids)
    positions = torch.arange(5)[None, :]
    with torch.no_grad():
        raw = token_values(rm, ids, mask, positions)
    set_reward_normalization(rm, 0.25, -1.5)
    trainer = _trainer(kit, tmp_path, reward_model=rm, value_model_init="reward_model")
    with torch.no_grad():
        values = token_values(trainer.value_model, ids, mask, positions)
        reward_scores = trainer.reward_sources(
            query_response_ids=ids,
            prompts=["x"],
            completions=["y"],
            columns={},
            reward_model_forward=trainer.passes.reward_forward,
        )[0]
    torch.testing.assert_close(values, raw * 0.25 - 1.5)
    # The last token's value is the reward model's (normalized) score of the sequence.
    torch.testing.assert_close(values[0, -1], reward_scores[0].to(values.dtype), atol=1e-5, rtol=1e-5)


def test_reward_model_with_a_different_tokenizer(kit, tmp_path):
    trainer = _trainer(
        kit,
        tmp_path,
        reward_model=kit.load_model("gpt2-alt-seqcls"),
        reward_processing_class=kit.load_tokenizer("alt"),
        max_steps=1,
        logging_steps=1,
    )
    assert not trainer.reward_sources.same_tokenizer
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "objective/scores" in h)
    assert math.isfinite(logged["objective/scores"])
    rollout = trainer._last_rollout
    from rlhf_trainers.rewards import join_prompt_completion, score_texts

    alt = kit.load_tokenizer("alt")
    texts = [
        join_prompt_completion(p, c, alt) for p, c in zip(rollout.prompts, rollout.completions, strict=True)
    ]
    expected = score_texts(trainer.reward_model, alt, texts, add_eos=True)
    assert torch.allclose(rollout.raw_scores.cpu(), expected, atol=1e-5)


def test_several_reward_functions_are_weighted(kit, tmp_path):
    def length_bonus(prompts, completions, **kwargs):
        return [0.1 * len(c.split()) for c in completions]

    trainer = _trainer(kit, tmp_path, reward_funcs=[true_reward, length_bonus], reward_weights=[2.0, -1.0])
    trainer.train()
    r = trainer._last_rollout
    expected = 2.0 * r.per_source["true_reward"] - 1.0 * r.per_source["length_bonus"]
    assert torch.allclose(r.raw_scores.cpu(), expected, atol=1e-6)


def test_dataset_columns_reach_reward_functions(kit, tmp_path):
    seen = []

    def uses_column(prompts, completions, topic):
        seen.extend(topic)
        return [0.0] * len(completions)

    ds = kit.prompt_dataset("train", n=32)
    ds = ds.add_column("topic", [f"t{i}" for i in range(len(ds))])
    trainer = PPOTrainer(
        model=kit.load_model("llama-sft"),
        processing_class=kit.load_tokenizer(),
        reward_funcs=uses_column,
        args=_config(tmp_path, max_steps=1),
        train_dataset=ds,
    )
    trainer.train()
    assert len(seen) == 8 and all(t.startswith("t") for t in seen)


# ---- prompts --------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["chat", "input_ids"])
def test_chat_and_tokenized_prompts_train(kit, tmp_path, form):
    tok = kit.load_tokenizer()
    if form == "chat":
        ds = kit.prompt_dataset("train", n=32, chat=True)
    else:
        ds = kit.prompt_dataset("train", n=32).map(lambda r: {"input_ids": tok(r["prompt"])["input_ids"]})
        ds = ds.remove_columns("prompt")
    trainer = PPOTrainer(
        model=kit.load_model("llama-sft"),
        processing_class=tok,
        reward_funcs=true_reward,
        args=_config(tmp_path, max_steps=1),
        train_dataset=ds,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    r = trainer._last_rollout
    if form == "chat":
        assert isinstance(r.prompts[0], list) and r.prompts[0][0]["role"] == "user"


def test_long_prompts_are_truncated_from_the_left_and_counted(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, max_prompt_length=3)
    stats = trainer.preprocessing_stats["train"]
    assert stats.num_truncated > 0
    assert max(len(x) for x in trainer.train_dataset["input_ids"]) == 3


def test_rollout_uses_left_padding_and_position_ids(kit, tmp_path):
    trainer = _trainer(kit, tmp_path)
    batch = trainer.producer.prompt_batch(0)
    r = trainer.rollout(batch)
    q, qm = r.query, r.query_mask
    assert (q[~qm] == trainer.processing_class.pad_token_id).all()
    assert qm[:, -1].all(), "prompts are left-padded: the last query column is real for every row"
    # The rollout log-probs equal an unpadded forward pass row by row.
    policy = trainer.policy
    for i in range(3):
        ids = torch.cat([q[i][qm[i]], r.response[i][: r.lengths[i]]])[None]
        logits = policy(input_ids=ids).logits
        n = int(r.lengths[i])
        expected = F.logprobs_from_logits(logits[:, -n - 1 : -1], ids[:, -n:], trainer.args.temperature)
        assert torch.allclose(r.logprobs[i, :n], expected[0], atol=1e-4)


# ---- options --------------------------------------------------------------------------------------


def test_fixed_length_responses_ignore_eos(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, stop_token=None, response_length=10)
    r = trainer.rollout(trainer.producer.prompt_batch(0))
    assert (r.lengths == 10).all()
    assert r.response_mask.all()
    # Generation did not stop at EOS either: no padding anywhere, and EOS sampled mid-response is kept.
    assert not (r.response == trainer.processing_class.pad_token_id).any()
    eos = _trainer(kit, tmp_path, response_length=10)
    r = eos.rollout(eos.producer.prompt_batch(0))
    assert (r.lengths < 10).any(), "with stop_token='eos' responses end at EOS"
    eos_id = eos.processing_class.eos_token_id
    for row, n in zip(r.response, r.lengths, strict=True):
        if n < 10:
            assert row[n - 1] == eos_id and (row[n:] == eos.processing_class.pad_token_id).all()


def test_stop_token_id_with_truncate_after_and_rejection_penalty(kit, tmp_path):
    tok = kit.load_tokenizer()
    period = tok.convert_tokens_to_ids(tok.tokenize(" .")[-1])
    trainer = _trainer(
        kit, tmp_path, stop_token_id=period, truncate_after=2, rejection_penalty=-1.0, response_length=10
    )
    r = trainer.rollout(trainer.producer.prompt_batch(0))
    for row, n, found in zip(r.response, r.lengths, r.found_stop, strict=True):
        hits = [i for i, t in enumerate(row[:n].tolist()) if t == period and i >= 2]
        if found:
            assert hits and hits[0] == n - 1
        else:
            assert n == 10 and not hits
    assert torch.all(r.scores[~r.found_stop] == -1.0)


def test_score_shaping_order_and_values(kit, tmp_path):
    trainer = _trainer(
        kit,
        tmp_path,
        reward_scaling=[0.0, 1.0, -1.0, 1.0],
        reward_clip=0.8,
        overlong_buffer_length=4,
        overlong_penalty=0.5,
        missing_eos_penalty=1.0,
        response_length=8,
    )
    scores = torch.tensor([0.5, 2.0, -3.0, 0.75, float("nan")])
    lengths = torch.tensor([2, 2, 2, 8, 2])
    found = torch.tensor([True, True, False, True, True])
    shaped, valid = trainer.producer.shape_scores(scores, lengths, found)
    # scale [0,1] -> [-1,1] (clamped), clip to 0.8, overlong ramp, then subtract 1 without a stop token.
    expected = torch.tensor([0.0, 0.8, -0.8 - 1.0, 0.5 - 0.5, 0.0])
    assert torch.allclose(shaped, expected)
    assert valid.tolist() == [True, True, True, True, False]


def test_nan_rewards_are_masked_out_and_counted(kit, tmp_path):
    def sometimes_none(prompts, completions, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    trainer = _trainer(kit, tmp_path, reward_funcs=sometimes_none, max_steps=1, logging_steps=1)
    trainer.train()
    r = trainer._last_rollout
    assert not r.response_mask[~r.valid_rows].any()
    logged = next(h for h in trainer.state.log_history if "rollout/invalid_rewards" in h)
    assert logged["rollout/invalid_rewards"] == 4
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimator(kit, tmp_path, estimator):
    trainer = _trainer(kit, tmp_path, kl_estimator=estimator)
    r = trainer.rollout(trainer.producer.prompt_batch(0))
    expected = F.kl_penalty(r.logprobs, r.ref_logprobs, estimator) * r.response_mask
    assert torch.allclose(r.kl, expected)
    rewards = trainer.token_rewards(r)
    last = r.lengths - 1
    non_score = -trainer.args.kl_coef * r.kl
    non_score[torch.arange(len(last)), last] += r.scores
    assert torch.allclose(rewards, non_score, atol=1e-6)


def test_adaptive_kl_coefficient_moves_towards_the_target(kit, tmp_path):
    trainer = _trainer(
        kit, tmp_path, adaptive_kl=True, kl_coef=0.1, kl_target=100.0, kl_horizon=10, max_steps=2
    )
    trainer.train()
    assert trainer.kl_ctl.value < 0.1  # KL far below the target: the coefficient shrinks
    fixed = _trainer(kit, tmp_path, kl_coef=0.1, max_steps=2)
    fixed.train()
    assert fixed.kl_ctl.value == 0.1


def test_reward_whitening_keeps_the_mean(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, whiten_rewards=True, per_device_train_batch_size=16)
    r = trainer.rollout(trainer.producer.prompt_batch(0))
    trainer.args.whiten_rewards = False
    raw = trainer.token_rewards(r)
    trainer.args.whiten_rewards = True
    white = trainer.token_rewards(r)
    mask = r.response_mask
    assert F.masked_mean(white, mask) == pytest.approx(float(F.masked_mean(raw, mask)), abs=1e-5)
    assert F.masked_var(white, mask) == pytest.approx(1.0, abs=1e-3)


def test_gae_options_reach_the_advantages(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, lam_value=1.0, whiten_advantages=False)
    r = trainer.rollout(trainer.producer.prompt_batch(0))
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    mask = r.response_mask
    # lam_value = gamma = 1: the returns are the reward-to-go (Monte-Carlo), whatever the values.
    to_go = (adv.rewards * mask).flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(adv.returns, to_go, atol=1e-5)
    assert abs(float(F.masked_mean(adv.advantages, mask))) > 1e-3  # not whitened
    trainer.args.whiten_advantages = True
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    assert float(F.masked_mean(adv.advantages, mask)) == pytest.approx(0.0, abs=1e-5)
    trainer.args.length_adaptive_alpha = 0.05
    trainer.args.whiten_advantages = False
    adv_before = adv.advantages.clone()
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    assert not torch.allclose(adv_before, adv.advantages)


def test_clip_options_change_the_loss(kit, tmp_path):
    trainer = _trainer(kit, tmp_path)
    r = trainer.rollout(trainer.producer.prompt_batch(0))
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    idx = torch.arange(8)
    # A policy far from the rollout one: ratio e > 1.5 at every token, so that cliprange_high acts on each
    # token of positive advantage and the dual clip (1.5) on each of negative advantage, whatever the
    # sampled tokens (whitened advantages have both signs).
    real = r.response_mask[idx].bool()
    assert (adv.advantages[idx][real] > 0).any() and (adv.advantages[idx][real] < 0).any()
    logprobs = r.logprobs + 1.0
    values = r.values + 1.0
    base, m = trainer.compute_policy_loss(r, adv, idx, logprobs, values)
    trainer.args.cliprange_high = 0.5
    high, _ = trainer.compute_policy_loss(r, adv, idx, logprobs, values)
    trainer.args.cliprange_high = None
    trainer.args.dual_clip = 1.5
    dual, md = trainer.compute_policy_loss(r, adv, idx, logprobs, values)
    trainer.args.dual_clip = None
    trainer.args.cliprange_value = None
    unclipped_v, _ = trainer.compute_policy_loss(r, adv, idx, logprobs, values)
    assert not torch.isclose(base, high) and not torch.isclose(base, dual)
    assert float(md["policy/dual_clipfrac_avg"]) > 0
    assert not torch.isclose(base, unclipped_v)
    assert float(m["val/clipfrac_avg"]) > 0


def test_critic_warmup_trains_only_the_value_model(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, critic_warmup_steps=1, max_steps=1)
    policy_before, value_before = _digest(trainer.policy), _digest(trainer.value_model)
    trainer.train()
    assert torch.equal(_digest(trainer.policy), policy_before)
    assert not torch.equal(_digest(trainer.value_model), value_before)


def test_critic_learning_rate_and_tf_style_adam(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, critic_learning_rate=5e-4, tf_style_adam=True, max_steps=1)
    trainer.train()
    assert isinstance(
        trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer,
        TFStyleAdam,
    )
    value_ids = {id(p) for p in trainer.value_model.parameters()}
    lrs = {
        ("value" if id(g["params"][0]) in value_ids else "policy"): g["initial_lr"]
        for g in trainer.optimizer.param_groups
    }
    assert lrs == {"value": 5e-4, "policy": 1e-3}


def test_learning_rate_anneals_to_zero_over_updates(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, max_steps=3, logging_steps=1)
    trainer.train()
    lrs = [h["lr"] for h in trainer.state.log_history if "lr" in h]
    assert lrs == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3])
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)


def test_gradient_accumulation_matches_one_big_micro_batch(kit, tmp_path):
    def run(sub, **kw):
        # seq-mean: the mean over a micro-batch's sequences / GA is the mean over the mini-batch's.
        t = _trainer(
            kit, tmp_path / sub, max_steps=1, logging_steps=1, loss_agg_mode="seq-mean-token-mean", **kw
        )
        t.train()
        return _digest(t.policy)

    one = run("a", per_device_train_batch_size=8, gradient_accumulation_steps=1)
    two = run("b", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    # Summation order differs between the two, and AdamW's first step, g / (sqrt(g^2) + eps), turns the
    # float32 rounding of a gradient near eps into up to lr * rounding / eps (1.1e-5 seen on an AVX-512
    # CPU). A wrong accumulation (a micro-batch lost or counted twice) moves weights by ~lr = 1e-3.
    assert torch.allclose(one, two, atol=1e-4)


def test_gradient_checkpointing_gives_the_same_update(kit, tmp_path):
    def run(sub, **kw):
        t = _trainer(kit, tmp_path / sub, max_steps=1, **kw)
        t.train()
        return _digest(t.policy)

    assert torch.allclose(run("a"), run("b", gradient_checkpointing=True), atol=1e-5)


@pytest.mark.parametrize(
    "split",
    [
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_mini_batches": 2},
        {"per_device_train_batch_size": 8, "num_mini_batches": 1},
        {"per_device_train_batch_size": 8, "num_mini_batches": 2, "max_tokens_per_microbatch": 40},
        {
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "num_mini_batches": 2,
            "gradient_checkpointing": True,
            "lora": True,
        },
    ],
    ids=["accumulated", "one-micro-batch", "token-budget", "lora-checkpointed"],
)
def test_rollout_values_from_the_first_training_pass_give_the_same_update(kit, tmp_path, monkeypatch, split):
    """rollout_values='auto' takes the values of step 7's first micro-batch from its training forward pass
    (before any optimizer step) and runs the no-grad value pass over the other rows only: the rollout's
    values, the advantages and the weights after two updates (2 epochs) are those of a separate value pass
    over every row (fp32, within 1e-5), and the no-grad pass sees one micro-batch fewer rows. Also with a
    LoRA policy under gradient checkpointing (the kept forward pass's graph recomputes in step 7)."""
    from rlhf_trainers.onpolicy import passes as rollout_steps

    split = dict(split)
    if split.pop("lora", False):
        from peft import LoraConfig

        split["peft_config"] = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )

    value_rows: list[int] = []
    original = rollout_steps.response_values

    def counting(model, input_ids, *args, **kwargs):
        value_rows.append(input_ids.shape[0])  # (B, T) padded ids, packed or not
        return original(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(rollout_steps, "response_values", counting)

    starts: dict[str, torch.Tensor] = {}

    def run(sub, mode):
        value_rows.clear()
        trainer = _trainer(
            kit, tmp_path / sub, max_steps=1, num_ppo_epochs=2, rollout_values=mode, stop_token="eos", **split
        )
        assert trainer.loop.values_from_training_pass == (mode == "auto")
        with torch.no_grad():  # values far from 0 from the start (the head starts at zero otherwise)
            trainer.value_model.score.weight.copy_(
                torch.randn(
                    trainer.value_model.score.weight.shape, generator=torch.Generator().manual_seed(1)
                )
            )
        starts.update(policy=_digest(trainer.policy), value_model=_digest(trainer.value_model))
        trainer.train()
        rows = sum(value_rows)
        return trainer, rows

    auto, auto_rows = run("auto", "auto")
    forward, forward_rows = run("forward", "forward")
    mask = forward._last_rollout.response_mask
    assert torch.equal(mask, auto._last_rollout.response_mask)  # the same samples
    assert torch.allclose(auto._last_rollout.values[mask], forward._last_rollout.values[mask], atol=1e-5)
    assert torch.allclose(auto._last_advantages.advantages, forward._last_advantages.advantages, atol=1e-4)
    for name in ("policy", "value_model"):
        moved = (_digest(getattr(forward, name)) - starts[name]).norm()
        apart = (_digest(getattr(auto, name)) - _digest(getattr(forward, name))).norm()
        # rounding only: the no-grad pass and the training pass batch the rows differently (values ~1e-6
        # apart), which Adam's steps carry into the weights (a 1e-6 noise on the values: ~3e-5 x moved)
        assert apart < 1e-3 * moved
    rows_per_update = forward.args.local_batch_size
    assert forward_rows == rows_per_update  # every row
    if "max_tokens_per_microbatch" in split:
        assert 0 < auto_rows < forward_rows
    else:  # the first micro-batch (per_device_train_batch_size rows) has no no-grad pass
        assert auto_rows == rows_per_update - split["per_device_train_batch_size"]


def test_rollout_values_fall_back_to_a_separate_pass_where_the_training_pass_differs(kit, tmp_path):
    assert not _trainer(
        kit, tmp_path / "a", model="gpt2", disable_dropout=False
    ).loop.values_from_training_pass
    assert not _trainer(kit, tmp_path / "b", rollout_values="forward").loop.values_from_training_pass
    with pytest.raises(ValueError, match="rollout_values='first'"):
        _config(tmp_path, rollout_values="first")


def test_dropout_is_disabled_and_ratio_starts_at_one(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, model="gpt2", max_steps=1, logging_steps=1)  # kit GPT-2 has dropout
    assert all(m.p == 0 for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout))
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "policy/ratio_at_start" in h)
    assert logged["policy/ratio_at_start"] < 1e-4


def test_bf16_on_cpu_keeps_the_ratio_at_one_and_trains(kit, tmp_path):
    """bf16 autocast on CPU: the rollout's recomputed log-probs and the training pass run the same bf16
    arithmetic (packed attention in float32 in both, the fused head's products in bf16 in both), so the
    ratio at the first mini-batch is exactly 1; the update is finite and moves the weights."""
    trainer = _trainer(kit, tmp_path, bf16=True, max_steps=2, logging_steps=1, num_mini_batches=2)
    before = _digest(trainer.policy)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "policy/ratio_at_start" in h]
    assert len(logged) == 2 and all(h["policy/ratio_at_start"] == 0 for h in logged)
    assert all(math.isfinite(h["loss/policy_avg"]) for h in logged)
    after = _digest(trainer.policy)
    assert after.dtype == torch.float32 and not torch.equal(before, after)


def test_ratio_guard_warns_when_rollout_and_training_disagree(kit, tmp_path, caplog):
    trainer = _trainer(kit, tmp_path, model="gpt2", disable_dropout=False, max_steps=1, logging_steps=1)
    with caplog.at_level("WARNING"):
        trainer.train()
    logged = next(h for h in trainer.state.log_history if "policy/ratio_at_start" in h)
    assert logged["policy/ratio_at_start"] > 1e-3
    assert "ratio at the first mini-batch deviates" in caplog.text


# ---- Trainer integration --------------------------------------------------------------------------


def test_save_model_writes_a_loadable_policy_and_value_model(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, max_steps=1)
    trainer.train()
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    policy = AutoModelForCausalLM.from_pretrained(out)
    value = AutoModelForSequenceClassification.from_pretrained(out / VALUE_MODEL_DIR)
    assert torch.equal(_digest(policy), _digest(trainer.policy))
    assert torch.equal(_digest(value), _digest(trainer.value_model))


def test_checkpoints_rotate_and_samples_are_written(kit, tmp_path):
    trainer = _trainer(
        kit,
        tmp_path,
        max_steps=4,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=2,
        num_sample_generations=2,
    )
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / "samples.jsonl").write_text('{"update": 99, "from": "an earlier run in this folder"}\n')
    output = trainer.train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["update"] for r in rows}) == [1, 3]  # num_sample_generations=2 tables, a fresh file
    assert all({"prompt", "completion", "score"} <= set(r) for r in rows)
    losses = [h["loss/policy_avg"] for h in trainer.state.log_history if "loss/policy_avg" in h]
    assert output.training_loss == pytest.approx(sum(losses) / len(losses))


def test_eval_on_start_evaluates_before_the_first_update(kit, tmp_path):
    trainer = _trainer(
        kit, tmp_path, max_steps=1, eval_n=8, eval_on_start=True, eval_strategy="steps", eval_steps=5
    )
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_objective/scores" in h]
    assert [h["step"] for h in evals] == [0, 1]  # before the first update, and Trainer's at the last step


def test_epoch_strategies_act_at_the_end_of_each_pass_over_the_prompts(kit, tmp_path):
    class EpochEvents(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.events.append(("begin", state.global_step))

        def on_epoch_end(self, args, state, control, **kwargs):
            self.events.append(("end", state.global_step))

    events = EpochEvents()
    # 16 prompts, 8 per update: a pass is 2 updates; 5 updates end within the third pass.
    trainer = _trainer(
        kit,
        tmp_path,
        train_n=16,
        max_steps=5,
        eval_n=8,
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_strategy="epoch",
        callbacks=[events],
    )
    assert trainer.updates_per_data_epoch == 2
    trainer.train()
    assert events.events == [("begin", 0), ("end", 2), ("begin", 2), ("end", 4), ("begin", 4), ("end", 5)]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
    evals = [h for h in trainer.state.log_history if "eval_objective/scores" in h]
    assert [(h["step"], h["epoch"]) for h in evals] == [(2, 1.0), (4, 2.0), (5, 2.5)]
    logs = [h["step"] for h in trainer.state.log_history if "objective/kl" in h]
    assert logs == [2, 4, 5]


def test_evaluation_does_not_change_the_training_run(kit, tmp_path):
    plain = _trainer(kit, tmp_path / "a", max_steps=3, logging_steps=1, eval_n=16)
    plain.train()
    evaluated = _trainer(
        kit, tmp_path / "b", max_steps=3, logging_steps=1, eval_n=16, eval_strategy="steps", eval_steps=1
    )
    evaluated.train()
    assert torch.equal(_digest(plain.policy), _digest(evaluated.policy))
    evals = [h for h in evaluated.state.log_history if "eval_objective/scores" in h]
    assert len(evals) == 3 and all("eval_objective/scores/true_reward" in h for h in evals)


def test_metrics_have_trl_nemo_and_verl_names(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, max_steps=1, logging_steps=1)
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "objective/kl" in h)
    expected = {
        "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
        "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg",
        "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/ratio_var",
        "val/num_eos_tokens", "lr", "episode", "critic/values_mean", "critic/values_min",
        "critic/values_max", "critic/returns_mean", "critic/explained_var", "timing/generate",
        "timing/ref", "timing/values", "timing/reward", "timing/update", "perf/tokens_per_sec",
        "policy/ratio_at_start",
    }  # fmt: skip
    assert expected <= set(logged), expected - set(logged)
    assert logged["episode"] == 8
    assert logged["critic/values_min"] <= logged["critic/values_mean"] <= logged["critic/values_max"]


def test_batch_accounting_is_printed(kit, tmp_path, capsys):
    trainer = _trainer(
        kit,
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        max_steps=1,
    )
    trainer.train()
    out = capsys.readouterr().out
    assert "16 completions per update" in out and "2 micro-batch(es) of 4" in out and "1 updates" in out


def test_total_episodes_sets_the_number_of_updates(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, max_steps=-1, total_episodes=20)
    assert trainer.num_updates == 3  # ceil(20 / 8)
    trainer = _trainer(kit, tmp_path, max_steps=-1, num_train_epochs=2, train_n=32)
    assert trainer.num_updates == 8


# ---- errors ---------------------------------------------------------------------------------------


def test_errors_at_construction(kit, tmp_path):
    tok = kit.load_tokenizer()
    ds = kit.prompt_dataset("train", n=16)
    model = kit.load_model("llama-sft")
    with pytest.raises(ValueError, match="No reward"):
        PPOTrainer(model=model, processing_class=tok, args=_config(tmp_path), train_dataset=ds)
    with pytest.raises(TypeError, match="args must be a PPOConfig"):
        PPOTrainer(
            model=model,
            processing_class=tok,
            reward_funcs=true_reward,
            args=RewardConfig("x"),
            train_dataset=ds,
        )
    with pytest.raises(ValueError, match="has 16 prompts but one update needs 32"):
        PPOTrainer(
            model=model,
            processing_class=tok,
            reward_funcs=true_reward,
            args=_config(tmp_path, per_device_train_batch_size=16, num_mini_batches=2),
            train_dataset=ds,
        )
    no_pad = kit.load_tokenizer()
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        PPOTrainer(
            model=model,
            processing_class=no_pad,
            reward_funcs=true_reward,
            args=_config(tmp_path),
            train_dataset=ds,
        )
    with pytest.raises(ValueError, match="one label"):
        PPOTrainer(
            model=model,
            processing_class=tok,
            reward_model=kit.load_model("llama"),
            args=_config(tmp_path),
            train_dataset=ds,
        )
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(kit.load_model("llama-sft"), LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="already has a PEFT adapter"):
        PPOTrainer(
            model=peft_model,
            processing_class=tok,
            reward_funcs=true_reward,
            peft_config=LoraConfig(target_modules=["q_proj"]),
            args=_config(tmp_path),
            train_dataset=ds,
        )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cliprange", 1.5, "cliprange=1.5"),
        ("truncate_after", 8, "truncate_after=8 must be < response_length=8"),
        ("reward_scaling", [0.0, 1.0], "expected four numbers"),
        ("kl_estimator", "k9", "kl_estimator='k9'"),
        ("stop_token", "period", "stop_token='period'"),
        ("dual_clip", 0.5, "dual_clip=0.5"),
        ("gamma", 1.5, "gamma=1.5"),
        ("value_model_init", "random", "value_model_init='random'"),
        ("response_length", 0, "response_length=0"),
        ("loss_agg_mode", "sum", "loss_agg_mode='sum'"),
    ],
)
def test_config_validation(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        _config(tmp_path, **{field: value})


def test_both_penalties_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="set one of them"):
        _config(tmp_path, missing_eos_penalty=1.0, rejection_penalty=-1.0)


def test_trimmed_forward_passes_give_the_untrimmed_values_losses_and_gradients(kit, tmp_path, monkeypatch):
    """PPO's rollout and training forward passes skip the all-padding prompt and response columns; the
    values, log-probs, losses and gradients (policy and value model) are those of full-width passes."""
    from rlhf_trainers.onpolicy import forward
    from rlhf_trainers.onpolicy import passes as rollout_steps

    R = 10
    trainer = _trainer(
        kit, tmp_path, stop_token="eos", response_length=R, temperature=0.7, rollout_logprobs="forward"
    )
    eos = trainer.processing_class.eos_token_id

    def generate(query, query_mask, with_logprobs=False):
        g = torch.Generator().manual_seed(int(query.sum()))
        response = torch.randint(10, 40, (query.shape[0], R), generator=g)
        response[torch.arange(query.shape[0]), 1 + torch.arange(query.shape[0]) % 4] = eos
        return response, None

    trainer.sampler.generate = generate
    batch = trainer.producer.prompt_batch(0)
    trimmed = trainer.rollout(batch)
    with monkeypatch.context() as m:
        m.setattr(rollout_steps, "trim_bounds", lambda query_mask, response_mask: (0, response_mask.shape[1]))
        full = trainer.rollout(batch)
    mask = trimmed.response_mask
    assert int(trimmed.lengths.max()) == 5
    for key in ("logprobs", "ref_logprobs", "values"):
        torch.testing.assert_close(getattr(trimmed, key) * mask, getattr(full, key) * mask, atol=2e-5, rtol=0)

    trimmed_adv = trainer.compute_advantages(trimmed, trainer.token_rewards(trimmed))
    qlen = trimmed.query_mask.sum(1)
    idx = torch.nonzero(qlen < qlen.max()).flatten()[:4]
    start, end = forward.trim_bounds(trimmed.query_mask[idx], mask[idx])
    assert start > 0 and end == 5
    model = trainer.model
    results = []
    for bounds in (None, (0, R)):
        model.zero_grad()
        logprobs, values, _ = trainer.loop.training_forward(model, trimmed, idx, bounds)
        assert logprobs.shape == values.shape == (len(idx), R)
        loss, _ = trainer.compute_policy_loss(trimmed, trimmed_adv, idx, logprobs, values)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((values.detach() * mask[idx], loss.detach(), grads))
    (v_t, loss_t, grads_t), (v_f, loss_f, grads_f) = results
    torch.testing.assert_close(v_t, v_f, atol=2e-5, rtol=0)
    torch.testing.assert_close(loss_t, loss_f, atol=1e-6, rtol=1e-5)
    assert len(grads_t) == len(grads_f) > 0
    for a, b in zip(grads_t, grads_f, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_several_completions_per_prompt(kit, tmp_path):
    """num_generations=2: each prompt sampled twice (completion j of prompt i at row j * B + i), each
    completion its own GAE episode; the rollout per process must be a multiple of it."""
    trainer = _trainer(kit, tmp_path, num_generations=2, max_steps=2)
    assert trainer.local_prompts == 4 and trainer.prompts_per_update == 4
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    assert torch.equal(rollout.query[:4], rollout.query[4:])
    assert rollout.response.shape[0] == 8
    trainer.train()
    assert trainer.state.global_step == 2
    with pytest.raises(ValueError, match="multiple of num_generations=3"):
        _trainer(kit, tmp_path, num_generations=3)
    with pytest.raises(ValueError, match="num_generations=0"):
        _config(tmp_path, num_generations=0)
