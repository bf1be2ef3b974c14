"""TRL 1.16's documented scripts on SmolLM2-135M-Instruct, with TRL's trainers and with ours (issue #48).

The scripts are ``tests/trl_scripts/*.py`` (TRL's documentation examples; the test suite runs them on the
offline kit). Each runs twice through ``tests/trl_scripts/run_script.py``: with ``--trl`` in
``benchmarks/.venvs/trl-latest`` (TRL 1.16, with peft and math-verify: ``bash benchmarks/setup_trl.sh``),
whose only change to the script is ``from rlhf_trainers ...`` -> ``from trl ...``; and as written in this
interpreter (the project's environment: it needs the ``peft`` and ``math`` extras). Both sides load the
same model folder (SmolLM2-135M-Instruct saved with the pad token ``<|endoftext|>``, prepared as in
``learning_vs_trl_real.py``) and the same offline datasets (``tests/trl_scripts/_offline.py`` at
``real`` scale: 16 completions per step, 4 per prompt, up to 64 tokens, float32, no gradient
checkpointing on either side). The two sides alternate (TRL first for even scripts, ours first for odd
ones), each run in its own process with the machine's threads.

Recorded per script and side: the wall-clock time of every optimizer step (generation included; the
first step, which warms up, is left out of the median), the per-step ``reward`` (GRPO, RLOO) or
``accuracy`` (reward modeling) from the trainer's own log, and the run's wall time.

    python benchmarks/trl_scripts_real.py --steps 12 --out benchmarks/results

Writes ``<out>/trl_scripts_real.json``, ``.md`` and ``.png`` (the curves side by side; ``--render
FILE.json`` redraws the ``.md`` and ``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = ROOT / "tests" / "trl_scripts"
sys.path.insert(0, str(HERE))

from learning_vs_trl_real import prepare  # noqa: E402
from vs_trl import DEFAULT_WORK, git_state, machine_name  # noqa: E402

NAME = "trl_scripts_real"
ALL = sorted(p.stem for p in SCRIPTS.glob("*.py") if not p.name.startswith(("_", "run_")))


def tool_model(policy: str, work: Path) -> str:
    """A copy of the `policy` folder whose tokenizer has our tool chat template (SmolLM2's renders no
    tools), for the scripts with tools or environments (``_offline.TOOL_MODEL``); both sides load it."""
    import shutil

    from transformers import AutoTokenizer

    from rlhf_trainers.agents import install_tool_chat_template

    folder = work / "policy-tools"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(policy, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    install_tool_chat_template(tokenizer)
    tokenizer.save_pretrained(folder)
    return str(folder)


def curve_key(script: str) -> str:
    """The logged figure whose curve is compared: reward modeling's accuracy, else the mean reward."""
    return "accuracy" if script.startswith("reward") else "reward"


def run_one(script: str, lib: str, python: str, env: dict[str, str], work: Path) -> dict[str, Any]:
    """One run of `script` by `lib` ("trl" or "ours"); its record (see run_script.py) plus the curve."""
    log = work / f"{script}-{lib}.json"
    log.unlink(missing_ok=True)
    cmd = [python, str(SCRIPTS / "run_script.py"), f"{script}.py", "--log", str(log)]
    if lib == "trl":
        cmd.append("--trl")
    began = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - began
    if proc.returncode:
        tail = (proc.stdout[-2000:] + proc.stderr[-4000:]).strip()
        return {"script": script, "lib": lib, "error": tail, "process_s": elapsed}
    record = json.loads(log.read_text())
    key = curve_key(script)
    logs = [e for e in record["log_history"] if "loss" in e and "train_runtime" not in e]
    tracked = sorted({k for e in logs for k in e if k == "tools/call_frequency" or _is_reward_mean(k)})
    record.update(
        lib=lib,
        process_s=elapsed,
        curve_key=key,
        curve=[e.get(key) for e in logs],
        curves={k: [e.get(k) for e in logs] for k in tracked},  # each reward function's, and tool calls
        median_step_s=statistics.median(record["step_s"][1:]) if len(record["step_s"]) > 1 else None,
    )
    del record["log_history"][:-1]  # the per-step figures are in `curve`; keep the final entry
    return record


def _is_reward_mean(key: str) -> bool:
    return key.startswith("rewards/") and key.endswith("/mean")


def mean_of(values: list[Any], part: slice) -> float | None:
    kept = [v for v in values[part] if isinstance(v, (int, float)) and v == v]
    return sum(kept) / len(kept) if kept else None


def _curve(run: dict[str, Any]) -> str:
    """The curve's first 3 steps' mean -> last 3 steps' mean."""
    first, last = mean_of(run["curve"], slice(0, 3)), mean_of(run["curve"], slice(-3, None))
    return "n/a" if first is None or last is None else f"{first:.3f} -> {last:.3f}"


def render(result: dict[str, Any]) -> str:
    """The Markdown table of `result`: time per step and the reward curve's start and end, side by side."""
    lines = [
        f"TRL's documented scripts on SmolLM2-135M-Instruct, {result['steps']} optimizer steps each "
        f"({result['machine']}, {result['date']}, idle machine: {result['idle']}). Time per step: median "
        "wall-clock seconds of steps 2..N (generation included). Curve: the logged `reward` (reward "
        "modeling: `accuracy`), mean of the first 3 steps -> mean of the last 3.",
        "",
        "| script | TRL 1.16 s/step | ours s/step | TRL / ours | TRL curve | ours curve |",
        "|---|---|---|---|---|---|",
    ]
    for script in result["scripts"]:
        runs = result["runs"][script]
        trl, ours = runs.get("trl", {}), runs.get("ours", {})
        if not trl or not ours:  # one side only (--libs)
            only, run = ("ours", ours) if ours else ("TRL 1.16", trl)
            figures = "error" if "error" in run else f"{run['median_step_s']:.2f} s/step, {_curve(run)}"
            lines.append(f"| `{script}` | {only} only: {figures} | | | | |")
            continue
        if "error" in trl or "error" in ours:
            lines.append(
                f"| `{script}` | {'error' if 'error' in trl else ''} | {'error' if 'error' in ours else ''} | | | |"
            )
            continue
        ratio = trl["median_step_s"] / ours["median_step_s"]
        lines.append(
            f"| `{script}` | {trl['median_step_s']:.2f} | {ours['median_step_s']:.2f} | {ratio:.2f}x | "
            f"{_curve(trl)} | {_curve(ours)} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """One panel per script: the logged reward (or accuracy) per optimizer step, TRL's and ours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scripts = result["scripts"]
    cols = 5 if len(scripts) > 4 else len(scripts)
    rows = -(-len(scripts) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, script in zip(axes.flat, scripts, strict=False):
        for lib, style in (
            ("trl", dict(color="tab:orange", label="TRL 1.16")),
            ("ours", dict(color="tab:blue", label="ours")),
        ):
            run = result["runs"][script].get(lib, {})
            curve = run.get("curve") or []
            ax.plot(
                range(1, len(curve) + 1),
                [float("nan") if v is None else v for v in curve],
                marker=".",
                **style,
            )
        ax.set_title(script, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.set_ylabel(curve_key(script), fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(scripts) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        f"TRL's documented scripts on SmolLM2-135M-Instruct ({result['machine']}, {result['date']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", default=",".join(ALL), help=f"comma-separated, of: {', '.join(ALL)}")
    parser.add_argument("--steps", type=int, default=12, help="max_steps of every script")
    parser.add_argument("--work", default=str(DEFAULT_WORK), help="folder for the model copy and logs")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--trl-python", default=str(HERE / ".venvs" / "trl-latest" / "bin" / "python"))
    parser.add_argument("--ours-python", default=sys.executable)
    parser.add_argument("--idle", default="unknown", help="say whether the machine was otherwise idle")
    parser.add_argument("--render", help="rewrite the .md of this result JSON and stop")
    parser.add_argument("--libs", default="trl,ours", help="the sides to run: trl, ours or both")
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    args = parser.parse_args()
    out = Path(args.out)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(render(result))
        plot(result, Path(args.render).with_suffix(".png"))
        return
    scripts = [s.strip() for s in args.scripts.split(",") if s.strip()]
    libs = [lib.strip() for lib in args.libs.split(",") if lib.strip()]
    if not libs or set(libs) - {"trl", "ours"}:
        raise SystemExit(f"--libs {args.libs!r}: expected trl, ours or trl,ours")
    unknown = sorted(set(scripts) - set(ALL))
    if unknown:
        raise SystemExit(f"unknown scripts {unknown}; known: {', '.join(ALL)}")
    work = Path(args.work) / NAME
    work.mkdir(parents=True, exist_ok=True)
    policy = prepare(Path(args.work), "addition", 8, 8)["policy"]
    env = {**os.environ, "TRL_SCRIPTS_MODEL": policy, "TRL_SCRIPTS_SCALE": "real"}
    env["TRL_SCRIPTS_TOOL_MODEL"] = tool_model(policy, work)
    env.update(TRL_SCRIPTS_STEPS=str(args.steps), TRL_SCRIPTS_OUTPUT=str(work / "out"))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    pythons = {"trl": args.trl_python, "ours": args.ours_python}
    result: dict[str, Any] = {
        "machine": machine_name(),
        "date": time.strftime("%Y-%m-%d"),
        "idle": args.idle,
        "steps": args.steps,
        "scripts": scripts,
        "git": git_state(),
        "runs": {},
    }
    out.mkdir(parents=True, exist_ok=True)
    for i, script in enumerate(scripts):
        order = [lib for lib in (("trl", "ours") if i % 2 == 0 else ("ours", "trl")) if lib in libs]
        result["runs"][script] = {}
        for lib in order:
            run = run_one(script, lib, pythons[lib], env, work)
            result["runs"][script][lib] = run
            status = run.get("error", "")[-300:] or f"{run['median_step_s']:.2f} s/step, curve {run['curve']}"
            print(f"{script} [{lib}]: {status}", flush=True)
        (out / f"{NAME}{args.tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"{NAME}{args.tag}.md").write_text(render(result))
    plot(result, out / f"{NAME}{args.tag}.png")
    print(render(result))


if __name__ == "__main__":
    main()
