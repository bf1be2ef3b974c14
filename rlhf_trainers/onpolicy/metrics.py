"""Step 8 of the update: the metrics every on-policy algorithm logs (TRL's names), over all processes,
and the collectives that reduce them (:class:`Collectives`). An algorithm adds its own in its
objective's :meth:`~rlhf_trainers.onpolicy.objective.Objective.metrics`.

GRPO and RLOO also log TRL 1.x's ``GRPOTrainer`` / ``RLOOTrainer`` names
(``Objective.trl_metric_names``): the rollout's and the evaluation's with :func:`trl_sample_metrics`, the
training passes' per micro-batch (:func:`trl_clip_metrics`, the entropy and the KL loss term) reduced over
the processes by :class:`MicroBatchReductions`."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
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
    mask = rollout.policy_mask
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
    mask = rollout.policy_mask
    weights = rollout.sampling_weights
    if weights is None:
        w = None
    elif weights.shape == mask.shape:  # per token
        w = weights[mask].float()
    else:  # per sequence
        w = weights[rollout.valid_rows].reshape(-1).float()
    diff = (rollout.logprobs - rollout.generation_logprobs).float()[mask]
    return sampling_mismatch_metrics(diff, w, collectives, sync_seconds)


# ---- TRL 1.x's GRPOTrainer / RLOOTrainer names -------------------------------------------------------

#: TRL's names logged as a mean over the tokens (or sequences) of one micro-batch on all processes, then
#: averaged over the micro-batches: each micro-batch gives a ``(sum, count)`` pair.
TRL_GLOBAL_MEANS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
#: TRL's names logged as the smallest (``clip_ratio/low_min``) or largest (``clip_ratio/high_max``) value over
#: the sequences of one micro-batch on all processes, then averaged over the micro-batches.
TRL_GLOBAL_MINS = ("clip_ratio/low_min",)
TRL_GLOBAL_MAXES = ("clip_ratio/high_max",)


def trl_sample_metrics(
    total: torch.Tensor,
    per_source: dict[str, torch.Tensor],
    lengths: torch.Tensor,
    found_stop: torch.Tensor,
    prompt_tokens: torch.Tensor,
    collectives: Collectives,
    keep: torch.Tensor | None = None,
) -> tuple[dict[str, float], float]:
    """TRL's reward and completion metrics of sampled completions, over all processes (a collective).

    Args:
        total: (N,) the weighted sum of the reward sources before shaping; NaN where there is no reward.
        per_source: (N,) each reward source's score, by name; NaN where it gave none.
        lengths: (N,) completion tokens, the stop token included.
        found_stop: (N,) bool, whether the completion ended with its stop token.
        prompt_tokens: (N,) prompt tokens (padding not counted).
        collectives: the processes' collectives.
        keep: (N,) bool, the rows to count (None: all).

    Returns:
        ``(metrics, tokens)``: ``reward`` and ``reward_std`` (mean and unbiased std over the completions
        with a reward), ``rewards/<source>/mean`` and ``/std`` (over the completions the source scored),
        ``completions/mean_length``, ``/min_length``, ``/max_length`` (all completions),
        ``completions/clipped_ratio`` (share without a stop token) and ``completions/mean_terminated_length``,
        ``/min_terminated_length``, ``/max_terminated_length`` (those with one; 0 when there is none);
        ``tokens`` is the prompt and completion tokens of the rows counted.
    """
    device = collectives.accelerator.device
    names = list(per_source)
    columns = [total, lengths, found_stop, prompt_tokens, *(per_source[n] for n in names)]
    rows = torch.stack([c.to(device).float().reshape(-1) for c in columns], dim=1)
    if keep is None:
        keep = torch.ones(rows.shape[0], dtype=torch.bool, device=device)
    rows = collectives.gather(rows)[collectives.gather(keep.to(device).float()).bool()].double().cpu()

    def mean_and_std(values: torch.Tensor) -> tuple[float, float]:
        values = values[torch.isfinite(values)]
        if not values.numel():
            return math.nan, math.nan
        return float(values.mean()), float(values.std(unbiased=True)) if values.numel() > 1 else math.nan

    metrics: dict[str, float] = {}
    metrics["reward"], metrics["reward_std"] = mean_and_std(rows[:, 0])
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"], metrics[f"rewards/{name}/std"] = mean_and_std(rows[:, 4 + i])
    length, stopped = rows[:, 1], rows[:, 2].bool()
    terminated = length[stopped] if stopped.any() else length.new_zeros(1)
    if length.numel():
        metrics["completions/mean_length"] = float(length.mean())
        metrics["completions/min_length"] = float(length.min())
        metrics["completions/max_length"] = float(length.max())
        metrics["completions/clipped_ratio"] = float((~stopped).double().mean())
        metrics["completions/mean_terminated_length"] = float(terminated.mean())
        metrics["completions/min_terminated_length"] = float(terminated.min())
        metrics["completions/max_terminated_length"] = float(terminated.max())
    return metrics, float(rows[:, 1].sum() + rows[:, 3].sum())


def trl_clip_metrics(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> dict[str, torch.Tensor]:
    """TRL's ``clip_ratio/*`` of one micro-batch on this process: where the ratio ``exp(log_ratio)`` is
    below ``1 - clip_low`` with a negative advantage (low), above ``1 + clip_high`` with a positive one
    (high), or either (region). ``log_ratio``, ``advantages`` and ``mask`` are (M, R) per token, or (M, 1)
    when the ratio is one per sequence (RLOO's default, GSPO). Returns ``(sum, count)`` pairs for the
    ``*_mean`` names (:data:`TRL_GLOBAL_MEANS`) and, per sequence, the smallest share of low-clipped
    tokens and the largest share of high-clipped ones (NaN without a sequence)."""
    with torch.no_grad():
        valid = mask.bool()
        ratio = log_ratio.detach().float().exp()
        advantages = torch.broadcast_to(advantages.detach().float(), ratio.shape)
        low = (ratio < 1 - clip_low) & (advantages < 0) & valid
        high = (ratio > 1 + clip_high) & (advantages > 0) & valid
        count = valid.sum().float()
        per_sequence = valid.sum(1).float()
        sequences = per_sequence > 0
        low_share = (low.sum(1).float() / per_sequence.clamp_min(1))[sequences]
        high_share = (high.sum(1).float() / per_sequence.clamp_min(1))[sequences]
        nan = torch.full((), math.nan, device=ratio.device)
        return {
            "clip_ratio/low_mean": torch.stack([low.sum().float(), count]),
            "clip_ratio/high_mean": torch.stack([high.sum().float(), count]),
            "clip_ratio/region_mean": torch.stack([(low | high).sum().float(), count]),
            "clip_ratio/low_min": low_share.min() if low_share.numel() else nan,
            "clip_ratio/high_max": high_share.max() if high_share.numel() else nan,
        }


class MicroBatchReductions:
    """TRL's per-micro-batch metrics of an update (:data:`TRL_GLOBAL_MEANS`, :data:`TRL_GLOBAL_MINS`,
    :data:`TRL_GLOBAL_MAXES`), kept on each process and reduced over all processes once per update: a
    mean's ``(sum, count)`` pairs are summed over processes per micro-batch, a min or max taken over
    processes per micro-batch, and the results averaged over the micro-batches (NaN ones left out).

    Args:
        per_micro_batch: whether every process runs the same micro-batches (fixed sizes); if not (a token
            budget, ``max_tokens_per_microbatch``, or rows moved between processes, ``balance_batch``),
            the micro-batches of each optimizer step are merged first (sums added, the min or max of
            their values), and the optimizer steps are the units averaged.
    """

    def __init__(self, per_micro_batch: bool) -> None:
        self.per_micro_batch = per_micro_batch
        self.values: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.steps: dict[str, list[int]] = defaultdict(list)

    @staticmethod
    def handles(name: str) -> bool:
        """Whether ``name`` is reduced here."""
        return name in TRL_GLOBAL_MEANS or name in TRL_GLOBAL_MINS or name in TRL_GLOBAL_MAXES

    def add(self, name: str, value: torch.Tensor, step: int) -> None:
        """One micro-batch's ``value`` of ``name`` (a ``(sum, count)`` pair for a mean), in optimizer
        step ``step`` of the update."""
        self.values[name].append(value.detach().float().reshape(-1))
        self.steps[name].append(step)

    def _units(self, name: str) -> torch.Tensor:
        """(units, 2) pairs, or (units,) values, of ``name``: per micro-batch, or merged per step."""
        values = torch.stack(self.values[name])
        if self.per_micro_batch:
            return values if name in TRL_GLOBAL_MEANS else values[:, 0]
        steps = torch.tensor(self.steps[name], device=values.device)
        merged = []
        for step in sorted(set(self.steps[name])):
            chosen = values[steps == step]
            if name in TRL_GLOBAL_MEANS:
                merged.append(chosen.sum(0))
            else:
                finite = chosen[:, 0][~chosen[:, 0].isnan()]
                if not finite.numel():
                    merged.append(chosen.new_full((), math.nan))
                else:
                    merged.append(finite.min() if name in TRL_GLOBAL_MINS else finite.max())
        return torch.stack(merged)

    def reduce(self, collectives: Collectives) -> dict[str, float]:
        """The metrics of the update over all processes (a collective: every process has the same names
        and units)."""
        device = collectives.accelerator.device
        metrics: dict[str, float] = {}
        for name in sorted(self.values):
            units = self._units(name).to(device)
            if name in TRL_GLOBAL_MEANS:
                sums = collectives.all_reduce(units.double())
                per_unit = sums[:, 0] / sums[:, 1].clamp_min(1)
            else:
                gathered = collectives.gather(units.reshape(1, -1)).double()  # (processes, units)
                big = torch.where(
                    gathered.isnan(), -math.inf if name in TRL_GLOBAL_MAXES else math.inf, gathered
                )
                per_unit = big.amax(0) if name in TRL_GLOBAL_MAXES else big.amin(0)
                per_unit = torch.where(per_unit.isinf(), math.nan, per_unit)
            finite = per_unit[~per_unit.isnan()]
            metrics[name] = float(finite.mean()) if finite.numel() else math.nan
        return metrics
