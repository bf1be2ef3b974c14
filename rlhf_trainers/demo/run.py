"""The demo's pipeline: task, reward model, PPO and RLOO, then the report (:func:`run_demo`)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .arguments import DemoArguments
from .progress import Stage, quiet, timed_stage
from .report import (
    check_plotting,
    collect_sample_rows,
    format_table,
    json_default,
    plot_learning_curves,
    print_samples,
    summary_rows,
    write_csv,
)
from .task import Task, check_smollm2, kit_task, seed_everything, smollm2_task

# ---- labels on the policy's own samples (smollm2) --------------------------------------------------


def _label_policy_samples(task: Task, args: DemoArguments) -> dict[str, Any]:
    """The reference implementation's labelling, with the hidden rule as the labeller: 4 completions of
    each label prompt sampled from the starting policy, the best preferred to each lower one. Sets
    ``task.preferences_train`` / ``preferences_test`` (token ids, as the trainers' rollouts hold them);
    the train samples are kept for the reward normalization. Returns the counts for the report."""
    import torch
    from transformers import AutoModelForCausalLM

    from .preferences import on_policy_preferences

    assert task.label_prompts is not None and task.label_test_prompts is not None
    seed_everything(args.seed)
    policy = AutoModelForCausalLM.from_pretrained(task.sft_dir).eval()
    info: dict[str, Any] = {"samples_per_prompt": 4, "temperature": args.temperature}
    for split, prompts in (("train", task.label_prompts), ("test", task.label_test_prompts)):
        with torch.no_grad():
            pairs, groups, counts = on_policy_preferences(
                policy,
                task.tokenizer,
                list(prompts["prompt"]),
                task.true_reward,
                samples_per_prompt=4,
                response_length=args.response_length,
                temperature=args.temperature,
                batch_size=64,
                swaps=task.label_swaps,
                seed=args.seed,
            )
        rewards = [r for g in groups for r in task.true_reward(None, g.texts)]
        info[split] = {**counts, "mean_true_reward": sum(rewards) / len(rewards)}
        if split == "train":
            task.preferences_train, task.label_samples = pairs, groups
        else:
            task.preferences_test = pairs
        print(
            f"    {split}: {counts['groups']} prompts x 4 samples (mean true reward "
            f"{info[split]['mean_true_reward']:+.3f}); {counts['groups_tied_at_top']} with a tie for the "
            f"best; {counts['pairs']} pairs ({counts.get('best_of_n_pairs', counts['pairs'])} best of 4, "
            f"{counts.get('word_swap_pairs', 0)} one-word swaps)"
        )
    return info


# ---- reward model ----------------------------------------------------------------------------------


def _train_reward_model(task: Task, args: DemoArguments, out_dir: Path) -> dict[str, Any]:
    from ..reward import RewardConfig, RewardTrainer

    seed_everything(args.seed)
    peft_config = None
    if task.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="SEQ_CLS"
        )
    kit = task.name == "kit"
    config = RewardConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=32 if kit else 8,
        per_device_eval_batch_size=64 if kit else 16,
        learning_rate=3e-3 if kit else 2e-3,
        num_train_epochs=1,
        max_length=task.reward_max_length,
        logging_steps=5,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
        # The SmolLM2 pairs are token ids of the policy's own samples, ending as rollouts end (EOS or cut
        # at response_length); they are normalized below on those samples, as the trainers will score them.
        reward_normalization="after" if kit else "no",
        normalization_num_samples=256,
        normalization_response_length=args.response_length,
        normalization_batch_size=64,
    )
    trainer = RewardTrainer(
        model=task.sft_dir,
        args=config,
        train_dataset=task.preferences_train,
        eval_dataset=task.preferences_test,
        processing_class=task.tokenizer,
        peft_config=peft_config,
        normalization_policy=task.sft_dir if kit else None,
        normalization_tokenizer=task.tokenizer,
        normalization_prompts=task.train_prompts if kit else None,
    )
    quiet(trainer, "reward model", {"loss": "loss", "accuracy": "acc"})
    before = trainer.evaluate()
    trainer.train()
    if task.label_samples is not None:
        _normalize_on_samples(trainer, task)
    after = trainer.evaluate()
    trainer.save_model(str(out_dir))
    task.tokenizer.save_pretrained(str(out_dir))
    from ..models import get_reward_normalization

    gain, bias = get_reward_normalization(trainer.accelerator.unwrap_model(trainer.model))
    print(
        f"    held-out preference accuracy {before['eval_accuracy']:.3f} -> {after['eval_accuracy']:.3f}; "
        f"normalization on the starting policy's samples: gain {gain:.3f}, bias {bias:+.3f}"
    )
    return {
        "pairs": len(task.preferences_train),
        "eval_pairs": len(task.preferences_test),
        "eval_accuracy_before": before["eval_accuracy"],
        "eval_accuracy_after": after["eval_accuracy"],
        "eval_loss_after": after["eval_loss"],
        "normalization_gain": gain,
        "normalization_bias": bias,
    }


def _normalize_on_samples(trainer: Any, task: Task, num_samples: int = 128) -> None:
    """The reference implementation's reward normalization "after", on samples of the starting policy
    that are already there: the labelled samples (token ids, scored exactly as the trainers score their
    rollouts), the first ``num_samples`` of them, so that they get mean 0 and std 1."""
    from .. import functional as F
    from ..models import set_reward_normalization
    from ..rewards import score_ids
    from .preferences import right_padded, sequences

    model = trainer.model
    was_training = model.training
    model.eval()
    rows = sequences(task.label_samples)[:num_samples]
    pad = task.tokenizer.pad_token_id
    raw = score_ids(model, right_padded(rows, pad), pad, normalize=False, batch_size=32)
    model.train(was_training)
    gain, bias = F.normalize_rewards_gain_bias(raw)
    set_reward_normalization(model, gain, bias)


# ---- PPO and RLOO ----------------------------------------------------------------------------------


#: ``--model smollm2``: PPO's value model learns at ``--learning_rate`` times this (both policies at
#: ``--learning_rate``).
SMOLLM2_CRITIC_LR_FACTOR = 0.5


def _onpolicy_config(kind: str, task: Task, args: DemoArguments, out_dir: Path) -> Any:
    from ..ppo import PPOConfig
    from ..rloo import RLOOConfig

    common: dict[str, Any] = {
        "output_dir": str(out_dir),
        "max_steps": args.ppo_updates if kind == "ppo" else args.rloo_updates,
        # rollout_size completions per update in 2 mini-batches of one micro-batch each.
        "per_device_train_batch_size": args.rollout_size // 2,
        "num_mini_batches": 2,
        # SmolLM2: one pass over each rollout; a second epoch doubled the update time and, with a LoRA
        # learning rate that moves the policy at all in 16 updates, overshot (clip fraction above 0.5).
        "num_ppo_epochs": 2 if task.name == "kit" else 1,
        "learning_rate": args.learning_rate,
        "response_length": args.response_length,
        "temperature": args.temperature,
        "kl_coef": args.kl_coef,
        # The reward model steers; the hidden true reward is only logged (objective/scores/<name>).
        "reward_weights": [1.0, 0.0],
        "local_rollout_forward_batch_size": 128 if task.name == "kit" else 16,
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "num_sample_generations": 0,
        "report_to": "none",
        "use_cpu": True,
        "seed": args.seed,
        "disable_tqdm": True,
    }
    if kind == "ppo":
        if task.name != "kit":
            # SmolLM2: the value model is a full copy of the model (no adapter) and learns at half the LoRA
            # policy's rate. With both at 1e-3 it collapsed on one seed of two (one large step at the second
            # update, explained variance ~0 after it, so the advantages lost their baseline); at 5e-4 it
            # kept learning (explained variance 0.5-0.6). Measured in docs/demo.md.
            common["critic_learning_rate"] = args.learning_rate * SMOLLM2_CRITIC_LR_FACTOR
        return PPOConfig(**common)
    return RLOOConfig(rloo_k=args.rloo_k, **common)


def _sample(trainer: Any, prompts: list[Any], seed: int) -> list[dict[str, Any]]:
    """Completions of ``trainer``'s current policy for ``prompts``, sampled and scored by the engine's own
    steps (as in evaluation) from a fixed seed without touching the global RNG."""
    import torch
    from datasets import Dataset

    data = trainer.tokenized_prompts(Dataset.from_dict({"prompt": prompts}), "samples")
    batch = trainer.data_collator([data[i] for i in range(len(data))])
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        _, scores = trainer.producer.sample_and_score(batch)
    rm_name, true_name = trainer.reward_sources.names
    return [
        {
            "prompt": _as_text(prompts[i]),
            "completion": scores.completions[i],
            "true_reward": float(scores.per_source[true_name][i]),
            "rm_score": float(scores.per_source[rm_name][i]),
        }
        for i in range(len(prompts))
    ]


def _as_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages: the last (user) message
        return str(prompt[-1].get("content", "")) if prompt else ""
    return str(prompt)


def _run_onpolicy(
    kind: str, task: Task, reward_dir: Path, args: DemoArguments, out_dir: Path, sample_prompts: list[Any]
) -> dict[str, Any]:
    """Train the SFT policy with PPO or RLOO against the reward model; evaluate before and after."""
    from ..ppo import PPOTrainer
    from ..rloo import RLOOTrainer

    seed_everything(args.seed)
    config = _onpolicy_config(kind, task, args, out_dir)
    peft_config = None
    if task.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    trainer_cls = PPOTrainer if kind == "ppo" else RLOOTrainer
    trainer = trainer_cls(
        model=task.sft_dir,
        reward_model=str(reward_dir),
        reward_funcs=[task.true_reward],
        args=config,
        processing_class=task.tokenizer,
        train_dataset=task.train_prompts,
        eval_dataset=task.eval_prompts,
        peft_config=peft_config,
    )
    rm_name, true_name = trainer.reward_sources.names
    quiet(
        trainer,
        kind.upper(),
        {f"objective/scores/{true_name}": "true reward", "objective/scores": "RM", "objective/kl": "KL"},
    )
    seed = args.seed + 12345
    samples_before = _sample(trainer, sample_prompts, seed)
    before = trainer.evaluate()
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    after = trainer.evaluate()
    samples_after = _sample(trainer, sample_prompts, seed)
    # The trained policy (a LoRA adapter for smollm2) and its tokenizer; not PPO's value model, a
    # training by-product (a full 135M copy for smollm2).
    trainer.policy.save_pretrained(str(out_dir))
    task.tokenizer.save_pretrained(str(out_dir))

    history = []
    for entry in trainer.state.log_history:
        if "objective/kl" not in entry:
            continue  # the eval entries
        row = {"update": entry.get("step"), "episode": entry["episode"]}
        row["true_reward"] = entry[f"objective/scores/{true_name}"]
        row["rm_score"] = entry[f"objective/scores/{rm_name}"]
        row.update({k: v for k, v in entry.items() if k not in ("step", "episode")})
        history.append(row)
    tail = history[-5:]
    result = {
        "trainer": kind.upper(),
        "updates": trainer.state.global_step,
        "episodes": trainer.total_episodes,
        "batch_accounting": trainer.batch_accounting(),
        "true_reward_before": before[f"eval_objective/scores/{true_name}"],
        "true_reward_after": after[f"eval_objective/scores/{true_name}"],
        "rm_score_before": before[f"eval_objective/scores/{rm_name}"],
        "rm_score_after": after[f"eval_objective/scores/{rm_name}"],
        "response_length_before": before["eval_val/response_length"],
        "response_length_after": after["eval_val/response_length"],
        "final_kl": sum(r["objective/kl"] for r in tail) / len(tail),
        "train_seconds": train_seconds,
        "eval_before": before,
        "eval_after": after,
        "history": history,
        "samples_before": samples_before,
        "samples_after": samples_after,
    }
    print(
        f"    held-out true reward {result['true_reward_before']:+.3f} -> {result['true_reward_after']:+.3f}, "
        f"RM score {result['rm_score_before']:+.3f} -> {result['rm_score_after']:+.3f}, "
        f"KL {result['final_kl']:.2f} (mean of the last {len(tail)} updates)"
    )
    return result


# ---- the demo --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _demo_environment(threads: int | None) -> Iterator[None]:
    """The torch thread count for the run, no per-dataset-map progress bars (the stages have their own),
    transformers' warnings only and no FutureWarnings; all restored afterwards."""
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    bars = datasets.is_progress_bar_enabled()
    old_threads = torch.get_num_threads()
    verbosity = hf_logging.get_verbosity()
    datasets.disable_progress_bars()
    # Load reports ("score.weight MISSING" when a LoRA reward model's base is loaded before its adapter)
    # and other info-level notes would interleave with the stages' output.
    hf_logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():
            # Deprecation notes of the libraries (e.g. peft calling transformers'
            # is_gradient_checkpointing) say nothing about the demo.
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        torch.set_num_threads(old_threads)
        hf_logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def run_demo(args: DemoArguments) -> dict[str, Any]:
    """Run the whole pipeline and write the report; returns the summary (also ``summary.json``)."""
    check_plotting()
    if args.model == "smollm2":
        check_smollm2(args)
    with _demo_environment(args.threads or (1 if args.model == "kit" else None)):
        return _run(args)


def _run(args: DemoArguments) -> dict[str, Any]:
    import torch
    import transformers

    out = Path(args.output_dir)
    models_dir = out / "models"
    out.mkdir(parents=True, exist_ok=True)
    # kit: kit, [SFT], reward model, PPO, RLOO; smollm2: model, labels, reward model, PPO, RLOO.
    total = 4 if (args.model == "kit" and not args.sft_steps) else 5
    stages: list[Stage] = []
    start = time.perf_counter()
    policy = "SFT of the kit's tiny Llama" if args.model == "kit" else "SmolLM2-135M-Instruct (already SFT)"
    print(
        f"rlhf-trainers demo --model {args.model}: {policy} -> reward model (RewardTrainer) -> PPOTrainer and "
        f"RLOOTrainer against it, the hidden true reward evaluated before and after. Report: {out}/"
    )
    task = (kit_task if args.model == "kit" else smollm2_task)(args, models_dir, stages, total)
    label_info = None
    if task.preferences_train is None:
        with timed_stage(
            stages,
            len(stages) + 1,
            total,
            f"labels: 4 samples of each of {len(task.label_prompts)} train prompts from the policy, the best "
            "by the hidden rule preferred to each lower one",
        ):
            label_info = _label_policy_samples(task, args)
    number = len(stages) + 1
    with timed_stage(
        stages,
        number,
        total,
        f"reward model: RewardTrainer on {len(task.preferences_train)} preference pairs",
    ):
        reward_info = _train_reward_model(task, args, models_dir / "reward_model")
    sample_prompts = list(task.eval_prompts["prompt"])[: args.sample_rows] if args.sample_rows else []
    results: dict[str, dict[str, Any]] = {}
    by_name: dict[str, Stage] = {}
    for offset, kind in enumerate(("ppo", "rloo")):
        updates = args.ppo_updates if kind == "ppo" else args.rloo_updates
        with timed_stage(
            stages, number + 1 + offset, total, f"{kind.upper()}: {updates} updates against the reward model"
        ) as st:
            results[kind] = _run_onpolicy(
                kind, task, models_dir / "reward_model", args, models_dir / kind, sample_prompts
            )
        by_name[kind] = st
    wall = time.perf_counter() - start

    samples = collect_sample_rows(results) if sample_prompts else []
    if samples:
        print_samples(samples, width=60 if args.model == "kit" else 90, temperature=args.temperature)
    trainer_rows = summary_rows(results, by_name)
    _print_summary(trainer_rows, stages, wall)
    summary = {
        "model": args.model,
        "wall_seconds": wall,
        "trainers": trainer_rows,
        "stages": [asdict(s) for s in stages],
        "sft": task.notes.get("sft"),
        "labels": label_info,
        "reward_model": reward_info,
        "ppo": {
            k: v for k, v in results["ppo"].items() if k not in ("history", "samples_before", "samples_after")
        },
        "rloo": {
            k: v
            for k, v in results["rloo"].items()
            if k not in ("history", "samples_before", "samples_after")
        },
        "samples": samples,
        "args": asdict(args),
        "notes": task.notes,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
        },
    }
    _write_report(out, models_dir, summary, results, samples, args)
    return summary


def _print_summary(trainer_rows: list[dict[str, Any]], stages: list[Stage], wall: float) -> None:
    """The summary table of the trainers and the time of each stage."""
    print("\nSummary (held-out prompts; true reward: the hidden rule, never seen by the trainers):")
    print(
        format_table(
            [
                "trainer",
                "updates",
                "true reward before -> after",
                "RM score before -> after",
                "final KL",
                "train time",
                "peak RSS",
            ],
            [
                [
                    r["trainer"],
                    str(r["updates"]),
                    f"{r['true_reward_before']:+.3f} -> {r['true_reward_after']:+.3f}",
                    f"{r['rm_score_before']:+.3f} -> {r['rm_score_after']:+.3f}",
                    f"{r['final_kl']:.2f}",
                    f"{r['train_seconds']:.1f} s",
                    f"{r['peak_rss_mib']:.0f} MiB",
                ]
                for r in trainer_rows
            ],
        )
    )
    print(
        "\nstages: "
        + ", ".join(f"{s.name.split(':')[0]} {s.seconds:.1f} s" for s in stages)
        + f"; total {wall:.1f} s"
    )


def _write_report(
    out: Path,
    models_dir: Path,
    summary: dict[str, Any],
    results: dict[str, dict[str, Any]],
    samples: list[dict[str, Any]],
    args: DemoArguments,
) -> None:
    """summary.json/.csv, stages.csv, the log histories, samples.csv and the learning curves in ``out``."""
    trainer_rows, stages = summary["trainers"], summary["stages"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=json_default))
    write_csv(out / "summary.csv", trainer_rows)
    write_csv(out / "stages.csv", stages)
    for kind in ("ppo", "rloo"):
        write_csv(out / f"{kind}_log_history.csv", results[kind]["history"])
    (out / "log_history.json").write_text(
        json.dumps({k: results[k]["history"] for k in ("ppo", "rloo")}, indent=1, default=json_default)
    )
    if samples:
        write_csv(out / "samples.csv", samples)
    plot_learning_curves(
        results,
        out / "learning_curves.png",
        f"rlhf-trainers demo ({'offline kit, tiny Llama' if args.model == 'kit' else 'SmolLM2-135M-Instruct + LoRA'})",
    )
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    print(f"\nreport written to {out}/: {', '.join(files)} (trained models under {models_dir}/)")
