"""RLVR learning curves on the real model: SmolLM2-135M-Instruct, PPO, RLOO and GRPO with LoRA, several seeds,
held-out strict success of an :mod:`rlhf_trainers.rewards.rlvr` task against episodes.

Each run is ``examples/rlvr.py`` in its own process on one torch thread (``OMP_NUM_THREADS=1``), one at a
time, with the settings below passed as flags (the same for all trainers: 32 completions per update,
RLOO and GRPO as 8 prompts x 4, GRPO with its KL as the loss term ``beta``); the example measures the
success rate on ``--num-eval-prompts`` held-out test prompts (one sample each, temperature 0.7) before
training and every ``--eval-every`` updates. The results are written after every run, so an interrupted
driver keeps what it finished.

    python benchmarks/rlvr_learning.py --trainers rloo,ppo   # 3 seeds x {ppo, rloo}, word_count
    python benchmarks/rlvr_learning.py --trainers grpo --keep-other-trainers   # add GRPO to that file
    python benchmarks/rlvr_learning.py --render benchmarks/results/rlvr_learning.json   # redraw the PNG

Writes ``<out>/rlvr_learning.json``, ``rlvr_learning.md`` (the table) and ``rlvr_learning.png`` (mean over seeds, thick, and each seed,
thin), and copies the PNG to ``docs/img/rlvr_learning.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRAINERS = ("rloo", "ppo", "grpo")
COLORS = {"ppo": "tab:blue", "rloo": "tab:orange", "grpo": "tab:green"}


def run_one(args: argparse.Namespace, trainer: str, seed: int, work: Path) -> dict[str, Any]:
    """One ``examples/rlvr.py`` run; its curve JSON."""
    curve_file = work / f"{trainer}-{seed}.json"
    command = [
        sys.executable,
        str(ROOT / "examples" / "rlvr.py"),
        "--trainer", trainer,
        "--task", args.task,
        "--seed", str(seed),
        "--output_dir", str(work / f"{trainer}-{seed}"),
        "--curve_file", str(curve_file),
        "--max_steps", str(args.updates),
        "--eval_steps", str(args.eval_every),
        "--num_eval_prompts", str(args.num_eval_prompts),
        "--learning_rate", str(args.learning_rate),
        "--per_device_train_batch_size", "32",
        "--disable_tqdm", "true",
    ]  # fmt: skip
    if trainer == "grpo":  # TRL's names: the KL as its loss term, one optimizer step per generation
        command += ["--beta", str(args.kl_coef), "--num_iterations", "1"]
    else:
        command += ["--kl_coef", str(args.kl_coef), "--num_mini_batches", "1", "--num_ppo_epochs", "1"]
    command += list(args.extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{trainer} seed {seed} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(curve_file.read_text())
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per trainer: the gain (last minus first evaluation) of each seed, their mean, and the mean curve."""
    summary: dict[str, Any] = {}
    for trainer in TRAINERS:
        mine = [r for r in runs if r["trainer"] == trainer]
        if not mine:
            continue
        gains = [r["after"] - r["before"] for r in mine]
        length = min(len(r["curve"]) for r in mine)
        summary[trainer] = {
            "seeds": [r["seed"] for r in mine],
            "before": [r["before"] for r in mine],
            "after": [r["after"] for r in mine],
            "gain": gains,
            "mean_before": statistics.fmean(r["before"] for r in mine),
            "mean_after": statistics.fmean(r["after"] for r in mine),
            "mean_gain": statistics.fmean(gains),
            "seconds_per_run": [r["wall_seconds"] for r in mine],
            "mean_curve": [
                {
                    "episode": mine[0]["curve"][i]["episode"],
                    "success": statistics.fmean(r["curve"][i]["success"] for r in mine),
                }
                for i in range(length)
            ],
        }
    return summary


def plot(result: dict[str, Any], png: Path) -> None:
    """Held-out success against episodes: each seed thin, the mean over seeds thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for trainer, info in result["summary"].items():
        color = COLORS[trainer]
        for run in (r for r in result["runs"] if r["trainer"] == trainer):
            xs = [p["episode"] for p in run["curve"]]
            ax.plot(xs, [p["success"] for p in run["curve"]], color=color, alpha=0.35, linewidth=1)
        xs = [p["episode"] for p in info["mean_curve"]]
        label = f"{trainer.upper()} (mean of {len(info['seeds'])} seeds, gain {info['mean_gain']:+.2f})"
        ax.plot(
            xs,
            [p["success"] for p in info["mean_curve"]],
            color=color,
            linewidth=2.5,
            marker="o",
            label=label,
        )
    settings = result["settings"]
    ax.set_xlabel("episodes (completions trained on)")
    ax.set_ylabel(f"held-out success ({settings['num_eval_prompts']} test prompts)")
    ax.set_title(f"RLVR on SmolLM2-135M-Instruct, task {settings['task']} (LoRA, 1 CPU thread)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def table(result: dict[str, Any]) -> str:
    """A markdown table: per trainer, held-out success before -> after for each seed, the mean gain, and
    the minutes per run."""
    lines = [
        "| trainer | seed | held-out success before | after | gain | minutes |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for trainer, info in result["summary"].items():
        for seed, before, after, seconds in zip(
            info["seeds"], info["before"], info["after"], info["seconds_per_run"], strict=True
        ):
            lines.append(
                f"| {trainer.upper()} | {seed} | {before:.3f} | {after:.3f} | {after - before:+.3f} | {seconds / 60:.1f} |"
            )
        lines.append(
            f"| **{trainer.upper()} mean** | | {info['mean_before']:.3f} | {info['mean_after']:.3f} | "
            f"**{info['mean_gain']:+.3f}** | {statistics.fmean(info['seconds_per_run']) / 60:.1f} |"
        )
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out: Path, docs_png: Path | None, stem: str = "rlvr_learning") -> None:
    """``<out>/<stem>.json``, ``.md`` and ``.png`` (and the PNG copied to ``docs_png``)."""
    result["summary"] = summarize(result["runs"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table(result))
    plot(result, out / f"{stem}.png")
    if docs_png is not None:
        shutil.copyfile(out / f"{stem}.png", docs_png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="word_count")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--num-eval-prompts", type=int, default=48)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--kl-coef", type=float, default=0.03)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--docs-png", type=Path, default=ROOT / "docs" / "img" / "rlvr_learning.png")
    parser.add_argument(
        "--render",
        type=Path,
        help="Redraw the table and PNG of this JSON (beside it, under its name) and exit.",
    )
    parser.add_argument(
        "--keep-other-trainers",
        action="store_true",
        help="Keep the runs of the trainers not run now from the existing result file (its other settings must "
        "be the same), e.g. to add GRPO to an RLOO/PPO result.",
    )
    parser.add_argument("extra", nargs="*", help="More flags for examples/rlvr.py (after --).")
    args = parser.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
        # the file's own name: rendering rlvr_learning_bf16_rloo.json rewrites that file, not rlvr_learning.*
        write(result, args.render.parent, args.docs_png, stem=args.render.stem)
        return

    skip = ("out", "docs_png", "render", "keep_other_trainers")
    settings = {k: v for k, v in vars(args).items() if k not in skip}
    result: dict[str, Any] = {
        "settings": settings,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": 1},
        "runs": [],
    }
    trainers = [t for t in args.trainers.split(",") if t]
    existing = args.out / "rlvr_learning.json"
    if args.keep_other_trainers and existing.is_file():
        old = json.loads(existing.read_text())
        same = {k: v for k, v in old["settings"].items() if k != "trainers"}
        if same != {k: v for k, v in settings.items() if k != "trainers"}:
            parser.error(f"--keep-other-trainers: {existing} was run with other settings: {old['settings']}")
        result["runs"] = [r for r in old["runs"] if r["trainer"] not in trainers]
        kept = [t for t in old["settings"]["trainers"].split(",") if t not in trainers]
        settings["trainers"] = ",".join(kept + trainers)
    with tempfile.TemporaryDirectory(prefix="rlvr-learning-") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            for trainer in trainers:
                run = run_one(args, trainer, seed, Path(tmp))
                result["runs"].append(run)
                print(
                    f"{trainer} seed {seed}: success {run['before']:.3f} -> {run['after']:.3f} "
                    f"in {run['wall_seconds']:.0f} s",
                    flush=True,
                )
                write(result, args.out, args.docs_png)


if __name__ == "__main__":
    main()
