"""Evaluation and sample tables of the on-policy engine: the rollout producer's samples and scores
(``sample_and_score``) on held-out prompts. Functions of the trainer, which ``evaluate()`` calls."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from transformers.trainer_utils import speed_metrics

from ..models import embedding_rows
from ..rewards import RewardLog
from .metrics import logged_metric_means, trl_sample_metrics
from .rollout import Rollout
from .setup import tokenize

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
# Per-process seed offset (a large prime), so that ranks sample different completions.
RANK_SEED_STRIDE = 100003


def print_sample_table(
    rows: list[dict[str, Any]], title: str, to_log: bool = False, display: Any = None
) -> None:
    """Print (or log at INFO) ``[score] prompt ||| completion`` lines of a sample table; through the
    trainer's progress display when given (which prints the run's first table and keeps the latest for its
    summary: :meth:`rlhf_trainers.display.TrainingDisplay.show_samples`)."""
    text = "\n".join(
        f"  [{r['score']:+.3f}] {_one_line(r['prompt'])} ||| {_one_line(r['completion'])}" for r in rows
    )
    if to_log:
        logger.info("%s:\n%s", title, text)
    elif display is not None:
        display.show_samples(f"{title}:\n{text}")
    else:
        print(f"{title}:\n{text}")


def log_samples(trainer: Any, rollout: Rollout) -> None:
    """The first ``sample_table_size`` rows of a rollout: printed (with the progress display, only the run's
    first table, and its latest in the summary) and appended to ``samples.jsonl``."""
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
    title = f"sample completions at update {trainer.state.global_step}"
    print_sample_table(table, title, display=getattr(trainer, "display", None))
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
    reward_log = RewardLog()  # what the reward functions logged (log_metric), over the eval batches
    extra: dict[str, list[float]] = defaultdict(list)  # the producer's own metrics (tools/*), likewise
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
            if scores.reward_log is not None:
                reward_log.update(scores.reward_log)
            _add_extra_metrics(extra, samples.extra_metrics, keep[start : start + step].tolist())
            batches += 1
            if len(samples_table) < trainer.args.sample_table_size:
                samples_table.extend(
                    {"prompt": p, "completion": c, "score": float(x)}
                    for p, c, x in zip(
                        samples.prompts, scores.completions, scores.total.tolist(), strict=True
                    )
                )
    metrics = _gathered_metrics(trainer, parts, sources, reward_log, extra, keep, metric_key_prefix)
    metrics.update(speed_metrics(metric_key_prefix, start_time, num_samples=n, num_steps=batches))
    if trainer.is_world_process_zero() and samples_table:
        title = f"evaluation samples at update {trainer.state.global_step}"
        print_sample_table(samples_table[: trainer.args.sample_table_size], title, to_log=True)
    trainer.log(metrics)
    trainer.control = trainer.callback_handler.on_evaluate(
        trainer.args, trainer.state, trainer.control, metrics
    )
    return metrics


def _gathered_metrics(
    trainer: Any,
    parts: dict[str, list[torch.Tensor]],
    sources: dict[str, list[torch.Tensor]],
    reward_log: RewardLog,
    extra: dict[str, list[float]],
    keep: torch.Tensor,
    metric_key_prefix: str,
) -> dict[str, float]:
    """The evaluation's metrics over all processes (the rows in ``keep``): the means of ``parts``, the
    reward functions' and the producer's logged values, and TRL's names where the objective logs them.
    A collective: every process calls it."""
    keep_all = trainer.collectives.gather(keep.float()).bool()

    def mean(values: list[torch.Tensor]) -> float:
        gathered = trainer.collectives.gather(torch.cat(values).float())[keep_all]
        finite = torch.isfinite(gathered)
        return float(gathered[finite].mean()) if finite.any() else float("nan")

    metrics = {f"{metric_key_prefix}_{name}": mean(values) for name, values in parts.items()}
    # The reward functions' log_metric values and the producer's metrics (a tool run's tools/*), as in
    # training. A collective: every process calls it, whatever it has.
    logged = dict(reward_log.metrics) if trainer.reward_sources.may_log else {}
    for name, values in extra.items():
        logged.setdefault(name, []).extend(values)
    for name, value in logged_metric_means(logged, trainer.collectives).items():
        metrics.setdefault(f"{metric_key_prefix}_{name}", value)
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
    return metrics


def _add_extra_metrics(
    into: dict[str, list[float]], metrics: dict[str, list[float]] | None, keep: list[bool]
) -> None:
    """Append a batch's ``SampledResponses.extra_metrics`` to ``into``; a metric with one value per row
    keeps only the rows in ``keep`` (an eval batch's rows past the end of the dataset repeat others)."""
    for name, values in (metrics or {}).items():
        if len(values) == len(keep):
            values = [value for value, kept in zip(values, keep, strict=True) if kept]
        into[name].extend(values)


def completions_table(trainer: Any) -> dict[str, list[Any]] | None:
    """The last rollout of this process as TRL's completions table: columns ``prompt``, ``completion``, one
    per reward source (its score) and ``advantage`` (the sequence's; the mean over its tokens where the
    advantages are per token). ``num_completions_to_print`` rows drawn at random (seeded by ``seed`` and the
    step), all when None; None before the first update."""
    rollout, advantages = getattr(trainer, "_last_rollout", None), getattr(trainer, "_last_advantages", None)
    if rollout is None or advantages is None:
        return None
    adv = advantages.advantages.detach().float().cpu()
    if adv.shape[1] == 1:
        per_row = adv[:, 0]
    else:
        mask = rollout.response_mask.detach().cpu().float()
        per_row = (adv * mask).sum(1) / mask.sum(1).clamp(min=1)
    rows = list(range(len(rollout.completions)))
    wanted = trainer.args.num_completions_to_print
    if wanted is not None and wanted < len(rows):
        rows = sorted(
            random.Random(trainer.args.seed * 1_000_003 + trainer.state.global_step).sample(rows, wanted)
        )
    table: dict[str, list[Any]] = {
        "prompt": [rollout.prompts[i] for i in rows],
        "completion": [rollout.completions[i] for i in rows],
    }
    for name, scores in rollout.per_source.items():
        values = scores.detach().float().cpu()
        table[name] = [float(values[i]) for i in rows]
    table["advantage"] = [float(per_row[i]) for i in rows]
    return table


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def _content_text(content: Any) -> str:
    """A message's content as text: a list of content blocks as their text parts joined."""
    if isinstance(content, list):
        return " ".join(
            str(block.get("text", block)) if isinstance(block, dict) else str(block) for block in content
        )
    return "" if content is None else str(content)


def message_lines(messages: list[dict[str, Any]]) -> list[str]:
    """Chat messages as one line each (their text keeps its own line breaks): ``ROLE: content``; an
    assistant turn's tool calls as ``-> name({"arg": value})`` after its content, a tool result as
    ``TOOL name: content``. How sample tables show a prompt's messages and a tool episode's conversation
    (the assistant turns, the calls and the tool results)."""
    lines = []
    for message in messages:
        role = str(message.get("role", ""))
        content = _content_text(message.get("content"))
        if role == "tool":
            name = message.get("name")
            lines.append(f"TOOL {name}: {content}" if name else f"TOOL: {content}")
            continue
        calls = []
        for call in message.get("tool_calls") or ():
            function = call.get("function", call) if isinstance(call, dict) else {}
            arguments = function.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, default=str)
            calls.append(f"-> {function.get('name', '?')}({arguments})")
        lines.append(" ".join([f"{role.upper()}: {content}".rstrip(), *calls]))
    return lines


def _as_text(value: Any) -> str:
    """A prompt or completion as text: chat messages (a prompt's, a tool episode's) one per line
    (:func:`message_lines`)."""
    if _is_messages(value):
        return "\n".join(message_lines(value))
    return str(value)


def _one_line(value: Any) -> str:
    """A prompt or completion on one line of a ``[score] prompt ||| completion`` table: messages joined by
    `` | `` (:func:`message_lines`), line breaks shown as ``\\n``; text as it is."""
    if _is_messages(value):
        return " | ".join(line.replace("\n", "\\n") for line in message_lines(value))
    return str(value)


def print_completions(table: dict[str, list[Any]], step: int) -> None:
    """Print the completions table: a rich table in a panel titled with the step when ``rich`` is installed,
    else plain text (one block per row)."""
    numeric = [name for name in table if name not in ("prompt", "completion")]
    try:
        from rich.console import Console
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        lines = [f"Step {step}"]
        for i, prompt in enumerate(table["prompt"]):
            values = "  ".join(f"{name}={table[name][i]:.2f}" for name in numeric)
            lines.append(
                f"--- {values}\nPrompt: {_as_text(prompt)}\nCompletion: {_as_text(table['completion'][i])}"
            )
        print("\n".join(lines))
        return
    rich_table = Table(show_header=True, header_style="bold white", expand=True)
    rich_table.add_column("Prompt", style="bright_yellow")
    rich_table.add_column("Completion", style="bright_green")
    for name in numeric:
        rich_table.add_column(name.capitalize() if name == "advantage" else name, justify="right")
    for i, prompt in enumerate(table["prompt"]):
        rich_table.add_row(
            Text(_as_text(prompt)),  # (Text: brackets in a prompt are not rich markup)
            Text(_as_text(table["completion"][i])),
            *(f"{table[name][i]:.2f}" for name in numeric),
        )
        rich_table.add_section()
    Console().print(Panel(rich_table, expand=False, title=f"Step {step}", border_style="bold white"))


def log_completions(trainer: Any) -> None:
    """``log_completions``: at a logging step, print the last rollout's table (main process) and log it, with
    a ``step`` column, to wandb / trackio when they are in ``report_to`` (as TRL does; with
    ``log_unique_prompts`` one row per distinct prompt there)."""
    if not trainer.is_world_process_zero():
        return
    table = completions_table(trainer)
    if table is None:
        return
    step = trainer.state.global_step
    print_completions(table, step)
    report_to = trainer.args.report_to or []
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    backends = []
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            backends.append(wandb)
    if "trackio" in report_to:
        import trackio

        backends.append(trackio)
    if not backends:
        return
    columns = ["step", *table]
    rows = [
        [
            step,
            *(
                _as_text(v) if name in ("prompt", "completion") else v
                for name, v in zip(table, row, strict=True)
            ),
        ]
        for row in zip(*table.values(), strict=True)
    ]
    if trainer.args.log_unique_prompts:
        first: dict[str, list[Any]] = {}
        for row in rows:
            first.setdefault(row[1], row)
        rows = list(first.values())
    for backend in backends:
        backend.log({"completions": backend.Table(columns=columns, data=rows)})
