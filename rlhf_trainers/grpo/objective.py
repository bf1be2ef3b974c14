"""GRPO's part of the on-policy update: the advantages of the registered ``advantage_estimator``
(group-relative by default), the policy loss per token reduced by ``loss_type``, and GRPO's metrics."""

from __future__ import annotations

import torch

from .. import functional as F
from ..onpolicy.objective import Objective
from ..onpolicy.rollout import Advantages, LossNormalization, Rollout


class GRPOObjective(Objective):
    """GRPO (TRL's GRPOTrainer), with verl's estimators by name."""

    trl_metric_names = True
    display_metrics = (("objective/scores", "reward"), ("reward_std", "reward_std"), ("objective/kl", "kl"))

    def advantages(self, rollout: Rollout, rewards: torch.Tensor, kl_coef: float) -> Advantages:
        """The advantages of ``advantage_estimator`` (registered by name: group-relative with
        ``scale_rewards``, leave-one-out, REINFORCE++ per token, or one of yours); the vLLM importance
        weights of the rollout, if any, pass through to the loss. GRPO puts no KL in the reward; a
        ``kl_coef`` > 0 (not TRL's) subtracts it as RLOO does."""
        estimator = F.get_advantage_estimator(self.args.advantage_estimator)
        inputs = self.advantage_inputs(rollout, rewards, kl_coef, group_size=self.args.num_generations)
        advantages, _ = estimator(inputs)
        return Advantages(
            advantages=advantages.to(torch.float32),
            rlhf_reward=inputs.sequence_rewards,
            importance_weights=rollout.sampling_weights,
        )

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
        """The policy loss per token with the completion's advantage at every token (the sequence's
        ratio with ``importance_sampling_level="sequence"``), weighted by the vLLM importance weights,
        plus ``beta`` x the KL estimate, reduced by ``loss_type`` over the optimizer step."""
        weights = advantages.importance_weights
        loss, metrics, _ = self.token_policy_loss(
            rollout,
            advantages.advantages[rows],
            rows,
            logprobs,
            normalization,
            weights[rows] if weights is not None else None,
            entropy,
        )
        return loss, metrics

    def metrics(self, rollout: Rollout, advantages: Advantages) -> dict[str, float]:
        """``objective/reward_std`` (mean over prompts of the std of their group's rewards),
        ``objective/frac_reward_zero_std`` (groups whose rewards are all equal: no learning signal, TRL's
        name; also logged as TRL 1.x's ``frac_reward_zero_std``) and ``rollout/num_completions_kept``."""
        G = self.args.num_generations
        reward = advantages.rlhf_reward.float().reshape(G, -1)
        ok = rollout.valid_rows.reshape(G, -1).all(0)
        std = reward.std(0, unbiased=True)[ok]
        sums = torch.stack(
            [
                std.sum(),
                (std < 1e-8).float().sum(),
                torch.tensor(float(std.numel()), device=std.device),
                rollout.valid_rows.float().sum(),
            ]
        ).double()
        sums = self.collectives.all_reduce(sums.to(self.collectives.accelerator.device)).cpu()
        groups = float(sums[2])
        frac_zero_std = float(sums[1]) / groups if groups else 0.0
        return {
            "objective/reward_std": float(sums[0]) / groups if groups else 0.0,
            "objective/frac_reward_zero_std": frac_zero_std,
            "frac_reward_zero_std": frac_zero_std,  # TRL's name
            "rollout/num_completions_kept": float(sums[3]),
        }
