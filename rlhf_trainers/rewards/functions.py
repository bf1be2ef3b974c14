"""Python reward functions as reward sources, called as TRL 1.16 calls them: the keyword arguments a
function receives (:data:`REWARD_FUNC_ARGS` and the dataset's other columns), the completions' form
(assistant-message lists for conversational prompts, strings otherwise), sync and async functions, what a
function may return, and what a failing function does (:data:`REWARD_ERROR_MODES`)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

import torch

from ..background_loop import BackgroundLoop
from .base import RewardBatch, RewardLog

logger = logging.getLogger(__name__)

__all__ = [
    "REWARD_ERROR_MODES",
    "REWARD_FUNC_ARGS",
    "RewardFunc",
    "RewardFunctionSource",
    "is_async_reward_func",
    "reward_func_name",
    "run_coroutine",
]


RewardFunc = Callable[..., Sequence[float | None] | Awaitable[Sequence[float | None]]]
"""A rule-based reward, sync or ``async``: called as ``f(prompts=[...], completions=[...], **kwargs)`` (see
:class:`RewardFunctionSource`), it returns one float (or ``None``, "no reward for this row") per
completion."""

_FIXED_ARGS = ("prompts", "completions")

#: The keyword arguments every reward function may take besides the dataset's columns, as TRL 1.16 passes
#: them: ``prompts``, ``completions``, ``completion_ids`` (token ids of each completion, without padding),
#: ``trainer_state`` (the trainer's ``TrainerState``), ``log_extra`` and ``log_metric`` (see
#: :class:`~rlhf_trainers.rewards.RewardLog`). A dataset column must not have one of these names.
REWARD_FUNC_ARGS: tuple[str, ...] = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
)
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def is_async_reward_func(func: Any) -> bool:
    """Whether calling ``func`` returns a coroutine: an ``async def`` function, a ``functools.partial`` of
    one, or an object whose ``__call__`` is ``async def``."""
    while isinstance(func, functools.partial):
        func = func.func
    call = type(func).__call__ if callable(func) and not inspect.isroutine(func) else None
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(call)


#: The event loop (a daemon thread) of every async reward function of the process.
_LOOP = BackgroundLoop("rlhf-trainers-reward-functions")


def run_coroutine(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coroutine`` to completion on the reward functions' event loop (a daemon thread) and return its
    result (or raise its exception). Blocks the calling thread, which must not be that loop's."""
    return asyncio.run_coroutine_threadsafe(coroutine, _LOOP.get()).result()


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
        hint = (
            f" A string names a reward model only as a folder path (./{func}) or a Hub id (owner/name)."
            if isinstance(func, str)
            else ""
        )
        raise TypeError(
            f"reward_funcs[{index}] must be callable, a function f(prompts, completions, **kwargs) that "
            f"returns one float per completion; got {type(func).__name__}: {func!r}.{hint}"
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
            "completion_ids=[...], trainer_state=..., log_extra=..., log_metric=..., **dataset_columns), "
            "as TRL calls them. Name its parameters `prompts` and `completions` (and take the others with "
            f"**kwargs), e.g. `{example}`."
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


def _row(kwargs: dict[str, Any], i: int, per_row: frozenset[str]) -> dict[str, Any]:
    """Row ``i`` of a call's keyword arguments: the per-row lists cut to one value, the others as they are."""
    return {k: ([v[i]] if k in per_row else v) for k, v in kwargs.items()}


def _describe_row(kwargs: dict[str, Any], i: int) -> str:
    text = repr(kwargs["prompts"][i])
    text = text if len(text) <= 80 else text[:77] + "..."
    completion = repr(kwargs["completions"][i])
    completion = completion if len(completion) <= 80 else completion[:77] + "..."
    return f"at prompt index {i} of the batch: prompt {text}, completion {completion}"


_NO_SINGLE_ROW = "on the whole batch; no single row reproduces it"


class RewardFunctionSource:
    """A Python reward function as a :class:`~rlhf_trainers.rewards.RewardSource`, called as TRL 1.16
    calls reward functions.

    The function is called once per batch with keyword arguments only:

    - ``prompts``: the B prompts as in the dataset (strings, or lists of ``{"role", "content"}`` messages);
    - ``completions``: for conversational prompts (message lists) each completion as
      ``[{"role": "assistant", "content": text}]``, otherwise the decoded string (special tokens skipped
      in both);
    - ``completion_ids``: each completion's token ids without padding (lists of ints, the stop token
      included); passed when the batch carries ids, as the trainers' batches always do;
    - ``trainer_state``: the trainer's ``transformers.TrainerState`` (None outside a trainer);
    - ``log_metric(name, value)`` and ``log_extra(column, values)``: log a scalar metric or a column of the
      completions table (:class:`~rlhf_trainers.rewards.RewardLog`);
    - every other dataset column of the rows, as a list of B values.

    A function with ``**kwargs`` receives all of them; one without receives only those it names. A
    parameter without a default that is none of these is refused before anything is scored
    (:meth:`check`). An ``async def`` function (or an object with an ``async def __call__``) is awaited:
    :class:`~rlhf_trainers.rewards.RewardSources` runs the asynchronous functions of a batch concurrently
    (:meth:`ascore`); :meth:`score` runs it alone, on a daemon thread's event loop.

    It must return one value per completion; ``None`` (no reward for that row: the function is left out of
    that row's weighted sum) and non-finite values become NaN. A function that raises, or returns the
    wrong number or kind of values, is handled per ``on_error``: ``"raise"`` raises a ``RuntimeError``
    naming the function and the first prompt index whose row alone reproduces the error (the original
    exception is the cause); ``"skip"`` gives NaN for every row of this call (they leave the update), logs a
    warning and counts the rows in ``last_errors``. What a failed call logged is dropped.

    Args:
        func: the function (any callable taking ``prompts=`` and ``completions=`` as keywords, sync or
            async).
        name: the source's name in metrics; default: the function's ``__name__`` (a partial's function,
            else the class name).
        on_error: ``"raise"`` (default) or ``"skip"`` (see above).
        index: the function's position in the trainer's ``reward_funcs``, named in error messages.

    Attributes:
        is_async: whether the function is asynchronous.
        last_errors: rows of the last scoring call that the function failed on (``on_error="skip"``).

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
        self.is_async = is_async_reward_func(func)
        self.last_errors = 0

    @property
    def may_log(self) -> bool:
        """Whether the function can receive ``log_metric`` or ``log_extra`` (it names one or takes
        ``**kwargs``)."""
        spec = self._spec
        return spec.var_keyword or bool({"log_metric", "log_extra"} & spec.params)

    def _available(self, batch: RewardBatch) -> set[str]:
        names = {"trainer_state", "log_extra", "log_metric", *batch.columns}
        if batch.has_completion_ids:
            names.add("completion_ids")
        return names

    def check(self, batch: RewardBatch) -> None:
        """Refuse ``batch`` when it lacks an argument that the function requires (a parameter without a
        default that is not one of :data:`REWARD_FUNC_ARGS` the batch provides, nor a column)."""
        missing = [p for p in self._spec.required if p not in self._available(batch)]
        if missing:
            ids = "" if batch.has_completion_ids else " (this batch carries no completion ids)"
            raise ValueError(
                f"reward function {self.name!r} requires the argument(s) {missing}, which are not columns of "
                f"the batch (columns: {sorted(batch.columns)}) nor arguments the trainers pass "
                f"({list(REWARD_FUNC_ARGS)}){ids}. Add those columns to the dataset or give the parameters "
                "default values."
            )

    def _kwargs(self, batch: RewardBatch, log: RewardLog) -> tuple[dict[str, Any], frozenset[str]]:
        """The call's keyword arguments (those the function takes) and the names of the per-row ones."""
        spec = self._spec
        wanted = (lambda k: True) if spec.var_keyword else (lambda k: k in spec.params)
        kwargs: dict[str, Any] = {k: list(v) for k, v in batch.columns.items() if wanted(k)}
        per_row = set(kwargs)
        kwargs["prompts"] = list(batch.prompts)
        kwargs["completions"] = batch.function_completions()
        per_row.update(("prompts", "completions"))
        if batch.has_completion_ids and wanted("completion_ids"):
            kwargs["completion_ids"] = batch.completion_id_lists()
            per_row.add("completion_ids")
        if wanted("trainer_state"):
            kwargs["trainer_state"] = batch.trainer_state
        if wanted("log_extra"):
            kwargs["log_extra"] = log.log_extra
        if wanted("log_metric"):
            kwargs["log_metric"] = log.log_metric
        return kwargs, frozenset(per_row)

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """The function's rewards of ``batch``: float32 (B,) on CPU, NaN for ``None``, non-finite values and
        (with ``on_error="skip"``) every row of a failing call. An async function is run to completion on
        the reward functions' event loop."""
        if self.is_async:
            return run_coroutine(self.ascore(batch))
        self.check(batch)
        self.last_errors = 0
        log = RewardLog()
        kwargs, per_row = self._kwargs(batch, log)
        try:
            values = self.func(**kwargs)
            if inspect.isawaitable(values):  # a callable that is not recognisably async returned a coroutine
                values = run_coroutine(_awaited(values))
            result = _rewards_tensor(values, self.name, len(batch))
        except Exception as err:
            where = None
            if self.on_error != "skip" and not self._is_return_error(err):
                where = self._first_failing_row(kwargs, per_row, len(batch))
            return self._failed(err, len(batch), where)
        batch.log.update(log)
        return result

    async def ascore(self, batch: RewardBatch) -> torch.Tensor:
        """:meth:`score` as a coroutine, for an async function (a sync one is called as in :meth:`score`).
        Must run on the reward functions' event loop (:func:`run_coroutine`) or another loop that does not
        block the caller's thread."""
        if not self.is_async:
            return self.score(batch)
        self.check(batch)
        self.last_errors = 0
        log = RewardLog()
        kwargs, per_row = self._kwargs(batch, log)
        try:
            result = _rewards_tensor(await self.func(**kwargs), self.name, len(batch))
        except Exception as err:
            where = None
            if self.on_error != "skip" and not self._is_return_error(err):
                where = await self._afirst_failing_row(kwargs, per_row, len(batch))
            return self._failed(err, len(batch), where)
        batch.log.update(log)
        return result

    def _is_return_error(self, err: Exception) -> bool:
        """Whether ``err`` is :func:`_rewards_tensor`'s (a wrong return value), not the function's own."""
        return isinstance(err, (ValueError, TypeError)) and str(err).startswith(
            f"reward function {self.name!r}"
        )

    def _failed(self, err: Exception, rows: int, where: str | None) -> torch.Tensor:
        """A failed call: NaN rows under ``on_error="skip"``, else the error (re-raised with where it fails)."""
        name = self.name
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
        if self._is_return_error(err):
            raise err  # a wrong return value: the message already says what was expected
        raise RuntimeError(
            f"reward function {name!r} raised {type(err).__name__}: {err} ({where}). Fix the function, or set "
            "reward_func_errors='skip' to leave the rows of a failing call out of the update."
        ) from err

    def _first_failing_row(self, kwargs: dict[str, Any], per_row: frozenset[str], rows: int) -> str:
        """Where a failing batch call fails: the first row that raises when called alone (its logs
        dropped)."""
        for i in range(rows):
            row = self._quiet(_row(kwargs, i, per_row))
            try:
                values = self.func(**row)
                if inspect.isawaitable(values):
                    run_coroutine(_awaited(values))
            except Exception:
                return _describe_row(kwargs, i)
        return _NO_SINGLE_ROW

    async def _afirst_failing_row(self, kwargs: dict[str, Any], per_row: frozenset[str], rows: int) -> str:
        """:meth:`_first_failing_row` of an async function."""
        for i in range(rows):
            try:
                await self.func(**self._quiet(_row(kwargs, i, per_row)))
            except Exception:
                return _describe_row(kwargs, i)
        return _NO_SINGLE_ROW

    @staticmethod
    def _quiet(kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with ``log_metric``/``log_extra`` that log nowhere (the rows re-run to find an error)."""
        scratch = RewardLog()
        if "log_metric" in kwargs:
            kwargs["log_metric"] = scratch.log_metric
        if "log_extra" in kwargs:
            kwargs["log_extra"] = scratch.log_extra
        return kwargs

    def __repr__(self) -> str:
        kind = ", async" if self.is_async else ""
        return f"{type(self).__name__}({self.name!r}, on_error={self.on_error!r}{kind})"


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
