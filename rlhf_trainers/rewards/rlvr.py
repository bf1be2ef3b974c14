"""Verifiable rewards (RLVR): tasks graded by code, for training a real model with reward functions only.

Two tasks, each with deterministic, disjoint "train" and "test" prompts (chat messages), a shaped training
reward and a strict held-out score:

``addition``
    "What is 7 + 12? Reply with the number only." (operands 1-20). The ``answer`` column holds the sum.
    :func:`success` is 1 when the completion, with surrounding whitespace and trailing periods removed, is
    exactly the sum ("19", " 19.", "19\\n"), else 0. The training reward (:func:`addition_reward`) is 1.0
    for that, 0.5 when the sum appears as a number somewhere in a longer answer ("7 + 12 = 19"), else 0:
    partial credit for a correct answer in the wrong format, so the policy first finds the sum and then
    learns to drop the words around it.
``word_count``
    "Describe the ocean in exactly 4 words." (N from 3 to 6). The ``num_words`` column holds N.
    :func:`success` is 1 when the completion has exactly N words (a word: a whitespace-separated run that
    holds at least one letter or digit, so "sun-kissed" is one word and a lone "-" none), else 0. The
    training reward (:func:`word_count_reward`) is 1.0 for exactly N and ``0.5 * max(0, 1 - |n - N| / N)``
    otherwise: closer counts earn more.

Both functions read only the completion's text (a string, or chat messages whose contents are joined, as
the trainers pass them: decoded without special tokens). Edge cases: an empty completion scores 0; extra
text fails the strict score; a completion cut off at the length limit (no EOS) is scored on the text it
has, which is then longer than a correct answer and fails (the trainers' ``missing_eos_penalty`` can
penalise it further); special tokens such as ``<|im_end|>`` left in a text are ignored.

Each grader is also a reward source (:class:`rlhf_trainers.rewards.RewardSource`): :func:`reward_source`
and :func:`success_source` wrap them, for the trainers' ``reward_funcs`` next to any other source.

This module imports only the standard library at module level, so that another virtual environment (for
instance TRL's, in ``benchmarks/``) can load it by path (``rlhf_trainers/rewards/rlvr.py``);
:func:`task_dataset` imports ``datasets``, :func:`reward_source` and :func:`success_source` import torch.

Example::

    from rlhf_trainers.rewards.rlvr import reward_function, success, task_rows

    rows = task_rows("addition", "test", n=2)
    reward_function("addition")(prompts=[r["prompt"] for r in rows], completions=["19", "no idea"],
                                answer=[r["answer"] for r in rows])
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import datasets

    from .functions import RewardFunctionSource

__all__ = [
    "TASKS",
    "addition_reward",
    "completion_text",
    "count_words",
    "reward_function",
    "reward_source",
    "success",
    "success_function",
    "success_source",
    "task_dataset",
    "task_rows",
    "word_count_reward",
]

#: The tasks this module implements.
TASKS: tuple[str, ...] = ("addition", "word_count")

_SPLITS = ("train", "test")
_SPLIT_SEED = 2111
# A fixed quarter of each task's prompt pool is held out for testing.
_TEST_FRACTION = 0.25

_ADDITION_MAX = 20
_ADDITION_TEMPLATE = "What is {a} + {b}? Reply with the number only."

_WORD_COUNTS = (3, 4, 5, 6)
_WORD_COUNT_TEMPLATE = "Describe {subject} in exactly {n} words."
_SUBJECTS = (
    "the ocean", "a cat", "the moon", "a forest", "the city at night", "a cup of coffee", "winter",
    "a mountain", "the desert", "a river", "a library", "the sun", "a thunderstorm", "a garden",
    "a train station", "the sky", "a dog", "autumn", "a bakery", "the beach", "a candle", "a volcano",
    "a waterfall", "the wind", "a snowman", "a castle", "a bicycle", "spring", "a kitchen", "a lighthouse",
    "a piano", "the rain", "an island", "a bridge", "a market", "a butterfly", "the stars", "a school",
    "a farm", "a clock", "a rainbow", "a ship", "a museum", "summer", "an owl", "a park", "a village",
    "a guitar", "the fog", "a campfire", "a robot", "a painting", "a horse", "a storm at sea", "a meadow",
    "a violin", "a cave", "an apple", "a friend", "a city park",
)  # fmt: skip

_SPECIAL_RE = re.compile(r"<\|[^|<>\s]*\|>")
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_WORD_RE = re.compile(r"[^\W_]")


# ---- data ---------------------------------------------------------------------------------------


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown RLVR task {task!r}; expected one of {', '.join(TASKS)}.")


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'.")


def _split_pool(pool: list[Any], split: str) -> list[Any]:
    """The `split` part of `pool`: a fixed seeded shuffle, the first quarter "test", the rest "train"."""
    shuffled = list(pool)
    random.Random(_SPLIT_SEED).shuffle(shuffled)
    n_test = max(1, round(len(shuffled) * _TEST_FRACTION))
    return shuffled[:n_test] if split == "test" else shuffled[n_test:]


def _message(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def task_rows(task: str, split: str, n: int | None = None) -> list[dict[str, Any]]:
    """The rows of `task`'s `split` ("train" or "test"), deterministic, the two splits disjoint.

    Each row is ``{"prompt": [{"role": "user", "content": ...}], <the columns the reward needs>}``:
    ``answer`` (int) for addition, ``num_words`` (int) for word_count. The rows are the split's prompt
    pool in a fixed order (addition: 300 train / 100 test; word_count: 180 / 60), repeated when `n` asks
    for more; `n` None gives the pool once.
    """
    _check_task(task)
    _check_split(split)
    if task == "addition":
        pairs = [(a, b) for a in range(1, _ADDITION_MAX + 1) for b in range(1, _ADDITION_MAX + 1)]
        pool = [
            {"prompt": _message(_ADDITION_TEMPLATE.format(a=a, b=b)), "answer": a + b}
            for a, b in _split_pool(pairs, split)
        ]
    else:
        # Split by subject, so that the test set asks about things never seen in training.
        subjects = _split_pool(list(_SUBJECTS), split)
        pool = [
            {"prompt": _message(_WORD_COUNT_TEMPLATE.format(subject=s, n=k)), "num_words": k}
            for s in subjects
            for k in _WORD_COUNTS
        ]
        random.Random(_SPLIT_SEED + 1).shuffle(pool)
    if n is None:
        return pool
    if n < 0:
        raise ValueError(f"n={n}: expected a non-negative number of rows (or None for the whole pool).")
    return [dict(pool[i % len(pool)]) for i in range(n)]


def task_dataset(task: str, split: str, n: int | None = None) -> datasets.Dataset:
    """:func:`task_rows` as a ``datasets.Dataset`` (a ``prompt`` column of chat messages, plus the
    reward's columns), ready for ``PPOTrainer``/``RLOOTrainer``'s ``train_dataset``/``eval_dataset``."""
    import datasets

    return datasets.Dataset.from_list(task_rows(task, split, n))


# ---- grading ------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """The text of a completion: a string as is; a message or a list of messages, their contents joined
    by spaces. Special tokens (``<|im_end|>``...) are removed."""
    if isinstance(completion, str):
        text = completion
    elif isinstance(completion, dict):
        content = completion.get("content", "")
        if isinstance(content, str):
            text = content
        else:
            text = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    elif isinstance(completion, Sequence):
        text = " ".join(completion_text(message) for message in completion)
    else:
        raise TypeError(
            f"expected a completion as a string or a list of {{'role', 'content'}} messages, got "
            f"{type(completion).__name__}"
        )
    return _SPECIAL_RE.sub(" ", text)


def _bare_answer(text: str) -> str:
    """`text` without surrounding whitespace and trailing periods: "19", " 19.", "19\\n" are all "19"."""
    return text.strip().rstrip(".").strip()


def count_words(text: str) -> int:
    """Words in `text`: whitespace-separated runs holding at least one letter or digit ("sun-kissed"
    is one word; punctuation alone, like "-" or "...", is none)."""
    return sum(1 for token in text.split() if _WORD_RE.search(token))


def _check_lengths(completions: Sequence[Any], **columns: Sequence[Any]) -> None:
    for name, values in columns.items():
        if values is None:
            raise ValueError(f"the column {name!r} is required to grade these completions.")
        if len(values) != len(completions):
            raise ValueError(
                f"{len(completions)} completions but {len(values)} values of {name!r}: expected one each."
            )


def _addition_success(completions: Sequence[Any], answer: Sequence[Any]) -> list[float]:
    _check_lengths(completions, answer=answer)
    return [
        float(_bare_answer(completion_text(c)) == str(int(a)))
        for c, a in zip(completions, answer, strict=True)
    ]


def _word_count_success(completions: Sequence[Any], num_words: Sequence[Any]) -> list[float]:
    _check_lengths(completions, num_words=num_words)
    return [
        float(count_words(completion_text(c)) == int(k)) for c, k in zip(completions, num_words, strict=True)
    ]


def addition_reward(
    prompts: Sequence[Any] | None = None,
    completions: Sequence[Any] = (),
    answer: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float]:
    """The addition task's training reward, one float per completion: 1.0 when the completion is exactly
    the sum (whitespace and trailing periods aside), 0.5 when the sum is one of the numbers in a longer
    text ("7 + 12 = 19."), 0.0 otherwise (empty, wrong, no number). `prompts` and other columns are
    ignored."""
    strict = _addition_success(completions, answer)  # type: ignore[arg-type]
    rewards = []
    for completion, a, exact in zip(completions, answer, strict, strict=True):  # type: ignore[arg-type]
        if exact:
            rewards.append(1.0)
            continue
        numbers = _NUMBER_RE.findall(completion_text(completion))
        rewards.append(0.5 if str(int(a)) in numbers else 0.0)
    return rewards


def word_count_reward(
    prompts: Sequence[Any] | None = None,
    completions: Sequence[Any] = (),
    num_words: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float]:
    """The word_count task's training reward, one float per completion: 1.0 for exactly ``num_words``
    words, else ``0.5 * max(0, 1 - |n - N| / N)`` (n words written, N asked; an empty completion with
    N = 4 gets 0). `prompts` and other columns are ignored."""
    _check_lengths(completions, num_words=num_words)  # type: ignore[arg-type]
    rewards = []
    for completion, k in zip(completions, num_words, strict=True):  # type: ignore[arg-type]
        n, k = count_words(completion_text(completion)), int(k)
        rewards.append(1.0 if n == k else 0.5 * max(0.0, 1.0 - abs(n - k) / k))
    return rewards


_REWARDS: dict[str, Callable[..., list[float]]] = {
    "addition": addition_reward,
    "word_count": word_count_reward,
}


def reward_function(task: str) -> Callable[..., list[float]]:
    """`task`'s training reward, a reward function for the trainers' ``reward_funcs``: called as
    ``f(prompts=..., completions=..., **columns)`` it returns one float per completion (see
    :func:`addition_reward`, :func:`word_count_reward`)."""
    _check_task(task)
    return _REWARDS[task]


def success(task: str, completions: Sequence[Any], **columns: Any) -> list[float]:
    """The strict held-out score of `task`, 1.0 or 0.0 per completion.

    addition: the completion, without surrounding whitespace and trailing periods, is exactly the
    ``answer`` column's sum. word_count: it has exactly ``num_words`` words (:func:`count_words`). Other
    columns (``prompt``...) are ignored.
    """
    _check_task(task)
    if task == "addition":
        return _addition_success(completions, columns.get("answer"))  # type: ignore[arg-type]
    return _word_count_success(completions, columns.get("num_words"))  # type: ignore[arg-type]


def success_function(task: str) -> Callable[..., list[float]]:
    """:func:`success` of `task` as a reward function named ``success`` (``f(prompts=..., completions=...,
    **columns)``). Given to a trainer with weight 0.0 (``reward_weights``), it does not change the reward
    but is logged beside it: ``objective/scores/success`` in training and ``eval_objective/scores/success``,
    the held-out success rate, in ``evaluate()``."""
    _check_task(task)

    def success_(
        prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (), **columns: Any
    ) -> list[float]:
        return success(task, completions, **columns)

    success_.__name__ = success_.__qualname__ = "success"
    return success_


def reward_source(task: str) -> RewardFunctionSource:
    """:func:`reward_function` of `task` as a reward source (named as the function:
    ``addition_reward``, ``word_count_reward``), for the trainers' ``reward_funcs``."""
    from .functions import RewardFunctionSource

    return RewardFunctionSource(reward_function(task))


def success_source(task: str) -> RewardFunctionSource:
    """:func:`success_function` of `task` as a reward source named ``success`` (give it weight 0.0 to log
    the strict score beside the reward without training on it)."""
    from .functions import RewardFunctionSource

    return RewardFunctionSource(success_function(task))
