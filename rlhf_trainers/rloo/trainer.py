"""RLOOTrainer: what is RLOO-only on top of the on-policy engine: k completions per prompt and the
leave-one-out baseline. No value model: three models (policy, reference, reward) instead of PPO's four.

Per update (the engine runs the steps, see ``OnPolicyTrainer._update``; RLOO's objective,
``rloo/objective.py``, supplies the advantages, the loss and its metrics):

1. rollout of ``rloo_k`` completions per prompt (the k copies of the prompt batch concatenated, as the
   RLOO blog lays them out: completion j of prompt i at row ``j * B + i``);
2. sequence-level (default): ``rlhf_reward = score - kl_coef * sum_t KL_t``; each completion's advantage
   is its reward minus the mean of the other k - 1 completions of its prompt; the loss is PPO's clipped
   objective on the sequence log-prob (REINFORCE when the ratio is 1, as the blog shows);
   token-level (``token_level_kl``): per-token rewards, reward-to-go minus the leave-one-out baseline;
3. optional advantage whitening and truncated importance sampling against the generation's log-probs.

All completions of a prompt are generated on the same process, so the baseline never needs another
process's rewards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import functional as F
from ..agents.trainer import AgentRollouts
from ..onpolicy.trainer import OnPolicyTrainer
from ..rewards import split_reward_funcs
from .config import RLOOConfig
from .objective import RLOOObjective

if TYPE_CHECKING:
    import datasets
    from peft import PeftConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback

    from ..cpu import CPUOptions

#: A minimal chat template for the prompts of base models that have none (the RLOO blog's snippet sets it,
#: TRL's own): each message's content after a space, and no EOS at the end, since the policy is to
#: continue the query and end its own completion with EOS.
SIMPLE_QUERY_CHAT_TEMPLATE = "{% for message in messages %}{{ ' ' + message['content'] }}{% endfor %}"


def leave_one_out(values: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """``F.rloo_advantages(values, k, valid=valid)`` under the name and argument order it had before
    there was one leave-one-out in the package: (k * B,) rewards, completion j of prompt i at
    ``j * B + i``; an invalid completion gets 0 and is left out of the others' baselines."""
    return F.rloo_advantages(values, k, valid=valid)


class RLOOTrainer(AgentRollouts, OnPolicyTrainer):
    """REINFORCE Leave-One-Out (Ahmadian et al., 2024; the RLOO blog) as a ``transformers.Trainer``.

    Args:
        model: the policy: a path, Hub id, causal-LM instance or PeftModel (alias: ``policy``).
        ref_model: the reference policy (alias: ``ref_policy``); None uses a frozen copy of ``model``, or
            under PEFT the same weights with the adapter disabled.
        reward_model: a one-label sequence-classification model or its path (its normalization is
            applied); may use another tokenizer (``reward_processing_class``).
        args: an :class:`RLOOConfig` (alias: ``config``).
        processing_class: the policy's tokenizer, with a pad token (alias: ``tokenizer``). Its pad id may
            lie past the policy's embedding table (the blog's ``add_special_tokens({"pad_token": "[PAD]"})``
            on a model without spare rows): it never reaches an embedding, every model reads 0 at the
            (masked) padding instead, which gives the numbers of an in-vocabulary pad token.
        train_dataset / eval_dataset: prompts (``prompt`` text or chat messages, ``messages``, or
            ``input_ids``); other columns are passed to reward functions.
        reward_funcs: ``f(prompts, completions, **columns) -> list[float]``, a reward source
            (:class:`rlhf_trainers.rewards.RewardSource`), or a list of them, weighted by
            ``RLOOConfig.reward_weights`` (reward model first); as in TRL 1.x, the list may also hold one
            reward model (instance or path; its tokenizer in ``reward_processing_classes``), in which
            case ``reward_weights`` follow the list's order.
        peft_config, callbacks, optimizers, data_collator, cpu_options, tools, environment_factory,
            rollout_func: as for :class:`~rlhf_trainers.PPOTrainer`.

    The aliases are the names of the RLOO blog's snippet (TRL's first RLOOTrainer), so that code runs
    unchanged; giving both a name and its alias is an error. Without ``args``, a call with ``reward_funcs``
    and no ``reward_model`` (TRL 1.x's) gets TRL 1.x's step semantics (``RLOOConfig.trl_semantics``).
    """

    _config_class = RLOOConfig
    objective_class = RLOOObjective
    algorithm_name = "RLOO"
    args: RLOOConfig

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel | None = None,
        ref_model: str | os.PathLike[str] | PreTrainedModel | None = None,
        reward_model: str | os.PathLike[str] | PreTrainedModel | None = None,
        args: RLOOConfig | None = None,
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
        *,
        config: RLOOConfig | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        policy: str | os.PathLike[str] | PreTrainedModel | None = None,
        ref_policy: str | os.PathLike[str] | PreTrainedModel | None = None,
        reward_processing_classes: Any = None,
        cpu_options: CPUOptions | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
        rollout_func: Callable[[list[Any], Any], Any] | None = None,
    ) -> None:
        model = _alias("model", model, "policy", policy)
        ref_model = _alias("ref_model", ref_model, "ref_policy", ref_policy)
        args = _alias("args", args, "config", config)
        processing_class = _alias("processing_class", processing_class, "tokenizer", tokenizer)
        if model is None:
            raise ValueError("RLOOTrainer needs a policy: model=<path, Hub id or causal-LM model>.")
        if args is None and reward_funcs is not None and reward_model is None:
            # TRL 1.x's call (RLOOTrainer(model, reward_funcs=..., train_dataset=...)): its step semantics.
            args = RLOOConfig(output_dir="rloo-output", trl_semantics=True)
        if reward_funcs is not None and reward_model is None:
            # TRL 1.x: a reward model may come in reward_funcs (alone or in a list with functions).
            args = self._checked_args(args)
            reward_model, reward_funcs, tokenizer_of_model, args.reward_weights = split_reward_funcs(
                reward_funcs, reward_processing_classes, args.reward_weights
            )
            reward_processing_class = reward_processing_class or tokenizer_of_model
            reward_funcs = reward_funcs or None
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
            reward_funcs=reward_funcs,
            reward_processing_class=reward_processing_class,
            data_collator=data_collator,
            cpu_options=cpu_options,
            tools=tools,
            environment_factory=environment_factory,
            rollout_func=rollout_func,
        )

    @property
    def completions_per_prompt_name(self) -> str:  # type: ignore[override]
        """The field named in error messages: the one the config was written with."""
        return "num_generations" if self.args.num_generations is not None else "rloo_k"

    @property
    def completions_per_prompt(self) -> int:  # type: ignore[override]
        return self.args.rloo_k

    def batch_accounting(self) -> str:
        """The sizes of one update, as printed before training; with TRL 1.x's semantics, what a step is."""
        text = super().batch_accounting()
        if self.args.trl_semantics:
            text += (
                f" TRL 1.x's step semantics: a step is one optimizer step, {self.steps_per_update} per generation "
                f"({self.num_updates * self.steps_per_update} in the run)."
            )
        return text

    @property
    def steps_per_update(self) -> int:
        """Trainer steps per update: 1 with the blog's / TRL 0.x's names (a step is an update); the update's
        optimizer steps with TRL 1.x's (``RLOOConfig.trl_semantics``), as TRL 1.x's RLOOTrainer counts."""
        return self.args.steps_per_update


def _alias(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None:
        raise ValueError(f"{name}= and {alias}= name the same argument; give one of them.")
    return value if value is not None else alias_value
