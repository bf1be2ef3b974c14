"""GRPOTrainer on the offline kit (single process): TRL's interface and batch semantics, the loss types,
advantage scalings and KL placement against reference computations written here, the split invariance
of every aggregation mode (1 x 16 vs 4 x 4 micro-batches; 2 processes x 8 in
tests/test_grpo_distributed.py), learning with a reward function and a reward model, beta=0 without a
reference model, LoRA and resume.

Rows are laid out as in the RLOO blog: completion j of prompt i at row ``j * B + i``.
"""

from __future__ import annotations

import math

import pytest
import torch
from resume_checks import assert_resumed_like_uninterrupted, resume_from_each
from transformers import TrainerCallback

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers import functional as F
from rlhf_trainers.grpo import LOSS_TYPES
from rlhf_trainers.onpolicy.rollout import LossNormalization
from rlhf_trainers.testing import true_reward

LEARN = {
    "learning_rate": 2e-3,
    "per_device_train_batch_size": 16,
    "steps_per_generation": 2,
    "num_iterations": 2,
    "num_generations": 4,
    "max_completion_length": 12,
}


def _config(tmp_path, **overrides) -> GRPOConfig:
    fields = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "learning_rate": 1e-3,
        "max_steps": 2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "num_sample_generations": 0,
        "disable_tqdm": True,
    }
    fields.update(overrides)
    return GRPOConfig(**fields)


def _trainer(kit, tmp_path, *, train_n=64, eval_n=None, model="llama-sft", reward_funcs=None, **kwargs):
    extra = {k: kwargs.pop(k) for k in ("peft_config", "callbacks", "ref_model") if k in kwargs}
    return GRPOTrainer(
        model=kit.load_model(model) if isinstance(model, str) else model,
        reward_funcs=true_reward if reward_funcs is None else reward_funcs,
        args=_config(tmp_path, **kwargs),
        train_dataset=kit.prompt_dataset("train", n=train_n),
        eval_dataset=kit.prompt_dataset("test", n=eval_n) if eval_n else None,
        processing_class=kit.load_tokenizer(),
        **extra,
    )


def _digest(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()]).clone()


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


# ---- advantages: reference computations -----------------------------------------------------------


def test_group_advantages_by_hand():
    # k=2 completions of B=3 prompts: prompt i's completions at rows i and 3 + i.
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 6.0])
    groups = [(1.0, 4.0), (2.0, 0.0), (3.0, 6.0)]
    eps = 1e-4
    expected_group, expected_none = [0.0] * 6, [0.0] * 6
    for i, (a, b) in enumerate(groups):
        mean = (a + b) / 2
        std = math.sqrt(((a - mean) ** 2 + (b - mean) ** 2) / 1)  # unbiased, n - 1 = 1
        expected_group[i], expected_group[3 + i] = (a - mean) / (std + eps), (b - mean) / (std + eps)
        expected_none[i], expected_none[3 + i] = a - mean, b - mean
    batch_mean = sum(rewards.tolist()) / 6
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in rewards.tolist()) / 5)
    expected_batch = [x / (batch_std + eps) for x in expected_none]
    torch.testing.assert_close(F.group_advantages(rewards, 2, "group"), torch.tensor(expected_group))
    torch.testing.assert_close(F.group_advantages(rewards, 2, "none"), torch.tensor(expected_none))
    torch.testing.assert_close(F.group_advantages(rewards, 2, "batch"), torch.tensor(expected_batch))


def test_group_advantages_leave_invalid_completions_out():
    # k=3, B=1; the middle completion has no reward (NaN): the group is the other two.
    rewards = torch.tensor([1.0, math.nan, 3.0])
    valid = torch.tensor([True, False, True])
    out = F.group_advantages(rewards, 3, "group", valid=valid)
    std = math.sqrt(2.0)  # values 1, 3: mean 2, unbiased var 2
    torch.testing.assert_close(out, torch.tensor([-1 / (std + 1e-4), 0.0, 1 / (std + 1e-4)]))
    # a group whose rewards are all equal gets 0 (no signal), not NaN
    assert F.group_advantages(torch.tensor([2.0, 2.0]), 2, "group").tolist() == [0.0, 0.0]


def test_group_advantages_batch_std_is_global_over_processes():
    rewards = torch.tensor([1.0, 2.0, 5.0, 7.0])
    other_rank = torch.tensor([0.0, 3.0, 3.0, 9.0])

    def summed(t):
        # an all-reduce over two processes: this one's (sum, sum of squares, count) plus the other's
        v = other_rank.double()
        theirs = torch.stack([v.sum(), v.square().sum(), torch.tensor(4.0, dtype=torch.float64)])
        return t + theirs.to(t.dtype)

    std = torch.cat([rewards, other_rank]).std()  # unbiased over both processes' 8 rewards
    grouped = rewards.reshape(2, 2)
    centred = (grouped - grouped.mean(0, keepdim=True)).reshape(-1)
    out = F.group_advantages(rewards, 2, "batch", all_reduce=summed)
    torch.testing.assert_close(out, centred / (std + 1e-4))


# ---- loss types: reference computations ------------------------------------------------------------


def _reference_loss(loss_type, logprobs, old, adv, mask, eps_low, eps_high, beta, ref, max_len):
    """TRL's GRPO loss written out per token (the whole batch as one micro-batch)."""
    total, per_seq, n_tokens, n_seqs = 0.0, [], 0, 0
    for i in range(logprobs.shape[0]):
        row = []
        for t in range(logprobs.shape[1]):
            if not mask[i, t]:
                continue
            ratio = math.exp(float(logprobs[i, t] - old[i, t]))
            a = adv[i]
            term = max(-a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high))
            d = float(ref[i, t] - logprobs[i, t])
            term += beta * (math.exp(d) - d - 1)
            row.append(term)
        if row:
            per_seq.append(row)
            n_tokens += len(row)
            n_seqs += 1
            total += sum(row)
    if loss_type == "grpo":
        return sum(sum(r) / len(r) for r in per_seq) / n_seqs
    if loss_type in ("dapo", "bnpo"):
        return total / n_tokens
    assert loss_type == "dr_grpo"
    return total / (n_seqs * max_len)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_types_match_trls_formulas(kit, tmp_path, loss_type, beta):
    trainer = _trainer(kit, tmp_path, loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28)
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    advantages = trainer.compute_advantages(rollout, trainer.token_rewards(rollout))
    N, R = rollout.response.shape
    rows = torch.arange(N)
    torch.manual_seed(1)
    logprobs = rollout.logprobs + 0.3 * torch.randn(N, R)  # ratios away from 1, some clipped
    if beta:
        # a reference that differs from the policy, so the KL term is not 0
        rollout.ref_logprobs = rollout.logprobs + 0.2 * torch.randn(N, R)
    loss, _ = trainer.compute_policy_loss(rollout, advantages, rows, logprobs, None)
    expected = _reference_loss(
        loss_type,
        logprobs.double(),
        rollout.logprobs.double(),
        advantages.advantages[:, 0].double().tolist(),
        rollout.response_mask,
        0.2,
        0.28,
        beta,
        rollout.ref_logprobs.double(),
        8,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_sequence_level_importance_sampling_is_gspo(kit, tmp_path):
    """GSPO: every token of a completion gets the ratio exp(mean over its tokens of the log-ratio)."""
    trainer = _trainer(kit, tmp_path, importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2)
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    advantages = trainer.compute_advantages(rollout, trainer.token_rewards(rollout))
    N, R = rollout.response.shape
    torch.manual_seed(2)
    logprobs = (rollout.logprobs + 0.1 * torch.randn(N, R)).requires_grad_()
    loss, _ = trainer.compute_policy_loss(rollout, advantages, torch.arange(N), logprobs, None)
    mask = rollout.response_mask
    seq_terms = []
    for i in range(N):
        m = mask[i]
        if not m.any():
            continue
        s = torch.exp((logprobs[i][m] - rollout.logprobs[i][m]).mean())
        a = advantages.advantages[i, 0]
        # 'grpo' averages the (equal) per-token terms of a sequence: the sequence's term itself
        seq_terms.append(torch.maximum(-a * s, -a * s.clamp(0.8, 1.2)))
    expected = torch.stack(seq_terms).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    (grad,) = torch.autograd.grad(loss, logprobs)
    (expected_grad,) = torch.autograd.grad(expected, logprobs)
    torch.testing.assert_close(grad, expected_grad)


# ---- split invariance (1 x 16 vs 4 x 4 micro-batches) --------------------------------------------


def _gradients(trainer, rollout, advantages, parts: int, normalization: LossNormalization) -> torch.Tensor:
    wrapper = trainer.model
    wrapper.zero_grad()
    for rows in torch.arange(rollout.response.shape[0]).chunk(parts):
        logprobs, values, _ = trainer.loop.training_forward(wrapper, rollout, rows)
        loss, _ = trainer.compute_policy_loss(rollout, advantages, rows, logprobs, values, normalization)
        loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in wrapper.parameters() if p.grad is not None]).clone()


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_every_loss_type_gives_the_same_gradient_however_the_batch_is_split(kit, tmp_path, loss_type):
    trainer = _trainer(kit, tmp_path, per_device_train_batch_size=16, loss_type=loss_type, beta=0.04)
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    advantages = trainer.compute_advantages(rollout, trainer.token_rewards(rollout))
    assert rollout.response_mask.sum(1).unique().numel() > 1, "responses of different lengths make the test"
    torch.manual_seed(3)
    rollout.ref_logprobs = rollout.logprobs + 0.1 * torch.randn_like(rollout.logprobs)
    whole = LossNormalization.local(rollout.response_mask, trainer.args.response_length)
    one = _gradients(trainer, rollout, advantages, 1, whole)
    four = _gradients(trainer, rollout, advantages, 4, whole)
    torch.testing.assert_close(four, one, rtol=1e-4, atol=1e-7)
    # the engine's own counts for an optimizer step over the whole rollout are those of the rollout
    (normalization,) = trainer.loop.loss_normalizations(rollout, [torch.randperm(16)])[0]
    assert normalization.tokens.item() == whole.tokens.item()
    assert normalization.sequences.item() == whole.sequences.item()


def test_engine_accumulation_gives_the_update_of_one_micro_batch(kit, tmp_path):
    """A whole update (rollout + one SGD step) with 1 x 16 and with 4 x 4 micro-batches: the same step
    (the same gradient, up to float rounding), for TRL's default loss_type 'dapo' whose token counts
    differ between micro-batches. (Plain SGD: Adam's first step is about lr x sign(gradient), which
    rounding flips where a gradient entry is near 0.)"""
    common = {
        "max_steps": 1,
        "num_generations": 4,
        "max_grad_norm": 0.0,
        "tf_style_adam": False,
        "optim": "sgd",
    }
    start = _digest(_trainer(kit, tmp_path / "start").policy)
    one = _trainer(kit, tmp_path / "one", per_device_train_batch_size=16, **common)
    four = _trainer(
        kit, tmp_path / "four", per_device_train_batch_size=4, gradient_accumulation_steps=4, **common
    )
    one.train()
    four.train()
    step_one, step_four = _digest(one.policy) - start, _digest(four.policy) - start
    assert step_one.abs().max() > 1e-6
    torch.testing.assert_close(step_four, step_one, rtol=1e-3, atol=1e-8)


# ---- learning --------------------------------------------------------------------------------------


def test_learns_the_hidden_reward_with_a_reward_function(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, train_n=512, eval_n=128, max_steps=32, logging_steps=4, **LEARN)
    before = trainer.evaluate()["eval_objective/scores"]
    trainer.train()
    after = trainer.evaluate()["eval_objective/scores"]
    assert after - before >= 0.25, (before, after)
    # TRL's unit: a step is an optimizer step, 4 per generation here (2 iterations x 2 steps)
    assert trainer.state.global_step == 32
    steps = [h["step"] for h in trainer.state.log_history if "objective/scores" in h]
    assert steps == list(range(4, 33, 4))


@pytest.mark.slow
def test_learns_the_hidden_reward_with_a_trained_reward_model(kit, tmp_path, reward_model_dir):
    from rlhf_trainers.models import load_reward_model

    reward_model, _ = load_reward_model(reward_model_dir)
    trainer = _trainer(
        kit,
        tmp_path,
        train_n=512,
        eval_n=128,
        max_steps=32,
        logging_steps=4,
        reward_funcs=[reward_model, true_reward],
        reward_weights=[1.0, 0.0],  # the hidden rule is logged beside the reward model with weight 0
        **LEARN,
    )
    before = trainer.evaluate()["eval_objective/scores/true_reward"]
    trainer.train()
    after = trainer.evaluate()["eval_objective/scores/true_reward"]
    assert after - before >= 0.2, (before, after)


def test_beta_zero_builds_and_runs_no_reference_model(kit, tmp_path, monkeypatch):
    trainer = _trainer(kit, tmp_path, beta=0.0)
    assert trainer.ref_model is None and not trainer.args.uses_reference_model

    def never(*args, **kwargs):
        raise AssertionError("the reference model ran with beta=0")

    monkeypatch.setattr(trainer.passes, "reference_logprobs", never)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert logged and "objective/kl" not in logged[0]
    with_kl = _trainer(kit, tmp_path / "kl", beta=0.04)
    assert with_kl.ref_model is not None
    with_kl.train()
    assert any("policy/kl_loss_avg" in h for h in with_kl.state.log_history)


def test_lora_trains_only_the_adapter(kit, tmp_path):
    from peft import LoraConfig

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0)
    trainer = _trainer(kit, tmp_path, peft_config=config, beta=0.04, max_steps=2)
    base = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if "lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if "lora_" in n}
    assert trainer.ref_model is None  # the reference is the adapter-disabled policy
    trainer.train()
    params = dict(trainer.policy.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in base.items())
    assert any(not torch.equal(params[n], v) for n, v in adapters.items())


def test_resumed_run_logs_the_same_metrics_as_an_uninterrupted_one(kit, tmp_path):
    settings = {
        "max_steps": 8,
        "save_strategy": "steps",
        "save_steps": 4,
        "logging_steps": 2,
        "steps_per_generation": 2,
        "num_iterations": 1,
        "beta": 0.04,
        "seed": 3,
    }
    full = _trainer(kit, tmp_path / "full", **settings)
    full.train()
    interrupted = _trainer(kit, tmp_path / "resumed", callbacks=[StopAt(4)], **settings)
    interrupted.train()
    assert interrupted.state.global_step == 4
    resumed = _trainer(kit, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 8

    def logged(trainer, step):
        return next(h for h in trainer.state.log_history if h.get("step") == step and "objective/scores" in h)

    for step in (6, 8):
        a, b = logged(full, step), logged(resumed, step)
        for key in (
            "objective/scores",
            "objective/reward_std",
            "loss/policy_avg",
            "policy/kl_loss_avg",
            "lr",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (step, key)
    assert torch.equal(_digest(full.policy), _digest(resumed.policy))


class SaveAt(TrainerCallback):
    """Save a checkpoint after Trainer step ``step`` too (besides what ``save_strategy`` saves)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
        return control


@pytest.mark.parametrize("length", ["max_steps", "total_episodes"])
def test_resume_at_the_end_of_a_pass_over_the_prompts_and_within_the_next(kit, tmp_path, length):
    """Issue #25: 16 prompts, 4 per generation (16 completions), each generation 2 x 2 optimizer steps
    (steps_per_generation 2, num_iterations 2), so a pass over the prompts is 4 generations = 16 Trainer
    steps and the run 10 generations = 40 steps. save_strategy="epoch" writes checkpoint-16 at the end of
    the first pass; checkpoint-24 (within the second) is asked for by a callback. Each resumed run trains
    the remaining generations and logs what the uninterrupted run logged, ending with its weights."""
    settings = {
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "steps_per_generation": 2,
        "num_iterations": 2,
        "beta": 0.04,
        "save_strategy": "epoch",
        "logging_steps": 4,
        "seed": 5,
        **({"max_steps": 40} if length == "max_steps" else {"max_steps": -1, "total_episodes": 150}),
    }

    def build(root, callbacks=None):  # the uninterrupted run saves at step 24 too
        return _trainer(kit, root, train_n=16, callbacks=callbacks or [SaveAt(24)], **settings)

    full, resumed = resume_from_each(build, tmp_path, checkpoints=(16, 24))
    assert (full.updates_per_data_epoch, full.num_updates, full.state.global_step) == (4, 10, 40)
    for step, (trainer, seen) in resumed.items():
        assert seen.steps == (40 - step) // 4, (step, seen.steps)  # on_step_end once per generation
        assert seen.epochs == [("begin", step), ("end", 32), ("begin", 32), ("end", 40)], seen.epochs
        assert_resumed_like_uninterrupted(full, trainer, step)


# ---- TRL's interface and batch semantics -----------------------------------------------------------


def test_trl_style_code_runs_unchanged_apart_from_the_import(kit, tmp_path):
    def reward_len(completions, **kwargs):
        return [-abs(8 - len(c)) / 8 for c in completions]

    dataset = kit.prompt_dataset("train", n=32)
    training_args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        model=str(kit.model_path("llama-sft")),
        reward_funcs=[reward_len],
        args=training_args,
        train_dataset=dataset,
        processing_class=kit.load_tokenizer(),
    )
    trainer.train()
    assert trainer.state.global_step == 2


def test_trl_batch_semantics(kit, tmp_path, capsys):
    trainer = _trainer(
        kit,
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_iterations=3,
        num_generations=4,
        max_steps=12,
        logging_steps=4,
    )
    args = trainer.args
    # one generation: 4 micro-batches of 4 = 16 completions of 4 prompts; 3 iterations x 2 optimizer steps
    assert (args.num_ppo_epochs, args.num_mini_batches, args.local_batch_size) == (3, 2, 16)
    assert trainer.steps_per_update == 6 and trainer.num_updates == 2
    trainer.train()
    assert trainer.state.global_step == 12
    # logging step 4 falls in the first generation (steps 1-6), 8 and 12 in the second: logged at their ends
    assert [h["step"] for h in trainer.state.log_history if "objective/scores" in h] == [6, 12]
    printed = capsys.readouterr().out
    assert "generation_batch_size 16 completions = 4 prompts x num_generations 4" in printed
    assert "= 6 optimizer step(s) per generation; 12 optimizer steps (2 generations" in printed
    assert GRPOConfig(**{**_fields(tmp_path), "generation_batch_size": 32}).steps_per_generation == 4


def _fields(tmp_path) -> dict:
    return {
        "output_dir": str(tmp_path / "x"),
        "per_device_train_batch_size": 8,
        "use_cpu": True,
        "report_to": "none",
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_generations": 1}, "num_generations=1"),
        ({"loss_type": "ppo"}, "loss_type='ppo'"),
        ({"scale_rewards": "prompt"}, "scale_rewards='prompt'"),
        ({"num_iterations": 2, "num_ppo_epochs": 3}, "num_ppo_epochs=3 conflicts with num_iterations=2"),
        ({"beta": 0.1, "kl_loss_coef": 0.2}, "kl_loss_coef=0.2 conflicts with beta=0.1"),
        (
            {"steps_per_generation": 3, "gradient_accumulation_steps": 2},
            "multiple of gradient_accumulation_steps",
        ),
        ({"generation_batch_size": 12}, "generation_batch_size=12"),
        ({"generation_batch_size": 16, "steps_per_generation": 1}, "conflicts with steps_per_generation=1"),
        ({"num_iterations": 2, "max_steps": 3}, "max_steps=3"),
        ({"mask_truncated_completions": True, "stop_token": None}, "mask_truncated_completions=True"),
        ({"importance_sampling_level": "prompt"}, "importance_sampling_level='prompt'"),
        ({"kl_loss_estimator": "k4"}, "kl_loss_estimator='k4'"),
    ],
)
def test_bad_settings_are_refused_at_construction(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        GRPOConfig(**{**_fields(tmp_path), **overrides})


def test_trl_names_set_the_engine_fields(tmp_path):
    args = GRPOConfig(
        **_fields(tmp_path),
        num_iterations=2,
        max_completion_length=32,
        epsilon=0.1,
        epsilon_high=0.3,
        beta=0.02,
        loss_type="dr_grpo",
        scale_rewards=False,
    )
    assert (args.num_ppo_epochs, args.response_length, args.cliprange, args.cliprange_high) == (
        2,
        32,
        0.1,
        0.3,
    )
    assert (args.kl_loss_coef, args.loss_agg_mode, args.scale_rewards) == (
        0.02,
        "seq-mean-token-sum-norm",
        "none",
    )
    assert args.kl_coef == 0.0 and args.uses_reference_model
    assert not GRPOConfig(**_fields(tmp_path)).uses_reference_model  # TRL's default beta=0


def test_reward_funcs_may_mix_a_reward_model_and_functions(kit, tmp_path, reward_model_dir):
    def constant(completions, **kwargs):
        return [0.5] * len(completions)

    trainer = _trainer(
        kit, tmp_path, reward_funcs=[constant, str(reward_model_dir)], reward_weights=[2.0, 1.0]
    )
    # the engine's order: reward model first
    assert trainer.args.reward_weights == [1.0, 2.0]
    assert trainer.reward_model is not None
    with pytest.raises(ValueError, match="at most one reward model"):
        _trainer(kit, tmp_path, reward_funcs=[str(reward_model_dir), str(reward_model_dir)])


def test_mask_truncated_completions_leaves_them_out_of_the_loss(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, mask_truncated_completions=True, max_completion_length=4)
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    truncated = ~rollout.found_stop
    assert truncated.any() and (~truncated).any()
    assert not rollout.response_mask[truncated].any()
    assert rollout.response_mask[~truncated].any(1).all()
    # their rewards still count in the group statistics
    assert rollout.valid_rows[truncated].all()


# ---- REINFORCE++ and the other estimators ------------------------------------------------------------


def _whiten_by_hand(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)  # unbiased, as verl's masked_whiten
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.0, 2.0, 9.0], [0.3, 0.0, 0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    gamma = 0.9
    # discounted returns of the valid tokens, computed backwards per row
    returns = []
    for row, m in zip(rewards.tolist(), mask.tolist(), strict=True):
        valid = [r for r, keep in zip(row, m, strict=True) if keep]
        out, running = [], 0.0
        for r in reversed(valid):
            running = r + gamma * running
            out.append(running)
        returns.append(list(reversed(out)))
    flat = _whiten_by_hand([v for row in returns for v in row])
    got = F.reinforce_plus_plus_advantages(rewards, mask, gamma=gamma)
    assert got[mask].tolist() == pytest.approx(flat, abs=1e-5)
    assert got[~mask].tolist() == [0.0]


def test_reinforce_plus_plus_baseline_by_hand():
    # k=2 completions of B=2 prompts (rows 0, 2 are prompt 0; rows 1, 3 prompt 1); one row invalid
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [2.0, 0.0], [0.5, 0.5]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]], dtype=torch.bool)
    totals = [1.0, 3.0, 2.0, 1.0]
    means = [(1.0 + 2.0) / 2, (3.0 + 1.0) / 2]
    centred = [totals[0] - means[0], totals[1] - means[1], totals[2] - means[0], totals[3] - means[1]]
    per_token = [centred[0]] * 2 + [centred[1]] * 2 + [centred[2]] + [centred[3]] * 2
    got = F.reinforce_plus_plus_advantages(rewards, mask, k=2)
    assert got[mask].tolist() == pytest.approx(_whiten_by_hand(per_token), abs=1e-5)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_other_advantage_estimators(kit, tmp_path, estimator):
    trainer = _trainer(kit, tmp_path, advantage_estimator=estimator, kl_coef=0.05)
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    rewards = trainer.token_rewards(rollout)
    got = trainer.compute_advantages(rollout, rewards).advantages
    if estimator == "rloo":
        expected = F.rloo_advantages(rollout.scores - 0.05 * rollout.kl.sum(1), 4, valid=rollout.valid_rows)[
            :, None
        ]
    else:
        k = 4 if estimator.endswith("baseline") else None
        expected = F.reinforce_plus_plus_advantages(
            rewards, rollout.response_mask, k=k, valid=rollout.valid_rows
        )
    torch.testing.assert_close(got, expected.float())
    trainer.train()  # the loss takes per-token and per-sequence advantages alike


# ---- dynamic sampling and PPO with several completions per prompt -------------------------------------


def _half_constant_reward(prompts, completions, **kwargs):
    """The true reward, except for prompts of even length, whose completions all get 0.5 (no signal)."""
    true = true_reward(prompts, completions)
    return [0.5 if len(p) % 2 == 0 else r for p, r in zip(prompts, true, strict=True)]


def test_dynamic_sampling_replaces_groups_without_signal(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, reward_funcs=_half_constant_reward, dynamic_sampling=True)
    k, B = 4, trainer.local_prompts
    batch = trainer.producer.prompt_batch(0)
    samples = trainer.producer.sample(batch, k)
    scores = trainer.producer.score(samples)
    assert not trainer.producer._group_signal(samples, scores, k).all(), (
        "the test needs groups without signal"
    )
    kept, kept_scores = trainer.producer.dynamic_sampling(batch, samples, scores, update=0)
    assert kept.response.shape[0] == k * B and len(kept.prompts) == k * B
    assert trainer.producer._group_signal(kept, kept_scores, k).all()
    for g in range(B):  # a group's rows are completions of one prompt
        assert len({kept.prompts[j * B + g] for j in range(k)}) == 1
    # reproducible: the same update draws the same extra prompts
    again, _ = trainer.producer.dynamic_sampling(batch, samples, scores, update=0)
    assert again.prompts == kept.prompts
    trainer.train()
    logged = [h for h in trainer.state.log_history if "rollout/dynamic_sampling_rounds" in h]
    assert logged and logged[0]["rollout/dynamic_sampling_rounds"] >= 2
    assert logged[0]["rollout/dynamic_sampling_groups_short"] == 0
    assert logged[0]["objective/frac_reward_zero_std"] == 0


def test_dynamic_sampling_fills_with_dropped_groups_after_the_last_round(kit, tmp_path):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = _trainer(
        kit, tmp_path, reward_funcs=constant, dynamic_sampling=True, dynamic_sampling_max_rounds=2
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "rollout/dynamic_sampling_rounds" in h]
    assert logged[0]["rollout/dynamic_sampling_rounds"] == 2
    assert logged[0]["rollout/dynamic_sampling_groups_short"] == trainer.local_prompts
    with pytest.raises(ValueError, match="dynamic_sampling=True with num_generations=1"):
        from rlhf_trainers import PPOConfig, PPOTrainer

        PPOTrainer(
            model=kit.load_model("llama-sft"),
            reward_funcs=true_reward,
            args=PPOConfig(
                output_dir=str(tmp_path / "ppo"), dynamic_sampling=True, use_cpu=True, report_to="none"
            ),
            train_dataset=kit.prompt_dataset("train", n=64),
            processing_class=kit.load_tokenizer(),
        )


def test_top_k_top_p_min_p_sample_but_train_the_full_distribution(kit, tmp_path):
    """Restricted sampling in a run: the rollout's log-probs (here the sampling loop's own) are those of
    the unrestricted distribution, so the ratio is 1 before the first step as without filters."""
    trainer = _trainer(kit, tmp_path, top_k=10, top_p=0.9, min_p=0.02, max_steps=2)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "policy/ratio_at_start" in h]
    assert logged and all(h["policy/ratio_at_start"] < 1e-4 for h in logged)
    for bad, message in (
        ({"top_k": -1}, "top_k=-1"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"min_p": 1.5}, "min_p=1.5"),
    ):
        with pytest.raises(ValueError, match=message):
            GRPOConfig(**{**_fields(tmp_path), **bad})


# ---- entropy bonus --------------------------------------------------------------------------------


def test_entropy_bonus_is_subtracted_per_token_and_reduced_like_the_loss(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, entropy_coeff=0.01, loss_type="dapo")
    rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    advantages = trainer.compute_advantages(rollout, trainer.token_rewards(rollout))
    rows = torch.arange(rollout.response.shape[0])
    logprobs, _, entropy = trainer.loop.training_forward(trainer.model, rollout, rows)
    assert entropy.requires_grad
    plain, _ = trainer.compute_policy_loss(rollout, advantages, rows, logprobs, None)
    bonus, _ = trainer.compute_policy_loss(rollout, advantages, rows, logprobs, None, entropy=entropy)
    mask = rollout.response_mask
    expected = -0.01 * entropy[mask].sum() / mask.sum()
    assert (bonus - plain).item() == pytest.approx(expected.item(), rel=1e-5)
    (grad,) = torch.autograd.grad(bonus - plain, entropy)
    torch.testing.assert_close(grad, torch.where(mask, -0.01 / mask.sum(), 0.0).to(grad.dtype))


def test_entropy_bonus_keeps_the_policy_more_random(kit, tmp_path):
    def final_entropy(coeff: float, out: str) -> float:
        trainer = _trainer(kit, tmp_path / out, entropy_coeff=coeff, train_n=256, max_steps=16, **LEARN_SHORT)
        trainer.train()
        return [h for h in trainer.state.log_history if "policy/entropy_avg" in h][-1]["policy/entropy_avg"]

    assert final_entropy(0.2, "bonus") > final_entropy(0.0, "plain") + 0.1


LEARN_SHORT = {k: v for k, v in LEARN.items() if k != "num_iterations"}


# ---- micro-batches by token budget (issue #24's first piece) -------------------------------------------


def test_token_budget_micro_batches_give_the_update_of_fixed_ones(kit, tmp_path, monkeypatch):
    """A mini-batch of 16 split by a token budget (longest rows first, each micro-batch's rows x padded
    columns within the budget) gives the SGD step of the fixed 4 x 4 split, for a loss type whose counts
    differ between micro-batches; every micro-batch keeps to the budget."""
    # Padded passes: the budget holds rows x padded columns (with padding_free it holds real tokens,
    # tests/test_padding_free.py).
    common = {
        "max_steps": 1,
        "max_grad_norm": 0.0,
        "optim": "sgd",
        "per_device_train_batch_size": 4,
        "padding_free": False,
    }
    start = _digest(_trainer(kit, tmp_path / "start").policy)
    fixed = _trainer(kit, tmp_path / "fixed", gradient_accumulation_steps=4, **common)
    budget = _trainer(
        kit, tmp_path / "budget", gradient_accumulation_steps=4, max_tokens_per_microbatch=100, **common
    )
    seen: list[tuple[int, int]] = []
    forward = budget.loop.training_forward

    def recording(model, rollout, rows, bounds=None):
        first, end = bounds
        seen.append((len(rows), (rollout.query.shape[1] - first) + end))
        return forward(model, rollout, rows, bounds)

    monkeypatch.setattr(budget.loop, "training_forward", recording)
    fixed.train()
    budget.train()
    assert all(n * width <= 100 or n == 1 for n, width in seen), seen
    assert len(seen) != 4 and sum(n for n, _ in seen) == 16
    step_fixed, step_budget = _digest(fixed.policy) - start, _digest(budget.policy) - start
    assert step_fixed.abs().max() > 1e-6
    torch.testing.assert_close(step_budget, step_fixed, rtol=1e-3, atol=1e-8)
    logged = next(h for h in budget.state.log_history if "perf/micro_batches_per_step" in h)
    assert logged["perf/micro_batches_per_step"] == len(seen)
