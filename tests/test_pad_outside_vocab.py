"""A pad token past the embedding table: the reference implementation's and the RLOO blog's
``tokenizer.add_special_tokens({"pad_token": "[PAD]"})`` without ``resize_token_embeddings``.

The pad id (627, one past the kit's 627 embedding rows) must never reach an embedding: every forward
pass reads 0 at the padding, which the attention masks hide, so a run gives exactly the numbers of the
same run with the kit's own in-vocabulary pad token (id 1).
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhf_trainers import PPOConfig, PPOTrainer, RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.generation import BuiltinSampling, SamplingSettings, TransformersGenerate
from rlhf_trainers.rewards import score_ids, score_texts

KIT_PAD = 1  # "<|pad|>", a row of the kit's embedding tables
NEW_PAD = 627  # "[PAD]", added past them


def _tokenizer(kit, outside: bool):
    tok = kit.load_tokenizer()
    if outside:
        tok.add_special_tokens({"pad_token": "[PAD]"})
        assert tok.pad_token_id == NEW_PAD
    else:
        assert tok.pad_token_id == KIT_PAD
    return tok


def _digest(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])


def test_readable_ids_replace_only_a_pad_id_past_the_table():
    from rlhf_trainers.models import readable_ids, readable_pad_id

    ids = torch.tensor([[627, 627, 5, 0], [3, 4, 627, 626]])
    assert readable_pad_id(627, 627) == 0 and readable_pad_id(-1, 627) == 0
    assert readable_pad_id(1, 627) == 1 and readable_pad_id(None, 627) is None
    assert torch.equal(readable_ids(ids, 627, 627), torch.tensor([[0, 0, 5, 0], [3, 4, 0, 626]]))
    assert readable_ids(ids, 627, 628) is ids  # a row for it: unchanged, not copied
    assert readable_ids(ids, 1, 627) is ids


# ---- generation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [BuiltinSampling, TransformersGenerate])
def test_generation_with_a_pad_id_past_the_table_draws_as_with_an_in_vocabulary_pad(kit, policy, backend):
    # Left-padded prompts, and rows that stop early: the stopped rows' pad id is fed back to the model.
    rows = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]]
    width = max(map(len, rows))
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    eos = kit.load_tokenizer().eos_token_id
    out = {}
    for pad in (KIT_PAD, NEW_PAD):
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        settings = SamplingSettings(
            max_new_tokens=24, pad_token_id=pad, stop_token_ids=[eos], return_logprobs=True
        )
        torch.manual_seed(3)
        out[pad] = backend(policy).sample(ids, mask, settings)
    inside, outside = out[KIT_PAD], out[NEW_PAD]
    stopped = inside.tokens == KIT_PAD
    assert stopped.any()  # some row stopped before the end
    assert torch.equal(outside.tokens == NEW_PAD, stopped)  # the pad id after a stop token, as promised
    assert torch.equal(outside.tokens[~stopped], inside.tokens[~stopped])
    assert torch.equal(outside.logprobs, inside.logprobs)
    assert torch.equal(outside.entropy, inside.entropy)


# ---- reward models ---------------------------------------------------------------------------------


def test_score_ids_reads_the_last_real_token_with_a_pad_id_past_the_table(kit):
    reward_model = kit.load_model("llama-seqcls").eval()
    reward_model.config.pad_token_id = KIT_PAD
    sequences = [[4, 5, 6, 7], [8, 9], [10, 11, 12], [13]]
    width = 7
    alone = torch.cat([score_ids(reward_model, torch.tensor([s]), KIT_PAD) for s in sequences])
    for pad in (KIT_PAD, NEW_PAD):
        # Padded on both sides, as a rollout's left-padded prompt + right-padded response.
        ids = torch.tensor(
            [[pad] * (i % 2) + s + [pad] * (width - len(s) - i % 2) for i, s in enumerate(sequences)]
        )
        torch.testing.assert_close(score_ids(reward_model, ids, pad), alone, rtol=0, atol=1e-6)
    # The config keeps the in-vocabulary id: a pad id past the table is never written there (transformers
    # could not load the saved model: its embedding's padding_idx must be a row).
    assert reward_model.config.pad_token_id == KIT_PAD
    # A model without a pad id in its config (Pythia's): transformers would refuse a batch, but the score
    # is read per token; the config is left as it was.
    reward_model.config.pad_token_id = None
    torch.testing.assert_close(score_ids(reward_model, ids, NEW_PAD), alone, rtol=0, atol=1e-6)
    assert reward_model.config.pad_token_id is None


def test_score_texts_with_a_pad_id_past_the_table(kit):
    reward_model = kit.load_model("llama-seqcls").eval()
    reward_model.config.pad_token_id = KIT_PAD
    texts = ["the food was great", "awful", "the service was slow and the room was cold"]
    inside = score_texts(reward_model, _tokenizer(kit, False), texts)
    outside = score_texts(reward_model, _tokenizer(kit, True), texts)
    assert torch.equal(inside, outside)


def test_pooled_scores_refuses_a_head_that_is_not_applied_per_token():
    from rlhf_trainers.models import pooled_scores

    class MeanPooling(torch.nn.Module):
        """A scorer whose head reads the mean hidden state: no per-token output to read the last token from."""

        config = types.SimpleNamespace(pad_token_id=None)

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.score = torch.nn.Linear(4, 1)

        def get_input_embeddings(self):
            return self.embed

        def forward(self, input_ids, attention_mask, **kwargs):
            hidden = (self.embed(input_ids) * attention_mask[..., None]).mean(1)
            return types.SimpleNamespace(logits=self.score(hidden))

    model = MeanPooling()
    ids, mask = torch.tensor([[4, 5, 8]]), torch.tensor([[1, 1, 0]])
    assert pooled_scores(model, ids.clamp(max=7), mask, 7).shape == (1, 1)  # a pad id it has: its own pooling
    with pytest.raises(ValueError, match=r"not applied to every token.*resize_token_embeddings"):
        pooled_scores(model, ids, mask, 8)
    assert model.config.pad_token_id is None  # restored


def test_reward_trainer_with_a_pad_id_past_the_table_trains_as_with_an_in_vocabulary_pad(kit, tmp_path):
    results = {}
    for outside in (False, True):
        trainer = _reward_trainer(kit, tmp_path / str(outside), outside)
        trainer.train()
        results[outside] = (_digest(trainer.model), trainer.evaluate())
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1]["eval_loss"] == results[False][1]["eval_loss"]
    # Trainer.train copies the tokenizer's pad id into the model's config; a pad id without an embedding
    # row is not saved there (transformers could not load the model again), the model's own is.
    trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "saved"))
    assert loaded.config.pad_token_id == KIT_PAD
    assert torch.equal(_digest(loaded), results[True][0])


def test_reward_trainer_with_lora_and_a_pad_id_past_the_table(kit, tmp_path):
    # The score head is wrapped by PEFT (modules_to_save): its per-token output is still what is read.
    pytest.importorskip("peft")
    from peft import LoraConfig

    results = {}
    for outside in (False, True):
        lora = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
        trainer = _reward_trainer(kit, tmp_path / str(outside), outside, peft_config=lora)
        trainer.train()
        results[outside] = (_digest(trainer.model), trainer.evaluate()["eval_loss"])
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1] == results[False][1]


def _reward_trainer(kit, output_dir, outside: bool, **kwargs) -> RewardTrainer:
    return RewardTrainer(
        model=kit.load_model("llama-seqcls"),
        processing_class=_tokenizer(kit, outside),
        args=RewardConfig(
            output_dir=str(output_dir),
            per_device_train_batch_size=8,
            max_steps=2,
            learning_rate=1e-3,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        ),
        train_dataset=kit.preference_dataset("train", n=16),
        eval_dataset=kit.preference_dataset("test", n=8),
        **kwargs,
    )


# ---- PPO and RLOO ----------------------------------------------------------------------------------


def _onpolicy(kit, tmp_path, algorithm, outside, **overrides):
    config_class, trainer_class = (PPOConfig, PPOTrainer) if algorithm == "ppo" else (RLOOConfig, RLOOTrainer)
    fields = {
        "output_dir": str(tmp_path / f"{algorithm}-{outside}"),
        "per_device_train_batch_size": 8,
        "num_mini_batches": 1,
        "num_ppo_epochs": 1,
        "response_length": 8,
        "learning_rate": 1e-3,
        "max_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "num_sample_generations": 0,
        "disable_tqdm": True,
        "stop_token": "eos",  # responses of different lengths: right padding inside every forward pass
        **({"rloo_k": 2} if algorithm == "rloo" else {}),
        **overrides,
    }
    return trainer_class(
        model=kit.load_model("llama-sft"),
        processing_class=_tokenizer(kit, outside),
        args=config_class(**fields),
        train_dataset=kit.prompt_dataset("train", n=32),
        eval_dataset=kit.prompt_dataset("test", n=8),
        reward_model=kit.load_model("llama-seqcls"),
    )


@pytest.mark.parametrize(
    ("algorithm", "overrides"),
    [
        ("rloo", {}),
        ("ppo", {}),
        # the policy's own forward pass for the rollout log-probs, and transformers.generate
        ("rloo", {"rollout_logprobs": "forward", "generation_loop": "transformers"}),
    ],
)
def test_onpolicy_run_with_a_pad_id_past_the_table_matches_an_in_vocabulary_pad(
    kit, tmp_path, algorithm, overrides
):
    rollouts, digests, logs, evals = {}, {}, {}, {}
    for outside in (False, True):
        trainer = _onpolicy(kit, tmp_path, algorithm, outside, **overrides)
        assert trainer.passes.input_pad_id == KIT_PAD if not outside else trainer.passes.input_pad_id == 0
        torch.manual_seed(0)
        rollouts[outside] = trainer.rollout(trainer.producer.prompt_batch(0))
        trainer = _onpolicy(kit, tmp_path, algorithm, outside, **overrides)
        trainer.train()
        # The policy's and reward model's configs keep their own in-vocabulary pad id.
        assert trainer.policy.config.pad_token_id == trainer.reward_model.config.pad_token_id == KIT_PAD
        digests[outside] = _digest(trainer.policy)
        logs[outside] = trainer.state.log_history[0]
        evals[outside] = trainer.evaluate()
    inside, outside = rollouts[False], rollouts[True]
    mask = inside.response_mask
    assert not mask.all()  # some responses stopped early: padding inside the forward passes
    assert torch.equal(outside.response_mask, mask) and torch.equal(outside.lengths, inside.lengths)
    assert torch.equal(outside.response[mask], inside.response[mask])
    assert bool((outside.response[~mask] == NEW_PAD).all())
    assert bool((inside.response[~mask] == KIT_PAD).all())
    for name in ("logprobs", "ref_logprobs", "entropy", "kl") + (("values",) if algorithm == "ppo" else ()):
        assert torch.equal(getattr(outside, name) * mask, getattr(inside, name) * mask), name
    assert torch.equal(outside.raw_scores, inside.raw_scores)
    # One update: the same parameters, the same logged numbers (timings aside), the same evaluation.
    assert torch.equal(digests[True], digests[False])
    numbers = {k for k in logs[False] if not k.startswith(("timing/", "perf/"))}
    assert {k: logs[True][k] for k in numbers} == {k: logs[False][k] for k in numbers}
    for key in ("eval_objective/scores", "eval_val/response_length"):
        assert evals[True][key] == evals[False][key], key
