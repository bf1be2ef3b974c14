"""OnPolicyTrainer: the on-policy update PPO, RLOO and GRPO share, as a ``transformers.Trainer``.

One *update* (a Trainer step, or several where a step is an optimizer step) is
:meth:`OnPolicyTrainer._update`, eight numbered steps, each one call to a part of the engine:

- a rollout producer (:mod:`~rlhf_trainers.onpolicy.producer`) makes the update's experience, a typed
  :class:`~rlhf_trainers.onpolicy.rollout.Rollout`, with the policy's sampler
  (:mod:`~rlhf_trainers.onpolicy.sampling`), the models' forward passes
  (:mod:`~rlhf_trainers.onpolicy.passes`) and the reward sources;
- the algorithm's objective (``ppo/objective.py``, ``rloo/objective.py``, ``grpo/objective.py``) gives
  the per-token rewards, the advantages, the loss and its own metrics;
- the optimization loop (:mod:`~rlhf_trainers.onpolicy.optimize`) runs the epochs x mini-batches x
  micro-batches with that loss;
- the shared metrics (:mod:`~rlhf_trainers.onpolicy.metrics`), evaluation
  (:mod:`~rlhf_trainers.onpolicy.evaluation`), saving and resuming
  (:mod:`~rlhf_trainers.onpolicy.checkpoint`) and construction (:mod:`~rlhf_trainers.onpolicy.setup`).

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
from transformers.trainer_utils import TrainOutput, get_last_checkpoint, speed_metrics

from .. import compat
from .. import functional as F
from ..compat import TrainerHooksMixin
from ..compilation import CompiledBlocks
from ..cpu import CPUOptions, apply_host_memory_settings, resolve_cpu_options
from ..data import PromptCollator
from ..display import install_display
from ..distributed_exit import tear_down_process_group_at_exit
from ..generation.factory import backend_summary
from ..models import _is_peft_model
from ..optim import TFStyleAdam
from ..reliability import AtomicCheckpoints, reliability_callback
from . import checkpoint, evaluation
from .balance import rebalance
from .config import TORCH_COMPILE_WITH_DEEPSPEED, OnPolicyConfig
from .evaluation import RANK_SEED_STRIDE, SAMPLES_FILE
from .forward import PolicyAndValue
from .metrics import Collectives, rollout_metrics, rollout_sampling_metrics, trl_sample_metrics
from .objective import Objective
from .optimize import OptimizationLoop
from .passes import ModelPasses
from .producer import ProducerHooks, RolloutProducer
from .rollout import Advantages, LossNormalization, Rollout
from .sampling import PolicySampler
from .setup import (
    batch_plan,
    fill_deepspeed_bucket_sizes,
    load_models,
    policy_tokenizer,
    prepare_prompts,
    resolve_stop_ids,
    reward_sources,
    rollout_inputs,
)

if TYPE_CHECKING:
    import datasets
    from peft import PeftConfig
    from transformers import PreTrainedModel, TrainerCallback

    from ..generation import GenerationBackend

logger = logging.getLogger(__name__)


class OnPolicyTrainer(TrainerHooksMixin, ProducerHooks, Trainer):
    """The engine of :class:`~rlhf_trainers.PPOTrainer`, :class:`~rlhf_trainers.RLOOTrainer` and
    :class:`~rlhf_trainers.GRPOTrainer`.

    A subclass sets ``_config_class``, ``objective_class`` (its
    :class:`~rlhf_trainers.onpolicy.objective.Objective`) and ``completions_per_prompt``; PPO also
    :meth:`build_value_model`. The constructor's arguments are documented on the subclasses.

    Attributes:
        producer: the rollout producer (:class:`~rlhf_trainers.onpolicy.producer.RolloutProducer`).
        algorithm: the algorithm's objective (advantages, loss, metrics); not ``objective``, which
            ``Trainer`` sets in a hyperparameter search.
        loop: the optimization loop (:class:`~rlhf_trainers.onpolicy.optimize.OptimizationLoop`).
        sampler: the policy's sampler (:class:`~rlhf_trainers.onpolicy.sampling.PolicySampler`).
        passes: the models' forward passes (:class:`~rlhf_trainers.onpolicy.passes.ModelPasses`).
        collectives: sums, gathers and means over processes.
        reward_sources: every reward source of the run.
    """

    _config_class: type[OnPolicyConfig] = OnPolicyConfig
    objective_class: type[Objective] = Objective
    algorithm_name = "on-policy"
    completions_per_prompt: int = 1
    #: The config field that sets ``completions_per_prompt`` (named in error messages).
    completions_per_prompt_name = "completions per prompt"

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
        cpu_options: CPUOptions | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
        rollout_func: Callable[[list[Any], Any], Any] | None = None,
    ) -> None:
        args = self._checked_args(args)
        #: The CPU speed switches (rlhf_trainers.cpu); the defaults when None was given.
        self.cpu_options = resolve_cpu_options(cpu_options)
        paths = dict(model=model, ref_model=ref_model, reward_model=reward_model, value_model=value_model)
        options = dict(tools=tools, environment_factory=environment_factory, rollout_func=rollout_func)
        train_dataset, processing_class, extra_rewards = rollout_inputs(  # before anything loads
            self, args, model, processing_class, train_dataset, paths, reward_model, reward_funcs, options
        )
        processing_class = policy_tokenizer(model, processing_class)
        stop_ids = resolve_stop_ids(args, processing_class)

        # ---- models and reward sources ----
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
        self.ref_model = models.ref_model
        self.reward_model = models.reward_model
        self.reward_sources = reward_sources(models, processing_class, reward_funcs, args, extra_rewards)

        # ---- data ----
        self.preprocessing_stats: dict[str, Any] = {}
        train_dataset, eval_dataset = prepare_prompts(
            train_dataset,
            eval_dataset,
            processing_class,
            args,
            models,
            stop_ids=stop_ids,
            reward_model_reads_ids=self.reward_sources.same_tokenizer,
            value_model_given=value_model is not None,
            stats=self.preprocessing_stats,
            chat_template_kwargs=getattr(self, "prompt_chat_template_kwargs", None),  # tools=
        )
        super().__init__(
            model=PolicyAndValue(models.policy, models.value_model),
            args=args,
            data_collator=data_collator or PromptCollator(processing_class.pad_token_id),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        tear_down_process_group_at_exit()

        self._build_parts(models, stop_ids)
        self._compiled = self._compile_blocks()
        self.kl_ctl: F.AdaptiveKLController | F.FixedKLController = (
            F.AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
            if args.adaptive_kl
            else F.FixedKLController(args.kl_coef)
        )
        self._checkpoints = AtomicCheckpoints(self)
        self._log_buffer: dict[str, list[float]] = defaultdict(list)
        self._pass_open = False
        #: True when the last train() stopped early on SIGTERM/SIGINT (``save_on_interrupt``).
        self.interrupted = False
        # (the engine steps its learning-rate schedule itself, skipped optimizer steps included)
        self._reliability = reliability_callback(self, loop_holds_schedule_on_skip=False)
        self.add_callback(self._reliability)
        #: The progress bar and summary (rlhf_trainers.display); None with disable_tqdm=True (dicts printed).
        self.display = install_display(self, self.algorithm_name, self.algorithm.display_metrics)

    def _build_parts(self, models: Any, stop_ids: list[int]) -> None:
        """The batch plan and the engine's parts, once ``Trainer.__init__`` made the accelerator."""
        args = self.args
        plan = batch_plan(
            args,
            completions_per_prompt=self.completions_per_prompt,
            completions_name=self.completions_per_prompt_name,
            num_prompts=len(self.train_dataset),
            world=self.accelerator.num_processes,
            steps_per_update=self.steps_per_update,
            deepspeed=self.is_deepspeed_enabled,
        )
        self.local_prompts, self.batch_size = plan.local_prompts, plan.batch_size
        self.prompts_per_update = plan.prompts_per_update
        self.updates_per_data_epoch = plan.updates_per_data_epoch
        self.num_updates, self.total_episodes = plan.num_updates, plan.total_episodes
        fill_deepspeed_bucket_sizes(self)
        self.collectives = Collectives(self.accelerator)
        self.algorithm = self.objective_class(args, self.collectives)
        self.passes = ModelPasses(self, models.vocab)
        self.sampler = PolicySampler(self, stop_ids, self.cpu_options)
        self.producer: RolloutProducer = self.make_producer()
        self.loop = OptimizationLoop(self)

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
        """One on-policy update (one Trainer step): the whole algorithm, step by step."""
        timings: dict[str, float] = defaultdict(float)
        start = time.perf_counter()

        # 1. rollout (the producer): this process's prompts of the update, k completions each, scored by
        #    the reward sources, with the log-probs of policy and reference (PPO: and the values), the
        #    per-token KL and the shaped scores; rows without a finite reward masked out. No gradient.
        rollout = self.producer.produce(update, timings, with_values=not self.loop.values_from_training_pass)
        # 2. per-token rewards: -kl_coef * KL at every token, the score added at the last one (LHPD).
        rewards = self.token_rewards(rollout)
        # 3. (PPO, rollout_values='auto') the values of the optimization's first micro-batch from its
        #    training forward pass, the others' from a no-grad pass; that forward pass is kept for step 5.
        self.loop.fill_values(model, rollout, update, timings)
        # 4. advantages (the objective): PPO's GAE over the values, RLOO's leave-one-out baseline over the
        #    k completions of each prompt, GRPO's registered advantage_estimator.
        began = time.perf_counter()
        advantages = self.compute_advantages(rollout, rewards)
        timings["timing/advantages"] += time.perf_counter() - began
        # 5. num_ppo_epochs x num_mini_batches optimizer steps, each over gradient-accumulated micro-batches,
        #    a new shuffle every epoch, with the objective's loss. With balance_batch (several processes)
        #    the rows first move so each process trains about as many tokens as the others.
        began = time.perf_counter()
        stats = self._optimize(model, rollout, advantages, update)
        timings["timing/update"] += time.perf_counter() - began
        # 6. metrics (TRL's names, over all processes): the rollout's, the objective's and the loop's.
        metrics = self.rollout_metrics(rollout, advantages)
        metrics.update(stats)
        metrics.update(timings)
        # 7. throughput of the update.
        metrics.update(self._throughput(rollout, time.perf_counter() - start))
        # 8. the KL controller adapts kl_coef to the measured KL (LHPD's adaptive controller; a constant
        #    with adaptive_kl=False).
        self.kl_ctl.update(metrics.get("objective/kl", 0.0), self.batch_size)
        metrics["objective/kl_coef"] = self.kl_ctl.value
        self._last_rollout, self._last_advantages = rollout, advantages
        return metrics

    def _optimize(
        self, model: nn.Module, rollout: Rollout, advantages: Advantages, update: int
    ) -> dict[str, float]:
        """Step 5: the optimization loop over the rollout (after :func:`~.balance.rebalance` with
        ``balance_batch`` on several processes; the groups were whole for step 4, the loss is per row)."""
        balance: dict[str, float] = {}
        if self.args.balance_batch and self.accelerator.num_processes > 1:
            rollout, advantages, balance = rebalance(
                rollout,
                advantages,
                pad_token_id=self.processing_class.pad_token_id,
                device=self.accelerator.device,
            )
        stats = self.loop.run(model, rollout, advantages, update)
        stats.update(balance)
        return stats

    def _throughput(self, rollout: Rollout, elapsed: float) -> dict[str, float]:
        """``timing/step`` and the tokens and episodes per second of an update (over all processes)."""
        tokens = rollout.query_mask.sum() + rollout.response_mask.sum()
        tokens = float(self.collectives.gather(tokens.reshape(1).float()).sum())
        return {
            "timing/step": elapsed,
            "perf/tokens_per_sec": tokens / elapsed,
            "perf/episodes_per_sec": self.batch_size / elapsed,
        }

    def rollout(self, batch: dict[str, Any], timings: dict[str, float] | None = None) -> Rollout:
        """The rollout of a collated prompt ``batch`` (this process's share) as the update makes it:
        sampled, scored, with the log-probs of policy and reference, values and KL, in the training
        precision. The per-token rewards are :meth:`token_rewards` of the result."""
        return self.producer.rollout(batch, timings)

    # ---- the algorithm (the objective) ----------------------------------------------------------------

    @property
    def steps_per_update(self) -> int:
        """How many of Trainer's *steps* (``global_step``, ``max_steps``, ``logging_steps``,
        ``save_steps``, the learning-rate schedule) one update counts: 1 here (PPO and RLOO count updates,
        as TRL 0.x did); GRPO counts optimizer steps, as TRL's GRPOTrainer does."""
        return 1

    @property
    def needs_generation_logprobs(self) -> bool:
        """Whether the rollout keeps the generation's own log-probs (``Rollout.generation_logprobs``):
        with ``use_vllm`` (the mismatch metrics and importance weights), or for the objective's loss."""
        return bool(self.args.use_vllm) or self.algorithm.needs_generation_logprobs

    @property
    def wants_generation_logprobs(self) -> bool:
        """Whether sampling keeps its own log-probs: as the rollout's (:attr:`logprobs_from_generation`)
        or for the loss (:attr:`needs_generation_logprobs`)."""
        return self.needs_generation_logprobs or self.logprobs_from_generation

    @property
    def logprobs_from_generation(self) -> bool:
        """Whether the rollout takes its log-probs and entropy from the sampling loop
        (``rollout_logprobs``, with 'auto' resolved against the policy's dtype and the precision)."""
        return self.sampler.logprobs_from_generation

    @property
    def vllm_logprobs_are_old(self) -> bool:
        """Whether the rollout's log-probs (the clipped ratio's denominator) are vLLM's own
        (``rollout_logprobs='generation'`` with ``use_vllm``, verl's bypass mode): no policy forward pass in
        the rollout, no separate importance weights, and the mismatch metrics measured on the update's
        first mini-batch, before its first optimizer step."""
        return bool(self.args.use_vllm and self.logprobs_from_generation)

    @property
    def generation_backend(self) -> GenerationBackend:
        """The generation backend (:mod:`rlhf_trainers.generation`), chosen once at construction."""
        return self.sampler.backend

    @property
    def weight_sync_seconds(self) -> float:
        """Seconds of the generation backend's last weight sync (vLLM), 0 where it has none."""
        return float(getattr(self.generation_backend, "last_sync_seconds", 0.0))

    def token_rewards(self, rollout: Rollout) -> torch.Tensor:
        """Step 2: (N, R) per-token rewards of ``rollout`` at the current ``kl_coef`` (the objective's)."""
        return self.algorithm.token_rewards(rollout, self.kl_ctl.value)

    def compute_advantages(self, rollout: Rollout, rewards: torch.Tensor) -> Advantages:
        """Step 4: the objective's :class:`~rlhf_trainers.onpolicy.rollout.Advantages` of ``rollout`` (not
        modified) from its (N, R) per-token ``rewards`` (:meth:`token_rewards`): ``advantages`` (N, R) or
        (N, 1), and what else the loss and metrics read (PPO's returns, ...)."""
        return self.algorithm.advantages(rollout, rewards, self.kl_ctl.value)

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
        """Step 5's loss of one micro-batch: the objective's
        (:meth:`~rlhf_trainers.onpolicy.objective.Objective.loss`, which documents the arguments), at this
        ``global_step``. Returns ``(loss, metrics)``: the micro-batch's share of the mini-batch's loss and
        detached scalar metrics."""
        return self.algorithm.loss(
            rollout, advantages, rows, logprobs, values, normalization, entropy, step=self.state.global_step
        )

    def rollout_metrics(self, rollout: Rollout, advantages: Advantages) -> dict[str, float]:
        """Step 6: TRL's objective/* and val/* metrics of a rollout over all processes, the vLLM
        sampling mismatch (where the trainer recomputed the log-probs), and the objective's own. Where the
        objective logs TRL 1.x's names (GRPO, RLOO: ``trl_metric_names``), also ``reward``, ``reward_std``,
        ``rewards/<source>/*``, ``completions/*`` and ``num_tokens`` (the prompt and completion tokens
        trained on so far, all processes: ``state.num_input_tokens_seen``, which this call advances)."""
        metrics = rollout_metrics(
            rollout,
            self.collectives,
            kl_coef=self.kl_ctl.value,
            eos_token_id=self.processing_class.eos_token_id,
            uses_reference_model=self.args.uses_reference_model,
        )
        if self.algorithm.trl_metric_names:
            trl, tokens = trl_sample_metrics(
                rollout.raw_scores,
                rollout.per_source,
                rollout.lengths
                if rollout.inserted_tokens is None
                else rollout.lengths - rollout.inserted_tokens,
                rollout.found_stop,
                rollout.query_mask.sum(1),
                self.collectives,
            )
            self.state.num_input_tokens_seen += int(tokens)
            trl["num_tokens"] = float(self.state.num_input_tokens_seen)
            metrics.update(trl)
        if self.args.use_vllm and rollout.generation_logprobs is not None and not self.vllm_logprobs_are_old:
            metrics.update(rollout_sampling_metrics(rollout, self.collectives, self.weight_sync_seconds))
        metrics.update(self.algorithm.metrics(rollout, advantages))
        return metrics

    # ---- evaluation, saving and loading (Trainer's hooks) ------------------------------------------

    def evaluate(
        self,
        eval_dataset: datasets.Dataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Generate on ``eval_dataset`` (default: the one given at construction) with the training
        sampling settings, score with every reward source and log ``{prefix}_objective/scores`` (and per
        source), the response length and the stop-token rate, with Trainer's ``{prefix}_runtime`` and
        speeds; GRPO and RLOO add TRL 1.x's ``{prefix}_reward``, ``{prefix}_reward_std``,
        ``{prefix}_rewards/<source>/mean`` and ``/std``, ``{prefix}_completions/*`` and
        ``{prefix}_num_tokens`` (:func:`.evaluation.evaluate`). The sampling RNG is seeded from ``seed``
        and forked, so evaluation neither changes the training run nor varies between calls on the same
        weights."""
        return evaluation.evaluate(self, eval_dataset, ignore_keys, metric_key_prefix)

    def tokenized_prompts(self, dataset: datasets.Dataset, name: str = "eval") -> datasets.Dataset:
        """``dataset`` of prompts tokenized as the training prompts are, ready for ``data_collator``."""
        return evaluation.tokenized_prompts(self, dataset, name)

    def batch_accounting(self) -> str:
        """The sizes of one update, as printed before training."""
        args = self.args
        world = self.accelerator.num_processes
        return (
            f"{type(self).__name__}: {self.prompts_per_update} prompts x {self.completions_per_prompt} "
            f"completion(s) = {self.batch_size} completions per update ({args.local_batch_size} per process x "
            f"{world} processes) -> {args.num_ppo_epochs} epoch(s) x {args.num_mini_batches} mini-batch(es) of "
            f"{args.local_mini_batch_size * world} -> {args.gradient_accumulation_steps} micro-batch(es) of "
            f"{args.per_device_train_batch_size} per process -> "
            f"{args.num_ppo_epochs * args.num_mini_batches} optimizer steps per update; {self.num_updates} "
            f"updates, {self.total_episodes} episodes; generation: {backend_summary(self.generation_backend)}."
        )

    def write_model(self, output_dir: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the policy (``from_pretrained`` / PEFT adapter folder), the value model in
        ``value_model/`` and the tokenizer into ``output_dir`` (:func:`.checkpoint.write_model`)."""
        checkpoint.write_model(self, output_dir, state_dict)

    def write_extra_checkpoint_state(self, folder: str) -> None:
        """``onpolicy_state.json`` in a checkpoint (:func:`.checkpoint.write_extra_checkpoint_state`)."""
        checkpoint.write_extra_checkpoint_state(self, folder)

    def checkpoint_run_dir(self, trial: Any) -> str:
        """Where ``Trainer`` writes a checkpoint: the staging folder of :class:`AtomicCheckpoints` while
        one is being written, else the run's folder."""
        return self._checkpoints.run_dir(super().checkpoint_run_dir(trial))

    def write_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """``Trainer``'s checkpoint with :meth:`write_extra_checkpoint_state`, written atomically
        (:class:`~rlhf_trainers.reliability.AtomicCheckpoints`)."""
        self._checkpoints.write(
            super().checkpoint_run_dir(trial),
            lambda: super(OnPolicyTrainer, self).write_checkpoint(model, trial),
            self.write_extra_checkpoint_state,
        )

    def load_weights_from_checkpoint(self, checkpoint_dir: str, model: nn.Module | None = None) -> None:
        """Load the policy and value model saved by :meth:`write_model`."""
        checkpoint.load_weights_from_checkpoint(self, checkpoint_dir, model)

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
            checkpoint.check_resume(self, resume_from_checkpoint)
        self.is_in_train = True
        self.interrupted = False
        apply_host_memory_settings(self.cpu_options, args.device)
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
            checkpoint.load_onpolicy_state(self, resume_from_checkpoint)
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
        first_step = self.state.global_step
        self._pass_open = False  # on_epoch_begin heard for the pass this call trains in
        while self.state.global_step < self.num_updates * steps and not self.control.should_training_stop:
            last_metrics = self._training_step(model, sample_every)
            if "loss/policy_avg" in last_metrics:
                policy_losses.append(last_metrics["loss/policy_avg"])
        # training_loss, as Trainer reports it: the mean policy loss over the updates of this call.
        training_loss = sum(policy_losses) / len(policy_losses) if policy_losses else 0.0
        summary = self._train_summary(start_time, self.state.global_step - first_step, training_loss)
        self.log(dict(summary))
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        out: dict[str, Any] = {**summary, "interrupted": self.interrupted}
        out.update({k: v for k, v in last_metrics.items() if k.startswith("objective/")})
        return TrainOutput(self.state.global_step, training_loss, out)

    def _train_summary(self, start_time: float, steps: int, training_loss: float) -> dict[str, float]:
        """The entry ``transformers.Trainer`` logs at the end of ``train()`` (callbacks hear it in
        ``on_log``): ``train_runtime``, ``train_samples_per_second`` (completions trained on),
        ``train_steps_per_second`` (Trainer steps of this call), ``total_flos`` and ``train_loss`` (the
        mean policy loss over the updates of this call)."""
        completions = steps // self.steps_per_update * self.batch_size
        summary = speed_metrics("train", start_time, num_samples=completions, num_steps=steps)
        self.store_flos()
        summary["total_flos"] = self.state.total_flos
        summary["train_loss"] = training_loss
        return summary

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
        if self.algorithm.trl_metric_names:
            # transformers.Trainer's names: the loss of the optimizer steps and the last step's rate
            if "loss/policy_avg" in metrics:
                metrics["loss"] = metrics["loss/policy_avg"]
            last = self.loop.last_learning_rate
            metrics["learning_rate"] = last if last is not None else lr
        metrics["episode"] = done * self.batch_size
        metrics["train/nonfinite_steps_skipped"] = float(self._reliability.guard.skipped)
        for name, value in metrics.items():
            self._log_buffer[name].append(value)
        if sample_every and update % sample_every == 0:
            evaluation.log_samples(self, self._last_rollout)
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
            for name in ("learning_rate", "num_tokens"):  # TRL's: the last value
                if name in self._log_buffer:
                    logs[name] = self._log_buffer[name][-1]
            self._log_buffer.clear()
            self.log(logs)
            if getattr(self.args, "log_completions", False):  # (TRL's field: GRPOConfig, RLOOConfig)
                evaluation.log_completions(self)
        if self.control.should_evaluate:
            self.evaluate()
        if self.control.should_save:
            compat.save_checkpoint(self, model)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _enable_gradient_checkpointing(self) -> None:
        kwargs = compat.checkpointing_kwargs(self.args) or {"use_reentrant": False}
        unwrapped = self.accelerator.unwrap_model(self.model)
        for module in (unwrapped.policy, unwrapped.value_model):
            if module is None:
                continue
            compat.enable_activation_checkpointing(module, kwargs)
            if _is_peft_model(module) and hasattr(module, "enable_input_require_grads"):
                module.enable_input_require_grads()
