"""PPOTrainer: what is PPO-only on top of the on-policy engine: the value model, GAE, the value loss.

The whole algorithm per update (the engine runs the steps, see ``OnPolicyTrainer._update``; PPO supplies
the value model, and its objective (``ppo/objective.py``) the advantages, the loss and the critic metrics):

1. rollout: responses, log-probs of policy and reference, values V(s_t), scores;
2. per-token rewards ``r_t = -beta * KL_t`` plus the score at the last token (optionally whitened);
3. GAE advantages and returns (gamma, lam, decoupled lam for the returns, length-adaptive lam),
   advantages whitened over all processes;
4. for each micro-batch: clipped policy loss (asymmetric / dual clip) + ``vf_coef`` x clipped value
   loss; during ``critic_warmup_steps`` only the value loss.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

import torch

from ..agents.trainer import AgentRollouts
from ..distributed import copy_model, full_state_dict, gathered, load_full_state_dict
from ..models import _base, _is_peft_model, check_one_label, find_score_head, load_reward_model
from ..onpolicy.trainer import OnPolicyTrainer
from .config import PPOConfig
from .objective import PPOObjective

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def zero_value_head(model: torch.nn.Module) -> None:
    """Zero the scalar head (LHPD initialises the value head with zeros: V = 0 everywhere at the
    start, so the first advantages are the returns themselves)."""
    _, head = find_score_head(model)
    params = [head.weight] + ([head.bias] if head.bias is not None else [])
    with gathered(*params, modify=True), torch.no_grad():
        for p in params:
            p.zero_()


def value_model_from_policy(policy: PreTrainedModel) -> PreTrainedModel:
    """A one-label sequence-classification model with the policy's transformer weights and a zero head.

    The architecture's ``...ForSequenceClassification`` class where transformers has one, otherwise a
    :class:`~rlhf_trainers.score_head.ScoreHeadModel` (the architecture's base model plus a scalar head).
    """
    from transformers import AutoModelForSequenceClassification

    from ..score_head import ScoreHeadModel, has_sequence_classification_class

    source = _base(policy)
    if _is_peft_model(policy):
        source = copy.deepcopy(policy).merge_and_unload()
    config = copy.deepcopy(source.config)
    config.num_labels = 1
    config.architectures = None
    if has_sequence_classification_class(config):
        value = AutoModelForSequenceClassification.from_config(config)
    else:
        value = ScoreHeadModel(config)
    backbone = getattr(source, source.base_model_prefix, None)
    if backbone is None:
        raise ValueError(
            f"Cannot build a value model from {type(source).__name__}: it has no '{source.base_model_prefix}' "
            "backbone. Pass value_model= (a one-label sequence-classification model) or "
            "value_model_init='reward_model'."
        )
    # Whole tensors on both sides: under ZeRO-3 (zero3_init_flag) both models are partitioned.
    load_full_state_dict(getattr(value, value.base_model_prefix), full_state_dict(backbone))
    value.to(next(source.parameters()).dtype)
    zero_value_head(value)
    if getattr(source.config, "pad_token_id", None) is not None:
        value.config.pad_token_id = source.config.pad_token_id
    return value


class PPOTrainer(AgentRollouts, OnPolicyTrainer):
    """PPO for language models (LHPD's algorithm, with TRL's interface), as a ``transformers.Trainer``.

    Args:
        model: the policy: a path, Hub id, causal-LM instance or PeftModel.
        ref_model: the reference policy; None uses a frozen copy of ``model``, or under PEFT the same
            weights with the adapter disabled (no second copy).
        reward_model: a one-label sequence-classification model or its path (its
            ``reward_normalization.json`` is applied); may use another tokenizer
            (``reward_processing_class``, loaded from the path when it has one).
        value_model: the critic (a one-label sequence-classification model or path; a fresh head is
            zero-initialised). None builds it per ``PPOConfig.value_model_init``.
        args: a :class:`PPOConfig`.
        processing_class: the policy's tokenizer (must have a pad token). Its pad id may lie past the
            policy's embedding table (``add_special_tokens({"pad_token": "[PAD]"})`` without resizing, as
            the reference implementation does): it never reaches an embedding, every model reads 0 at the
            (masked) padding instead, which gives the numbers of an in-vocabulary pad token.
        train_dataset / eval_dataset: prompts: a ``prompt`` column of text or chat messages, a
            ``messages`` column, or ``input_ids``; other columns are passed to reward functions.
        reward_funcs: ``f(prompts, completions, **columns) -> list[float]``, a reward source
            (:class:`rlhf_trainers.rewards.RewardSource`), or a list of them, weighted by
            ``PPOConfig.reward_weights`` (reward model first).
        peft_config: a PEFT config applied to ``model`` (LoRA).
        callbacks, optimizers, data_collator: as in ``transformers.Trainer``.
        cpu_options: the CPU speed switches (:class:`~rlhf_trainers.CPUOptions`, docs/cpu.md); None: their
            defaults, the automatic choices.
        tools: functions (plain or ``async``, typed, with Google-style docstrings) the policy may call, as
            TRL's ``GRPOTrainer(tools=)``: each rollout is a multi-turn episode (docs/agents.md); the tool
            turns are in the sequence the policy and the critic read, but out of the loss, the KL, the
            advantages and the value loss. ``max_tool_calling_iterations`` and ``tool_timeout`` bound it.
        environment_factory: TRL's ``GRPOTrainer(environment_factory=)``: a zero-argument callable that
            returns an environment (or a dict of them, picked by each row's ``environment`` column); one
            per episode, reset with the row, its public methods the episode's tools, its ``get_reward()``
            a reward source of weight 1 (docs/agents.md, "Environments").
        rollout_func: TRL's ``GRPOTrainer(rollout_func=)``, ``f(prompts, trainer) -> dict`` with
            ``prompt_ids``, ``completion_ids``, ``logprobs`` (and optionally ``env_mask`` and fields for the
            reward functions), one entry per prompt it gets: the function makes the completions
            (:class:`~rlhf_trainers.agents.user_rollouts.UserRolloutProducer`, docs/agents.md); ``env_mask``
            0 tokens are out of the loss, the KL, the advantages and the value loss.
    """

    _config_class = PPOConfig
    objective_class = PPOObjective
    algorithm_name = "PPO"
    completions_per_prompt_name = "num_generations"
    args: PPOConfig

    @property
    def completions_per_prompt(self) -> int:  # type: ignore[override]
        return self.args.num_generations

    def build_value_model(
        self,
        policy: PreTrainedModel,
        reward_model: PreTrainedModel | None,
        value_model: str | os.PathLike[str] | PreTrainedModel | None,
        args: PPOConfig,
    ) -> PreTrainedModel:
        if isinstance(value_model, (str, os.PathLike)):
            value_model, head_is_new = load_reward_model(
                value_model, init_head=False, model_kwargs=args.model_init_kwargs
            )
            if head_is_new:
                zero_value_head(value_model)
            return value_model
        if value_model is not None:
            check_one_label(value_model, "value model")
            return value_model
        if args.value_model_init == "reward_model":
            if reward_model is None:
                raise ValueError(
                    "value_model_init='reward_model' needs a reward_model; with reward functions only use "
                    "value_model_init='policy' or pass value_model=."
                )
            return copy_model(reward_model).requires_grad_(True).train()
        return value_model_from_policy(policy)

    def _parameter_groups(self, model: torch.nn.Module) -> list[dict[str, Any]]:
        groups = super()._parameter_groups(model)
        lr = self.args.critic_learning_rate
        if lr is None:
            return groups
        value_params = {id(p) for n, p in model.named_parameters() if n.startswith("value_model.")}
        out = []
        for group in groups:
            policy = [p for p in group["params"] if id(p) not in value_params]
            value = [p for p in group["params"] if id(p) in value_params]
            out.append({**group, "params": policy})
            out.append({**group, "params": value, "lr": lr})
        return [g for g in out if g["params"]]
