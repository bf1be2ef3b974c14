"""Step 8 of the update: the metrics every on-policy algorithm logs (TRL's names), over all processes,
and the collectives that reduce them (:class:`Collectives`). An algorithm adds its own in its
objective's :meth:`~rlhf_trainers.onpolicy.objective.Objective.metrics`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from .rollout import Rollout

logger = logging.getLogger(__name__)


class Collectives:
    """Sums, gathers and means over the data-parallel processes of ``accelerator`` (no-ops on one).
    Every method is a collective: every process calls it, in the same order."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The sum of ``tensor`` over processes."""
        if self.accelerator.num_processes == 1:
            return tensor
        return self.accelerator.reduce(tensor, reduction="sum")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated along dim 0 (on the accelerator's device)."""
        tensor = tensor.to(self.accelerator.device)
        return self.accelerator.gather(tensor) if self.accelerator.num_processes > 1 else tensor

    def gather_objects(self, items: list[Any]) -> list[Any]:
        """Every process's list ``items`` (picklable objects) concatenated, in process order."""
        if self.accelerator.num_processes == 1:
            return list(items)
        from accelerate.utils import gather_object

        return list(gather_object(list(items)))

    def reduce_means(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """Means over processes of per-process scalars (one collective)."""
        if not values:
            return {}
        names = sorted(values)
        stacked = torch.stack([values[n].detach().float().to(self.accelerator.device) for n in names])
        if self.accelerator.num_processes > 1:
            stacked = self.accelerator.reduce(stacked, reduction="mean")
        return {n: float(v) for n, v in zip(names, stacked.tolist(), strict=True)}


def rollout_metrics(
    rollout: Rollout,
    collectives: Collectives,
    *,
    kl_coef: float,
    eos_token_id: int | None,
    uses_reference_model: bool,
) -> dict[str, float]:
    """TRL's ``objective/*`` and ``val/*`` metrics of a rollout over all processes, the per-source scores,
    the reward errors and (DAPO) the dynamic-sampling counts."""
    mask = rollout.response_mask
    valid = rollout.valid_rows
    kl_seq = rollout.kl.sum(1)
    non_score = -kl_coef * kl_seq
    entropy_seq = -(rollout.logprobs * mask).sum(1)
    response = rollout.response
    # EOS tokens inside each response (up to its length): the padding after it may be EOS as well
    # (a tokenizer whose pad token is its EOS token).
    inside = torch.arange(response.shape[1], device=response.device)[None, :] < rollout.lengths[:, None]
    eos_count = (
        ((response == eos_token_id) & inside).sum(1).float()
        if eos_token_id is not None
        else torch.zeros_like(kl_seq)
    )
    per_row = torch.stack(
        [
            kl_seq,
            entropy_seq,
            non_score,
            rollout.scores + non_score,
            rollout.scores,
            rollout.raw_scores.nan_to_num(0.0),
            rollout.lengths.float(),
            eos_count,
            rollout.found_stop.float(),
            valid.float(),
        ],
        dim=1,
    ).float()
    gathered = collectives.gather(per_row)
    ok = collectives.gather(valid.float()).bool()

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
        "rollout/reward_func_errors": float(collectives.gather(rollout.reward_func_errors.reshape(1)).sum()),
    }
    if rollout.dynamic_sampling is not None:
        # rounds (max over processes), groups dropped and groups that still had to fill the rollout
        stats = collectives.gather(rollout.dynamic_sampling.reshape(1, 3).float()).cpu()
        metrics["rollout/dynamic_sampling_rounds"] = float(stats[:, 0].max())
        metrics["rollout/dynamic_sampling_groups_dropped"] = float(stats[:, 1].sum())
        metrics["rollout/dynamic_sampling_groups_short"] = float(stats[:, 2].sum())
    if not uses_reference_model:
        # No reference policy was run: there is no KL to report (it would read 0).
        del metrics["objective/kl"], metrics["objective/non_score_reward"]
    for name, scores in rollout.per_source.items():
        values = collectives.gather(scores.float())
        finite = torch.isfinite(values)
        metrics[f"objective/scores/{name}"] = float(values[finite].mean()) if finite.any() else float("nan")
    if rollout.reward_metrics is not None:
        for name, value in logged_metric_means(rollout.reward_metrics, collectives).items():
            if name in metrics:
                logger.warning(
                    "a reward function logged the metric %r with log_metric, which is a name of the trainer's "
                    "own metrics; the trainer's value is kept. Give the metric another name.",
                    name,
                )
                continue
            metrics[name] = value
    return metrics


def logged_metric_means(values: dict[str, list[float]], collectives: Collectives) -> dict[str, float]:
    """The mean of each metric the reward functions logged (``log_metric``) over all its values on all
    processes, as TRL averages them. A collective: every process calls it, whatever it logged (one sum
    says whether any process logged; only then are the names gathered)."""
    if collectives.accelerator.num_processes > 1:
        logged = torch.tensor([float(len(values))], device=collectives.accelerator.device)
        if not float(collectives.all_reduce(logged)):
            return {}
    names = sorted(set(collectives.gather_objects(sorted(values))))
    if not names:
        return {}
    sums = torch.tensor(
        [[sum(values.get(n, ())), float(len(values.get(n, ())))] for n in names], dtype=torch.float32
    )
    sums = collectives.all_reduce(sums.to(collectives.accelerator.device)).cpu()
    return {n: float(total / count) for n, (total, count) in zip(names, sums.tolist(), strict=True) if count}


def sampling_mismatch_metrics(
    diff: torch.Tensor, weights: torch.Tensor | None, collectives: Collectives, sync_seconds: float
) -> dict[str, float]:
    """How far vLLM's sampling distribution is from the trained one, over valid response tokens of all
    processes (TRL's ``sampling/*`` names): the mean and max of |logp_train - logp_vllm| (``diff``, one
    value per token), a k3 estimate of KL(pi_vllm || pi_train) (the tokens were sampled from vLLM), the
    importance ``weights`` (after the cap; per token or per sequence; None: not applied) and
    ``sync_seconds``, the last weight sync's duration. A collective."""
    device = collectives.accelerator.device
    k3 = (diff.exp() - 1) - diff
    w = diff.new_zeros(0) if weights is None else weights
    count = diff.new_tensor(float(diff.numel()))
    sums = torch.stack([count, diff.abs().sum(), k3.sum(), w.sum(), w.new_tensor(float(w.numel()))])
    sums = collectives.all_reduce(sums.double().to(device)).cpu()
    big = torch.finfo(torch.float32).max
    extremes = torch.stack(
        [
            diff.abs().max() if diff.numel() else diff.new_tensor(0.0),
            -w.min() if w.numel() else w.new_tensor(-big),
            w.max() if w.numel() else w.new_tensor(-big),
        ]
    )
    top = collectives.gather(extremes.reshape(1, 3).to(device)).max(0).values.cpu()
    n = float(sums[0])
    metrics = {
        "sampling/sampling_logp_difference/mean": float(sums[1]) / n if n else 0.0,
        "sampling/sampling_logp_difference/max": float(top[0]),
        "sampling/kl_vllm_train": float(sums[2]) / n if n else 0.0,
        "timing/weight_sync": sync_seconds,
    }
    if weights is not None and float(sums[4]) > 0:
        metrics["sampling/importance_sampling_ratio/min"] = -float(top[1])
        metrics["sampling/importance_sampling_ratio/max"] = float(top[2])
        metrics["sampling/importance_sampling_ratio/mean"] = float(sums[3] / sums[4])
    return metrics


def rollout_sampling_metrics(
    rollout: Rollout, collectives: Collectives, sync_seconds: float
) -> dict[str, float]:
    """:func:`sampling_mismatch_metrics` of a rollout whose log-probs the trainer recomputed (vLLM's are
    in ``generation_logprobs``), with its importance weights where they are applied."""
    mask = rollout.response_mask
    weights = rollout.sampling_weights
    if weights is None:
        w = None
    elif weights.shape == mask.shape:  # per token
        w = weights[mask].float()
    else:  # per sequence
        w = weights[rollout.valid_rows].reshape(-1).float()
    diff = (rollout.logprobs - rollout.generation_logprobs).float()[mask]
    return sampling_mismatch_metrics(diff, w, collectives, sync_seconds)
