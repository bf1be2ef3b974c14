"""Agents: the pieces of a multi-turn rollout with tools (see docs/agents.md, "Tools").

- :class:`Toolbox`: the tools (plain or ``async`` functions with type hints and Google-style docstrings)
  by name, their JSON schemas for the chat template's ``tools=``, and :meth:`Toolbox.execute`, which runs
  one turn's :class:`ToolCall` s into :class:`ToolResult` s (errors, exceptions and timeouts recorded as
  the tool's error, TRL's way, never raised).
- :func:`parse_tool_calls`: an assistant turn's content and tool calls from generated text, with the
  tokenizer's response template where it has one and the ``<tool_call>{json}</tool_call>`` format
  otherwise.
- :func:`supports_tool_calling` / :func:`check_tool_calling`: whether a chat template can hold a
  tool-calling conversation; :func:`install_tool_chat_template` gives one that cannot (SmolLM2's) ours.
- :class:`EnvironmentSet` / :class:`EnvironmentReward`: TRL's ``environment_factory`` (one environment per
  episode, its methods the tools, its ``get_reward`` a reward source; docs/agents.md, "Environments").
"""

from .chat_template import (
    ToolChatTemplate,
    check_tool_calling,
    install_tool_chat_template,
    supports_tool_calling,
    tool_calling_problems,
    tool_chat_template,
)
from .environments import EnvironmentReward, EnvironmentSet
from .parsing import ParsedResponse, parse_tool_calls, parse_tool_calls_in_tags
from .tools import (
    Toolbox,
    ToolCall,
    ToolResult,
    environment_tools,
    error_content,
    is_async_callable,
    tool_content,
    tool_schema,
)

__all__ = [
    "EnvironmentReward",
    "EnvironmentSet",
    "ParsedResponse",
    "ToolCall",
    "ToolChatTemplate",
    "ToolResult",
    "Toolbox",
    "check_tool_calling",
    "environment_tools",
    "error_content",
    "install_tool_chat_template",
    "is_async_callable",
    "parse_tool_calls",
    "parse_tool_calls_in_tags",
    "supports_tool_calling",
    "tool_calling_problems",
    "tool_chat_template",
    "tool_content",
    "tool_schema",
]
