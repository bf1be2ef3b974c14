"""RewardTrainer: padded vs padding-free (``RewardConfig.padding_free``) training steps on preference pairs
whose two sides have very different lengths.

Workload: ``--pairs`` pairs of random token ids (seeded), per pair one side of 4 to ``--short`` tokens and
the other of ``--long / 2`` to ``--long`` tokens, the long side alternating between chosen and rejected;
micro-batches of ``--batch`` pairs (2 x batch sequences, padded to the longest in the padded mode). Each
round times, on the same micro-batches, one training step per mode: ``compute_loss`` forward + backward
(gradients zeroed after, no optimizer step, so the model stays the same), the mode that goes first
alternating from round to round. Reported: seconds per micro-batch step per mode (median over the rounds
after the first, a warm-up) and the padded / packed ratio per round (median), plus the fraction of the
padded positions that are real tokens and the largest difference of the two modes' rewards on the first
micro-batch. One process, float32 on CPU (``--threads`` threads) unless
``--device`` names a GPU (``--dtype bf16`` then trains in bfloat16 autocast).

    python benchmarks/reward_padding_free.py --sizes tiny smollm2-135m --out benchmarks/results

Writes ``<out>/reward_padding_free_<device kind>.json``. On a shared machine the timings move with the
other work on it; the ratio of the interleaved rounds is the steadier number.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

SIZES = ("tiny", "smollm2-135m")


def pairs(n: int, short: int, long: int, vocab: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        a = int(torch.randint(4, short + 1, (1,), generator=g))
        b = int(torch.randint(long // 2, long + 1, (1,), generator=g))
        small = torch.randint(3, vocab, (a,), generator=g).tolist()
        big = torch.randint(3, vocab, (b,), generator=g).tolist()
        chosen, rejected = (small, big) if i % 2 == 0 else (big, small)
        out.append({"input_ids_chosen": chosen, "input_ids_rejected": rejected})
    return out


def model_path(size: str) -> str:
    if size == "tiny":
        from rlhf_trainers.testing import get_kit

        return str(get_kit().model_path("llama-seqcls"))
    from rlhf_trainers.testing.smollm2 import smollm2_folder

    return str(smollm2_folder())


def run_size(size: str, args: argparse.Namespace) -> dict:
    import datasets
    import torch
    from transformers import AutoTokenizer

    from rlhf_trainers import RewardConfig, RewardTrainer

    path = model_path(size)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = pairs(args.pairs, args.short, args.long, min(len(tokenizer), 30000), args.seed)
    # no EOS appended: the random ids must not hold the pad id (it is EOS for SmolLM2)
    rows = [{k: [t for t in v if t != tokenizer.pad_token_id] or [5] for k, v in row.items()} for row in rows]
    config = RewardConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.batch,
        max_length=None,
        add_eos=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bf16",
        padding_free=True,
    )
    trainer = RewardTrainer(
        model=path, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    packing = trainer.packing
    if packing is None:
        raise SystemExit(f"{size}: the model does not pack; nothing to compare")
    model = trainer.model
    model.train()
    device = trainer.args.device
    batches = [
        {
            k: v.to(device)
            for k, v in trainer.data_collator(rows[i : i + args.batch]).items()
            if isinstance(v, torch.Tensor)
        }
        for i in range(0, len(rows) - args.batch + 1, args.batch)
    ]
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    padded_positions = sum(b["attention_mask"].numel() for b in batches)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(mode: str) -> float:
        trainer.packing = packing if mode == "padding_free" else None
        seconds = []
        for batch in batches:
            sync()
            start = time.perf_counter()
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, batch)
            loss.backward()
            sync()
            seconds.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        return statistics.mean(seconds)

    def rewards(mode: str) -> torch.Tensor:
        trainer.packing = packing if mode == "padding_free" else None
        with torch.no_grad(), trainer.compute_loss_context_manager():
            return torch.stack(trainer._rewards(model, batches[0])).float()

    # the same rewards both ways (the first micro-batch), as a check of the run
    reward_diff = float((rewards("padding_free") - rewards("padded")).abs().max())
    times: dict[str, list[float]] = {"padded": [], "padding_free": []}
    ratios = []
    for round_ in range(args.rounds):
        order = ("padded", "padding_free") if round_ % 2 == 0 else ("padding_free", "padded")
        this = {mode: step(mode) for mode in order}
        print(f"  {size} round {round_}: " + ", ".join(f"{m} {s:.4f} s/step" for m, s in this.items()))
        if round_ == 0:
            continue  # warm-up
        for mode, s in this.items():
            times[mode].append(s)
        ratios.append(this["padded"] / this["padding_free"])
    return {
        "model": size,
        "layout": "one_row" if packing.one_row else "rows",
        "batch_pairs": args.batch,
        "micro_batches": len(batches),
        "real_token_fraction_of_padded": real / padded_positions,
        "s_per_step_padded": statistics.median(times["padded"]),
        "s_per_step_padding_free": statistics.median(times["padding_free"]),
        "max_abs_reward_difference_first_batch": reward_diff,
        "padded_over_packed_median": statistics.median(ratios),
        "ratios": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=["tiny"])
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="pairs per micro-batch")
    parser.add_argument("--short", type=int, default=32, help="longest short side")
    parser.add_argument("--long", type=int, default=256, help="longest long side")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    results = {
        "benchmark": "reward_padding_free",
        "machine": platform.processor() or platform.machine(),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "threads": args.threads,
        "torch": torch.__version__,
        "workload": {k: getattr(args, k) for k in ("pairs", "batch", "short", "long", "rounds", "seed")},
        "note": "shared machine: other work ran alongside; the interleaved ratio is the steadier number",
        "runs": [run_size(size, args) for size in args.sizes],
    }
    kind = "cpu" if args.device == "cpu" else torch.cuda.get_device_name().replace(" ", "_")
    out = Path(args.out) / f"reward_padding_free_{kind}{'_bf16' if args.dtype == 'bf16' else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["runs"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
