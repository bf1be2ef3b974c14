"""mkdocs hook (see ``hooks:`` in mkdocs.yml): links from a page to a repository file outside docs/.

The pages link to files such as ``../examples/ppo.py`` or ``../benchmarks/README.md`` so that they work
when read on GitHub or in a clone. The site holds only docs/, where such links would be broken (and
``mkdocs build --strict`` fails on them). With ``repo_url`` set in mkdocs.yml they become links to the
file in the repository (``<repo_url>/blob/main/<path>``); without it, the link text is kept and the path
shown as code.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]+)\]\((?P<target>\.\./[^)\s#]*)(?P<anchor>#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, **_: Any) -> str:
    """Rewrite the page's links that leave docs/ (mkdocs calls this for every page)."""
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    page_dir = posixpath.dirname(page.file.src_uri)
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def rewrite(match: re.Match[str]) -> str:
        target = (docs / page_dir / match["target"]).resolve()
        if target.is_relative_to(docs) or not target.is_relative_to(root) or not target.exists():
            return match[0]  # inside docs/ (mkdocs checks it), or not a repository file: leave it
        path = target.relative_to(root).as_posix() + ("/" if target.is_dir() else "")
        text = match["text"]
        if repo_url:
            return f"[{text}]({repo_url}/blob/main/{path}{match['anchor'] or ''})"
        if text.strip("`").rstrip("/") == path.rstrip("/"):
            return f"`{path}`"
        return f"{text} (`{path}` in the repository)"

    return _LINK.sub(rewrite, markdown)
