"""The tables and plots of docs/benchmarks.md, made from the committed results in benchmarks/results/.

Each generated table of docs/benchmarks.md sits between ``<!-- bench:NAME:start -->`` and
``<!-- bench:NAME:end -->``; this script rewrites them from the JSON (or, for the TRL comparisons, the
head of the markdown report that benchmark writes beside its JSON, for the files listed in ``CITED``), and
draws docs/img/*.png with matplotlib (Agg).
A benchmark whose result file is not there yet gets a line saying so instead of a table.

    python benchmarks/plot_results.py              # rewrite the tables and draw the plots
    python benchmarks/plot_results.py --check      # exit 1 when a table is not current (nothing written)
    python benchmarks/plot_results.py --no-plots   # tables only (no matplotlib needed)

To add a benchmark to the page: write a ``table_<name>(results) -> str`` (and, if useful, a
``plot_<name>(results, path)``), register it in ``TABLES`` / ``PLOTS``, and put the two markers in the page.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _missing(pattern: str) -> str:
    return f"No result committed yet (`benchmarks/results/{pattern}`)."


def _f(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _g(value: float | None) -> str:
    """Small deviations: 0 stays 0, others in 2 significant digits."""
    if value is None:
        return "n/a"
    return "0" if value == 0 else f"{value:.2g}"


# ---- tables ---------------------------------------------------------------------------------------------


def table_logprobs_memory() -> str:
    rows = ["| logits dtype | variant | extra peak MiB | median s |", "|---|---|---:|---:|"]
    found = []
    for dtype in ("fp32", "bf16"):
        data = _load(f"logprobs_memory_cpu_{dtype}.json")
        if data is None:
            continue
        found.append(data)
        for r in data["results"]:
            label = f"{data['dtype']} ({data['logits_mib']:.0f} MiB of logits)"
            rows.append(f"| {label} | `{r['variant']}` | {r['extra_peak_mib']:.0f} | {r['median_s']:.2f} |")
    if not found:
        return _missing("logprobs_memory_cpu_*.json")
    d = found[0]
    head = (
        f"{d['device']}, torch {d['torch']}, logits {tuple(d['shape'])}, log-softmax in "
        f"{d['compute_dtype']}; peak RSS above the baseline, each variant in its own process."
    )
    return head + "\n\n" + "\n".join(rows)


def table_ppo_run() -> str:
    runs = [
        ("fp32", "fp32", "ppo_run_h100_fp32.json"),
        ("bf16 autocast", "fp32 (`logprobs_in_fp32=True`, default)", "ppo_run_h100_bf16.json"),
        ("bf16 autocast", "bf16 (`logprobs_in_fp32=False`)", "ppo_run_h100_bf16_bf16logprobs.json"),
    ]
    rows = [
        "| precision | log-softmax | true reward before -> after | s/update (median) | episodes/s | "
        "max ratio deviation at update start | KL at the end | CUDA max allocated MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    head = None
    for precision, logsoftmax, name in runs:
        d = _load(name)
        if d is None:
            continue
        head = head or (
            f"{d['gpu']}, torch {d['torch']}; {d['updates']} updates of {d['completions_per_update']} completions."
        )
        rows.append(
            f"| {precision} | {logsoftmax} | {d['true_reward_before']:.3f} -> {d['true_reward_after']:.3f} | "
            f"{d['seconds_per_update_median']:.2f} | {d['episodes_per_sec']:.0f} | {_g(d['ratio_at_start_max'])} | "
            f"{d['final_kl']:.2f} | {d['cuda_max_allocated_mib']:.0f} |"
        )
    if head is None:
        return _missing("ppo_run_*.json")
    return head + "\n\n" + "\n".join(rows)


def table_rloo_bf16_ratio() -> str:
    d = _load("rloo_bf16_ratio_h100.json")
    if d is None:
        return _missing("rloo_bf16_ratio_*.json")
    rows = [
        "| precision | log-softmax | response tokens | true reward before -> after | token ratio deviation "
        "at start (mean / max) | sequences clipped at start (mean / max) | generation-vs-training sequence "
        "ratio, max | `policy/clipfrac_avg` (mean) |",
        "|---|---|---:|---|---|---|---:|---:|",
    ]
    for run in d["runs"].values():
        mean, top = run["mean_over_updates"], run["max_over_updates"]
        rows.append(
            f"| {'bf16 autocast' if run['bf16'] else 'fp32'} | {'fp32' if run['logprobs_in_fp32'] else 'bf16'} | "
            f"{run['response_length']} | {run['true_reward_before']:.3f} -> {run['true_reward_after']:.3f} | "
            f"{_g(mean['policy/ratio_at_start'])} / {_g(top['policy/ratio_at_start'])} | "
            f"{100 * mean['policy/seq_ratio_at_start_clipfrac']:.1f} % / "
            f"{100 * top['policy/seq_ratio_at_start_clipfrac']:.0f} % | "
            f"{top['policy/gen_ratio_max']:.4f} | {mean['policy/clipfrac_avg']:.2f} |"
        )
    head = (
        f"{d['gpu']}, torch {d['torch']}; RLOO with `rloo_k={d['rloo_k']}`, {d['completions_per_update']} "
        f"completions per update, {d['updates']} updates, `truncated_is_cap={d['truncated_is_cap']}`; "
        "mean and max over the updates."
    )
    return head + "\n\n" + "\n".join(rows)


def _memory_rows(d: dict[str, Any]) -> list[str]:
    cuda = d["device"] == "cuda"
    rows = (
        [
            "| size | trainer | CUDA before `train()` MiB | CUDA max allocated MiB | CUDA train extra MiB | "
            "optimizer states MiB | s/update (median) |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        if cuda
        else [
            "| size | trainer | peak RSS MiB | RSS before `train()` MiB | train extra MiB | optimizer states MiB | "
            "s/update (median) |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
    )
    for r in d["results"]:
        first = [r["cuda_before_train_mib"], r["cuda_max_allocated_mib"], r["cuda_train_extra_mib"]]
        if not cuda:
            first = [r["peak_rss_mib"], r["rss_before_train_mib"], r["train_extra_mib"]]
        cells = " | ".join(f"{v:.0f}" for v in [*first, r["optimizer_state_mib"]])
        rows.append(
            f"| {r['size']} | {r['trainer'].upper()} | {cells} | {r['seconds_per_update_median']:.2f} |"
        )
    return rows


def _memory_ratio(d: dict[str, Any], size: str) -> float | None:
    key = "cuda_max_allocated_mib" if d["device"] == "cuda" else "peak_rss_mib"
    by = {r["trainer"]: r[key] for r in d["results"] if r["size"] == size}
    return by["rloo"] / by["ppo"] if {"ppo", "rloo"} <= set(by) else None


def table_onpolicy_memory() -> str:
    parts = []
    for tag, what in (("cpu", "peak RSS"), ("h100", "CUDA max allocated")):
        d = _load(f"onpolicy_memory_{tag}.json")
        if d is None:
            continue
        sizes = list(dict.fromkeys(r["size"] for r in d["results"]))
        ratios = ", ".join(f"{s} {_f(_memory_ratio(d, s))}" for s in sizes)
        where = d.get("gpu") or d.get("machine") or d["device"]
        parts.append(
            f"**{where}**, torch {d['torch']}. RLOO / PPO {what}: {ratios}.\n\n" + "\n".join(_memory_rows(d))
        )
    return "\n\n".join(parts) if parts else _missing("onpolicy_memory_*.json")


def _summary(text: str) -> str:
    """The head of a benchmark's markdown report: its first paragraph (machine, versions, settings), its
    first table, the bullet list right after that table (learning reports: gains, ours - TRL) and the
    ratio table (``| pair | ratio | value |``). The rest (per-phase seconds, memory, the settings that
    differ between the sides) stays in the file."""
    blocks = [b.strip() for b in re.split(r"\n\s*\n", text.strip()) if b.strip()]
    keep = blocks[:2]
    if len(blocks) > 2 and blocks[2].startswith("- "):
        keep.append(blocks[2])
    keep += [b for b in blocks[2:] if b.startswith("| pair |")]
    return "\n\n".join(keep)


def _include(names: tuple[tuple[str, str], ...], plots: bool = False) -> str:
    """The heads of the markdown reports a benchmark wrote beside its JSON, for the files this page cites
    (:func:`_summary`), each with its PNG when ``plots`` and one was committed."""
    parts = []
    for name, date in names:
        path = RESULTS / name
        if not path.is_file():
            parts.append(_missing(name))
            continue
        text = f"From `benchmarks/results/{name}` ({date}; the whole report is in the file):\n\n"
        text += _summary(path.read_text(encoding="utf-8"))
        png = path.with_suffix(".png")
        if plots and png.is_file():
            text += f"\n\n![{png.stem}](img/{png.name})"
        parts.append(text)
    return "\n\n".join(parts)


#: The result files each generated table of docs/benchmarks.md shows, in order, with the date of the run
#: (the reports name the machine, not the day): the current figures. Earlier runs are in git history.
CITED: dict[str, tuple[tuple[str, str], ...]] = {
    "vs_trl": (
        ("vs_trl_cpu_2threads_s6.md", "2026-11-25"),
        ("issue20/vs_trl_cpu_2threads_tiny_s7_after.md", "2026-11-25"),
    ),
    "vs_trl_varlen": (
        ("vs_trl_varlen_135m_s24_parts.md", "2026-11-29"),
        ("vs_trl_varlen_135m.md", "2026-11-26"),
    ),
    "vs_trl_grpo": (
        ("vs_trl_grpo_cpu_1thread.md", "2026-11-26"),
        ("vs_trl_grpo_varlen_135m.md", "2026-11-26"),
        ("vs_trl_grpo_varlen_135m_s20_amd.md", "2026-11-28"),
    ),
    "vs_trl_vllm": (
        ("vs_trl_vllm_varlen_135m_rloo_s19.md", "2026-11-27"),
        ("vs_trl_vllm_varlen_135m_rloo_bf16engine_s19.md", "2026-11-27"),
    ),
    "learning_vs_trl": (("learning_vs_trl.md", "2026-11-25"), ("learning_vs_trl_seeds345.md", "2026-11-25")),
    "learning_vs_trl_grpo": (("learning_vs_trl_grpo.md", "2026-11-26"),),
    "learning_vs_trl_real": (("learning_vs_trl_real.md", "2026-11-25"),),
}


def table_vs_trl() -> str:
    """PPO and RLOO against TRL on fixed-length jobs (``vs_trl.py``, issue #7)."""
    return _include(CITED["vs_trl"])


def table_vs_trl_vllm() -> str:
    """RLOO against the newest TRL's with both on colocated vLLM (``vs_trl.py --vllm``, issue #22)."""
    return _include(CITED["vs_trl_vllm"])


def table_vs_trl_grpo() -> str:
    return _include(CITED["vs_trl_grpo"])


def table_vs_trl_varlen() -> str:
    """The variable-length job against TRL (``vs_trl.py --stop-at-eos``, issue #24)."""
    return _include(CITED["vs_trl_varlen"])


def table_learning_vs_trl() -> str:
    return _include(CITED["learning_vs_trl"], plots=True)


def table_learning_vs_trl_grpo() -> str:
    return _include(CITED["learning_vs_trl_grpo"], plots=True)


def table_learning_vs_trl_real() -> str:
    return _include(CITED["learning_vs_trl_real"], plots=True)


#: How the long-run tables and plot name each trainer.
TRAINER_NAMES = {"ppo": "PPO", "rloo": "RLOO", "grpo": "GRPO", "reward": "Reward"}


def _trainer_name(name: str) -> str:
    return TRAINER_NAMES.get(name, name)


def _long_runs() -> list[tuple[str, dict[str, Any]]]:
    """(file name, result) of every long_run_memory_*.json (one per trainer and tag)."""
    return [
        (f.name, json.loads(f.read_text(encoding="utf-8")))
        for f in sorted(RESULTS.glob("long_run_memory_*.json"))
    ]


def table_long_run_memory() -> str:
    runs = _long_runs()
    if not runs:
        return _missing("long_run_memory_*.json")
    rows = [
        "| result file | trainer | CPUs | updates | checkpoint every | peak RSS, first half MiB | "
        "peak RSS, second half MiB | ratio | s/update (median) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, d in runs:
        rows.append(
            f"| `{name}` | {_trainer_name(d['trainer'])}{' (vLLM)' if d.get('vllm') else ''} | "
            f"{d.get('machine', {}).get('cpus', 'n/a')} | {d['updates']} | "
            f"{d['save_steps']} | {d['first_half_peak_mib']:.1f} | {d['second_half_peak_mib']:.1f} | "
            f"{d['ratio']:.4f} | {d['median_seconds_per_update']:.3f} |"
        )
    return "\n".join(rows) + "\n\n![Resident memory over a long run](img/long_run_memory.png)"


TABLES: dict[str, Callable[[], str]] = {
    "logprobs_memory": table_logprobs_memory,
    "ppo_run": table_ppo_run,
    "rloo_bf16_ratio": table_rloo_bf16_ratio,
    "onpolicy_memory": table_onpolicy_memory,
    "vs_trl": table_vs_trl,
    "learning_vs_trl": table_learning_vs_trl,
    "vs_trl_grpo": table_vs_trl_grpo,
    "vs_trl_varlen": table_vs_trl_varlen,
    "vs_trl_vllm": table_vs_trl_vllm,
    "learning_vs_trl_grpo": table_learning_vs_trl_grpo,
    "learning_vs_trl_real": table_learning_vs_trl_real,
    "long_run_memory": table_long_run_memory,
}


# ---- plots ----------------------------------------------------------------------------------------------


def _grouped_bars(
    ax: Any, ticks: list[str], series: list[tuple[str, list[float]]], label_bars: bool = True
) -> None:
    """One bar per series at every tick, side by side, with a legend."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        bars = ax.bar([x + offset for x in range(len(ticks))], values, width, label=label)
        if label_bars:
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(ticks)), ticks, fontsize=8)
    ax.legend(fontsize=8)


def _save(plt: Any, fig: Any, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_onpolicy_memory(plt: Any, path: Path) -> bool:
    panels = []
    for tag, label, key in (
        ("cpu", "2 CPU cores: peak RSS (MiB)", "peak_rss_mib"),
        ("h100", "H100: CUDA max allocated (MiB)", "cuda_max_allocated_mib"),
    ):
        d = _load(f"onpolicy_memory_{tag}.json")
        if d is not None:
            panels.append((label, key, d))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (label, key, d) in zip(axes[0], panels, strict=True):
        sizes = list(dict.fromkeys(r["size"] for r in d["results"]))
        value = {(r["size"], r["trainer"]): r[key] for r in d["results"]}
        _grouped_bars(ax, sizes, [(t.upper(), [value[s, t] for s in sizes]) for t in ("ppo", "rloo")])
        ax.set_title(label, fontsize=10)
        ax.set_yscale("log")
    fig.suptitle("PPO vs RLOO peak memory, same settings (8 completions x 32 tokens, fp32)", fontsize=10)
    return _save(plt, fig, path)


def plot_logprobs_memory(plt: Any, path: Path) -> bool:
    data = [d for d in (_load(f"logprobs_memory_cpu_{t}.json") for t in ("fp32", "bf16")) if d is not None]
    if not data:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.4))
    variants = [r["variant"] for r in data[0]["results"]]
    _grouped_bars(
        ax, variants, [(f"{d['dtype']} logits", [r["extra_peak_mib"] for r in d["results"]]) for d in data]
    )
    ax.set_ylabel("extra peak MiB")
    shape = tuple(data[0]["shape"])
    ax.set_title(f"Per-token log-probs of logits {shape}, forward + backward (CPU)", fontsize=10)
    return _save(plt, fig, path)


def plot_rloo_bf16_ratio(plt: Any, path: Path) -> bool:
    d = _load("rloo_bf16_ratio_h100.json")
    if d is None:
        return False
    runs = list(d["runs"].values())
    labels = [
        f"{'bf16 autocast' if r['bf16'] else 'fp32'}\nlog-softmax {'fp32' if r['logprobs_in_fp32'] else 'bf16'}\n"
        f"{r['response_length']} tokens"
        for r in runs
    ]
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.4))
    panels = (
        ("policy/ratio_at_start", "token ratio deviation at update start", 1),
        ("policy/seq_ratio_at_start_clipfrac", "% of sequences clipped at update start", 100),
    )
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        series = [
            (stat.split("_")[0], [scale * r[stat][key] for r in runs])
            for stat in ("mean_over_updates", "max_over_updates")
        ]
        _grouped_bars(ax, labels, series, label_bars=False)
        ax.set_title(title, fontsize=10)
    fig.suptitle("RLOO on an H100: rounding alone moves the ratio at the start of an update", fontsize=10)
    return _save(plt, fig, path)


def plot_long_run_memory(plt: Any, path: Path) -> bool:
    runs = _long_runs()
    if not runs:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for name, d in runs:
        ax.plot(
            range(1, len(d["rss_mib"]) + 1), d["rss_mib"], label=f"{_trainer_name(d['trainer'])} ({name})"
        )
    ax.set_xlabel("update")
    ax.set_ylabel("RSS MiB")
    ax.set_title("Resident memory over a long run (offline kit)", fontsize=10)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


PLOTS: dict[str, Callable[[Any, Path], bool]] = {
    "onpolicy_memory.png": plot_onpolicy_memory,
    "logprobs_memory.png": plot_logprobs_memory,
    "rloo_bf16_ratio.png": plot_rloo_bf16_ratio,
    "long_run_memory.png": plot_long_run_memory,
}


# ---- the page -------------------------------------------------------------------------------------------


def render(page: str) -> str:
    """The page with every generated table rewritten."""
    for name, make in TABLES.items():
        start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        if not pattern.search(page):
            raise SystemExit(
                f"{PAGE}: the markers {start} ... {end} are missing; put them where the table goes."
            )
        block = f"{start}\n{make()}\n{end}"
        page = pattern.sub(lambda _m, block=block: block, page)
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a table is not current; write nothing"
    )
    parser.add_argument("--no-plots", action="store_true", help="rewrite the tables only")
    args = parser.parse_args(argv)
    old = PAGE.read_text(encoding="utf-8")
    new = render(old)
    if args.check:
        if new != old:
            print(f"{PAGE} is not current: run python benchmarks/plot_results.py", file=sys.stderr)
            return 1
        print(f"{PAGE}: tables current")
        return 0
    if new != old:
        PAGE.write_text(new, encoding="utf-8")
        print(f"rewrote the tables of {PAGE}")
    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        IMG.mkdir(parents=True, exist_ok=True)
        for name, draw in PLOTS.items():
            if draw(plt, IMG / name):
                print(f"wrote {IMG / name}")
        for name, _date in (x for key in CITED if key.startswith("learning") for x in CITED[key]):
            png = (RESULTS / name).with_suffix(".png")
            if png.is_file():  # the learning curves the page shows
                shutil.copyfile(png, IMG / png.name)
                print(f"copied {png.name} to {IMG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
