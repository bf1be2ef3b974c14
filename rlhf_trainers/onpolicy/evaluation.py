"""Evaluation and sample tables of the on-policy engine: the rollout producer's samples and scores
(``sample_and_score``) on held-out prompts. Functions of the trainer, which ``evaluate()`` calls."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from transformers.trainer_utils import speed_metrics

from ..models import embedding_rows
from .metrics import trl_sample_metrics
from .rollout import Rollout
from .setup import tokenize

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
# Per-process seed offset (a large prime), so that ranks sample different completions.
RANK_SEED_STRIDE = 100003


def print_sample_table(rows: list[dict[str, Any]], title: str, to_log: bool = False) -> None:
    """Print (or log at INFO) ``[score] prompt ||| completion`` lines of a sample table."""
    text = "\n".join(f"  [{r['score']:+.3f}] {r['prompt']!s} ||| {r['completion']}" for r in rows)
    if to_log:
        logger.info("%s:\n%s", title, text)
    else:
        print(f"{title}:\n{text}")


def log_samples(trainer: Any, rollout: Rollout) -> None:
    """The first ``sample_table_size`` rows of a rollout: printed and appended to ``samples.jsonl``."""
    count = min(trainer.args.sample_table_size, len(rollout.completions))
    if not trainer.is_world_process_zero() or count == 0:
        return
    table = [
        {
            "update": trainer.state.global_step,
            "prompt": rollout.prompts[i],
            "completion": rollout.completions[i],
            "score": float(rollout.scores[i]),
        }
        for i in range(count)
    ]
    print_sample_table(table, f"sample completions at update {trainer.state.global_step}")
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    with open(os.path.join(trainer.args.output_dir, SAMPLES_FILE), "a", encoding="utf-8") as fh:
        for row in table:
            fh.write(json.dumps(row, default=str) + "\n")


def tokenized_prompts(trainer: Any, dataset: datasets.Dataset, name: str = "eval") -> datasets.Dataset:
    """``dataset`` of prompts (a "prompt" or "messages" column) tokenized as the training prompts are
    (chat template, ``max_prompt_length``), ready for ``data_collator`` and the producer's ``sample_and_score``;
    one with ``input_ids`` and no "prompt" column is returned as it is. ``name`` keys its entry in
    ``preprocessing_stats``."""
    if "input_ids" in dataset.column_names and "prompt" not in dataset.column_names:
        return dataset
    return tokenize(
        dataset,
        trainer.processing_class,
        trainer.args,
        embedding_rows(trainer.policy),
        name,
        trainer.preprocessing_stats,
    )


@torch.no_grad()
def evaluate(
    trainer: Any,
    eval_dataset: datasets.Dataset | None = None,
    ignore_keys: list[str] | None = None,
    metric_key_prefix: str = "eval",
) -> dict[str, float]:
    """Generate on ``eval_dataset`` (default: the one given at construction) with the training
    sampling settings, score with every reward source and log ``{prefix}_objective/scores`` (and per
    source), the response length and the stop-token rate, with ``transformers.Trainer``'s
    ``{prefix}_runtime``, ``{prefix}_samples_per_second`` and ``{prefix}_steps_per_second``; where the
    objective logs TRL 1.x's names (GRPO, RLOO) also ``{prefix}_reward``, ``{prefix}_reward_std``,
    ``{prefix}_rewards/<source>/mean`` and ``/std``, ``{prefix}_completions/*`` and ``{prefix}_num_tokens``
    (:func:`~.metrics.trl_sample_metrics`). Runs the rollout's steps 2 and 3 (the producer's
    ``sample_and_score``). The sampling RNG is seeded from ``seed`` and forked, so evaluation neither
    changes the training run nor varies between calls on the same weights."""
    start_time = time.time()
    if eval_dataset is None:
        eval_dataset = trainer.eval_dataset
    else:
        eval_dataset = tokenized_prompts(trainer, eval_dataset, metric_key_prefix)
    if eval_dataset is None:
        raise ValueError("evaluate() needs an eval_dataset (here or at construction).")
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    n = len(eval_dataset)
    per_rank = math.ceil(n / world)
    # Every rank runs the same number of rows (ZeRO-3 forward passes are collective); rows past the end
    # repeat earlier ones and are dropped from the metrics.
    indices = [(rank * per_rank + i) for i in range(per_rank)]
    keep = torch.tensor([i < n for i in indices], device=trainer.accelerator.device)
    indices = [i % n for i in indices]
    devices = [trainer.accelerator.device] if trainer.accelerator.device.type == "cuda" else []
    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    sources: dict[str, list[torch.Tensor]] = defaultdict(list)
    batches = 0
    samples_table: list[dict[str, Any]] = []
    with (
        torch.random.fork_rng(devices=devices),
        trainer.accelerator.autocast(),
        trainer._compiled_passes(),
        trainer.sampler.prepared_weights_kept(),  # sampled many times on the same weights: prepared once
    ):
        torch.manual_seed(trainer.args.seed + 7 + rank * RANK_SEED_STRIDE)
        step = trainer.args.local_rollout_forward_batch_size
        for start in range(0, len(indices), step):
            batch = trainer.data_collator([eval_dataset[i] for i in indices[start : start + step]])
            samples, scores = trainer.producer.sample_and_score(batch)
            parts["objective/scores"].append(scores.total)
            parts["val/response_length"].append(samples.lengths.float())
            parts["val/stop_token_rate"].append(scores.found_stop.float())
            for name, values in scores.per_source.items():
                parts[f"objective/scores/{name}"].append(values.to(scores.total.device))
                sources[name].append(values.to(scores.total.device))
            batches += 1
            if len(samples_table) < trainer.args.sample_table_size:
                samples_table.extend(
                    {"prompt": p, "completion": c, "score": float(x)}
                    for p, c, x in zip(
                        samples.prompts, scores.completions, scores.total.tolist(), strict=True
                    )
                )
    keep_all = trainer.collectives.gather(keep.float()).bool()

    def mean(values: list[torch.Tensor]) -> float:
        gathered = trainer.collectives.gather(torch.cat(values).float())[keep_all]
        finite = torch.isfinite(gathered)
        return float(gathered[finite].mean()) if finite.any() else float("nan")

    metrics = {f"{metric_key_prefix}_{name}": mean(values) for name, values in parts.items()}
    if trainer.algorithm.trl_metric_names:
        lengths = torch.cat(parts["val/response_length"])
        trl, _ = trl_sample_metrics(
            torch.cat(parts["objective/scores"]),
            {name: torch.cat(values) for name, values in sources.items()},
            lengths,
            torch.cat(parts["val/stop_token_rate"]),
            torch.zeros_like(lengths),
            trainer.collectives,
            keep=keep,
        )
        trl["num_tokens"] = float(trainer.state.num_input_tokens_seen)
        metrics.update({f"{metric_key_prefix}_{name}": value for name, value in trl.items()})
    metrics.update(speed_metrics(metric_key_prefix, start_time, num_samples=n, num_steps=batches))
    if trainer.is_world_process_zero() and samples_table:
        title = f"evaluation samples at update {trainer.state.global_step}"
        print_sample_table(samples_table[: trainer.args.sample_table_size], title, to_log=True)
    trainer.log(metrics)
    trainer.control = trainer.callback_handler.on_evaluate(
        trainer.args, trainer.state, trainer.control, metrics
    )
    return metrics
