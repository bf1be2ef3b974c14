"""The synthetic task of the offline kit: sentences from templates, the disjoint train/test prompt
pools, and the hidden preference :func:`true_reward` (the task is described in
:mod:`rlhf_trainers.testing`).

This module imports only the standard library and nothing of this package: the benchmarks load it by
file path (``benchmarks/vs_trl_worker.py``) to score with :func:`true_reward` in environments where
this project is not installed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

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
            first, second = _sample_completion(rng), _sample_completion(rng)
            first_reward, second_reward = true_reward(None, [first, second])
            if first_reward != second_reward:
                break
        rows.append((prompt, first, second) if first_reward > second_reward else (prompt, second, first))
    return rows


def _split_sentence(sentence: str) -> tuple[str, str]:
    """(prompt, completion) of a corpus sentence: the prompt is the longest matching pool prompt."""
    for prompt in _PROMPT_INDEX:
        if sentence.startswith(prompt + " "):
            return prompt, sentence[len(prompt) :]
    raise ValueError(sentence)  # pragma: no cover


_PROMPT_INDEX = sorted(_POOLS["train"] + _POOLS["test"], key=len, reverse=True)
