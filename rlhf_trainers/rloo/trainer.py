"""RLOOTrainer: what is RLOO-only on top of the on-policy engine: k completions per prompt and the
leave-one-out baseline. No value model: three models (policy, reference, reward) instead of PPO's four.

Per update (the engine runs the steps, see ``OnPolicyTrainer._update``; RLOO supplies step 6 and the loss
of step 7):

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
from ..onpolicy.rollout import Advantages, LossNormalization, Rollout
from ..onpolicy.trainer import OnPolicyTrainer
from ..rewards import split_reward_funcs
from .config import RLOOConfig

if TYPE_CHECKING:
    import datasets
    from peft import PeftConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback

#: A minimal chat template for the prompts of base models that have none (the RLOO blog's snippet sets it,
#: TRL's own): each message's content after a space, and no EOS at the end, since the policy is to
#: continue the query and end its own completion with EOS.
SIMPLE_QUERY_CHAT_TEMPLATE = "{% for message in messages %}{{ ' ' + message['content'] }}{% endfor %}"


def leave_one_out(values: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """``F.rloo_advantages(values, k, valid=valid)`` under the name and argument order it had before
    there was one leave-one-out in the package: (k * B,) rewards, completion j of prompt i at
    ``j * B + i``; an invalid completion gets 0 and is left out of the others' baselines."""
    return F.rloo_advantages(values, k, valid=valid)


class RLOOTrainer(OnPolicyTrainer):
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
        peft_config, callbacks, optimizers, data_collator: as for :class:`~rlhf_trainers.PPOTrainer`.

    The aliases are the names of the RLOO blog's snippet (TRL's first RLOOTrainer), so that code runs
    unchanged; giving both a name and its alias is an error.
    """

    _config_class = RLOOConfig
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
    ) -> None:
        model = _alias("model", model, "policy", policy)
        ref_model = _alias("ref_model", ref_model, "ref_policy", ref_policy)
        args = _alias("args", args, "config", config)
        processing_class = _alias("processing_class", processing_class, "tokenizer", tokenizer)
        if model is None:
            raise ValueError("RLOOTrainer needs a policy: model=<path, Hub id or causal-LM model>.")
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
        )

    completions_per_prompt_name = "rloo_k"

    @property
    def completions_per_prompt(self) -> int:  # type: ignore[override]
        return self.args.rloo_k

    @property
    def needs_generation_logprobs(self) -> bool:  # type: ignore[override]
        return self.args.truncated_is_cap is not None or super().needs_generation_logprobs

    def compute_advantages(self, rollout: Rollout, rewards: torch.Tensor) -> Advantages:
        """Leave-one-out advantages over the k completions of each prompt: of the sequence reward
        ``score - kl_coef * sum_t KL_t`` (default), or per token of the reward-to-go of ``rewards``
        (``token_level_kl``); optionally whitened, with truncated importance weights against the
        generation's log-probs (``truncated_is_cap``)."""
        args = self.args
        k = args.rloo_k
        mask = rollout.response_mask
        valid = rollout.valid_rows
        if args.token_level_kl:
            to_go = (rewards * mask).flip(1).cumsum(1).flip(1)
            rlhf_reward = to_go[:, 0]
            baseline = rlhf_reward - F.rloo_advantages(rlhf_reward, k, valid=valid)
            advantages = torch.where(mask, to_go - baseline[:, None], torch.zeros_like(to_go))
        else:
            rlhf_reward = rollout.scores - self.kl_ctl.value * rollout.kl.sum(1)
            advantages = F.rloo_advantages(rlhf_reward, k, valid=valid)[:, None]
        if args.normalize_advantage:
            advantage_mask = mask if args.token_level_kl else valid[:, None]
            advantages = F.whiten(advantages, advantage_mask, shift_mean=True, all_reduce=self._all_reduce)
        weights = None
        if args.truncated_is_cap is not None:
            # training-pass log-probs / generation log-probs, capped: per sequence for the sequence-level
            # loss (the ratio the blog prints), per token for the token-level one.
            difference = (rollout.logprobs - rollout.generation_logprobs) * mask
            if not args.token_level_kl:
                difference = difference.sum(1, keepdim=True)
            weights = difference.exp().clamp(max=args.truncated_is_cap)
        elif rollout.sampling_weights is not None:
            # vLLM's sampling distribution vs the trained one (vllm_importance_sampling_*): the sequence
            # ratio for the sequence-level loss, else the rollout's weights (per token, or per sequence).
            weights = rollout.sampling_weights
            if not args.token_level_kl and weights.shape[1] != 1:
                constraint = args.vllm_importance_sampling_mode.split("_", 1)[1]
                weights = F.truncated_importance_weights(
                    rollout.logprobs,
                    rollout.generation_logprobs,
                    mask,
                    args.vllm_importance_sampling_cap,
                    f"sequence_{constraint}",
                )
            elif args.token_level_kl and weights.shape[1] == 1:
                weights = weights.expand_as(mask).masked_fill(~mask, 0.0)
        return Advantages(advantages=advantages, rlhf_reward=rlhf_reward, importance_weights=weights)

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
        """PPO's clipped objective on the sequence log-prob (default; REINFORCE at ratio 1, the mean over
        the mini-batch's sequences), or per token (``token_level_kl``, reduced with ``loss_agg_mode``),
        weighted by the truncated importance weights when there are any; plus the KL loss term with
        ``kl_loss_coef`` (per token, reduced like the loss)."""
        args = self.args
        weights = advantages.importance_weights[rows] if advantages.importance_weights is not None else None
        if args.token_level_kl:
            loss, metrics, _ = self.token_policy_loss(
                rollout, advantages.advantages[rows], rows, logprobs, normalization, weights, entropy
            )
            return loss, metrics
        mask = rollout.response_mask[rows]
        old = rollout.logprobs[rows]
        sequences = normalization.sequences if normalization is not None else mask.any(1).sum().float()
        kl_loss = self.kl_loss(rollout, rows, logprobs)
        extra = self.extra_token_loss(kl_loss, entropy)
        # The whole completion is one action: its log-prob is the sum over its tokens, and the KL term
        # the sequence's summed per-token estimate; the mean over the mini-batch's sequences.
        loss, pm = F.clipped_policy_loss(
            (logprobs * mask).sum(1, keepdim=True),
            (old * mask).sum(1, keepdim=True),
            advantages.advantages[rows],
            mask.any(1, keepdim=True),
            clip_low=args.cliprange,
            clip_high=args.cliprange_high,
            dual_clip=args.dual_clip,
            importance_weights=weights,
            extra_loss=None if extra is None else (extra * mask).sum(1, keepdim=True),
            loss_agg_mode="token-mean",
            denominator=sequences,
        )
        metrics = self.policy_loss_metrics(loss, pm, kl_loss, mask)
        return loss, metrics

    def rollout_metrics(self, rollout: Rollout, advantages: Advantages) -> dict[str, float]:
        """The engine's metrics plus the RLOO ones: ``objective/rlhf_reward`` (the reward the baseline is
        computed from), ``objective/reward_std_per_prompt`` (std of that reward over the k completions of a
        prompt: 0 means no learning signal), ``rollout/num_completions_kept`` and, with truncated importance
        sampling, ``policy/is_weight_mean`` and ``policy/gen_ratio_max`` (the generation-vs-training
        ratio before capping)."""
        metrics = super().rollout_metrics(rollout, advantages)
        k = self.args.rloo_k
        valid = rollout.valid_rows
        rlhf = advantages.rlhf_reward.float()
        per_prompt = rlhf.reshape(k, -1)
        ok = valid.reshape(k, -1).all(0)
        std = per_prompt.std(0, unbiased=False)[ok]
        sums = torch.stack(
            [
                (rlhf * valid).sum(),
                valid.float().sum(),
                std.sum(),
                torch.tensor(float(std.numel()), device=rlhf.device),
            ]
        ).double()
        sums = self._all_reduce(sums.to(self.accelerator.device)).cpu()
        metrics["objective/rlhf_reward"] = float(sums[0] / sums[1].clamp_min(1))
        metrics["objective/reward_std_per_prompt"] = float(sums[2] / sums[3].clamp_min(1))
        metrics["rollout/num_completions_kept"] = float(sums[1])
        if advantages.importance_weights is not None:
            mask = rollout.response_mask
            ratios = ((rollout.logprobs - rollout.generation_logprobs) * mask).sum(1).exp()[valid]
            stats = torch.stack(
                [
                    advantages.importance_weights.float().mean(),
                    ratios.max() if ratios.numel() else ratios.new_zeros(()),
                ]
            )
            gathered = self._gather(stats.reshape(1, 2)).cpu()
            metrics["policy/is_weight_mean"] = float(gathered[:, 0].mean())
            metrics["policy/gen_ratio_max"] = float(gathered[:, 1].max())
        return metrics


def _alias(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None:
        raise ValueError(f"{name}= and {alias}= name the same argument; give one of them.")
    return value if value is not None else alias_value
