"""Learning to use a tool, ours vs TRL (issue #50): ``examples/agent.py``'s task (SmolLM2-135M-Instruct
with LoRA learns to call ``multiply`` for "What is 347 * 86?") trained by our GRPOTrainer and by TRL
1.16's ``trl.GRPOTrainer``, both with ``tools=[multiply]``, the same job and settings, several seeds.

Every run is its own process: ours is ``examples/agent.py`` in this interpreter; TRL's is this file's
``--trl-worker`` mode in TRL's environment (``benchmarks/.venvs/trl-latest``, ``bash
benchmarks/setup_trl.sh``), which loads ``examples/agent.py`` by path for the task (the tool, the
questions, the two 0/1 reward columns: it imports nothing of ``rlhf_trainers``). Both sides load one
prepared folder (``<work>/policy``): SmolLM2-135M-Instruct with the pad token ``<|endoftext|>`` and our
tool-capable chat template installed (``install_tool_chat_template`` with the example's system prompt
and instruction), saved with its ``response_template``. TRL reads the template as it is: it supports
tool calling (TRL's ``supports_tool_calling``), it is prefix-preserving (so TRL keeps it for training),
and the tokenizer has a ``response_template`` (so TRL does not call ``add_response_schema``, which only
knows other models' templates) from which ``parse_response`` reads the ``<tool_call>`` blocks.

The same settings on both sides (:data:`SETTINGS`, the example's defaults): LoRA r 16 / alpha 32 on
every linear layer, learning rate 1e-3, temperature 0.7, 16 episodes per update (2 prompts x 8
generations, micro-batches of 8), at most 96 completion tokens per episode (tool turns included), at most
one tool turn, beta 0, TRL's loss defaults on both sides, no gradient checkpointing (TRL's default turns it
on), reward = success (+ ``--tool-reward`` x tool use, 0 by default). Ours also runs PPO (``ours-ppo``) and RLOO
(``ours-rloo``) on the task with the example's defaults for them (PPO: 16 questions, one episode each,
micro-batches of 4, learning rate 5e-4); TRL 1.16 has no PPO or RLOO with tools.

The measure: per update, on that update's own episodes (new prompts every update), the share of
episodes whose final answer is the product (``success``) and that called the tool without an error
(``tool_use``), TRL's ``tools/call_frequency`` and ``tools/failure_frequency``, and the seconds since
training began; per run, episodes/s over the whole run, and the CPUs it was allowed (``taskset``).

    python benchmarks/agent_vs_trl.py --seeds 0 --updates 12 --out benchmarks/results
    # two drivers side by side, one core each, writing the same JSON (it is locked per write):
    taskset -c 0 python benchmarks/agent_vs_trl.py --seeds 0,1,2 --impls ours,ours-ppo &
    taskset -c 1 python benchmarks/agent_vs_trl.py --seeds 0,1,2 --impls trl
    python benchmarks/agent_vs_trl.py --render --plot docs/img/agent_vs_trl.png

Writes ``<out>/agent_vs_trl<tag>.json`` (merging runs already in it: a seed and side already there is
skipped unless ``--force``), and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "agent.py"
TRL_PYTHON = HERE / ".venvs" / "trl-latest" / "bin" / "python"
DEFAULT_WORK = Path.home() / ".cache" / "rlhf_trainers" / "agent_vs_trl"

#: The job, in GRPOConfig's names (TRL's and ours); the example's defaults.
SETTINGS: dict[str, Any] = {
    "learning_rate": 1e-3,
    "temperature": 0.7,
    "beta": 0.0,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "num_generations": 8,
    "max_completion_length": 96,
    "max_tool_calling_iterations": 1,
    "lora_r": 16,
    "lora_alpha": 32,
}


def load_example() -> Any:
    """``examples/agent.py`` as a module (by path: it is not a package)."""
    spec = importlib.util.spec_from_file_location("agent_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def prepare(work: Path) -> Path:
    """The policy folder both sides load (see the module docstring); written once, weights hard-linked
    where possible."""
    from transformers import AutoConfig, GenerationConfig

    from rlhf_trainers.testing.smollm2 import smollm2_folder

    policy = work / "policy"
    if (policy / "tokenizer_config.json").is_file():
        return policy
    source = smollm2_folder()
    tmp = work / "policy.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    for path in source.glob("*.safetensors"):
        try:
            os.link(path, tmp / path.name)
        except OSError:
            shutil.copy2(path, tmp / path.name)
    tokenizer = load_example().tool_tokenizer()  # SmolLM2's, pad <|endoftext|>, our template installed
    tokenizer.save_pretrained(tmp)
    config = AutoConfig.from_pretrained(source)
    config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(tmp)
    generation = GenerationConfig.from_pretrained(source)
    generation.pad_token_id = tokenizer.pad_token_id
    generation.save_pretrained(tmp)
    os.replace(tmp, policy)
    return policy


# ---- TRL's side (runs in TRL's environment) ------------------------------------------------------


def trl_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One TRL run of the job in `spec`; returns its curve and timings (the example's curve format)."""
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    agent = load_example()
    s = spec["settings"]
    tokenizer = AutoTokenizer.from_pretrained(spec["policy"], padding_side="left")
    if getattr(tokenizer, "response_template", None) is None:
        raise SystemExit(f"{spec['policy']}: the tokenizer was saved without its response_template")
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        seed=spec["seed"],
        max_steps=spec["updates"],
        learning_rate=s["learning_rate"],
        temperature=s["temperature"],
        beta=s["beta"],
        per_device_train_batch_size=s["per_device_train_batch_size"],
        gradient_accumulation_steps=s["gradient_accumulation_steps"],
        num_generations=s["num_generations"],
        max_completion_length=s["max_completion_length"],
        max_tool_calling_iterations=s["max_tool_calling_iterations"],
        reward_weights=[1.0, spec["tool_reward"]],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # TRL's default is True; ours has none (as vs_trl_worker.py)
        disable_tqdm=True,
    )
    clock = agent._Clock()
    trainer = GRPOTrainer(
        model=spec["policy"],
        reward_funcs=[agent.success, agent.tool_use],
        args=config,
        train_dataset=agent.agent_dataset(spec["num_questions"], spec["seed"]),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=s["lora_r"], lora_alpha=s["lora_alpha"], target_modules="all-linear", task_type="CAUSAL_LM"
        ),
        tools=[agent.multiply],
        callbacks=[clock],
    )
    clock.start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - clock.start
    episodes = s["per_device_train_batch_size"] * s["gradient_accumulation_steps"]
    return {
        "curve": agent.curve_of(trainer.state.log_history, episodes, clock.seconds),
        "seconds": round(seconds, 1),
        "episodes_per_update": episodes,
        "updates": trainer.state.global_step,
    }


# ---- the driver (this project's environment) -----------------------------------------------------


def run_ours(spec: dict[str, Any], log: Path, algorithm: str) -> dict[str, Any]:
    """One run of ours: ``examples/agent.py --algorithm ALGORITHM``. GRPO gets :data:`SETTINGS` (TRL's
    job); PPO and RLOO get the example's own defaults for them (the same sizes in their names; PPO's
    learning rate 5e-4)."""
    curve_file = Path(spec["output_dir"]) / "agent_curve.json"
    flags = {
        "algorithm": algorithm,
        "model_name_or_path": spec["policy"],
        "seed": spec["seed"],
        "max_steps": spec["updates"],
        "tool_reward": spec["tool_reward"],
        "num_questions": spec["num_questions"],
        "output_dir": spec["output_dir"],
        "curve_file": curve_file,
        **(spec["settings"] if algorithm == "grpo" else {}),
    }
    command = [sys.executable, str(EXAMPLE), *(f"--{name}={value}" for name, value in flags.items())]
    _run(command, log, spec["threads"])
    return json.loads(curve_file.read_text())


def run_trl(spec: dict[str, Any], log: Path, python: str) -> dict[str, Any]:
    """One run of TRL's: this file's ``--trl-worker`` mode in TRL's environment."""
    spec_file = Path(spec["output_dir"]) / "spec.json"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(spec))
    _run([python, str(Path(__file__).resolve()), "--trl-worker", str(spec_file)], log, spec["threads"])
    return json.loads((Path(spec["output_dir"]) / "trl_result.json").read_text())


def _run(command: list[str], log: Path, threads: int) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONPATH": str(ROOT),
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if done.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise SystemExit(f"{' '.join(command[:3])} ... failed (exit {done.returncode}); {log}:\n{tail}")


def summary(run: dict[str, Any], n: int = 3) -> dict[str, Any]:
    """First and last `n` updates' mean success and tool use, and episodes/s, of one run."""
    curve = run["curve"]

    def mean(rows: list[dict[str, Any]], key: str) -> float | None:
        values = [row[key] for row in rows if row.get(key) is not None]
        return round(statistics.fmean(values), 3) if values else None

    episodes = run["episodes_per_update"] * run["updates"]
    return {
        "success_first": mean(curve[:n], "success"),
        "success_last": mean(curve[-n:], "success"),
        "tool_use_first": mean(curve[:n], "tool_use"),
        "tool_use_last": mean(curve[-n:], "tool_use"),
        "episodes_per_s": round(episodes / run["seconds"], 3) if run.get("seconds") else None,
        "seconds": run.get("seconds"),
    }


def machine_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``) and core count."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} CPU cores"


#: The sides a run can be: ours with one of the example's algorithms, or TRL's GRPOTrainer.
IMPLS: dict[str, str] = {"ours": "grpo", "ours-ppo": "ppo", "ours-rloo": "rloo", "trl": "grpo"}
LABELS = {"ours": "ours GRPO", "ours-ppo": "ours PPO", "ours-rloo": "ours RLOO", "trl": "TRL 1.16 GRPO"}
COLORS = {"ours": "tab:blue", "ours-ppo": "tab:green", "ours-rloo": "tab:purple", "trl": "tab:orange"}


def table(results: dict[str, Any]) -> str:
    lines = [
        "| side | seed | success first 3 -> last 3 | tool use first 3 -> last 3 | episodes/s | seconds |",
        "|---|---:|---|---|---:|---:|",
    ]
    order = list(IMPLS)
    runs = sorted(results["runs"].values(), key=lambda run: (order.index(run["impl"]), run["seed"]))
    for run in runs:
        s = summary(run)
        lines.append(
            f"| {LABELS[run['impl']]} | {run['seed']} | {s['success_first']} -> {s['success_last']} | "
            f"{s['tool_use_first']} -> {s['tool_use_last']} | {s['episodes_per_s']} | {s['seconds']} |"
        )
    return "\n".join(lines)


def curve_table(results: dict[str, Any], key: str) -> str:
    """`key` (success or tool_use) per update, the mean over each side's seeds, one row per side."""
    by_impl = {impl: [r for r in results["runs"].values() if r["impl"] == impl] for impl in IMPLS}
    by_impl = {impl: runs for impl, runs in by_impl.items() if runs}
    updates = max(len(run["curve"]) for runs in by_impl.values() for run in runs)
    lines = [
        f"| {key} (mean of seeds) | " + " | ".join(str(u) for u in range(1, updates + 1)) + " |",
        "|---|" + "---:|" * updates,
    ]
    for impl, runs in by_impl.items():
        cells = []
        for i in range(updates):
            values = [run["curve"][i][key] for run in runs if len(run["curve"]) > i]
            cells.append(f"{statistics.fmean(values):.2f}" if values else "")
        lines.append(f"| {LABELS[impl]} ({len(runs)} seeds) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Success and tool use per update against episodes: one thin line per seed, the mean over seeds
    thick, one colour per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharex=True)
    for impl in IMPLS:
        runs = [run for run in results["runs"].values() if run["impl"] == impl]
        if not runs:
            continue
        for ax, key in zip(axes, ("success", "tool_use"), strict=True):
            for run in runs:
                curve = run["curve"]
                ax.plot([r["episode"] for r in curve], [r[key] for r in curve], color=COLORS[impl], alpha=0.3)
            length = min(len(run["curve"]) for run in runs)
            episodes = [runs[0]["curve"][i]["episode"] for i in range(length)]
            means = [statistics.fmean(run["curve"][i][key] for run in runs) for i in range(length)]
            label = f"{LABELS[impl]} (mean of {len(runs)} seeds)"
            ax.plot(episodes, means, color=COLORS[impl], linewidth=2.5, label=label)
    for ax, title in zip(axes, ("task success", "tool use (an error-free call)"), strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("episodes", fontsize=9)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("SmolLM2-135M-Instruct + LoRA learns to call multiply (examples/agent.py)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def record(out: Path, key: str, entry: dict[str, Any], header: dict[str, Any]) -> dict[str, Any]:
    """Add run `key` to the JSON at `out` under an exclusive lock (several drivers may share the file,
    e.g. one per core), written atomically; returns the whole result."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = json.loads(out.read_text()) if out.is_file() else {"runs": {}}
        results.update(header)
        results["runs"][key] = entry
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        os.replace(tmp, out)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument(
        "--impls", default="ours,trl", help=f"comma-separated, run in this order: {', '.join(IMPLS)}"
    )
    parser.add_argument("--updates", type=int, default=12, help="updates per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--tool-reward", type=float, default=0.0, help="the example's --tool_reward")
    parser.add_argument("--num-questions", type=int, default=4096)
    parser.add_argument("--trl-python", default=str(TRL_PYTHON))
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--tag", default="", help="suffix of the JSON's name")
    parser.add_argument("--force", action="store_true", help="rerun seeds and sides already in the JSON")
    parser.add_argument("--note", help="a note kept in the JSON (e.g. that the machine was shared)")
    parser.add_argument("--plot", type=Path, help="also draw the curves to this PNG")
    parser.add_argument("--render", action="store_true", help="run nothing: print the table (and --plot)")
    args = parser.parse_args()
    if args.trl_worker:
        spec = json.loads(Path(args.trl_worker).read_text())
        result = trl_worker(spec)
        (Path(spec["output_dir"]) / "trl_result.json").write_text(json.dumps(result, indent=2))
        return
    out = args.out / f"agent_vs_trl{args.tag}.json"
    if args.render:
        results = json.loads(out.read_text())
        print(table(results), curve_table(results, "success"), curve_table(results, "tool_use"), sep="\n\n")
        if args.plot:
            plot(results, args.plot)
        return
    impls = [impl.strip() for impl in args.impls.split(",") if impl.strip()]
    for impl in impls:
        if impl not in IMPLS:
            raise SystemExit(f"--impls: {impl!r} is not one of {', '.join(IMPLS)}")
    if "trl" in impls and not Path(args.trl_python).is_file():
        raise SystemExit(f"{args.trl_python} not found: run `bash benchmarks/setup_trl.sh` first")
    policy = prepare(args.work)
    header = {
        "task": "examples/agent.py: 3-digit x 2-digit multiplication with a multiply tool",
        "settings": SETTINGS | {"tool_reward": args.tool_reward, "updates": args.updates},
        "machine": machine_name(),
        "threads": args.threads,
    } | ({"note": args.note} if args.note else {})
    done = json.loads(out.read_text())["runs"] if out.is_file() else {}
    results: dict[str, Any] = {"runs": done}
    for seed in [int(seed) for seed in args.seeds.split(",")]:
        for impl in impls:
            key = f"{impl}-{seed}"
            if key in done and not args.force:
                print(f"{key}: in {out} already (--force reruns it)")
                continue
            spec = {
                "policy": str(policy),
                "seed": seed,
                "updates": args.updates,
                "threads": args.threads,
                "tool_reward": args.tool_reward,
                "num_questions": args.num_questions,
                "settings": SETTINGS,
                "output_dir": str(args.work / "runs" / key),
            }
            log = args.work / "logs" / f"{key}.log"
            print(f"{key}: running (log {log})", flush=True)
            run = run_trl(spec, log, args.trl_python) if impl == "trl" else run_ours(spec, log, IMPLS[impl])
            entry = {
                "impl": impl,
                "seed": seed,
                "cpus": sorted(os.sched_getaffinity(0)),
                **{k: run[k] for k in ("curve", "seconds", "episodes_per_update", "updates")},
            }
            results = record(out, key, entry, header)
    print(table(results))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
