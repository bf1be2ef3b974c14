"""RLOO's part of the on-policy update: leave-one-out advantages over the k completions of a prompt,
PPO's clipped objective on the whole sequence (or per token), and the RLOO metrics."""

from __future__ import annotations

import torch

from .. import functional as F
from ..onpolicy.objective import Objective
from ..onpolicy.rollout import Advantages, LossNormalization, Rollout


class RLOOObjective(Objective):
    """RLOO (the RLOO blog's algorithm, with its sequence- and token-level variants)."""

    trl_metric_names = True
    display_metrics = (
        ("objective/scores", "reward"),
        ("objective/kl", "kl"),
        ("policy/clipfrac_avg", "clipfrac"),
    )

    @property
    def needs_generation_logprobs(self) -> bool:  # type: ignore[override]
        return self.args.truncated_is_cap is not None

    def advantages(self, rollout: Rollout, rewards: torch.Tensor, kl_coef: float) -> Advantages:
        """Leave-one-out advantages over the k completions of each prompt: of the sequence reward
        ``score - kl_coef * sum_t KL_t`` (default; the registered ``"rloo"`` estimator), or per token of
        the reward-to-go of ``rewards`` (``token_level_kl``); optionally whitened, with truncated
        importance weights against the generation's log-probs (``truncated_is_cap``)."""
        args = self.args
        k = args.rloo_k
        mask = rollout.policy_mask
        valid = rollout.valid_rows
        if args.token_level_kl:
            to_go = (rewards * mask).flip(1).cumsum(1).flip(1)
            rlhf_reward = to_go[:, 0]
            baseline = rlhf_reward - F.rloo_advantages(rlhf_reward, k, valid=valid)
            advantages = torch.where(mask, to_go - baseline[:, None], torch.zeros_like(to_go))
        else:
            inputs = self.advantage_inputs(rollout, rewards, kl_coef, group_size=k)
            rlhf_reward = inputs.sequence_rewards
            advantages, _ = F.get_advantage_estimator("rloo")(inputs)
        if args.normalize_advantage:
            advantage_mask = mask if args.token_level_kl else valid[:, None]
            advantages = F.whiten(
                advantages, advantage_mask, shift_mean=True, all_reduce=self.collectives.all_reduce
            )
        return Advantages(
            advantages=advantages,
            rlhf_reward=rlhf_reward,
            importance_weights=self._importance_weights(rollout),
        )

    def _importance_weights(self, rollout: Rollout) -> torch.Tensor | None:
        """The truncated importance weights the loss multiplies by: the training pass's over the
        generation's probabilities, capped (``truncated_is_cap``), per sequence for the sequence-level loss
        (the ratio the blog prints), per token for the token-level one; else vLLM's sampling weights in
        the loss's shape; None without either."""
        args = self.args
        mask = rollout.policy_mask
        if args.truncated_is_cap is not None:
            difference = (rollout.logprobs - rollout.generation_logprobs) * mask
            if not args.token_level_kl:
                difference = difference.sum(1, keepdim=True)
            return difference.exp().clamp(max=args.truncated_is_cap)
        weights = rollout.sampling_weights
        if weights is None:
            return None
        if not args.token_level_kl and weights.shape[1] != 1:
            # vLLM's sampling distribution vs the trained one: the sequence ratio for the sequence loss
            constraint = args.vllm_importance_sampling_mode.split("_", 1)[1]
            return F.truncated_importance_weights(
                rollout.logprobs,
                rollout.generation_logprobs,
                mask,
                args.vllm_importance_sampling_cap,
                f"sequence_{constraint}",
            )
        if args.token_level_kl and weights.shape[1] == 1:
            return weights.expand_as(mask).masked_fill(~mask, 0.0)
        return weights

    def loss(
        self,
        rollout: Rollout,
        advantages: Advantages,
        rows: torch.Tensor,
        logprobs: torch.Tensor,
        values: torch.Tensor | None,
        normalization: LossNormalization | None = None,
        entropy: torch.Tensor | None = None,
        step: int = 0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy loss on the sequence log-prob (default; REINFORCE at ratio 1, the mean over the
        mini-batch's sequences), or per token (``token_level_kl``, reduced with ``loss_agg_mode``),
        weighted by the truncated importance weights when there are any; plus the KL loss term with
        ``kl_loss_coef`` (per token, reduced like the loss)."""
        weights = advantages.importance_weights[rows] if advantages.importance_weights is not None else None
        if self.args.token_level_kl:
            loss, metrics, _ = self.token_policy_loss(
                rollout, advantages.advantages[rows], rows, logprobs, normalization, weights, entropy
            )
            return loss, metrics
        mask = rollout.policy_mask[rows]
        old = rollout.logprobs[rows]
        sequences = normalization.sequences if normalization is not None else mask.any(1).sum().float()
        kl_loss = self.kl_loss(rollout, rows, logprobs)
        extra = self.extra_token_loss(kl_loss, entropy)
        # The whole completion is one action: its log-prob is the sum over its tokens, and the KL term
        # the sequence's summed per-token estimate; the mean over the mini-batch's sequences.
        loss, pm = self.policy_loss_fn(
            (logprobs * mask).sum(1, keepdim=True),
            (old * mask).sum(1, keepdim=True),
            advantages.advantages[rows],
            mask.any(1, keepdim=True),
            self.args,
            importance_weights=weights,
            extra_loss=None if extra is None else (extra * mask).sum(1, keepdim=True),
            loss_agg_mode="token-mean",
            denominator=sequences,
        )
        metrics = self.policy_loss_metrics(loss, pm, kl_loss, mask)
        # TRL's clip ratios, per sequence (the whole completion's ratio)
        log_ratio = ((logprobs.detach() - old) * mask).sum(1, keepdim=True)
        metrics.update(
            self.trl_loss_metrics(
                log_ratio, advantages.advantages[rows], mask.any(1, keepdim=True), None, mask
            )
        )
        return loss, metrics

    def trl_loss_metrics(
        self,
        log_ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        kl_loss: torch.Tensor | None,
        token_mask: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The objective's TRL clip ratios, without a ``kl`` from the loss: TRL's RLOO logs the KL of the
        reward (:meth:`metrics`)."""
        return super().trl_loss_metrics(log_ratio, advantages, mask, None, token_mask)

    def metrics(self, rollout: Rollout, advantages: Advantages) -> dict[str, float]:
        """``objective/rlhf_reward`` (the reward the baseline is computed from), ``objective/
        reward_std_per_prompt`` (std of that reward over the k completions of a prompt: 0 means no
        learning signal), ``rollout/num_completions_kept``, TRL 1.x's ``frac_reward_zero_std`` (prompts whose
        ``rlhf_reward`` std is 0) and ``kl`` (mean per-token KL estimate of the rollout, with a reference
        model), and, with truncated importance sampling,
        ``policy/is_weight_mean`` and ``policy/gen_ratio_max`` (the ratio before capping)."""
        k = self.args.rloo_k
        valid = rollout.valid_rows
        rlhf = advantages.rlhf_reward.float()
        ok = valid.reshape(k, -1).all(0)
        std = rlhf.reshape(k, -1).std(0, unbiased=False)[ok]
        sums = torch.stack(
            [
                (rlhf * valid).sum(),
                valid.float().sum(),
                std.sum(),
                torch.tensor(float(std.numel()), device=rlhf.device),
                (std < 1e-8).float().sum(),
                rollout.kl.float().sum(),
                (rollout.lengths * valid).sum().float(),
            ]
        ).double()
        sums = self.collectives.all_reduce(sums.to(self.collectives.accelerator.device)).cpu()
        metrics = {
            "objective/rlhf_reward": float(sums[0] / sums[1].clamp_min(1)),
            "objective/reward_std_per_prompt": float(sums[2] / sums[3].clamp_min(1)),
            "rollout/num_completions_kept": float(sums[1]),
            # TRL's names: the share of prompts whose rewards (KL term included) are all equal, and the
            # per-token KL estimate of the reward's KL term, over the response tokens of all processes
            "frac_reward_zero_std": float(sums[4] / sums[3].clamp_min(1)),
        }
        if self.args.uses_reference_model:
            metrics["kl"] = float(sums[5] / sums[6].clamp_min(1))
        if advantages.importance_weights is not None:
            mask = rollout.policy_mask
            ratios = ((rollout.logprobs - rollout.generation_logprobs) * mask).sum(1).exp()[valid]
            stats = torch.stack(
                [
                    advantages.importance_weights.float().mean(),
                    ratios.max() if ratios.numel() else ratios.new_zeros(()),
                ]
            )
            gathered = self.collectives.gather(stats.reshape(1, 2)).cpu()
            metrics["policy/is_weight_mean"] = float(gathered[:, 0].mean())
            metrics["policy/gen_ratio_max"] = float(gathered[:, 1].max())
        return metrics
