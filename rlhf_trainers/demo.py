"""The foundation-stage demo: a minimal RLOO loop on :mod:`rlhf_trainers.functional`.

``rlhf-trainers demo`` builds the offline kit (:mod:`rlhf_trainers.testing`), takes its briefly
pretrained tiny Llama policy, and trains it with RLOO (REINFORCE with a leave-one-out baseline,
through PPO's clipped objective, as the RLOO blog describes) against the synthetic task's hidden
rule-based reward, with a per-token KL penalty to a frozen reference copy. It prints the mean true
reward of held-out samples before and after, a few sample completions, and writes the metrics to
``<output_dir>/metrics.json``.

This is deliberately the smallest end-to-end thing the package can do before its trainers exist: one
screen of loop over the tested functions. Issue #6 replaces it with the full pipeline (reward model,
PPO and RLOO trainers, report and plots).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import functional as F
from .optim import TFStyleAdam


@dataclass
class DemoArguments:
    """Flags of ``rlhf-trainers demo``."""

    num_updates: int = field(default=40, metadata={"help": "Number of RLOO updates (one rollout each)."})
    prompts_per_update: int = field(default=16, metadata={"help": "Distinct prompts per rollout."})
    rloo_k: int = field(default=4, metadata={"help": "Completions sampled per prompt (>= 2)."})
    response_length: int = field(default=12, metadata={"help": "Maximum new tokens per completion."})
    num_ppo_epochs: int = field(default=2, metadata={"help": "Optimisation epochs over each rollout."})
    learning_rate: float = field(default=2e-3, metadata={"help": "TFStyleAdam learning rate."})
    kl_coef: float = field(
        default=0.05, metadata={"help": "Weight of the sequence KL penalty to the reference."}
    )
    cliprange: float = field(default=0.2, metadata={"help": "PPO ratio clip range."})
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature (also divides the logits)."}
    )
    eval_prompts: int = field(default=64, metadata={"help": "Held-out prompts scored before and after."})
    seed: int = field(default=0, metadata={"help": "Random seed."})
    output_dir: str = field(default="demo-report", metadata={"help": "Folder for metrics.json."})
    kit_dir: str | None = field(
        default=None, metadata={"help": "Offline kit folder (default: the kit cache)."}
    )

    def __post_init__(self) -> None:
        if self.rloo_k < 2:
            raise ValueError(
                f"rloo_k={self.rloo_k}: the leave-one-out baseline needs at least 2 completions per prompt; "
                "set --rloo_k 2 or more."
            )
        for name in ("num_updates", "prompts_per_update", "response_length", "num_ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1.")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0.")


class _Policy:
    """Sampling and log-probabilities for one causal LM, with the seed's padding conventions."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, args: DemoArguments) -> None:
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.pad_id: int = tokenizer.pad_token_id
        self.eos_id: int = tokenizer.eos_token_id

    @torch.no_grad()
    def sample(self, prompts: list[str], greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (left-padded query ids (B, Q), responses truncated after EOS (B, R))."""
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True)
        out = self.model.generate(
            **enc,
            max_new_tokens=self.args.response_length,
            do_sample=not greedy,
            temperature=self.args.temperature if not greedy else None,
            top_k=0 if not greedy else None,
            top_p=1.0 if not greedy else None,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
        )
        query = enc["input_ids"]
        response = out[:, query.shape[1] :]
        return query, F.truncate_response(response, self.eos_id, self.pad_id)

    def logprobs(self, query: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
        """Per-token log-probabilities (B, R) of `response` given `query`, logits / temperature."""
        ids = torch.cat([query, response], dim=1)
        mask = ids != self.pad_id
        logits = self.model(
            input_ids=ids.masked_fill(~mask, 0),
            attention_mask=mask.long(),
            position_ids=F.position_ids_from_mask(mask),  # seed: positions skip the padding
        ).logits
        logits = logits[:, query.shape[1] - 1 : -1]
        return F.logprobs_from_logits(logits, response, self.args.temperature)


def _true_reward(prompts: list[str], completions: list[str]) -> torch.Tensor:
    from .testing import true_reward

    return torch.tensor(true_reward(prompts, completions), dtype=torch.float32)


def _evaluate(policy: _Policy, prompts: list[str]) -> tuple[float, list[tuple[str, str, float]]]:
    _, response = policy.sample(prompts)
    completions = policy.tokenizer.batch_decode(response, skip_special_tokens=True)
    rewards = _true_reward(prompts, completions)
    return rewards.mean().item(), list(zip(prompts, completions, rewards.tolist(), strict=True))


def run_demo(args: DemoArguments) -> dict[str, Any]:
    """Run the demo and return its summary (also written to ``<output_dir>/metrics.json``)."""
    from tqdm.auto import tqdm

    from .testing import get_kit

    start = time.perf_counter()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    kit = get_kit(args.kit_dir)
    tokenizer = kit.load_tokenizer()
    model = kit.load_model("llama-sft")
    reference = kit.load_model("llama-sft").requires_grad_(False)
    for m in (model, reference):
        m.eval()  # seed: no dropout during RL (eval() also keeps generate deterministic in structure)
    policy, ref_policy = _Policy(model, tokenizer, args), _Policy(reference, tokenizer, args)
    optimizer = TFStyleAdam(model.parameters(), lr=args.learning_rate, eps=1e-5)

    train_prompts = list(kit.prompt_dataset("train")["prompt"])
    eval_prompts = list(kit.prompt_dataset("test", n=args.eval_prompts)["prompt"])
    before, before_samples = _evaluate(policy, eval_prompts)
    print(f"mean true reward of held-out samples before training: {before:+.3f}")

    rng = random.Random(args.seed)
    history: list[dict[str, float]] = []
    k, b = args.rloo_k, args.prompts_per_update
    for update in tqdm(range(args.num_updates), desc="RLOO updates"):
        batch = rng.sample(train_prompts, b)
        prompts = batch * k  # RLOO blog layout: completion j of prompt i at index j * B + i
        with torch.no_grad():
            query, response = policy.sample(prompts)
            mask = (response != policy.pad_id).float()
            old_logprobs = policy.logprobs(query, response)
            ref_logprobs = ref_policy.logprobs(query, response)
            completions = tokenizer.batch_decode(response, skip_special_tokens=True)
            scores = _true_reward(prompts, completions)
            kl = (F.kl_penalty(old_logprobs, ref_logprobs, "k1") * mask).sum(1)
            # RLOO blog: the whole completion is one action; its reward is score - beta * KL.
            rlhf_reward = scores - args.kl_coef * kl
            advantages = F.whiten(F.rloo_advantages(rlhf_reward, k))
            old_seq = (old_logprobs * mask).sum(1, keepdim=True)
        for _ in range(args.num_ppo_epochs):
            new_seq = (policy.logprobs(query, response) * mask).sum(1, keepdim=True)
            loss, stats = F.clipped_policy_loss(
                new_seq, old_seq, advantages[:, None], torch.ones_like(new_seq), clip_low=args.cliprange
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        history.append(
            {
                "update": update + 1,
                "episodes": (update + 1) * b * k,
                "objective/scores": scores.mean().item(),
                "objective/kl": kl.mean().item(),
                "objective/rlhf_reward": rlhf_reward.mean().item(),
                "policy/clipfrac": stats["clipfrac"].item(),
                "loss/policy": loss.item(),
            }
        )

    after, after_samples = _evaluate(policy, eval_prompts)
    elapsed = time.perf_counter() - start
    print("\nsample completions (held-out prompts), before -> after:")
    for (prompt, c0, r0), (_, c1, r1) in list(zip(before_samples, after_samples, strict=True))[:6]:
        print(f"  {prompt!r}\n     before {r0:+.2f} {c0!r}\n     after  {r1:+.2f} {c1!r}")
    summary = {
        "true_reward_before": before,
        "true_reward_after": after,
        "true_reward_gain": after - before,
        "final_kl": history[-1]["objective/kl"],
        "seconds": elapsed,
        "args": asdict(args),
        "history": history,
    }
    print(
        f"\nmean true reward {before:+.3f} -> {after:+.3f} (gain {after - before:+.3f}), "
        f"final KL {summary['final_kl']:.3f}, {elapsed:.1f} s"
    )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(summary, indent=2))
    print(f"metrics written to {out / 'metrics.json'}")
    return summary
