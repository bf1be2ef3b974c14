"""What one algorithm adds to the on-policy update: its per-token rewards (step 2),
advantages (step 4), loss (step 5) and metrics (step 6). PPO, RLOO and GRPO each subclass
:class:`Objective` in their own folder (``ppo/objective.py``, ...); the engine calls these four methods
and nothing else of it.

The pieces an objective is made of are registered by name in
:mod:`rlhf_trainers.functional.registry`: the advantage estimator (``GRPOConfig.advantage_estimator``;
PPO's is ``"gae"``) and the policy loss (``policy_loss``, default ``"vanilla"``: PPO's clipped
surrogate), so a variant is one registered function, not a new objective.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import functional as F
from .metrics import Collectives, trl_clip_metrics
from .rollout import Advantages, LossNormalization, Rollout


class Objective:
    """An algorithm's advantages, loss and metrics, over a :class:`Rollout`.

    Args:
        args: the trainer's config.
        collectives: sums, gathers and means over the processes (:class:`Collectives`).
    """

    #: Whether the rollout must keep the sampling loop's own log-probs for this algorithm's loss
    #: (``Rollout.generation_logprobs``); the engine adds its own reasons (vLLM).
    needs_generation_logprobs: bool = False
    #: Whether the algorithm also logs TRL 1.x's GRPOTrainer / RLOOTrainer metric names (``reward``,
    #: ``entropy``, ``clip_ratio/*``, ``completions/*``, ...) beside its own (GRPO and RLOO do; PPO keeps
    #: TRL's PPOTrainer names).
    trl_metric_names: bool = False
    #: The figures the progress bar shows live and the end-of-run summary compares (first -> last
    #: logged), as ``(logged name, label)`` pairs (:class:`rlhf_trainers.display.TrainingDisplay`).
    display_metrics: tuple[tuple[str, str], ...] = (("objective/scores", "reward"), ("objective/kl", "kl"))

    def __init__(self, args: Any, collectives: Collectives) -> None:
        self.args = args
        self.collectives = collectives
        self.policy_loss_fn = F.get_policy_loss(getattr(args, "policy_loss", "vanilla"))

    # ---- the calls of the engine --------------------------------------------------------------------

    def token_rewards(self, rollout: Rollout, kl_coef: float) -> torch.Tensor:
        """(N, R) per-token rewards: ``-kl_coef * kl`` at every response token and the sequence's score
        added at its last token (LHPD, "Per-token KL penalty"); whitened over all processes with
        ``shift_mean=False`` when ``whiten_rewards``."""
        rewards = (-kl_coef * rollout.kl).clone()
        last = (rollout.lengths - 1).clamp_min(0)
        rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += (
            rollout.scores * rollout.valid_rows.float()
        )
        if self.args.whiten_rewards:
            rewards = F.whiten(
                rewards, rollout.policy_mask, shift_mean=False, all_reduce=self.collectives.all_reduce
            )
        return rewards

    def advantages(self, rollout: Rollout, rewards: torch.Tensor, kl_coef: float) -> Advantages:
        """Step 4: the advantages of ``rollout`` (and what else the loss reads, e.g. PPO's returns).

        Args:
            rollout: the update's rollout (not to be modified).
            rewards: (N, R) per-token rewards (``-kl_coef * KL`` per token, the shaped score at the last).
            kl_coef: the KL coefficient of this update (the adaptive controller's value).
        """
        raise NotImplementedError

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
        """Step 5's loss of one micro-batch.

        Args:
            rollout: the update's rollout; ``rollout.X[rows]`` are the micro-batch's rows.
            advantages: what :meth:`advantages` returned for it.
            rows: (M,) long, the micro-batch's row indices into the rollout.
            logprobs: (M, R) log-probs of the responses under the current policy, with gradient.
            values: (M, R) the value model's current V(s_t), with gradient (PPO); None without one.
            normalization: the denominators of the optimizer step's loss (tokens and sequences of the
                whole mini-batch over all processes): dividing the micro-batch's summed loss by them makes
                it its share of the mini-batch's loss. None: the micro-batch's own counts.
            entropy: (M, R) the policy's entropy at each response position, with gradient, when
                ``entropy_coeff`` is not 0 (the bonus ``-entropy_coeff x entropy`` per token); else None.
            step: the Trainer's ``global_step`` (PPO's critic warm-up).

        Returns:
            ``(loss, metrics)``: the micro-batch's share of the mini-batch's loss, back-propagated as it
            is, and detached scalar metrics (``loss/*`` are shares like the loss, the others means).
        """
        raise NotImplementedError

    def metrics(self, rollout: Rollout, advantages: Advantages) -> dict[str, float]:
        """Step 6: the algorithm's own metrics over all processes (the engine logs its shared ones)."""
        return {}

    # ---- shared pieces ---------------------------------------------------------------------------

    def advantage_inputs(
        self, rollout: Rollout, rewards: torch.Tensor, kl_coef: float, group_size: int
    ) -> F.AdvantageInputs:
        """What a registered advantage estimator reads about ``rollout``."""
        return F.AdvantageInputs(
            token_rewards=rewards,
            sequence_rewards=rollout.scores - kl_coef * rollout.kl.sum(1),
            response_mask=rollout.policy_mask,
            valid=rollout.valid_rows,
            group_size=group_size,
            config=self.args,
            values=rollout.values,
            all_reduce=self.collectives.all_reduce,
        )

    def kl_loss(self, rollout: Rollout, rows: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor | None:
        """``kl_loss_coef`` x the per-token KL estimate (``kl_loss_estimator``) of the current policy
        against the reference, for the loss (GRPO's ``beta`` term); None when ``kl_loss_coef`` is 0."""
        if not self.args.kl_loss_coef:
            return None
        kl = F.kl_penalty(logprobs, rollout.ref_logprobs[rows], self.args.kl_loss_estimator)
        return self.args.kl_loss_coef * kl

    def extra_token_loss(
        self, kl_loss: torch.Tensor | None, entropy: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The per-token terms added to the policy loss: the KL loss (``kl_loss``, already scaled) and
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
        """The policy loss (``policy_loss``) per token of the micro-batch ``rows``: the ratio per token
        or of the sequence (``importance_sampling_level``), ``importance_weights`` ((M, R), or (M, 1) for
        a whole sequence), the KL loss term (``kl_loss_coef``) and the entropy bonus, reduced with
        ``loss_agg_mode`` by ``normalization`` (None: the micro-batch's own counts). Returns ``(loss,
        metrics, aggregation)``: the metrics of :meth:`policy_loss_metrics`, and the aggregation keywords
        (for a value loss reduced alike)."""
        args = self.args
        mask = rollout.policy_mask[rows]
        old = rollout.logprobs[rows]
        if normalization is None:
            normalization = LossNormalization.local(mask, args.response_length)
        if importance_weights is not None and importance_weights.shape != mask.shape:
            importance_weights = importance_weights.expand_as(mask)  # a sequence's weight at every token
        aggregation = normalization.aggregation(args.loss_agg_mode)
        kl_loss = self.kl_loss(rollout, rows, logprobs)
        loss, pm = self.policy_loss_fn(
            self.ratio_logprobs(logprobs, old, mask),
            old,
            advantages,
            mask,
            args,
            importance_weights=importance_weights,
            extra_loss=self.extra_token_loss(kl_loss, entropy),
            **aggregation,
        )
        metrics = self.policy_loss_metrics(loss, pm, kl_loss, mask)
        if self.trl_metric_names:
            if args.importance_sampling_level == "token":
                log_ratio, ratio_mask, ratio_advantages = logprobs.detach() - old, mask, advantages
            else:  # one ratio per sequence (GSPO): TRL's clip ratios count sequences
                m = mask.to(logprobs.dtype)
                summed = ((logprobs.detach() - old) * m).sum(1, keepdim=True)
                log_ratio = summed / m.sum(1, keepdim=True).clamp_min(1)
                ratio_mask = mask.any(1, keepdim=True)
                ratio_advantages = advantages
                if advantages.shape[1] != 1:
                    ratio_advantages = F.masked_mean(advantages, mask, dim=1, keepdim=True)
            metrics.update(self.trl_loss_metrics(log_ratio, ratio_advantages, ratio_mask, kl_loss, mask))
        return loss, metrics, aggregation

    def policy_loss_metrics(
        self,
        loss: torch.Tensor,
        pm: dict[str, torch.Tensor],
        kl_loss: torch.Tensor | None,
        mask: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The metrics of a policy loss (TRL's names): ``loss/policy_avg``, approx. KL, clip fractions,
        ratio mean and variance, and ``policy/kl_loss_avg`` with a KL loss term."""
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

    def trl_loss_metrics(
        self,
        log_ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        kl_loss: torch.Tensor | None,
        token_mask: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """TRL's names for one micro-batch (:attr:`trl_metric_names`): the ``clip_ratio/*`` of the ratio
        ``exp(log_ratio)`` against ``epsilon`` / ``epsilon_high`` (``cliprange`` / ``cliprange_high``)
        with ``advantages`` over ``mask`` ((M, R) per token or (M, 1) per sequence), and ``kl``, the
        per-token KL estimate of the loss term (``kl_loss``, already scaled by ``kl_loss_coef``; GRPO's
        ``beta`` term) over ``token_mask``; as ``(sum, count)`` pairs and per-sequence extremes
        (:func:`~rlhf_trainers.onpolicy.metrics.trl_clip_metrics`), reduced over the processes by the
        optimization loop."""
        args = self.args
        clip_high = args.cliprange if args.cliprange_high is None else args.cliprange_high
        metrics = trl_clip_metrics(log_ratio, advantages, mask, args.cliprange, clip_high)
        if kl_loss is not None:
            kl = kl_loss.detach().float() / args.kl_loss_coef
            valid = token_mask.bool()
            metrics["kl"] = torch.stack([torch.where(valid, kl, 0.0).sum(), valid.sum().float()])
        return metrics

    def ratio_logprobs(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The log-probs whose difference to ``old_logprobs`` is the ratio's log: ``logprobs`` for
        ``importance_sampling_level='token'``; for ``'sequence'`` (GSPO) ``old + mean over the sequence's
        valid tokens of (logprobs - old)`` at every token, so each token's ratio is the sequence's."""
        if self.args.importance_sampling_level == "token":
            return logprobs
        mask = mask.to(logprobs.dtype)
        mean = ((logprobs - old_logprobs) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(
            1
        )
        return old_logprobs + mean.expand_as(logprobs)
