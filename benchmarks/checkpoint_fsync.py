"""What making checkpoints durable costs (issue #25): the time of one checkpoint save with the fsyncs of
:class:`~rlhf_trainers.reliability.AtomicCheckpointMixin` (every file and folder of the checkpoint before
the rename, the parent folder after it) and without them.

An RLOOTrainer of ``--sizes`` (the kit's tiny Llama, SmolLM2-135M-Instruct from
``rlhf_trainers.testing.smollm2``) trains one tiny update (so that the optimizer holds its AdamW moments,
as in any checkpoint after the first step), then writes ``--repeats`` checkpoints with fsync and as many
without, alternating, into ``--dir``. Between saves (outside the timings) the checkpoint is deleted and
``os.sync()`` flushes everything, so each save starts with no dirty pages of an earlier one. Without fsync
a save returns once the bytes are in the page cache; the kernel writes them back later, so the
difference is the time a training run waits for the disk at each save. The switch used to turn the fsyncs
off, ``rlhf_trainers.reliability.FSYNC_CHECKPOINTS``, exists for this measurement only.

    python benchmarks/checkpoint_fsync.py --sizes tiny smollm2-135m --repeats 5 --out benchmarks/results

Writes ``<out>/checkpoint_fsync_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = ("tiny", "smollm2-135m")


def _length_reward(completions: list[str], **kwargs: object) -> list[float]:
    return [min(len(c), 32) / 32 for c in completions]


def _trainer(size: str, output_dir: str):
    from rlhf_trainers import RLOOConfig, RLOOTrainer
    from rlhf_trainers.testing import get_kit

    kit = get_kit()
    if size == "tiny":
        model, tokenizer = kit.load_model("llama-sft"), kit.load_tokenizer()
    else:
        from transformers import AutoModelForCausalLM

        from rlhf_trainers.testing.smollm2 import load_smollm2_tokenizer, smollm2_folder

        model = AutoModelForCausalLM.from_pretrained(smollm2_folder())
        tokenizer = load_smollm2_tokenizer()
        model.config.pad_token_id = tokenizer.pad_token_id
    config = RLOOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        rloo_k=2,
        response_length=4,
        learning_rate=1e-6,
        max_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        num_sample_generations=0,
        disable_tqdm=True,
        seed=0,
    )
    return RLOOTrainer(
        model=model,
        processing_class=tokenizer,
        args=config,
        train_dataset=kit.prompt_dataset("train", n=16),
        reward_funcs=_length_reward,
    )


def _tree_bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _mount_of(path: Path) -> str:
    """The /proc/mounts line of the filesystem that holds ``path`` (device, mount point, type)."""
    best = ""
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                device, point, kind = line.split()[:3]
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(
                    best.split(" ")[1] if best else ""
                ):
                    best = f"{device} {point} {kind}"
    except OSError:
        pass
    return best


def measure(size: str, repeats: int, root: Path) -> dict:
    import torch

    from rlhf_trainers import compat, reliability

    run_dir = Path(tempfile.mkdtemp(prefix=f"checkpoint_fsync_{size}_", dir=root))
    trainer = _trainer(size, str(run_dir))
    trainer.train()
    model = trainer.model_wrapped
    real_tree, real_dir = reliability.fsync_tree, reliability.fsync_dir
    in_fsync = [0.0]

    def timed(function):
        def wrapper(path: str):
            began = time.perf_counter()
            try:
                return function(path)
            finally:
                in_fsync[0] += time.perf_counter() - began

        return wrapper

    reliability.fsync_tree, reliability.fsync_dir = timed(real_tree), timed(real_dir)
    times: dict[str, list[float]] = {"fsync": [], "no_fsync": []}
    fsync_seconds: list[float] = []
    files = size_bytes = 0
    step = 1000
    try:
        for repeat in range(repeats):
            order = ("fsync", "no_fsync") if repeat % 2 == 0 else ("no_fsync", "fsync")
            for variant in order:
                reliability.FSYNC_CHECKPOINTS = variant == "fsync"
                step += 1
                trainer.state.global_step = step
                os.sync()
                in_fsync[0] = 0.0
                began = time.perf_counter()
                compat.save_checkpoint(trainer, model)
                times[variant].append(time.perf_counter() - began)
                if variant == "fsync":
                    fsync_seconds.append(in_fsync[0])
                checkpoint = run_dir / f"checkpoint-{step}"
                files, size_bytes = _tree_bytes(checkpoint)
                shutil.rmtree(checkpoint)
                os.sync()
    finally:
        reliability.FSYNC_CHECKPOINTS = True
        reliability.fsync_tree, reliability.fsync_dir = real_tree, real_dir
        shutil.rmtree(run_dir, ignore_errors=True)
    with_fsync, without = statistics.median(times["fsync"]), statistics.median(times["no_fsync"])
    return {
        "size": size,
        "parameters": sum(p.numel() for p in trainer.policy.parameters()),
        "checkpoint_files": files,
        "checkpoint_mib": round(size_bytes / 2**20, 1),
        "median_save_s_fsync": round(with_fsync, 4),
        "median_save_s_no_fsync": round(without, 4),
        "median_added_s": round(with_fsync - without, 4),
        "ratio": round(with_fsync / without, 3),
        "median_s_inside_fsync_calls": round(statistics.median(fsync_seconds), 4),
        "range_save_s_fsync": [round(min(times["fsync"]), 4), round(max(times["fsync"]), 4)],
        "range_save_s_no_fsync": [round(min(times["no_fsync"]), 4), round(max(times["no_fsync"]), 4)],
        "save_s_fsync": [round(t, 4) for t in times["fsync"]],
        "save_s_no_fsync": [round(t, 4) for t in times["no_fsync"]],
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--num_threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.num_threads)
    root = Path(args.dir)
    load_before = os.getloadavg()
    results = [measure(size, args.repeats, root) for size in args.sizes]
    report = {
        "benchmark": "checkpoint_fsync",
        "device": "cpu",
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "filesystem": _mount_of(root),
        "trainer": "RLOOTrainer, fp32, after one update (AdamW moments in the checkpoint)",
        "repeats": args.repeats,
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "checkpoint_fsync_cpu.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        print(
            f"{r['size']}: {r['checkpoint_mib']} MiB in {r['checkpoint_files']} files; median save "
            f"{r['median_save_s_fsync']:.3f} s with fsync, {r['median_save_s_no_fsync']:.3f} s without "
            f"(+{r['median_added_s']:.3f} s, x{r['ratio']})"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
