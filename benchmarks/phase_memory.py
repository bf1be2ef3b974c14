"""Resident memory phase by phase: the RSS high-water of each step of ours' update (sampling, scoring,
the rollout's passes, step 6a, the optimizer steps), for one or more configurations of the same job.

The job is ``vs_trl.py``'s (its worker builds ours' trainer the same way; assets from ``vs_trl.py
--prepare``, default work dir ``~/.cache/rlhf_trainers/vs_trl``): SmolLM2-135M-Instruct, its reward
model, PPO or RLOO, prompts whose responses stop at EOS (``--stop-at-eos`` in vs_trl.py's terms), float32,
one torch thread. Each configuration (a JSON object of ours' config fields) runs in its own process.
Around every wrapped step of ``OnPolicyTrainer._update`` the process resets its RSS high-water
(``/proc/self/clear_refs``) and records the RSS before, the high-water during and the RSS after; the
peak of an update is the largest of its steps'. Memory does not depend on the CPU's speed, so
``--parallel`` runs the configurations at the same time (their peaks add up: mind the machine's RAM).

    python benchmarks/phase_memory.py --configs '{"rollout_values": "auto"}' '{"rollout_values": "forward"}'
    python benchmarks/phase_memory.py --configs '{"rollout_values": "auto", "reuse_host_memory": false}' \\
        '{"rollout_values": "forward", "reuse_host_memory": false}' --parallel --tag _default_allocator

Writes ``<out>/phase_memory<tag>.json`` and prints a table (MiB).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: The profiler's name of a phase's time window (``--live-bytes``).
PHASE_PREFIX = "phase_memory::"
#: The steps of ``OnPolicyTrainer._update`` (or of the engine's parts it calls) that are measured, by the
#: class that holds each: the rollout producer, the models' passes, the optimization loop, the trainer.
PHASES = {
    "SingleTurnProducer": ("sample", "score", "assemble"),
    "ModelPasses": ("logprobs", "values"),
    "OptimizationLoop": ("fill_values", "run"),
    "OnPolicyTrainer": ("token_rewards", "compute_advantages", "rollout_metrics"),
}


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def child(spec_path: str, out_path: str) -> None:
    """One configuration: the worker's run with every phase wrapped; the phase log goes to `out_path`."""
    sys.path.insert(0, str(HERE))
    import vs_trl_worker

    from rlhf_trainers.onpolicy import optimize, passes, producer
    from rlhf_trainers.onpolicy import trainer as trainer_module

    log: list[dict[str, Any]] = []
    current = {"update": -1}
    spec = json.loads(Path(spec_path).read_text())
    profiled_update = spec.pop("profile_update", None)
    live: dict[str, Any] = {}

    def wrap(owner: type, name: str) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def measured(self: Any, *args: Any, **kwargs: Any) -> Any:
            before = _status_mib("VmRSS")
            _reset_high_water()
            with torch.profiler.record_function(PHASE_PREFIX + name):
                out = method(self, *args, **kwargs)
            log.append(
                {
                    "update": current["update"],
                    "phase": name,
                    "rss_before": round(before, 1),
                    "peak": round(_status_mib("VmHWM"), 1),
                    "rss_after": round(_status_mib("VmRSS"), 1),
                }
            )
            _reset_high_water()
            return out

        setattr(owner, name, measured)

    update_method = trainer_module.OnPolicyTrainer._update

    def update(self: Any, model: Any, index: int) -> Any:
        current["update"] = index
        if index != profiled_update:
            return update_method(self, model, index)
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, profile_memory=True) as profiler:
            out = update_method(self, model, index)
        live.update(live_bytes_by_phase(profiler.profiler.kineto_results.events()))
        return out

    trainer_module.OnPolicyTrainer._update = update
    owners = (
        producer.SingleTurnProducer,
        passes.ModelPasses,
        optimize.OptimizationLoop,
        trainer_module.OnPolicyTrainer,
    )
    for owner in owners:
        for name in PHASES[owner.__name__]:
            wrap(owner, name)
    result = vs_trl_worker.run(spec)
    out = {"log": log, "seconds_per_update_median": result.get("seconds_per_update_median")}
    if profiled_update is not None:
        out["live_bytes"] = {"update": profiled_update, **live}
    Path(out_path).write_text(json.dumps(out, indent=1))


def live_bytes_by_phase(events: Any) -> dict[str, Any]:
    """The bytes torch's CPU allocator holds for live tensors over one profiled update (the profiler's
    kineto events), relative to its start (allocations before the profiler started are not seen): the
    peak, and the peak inside each phase's time window. Exact for tensors (every allocation and free is a
    ``[memory]`` event), whatever malloc keeps or returns."""
    memory = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.nbytes() and str(e.device_type()).endswith("CPU")
    )
    windows = [
        (e.name()[len(PHASE_PREFIX) :], e.start_ns(), e.end_ns())
        for e in events
        if e.name().startswith(PHASE_PREFIX)
    ]
    total, peak, phase_peaks = 0, 0, {}
    for when, change in memory:
        total += change
        peak = max(peak, total)
        for name, start, end in windows:
            if start <= when <= end:
                phase_peaks[name] = max(phase_peaks.get(name, total), total)
    mib = 1024 * 1024
    return {
        "peak_mib": round(peak / mib, 1),
        "end_mib": round(total / mib, 1),
        "phase_peak_mib": {k: round(v / mib, 1) for k, v in phase_peaks.items()},
    }


def summarize(log: list[dict[str, Any]]) -> dict[str, Any]:
    """Per update: the peak and the step it came in; per step: its largest peak after the first update."""
    updates = sorted({e["update"] for e in log})
    per_update = {}
    for u in updates:
        entries = [e for e in log if e["update"] == u]
        top = max(entries, key=lambda e: e["peak"])
        per_update[str(u)] = {
            "peak": top["peak"],
            "phase": top["phase"],
            "rss_after": entries[-1]["rss_after"],
        }
    later = [e for e in log if e["update"] > updates[0]] or log
    per_phase = {}
    for e in later:
        per_phase[e["phase"]] = max(per_phase.get(e["phase"], 0.0), e["peak"])
    return {"per_update": per_update, "per_phase_peak_after_first_update": per_phase}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["{}"], help="JSON objects of ours' config fields")
    parser.add_argument("--algo", choices=["ppo", "rloo"], default="ppo")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--parallel", action="store_true", help="run the configurations at the same time")
    parser.add_argument(
        "--live-bytes",
        type=int,
        metavar="UPDATE",
        help="also profile this update (0-based) with torch's memory profiler: the live tensor bytes' peak "
        "per phase, independent of malloc (slower: the profiler records every allocation)",
    )
    parser.add_argument("--work-dir", default=str(Path.home() / ".cache" / "rlhf_trainers" / "vs_trl"))
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return

    work = Path(args.work_dir)
    prompts_per_update = args.batch if args.algo == "ppo" else args.batch // 2
    prompts = work / "135m" / f"prompts_varlen_{prompts_per_update}.json"
    if not prompts.is_file():
        raise SystemExit(
            f"{prompts} is missing: prepare the assets first (python benchmarks/vs_trl.py --prepare "
            f"--varlen-prompts {prompts_per_update} --sizes 135m)"
        )
    settings = {
        "batch": args.batch,
        "mini_batches": 2,
        "epochs": 2,
        "response_length": args.response_length,
        "fixed_length": False,
        "rloo_k": 2,
        "num_generations": 4,
        "beta": 0.0,
        "loss_type": "dapo",
        "trl_generation": "generate",
        "learning_rate": 1e-6,
        "kl_coef": 0.05,
        "temperature": 1.0,
        "seed": 0,
        "eval_every": 0,
        "threads": 1,
        "trl_config": {},
        "bf16": False,
        "use_vllm": False,
        "vllm_kv_cache_gib": 2,
        "updates": args.updates,
    }
    configs = [json.loads(c) for c in args.configs]
    with tempfile.TemporaryDirectory() as tmp:
        processes = []
        for i, config in enumerate(configs):
            spec = {
                "impl": "ours",
                "git": subprocess.run(
                    ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
                ).stdout.strip(),
                "algo": args.algo,
                "policy": str(work / "135m" / "policy"),
                "reward": str(work / "135m" / "reward"),
                "prompts": str(prompts),
                "task_py": str(ROOT / "rlhf_trainers" / "testing" / "task.py"),
                "settings": {**settings, "ours_config": config},
            }
            if args.live_bytes is not None:
                spec["profile_update"] = args.live_bytes
            spec_path, out_path = Path(tmp) / f"spec{i}.json", Path(tmp) / f"out{i}.json"
            spec_path.write_text(json.dumps(spec))
            command = [sys.executable, __file__, "--child", str(spec_path), str(out_path)]
            log_path = Path(tmp) / f"log{i}.txt"
            with open(log_path, "w") as log_file:
                process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
            processes.append((config, process, out_path, log_path))
            if not args.parallel:
                process.wait()
        runs = []
        for config, process, out_path, log_path in processes:
            if process.wait() != 0:
                raise SystemExit(f"{config} failed:\n{log_path.read_text()[-4000:]}")
            log = json.loads(out_path.read_text())
            runs.append({"config": config, **log, **summarize(log["log"])})
    report = {
        "benchmark": "phase_memory",
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "git": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip(),
        "algo": args.algo,
        "settings": settings,
        "parallel": args.parallel,
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"phase_memory{args.tag}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    names = [name for owned in PHASES.values() for name in owned]
    phases = [p for p in names if any(p in r["per_phase_peak_after_first_update"] for r in runs)]
    print("| config | " + " | ".join(phases) + " | update peaks |")
    print("|---|" + "---:|" * (len(phases) + 1))
    for r in runs:
        cells = [f"{r['per_phase_peak_after_first_update'].get(p, float('nan')):.0f}" for p in phases]
        peaks = " / ".join(f"{v['peak']:.0f}" for v in r["per_update"].values())
        print(f"| `{json.dumps(r['config'])}` | " + " | ".join(cells) + f" | {peaks} |")
    for r in runs:
        if "live_bytes" in r:
            lb = r["live_bytes"]
            phases_text = ", ".join(f"{k} {v:.0f}" for k, v in lb["phase_peak_mib"].items())
            print(
                f"live tensor MiB above update {lb['update']}'s start, `{json.dumps(r['config'])}`: peak "
                f"{lb['peak_mib']:.0f} (per phase: {phases_text}); at its end {lb['end_mib']:.0f}"
            )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
