"""RewardTrainer and RewardConfig on the offline kit's synthetic preferences."""

from __future__ import annotations

import json
import math

import datasets
import pytest
import torch
import torch.nn.functional as torch_F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf_trainers import RewardConfig, RewardTrainer
from rlhf_trainers.generation import sample_completions
from rlhf_trainers.models import (
    REWARD_NORMALIZATION_FILE,
    get_reward_normalization,
    load_reward_model,
)
from rlhf_trainers.rewards import join_prompt_completion, score_texts


def _config(tmp_path, **overrides) -> RewardConfig:
    fields = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 32,
        "per_device_eval_batch_size": 64,
        "learning_rate": 3e-3,
        "num_train_epochs": 1,
        "logging_steps": 5,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "max_length": 64,
        "disable_tqdm": True,
    }
    fields.update(overrides)
    return RewardConfig(**fields)


@pytest.fixture(scope="module")
def trained(kit, tmp_path_factory):
    """A reward model trained once on 2048 pairs (shared by the tests that need a trained model)."""
    tmp = tmp_path_factory.mktemp("rm")
    trainer = RewardTrainer(
        model=str(kit.model_path("llama-sft")),
        args=_config(tmp),
        train_dataset=kit.preference_dataset("train"),
        eval_dataset=kit.preference_dataset("test"),
    )
    trainer.train()
    metrics = trainer.evaluate()
    return trainer, metrics


def test_reaches_held_out_accuracy_090(trained):
    trainer, metrics = trained
    assert metrics["eval_accuracy"] >= 0.9, metrics
    assert trainer.head_is_new  # a causal-LM checkpoint got a new scalar head
    assert metrics["eval_margin"] > 0
    assert metrics["eval_min_reward"] <= metrics["eval_mean_reward"] <= metrics["eval_max_reward"]
    train_logs = [log for log in trainer.state.log_history if "loss" in log and "accuracy" in log]
    assert train_logs, trainer.state.log_history
    for key in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert key in train_logs[-1]
    # the loss fell and the training accuracy rose over the run
    assert train_logs[-1]["loss"] < train_logs[0]["loss"]
    assert train_logs[-1]["accuracy"] > train_logs[0]["accuracy"]


def test_rewards_follow_the_hidden_rule(trained, kit):
    trainer, _ = trained
    from rlhf_trainers.testing import true_reward

    prompt = "the movie was"
    completions = [" great .", " plain .", " awful ."]
    texts = [prompt + c for c in completions]
    scores = score_texts(trainer.model, trainer.processing_class, texts)
    truth = true_reward([prompt] * 3, completions)
    assert truth[0] > truth[1] > truth[2]
    assert scores[0] > scores[1] > scores[2], scores


@pytest.mark.parametrize("shape", ["explicit", "implicit", "chat", "tokenized"])
def test_every_dataset_shape_trains(kit, tmp_path, shape):
    tok = kit.load_tokenizer()
    train = kit.preference_dataset("train", n=1024, shape="explicit" if shape == "tokenized" else shape)
    test = kit.preference_dataset("test", n=128, shape="explicit" if shape == "tokenized" else shape)
    if shape == "tokenized":

        def encode(row):
            return {
                "input_ids_chosen": tok(row["prompt"] + row["chosen"])["input_ids"] + [tok.eos_token_id],
                "input_ids_rejected": tok(row["prompt"] + row["rejected"])["input_ids"] + [tok.eos_token_id],
            }

        train = train.map(encode, remove_columns=train.column_names)
        test = test.map(encode, remove_columns=test.column_names)
    trainer = RewardTrainer(
        model=str(kit.model_path("llama-sft")),
        args=_config(tmp_path, per_device_train_batch_size=16),
        train_dataset=train,
        eval_dataset=test,
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    assert after >= 0.75 and after > before + 0.1, (before, after)


def test_explicit_implicit_and_tokenized_give_the_same_inputs(kit, tmp_path):
    tok = kit.load_tokenizer()
    explicit = kit.preference_dataset("train", n=16)
    implicit = kit.preference_dataset("train", n=16, shape="implicit")
    tokenized = explicit.map(
        lambda r: {
            "input_ids_chosen": tok(r["prompt"] + r["chosen"])["input_ids"] + [tok.eos_token_id],
            "input_ids_rejected": tok(r["prompt"] + r["rejected"])["input_ids"] + [tok.eos_token_id],
        },
        remove_columns=explicit.column_names,
    )
    columns = []
    for ds in (explicit, implicit, tokenized):
        trainer = RewardTrainer(str(kit.model_path("llama-sft")), _config(tmp_path), train_dataset=ds)
        columns.append(
            (trainer.train_dataset["input_ids_chosen"], trainer.train_dataset["input_ids_rejected"])
        )
    assert columns[0] == columns[1] == columns[2]


def _batch(trainer):
    """The first 32 pairs, in dataset order, collated as the trainer collates them."""
    features = [trainer.train_dataset[i] for i in range(32)]
    return trainer._prepare_inputs(trainer.data_collator(features))


def test_loss_is_bradley_terry_with_margin(kit, tmp_path):
    pairs = kit.preference_dataset("train", n=32)
    with_margin = pairs.add_column("margin", [float(i % 4) for i in range(32)])
    trainer = RewardTrainer(
        str(kit.model_path("llama-sft")),
        _config(tmp_path, per_device_train_batch_size=32),
        train_dataset=with_margin,
    )
    inputs = _batch(trainer)
    assert inputs["input_ids"].shape[0] == 64  # chosen and rejected in one forward pass
    model = trainer.model
    loss, out = trainer.compute_loss(model, inputs, return_outputs=True)
    margin = inputs["margin"]
    assert margin.tolist() == [float(i % 4) for i in range(32)]
    expected = -torch_F.logsigmoid(out["rewards_chosen"] - out["rewards_rejected"] - margin).mean()
    torch.testing.assert_close(loss, expected)
    no_margin = -torch_F.logsigmoid(out["rewards_chosen"] - out["rewards_rejected"]).mean()
    assert loss > no_margin  # positive margins demand a larger gap


def test_center_rewards_term(kit, tmp_path):
    pairs = kit.preference_dataset("train", n=32)
    trainer = RewardTrainer(
        str(kit.model_path("llama-sft")),
        _config(tmp_path, per_device_train_batch_size=32, center_rewards_coefficient=0.5),
        train_dataset=pairs,
    )
    inputs = _batch(trainer)
    loss, out = trainer.compute_loss(trainer.model, inputs, return_outputs=True)
    rc, rr = out["rewards_chosen"], out["rewards_rejected"]
    expected = -torch_F.logsigmoid(rc - rr).mean() + 0.5 * torch.mean((rc + rr) ** 2)
    torch.testing.assert_close(loss, expected)


def test_centering_pulls_the_mean_reward_to_zero(kit, tmp_path):
    # The pairwise loss cannot see a common shift of the rewards, so without centering their mean
    # drifts wherever training takes it; the centering term holds it near zero.
    pairs = kit.preference_dataset("train", n=512)
    means = {}
    for coef in (None, 1.0):
        trainer = RewardTrainer(
            str(kit.model_path("llama-sft")),
            _config(tmp_path, per_device_train_batch_size=16, center_rewards_coefficient=coef),
            train_dataset=pairs,
            eval_dataset=kit.preference_dataset("test", n=128),
        )
        trainer.train()
        means[coef] = abs(trainer.evaluate()["eval_mean_reward"])
    assert means[1.0] < 0.3, means
    assert means[None] > 3 * means[1.0], means


def test_truncate_keeps_response_end_and_drop_removes(kit, tmp_path):
    pairs = kit.preference_dataset("train", n=64)
    tok = kit.load_tokenizer()
    full = [
        tok(p + c)["input_ids"] + [tok.eos_token_id]
        for p, c in zip(pairs["prompt"], pairs["chosen"], strict=True)
    ]
    limit = sorted(len(x) for x in full)[32]  # about half the pairs are longer
    trunc = RewardTrainer(
        str(kit.model_path("llama-sft")), _config(tmp_path, max_length=limit), train_dataset=pairs
    )
    stats = trunc.preprocessing_stats["train"]
    assert stats.num_truncated > 0 and stats.num_dropped == 0 and len(trunc.train_dataset) == 64
    for ids, original in zip(list(trunc.train_dataset["input_ids_chosen"]), full, strict=True):
        assert ids == original[-limit:]  # the start is cut, the response end (and EOS) kept
    drop = RewardTrainer(
        str(kit.model_path("llama-sft")),
        _config(tmp_path, max_length=limit, long_pairs="drop"),
        train_dataset=pairs,
    )
    dstats = drop.preprocessing_stats["train"]
    assert dstats.num_dropped > 0 and dstats.num_truncated == 0
    assert len(drop.train_dataset) == 64 - dstats.num_dropped
    assert all(
        len(x) <= limit
        for x in list(drop.train_dataset["input_ids_chosen"]) + list(drop.train_dataset["input_ids_rejected"])
    )


def test_fresh_head_is_initialised_like_the_seed_and_trained_head_is_kept(kit, tmp_path):
    model, new = load_reward_model(str(kit.model_path("llama-sft")), seed=0)
    assert new
    w = model.score.weight.detach()
    d = w.shape[-1]
    assert abs(w.std().item() - 1 / math.sqrt(d + 1)) < 0.35 / math.sqrt(d + 1)
    assert model.score.bias is None or torch.all(model.score.bias == 0)
    model.save_pretrained(tmp_path / "rm")
    kit.load_tokenizer().save_pretrained(tmp_path / "rm")
    again, new_again = load_reward_model(str(tmp_path / "rm"))
    assert not new_again
    torch.testing.assert_close(again.score.weight, model.score.weight)


def test_dropout_is_disabled(kit, tmp_path):
    trainer = RewardTrainer(
        str(kit.model_path("gpt2")), _config(tmp_path), train_dataset=kit.preference_dataset("train", n=16)
    )
    probs = [m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert probs and all(p == 0 for p in probs)


def _normalization_check(trainer, kit, policy, seed):
    """Fresh reference-policy samples (a seed not used to fit), scored with the stored normalization."""
    tok = kit.load_tokenizer()
    prompts = list(kit.prompt_dataset("train")["prompt"]) * 8
    torch.manual_seed(seed)
    completions = sample_completions(policy, tok, prompts, response_length=24, batch_size=256)
    texts = [join_prompt_completion(p, c, tok) for p, c in zip(prompts, completions, strict=True)]
    return score_texts(trainer.model, tok, texts, batch_size=256)


def test_normalization_gives_reference_samples_mean_0_std_1_and_survives_reload(trained, kit, tmp_path):
    trainer, _ = trained
    policy = kit.load_model("llama-sft")
    trainer.args.normalization_num_samples = 2304
    trainer.args.normalization_response_length = 24
    trainer.args.normalization_batch_size = 256
    torch.manual_seed(1)
    gain, bias = trainer.normalize_rewards(policy, kit.prompt_dataset("train"))
    assert (gain, bias) == get_reward_normalization(trainer.model) and gain != 1.0
    scores = _normalization_check(trainer, kit, policy, seed=2)
    assert abs(scores.mean().item()) < 0.05, scores.mean()
    assert abs(scores.std().item() - 1) < 0.05, scores.std()

    trainer.save_model(str(tmp_path / "normalized"))
    assert json.loads((tmp_path / "normalized" / REWARD_NORMALIZATION_FILE).read_text()) == {
        "gain": gain,
        "bias": bias,
    }
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "normalized")
    assert (plain.config.reward_gain, plain.config.reward_bias) == (gain, bias)  # in config.json too
    reloaded, _ = load_reward_model(str(tmp_path / "normalized"))
    assert get_reward_normalization(reloaded) == (gain, bias)
    texts = ["the movie was great .", "the movie was awful ."]
    tok = AutoTokenizer.from_pretrained(tmp_path / "normalized")
    torch.testing.assert_close(score_texts(reloaded, tok, texts), score_texts(trainer.model, tok, texts))


def test_normalization_before_and_after_training(kit, tmp_path):
    trainer = RewardTrainer(
        str(kit.model_path("llama-sft")),
        _config(
            tmp_path,
            reward_normalization="before_and_after",
            normalization_num_samples=256,
            normalization_response_length=16,
            normalization_batch_size=128,
        ),
        train_dataset=kit.preference_dataset("train", n=512),
        normalization_policy=str(kit.model_path("llama-sft")),
        normalization_prompts=kit.prompt_dataset("train"),
    )
    seen = []
    original = trainer.normalize_rewards

    def spy(*a, **k):
        seen.append(original(*a, **k))
        return seen[-1]

    trainer.normalize_rewards = spy
    trainer.train()
    assert len(seen) == 2 and seen[0] != seen[1]
    assert get_reward_normalization(trainer.model) == seen[1]


def test_lora_trains_adapter_and_head_and_reloads_identically(kit, tmp_path):
    from peft import AutoPeftModelForSequenceClassification, LoraConfig

    base_path = str(kit.model_path("llama-sft"))
    trainer = RewardTrainer(
        base_path,
        _config(tmp_path, num_train_epochs=2),
        train_dataset=kit.preference_dataset("train"),
        eval_dataset=kit.preference_dataset("test", n=128),
        peft_config=LoraConfig(r=64, lora_alpha=64, target_modules="all-linear"),
    )
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or ".score." in n for n in trainable), trainable
    assert any(".score." in n for n in trainable)
    frozen_before = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad
    }
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_accuracy"] > 0.75, metrics
    for n, p in trainer.model.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n
    trainer.save_model(str(tmp_path / "lora"))
    reloaded = AutoPeftModelForSequenceClassification.from_pretrained(str(tmp_path / "lora"), num_labels=1)
    reloaded.config.pad_token_id = trainer.processing_class.pad_token_id
    texts = ["the movie was great .", "the movie was awful .", "our book feels plain ."]
    tok = trainer.processing_class
    torch.testing.assert_close(
        score_texts(reloaded.eval(), tok, texts), score_texts(trainer.model.eval(), tok, texts)
    )
    merged, _ = load_reward_model(str(tmp_path / "lora"))  # what PPO/RLOO do with an adapter folder
    torch.testing.assert_close(score_texts(merged, tok, texts), score_texts(trainer.model.eval(), tok, texts))


# ---- errors at construction ---------------------------------------------------------------------


def test_missing_columns_are_named_with_the_accepted_formats(kit, tmp_path):
    bad = datasets.Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "loser": ["c"]})
    with pytest.raises(ValueError, match="rejected") as info:
        RewardTrainer(str(kit.model_path("llama-sft")), _config(tmp_path), train_dataset=bad)
    assert "input_ids_chosen" in str(info.value)  # lists the accepted formats


def test_empty_dataset(kit, tmp_path):
    empty = datasets.Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []})
    with pytest.raises(ValueError, match="0 rows"):
        RewardTrainer(str(kit.model_path("llama-sft")), _config(tmp_path), train_dataset=empty)


def test_model_with_more_than_one_label(kit, tmp_path):
    two = AutoModelForSequenceClassification.from_pretrained(
        kit.model_path("llama-seqcls"), num_labels=2, ignore_mismatched_sizes=True
    )
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardTrainer(
            two,
            _config(tmp_path),
            train_dataset=kit.preference_dataset("train", n=8),
            processing_class=kit.load_tokenizer(),
        )


def test_tokenizer_without_pad_token(kit, tmp_path):
    tok = kit.load_tokenizer()
    tok.pad_token = None
    with pytest.raises(ValueError, match="pad token") as info:
        RewardTrainer(
            str(kit.model_path("llama-sft")),
            _config(tmp_path),
            train_dataset=kit.preference_dataset("train", n=8),
            processing_class=tok,
        )
    assert "add_special_tokens" in str(info.value)


def test_config_validation():
    with pytest.raises(ValueError, match="long_pairs='cut'"):
        RewardConfig(output_dir="x", long_pairs="cut", use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="reward_normalization='always'"):
        RewardConfig(output_dir="x", reward_normalization="always", use_cpu=True, report_to="none")


def test_normalization_requires_policy_and_prompts(kit, tmp_path):
    with pytest.raises(ValueError, match="normalization_policy"):
        RewardTrainer(
            str(kit.model_path("llama-sft")),
            _config(tmp_path, reward_normalization="after"),
            train_dataset=kit.preference_dataset("train", n=8),
        )


def test_normalization_samples_ignore_the_policys_generation_config(kit):
    # The reference-policy samples that fit the reward normalization follow softmax(logits / T): settings
    # in the checkpoint's generation_config.json (here a repetition penalty and a suppressed EOS) must not
    # change them.
    tok = kit.load_tokenizer()
    prompts = list(kit.prompt_dataset("train", n=32)["prompt"])
    plain = kit.load_model("llama-sft")
    tweaked = kit.load_model("llama-sft")
    tweaked.generation_config.repetition_penalty = 3.0
    tweaked.generation_config.suppress_tokens = [tok.eos_token_id]
    torch.manual_seed(4)
    want = sample_completions(plain, tok, prompts, response_length=12)
    torch.manual_seed(4)
    got = sample_completions(tweaked, tok, prompts, response_length=12)
    assert got == want
    assert tweaked.generation_config.repetition_penalty == 3.0  # set aside, then restored
    # With the settings applied (what generate() did with them left in place), the samples differ.
    torch.manual_seed(4)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    leaked = tweaked.generate(**enc, max_new_tokens=12, do_sample=True, top_k=0, top_p=1.0)
    leaked_text = tok.batch_decode(leaked[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert leaked_text != want
