"""The demo's report: sample and summary tables, CSV and JSON files, and the learning-curve plot."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from .progress import Stage

# ---- tables, report, plot --------------------------------------------------------------------------


def _clip(text: str, width: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def collect_sample_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    ppo, rloo = results["ppo"], results["rloo"]
    rows = []
    for b, p, r in zip(ppo["samples_before"], ppo["samples_after"], rloo["samples_after"], strict=True):
        rows.append(
            {
                "prompt": b["prompt"],
                "before": b["completion"],
                "before_true_reward": b["true_reward"],
                "before_rm_score": b["rm_score"],
                "ppo": p["completion"],
                "ppo_true_reward": p["true_reward"],
                "ppo_rm_score": p["rm_score"],
                "rloo": r["completion"],
                "rloo_true_reward": r["true_reward"],
                "rloo_rm_score": r["rm_score"],
            }
        )
    return rows


def print_samples(rows: list[dict[str, Any]], width: int, temperature: float) -> None:
    print(
        f"\nSample completions on held-out prompts (sampled at temperature {temperature:g}; true reward / RM "
        "score):"
    )
    for row in rows:
        print(f"  {_clip(row['prompt'], 100)!r}")
        for key, label in (("before", "before"), ("ppo", "PPO"), ("rloo", "RLOO")):
            score = f"{row[f'{key}_true_reward']:+.2f} / {row[f'{key}_rm_score']:+.2f}"
            print(f"    {label:<7} {score:>13}  {_clip(row[key], width)!r}")


def summary_rows(results: dict[str, dict[str, Any]], stages: dict[str, Stage]) -> list[dict[str, Any]]:
    rows = []
    for kind in ("ppo", "rloo"):
        r, stage = results[kind], stages[kind]
        rows.append(
            {
                "trainer": r["trainer"],
                "updates": r["updates"],
                "episodes": r["episodes"],
                "true_reward_before": r["true_reward_before"],
                "true_reward_after": r["true_reward_after"],
                "true_reward_gain": r["true_reward_after"] - r["true_reward_before"],
                "rm_score_before": r["rm_score_before"],
                "rm_score_after": r["rm_score_after"],
                "final_kl": r["final_kl"],
                "train_seconds": r["train_seconds"],
                "stage_seconds": stage.seconds,
                "peak_rss_mib": stage.peak_rss_mib,
            }
        )
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_learning_curves(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The true reward and the reward model's score side by side: they must rise together (a rising score
    # with a flat true reward is reward hacking).
    fig, (ax_r, ax_rm, ax_kl) = plt.subplots(1, 3, figsize=(17, 4.6))
    colors = {"ppo": "tab:blue", "rloo": "tab:orange"}
    for kind in ("ppo", "rloo"):
        r, color = results[kind], colors[kind]
        x = [h["episode"] for h in r["history"]]
        window = max(1, min(5, len(x) // 4))
        for ax, key in ((ax_r, "true_reward"), (ax_rm, "rm_score"), (ax_kl, "objective/kl")):
            y = [h[key] for h in r["history"]]
            ax.plot(x, y, color=color, alpha=0.25, linewidth=1)
            ax.plot(
                x, _moving_average(y, window), color=color, linewidth=2, label=f"{r['trainer']} (rollouts)"
            )
        for ax, key in ((ax_r, "true_reward"), (ax_rm, "rm_score")):
            ax.plot(
                [0, r["episodes"]],
                [r[f"{key}_before"], r[f"{key}_after"]],
                linestyle="none",
                marker="o",
                markersize=8,
                markerfacecolor="white",
                color=color,
                label=f"{r['trainer']} held-out eval",
            )
    ax_r.set_title("hidden true reward (never seen by the trainers)")
    ax_r.set_ylabel("mean true reward per completion")
    ax_rm.set_title("reward-model score (what the trainers optimise)")
    ax_rm.set_ylabel("mean reward-model score per completion")
    ax_kl.set_title("KL to the reference (the SFT policy)")
    ax_kl.set_ylabel("nats per completion")
    for ax in (ax_r, ax_rm, ax_kl):
        ax.set_xlabel("episodes (completions trained on)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_plotting() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(
            "The demo plots its learning curves with matplotlib, which is not installed; install the demo "
            'extra: pip install "rlhf_trainers[demo]" (or pip install matplotlib).'
        )


def json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
