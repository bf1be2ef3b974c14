"""The offline kit: tiny models, tokenizers and a synthetic RLHF task, built locally in seconds.

Tests, examples, the demo and the benchmarks need causal LMs, reward models and a task whose
"human preference" is known, without touching the network. :func:`get_kit` builds all of that once
into a cache folder (10-15 s on 2 CPU cores) and afterwards returns it instantly.

The synthetic task
------------------
Sentences are generated from templates over a small vocabulary::

    the movie was | really bright but dull .
    i think the room is | warm and fine .
    <prompt>        | <completion>

A *prompt* is the opening of a sentence, up to where the first adjective goes ("the movie was"); a
*completion* is the rest, which always starts with a space (so ``prompt + completion`` is the full
sentence). Adjectives are drawn from three equally likely classes: :data:`POSITIVE_WORDS`,
:data:`NEGATIVE_WORDS` and :data:`NEUTRAL_WORDS`, so a model trained on the corpus writes mixed
sentiment and its mean true reward is near 0.

The hidden preference is :func:`true_reward`: the completion is lower-cased and split into words
(runs of letters and digits; whitespace and punctuation separate words and are not words), and::

    true_reward = (#positive words - #negative words) / max(#words, 1)      in [-1, 1]

"really bright but dull ." has 4 words, 1 positive and 1 negative: reward 0. "warm and fine ." scores
2/3. An RL-trained policy raises it by writing more, and denser, positive words; the ceiling 1.0 is
only reached by completions made of positive words alone (e.g. " good ."), which a KL penalty to the
starting policy should hold back.

Prompts are split by (template, noun) combination into disjoint "train" and "test" pools; all
datasets are generated from seeded local RNGs, so they are deterministic and cost nothing to make.

The assets
----------
=====================  ==========================================================================
``tokenizer``          byte-level BPE trained on the corpus; every vocabulary word (with and
                       without a leading space) is one token; ``<|endoftext|>`` is eos and bos,
                       ``<|pad|>`` is pad (never equal to eos); padding side "left"; chat template
``tokenizer-alt``      a second, different byte-level BPE (other corpus seed, smaller vocabulary,
                       pad and eos at other ids) for a reward model whose tokenizer differs
``llama``              random ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads, 2 kv heads,
                       tied embeddings)
``gpt2``               random ``GPT2LMHeadModel`` (n_embd 64, 2 layers, 4 heads; keeps GPT-2's
                       default dropout 0.1, so code that must disable dropout can be tested)
``gpt_neox``           random ``GPTNeoXForCausalLM`` (Pythia-like: parallel residual, partial rotary)
``llama-sft``          ``llama`` trained on the corpus (plain text and chat-formatted): the starting
                       policy of the RL tests; it writes corpus-like sentences and then eos
``llama-seqcls``       ``LlamaForSequenceClassification`` (1 label): ``llama-sft``'s backbone, a new head
``gpt2-seqcls``        random ``GPT2ForSequenceClassification`` (1 label)
``gpt2-alt-seqcls``    the same with the alt tokenizer
=====================  ==========================================================================

Every model folder also holds its tokenizer, like a Hub repository, so
``AutoTokenizer.from_pretrained(kit.model_path(name))`` works. Sequence-classification heads are
untrained (scores near 0). Example::

    from rlhf_trainers.testing import get_kit, true_reward

    kit = get_kit()
    tokenizer = kit.load_tokenizer()
    policy = kit.load_model("llama-sft")
    prompts = list(kit.prompt_dataset("test", n=8)["prompt"])
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = policy.generate(**batch, max_new_tokens=12, do_sample=True, top_k=0)
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    print(true_reward(prompts, completions))

Caching: the default folder is ``$RLHF_TRAINERS_KIT_DIR`` if set, else
``~/.cache/rlhf_trainers/kit-<KIT_VERSION>``. A build happens in a temporary sibling folder that is
renamed into place when complete, under an ``fcntl`` lock so that concurrent processes (two test
sessions, two distributed ranks) build it once. A kit records a fingerprint of this file, so a kit
built by a different version of this module is rebuilt rather than silently reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:  # POSIX only; elsewhere concurrent builders are not guarded.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:  # pragma: no cover
    import datasets
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "CAUSAL_MODEL_NAMES",
    "CHAT_TEMPLATE",
    "CONJUNCTIONS",
    "CONNECTIVES",
    "EOS_TOKEN",
    "INTENSIFIERS",
    "KIT_VERSION",
    "LORA_TARGET_MODULES",
    "MODEL_NAMES",
    "NEGATIVE_WORDS",
    "NEUTRAL_WORDS",
    "NOUNS",
    "PAD_TOKEN",
    "POSITIVE_WORDS",
    "SEQ_CLS_MODEL_NAMES",
    "VOCABULARY",
    "OfflineKit",
    "default_kit_dir",
    "get_kit",
    "true_reward",
]

#: Bump when the assets change in a way users of an existing cache should not miss.
KIT_VERSION = "1"

# --------------------------------------------------------------------------------------------------
# The synthetic task
# --------------------------------------------------------------------------------------------------

#: Words that count +1 in :func:`true_reward`.
POSITIVE_WORDS: tuple[str, ...] = (
    "good", "great", "happy", "lovely", "nice", "bright",
    "warm", "fine", "sweet", "calm", "kind", "clean",
)  # fmt: skip
#: Words that count -1 in :func:`true_reward`.
NEGATIVE_WORDS: tuple[str, ...] = (
    "bad", "awful", "sad", "ugly", "cold", "dull",
    "poor", "rude", "dirty", "boring", "harsh", "grim",
)  # fmt: skip
#: Adjectives that count 0 (drawn as often as each sentiment class).
NEUTRAL_WORDS: tuple[str, ...] = (
    "big", "small", "new", "old", "long", "short",
    "loud", "quiet", "plain", "busy", "full", "simple",
)  # fmt: skip
#: Nouns of the prompts.
NOUNS: tuple[str, ...] = (
    "food", "movie", "room", "song", "book", "city", "park", "game",
    "show", "meal", "coffee", "hotel", "garden", "street", "house", "car",
    "phone", "story", "class", "team", "trip", "shop", "beach", "film",
    "dinner", "party", "town", "road", "train", "view", "lake", "music",
)  # fmt: skip
#: Intensifiers and conjunctions of the completions (all count 0).
INTENSIFIERS: tuple[str, ...] = ("very", "so", "really", "quite", "rather", "pretty", "truly", "fairly")
CONJUNCTIONS: tuple[str, ...] = ("and", "but", "yet")
CONNECTIVES: tuple[str, ...] = INTENSIFIERS + CONJUNCTIONS

# A prompt ends where the first adjective of the completion goes; {noun} is filled from NOUNS.
_PROMPT_TEMPLATES: tuple[str, ...] = (
    "the {noun} was",
    "the {noun} is",
    "i think the {noun} is",
    "my {noun} was",
    "this {noun} looks",
    "that {noun} seemed",
    "our {noun} feels",
    "we found the {noun}",
    "they said the {noun} was",
    "honestly , the {noun} is",
    "to me the {noun} sounds",
    "everyone agreed the {noun} was",
)
# {adj}: one of the three adjective classes, the class uniform; {adv}: an intensifier.
_COMPLETION_TEMPLATES: tuple[str, ...] = (
    "{adj} .",
    "{adv} {adj} .",
    "{adj} and {adj} .",
    "{adv} {adj} and {adj} .",
    "{adj} but {adj} .",
    "{adv} {adj} but {adv} {adj} .",
    "{adj} , {adj} and {adj} .",
    "{adj} yet {adv} {adj} .",
)
_TEMPLATE_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(w for t in _PROMPT_TEMPLATES for w in t.split() if w.isalpha())
)
#: Every word the generator can write (the corpus vocabulary).
VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(_TEMPLATE_WORDS + NOUNS + POSITIVE_WORDS + NEGATIVE_WORDS + NEUTRAL_WORDS + CONNECTIVES)
)

_POSITIVE = frozenset(POSITIVE_WORDS)
_NEGATIVE = frozenset(NEGATIVE_WORDS)
_ADJECTIVE_CLASSES = (POSITIVE_WORDS, NEGATIVE_WORDS, NEUTRAL_WORDS)
_WORD_RE = re.compile(r"[^\W_]+")
_SPECIAL_RE = re.compile(r"<\|[^|<>\s]*\|>")

# Seeds. The test prompt pool is a fixed quarter of the (template, noun) combinations.
_SPLIT_SEED = 20240
_TEST_FRACTION = 0.25
_DATA_SEEDS = {"train": 1001, "test": 2002}
_CORPUS_SEED = 31
_ALT_CORPUS_SEED = 47
_CORPUS_SIZE = 16384
_DEFAULT_PREFERENCE_ROWS = {"train": 2048, "test": 256}


def _text_of(item: Any) -> str:
    """The text of a completion/prompt: a string, one message, or a list of messages."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        content = item.get("content", "")
        if isinstance(content, str):
            return content
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    if isinstance(item, Sequence):
        return " ".join(_text_of(message) for message in item)
    raise TypeError(
        f"expected a string or a list of {{'role', 'content'}} messages, got {type(item).__name__}"
    )


def _words(text: str) -> list[str]:
    """Lower-cased words of `text`: runs of letters/digits; special tokens like ``<|pad|>`` removed."""
    return _WORD_RE.findall(_SPECIAL_RE.sub(" ", text).lower())


def true_reward(prompts: Sequence[Any] | None, completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """The task's hidden rule: the sentiment balance of each completion, a float in [-1, 1].

    For each completion: its words are the runs of letters and digits of the lower-cased text
    (whitespace and punctuation separate words and are not counted; special tokens such as
    ``<|endoftext|>`` are dropped first), and the reward is
    ``(#words in POSITIVE_WORDS - #words in NEGATIVE_WORDS) / max(#words, 1)``. An empty completion
    scores 0. The prompt is not scored.

    It has the signature of a rule-based reward function, so trainers can take it as one.

    Args:
        prompts: the prompts, strings or lists of ``{"role", "content"}`` messages; only their number is
            checked against `completions` (``None`` skips the check).
        completions: the completions (without the prompt), strings or lists of messages (the contents
            of all messages are scored together).
        **kwargs: ignored (trainers pass dataset columns and other context).

    Returns:
        One float per completion.

    Example:
        >>> true_reward(["the movie was"], [" really good but cold ."])
        [0.0]
        >>> true_reward(["the movie was"], [" good and nice ."])
        [0.6666666666666666]
    """
    if prompts is not None and len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions; they must pair up.")
    rewards = []
    for completion in completions:
        words = _words(_text_of(completion))
        balance = sum(w in _POSITIVE for w in words) - sum(w in _NEGATIVE for w in words)
        rewards.append(balance / max(len(words), 1))
    return rewards


def _prompt_pools() -> dict[str, list[str]]:
    """The disjoint train/test prompt pools, each in a fixed shuffled order."""
    combos = [t.format(noun=n) for t in _PROMPT_TEMPLATES for n in NOUNS]
    random.Random(_SPLIT_SEED).shuffle(combos)
    n_test = round(len(combos) * _TEST_FRACTION)
    return {"test": combos[:n_test], "train": combos[n_test:]}


_POOLS = _prompt_pools()


def _sample_completion(rng: random.Random) -> str:
    """One completion (with its leading space) from the generator."""
    template = rng.choice(_COMPLETION_TEMPLATES)
    words = []
    for token in template.split():
        if token == "{adj}":
            words.append(rng.choice(rng.choice(_ADJECTIVE_CLASSES)))
        elif token == "{adv}":
            words.append(rng.choice(INTENSIFIERS))
        else:
            words.append(token)
    return " " + " ".join(words)


def _check_split(split: str) -> None:
    if split not in _POOLS:
        raise ValueError(f"split={split!r}: must be 'train' or 'test'.")


def _generate_corpus(seed: int, n: int, split: str = "train") -> list[str]:
    """`n` sentences ``prompt + completion`` over the prompts of `split`."""
    rng = random.Random(seed)
    pool = _POOLS[split]
    return [rng.choice(pool) + _sample_completion(rng) for _ in range(n)]


def _generate_pairs(split: str, n: int) -> list[tuple[str, str, str]]:
    """`n` rows (prompt, chosen completion, rejected completion); chosen has the higher true reward."""
    rng = random.Random(_DATA_SEEDS[split])
    pool = _POOLS[split]
    rows = []
    for _ in range(n):
        prompt = rng.choice(pool)
        while True:
            a, b = _sample_completion(rng), _sample_completion(rng)
            ra, rb = true_reward(None, [a, b])
            if ra != rb:
                break
        rows.append((prompt, a, b) if ra > rb else (prompt, b, a))
    return rows


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------

#: End of text; also the bos token. Never the pad token.
EOS_TOKEN = "<|endoftext|>"
#: The padding token (distinct from eos).
PAD_TOKEN = "<|pad|>"
_ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
# Special tokens get the first ids, in this order; the alt tokenizer uses another order so that
# every id differs between the two (pad is 1 in the main tokenizer and 0 in the alt one).
_MAIN_SPECIALS = (EOS_TOKEN, PAD_TOKEN, *_ROLE_TOKENS)
_ALT_SPECIALS = (PAD_TOKEN, EOS_TOKEN, "<|system|>", "<|assistant|>", "<|user|>")
_MAIN_VOCAB_SIZE = 1024
_ALT_VOCAB_SIZE = 448

#: Jinja chat template: each message is ``<|role|>`` + content + newline (any role string works);
#: with ``add_generation_prompt=True`` the text ends with ``<|assistant|>``.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ content ~ '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def _train_bpe(texts: list[str], vocab_size: int, specials: Sequence[str]) -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Bare words (no leading space) follow special tokens in chat-formatted text: teach them too.
    bare = [" ".join([word] * 4) + "\n" + word for word in VOCABULARY]
    tokenizer.train_from_iterator(texts + bare * 8, trainer=trainer)
    return tokenizer


def _wrap_tokenizer(tokenizer: Any) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(_ROLE_TOKENS),
        padding_side="left",
        truncation_side="left",
        model_max_length=256,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------

#: Model names, by kind.
CAUSAL_MODEL_NAMES: tuple[str, ...] = ("llama", "gpt2", "gpt_neox", "llama-sft")
SEQ_CLS_MODEL_NAMES: tuple[str, ...] = ("llama-seqcls", "gpt2-seqcls", "gpt2-alt-seqcls")
MODEL_NAMES: tuple[str, ...] = CAUSAL_MODEL_NAMES + SEQ_CLS_MODEL_NAMES

#: LoRA ``target_modules`` for each kit architecture (key: ``config.model_type``): the attention
#: projections (and, for Llama, the MLP).
LORA_TARGET_MODULES: dict[str, list[str]] = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}

_MAX_POSITIONS = 256
_MODEL_SEEDS = {
    "llama": 11,
    "gpt2": 12,
    "gpt_neox": 13,
    "llama-seqcls": 14,
    "gpt2-seqcls": 15,
    "gpt2-alt-seqcls": 16,
}

# SFT of llama -> llama-sft: next-token loss on the corpus, a quarter of it chat-formatted.
_SFT_SEED = 17
_SFT_STEPS = 300
_SFT_BATCH = 32
_SFT_LR = 3e-3
_SFT_WARMUP = 20
_SFT_CHAT_FRACTION = 0.25


def _base_config(kind: str, tokenizer: PreTrainedTokenizerFast) -> Any:
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    if kind == "llama":
        return LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=_MAX_POSITIONS,
            tie_word_embeddings=True,
            **ids,
        )
    if kind == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=_MAX_POSITIONS, **ids)
    if kind == "gpt_neox":
        return GPTNeoXConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=_MAX_POSITIONS,
            rotary_pct=0.25,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            **ids,
        )
    raise ValueError(kind)  # pragma: no cover


def _init_model(auto_class: str, config: Any, seed: int) -> PreTrainedModel:
    """A randomly initialised model, seeded without touching the caller's global RNG."""
    import torch
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, auto_class).from_config(config)
    _set_generation_ids(model, config)
    return model.eval()


def _set_generation_ids(model: PreTrainedModel, config: Any) -> None:
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.pad_token_id = config.pad_token_id
        generation_config.eos_token_id = config.eos_token_id
        generation_config.bos_token_id = config.bos_token_id


def _seq_cls_config(config: Any) -> Any:
    config = config.__class__.from_dict(config.to_dict())
    config.num_labels = 1  # pad_token_id is kept: the head reads the last non-pad token
    config.architectures = None
    return config


def _sft_examples(tokenizer: PreTrainedTokenizerFast, corpus: list[str]) -> list[list[int]]:
    """Token ids of the SFT examples: sentences + eos, a fraction rendered as a chat instead."""
    rng = random.Random(_SFT_SEED)
    texts = []
    for sentence in corpus:
        if rng.random() < _SFT_CHAT_FRACTION:
            prompt, completion = _split_sentence(sentence)
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion.strip()},
            ]
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False) + EOS_TOKEN)
        else:
            texts.append(sentence + EOS_TOKEN)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _split_sentence(sentence: str) -> tuple[str, str]:
    """(prompt, completion) of a corpus sentence: the prompt is the longest matching pool prompt."""
    for prompt in _PROMPT_INDEX:
        if sentence.startswith(prompt + " "):
            return prompt, sentence[len(prompt) :]
    raise ValueError(sentence)  # pragma: no cover


_PROMPT_INDEX = sorted(_POOLS["train"] + _POOLS["test"], key=len, reverse=True)


def _train_sft(model: PreTrainedModel, examples: list[list[int]], pad_id: int) -> dict[str, float]:
    """Next-token training of `model` in place on `examples`; returns loss statistics."""
    import torch

    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SFT_SEED)
        rng = random.Random(_SFT_SEED)
        optimizer = torch.optim.AdamW(model.parameters(), lr=_SFT_LR, weight_decay=0.0)

        def schedule(step: int) -> float:
            if step < _SFT_WARMUP:
                return (step + 1) / _SFT_WARMUP
            return max(0.05, 1.0 - (step - _SFT_WARMUP) / (_SFT_STEPS - _SFT_WARMUP))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        model.train()
        for _ in range(_SFT_STEPS):
            batch = rng.sample(examples, _SFT_BATCH)
            input_ids, attention_mask, labels = _right_pad(batch, pad_id)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        model.eval()
    tail = losses[-50:]
    return {"sft_first_loss": losses[0], "sft_final_loss": sum(tail) / len(tail)}


def _right_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 3)


def _eval_loss(model: PreTrainedModel, examples: list[list[int]], pad_id: int) -> float:
    import torch

    with torch.no_grad():
        input_ids, attention_mask, labels = _right_pad(examples, pad_id)
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.item()


def _build(dest: Path) -> dict[str, Any]:
    """Build every asset into the (new, empty) folder `dest`; returns the manifest."""
    import torch
    import transformers

    start = time.perf_counter()
    timings: dict[str, float] = {}
    models: dict[str, dict[str, Any]] = {}
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" x 7 is noise here
    # One thread: these models are too small to gain from more (on a busy 2-core machine, two
    # threads were several times slower), and the weights then do not depend on the thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        manifest = _build_assets(dest, timings, models)
    finally:
        torch.set_num_threads(threads)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    manifest["build_seconds"] = round(time.perf_counter() - start, 3)
    return manifest


def _build_assets(dest: Path, timings: dict[str, float], models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import tokenizers
    import torch
    import transformers

    with _timed(timings, "tokenizer"):
        corpus = _generate_corpus(_CORPUS_SEED, _CORPUS_SIZE)
        tokenizer = _wrap_tokenizer(_train_bpe(corpus, _MAIN_VOCAB_SIZE, _MAIN_SPECIALS))
        tokenizer.save_pretrained(dest / "tokenizer")
    with _timed(timings, "tokenizer-alt"):
        alt_corpus = _generate_corpus(_ALT_CORPUS_SEED, _CORPUS_SIZE // 2)
        alt_tokenizer = _wrap_tokenizer(_train_bpe(alt_corpus, _ALT_VOCAB_SIZE, _ALT_SPECIALS))
        alt_tokenizer.save_pretrained(dest / "tokenizer-alt")

    def save(name: str, model: PreTrainedModel, tok: PreTrainedTokenizerFast, auto_class: str) -> None:
        folder = dest / "models" / name
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        models[name] = {
            "auto_class": auto_class,
            "model_type": model.config.model_type,
            "tokenizer": "alt" if tok is alt_tokenizer else "main",
            "parameters": sum(p.numel() for p in model.parameters()),
        }

    causal = "AutoModelForCausalLM"
    seq_cls = "AutoModelForSequenceClassification"
    configs = {kind: _base_config(kind, tokenizer) for kind in ("llama", "gpt2", "gpt_neox")}
    for kind in ("llama", "gpt2", "gpt_neox"):
        with _timed(timings, kind):
            save(kind, _init_model(causal, configs[kind], _MODEL_SEEDS[kind]), tokenizer, causal)

    with _timed(timings, "llama-sft"):
        sft = transformers.AutoModelForCausalLM.from_pretrained(dest / "models" / "llama")
        examples = _sft_examples(tokenizer, corpus)
        stats = _train_sft(sft, examples, tokenizer.pad_token_id)
        held_out = _sft_examples(tokenizer, _generate_corpus(_DATA_SEEDS["test"], 256, split="test"))
        stats["sft_eval_loss"] = _eval_loss(sft, held_out, tokenizer.pad_token_id)
        save("llama-sft", sft, tokenizer, causal)

    with _timed(timings, "llama-seqcls"):
        model = _init_model(seq_cls, _seq_cls_config(configs["llama"]), _MODEL_SEEDS["llama-seqcls"])
        model.model.load_state_dict(sft.model.state_dict())
        save("llama-seqcls", model, tokenizer, seq_cls)
    with _timed(timings, "gpt2-seqcls"):
        model = _init_model(seq_cls, _seq_cls_config(configs["gpt2"]), _MODEL_SEEDS["gpt2-seqcls"])
        save("gpt2-seqcls", model, tokenizer, seq_cls)
    with _timed(timings, "gpt2-alt-seqcls"):
        config = _seq_cls_config(_base_config("gpt2", alt_tokenizer))
        model = _init_model(seq_cls, config, _MODEL_SEEDS["gpt2-alt-seqcls"])
        save("gpt2-alt-seqcls", model, alt_tokenizer, seq_cls)

    return {
        "kit_version": KIT_VERSION,
        "fingerprint": _FINGERPRINT,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "tokenizer_vocab_size": len(tokenizer),
        "alt_tokenizer_vocab_size": len(alt_tokenizer),
        "models": models,
        **{key: round(value, 4) for key, value in stats.items()},
        "sft_steps": _SFT_STEPS,
        "builder_pid": os.getpid(),
        "build_timings_s": timings,
    }


# --------------------------------------------------------------------------------------------------
# The kit folder
# --------------------------------------------------------------------------------------------------

_MANIFEST = "kit.json"


def _source_fingerprint() -> str:
    """Hash of this module's source as imported: a kit built by other code is rebuilt, not reused."""
    try:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    except OSError:  # pragma: no cover - e.g. running from a zip
        return "unknown"


_FINGERPRINT = _source_fingerprint()


def _read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of a complete kit of this version at `root`, else None."""
    try:
        manifest = json.loads((root / _MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("kit_version") != KIT_VERSION or manifest.get("fingerprint") != _FINGERPRINT:
        return None
    return manifest


class OfflineKit:
    """A built kit folder: paths to its assets, loaders, and the synthetic task's datasets.

    Get one from :func:`get_kit`, which builds the folder when needed.
    """

    def __init__(self, root: str | os.PathLike[str], manifest: dict[str, Any] | None = None) -> None:
        self.root: Path = Path(root)
        """The kit folder."""
        if manifest is None:
            manifest = _read_manifest(self.root)
            if manifest is None:
                raise FileNotFoundError(
                    f"{self.root} is not a complete offline kit of version {KIT_VERSION}; use get_kit()."
                )
        self.manifest: dict[str, Any] = manifest
        """The build record: versions, vocabulary sizes, parameter counts, SFT losses, build timings."""

    def __repr__(self) -> str:
        return f"OfflineKit(root={str(self.root)!r}, version={KIT_VERSION!r})"

    @property
    def tokenizer_path(self) -> Path:
        """Folder of the main tokenizer (``AutoTokenizer.from_pretrained`` loads it)."""
        return self.root / "tokenizer"

    @property
    def alt_tokenizer_path(self) -> Path:
        """Folder of the alternative tokenizer (other vocabulary and ids; used by ``gpt2-alt-seqcls``)."""
        return self.root / "tokenizer-alt"

    def load_tokenizer(self, which: str = "main") -> PreTrainedTokenizerFast:
        """The main (``which="main"``) or the alternative (``"alt"``) tokenizer.

        Padding side "left", pad token ``<|pad|>`` (never eos), eos/bos ``<|endoftext|>``, chat template
        :data:`CHAT_TEMPLATE`. No special tokens are added when encoding.
        """
        from transformers import AutoTokenizer

        paths = {"main": self.tokenizer_path, "alt": self.alt_tokenizer_path}
        if which not in paths:
            raise ValueError(f"which={which!r}: must be 'main' or 'alt'.")
        return AutoTokenizer.from_pretrained(paths[which])

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names of the models, for :meth:`model_path` and :meth:`load_model`."""
        return tuple(self.manifest["models"])

    def model_path(self, name: str) -> Path:
        """Folder of model `name`: config, safetensors weights, generation config and its tokenizer."""
        if name not in self.manifest["models"]:
            raise KeyError(f"no kit model {name!r}; the kit has {', '.join(self.model_names)}.")
        return self.root / "models" / name

    def load_model(self, name: str, **from_pretrained_kwargs: Any) -> PreTrainedModel:
        """Model `name` through its Auto class (causal LM or sequence classification), in eval mode.

        Keyword arguments go to ``from_pretrained`` (e.g. ``dtype=torch.bfloat16``).
        """
        import transformers

        path = self.model_path(name)
        auto_class = getattr(transformers, self.manifest["models"][name]["auto_class"])
        return auto_class.from_pretrained(path, **from_pretrained_kwargs)

    def corpus(self, n: int | None = None) -> list[str]:
        """The generated corpus (train-split prompts) the tokenizer and ``llama-sft`` were trained on.

        Args:
            n: how many sentences (the first `n`; any size, generated on demand); default: the
                corpus as used by the build (16384 sentences).
        """
        return _generate_corpus(_CORPUS_SEED, _CORPUS_SIZE if n is None else _check_n(n))

    def prompt_dataset(
        self, split: str = "train", n: int | None = None, chat: bool = False
    ) -> datasets.Dataset:
        """Prompts of `split` in a column "prompt".

        Args:
            split: "train" or "test": disjoint pools of (template, noun) combinations
                (288 and 96 distinct prompts), each in a fixed shuffled order.
            n: number of rows; default all distinct prompts of the split. Beyond the pool size the
                pool repeats.
            chat: if True each prompt is a list with one ``{"role": "user", "content": ...}`` message.
        """
        import datasets

        _check_split(split)
        pool = _POOLS[split]
        n = len(pool) if n is None else _check_n(n)
        prompts: list[Any] = [pool[i % len(pool)] for i in range(n)]
        if chat:
            prompts = [[{"role": "user", "content": p}] for p in prompts]
        return datasets.Dataset.from_dict({"prompt": prompts})

    def preference_dataset(
        self, split: str = "train", n: int | None = None, shape: str = "explicit"
    ) -> datasets.Dataset:
        """Preference pairs: for a prompt of `split`, two different generated completions, the one with
        the higher :func:`true_reward` is "chosen" (pairs that tie are resampled).

        Args:
            split: "train" or "test" (disjoint prompts, different seeds).
            n: number of rows; default 2048 for "train", 256 for "test". Deterministic, and the first
                `n` rows do not depend on `n`.
            shape: "explicit": columns prompt, chosen, rejected, the completions without the prompt
                (each starts with a space, so ``prompt + chosen`` is the full text);
                "implicit": columns chosen, rejected holding the full texts ``prompt + completion``;
                "chat": prompt (a user message list), chosen and rejected (assistant message lists
                whose content is the completion without its leading space).
        """
        import datasets

        _check_split(split)
        n = _DEFAULT_PREFERENCE_ROWS[split] if n is None else _check_n(n)
        rows = _generate_pairs(split, n)
        prompts = [r[0] for r in rows]
        chosen = [r[1] for r in rows]
        rejected = [r[2] for r in rows]
        if shape == "explicit":
            columns: dict[str, list[Any]] = {"prompt": prompts, "chosen": chosen, "rejected": rejected}
        elif shape == "implicit":
            columns = {
                "chosen": [p + c for p, c in zip(prompts, chosen, strict=True)],
                "rejected": [p + r for p, r in zip(prompts, rejected, strict=True)],
            }
        elif shape == "chat":
            columns = {
                "prompt": [[{"role": "user", "content": p}] for p in prompts],
                "chosen": [[{"role": "assistant", "content": c.strip()}] for c in chosen],
                "rejected": [[{"role": "assistant", "content": r.strip()}] for r in rejected],
            }
        else:
            raise ValueError(f"shape={shape!r}: must be 'explicit', 'implicit' or 'chat'.")
        return datasets.Dataset.from_dict(columns)


def _check_n(n: int) -> int:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r}: must be a non-negative integer (or None for the default).")
    return n


_KITS: dict[str, OfflineKit] = {}


def default_kit_dir() -> Path:
    """``$RLHF_TRAINERS_KIT_DIR`` if set, else ``~/.cache/rlhf_trainers/kit-<KIT_VERSION>``."""
    env = os.environ.get("RLHF_TRAINERS_KIT_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "rlhf_trainers" / f"kit-{KIT_VERSION}"


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on `lock_path` (blocks while another process holds it)."""
    with open(lock_path, "a+") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def get_kit(root: str | os.PathLike[str] | None = None) -> OfflineKit:
    """The offline kit at `root` (default :func:`default_kit_dir`), built there first if needed.

    The first call in a process checks the folder's manifest; a missing, incomplete, older or
    differently-built kit is (re)built: 10-15 s on 2 CPU cores. Later calls for the same folder
    return the same object instantly.

    Building happens in a temporary sibling folder renamed into place at the end, under a lock file
    next to `root` (``<root>.lock``), so concurrent callers build once: the others wait and load.
    A folder that exists, is not empty and is not a kit is never overwritten (ValueError).
    """
    root = Path(root).expanduser() if root is not None else default_kit_dir()
    root = root.absolute()
    key = str(root)
    if key in _KITS:
        return _KITS[key]
    manifest = _read_manifest(root)
    if manifest is None:
        root.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(root.parent / f"{root.name}.lock"):
            manifest = _read_manifest(root)  # another process may have built it while we waited
            if manifest is None:
                manifest = _build_in_place(root)
    kit = _KITS[key] = OfflineKit(root, manifest)
    return kit


def _build_in_place(root: Path) -> dict[str, Any]:
    """Build into a temporary sibling, then swap it in for `root` (caller holds the lock)."""
    if root.exists() and (not root.is_dir() or (any(root.iterdir()) and not (root / _MANIFEST).exists())):
        raise ValueError(
            f"{root} exists and is not an offline kit; pass an empty or new folder to get_kit(), "
            "or remove it."
        )
    tmp = root.parent / f".{root.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        manifest = _build(tmp)
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if root.exists():  # an empty folder, or a kit of another version: moved aside, then removed
            old = root.parent / f".{root.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(root, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
