"""GRPOTrainer: Group Relative Policy Optimization (Shao et al., 2024) on the on-policy engine, with TRL's
GRPOTrainer interface (``GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
train_dataset=...)``).

Per generation (one engine update, see ``OnPolicyTrainer._update``):

1. ``num_generations`` completions per prompt (completion j of prompt i at row ``j * B + i``);
2. the reward: the weighted sum of the reward functions / reward model (no KL in it);
3. advantages: each completion's reward minus its group's mean, divided by the group's std
   (``scale_rewards="group"``), the batch's (``"batch"``) or nothing (``"none"``), one per completion;
4. ``num_iterations`` passes, each of ``steps_per_generation / gradient_accumulation_steps`` optimizer
   steps: PPO's clipped loss per token (``epsilon``, ``epsilon_high``), or of the sequence's ratio
   (``importance_sampling_level="sequence"``, GSPO), plus ``beta`` x k3 KL to the reference, reduced by
   ``loss_type`` over the whole optimizer step (every micro-batch and process).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..agents.trainer import AgentRollouts
from ..generation.factory import backend_summary
from ..model_paths import check_model_paths
from ..onpolicy.trainer import OnPolicyTrainer
from ..rewards import split_reward_funcs
from ..rewards.sources import names_a_model
from .config import GRPOConfig
from .objective import GRPOObjective

if TYPE_CHECKING:
    import datasets
    from peft import PeftConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback

    from ..cpu import CPUOptions


class GRPOTrainer(AgentRollouts, OnPolicyTrainer):
    """GRPO as a ``transformers.Trainer``, with the arguments of TRL's ``GRPOTrainer``.

    Args:
        model: the policy: a path, Hub id or causal-LM instance (or a PeftModel).
        reward_funcs: one reward or a list of them, each a function ``f(prompts, completions, **columns)
            -> list[float | None]`` (TRL's signature: the dataset's other columns arrive as keyword
            arguments), a reward source (:class:`rlhf_trainers.rewards.RewardSource`), or a one-label
            sequence-classification model (instance or path; at most one).
            Weighted by ``GRPOConfig.reward_weights`` in the order given; ``None`` leaves a completion out.
        args: a :class:`GRPOConfig`.
        train_dataset / eval_dataset: prompts (``prompt`` text or chat messages, ``messages``, or
            ``input_ids``); other columns are passed to the reward functions.
        processing_class: the policy's tokenizer (with a pad token); None: loaded with ``model``.
        reward_processing_classes: the tokenizer of the reward model, alone or in a list aligned with
            ``reward_funcs`` (None entries for functions); None: the policy's tokenizer, or the one saved
            with the reward model's path.
        callbacks, optimizers, peft_config: as for ``transformers.Trainer`` / TRL.
        ref_model: the reference for ``beta > 0``; None: a frozen copy of ``model`` (the base weights
            under PEFT). Not built at all with ``beta == 0``.
        reward_model: a reward model given apart (PPO's and RLOO's keyword), taken as the first entry of
            ``reward_funcs`` (so ``reward_weights`` list its weight first).
        cpu_options: the CPU speed switches (:class:`~rlhf_trainers.CPUOptions`, docs/cpu.md); None: their
            defaults.
        tools: TRL's ``tools``: functions (plain or ``async``, with type hints and Google-style docstrings)
            the policy may call. The prompts are rendered with their schemas (``tools=`` of the chat
            template, which must support tool calling: :func:`~rlhf_trainers.agents.install_tool_chat_template`
            gives one), and each rollout is a multi-turn episode
            (:class:`~rlhf_trainers.agents.producer.MultiTurnProducer`, docs/agents.md) of at most
            ``max_tool_calling_iterations`` tool turns, each call limited to ``tool_timeout`` seconds.
        environment_factory: TRL's ``environment_factory``: a zero-argument callable (e.g. a class) that
            returns an environment, or a dict of them by name (each row's ``environment`` column picks
            one). Each episode gets its own environment, reset with the row (``reset(**row)``; a string it
            returns is appended to the prompt's last message); its public methods are the episode's tools
            (with ``tools``), and its ``get_reward()``, if it has one, is a reward source of weight 1
            named after its class (``reward_funcs`` may then be omitted); reward functions receive the
            rows' environments as ``environments=``. See docs/agents.md, "Environments".
        rollout_func: TRL's ``rollout_func(prompts, trainer) -> dict``: makes the completions instead of
            the builtin sampler. It gets this process's prompts (each ``num_generations`` times in a row,
            no chat template applied) and returns ``prompt_ids``, ``completion_ids`` and ``logprobs``
            (None allowed), one entry per prompt, optionally ``env_mask`` (1 at the policy's tokens) and
            fields forwarded to the reward functions
            (:class:`~rlhf_trainers.agents.user_rollouts.UserRolloutProducer`, docs/agents.md).
    """

    _config_class = GRPOConfig
    objective_class = GRPOObjective
    algorithm_name = "GRPO"
    completions_per_prompt_name = "num_generations"
    args: GRPOConfig

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: datasets.Dataset | None = None,
        eval_dataset: datasets.Dataset | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: PreTrainedTokenizerBase
        | Sequence[PreTrainedTokenizerBase | None]
        | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        peft_config: PeftConfig | None = None,
        *,
        ref_model: str | os.PathLike[str] | PreTrainedModel | None = None,
        reward_model: str | os.PathLike[str] | PreTrainedModel | None = None,
        data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
        cpu_options: CPUOptions | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
        rollout_func: Callable[[list[Any], Any], Any] | None = None,
    ) -> None:
        args = self._checked_args(args)
        listed = isinstance(reward_funcs, (list, tuple))
        entries = list(reward_funcs) if listed else [reward_funcs]
        named = {
            f"reward_funcs[{i}]" if listed else "reward_funcs": f
            for i, f in enumerate(entries)
            if names_a_model(f)
        }
        check_model_paths(named, args.model_init_kwargs)  # before anything loads: one clear error
        if reward_model is not None:
            # The engine's keyword (PPO's and RLOO's): the reward model first, then the functions.
            more = (
                []
                if reward_funcs is None
                else list(reward_funcs)
                if isinstance(reward_funcs, (list, tuple))
                else [reward_funcs]
            )
            reward_funcs = [reward_model, *more]
        if reward_funcs is None and environment_factory is not None:
            # TRL's: the environments' get_reward may be the only reward (checked once they are made)
            functions, reward_tokenizer = [], None
        else:
            reward_model, functions, reward_tokenizer, weights = split_reward_funcs(
                reward_funcs, reward_processing_classes, args.reward_weights
            )
            args.reward_weights = weights
        super().__init__(
            model=model,
            ref_model=ref_model,
            reward_model=reward_model,
            args=args,
            processing_class=processing_class,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            callbacks=callbacks,
            optimizers=optimizers,
            reward_funcs=functions or None,
            reward_processing_class=reward_tokenizer,
            data_collator=data_collator,
            cpu_options=cpu_options,
            tools=tools,
            environment_factory=environment_factory,
            rollout_func=rollout_func,
        )

    @property
    def completions_per_prompt(self) -> int:  # type: ignore[override]
        return self.args.num_generations

    @property
    def steps_per_update(self) -> int:
        """TRL's unit: a Trainer step is one optimizer step; a generation is ``num_iterations x
        steps_per_generation / gradient_accumulation_steps`` of them."""
        return self.args.optimizer_steps_per_generation

    def batch_accounting(self) -> str:
        """The sizes of one generation in TRL's terms, printed before training."""
        args = self.args
        world = self.accelerator.num_processes
        per_step = args.per_device_train_batch_size * world * args.gradient_accumulation_steps
        return (
            f"GRPOTrainer: generation_batch_size {self.batch_size} completions = {self.prompts_per_update} prompts "
            f"x num_generations {args.num_generations} ({args.local_batch_size} per process x {world} processes "
            f"= steps_per_generation {args.steps_per_generation} x per_device_train_batch_size "
            f"{args.per_device_train_batch_size}) -> num_iterations {args.num_iterations} x "
            f"{args.num_mini_batches} optimizer step(s) of {per_step} completions (gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps}) = {self.steps_per_update} optimizer step(s) per generation; "
            f"{self.num_updates * self.steps_per_update} optimizer steps ({self.num_updates} generations, "
            f"{self.total_episodes} completions); loss_type {args.loss_type}, beta {args.beta} "
            f"({'no reference model' if not args.uses_reference_model else 'reference model'}); generation: "
            f"{backend_summary(self.generation_backend)}."
        )
