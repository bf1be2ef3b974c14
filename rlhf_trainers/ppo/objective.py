"""PPO's part of the on-policy update: GAE advantages over the value model's estimates, the clipped
policy loss plus ``vf_coef`` x the clipped value loss, and NeMo RL's critic metrics."""

from __future__ import annotations

import torch

from .. import functional as F
from ..onpolicy.objective import Objective
from ..onpolicy.rollout import Advantages, LossNormalization, Rollout


class PPOObjective(Objective):
    """PPO (LHPD's algorithm; NeMo RL's critic options)."""

    #: The registered advantage estimator PPO uses (:mod:`rlhf_trainers.functional.registry`).
    advantage_estimator = "gae"
    display_metrics = (
        ("objective/scores", "reward"),
        ("objective/kl", "kl"),
        ("loss/value_avg", "value_loss"),
        ("policy/clipfrac_avg", "clipfrac"),
    )

    def advantages(self, rollout: Rollout, rewards: torch.Tensor, kl_coef: float) -> Advantages:
        """GAE over the value model's estimates (``gamma``, ``lam``, ``lam_value``, length-adaptive lam);
        the advantages whitened over all processes (``whiten_advantages``), the returns are the value
        targets. Over the tokens the policy wrote (``Rollout.policy_mask``): a multi-turn episode's tool
        turns are skipped by GAE's carry-forward masking (the last token of an assistant turn bootstraps
        from the first token of the next one), so an episode is one sequence of the policy's tokens."""
        mask = rollout.policy_mask
        estimator = F.get_advantage_estimator(self.advantage_estimator)
        advantages, returns = estimator(self.advantage_inputs(rollout, rewards, kl_coef, group_size=1))
        if self.args.whiten_advantages:
            advantages = F.whiten(advantages, mask, shift_mean=True, all_reduce=self.collectives.all_reduce)
        return Advantages(advantages=advantages.masked_fill(~mask, 0.0), returns=returns, rewards=rewards)

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
        """The policy loss (each token weighted by the rollout's vLLM importance weights, if any; the KL
        loss term with ``kl_loss_coef``) plus ``vf_coef`` x clipped value loss, both reduced with
        ``loss_agg_mode`` over the mini-batch; the value loss alone (the policy term with weight 0) during
        ``critic_warmup_steps``."""
        args = self.args
        weights = rollout.sampling_weights[rows] if rollout.sampling_weights is not None else None
        pg_loss, metrics, aggregation = self.token_policy_loss(
            rollout, advantages.advantages[rows], rows, logprobs, normalization, weights, entropy
        )
        assert values is not None, "PPO's loss needs the value model's values"
        mask = rollout.policy_mask[rows]  # the critic is trained at the policy's tokens only
        vf_loss, vm = F.clipped_value_loss(
            values, rollout.values[rows], advantages.returns[rows], mask, args.cliprange_value, **aggregation
        )
        warmup = step < args.critic_warmup_steps
        # During warmup the policy term is kept in the graph with weight 0: its gradients are zeros, not
        # missing, which DDP (find_unused_parameters=False) needs.
        loss = args.vf_coef * vf_loss + (0.0 if warmup else 1.0) * pg_loss
        metrics["loss/value_avg"] = vf_loss.detach()
        metrics["val/clipfrac_avg"] = vm["vf_clipfrac"]
        return loss, metrics

    def metrics(self, rollout: Rollout, advantages: Advantages) -> dict[str, float]:
        """NeMo RL's critic metrics over the policy's valid tokens of all processes."""
        mask = rollout.policy_mask
        v = rollout.values[mask].double()
        r = advantages.returns[mask].double()
        a = advantages.advantages[mask].double()
        d = r - v
        sums = torch.stack(
            [
                v.new_tensor(float(v.numel())),
                v.sum(),
                r.sum(),
                r.square().sum(),
                d.sum(),
                d.square().sum(),
                a.sum(),
            ]
        )
        device = self.collectives.accelerator.device
        sums = self.collectives.all_reduce(sums.to(device)).cpu()
        big = torch.finfo(torch.float64).max
        extremes = torch.stack(
            [v.min() if v.numel() else v.new_tensor(big), -(v.max() if v.numel() else v.new_tensor(-big))]
        )
        extremes = self.collectives.gather(extremes.reshape(1, 2).to(device)).cpu().min(0).values
        n = float(sums[0])
        if n == 0:
            return {}
        var_r = float(sums[3]) / n - (float(sums[2]) / n) ** 2
        var_d = float(sums[5]) / n - (float(sums[4]) / n) ** 2
        return {
            "critic/values_mean": float(sums[1]) / n,
            "critic/values_min": float(extremes[0]),
            "critic/values_max": -float(extremes[1]),
            "critic/returns_mean": float(sums[2]) / n,
            "critic/explained_var": 1.0 - var_d / var_r if var_r > 0 else 0.0,
            "critic/advantages_mean": float(sums[6]) / n,
        }
