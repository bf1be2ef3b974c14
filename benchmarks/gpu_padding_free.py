"""Padded vs padding-free (``padding_free``) passes on one GPU (issue #24's GPU item): tokens/s and peak
GPU memory of the rollout's forward passes (policy, reference, values) and of the training forward +
backward passes, for PPO and RLOO, on a variable-length workload.

Models (random weights, built from a config: the GPU machines lent to this project reach no Hub):
``smollm2-135m`` = SmolLM2-135M's shape (Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary
49,152) and ``qwen2-0.5b`` = Qwen2-0.5B's shape (see ``gpu_generation.py``). Prompts: ``--batch`` rows of
random token ids whose lengths are drawn from ``--prompt-lengths`` (left-padded by the trainer); responses
are sampled to ``--response-length`` tokens, then each is cut at a length drawn uniformly from 2 to that
limit, EOS its last token (the same cut in both modes). Reward: a function of the text (spread, so the
advantages are not 0). Precision: ``--dtype bf16`` (the trainers' ``bf16=True``: fp32 weights, bf16
autocast, log-softmax in fp32) or ``fp32`` (TF32 off), on the default attention (SDPA).

A run is ``size:dtype`` or ``size:dtype:sdpa``: the latter keeps, in the packed passes, one
``scaled_dot_product_attention`` call per sequence where a GPU in bf16 would otherwise take one
variable-length flash-attention call per layer (``rlhf_trainers.packing.varlen_kernel``), so that the two
kernels' packed tokens/s can be compared.

Method: the interleaved rounds of ``padding_free.py`` (both modes on the same samples in one process,
alternating which goes first; gradients zeroed, no optimizer step), with ``torch.cuda.synchronize()``
before each clock read and ``torch.cuda.max_memory_allocated`` per phase. Also reported: the largest
|packed - padded| log-prob (and value) difference over real response tokens in the first round.

    python benchmarks/gpu_padding_free.py --out benchmarks/results

Writes ``<out>/gpu_padding_free_<gpu>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from gpu_generation import qwen2_half_billion  # benchmarks/ is on sys.path
from padding_free import interleaved_rounds, trainer_for


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def smollm2_shaped() -> Any:
    """A SmolLM2-135M-shaped Llama (134.5M parameters) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=2,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


MODELS = {"smollm2-135m": smollm2_shaped, "qwen2-0.5b": qwen2_half_billion}


def build(args: argparse.Namespace, size: str, algorithm: str, dtype: str) -> tuple[Any, Any]:
    """The trainer of one (size, algorithm, dtype) and its tokenizer."""
    import datasets
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = MODELS[size]()
    vocab_size, pad, eos = model.config.vocab_size, model.config.pad_token_id, model.config.eos_token_id
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
        pad_token=f"t{pad}",
        eos_token=f"t{eos}",
    )
    g = torch.Generator().manual_seed(args.seed)
    low, high = args.prompt_lengths
    lengths = torch.randint(low, high + 1, (1024,), generator=g).tolist()
    rows = [torch.randint(3, vocab_size - 1000, (n,), generator=g).tolist() for n in lengths]
    dataset = datasets.Dataset.from_dict({"input_ids": rows})

    def text_reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [sum(map(ord, c)) % 97 / 97 for c in completions]

    trainer = trainer_for(
        algorithm,
        model,
        tokenizer,
        dataset,
        text_reward,
        rloo_k=args.rloo_k,
        bf16=dtype == "bf16",
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.batch // args.micro_batch,
        local_rollout_forward_batch_size=args.micro_batch,
        response_length=args.response_length,
        stop_token=None,
        max_steps=args.updates,
        seed=args.seed,
        padding_free=True,
    )
    return trainer, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["smollm2-135m:bf16", "qwen2-0.5b:bf16", "smollm2-135m:bf16:sdpa", "smollm2-135m:fp32"],
    )
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "rloo"])
    parser.add_argument("--batch", type=int, default=64, help="completions per update")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--rloo-k", type=int, default=4)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=[16, 128])
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--updates", type=int, default=3, help="rounds (the first is a warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else None
    baseline = [0]

    def reset() -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline[0] = torch.cuda.memory_allocated()

    def read() -> float:
        return (torch.cuda.max_memory_allocated() - baseline[0]) / 2**20

    import transformers

    record: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "settings": vars(args),
        "note": "peak_max: MiB of GPU memory allocated above what was allocated before the phase",
        "runs": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu_padding_free_{record['gpu'].replace(' ', '_')}.json"
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 runs in full fp32 (bf16 runs unaffected)
    torch.backends.cudnn.allow_tf32 = False
    import time

    from rlhf_trainers import packing

    started = time.perf_counter()
    for run in args.runs:
        size, dtype, *kernel = run.split(":")
        kernel = kernel[0] if kernel else "auto"
        if kernel not in ("auto", "sdpa"):
            raise SystemExit(f"--runs {run!r}: the third field is 'sdpa' or nothing")
        for algorithm in args.algorithms:
            trainer, tokenizer = build(args, size, algorithm, dtype)
            result = {"size": size, "dtype": dtype, "algorithm": algorithm, "segment_kernel": kernel}
            with contextlib.ExitStack() as stack:
                if kernel == "sdpa":  # the packed passes' attention: one SDPA call per sequence
                    stack.enter_context(_patched(packing, "_varlen_applies", lambda query: False))
                result["varlen_kernel_available"] = packing.varlen_kernel() is not None
                result.update(
                    interleaved_rounds(
                        trainer,
                        tokenizer,
                        updates=args.updates,
                        seed=args.seed,
                        micro_batch=args.micro_batch,
                        sync=sync,
                        memory=(reset, read) if cuda else None,
                    )
                )
            result["elapsed_since_start_s"] = time.perf_counter() - started
            record["runs"].append(result)
            path.write_text(json.dumps(record, indent=1) + "\n")  # after every run: a timeout keeps the rest
            line = f"{time.perf_counter() - started:5.0f}s {size:13s} {dtype} {kernel:4s} {algorithm:4s}"
            for phase in ("rollout_passes", "train_passes"):
                r = result[phase]
                line += (
                    f" | {phase} x{r['speedup_median']:.2f} "
                    f"({r['padded']['tokens_per_second_median']:.0f} -> "
                    f"{r['padding_free']['tokens_per_second_median']:.0f} tok/s"
                )
                if cuda:
                    line += f", {r['padded']['peak_max']:.0f} -> {r['padding_free']['peak_max']:.0f} MiB"
                line += ")"
            sampling = statistics.median(r["sampling_seconds"] for r in result["rounds"])
            print(line, result["max_abs_difference_round_0"], f"sampling {sampling:.1f}s/round", flush=True)
            del trainer
            if cuda:
                torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
