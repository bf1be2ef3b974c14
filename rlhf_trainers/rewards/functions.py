"""Python reward functions as reward sources: the signature a function must have, the dataset columns it
receives, what it may return, and what a failing function does (:data:`REWARD_ERROR_MODES`)."""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..data.common import Prompt
from .base import RewardBatch

logger = logging.getLogger(__name__)

__all__ = ["REWARD_ERROR_MODES", "RewardFunc", "RewardFunctionSource", "reward_func_name"]


RewardFunc = Callable[..., Sequence[float | None]]
"""A rule-based reward: called as ``f(prompts=[...], completions=[...], **columns)``, it returns one
float (or ``None``, "no reward for this row") per completion."""

_FIXED_ARGS = ("prompts", "completions")
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def reward_func_name(func: Any) -> str:
    """A readable name for a reward function (``__name__``; a partial's function; the class name)."""
    if isinstance(func, functools.partial):
        return reward_func_name(func.func)
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) and name else type(func).__name__


class _FuncSpec:
    """What a reward function accepts: ``**kwargs`` or not, its keyword parameters, the required ones."""

    __slots__ = ("params", "required", "var_keyword")

    def __init__(self, var_keyword: bool, params: frozenset[str], required: tuple[str, ...]) -> None:
        self.var_keyword = var_keyword
        self.params = params
        self.required = required


def _inspect_reward_func(func: Any, index: int) -> _FuncSpec:
    """Check that ``func`` can be called as ``func(prompts=..., completions=..., **columns)``."""
    if not callable(func):
        raise TypeError(
            f"reward_funcs[{index}] must be callable, a function f(prompts, completions, **kwargs) that "
            f"returns one float per completion; got {type(func).__name__}: {func!r}."
        )
    name = reward_func_name(func)
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # some builtins: nothing to check, everything is passed
        return _FuncSpec(True, frozenset(), ())
    params = list(signature.parameters.values())
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    keyword = frozenset(p.name for p in params if p.kind in _KEYWORD_KINDS)
    positional_only = [
        p.name
        for p in params
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    missing = [arg for arg in _FIXED_ARGS if arg not in keyword]
    if positional_only or (missing and not var_keyword):
        example = (
            "lambda prompts, completions, **kwargs: ..."
            if name == "<lambda>"
            else (f"def {name}(prompts, completions, **kwargs): ...")
        )
        raise TypeError(
            f"reward function {name!r} (reward_funcs[{index}]) has the signature {signature}, but reward "
            "functions are called with keyword arguments only: f(prompts=[...], completions=[...], "
            "**dataset_columns). Name its parameters `prompts` and `completions` (and take the other "
            f"columns with **kwargs), e.g. `{example}`."
        )
    required = tuple(
        p.name
        for p in params
        if p.kind in _KEYWORD_KINDS and p.default is inspect.Parameter.empty and p.name not in _FIXED_ARGS
    )
    return _FuncSpec(var_keyword, keyword, required)


def _rewards_tensor(values: Any, name: str, batch: int) -> torch.Tensor:
    """A reward function's result as a float32 (B,) tensor, ``None`` and non-finite values as NaN."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise ValueError(
            f"reward function {name!r} returned {type(values).__name__}, expected a list of {batch} floats "
            "(one per completion, None where it has no reward)."
        )
    if len(values) != batch:
        raise ValueError(
            f"reward function {name!r} returned {len(values)} values for a batch of {batch} completions; "
            "it must return exactly one float (or None) per completion, in order."
        )
    out = torch.empty(batch, dtype=torch.float32)
    for i, value in enumerate(values):
        if value is None:
            out[i] = math.nan
            continue
        if isinstance(value, (str, bytes)):
            raise TypeError(
                f"reward function {name!r} returned {value!r} at index {i}; expected a float or None."
            )
        try:
            number = float(value)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"reward function {name!r} returned {value!r} ({type(value).__name__}) at index {i}; expected "
                "a float or None."
            ) from err
        out[i] = number if math.isfinite(number) else math.nan
    return out


#: What a failing reward function does (``RewardFunctionSource(on_error=...)``, ``reward_func_errors``).
REWARD_ERROR_MODES = ("raise", "skip")


def _first_failing_row(
    func: RewardFunc,
    name: str,
    prompts: list[Prompt],
    completions: list[str],
    kwargs: dict[str, list[Any]],
) -> str:
    """Where a failing batch call fails: the first row that raises when called alone."""
    for i in range(len(prompts)):
        row = {k: [v[i]] for k, v in kwargs.items()}
        try:
            func(prompts=[prompts[i]], completions=[completions[i]], **row)
        except Exception:
            text = repr(prompts[i])
            text = text if len(text) <= 80 else text[:77] + "..."
            return f"at prompt index {i} of the batch: prompt {text}, completion {completions[i][:80]!r}"
    return "on the whole batch; no single row reproduces it"


class RewardFunctionSource:
    """A Python reward function as a :class:`~rlhf_trainers.rewards.RewardSource`.

    The function is called as ``f(prompts=list(prompts), completions=list(completions), **columns)``. A
    function without ``**kwargs`` receives only the columns it names; a parameter without a default that
    is neither ``prompts``/``completions`` nor a column of the batch is refused before anything is
    scored (:meth:`check`). It must return one value per completion; ``None`` (no reward for that row)
    and non-finite values become NaN. A function that raises, or returns the wrong number or kind of
    values, is handled per ``on_error``: ``"raise"`` raises a ``RuntimeError`` naming the function and the
    first prompt index whose row alone reproduces the error (the original exception is the cause);
    ``"skip"`` gives NaN for every row of this call (so they take no part in the update), logs a warning
    and counts the rows in ``last_errors``.

    Args:
        func: the function (any callable taking ``prompts=`` and ``completions=`` as keywords).
        name: the source's name in metrics; default: the function's ``__name__`` (a partial's function,
            else the class name).
        on_error: ``"raise"`` (default) or ``"skip"`` (see above).
        index: the function's position in the trainer's ``reward_funcs``, named in error messages.

    Raises:
        TypeError: ``func`` is not callable or cannot take ``prompts=`` and ``completions=`` as keyword
            arguments.
        ValueError: an unknown ``on_error``.
    """

    def __init__(
        self, func: RewardFunc, *, name: str | None = None, on_error: str = "raise", index: int = 0
    ) -> None:
        if on_error not in REWARD_ERROR_MODES:
            raise ValueError(f"on_error must be one of {REWARD_ERROR_MODES}, got {on_error!r}.")
        self._spec = _inspect_reward_func(func, index)
        self.func = func
        self.name = name if name is not None else reward_func_name(func)
        self.on_error = on_error
        #: Rows of the last :meth:`score` call that the function failed on (``on_error="skip"``).
        self.last_errors = 0

    def check(self, batch: RewardBatch) -> None:
        """Refuse ``batch`` when it lacks a column that the function requires (a parameter without a
        default that is not ``prompts``/``completions``)."""
        missing = [p for p in self._spec.required if p not in batch.columns]
        if missing:
            raise ValueError(
                f"reward function {self.name!r} requires the argument(s) {missing}, which are not columns of "
                f"the batch (columns: {sorted(batch.columns)}). Add those columns to the dataset or give the "
                "parameters default values."
            )

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """The function's rewards of ``batch``: float32 (B,) on CPU, NaN for ``None``, non-finite values and
        (with ``on_error="skip"``) every row of a failing call."""
        self.check(batch)
        self.last_errors = 0
        prompts, completions = list(batch.prompts), list(batch.completions)
        rows = len(prompts)
        spec, name, func = self._spec, self.name, self.func
        kwargs = {k: list(v) for k, v in batch.columns.items() if spec.var_keyword or k in spec.params}
        try:
            return _rewards_tensor(
                func(prompts=list(prompts), completions=list(completions), **kwargs), name, rows
            )
        except Exception as err:
            if self.on_error == "skip":
                self.last_errors += rows
                logger.warning(
                    "reward function %r failed on a batch of %d (%s: %s); its rows are left out of this update "
                    "(reward_func_errors='skip').",
                    name,
                    rows,
                    type(err).__name__,
                    err,
                )
                return torch.full((rows,), math.nan)
            if isinstance(err, (ValueError, TypeError)) and str(err).startswith(f"reward function {name!r}"):
                raise  # a wrong return value: the message already says what was expected
            where = _first_failing_row(func, name, prompts, completions, kwargs)
            raise RuntimeError(
                f"reward function {name!r} raised {type(err).__name__}: {err} ({where}). Fix the function, or set "
                "reward_func_errors='skip' to leave the rows of a failing call out of the update."
            ) from err

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, on_error={self.on_error!r})"
