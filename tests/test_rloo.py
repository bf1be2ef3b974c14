"""RLOOTrainer on the offline kit's synthetic task (single process), and the RLOO blog's snippet.

The task: complete a short prompt; the hidden true reward (:func:`rlhf_trainers.testing.true_reward`)
is the sentiment balance of the completion, in [-1, 1]. The kit's ``llama-sft`` policy starts near 0.
Rollout rows are laid out as in the RLOO blog: completion j of prompt i at row ``j * B + i``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch
from resume_checks import assert_resumed_like_uninterrupted, resume_from_each
from transformers import TrainerCallback

from rlhf_trainers import CPUOptions, PPOConfig, RLOOConfig, RLOOTrainer
from rlhf_trainers import functional as F
from rlhf_trainers.onpolicy.checkpoint import ONPOLICY_STATE_FILE, VALUE_MODEL_DIR
from rlhf_trainers.onpolicy.rollout import Advantages, Rollout
from rlhf_trainers.rloo import SIMPLE_QUERY_CHAT_TEMPLATE, leave_one_out
from rlhf_trainers.testing import true_reward

# Settings under which the tiny policy learns the task within a few dozen updates (8 prompts x 4 completions).
LEARN = {
    "learning_rate": 2e-3,
    "per_device_train_batch_size": 16,
    "num_mini_batches": 2,
    "num_ppo_epochs": 2,
    "response_length": 12,
    "temperature": 1.0,
    "kl_coef": 0.05,
    "rloo_k": 4,
}


def _config(tmp_path, **overrides) -> RLOOConfig:
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
    return RLOOConfig(**fields)


def _trainer(kit, tmp_path, *, train_n=64, eval_n=None, model="llama-sft", **kwargs) -> RLOOTrainer:
    trainer_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _TRAINER_ARGS}
    switches = {k: kwargs.pop(k) for k in list(kwargs) if k in _CPU_OPTIONS}
    if switches:  # the CPU speed switches go to the trainer's cpu_options, not to the config
        trainer_kwargs["cpu_options"] = CPUOptions(**switches)
    trainer_kwargs.setdefault("reward_funcs", None if "reward_model" in trainer_kwargs else true_reward)
    return RLOOTrainer(
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
    "peft_config",
    "reward_processing_class",
    "callbacks",
    "cpu_options",
}
_CPU_OPTIONS = {f.name for f in dataclasses.fields(CPUOptions)}


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


def _rollout(trainer: RLOOTrainer) -> tuple[Rollout, Advantages]:
    r = trainer.rollout(trainer.producer.prompt_batch(0))
    return r, trainer.compute_advantages(r, trainer.token_rewards(r))


# ---- learning -------------------------------------------------------------------------------------


def test_learns_the_hidden_reward_with_a_reward_function(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, train_n=512, eval_n=128, max_steps=30, **LEARN)
    before = trainer.evaluate()["eval_objective/scores"]
    trainer.train()
    after = trainer.evaluate()["eval_objective/scores"]
    assert after - before >= 0.3, (before, after)
    logged = [h for h in trainer.state.log_history if "objective/rlhf_reward" in h]
    assert logged[-1]["objective/rlhf_reward"] > logged[0]["objective/rlhf_reward"]


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


# ---- the RLOO blog's snippet ----------------------------------------------------------------------

# Verbatim from the RLOO blog (seeds/rloo-trainer-blog-zh.txt, "开始使用 TRL 的 RLOO"); the test replaces
# only the model name and the two dataset lines.
BLOG_SNIPPET = """\
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)
from trl.trainer.rloo_trainer import RLOOConfig, RLOOTrainer
from trl.trainer.utils import SIMPLE_QUERY_CHAT_TEMPLATE
base_model_name = "EleutherAI/pythia-1b-deduped"
tokenizer = AutoTokenizer.from_pretrained(base_model_name, padding_side="left")
tokenizer.add_special_tokens({"pad_token": "[PAD]"})
if tokenizer.chat_template is None:
    tokenizer.chat_template = SIMPLE_QUERY_CHAT_TEMPLATE
reward_model = AutoModelForSequenceClassification.from_pretrained(base_model_name, num_labels=1)
ref_policy = AutoModelForCausalLM.from_pretrained(base_model_name)
policy = AutoModelForCausalLM.from_pretrained(base_model_name)
train_dataset = ... # make sure to have columns "input_ids"
eval_dataset = ...
trainer = RLOOTrainer(
    config=RLOOConfig(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=64,
        total_episodes=30000,
    ),
    tokenizer=tokenizer,
    policy=policy,
    ref_policy=ref_policy,
    reward_model=reward_model,
    train_dataset=train_dataset,
    eval_dataset=eval_dataset,
)
trainer.train()
"""


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


@pytest.fixture(params=[640, None], ids=["spare-embedding-rows", "no-row-for-the-pad-token"])
def blog_base_model(kit, tmp_path, request):
    """A kit model standing in for Pythia: its embedding table padded beyond the tokenizer (Pythia's 50304
    rows for 50277 tokens), so the snippet's added "[PAD]" token (id 627, past the kit's vocabulary) has
    a row; or left at the kit's 627 rows, so that it has none (the reference implementation's setting:
    the pad id never reaches an embedding)."""
    folder = tmp_path / "base"
    model = kit.load_model("llama-sft")
    if request.param is not None:
        model.resize_token_embeddings(request.param)
    model.save_pretrained(folder)
    kit.load_tokenizer().save_pretrained(folder)
    return folder


def test_the_rloo_blog_snippet_runs_unchanged(kit, tmp_path, monkeypatch, blog_base_model):
    class StoppingRLOOTrainer(RLOOTrainer):
        """The snippet's total_episodes=30000 is 469 updates (minutes): stop after 2."""

        def __init__(self, *args, **kwargs):
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), StopAt(2)]
            super().__init__(*args, **kwargs)

    trl = types.ModuleType("trl")
    trl_trainer = types.ModuleType("trl.trainer")
    rloo_module = types.ModuleType("trl.trainer.rloo_trainer")
    utils_module = types.ModuleType("trl.trainer.utils")
    rloo_module.RLOOConfig = RLOOConfig
    rloo_module.RLOOTrainer = StoppingRLOOTrainer
    utils_module.SIMPLE_QUERY_CHAT_TEMPLATE = SIMPLE_QUERY_CHAT_TEMPLATE
    trl.trainer = trl_trainer
    trl_trainer.rloo_trainer, trl_trainer.utils = rloo_module, utils_module
    for name, module in [
        ("trl", trl),
        ("trl.trainer", trl_trainer),
        ("trl.trainer.rloo_trainer", rloo_module),
        ("trl.trainer.utils", utils_module),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    # RLOOConfig() without output_dir writes to ./trainer_output (transformers 5's default).
    monkeypatch.chdir(tmp_path)

    tok = kit.load_tokenizer()

    def input_ids(split, n):
        ds = kit.prompt_dataset(split, n=n)
        return ds.map(lambda r: {"input_ids": tok(r["prompt"])["input_ids"]}, remove_columns=["prompt"])

    code = _replace_once(BLOG_SNIPPET, '"EleutherAI/pythia-1b-deduped"', repr(str(blog_base_model)))
    code = _replace_once(
        code, 'train_dataset = ... # make sure to have columns "input_ids"', "train_dataset = kit_train"
    )
    code = _replace_once(code, "eval_dataset = ...", "eval_dataset = kit_eval")
    namespace = {"kit_train": input_ids("train", 256), "kit_eval": input_ids("test", 16)}
    exec(compile(code, "rloo_blog_snippet", "exec"), namespace)

    trainer = namespace["trainer"]
    assert isinstance(trainer, RLOOTrainer)
    assert trainer.state.global_step == 2
    assert trainer.num_updates == math.ceil(30000 / 64)  # 32 prompts x rloo_k=2 per update
    assert trainer.args.output_dir == "trainer_output"
    assert trainer.processing_class.pad_token == "[PAD]"
    assert trainer.processing_class.pad_token_id == len(tok)  # a new token past the kit vocabulary
    # Without an embedding row for it, every forward pass reads 0 at the padding instead.
    has_row = trainer.policy.get_input_embeddings().num_embeddings > len(tok)
    assert trainer.passes.input_pad_id == (len(tok) if has_row else 0)
    assert trainer.ref_model is namespace["ref_policy"] and trainer.reward_model is namespace["reward_model"]
    assert not torch.equal(_digest(trainer.policy), _digest(namespace["ref_policy"]))
    logged = [h for h in trainer.state.log_history if "objective/rlhf_reward" in h]
    assert len(logged) == 2 and all(math.isfinite(h["objective/rlhf_reward"]) for h in logged)
    assert logged[0]["rollout/num_completions_kept"] == 64


def test_simple_query_chat_template_does_not_end_the_query_with_eos(kit):
    tok = kit.load_tokenizer()
    tok.chat_template = SIMPLE_QUERY_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "the food was"}], tokenize=False)
    assert text == " the food was"  # the policy continues the query and ends its completion with EOS


# ---- resume ---------------------------------------------------------------------------------------


def test_resumed_run_logs_the_same_metrics_as_an_uninterrupted_one(kit, tmp_path):
    settings = {
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1,
        "num_mini_batches": 2,
        "num_ppo_epochs": 2,
        "rloo_k": 4,
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
    assert (checkpoint / "model.safetensors").is_file()
    assert not (checkpoint / VALUE_MODEL_DIR).exists()
    resumed = _trainer(kit, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=True)

    def update(trainer, step):
        return next(h for h in trainer.state.log_history if h.get("step") == step and "objective/kl" in h)

    for step in (3, 4):
        a, b = update(full, step), update(resumed, step)
        for key in (
            "objective/scores",
            "objective/kl",
            "objective/rlhf_reward",
            "objective/reward_std_per_prompt",
            "loss/policy_avg",
            "objective/kl_coef",
            "lr",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (step, key, a[key], b[key])
    assert torch.equal(_digest(full.policy), _digest(resumed.policy))


#: Three ways to ask for the same run of 10 updates (8 completions each, 2.5 passes over 16 prompts).
RUN_LENGTHS = {
    "max_steps": {"max_steps": 10},
    "total_episodes": {"max_steps": -1, "total_episodes": 76},  # ceil(76 / 8) updates
    "num_train_epochs": {"max_steps": -1, "num_train_epochs": 2.5},  # 2.5 x 16 prompts x rloo_k 2
}


@pytest.mark.parametrize("length", list(RUN_LENGTHS))
def test_resume_at_the_end_of_a_pass_over_the_prompts_and_within_the_next(kit, tmp_path, length):
    """Issue #25: 16 prompts, 4 per update, so a pass over the prompts is 4 updates and the run 10.
    Resumed from checkpoint-4 (the end of the first pass: the next update starts a new permutation of the
    prompts) and from checkpoint-6 (within the second pass), each resumed run trains the 6 and 4 remaining
    updates and logs, update by update, what the uninterrupted run logged, ending with its weights."""
    settings = {
        "per_device_train_batch_size": 8,
        "rloo_k": 2,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1,
        "seed": 5,
        **RUN_LENGTHS[length],
    }

    def build(root, callbacks=None):
        return _trainer(kit, root, train_n=16, callbacks=callbacks, **settings)

    full, resumed = resume_from_each(build, tmp_path, checkpoints=(4, 6))
    assert (full.updates_per_data_epoch, full.num_updates, full.state.global_step) == (4, 10, 10)
    for step, (trainer, seen) in resumed.items():
        assert seen.steps == 10 - step, (step, seen.steps)
        # A pass entered in its middle opens with on_epoch_begin too (as Trainer does for a resumed epoch).
        assert seen.epochs == [("begin", step), ("end", 8), ("begin", 8), ("end", 10)], seen.epochs
        assert_resumed_like_uninterrupted(full, trainer, step)


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
    assert trainer.value_model is None  # RLOO holds no value model
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
    trainer.save_model()
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_a_new_adapter_starts_from_the_configs_seed(kit, tmp_path):
    """peft_config's adapter is initialised from ``seed`` (it is drawn before Trainer seeds the process), so
    two runs with one seed start alike whatever the process's random state was."""
    from peft import LoraConfig

    def adapter(seed):
        torch.manual_seed(1000 + len(calls))  # the process's random state differs at every call
        calls.append(seed)
        trainer = _trainer(
            kit, tmp_path / str(seed), seed=seed, peft_config=LoraConfig(target_modules=["q_proj"])
        )
        return {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if "lora_A" in n}

    calls: list[int] = []
    first, again, other = adapter(0), adapter(0), adapter(1)
    assert first.keys() == again.keys() and first
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert any(not torch.equal(first[n], other[n]) for n in first)


def test_three_models_and_no_value_model(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, reward_model=kit.load_model("llama-seqcls"))
    assert trainer.value_model is None
    assert [n for n, _ in trainer.model.named_children()] == ["policy"]
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.policy
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    assert not any(p.requires_grad for p in trainer.reward_model.parameters())


# ---- leave-one-out --------------------------------------------------------------------------------


def test_masked_leave_one_out_equals_the_unmasked_one_when_all_completions_are_valid():
    torch.manual_seed(0)
    for k, B in [(2, 5), (4, 3), (8, 1)]:
        values = torch.randn(k * B)
        valid = torch.ones(k * B, dtype=torch.bool)
        assert torch.allclose(
            F.rloo_advantages(values, k, valid=valid), F.rloo_advantages(values, k), atol=1e-6
        )


def test_rloo_leave_one_out_keeps_its_argument_order_and_is_rloo_advantages():
    rlhf_reward = torch.tensor([1.0, 2.0, float("nan"), 4.0, 5.0, 6.0])
    valid = torch.tensor([True, True, False, True, True, True])
    torch.testing.assert_close(
        leave_one_out(rlhf_reward, valid, 2), F.rloo_advantages(rlhf_reward, 2, valid=valid), equal_nan=False
    )


def test_leave_one_out_reproduces_the_blog_example():
    # 3 prompts x 4 completions; completion j of prompt i at j * 3 + i.
    rlhf_reward = torch.tensor([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10]).float()
    advantages = F.rloo_advantages(rlhf_reward, 4, valid=torch.ones(12, dtype=torch.bool))
    assert advantages[0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)
    assert advantages[7].item() == pytest.approx(6 - (3 + 2 + 9) / 3)
    # The blog's vectorised implementation.
    r = rlhf_reward.reshape(4, 3)
    torch.testing.assert_close(advantages, (r - (r.sum(0) - r) / 3).flatten())


def test_invalid_completions_get_zero_and_leave_the_others_baselines():
    rlhf_reward = torch.tensor([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 100]).float()
    valid = torch.ones(12, dtype=torch.bool)
    valid[11] = False  # prompt 2's fourth completion has no reward (its 100 must not count)
    valid[4] = valid[7] = valid[10] = False  # prompt 1 keeps only its first completion
    adv = F.rloo_advantages(rlhf_reward, 4, valid=valid)
    assert adv[11] == 0 and adv[4] == 0 and adv[7] == 0 and adv[10] == 0
    assert adv[1] == 0, "a prompt's only valid completion has no baseline"
    assert adv[2].item() == pytest.approx(3 - (4 + 7) / 2)
    assert adv[8].item() == pytest.approx(7 - (3 + 4) / 2)
    assert adv[0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)  # prompt 0 untouched


def test_invalid_rewards_in_a_run_get_zero_advantage_and_are_counted(kit, tmp_path):
    def sometimes_none(prompts, completions, **kwargs):
        return [None if i % 3 == 0 else float(len(c)) for i, c in enumerate(completions)]

    trainer = _trainer(kit, tmp_path, reward_funcs=sometimes_none, rloo_k=4, max_steps=1, logging_steps=1)
    trainer.train()
    r, adv = trainer._last_rollout, trainer._last_advantages
    valid = r.valid_rows
    assert (adv.advantages[~valid] == 0).all()
    assert torch.allclose(adv.advantages[:, 0], F.rloo_advantages(adv.rlhf_reward, 4, valid=valid))
    logged = next(h for h in trainer.state.log_history if "rollout/num_completions_kept" in h)
    assert logged["rollout/num_completions_kept"] == int(valid.sum()) == 8 - 3
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# ---- options --------------------------------------------------------------------------------------


def test_rloo_k_copies_each_prompt_k_times(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, rloo_k=4, per_device_train_batch_size=12)
    assert trainer.local_prompts == 3
    batch = trainer.producer.prompt_batch(0)
    r, adv = _rollout(trainer)
    B = batch["input_ids"].shape[0]
    assert B == 3 and r.query.shape[0] == r.response.shape[0] == 12
    for j in range(4):
        assert torch.equal(r.query[j * B : (j + 1) * B], batch["input_ids"])
    assert r.prompts[:B] * 4 == r.prompts
    # The advantages of a prompt's k completions sum to 0 (leave-one-out over the same prompt).
    assert torch.allclose(adv.advantages.reshape(4, B).sum(0), torch.zeros(B), atol=1e-5)
    two = _trainer(kit, tmp_path, rloo_k=2)
    assert two.local_prompts == 4 and two.batch_size == 8


def test_sequence_level_and_token_level_advantages(kit, tmp_path):
    # A reference other than the policy, so that the KL term is not zero.
    trainer = _trainer(kit, tmp_path, rloo_k=4, ref_model=kit.load_model("llama"), kl_coef=0.1)
    r, adv = _rollout(trainer)
    mask = r.response_mask
    assert r.kl.abs().sum() > 0
    rlhf = r.scores - 0.1 * r.kl.sum(1)
    assert torch.allclose(adv.rlhf_reward, rlhf, atol=1e-6)
    assert adv.advantages.shape == (8, 1)  # one action per completion
    assert torch.allclose(adv.advantages[:, 0], F.rloo_advantages(rlhf, 4), atol=1e-5)

    trainer.args.token_level_kl = True
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    rewards = trainer.token_rewards(r)  # -kl_coef * KL per token, score at the last token
    to_go = (rewards * mask).flip(1).cumsum(1).flip(1)
    returns = to_go[:, 0]
    assert torch.allclose(returns, rlhf, atol=1e-5)  # same total reward, spread over the tokens
    baseline = returns - F.rloo_advantages(returns, 4)  # mean return of the other 3 completions
    expected = (to_go - baseline[:, None]) * mask
    assert adv.advantages.shape == mask.shape
    assert torch.allclose(adv.advantages, expected, atol=1e-5)
    assert torch.allclose(adv.advantages[:, 0], F.rloo_advantages(rlhf, 4), atol=1e-5)


def test_kl_coef_enters_the_sequence_reward(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, rloo_k=4, ref_model=kit.load_model("llama"))
    r = trainer.rollout(trainer.producer.prompt_batch(0))
    trainer.kl_ctl = F.FixedKLController(0.0)
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    assert torch.allclose(adv.advantages[:, 0], F.rloo_advantages(r.scores, 4), atol=1e-6)
    trainer.kl_ctl = F.FixedKLController(0.5)
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    rlhf = r.scores - 0.5 * r.kl.sum(1)
    assert torch.allclose(adv.advantages[:, 0], F.rloo_advantages(rlhf, 4), atol=1e-5)


def test_normalize_advantage_gives_zero_mean_over_valid_completions(kit, tmp_path):
    def sometimes_none(prompts, completions, **kwargs):
        return [None if i == 0 else float(len(c)) for i, c in enumerate(completions)]

    trainer = _trainer(kit, tmp_path, reward_funcs=sometimes_none, rloo_k=4, per_device_train_batch_size=16)
    r, adv = _rollout(trainer)
    valid = r.valid_rows[:, None]
    raw = adv.advantages.clone()
    trainer.args.normalize_advantage = True
    whitened = trainer.compute_advantages(r, trainer.token_rewards(r)).advantages
    assert float(F.masked_mean(whitened, valid)) == pytest.approx(0.0, abs=1e-5)
    assert float(F.masked_var(whitened, valid)) == pytest.approx(1.0, abs=0.1)
    assert not torch.allclose(whitened, raw)
    trainer.args.token_level_kl = True
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    assert float(F.masked_mean(adv.advantages, r.response_mask)) == pytest.approx(0.0, abs=1e-5)


def test_sequence_loss_is_ppos_clipped_objective_on_summed_logprobs(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, rloo_k=4, cliprange=0.2)
    r, adv = _rollout(trainer)
    idx = torch.tensor([0, 3, 5, 6])
    mask = r.response_mask[idx]
    shift = torch.linspace(-0.3, 0.3, mask.shape[1])  # a policy away from the rollout one
    logprobs = (r.logprobs[idx] + shift).requires_grad_(True)
    loss, metrics = trainer.compute_policy_loss(r, adv, idx, logprobs, None)

    ratio = ((logprobs - r.logprobs[idx]) * mask).sum(1).exp()
    sequence_adv = adv.advantages[idx, 0]
    per_seq = torch.maximum(-sequence_adv * ratio, -sequence_adv * ratio.clamp(0.8, 1.2))
    assert loss.item() == pytest.approx(per_seq.mean().item(), rel=1e-5, abs=1e-7)
    clipfrac = (
        -sequence_adv * ratio.clamp(0.8, 1.2) > -sequence_adv * ratio
    )  # the clip binds (PPO's clipfrac)
    assert float(metrics["policy/clipfrac_avg"]) == pytest.approx(clipfrac.float().mean().item())
    assert float(metrics["val/ratio"]) == pytest.approx(ratio.mean().item(), rel=1e-5)
    # At ratio 1 the gradient is REINFORCE's: -A * d(sum log p) per sequence (the blog's point).
    at_start = r.logprobs[idx].clone().requires_grad_(True)
    loss, _ = trainer.compute_policy_loss(r, adv, idx, at_start, None)
    loss.backward()
    reinforce = -(sequence_adv[:, None] * mask) / len(idx)
    assert torch.allclose(at_start.grad, reinforce, atol=1e-6)


def test_truncated_importance_sampling_weights(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, rloo_k=4, truncated_is_cap=2.0)
    assert trainer.needs_generation_logprobs
    r, adv = _rollout(trainer)
    mask = r.response_mask
    seq = ((r.logprobs - r.generation_logprobs) * mask).sum(1, keepdim=True)
    assert torch.allclose(adv.importance_weights, seq.exp().clamp(max=2.0))
    # fp32: generation and the training-mode forward agree, the weights are 1.
    assert torch.allclose(adv.importance_weights, torch.ones_like(adv.importance_weights), atol=1e-4)
    # A forced mismatch: the generation saw each token as 0.5 nats less likely -> capped at 2.
    r.generation_logprobs = r.logprobs - 0.5
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    lengths = mask.sum(1, keepdim=True)
    assert torch.allclose(adv.importance_weights, (0.5 * lengths).exp().clamp(max=2.0))
    assert (adv.importance_weights[lengths >= 2] == 2.0).all()
    # The weights multiply each sequence's clipped loss.
    idx = torch.arange(8)
    weighted, _ = trainer.compute_policy_loss(r, adv, idx, r.logprobs, None)
    expected = (-adv.advantages[:, 0] * adv.importance_weights[:, 0]).mean()
    assert weighted.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    # Token level: one weight per token.
    trainer.args.token_level_kl = True
    adv = trainer.compute_advantages(r, trainer.token_rewards(r))
    assert adv.importance_weights.shape == mask.shape
    assert torch.allclose(
        adv.importance_weights[mask], torch.full_like(adv.importance_weights[mask], math.exp(0.5))
    )
    # Without the cap there are no generation log-probs and no weights.
    plain, plain_adv = _rollout(_trainer(kit, tmp_path, rloo_k=4))
    assert plain.generation_logprobs is None and plain_adv.importance_weights is None


def test_truncated_importance_sampling_metrics_with_a_real_mismatch(kit, tmp_path):
    # Dropout on (kit GPT-2): generation runs in eval mode, the rollout forward in training mode.
    trainer = _trainer(
        kit, tmp_path, model="gpt2", disable_dropout=False, truncated_is_cap=1.0, max_steps=1, logging_steps=1
    )
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "policy/is_weight_mean" in h)
    assert logged["policy/gen_ratio_max"] > 1.0
    assert logged["policy/is_weight_mean"] <= 1.0


def test_reward_clip_and_missing_eos_penalty_shape_the_scores(kit, tmp_path):
    def loud(prompts, completions, **kwargs):
        return [5.0 if i % 2 else -5.0 for i in range(len(completions))]

    trainer = _trainer(kit, tmp_path, reward_funcs=loud, reward_clip=1.0, rloo_k=4)
    r, adv = _rollout(trainer)
    assert set(r.scores.tolist()) <= {1.0, -1.0}
    assert torch.allclose(adv.advantages[:, 0], F.rloo_advantages(adv.rlhf_reward, 4), atol=1e-6)

    def zero(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    short = _trainer(kit, tmp_path, reward_funcs=zero, missing_eos_penalty=1.0, response_length=2, rloo_k=4)
    r = short.rollout(short.producer.prompt_batch(0))
    assert (~r.found_stop).any()
    assert torch.equal(r.scores, -(~r.found_stop).float())


# ---- metrics --------------------------------------------------------------------------------------


def test_metrics_have_the_rloo_names_and_no_critic(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, rloo_k=4, max_steps=1, logging_steps=1)
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "objective/kl" in h)
    expected = {
        "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
        "objective/scores", "objective/reward_std_per_prompt", "rollout/num_completions_kept",
        "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg",
        "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr", "episode", "policy/ratio_at_start",
        "policy/seq_ratio_at_start_mean", "policy/seq_ratio_at_start_max",
        "policy/seq_ratio_at_start_clipfrac", "timing/generate", "timing/ref", "timing/reward",
        "timing/update",
    }  # fmt: skip
    assert expected <= set(logged), expected - set(logged)
    assert not [k for k in logged if k.startswith("critic/") or k in ("loss/value_avg", "timing/values")]
    assert "policy/is_weight_mean" not in logged
    assert logged["episode"] == 8 and logged["rollout/num_completions_kept"] == 8
    # fp32 on CPU: the rollout log-probs are the first training forward's, ratio exactly 1 at the start.
    assert logged["policy/ratio_at_start"] < 1e-5
    assert logged["policy/seq_ratio_at_start_mean"] == pytest.approx(1.0, abs=1e-5)
    assert logged["policy/seq_ratio_at_start_clipfrac"] == 0
    adv = trainer._last_advantages
    assert logged["objective/rlhf_reward"] == pytest.approx(float(adv.rlhf_reward.mean()), abs=1e-5)
    std = adv.rlhf_reward.reshape(4, 2).std(0, unbiased=False).mean()
    assert logged["objective/reward_std_per_prompt"] == pytest.approx(float(std), abs=1e-5)


def test_batch_accounting_counts_prompts_and_completions(kit, tmp_path, capsys):
    trainer = _trainer(
        kit,
        tmp_path,
        rloo_k=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        max_steps=-1,
        total_episodes=40,
    )
    assert trainer.num_updates == 3  # ceil(40 / 16)
    trainer.args.max_steps = 1
    trainer.num_updates = 1
    trainer.train()
    out = capsys.readouterr().out
    assert "4 prompts x 4 completion(s) = 16 completions per update" in out


# ---- errors ---------------------------------------------------------------------------------------


def test_errors_at_construction(kit, tmp_path):
    tok = kit.load_tokenizer()
    ds = kit.prompt_dataset("train", n=16)
    model = kit.load_model("llama-sft")
    with pytest.raises(ValueError, match="rloo_k=1"):
        _config(tmp_path, rloo_k=1)
    with pytest.raises(ValueError, match=r"num_mini_batches \(1\) = 6 completions .* multiple of rloo_k=4"):
        RLOOTrainer(
            model=model,
            processing_class=tok,
            reward_funcs=true_reward,
            args=_config(tmp_path, per_device_train_batch_size=6, rloo_k=4),
            train_dataset=ds,
        )
    with pytest.raises(TypeError, match="value_model"):
        RLOOTrainer(
            model=model,
            value_model=kit.load_model("llama-seqcls"),
            processing_class=tok,
            reward_funcs=true_reward,
            args=_config(tmp_path),
            train_dataset=ds,
        )
    with pytest.raises(ValueError, match="model= and policy= name the same argument"):
        RLOOTrainer(
            model=model,
            policy=model,
            processing_class=tok,
            reward_funcs=true_reward,
            args=_config(tmp_path),
            train_dataset=ds,
        )
    with pytest.raises(ValueError, match="args= and config= name the same argument"):
        RLOOTrainer(
            model=model,
            processing_class=tok,
            reward_funcs=true_reward,
            args=_config(tmp_path),
            config=_config(tmp_path),
            train_dataset=ds,
        )
    with pytest.raises(TypeError, match="args must be a RLOOConfig"):
        RLOOTrainer(
            policy=model,
            tokenizer=tok,
            reward_funcs=true_reward,
            config=PPOConfig(output_dir=str(tmp_path)),
            train_dataset=ds,
        )
    with pytest.raises(ValueError, match="needs a policy"):
        RLOOTrainer(processing_class=tok, reward_funcs=true_reward, args=_config(tmp_path), train_dataset=ds)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rloo_k", 1, "rloo_k=1"),
        ("rloo_k", True, "rloo_k=True"),
        ("truncated_is_cap", 0.5, "truncated_is_cap=0.5"),
        ("whiten_rewards", True, "only the token-level reward uses"),
        ("cliprange", 1.5, "cliprange=1.5"),
        ("kl_coef", -1.0, "kl_coef=-1.0"),
    ],
)
def test_config_validation(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **{field: value})


def test_whiten_rewards_with_the_token_level_reward(kit, tmp_path):
    trainer = _trainer(
        kit, tmp_path, whiten_rewards=True, token_level_kl=True, per_device_train_batch_size=16
    )
    r, _ = _rollout(trainer)
    mask = r.response_mask
    assert float(F.masked_var(trainer.token_rewards(r), mask)) == pytest.approx(1.0, abs=1e-3)


def _early_stopping_generation(trainer, width: int):
    """A deterministic ``sampler.generate``: random tokens with the EOS stop token at position 1 + row % 4, so
    every response ends before column 5 of ``width`` and the lengths differ between rows."""
    eos = trainer.processing_class.eos_token_id

    def generate(query, query_mask, with_logprobs=False):
        g = torch.Generator().manual_seed(int(query.sum()))
        response = torch.randint(10, 40, (query.shape[0], width), generator=g)
        response[torch.arange(query.shape[0]), 1 + torch.arange(query.shape[0]) % 4] = eos
        zeros = torch.zeros(response.shape)
        return response, ({"logprobs": zeros, "entropy": zeros} if with_logprobs else None)

    return generate


def test_trimmed_forward_passes_give_the_untrimmed_results(kit, tmp_path, monkeypatch):
    """Rollout and training forward passes leave out the prompt columns that are padding in every row and
    the response columns after the longest response; log-probs, entropies, losses and gradients are
    those of the full-width passes (temperature != 1, sequence-level and token-level losses)."""
    from rlhf_trainers.onpolicy import forward
    from rlhf_trainers.onpolicy import passes as rollout_steps

    R = 10
    trainer = _trainer(
        kit,
        tmp_path,
        stop_token="eos",
        response_length=R,
        temperature=0.7,
        rloo_k=2,
        train_n=64,
        rollout_logprobs="forward",  # the rollout's policy forward pass is one of the trimmed ones
    )
    trainer.sampler.generate = _early_stopping_generation(trainer, R)
    batch = trainer.producer.prompt_batch(0)
    trimmed = trainer.rollout(batch)
    with monkeypatch.context() as m:
        m.setattr(rollout_steps, "trim_bounds", lambda query_mask, response_mask: (0, response_mask.shape[1]))
        full = trainer.rollout(batch)
    mask = trimmed.response_mask
    assert torch.equal(mask, full.response_mask) and int(trimmed.lengths.max()) == 5
    for key in ("logprobs", "ref_logprobs", "entropy"):
        torch.testing.assert_close(getattr(trimmed, key) * mask, getattr(full, key) * mask, atol=2e-5, rtol=0)
        assert (getattr(trimmed, key)[:, 5:] == 0).all()  # padded back to R with zeros, at masked positions

    # Training forward: a micro-batch whose prompts are all shorter than the rollout's longest one.
    qlen = trimmed.query_mask.sum(1)
    idx = torch.nonzero(qlen < qlen.max()).flatten()[:4]
    start, end = forward.trim_bounds(trimmed.query_mask[idx], mask[idx])
    assert start > 0 and end == 5
    model = trainer.model
    for token_level in (False, True):
        trainer.args.token_level_kl = token_level
        trimmed_adv = trainer.compute_advantages(trimmed, trainer.token_rewards(trimmed))
        results = []
        for bounds in (None, (0, R)):
            model.zero_grad()
            logprobs, values, entropy = trainer.loop.training_forward(model, trimmed, idx, bounds)
            assert values is None and logprobs.shape == entropy.shape == (len(idx), R)
            assert (
                entropy.requires_grad
            )  # differentiable (entropy_coeff); unused here, no backward through it
            loss, _ = trainer.compute_policy_loss(trimmed, trimmed_adv, idx, logprobs, values)
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            results.append((logprobs.detach() * mask[idx], entropy * mask[idx], loss.detach(), grads))
        (lp_t, ent_t, loss_t, grads_t), (lp_f, ent_f, loss_f, grads_f) = results
        torch.testing.assert_close(lp_t, lp_f, atol=2e-5, rtol=0)
        torch.testing.assert_close(ent_t, ent_f, atol=2e-5, rtol=0)
        torch.testing.assert_close(loss_t, loss_f, atol=1e-6, rtol=1e-5)
        assert len(grads_t) == len(grads_f) > 0
        for a, b in zip(grads_t, grads_f, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_the_unwrapped_model_is_cached_per_wrapper(kit, tmp_path, monkeypatch):
    """The policy property unwraps once per wrapper object (accelerate's unwrap_model reads package
    metadata on every call), and a new wrapper (as train() makes under DDP/DeepSpeed) is unwrapped anew."""
    from rlhf_trainers.onpolicy import PolicyAndValue

    trainer = _trainer(kit, tmp_path)
    calls = []
    unwrap = trainer.accelerator.unwrap_model
    monkeypatch.setattr(
        trainer.accelerator, "unwrap_model", lambda m, *a, **k: calls.append(m) or unwrap(m, *a, **k)
    )
    first = trainer.policy
    assert trainer.policy is first and trainer.value_model is None and len(calls) <= 1
    other = PolicyAndValue(kit.load_model("llama-sft"))
    trainer.model_wrapped = other
    assert trainer.policy is other.policy and calls[-1] is other


def test_num_eos_tokens_counts_only_eos_inside_responses_when_pad_is_eos(kit, tmp_path):
    # A tokenizer whose pad token is its EOS token: the padding written after a response's stop token is
    # EOS too, and must not be counted. With stop_token="eos" each stopped response holds exactly one EOS.
    tokenizer = kit.load_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    trainer = RLOOTrainer(
        model=kit.load_model("llama-sft"),
        processing_class=tokenizer,
        reward_funcs=true_reward,
        args=_config(tmp_path, response_length=12, max_steps=3),
        train_dataset=kit.prompt_dataset("train", n=64),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "val/num_eos_tokens" in h]
    completions = trainer.args.per_device_train_batch_size  # one process, one mini-batch
    assert len(logs) == 3
    for log in logs:
        stopped = log["val/stop_token_rate"] * completions
        assert log["val/num_eos_tokens"] == pytest.approx(stopped)
    # Some responses stopped before the last position, so padding existed to be miscounted.
    assert any(0 < log["val/response_length"] < 12 for log in logs)


# ---- TRL 1.x names ------------------------------------------------------------------------------


def test_trl_1x_names_set_the_blogs_fields_and_train(kit, tmp_path, reward_model_dir):
    """TRL 1.x's RLOOConfig names (GRPO style) next to the blog's; a reward model in reward_funcs."""
    args = RLOOConfig(
        output_dir=str(tmp_path / "trl1x"),
        num_generations=4,
        beta=0.03,
        epsilon=0.25,
        epsilon_high=0.3,
        num_iterations=2,
        max_completion_length=8,
        normalize_advantages=True,
        per_device_train_batch_size=8,
        max_steps=2,
        report_to="none",
        use_cpu=True,
        num_sample_generations=0,
    )
    assert (args.rloo_k, args.kl_coef, args.cliprange, args.cliprange_high) == (4, 0.03, 0.25, 0.3)
    assert (args.num_ppo_epochs, args.response_length, args.normalize_advantage) == (2, 8, True)
    trainer = RLOOTrainer(
        model=str(kit.model_path("llama-sft")),
        reward_funcs=[true_reward, str(reward_model_dir)],
        args=args,
        train_dataset=kit.prompt_dataset("train", n=32),
        processing_class=kit.load_tokenizer(),
    )
    assert trainer.reward_model is not None
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "objective/scores/reward_model" in h)
    assert "objective/scores/true_reward" in logged
    with pytest.raises(ValueError, match="num_generations=4 and rloo_k=3 name the same setting"):
        _config(tmp_path, num_generations=4, rloo_k=3)
    with pytest.raises(ValueError, match=r"beta=0\.1 and kl_coef=0\.2"):
        _config(tmp_path, beta=0.1, kl_coef=0.2)
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' with token_level_kl=False"):
        _config(tmp_path, importance_sampling_level="sequence")
