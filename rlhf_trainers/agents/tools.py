"""Tools: Python callables the policy can call, their JSON schemas, and one call's request and result.

A tool is a plain or ``async`` function (or a bound method, e.g. of an environment) with type hints and a
Google-style docstring, as TRL 1.16's ``GRPOTrainer(tools=[...])`` takes them. :class:`Toolbox` holds
the tools of a rollout by name, gives the JSON schemas a chat template's ``tools=`` renders, and runs
:class:`ToolCall` requests (parsed from generated text by :func:`~rlhf_trainers.agents.parse_tool_calls`)
into :class:`ToolResult` s, whose :meth:`ToolResult.to_message` is the ``tool`` turn appended to the
conversation. Nothing a call does raises out of :meth:`Toolbox.execute`: an unknown tool, arguments that
do not fit, a tool that raises or runs past the timeout each become an error result.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..rewards.functions import is_async_reward_func as is_async_callable

__all__ = [
    "ToolCall",
    "ToolResult",
    "Toolbox",
    "environment_tools",
    "error_content",
    "is_async_callable",
    "tool_content",
    "tool_schema",
]

ToolContent = str | list[dict[str, Any]]


def tool_name(func: Callable[..., Any]) -> str:
    """The name a tool is called by: its function's ``__name__`` (a bound method's function name)."""
    name = getattr(func, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(
            f"Tool {func!r} has no usable name (got __name__={name!r}); a tool is called by its function's "
            "name, so pass a function defined with `def` (or `async def`), not a lambda or a callable object."
        )
    return name


def tool_schema(func: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``func`` as a chat template's ``tools=`` takes it (what transformers'
    ``get_json_schema`` makes from the type hints and the Google-style docstring).

    Raises ``ValueError`` naming the function and what is missing (the docstring, a type hint, an
    argument's description in the docstring's ``Args:`` section) when it cannot be described.
    """
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    if not callable(func):
        raise ValueError(f"A tool must be a function, got {type(func).__name__}: {func!r}.")
    name = tool_name(func)
    try:
        return get_json_schema(func)
    except (DocstringParsingException, TypeHintParsingException) as error:
        raise ValueError(
            f"Tool {name!r} cannot be described to the model: {error}. A tool needs a type hint on every "
            "argument and a Google-style docstring with a one-line description and an `Args:` section that "
            'describes each argument, e.g.\n    def add(a: int, b: int) -> int:\n        """Add two '
            "integers.\n\n        Args:\n            a: The first integer.\n            b: The second "
            'integer.\n        """'
        ) from error


def environment_tools(environment: Any) -> list[Callable[..., Any]]:
    """The public methods of an environment instance, which TRL exposes as its tools: every function
    defined on its class whose name does not start with ``_``, except ``reset`` and ``get_reward``,
    bound to ``environment``, in name order."""
    methods = []
    for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction):
        if not name.startswith("_") and name not in ("reset", "get_reward"):
            methods.append(getattr(environment, name))
    return methods


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the policy wrote it.

    Attributes:
        name: The tool's name (``None`` when it could not be read from the text).
        arguments: The keyword arguments (``None`` when they could not be read).
        error: Why the call could not be parsed (``None`` for a well-formed call); a call with an error
            is not run: its result is this error.
        text: The text of the call as generated (for logs).
    """

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        """Whether the call was well formed (a name and a dict of arguments)."""
        return self.error is None and self.name is not None and isinstance(self.arguments, dict)

    def to_message_call(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (the transformers/OpenAI shape)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one :class:`ToolCall`.

    Attributes:
        name: The tool's name as called (``"unknown"`` when the call had none).
        content: The tool message's content: the tool's return value as a string (a list of content
            blocks is kept as is), or the error as ``str({"error": message})``, the text TRL records.
        error: The error message, ``None`` when the tool ran and returned.
        seconds: Wall time of the call.
        timed_out: Whether the call ran past the timeout.
    """

    name: str
    content: ToolContent
    error: str | None = None
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Whether the tool ran and returned."""
        return self.error is None

    def to_message(self) -> dict[str, Any]:
        """The ``tool`` turn that carries this result: ``{"role": "tool", "name": ..., "content": ...}``."""
        return {"role": "tool", "name": self.name, "content": self.content}


def tool_content(value: Any) -> ToolContent:
    """A tool's return value as a tool message's content: a list of content blocks (dicts with a
    ``"type"``, e.g. ``{"type": "text", "text": ...}``) is kept, anything else becomes ``str(value)``
    (so ``None`` is ``"None"`` and ``{"a": 1}`` is ``"{'a': 1}"``, as TRL writes them)."""
    if isinstance(value, list) and value and all(isinstance(part, dict) and "type" in part for part in value):
        return value
    return str(value)


def error_content(message: str) -> str:
    """A failed call's tool message content, TRL's: ``str({"error": message})``."""
    return str({"error": message})


def exception_message(error: BaseException) -> str:
    """``str(error)``, or the exception's type name when that is empty."""
    return str(error) or type(error).__name__


@dataclass
class _Tool:
    name: str
    func: Callable[..., Any]
    schema: dict[str, Any]
    is_async: bool
    signature: inspect.Signature | None


class Toolbox:
    """The tools of a rollout, by name; runs the calls the policy makes.

    Args:
        tools: Plain or ``async`` functions (or bound methods) with type hints and Google-style
            docstrings. Each is described with :func:`tool_schema` at construction, so a function that
            cannot be described fails here, naming it and what is missing.
        timeout: Seconds one call may take (``None``: no limit). A call past it is recorded as an error
            result and the rollout goes on. A synchronous tool with a timeout runs on a daemon thread
            that is abandoned when it overruns (Python cannot stop a thread: the tool keeps running in
            the background, so a tool with side effects should bound its own work); an ``async`` tool
            is cancelled. Without a timeout, synchronous tools run in the calling thread.

    Raises:
        ValueError: a tool that is not a function, cannot be described, or two tools with one name.
    """

    def __init__(
        self, tools: Sequence[Callable[..., Any]] | None = (), *, timeout: float | None = None
    ) -> None:
        tools = () if tools is None else tools
        if isinstance(tools, Mapping | str) or callable(tools):
            raise ValueError(f"`tools` must be a list of functions, got {type(tools).__name__}.")
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"`timeout` must be a positive number of seconds or None, got {timeout!r}.")
        self.timeout = None if timeout is None else float(timeout)
        self._tools: dict[str, _Tool] = {}
        for func in tools:
            schema = tool_schema(func)
            name = tool_name(func)
            if name in self._tools:
                raise ValueError(
                    f"Two tools are named {name!r} ({self._tools[name].func!r} and {func!r}); the model calls a "
                    "tool by its name, so each name must be unique: rename one of the functions."
                )
            try:
                signature = inspect.signature(func)
            except (TypeError, ValueError):
                signature = None
            self._tools[name] = _Tool(name, func, schema, is_async_callable(func), signature)
        self.abandoned_calls = 0
        """How many synchronous calls ran past the timeout and were left running on their thread."""

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self._tools[name].func

    def __repr__(self) -> str:
        return f"Toolbox({list(self._tools)}, timeout={self.timeout})"

    @property
    def names(self) -> list[str]:
        """The tools' names, in the order given."""
        return list(self._tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for ``tokenizer.apply_chat_template(..., tools=toolbox.schemas)``."""
        return [tool.schema for tool in self._tools.values()]

    def is_async(self, name: str) -> bool:
        """Whether the tool ``name`` is an ``async`` function."""
        return self._tools[name].is_async

    def check_call(self, call: ToolCall) -> str | None:
        """Why ``call`` cannot be run (malformed, unknown tool, arguments that do not fit the tool's
        signature), or ``None`` when it can."""
        if call.error is not None:
            return call.error
        if not isinstance(call.name, str):
            return "Malformed tool call: it has no tool name."
        if call.name not in self._tools:
            available = ", ".join(self._tools) or "none"
            return f"Tool {call.name} not found. Available tools: {available}."
        if not isinstance(call.arguments, dict):
            return f"Malformed tool call: the arguments of {call.name} must be a JSON object, got {call.arguments!r}."
        signature = self._tools[call.name].signature
        if signature is not None:
            try:
                signature.bind(**call.arguments)
            except TypeError as error:
                return f"Invalid arguments for tool {call.name}: {error}."
        return None

    def execute(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run ``calls`` (one assistant turn's) and return one result per call, in order. Synchronous
        tools run one after another, in order; the ``async`` ones run concurrently on a background event
        loop. Never raises for what a call does: see :class:`ToolResult`."""
        from .execution import run_async_calls, run_sync_call

        results: list[ToolResult | None] = [None] * len(calls)
        pending_async: list[tuple[int, _Tool, dict[str, Any]]] = []
        for index, call in enumerate(calls):
            problem = self.check_call(call)
            name = call.name if isinstance(call.name, str) else "unknown"
            if problem is not None:
                results[index] = ToolResult(name, error_content(problem), error=problem)
            elif self._tools[name].is_async:
                pending_async.append((index, self._tools[name], dict(call.arguments or {})))
            else:
                tool = self._tools[name]
                result, abandoned = run_sync_call(
                    tool.name, tool.func, dict(call.arguments or {}), self.timeout
                )
                self.abandoned_calls += abandoned
                results[index] = result
        if pending_async:
            batch = [(tool.name, tool.func, arguments) for _, tool, arguments in pending_async]
            for (index, _, _), result in zip(
                pending_async, run_async_calls(batch, self.timeout), strict=True
            ):
                results[index] = result
        return [result for result in results if result is not None]


def timed(start: float) -> float:
    """Seconds since ``start`` (a ``time.perf_counter()`` reading)."""
    return time.perf_counter() - start
