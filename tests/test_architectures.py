"""PPO and RLOO on tiny random models of the causal-LM architectures TRL's own PPO tests used.

Each architecture is built offline from its config (2 layers, hidden 64, head_dim 16, the kit
tokenizer's vocabulary); each trainer constructs, trains two updates with a reward function, saves, and
the saved policy (and PPO's value model) loads back with the loaders the library uses. Cohere has no
``...ForSequenceClassification`` class in transformers: its value model (and a reward model built from
its checkpoint) is a :class:`~rlhf_trainers.score_head.ScoreHeadModel`.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from rlhf_trainers import PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.models import find_score_head, load_reward_model
from rlhf_trainers.onpolicy.checkpoint import VALUE_MODEL_DIR
from rlhf_trainers.ppo.trainer import value_model_from_policy
from rlhf_trainers.score_head import ScoreHeadModel, has_sequence_classification_class
from rlhf_trainers.testing import true_reward

# Sizes in each config's own field names (GPT-2 and Bloom predate the common names).
_LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
ARCHITECTURES = {
    "Bloom": ("BloomConfig", {"hidden_size": 64, "n_layer": 2, "n_head": 4}),
    "Cohere": ("CohereConfig", _LLAMA_LIKE),
    "Gemma": ("GemmaConfig", {**_LLAMA_LIKE, "head_dim": 16}),
    "Gemma2": ("Gemma2Config", {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 64}),
    "GPT-2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    "GPT-NeoX": (
        "GPTNeoXConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 128,
        },
    ),
    "Llama": ("LlamaConfig", _LLAMA_LIKE),
    "Mistral": ("MistralConfig", {**_LLAMA_LIKE, "sliding_window": None}),
    "OPT": (
        "OPTConfig",
        {
            "hidden_size": 64,
            "ffn_dim": 128,
            "word_embed_proj_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 128,
        },
    ),
    "Phi3": ("Phi3Config", _LLAMA_LIKE),
    "Qwen2": ("Qwen2Config", _LLAMA_LIKE),
    "Qwen3": ("Qwen3Config", {**_LLAMA_LIKE, "head_dim": 16}),
}


def tiny_model(name: str, tokenizer) -> transformers.PreTrainedModel:
    """A random causal LM of architecture ``name`` sized for the kit's tokenizer (fails, not skips,
    when transformers lacks the architecture)."""
    config_name, sizes = ARCHITECTURES[name]
    config_class = getattr(transformers, config_name, None)
    assert config_class is not None, f"transformers {transformers.__version__} has no {config_name}"
    config = config_class(
        **{
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **sizes,
        }
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _args(config_class, tmp_path):
    return config_class(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_mini_batches=1,
        num_ppo_epochs=1,
        response_length=6,
        learning_rate=1e-3,
        max_steps=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        num_sample_generations=0,
        disable_tqdm=True,
    )


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sb if k in sa) and set(sb) <= set(sa)


@pytest.mark.parametrize("trainer_class", [PPOTrainer, RLOOTrainer], ids=["PPO", "RLOO"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_trains_saves_and_reloads(kit, tmp_path, name, trainer_class):
    tokenizer = kit.load_tokenizer()
    config_class = PPOConfig if trainer_class is PPOTrainer else RLOOConfig
    trainer = trainer_class(
        model=tiny_model(name, tokenizer),
        processing_class=tokenizer,
        args=_args(config_class, tmp_path),
        train_dataset=kit.prompt_dataset("train", n=16),
        reward_funcs=true_reward,
    )
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded) is type(policy)
    assert _same_weights(policy, reloaded)
    if trainer_class is PPOTrainer:
        value = trainer.value_model
        value_reloaded, head_is_new = load_reward_model(out / VALUE_MODEL_DIR, init_head=False)
        assert not head_is_new
        assert type(value_reloaded) is type(value)
        assert _same_weights(value, value_reloaded)
        # Resuming reads the same folders back into the trained module.
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.zero_()
        trainer.load_weights_from_checkpoint(str(out))
        assert _same_weights(value, value_reloaded) and _same_weights(policy, reloaded)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_value_model_from_policy_on_every_architecture(kit, name):
    policy = tiny_model(name, kit.load_tokenizer())
    value = value_model_from_policy(policy)
    if has_sequence_classification_class(policy.config):
        assert type(value).__name__.endswith("ForSequenceClassification")
    else:
        assert isinstance(value, ScoreHeadModel)
    assert _same_weights(getattr(policy, policy.base_model_prefix), getattr(value, value.base_model_prefix))
    _, head = find_score_head(value)
    assert head.weight.shape == (1, policy.config.hidden_size)
    assert not head.weight.any()
    assert value.config.pad_token_id == policy.config.pad_token_id


def test_cohere_has_no_sequence_classification_class_in_transformers(kit):
    """The premise of ScoreHeadModel: if transformers adds the class, Cohere goes through it and
    another architecture should exercise the fallback here."""
    assert not has_sequence_classification_class(tiny_model("Cohere", kit.load_tokenizer()).config)


def test_reward_model_from_a_causal_lm_checkpoint_without_a_classifier_class(kit, tmp_path):
    tokenizer = kit.load_tokenizer()
    policy = tiny_model("Cohere", tokenizer)
    policy.save_pretrained(tmp_path / "lm")
    reward_model, head_is_new = load_reward_model(tmp_path / "lm", seed=3)
    assert head_is_new and isinstance(reward_model, ScoreHeadModel)
    assert _same_weights(policy.model, reward_model.model)
    head = reward_model.score.weight
    assert head.any() and head.std().item() < 3.0 / (policy.config.hidden_size + 1) ** 0.5

    # The pooled score is the head at the last non-pad token, whatever the padding side.
    pad = tokenizer.pad_token_id
    reward_model.config.pad_token_id = pad
    ids = torch.tensor([[pad, 5, 6, 7], [5, 6, 7, pad]])
    with torch.no_grad():
        pooled = reward_model(input_ids=ids, attention_mask=(ids != pad).long()).logits
        alone = reward_model(input_ids=ids[:1, 1:]).logits
    assert pooled.shape == (2, 1)
    torch.testing.assert_close(pooled[0], alone[0], rtol=1e-4, atol=1e-5)

    reward_model.save_pretrained(tmp_path / "rm")
    again, head_is_new = load_reward_model(tmp_path / "rm")
    assert not head_is_new and isinstance(again, ScoreHeadModel)
    assert _same_weights(reward_model, again)
