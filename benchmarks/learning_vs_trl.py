"""Learning against TRL (issues #7 and #23): the hidden true reward of the offline kit's synthetic task
against episodes, for our PPOTrainer / RLOOTrainer / GRPOTrainer and TRL's (``trl==1.12.0`` PPO, newest
TRL RLOO and GRPO), several seeds each.

Every run is a worker process (``vs_trl_worker.py``) in the right virtual environment (made by
``benchmarks/setup_trl.sh``), with the same job on both sides: the kit's ``llama-sft`` policy, the same
reward source for all four trainers, a reward model trained once by our RewardTrainer on the kit's
synthetic preference pairs (TRL's PPO 1.12 takes no reward functions; the true reward stays hidden from
every trainer), the kit's train prompts, the same batch, mini-batches, epochs, response length (responses
stop at EOS), learning rate, KL coefficient and sampling temperature. The PPO value model starts as a copy
of the reward model on both sides. GRPO (``--algos grpo``) takes TRL's names on both sides:
``generation_batch_size = --batch`` completions of ``batch / --num-generations`` prompts,
``steps_per_generation = --mini-batches``, ``num_iterations = --epochs``, ``max_completion_length =
--response-length``, ``beta = --beta`` (TRL's default 0), ``loss_type = --loss-type``; its reward is chosen
by ``--grpo-reward`` like RLOO's by ``--rloo-reward``.

The measure is outside every trainer: before training and every ``--eval-every`` updates, the worker
samples ``--eval-samples`` completions for each of the 96 held-out test prompts from the current policy
(temperature 1, top-k 0, top-p 1, stop at EOS, the RNG seeded for the evaluation and restored after it)
and averages their true reward. The gain of a run is its last evaluation minus its first; ours vs TRL
compares the mean gain over seeds at the same number of episodes.

    bash benchmarks/setup_trl.sh
    python benchmarks/learning_vs_trl.py --seeds 0,1,2 --out benchmarks/results

Writes ``<out>/learning_vs_trl<tag>.json``, ``.md`` and ``.png`` (``--render FILE.json`` redraws them).
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

from vs_trl import (  # noqa: E402
    DEFAULT_WORK,
    git_state,
    interpreters,
    machine_name,
    prepare_assets,
    run_worker,
)

ALGOS = ("ppo", "rloo", "grpo")


def run_prepare(cmd: list[str]) -> dict[str, Any]:
    """Run the driver's ``--prepare`` step in its own process (the models and data it builds are freed
    before the workers start) and return the JSON it prints last."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"preparation failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def learning_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The worker settings shared by the learning comparisons (same on both sides of a comparison)."""
    return {
        "batch": args.batch,
        "mini_batches": args.mini_batches,
        "epochs": args.epochs,
        "response_length": args.response_length,
        "fixed_length": False,
        "rloo_k": args.rloo_k,
        "num_generations": args.num_generations,
        "beta": args.beta,
        "loss_type": args.loss_type,
        "learning_rate": args.learning_rate,
        "kl_coef": args.kl_coef,
        "temperature": args.temperature,
        "updates": args.updates,
        "eval_every": args.eval_every,
        "eval_samples": args.eval_samples,
        "threads": args.threads,
    }


def train_reward_model(work: Path) -> dict[str, Any]:
    """The learning runs' reward model: our RewardTrainer on the kit's preference pairs, from
    ``llama-sft`` (saved with its tokenizer to ``<work>/tiny/reward-trained``, once), and its held-out
    pairwise accuracy."""
    import torch

    from rlhf_trainers.testing import get_kit
    from rlhf_trainers.testing.kit_reward import EDGE_CASE_ROWS, edge_case_pairs, train_kit_reward_model

    out = work / "tiny" / "reward-trained"
    info_path = out / "benchmark_info.json"
    # The recipe's edge-case pairs (their number and a digest of the first rows) decide whether a cached model
    # is still the recipe's: a model trained by an older recipe is trained again.
    recipe = {"edge_cases": EDGE_CASE_ROWS, "edge_case_rows": edge_case_pairs("train", 8).to_list()}
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("recipe") == recipe:
            return info
        shutil.rmtree(out)
    kit = get_kit()
    tmp = out.with_name(out.name + ".tmp")
    trainer = train_kit_reward_model(kit, tmp)
    model, tokenizer = trainer.model.eval(), kit.load_tokenizer()
    test = kit.preference_dataset("test")
    correct = 0
    with torch.no_grad():
        for row in test:
            texts = [row["prompt"] + row["chosen"], row["prompt"] + row["rejected"]]
            batch = tokenizer(texts, return_tensors="pt", padding=True)
            scores = model(**batch).logits.squeeze(-1)
            correct += int(scores[0] > scores[1])
    info = {"path": str(out), "test_pairs": len(test), "test_accuracy": correct / len(test), "recipe": recipe}
    (tmp / "benchmark_info.json").write_text(json.dumps(info))
    os.replace(tmp, out)
    return info


def prepare(work: Path) -> dict[str, Any]:
    info = prepare_assets(work, ["tiny"])
    info["reward_model"] = train_reward_model(work)
    return info


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (algo, impl): gains per seed, mean gain, and the mean curve over seeds."""
    out: dict[str, Any] = {}
    for algo in ALGOS:
        for impl in ("ours", "trl"):
            runs = [r for r in results if (r["algo"], r["impl"]) == (algo, impl)]
            if not runs:
                continue
            gains = [r["evals"][-1]["true_reward"] - r["evals"][0]["true_reward"] for r in runs]
            episodes = [e["episodes"] for e in runs[0]["evals"]]
            curve = [
                statistics.mean(r["evals"][i]["true_reward"] for r in runs) for i in range(len(episodes))
            ]
            out[f"{algo} {impl}"] = {
                "seeds": [r["settings"]["seed"] for r in runs],
                "gains": gains,
                "mean_gain": statistics.mean(gains),
                "std_gain": statistics.stdev(gains) if len(gains) > 1 else 0.0,
                "episodes": episodes,
                "mean_curve": curve,
                "final_mean": curve[-1],
                "start_mean": curve[0],
                "train_wall_s_mean": statistics.mean(r["train_wall_s"] - r["eval_wall_s"] for r in runs),
            }
        if f"{algo} ours" in out and f"{algo} trl" in out:
            out[f"{algo} ours - trl mean gain"] = (
                out[f"{algo} ours"]["mean_gain"] - out[f"{algo} trl"]["mean_gain"]
            )
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [a for a in ALGOS if any(r["algo"] == a for r in report["results"])]
    fig, axes = plt.subplots(1, len(algos), figsize=(6 * len(algos), 4.2), squeeze=False)
    colors = {"ours": "tab:blue", "trl": "tab:orange"}
    for ax, algo in zip(axes[0], algos, strict=True):
        for impl in ("ours", "trl"):
            runs = [r for r in report["results"] if (r["algo"], r["impl"]) == (algo, impl)]
            for r in runs:
                xs = [e["episodes"] for e in r["evals"]]
                ax.plot(xs, [e["true_reward"] for e in r["evals"]], color=colors[impl], alpha=0.3, lw=1)
            s = report["summary"].get(f"{algo} {impl}")
            if s:
                name = "ours" if impl == "ours" else f"TRL {runs[0]['versions'].get('trl', '')}"
                ax.plot(
                    s["episodes"],
                    s["mean_curve"],
                    color=colors[impl],
                    lw=2.5,
                    label=f"{name} (mean of {len(runs)}; gain {s['mean_gain']:+.3f})",
                )
        ax.set_title(f"{algo.upper()}: held-out true reward")
        ax.set_xlabel("episodes (completions trained on)")
        ax.set_ylabel("mean true reward of sampled completions")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    reward = {
        "true": "true reward as a reward function",
        "model-text": "same reward model on the same text",
    }.get(reward_kind(report), "same reward model")
    fig.suptitle(f"Offline kit task, tiny Llama, {reward} for all (thin lines: single seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(report: dict[str, Any]) -> list[str]:
    lines = [report["settings_text"], ""]
    lines += [
        "| trainer | seeds | true reward at start (mean) | at the end (mean) | gain per seed | mean gain | "
        "train s per run (mean, eval excluded) |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for key, s in report["summary"].items():
        if not isinstance(s, dict):
            continue
        algo, impl = key.split()
        label = f"{'ours' if impl == 'ours' else 'TRL'} {algo.upper()}"
        gains = ", ".join(f"{g:+.3f}" for g in s["gains"])
        lines.append(
            f"| {label} | {','.join(map(str, s['seeds']))} | {s['start_mean']:.3f} | {s['final_mean']:.3f} | "
            f"{gains} | {s['mean_gain']:+.3f} | {s['train_wall_s_mean']:.1f} |"
        )
    lines.append("")
    for algo in ALGOS:
        diff = report["summary"].get(f"{algo} ours - trl mean gain")
        if diff is not None:
            lines.append(f"- {algo.upper()}: ours - TRL mean gain = {diff:+.3f}")
    for algo in ALGOS:
        ours, trl = report["summary"].get(f"{algo} ours"), report["summary"].get(f"{algo} trl")
        if not (ours and trl):
            continue
        lines += [
            "",
            f"{algo.upper()}, mean true reward over seeds at each evaluation:",
            "",
            "| episodes | " + " | ".join(str(e) for e in ours["episodes"]) + " |",
            "|---|" + "---:|" * len(ours["episodes"]),
            "| ours | " + " | ".join(f"{v:.3f}" for v in ours["mean_curve"]) + " |",
            "| TRL | " + " | ".join(f"{v:.3f}" for v in trl["mean_curve"]) + " |",
        ]
    lines += ["", "Settings that differ between the two sides:", ""]
    algos = {r["algo"] for r in report["results"]}
    notes = (NOTES if algos - {"grpo"} else []) + (NOTES_GRPO if "grpo" in algos else [])
    lines += [f"- {note}" for note in notes]
    return lines


def reward_kind(report: dict[str, Any]) -> str:
    """The reward of a report's runs: ``--grpo-reward`` for a GRPO-only report, else ``--rloo-reward``
    (PPO always uses the model)."""
    algos = {r["algo"] for r in report["results"]}
    if algos == {"grpo"}:
        return report.get("grpo_reward", "model")
    return report.get("rloo_reward", "model")


NOTES_GRPO = [
    "With a reward model, TRL's GRPO decodes each completion (dropping special tokens, so the EOS) and "
    "re-tokenizes prompt + completion text; ours scores the token ids, EOS included (`--grpo-reward "
    "model-text` gives ours TRL's text scoring through a reward function, so both optimise the same reward).",
    "TRL's GRPO splits a generation into micro-batches once and reuses them in every iteration "
    "(`num_iterations`); ours reshuffles every pass.",
    "Both clip gradients at `max_grad_norm=1.0`, count optimizer steps in `max_steps` and decay the "
    "learning rate linearly to 0 per optimizer step.",
    "Old log-probs: TRL's GRPO recomputes them with a no-grad forward; ours takes them from its sampling "
    "loop (float32, the same model; equal up to summation order).",
]

NOTES = [
    "With a reward model, TRL's RLOO decodes each completion (dropping special tokens, so the EOS) and "
    "re-tokenizes prompt + completion text: the reward model reads the last word instead of the EOS it "
    "was trained to end on. Ours and TRL's PPO score the token ids, EOS included. The two RLOO sides "
    "therefore optimise different rewards from the same model (`--rloo-reward model-text` gives our RLOO "
    "the same text scoring through a reward function; `--rloo-reward true` scores both with the true reward).",
    "TRL's PPO never clips gradients; ours and TRL's RLOO clip at `max_grad_norm=1.0`.",
    "TRL's RLOO shuffles a generation batch once and reuses the same mini-batches in every epoch "
    "(`num_iterations`); ours and TRL's PPO reshuffle every epoch.",
    "The learning-rate schedule decays linearly to 0 over the run on every side (TRL's RLOO per optimizer "
    "step, the others per update).",
]


def settings_text(report: dict[str, Any]) -> str:
    s = report["settings"]
    rm = report["reward_model"]
    algos = sorted({r["algo"] for r in report["results"]})
    kind = reward_kind(report)
    edge = (rm.get("recipe") or {}).get("edge_cases", 0)
    pairs = (
        f"the kit's 2048 preference pairs + {edge} edge-case pairs"
        if edge
        else "the kit's 2048 preference pairs"
    )
    if kind == "true":
        source = "reward: the hidden true reward as a reward function (`true_reward`), on both sides"
    elif kind == "model-text":
        source = (
            f"reward: the reward model (llama-sft + head trained by our RewardTrainer on {pairs}, held-out "
            f"pair accuracy {rm['test_accuracy']:.3f}) on prompt + completion text without special tokens, re-tokenized: "
            f"TRL's {'GRPO' if algos == ['grpo'] else 'RLOO'} does this itself, ours through a reward function "
            "that does the same"
        )
    else:
        source = (
            f"reward model = llama-sft + head trained by our RewardTrainer on {pairs} (held-out pair "
            f"accuracy {rm['test_accuracy']:.3f}), the same for all trainers"
        )
    if algos == ["grpo"]:
        G = s["num_generations"]
        shape = (
            f"{s['batch']} completions per generation ({s['batch'] // G} prompts x num_generations={G}), "
            f"steps_per_generation {s['mini_batches']} x num_iterations {s['epochs']} = "
            f"{s['mini_batches'] * s['epochs']} optimizer steps per generation (update), max_completion_length "
            f"{s['response_length']} (stop at EOS), learning rate {s['learning_rate']}, beta {s['beta']}, "
            f"loss_type {s['loss_type']}, temperature "
        )
    else:
        shape = (
            f"{s['batch']} completions per update (PPO {s['batch']} prompts, RLOO {s['batch'] // s['rloo_k']} x "
            f"rloo_k={s['rloo_k']}), {s['mini_batches']} mini-batches, {s['epochs']} epochs, response_length "
            f"{s['response_length']} (stop at EOS), learning rate {s['learning_rate']}, kl_coef {s['kl_coef']}, "
            "temperature "
        )
    return (
        f"{report['machine']}, torch {report['torch']}; TRL {', '.join(report['trl_versions'])}; "
        f"{'/'.join(a.upper() for a in algos)}. Kit `llama-sft` policy; {source}; {shape}"
        f"{s['temperature']}, {s['updates']} updates ({s['updates'] * s['batch']} episodes); true reward of "
        f"{s['eval_samples']} samples per held-out prompt (96 prompts) every {s['eval_every']} updates."
    )


def write(report: dict[str, Any], out: Path, tag: str) -> None:
    report["summary"] = summarize(report["results"])
    report["settings_text"] = settings_text(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"learning_vs_trl{tag}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = table(report)
    (out / f"learning_vs_trl{tag}.md").write_text("\n".join(lines) + "\n")
    plot(report, out / f"learning_vs_trl{tag}.png")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--algos", default="ppo,rloo")
    parser.add_argument("--impls", default="ours,trl", help="which sides run: ours, trl or both")
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=2, help="samples per held-out prompt")
    parser.add_argument("--batch", type=int, default=16, help="completions per update")
    parser.add_argument("--mini-batches", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--response-length", type=int, default=12)
    parser.add_argument("--rloo-k", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=4, help="GRPO: completions per prompt")
    parser.add_argument("--beta", type=float, default=0.0, help="GRPO: KL loss coefficient (TRL's default 0)")
    parser.add_argument("--loss-type", default="dapo", help="GRPO: loss_type (TRL's default dapo)")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--rloo-reward",
        choices=["model", "model-text", "true"],
        default="model",
        help="RLOO's reward: the trained reward model; 'model-text': the same model, but our RLOO scores "
        "through a reward function that does what TRL's RLOO does with a reward model (prompt + completion "
        "text without special tokens, re-tokenized), so both sides optimise the same reward; or the hidden "
        "true reward as a reward function (both sides support one; TRL 1.12's PPO does not, so PPO always "
        "uses the model)",
    )
    parser.add_argument(
        "--grpo-reward",
        choices=["model", "model-text", "true"],
        default="model",
        help="GRPO's reward, as --rloo-reward (TRL's GRPO scores text with a reward model, as its RLOO does)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per worker (0: torch's default)"
    )
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK))
    parser.add_argument("--trl-ppo-python", help="python of the trl==1.12.0 venv")
    parser.add_argument("--trl-rloo-python", help="python of the newest-trl venv")
    parser.add_argument("--ours-python", help="python of the venv with this project (default: .venvs/ours)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--render", metavar="JSON", help="only redraw the table and plot of a result file")
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work_dir).expanduser()
    if args.render:
        path = Path(args.render)
        write(json.loads(path.read_text()), path.parent, path.stem[len("learning_vs_trl") :])
        return
    if args.prepare:
        print(json.dumps(prepare(work)))
        return
    pythons = interpreters(args)
    info = run_prepare([sys.executable, __file__, "--prepare", f"--work-dir={work}"])
    settings = learning_settings(args)
    results = []
    for algo in [a for a in args.algos.split(",") if a]:
        for i, seed in enumerate(int(x) for x in args.seeds.split(",")):
            order = ("ours", "trl") if i % 2 == 0 else ("trl", "ours")
            for impl in [x for x in order if x in args.impls.split(",")]:
                spec = {
                    "impl": impl,
                    "algo": algo,
                    "policy": info["tiny"]["policy"],
                    "reward": info["reward_model"]["path"],
                    "prompts": info["prompts"],
                    "task_py": str(ROOT / "rlhf_trainers" / "testing" / "task.py"),
                    "settings": {
                        **settings,
                        "seed": seed,
                        "reward_source": {"rloo": args.rloo_reward, "grpo": args.grpo_reward}.get(
                            algo, "model"
                        ).replace("-", "_"),
                    },
                }
                name = f"learning{args.tag}-{impl}-{algo}-seed{seed}"
                r = run_worker(pythons[(impl, algo)], spec, work / "logs", name)
                results.append(r)
                e = r["evals"]
                print(
                    f"{name}: true reward {e[0]['true_reward']:.3f} -> {e[-1]['true_reward']:.3f} "
                    f"({e[-1]['episodes']} episodes, train {r['train_wall_s'] - r['eval_wall_s']:.0f} s)",
                    flush=True,
                )

    import torch

    report = {
        "benchmark": "learning_vs_trl",
        "machine": machine_name(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "trl_versions": sorted({r["versions"]["trl"] for r in results if "trl" in r["versions"]}),
        "git": git_state(),
        "settings": settings,
        "reward_model": info["reward_model"],
        "rloo_reward": args.rloo_reward,
        "grpo_reward": args.grpo_reward,
        "results": results,
    }
    write(report, Path(args.out), args.tag)


if __name__ == "__main__":
    main()
