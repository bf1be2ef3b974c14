"""OnPolicyTrainer: the loop PPO and RLOO share, as a ``transformers.Trainer``.

One *update* (a Trainer step) is: take the next prompts, generate, score, compute log-probs of the
policy and the reference, build rewards (scores, penalties, per-token KL), let the subclass compute
advantages, then ``num_ppo_epochs`` x ``num_mini_batches`` optimizer steps of gradient-accumulated
micro-batches, each with a fresh shuffle. The subclass supplies only what differs between algorithms:
which extra model it trains (PPO's value model), the advantages, and the loss.

What comes from ``transformers.Trainer`` unchanged: the optimizer and scheduler creation (the schedule
runs over updates, so the linear default anneals the learning rate to zero at the last update, as the
seed does), accelerate/DDP/DeepSpeed preparation, gradient clipping, callbacks, the logging / eval /
save cadence, checkpoint rotation, RNG-state saving and ``resume_from_checkpoint``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, Trainer
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

from .. import functional as F
from ..cpu_linear import OneDNNLinear, onednn_linear_available
from ..data import PromptCollator, PromptTokenizationStats, tokenize_prompts
from ..models import (
    _base,
    _is_peft_model,
    check_one_label,
    check_onpolicy_models,
    disable_dropout,
    embedding_rows,
    generation_config_set_aside,
    has_peft_adapter,
    load_reward_model,
    require_peft,
)
from ..optim import TFStyleAdam
from ..reliability import AtomicCheckpointMixin, reliability_callback
from ..rewards import RewardSources
from ..sampling import sample_completions
from ..trainer_utils import apply_host_memory_settings
from .config import OnPolicyConfig

if TYPE_CHECKING:
    import datasets
    from peft import PeftConfig
    from transformers import PreTrainedModel, TrainerCallback

logger = logging.getLogger(__name__)

ONPOLICY_STATE_FILE = "onpolicy_state.json"
VALUE_MODEL_DIR = "value_model"
SAMPLES_FILE = "samples.jsonl"
# Per-process seed offset (a large prime), so that ranks sample different completions.
RANK_SEED_STRIDE = 100003


class PolicyAndValue(nn.Module):
    """The trained models of an on-policy run in one module: one optimizer, one DDP wrapper, one
    DeepSpeed engine for both (PPO's value model is ``None`` for RLOO).

    ``forward`` returns the policy logits of the last ``logits_to_keep`` positions and, when asked, the
    value model's per-token values (its scalar head applied to every hidden state); given ``response``,
    the response's log-probs and entropy instead of the logits (what the training step uses, through
    the fused lm head where the model allows it).
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: int = 0,
        with_values: bool = False,
        response: torch.Tensor | None = None,
        logprob_options: dict[str, Any] | None = None,
        fused_head: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """``(logits, values)``; with ``response`` (B, R), the response's log-probs and entropy instead of
        the logits: ``(logprobs, values, entropy)`` (see :func:`response_logprobs`)."""
        values = None
        if with_values and self.value_model is not None:
            values = token_values(self.value_model, input_ids, attention_mask, position_ids)
        if response is not None:
            logprobs, entropy = response_logprobs(
                self.policy,
                input_ids,
                attention_mask,
                position_ids,
                response,
                logprob_options or {},
                fused_head=fused_head,
            )
            return logprobs, values, entropy
        logits = policy_logits(self.policy, input_ids, attention_mask, position_ids, logits_to_keep)
        return logits, values


def fused_head_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(backbone, lm_head)`` of a causal LM (under a PEFT wrapper too) whose lm head is a plain
    ``nn.Linear`` without forward hooks; None otherwise (an adapter on the lm head, no backbone
    attribute, a hook that the fused path would skip)."""

    try:
        base = _base(model)
        backbone = getattr(base, base.base_model_prefix, None)
        head = base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(backbone, nn.Module) or type(head) is not nn.Linear:
        return None
    # The fused head reads the weights without calling the module: hooks on it would not run.
    if head._forward_hooks or head._forward_pre_hooks or _global_forward_hooks_set():
        return None
    return backbone, head


def _global_forward_hooks_set() -> bool:
    """Whether ``nn.modules.module.register_module_forward_(pre_)hook`` hooks are registered."""
    from torch.nn.modules import module as _module

    return bool(
        getattr(_module, "_global_forward_hooks", None) or getattr(_module, "_global_forward_pre_hooks", None)
    )


@torch.no_grad()
def fused_head_matches(model: nn.Module) -> bool:
    """Whether the model's logits are exactly ``lm_head(backbone(...).last_hidden_state)``, checked on a
    three-token probe in eval mode: models that scale or soft-cap their logits (Gemma 2, Cohere,
    Granite) fail it and keep the logits path."""
    parts = fused_head_parts(model)
    if parts is None:
        return False
    backbone, head = parts
    device = head.weight.device
    ids = torch.arange(min(3, embedding_rows(model)), device=device).unsqueeze(0)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        logits = model(input_ids=ids, use_cache=False).logits
        fused = head(backbone(input_ids=ids, use_cache=False).last_hidden_state)
    except Exception:  # any failure means: use the logits path
        return False
    finally:
        for module, training in modes:  # each submodule's own mode back, as it was
            module.training = training
    return logits.shape == fused.shape and torch.allclose(logits.float(), fused.float(), rtol=1e-4, atol=1e-5)


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response: torch.Tensor,
    options: dict[str, Any],
    *,
    fused_head: bool = False,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of ``response``, the last R columns of ``input_ids``, and (when asked) the float32
    entropy metric. ``options``: temperature, chunk_size, compute_dtype (the engine's log-prob options).

    With ``fused_head`` (see :func:`fused_head_matches`; ignored while the lm head has forward hooks,
    which the fused path would not run) the backbone's hidden states go through
    :func:`rlhf_trainers.functional.logprobs_and_entropy_from_hidden`, which never holds the (B, R, V)
    logits or their gradient; otherwise the lm head's logits go through the chunked log-softmax."""
    R = response.shape[1]
    temperature = options.get("temperature", 1.0)
    chunk = options.get("chunk_size")
    cdt = options.get("compute_dtype")
    parts = fused_head_parts(model) if fused_head else None
    if parts is not None:  # None also when a hook was put on the lm head after construction
        backbone, head = parts
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state[:, -(R + 1) : -1]
        logprobs, entropy = F.logprobs_and_entropy_from_hidden(
            hidden,
            head.weight,
            response,
            temperature,
            bias=head.bias,
            row_chunk_size=chunk or max(hidden.shape[0] * hidden.shape[1], 1),
            compute_dtype=cdt,
            with_entropy=with_entropy,
        )
        return logprobs, (entropy.float() if entropy is not None else None)
    logits = policy_logits(model, input_ids, attention_mask, position_ids, R + 1)[:, :-1]
    if with_entropy:
        return F.logprobs_and_entropy_from_logits(
            logits, response, temperature, chunk_size=chunk, compute_dtype=cdt, entropy_dtype=torch.float32
        )
    return F.logprobs_from_logits(logits, response, temperature, chunk_size=chunk, compute_dtype=cdt), None


def policy_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """Logits (B, logits_to_keep or T, V) of a causal LM; ``logits_to_keep`` spares the lm-head matmul
    over the prompt."""
    kwargs: dict[str, Any] = {}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    logits = out.logits
    if logits_to_keep and logits.shape[1] != logits_to_keep:
        logits = logits[:, -logits_to_keep:]
    return logits


def token_values(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Per-token outputs (B, T) of a one-label sequence-classification model: its head applied to every
    hidden state, not only the last one (the value of each prefix)."""
    from ..models import find_score_head

    base = _base(model)
    backbone = getattr(base, base.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    head_name, _ = find_score_head(base)
    return getattr(base, head_name)(hidden).squeeze(-1)


def _bounds_of(query_start: torch.Tensor, response_end: torch.Tensor, query_width: int) -> tuple[int, int]:
    """The columns a batch needs from per-row bounds: its earliest first prompt column (at most
    ``query_width - 1``: one prompt column always stays, the one whose output predicts the first
    response token), and its latest response end (at least 1: never an empty response)."""
    if query_start.numel() == 0:
        return 0, 1
    start = min(int(query_start.min()), max(query_width - 1, 0))
    return start, max(int(response_end.max()), 1)


def _trim_bounds(query_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[int, int]:
    """``(start, end)``: the batch's prompt columns before ``start`` and response columns from ``end`` on
    are padding in every row (see :func:`_bounds_of`)."""
    return _bounds_of(
        F.first_true_indices(query_mask), F.last_true_indices(response_mask) + 1, query_mask.shape[1]
    )


def _pad_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """(B, n) -> (B, width) with zeros appended (``values`` itself when ``n == width``)."""
    missing = width - values.shape[1]
    if missing <= 0:
        return values
    return torch.cat([values, values.new_zeros(values.shape[0], missing)], dim=1)


def _load_causal_lm(
    model: str | os.PathLike[str] | PreTrainedModel, kwargs: dict[str, Any] | None, what: str
) -> PreTrainedModel:
    if not isinstance(model, (str, os.PathLike)):
        if not hasattr(model, "generate"):
            raise TypeError(
                f"The {what} must be a causal language model (e.g. AutoModelForCausalLM), got "
                f"{type(model).__name__}."
            )
        return model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, **dict(kwargs or {}))


def _zero3_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that DeepSpeed ZeRO-3 partitioned (loaded under ``zero.Init``)."""
    return [p for p in model.parameters() if hasattr(p, "ds_id")]


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `model`'s state dict with whole tensors, gathering ZeRO-3 partitions (a collective:
    every process must call it)."""
    params = _zero3_params(model)
    gather: Any = contextlib.nullcontext()
    if params:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with gather, torch.no_grad():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """``model.load_state_dict(state)`` that also fills ZeRO-3 partitioned parameters (a collective)."""
    params = _zero3_params(model)
    gather: Any = contextlib.nullcontext()
    if params:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with gather, torch.no_grad():
        return model.load_state_dict(state, strict=strict)


def copy_model(model: PreTrainedModel) -> PreTrainedModel:
    """A deep copy of `model`. Under DeepSpeed ZeRO-3 with ``zero3_init_flag`` a model loaded from a path
    is partitioned and ``copy.deepcopy`` would copy empty shards and DeepSpeed's bookkeeping: the copy is
    then built from the config (partitioned again under ``zero.Init``) and filled with the gathered
    weights."""
    if not _zero3_params(model):
        return copy.deepcopy(model)
    state = _full_state_dict(model)
    dtype = next(iter(model.parameters())).dtype
    clone = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
    _load_full_state_dict(clone, state)
    if getattr(model, "generation_config", None) is not None:
        clone.generation_config = copy.deepcopy(model.generation_config)
    clone.train(model.training)
    return clone


class OnPolicyTrainer(AtomicCheckpointMixin, Trainer):
    """The engine of :class:`~rlhf_trainers.PPOTrainer` and :class:`~rlhf_trainers.RLOOTrainer`.

    Subclasses set ``_config_class`` and ``completions_per_prompt`` and implement
    :meth:`compute_advantages` and :meth:`compute_policy_loss`; PPO also :meth:`build_value_model`.
    The constructor's arguments are documented on the subclasses.
    """

    _config_class: type[OnPolicyConfig] = OnPolicyConfig
    _tag_names: tuple[str, ...] = ("rlhf_trainers",)
    algorithm_name = "on-policy"

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel,
        ref_model: str | os.PathLike[str] | PreTrainedModel | None = None,
        reward_model: str | os.PathLike[str] | PreTrainedModel | None = None,
        args: OnPolicyConfig | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        train_dataset: datasets.Dataset | None = None,
        eval_dataset: datasets.Dataset | None = None,
        peft_config: PeftConfig | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
        reward_processing_class: PreTrainedTokenizerBase | None = None,
        data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
        value_model: str | os.PathLike[str] | PreTrainedModel | None = None,
    ) -> None:
        config_class = self._config_class
        if args is None:
            args = config_class(output_dir=f"{self.algorithm_name.lower()}-output")
        elif not isinstance(args, config_class):
            raise TypeError(
                f"args must be a {config_class.__name__}, got {type(args).__name__}; build one with "
                f"{config_class.__name__}(output_dir=..., **fields) (it accepts every TrainingArguments field)."
            )
        if train_dataset is None:
            raise ValueError(
                f"{type(self).__name__} needs a train_dataset of prompts (a 'prompt' column of text or chat "
                "messages, or an 'input_ids' column)."
            )
        if processing_class is None:
            if not isinstance(model, (str, os.PathLike)):
                raise ValueError(
                    "processing_class (the policy's tokenizer) is required when model is an instance; pass "
                    "processing_class=AutoTokenizer.from_pretrained(<model path>)."
                )
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(model)
        if not isinstance(processing_class, PreTrainedTokenizerBase):
            raise TypeError(
                f"processing_class must be a tokenizer (PreTrainedTokenizerBase), got {type(processing_class).__name__}."
            )
        if processing_class.pad_token_id is None:
            raise ValueError(
                "The policy tokenizer has no pad token; prompts are left-padded into batches. Add a dedicated one "
                "(the seed pads with a token distinct from EOS): tokenizer.add_special_tokens({'pad_token': "
                "'<|pad|>'}) and model.resize_token_embeddings(len(tokenizer))."
            )
        self._stop_ids = self._resolve_stop_ids(args, processing_class)
        if peft_config is not None and has_peft_adapter(model):
            raise ValueError(
                "model already has a PEFT adapter and peft_config was given too; pass the base model with "
                "peft_config, or the PeftModel without it."
            )
        if reward_model is None and not reward_funcs:
            raise ValueError(
                "No reward: pass reward_model= (a one-label sequence-classification model or its path), "
                "reward_funcs= (f(prompts, completions, **columns) -> list[float]), or both."
            )

        # ---- models ----
        policy = _load_causal_lm(model, args.model_init_kwargs, "policy")
        if ref_model is not None:
            ref_model = _load_causal_lm(ref_model, args.model_init_kwargs, "reference model")
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
        value = self.build_value_model(policy, reward_model, value_model, args)
        if peft_config is not None:
            require_peft("peft_config")
            from peft import get_peft_model

            policy = get_peft_model(policy, peft_config)
        self.is_peft = _is_peft_model(policy)
        if ref_model is None and not self.is_peft:
            ref_model = copy_model(policy)
        vocab = embedding_rows(policy)
        if processing_class.pad_token_id >= vocab:
            raise ValueError(
                f"The tokenizer's pad token id ({processing_class.pad_token_id}) is outside the policy's "
                f"vocabulary ({vocab} embeddings): padded batches would index past the embedding table. Call "
                "model.resize_token_embeddings(len(tokenizer)) after adding the pad token, or use a pad token "
                "the model already has."
            )
        if ref_model is not None and embedding_rows(ref_model) != vocab:
            raise ValueError(
                f"The reference model's vocabulary ({embedding_rows(ref_model)}) differs from the policy's ({vocab}); "
                "the KL penalty compares log-probs of the same token ids, so both must share a tokenizer."
            )
        for m in (policy, ref_model, reward_model, value):
            if m is not None and args.disable_dropout:
                disable_dropout(m)
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        if reward_model is not None:
            reward_model.eval().requires_grad_(False)
        self.ref_model = ref_model
        self.reward_model = reward_model
        self.reward_sources = RewardSources(
            policy_tokenizer=processing_class,
            reward_model=reward_model,
            reward_tokenizer=reward_processing_class,
            reward_funcs=reward_funcs,
            reward_weights=args.reward_weights,
            batch_size=args.reward_batch_size,
            on_error=args.reward_func_errors,
        )

        # ---- data ----
        self.preprocessing_stats: dict[str, PromptTokenizationStats] = {}
        from accelerate import PartialState

        with PartialState().main_process_first():
            train_dataset = self._tokenize(train_dataset, processing_class, args, "train", vocab)
            if eval_dataset is not None:
                eval_dataset = self._tokenize(eval_dataset, processing_class, args, "eval", vocab)
        check_onpolicy_models(
            policy,
            processing_class,
            prompts={"train": train_dataset, **({"eval": eval_dataset} if eval_dataset is not None else {})},
            response_length=args.response_length,
            stop_token_ids=self._stop_ids,
            truncate_after=args.truncate_after,
            ref_model=ref_model,
            value_model=value,
            reward_model=reward_model,
            reward_model_reads_ids=self.reward_sources.same_tokenizer,
            value_model_from_reward_model=value_model is None
            and getattr(args, "value_model_init", None) == "reward_model",
        )
        if data_collator is None:
            data_collator = PromptCollator(processing_class.pad_token_id)

        super().__init__(
            model=PolicyAndValue(policy, value),
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._check_batch_sizes()
        self._prepare_frozen_models()
        self._resolve_fused_head()
        self._resolve_onednn_linear()
        self.kl_ctl: F.AdaptiveKLController | F.FixedKLController = (
            F.AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
            if args.adaptive_kl
            else F.FixedKLController(args.kl_coef)
        )
        self._log_buffer: dict[str, list[float]] = defaultdict(list)
        self._ratio_warned = False
        #: True when the last train() stopped early on SIGTERM/SIGINT (``save_on_interrupt``).
        self.interrupted = False
        self._reliability = reliability_callback(self)
        self.add_callback(self._reliability)

    # ---- construction helpers ------------------------------------------------------------------

    @staticmethod
    def _resolve_stop_ids(args: OnPolicyConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
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

    def build_value_model(
        self,
        policy: PreTrainedModel,
        reward_model: PreTrainedModel | None,
        value_model: str | os.PathLike[str] | PreTrainedModel | None,
        args: OnPolicyConfig,
    ) -> PreTrainedModel | None:
        """The trained model besides the policy (PPO's value model); None here."""
        if value_model is not None:
            raise ValueError(f"{type(self).__name__} has no value model; drop value_model=.")
        return None

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
        if args.local_batch_size % k:
            raise ValueError(
                f"A rollout of per_device_train_batch_size ({args.per_device_train_batch_size}) x "
                f"gradient_accumulation_steps ({args.gradient_accumulation_steps}) x num_mini_batches "
                f"({args.num_mini_batches}) = {args.local_batch_size} completions per process must be a multiple "
                f"of rloo_k={k} (all completions of a prompt stay on one process); change "
                "per_device_train_batch_size or rloo_k."
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
            self.num_updates = args.max_steps
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
            f"updates, {self.total_episodes} episodes."
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
        their weights are partitioned like the trained ones."""
        self._fill_deepspeed_bucket_sizes()
        device = self.accelerator.device
        self._ref_forward: Callable[..., Any] | None = None
        self._reward_forward: Callable[..., Any] | None = None
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        for name in ("ref_model", "reward_model"):
            model = getattr(self, name)
            if model is None:
                continue
            if zero3:
                engine = _deepspeed_inference_engine(model, self.accelerator)
                setattr(self, f"_{name.split('_')[0]}_forward", engine)
            else:
                model.to(device)

    # ---- optimizer -------------------------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The optimizer ``optim`` names (or :class:`TFStyleAdam` when ``tf_style_adam``), over
        :meth:`_parameter_groups` (Trainer's weight-decay groups; PPO adds a critic learning rate)."""
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        groups = self._parameter_groups(model)
        if self.args.tf_style_adam:
            self.optimizer = TFStyleAdam(
                groups,
                lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
            )
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def _parameter_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]

    # ---- the models as used in a rollout ---------------------------------------------------------

    def _unwrapped(self) -> nn.Module:
        """``PolicyAndValue`` unwrapped from DDP/DeepSpeed, cached per wrapper object: accelerate's
        ``unwrap_model`` reads installed-package metadata on every call (``is_deepspeed_available``),
        which cost 18 % of a tiny model's update when the engine asked for the policy ~8 times per
        update."""
        wrapped = self.model_wrapped
        cached = getattr(self, "_unwrap_cache", None)
        if cached is None or cached[0] is not wrapped:
            cached = (wrapped, self.accelerator.unwrap_model(wrapped))
            self._unwrap_cache = cached
        return cached[1]

    @property
    def policy(self) -> nn.Module:
        """The policy (a PreTrainedModel, or PeftModel), unwrapped from DDP/DeepSpeed."""
        return self._unwrapped().policy

    @property
    def value_model(self) -> nn.Module | None:
        """PPO's value model (unwrapped), None for RLOO."""
        return self._unwrapped().value_model

    @contextlib.contextmanager
    def _generation_context(self) -> Any:
        """Under ZeRO-3, what generation needs around it. With ``ds3_gather_for_generation`` (or before
        training, when no engine's hooks would fetch the shards): the policy's weights gathered whole and
        the training engine's parameter hooks removed meanwhile, as DeepSpeed's own
        ``unwrap_model_for_generation`` does: with the hooks on, every generation step would still run
        the engine's fetch/trace bookkeeping, and ranks whose responses stop after different numbers of
        steps would then issue different collectives and deadlock at the next forward pass. Without
        gathering, the hooks fetch the shards layer by layer and ``generate(synced_gpus=True)`` keeps the
        ranks in step."""
        params = _zero3_params(self.policy)
        if not params:
            yield
            return
        optimizer = getattr(self.model_wrapped, "optimizer", None)
        offload = getattr(optimizer, "parameter_offload", None)
        if offload is not None and not self.args.ds3_gather_for_generation:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if offload is None:
                yield
                return
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield
            finally:
                offload._register_deepspeed_module(offload.module)

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

    def _resolve_onednn_linear(self) -> None:
        """``onednn_linear``: whether generation runs the decoding steps' linear layers through oneDNN
        (:class:`~rlhf_trainers.cpu_linear.OneDNNLinear`); decided once, at construction."""
        args = self.args
        on = bool(args.onednn_linear) and self.accelerator.device.type == "cpu"
        on = on and not (args.bf16 or args.fp16) and not self.is_deepspeed_enabled
        if on:
            largest = max(
                (m.weight.numel() for m in self.policy.modules() if isinstance(m, nn.Linear)), default=0
            )
            floating = [p for p in self.policy.parameters() if p.is_floating_point()]
            on = (
                largest >= args.onednn_linear_min_weights
                and all(p.dtype == torch.float32 for p in floating)
                and onednn_linear_available()
            )
        #: True when generation runs under :class:`~rlhf_trainers.cpu_linear.OneDNNLinear`.
        self.uses_onednn_linear = on

    def _linear_backend(self) -> contextlib.AbstractContextManager[Any]:
        """The context generation runs in: oneDNN's linear for the decoding steps where
        :attr:`uses_onednn_linear`, else nothing (the mode sees every torch call made inside it, so it
        covers generation only)."""
        return OneDNNLinear() if self.uses_onednn_linear else contextlib.nullcontext()

    def _synced_generation(self) -> bool:
        """Multi-process ZeRO-3 without gathering the weights: ranks must step generation together."""
        return bool(
            self.is_deepspeed_enabled
            and not self.args.ds3_gather_for_generation
            and self.accelerator.num_processes > 1
        )

    @property
    def logprobs_from_generation(self) -> bool:
        """Whether the rollout takes its log-probs and entropy from the sampling loop
        (``rollout_logprobs``, with 'auto' resolved against the policy's dtype and the precision)."""
        cached = getattr(self, "_logprobs_from_generation", None)
        if cached is None:
            args = self.args
            if args.rollout_logprobs == "auto":
                float32 = all(
                    p.dtype == torch.float32 for p in self.policy.parameters() if p.is_floating_point()
                )
                cached = bool(
                    float32
                    and not (args.bf16 or args.fp16)
                    and args.disable_dropout
                    and args.generation_loop == "builtin"
                    and not self._synced_generation()
                    and not self.needs_generation_logprobs
                )
            else:
                cached = args.rollout_logprobs == "generation"
            self._logprobs_from_generation = cached
        return cached

    @torch.no_grad()
    def _generate(
        self, query: torch.Tensor, query_mask: torch.Tensor, with_logprobs: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """Sample (B, response_length) response ids from ``softmax(logits / temperature)``; rows end at a
        stop token only when generation may stop there (else fixed length, truncated afterwards).

        With ``with_logprobs`` also ``{"logprobs", "entropy"}`` (B, response_length) float32: the sampled
        tokens' log-probabilities and the entropy of each step's distribution, as the generation computed
        them (its own logits / temperature, in the generation's precision; 0 after a stop token)."""
        args = self.args
        stop_in_generation = self._stop_ids and args.truncate_after == 0
        stop_ids = list(self._stop_ids) if stop_in_generation else []
        pad_id = self.processing_class.pad_token_id
        policy = self.policy
        was_training = policy.training
        policy.eval()
        synced = self._synced_generation()
        extras: dict[str, torch.Tensor] | None = None
        try:
            with self._generation_context(), self._linear_backend():
                if args.generation_loop == "builtin" and not synced:
                    samples = sample_completions(
                        policy,
                        query,
                        query_mask,
                        max_new_tokens=args.response_length,
                        temperature=args.temperature,
                        pad_token_id=pad_id,
                        stop_token_ids=stop_ids,
                        return_logprobs=with_logprobs,
                        lean_decoding=args.lean_decoding,
                    )
                    response = samples.tokens
                    if with_logprobs:
                        extras = {"logprobs": samples.logprobs, "entropy": samples.entropy}
                else:
                    response, extras = self._hf_generate(
                        policy, query, query_mask, stop_ids, with_logprobs, synced
                    )
        finally:
            policy.train(was_training)
        missing = args.response_length - response.shape[1]
        if missing > 0:
            pad = torch.full(
                (response.shape[0], missing), pad_id, dtype=response.dtype, device=response.device
            )
            response = torch.cat([response, pad], dim=1)
            if extras is not None:
                extras = {
                    k: torch.cat([v, torch.zeros_like(pad, dtype=v.dtype)], dim=1) for k, v in extras.items()
                }
        return response, extras

    def _hf_generate(
        self,
        policy: nn.Module,
        query: torch.Tensor,
        query_mask: torch.Tensor,
        stop_ids: list[int],
        with_logprobs: bool,
        synced: bool,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """``generate()`` with top-k 0 / top-p 1 and nothing from the model's ``generation_config``."""
        from transformers import GenerationConfig

        args = self.args
        config = GenerationConfig(
            max_new_tokens=args.response_length,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            pad_token_id=self.processing_class.pad_token_id,
            # [] (not None, which generate() would fill from the model's generation config): sample the
            # full length, with EOS a token like any other (the seed's fixed-length responses).
            eos_token_id=stop_ids,
            use_cache=True,
            return_dict_in_generate=with_logprobs,
            output_logits=with_logprobs,
        )
        # generate() fills what `config` leaves unset (repetition_penalty, no_repeat_ngram_size,
        # suppress_tokens, ...) from the model's own generation_config: set a blank one aside meanwhile.
        with generation_config_set_aside(policy):
            out = policy.generate(
                input_ids=query, attention_mask=query_mask, generation_config=config, synced_gpus=synced
            )
        sequences = out.sequences if with_logprobs else out
        response = sequences[:, query.shape[1] :]
        if not with_logprobs:
            return response, None
        logits = torch.stack(out.logits, dim=1)
        logprobs, entropy = F.logprobs_and_entropy_from_logits(
            logits, response, args.temperature, compute_dtype=logits.dtype, entropy_dtype=torch.float32
        )
        done = torch.zeros_like(response, dtype=torch.bool)
        if stop_ids:
            # Positions after a row's stop token (generate pads them): 0, as the builtin loop.
            hits = torch.isin(response, torch.tensor(stop_ids, device=response.device))
            done[:, 1:] = hits.cumsum(1)[:, :-1] > 0
        return response, {
            "logprobs": logprobs.float().masked_fill(done, 0.0),
            "entropy": entropy.masked_fill(done, 0.0),
        }

    def _response_lengths(self, raw: torch.Tensor) -> torch.Tensor:
        """Valid tokens per response: up to and including the first stop token (at index >=
        truncate_after); a response without one keeps every generated token."""
        R = raw.shape[1]
        if not self._stop_ids:
            return torch.full((raw.shape[0],), R, dtype=torch.long, device=raw.device)
        idx = torch.arange(R, device=raw.device)
        hits = torch.isin(raw, torch.tensor(self._stop_ids, device=raw.device)) & (
            idx >= self.args.truncate_after
        )
        first = F.first_true_indices(hits)
        return torch.where(first < R, first + 1, torch.full_like(first, R))

    def _logprob_options(self) -> dict[str, Any]:
        """Temperature, chunking and precision of every log-prob computation of the engine."""
        args = self.args
        return {
            "temperature": args.temperature,
            "chunk_size": args.logprob_chunk_size,
            "compute_dtype": torch.float32 if args.logprobs_in_fp32 else None,
        }

    def _sequence_inputs(
        self,
        query: torch.Tensor,
        query_mask: torch.Tensor,
        response: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.cat([query, response], dim=1)
        mask = torch.cat([query_mask.bool(), response_mask], dim=1)
        ids = ids.masked_fill(~mask, self.processing_class.pad_token_id)
        return ids, mask.long(), F.position_ids_from_mask(mask)

    @torch.no_grad()
    def _reference_logprobs(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, response: torch.Tensor
    ) -> torch.Tensor:
        options = self._logprob_options()
        if self.ref_model is None:
            # PEFT: the reference is the same weights with the adapter disabled (no second copy).
            with self.policy.disable_adapter():
                return response_logprobs(
                    self.policy,
                    ids,
                    mask,
                    pos,
                    response,
                    options,
                    fused_head=self._fused_ref,
                    with_entropy=False,
                )[0]
        forward = self._ref_forward or self.ref_model
        return response_logprobs(
            forward, ids, mask, pos, response, options, fused_head=self._fused_ref, with_entropy=False
        )[0]

    # ---- the rollout -----------------------------------------------------------------------------

    def _prompt_batch(self, update: int) -> dict[str, Any]:
        """This process's prompts of update ``update``: a fixed permutation per pass over the data (from
        ``seed`` and the pass number), so the order depends only on the update index (resume-safe)."""
        epoch, slot = divmod(update, self.updates_per_data_epoch)
        generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.train_dataset), generator=generator)
        start = slot * self.prompts_per_update + self.accelerator.process_index * self.local_prompts
        indices = perm[start : start + self.local_prompts].tolist()
        return self.data_collator([self.train_dataset[i] for i in indices])

    def _prompts_and_columns(self, batch: dict[str, Any]) -> tuple[list[Any], dict[str, list[Any]]]:
        columns = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
        if "prompt" in columns:
            prompts = columns.pop("prompt")
        elif "messages" in columns:
            prompts = columns.pop("messages")
        else:
            prompts = self.processing_class.batch_decode(batch["input_ids"], skip_special_tokens=True)
        return list(prompts), columns

    def rollout(self, batch: dict[str, Any], timings: dict[str, float] | None = None) -> dict[str, Any]:
        """Experience for one update (see :meth:`_rollout`), in the training precision: under ``bf16``/``fp16``
        the same autocast as the training forward pass, so the rollout log-probs are the ones the first
        training step recomputes (ratio 1; with ``rollout_logprobs='generation'`` up to the rounding of
        the cached decode)."""
        with torch.no_grad(), self.accelerator.autocast():
            return self._rollout(batch, timings)

    def _rollout(self, batch: dict[str, Any], timings: dict[str, float] | None = None) -> dict[str, Any]:
        """Experience for one update from a collated prompt batch (this process's share).

        Returns a dict of (N, ...) tensors, N = prompts x ``completions_per_prompt`` (the k copies of the
        batch concatenated, completion j of prompt i at row j * B + i): ``query``, ``query_mask``,
        ``response`` (truncated, padding after the stop token), ``response_mask``, ``lengths``,
        ``logprobs`` and ``entropy`` (a training-mode forward pass, logits / temperature, or the sampling
        loop's own logits: :attr:`logprobs_from_generation`), ``ref_logprobs``, ``kl``
        (per token, masked), ``scores`` (after scaling, clipping and penalties), ``raw_scores``,
        ``found_stop``, ``per_source`` scores, and ``values`` when there is a value model; plus the
        decoded ``prompts``/``completions``.
        """
        args = self.args
        timings = timings if timings is not None else defaultdict(float)
        device = self.accelerator.device
        k = self.completions_per_prompt
        query = batch["input_ids"].to(device).repeat(k, 1)
        query_mask = batch["attention_mask"].to(device).repeat(k, 1)
        prompts, columns = self._prompts_and_columns(batch)
        prompts = prompts * k
        columns = {name: list(v) * k for name, v in columns.items()}
        pad = self.processing_class.pad_token_id
        N, step = query.shape[0], args.local_rollout_forward_batch_size
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        for s in range(0, N, step):
            q, qm = query[s : s + step], query_mask[s : s + step]
            t0 = time.perf_counter()
            from_generation = self.logprobs_from_generation
            raw, gen = self._generate(q, qm, with_logprobs=self.needs_generation_logprobs or from_generation)
            if gen is not None and self.needs_generation_logprobs:
                parts["gen_logprobs"].append(gen["logprobs"].float())
            timings["timing/generate"] += time.perf_counter() - t0
            lengths = self._response_lengths(raw)
            R = raw.shape[1]
            rmask = torch.arange(R, device=device)[None, :] < lengths[:, None]
            response = raw.masked_fill(~rmask, pad)
            # The forward passes see the prompt columns some row uses and the response columns up to
            # the longest response; what they leave out is padding in every row, and the results are
            # padded back to R (with zeros, at masked positions).
            start, end = _trim_bounds(qm, rmask)
            tq, tqm, tr, trm = q[:, start:], qm[:, start:], response[:, :end], rmask[:, :end]
            ids, mask, pos = self._sequence_inputs(tq, tqm, tr, trm)
            if from_generation and gen is not None:
                # The sampling loop's own log-probs (rollout_logprobs): no policy forward pass.
                parts["logprobs"].append(gen["logprobs"].float().masked_fill(~rmask, 0.0))
                parts["entropy"].append(gen["entropy"].float().masked_fill(~rmask, 0.0))
                timings["timing/policy"] += 0.0  # logged as 0: the pass was skipped
            else:
                t0 = time.perf_counter()
                logprobs, entropy = response_logprobs(
                    self.policy, ids, mask, pos, tr, self._logprob_options(), fused_head=self._fused_policy
                )
                parts["logprobs"].append(_pad_columns(logprobs, R))
                parts["entropy"].append(_pad_columns(entropy, R))
                timings["timing/policy"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            parts["ref_logprobs"].append(_pad_columns(self._reference_logprobs(ids, mask, pos, tr), R))
            timings["timing/ref"] += time.perf_counter() - t0
            if self.value_model is not None:
                t0 = time.perf_counter()
                values = token_values(self.value_model, ids, mask, pos)[:, tq.shape[1] - 1 : -1].float()
                parts["values"].append(_pad_columns(values, R))
                timings["timing/values"] += time.perf_counter() - t0
            parts["response"].append(response)
            parts["response_mask"].append(rmask)
            parts["lengths"].append(lengths)
        out: dict[str, Any] = {name: torch.cat(v) for name, v in parts.items()}
        out["query"], out["query_mask"] = query, query_mask.bool()
        completions = self.processing_class.batch_decode(out["response"], skip_special_tokens=True)
        t0 = time.perf_counter()
        ids = torch.cat([query, out["response"]], dim=1)
        raw_scores, per_source = self.reward_sources(
            query_response_ids=ids,
            prompts=prompts,
            completions=completions,
            columns=columns,
            reward_model_forward=self._reward_forward,
        )
        timings["timing/reward"] += time.perf_counter() - t0
        out.update(prompts=prompts, completions=completions, per_source=per_source)
        out["reward_func_errors"] = torch.tensor(float(self.reward_sources.last_errors), device=device)
        mask = out["response_mask"]
        out["kl"] = F.kl_penalty(out["logprobs"], out["ref_logprobs"], args.kl_estimator) * mask
        out["raw_scores"] = raw_scores.to(device)
        out["found_stop"] = (
            F.stop_token_found(out["response"], self._stop_ids, args.truncate_after)
            if self._stop_ids
            else torch.ones(N, dtype=torch.bool, device=device)
        )
        out["scores"], out["valid_rows"] = self._shape_scores(
            out["raw_scores"], out["lengths"], out["found_stop"]
        )
        # Rows whose reward is NaN (a function returned None / NaN) take no part in the update.
        out["response_mask"] = out["response_mask"] & out["valid_rows"][:, None]
        out["kl"] = out["kl"] * out["valid_rows"][:, None]
        return out

    def _shape_scores(
        self, scores: torch.Tensor, lengths: torch.Tensor, found: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores -> rewards of the sequences, in this order: scaling to the target range, clipping,
        overlong shaping, the missing-stop-token penalty (so a penalty is in the final units, as the
        seed's -1)."""
        args = self.args
        valid = torch.isfinite(scores)
        scores = torch.where(valid, scores, torch.zeros_like(scores)).float()
        if args.reward_scaling is not None:
            scores = F.scale_rewards(scores, *args.reward_scaling)
        if args.reward_clip is not None:
            scores = scores.clamp(-args.reward_clip, args.reward_clip)
        if args.overlong_buffer_length is not None:
            scores = scores + F.overlong_penalty(
                lengths, args.response_length, args.overlong_buffer_length, args.overlong_penalty
            ).to(scores)
        if args.missing_eos_penalty is not None:
            scores = F.apply_rejection_penalty(scores, found, args.missing_eos_penalty, "subtract")
        if args.rejection_penalty is not None:
            scores = F.apply_rejection_penalty(scores, found, args.rejection_penalty, "replace")
        return torch.where(valid, scores, torch.zeros_like(scores)), valid

    def token_rewards(self, rollout: dict[str, Any]) -> torch.Tensor:
        """(N, R) per-token rewards: ``-kl_coef * kl`` at every response token and the sequence's score
        added at its last token (N-implementation-details, "Per-token KL penalty"); whitened over all
        processes with ``shift_mean=False`` when ``whiten_rewards``."""
        mask = rollout["response_mask"]
        rewards = -self.kl_ctl.value * rollout["kl"]
        last = (rollout["lengths"] - 1).clamp_min(0)
        rewards = rewards.clone()
        rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += (
            rollout["scores"] * rollout["valid_rows"].float()
        )
        if self.args.whiten_rewards:
            rewards = F.whiten(rewards, mask, shift_mean=False, all_reduce=self._all_reduce)
        return rewards

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor | None:
        if self.accelerator.num_processes == 1:
            return tensor
        return self.accelerator.reduce(tensor, reduction="sum")

    # ---- subclass hooks ---------------------------------------------------------------------------

    completions_per_prompt: int = 1
    #: Whether the rollout keeps the generation's own log-probs (``rollout["gen_logprobs"]``).
    needs_generation_logprobs: bool = False

    def compute_advantages(self, rollout: dict[str, Any]) -> None:
        """Add ``advantages`` (and whatever the loss needs) to ``rollout``."""
        raise NotImplementedError

    def compute_policy_loss(
        self, rollout: dict[str, Any], idx: torch.Tensor, logprobs: torch.Tensor, values: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch (rows ``idx`` of the rollout) and its metrics."""
        raise NotImplementedError

    # ---- the optimisation ------------------------------------------------------------------------

    def _training_forward(
        self,
        model: nn.Module,
        rollout: dict[str, Any],
        idx: torch.Tensor,
        bounds: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Log-probs (with gradient), values (PPO) and the entropy metric of rollout rows ``idx``.

        The forward pass covers only the columns some row of the micro-batch needs (``bounds``: first
        prompt column, end of the response columns; computed from the masks when None): leading prompt
        padding and the response padding after the longest response are left out, and the outputs are
        padded back to the rollout's response length with zeros at those (masked) positions."""
        q, qm = rollout["query"][idx], rollout["query_mask"][idx]
        response, rmask = rollout["response"][idx], rollout["response_mask"][idx]
        R = response.shape[1]
        start, end = _trim_bounds(qm, rmask) if bounds is None else bounds
        q, qm, response, rmask = q[:, start:], qm[:, start:], response[:, :end], rmask[:, :end]
        ids, mask, pos = self._sequence_inputs(q, qm, response, rmask)
        logprobs, values, entropy = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            with_values=self.value_model is not None,
            response=response,
            logprob_options=self._logprob_options(),
            fused_head=self._fused_policy,
        )
        if values is not None:
            values = _pad_columns(values[:, q.shape[1] - 1 : -1].float(), R)
        return _pad_columns(logprobs, R), values, _pad_columns(entropy, R)

    def _optimize(self, model: nn.Module, rollout: dict[str, Any], update: int) -> dict[str, float]:
        args = self.args
        ga = args.gradient_accumulation_steps
        N = rollout["response"].shape[0]
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        grad_norms: list[float] = []
        is_deepspeed = self.is_deepspeed_enabled
        # Per row, on the host (one transfer per update, none per micro-batch): first real prompt column
        # and one past the last valid response column, from which each micro-batch's trim is read.
        q_start = F.first_true_indices(rollout["query_mask"]).cpu()
        r_end = (F.last_true_indices(rollout["response_mask"]) + 1).cpu()
        for epoch in range(args.num_ppo_epochs):
            generator = torch.Generator().manual_seed(
                hash((args.seed, self.accelerator.process_index, update, epoch)) % (2**63)
            )
            perm_cpu = torch.randperm(N, generator=generator)
            perm = perm_cpu.to(rollout["response"].device)
            for mb in range(args.num_mini_batches):
                for micro in range(ga):
                    rows = slice(
                        mb * args.local_mini_batch_size + micro * args.per_device_train_batch_size,
                        mb * args.local_mini_batch_size + (micro + 1) * args.per_device_train_batch_size,
                    )
                    idx = perm[rows]
                    bounds = _bounds_of(
                        q_start[perm_cpu[rows]], r_end[perm_cpu[rows]], rollout["query"].shape[1]
                    )
                    last = micro == ga - 1
                    self.accelerator.gradient_state._set_sync_gradients(last)
                    sync = (
                        contextlib.nullcontext()
                        if last or is_deepspeed or self.accelerator.num_processes == 1
                        else self.accelerator.no_sync(model)
                    )
                    with sync:
                        logprobs, values, entropy = self._training_forward(model, rollout, idx, bounds)
                        if epoch == 0 and mb == 0 and micro == 0:
                            self._check_ratio_at_start(logprobs.detach(), rollout, idx, stats)
                        loss, metrics = self.compute_policy_loss(rollout, idx, logprobs, values)
                        kwargs = {"scale_wrt_gas": False} if is_deepspeed else {}
                        self.accelerator.backward(loss / ga, **kwargs)
                    mask = rollout["response_mask"][idx]
                    stats["policy/entropy_avg"].append(F.masked_mean(entropy, mask))
                    for name, value in metrics.items():
                        stats[name].append(value.detach().float())
                if args.max_grad_norm and args.max_grad_norm > 0:
                    norm = self._clip_grad_norm(model)
                    grad_norms.append(float(norm.item() if hasattr(norm, "item") else norm))
                    # The clipping norm covers the parameters the optimizer steps: when it is finite the
                    # non-finite-step guard need not scan every gradient again.
                    self._reliability.guard.note_grad_norm(grad_norms[-1])
                self.optimizer.step()
                model.zero_grad()
        out = {name: torch.stack(v).mean() for name, v in stats.items()}
        reduced = self._reduce_means(out)
        if grad_norms:
            reduced["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return reduced

    def _check_ratio_at_start(
        self,
        logprobs: torch.Tensor,
        rollout: dict[str, Any],
        idx: torch.Tensor,
        stats: dict[str, list[torch.Tensor]],
    ) -> None:
        """Numerics guard: before any optimizer step of an update the policy is the one that produced the
        rollout log-probs, so the ratio must be 1 up to rounding."""
        mask = rollout["response_mask"][idx]
        diff = (logprobs - rollout["logprobs"][idx]) * mask
        deviation = (diff.exp() - 1).abs() * mask
        worst = deviation.max() if deviation.numel() else torch.zeros((), device=logprobs.device)
        stats["policy/ratio_at_start"].append(worst.float())
        # The RLOO blog's view of the same thing: the ratio of whole sequences (what a sequence-level
        # loss clips), where small per-token differences multiply.
        rows = mask.any(1)
        seq_ratio = diff.sum(1).exp()[rows]
        if seq_ratio.numel():
            clip = self.args.cliprange
            stats["policy/seq_ratio_at_start_mean"].append(seq_ratio.mean().float())
            stats["policy/seq_ratio_at_start_max"].append(seq_ratio.max().float())
            stats["policy/seq_ratio_at_start_clipfrac"].append(
                ((seq_ratio < 1 - clip) | (seq_ratio > 1 + clip)).float().mean()
            )
        if float(worst) > self.args.ratio_tolerance and not self._ratio_warned and self.args.should_log:
            self._ratio_warned = True
            logger.warning(
                "policy ratio at the first mini-batch deviates from 1 by %.3g (> ratio_tolerance=%g): the rollout "
                "log-probs and the training forward pass disagree. Keep logprobs_in_fp32=True, run both passes in "
                "the same precision, and keep dropout off (disable_dropout=True).",
                float(worst),
                self.args.ratio_tolerance,
            )

    def _reduce_means(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """Means over processes of per-process scalars (one collective)."""
        if not values:
            return {}
        names = sorted(values)
        stacked = torch.stack([values[n].detach().float().to(self.accelerator.device) for n in names])
        if self.accelerator.num_processes > 1:
            stacked = self.accelerator.reduce(stacked, reduction="mean")
        return {n: float(v) for n, v in zip(names, stacked.tolist(), strict=True)}

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.accelerator.device)
        return self.accelerator.gather(tensor) if self.accelerator.num_processes > 1 else tensor

    # ---- metrics ---------------------------------------------------------------------------------

    def rollout_metrics(self, rollout: dict[str, Any]) -> dict[str, float]:
        """TRL's objective/* and val/* metrics of a rollout, over all processes."""
        mask = rollout["response_mask"]
        valid = rollout["valid_rows"]
        kl_seq = rollout["kl"].sum(1)
        non_score = -self.kl_ctl.value * kl_seq
        entropy_seq = -(rollout["logprobs"] * mask).sum(1)
        eos = self.processing_class.eos_token_id
        response = rollout["response"]
        # EOS tokens inside each response (up to its length): the padding after it may be EOS as well
        # (a tokenizer whose pad token is its EOS token).
        inside = (
            torch.arange(response.shape[1], device=response.device)[None, :] < rollout["lengths"][:, None]
        )
        per_row = torch.stack(
            [
                kl_seq,
                entropy_seq,
                non_score,
                rollout["scores"] + non_score,
                rollout["scores"],
                rollout["raw_scores"].nan_to_num(0.0),
                rollout["lengths"].float(),
                ((response == eos) & inside).sum(1).float() if eos is not None else torch.zeros_like(kl_seq),
                rollout["found_stop"].float(),
                valid.float(),
            ],
            dim=1,
        ).float()
        gathered = self._gather(per_row)
        ok = self._gather(valid.float()).bool()

        def mean(col: int, rows: torch.Tensor | None = None) -> float:
            values = gathered[:, col]
            rows = ok if rows is None else rows
            return float(values[rows].mean()) if rows.any() else 0.0

        every = torch.ones_like(ok)
        metrics = {
            "objective/kl": mean(0),
            "objective/entropy": mean(1),
            "objective/non_score_reward": mean(2),
            "objective/rlhf_reward": mean(3),
            "objective/scores": mean(4),
            "objective/raw_scores": mean(5),
            "val/response_length": mean(6, every),
            "val/num_eos_tokens": float(gathered[:, 7].sum()),
            "val/stop_token_rate": mean(8, every),
            "rollout/invalid_rewards": float((~ok).sum()),
            "rollout/reward_func_errors": float(self._gather(rollout["reward_func_errors"].reshape(1)).sum()),
        }
        for name, scores in rollout["per_source"].items():
            values = self._gather(scores.float())
            finite = torch.isfinite(values)
            metrics[f"objective/scores/{name}"] = (
                float(values[finite].mean()) if finite.any() else float("nan")
            )
        return metrics

    # ---- one update ------------------------------------------------------------------------------

    def _update(self, model: nn.Module, update: int) -> dict[str, float]:
        timings: dict[str, float] = defaultdict(float)
        start = time.perf_counter()
        batch = self._prompt_batch(update)
        rollout = self.rollout(batch, timings)
        t0 = time.perf_counter()
        self.compute_advantages(rollout)
        timings["timing/advantages"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = self._optimize(model, rollout, update)
        timings["timing/update"] += time.perf_counter() - t0
        metrics = self.rollout_metrics(rollout)
        metrics.update(stats)
        elapsed = time.perf_counter() - start
        tokens = rollout["query_mask"].sum() + rollout["response_mask"].sum()
        tokens = float(self._gather(tokens.reshape(1).float()).sum())
        metrics.update(timings)
        metrics["timing/step"] = elapsed
        metrics["perf/tokens_per_sec"] = tokens / elapsed
        metrics["perf/episodes_per_sec"] = self.batch_size / elapsed
        self.kl_ctl.update(metrics["objective/kl"], self.batch_size)
        metrics["objective/kl_coef"] = self.kl_ctl.value
        self._last_rollout = rollout
        return metrics

    # ---- train -----------------------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Run ``num_updates`` on-policy updates (or continue a run from ``resume_from_checkpoint``: a
        checkpoint folder, or True for the newest one in ``output_dir``)."""
        args = self.args
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments {sorted(kwargs)}.")
        if resume_from_checkpoint is True or (
            isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint
        ):
            resume_from_checkpoint = get_last_checkpoint(args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No checkpoint found in output_dir={args.output_dir!r} to resume from.")
        elif resume_from_checkpoint is False:
            resume_from_checkpoint = None
        self.is_in_train = True
        self.interrupted = False
        apply_host_memory_settings(self)
        if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
            self._enable_gradient_checkpointing()
        if resume_from_checkpoint is not None and not self.is_deepspeed_enabled:
            self._load_from_checkpoint(resume_from_checkpoint)
        self._init_training_state(
            self.num_updates,
            self.updates_per_data_epoch,
            math.ceil(self.num_updates / self.updates_per_data_epoch),
            resume_from_checkpoint,
            trial,
        )
        model, _ = self._prepare_for_training(self.num_updates, None, resume_from_checkpoint)
        if resume_from_checkpoint is not None:
            self._load_rng_state(resume_from_checkpoint)
            self._load_onpolicy_state(resume_from_checkpoint)
        else:
            # Per-process seeds: ranks sample different completions (seed + rank * 100003).
            torch.manual_seed(args.seed + self.accelerator.process_index * RANK_SEED_STRIDE)
        if args.should_log:
            logger.info(self.batch_accounting())
            if self.is_local_process_zero():
                print(self.batch_accounting())
        model.train()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time = time.time()
        # num_sample_generations tables over the run: at updates 1, 1 + every, 1 + 2 * every, ...
        sample_every = (
            max(1, self.num_updates // args.num_sample_generations) if args.num_sample_generations else 0
        )
        if resume_from_checkpoint is None and self.is_world_process_zero():
            # A fresh run starts a fresh sample file (a resumed one appends to its own).
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(args.output_dir, SAMPLES_FILE))
        if args.eval_on_start and resume_from_checkpoint is None and self.eval_dataset is not None:
            self.evaluate()
        last_metrics: dict[str, float] = {}
        policy_losses: list[float] = []
        while self.state.global_step < self.num_updates and not self.control.should_training_stop:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            lr = self._get_learning_rate()  # the rate this update trains with
            metrics = self._update(model, self.state.global_step)
            self.lr_scheduler.step()
            self.state.global_step += 1
            self.state.epoch = self.state.global_step / self.updates_per_data_epoch
            metrics["lr"] = lr
            metrics["episode"] = self.state.global_step * self.batch_size
            metrics["train/nonfinite_steps_skipped"] = float(self._reliability.guard.skipped)
            for name, value in metrics.items():
                self._log_buffer[name].append(value)
            last_metrics = metrics
            if "loss/policy_avg" in metrics:
                policy_losses.append(metrics["loss/policy_avg"])
            if sample_every and (self.state.global_step - 1) % sample_every == 0:
                self._log_samples(self._last_rollout)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._log_save_evaluate(model)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        runtime = time.time() - start_time
        out = {
            "train_runtime": runtime,
            "train_steps_per_second": self.state.global_step / max(runtime, 1e-9),
            "interrupted": self.interrupted,
        }
        out.update({k: v for k, v in last_metrics.items() if k.startswith("objective/")})
        # training_loss, as Trainer reports it: the mean policy loss over the updates of this call.
        training_loss = sum(policy_losses) / len(policy_losses) if policy_losses else 0.0
        return TrainOutput(self.state.global_step, training_loss, out)

    def _log_save_evaluate(self, model: nn.Module) -> None:
        if self.control.should_log and self._log_buffer:
            logs = {name: sum(v) / len(v) for name, v in self._log_buffer.items()}
            logs["episode"] = self._log_buffer["episode"][-1]
            logs["lr"] = self._log_buffer["lr"][-1]
            logs["train/nonfinite_steps_skipped"] = self._log_buffer["train/nonfinite_steps_skipped"][-1]
            self._log_buffer.clear()
            self.log(logs)
        if self.control.should_evaluate:
            self.evaluate()
        if self.control.should_save:
            self._save_checkpoint(model, trial=None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _enable_gradient_checkpointing(self) -> None:
        kwargs = self.args.gradient_checkpointing_kwargs or {"use_reentrant": False}
        unwrapped = self.accelerator.unwrap_model(self.model)
        for module in (unwrapped.policy, unwrapped.value_model):
            if module is None:
                continue
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            if _is_peft_model(module) and hasattr(module, "enable_input_require_grads"):
                module.enable_input_require_grads()

    # ---- samples, evaluation ---------------------------------------------------------------------

    def _log_samples(self, rollout: dict[str, Any]) -> None:
        rows = min(self.args.sample_table_size, len(rollout["completions"]))
        if not self.is_world_process_zero() or rows == 0:
            return
        table = [
            {
                "update": self.state.global_step,
                "prompt": rollout["prompts"][i],
                "completion": rollout["completions"][i],
                "score": float(rollout["scores"][i]),
            }
            for i in range(rows)
        ]
        text = "\n".join(f"  [{r['score']:+.3f}] {r['prompt']!s} ||| {r['completion']}" for r in table)
        print(f"sample completions at update {self.state.global_step}:\n{text}")
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, SAMPLES_FILE), "a", encoding="utf-8") as fh:
            for row in table:
                fh.write(json.dumps(row, default=str) + "\n")

    @torch.no_grad()
    def evaluate(
        self,
        eval_dataset: datasets.Dataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Generate on ``eval_dataset`` (default: the one given at construction) with the training
        sampling settings, score with every reward source and log ``{prefix}_objective/scores`` (and per
        source), the response length and the stop-token rate. The sampling RNG is seeded from ``seed`` and
        forked, so evaluation neither changes the training run nor varies between calls on the same
        weights."""
        if eval_dataset is None:
            eval_dataset = self.eval_dataset
        elif "input_ids" not in eval_dataset.column_names or "prompt" in eval_dataset.column_names:
            eval_dataset = self._tokenize(
                eval_dataset, self.processing_class, self.args, metric_key_prefix, embedding_rows(self.policy)
            )
        if eval_dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (here or at construction).")
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        n = len(eval_dataset)
        per_rank = math.ceil(n / world)
        # Every rank runs the same number of rows (ZeRO-3 forward passes are collective); rows past the end
        # repeat earlier ones and are dropped from the metrics.
        rows = [(rank * per_rank + i) for i in range(per_rank)]
        keep = torch.tensor([r < n for r in rows], device=self.accelerator.device)
        rows = [r % n for r in rows]
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        scores_all, lengths_all, found_all = [], [], []
        per_source_all: dict[str, list[torch.Tensor]] = defaultdict(list)
        samples: list[dict[str, Any]] = []
        with torch.random.fork_rng(devices=devices), self.accelerator.autocast():
            torch.manual_seed(self.args.seed + 7 + rank * RANK_SEED_STRIDE)
            step = self.args.local_rollout_forward_batch_size
            for s in range(0, len(rows), step):
                batch = self.data_collator([eval_dataset[i] for i in rows[s : s + step]])
                query = batch["input_ids"].to(self.accelerator.device)
                qmask = batch["attention_mask"].to(self.accelerator.device)
                raw, _ = self._generate(query, qmask)
                lengths = self._response_lengths(raw)
                rmask = torch.arange(raw.shape[1], device=raw.device)[None, :] < lengths[:, None]
                response = raw.masked_fill(~rmask, self.processing_class.pad_token_id)
                prompts, columns = self._prompts_and_columns(batch)
                completions = self.processing_class.batch_decode(response, skip_special_tokens=True)
                raw_scores, per_source = self.reward_sources(
                    query_response_ids=torch.cat([query, response], dim=1),
                    prompts=prompts,
                    completions=completions,
                    columns=columns,
                    reward_model_forward=self._reward_forward,
                )
                found = (
                    F.stop_token_found(response, self._stop_ids, self.args.truncate_after)
                    if self._stop_ids
                    else torch.ones(len(rows[s : s + step]), dtype=torch.bool, device=raw.device)
                )
                scores_all.append(raw_scores.to(raw.device))
                lengths_all.append(lengths.float())
                found_all.append(found.float())
                for name, v in per_source.items():
                    per_source_all[name].append(v.to(raw.device))
                if len(samples) < self.args.sample_table_size:
                    samples.extend(
                        {"prompt": p, "completion": c, "score": float(x)}
                        for p, c, x in zip(prompts, completions, raw_scores.tolist(), strict=True)
                    )
        keep_all = self._gather(keep.float()).bool()

        def mean(parts: list[torch.Tensor]) -> float:
            values = self._gather(torch.cat(parts).float())[keep_all]
            finite = torch.isfinite(values)
            return float(values[finite].mean()) if finite.any() else float("nan")

        p = metric_key_prefix
        metrics = {
            f"{p}_objective/scores": mean(scores_all),
            f"{p}_val/response_length": mean(lengths_all),
            f"{p}_val/stop_token_rate": mean(found_all),
        }
        for name, parts in per_source_all.items():
            metrics[f"{p}_objective/scores/{name}"] = mean(parts)
        if self.is_world_process_zero() and samples:
            text = "\n".join(
                f"  [{r['score']:+.3f}] {r['prompt']!s} ||| {r['completion']}"
                for r in samples[: self.args.sample_table_size]
            )
            logger.info("evaluation samples at update %d:\n%s", self.state.global_step, text)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ---- saving and resuming ---------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the policy in a loadable form (``from_pretrained`` / PEFT adapter folder) into
        ``output_dir``, the value model (if any) into ``output_dir/value_model``, and the tokenizer."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        unwrapped = self.accelerator.unwrap_model(self.model)
        if state_dict is None:
            state_dict = unwrapped.state_dict()
        policy_sd = {k[len("policy.") :]: v for k, v in state_dict.items() if k.startswith("policy.")}
        unwrapped.policy.save_pretrained(output_dir, state_dict=policy_sd or None)
        if unwrapped.value_model is not None:
            value_sd = {
                k[len("value_model.") :]: v for k, v in state_dict.items() if k.startswith("value_model.")
            }
            unwrapped.value_model.save_pretrained(
                os.path.join(output_dir, VALUE_MODEL_DIR), state_dict=value_sd or None
            )
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_extra_checkpoint_state(self, folder: str) -> None:
        if self.args.should_save:
            path = os.path.join(folder, ONPOLICY_STATE_FILE)
            state = {"kl_controller": self.kl_ctl.state_dict(), "global_step": self.state.global_step}
            with open(path, "w") as fh:
                json.dump(state, fh, indent=2)

    def _load_onpolicy_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, ONPOLICY_STATE_FILE)
        if not os.path.isfile(path):
            logger.warning(
                "%s has no %s; the KL controller starts from its initial value.",
                checkpoint,
                ONPOLICY_STATE_FILE,
            )
            return
        with open(path) as fh:
            state = json.load(fh)
        self.kl_ctl.load_state_dict(state["kl_controller"])

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Load the policy (full weights or PEFT adapter) and value model saved by :meth:`_save`."""
        unwrapped = self.accelerator.unwrap_model(self.model if model is None else model)
        _load_pretrained_into(unwrapped.policy, resume_from_checkpoint)
        if unwrapped.value_model is not None:
            _load_pretrained_into(
                unwrapped.value_model, os.path.join(resume_from_checkpoint, VALUE_MODEL_DIR)
            )


def _load_pretrained_into(model: nn.Module, folder: str) -> None:
    """Load weights saved by ``save_pretrained`` (safetensors, full model or PEFT adapter) into ``model``."""
    from safetensors.torch import load_file

    if _is_peft_model(model):
        from peft import set_peft_model_state_dict

        path = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(f"No adapter weights ({path}) to resume the PEFT policy from.")
        set_peft_model_state_dict(model, load_file(path))
        return
    path = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(path):
        raise ValueError(f"No model.safetensors in {folder} to resume from.")
    state = load_file(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}."
        )


def _deepspeed_inference_engine(model: nn.Module, accelerator: Any) -> Any:
    """A ZeRO-3 inference engine for a frozen model (weights partitioned across processes)."""
    import deepspeed

    plugin = accelerator.state.deepspeed_plugin
    config = copy.deepcopy(plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = dict(config.get("zero_optimization", {}))
    zero["stage"] = 3
    for key in ("offload_optimizer",):
        zero.pop(key, None)
    config["zero_optimization"] = zero
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        if config.get(key) == "auto" or key not in config:
            config[key] = 1
    config.pop("train_batch_size", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine
