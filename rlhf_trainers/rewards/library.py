"""Ready-made reward functions with the names, arguments and results of TRL 1.16's ``trl.rewards``.

A TRL script that does ``from trl.rewards import accuracy_reward`` runs here with the import changed to
``from rlhf_trainers.rewards import accuracy_reward``. Each function is called as the trainers call every
reward function (:class:`~rlhf_trainers.rewards.RewardFunctionSource`: keyword arguments, the dataset's
columns among them) and can also be called directly, positionally, as TRL's examples do:

- :func:`accuracy_reward` (``completions, solution``): 1.0 when the completion's math answer equals the
  ``solution`` column's, else 0.0; ``None`` (the row is left out) when the solution cannot be parsed.
- :func:`reasoning_accuracy_reward` (``completions, solution, reasoning_delimiters``): the same, graded on
  the text after the reasoning (``</think>`` by default); 0.0 when the reasoning never ends.
- :func:`think_format_reward` (``completions``): 1.0 for ``<think>...</think>`` then the answer, else 0.0.
- :func:`get_cosine_scaled_reward` (``max_len``, ...): a reward function of ``completions, solution,
  completion_ids`` that scales correctness by the completion's length (shorter is better when correct).
- :func:`get_soft_overlong_punishment` (``max_completion_len, soft_punish_cache``): a reward function of
  ``completion_ids`` that punishes completions near and over a length limit (DAPO).
- :func:`get_repetition_penalty_reward` (``ngram_size, max_penalty``): a reward function of
  ``completion_ids`` that punishes repeated token n-grams.

Completions may be conversational (each a list holding one assistant message, as the trainers pass them
for conversational prompts) or plain strings (text prompts); TRL's functions take the conversational form
only. The ``get_*`` factories return picklable callable objects whose ``__name__`` is TRL's
(``cosine_scaled_reward``, ``soft_overlong_punishment_reward``, ``repetition_penalty_reward``), so the
metrics carry TRL's names: ``rewards/<name>/mean``.

The math grading (:func:`accuracy_reward`, :func:`reasoning_accuracy_reward`, :func:`get_cosine_scaled_reward`)
uses the optional `math-verify <https://github.com/huggingface/Math-Verify>`_ package, with TRL's settings:
the gold solution parsed with math-verify's defaults; the completion's answer parsed as LaTeX only
and only where it is marked: a ``\\boxed{}`` (tried first; several boxes make a set, ``{2, 3}``) or a
``$...$`` after an anchor such as "answer:" or "the answer is" (a bare ``3``, or ``$3$`` in passing, is not
an answer), units normalized, malformed operators not repaired, the first match kept; the two compared by
``verify``. Timeouts (10 s to parse, 5 s to verify) use ``signal.alarm`` and so apply in the main thread only;
elsewhere they are off. Install it with ``pip install "rlhf_trainers[math]"``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .rlvr import completion_text

__all__ = [
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "think_format_reward",
]

#: A reward function's ``log_extra`` argument: ``log_extra(column, one value per completion)``.
LogExtra = Callable[[str, list], None]

_UNPARSEABLE = "[unparseable]"
_SKIPPED = "[skipped]"
_INCOMPLETE = "[incomplete reasoning]"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


# ---- shared helpers ------------------------------------------------------------------------------


def _texts(completions: Any, func: str) -> list[str]:
    """The completions' texts: strings as they are, conversational completions' message contents."""
    if isinstance(completions, (str, bytes)) or not isinstance(completions, Sequence):
        raise TypeError(
            f"{func} expects `completions` as a list (one completion per row: a string, or a list with one "
            f"assistant message {{'role': 'assistant', 'content': ...}}); got {type(completions).__name__}."
        )
    return [completion_text(completion) for completion in completions]


def _check_same_length(func: str, completions: Sequence[Any], name: str, values: Any) -> list[Any]:
    """``values`` as a list, refused unless it has one entry per completion."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{func} expects `{name}` as a list with one entry per completion; got {type(values).__name__}."
        )
    if len(values) != len(completions):
        raise ValueError(
            f"{func} got {len(completions)} completions but {len(values)} `{name}` values; pass one per "
            f"completion (in a trainer, `{name}` is the dataset column of that name)."
        )
    return list(values)


def _length(ids: Any) -> int:
    return len(ids.tolist() if hasattr(ids, "tolist") else ids)


def _math_verify(func: str) -> tuple[Any, Any, Any, Any]:
    """math-verify's ``parse``, ``verify``, ``LatexExtractionConfig`` and latex2sympy2's
    ``NormalizationConfig``, or an ImportError that says how to install them."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as err:
        raise ImportError(
            f"{func} grades math answers with the math-verify package, which is not installed ({err}). "
            'Install it with: pip install "rlhf_trainers[math]" (or pip install math-verify).'
        ) from err
    return parse, verify, LatexExtractionConfig, NormalizationConfig


class _MathGrader:
    """Parses gold solutions and answers and compares them with math-verify, with TRL's settings."""

    def __init__(self, func: str) -> None:
        self._parse, self._verify, latex_config, normalization = _math_verify(func)
        # signal.alarm, behind math-verify's timeouts, works in the main thread only.
        in_main_thread = threading.current_thread() is threading.main_thread()
        self._parse_timeout = 10 if in_main_thread else None
        self._verify_timeout = 5 if in_main_thread else None
        if not in_main_thread:  # math-verify warns at every call that its timeout is off
            for name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(name).setLevel(logging.ERROR)
        self._answer_config = [
            latex_config(
                normalization_config=normalization(units=True),
                boxed_match_priority=0,
                try_extract_without_anchor=False,
            )
        ]
        self.gold_parsed: list[str] = []
        self.answer_parsed: list[str] = []

    def grade(self, answer: str, solution: str) -> float | None:
        """1.0 when ``answer`` holds the solution's value, 0.0 when not, None when the solution cannot be
        parsed; records what was parsed, for the ``gold_parsed`` and ``answer_parsed`` columns."""
        gold = self._parse(solution, parsing_timeout=self._parse_timeout)
        if not gold:
            self.gold_parsed.append(_UNPARSEABLE)
            self.answer_parsed.append(_SKIPPED)
            return None
        parsed = self._parse(
            answer,
            extraction_config=self._answer_config,
            extraction_mode="first_match",
            parsing_timeout=self._parse_timeout,
        )
        self.gold_parsed.append(str(gold))
        self.answer_parsed.append(str(parsed) if parsed else _UNPARSEABLE)
        return float(self._verify(gold, parsed, timeout_seconds=self._verify_timeout))

    def skip(self, reason: str) -> None:
        self.gold_parsed.append(reason)
        self.answer_parsed.append(reason)

    def log(self, solution: list[str], log_extra: LogExtra | None) -> None:
        if log_extra is not None:
            log_extra("solution", list(solution))
            log_extra("gold_parsed", list(self.gold_parsed))
            log_extra("answer_parsed", list(self.answer_parsed))


# ---- accuracy ------------------------------------------------------------------------------------


def accuracy_reward(
    completions: list[list[dict[str, str]]] | list[str],
    solution: list[str],
    log_extra: LogExtra | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r"""Whether each completion's math answer equals its gold solution (TRL's ``accuracy_reward``).

    Args:
        completions: one completion per row: a list holding one assistant message (conversational
            prompts) or a string.
        solution: the gold answer of each row, as raw text or LaTeX (the dataset's ``solution`` column).
        log_extra: given by the trainers: logs the ``solution``, ``gold_parsed`` and ``answer_parsed``
            columns to the completions table (``[unparseable]`` / ``[skipped]`` where nothing was parsed).
        **kwargs: the trainers' other arguments, unused.

    Returns:
        1.0 where the answer (a ``\boxed{}``, or LaTeX after "answer:"; see the module docstring)
        verifies against the solution, 0.0 where it does not or cannot be parsed, ``None`` where the solution cannot be parsed (the row is left out of
        the reward). Needs math-verify (``pip install "rlhf_trainers[math]"``); see the module docstring.

    Example::

        >>> accuracy_reward(
        ...     [[{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{3}}"}],
        ...      [{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{2}}"}]],
        ...     [r"\frac{1}{3}", r"\frac{1}{3}"],
        ... )
        [1.0, 0.0]
    """
    texts = _texts(completions, "accuracy_reward")
    solution = _check_same_length("accuracy_reward", texts, "solution", solution)
    grader = _MathGrader("accuracy_reward")
    rewards = [grader.grade(text, sol) for text, sol in zip(texts, solution, strict=True)]
    grader.log(solution, log_extra)
    return rewards


def reasoning_accuracy_reward(
    completions: list[list[dict[str, str]]] | list[str],
    solution: list[str],
    reasoning_delimiters: list[str] | None = None,
    log_extra: LogExtra | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r""":func:`accuracy_reward` on the final answer only, after the reasoning (TRL's
    ``reasoning_accuracy_reward``).

    The answer is the text after the last occurrence of the first delimiter of ``reasoning_delimiters``
    (tried in order) that the completion contains. A completion that contains none (its reasoning never
    ended) gets 0.0, even when the solution cannot be parsed, and ``[incomplete reasoning]`` in the
    logged columns; an answer in the reasoning does not count.

    Args:
        completions: one completion per row: a list holding one assistant message, or a string.
        solution: the gold answer of each row (the dataset's ``solution`` column).
        reasoning_delimiters: the strings that end the reasoning; None: ``["</think>"]``.
        log_extra: given by the trainers: logs ``solution``, ``gold_parsed`` and ``answer_parsed``.
        **kwargs: the trainers' other arguments, unused.

    Returns:
        One reward per completion: 1.0, 0.0 or ``None`` as :func:`accuracy_reward`. Needs math-verify.

    Example::

        >>> reasoning_accuracy_reward(
        ...     [r"<think>...</think> The answer is \boxed{\frac{1}{3}}",
        ...      r"<think>Maybe \boxed{\frac{1}{3}}, still thinking"],
        ...     [r"\frac{1}{3}", r"\frac{1}{3}"],
        ... )
        [1.0, 0.0]
    """
    func = "reasoning_accuracy_reward"
    texts = _texts(completions, func)
    solution = _check_same_length(func, texts, "solution", solution)
    if reasoning_delimiters is None:
        reasoning_delimiters = [_THINK_CLOSE]
    elif isinstance(reasoning_delimiters, str) or not all(
        isinstance(d, str) and d for d in reasoning_delimiters
    ):
        raise TypeError(
            f"{func} expects `reasoning_delimiters` as a list of non-empty strings, e.g. ['</think>']; got "
            f"{reasoning_delimiters!r}."
        )
    grader = _MathGrader(func)
    rewards: list[float | None] = []
    for text, sol in zip(texts, solution, strict=True):
        delimiter = next((d for d in reasoning_delimiters if d in text), None)
        if delimiter is None:
            grader.skip(_INCOMPLETE)
            rewards.append(0.0)
        else:
            rewards.append(grader.grade(text.rsplit(delimiter, 1)[1], sol))
    grader.log(solution, log_extra)
    return rewards


def think_format_reward(completions: list[list[dict[str, str]]] | list[str], **kwargs: Any) -> list[float]:
    """1.0 for each completion that is ``<think>`` reasoning ``</think>`` then anything, else 0.0 (TRL's
    ``think_format_reward``).

    The completion must start with ``<think>`` (no leading whitespace), hold no second ``<think>``, and
    close the reasoning with ``</think>``; what follows is free.

    Args:
        completions: one completion per row: a list holding one assistant message, or a string.
        **kwargs: the trainers' other arguments, unused.

    Example::

        >>> think_format_reward(["<think>\\nReasoning.\\n</think>\\nAnswer.", "<think>\\nReasoning. Answer."])
        [1.0, 0.0]
    """
    rewards = []
    for text in _texts(completions, "think_format_reward"):
        rest = text[len(_THINK_OPEN) :]
        ok = text.startswith(_THINK_OPEN) and _THINK_OPEN not in rest and _THINK_CLOSE in rest
        rewards.append(1.0 if ok else 0.0)
    return rewards


# ---- length and repetition ----------------------------------------------------------------------


def _check_positive_int(func: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{func}: `{name}` must be an integer >= {minimum}; got {value!r}.")


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> Callable[..., list[float | None]]:
    """A reward function that scales correctness by length on a cosine schedule (TRL's
    ``get_cosine_scaled_reward``; "Demystifying Long Chain-of-Thought Reasoning", appendix C.1).

    The returned function, ``f(completions, solution, completion_ids, **kwargs)``, grades each completion
    as :func:`accuracy_reward` does (needs math-verify) and, with ``t = min(len(ids) / max_len, 1)``, returns
    ``lo + (hi - lo) * (1 + cos(pi * t)) / 2``: for a correct completion ``(lo, hi) = (min_value_correct,
    max_value_correct)``, so shorter earns more; for a wrong one ``(lo, hi) = (max_value_wrong,
    min_value_wrong)``, so shorter is punished more. ``None`` where the solution cannot be parsed. Its
    ``__name__`` is ``cosine_scaled_reward``.

    Args:
        max_len: the completion length, in tokens, where the schedule ends (a positive integer).
        min_value_wrong: a wrong completion's reward at length 0.
        max_value_wrong: a wrong completion's reward at ``max_len`` tokens and beyond.
        min_value_correct: a correct completion's reward at ``max_len`` tokens and beyond.
        max_value_correct: a correct completion's reward at length 0.

    Example::

        >>> reward = get_cosine_scaled_reward(max_len=100)
        >>> reward([r"\\boxed{\\frac{1}{3}}", r"\\boxed{\\frac{1}{2}}"], [r"\\frac{1}{3}"] * 2, [[1] * 50] * 2)
        [0.75, -0.75]
    """
    _check_positive_int("get_cosine_scaled_reward", "max_len", max_len)
    return _CosineScaledReward(
        max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct
    )


class _CosineScaledReward:
    """:func:`get_cosine_scaled_reward`'s function: an object, not a closure, so it can be pickled."""

    __name__ = "cosine_scaled_reward"

    def __init__(
        self, max_len: int, min_wrong: float, max_wrong: float, min_correct: float, max_correct: float
    ) -> None:
        self.max_len = max_len
        self.correct_bounds = (min_correct, max_correct)
        self.wrong_bounds = (max_wrong, min_wrong)  # swapped: a short wrong answer is punished most

    def __call__(
        self,
        completions: list[list[dict[str, str]]] | list[str],
        solution: list[str],
        completion_ids: list[list[int]],
        **kwargs: Any,
    ) -> list[float | None]:
        _check_same_length("cosine_scaled_reward", completions, "completion_ids", completion_ids)
        rewards: list[float | None] = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if correct is None:
                rewards.append(None)
                continue
            lo, hi = self.correct_bounds if correct else self.wrong_bounds
            # Capped at 1: past max_len the cosine would rise again and reward very long completions.
            progress = min(_length(ids) / self.max_len, 1.0)
            rewards.append(float(lo + (hi - lo) * (1.0 + math.cos(math.pi * progress)) / 2))
        return rewards

    def __repr__(self) -> str:
        return f"get_cosine_scaled_reward(max_len={self.max_len}, ...)"


def get_soft_overlong_punishment(
    max_completion_len: int, soft_punish_cache: int
) -> Callable[..., list[float]]:
    """A reward function that punishes completions near and over a length limit (TRL's
    ``get_soft_overlong_punishment``; DAPO, eq. 13).

    The returned function, ``f(completion_ids, **kwargs)``, gives a completion of ``n`` tokens 0.0 when
    ``n <= max_completion_len - soft_punish_cache``, ``(max_completion_len - soft_punish_cache - n) /
    soft_punish_cache`` (from 0 down to -1) up to ``max_completion_len``, and -1.0 beyond. It never rewards a
    short completion. Its ``__name__`` is ``soft_overlong_punishment_reward``.

    Args:
        max_completion_len: the length limit, in tokens (a positive integer).
        soft_punish_cache: the width of the soft zone below the limit, in tokens; 0: only completions over
            the limit are punished.

    Example::

        >>> get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)([[1] * 90])
        [-0.5]
    """
    _check_positive_int("get_soft_overlong_punishment", "max_completion_len", max_completion_len)
    _check_positive_int("get_soft_overlong_punishment", "soft_punish_cache", soft_punish_cache, minimum=0)
    return _SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class _SoftOverlongPunishment:
    """:func:`get_soft_overlong_punishment`'s function (picklable)."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        free = self.max_completion_len - self.soft_punish_cache  # the longest unpunished length
        rewards = []
        for ids in completion_ids:
            n = _length(ids)
            if n <= free:
                rewards.append(0.0)
            elif n <= self.max_completion_len:
                rewards.append((free - n) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

    def __repr__(self) -> str:
        return (
            f"get_soft_overlong_punishment(max_completion_len={self.max_completion_len}, "
            f"soft_punish_cache={self.soft_punish_cache})"
        )


def get_repetition_penalty_reward(
    ngram_size: int = 3, max_penalty: float = -1.0
) -> Callable[..., list[float]]:
    """A reward function that punishes repeated token n-grams (TRL's ``get_repetition_penalty_reward``;
    "Demystifying Long Chain-of-Thought Reasoning", appendix C.2).

    The returned function, ``f(completion_ids, **kwargs)``, gives each completion ``(1 - distinct n-grams /
    n-grams) * max_penalty`` over its token ids: 0.0 without a repeated n-gram (or with fewer than
    ``ngram_size`` tokens), close to ``max_penalty`` when one n-gram repeats throughout. Its ``__name__`` is
    ``repetition_penalty_reward``.

    Args:
        ngram_size: the n-gram length, in tokens (a positive integer).
        max_penalty: the penalty of a fully repetitive completion; must be <= 0.

    Example::

        >>> get_repetition_penalty_reward(ngram_size=2)([[1, 2, 3, 4], [5, 5, 5, 5, 5]])
        [0.0, -0.75]
    """
    _check_positive_int("get_repetition_penalty_reward", "ngram_size", ngram_size)
    if not isinstance(max_penalty, (int, float)) or isinstance(max_penalty, bool) or not max_penalty <= 0:
        raise ValueError(
            f"get_repetition_penalty_reward: `max_penalty` is the (non-positive) reward of a fully repetitive "
            f"completion; got {max_penalty!r}. Pass a number <= 0, e.g. -1.0."
        )
    return _RepetitionPenalty(ngram_size, float(max_penalty))


class _RepetitionPenalty:
    """:func:`get_repetition_penalty_reward`'s function (picklable)."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float) -> None:
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        rewards = []
        for ids in completion_ids:
            tokens = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            total = len(tokens) - self.ngram_size + 1
            if total < 1:
                rewards.append(0.0)
                continue
            distinct = len({tuple(tokens[i : i + self.ngram_size]) for i in range(total)})
            repeated = 1.0 - distinct / total
            rewards.append(repeated * self.max_penalty if repeated else 0.0)
        return rewards

    def __repr__(self) -> str:
        return f"get_repetition_penalty_reward(ngram_size={self.ngram_size}, max_penalty={self.max_penalty})"
