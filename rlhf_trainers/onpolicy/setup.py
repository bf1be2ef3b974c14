"""What the on-policy engine does at construction: before ``transformers.Trainer.__init__`` the policy's
tokenizer, the stop tokens, and loading and checking the models; after it the
prompt tokenization and the batch plan."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from ..compat import peft_wrap
from ..data import PromptTokenizationStats, tokenize_prompts
from ..distributed import copy_model
from ..model_paths import check_model_path, check_model_paths
from ..models import (
    _is_peft_model,
    check_one_label,
    check_onpolicy_models,
    disable_dropout,
    embedding_rows,
    has_peft_adapter,
    load_reward_model,
    require_peft,
    seeded,
    tokenizer_of,
)
from ..rewards import RewardSources
from .config import OnPolicyConfig

if TYPE_CHECKING:
    import datasets
    from peft import PeftConfig
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


def rollout_inputs(
    trainer: Any,
    args: OnPolicyConfig,
    model: Any,
    processing_class: Any,
    train_dataset: Any,
    paths: dict[str, Any],
    reward_model: Any,
    reward_funcs: Any,
    options: dict[str, Any],
) -> tuple[Any, Any, list[Any]]:
    """What a trainer's construction checks before any model loads, through its producer hooks
    (:class:`~rlhf_trainers.onpolicy.producer.ProducerHooks`): the train dataset (an environment may
    own the data), the inputs (:func:`check_inputs`), the rollout ``options`` (``tools``,
    ``environment_factory``, ``rollout_func``) and the reward sources they add; a run without any reward
    is refused. Returns ``(train_dataset, processing_class, extra_reward_sources)``."""
    environment_factory = options.get("environment_factory")
    train_dataset = trainer.default_train_dataset(train_dataset, args, environment_factory)
    # (with environments, get_reward may be the reward: checked once they are made)
    rewarded = reward_funcs if environment_factory is None else True
    check_inputs(type(trainer).__name__, args, train_dataset, paths, rewarded)
    processing_class = trainer.setup_rollouts(args, model, processing_class, **options)
    extra_rewards = trainer.extra_reward_sources(args)
    if reward_model is None and not reward_funcs and not extra_rewards:
        raise ValueError(
            "No reward: pass reward_model=, reward_funcs=, or an environment_factory whose environments "
            "define get_reward() (none of them does)."
        )
    return train_dataset, processing_class, extra_rewards


def check_inputs(
    trainer_name: str,
    args: OnPolicyConfig,
    train_dataset: Any,
    paths: dict[str, Any],
    reward_funcs: Any,
) -> None:
    """The trainer's arguments that can be checked before anything loads, each with one clear error:
    a train dataset is given, every model path names something loadable, and there is a reward."""
    if train_dataset is None:
        raise ValueError(
            f"{trainer_name} needs a train_dataset of prompts (a 'prompt' column of text or chat "
            "messages, or an 'input_ids' column)."
        )
    check_model_paths(paths, args.model_init_kwargs)
    if paths.get("reward_model") is None and not reward_funcs:
        raise ValueError(
            "No reward: pass reward_model= (a one-label sequence-classification model or its path), "
            "reward_funcs= (f(prompts, completions, **columns) -> list[float]), or both."
        )


def policy_tokenizer(
    model: str | os.PathLike[str] | PreTrainedModel, processing_class: PreTrainedTokenizerBase | None
) -> PreTrainedTokenizerBase:
    """The policy's tokenizer: ``processing_class``, or loaded from the model's path; it must have a pad
    token (prompts are left-padded into batches)."""
    processing_class = tokenizer_of(model, processing_class, "the policy's tokenizer")
    if processing_class.pad_token_id is None:
        raise ValueError(
            "The policy tokenizer has no pad token; prompts are left-padded into batches. Add a dedicated one "
            "(LHPD pads with a token distinct from EOS): tokenizer.add_special_tokens({'pad_token': "
            "'<|pad|>'}) and model.resize_token_embeddings(len(tokenizer))."
        )
    return processing_class


def resolve_stop_ids(args: OnPolicyConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids a response stops at: ``stop_token_id``, the EOS token (``stop_token='eos'``), or none."""
    if args.stop_token_id is not None:
        return [int(args.stop_token_id)]
    if args.stop_token == "eos":
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "stop_token='eos' but the tokenizer has no EOS token; set stop_token_id=<id> or "
                "stop_token=None (fixed-length responses)."
            )
        return [int(tokenizer.eos_token_id)]
    return []


def load_causal_lm(
    model: str | os.PathLike[str] | PreTrainedModel, kwargs: dict[str, Any] | None, what: str
) -> PreTrainedModel:
    """``model`` itself when it is a model with ``generate``, else ``AutoModelForCausalLM`` loaded from the path."""
    if not isinstance(model, (str, os.PathLike)):
        if not hasattr(model, "generate"):
            raise TypeError(
                f"The {what} must be a causal language model (e.g. AutoModelForCausalLM), got "
                f"{type(model).__name__}."
            )
        return model
    from transformers import AutoModelForCausalLM

    check_model_path(model, what, model_kwargs=kwargs)
    return AutoModelForCausalLM.from_pretrained(model, **dict(kwargs or {}))


@dataclass
class OnPolicyModels:
    """The models of an on-policy run, loaded, checked and placed in train/eval mode."""

    policy: PreTrainedModel
    """The trained causal LM (a PeftModel under ``peft_config``)."""
    ref_model: PreTrainedModel | None
    """The frozen reference; None under PEFT (the policy with its adapter disabled)."""
    reward_model: PreTrainedModel | None
    """The frozen one-label reward model, if any."""
    value_model: PreTrainedModel | None
    """PPO's value model (trained with the policy); None for RLOO."""
    reward_processing_class: PreTrainedTokenizerBase | None
    """The reward model's own tokenizer (given, or loaded from the reward model's path)."""
    is_peft: bool
    """Whether the policy is a PEFT model."""
    vocab: int
    """Rows of the policy's input embeddings."""


def load_models(
    model: str | os.PathLike[str] | PreTrainedModel,
    ref_model: str | os.PathLike[str] | PreTrainedModel | None,
    reward_model: str | os.PathLike[str] | PreTrainedModel | None,
    value_model: str | os.PathLike[str] | PreTrainedModel | None,
    reward_processing_class: PreTrainedTokenizerBase | None,
    peft_config: PeftConfig | None,
    processing_class: PreTrainedTokenizerBase,
    args: OnPolicyConfig,
    build_value_model: Callable[..., PreTrainedModel | None],
) -> OnPolicyModels:
    """Load the policy, reference, reward and value models (paths or instances), apply ``peft_config``,
    copy the policy as the reference when none is given (not under PEFT), check the vocabularies, turn
    dropout off (``disable_dropout``) and freeze the reference and reward models. ``build_value_model``
    is the trainer's hook ``(policy, reward_model, value_model, args) -> value model or None``."""
    if peft_config is not None and has_peft_adapter(model):
        raise ValueError(
            "model already has a PEFT adapter and peft_config was given too; pass the base model with "
            "peft_config, or the PeftModel without it."
        )
    policy = load_causal_lm(model, args.model_init_kwargs, "policy")
    if ref_model is not None and not args.uses_reference_model:
        logger.warning(
            "ref_model is not used: no KL term reads it (kl_coef=0, kl_loss_coef=0, adaptive_kl=False), so it "
            "is neither loaded nor run. Set kl_coef (KL in the reward) or kl_loss_coef / beta (KL as a loss) "
            "to use it."
        )
        ref_model = None
    if ref_model is not None:
        ref_model = load_causal_lm(ref_model, args.model_init_kwargs, "reference model")
    if isinstance(reward_model, (str, os.PathLike)):
        reward_path = reward_model
        reward_model, _ = load_reward_model(
            reward_model, init_head=False, model_kwargs=args.model_init_kwargs
        )
        if reward_processing_class is None and os.path.isfile(
            os.path.join(reward_path, "tokenizer_config.json")
        ):
            from transformers import AutoTokenizer

            reward_processing_class = AutoTokenizer.from_pretrained(reward_path)
    elif reward_model is not None:
        check_one_label(reward_model)
    value = build_value_model(policy, reward_model, value_model, args)
    if peft_config is not None:
        require_peft("peft_config")
        with seeded(args.seed):  # the adapter's initial weights follow the config's seed
            policy = peft_wrap(policy, peft_config)
    is_peft = _is_peft_model(policy)
    if ref_model is None and not is_peft and args.uses_reference_model:
        ref_model = copy_model(policy)
    # A pad id past the embedding table (the RLOO blog's "[PAD]", added without resizing) is accepted:
    # it never reaches an embedding (ModelPasses.input_pad_id, the generation backends, the reward
    # model's pooled_scores).
    vocab = embedding_rows(policy)
    if ref_model is not None and embedding_rows(ref_model) != vocab:
        raise ValueError(
            f"The reference model's vocabulary ({embedding_rows(ref_model)}) differs from the policy's ({vocab}); "
            "the KL penalty compares log-probs of the same token ids, so both must share a tokenizer."
        )
    for loaded in (policy, ref_model, reward_model, value):
        if loaded is not None and args.disable_dropout:
            disable_dropout(loaded)
    if ref_model is not None:
        ref_model.eval().requires_grad_(False)
    if reward_model is not None:
        reward_model.eval().requires_grad_(False)
    return OnPolicyModels(policy, ref_model, reward_model, value, reward_processing_class, is_peft, vocab)


@dataclass
class BatchPlan:
    """The sizes of one update and of the run, from the config (TRL's names), checked before any work."""

    local_prompts: int
    """Prompts per update on this process."""
    batch_size: int
    """Completions per update over all processes."""
    prompts_per_update: int
    """Prompts per update over all processes."""
    updates_per_data_epoch: int
    """Updates in one pass over the train prompts."""
    num_updates: int
    """Updates in the run (``max_steps``, or ``total_episodes`` / ``num_train_epochs``)."""
    total_episodes: int
    """Completions in the run."""


def batch_plan(
    args: OnPolicyConfig,
    *,
    completions_per_prompt: int,
    completions_name: str,
    num_prompts: int,
    world: int,
    steps_per_update: int,
    deepspeed: bool,
) -> BatchPlan:
    """The :class:`BatchPlan` of a run on ``world`` processes over ``num_prompts`` train prompts, or a
    ValueError naming the sizes that do not fit (``completions_name`` names the config field of
    ``completions_per_prompt`` in the message)."""
    k = completions_per_prompt
    if args.max_tokens_per_microbatch is not None and deepspeed:
        raise ValueError(
            f"max_tokens_per_microbatch={args.max_tokens_per_microbatch} under DeepSpeed: DeepSpeed counts "
            "gradient_accumulation_steps micro-batches per optimizer step, while a token budget makes that "
            "number vary. Use fixed micro-batches (max_tokens_per_microbatch=None) with DeepSpeed."
        )
    if args.dynamic_sampling and k < 2:
        raise ValueError(
            f"dynamic_sampling=True with {completions_name}={k}: it drops prompts whose "
            "completions all scored alike, which needs 2 or more completions per prompt."
        )
    if args.local_batch_size % k:
        raise ValueError(
            f"A rollout of per_device_train_batch_size ({args.per_device_train_batch_size}) x "
            f"gradient_accumulation_steps ({args.gradient_accumulation_steps}) x num_mini_batches "
            f"({args.num_mini_batches}) = {args.local_batch_size} completions per process must be a multiple "
            f"of {completions_name}={k} (all completions of a prompt stay on one process); change "
            f"per_device_train_batch_size or {completions_name}."
        )
    local_prompts = args.local_batch_size // k
    batch_size = args.local_batch_size * world
    prompts_per_update = local_prompts * world
    if num_prompts < prompts_per_update:
        raise ValueError(
            f"The train dataset has {num_prompts} prompts but one update needs {prompts_per_update} "
            f"({local_prompts} per process x {world} processes); add prompts or lower "
            "per_device_train_batch_size, gradient_accumulation_steps or num_mini_batches."
        )
    if args.max_steps and args.max_steps > 0:
        # max_steps counts Trainer steps: updates, or optimizer steps where a step is one (GRPO).
        num_updates = math.ceil(args.max_steps / steps_per_update)
    else:
        total = args.total_episodes or int(args.num_train_epochs * num_prompts * k)
        num_updates = max(1, math.ceil(total / batch_size))
    return BatchPlan(
        local_prompts=local_prompts,
        batch_size=batch_size,
        prompts_per_update=prompts_per_update,
        updates_per_data_epoch=num_prompts // prompts_per_update,
        num_updates=num_updates,
        total_episodes=num_updates * batch_size,
    )


def tokenize(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    args: OnPolicyConfig,
    vocab_size: int,
    name: str,
    stats: dict[str, PromptTokenizationStats],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> datasets.Dataset:
    """``dataset``'s prompts tokenized (chat template, ``max_prompt_length`` from the left), with its
    statistics stored in ``stats[name]`` and a warning when prompts were truncated."""
    tokenized, stats[name] = tokenize_prompts(
        dataset,
        tokenizer,
        max_prompt_length=args.max_prompt_length,
        vocab_size=vocab_size,
        num_proc=args.dataset_num_proc,
        chat_template_kwargs=chat_template_kwargs,
    )
    if stats[name].num_truncated:
        # with tools the cut start is the system turn that describes them (TRL keeps prompts whole)
        tools = " That start holds the tools' descriptions (tools=): set max_prompt_length=None to keep them."
        logger.warning(
            "%s dataset: %d of %d prompts were longer than max_prompt_length=%s tokens (longest %d) and were "
            "truncated from the left.%s",
            name,
            stats[name].num_truncated,
            stats[name].num_rows,
            args.max_prompt_length,
            stats[name].longest,
            tools if chat_template_kwargs and chat_template_kwargs.get("tools") else "",
        )
    return tokenized


def prepare_prompts(
    train_dataset: datasets.Dataset,
    eval_dataset: datasets.Dataset | None,
    tokenizer: PreTrainedTokenizerBase,
    args: OnPolicyConfig,
    models: OnPolicyModels,
    *,
    stop_ids: list[int],
    reward_model_reads_ids: bool,
    value_model_given: bool,
    stats: dict[str, PromptTokenizationStats],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Tokenize the prompt datasets (the main process first, so the others read its cache) and check
    the models against them (:func:`~rlhf_trainers.models.check_onpolicy_models`)."""
    from accelerate import PartialState

    with PartialState().main_process_first():
        kwargs = chat_template_kwargs
        train_dataset = tokenize(train_dataset, tokenizer, args, models.vocab, "train", stats, kwargs)
        if eval_dataset is not None:
            eval_dataset = tokenize(eval_dataset, tokenizer, args, models.vocab, "eval", stats, kwargs)
    check_onpolicy_models(
        models.policy,
        tokenizer,
        prompts={"train": train_dataset, **({"eval": eval_dataset} if eval_dataset is not None else {})},
        response_length=args.response_length,
        stop_token_ids=stop_ids,
        truncate_after=args.truncate_after,
        ref_model=models.ref_model,
        value_model=models.value_model,
        reward_model=models.reward_model,
        reward_model_reads_ids=reward_model_reads_ids,
        value_model_from_reward_model=not value_model_given
        and getattr(args, "value_model_init", None) == "reward_model",
    )
    return train_dataset, eval_dataset


def fill_deepspeed_bucket_sizes(trainer: Any) -> None:
    """Fill the "auto" ZeRO bucket sizes of a DeepSpeed config file from the policy's hidden size, as
    transformers does from ``model.config.hidden_size`` when the engine starts: the trained module
    (policy + value model) has no ``config``, and transformers would raise instead."""
    plugin = trainer.accelerator.state.deepspeed_plugin if trainer.is_deepspeed_enabled else None
    hf_config = getattr(plugin, "hf_ds_config", None)
    hidden = getattr(getattr(trainer.policy, "config", None), "hidden_size", None)
    if hf_config is None or not isinstance(hidden, int):
        return
    hf_config.fill_only("zero_optimization.reduce_bucket_size", hidden * hidden)
    if hf_config.is_zero3():
        hf_config.fill_only("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        hf_config.fill_only("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)


def reward_sources(
    models: OnPolicyModels,
    tokenizer: PreTrainedTokenizerBase,
    reward_funcs: Any,
    args: OnPolicyConfig,
    extra_sources: Sequence[Any] = (),
) -> RewardSources:
    """Every reward source of the run: the reward model (if any) and the reward functions or sources,
    weighted by ``reward_weights``, then ``extra_sources`` (an environment's ``get_reward``), weight 1
    each as in TRL (``reward_weights`` lists the others only)."""
    weights = args.reward_weights
    if extra_sources:
        entries = RewardSources._as_entry_list(reward_funcs)
        reward_funcs = [*entries, *extra_sources]
        weights = None if weights is None else [*weights, *[1.0] * len(extra_sources)]
    return RewardSources(
        policy_tokenizer=tokenizer,
        reward_model=models.reward_model,
        reward_tokenizer=models.reward_processing_class,
        reward_funcs=reward_funcs,
        reward_weights=weights,
        batch_size=args.reward_batch_size,
        on_error=args.reward_func_errors,
        padding_free=args.padding_free,
    )
