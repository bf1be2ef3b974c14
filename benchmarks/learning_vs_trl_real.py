"""Learning against TRL on a real model (issue #21): the held-out success rate of SmolLM2-135M-Instruct on
a verifiable-reward task (``rlhf_trainers/rewards/rlvr.py``) against episodes, for our RLOOTrainer and the newest
TRL's RLOOTrainer (optionally our PPOTrainer too), several seeds each.

The sibling of ``learning_vs_trl.py`` (the offline kit's task): every run is a worker process
(``vs_trl_worker.py``) in its own virtual environment, ours in this project's, TRL's in
``benchmarks/.venvs/trl-latest`` (``bash benchmarks/setup_trl.sh``; it installs peft there). Both sides
get the same job: SmolLM2-135M-Instruct from ``rlhf_trainers.testing.smollm2.smollm2_folder()`` (saved
once with the pad token ``<|endoftext|>``, so the EOS ``<|im_end|>`` is not padding), the same LoRA
adapter (r 16, alpha 32, all linear layers), the task's train rows (chat prompts plus the columns the
reward reads, e.g. ``answer``), the task's reward function (loaded by file path on TRL's side; the worker
fails the run unless every call receives the columns), and the same batch, k (``rloo_k`` =
``num_generations``), mini-batches, epochs, response length (stop at EOS), learning rate, KL coefficient
(``kl_coef`` = ``beta``) and sampling (temperature, no top-k/top-p).

The measure is outside both trainers: before training and every ``--eval-every`` updates, the worker
samples ``--eval-samples`` completions per held-out test row from the current policy (the trainer's
LoRA model; temperature as in training, top-k 0, top-p 1, stop at EOS, the RNG seeded for the
evaluation and restored after it) and averages the task's strict 0/1 ``success``. The gain of a run is
its last evaluation minus its first; ours vs TRL compares the mean over seeds at equal episodes.

    bash benchmarks/setup_trl.sh
    python benchmarks/learning_vs_trl_real.py --seeds 0,1,2 --threads 1 --out benchmarks/results

Writes ``<out>/learning_vs_trl_real<tag>.json``, ``.md`` and ``.png`` (``--render FILE.json`` redraws them).
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from learning_vs_trl import learning_settings, run_prepare  # noqa: E402
from vs_trl import DEFAULT_WORK, git_state, machine_name, run_worker  # noqa: E402

TASK_PY = ROOT / "rlhf_trainers" / "rewards" / "rlvr.py"
VENVS = HERE / ".venvs"
NAME = "learning_vs_trl_real"
#: (impl, algo) pairs this benchmark can run: TRL's PPO (1.12) takes only a reward model, see NOTES.
PAIRS = {"rloo": ("ours", "trl"), "ppo": ("ours",)}


def prepare(work: Path, task: str, n_train: int | None, n_test: int | None) -> dict[str, Any]:
    """The policy folder both sides load (SmolLM2-135M-Instruct with the pad token ``<|endoftext|>``
    saved in its tokenizer and configs; weights hard-linked where possible) and the task's rows
    (``rows-<task>.json``). Idempotent."""
    import importlib.util

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from rlhf_trainers.testing.smollm2 import SMOLLM2_PAD_TOKEN, smollm2_folder

    work.mkdir(parents=True, exist_ok=True)
    policy = work / "smollm2" / "policy"
    if not (policy / "tokenizer_config.json").is_file():
        source = smollm2_folder()
        tmp = policy.with_name("policy.tmp")
        shutil.rmtree(tmp, ignore_errors=True)

        def link_or_copy(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

        shutil.copytree(source, tmp, copy_function=link_or_copy)
        # padding_side must be a constructor argument to be saved with the tokenizer.
        tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
        tokenizer.pad_token = SMOLLM2_PAD_TOKEN
        for name in (
            "tokenizer_config.json",
            "tokenizer.json",
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            (tmp / name).unlink(missing_ok=True)  # hard links: write new files, not into the source
        tokenizer.save_pretrained(tmp)
        config = AutoConfig.from_pretrained(source)
        config.pad_token_id = tokenizer.pad_token_id
        (tmp / "config.json").unlink()
        config.save_pretrained(tmp)
        generation = GenerationConfig.from_pretrained(source)
        generation.pad_token_id = tokenizer.pad_token_id
        (tmp / "generation_config.json").unlink()
        generation.save_pretrained(tmp)
        os.replace(tmp, policy)

    spec = importlib.util.spec_from_file_location("_rlvr_driver", TASK_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rows = {"train": module.task_rows(task, "train", n_train), "test": module.task_rows(task, "test", n_test)}
    rows_path = work / f"rows-{task}.json"
    rows_path.write_text(json.dumps(rows))
    return {
        "policy": str(policy),
        "rows": str(rows_path),
        "train_rows": len(rows["train"]),
        "test_rows": len(rows["test"]),
    }


def interpreters(args: argparse.Namespace) -> dict[str, str]:
    """The Python of each side: ours defaults to this interpreter (it needs peft, so not
    ``.venvs/ours``, which has no extras), TRL's to ``.venvs/trl-latest``."""
    out = {
        "ours": args.ours_python or sys.executable,
        "trl": args.trl_python or str(VENVS / "trl-latest" / "bin" / "python"),
    }
    for impl, path in out.items():
        probe = subprocess.run(
            [path, "-c", "import peft, " + ("trl" if impl == "trl" else "transformers")], capture_output=True
        )
        if probe.returncode:
            raise SystemExit(
                f"{path} ({impl}) cannot import peft/trl: run `bash benchmarks/setup_trl.sh` first"
            )
    return out


#: The two held-out measures every evaluation records: the task's strict 0/1 score, and its training
#: reward (shaped: partial credit) on the same samples.
METRICS = {"success": "held-out success (strict)", "reward": "held-out reward (shaped)"}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (algo, impl): for each metric, gains per seed, mean gain, and the mean curve over seeds."""
    out: dict[str, Any] = {}
    for algo, impls in PAIRS.items():
        for impl in impls:
            runs = [r for r in results if (r["algo"], r["impl"]) == (algo, impl)]
            if not runs:
                continue
            episodes = [e["episodes"] for e in runs[0]["evals"]]
            entry: dict[str, Any] = {
                "seeds": [r["settings"]["seed"] for r in runs],
                "episodes": episodes,
                "train_wall_s_mean": statistics.mean(r["train_wall_s"] - r["eval_wall_s"] for r in runs),
                "final_kl_mean": statistics.mean(r["final_kl"] for r in runs)
                if all(r.get("final_kl") is not None for r in runs)
                else None,
            }
            for metric in METRICS:
                gains = [r["evals"][-1][metric] - r["evals"][0][metric] for r in runs]
                curve = [statistics.mean(r["evals"][i][metric] for r in runs) for i in range(len(episodes))]
                entry[metric] = {
                    "gains": gains,
                    "mean_gain": statistics.mean(gains),
                    "std_gain": statistics.stdev(gains) if len(gains) > 1 else 0.0,
                    "mean_curve": curve,
                    "start_mean": curve[0],
                    "final_mean": curve[-1],
                }
            out[f"{algo} {impl}"] = entry
        if f"{algo} ours" in out and f"{algo} trl" in out:
            out[f"{algo} ours - trl mean gain"] = {
                m: out[f"{algo} ours"][m]["mean_gain"] - out[f"{algo} trl"][m]["mean_gain"] for m in METRICS
            }
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [a for a in PAIRS if any(r["algo"] == a for r in report["results"])]
    fig, axes = plt.subplots(
        len(algos), len(METRICS), figsize=(6 * len(METRICS), 4.2 * len(algos)), squeeze=False
    )
    colors = {"ours": "tab:blue", "trl": "tab:orange"}
    for row, algo in zip(axes, algos, strict=True):
        for ax, (metric, title) in zip(row, METRICS.items(), strict=True):
            for impl in PAIRS[algo]:
                runs = [r for r in report["results"] if (r["algo"], r["impl"]) == (algo, impl)]
                for r in runs:
                    xs = [e["episodes"] for e in r["evals"]]
                    ax.plot(xs, [e[metric] for e in r["evals"]], color=colors[impl], alpha=0.3, lw=1)
                s = report["summary"].get(f"{algo} {impl}")
                if s:
                    name = "ours" if impl == "ours" else f"TRL {runs[0]['versions'].get('trl', '')}"
                    ax.plot(
                        s["episodes"],
                        s[metric]["mean_curve"],
                        color=colors[impl],
                        lw=2.5,
                        label=f"{name} (mean of {len(runs)}; gain {s[metric]['mean_gain']:+.3f})",
                    )
            ax.set_title(f"{algo.upper()}: {title}, task '{report['task']}'", fontsize=10)
            ax.set_xlabel("episodes (completions trained on)")
            ax.set_ylabel(f"mean {metric} of sampled completions")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(
        "SmolLM2-135M-Instruct + LoRA, same settings on both sides (thin lines: single seeds)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


NOTES = [
    "Generation: ours samples with its own loop (`generation_loop='builtin'`: softmax(logits / T), no top-k/top-p), "
    "TRL with `model.generate` (temperature T, top-k 0, top-p 1, no min-p, repetition penalty 1): the same "
    "distribution, but different random streams, so a seed does not give the same samples on both sides "
    "(nor can it: the two trainers draw their random numbers in different orders).",
    "Rollout log-probs: ours takes them from its sampling loop (`rollout_logprobs='auto'` picks that in "
    "float32), TRL from a separate forward pass; in float32 they agree to rounding (~1e-6).",
    "How the completion reaches the reward function: TRL passes a chat completion as one assistant message, "
    "ours as text; the rlvr functions read both the same way. Both pass the dataset columns (`answer`), "
    "which the worker checks on every call.",
    "Mini-batch order: TRL's RLOO shuffles a generation batch once and reuses the same mini-batches in every "
    "epoch (`num_iterations`), ours reshuffles every epoch; with 1 epoch of 1 mini-batch (the settings "
    "here) this does not come into play.",
    "Learning-rate schedule: constant on both sides (`lr_scheduler_type='constant'`): TRL's `max_steps` "
    "counts optimizer steps and ours counts updates, so the default linear decay would not match.",
    "Loss: both use the sequence-level ratio clipped at 0.2, the reward minus kl_coef (beta) x the summed "
    "k1 KL to the LoRA-disabled base, the leave-one-out baseline without advantage whitening, gradient "
    "clipping at 1.0 and the mean over the mini-batch's completions; dropout is off on both (SmolLM2 and "
    "the adapter have none).",
    "TRL 1.12's PPO (the last TRL with PPO) is not run: its `reward_model` must be an nn.Module with a "
    "backbone and a `score` head whose output is read at the last real token, and it receives only the "
    "token ids of prompt + response; a task graded by code from a dataset column (`answer`) does not fit "
    "it without a fake module that decodes the ids and looks the answer up by prompt text, which would test "
    "that adapter rather than TRL's PPO. Our PPO runs on the task with the reward function (`--algos ppo`, "
    "its own result file).",
]


def settings_text(report: dict[str, Any]) -> str:
    s = report["settings"]
    algos = sorted({r["algo"] for r in report["results"]})
    sides = "on both sides" if report["trl_versions"] else "(ours only)"
    shapes = []
    if "rloo" in algos:
        shapes.append(f"RLOO {s['batch'] // s['rloo_k']} prompts x k={s['rloo_k']}")
    if "ppo" in algos:
        shapes.append(f"PPO {s['batch']} prompts, value model from the policy")
    return (
        f"{report['machine']}, torch {report['torch']}; TRL {', '.join(report['trl_versions']) or '-'}; "
        f"{'/'.join(a.upper() for a in algos)}. SmolLM2-135M-Instruct, LoRA r {s['lora']['r']} alpha "
        f"{s['lora']['alpha']} all-linear {sides}; rlvr task `{report['task']}` "
        f"({report['assets']['train_rows']} train rows, {report['assets']['test_rows']} held-out test rows), "
        f"its reward function {sides}; {s['batch']} completions per update ({'; '.join(shapes)}), "
        f"{s['mini_batches']} mini-batches, {s['epochs']} epochs, response_length {s['response_length']} "
        f"(stop at EOS), learning rate {s['learning_rate']} (constant), kl_coef/beta {s['kl_coef']}, "
        f"temperature {s['temperature']} (no top-k/top-p), {s['updates']} updates "
        f"({s['updates'] * s['batch']} episodes), {s['threads']} torch thread per run; held-out success of "
        f"{s['eval_samples']} sample(s) per test row every {s['eval_every']} updates (strict success and the "
        "shaped reward of the same samples)."
    )


def table(report: dict[str, Any]) -> list[str]:
    lines = [report["settings_text"], ""]
    lines += [
        "| trainer | seeds | measure | at start (mean) | at the end (mean) | gain per seed | mean gain |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    for key, s in report["summary"].items():
        if "-" in key:
            continue
        algo, impl = key.split()
        label = f"{'ours' if impl == 'ours' else 'TRL ' + report['trl_versions'][0]} {algo.upper()}"
        for metric, title in METRICS.items():
            m = s[metric]
            gains = ", ".join(f"{g:+.3f}" for g in m["gains"])
            lines.append(
                f"| {label} | {','.join(map(str, s['seeds']))} | {title} | {m['start_mean']:.3f} | "
                f"{m['final_mean']:.3f} | {gains} | {m['mean_gain']:+.3f} |"
            )
    lines.append("")
    for key, s in report["summary"].items():
        if "-" in key:
            continue
        kl = (
            f", KL to the base at the last update {s['final_kl_mean']:.2f} nats per completion"
            if s["final_kl_mean"] is not None
            else ""
        )
        lines.append(
            f"- {key}: train {s['train_wall_s_mean']:.0f} s per run (mean, evaluations excluded){kl}"
        )
    for algo in PAIRS:
        diff = report["summary"].get(f"{algo} ours - trl mean gain")
        if diff is not None:
            lines.append(
                f"- {algo.upper()}: ours - TRL mean gain = {diff['success']:+.3f} (success), "
                f"{diff['reward']:+.3f} (reward)"
            )
    seen = sorted({k for r in report["results"] for k in r.get("reward_kwargs_seen", [])})
    lines.append(f"- Keyword arguments the reward function received (union over runs): {', '.join(seen)}")
    for algo in PAIRS:
        curves = [(impl, report["summary"].get(f"{algo} {impl}")) for impl in PAIRS[algo]]
        curves = [(impl, s) for impl, s in curves if s]
        if not curves:
            continue
        episodes = curves[0][1]["episodes"]
        lines += [
            "",
            f"{algo.upper()}, mean over seeds at each evaluation:",
            "",
            "| episodes | " + " | ".join(str(e) for e in episodes) + " |",
            "|---|" + "---:|" * len(episodes),
        ]
        for metric in METRICS:
            for impl, s in curves:
                name = "ours" if impl == "ours" else "TRL"
                lines.append(
                    f"| {name}, {metric} | " + " | ".join(f"{v:.3f}" for v in s[metric]["mean_curve"]) + " |"
                )
    if report["trl_versions"]:
        lines += ["", "What differs between the two sides, and why:", ""]
        lines += [f"- {note}" for note in NOTES]
    else:
        lines += ["", f"- {NOTES[-1]}"]
    return lines


def write(report: dict[str, Any], out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # the raw results first: a failure below must not lose the runs (--render redraws from the JSON)
    (out / f"{NAME}{tag}.json").write_text(json.dumps(report, indent=2) + "\n")
    report["summary"] = summarize(report["results"])
    report["settings_text"] = settings_text(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}{tag}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = table(report)
    (out / f"{NAME}{tag}.md").write_text("\n".join(lines) + "\n")
    plot(report, out / f"{NAME}{tag}.png")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="addition", help="a task of rlhf_trainers/rewards/rlvr.py (TASKS)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--algos", default="rloo", help="rloo (ours and TRL's), ppo (ours only: see NOTES)")
    parser.add_argument("--impls", default="ours,trl", help="which sides to run (debugging: one of them)")
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-samples", type=int, default=1, help="samples per held-out row")
    parser.add_argument("--train-rows", type=int, default=None, help="default: the task's train pool")
    parser.add_argument("--test-rows", type=int, default=64, help="0: the task's whole test pool")
    parser.add_argument("--batch", type=int, default=16, help="completions per update")
    parser.add_argument("--mini-batches", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--response-length", type=int, default=12)
    parser.add_argument("--rloo-k", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--kl-coef", type=float, default=0.03)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK))
    parser.add_argument(
        "--ours-python", help="python with this project's dependencies and peft (default: this one)"
    )
    parser.add_argument(
        "--trl-python", help="python of the newest-trl venv with peft (default: .venvs/trl-latest)"
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--render", metavar="JSON", help="only redraw the table and plot of a result file")
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    # learning_settings() also reads GRPO's options, which this driver does not run (dropped below)
    parser.set_defaults(num_generations=None, beta=None, loss_type=None)
    args = parser.parse_args()
    work = Path(args.work_dir).expanduser()
    if args.render:
        path = Path(args.render)
        write(json.loads(path.read_text()), path.parent, path.stem[len(NAME) :])
        return
    if args.prepare:
        print(json.dumps(prepare(work, args.task, args.train_rows, args.test_rows or None)))
        return
    pythons = interpreters(args)
    cmd = [sys.executable, __file__, "--prepare", f"--work-dir={work}", f"--task={args.task}"]
    cmd += [f"--train-rows={args.train_rows}"] if args.train_rows else []
    cmd += [f"--test-rows={args.test_rows}"]
    assets = run_prepare(cmd)
    grpo_only = ("num_generations", "beta", "loss_type")
    settings = {
        **{k: v for k, v in learning_settings(args).items() if k not in grpo_only},
        "lora": {"r": args.lora_r, "alpha": args.lora_alpha},
        "lr_scheduler_type": "constant",
    }
    results = []
    for algo in [a for a in args.algos.split(",") if a]:
        for i, seed in enumerate(int(x) for x in args.seeds.split(",")):
            # alternate which side runs first, so a change of load on the shared machine hits both
            order = PAIRS[algo] if i % 2 == 0 else PAIRS[algo][::-1]
            for impl in [x for x in order if x in args.impls.split(",")]:
                spec = {
                    "impl": impl,
                    "algo": algo,
                    "policy": assets["policy"],
                    "task": {"py": str(TASK_PY), "name": args.task, "rows": assets["rows"]},
                    "settings": {**settings, "seed": seed},
                }
                name = f"{NAME}-{args.task}-{impl}-{algo}-seed{seed}"
                r = run_worker(pythons[impl], spec, work / "logs", name)
                results.append(r)
                e = r["evals"]
                print(
                    f"{name}: success {e[0]['success']:.3f} -> {e[-1]['success']:.3f}, reward "
                    f"{e[0]['reward']:.3f} -> {e[-1]['reward']:.3f} ({e[-1]['episodes']} "
                    f"episodes, train {r['train_wall_s'] - r['eval_wall_s']:.0f} s, eval {r['eval_wall_s']:.0f} s, "
                    f"reward kwargs {r['reward_kwargs_seen']})",
                    flush=True,
                )

    import torch

    report = {
        "benchmark": NAME,
        "task": args.task,
        "machine": machine_name(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "trl_versions": sorted({r["versions"]["trl"] for r in results if "trl" in r["versions"]}),
        "git": git_state(),
        "settings": settings,
        "assets": assets,
        "command": " ".join(["python", "benchmarks/learning_vs_trl_real.py", *sys.argv[1:]]),
        "results": results,
    }
    write(report, Path(args.out), args.tag)


if __name__ == "__main__":
    main()
