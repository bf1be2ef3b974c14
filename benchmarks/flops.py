"""How close an on-policy update runs to the machine's limit (issue #7, "limit").

Two halves:

1. :func:`measure_matmul`: the machine's fp32 matmul rate, ``torch.matmul`` of two ``n x n`` float32
   matrices (2 n^3 FLOPs each), median over ``repeats`` timed calls after warm-up, with torch's default
   thread count (the trainers run with the same).
2. :func:`update_flops`: the model FLOPs of one update of a trainer, counted from the model shapes and the
   forward passes that trainer runs. A forward pass over a sequence of ``T`` tokens costs

   - ``2 x (linear parameters of the body)`` per token (every ``nn.Linear`` in the decoder layers),
   - ``2 x (lm-head parameters)`` per position whose logits are computed (``logits_to_keep``),
   - ``4 x hidden x layers x context`` per token for the attention scores and the weighted sum (context
     ``T / 2`` on average with a causal mask; generation with a KV cache does the same work);

   a backward pass twice its forward. Embedding look-ups, norms, activations, softmaxes and the optimizer
   are not counted (they are not matmuls). Tokens are the *real* prompt tokens plus the response tokens;
   left padding inside a batch is work the model does but not model FLOPs. With variable-length
   responses (``update_flops(rows=...)``) every completion counts its own prompt and response tokens
   (up to and including its stop token): the padding after a short response is not counted either.

The passes of one update, per completion (``E`` = epochs, ``P`` prompt tokens, ``L`` response tokens,
``T = P + L``, "head k" = lm-head on k positions):

==========  ===========================================================================================
ours PPO    generate (head L); policy (head L+1; skipped when the rollout log-probs come from the
            sampling loop, ``rollout_logprobs``); ref (head L+1); values; reward; E x (policy
            fwd+bwd (head L+1) + value fwd+bwd)
TRL PPO     generate (head L; its log-probs come from the generation scores); ref (head T: no
            ``logits_to_keep``); values; reward; E x (policy fwd+bwd (head T) + value fwd+bwd)
ours RLOO   generate (head L); policy (head L+1; skipped as for PPO); ref (head L+1); reward; E x policy
            fwd+bwd (head L+1)
TRL RLOO    generate (head L); policy (head L); ref (head L); reward; E x policy fwd+bwd (head L)
ours GRPO   as ours RLOO; ref only with ``beta > 0``
TRL GRPO    as TRL RLOO; policy only when the old log-probs are needed (``num_iterations > 1`` or
            ``steps_per_generation > gradient_accumulation_steps``), ref only with ``beta > 0``
==========  ===========================================================================================

The value and reward models are sequence classifiers: body + a one-output head (ignored).

    python benchmarks/flops.py --sizes 1024 2048 --repeats 10
    python benchmarks/flops.py --model-config PATH/config.json    # FLOPs per token of one model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

# pass list per (impl, algo): (model, head positions: "L", "L+1", "T" or None for a classifier, backward?)
PASSES: dict[tuple[str, str], list[tuple[str, str, str | None, bool]]] = {
    ("ours", "ppo"): [
        ("generate", "policy", "L", False),
        ("policy", "policy", "L+1", False),
        ("ref", "policy", "L+1", False),
        ("values", "reward", None, False),
        ("reward", "reward", None, False),
        ("train", "policy", "L+1", True),
        ("train", "reward", None, True),
    ],
    ("trl", "ppo"): [
        ("generate", "policy", "L", False),
        ("ref", "policy", "T", False),
        ("values", "reward", None, False),
        ("reward", "reward", None, False),
        ("train", "policy", "T", True),
        ("train", "reward", None, True),
    ],
    ("ours", "rloo"): [
        ("generate", "policy", "L", False),
        ("policy", "policy", "L+1", False),
        ("ref", "policy", "L+1", False),
        ("reward", "reward", None, False),
        ("train", "policy", "L+1", True),
    ],
    ("trl", "rloo"): [
        ("generate", "policy", "L", False),
        ("policy", "policy", "L", False),
        ("ref", "policy", "L", False),
        ("reward", "reward", None, False),
        ("train", "policy", "L", True),
    ],
}
PASSES[("ours", "grpo")] = PASSES[("ours", "rloo")]
PASSES[("trl", "grpo")] = PASSES[("trl", "rloo")]


def measure_matmul(
    sizes: list[int], repeats: int = 10, warmup: int = 2, dtype: str = "float32"
) -> dict[str, Any]:
    """Median ``torch.matmul`` FLOP/s in ``dtype`` (``float32`` or ``bfloat16``) for each size; ``best`` is
    the highest median."""
    import torch

    results = {}
    for n in sizes:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=gen).to(getattr(torch, dtype))
        b = torch.randn(n, n, generator=gen).to(getattr(torch, dtype))
        for _ in range(warmup):
            torch.matmul(a, b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        results[str(n)] = {"median_s": med, "flops_per_s": 2 * n**3 / med, "all_s": times}
    best = max(r["flops_per_s"] for r in results.values())
    return {
        "sizes": results,
        "best_median_flops_per_s": best,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
    }


def model_shape(config_path: str | os.PathLike[str]) -> dict[str, int]:
    """Linear parameters of the body and of the lm-head, hidden size and layers, from a ``config.json``
    (the model is built on the meta device: no weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(Path(config_path).parent)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return {
        "body_linear_params": body,
        "lm_head_params": head.weight.numel(),
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def forward_flops(shape: dict[str, int], tokens: float, head_positions: float, seq_len: float) -> float:
    """Model FLOPs of one forward pass over ``tokens`` tokens of sequences of ``seq_len`` tokens."""
    body = 2 * shape["body_linear_params"] * tokens
    head = 2 * shape["lm_head_params"] * head_positions
    attention = 4 * shape["hidden_size"] * shape["num_layers"] * (seq_len / 2) * tokens
    return body + head + attention


def update_flops(
    impl: str,
    algo: str,
    policy_shape: dict[str, int],
    reward_shape: dict[str, int],
    completions: int,
    prompt_tokens: float,
    response_length: int,
    epochs: int,
    policy_forward: bool = True,
    ref_forward: bool = True,
    rows: list[tuple[float, float]] | None = None,
) -> dict[str, float]:
    """Model FLOPs of one update, per phase and in total (see the module docstring for the passes).

    ``prompt_tokens`` is the mean number of real prompt tokens per completion and ``response_length``
    the tokens of every response; ``rows`` (variable-length responses) replaces both with each
    completion's own ``(real prompt tokens, response tokens up to and including its stop token)``, so
    that only real tokens count (``completions``, ``prompt_tokens`` and ``response_length`` are then
    ignored). ``policy_forward=False`` leaves out the separate no-grad policy pass (ours, when the
    sampling loop gives the log-probs; TRL's GRPO when it needs no old log-probs), ``ref_forward=False``
    the reference pass (GRPO with ``beta=0``)."""
    sequences = rows if rows is not None else [(prompt_tokens, response_length)] * completions
    out: dict[str, float] = {}
    for phase, model, head, backward in PASSES[(impl, algo)]:
        if (phase == "policy" and not policy_forward) or (phase == "ref" and not ref_forward):
            continue
        shape = policy_shape if model == "policy" else reward_shape
        fwd = 0.0
        for P, L in sequences:
            T = P + L
            heads = {"L": L, "L+1": L + 1, "T": T}
            fwd += forward_flops(shape, T, heads[head] if head else 0.0, T)
        total = fwd * 3 * epochs if backward else fwd
        out[phase] = out.get(phase, 0.0) + total
    out["total"] = sum(out.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="matrix sizes n")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--model-config", help="print the FLOP shape of this model instead")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args()
    if args.model_config:
        result: dict[str, Any] = model_shape(args.model_config)
    else:
        result = measure_matmul(args.sizes, args.repeats, dtype=args.dtype)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
