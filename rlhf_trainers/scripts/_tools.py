"""``--tools`` and ``--tool_chat_template`` of ``rlhf-trainers grpo|rloo|ppo``: the tool functions named
on the command line, imported (with a clear error for each way a name can be wrong) before anything
else is loaded, and the policy tokenizer's chat template made able to hold a tool-calling conversation.

A tool is named as ``module:function`` (``my_tools:add``, ``pkg.tools:search``), as TRL's
``--reward_funcs`` names a function (``my_tools.add``: the part after the last dot), or as
``path/to/file.py:function`` (the file is imported as a module of its own). The current folder is
searched before ``sys.path``, as ``python -m`` does.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: ``--tool_chat_template`` values.
TOOL_CHAT_TEMPLATES = ("auto", "ours", "model")

_FORMS = "module:function (e.g. my_tools:add), module.function, or path/to/file.py:function"


def split_tool_specs(values: Sequence[str] | None) -> list[str]:
    """The tool names of ``--tools`` (space- and/or comma-separated), without blanks."""
    return [part.strip() for value in values or () for part in value.split(",") if part.strip()]


def import_tool(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names (see the module docstring for the forms).

    Raises:
        ValueError: ``spec`` has no function part, its module or file does not exist, the module has no
            such attribute, or the attribute is not callable. An error raised while the module itself is
            imported (its own bad import, a syntax error) propagates unchanged, with its traceback.
    """
    if ":" in spec:
        location, _, name = spec.rpartition(":")
    elif "." in spec and not spec.endswith(".py"):
        location, _, name = spec.rpartition(".")
    else:
        raise ValueError(f"--tools {spec}: expected {_FORMS}.")
    if not location or not name.isidentifier():
        raise ValueError(f"--tools {spec}: expected {_FORMS}; {name!r} is not a function name.")
    if location.endswith(".py") or os.sep in location or "/" in location:
        module = _import_file(spec, Path(location).expanduser())
    else:
        module = _import_module(spec, location)
    if not hasattr(module, name):
        found = sorted(
            key
            for key, value in vars(module).items()
            if inspect.isfunction(value) and not key.startswith("_")
        )
        listing = f"its functions: {', '.join(found)}" if found else "it defines no functions"
        raise ValueError(f"--tools {spec}: {location} has no attribute {name!r} ({listing}).")
    tool = getattr(module, name)
    if not callable(tool):
        raise ValueError(
            f"--tools {spec}: {location}.{name} is not callable (its type is {type(tool).__name__}). A tool is a "
            "function (plain or async) with a type hint on every argument and a Google-style docstring."
        )
    return tool


def _import_module(spec: str, module_name: str) -> Any:
    """``module_name`` imported, the current folder searched first (TRL's CLI does the same)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name != missing and not module_name.startswith(missing + "."):
            raise  # the module exists; one of its own imports failed: its traceback says which
        raise ValueError(
            f"--tools {spec}: no module named {missing!r} (searched the current folder {cwd} and "
            f"sys.path). Give an importable module, or the file itself: path/to/{module_name.split('.')[-1]}.py:"
            f"{spec.rpartition(':')[2] or spec.rpartition('.')[2]}."
        ) from None


def _import_file(spec: str, path: Path) -> Any:
    """The Python file ``path`` imported as a module of its own (registered in ``sys.modules``, so that
    its functions pickle and its dataclasses work)."""
    if not path.is_file():
        raise FileNotFoundError(f"--tools {spec}: no such file {path.absolute()}.")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    module_name = f"rlhf_trainers_tools_{resolved.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if loader_spec is None or loader_spec.loader is None:
        raise ValueError(f"--tools {spec}: {path} cannot be imported as a Python module (name it *.py).")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_tools(values: Sequence[str] | None) -> list[Callable[..., Any]] | None:
    """The tools ``--tools`` names (None when it names none), each checked as the trainer will use it
    (a name, type hints and a docstring its JSON schema is made from), before any model is loaded."""
    specs = split_tool_specs(values)
    if not specs:
        return None
    from ..agents import Toolbox

    tools = [import_tool(spec) for spec in specs]
    try:
        Toolbox(tools)
    except ValueError as error:
        raise ValueError(f"--tools {','.join(specs)}: {error}") from None
    return tools


def prepare_tool_tokenizer(tokenizer: Any, choice: str, with_tools: bool, model_name: str) -> Any:
    """``tokenizer`` with the chat template ``--tool_chat_template`` asks for:

    - ``auto`` (the default): with ``--tools``, the tokenizer's own template when it can hold a
      tool-calling conversation (the tools offered, the calls, the results), else ours
      (:func:`~rlhf_trainers.agents.install_tool_chat_template`), with a note on the main process;
      without ``--tools``, the tokenizer's own.
    - ``ours``: ours, always.
    - ``model``: the tokenizer's own, always; with ``--tools``, one that cannot hold tool calls is refused.
    """
    from ..agents import install_tool_chat_template, tool_calling_problems

    if choice not in TOOL_CHAT_TEMPLATES:  # pragma: no cover  (the flag's choices refuse it first)
        raise ValueError(f"--tool_chat_template {choice}: expected one of {', '.join(TOOL_CHAT_TEMPLATES)}.")
    if choice == "ours":
        return install_tool_chat_template(tokenizer)
    if not with_tools:
        return tokenizer
    problems = tool_calling_problems(tokenizer)
    if not problems:
        return tokenizer
    if choice == "model":
        raise ValueError(
            f"--tool_chat_template model: the chat template of {model_name} cannot hold a tool-calling "
            f"conversation ({'; '.join(problems)}). Use --tool_chat_template auto (or ours) for rlhf_trainers' "
            "tool-capable template, or give a model whose template renders tools, tool calls and results."
        )
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"note: the chat template of {model_name} cannot hold a tool-calling conversation "
            f"({problems[0]}); using rlhf_trainers' tool chat template instead (tools listed in the "
            "system turn, calls as <tool_call> JSON; saved with the model). --tool_chat_template model "
            "keeps the model's own.",
            file=sys.stderr,
        )
    return install_tool_chat_template(tokenizer)
