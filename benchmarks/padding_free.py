"""Padded vs padding-free (``padding_free``) forward passes on a variable-length workload: tokens/s and
peak RSS of the rollout's forward passes (policy, reference, values) and of the training update, for PPO
and RLOO, at the offline kit's size and at SmolLM2-135M.

Workload: ``--batch`` completions per update (PPO: that many prompts; RLOO: ``--batch / --rloo-k`` prompts
x ``--rloo-k``), ``response_length`` 64 (``--response-length``), the kit's text prompts. Responses are
sampled by the model, then each is cut at a length drawn uniformly from 2 to the limit (seeded per update,
the same in both modes), with the stop token (EOS) as its last token: the lengths spread from a few tokens
to the limit whatever the model would have written. Reward: the kit's hidden reward function (no reward
model: its scoring is not packed). ``per_device_train_batch_size`` x ``gradient_accumulation_steps`` =
``--micro-batch`` x ``--batch / --micro-batch`` (one mini-batch, one epoch), float32, one thread.

Each (size, algorithm, mode) runs in its own subprocess. Per update, the RSS high-water (``VmHWM``) is
reset (``/proc/self/clear_refs``, Linux) just before the rollout's forward passes and before the
update, and read after each: ``peak_rss_mib`` is the process's peak during the phase (models included),
``extra_mib`` that minus the RSS just before it. Tokens/s counts real tokens (prompt + response, no
padding) over the phase's seconds; the update's counts each token once per epoch. Medians over the
updates after the first (warm-up).

With ``--interleaved``, timing only and less exposed to other work on a shared machine: one process per
(size, algorithm) runs both modes on the same samples, alternating which goes first, ``--updates`` rounds
of: the rollout's forward passes, then the training forward + backward passes of the update's
micro-batches (the algorithm's loss; gradients zeroed, no optimizer step, so the model stays the same).
It reports each round's padded / packed time ratio (median over the rounds after the first).

    python benchmarks/padding_free.py --sizes tiny smollm2-135m --out benchmarks/results
    python benchmarks/padding_free.py --interleaved --updates 5 --out benchmarks/results

Writes ``<out>/padding_free<tag>.json`` (``padding_free_interleaved<tag>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from onpolicy_memory import _reset_rss_high_water, _rss_bytes  # benchmarks/ is on sys.path

SIZES = ("tiny", "smollm2-135m")
ALGORITHMS = ("ppo", "rloo")
MODES = ("padded", "padding_free")


def _high_water_bytes() -> int:
    """The RSS high-water (``VmHWM``) since the last reset."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trainer_for(algorithm: str, model, tokenizer, dataset, reward, *, rloo_k: int, **config):
    """The PPO or RLOO trainer of the benchmark's job: one mini-batch, one epoch, temperature 1, nothing
    saved, the policy pass run in both modes (in float32 the padded path would reuse generation's
    log-probs); ``config`` holds the batch sizes, lengths, device and ``padding_free``."""
    from rlhf_trainers import PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer

    common = dict(
        output_dir=tempfile.mkdtemp(),
        num_mini_batches=1,
        num_ppo_epochs=1,
        temperature=1.0,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        num_sample_generations=0,
        disable_tqdm=True,
        rollout_logprobs="forward",
        **config,
    )
    if algorithm == "ppo":
        args = PPOConfig(**common)
        return PPOTrainer(
            model=model, processing_class=tokenizer, args=args, train_dataset=dataset, reward_funcs=reward
        )
    args = RLOOConfig(rloo_k=rloo_k, **common)
    return RLOOTrainer(
        model=model, processing_class=tokenizer, args=args, train_dataset=dataset, reward_funcs=reward
    )


def _build(args: argparse.Namespace, padding_free: bool):
    """The trainer of one run and its tokenizer."""
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlhf_trainers.testing import get_kit, true_reward

    kit = get_kit()
    if args.size == "tiny":
        policy, tokenizer = kit.load_model("llama-sft"), kit.load_tokenizer()
    else:
        from transformers import AutoModelForCausalLM

        from rlhf_trainers.testing.smollm2 import load_smollm2_tokenizer, smollm2_folder

        policy = AutoModelForCausalLM.from_pretrained(smollm2_folder())
        tokenizer = load_smollm2_tokenizer()
        policy.config.pad_token_id = tokenizer.pad_token_id
        policy.generation_config.pad_token_id = tokenizer.pad_token_id
    trainer = trainer_for(
        args.algorithm,
        policy,
        tokenizer,
        kit.prompt_dataset("train", n=1024),
        true_reward,
        rloo_k=args.rloo_k,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.batch // args.micro_batch,
        response_length=args.response_length,
        max_steps=args.updates,
        use_cpu=True,
        seed=args.seed,
        padding_free=padding_free,
    )
    return trainer, tokenizer


def _cut(samples, generator, eos: int, pad: int):
    """Each response cut at a length drawn from 2 to R, the stop token (EOS) its last token."""
    import torch

    n, R = samples.response.shape
    device = samples.response.device
    lengths = torch.randint(2, R + 1, (n,), generator=generator).to(device)
    keep = torch.arange(R, device=device)[None, :] < lengths[:, None]
    response = samples.response.masked_fill(~keep, pad)
    response[torch.arange(n, device=device), lengths - 1] = eos
    samples.response, samples.response_mask, samples.lengths = response, keep, lengths
    return samples


def _child(args: argparse.Namespace) -> None:
    import torch

    trainer, tokenizer = _build(args, args.mode == "padding_free")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    phases: dict[str, list[dict[str, float]]] = {"rollout_passes": [], "update": []}
    tokens: list[int] = []
    sample = trainer.producer.sample
    rollout_logprobs = trainer.passes.logprobs
    optimize = trainer._optimize

    def cut_samples(*a, **kw):
        generator = torch.Generator().manual_seed(args.seed * 1000 + len(tokens))
        samples = _cut(sample(*a, **kw), generator, eos, pad)
        tokens.append(int(samples.query_mask.sum() + samples.response_mask.sum()))
        return samples

    def measured(name, fn):
        def run(*a, **kw):
            before = _rss_bytes()
            _reset_rss_high_water()
            began = time.perf_counter()
            out = fn(*a, **kw)
            seconds = time.perf_counter() - began
            peak = _high_water_bytes()
            phases[name].append({"seconds": seconds, "peak_rss": peak, "extra": peak - before})
            return out

        return run

    trainer.producer.sample = cut_samples
    trainer.passes.logprobs = measured("rollout_passes", rollout_logprobs)
    trainer._optimize = measured("update", optimize)
    trainer.train()
    mib = 2**20
    result = {
        "size": args.size,
        "algorithm": args.algorithm,
        "mode": args.mode,
        "packed_models": {
            "policy": trainer.passes.pack_policy,
            "reference": trainer.passes.pack_ref,
            "values": trainer.passes.pack_values,
        },
        "batch_accounting": trainer.batch_accounting(),
        "real_tokens_per_update": tokens,
    }
    for name, records in phases.items():
        steady = records[1:] or records
        seconds = statistics.median(r["seconds"] for r in steady)
        result[name] = {
            "seconds_median": seconds,
            "seconds_all": [r["seconds"] for r in records],
            "tokens_per_second": statistics.median(
                t / r["seconds"] for t, r in zip(tokens[1:] or tokens, steady, strict=True)
            ),
            # the best update: on a shared machine, the one least slowed by other processes
            "tokens_per_second_best": max(
                t / r["seconds"] for t, r in zip(tokens[1:] or tokens, steady, strict=True)
            ),
            "peak_rss_mib": max(r["peak_rss"] for r in steady) / mib,
            "extra_mib": max(r["extra"] for r in steady) / mib,
        }
    print("RESULT " + json.dumps(result))


def interleaved_rounds(
    trainer,
    tokenizer,
    *,
    updates: int,
    seed: int,
    micro_batch: int,
    sync=None,
    memory=None,
) -> dict:
    """Timing of both modes on the same samples, alternating which goes first: per round, the rollout's
    forward passes and the training forward + backward passes of the update's micro-batches (the loss of
    the algorithm, gradients zeroed after, no optimizer step: the model stays the same), once padded and
    once packed. ``sync`` (e.g. ``torch.cuda.synchronize``) is called before each clock read; ``memory``,
    a pair (reset, read) of callables, records the peak memory of each phase (``<mode>/<phase>/peak``).
    Also records, from the first round, the largest |packed - padded| difference of the rollout's
    log-probs (and values) over real response tokens. Returns the rounds and their medians."""
    import torch

    sync = sync or (lambda: None)
    # the training precision, as the update runs every pass (bf16/fp16 autocast; a no-op in fp32)
    autocast = trainer.accelerator.autocast
    model = trainer.model
    flags = (trainer.passes.pack_policy, trainer.passes.pack_ref, trainer.passes.pack_values)
    rounds: list[dict[str, float]] = []
    differences: dict[str, float] = {}
    for round_ in range(updates):
        generator = torch.Generator().manual_seed(seed * 1000 + round_)
        sync()
        began = time.perf_counter()
        with torch.no_grad(), autocast():
            samples = trainer.producer.sample(
                trainer.producer.prompt_batch(round_), trainer.completions_per_prompt
            )
        sync()
        sampling = time.perf_counter() - began
        samples = _cut(samples, generator, tokenizer.eos_token_id, tokenizer.pad_token_id)
        record = {"tokens": float(samples.query_mask.sum() + samples.response_mask.sum())}
        record["sampling_seconds"] = sampling  # not compared: the samples are shared by both modes
        modes = MODES if round_ % 2 == 0 else MODES[::-1]
        rollout = None
        outputs = {}
        for mode in modes:
            on = mode == "padding_free"
            trainer.passes.pack_policy, trainer.passes.pack_ref, trainer.passes.pack_values = (
                f and on for f in flags
            )
            if memory:
                memory[0]()
            sync()
            began = time.perf_counter()
            with torch.no_grad(), autocast():
                passes = trainer.passes.logprobs(samples)
            sync()
            record[f"{mode}/rollout_passes"] = time.perf_counter() - began
            if memory:
                record[f"{mode}/rollout_passes/peak"] = memory[1]()
            outputs[mode] = passes
            if rollout is None:
                with torch.no_grad(), autocast():
                    rollout = trainer.producer.assemble(samples, trainer.producer.score(samples), passes)
                advantages = trainer.compute_advantages(rollout, trainer.token_rewards(rollout))
            if memory:
                memory[0]()
            sync()
            began = time.perf_counter()
            for rows in torch.arange(rollout.response.shape[0]).split(micro_batch):
                with autocast():
                    logprobs, values, entropy = trainer.loop.training_forward(model, rollout, rows)
                    bonus = entropy if trainer.args.entropy_coeff else None
                    loss, _ = trainer.compute_policy_loss(
                        rollout, advantages, rows, logprobs, values, entropy=bonus
                    )
                loss.backward()
            model.zero_grad(set_to_none=True)
            sync()
            record[f"{mode}/train_passes"] = time.perf_counter() - began
            if memory:
                record[f"{mode}/train_passes/peak"] = memory[1]()
        if round_ == 0:
            mask = samples.response_mask.to(outputs["padded"].logprobs.device)
            for name in ("logprobs", "ref_logprobs", "values"):
                a, b = getattr(outputs["padded"], name), getattr(outputs["padding_free"], name)
                if a is not None:
                    differences[name] = float((a - b).abs()[mask].max())
        rounds.append(record)
    trainer.passes.pack_policy, trainer.passes.pack_ref, trainer.passes.pack_values = flags
    steady = rounds[1:] or rounds
    result = {"rounds": rounds, "packed_models": list(flags), "max_abs_difference_round_0": differences}
    for phase in ("rollout_passes", "train_passes"):
        result[phase] = {
            mode: {
                "seconds_median": statistics.median(r[f"{mode}/{phase}"] for r in steady),
                "tokens_per_second_median": statistics.median(
                    r["tokens"] / r[f"{mode}/{phase}"] for r in steady
                ),
            }
            for mode in MODES
        }
        if memory:
            for mode in MODES:
                result[phase][mode]["peak_max"] = max(r[f"{mode}/{phase}/peak"] for r in steady)
        # Paired: each round's padded time over its packed time (the same samples, moments apart).
        result[phase]["speedup_median"] = statistics.median(
            r[f"padded/{phase}"] / r[f"padding_free/{phase}"] for r in steady
        )
    return result


def _child_interleaved(args: argparse.Namespace) -> None:
    """Timing only, both modes in one process, alternating on the same samples (so that other work on
    the machine slows both alike): :func:`interleaved_rounds`."""
    trainer, tokenizer = _build(args, True)
    result = {"size": args.size, "algorithm": args.algorithm}
    result.update(
        interleaved_rounds(
            trainer, tokenizer, updates=args.updates, seed=args.seed, micro_batch=args.micro_batch
        )
    )
    print("RESULT " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--batch", type=int, default=16, help="completions per update")
    parser.add_argument("--micro-batch", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--rloo-k", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="timing only: both modes in one process per (size, algorithm), alternating on the same samples",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--algorithm", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        (_child_interleaved if args.mode == "both" else _child)(args)
        return
    if args.interleaved:
        _interleaved_main(args)
        return
    runs = []
    for size in args.sizes:
        for algorithm in args.algorithms:
            for mode in MODES:
                command = [sys.executable, __file__, "--child", "--size", size, "--algorithm", algorithm]
                command += [
                    "--mode",
                    mode,
                    "--batch",
                    str(args.batch),
                    "--micro-batch",
                    str(args.micro_batch),
                ]
                command += ["--rloo-k", str(args.rloo_k), "--response-length", str(args.response_length)]
                command += ["--updates", str(args.updates), "--threads", str(args.threads)]
                command += ["--seed", str(args.seed)]
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
                began = time.perf_counter()
                out = subprocess.run(command, capture_output=True, text=True, env=env)
                lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
                if out.returncode or not lines:
                    raise SystemExit(f"{size} {algorithm} {mode} failed:\n{out.stderr[-4000:]}")
                run = json.loads(lines[-1][len("RESULT ") :])
                run["wall_seconds"] = time.perf_counter() - began
                runs.append(run)
                print(
                    f"{size:13s} {algorithm:4s} {mode:12s} rollout passes "
                    f"{run['rollout_passes']['tokens_per_second']:8.0f} tok/s "
                    f"{run['rollout_passes']['peak_rss_mib']:7.0f} MiB | update "
                    f"{run['update']['tokens_per_second']:8.0f} tok/s {run['update']['peak_rss_mib']:7.0f} MiB",
                    flush=True,
                )
    speedups = {}
    for size in args.sizes:
        for algorithm in args.algorithms:
            pair = {r["mode"]: r for r in runs if r["size"] == size and r["algorithm"] == algorithm}
            speedups[f"{size}/{algorithm}"] = {
                phase: {
                    "tokens_per_second_ratio": pair["padding_free"][phase]["tokens_per_second"]
                    / pair["padded"][phase]["tokens_per_second"],
                    "best_tokens_per_second_ratio": pair["padding_free"][phase]["tokens_per_second_best"]
                    / pair["padded"][phase]["tokens_per_second_best"],
                    "peak_rss_mib_difference": pair["padding_free"][phase]["peak_rss_mib"]
                    - pair["padded"][phase]["peak_rss_mib"],
                }
                for phase in ("rollout_passes", "update")
            }
    import torch
    import transformers

    record = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "size", "algorithm", "mode")},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "load_average_after": os.getloadavg()[0],
        },
        "runs": runs,
        "padding_free_vs_padded": speedups,
    }
    path = Path(args.out) / f"padding_free{args.tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(speedups, indent=1))
    print(f"wrote {path}")


def _interleaved_main(args: argparse.Namespace) -> None:
    runs = []
    for size in args.sizes:
        for algorithm in args.algorithms:
            command = [sys.executable, __file__, "--child", "--size", size, "--algorithm", algorithm]
            command += ["--mode", "both", "--batch", str(args.batch), "--micro-batch", str(args.micro_batch)]
            command += ["--rloo-k", str(args.rloo_k), "--response-length", str(args.response_length)]
            command += [
                "--updates",
                str(args.updates),
                "--threads",
                str(args.threads),
                "--seed",
                str(args.seed),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            out = subprocess.run(command, capture_output=True, text=True, env=env)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode or not lines:
                raise SystemExit(f"{size} {algorithm} interleaved failed:\n{out.stderr[-4000:]}")
            run = json.loads(lines[-1][len("RESULT ") :])
            runs.append(run)
            print(
                f"{size:13s} {algorithm:4s} rollout passes x{run['rollout_passes']['speedup_median']:.2f} "
                f"train passes x{run['train_passes']['speedup_median']:.2f}",
                flush=True,
            )
    import torch
    import transformers

    record = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "size", "algorithm", "mode")},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "load_average_after": os.getloadavg()[0],
        },
        "runs": runs,
    }
    path = Path(args.out) / f"padding_free_interleaved{args.tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
