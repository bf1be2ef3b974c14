"""What the on-policy engine does at construction: before ``transformers.Trainer.__init__`` the policy's
tokenizer, the stop tokens, and loading and checking the models; after it (:class:`SetupSteps`) the
prompt tokenization, the batch accounting, and the placement of the frozen models."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from ..data import PromptTokenizationStats, tokenize_prompts
from ..distributed import copy_model, deepspeed_inference_engine
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
from ..packing import attention_head_size, one_row_fits, packing_layout
from .config import OnPolicyConfig
from .forward import fused_head_matches

if TYPE_CHECKING:
    import datasets
    from peft import PeftConfig
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


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
        from peft import get_peft_model

        with seeded(args.seed):  # the adapter's initial weights follow the config's seed
            policy = get_peft_model(policy, peft_config)
    is_peft = _is_peft_model(policy)
    if ref_model is None and not is_peft and args.uses_reference_model:
        ref_model = copy_model(policy)
    # A pad id past the embedding table (the RLOO blog's "[PAD]", added without resizing) is accepted:
    # it never reaches an embedding (OnPolicyTrainer._input_pad_id, the generation backends, the reward
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


class SetupSteps:
    """The construction steps of :class:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer` that run after
    ``transformers.Trainer.__init__`` (they need the accelerator), and the prompt tokenization."""

    def _prepare_prompts(
        self,
        train_dataset: datasets.Dataset,
        eval_dataset: datasets.Dataset | None,
        processing_class: PreTrainedTokenizerBase,
        args: OnPolicyConfig,
        models: OnPolicyModels,
        value_model_given: bool,
    ) -> tuple[datasets.Dataset, datasets.Dataset | None]:
        """Tokenize the prompt datasets (the main process first, so the others read its cache) and check
        the models against them (:func:`~rlhf_trainers.models.check_onpolicy_models`)."""
        self.preprocessing_stats: dict[str, PromptTokenizationStats] = {}
        from accelerate import PartialState

        with PartialState().main_process_first():
            train_dataset = self._tokenize(train_dataset, processing_class, args, "train", models.vocab)
            if eval_dataset is not None:
                eval_dataset = self._tokenize(eval_dataset, processing_class, args, "eval", models.vocab)
        check_onpolicy_models(
            models.policy,
            processing_class,
            prompts={"train": train_dataset, **({"eval": eval_dataset} if eval_dataset is not None else {})},
            response_length=args.response_length,
            stop_token_ids=self._stop_ids,
            truncate_after=args.truncate_after,
            ref_model=models.ref_model,
            value_model=models.value_model,
            reward_model=models.reward_model,
            reward_model_reads_ids=self.reward_sources.same_tokenizer,
            value_model_from_reward_model=not value_model_given
            and getattr(args, "value_model_init", None) == "reward_model",
        )
        return train_dataset, eval_dataset

    def _tokenize(
        self,
        dataset: datasets.Dataset,
        tokenizer: PreTrainedTokenizerBase,
        args: OnPolicyConfig,
        name: str,
        vocab_size: int,
    ) -> datasets.Dataset:
        tokenized, stats = tokenize_prompts(
            dataset,
            tokenizer,
            max_prompt_length=args.max_prompt_length,
            vocab_size=vocab_size,
            num_proc=args.dataset_num_proc,
        )
        self.preprocessing_stats[name] = stats
        if stats.num_truncated:
            logger.warning(
                "%s dataset: %d of %d prompts were longer than max_prompt_length=%s tokens (longest %d) and were "
                "truncated from the left.",
                name,
                stats.num_truncated,
                stats.num_rows,
                args.max_prompt_length,
                stats.longest,
            )
        return tokenized

    def _check_batch_sizes(self) -> None:
        """Batch accounting, checked before any work (TRL's names: local_batch_size, mini_batch_size)."""
        args = self.args
        k = self.completions_per_prompt
        world = self.accelerator.num_processes
        if args.max_tokens_per_microbatch is not None and self.is_deepspeed_enabled:
            raise ValueError(
                f"max_tokens_per_microbatch={args.max_tokens_per_microbatch} under DeepSpeed: DeepSpeed counts "
                "gradient_accumulation_steps micro-batches per optimizer step, while a token budget makes that "
                "number vary. Use fixed micro-batches (max_tokens_per_microbatch=None) with DeepSpeed."
            )
        if args.dynamic_sampling and k < 2:
            raise ValueError(
                f"dynamic_sampling=True with {self.completions_per_prompt_name}={k}: it drops prompts whose "
                "completions all scored alike, which needs 2 or more completions per prompt."
            )
        if args.local_batch_size % k:
            name = self.completions_per_prompt_name
            raise ValueError(
                f"A rollout of per_device_train_batch_size ({args.per_device_train_batch_size}) x "
                f"gradient_accumulation_steps ({args.gradient_accumulation_steps}) x num_mini_batches "
                f"({args.num_mini_batches}) = {args.local_batch_size} completions per process must be a multiple "
                f"of {name}={k} (all completions of a prompt stay on one process); change "
                f"per_device_train_batch_size or {name}."
            )
        self.local_prompts = args.local_batch_size // k
        self.batch_size = args.local_batch_size * world
        self.prompts_per_update = self.local_prompts * world
        n = len(self.train_dataset)
        if n < self.prompts_per_update:
            raise ValueError(
                f"The train dataset has {n} prompts but one update needs {self.prompts_per_update} "
                f"({self.local_prompts} per process x {world} processes); add prompts or lower "
                "per_device_train_batch_size, gradient_accumulation_steps or num_mini_batches."
            )
        self.updates_per_data_epoch = n // self.prompts_per_update
        if args.max_steps and args.max_steps > 0:
            # max_steps counts Trainer steps: updates, or optimizer steps where a step is one (GRPO).
            self.num_updates = math.ceil(args.max_steps / self.steps_per_update)
        else:
            total = args.total_episodes or int(args.num_train_epochs * n * k)
            self.num_updates = max(1, math.ceil(total / self.batch_size))
        self.total_episodes = self.num_updates * self.batch_size

    def batch_accounting(self) -> str:
        """The sizes of one update, as printed before training."""
        args = self.args
        world = self.accelerator.num_processes
        k = self.completions_per_prompt
        return (
            f"{type(self).__name__}: {self.prompts_per_update} prompts x {k} completion(s) = {self.batch_size} "
            f"completions per update ({args.local_batch_size} per process x {world} processes) -> "
            f"{args.num_ppo_epochs} epoch(s) x {args.num_mini_batches} mini-batch(es) of "
            f"{args.local_mini_batch_size * world} -> {args.gradient_accumulation_steps} micro-batch(es) of "
            f"{args.per_device_train_batch_size} per process -> "
            f"{args.num_ppo_epochs * args.num_mini_batches} optimizer steps per update; {self.num_updates} "
            f"updates, {self.total_episodes} episodes; generation: {self.generation_backend.name}."
        )

    def _fill_deepspeed_bucket_sizes(self) -> None:
        """Fill the "auto" ZeRO bucket sizes of a DeepSpeed config file from the policy's hidden size, as
        transformers does from ``model.config.hidden_size`` when the engine starts: the trained module
        here (policy + value model) has no ``config``, and transformers would raise instead."""
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        hf_config = getattr(plugin, "hf_ds_config", None)
        hidden = getattr(getattr(self.policy, "config", None), "hidden_size", None)
        if hf_config is None or not isinstance(hidden, int):
            return
        hf_config.fill_only("zero_optimization.reduce_bucket_size", hidden * hidden)
        if hf_config.is_zero3():
            hf_config.fill_only("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
            hf_config.fill_only("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)

    def _prepare_frozen_models(self) -> None:
        """Place the reference and reward models; under DeepSpeed ZeRO-3 wrap them in inference engines so
        their weights are partitioned like the trained ones. Under DeepSpeed ZeRO-1/2 also place the
        trained policy (and value model): ``transformers.Trainer`` leaves that to DeepSpeed's engine, which
        starts in ``train()``, so ``evaluate()`` before ``train()`` would generate with weights on the
        CPU and inputs on the GPU (the engine moves them to the same device anyway)."""
        self._fill_deepspeed_bucket_sizes()
        device = self.accelerator.device
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage < 3:
            self.model.to(device)
        self._ref_forward: Callable[..., Any] | None = None
        self._reward_forward: Callable[..., Any] | None = None
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        for name in ("ref_model", "reward_model"):
            model = getattr(self, name)
            if model is None:
                continue
            if zero3:
                engine = deepspeed_inference_engine(model, self.accelerator)
                setattr(self, f"_{name.split('_')[0]}_forward", engine)
            else:
                model.to(device)

    def _resolve_fused_head(self) -> None:
        """``fused_lm_head``: use the fused log-prob head for the policy and the reference where each
        model passes :func:`fused_head_matches`; never under ZeRO-3 (partitioned lm-head weights)."""
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        on = bool(self.args.fused_lm_head) and not zero3
        self._fused_policy = on and fused_head_matches(self.policy)
        if self.ref_model is None:
            self._fused_ref = self._fused_policy
        else:
            self._fused_ref = on and self._ref_forward is None and fused_head_matches(self.ref_model)

    def _resolve_padding_free(self) -> None:
        """``padding_free``: pack the passes of each model (policy, reference, value model) that has a
        :func:`~rlhf_trainers.packing.packing_layout`; the others keep the padded passes, with an info line
        saying so. The packed passes of a batch share one layout: a single row of all its real tokens when
        every packed model takes it, else rows of the longest sequence. Never under ZeRO-3 (its
        partitioned weights and inference engines were not tried with packing)."""
        self._pack_policy = self._pack_ref = self._pack_values = False
        self._pack_one_row = False
        if not self.args.padding_free:
            return
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            logger.info("padding_free: not under DeepSpeed ZeRO-3; every forward pass stays padded.")
            return
        layouts: list[str] = []

        def check(name: str, model: Any) -> bool:
            layout = packing_layout(model)
            if layout is None:
                logger.info(
                    "padding_free: the %s (%s) does not keep attention within packed sequences (checked on a "
                    "probe at construction); its forward passes stay padded.",
                    name,
                    type(model).__name__,
                )
                return False
            layouts.append(layout)
            return True

        self._pack_policy = check("policy", self.policy)
        if self.ref_model is None:
            self._pack_ref = self._pack_policy  # the policy with its adapter disabled (PEFT), or none
        elif self._ref_forward is None:
            self._pack_ref = check("reference model", self.ref_model)
        if self.value_model is not None:
            self._pack_values = check("value model", self.value_model)
        self._pack_one_row = bool(layouts) and all(layout == "one_row" for layout in layouts)
        if self._pack_one_row:
            dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
            packed = (
                (self.policy, self._pack_policy),
                (self.ref_model, self._pack_ref),
                (self.value_model, self._pack_values),
            )
            models = [m for m, on in packed if m is not None and on]
            fits = all(
                one_row_fits(
                    self.accelerator.device,
                    dtype or next(m.parameters()).dtype,
                    attention_head_size(m),
                )
                for m in models
            )
            if not fits:
                logger.info(
                    "padding_free: on %s in %s the packed passes use rows of the longest sequence (one "
                    "attention call per sequence, the one-row layout's, is slow there without PyTorch's "
                    "variable-length flash attention: torch >= 2.10, fp16/bf16, an Ampere or newer GPU).",
                    self.accelerator.device,
                    dtype or next(self.policy.parameters()).dtype,
                )
                self._pack_one_row = False
