"""RewardTrainer: a Bradley-Terry reward model from preference pairs, as a ``transformers.Trainer``."""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as torch_F
from transformers import PreTrainedTokenizerBase, Trainer
from transformers.trainer_utils import get_last_checkpoint

from ..compat import EvaluateBeforeTrainMixin, peft_wrap, prepare_inputs
from ..cpu import CPUOptions, apply_host_memory_settings, resolve_cpu_options
from ..data import PreferenceCollator, PreferenceTokenizationStats, longest_sequence, tokenize_preferences
from ..distributed_exit import tear_down_process_group_at_exit
from ..model_paths import check_model_paths
from ..models import (
    _base,
    align_pad_token,
    check_fits_context,
    disable_dropout,
    embedding_rows,
    find_score_head,
    get_reward_normalization,
    has_peft_adapter,
    load_reward_model,
    pooled_scores,
    readable_pad_id,
    require_peft,
    seeded,
    set_reward_normalization,
    tokenizer_of,
    write_reward_normalization,
)
from ..reliability import AtomicCheckpointMixin, check_resume_process_count, reliability_callback
from ..rewards import Prompt, compute_reward_normalization
from .config import RewardConfig
from .packed import RewardPacking, gradient_checkpointing_on, packed_reward_logits, resolve_reward_packing

if TYPE_CHECKING:
    import datasets
    from peft import PeftConfig
    from transformers import EvalPrediction, PreTrainedModel, TrainerCallback

logger = logging.getLogger(__name__)


def reward_metrics(eval_pred: EvalPrediction) -> dict[str, float]:
    """Metrics of an evaluation: ``predictions`` (N, 2) holds the chosen and rejected rewards.

    accuracy (fraction of pairs with r_chosen > r_rejected; ties count half), margin (mean of
    r_chosen - r_rejected), mean/min/max reward over both halves, and the means of each half.
    """
    rewards = np.asarray(eval_pred.predictions, dtype=np.float64).reshape(-1, 2)
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return _pair_metrics(chosen, rejected)


def _pair_metrics(chosen: np.ndarray, rejected: np.ndarray) -> dict[str, float]:
    if chosen.size == 0:
        return {}
    both = np.concatenate([chosen, rejected])
    return {
        "accuracy": float(np.mean((chosen > rejected) + 0.5 * (chosen == rejected))),
        "margin": float(np.mean(chosen - rejected)),
        "mean_reward": float(both.mean()),
        "min_reward": float(both.min()),
        "max_reward": float(both.max()),
        "mean_reward_chosen": float(chosen.mean()),
        "mean_reward_rejected": float(rejected.mean()),
    }


class RewardTrainer(AtomicCheckpointMixin, EvaluateBeforeTrainMixin, Trainer):
    """Trains a scalar reward model on preference pairs with the Bradley-Terry loss
    ``-log sigmoid(r_chosen - r_rejected - margin)``.

    Args:
        model: a path, Hub id or model instance. A causal-LM checkpoint becomes a one-label
            sequence-classification model with a new head (initialised as the reference implementation does, see
            ``RewardConfig.init_reward_head``).
        args: a :class:`RewardConfig` (default: ``RewardConfig("reward-model")``).
        data_collator: default :class:`~rlhf_trainers.data.PreferenceCollator`.
        train_dataset / eval_dataset: ``datasets.Dataset`` of pairs in any accepted format
            (:data:`rlhf_trainers.data.PREFERENCE_FORMATS`): prompt/chosen/rejected text, implicit
            chosen/rejected text, conversational messages, or ``input_ids_chosen``/``input_ids_rejected``;
            optional ``margin``. ``eval_dataset`` may be a dict of such datasets.
        processing_class: the tokenizer (default: loaded from ``model`` when it is a path). It must
            have a pad token; its id may lie past the model's embedding table (a ``[PAD]`` token added
            without resizing): the model then reads 0 at the (masked) padding and the reward is read at
            the last real token from the head's per-token output
            (:func:`~rlhf_trainers.models.pooled_scores`); the saved config keeps the model's own pad id.
        peft_config: a PEFT config (e.g. ``LoraConfig``): the adapter and the score head are trained
            (the head is added to ``modules_to_save``).
        normalization_policy: the reference policy (path or causal-LM instance) whose samples define
            the reward normalization (``RewardConfig.reward_normalization``); its tokenizer is
            ``normalization_tokenizer`` or loaded from its path, else ``processing_class``.
        normalization_prompts: prompts (strings or message lists, or a dataset with a "prompt"
            column) to sample from for the normalization.
        cpu_options: the CPU speed switches (:class:`~rlhf_trainers.CPUOptions`): of them, the reward
            trainer uses ``reuse_host_memory``. None: the defaults.

    Everything else is ``transformers.Trainer``'s. Training logs ``loss``, ``accuracy``, ``margin``,
    ``mean_reward``, ``min_reward``, ``max_reward`` (over the pairs since the last log); evaluation
    the same with the ``eval_`` prefix. ``preprocessing_stats`` holds per dataset how many pairs
    were truncated or dropped. With ``RewardConfig.padding_free`` (the default) the passes run on the
    real tokens only where the model allows it (:attr:`packing`; docs/reward.md, "Padding-free passes").
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel,
        args: RewardConfig | None = None,
        data_collator: Callable[[list[Any]], dict[str, Any]] | None = None,
        train_dataset: datasets.Dataset | None = None,
        eval_dataset: datasets.Dataset | dict[str, datasets.Dataset] | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        peft_config: PeftConfig | None = None,
        normalization_policy: str | os.PathLike[str] | PreTrainedModel | None = None,
        normalization_tokenizer: PreTrainedTokenizerBase | None = None,
        normalization_prompts: Sequence[Prompt] | datasets.Dataset | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        cpu_options: CPUOptions | None = None,
    ) -> None:
        #: The CPU speed switches (rlhf_trainers.cpu); the defaults when None was given.
        self.cpu_options = resolve_cpu_options(cpu_options)
        args, processing_class = _checked_arguments(
            model, args, processing_class, train_dataset, eval_dataset, peft_config, normalization_policy
        )
        if args.reward_normalization != "no" and (
            normalization_policy is None or normalization_prompts is None
        ):
            raise ValueError(
                f"reward_normalization={args.reward_normalization!r} needs normalization_policy= (the reference "
                "policy, a path or causal-LM model) and normalization_prompts= (prompts to sample from)."
            )

        model, head_is_new = load_reward_model(
            model, init_head=args.init_reward_head, seed=args.seed, model_kwargs=args.model_init_kwargs
        )
        align_pad_token(model, processing_class)
        # The model's own pad id, kept where the tokenizer's has no embedding row (see _readable_config_pad).
        self._config_pad_token_id = _base(model).config.pad_token_id
        if args.disable_dropout:
            disable_dropout(model)
        self.head_is_new = head_is_new
        if peft_config is not None:
            with seeded(args.seed):  # the adapter's initial weights follow the config's seed
                model = _wrap_peft(model, peft_config)

        self.preprocessing_stats: dict[str, PreferenceTokenizationStats] = {}
        train_dataset, eval_dataset = self._tokenize_datasets(
            train_dataset, eval_dataset, processing_class, args, model
        )

        if data_collator is None:
            data_collator = PreferenceCollator(processing_class.pad_token_id)
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics if compute_metrics is not None else reward_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        tear_down_process_group_at_exit()
        # The loss below is a mean over the pairs of a micro-batch: the Trainer must divide it by the
        # gradient-accumulation steps (it does so only when the model takes no loss kwargs).
        self.model_accepts_loss_kwargs = False
        self._pair_rewards: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._normalization_policy = normalization_policy
        self._normalization_tokenizer = normalization_tokenizer
        self._normalization_prompts = normalization_prompts
        #: True when the last train() stopped early on SIGTERM/SIGINT (``save_on_interrupt``).
        self.interrupted = False
        self._reliability = reliability_callback(self)
        self.add_callback(self._reliability)
        #: How the training and evaluation passes are packed (``RewardConfig.padding_free``); None: padded.
        self.packing = self._resolve_packing() if args.padding_free else None

    def _resolve_packing(self) -> RewardPacking | None:
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
        return resolve_reward_packing(self.model, self.args.device, dtype, zero3)

    # ---- data ---------------------------------------------------------------------------------

    def _tokenize_datasets(
        self,
        train_dataset: datasets.Dataset | None,
        eval_dataset: datasets.Dataset | dict[str, datasets.Dataset] | None,
        tokenizer: PreTrainedTokenizerBase,
        args: RewardConfig,
        model: torch.nn.Module,
    ) -> tuple[Any, Any]:
        """The train and eval pairs tokenized (each eval dataset of a dict by its name)."""
        # Tokenize once, on the main process first so the cache is shared (datasets fingerprints).
        from accelerate import PartialState

        with PartialState().main_process_first():
            if train_dataset is not None:
                train_dataset = self._tokenize(train_dataset, tokenizer, args, "train", model)
            if isinstance(eval_dataset, dict):
                eval_dataset = {
                    name: self._tokenize(ds, tokenizer, args, f"eval_{name}", model)
                    for name, ds in eval_dataset.items()
                }
            elif eval_dataset is not None:
                eval_dataset = self._tokenize(eval_dataset, tokenizer, args, "eval", model)
        return train_dataset, eval_dataset

    def _tokenize(
        self,
        dataset: datasets.Dataset,
        tokenizer: PreTrainedTokenizerBase,
        args: RewardConfig,
        name: str,
        model: torch.nn.Module,
    ) -> datasets.Dataset:
        tokenized, stats = tokenize_preferences(
            dataset,
            tokenizer,
            max_length=args.max_length,
            long_pairs=args.long_pairs,
            add_eos=args.add_eos,
            num_proc=args.dataset_num_proc,
            vocab_size=embedding_rows(model),
        )
        self.preprocessing_stats[name] = stats
        if stats.num_truncated or stats.num_dropped:
            logger.warning(
                "%s dataset: %d of %d pairs longer than max_length=%s were %s.",
                name,
                stats.num_truncated + stats.num_dropped,
                stats.num_rows,
                args.max_length,
                "truncated (keeping the end of each response)"
                if args.long_pairs == "truncate"
                else "dropped",
            )
        if len(tokenized) == 0:
            raise ValueError(
                f"The {name} dataset has no pairs left after preprocessing ({stats.num_rows} rows, "
                f"{stats.num_dropped} dropped as longer than max_length={args.max_length}); raise max_length "
                "or use long_pairs='truncate'."
            )
        check_fits_context(
            longest_sequence(tokenized, "input_ids_chosen", "input_ids_rejected"),
            {"reward model": model},
            given=f"the longest side of the {name} pairs (max_length={args.max_length})",
            fix="Set max_length to at most that many positions: longer pairs then keep their last tokens (the "
            "end of the response, where the reward is read).",
        )
        return tokenized

    # ---- loss ---------------------------------------------------------------------------------

    def _rewards(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen and rejected rewards (B,), float32, normalized by the stored gain and bias; one
        forward pass over the 2B sequences (chosen rows first). A pad id past the model's embedding table
        (a ``[PAD]`` token added without resizing) never reaches it
        (:func:`~rlhf_trainers.models.pooled_scores`). With :attr:`packing` (``padding_free``) the pass runs
        on the real tokens only (:func:`~rlhf_trainers.reward.packed.packed_reward_logits`)."""
        if self.packing is not None:
            logits = packed_reward_logits(
                self.model,
                inputs["input_ids"],
                inputs["attention_mask"],
                self.packing,
                call=model,
                # a recomputed forward (gradient checkpointing) runs outside the one-row attention
                one_row=self.packing.one_row
                and not (model.training and gradient_checkpointing_on(self.model)),
            )
        else:
            logits = pooled_scores(
                self.model,
                inputs["input_ids"],
                inputs["attention_mask"],
                self.processing_class.pad_token_id,
                call=model,
            )
        gain, bias = get_reward_normalization(self.model)
        rewards = logits[:, 0].float() * gain + bias
        half = rewards.shape[0] // 2
        return rewards[:half], rewards[half:]

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``-log sigmoid(r_chosen - r_rejected - margin)`` averaged over the pairs, plus
        ``center_rewards_coefficient * mean((r_chosen + r_rejected)^2)`` when set."""
        chosen, rejected = self._rewards(model, inputs)
        margin = inputs.get("margin")
        diff = chosen - rejected - (margin.to(chosen) if margin is not None else 0.0)
        loss = -torch_F.logsigmoid(diff).mean()
        if self.args.center_rewards_coefficient:
            loss = loss + self.args.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
        if model.training:
            pair = torch.stack([chosen.detach(), rejected.detach()], dim=1)
            self._pair_rewards["train"].append(self.accelerator.gather_for_metrics(pair).cpu())
        if return_outputs:
            return loss, {"rewards_chosen": chosen, "rewards_rejected": rejected}
        return loss

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Returns ``(loss, rewards (B, 2) [chosen, rejected], labels (B,) zeros)``."""
        inputs = prepare_inputs(self, inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        rewards = torch.stack([outputs["rewards_chosen"], outputs["rewards_rejected"]], dim=1)
        return loss, rewards, torch.zeros(rewards.shape[0], device=rewards.device)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the training pair metrics (since the last log) to a training log entry."""
        if "loss" in logs and self._pair_rewards["train"]:
            pairs = torch.cat(self._pair_rewards.pop("train")).double().numpy()
            logs.update(_pair_metrics(pairs[:, 0], pairs[:, 1]))
        if "loss" in logs:
            logs["train/nonfinite_steps_skipped"] = float(self._reliability.guard.skipped)
        super().log(logs, start_time)

    # ---- normalization ------------------------------------------------------------------------

    def normalize_rewards(
        self,
        policy: str | os.PathLike[str] | PreTrainedModel | None = None,
        prompts: Sequence[Prompt] | datasets.Dataset | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> tuple[float, float]:
        """Compute and store the reward normalization (the gain and bias of the reference implementation).

        Samples ``normalization_num_samples`` completions from ``policy`` (default: the
        ``normalization_policy`` given at construction) on ``prompts``, scores them with the current
        reward model, and sets ``gain = std_T / std_D``, ``bias = mean_T - gain * mean_D`` so that these
        rewards have the configured target mean and std. The values replace any earlier normalization,
        are stored in the model's config (and, when saving, in ``reward_normalization.json``), and are
        used by this trainer's loss and metrics and by the PPO/RLOO trainers.

        Returns:
            ``(gain, bias)``.
        """
        args = self.args
        policy = policy if policy is not None else self._normalization_policy
        prompts = prompts if prompts is not None else self._normalization_prompts
        tokenizer = tokenizer if tokenizer is not None else self._normalization_tokenizer
        if policy is None or prompts is None:
            raise ValueError("normalize_rewards needs a policy and prompts (here or at construction).")
        policy, tokenizer = self._load_policy(policy, tokenizer)
        if hasattr(prompts, "column_names"):
            if "prompt" not in prompts.column_names:
                raise ValueError(
                    f"normalization prompts dataset needs a 'prompt' column, has {prompts.column_names}."
                )
            prompts = list(prompts["prompt"])
        state = self.accelerator.state
        was_training = self.model.training
        self.model.eval()
        gain, bias, _ = compute_reward_normalization(
            self.accelerator.unwrap_model(self.model),
            self.processing_class,
            policy,
            tokenizer,
            list(prompts),
            num_samples=args.normalization_num_samples,
            response_length=args.normalization_response_length,
            temperature=args.normalization_temperature,
            batch_size=args.normalization_batch_size,
            target_mean=args.normalization_target_mean,
            target_std=args.normalization_target_std,
            max_length=args.max_length,
            add_eos=args.add_eos,
            rank=state.process_index,
            world_size=state.num_processes,
            all_reduce=self._all_reduce_sum if state.num_processes > 1 else None,
        )
        self.model.train(was_training)
        set_reward_normalization(self.model, gain, bias)
        logger.info("reward normalization: gain %.5f, bias %.5f", gain, bias)
        return gain, bias

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor.to(self.accelerator.device), reduction="sum").to(tensor.device)

    def _load_policy(
        self, policy: str | os.PathLike[str] | PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None
    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        if isinstance(policy, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = tokenizer or AutoTokenizer.from_pretrained(policy)
            policy = AutoModelForCausalLM.from_pretrained(policy).to(self.accelerator.device)
            self._normalization_policy = policy  # load once for "before_and_after"
        tokenizer = tokenizer or self.processing_class
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "The normalization policy's tokenizer has no pad token; set one (see RewardTrainer docs)."
            )
        self._normalization_tokenizer = tokenizer
        return policy, tokenizer

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, with the reward normalization before and/or after when configured. A checkpoint
        saved on another number of processes is refused before anything is loaded
        (:func:`~rlhf_trainers.reliability.check_resume_process_count`)."""
        resume = args[0] if args else kwargs.get("resume_from_checkpoint")
        if resume is True:
            resume = get_last_checkpoint(self.args.output_dir)
        if isinstance(resume, (str, os.PathLike)):
            # before Trainer loads anything (DeepSpeed would fail on the ZeRO partitions, DDP go on quietly)
            check_resume_process_count(
                os.fspath(resume),
                self.accelerator.num_processes,
                save_on_each_node=self.args.save_on_each_node,
            )
        when = self.args.reward_normalization
        if when in ("before", "before_and_after") and not kwargs.get("resume_from_checkpoint") and not args:
            self.normalize_rewards()
        self.interrupted = False
        apply_host_memory_settings(self.cpu_options, self.args.device)
        output = super().train(*args, **kwargs)
        self._readable_config_pad()
        if when in ("after", "before_and_after"):
            self.normalize_rewards()
            if self.args.should_save and self.state.global_step > 0:
                logger.info("call trainer.save_model() to save the model with its new normalization")
        return output

    # ---- saving -------------------------------------------------------------------------------

    def write_model(self, output_dir: str, state_dict: dict[str, Any] | None = None) -> None:
        """``Trainer``'s model folder, plus ``reward_normalization.json`` (the gain and bias)."""
        self._readable_config_pad()
        super().write_model(output_dir, state_dict)
        if self.args.should_save:
            write_reward_normalization(self.model, output_dir)

    def _readable_config_pad(self) -> None:
        """Put the model's own pad id back in its config where ``Trainer.train`` copied the tokenizer's into
        it and that id has no embedding row (a ``[PAD]`` token added without resizing): saved there,
        transformers could not load the model again (the embedding's ``padding_idx`` must be a row). The
        scores never read it (:func:`~rlhf_trainers.models.pooled_scores` finds the last real token)."""
        config = _base(self.model).config
        pad = getattr(config, "pad_token_id", None)
        if readable_pad_id(pad, embedding_rows(self.model)) != pad:
            config.pad_token_id = self._config_pad_token_id


def _checked_arguments(
    model: str | os.PathLike[str] | PreTrainedModel,
    args: RewardConfig | None,
    processing_class: PreTrainedTokenizerBase | None,
    train_dataset: datasets.Dataset | None,
    eval_dataset: datasets.Dataset | dict[str, datasets.Dataset] | None,
    peft_config: PeftConfig | None,
    normalization_policy: Any = None,
) -> tuple[RewardConfig, PreTrainedTokenizerBase]:
    """``args`` (or the default config) and the tokenizer (loaded from ``model`` when not given), after
    refusing what RewardTrainer cannot work with (a model path that names nothing, first)."""
    if args is None:
        args = RewardConfig(output_dir="reward-model")
    elif not isinstance(args, RewardConfig):
        raise TypeError(
            f"args must be a RewardConfig, got {type(args).__name__}; build one with "
            "RewardConfig(output_dir=..., **fields) (it accepts every TrainingArguments field)."
        )
    named = {"model": model, "normalization_policy": normalization_policy}
    check_model_paths(named, args.model_init_kwargs)
    processing_class = tokenizer_of(model, processing_class, "the tokenizer")
    if train_dataset is None and eval_dataset is None:
        raise ValueError("RewardTrainer needs a train_dataset (or at least an eval_dataset to evaluate).")
    if peft_config is not None and has_peft_adapter(model):
        raise ValueError(
            "model already has a PEFT adapter and peft_config was given too; pass the base model with "
            "peft_config, or the PeftModel without it."
        )
    return args, processing_class


def _wrap_peft(model: PreTrainedModel, peft_config: PeftConfig) -> Any:
    """LoRA (or any PEFT method) on the backbone; the scalar head is trained in full (modules_to_save)."""
    import copy

    require_peft("peft_config")
    from peft import TaskType

    config = copy.deepcopy(peft_config)
    if getattr(config, "task_type", None) not in (None, TaskType.SEQ_CLS, "SEQ_CLS"):
        raise ValueError(
            f"peft_config.task_type={config.task_type!r}: a reward model is a sequence classifier; use "
            "task_type='SEQ_CLS' (or leave it unset)."
        )
    config.task_type = TaskType.SEQ_CLS
    head_name, _ = find_score_head(model)
    modules = list(getattr(config, "modules_to_save", None) or [])
    if head_name not in modules:
        config.modules_to_save = [*modules, head_name]
    return peft_wrap(model, config)
