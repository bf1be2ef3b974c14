"""Generation and whole-update throughput on one GPU at a 0.5B-parameter model (issue #22's GPU item, as
far as a machine without vLLM allows): the builtin sampling loop against ``transformers.generate``, and
one GRPO update, in bf16.

The model is Qwen2-0.5B-shaped (24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, vocabulary
151,936: 494M parameters) with random weights, built from its config (the GPU machines lent to this
project reach no Hub); generation runs to a fixed length (no stop token) so that every backend produces
the same number of tokens. Prompts: ``--prompts`` rows of ``--prompt-length`` random token ids.

Figures: generation seconds (median of ``--repeats`` after one warm-up), new tokens/s, and for a GRPO
update (``num_generations`` 4, fixed-length completions, a length reward) the seconds per update and
tokens/s/GPU (prompt + completion tokens of the update / its seconds), verl's definition.

    python benchmarks/gpu_generation.py --out benchmarks/results

Writes ``<out>/gpu_generation_<gpu>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def qwen2_half_billion() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=151643,
        eos_token_id=151645,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def time_generation(
    backend: Any, ids: torch.Tensor, mask: torch.Tensor, settings: Any, repeats: int
) -> float:
    backend.sample(ids, mask, settings)  # warm-up
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        backend.sample(ids, mask, settings)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    from rlhf_trainers.generation import BuiltinSampling, SamplingSettings
    from rlhf_trainers.generation.transformers_generate import TransformersGenerate

    model = qwen2_half_billion().to("cuda", torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 151000, (args.prompts, args.prompt_length), generator=g).cuda()
    mask = torch.ones_like(ids)
    settings = SamplingSettings(max_new_tokens=args.new_tokens, pad_token_id=151643, temperature=1.0)
    new_tokens = args.prompts * args.new_tokens
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "parameters": params,
        "dtype": "bfloat16",
        "prompts": args.prompts,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "generation": {},
    }
    for name, backend in (
        ("builtin", BuiltinSampling(model)),
        ("transformers.generate", TransformersGenerate(model)),
    ):
        seconds = time_generation(backend, ids, mask, settings, args.repeats)
        result["generation"][name] = {"seconds": seconds, "new_tokens_per_sec": new_tokens / seconds}
        print(name, f"{seconds:.3f} s", f"{new_tokens / seconds:.0f} new tokens/s", flush=True)
    result["update"] = grpo_update(model, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu_generation_{result['gpu'].replace(' ', '_')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def grpo_update(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per GRPO update (median after the first) and tokens/s/GPU at this model size."""
    import datasets
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from rlhf_trainers import GRPOConfig, GRPOTrainer

    vocab = {f"t{i}": i for i in range(151936)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
        pad_token="t151643",
        eos_token="t151645",
    )
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 151000, (256, args.prompt_length), generator=g).tolist()
    dataset = datasets.Dataset.from_dict({"input_ids": rows})

    def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [sum(map(ord, c)) % 97 / 97 for c in completions]  # spread, so the advantages are not 0

    config = GRPOConfig(
        output_dir="/tmp/gpu-grpo",
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        num_generations=4,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=4,  # one generation: 64 completions of 16 prompts, one optimizer step
        max_completion_length=args.new_tokens,
        stop_token=None,
        local_rollout_forward_batch_size=64,
        learning_rate=1e-6,
        max_steps=args.updates,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        num_sample_generations=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model.float(),
        reward_funcs=length_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "timing/step" in h]
    steps = [h["timing/step"] for h in logs[1:]] or [logs[0]["timing/step"]]
    seconds = statistics.median(steps)
    tokens = 64 * (args.prompt_length + args.new_tokens)
    return {
        "completions_per_update": 64,
        "seconds_per_update": seconds,
        "tokens_per_sec_per_gpu": tokens / seconds,
        "timing_generate": statistics.median(h["timing/generate"] for h in logs[1:] or logs),
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


if __name__ == "__main__":
    main()
