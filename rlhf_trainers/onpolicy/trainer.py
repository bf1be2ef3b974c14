"""OnPolicyTrainer: the loop PPO and RLOO share, as a ``transformers.Trainer``.

One *update* (a Trainer step) is :meth:`OnPolicyTrainer._update`, eight numbered steps: 1 prompts,
2 sample, 3 score, 4 log-probs of policy and reference (+ values), 5 per-token rewards and KL,
6 advantages (subclass hook), 7 ``num_ppo_epochs`` x ``num_mini_batches`` optimizer steps of
gradient-accumulated micro-batches with the loss (subclass hook), 8 metrics and the KL controller.
The subclass supplies only what differs between algorithms: which extra model it trains (PPO's value
model), the advantages, and the loss.

The engine's other parts, each a module of this package: ``rollout`` (the typed
:class:`~rlhf_trainers.onpolicy.rollout.Rollout` and steps 1-5), ``forward`` (the trained module and
its forward passes), ``generation_mixin`` (sampling), ``setup`` (construction), ``evaluation`` and
``checkpoint``.

What comes from ``transformers.Trainer`` unchanged: the optimizer and scheduler creation (the schedule
runs over updates, so the linear default anneals the learning rate to zero at the last update, as LHPD's
does), accelerate/DDP/DeepSpeed preparation, gradient clipping, callbacks, the logging / eval / save
cadence, checkpoint rotation, RNG-state saving and ``resume_from_checkpoint``.
"""

from __future__ import annotations

import contextlib
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

from .. import compat
from .. import functional as F
from ..compilation import CompiledBlocks
from ..cpu_speedups import apply_host_memory_settings
from ..data import PromptCollator
from ..distributed_exit import tear_down_process_group_at_exit
from ..models import _is_peft_model, readable_pad_id
from ..optim import TFStyleAdam
from ..reliability import AtomicCheckpointMixin, reliability_callback
from ..rewards import RewardSources
from .balance import rebalance
from .checkpoint import CheckpointMixin
from .config import TORCH_COMPILE_WITH_DEEPSPEED, OnPolicyConfig
from .evaluation import RANK_SEED_STRIDE, SAMPLES_FILE, EvaluationMixin
from .forward import PolicyAndValue, column_bounds, pad_columns
from .generation_mixin import OnPolicyGenerationMixin
from .rollout import Advantages, FirstMicroBatch, HeldForward, LossNormalization, Rollout, RolloutSteps
from .setup import SetupSteps, load_models, policy_tokenizer, resolve_stop_ids

if TYPE_CHECKING:
    import datasets
    from peft import PeftConfig
    from transformers import PreTrainedModel, TrainerCallback

logger = logging.getLogger(__name__)


class OnPolicyTrainer(
    CheckpointMixin,
    EvaluationMixin,
    OnPolicyGenerationMixin,
    RolloutSteps,
    SetupSteps,
    AtomicCheckpointMixin,
    Trainer,
):
    """The engine of :class:`~rlhf_trainers.PPOTrainer` and :class:`~rlhf_trainers.RLOOTrainer`.

    Subclasses set ``_config_class`` and ``completions_per_prompt`` and implement
    :meth:`compute_advantages` and :meth:`compute_policy_loss`; PPO also :meth:`build_value_model`.
    The constructor's arguments are documented on the subclasses.
    """

    _config_class: type[OnPolicyConfig] = OnPolicyConfig
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
        args = self._checked_args(args)
        if train_dataset is None:
            raise ValueError(
                f"{type(self).__name__} needs a train_dataset of prompts (a 'prompt' column of text or chat "
                "messages, or an 'input_ids' column)."
            )
        processing_class = policy_tokenizer(model, processing_class)
        self._stop_ids = resolve_stop_ids(args, processing_class)
        if reward_model is None and not reward_funcs:
            raise ValueError(
                "No reward: pass reward_model= (a one-label sequence-classification model or its path), "
                "reward_funcs= (f(prompts, completions, **columns) -> list[float]), or both."
            )

        # ---- models ----
        models = load_models(
            model,
            ref_model,
            reward_model,
            value_model,
            reward_processing_class,
            peft_config,
            processing_class,
            args,
            self.build_value_model,
        )
        self.is_peft = models.is_peft
        #: What padding positions hold in the input of every forward pass of the policy, reference and
        #: value model: the pad id, or 0 where the policy has no embedding row for it (a "[PAD]" token added
        #: without resizing, as the RLOO blog's snippet does; the positions are masked out of attention).
        self._input_pad_id: int = readable_pad_id(processing_class.pad_token_id, models.vocab)
        self.ref_model = models.ref_model
        self.reward_model = models.reward_model
        self.reward_sources = RewardSources(
            policy_tokenizer=processing_class,
            reward_model=models.reward_model,
            reward_tokenizer=models.reward_processing_class,
            reward_funcs=reward_funcs,
            reward_weights=args.reward_weights,
            batch_size=args.reward_batch_size,
            on_error=args.reward_func_errors,
            padding_free=args.padding_free,
        )

        # ---- data ----
        train_dataset, eval_dataset = self._prepare_prompts(
            train_dataset,
            eval_dataset,
            processing_class,
            args,
            models,
            value_model_given=value_model is not None,
        )
        if data_collator is None:
            data_collator = PromptCollator(processing_class.pad_token_id)

        super().__init__(
            model=PolicyAndValue(models.policy, models.value_model),
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        tear_down_process_group_at_exit()
        self._check_batch_sizes()
        self._prepare_frozen_models()
        self._resolve_fused_head()
        self._resolve_padding_free()
        self._build_generation_backend()
        self._compiled = self._compile_blocks()
        self.kl_ctl: F.AdaptiveKLController | F.FixedKLController = (
            F.AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
            if args.adaptive_kl
            else F.FixedKLController(args.kl_coef)
        )
        self._log_buffer: dict[str, list[float]] = defaultdict(list)
        self._pass_open = False
        self._ratio_warned = False
        #: True when the last train() stopped early on SIGTERM/SIGINT (``save_on_interrupt``).
        self.interrupted = False
        # (the engine steps its learning-rate schedule itself, skipped optimizer steps included)
        self._reliability = reliability_callback(self, loop_holds_schedule_on_skip=False)
        self.add_callback(self._reliability)

    def accelerator_arguments(self, **kwargs: Any) -> dict[str, Any]:
        """Trainer's accelerator arguments without a compiling dynamo plugin: ``torch_compile`` is the
        engine's own (:meth:`_compile_blocks`); accelerate's would wrap the whole policy-and-value module
        in one graph, recompiled for every shape of sampling, scoring and training (and, on CUDA in fp32,
        turn TF32 on for the whole process)."""
        # (without the backend's name: accelerate accepts only the names it lists, torch.compile any
        # registered backend, and only torch.compile gets it)
        backend, self.args.torch_compile_backend = self.args.torch_compile_backend, None
        try:
            accelerator_args = super().accelerator_arguments(**kwargs)
        finally:
            self.args.torch_compile_backend = backend
        if "dynamo_plugin" in accelerator_args:
            from accelerate.utils import TorchDynamoPlugin

            if os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() != "no":
                logger.warning(
                    "ACCELERATE_DYNAMO_BACKEND=%s is ignored by %s: set torch_compile=True (and "
                    "torch_compile_backend) to compile the models' layers.",
                    os.environ["ACCELERATE_DYNAMO_BACKEND"],
                    type(self).__name__,
                )
            accelerator_args["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return accelerator_args

    def _compile_blocks(self) -> CompiledBlocks | None:
        """``torch_compile``: the repeated blocks (decoder layers) of the policy, value, reference and
        reward models, compiled for the engine's passes (:class:`~rlhf_trainers.compilation.CompiledBlocks`);
        None when off."""
        args = self.args
        if not args.torch_compile:
            return None
        if self.is_deepspeed_enabled:
            raise ValueError(TORCH_COMPILE_WITH_DEEPSPEED)
        frozen = [m for m in (self.ref_model, self.reward_model) if m is not None]
        compiled = CompiledBlocks(
            [self.policy, self.value_model, *frozen],
            backend=args.torch_compile_backend,
            mode=args.torch_compile_mode,
        )
        if not len(compiled):
            logger.warning(
                "torch_compile=True: no repeated blocks found in the models (no _no_split_modules and no "
                "ModuleList of one class); they run eager."
            )
        return compiled

    def _compiled_passes(self) -> contextlib.AbstractContextManager[Any]:
        """The context of the engine's passes: the compiled blocks active under ``torch_compile``."""
        return self._compiled.active() if self._compiled is not None else contextlib.nullcontext()

    def _checked_args(self, args: OnPolicyConfig | None) -> OnPolicyConfig:
        """``args``, or the default config of the subclass; a config of another class is refused."""
        config_class = self._config_class
        if args is None:
            args = config_class(output_dir=f"{self.algorithm_name.lower()}-output")
        elif not isinstance(args, config_class):
            raise TypeError(
                f"args must be a {config_class.__name__}, got {type(args).__name__}; build one with "
                f"{config_class.__name__}(output_dir=..., **fields) (it accepts every TrainingArguments field)."
            )
        return args

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

    # ---- one update ------------------------------------------------------------------------------

    def _update(self, model: nn.Module, update: int) -> dict[str, float]:
        """One on-policy update (one Trainer step): the whole algorithm, step by step. The subclass
        supplies step 6 (:meth:`compute_advantages`) and the loss of step 7 (:meth:`compute_policy_loss`)."""
        timings: dict[str, float] = defaultdict(float)
        start = time.perf_counter()

        # 1. prompts: this process's share of the update's prompts, from a permutation fixed by `seed` and
        #    the pass over the data, so the order depends on the update index only (resume-safe).
        batch = self._prompt_batch(update)

        # Steps 2-5 take no gradient and run in the training precision: under bf16/fp16 the same autocast
        # as the training forward pass, so its first step recomputes the rollout's log-probs (ratio 1).
        with torch.no_grad(), self.accelerator.autocast():
            # 2. sample: k completions per prompt (the batch repeated k times, completion j of prompt i at
            #    row j * B + i, the RLOO blog's layout), cut after the stop token (LHPD's truncation); the
            #    sampling loop's own log-probs when the rollout or the loss reads them.
            samples = self.sample_responses(
                batch, self.completions_per_prompt, self._wants_generation_logprobs(), timings
            )
            # 3. score: every reward source on the completions; the reward model reads the policy's ids
            #    when it shares the tokenizer, the decoded text otherwise.
            scores = self.score_samples(samples, timings)
            if self.args.dynamic_sampling:
                # DAPO: groups whose completions scored alike are replaced by new prompts' groups.
                samples, scores = self.dynamic_sampling(batch, samples, scores, update, timings)
            # 4. log-probs of policy and reference (+ values): the "old" log-probs of the clipped ratio,
            #    the KL's other side, and PPO's V(s_t); padding columns trimmed out of each forward pass.
            #    (With rollout_values='auto' the values wait for step 6a.)
            held_values = self.values_from_training_pass
            passes = self.rollout_logprobs(samples, timings, with_values=not held_values)
            # 5a. the shaped scores (scaling, clipping, overlong and stop-token penalties, in that order),
            #     the per-token KL estimate, and rows without a finite reward masked out of the update.
            rollout = self.assemble_rollout(samples, scores, passes)
        # 5b. per-token rewards: -kl_coef * KL at every token, the score added at the last one (LHPD).
        rewards = self.token_rewards(rollout)

        # 6a. (PPO, rollout_values='auto') the values: a no-grad pass gives them to the rows outside step
        #     7's first micro-batch; that micro-batch then runs its training forward pass, before any
        #     optimizer step, so its values are the rollout's for its rows (its graph is kept for step 7's
        #     backward pass; the no-grad pass runs first so that the two do not hold memory at once).
        held = None
        if held_values:
            first = self._first_micro_batch(rollout, update)
            values = self.rollout_values(rollout, first.rows, timings)
            began = time.perf_counter()
            held = self._first_training_forward(model, rollout, first)
            timings["timing/update"] += time.perf_counter() - began
            rows = held.rows.to(values.device)
            values[rows] = held.values.detach().float().masked_fill(~rollout.response_mask[rows], 0.0)
            rollout.values = values

        # 6. advantages (subclass hook): PPO's GAE over the values, RLOO's leave-one-out baseline over the
        #    k completions of each prompt.
        began = time.perf_counter()
        advantages = self.compute_advantages(rollout, rewards)
        timings["timing/advantages"] += time.perf_counter() - began

        # 7. num_ppo_epochs x num_mini_batches optimizer steps, each over gradient_accumulation_steps
        #    micro-batches, a new shuffle every epoch; the loss is the subclass hook (compute_policy_loss).
        #    With balance_batch (several processes), the rows first move so each process trains about as
        #    many tokens as the others (the groups were whole for step 6; the loss is per row).
        began = time.perf_counter()
        trained, trained_advantages, balance = rollout, advantages, {}
        if self.args.balance_batch and self.accelerator.num_processes > 1:
            trained, trained_advantages, balance = rebalance(
                rollout,
                advantages,
                pad_token_id=self.processing_class.pad_token_id,
                device=self.accelerator.device,
            )
        stats = self._optimize(model, trained, trained_advantages, update, held)
        stats.update(balance)
        timings["timing/update"] += time.perf_counter() - began

        # 8. metrics (TRL's names, over all processes) and the KL controller, which adapts kl_coef to the
        #    measured KL (LHPD's adaptive controller; a constant with adaptive_kl=False).
        metrics = self.rollout_metrics(rollout, advantages)
        metrics.update(stats)
        metrics.update(timings)
        elapsed = time.perf_counter() - start
        tokens = rollout.query_mask.sum() + rollout.response_mask.sum()
        tokens = float(self._gather(tokens.reshape(1).float()).sum())
        metrics["timing/step"] = elapsed
        metrics["perf/tokens_per_sec"] = tokens / elapsed
        metrics["perf/episodes_per_sec"] = self.batch_size / elapsed
        self.kl_ctl.update(metrics.get("objective/kl", 0.0), self.batch_size)
        metrics["objective/kl_coef"] = self.kl_ctl.value
        self._last_rollout, self._last_advantages = rollout, advantages
        return metrics

    @property
    def values_from_training_pass(self) -> bool:
        """Whether the update takes the rollout's values of step 7's first micro-batch from that
        micro-batch's training forward pass (``rollout_values='auto'``, PPO) instead of step 4's no-grad
        pass: where there is a value model, dropout is off (the training pass computes what a no-grad
        pass would), and the rows trained are the rows rolled out on this process with an engine that
        lets a forward pass wait for its backward (not DeepSpeed, no ``balance_batch`` over several
        processes)."""
        args = self.args
        return bool(
            self.value_model is not None
            and getattr(args, "rollout_values", "forward") == "auto"
            and args.disable_dropout
            and not self.is_deepspeed_enabled
            and not (args.balance_batch and self.accelerator.num_processes > 1)
        )

    def _epoch_orders(self, N: int, update: int) -> list[torch.Tensor]:
        """The shuffles of step 7, one per epoch (host tensors): fixed by ``seed``, the process and the
        update, so a resumed run and step 6a see the same."""
        args = self.args
        return [
            torch.randperm(
                N,
                generator=torch.Generator().manual_seed(
                    hash((args.seed, self.accelerator.process_index, update, epoch)) % (2**63)
                ),
            )
            for epoch in range(args.num_ppo_epochs)
        ]

    def _first_micro_batch(self, rollout: Rollout, update: int) -> FirstMicroBatch:
        """Step 7's first micro-batch (epoch 0, mini-batch 0), as :meth:`_optimize` will split it."""
        query_start = F.first_true_indices(rollout.query_mask).cpu()
        response_end = (F.last_true_indices(rollout.response_mask) + 1).cpu()
        order = self._epoch_orders(rollout.response.shape[0], update)[0]
        Q = rollout.query.shape[1]
        micro_batches = self.micro_batches(
            order[: self.args.local_mini_batch_size], query_start, response_end, Q
        )
        rows = micro_batches[0]
        return FirstMicroBatch(
            rows=rows,
            bounds=column_bounds(query_start[rows], response_end[rows], Q),
            last=len(micro_batches) == 1,
        )

    def _first_training_forward(
        self, model: nn.Module, rollout: Rollout, first: FirstMicroBatch
    ) -> HeldForward:
        """Step 6a: the training forward pass of step 7's first micro-batch, with gradient, under the
        gradient-sync context step 7 will run its backward pass in."""
        with self._micro_batch_sync(model, last=first.last):
            logprobs, values, entropy = self._training_forward(
                model, rollout, first.rows.to(rollout.response.device), first.bounds
            )
        assert values is not None, "rollout_values='auto' needs the value model's values"
        return HeldForward(first.rows, logprobs, values, entropy)

    def _micro_batch_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The gradient-sync context of a micro-batch's forward and backward passes: accumulation without
        an all-reduce except at the mini-batch's last micro-batch (DDP's ``no_sync``; DeepSpeed and a
        single process need none)."""
        compat.set_sync_gradients(self.accelerator, last)
        if last or self.is_deepspeed_enabled or self.accelerator.num_processes == 1:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def _wants_generation_logprobs(self) -> bool:
        """Whether step 2 keeps the sampling loop's log-probs: as the rollout's own
        (:attr:`logprobs_from_generation`) or for the loss (:attr:`needs_generation_logprobs`)."""
        return self.needs_generation_logprobs or self.logprobs_from_generation

    def rollout(self, batch: dict[str, Any], timings: dict[str, float] | None = None) -> Rollout:
        """Steps 2-5a of :meth:`_update` for a collated prompt ``batch`` (this process's share), as the
        update runs them: sampled, scored, with the log-probs of policy and reference, values and KL, in
        the training precision (with ``rollout_logprobs='generation'`` up to the rounding of the cached
        decode). The per-token rewards are :meth:`token_rewards` of the result."""
        timings = timings if timings is not None else defaultdict(float)
        with torch.no_grad(), self.accelerator.autocast():
            samples = self.sample_responses(
                batch, self.completions_per_prompt, self._wants_generation_logprobs(), timings
            )
            scores = self.score_samples(samples, timings)
            return self.assemble_rollout(samples, scores, self.rollout_logprobs(samples, timings))

    # ---- subclass hooks ---------------------------------------------------------------------------

    completions_per_prompt: int = 1
    #: The config field that sets ``completions_per_prompt`` (named in error messages).
    completions_per_prompt_name = "completions per prompt"

    @property
    def steps_per_update(self) -> int:
        """How many of Trainer's *steps* (``global_step``, ``max_steps``, ``logging_steps``,
        ``save_steps``, the learning-rate schedule) one update counts: 1 here (PPO and RLOO count updates,
        as TRL 0.x did); GRPO counts optimizer steps, as TRL's GRPOTrainer does."""
        return 1

    @property
    def needs_generation_logprobs(self) -> bool:
        """Whether the rollout keeps the generation's own log-probs (``Rollout.generation_logprobs``):
        with ``use_vllm`` (the mismatch metrics and importance weights); subclasses add their reasons."""
        return bool(self.args.use_vllm)

    def compute_advantages(self, rollout: Rollout, rewards: torch.Tensor) -> Advantages:
        """Step 6: the advantages of ``rollout`` (and what else the loss reads, e.g. PPO's returns).

        Args:
            rollout: the update's :class:`~rlhf_trainers.onpolicy.rollout.Rollout` (not to be modified).
            rewards: (N, R) per-token rewards (:meth:`token_rewards`: ``-kl_coef * KL`` per token, the
                shaped score at the last token).

        Returns:
            An :class:`~rlhf_trainers.onpolicy.rollout.Advantages`: ``advantages`` (N, R) or (N, 1), and
            the optional fields the subclass's loss and metrics use.
        """
        raise NotImplementedError

    def compute_policy_loss(
        self,
        rollout: Rollout,
        advantages: Advantages,
        rows: torch.Tensor,
        logprobs: torch.Tensor,
        values: torch.Tensor | None,
        normalization: LossNormalization | None = None,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Step 7's loss of one micro-batch.

        Args:
            rollout: the update's rollout; ``rollout.X[rows]`` are the micro-batch's rows.
            advantages: what :meth:`compute_advantages` returned for it.
            rows: (M,) long, the micro-batch's row indices into the rollout.
            logprobs: (M, R) log-probs of the responses under the current policy, with gradient.
            values: (M, R) the value model's current V(s_t), with gradient (PPO); None without one.
            normalization: the denominators of the optimizer step's loss (tokens and sequences of the
                whole mini-batch over all processes, :meth:`LossNormalization.denominator`): dividing the
                micro-batch's summed loss by them makes it its share of the mini-batch's loss. None:
                the micro-batch's own counts (``LossNormalization.local``), as when calling it directly.
            entropy: (M, R) the policy's entropy at each response position, with gradient, when
                ``entropy_coeff`` is not 0 (the bonus ``-entropy_coeff x entropy`` per token); else None.

        Returns:
            ``(loss, metrics)``: the micro-batch's share of the mini-batch's loss, back-propagated as it
            is, and detached scalar metrics (``loss/*`` are shares like the loss, the others means).
        """
        raise NotImplementedError

    # ---- the optimisation ------------------------------------------------------------------------

    def _training_forward(
        self,
        model: nn.Module,
        rollout: Rollout,
        rows: torch.Tensor,
        bounds: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Log-probs (with gradient), values (PPO) and the entropy (with gradient: ``entropy_coeff``) of
        rollout ``rows``.

        The forward pass covers only the columns some row of the micro-batch needs (``bounds``: first
        prompt column, end of the response columns; computed from the masks when None): leading prompt
        padding and the response padding after the longest response are left out, and the outputs are
        padded back to the rollout's response length with zeros at those (masked) positions."""
        R = rollout.response.shape[1]
        ids, mask, positions, response, packing = self._pass_inputs(
            rollout.query[rows],
            rollout.query_mask[rows],
            rollout.response[rows],
            rollout.response_mask[rows],
            bounds,
            training=True,
        )
        logprobs, values, entropy = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            with_values=self.value_model is not None,
            response=response,
            logprob_options=self._logprob_options(),
            fused_head=self._fused_policy,
            policy_packing=packing if self._pack_policy else None,
            value_packing=packing if self._pack_values else None,
        )
        if values is not None:
            values = pad_columns(values.float(), R)
        return pad_columns(logprobs, R), values, pad_columns(entropy, R)

    def _optimize(
        self,
        model: nn.Module,
        rollout: Rollout,
        advantages: Advantages,
        update: int,
        held: HeldForward | None = None,
    ) -> dict[str, float]:
        """Step 7: ``num_ppo_epochs`` x ``num_mini_batches`` optimizer steps over the rollout, each over
        ``gradient_accumulation_steps`` micro-batches (or those of the token budget,
        :meth:`micro_batches`); returns the mean metrics over processes. ``held``: the first micro-batch's
        forward pass, already run (step 6a)."""
        args = self.args
        N = rollout.response.shape[0]
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        grad_norms: list[float] = []
        is_deepspeed = self.is_deepspeed_enabled
        # Per row, on the host (one transfer per update, none per micro-batch): first real prompt column
        # and one past the last valid response column, from which each micro-batch's trim is read.
        query_start = F.first_true_indices(rollout.query_mask).cpu()
        response_end = (F.last_true_indices(rollout.response_mask) + 1).cpu()
        orders = self._epoch_orders(N, update)
        normalizations = self._loss_normalizations(rollout, orders)
        # vLLM's log-probs as the old ones: the first mini-batch's pass (the weights vLLM sampled with) is
        # where the trainer's own log-probs of the rollout are seen; the mismatch metrics come from it.
        mismatch: list[torch.Tensor] = []
        Q = rollout.query.shape[1]
        micro_batch_counts: list[int] = []
        for epoch, order_on_host in enumerate(orders):
            for mini_batch in range(args.num_mini_batches):
                size = args.local_mini_batch_size
                micro_batches = self.micro_batches(
                    order_on_host[mini_batch * size : (mini_batch + 1) * size], query_start, response_end, Q
                )
                micro_batch_counts.append(len(micro_batches))
                loss_sums: dict[str, torch.Tensor] = {}
                for micro, on_host in enumerate(micro_batches):
                    rows = on_host.to(rollout.response.device)
                    bounds = column_bounds(query_start[on_host], response_end[on_host], Q)
                    with self._micro_batch_sync(model, last=micro == len(micro_batches) - 1):
                        if held is not None:  # step 6a ran this micro-batch's forward pass
                            if not torch.equal(held.rows, on_host):
                                raise RuntimeError(
                                    "The first micro-batch of step 7 is not the one whose forward pass "
                                    f"step 6a ran (rows {held.rows.tolist()} vs {on_host.tolist()})."
                                )
                            logprobs, values, entropy = held.logprobs, held.values, held.entropy
                            held = None
                        else:
                            logprobs, values, entropy = self._training_forward(model, rollout, rows, bounds)
                        if epoch == 0 and mini_batch == 0 and micro == 0:
                            self._check_ratio_at_start(logprobs.detach(), rollout, rows, stats)
                        if epoch == 0 and mini_batch == 0 and self.vllm_logprobs_are_old:
                            mask = rollout.response_mask[rows]
                            mismatch.append((logprobs.detach() - rollout.logprobs[rows]).float()[mask])
                        loss, metrics = self.compute_policy_loss(
                            rollout,
                            advantages,
                            rows,
                            logprobs,
                            values,
                            normalizations[epoch][mini_batch],
                            entropy=entropy if args.entropy_coeff else None,
                        )
                        # The loss is already this micro-batch's share of the mini-batch's (its
                        # denominators count the whole mini-batch): no division by the accumulation steps.
                        kwargs = {"scale_wrt_gas": False} if is_deepspeed else {}
                        self.accelerator.backward(loss, **kwargs)
                    # detached: the metric must not keep the micro-batch's graph alive
                    stats["policy/entropy_avg"].append(
                        F.masked_mean(entropy.detach(), rollout.response_mask[rows])
                    )
                    for name, value in metrics.items():
                        if name.startswith("loss/"):
                            # shares of the mini-batch's loss: summed over its micro-batches
                            loss_sums[name] = loss_sums.get(name, 0.0) + value.detach().float()
                        else:
                            stats[name].append(value.detach().float())
                for name, value in loss_sums.items():
                    stats[name].append(value)
                if args.max_grad_norm and args.max_grad_norm > 0:
                    norm = compat.clip_grad_norm(self, model)
                    grad_norms.append(float(norm.item() if hasattr(norm, "item") else norm))
                    # The clipping norm covers the parameters the optimizer steps: when it is finite the
                    # non-finite-step guard need not scan every gradient again.
                    self._reliability.guard.note_grad_norm(grad_norms[-1])
                # (under DeepSpeed the engine stepped in the last backward; the callbacks hear it here, as
                # in Trainer's loop, and the non-finite guard counts a step the engine skipped)
                self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
                self.optimizer.step()
                self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
                if self.steps_per_update > 1:
                    self.lr_scheduler.step()  # a step is an optimizer step: the schedule moves with each
                model.zero_grad()
        if args.max_tokens_per_microbatch is not None:
            stats["perf/micro_batches_per_step"].append(
                torch.tensor(sum(micro_batch_counts) / len(micro_batch_counts))
            )
        reduced = self._reduce_means({name: torch.stack(v).mean() for name, v in stats.items()})
        if grad_norms:
            reduced["grad_norm"] = sum(grad_norms) / len(grad_norms)
        if self.vllm_logprobs_are_old:
            diff = torch.cat(mismatch) if mismatch else rollout.logprobs.new_zeros(0)
            reduced.update(self._sampling_mismatch_metrics(diff, None))
        return reduced

    def micro_batches(
        self, rows: torch.Tensor, query_start: torch.Tensor, response_end: torch.Tensor, query_width: int
    ) -> list[torch.Tensor]:
        """How one mini-batch (``rows``, host indices into the rollout, in the shuffled order) is split
        into micro-batches: ``gradient_accumulation_steps`` of ``per_device_train_batch_size`` rows, or,
        with ``max_tokens_per_microbatch``, as few micro-batches as keep each one's padded size (rows x
        its trimmed columns; its real tokens when the policy's passes are packed, ``padding_free``) within
        the budget: rows longest first, packed greedily (a row longer than
        the budget alone). The loss denominators count the whole mini-batch, so the split changes the
        gradient only by float rounding."""
        args = self.args
        budget = args.max_tokens_per_microbatch
        if budget is None:
            return list(rows.split(args.per_device_train_batch_size))
        prompt = (query_width - query_start[rows]).clamp_max(query_width)
        lengths = prompt + response_end[rows]
        order = rows[torch.argsort(lengths, descending=True, stable=True)]
        # Padding-free passes cost the real tokens (packed), padded ones rows x the widest row.
        packed = self._pack_policy
        parts: list[list[int]] = []
        widest_prompt = widest_response = tokens = 0
        for row in order.tolist():
            p = int(query_width - query_start[row])
            r = int(response_end[row])
            if parts:
                width = max(widest_prompt, p) + max(widest_response, r)
                cost = tokens + p + r if packed else (len(parts[-1]) + 1) * width
                if cost <= budget:
                    parts[-1].append(row)
                    widest_prompt, widest_response = max(widest_prompt, p), max(widest_response, r)
                    tokens += p + r
                    continue
            parts.append([row])
            widest_prompt, widest_response, tokens = p, r, p + r
        return [torch.tensor(part, dtype=rows.dtype) for part in parts]

    def _loss_normalizations(
        self, rollout: Rollout, orders: list[torch.Tensor]
    ) -> list[list[LossNormalization]]:
        """The denominators of every optimizer step of the update (per epoch, per mini-batch): the valid
        tokens and the sequences with a valid token of the mini-batch, summed over its micro-batches and
        over all processes (one collective for the whole update), divided by the number of processes
        (data-parallel gradients are averaged over them)."""
        args = self.args
        mask = rollout.response_mask.cpu()
        tokens, sequences = mask.sum(1).double(), mask.any(1).double()
        size = args.local_mini_batch_size
        counts = torch.stack(
            [
                torch.stack(
                    [tokens[order].reshape(-1, size).sum(1), sequences[order].reshape(-1, size).sum(1)]
                )
                for order in orders
            ]
        )  # (epochs, 2, mini-batches)
        world = self.accelerator.num_processes
        if world > 1:
            counts = self._all_reduce(counts.to(self.accelerator.device)).cpu()
        counts = (counts / world).float()
        device = rollout.response.device
        return [
            [
                LossNormalization(
                    tokens=counts[e, 0, m].to(device),
                    sequences=counts[e, 1, m].to(device),
                    max_length=args.response_length,
                )
                for m in range(counts.shape[2])
            ]
            for e in range(counts.shape[0])
        ]

    def kl_loss(self, rollout: Rollout, rows: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor | None:
        """``kl_loss_coef`` x the per-token KL estimate (``kl_loss_estimator``) of the current policy
        against the reference, for the loss (GRPO's ``beta`` term); None when ``kl_loss_coef`` is 0."""
        if not self.args.kl_loss_coef:
            return None
        kl = F.kl_penalty(logprobs, rollout.ref_logprobs[rows], self.args.kl_loss_estimator)
        return self.args.kl_loss_coef * kl

    def token_policy_loss(
        self,
        rollout: Rollout,
        advantages: torch.Tensor,
        rows: torch.Tensor,
        logprobs: torch.Tensor,
        normalization: LossNormalization | None,
        importance_weights: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """PPO's clipped loss per token of the micro-batch ``rows``: the ratio per token or of the sequence
        (``importance_sampling_level``), ``importance_weights`` ((M, R), or (M, 1) for a whole sequence),
        the KL loss term (``kl_loss_coef``) and the entropy bonus (``-entropy_coeff x entropy``, when the
        differentiable ``entropy`` is given), reduced with ``loss_agg_mode`` by ``normalization`` (None:
        the micro-batch's own counts). Returns ``(loss, metrics, aggregation)``: the metrics of
        :meth:`policy_loss_metrics`, and the aggregation keywords (for a value loss reduced alike)."""
        args = self.args
        mask = rollout.response_mask[rows]
        old = rollout.logprobs[rows]
        if normalization is None:
            normalization = LossNormalization.local(mask, args.response_length)
        if importance_weights is not None and importance_weights.shape != mask.shape:
            importance_weights = importance_weights.expand_as(mask)  # a sequence's weight at every token
        aggregation = normalization.aggregation(args.loss_agg_mode)
        kl_loss = self.kl_loss(rollout, rows, logprobs)
        extra = self.extra_token_loss(kl_loss, entropy)
        loss, pm = F.clipped_policy_loss(
            self.ratio_logprobs(logprobs, old, mask),
            old,
            advantages,
            mask,
            clip_low=args.cliprange,
            clip_high=args.cliprange_high,
            dual_clip=args.dual_clip,
            importance_weights=importance_weights,
            extra_loss=extra,
            **aggregation,
        )
        return loss, self.policy_loss_metrics(loss, pm, kl_loss, mask), aggregation

    def extra_token_loss(
        self, kl_loss: torch.Tensor | None, entropy: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The per-token terms added to the clipped loss: the KL loss (``kl_loss``, already scaled) and
        the entropy bonus ``-entropy_coeff x entropy`` (``entropy`` given only when the coefficient is
        not 0); None when there is neither."""
        terms = [
            t
            for t in (kl_loss, None if entropy is None else -self.args.entropy_coeff * entropy)
            if t is not None
        ]
        if not terms:
            return None
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]

    def policy_loss_metrics(
        self,
        loss: torch.Tensor,
        pm: dict[str, torch.Tensor],
        kl_loss: torch.Tensor | None,
        mask: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The metrics of a clipped policy loss (TRL's names): ``loss/policy_avg``, approx. KL, clip
        fractions, ratio mean and variance, and ``policy/kl_loss_avg`` with a KL loss term."""
        metrics = {
            "loss/policy_avg": loss.detach(),
            "policy/approxkl_avg": pm["approxkl"],
            "policy/clipfrac_avg": pm["clipfrac"],
            "policy/dual_clipfrac_avg": pm["dual_clipfrac"],
            "val/ratio": pm["ratio_mean"],
            "val/ratio_var": pm["ratio_var"],
        }
        if kl_loss is not None:
            metrics["policy/kl_loss_avg"] = F.masked_mean(kl_loss.detach() / self.args.kl_loss_coef, mask)
        return metrics

    def ratio_logprobs(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The log-probs whose difference to ``old_logprobs`` is the clipped ratio's log: ``logprobs`` for
        ``importance_sampling_level='token'``; for ``'sequence'`` (GSPO) ``old + mean over the sequence's
        valid tokens of (logprobs - old)`` at every token, so each token's ratio is the sequence's."""
        if self.args.importance_sampling_level == "token":
            return logprobs
        mask = mask.to(logprobs.dtype)
        mean = ((logprobs - old_logprobs) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(
            1
        )
        return old_logprobs + mean.expand_as(logprobs)

    def _check_ratio_at_start(
        self,
        logprobs: torch.Tensor,
        rollout: Rollout,
        rows: torch.Tensor,
        stats: dict[str, list[torch.Tensor]],
    ) -> None:
        """Numerics guard: before any optimizer step of an update the policy is the one that produced the
        rollout log-probs, so the ratio must be 1 up to rounding."""
        mask = rollout.response_mask[rows]
        diff = (logprobs - rollout.logprobs[rows]) * mask
        deviation = (diff.exp() - 1).abs() * mask
        worst = deviation.max() if deviation.numel() else torch.zeros((), device=logprobs.device)
        stats["policy/ratio_at_start"].append(worst.float())
        # The RLOO blog's view of the same thing: the ratio of whole sequences (what a sequence-level
        # loss clips), where small per-token differences multiply.
        seq_ratio = diff.sum(1).exp()[mask.any(1)]
        if seq_ratio.numel():
            clip = self.args.cliprange
            stats["policy/seq_ratio_at_start_mean"].append(seq_ratio.mean().float())
            stats["policy/seq_ratio_at_start_max"].append(seq_ratio.max().float())
            stats["policy/seq_ratio_at_start_clipfrac"].append(
                ((seq_ratio < 1 - clip) | (seq_ratio > 1 + clip)).float().mean()
            )
        if float(worst) > self.args.ratio_tolerance and not self._ratio_warned and self.args.should_log:
            self._ratio_warned = True
            if self.vllm_logprobs_are_old:
                logger.warning(
                    "policy ratio at the first mini-batch deviates from 1 by %.3g (> ratio_tolerance=%g): with "
                    "rollout_logprobs='generation' the ratio's denominator is vLLM's log-prob, and vLLM's "
                    "distribution differs from the trained one (see sampling/sampling_logp_difference); the clip "
                    "then acts on that difference too. Run vLLM in the policy's dtype (vllm_dtype='auto') or "
                    "use rollout_logprobs='auto' (recomputed log-probs + vllm_importance_sampling_correction).",
                    float(worst),
                    self.args.ratio_tolerance,
                )
                return
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

    def rollout_metrics(self, rollout: Rollout, advantages: Advantages) -> dict[str, float]:
        """Step 8: TRL's objective/* and val/* metrics of a rollout, over all processes (subclasses add
        their own from ``advantages``)."""
        mask = rollout.response_mask
        valid = rollout.valid_rows
        kl_seq = rollout.kl.sum(1)
        non_score = -self.kl_ctl.value * kl_seq
        entropy_seq = -(rollout.logprobs * mask).sum(1)
        eos = self.processing_class.eos_token_id
        response = rollout.response
        # EOS tokens inside each response (up to its length): the padding after it may be EOS as well
        # (a tokenizer whose pad token is its EOS token).
        inside = torch.arange(response.shape[1], device=response.device)[None, :] < rollout.lengths[:, None]
        per_row = torch.stack(
            [
                kl_seq,
                entropy_seq,
                non_score,
                rollout.scores + non_score,
                rollout.scores,
                rollout.raw_scores.nan_to_num(0.0),
                rollout.lengths.float(),
                ((response == eos) & inside).sum(1).float() if eos is not None else torch.zeros_like(kl_seq),
                rollout.found_stop.float(),
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
            "rollout/reward_func_errors": float(self._gather(rollout.reward_func_errors.reshape(1)).sum()),
        }
        if self.args.dynamic_sampling:
            # rounds (max over processes), groups dropped and groups that still had to fill the rollout
            stats = self._gather(self._dynamic_sampling_stats.reshape(1, 3).float()).cpu()
            metrics["rollout/dynamic_sampling_rounds"] = float(stats[:, 0].max())
            metrics["rollout/dynamic_sampling_groups_dropped"] = float(stats[:, 1].sum())
            metrics["rollout/dynamic_sampling_groups_short"] = float(stats[:, 2].sum())
        if not self.args.uses_reference_model:
            # No reference policy was run: there is no KL to report (it would read 0).
            del metrics["objective/kl"], metrics["objective/non_score_reward"]
        for name, scores in rollout.per_source.items():
            values = self._gather(scores.float())
            finite = torch.isfinite(values)
            metrics[f"objective/scores/{name}"] = (
                float(values[finite].mean()) if finite.any() else float("nan")
            )
        if self.args.use_vllm and rollout.generation_logprobs is not None and not self.vllm_logprobs_are_old:
            mask = rollout.response_mask
            weights = rollout.sampling_weights
            if weights is None:
                w = None
            elif weights.shape == mask.shape:  # per token
                w = weights[mask].float()
            else:  # per sequence
                w = weights[rollout.valid_rows].reshape(-1).float()
            diff = (rollout.logprobs - rollout.generation_logprobs).float()[mask]
            metrics.update(self._sampling_mismatch_metrics(diff, w))
        return metrics

    @property
    def vllm_logprobs_are_old(self) -> bool:
        """Whether the rollout's log-probs (the clipped ratio's denominator) are vLLM's own
        (``rollout_logprobs='generation'`` with ``use_vllm``, verl's bypass mode): no policy forward pass in
        the rollout, no separate importance weights, and the mismatch metrics measured on the update's
        first mini-batch (:meth:`_optimize`), before its first optimizer step."""
        return bool(self.args.use_vllm and self.logprobs_from_generation)

    def _sampling_mismatch_metrics(
        self, diff: torch.Tensor, weights: torch.Tensor | None
    ) -> dict[str, float]:
        """How far vLLM's sampling distribution is from the trained one, over valid response tokens of all
        processes (TRL's ``sampling/*`` names): the mean and max of |logp_train - logp_vllm| (``diff``, one
        value per token), a k3 estimate of KL(pi_vllm || pi_train) (the tokens were sampled from vLLM), the
        importance ``weights`` (after the cap; per token or per sequence; None: not applied) and the
        seconds of the last weight sync. A collective: every process calls it."""
        k3 = (diff.exp() - 1) - diff
        w = diff.new_zeros(0) if weights is None else weights
        count = diff.new_tensor(float(diff.numel()))
        sums = torch.stack([count, diff.abs().sum(), k3.sum(), w.sum(), w.new_tensor(float(w.numel()))])
        sums = self._all_reduce(sums.double().to(self.accelerator.device)).cpu()
        big = torch.finfo(torch.float32).max
        extremes = torch.stack(
            [
                diff.abs().max() if diff.numel() else diff.new_tensor(0.0),
                -w.min() if w.numel() else w.new_tensor(-big),
                w.max() if w.numel() else w.new_tensor(-big),
            ]
        )
        top = self._gather(extremes.reshape(1, 3).to(self.accelerator.device)).max(0).values.cpu()
        n = float(sums[0])
        metrics = {
            "sampling/sampling_logp_difference/mean": float(sums[1]) / n if n else 0.0,
            "sampling/sampling_logp_difference/max": float(top[0]),
            "sampling/kl_vllm_train": float(sums[2]) / n if n else 0.0,
            "timing/weight_sync": float(getattr(self.generation_backend, "last_sync_seconds", 0.0)),
        }
        if weights is not None and float(sums[4]) > 0:
            metrics["sampling/importance_sampling_ratio/min"] = -float(top[1])
            metrics["sampling/importance_sampling_ratio/max"] = float(top[2])
            metrics["sampling/importance_sampling_ratio/mean"] = float(sums[3] / sums[4])
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
        if resume_from_checkpoint is not None:
            self._check_resume_process_count(resume_from_checkpoint)
        self.is_in_train = True
        self.interrupted = False
        apply_host_memory_settings(self)
        if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
            self._enable_gradient_checkpointing()
        if resume_from_checkpoint is not None and not self.is_deepspeed_enabled:
            compat.load_from_checkpoint(self, resume_from_checkpoint)
        steps = self.steps_per_update
        compat.init_training_state(
            self,
            self.num_updates * steps,
            self.updates_per_data_epoch * steps,
            math.ceil(self.num_updates / self.updates_per_data_epoch),
            resume_from_checkpoint,
            trial,
        )
        model, _ = compat.prepare_for_training(self, self.num_updates * steps, None, resume_from_checkpoint)
        if resume_from_checkpoint is not None:
            compat.load_rng_state(self, resume_from_checkpoint)
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
        self._pass_open = False  # on_epoch_begin heard for the pass this call trains in
        while self.state.global_step < self.num_updates * steps and not self.control.should_training_stop:
            last_metrics = self._training_step(model, sample_every)
            if "loss/policy_avg" in last_metrics:
                policy_losses.append(last_metrics["loss/policy_avg"])
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

    def _training_step(self, model: nn.Module, sample_every: int) -> dict[str, float]:
        """One update with the callbacks and the bookkeeping around it; returns its metrics.

        Trainer's *epoch* is here a pass over the prompts (``updates_per_data_epoch`` updates): the
        callbacks hear ``on_epoch_begin`` and ``on_epoch_end`` at its boundaries, so the "epoch"
        strategies (``eval_strategy``, ``save_strategy``, ``logging_strategy``) act at the end of each
        pass, and, as in ``Trainer``, at the end of a run that stops within one. A run resumed within a
        pass hears ``on_epoch_begin`` at its first update, as ``Trainer`` calls it for a resumed epoch."""
        args = self.args
        steps = self.steps_per_update
        update = self.state.global_step // steps
        if update % self.updates_per_data_epoch == 0 or not self._pass_open:
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            self._pass_open = True
        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        lr = compat.get_learning_rate(self)  # the rate this update trains with (its first step's)
        with self._compiled_passes():
            metrics = self._update(model, update)
        if steps == 1:
            self.lr_scheduler.step()  # (else stepped after each optimizer step, in _optimize)
        self.state.global_step += steps
        done = update + 1
        self.state.epoch = done / self.updates_per_data_epoch
        metrics["lr"] = lr
        metrics["episode"] = done * self.batch_size
        metrics["train/nonfinite_steps_skipped"] = float(self._reliability.guard.skipped)
        for name, value in metrics.items():
            self._log_buffer[name].append(value)
        if sample_every and update % sample_every == 0:
            self._log_samples(self._last_rollout)
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        if steps > 1:
            self._act_on_crossed_steps(self.state.global_step - steps, self.state.global_step)
        if done % self.updates_per_data_epoch == 0 or self.control.should_training_stop:
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._pass_open = False
        self._log_save_evaluate(model)
        return metrics

    def _act_on_crossed_steps(self, before: int, after: int) -> None:
        """When an update counts several steps (``steps_per_update > 1``), log, evaluate and save at its
        end if a logging / evaluation / save step fell within it (Trainer's flow callback only looks at
        the step the update ended on)."""
        state, args = self.state, self.args
        for strategy, every, flag in (
            (args.logging_strategy, state.logging_steps, "should_log"),
            (args.eval_strategy, state.eval_steps, "should_evaluate"),
            (args.save_strategy, state.save_steps, "should_save"),
        ):
            if (
                str(getattr(strategy, "value", strategy)) == "steps"
                and every
                and after // every > before // every
            ):
                setattr(self.control, flag, True)

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
            compat.save_checkpoint(self, model)
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
