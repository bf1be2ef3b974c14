"""Reading tool calls out of generated text.

Two readers, picked per tokenizer:

- **The tokenizer's response template.** transformers (>= 5.13) parses a response with
  ``tokenizer.parse_response(text, prefix=..., tools=...)`` when the tokenizer carries a
  ``response_template`` (a declarative spec of where the content, the reasoning and each tool call sit;
  :func:`~rlhf_trainers.agents.install_tool_chat_template` sets one, and so does TRL's
  ``add_response_schema`` for the templates it knows). With ``tools=`` it also types the arguments from
  the tools' schemas (``"7"`` becomes ``7`` for an integer parameter).
- **JSON in tags**, the common format otherwise: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn. ``"parameters"`` is read as ``"arguments"``, and arguments written as a JSON
  string are decoded.

A call that cannot be read (malformed JSON, no name, arguments that are not an object, a block cut off
by the length limit) is kept as a :class:`~rlhf_trainers.agents.ToolCall` with an ``error``, which the
toolbox records as that call's error result; nothing here raises on what the model wrote. When the
response template cannot parse a response at all, the JSON-in-tags reader is tried on the same text and
the template's error is kept in :attr:`ParsedResponse.parse_error`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .tools import ToolCall

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ParsedResponse",
    "parse_tool_calls",
    "parse_tool_calls_in_tags",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_NAME_IN_TEXT = re.compile(r'"name"\s*:\s*"([^"\\]+)"')


@dataclass(frozen=True)
class ParsedResponse:
    """An assistant turn read from generated text.

    Attributes:
        content: The text outside the tool calls (stripped).
        tool_calls: The calls in the order written, well formed or not (see :attr:`ToolCall.error`).
        parser: ``"response_template"`` or ``"tags"``: which reader produced this.
        parse_error: Why the response template could not parse the text (then ``parser`` is ``"tags"``).
        fields: Other fields the response template read (e.g. ``reasoning_content``).
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parser: str = "tags"
    parse_error: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def to_message(self) -> dict[str, Any]:
        """The assistant message (``role``, ``content``, other template fields and the well-formed
        ``tool_calls``), as a chat template renders it and as reward functions receive it."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content, **self.fields}
        calls = [call.to_message_call() for call in self.tool_calls if call.ok]
        if calls:
            message["tool_calls"] = calls
        return message


def _malformed(reason: str, text: str, name: str | None = None) -> ToolCall:
    if name is None:
        found = _NAME_IN_TEXT.search(text)
        name = found.group(1) if found else None
    return ToolCall(name=name, arguments=None, error=f"Malformed tool call: {reason}", text=text)


def _decode_arguments(arguments: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Arguments as a dict (missing or null: no arguments; a JSON string: decoded), or why not."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return None, f"the arguments are a string that is not valid JSON ({error})"
    if not isinstance(arguments, dict):
        return None, f"the arguments must be a JSON object, got {type(arguments).__name__}"
    return arguments, None


def call_from_object(value: Any, text: str) -> ToolCall:
    """A :class:`ToolCall` from a decoded call: ``{"name": ..., "arguments": {...}}`` or the
    ``{"type": "function", "function": {...}}`` shape; malformed ones carry the reason."""
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        value = value["function"]
    if not isinstance(value, dict):
        return _malformed(
            f'expected a JSON object with "name" and "arguments", got {type(value).__name__}', text, name=""
        )
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return _malformed('the call has no "name" string', text, name="")
    arguments, problem = _decode_arguments(value.get("arguments", value.get("parameters")))
    if problem is not None:
        return _malformed(f"{problem} (tool {name})", text, name=name)
    return ToolCall(name=name, arguments=arguments, text=text)


def _call_from_block(body: str, closed: bool) -> ToolCall:
    text = body.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        if not closed:
            return _malformed(
                f"the {TOOL_CALL_OPEN} block is not closed (the response may have been cut off)", text
            )
        return _malformed(f"invalid JSON ({error})", text)
    return call_from_object(value, text)


def parse_tool_calls_in_tags(text: str, special_tokens: Sequence[str] = ()) -> ParsedResponse:
    """Read ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks from ``text``.

    A block left open at the end (the response was cut off) still counts when its JSON is complete, as
    transformers' parser reads it; otherwise it is a malformed call. ``special_tokens`` (e.g. the end of
    turn token) are removed from the content.
    """
    calls: list[ToolCall] = []
    pieces: list[str] = []
    position = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, position)
        if start < 0:
            pieces.append(text[position:])
            break
        pieces.append(text[position:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        closed = end >= 0
        body = text[body_start:end] if closed else text[body_start:]
        for token in special_tokens:
            body = body.replace(token, "")
        calls.append(_call_from_block(body, closed))
        if not closed:
            break
        position = end + len(TOOL_CALL_CLOSE)
    for token in special_tokens:
        pieces = [piece.replace(token, "") for piece in pieces]
    content = "\n".join(piece.strip() for piece in pieces if piece.strip())
    return ParsedResponse(content=content, tool_calls=calls, parser="tags")


def _from_template(parsed: dict[str, Any], special_tokens: Sequence[str]) -> ParsedResponse:
    raw_calls = parsed.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raw_calls = [raw_calls]
    calls = [call_from_object(raw, json.dumps(raw, default=str)) for raw in raw_calls]
    content = parsed.get("content")
    content = content if isinstance(content, str) else ""
    for token in special_tokens:
        content = content.replace(token, "")
    fields = {key: value for key, value in parsed.items() if key not in ("role", "content", "tool_calls")}
    return ParsedResponse(
        content=content.strip(),
        tool_calls=calls,
        parser="response_template",
        fields=fields,
    )


def parse_tool_calls(
    response: str | Sequence[int],
    tokenizer: Any = None,
    *,
    prefix: str | Sequence[int] | None = None,
    tools: Sequence[Any] | None = None,
) -> ParsedResponse:
    """Read an assistant turn (content and tool calls) from generated text.

    Args:
        response: The generated text, or its token ids (then ``tokenizer`` is required).
        tokenizer: The policy's tokenizer. With a ``response_template`` (transformers' response parsing)
            it reads the response; without one, the JSON-in-tags format is read, and the tokenizer's
            special tokens are removed from the content.
        prefix: The prompt the response continues (text or ids), which the response template needs to
            see where the assistant turn starts; ``None`` reads the response alone.
        tools: The tools (functions or JSON schemas) the prompt offered; the response template types
            the arguments from them.

    Returns:
        A :class:`ParsedResponse`. Never raises for what the model wrote.
    """
    if not isinstance(response, str):
        if tokenizer is None:
            raise ValueError(
                "parse_tool_calls got token ids without a tokenizer to decode them; pass `tokenizer=`."
            )
        response = tokenizer.decode(list(response), skip_special_tokens=False)
    special = [token for token in (getattr(tokenizer, "all_special_tokens", None) or []) if token]
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None:
        if prefix is not None and not isinstance(prefix, str):
            prefix = tokenizer.decode(list(prefix), skip_special_tokens=False)
        try:
            parsed = tokenizer.parse_response(
                response, prefix=prefix or "", tools=list(tools) if tools else None
            )
        except Exception as error:  # the parser's errors are ValueError/TypeError/KeyError; none may escape
            fallback = parse_tool_calls_in_tags(response, special)
            return ParsedResponse(
                content=fallback.content,
                tool_calls=fallback.tool_calls,
                parser="tags",
                parse_error=f"{type(error).__name__}: {error}",
            )
        if isinstance(parsed, dict):
            return _from_template(parsed, special)
        return parse_tool_calls_in_tags(response, special)
    return parse_tool_calls_in_tags(response, special)
