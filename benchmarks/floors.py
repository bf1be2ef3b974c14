"""The time floor of one on-policy update on this machine: the seconds that the model's matrix products
alone take at the job's real shapes, plus the optimizer, which no implementation of the same job can go
below (issue #23's "ours >= 1.5x TRL's episodes/s at 135M" is checked against it).

What is timed, one thread by default, medians of ``--repeats`` after a warm-up, each ``nn.Linear`` of the
model with its own weight (embeddings and norms, attention's score/softmax/weighted-sum, sampling,
Python and data movement are left out, so the floor is below anything real):

- **generation**: ``response_length`` decoding steps, each every linear layer (lm head included) applied
  to ``completions`` rows (one token per sequence), plus the prefill over the prompts;
- **reward**: the reward model's body (the policy's body here: the same architecture with a one-output
  head) over every completion's prompt + response tokens;
- **training**: ``train_passes`` forward + backward passes (the backward's two products per linear: the
  input's gradient and the weight's) over ``micro_batch`` completions each, the lm head on the response
  positions only (a fused head, as ours);
- **optimizer**: ``optimizer_steps`` x (``torch.optim.AdamW(fused=True)`` step + ``clip_grad_norm_``) over
  all parameters (gradients filled).

With ``--ppo``, PPO's job (issue #24's variable-length job of ``vs_trl.py --stop-at-eos``): also the
reference model's pass (the body and the head on the response positions), the value model's rollout pass
and its training passes (its body; a value head of one output is left out) and the value model's optimizer
steps; ``--response-mean`` is then the mean real response length (the passes' tokens), while generation
runs ``response_length`` decoding steps (a batch runs until its longest response stops).

Defaults: the GRPO job of ``vs_trl.py`` at SmolLM2-135M (``benchmarks/results/vs_trl_grpo_cpu_1thread.json``:
8 completions = 2 prompts x 4, 32 tokens each, 3.5 prompt tokens on average, 2 mini-batches x 2 iterations
= 4 optimizer steps of 4 completions). ``--trl-seconds`` (that file's TRL seconds per update) turns the
floor into the highest ratio reachable: ``trl_seconds / floor``.

    python benchmarks/floors.py --out benchmarks/results
    python benchmarks/floors.py --ppo --completions 16 --prompt-tokens 42.4 --response-length 64 \
        --response-mean 40 --micro-batch 8 --train-passes 4 --optimizer-steps 4 \
        --trl-seconds 70.04 70.12 --tag 135m_ppo_varlen      # vs_trl_varlen_135m.json's PPO job

Writes ``<out>/floors_<tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from flops import measure_matmul  # benchmarks/ is on sys.path


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def linear_seconds(weights: list[torch.Tensor], rows: int, repeats: int, backward: bool) -> float:
    """Seconds of one pass over ``weights`` in order, each multiplied by ``rows`` input rows (and, with
    ``backward``, its two backward products: the input's gradient and the weight's), median of
    ``repeats`` passes. Passing over all of them in order, as a model does, reads the weights from memory
    where they do not all fit in the caches (timing each weight alone would keep it cached)."""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, w.shape[1], generator=g) for w in weights]
    grads = [torch.randn(rows, w.shape[0], generator=g) for w in weights] if backward else []

    def one_pass() -> None:
        for i, w in enumerate(weights):
            F.linear(inputs[i], w)
            if backward:
                grads[i] @ w
                grads[i].t() @ inputs[i]

    return median_seconds(one_pass, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a causal-LM folder (default: the cached SmolLM2-135M)")
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=float, default=3.5, help="mean real prompt tokens")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument(
        "--response-mean",
        type=float,
        default=None,
        help="mean real response tokens (default: response-length)",
    )
    parser.add_argument("--ppo", action="store_true", help="PPO: reference pass, value model, its optimizer")
    parser.add_argument("--micro-batch", type=int, default=4, help="completions per training pass")
    parser.add_argument("--train-passes", type=int, default=4, help="forward + backward passes per update")
    parser.add_argument("--optimizer-steps", type=int, default=4)
    parser.add_argument("--trl-seconds", type=float, nargs="*", default=[12.355, 12.719])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="135m_grpo")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    folder = args.model
    if folder is None:
        from rlhf_trainers.testing.smollm2 import smollm2_folder

        folder = smollm2_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    head = model.get_output_embeddings()
    body = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    head_w = head.weight.detach()
    R, P, B = args.response_length, args.prompt_tokens, args.completions
    mean_response = R if args.response_mean is None else args.response_mean
    tokens = round(P + mean_response)
    head_rows = round(mean_response + 1)

    step = linear_seconds([*body, head_w], B, args.repeats, backward=False)
    prefill = linear_seconds(body, max(1, round(P * B)), args.repeats, backward=False)
    generation = R * step + prefill
    reward = linear_seconds(body, tokens * B, args.repeats, backward=False)
    body_pass = linear_seconds(body, tokens * args.micro_batch, args.repeats, backward=True)
    one_pass = body_pass + linear_seconds([head_w], head_rows * args.micro_batch, args.repeats, backward=True)
    training = args.train_passes * one_pass
    reference = values = value_training = 0.0
    if args.ppo:
        reference = reward + linear_seconds([head_w], head_rows * B, args.repeats, backward=False)
        values = reward  # the value model's body over the same tokens
        value_training = args.train_passes * body_pass

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    adamw = torch.optim.AdamW(params, lr=1e-6, fused=True)
    optimizer_step = median_seconds(adamw.step, args.repeats)
    clip = median_seconds(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), args.repeats)
    optimizer = args.optimizer_steps * (optimizer_step + clip) * (2 if args.ppo else 1)

    floor = generation + reward + training + optimizer + reference + values + value_training
    matmul = measure_matmul([1024, 2048], repeats=5)
    result: dict[str, Any] = {
        "model": str(folder),
        "parameters": sum(p.numel() for p in params),
        "settings": vars(args),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "loadavg_end": os.getloadavg(),
        },
        "seconds": {
            "decoding_step": step,
            "prefill": prefill,
            "generation": generation,
            "reward": reward,
            "training_pass": one_pass,
            "training": training,
            **(
                {"reference": reference, "values": values, "value_training": value_training}
                if args.ppo
                else {}
            ),
            "adamw_fused_step": optimizer_step,
            "clip_grad_norm": clip,
            "optimizer": optimizer,
            "floor": floor,
        },
        "matmul": matmul,
    }
    if args.trl_seconds:
        result["trl_seconds_per_update"] = args.trl_seconds
        result["highest_reachable_ratio"] = [t / floor for t in args.trl_seconds]
        result["seconds_needed_for_1.5x"] = [t / 1.5 for t in args.trl_seconds]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"floors_{args.tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["seconds"], indent=1))
    if args.trl_seconds:
        print("highest reachable ratio vs TRL:", [round(r, 3) for r in result["highest_reachable_ratio"]])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
