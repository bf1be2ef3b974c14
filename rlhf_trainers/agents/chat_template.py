"""Chat templates and tools: whether a tokenizer's template can hold a tool-calling conversation, and a
tool-capable template of our own to install on one that cannot.

A template supports tool calling when it renders the whole exchange: the tools offered (``tools=``), the
assistant's ``tool_calls`` (name and arguments) and the ``tool`` turn with the result. Many small chat
models' templates render none of it (SmolLM2-135M-Instruct's prints only each message's ``content``, so
the tools and calls vanish silently). :func:`install_tool_chat_template` gives such a tokenizer a
template that does:

- the system turn lists the tools, one JSON schema per line, after a short instruction to call them as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an assistant turn is its content, then each tool call as such a block on its own lines, then the end of
  turn (the end-of-sequence token: where generation stops);
- a tool result is a turn of role ``tool``.

Turns are marked in the tokenizer's own style: ChatML (``<|im_start|>role\\n ... <|im_end|>``) when the
tokenizer has those tokens (SmolLM2, Qwen), else ``<|role|> ... `` lines like the offline kit's. The
template also sets the tokenizer's ``response_template`` so transformers' ``parse_response`` (and
:func:`~rlhf_trainers.agents.parse_tool_calls`) reads back the calls it renders, and marks assistant text
with ``{% generation %}`` so ``return_assistant_tokens_mask=True`` finds the policy's tokens. It is
prefix-preserving: a conversation renders as the rendering of its first turns followed by the new ones.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOLS_INSTRUCTION",
    "ToolChatTemplate",
    "check_tool_calling",
    "install_tool_chat_template",
    "supports_tool_calling",
    "tool_calling_problems",
    "tool_chat_template",
]

# Sentinels for the probe conversation: distinct, so a problem names the part of the exchange dropped.
_TOOL = "probe_tool_3f9a1c"
_DESCRIPTION = "probe_description_7be204"
_ARG_KEY = "probe_argument_c81d55"
_ARG_VALUE = "probe_value_e4a70b"
_RESULT = "probe_result_19d6fe"

_INSTALL_FIX = (
    "Install a tool-capable chat template with `rlhf_trainers.agents.install_tool_chat_template(tokenizer)` "
    "(ours: tools listed in the system turn, calls as <tool_call> JSON, results as a `tool` turn), or "
    "set `tokenizer.chat_template` to one that renders tools, tool calls and tool results."
)


def _probe_messages(arguments: Any) -> list[dict[str, Any]]:
    call = {"type": "function", "function": {"name": _TOOL, "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": _TOOL, "content": _RESULT},
    ]


def _probe_tools() -> list[dict[str, Any]]:
    parameters = {
        "type": "object",
        "properties": {_ARG_KEY: {"type": "string", "description": "an argument"}},
        "required": [_ARG_KEY],
    }
    return [
        {
            "type": "function",
            "function": {"name": _TOOL, "description": _DESCRIPTION, "parameters": parameters},
        }
    ]


def _render_probe(tokenizer: Any) -> str:
    """The probe conversation as the template renders it (arguments as a dict; as a JSON string for the
    templates that only take that shape)."""
    try:
        return tokenizer.apply_chat_template(
            _probe_messages({_ARG_KEY: _ARG_VALUE}), tools=_probe_tools(), tokenize=False
        )
    except TypeError:
        arguments = json.dumps({_ARG_KEY: _ARG_VALUE})
        return tokenizer.apply_chat_template(_probe_messages(arguments), tools=_probe_tools(), tokenize=False)


def tool_calling_problems(tokenizer: Any) -> list[str]:
    """What the tokenizer's chat template fails to render of a tool-calling conversation (user, assistant
    with a tool call, tool result, with one tool offered); empty when it renders all of it."""
    if getattr(tokenizer, "chat_template", None) is None:
        return ["it has no chat template"]
    try:
        rendered = _render_probe(tokenizer)
    except Exception as error:  # jinja2 TemplateError, a template's raise_exception, a TypeError
        return [f"rendering a tool-calling conversation fails ({type(error).__name__}: {error})"]
    if not isinstance(rendered, str):
        return [f"apply_chat_template returned {type(rendered).__name__}, not text"]
    checks = [
        (_DESCRIPTION, "the tools offered (`tools=`) are not rendered"),
        (_TOOL, "the assistant's tool call (its name) is not rendered"),
        (_ARG_KEY, "the tool call's arguments are not rendered"),
        (_ARG_VALUE, "the tool call's argument values are not rendered"),
        (_RESULT, "the tool result (a `tool` turn) is not rendered"),
    ]
    return [problem for sentinel, problem in checks if sentinel not in rendered]


def supports_tool_calling(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a whole tool-calling conversation: the tools
    offered, the assistant's tool calls (name and arguments) and the tool results."""
    return not tool_calling_problems(tokenizer)


def check_tool_calling(tokenizer: Any, what: str = "The tokenizer") -> None:
    """Raise ``ValueError`` when the tokenizer's chat template cannot hold a tool-calling conversation,
    saying what it drops and how to fix it (:func:`install_tool_chat_template`)."""
    problems = tool_calling_problems(tokenizer)
    if problems:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"{what} ({name}) cannot hold a tool-calling conversation: {'; '.join(problems)}. Training with "
            f"tools needs a chat template that shows the model the tools, its calls and their results. {_INSTALL_FIX}"
        )


@dataclass(frozen=True)
class ToolChatTemplate:
    """A tool-capable chat template for one tokenizer (see :func:`tool_chat_template`).

    Attributes:
        style: ``"chatml"`` or ``"tags"``.
        chat_template: The Jinja source, for ``tokenizer.chat_template``.
        response_template: The transformers response-parsing spec, for ``tokenizer.response_template``.
        assistant_header: The text that opens an assistant turn (the generation prompt).
        assistant_end: The text that ends an assistant turn: where generation must stop.
    """

    style: str
    chat_template: str
    response_template: dict[str, Any]
    assistant_header: str
    assistant_end: str


TOOLS_INSTRUCTION = (
    'To call a tool, write <tool_call>\n{"name": "tool_name", "arguments": {"argument": "value"}}\n</tool_call>\n'
    "(one block per call); each result comes back in a `tool` turn. Tools:"
)
"""The default text that introduces the tools in the system turn (kept short: it is in every prompt)."""

# The template, with @NAME@ slots for Jinja string literals (turn markers, instruction, default system).
_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content if part is mapping and part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- elif content is defined and content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- set head = namespace(system=@DEFAULT_SYSTEM@, skip=0) -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set head.system = text(messages[0].content) -%}{%- set head.skip = 1 -%}
{%- endif -%}
{%- if head.system or tools -%}
{{- @OPEN@ ~ 'system' ~ @HEADER_END@ ~ head.system -}}
{%- if tools -%}
{%- if head.system -%}{{- '\\n\\n' -}}{%- endif -%}
{{- @INSTRUCTION@ -}}
{%- for tool in tools -%}
{{- '\\n' -}}{{- (tool.function if tool.function is defined else tool) | tojson -}}
{%- endfor -%}
{%- endif -%}
{{- @END@ -}}
{%- endif -%}
{%- for message in messages[head.skip:] -%}
{%- if message.role == 'assistant' -%}
{{- @OPEN@ ~ 'assistant' ~ @HEADER_END@ -}}
{%- generation -%}
{%- set said = text(message.content) if message.content is defined else '' -%}
{{- said -}}
{%- if message.tool_calls is defined and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if said or not loop.first -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' -}}
{{- (fn.arguments if fn.arguments is string else (fn.arguments | tojson)) ~ '}\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- @ASSISTANT_END@ -}}
{%- endgeneration -%}
{{- @AFTER_ASSISTANT@ -}}
{%- else -%}
{{- @OPEN@ ~ message.role ~ @HEADER_END@ ~ text(message.content) ~ @END@ -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- @OPEN@ ~ 'assistant' ~ @HEADER_END@ -}}{%- endif -%}"""


def _style_markers(tokenizer: Any, style: str) -> dict[str, str]:
    eos = getattr(tokenizer, "eos_token", None)
    if style == "chatml":
        return {
            "OPEN": "<|im_start|>",
            "HEADER_END": "\n",
            "END": "<|im_end|>\n",
            "ASSISTANT_END": "<|im_end|>",
        }
    if not eos:
        raise ValueError(
            "The 'tags' tool template ends an assistant turn with the end-of-sequence token, but the tokenizer "
            "has no `eos_token`; set one (tokenizer.eos_token = ...) or use style='chatml'."
        )
    return {"OPEN": "<|", "HEADER_END": "|>", "END": "\n", "ASSISTANT_END": eos}


def _detect_style(tokenizer: Any) -> str:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return "chatml" if "<|im_start|>" in vocab and "<|im_end|>" in vocab else "tags"


def tool_chat_template(
    tokenizer: Any,
    style: str = "auto",
    system_prompt: str | None = None,
    tools_instruction: str = TOOLS_INSTRUCTION,
) -> ToolChatTemplate:
    """Our tool-capable chat template for ``tokenizer`` (without installing it).

    Args:
        tokenizer: The tokenizer it is for (its vocabulary picks the style; its ``eos_token`` ends
            assistant turns in the ``"tags"`` style).
        style: ``"chatml"`` (``<|im_start|>role\\n...<|im_end|>``), ``"tags"`` (``<|role|>...`` lines,
            assistant turns ended by the EOS token) or ``"auto"``: ChatML when the tokenizer has the
            ``<|im_start|>`` and ``<|im_end|>`` tokens, else tags.
        system_prompt: The system turn used when a conversation has none (e.g. SmolLM2's own template
            adds "You are a helpful AI assistant named SmolLM, trained by Hugging Face"); ``None``: no
            system turn unless tools are offered or the conversation has one.
        tools_instruction: The text before the tools' schemas in the system turn
            (:data:`TOOLS_INSTRUCTION` by default: how to write a call).
    """
    if style == "auto":
        style = _detect_style(tokenizer)
    if style not in ("chatml", "tags"):
        raise ValueError(f"style must be 'auto', 'chatml' or 'tags', got {style!r}.")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"system_prompt must be a string or None, got {type(system_prompt).__name__}.")
    if not isinstance(tools_instruction, str):
        raise ValueError(f"tools_instruction must be a string, got {type(tools_instruction).__name__}.")
    markers = _style_markers(tokenizer, style)
    slots = {
        **markers,
        "AFTER_ASSISTANT": "\n",
        "INSTRUCTION": tools_instruction,
        "DEFAULT_SYSTEM": system_prompt or "",
    }
    source = _TEMPLATE
    for name, value in slots.items():
        source = source.replace(f"@{name}@", json.dumps(value))
    header = markers["OPEN"] + "assistant" + markers["HEADER_END"]
    response_template = {
        "defaults": {"role": "assistant"},
        "start_anchor": header,
        "fields": {
            "tool_calls": {
                "open": "<tool_call>",
                "close_pattern": r"</tool_call>\s*",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"close_pattern": re.escape(markers["ASSISTANT_END"]) + r"\s*", "content": "text"},
        },
    }
    return ToolChatTemplate(style, source, response_template, header, markers["ASSISTANT_END"])


def install_tool_chat_template(
    tokenizer: Any,
    style: str = "auto",
    system_prompt: str | None = None,
    tools_instruction: str = TOOLS_INSTRUCTION,
) -> Any:
    """Give ``tokenizer`` our tool-capable chat template (see :func:`tool_chat_template` for the
    arguments and the module docstring for the format) and the matching ``response_template``, so a
    model whose own template has no tool support (SmolLM2-135M-Instruct's) can be trained with tools.
    Replaces the tokenizer's chat template; ``save_pretrained`` saves both. Returns the tokenizer.

    Example::

        tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
        install_tool_chat_template(tokenizer, system_prompt="You are a helpful assistant.")
        tokenizer.apply_chat_template(messages, tools=[add], add_generation_prompt=True, tokenize=False)
    """
    template = tool_chat_template(tokenizer, style, system_prompt, tools_instruction)
    tokenizer.chat_template = template.chat_template
    tokenizer.response_template = template.response_template
    return tokenizer
