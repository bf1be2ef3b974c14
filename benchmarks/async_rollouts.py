"""Asynchronous rollouts against synchronous ones, generation on a vLLM server (issue #51): the seconds per
update, and the reward curve over updates, for RLOO, GRPO and PPO on SmolLM2-135M-Instruct.

The server (``rlhf-trainers vllm-serve``, float32, the checkpoint of
``rlhf_trainers.testing.smollm2.smollm2_folder()``) is pinned to one core and the trainer to the other
(``taskset``), each with one thread, so that generation and training can overlap only when the trainer
lets them (``async_rollouts=True``). The job is the RLVR ``word_count`` task of ``examples/rlvr.py``
(LoRA r 16 / alpha 32 on every linear layer, merged into the weights synced to the server at every update;
lr 1e-3, temperature 0.7, KL 0.03 / beta 0.03), ``--completions`` completions per update (``--k`` per
prompt) of at most ``--response-length`` tokens (stop at EOS), one optimizer step per update over
micro-batches of 8. Modes: ``sync`` (server, synchronous), ``async`` (server, ``async_rollouts=True``) and
``colocated`` (the engine in the trainer's process, on the trainer's core; for server vs colocated).
Everything runs in the vLLM environment (``rlhf_trainers.testing.vllm_env``).

Per update the worker records ``timing/step`` (the update's wall time), ``timing/generate`` (generation,
the weight sync included; async: the launch plus what the update waited for), ``timing/generate_wait``,
``timing/weight_sync``, ``timing/update`` and the mean reward ``objective/scores``; after training, the
mean reward of the trained policy on ``--eval-prompts`` held-out prompts (an asynchronous run's last
rollouts were sampled one update behind, so its training curve lags a synchronous run's by an update;
the held-out reward compares the policies the runs end with). The summary per run is the median over the
updates after the first (warm-up). The bound of the issue: async seconds per update
<= 1.15 x max(generation, training) of the synchronous run of the same seed, where generation is the sync
run's median ``timing/generate`` and training its median ``timing/step - timing/generate``.

    python benchmarks/async_rollouts.py --trainers rloo,grpo --modes sync,async,colocated --seeds 0
    python benchmarks/async_rollouts.py --trainers rloo --modes sync,async --seeds 0,1,2 --tag _curves
    python benchmarks/async_rollouts.py --trainers grpo --modes sync --server-args "--enable_lora --max_lora_rank 16" \
        --overrides '{"vllm_lora_sync": "adapter"}' --tag _adapter   # only the LoRA adapter synced

Writes ``<out>/async_rollouts<tag>.json`` and ``.md`` (``--render FILE.json`` rewrites the ``.md``).
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
sys.path.insert(0, str(HERE))

MODES = ("sync", "async", "colocated")
TRAINERS = ("rloo", "grpo", "ppo")
KEEP = (
    "timing/step",
    "timing/generate",
    "timing/generate_wait",
    "timing/weight_sync",
    "timing/update",
    "objective/scores",
    "val/response_length",
    "rollout/staleness",
    "sampling/importance_sampling_ratio/mean",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
)


def worker(trainer_name: str, mode: str, seed: int, updates: int, args: dict[str, Any]) -> dict[str, Any]:
    """One run in this process (the vLLM environment): its per-update figures."""
    import torch
    from peft import LoraConfig

    from rlhf_trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
    from rlhf_trainers.rewards.rlvr import reward_function, task_dataset
    from rlhf_trainers.testing.smollm2 import load_smollm2_tokenizer, smollm2_folder

    torch.set_num_threads(1)
    completions, k, micro = args["completions"], args["k"], 8
    common: dict[str, Any] = {
        "output_dir": f"/tmp/async-bench-{trainer_name}-{mode}-{seed}",
        "learning_rate": 1e-3,
        "temperature": 0.7,
        "max_steps": updates,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": seed,
        "disable_tqdm": True,
        "use_vllm": True,
        "vllm_mode": "colocate" if mode == "colocated" else "server",
        "async_rollouts": mode == "async",
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": completions // micro,
    }
    if mode != "colocated":
        common["vllm_server_base_url"] = args["url"]
    common.update(args.get("overrides") or {})  # --overrides: config fields of every run
    if trainer_name in ("rloo", "ppo"):
        onpolicy: dict[str, Any] = {
            "kl_coef": 0.03,
            "response_length": args["response_length"],
            "num_mini_batches": 1,
            "num_ppo_epochs": 1,
            "local_rollout_forward_batch_size": completions,
            "num_sample_generations": 0,
        }
        if trainer_name == "rloo":
            config: Any = RLOOConfig(rloo_k=k, **onpolicy, **common)
            trainer_cls: Any = RLOOTrainer
        else:  # PPO: one completion per prompt, a critic built from the policy
            config = PPOConfig(**onpolicy, **common)
            trainer_cls = PPOTrainer
    else:
        config = GRPOConfig(
            num_generations=k, beta=0.03, max_completion_length=args["response_length"], **common
        )
        trainer_cls = GRPOTrainer
    trainer = trainer_cls(
        model=str(smollm2_folder()),
        processing_class=load_smollm2_tokenizer(),
        args=config,
        reward_funcs=[reward_function("word_count")],
        train_dataset=task_dataset("word_count", "train"),
        eval_dataset=task_dataset("word_count", "test", n=args.get("eval_prompts", 64)),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    began = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - began
    rows = [h for h in trainer.state.log_history if "timing/step" in h]
    final = trainer.evaluate()  # the trained policy on held-out prompts (after training: not in its timing)
    return {
        "trainer": trainer_name,
        "mode": mode,
        "seed": seed,
        "generation": trainer.generation_backend.name,
        "wall_s": wall,
        "eval_scores": final.get("eval_objective/scores"),
        "updates": [{key: h[key] for key in KEEP if key in h} for h in rows],
    }


def summarize(run: dict[str, Any]) -> dict[str, float | None]:
    """Medians over the updates after the first."""
    later = run["updates"][1:] or run["updates"]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    step = median([u["timing/step"] for u in later])
    generate = median([u["timing/generate"] for u in later])
    training = median([u["timing/step"] - u["timing/generate"] for u in later])
    return {
        "step_s": step,
        "generate_s": generate,
        "training_s": training,
        "wait_s": median([u["timing/generate_wait"] for u in later if "timing/generate_wait" in u]),
        "weight_sync_s": median([u["timing/weight_sync"] for u in later if "timing/weight_sync" in u]),
        "reward_first": run["updates"][0].get("objective/scores"),
        "reward_last3": statistics.mean(
            [u.get("objective/scores", float("nan")) for u in run["updates"][-3:]]
        ),
        "eval_scores": run.get("eval_scores"),
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Asynchronous vs synchronous rollouts on a vLLM server, SmolLM2-135M-Instruct + LoRA, "
        f"{result['settings']['completions']} completions per update, {result['updates']} updates "
        f"({result['machine']}, {result['date']}; idle machine: {result['idle']}). Server on core 0, trainer on "
        "core 1, one thread each; medians over updates 2..N.",
        "",
        "| trainer | seed | mode | s/update | generation s | training s | waited s | sync s | bound 1.15 x max(gen, train) of sync | reward first -> last 3 | held-out reward after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = result["runs"]
    for run in runs:
        s = run["summary"]
        sync = next(
            (
                r
                for r in runs
                if r["trainer"] == run["trainer"] and r["seed"] == run["seed"] and r["mode"] == "sync"
            ),
            None,
        )
        bound = ""
        if sync is not None and run["mode"] == "async":
            limit = 1.15 * max(sync["summary"]["generate_s"], sync["summary"]["training_s"])
            verdict = "holds" if s["step_s"] <= limit else "missed"
            bound = f"{limit:.1f} s: {verdict}; {s['step_s'] / sync['summary']['step_s']:.2f} x sync"
        wait = "" if s["wait_s"] is None else f"{s['wait_s']:.1f}"
        sync_s = "" if s["weight_sync_s"] is None else f"{s['weight_sync_s']:.2f}"
        lines.append(
            f"| {run['trainer']} | {run['seed']} | {run['mode']} | {s['step_s']:.1f} | {s['generate_s']:.1f} | "
            f"{s['training_s']:.1f} | {wait} | {sync_s} | {bound} | {s['reward_first']:.3f} -> {s['reward_last3']:.3f} | "
            f"{'' if s.get('eval_scores') is None else format(s['eval_scores'], '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def start_server(
    python: str, env: dict[str, str], port: int, log: Path, extra: list[str]
) -> subprocess.Popen:
    from rlhf_trainers.testing.smollm2 import smollm2_folder

    command = [
        "taskset",
        "-c",
        "0",
        python,
        "-m",
        "rlhf_trainers.cli",
        "vllm-serve",
        "--model",
        str(smollm2_folder()),
    ]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max_model_len", "1024"]
    command += extra
    server_env = {**env, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=server_env, start_new_session=True
        )
    from rlhf_trainers.generation.server_client import VLLMServerClient

    client = VLLMServerClient(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 600
    while not client.is_up():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(2)
    return process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", default="rloo,grpo")
    parser.add_argument("--modes", default="sync,async,colocated")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--completions", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts scored after training")
    parser.add_argument("--port", type=int, default=8437)
    parser.add_argument("--idle", default="unknown")
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--overrides", default="{}", help="config fields for every run, as JSON: '{\"learning_rate\": 3e-4}'"
    )
    parser.add_argument(
        "--server-args", default="", help="more vllm-serve flags, e.g. '--enable_lora --max_lora_rank 16'"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--render", help="rewrite the .md of this result JSON and stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print("RESULT " + json.dumps(worker(job["trainer"], job["mode"], job["seed"], job["updates"], job)))
        return
    if args.render:
        result = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(render(result))
        return
    from vs_trl import machine_name

    from rlhf_trainers.testing.vllm_env import vllm_env_variables, vllm_python

    python = str(vllm_python())
    env = vllm_env_variables(ROOT)
    out = args.out / f"async_rollouts{args.tag}.json"
    settings = {
        "completions": args.completions,
        "k": args.k,
        "response_length": args.response_length,
        "eval_prompts": args.eval_prompts,
        "server_args": args.server_args,
        "overrides": json.loads(args.overrides),
    }
    result: dict[str, Any] = {
        "machine": machine_name(),
        "date": time.strftime("%Y-%m-%d"),
        "idle": args.idle,
        "updates": args.updates,
        "settings": settings,
        "runs": [],
    }
    modes = [m for m in args.modes.split(",") if m]
    server = None
    if any(m != "colocated" for m in modes):
        server = start_server(
            python, env, args.port, Path(f"/tmp/async-bench-server-{args.port}.log"), args.server_args.split()
        )
    try:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for trainer in args.trainers.split(","):
                for mode in modes:
                    job = {
                        **settings,
                        "trainer": trainer,
                        "mode": mode,
                        "seed": seed,
                        "updates": args.updates,
                    }
                    job["url"] = f"http://127.0.0.1:{args.port}"
                    cores = "0" if mode == "colocated" else "1"
                    command = ["taskset", "-c", cores, python, __file__, "--worker", json.dumps(job)]
                    done = subprocess.run(
                        command,
                        env={**env, "OMP_NUM_THREADS": "1"},
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                    if line is None:
                        print(done.stdout[-3000:], done.stderr[-5000:], file=sys.stderr)
                        raise SystemExit(f"run {job} failed")
                    run = json.loads(line[len("RESULT ") :])
                    run["summary"] = summarize(run)
                    result["runs"].append(run)
                    print(trainer, mode, seed, run["summary"], flush=True)
                    out.write_text(json.dumps(result, indent=1))
                    out.with_suffix(".md").write_text(render(result))
    finally:
        if server is not None:
            os.killpg(server.pid, 15)
            server.wait(60)


if __name__ == "__main__":
    main()
