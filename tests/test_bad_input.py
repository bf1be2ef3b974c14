"""Bad input gets an error at construction (issue #8): one table, every case, every trainer it applies to.

Each row of :data:`CASES` is one bad input of the issue's list, the trainers it applies to (reward, PPO,
RLOO), how it changes an otherwise valid construction, and what the message must say: what was given
and what to do about it. :func:`test_valid_construction` proves that the unchanged construction works,
so every error below comes from the bad input alone. :data:`WARNINGS` holds the inputs that work but
deserve a word (a pad token that is also EOS), and :data:`ALLOWED` inputs that look alike but must pass.

Only construction runs (no rollout, no training step): the whole file takes a few seconds on the kit's
tiny models, loaded once per module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import datasets
import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlhf_trainers import PPOConfig, PPOTrainer, RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.testing import OfflineKit, true_reward

TRAINERS = ("reward", "ppo", "rloo")
ONPOLICY = ("ppo", "rloo")

# Small and fast: the smallest rollout each trainer accepts, no saving, no logging.
CONFIG_FIELDS: dict[str, dict[str, Any]] = {
    "reward": {"max_length": 64, "per_device_train_batch_size": 4},
    "ppo": {"per_device_train_batch_size": 4, "response_length": 8, "num_ppo_epochs": 1},
    "rloo": {"per_device_train_batch_size": 4, "response_length": 8, "num_ppo_epochs": 1, "rloo_k": 2},
}
COMMON_FIELDS = {
    "use_cpu": True,
    "report_to": "none",
    "save_strategy": "no",
    "disable_tqdm": True,
    "max_steps": 1,
}
ONPOLICY_FIELDS = {"num_sample_generations": 0}
CONFIG_CLASSES = {"reward": RewardConfig, "ppo": PPOConfig, "rloo": RLOOConfig}
TRAINER_CLASSES = {"reward": RewardTrainer, "ppo": PPOTrainer, "rloo": RLOOTrainer}

# A ZeRO section and batch fields as DeepSpeed configs write them ("auto": filled from the config).
DS_BATCH = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
DS_OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}


class Assets:
    """The kit's models, loaded once per module; the tokenizer is loaded fresh for each construction
    because cases change it."""

    def __init__(self, kit: OfflineKit) -> None:
        self.kit = kit
        self._models: dict[str, PreTrainedModel] = {}

    def model(self, name: str) -> PreTrainedModel:
        """A kit model shared by the module's tests (only cases that leave it unchanged use it)."""
        if name not in self._models:
            self._models[name] = self.kit.load_model(name)
        return self._models[name]

    def fresh(self, name: str) -> PreTrainedModel:
        """A kit model of its own, for cases that change it (adapters)."""
        return self.kit.load_model(name)

    def tokenizer(self, which: str = "main") -> PreTrainedTokenizerBase:
        return self.kit.load_tokenizer(which)


@pytest.fixture(scope="module")
def assets(kit) -> Assets:
    return Assets(kit)


def construct(trainer: str, assets: Assets, tmp_path, config: dict[str, Any] | None = None, **kwargs: Any):
    """The trainer built from valid defaults, with `config` fields and trainer `kwargs` replacing them.

    A callable kwarg value receives the default tokenizer (so a case can derive its dataset from the
    tokenizer it changed)."""
    fields = {**COMMON_FIELDS, **CONFIG_FIELDS[trainer], "output_dir": str(tmp_path / trainer)}
    if trainer in ONPOLICY:
        fields.update(ONPOLICY_FIELDS)
    fields.update(config or {})
    tokenizer = kwargs.pop("processing_class", None) or assets.tokenizer()
    if trainer == "reward":
        defaults: dict[str, Any] = {
            "model": assets.model("llama-seqcls"),
            "train_dataset": assets.kit.preference_dataset("train", n=8),
        }
    else:
        defaults = {
            "model": assets.model("llama-sft"),
            "reward_funcs": true_reward,
            "train_dataset": assets.kit.prompt_dataset("train", n=8),
        }
    defaults.update(kwargs)
    args = CONFIG_CLASSES[trainer](**fields)
    return TRAINER_CLASSES[trainer](args=args, processing_class=tokenizer, **defaults)


# --------------------------------------------------------------------------------------------------
# what the cases change
# --------------------------------------------------------------------------------------------------


def _prompts(**columns: list[Any]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(columns)


def _pairs(**columns: list[Any]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(columns)


def _tokenizer_with(assets: Assets, **special: str) -> PreTrainedTokenizerBase:
    tok = assets.tokenizer()
    for name, value in special.items():
        setattr(tok, name, value)
    return tok


def _pad_is_eos(assets: Assets) -> PreTrainedTokenizerBase:
    tok = assets.tokenizer()
    tok.pad_token = tok.eos_token
    return tok


def _other_vocab_causal_lm(vocab_size: int = 448) -> LlamaForCausalLM:
    """A tiny causal LM whose vocabulary is the kit's other tokenizer's (448 ids, the policy has 627)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _two_labels(assets: Assets) -> PreTrainedModel:
    return AutoModelForSequenceClassification.from_pretrained(
        assets.kit.model_path("llama-seqcls"), num_labels=2, ignore_mismatched_sizes=True
    )


def _peft_model(assets: Assets, trainer: str) -> Any:
    from peft import LoraConfig, get_peft_model

    if trainer == "reward":
        return get_peft_model(
            assets.fresh("llama-seqcls"), LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj"])
        )
    return get_peft_model(assets.fresh("llama-sft"), LoraConfig(target_modules=["q_proj"]))


def _transformers_adapter(assets: Assets, trainer: str) -> PreTrainedModel:
    """A model whose adapter was added through transformers' PEFT integration (not a PeftModel)."""
    from peft import LoraConfig

    model = assets.fresh("llama-seqcls" if trainer == "reward" else "llama-sft")
    config = LoraConfig(target_modules=["q_proj"])
    try:
        model.add_adapter(config)
    except ValueError as error:
        # transformers >= 5.24 asks peft >= 0.22 for its integration, which PyPI did not have when
        # this was written: build the state add_adapter leaves (peft injects the layers, transformers
        # marks the model) the way add_adapter does.
        if "version of PEFT" not in str(error):
            raise
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, model, adapter_name="default")
        model._hf_peft_config_loaded = True
        model.peft_config = {"default": config}
    return model


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(target_modules=["q_proj"])


def _long_text(words: int) -> str:
    return " " + " ".join(["good"] * words) + " ."


def _wrong_signature(texts: list[str]) -> list[float]:
    return [0.0] * len(texts)


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One bad input: `make(assets, trainer)` gives the config fields (key "config") and trainer
    arguments that replace the valid defaults; the message must match every regex of `match`."""

    name: str
    trainers: tuple[str, ...]
    make: Callable[[Assets, str], dict[str, Any]]
    match: tuple[str, ...]
    error: type[Exception] = ValueError
    # per-trainer regexes, where the message differs between the trainers
    match_for: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _per_trainer(reward: Callable[[Assets], dict], onpolicy: Callable[[Assets], dict]):
    return lambda a, t: reward(a) if t == "reward" else onpolicy(a)


CASES: list[Case] = [
    # ---- dataset columns -----------------------------------------------------------------------
    Case(
        "missing dataset column",
        TRAINERS,
        _per_trainer(
            lambda a: {"train_dataset": _pairs(prompt=["the film was"], chosen=[" good ."])},
            lambda a: {"train_dataset": _prompts(text=["the film was"])},
        ),
        (),
        match_for={
            "reward": (
                r"columns \['chosen', 'prompt'\] match no preference format",
                r"missing 'rejected'",
                r"rename_column",
            ),
            "ppo": (r"columns \['text'\] hold no prompts", r"rename_column\(old, 'prompt'\)"),
        },
    ),
    Case(
        "wrong-typed dataset column",
        TRAINERS,
        _per_trainer(
            lambda a: {"train_dataset": _pairs(prompt=["the film was"], chosen=[3], rejected=[4])},
            lambda a: {"train_dataset": _prompts(prompt=[3, 4])},
        ),
        (r"the first row holds int \(3\)",),
        match_for={
            "reward": (
                r"column 'chosen'",
                r"a string .*explicit/implicit.* or a non-empty list of .*messages",
            ),
            "ppo": (r"column 'prompt'", r"a string \(text format\) or a non-empty list of", "input_ids"),
        },
    ),
    Case(
        "missing value in a later row",
        TRAINERS,
        _per_trainer(
            lambda a: {
                "train_dataset": _pairs(
                    prompt=["a", "b"], chosen=[" good .", None], rejected=[" bad .", " x"]
                )
            },
            lambda a: {"train_dataset": _prompts(prompt=["the film was", None, "a b"])},
        ),
        (r"row 1: column '(chosen|prompt)'",),
        match_for={
            "reward": (r"holds NoneType \(None\), expected a string", r"dataset\.filter"),
            "ppo": (r"is missing \(None\)", r"dataset\.filter\(lambda row: row\['prompt'\] is not None\)"),
        },
    ),
    Case(
        "empty prompt",
        ONPOLICY,
        lambda a, t: {"train_dataset": _prompts(prompt=["the film was", ""])},
        (r"row 1: the prompt has 0 tokens", r"Remove empty prompts.*dataset\.filter"),
    ),
    Case(
        "chat prompt ending with the assistant's turn",
        ONPOLICY,
        lambda a, t: {
            "train_dataset": _prompts(
                prompt=[[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "good"}]]
            )
        },
        (r"row 0: the conversation in column 'prompt' ends with an assistant message", r"drop the last turn"),
    ),
    Case(
        "empty dataset",
        TRAINERS,
        _per_trainer(
            lambda a: {"train_dataset": a.kit.preference_dataset("train", n=8).select([])},
            lambda a: {"train_dataset": a.kit.prompt_dataset("train", n=8).select([])},
        ),
        (r"dataset has 0 rows \(columns: \[", r"at least one .*check the split"),
    ),
    # ---- lengths -------------------------------------------------------------------------------
    Case(
        "prompt + response longer than the context",
        ONPOLICY,
        lambda a, t: {"config": {"response_length": 254}},
        (
            r"the longest prompt \(\d+ tokens, after max_prompt_length\) \+ response_length \(254\) = \d+ tokens",
            r"the policy has 256 positions",
            r"Set max_prompt_length .* or lower response_length",
        ),
    ),
    Case(
        "pair longer than the context",
        ("reward",),
        lambda a, t: {
            "config": {"max_length": None},
            "train_dataset": _pairs(prompt=["the film was"], chosen=[_long_text(300)], rejected=[" bad ."]),
        },
        (
            r"the longest side of the train pairs \(max_length=None\) = \d+ tokens",
            r"the reward model has 256 positions",
            r"Set max_length to at most that many",
        ),
    ),
    # ---- tokenizer -----------------------------------------------------------------------------
    Case(
        "tokenizer without pad token",
        TRAINERS,
        lambda a, t: {"processing_class": _tokenizer_with(a, pad_token=None)},
        (r"no pad token", r"add_special_tokens\(\{'pad_token': '<\|pad\|>'\}\)", r"resize_token_embeddings"),
    ),
    Case(
        "pad == eos, fixed-length responses (EOS inside them), reward model on the policy's ids",
        ONPOLICY,
        lambda a, t: {
            "processing_class": _pad_is_eos(a),
            "reward_model": a.model("llama-seqcls"),
            "reward_funcs": None,
            "config": {"stop_token": None},
        },
        (
            r"pad token is its EOS token \(id 0\)",
            r"do not stop at EOS \(stop_token=None",
            r"dedicated pad token",
            r"stop_token='eos', truncate_after=0",
        ),
    ),
    Case(
        "pad == eos, truncate_after > 0, reward model on the policy's ids",
        ONPOLICY,
        lambda a, t: {
            "processing_class": _pad_is_eos(a),
            "reward_model": a.model("llama-seqcls"),
            "reward_funcs": None,
            "config": {"truncate_after": 2},
        },
        (
            r"pad token is its EOS token \(id 0\)",
            r"truncate_after=2: EOS tokens before that index",
            r"dedicated pad token",
        ),
    ),
    Case(
        "pad == eos, a prompt holding EOS, reward model on the policy's ids",
        ONPOLICY,
        lambda a, t: {
            "processing_class": _pad_is_eos(a),
            "reward_model": a.model("llama-seqcls"),
            "reward_funcs": None,
            "train_dataset": _prompts(input_ids=[[20, 21, 22], [0, 23, 24]]),
        },
        (
            r"train dataset, row 1: the prompt holds token id 0, which is both the pad token and the EOS",
            r"dedicated pad token",
        ),
    ),
    Case(
        "prompts padded already",
        ONPOLICY,
        lambda a, t: {"train_dataset": _prompts(input_ids=[[20, 21, 22], [1, 1, 24]])},
        (r"train dataset, row 1: the prompt holds the pad token \(id 1\)", r"Give them unpadded"),
    ),
    # ---- vocabularies and architectures ----------------------------------------------------------
    Case(
        "token ids outside the model's vocabulary",
        TRAINERS,
        _per_trainer(
            lambda a: {
                "train_dataset": _pairs(
                    input_ids_chosen=[[20, 21], [20, 700]], input_ids_rejected=[[22], [23]]
                )
            },
            lambda a: {"train_dataset": _prompts(input_ids=[[20, 21], [20, 700]])},
        ),
        (
            r"row 1: token id 700 is outside the vocabulary \(vocab_size=627, valid ids 0\.\.626\)",
            r"Tokenize it with the (policy|reward model)'s tokenizer",
        ),
    ),
    Case(
        "reference model with another vocabulary",
        ONPOLICY,
        lambda a, t: {"ref_model": _other_vocab_causal_lm()},
        (r"reference model's vocabulary \(448\) differs from the policy's \(627\)", r"share a tokenizer"),
    ),
    Case(
        "reward model with another vocabulary scoring the policy's ids",
        ONPOLICY,
        lambda a, t: {"reward_model": a.model("gpt2-alt-seqcls")},
        (
            r"The reward model has 448 token embeddings but the policy's vocabulary has 627",
            r"reward_processing_class=",
        ),
    ),
    Case(
        "value model with another vocabulary",
        ("ppo",),
        lambda a, t: {"value_model": a.model("gpt2-alt-seqcls")},
        (
            r"The value model has 448 token embeddings but the policy's vocabulary has 627",
            r"value_model_init='policy'",
        ),
    ),
    Case(
        "value model copied from a reward model with its own tokenizer",
        ("ppo",),
        lambda a, t: {
            "reward_model": a.model("gpt2-alt-seqcls"),
            "reward_processing_class": a.tokenizer("alt"),
            "config": {"value_model_init": "reward_model"},
        },
        (
            r"value_model_init='reward_model' copies the reward model, whose tokenizer",
            r"value_model_init='policy'",
        ),
    ),
    Case(
        "policy that is not a causal language model",
        ONPOLICY,
        lambda a, t: {"model": a.model("llama-seqcls")},
        (r"The policy must be a causal language model .* got LlamaForSequenceClassification",),
        error=TypeError,
    ),
    Case(
        "reference model that is not a causal language model",
        ONPOLICY,
        lambda a, t: {"ref_model": a.model("llama-seqcls")},
        (r"The reference model must be a causal language model .* got LlamaForSequenceClassification",),
        error=TypeError,
    ),
    Case(
        "reward model that is a causal LM",
        TRAINERS,
        _per_trainer(
            lambda a: {"model": a.model("llama-sft")},
            lambda a: {"reward_model": a.model("llama-sft"), "reward_funcs": None},
        ),
        (
            r"must be a sequence-classification model with one label, got LlamaForCausalLM",
            r"AutoModelForSequenceClassification\.from_pretrained\(path, num_labels=1\)",
        ),
    ),
    Case(
        "reward model with two labels",
        TRAINERS,
        _per_trainer(
            lambda a: {"model": _two_labels(a)},
            lambda a: {"reward_model": _two_labels(a), "reward_funcs": None},
        ),
        (
            r"must output one scalar, but its config has num_labels=2",
            r"num_labels=1, ignore_mismatched_sizes=True",
        ),
    ),
    Case(
        "value model that is a causal LM",
        ("ppo",),
        lambda a, t: {"value_model": a.model("llama-sft")},
        (r"The value model must be a sequence-classification model with one label, got LlamaForCausalLM",),
    ),
    Case(
        "value model with two labels",
        ("ppo",),
        lambda a, t: {"value_model": _two_labels(a)},
        (r"The value model must output one scalar, but its config has num_labels=2",),
    ),
    Case(
        "PEFT config on a PeftModel",
        TRAINERS,
        lambda a, t: {"model": _peft_model(a, t), "peft_config": _lora()},
        (
            r"model already has a PEFT adapter and peft_config was given too",
            r"pass the base model with peft_config",
        ),
    ),
    Case(
        "PEFT config on a model with an adapter added by transformers",
        TRAINERS,
        lambda a, t: {"model": _transformers_adapter(a, t), "peft_config": _lora()},
        (r"model already has a PEFT adapter and peft_config was given too",),
    ),
    # ---- batch sizes and algorithm settings -----------------------------------------------------
    Case(
        "rollout that is not a multiple of rloo_k",
        ("rloo",),
        lambda a, t: {"config": {"per_device_train_batch_size": 6, "rloo_k": 4}},
        (
            r"= 6 completions per process must be a multiple of rloo_k=4",
            r"change per_device_train_batch_size or rloo_k",
        ),
    ),
    Case(
        "dataset smaller than one update",
        ONPOLICY,
        lambda a, t: {
            "config": {"per_device_train_batch_size": 8, "rloo_k": 2}
            if t == "rloo"
            else {"per_device_train_batch_size": 16},
            "train_dataset": a.kit.prompt_dataset("train", n=3),
        },
        (
            r"The train dataset has 3 prompts but one update needs (16|4) ",
            r"add prompts or lower per_device_train_batch_size",
        ),
    ),
    Case(
        "rloo_k < 2",
        ("rloo",),
        lambda a, t: {"config": {"rloo_k": 1}},
        (r"rloo_k=1: the leave-one-out baseline needs at least 2 completions", r"set rloo_k=2 or more"),
    ),
    Case(
        "response_length < 1",
        TRAINERS,
        lambda a, t: {
            "config": {"normalization_response_length": 0} if t == "reward" else {"response_length": 0}
        },
        (r"response_length=0: (expected an integer >= 1|must be >= 1)",),
    ),
    # ---- reward functions ----------------------------------------------------------------------
    Case(
        "reward function with a wrong signature",
        ONPOLICY,
        lambda a, t: {"reward_funcs": [true_reward, _wrong_signature]},
        (
            r"reward function '_wrong_signature' \(reward_funcs\[1\]\) has the signature \(texts",
            r"Name its parameters `prompts` and `completions`",
            r"def _wrong_signature\(prompts, completions, \*\*kwargs\)",
        ),
        error=TypeError,
    ),
    Case(
        "reward function that is not callable",
        ONPOLICY,
        lambda a, t: {"reward_funcs": [true_reward, "true_reward"]},
        (r"reward_funcs\[1\] must be callable", r"got str: 'true_reward'"),
        error=TypeError,
    ),
    Case(
        "no reward at all",
        ONPOLICY,
        lambda a, t: {"reward_funcs": None},
        (r"No reward: pass reward_model=", r"reward_funcs="),
    ),
    # ---- DeepSpeed -----------------------------------------------------------------------------
    Case(
        "DeepSpeed optimizer section with tf_style_adam",
        ONPOLICY,
        lambda a, t: {
            "config": {
                "tf_style_adam": True,
                "deepspeed": {"zero_optimization": {"stage": 2}, **DS_OPTIMIZER, **DS_BATCH},
            }
        },
        (
            r"tf_style_adam=True, but the DeepSpeed config has an 'optimizer' section",
            r"Remove the 'optimizer' section .* or set tf_style_adam=False",
        ),
    ),
    Case(
        "DeepSpeed optimizer section with critic_learning_rate",
        ("ppo",),
        lambda a, t: {
            "config": {
                "critic_learning_rate": 1e-4,
                "deepspeed": {"zero_optimization": {"stage": 2}, **DS_OPTIMIZER, **DS_BATCH},
            }
        },
        (
            r"critic_learning_rate=0\.0001, but the DeepSpeed config has an 'optimizer' section",
            r"or set critic_learning_rate=None",
        ),
    ),
    Case(
        "DeepSpeed optimizer offload without an optimizer section",
        TRAINERS,
        lambda a, t: {
            "config": {
                "deepspeed": {
                    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                    **DS_BATCH,
                }
            }
        },
        (
            r"offloads the optimizer \(zero_optimization\.offload_optimizer\.device='cpu'\) but has no 'optimizer'",
            r"refuse it when train\(\) starts",
            r'"zero_force_ds_cpu_optimizer": false',
        ),
    ),
    Case(
        "torch_compile under DeepSpeed",
        ONPOLICY,
        lambda a, t: {
            "config": {"torch_compile": True, "deepspeed": {"zero_optimization": {"stage": 2}, **DS_BATCH}}
        },
        (r"torch_compile=True with DeepSpeed", r"Drop torch_compile, or train without DeepSpeed"),
    ),
    Case(
        "ZeRO-3 without gathering the weights on save",
        ONPOLICY,
        lambda a, t: {"config": {"deepspeed": {"zero_optimization": {"stage": 3}, **DS_BATCH}}},
        (
            r"ZeRO-3 with stage3_gather_16bit_weights_on_model_save=None",
            r'"stage3_gather_16bit_weights_on_model_save": true',
            r"zero3_save_16bit_model: true",
        ),
    ),
    # ---- the engine options of issue #23 (every trainer on the engine) ----------------------------
    *[
        Case(
            f"new engine option: {name}={value!r}",
            ONPOLICY,
            lambda a, t, f={name: value}: {"config": f},
            patterns,
        )
        for name, value, patterns in (
            ("kl_loss_coef", -0.1, (r"kl_loss_coef=-0\.1", r">= 0")),
            ("kl_loss_estimator", "k4", (r"kl_loss_estimator='k4'", r"k3")),
            ("importance_sampling_level", "prompt", (r"importance_sampling_level='prompt'", r"sequence")),
            ("loss_agg_mode", "sum", (r"loss_agg_mode='sum'", r"seq-mean-token-sum-norm")),
            ("entropy_coeff", -1.0, (r"entropy_coeff=-1\.0", r">= 0")),
            ("top_k", -1, (r"top_k=-1", r">= 0")),
            ("top_p", 0.0, (r"top_p=0\.0", r"\(0, 1\]")),
            ("min_p", 2.0, (r"min_p=2\.0", r"\[0, 1\]")),
            ("dynamic_sampling_max_rounds", 0, (r"dynamic_sampling_max_rounds=0", r">= 1")),
            ("max_tokens_per_microbatch", 0, (r"max_tokens_per_microbatch=0", r">= 1")),
        )
    ],
    Case(
        "mask_truncated_completions without a stop token",
        ONPOLICY,
        lambda a, t: {"config": {"mask_truncated_completions": True, "stop_token": None}},
        (r"mask_truncated_completions=True without a stop token", r"stop_token='eos'"),
    ),
    Case(
        "dynamic sampling with one completion per prompt",
        ("ppo",),
        lambda a, t: {"config": {"dynamic_sampling": True}},
        (r"dynamic_sampling=True with num_generations=1", r"2 or more completions"),
    ),
    Case(
        "TRL 1.x name conflicting with the blog's",
        ("rloo",),
        lambda a, t: {"config": {"num_generations": 4, "rloo_k": 3}},
        (r"num_generations=4 and rloo_k=3 name the same setting", r"give one of them"),
    ),
]


def _params() -> list[Any]:
    return [
        pytest.param(case, trainer, id=f"{trainer}: {case.name}")
        for case in CASES
        for trainer in case.trainers
    ]


@pytest.fixture
def no_deepspeed_state():
    """Forget a DeepSpeed config a case's TrainingArguments registered (transformers keeps a global
    reference that turns ZeRO-3 loading on for later from_pretrained calls)."""
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


@pytest.mark.parametrize(("case", "trainer"), _params())
def test_bad_input_is_an_error_at_construction(
    case: Case, trainer: str, assets, tmp_path, no_deepspeed_state
):
    changes = case.make(assets, trainer)
    config = changes.pop("config", None)
    with pytest.raises(case.error) as info:
        construct(trainer, assets, tmp_path, config, **changes)
    message = str(info.value)
    patterns = case.match + case.match_for.get(
        trainer, case.match_for.get("ppo" if trainer == "rloo" else "", ())
    )
    for pattern in patterns:
        assert_matches(pattern, message)


def assert_matches(pattern: str, message: str) -> None:
    import re

    assert re.search(pattern, message, re.DOTALL), f"{pattern!r} not in the message:\n{message}"


# Inputs that work but deserve a word: (name, trainers, changes, regexes of the logged warning).
WARNINGS: list[tuple[str, tuple[str, ...], Callable[[Assets, str], dict[str, Any]], tuple[str, ...]]] = [
    (
        "pad == eos (reward model training)",
        ("reward",),
        lambda a, t: {"processing_class": _pad_is_eos(a)},
        (
            r"pad token is its EOS token \(id 0\)",
            r"scored at the token before that EOS",
            r"dedicated pad token",
        ),
    ),
    (
        "pad == eos, responses stopping at EOS, reward model on the policy's ids",
        ONPOLICY,
        lambda a, t: {
            "processing_class": _pad_is_eos(a),
            "reward_model": a.model("llama-seqcls"),
            "reward_funcs": None,
        },
        (
            r"pad token is its EOS token \(id 0\)",
            r"the EOS that ends a response is never scored",
            r"dedicated pad token",
        ),
    ),
]

# Inputs that look like bad ones but work: they must construct, without a warning.
ALLOWED: list[tuple[str, tuple[str, ...], Callable[[Assets, str], dict[str, Any]]]] = [
    (
        "pad == eos with reward functions only (EOS inside responses, and in a prompt)",
        ONPOLICY,
        lambda a, t: {
            "processing_class": _pad_is_eos(a),
            "config": {"stop_token": None},
            "train_dataset": _prompts(input_ids=[[20, 21, 22], [0, 23, 24]] * 4),
        },
    ),
    (
        "reward model with its own tokenizer and vocabulary",
        ONPOLICY,
        lambda a, t: {
            "reward_model": a.model("gpt2-alt-seqcls"),
            "reward_processing_class": a.tokenizer("alt"),
        },
    ),
    (
        "prompts longer than the context, cut by max_prompt_length",
        ONPOLICY,
        lambda a, t: {
            "config": {"max_prompt_length": 64, "response_length": 192},
            "train_dataset": _prompts(prompt=["the film was" + _long_text(300)] * 8),
        },
    ),
    (
        "pairs longer than the context, cut by max_length",
        ("reward",),
        lambda a, t: {
            "config": {"max_length": 256},
            "train_dataset": _pairs(
                prompt=["the film was"] * 2, chosen=[_long_text(300)] * 2, rejected=[" bad ."] * 2
            ),
        },
    ),
]


def _cases(table: list[tuple]) -> list[Any]:
    return [pytest.param(row, trainer, id=f"{trainer}: {row[0]}") for row in table for trainer in row[1]]


@pytest.mark.parametrize(("row", "trainer"), _cases(WARNINGS))
def test_working_but_doubtful_input_is_a_warning(row, trainer, assets, tmp_path, caplog):
    _, _, make, patterns = row
    changes = make(assets, trainer)
    with caplog.at_level(logging.WARNING, logger="rlhf_trainers"):
        construct(trainer, assets, tmp_path, changes.pop("config", None), **changes)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings, "no warning logged"
    message = "\n".join(warnings)
    for pattern in patterns:
        assert_matches(pattern, message)


@pytest.mark.parametrize(("row", "trainer"), _cases(ALLOWED))
def test_input_that_only_looks_bad_constructs_without_a_warning(row, trainer, assets, tmp_path, caplog):
    _, _, make = row
    changes = make(assets, trainer)
    with caplog.at_level(logging.WARNING, logger="rlhf_trainers"):
        built = construct(trainer, assets, tmp_path, changes.pop("config", None), **changes)
    assert len(built.train_dataset) >= 2
    doubts = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "EOS" in r.getMessage()
    ]
    assert not doubts, doubts


@pytest.mark.parametrize("trainer", TRAINERS)
def test_valid_construction(trainer, assets, tmp_path):
    """The defaults every case starts from construct: the errors above come from the bad inputs."""
    built = construct(trainer, assets, tmp_path)
    assert len(built.train_dataset) == 8


def test_every_issue_item_has_a_case():
    """The issue's list, item by item, against the table (a case per trainer where it applies)."""
    names = " | ".join(case.name for case in CASES)
    for item in (
        "missing dataset column",
        "wrong-typed dataset column",
        "empty dataset",
        "longer than the context",
        "without pad token",
        "pad == eos",
        "outside the model's vocabulary",
        "another vocabulary",
        "not a causal language model",
        "multiple of rloo_k",
        "rloo_k < 2",
        "response_length < 1",
        "wrong signature",
        "causal LM",
        "two labels",
        "PEFT config on",
        "ZeRO-3",
    ):
        assert item in names, item
    for trainer in TRAINERS:
        assert sum(trainer in case.trainers for case in CASES) >= 12, trainer


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize(
    "extra",
    [DS_OPTIMIZER, {"zero_force_ds_cpu_optimizer": False}],
    ids=["optimizer section", "zero_force_ds_cpu_optimizer false"],
)
def test_optimizer_offload_that_deepspeed_accepts_constructs(trainer, extra, tmp_path, no_deepspeed_state):
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    config = CONFIG_CLASSES[trainer](
        output_dir=str(tmp_path), report_to="none", deepspeed={"zero_optimization": zero, **DS_BATCH, **extra}
    )
    assert (
        config.deepspeed_plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    )
