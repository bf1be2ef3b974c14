"""The code snippets of the documentation run, so they never go stale.

Every fenced ```python block of every ``docs/*.md`` page and of ``README.md`` is executed; a new page is
found and tested without editing this file. The conventions a page follows (HTML comments, which the
rendered page does not show):

- The ```python blocks of one page run in order and share one namespace (a later block may use the
  names of earlier ones), in a fresh Python process whose working directory is a fresh temporary
  folder, so relative paths such as ``runs/ppo`` land there. A block passes when it runs without an
  exception (printed outputs are not compared). After the first failing block the page stops: later
  blocks would fail for the same reason.
- Only ``python`` fences run. ``bash`` (commands), ``json``, ``yaml`` and untagged blocks (outputs,
  folder layouts) are never executed.
- ``<!-- docs-test: skip (REASON) -->`` on the line before a block (blank lines may separate them)
  leaves that block out, e.g. ``(needs the Hugging Face Hub)`` or ``(needs a GPU)``. The reason is
  required. Each page's test prints how many blocks it skipped, and ``test_every_page_parses`` prints
  every skipped block with its reason.
- ``<!-- docs-test: needs MODULE[, MODULE] -->`` before a block runs it where those modules can be
  imported and skips it (counted and listed like a skip) where they cannot: for optional extras such as
  ``matplotlib`` (the ``demo`` extra), as the DeepSpeed tests do for the ``deepspeed`` extra.
- ``<!-- docs-test: signature MODULE -->`` before a block of call signatures (``name(params) -> ...`` at
  the start of a line, and indented ``.method(params)`` lines for the class above them) does not run
  the block but compares each signature with ``inspect.signature`` of ``MODULE.name``: parameter names,
  order, kinds (positional, keyword-only, ``*args``, ``**kwargs``) and default values. Annotations and
  return values are not compared.
- Page directives, anywhere outside a code block: ``<!-- docs-test: slow (WHY) -->`` (the reason
  optional) marks the page's test ``slow`` (its snippets take more than ~20 s on 2 CPU cores); ``<!-- docs-test: requires OTHER.md
  (WHY) -->`` (the reason optional) first runs the blocks of OTHER.md (a page in the same folder) in the
  same working directory, in their own namespace, for the files they write (e.g. a reward model another
  page trains).
- Any other ``docs-test:`` comment, a block marker that is not followed by a ```python block, and a
  required page that does not exist are errors.

Run one page with ``python -m pytest tests/test_docs.py -k ppo.md -s`` (``-s`` shows the per-block
report). This file is also the runner of one page: ``python tests/test_docs.py PAGE.md RESULT.json``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import forked
import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
PAGE_TIMEOUT_S = 3600

_DIRECTIVE = re.compile(r"<!--\s*docs-test:(.*?)-->")
_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>.*\S.*)\)$")
_SIGNATURE = re.compile(r"^signature\s+(?P<module>[A-Za-z_][\w.]*)$")
_NEEDS = re.compile(r"^needs\s+(?P<modules>[A-Za-z_][\w.]*(\s*,\s*[A-Za-z_][\w.]*)*)$")
_REQUIRES = re.compile(r"^requires\s+(?P<page>\S+\.md)(\s*\(.*\))?$")


class DocsTestError(ValueError):
    """A page breaks the snippet conventions (see the module docstring)."""


@dataclass
class Block:
    """One ```python block: ``line`` is the 1-based line of its first code line in the page."""

    line: int
    code: str
    kind: str = "run"  # "run", "skip" or "signature"
    arg: str = ""  # the skip reason or the signature module


@dataclass
class Page:
    """The python blocks and the page directives of one markdown file."""

    path: Path
    blocks: list[Block] = field(default_factory=list)
    slow: bool = False
    requires: list[Path] = field(default_factory=list)


def parse_page(path: Path, text: str | None = None) -> Page:
    """Extract the ```python blocks and ``docs-test`` directives of a markdown page.

    Raises:
        DocsTestError: an unknown directive, a skip without a reason, a block marker not followed by a
            ```python block, or a required page that does not exist.
    """
    path = Path(path)
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    page = Page(path)
    pending: tuple[int, str, str] | None = None  # (line, kind, arg) of a block marker
    i = 0
    while i < len(lines):
        line = lines[i]
        opening = _FENCE_OPEN.match(line)
        if opening:
            indent, fence = opening["indent"], opening["fence"]
            info = opening["info"].strip().split()
            language = info[0].lower() if info else ""
            close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
            end = i + 1
            while end < len(lines) and not close.match(lines[end]):
                end += 1
            if language == "python":
                body = [
                    row[len(indent) :] if row.startswith(indent) else row.lstrip()
                    for row in lines[i + 1 : end]
                ]
                kind, arg = ("run", "") if pending is None else pending[1:]
                page.blocks.append(Block(i + 2, "\n".join(body) + "\n", kind, arg))
            elif pending is not None:
                raise DocsTestError(
                    f"{path}:{pending[0]}: the docs-test marker is followed by a ```{language or '(untagged)'} "
                    "block; markers apply to ```python blocks only. Remove the marker or fix the fence."
                )
            pending = None
            i = end + 1
            continue
        for match in _DIRECTIVE.finditer(line):
            directive = " ".join(match[1].split())
            where = f"{path}:{i + 1}"
            if re.fullmatch(r"slow(\s*\(.*\))?", directive):
                page.slow = True
            elif m := _REQUIRES.match(directive):
                required = path.parent / m["page"]
                if not required.is_file():
                    raise DocsTestError(
                        f"{where}: 'requires {m['page']}' names a page that does not exist in {path.parent}."
                    )
                page.requires.append(required)
            elif m := _SKIP.match(directive):
                pending = (i + 1, "skip", m["reason"].strip())
            elif m := _SIGNATURE.match(directive):
                pending = (i + 1, "signature", m["module"])
            elif m := _NEEDS.match(directive):
                pending = (i + 1, "needs", ",".join(x.strip() for x in m["modules"].split(",")))
            else:
                raise DocsTestError(
                    f"{where}: unknown directive 'docs-test: {directive}'. Expected 'skip (REASON)' (with a "
                    "reason), 'needs MODULE[, MODULE]', 'signature MODULE', 'slow' or 'requires PAGE.md'."
                )
        if pending is not None and pending[0] != i + 1 and line.strip():
            raise DocsTestError(
                f"{path}:{pending[0]}: the docs-test marker is not followed by a ```python block (line {i + 1} "
                "comes first). Put the marker on the line right before the block."
            )
        i += 1
    if pending is not None:
        raise DocsTestError(
            f"{path}:{pending[0]}: the docs-test marker at the end of the page marks no block."
        )
    return page


# ---- signatures ------------------------------------------------------------------------------------


def _closing_paren(text: str, start: int) -> int:
    depth = 0
    for j in range(start, len(text)):
        if text[j] in "([{":
            depth += 1
        elif text[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    raise DocsTestError(f"unbalanced parentheses in the signature starting {text[start - 20 : start + 40]!r}")


_KINDS = inspect.Parameter


def _documented_parameters(params: str) -> list[tuple[str, object, str | None]]:
    """(name, kind, default source or None) of a documented parameter list."""
    try:
        args = ast.parse(f"def _f({params}): pass").body[0].args
    except SyntaxError as err:
        raise DocsTestError(f"not a parameter list: ({params}): {err.msg}") from err
    positional = [(a, _KINDS.POSITIONAL_ONLY) for a in args.posonlyargs] + [
        (a, _KINDS.POSITIONAL_OR_KEYWORD) for a in args.args
    ]
    defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    out = [(a.arg, kind, d) for (a, kind), d in zip(positional, defaults, strict=True)]
    if args.vararg:
        out.append((args.vararg.arg, _KINDS.VAR_POSITIONAL, None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append((a.arg, _KINDS.KEYWORD_ONLY, None if d is None else ast.unparse(d)))
    if args.kwarg:
        out.append((args.kwarg.arg, _KINDS.VAR_KEYWORD, None))
    return out


def _same_default(documented: str, actual: object, namespace: dict) -> bool:
    try:
        value = eval(documented, namespace)
        if isinstance(value, bool) or isinstance(actual, bool):
            return value is actual
        if isinstance(value, (int, float)) and isinstance(actual, (int, float)):
            return value == actual  # 1.0 documents a default of 1 well enough
        return type(value) is type(actual) and bool(value == actual)
    except Exception:
        return False


def check_signatures(code: str, module_name: str) -> tuple[int, list[str]]:
    """Compare every signature in ``code`` with the code of ``module_name``.

    Returns:
        (number of signatures checked, problems as readable strings).
    """
    module = importlib.import_module(module_name)
    namespace = dict(vars(module))
    text = "\n".join(row.split("#", 1)[0].rstrip() for row in code.splitlines())
    checked, problems = 0, []
    owner, consumed = None, 0
    for match in re.finditer(
        r"(?m)^(?P<indent>[ \t]*)(?P<dot>\.)?(?P<name>[A-Za-z_]\w*)\(|(?<=[ /])\.(?P<method>\w+)\(", text
    ):
        if match.start() < consumed:
            continue  # inside the parameters of the signature before
        if match["method"] or match["dot"]:
            name = match["method"] or match["name"]
            if owner is None:
                problems.append(f".{name}(...) documented before any class signature")
                continue
            target, label, drop_self = getattr(owner, name, None), f"{owner.__name__}.{name}", True
        elif match["indent"]:
            continue  # an indented line that is not a method: prose inside the block
        else:
            name = match["name"]
            target, label, drop_self = getattr(module, name, None), name, False
            owner = target if inspect.isclass(target) else None
        if target is None:
            problems.append(f"{label}: not found in {module_name}")
            continue
        open_at = match.end() - 1
        consumed = _closing_paren(text, open_at)
        documented = _documented_parameters(text[open_at + 1 : consumed])
        actual = list(inspect.signature(target).parameters.values())
        if drop_self and actual and actual[0].name in ("self", "cls"):
            actual = actual[1:]
        checked += 1
        doc_shape = [(n, k, d is not None) for n, k, d in documented]
        code_shape = [(p.name, p.kind, p.default is not p.empty) for p in actual]
        if doc_shape != code_shape:
            problems.append(
                f"{label}: documented ({_show(documented)}) but the code has {inspect.signature(target)}"
            )
            continue
        for (pname, _, default), p in zip(documented, actual, strict=True):
            if default is not None and not _same_default(default, p.default, namespace):
                problems.append(
                    f"{label}: {pname} documented with default {default}, the code has {p.default!r}"
                )
    if not checked:
        problems.append("the signature block holds no 'name(params)' line")
    return checked, problems


def _show(documented: list[tuple[str, object, str | None]]) -> str:
    prefix = {_KINDS.VAR_POSITIONAL: "*", _KINDS.VAR_KEYWORD: "**"}
    return ", ".join(
        f"{prefix.get(k, '')}{'' if k is not _KINDS.KEYWORD_ONLY else '(kw) '}{n}{'' if d is None else '=' + d}"
        for n, k, d in documented
    )


# ---- the runner (in the page's own process) ----------------------------------------------------------


def _run_blocks(page: Page, results: list[dict]) -> bool:
    """Run a page's blocks in one namespace; append one result per block; False after a failure."""
    namespace: dict = {"__name__": "__main__"}
    failed = False
    for block in page.blocks:
        entry = {"page": str(page.path), "line": block.line, "kind": block.kind, "arg": block.arg}
        results.append(entry)
        if failed:
            entry["status"] = "not run"
            continue
        start, cpu_start = time.perf_counter(), time.process_time()
        missing = (
            [m for m in block.arg.split(",") if importlib.util.find_spec(m) is None]
            if block.kind == "needs"
            else []
        )
        if block.kind == "skip" or missing:
            entry["status"] = "skipped"
            if missing:
                entry["arg"] = f"needs {', '.join(missing)}, not installed"
        elif block.kind == "signature":
            try:
                entry["checked"], problems = check_signatures(block.code, block.arg)
            except Exception:
                problems = [traceback.format_exc()]
            entry["status"] = "failed" if problems else "ok"
            entry["error"] = "\n".join(problems)
        else:
            # Pad with newlines so that tracebacks name the page and the line of the markdown file.
            try:
                code = compile("\n" * (block.line - 1) + block.code, str(page.path), "exec")
                exec(code, namespace)
                entry["status"] = "ok"
            except BaseException:
                entry["status"] = "failed"
                entry["error"] = traceback.format_exc()
        entry["seconds"] = round(time.perf_counter() - start, 3)
        # CPU seconds of this process (all its threads): on a loaded machine a better guide than wall time.
        entry["cpu_seconds"] = round(time.process_time() - cpu_start, 3)
        failed = entry["status"] == "failed"
    return not failed


def _requirements(page: Page, seen: tuple[Path, ...] = ()) -> list[Page]:
    out: list[Page] = []
    for required in page.requires:
        if required in seen or required == page.path:
            raise DocsTestError(f"{page.path}: circular 'requires' through {required.name}")
        sub = parse_page(required)
        out += [*_requirements(sub, (*seen, page.path)), sub]
    return out


def run_page_here(path: Path) -> list[dict]:
    """Run the blocks of ``path`` (after those of the pages it requires) in this process."""
    page = parse_page(path)
    results: list[dict] = []
    for required in _requirements(page):
        if not _run_blocks(required, results):
            return results
    _run_blocks(page, results)
    return results


def _main(argv: list[str]) -> int:
    page, out = argv
    # The tests folder must not shadow anything a snippet imports.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    results = run_page_here(Path(page))
    Path(out).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


def run_page(path: Path, workdir: Path, timeout: float = PAGE_TIMEOUT_S) -> tuple[list[dict], str]:
    """Run a page as a fresh process would (:func:`forked.run`) with ``workdir`` as its working directory.

    Returns:
        (one result per block, the process's output).
    """
    out = workdir / "docs-test-result.json"
    env = dict(os.environ)
    # Hub access fails fast instead of hanging; plots do not need a display.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg", TOKENIZERS_PARALLELISM="false")
    # A fork of a server that has imported torch, transformers and this package: what a fresh process
    # would run, without paying the ~5 s of imports per page (tests/forked.py).
    proc = forked.run(Path(__file__), [Path(path).resolve(), out], cwd=workdir, env=env, timeout=timeout)
    output = proc.stdout + proc.stderr
    (workdir / "docs-test-output.txt").write_text(output, encoding="utf-8")  # what the snippets printed
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"the runner of {path} exited with {proc.returncode}:\n{output[-6000:]}")
    return json.loads(out.read_text(encoding="utf-8")), output


def _report(results: list[dict]) -> str:
    rows = []
    for r in results:
        what = {"skip": f"skip ({r['arg']})", "signature": f"signature {r['arg']}"}.get(r["kind"], "run")
        if r["kind"] == "needs":
            what = r["arg"] if r["status"] == "skipped" else f"run (needs {r['arg']})"
        seconds = f"{r['seconds']:7.1f} s ({r['cpu_seconds']:7.1f} s CPU)" if "seconds" in r else " " * 25
        rows.append(f"  {Path(r['page']).name}:{r['line']:<5} {r['status']:8} {seconds}  {what}")
    return "\n".join(rows)


# ---- the tests ------------------------------------------------------------------------------------------


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO))


def _page_params() -> list:
    params = []
    for path in PAGES:
        try:
            page = parse_page(path)
        except DocsTestError:
            params.append(pytest.param(path, id=_relative(path)))  # the test reports the error
            continue
        if page.blocks:
            params.append(
                pytest.param(path, id=_relative(path), marks=[pytest.mark.slow] if page.slow else [])
            )
    return params


@pytest.mark.parametrize("path", _page_params())
def test_page_snippets_run(path: Path, tmp_path: Path) -> None:
    results, output = run_page(path, tmp_path)
    own = [r for r in results if Path(r["page"]) == path]
    counts = {s: sum(r["status"] == s for r in own) for s in ("ok", "skipped", "failed", "not run")}
    print(
        f"{_relative(path)}: {counts['ok']} ok ({sum(r['kind'] == 'signature' for r in own)} signature blocks), "
        f"{counts['skipped']} skipped, {counts['failed']} failed; "
        f"{sum(r.get('seconds', 0) for r in results):.1f} s wall, "
        f"{sum(r.get('cpu_seconds', 0) for r in results):.1f} s CPU\n{_report(results)}"
    )
    failures = [r for r in results if r["status"] == "failed"]
    assert not failures, (
        f"{Path(failures[0]['page']).name}, block at line {failures[0]['line']} failed:\n{failures[0]['error']}\n"
        f"Fix the snippet, or mark it '<!-- docs-test: skip (REASON) -->' if it cannot run offline.\n"
        f"{_report(results)}\n--- output (tail) ---\n{output[-3000:]}"
    )


def test_every_page_parses() -> None:
    """Every page follows the conventions; prints every skipped block with its reason."""
    errors, skipped, totals = [], [], {"run": 0, "skip": 0, "signature": 0, "needs": 0}
    for path in PAGES:
        try:
            page = parse_page(path)
        except DocsTestError as err:
            errors.append(str(err))
            continue
        for block in page.blocks:
            totals[block.kind] += 1
            if block.kind == "skip":
                skipped.append(f"  {_relative(path)}:{block.line}: {block.arg}")
            if block.kind == "needs":
                missing = [m for m in block.arg.split(",") if importlib.util.find_spec(m) is None]
                if missing:
                    skipped.append(
                        f"  {_relative(path)}:{block.line}: needs {', '.join(missing)}, not installed"
                    )
    print(
        f"{len(PAGES)} pages: {totals['run']} blocks run, {totals['needs']} run where their modules are installed, "
        f"{totals['signature']} signature blocks, {totals['skip']} skipped"
    )
    print("\n".join(skipped))
    assert not errors, "\n".join(errors)


_METRIC_PREFIXES = (
    "objective/",
    "policy/",
    "val/",
    "loss/",
    "critic/",
    "rollout/",
    "timing/",
    "perf/",
    "train/",
    "completions/",
    "clip_ratio/",
    "rewards/",
)


def _logged_metric_names() -> set[str]:
    """Metric names in the trainers' source: string literals (and f-string prefixes) with a metric prefix,
    and the keys of the reward trainer's pair metrics."""
    names: set[str] = set()
    sources = [REPO / "rlhf_trainers" / "reliability.py"]
    for package in ("onpolicy", "ppo", "rloo", "grpo", "reward"):
        sources += sorted((REPO / "rlhf_trainers" / package).glob("*.py"))
    for path in sources:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                node = node.values[0]
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith(_METRIC_PREFIXES) and " " not in node.value:
                    names.add(node.value)
            if isinstance(node, ast.FunctionDef) and node.name == "_pair_metrics":
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Dict):
                        names.update(k.value for k in sub.keys if isinstance(k, ast.Constant))
    return names


def test_metrics_guide_lists_every_logged_metric() -> None:
    names = _logged_metric_names()
    assert {"objective/rlhf_reward", "critic/explained_var", "accuracy", "margin"} <= names, sorted(names)
    text = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    missing = sorted(n for n in names if f"`{n}" not in text)
    assert not missing, f"docs/metrics.md does not explain these logged metrics: {missing}"


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    return []


def test_mkdocs_nav_lists_every_page() -> None:
    """The site's navigation (mkdocs.yml) holds every docs/*.md page once, and only existing pages."""
    import yaml  # PyYAML: a dependency of transformers

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert sorted(set(nav)) == sorted(nav), f"pages listed twice in mkdocs.yml: {nav}"
    assert sorted(nav) == pages, (
        f"mkdocs.yml nav and docs/ differ: not in the nav {sorted(set(pages) - set(nav))}, "
        f"in the nav but missing {sorted(set(nav) - set(pages))}. Add the page under nav: in mkdocs.yml."
    )
    index = (REPO / "docs" / "index.md").read_text(encoding="utf-8")
    unlisted = [p for p in pages if p != "index.md" and f"]({p}" not in index]
    assert not unlisted, f"docs/index.md does not link to {unlisted}"


def test_mkdocs_hook_rewrites_links_that_leave_docs() -> None:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "docs" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = SimpleNamespace(file=SimpleNamespace(src_uri="ppo.md"))
    text = (
        "[`examples/ppo.py`](../examples/ppo.py), [the script](../examples/rloo.py#L1), "
        "[kit](testing-kit.md), [gone](../no/such/file.py), ![plot](img/x.png)"
    )
    local = hooks.on_page_markdown(text, page=page, config={"docs_dir": str(REPO / "docs")})
    assert local == (
        "`examples/ppo.py`, the script (`examples/rloo.py` in the repository), "
        "[kit](testing-kit.md), [gone](../no/such/file.py), ![plot](img/x.png)"
    )
    config = {"docs_dir": str(REPO / "docs"), "repo_url": "https://example.org/rlhf_trainers/"}
    assert hooks.on_page_markdown("[s](../examples/rloo.py#L1)", page=page, config=config) == (
        "[s](https://example.org/rlhf_trainers/blob/main/examples/rloo.py#L1)"
    )


def test_config_tables_are_current() -> None:
    """The config field tables of docs/ppo.md are generated from the fields' help by docs/config_tables.py."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "docs" / "config_tables.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_benchmark_tables_are_current() -> None:
    """docs/benchmarks.md's tables are generated from benchmarks/results/ by benchmarks/plot_results.py."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "plot_results.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


_EXAMPLE = """\
# A page
<!-- docs-test: slow -->
<!-- docs-test: requires other.md (it writes a file) -->

```python
x = 1
```

```bash
echo not run
```

<!-- docs-test: skip (needs the Hugging Face Hub) -->

```python
AutoModel.from_pretrained("some/hub-model")
```

1. a list item

   ```python
   y = x + 1
   ```

<!-- docs-test: signature textwrap -->
```python
indent(text, prefix, predicate=None) -> str
```

<!-- docs-test: needs json, textwrap -->
```python
import json
```
"""


def test_parse_finds_blocks_markers_and_directives(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("no code\n")
    page = parse_page(tmp_path / "page.md", _EXAMPLE)
    assert page.slow and page.requires == [tmp_path / "other.md"]
    got = [(b.line, b.kind, b.arg, b.code) for b in page.blocks]
    assert got == [
        (6, "run", "", "x = 1\n"),
        (16, "skip", "needs the Hugging Face Hub", 'AutoModel.from_pretrained("some/hub-model")\n'),
        (22, "run", "", "y = x + 1\n"),
        (27, "signature", "textwrap", "indent(text, prefix, predicate=None) -> str\n"),
        (32, "needs", "json,textwrap", "import json\n"),
    ]
    assert _EXAMPLE.splitlines()[21] == "   y = x + 1"  # line numbers point at the code


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- docs-test: skip -->\n```python\nx\n```\n", "unknown directive"),
        ("<!-- docs-test: skip () -->\n```python\nx\n```\n", "unknown directive"),
        ("<!-- docs-test: skip (why) -->\n```bash\nls\n```\n", "```bash block"),
        (
            "<!-- docs-test: skip (why) -->\nsome prose\n```python\nx\n```\n",
            "not followed by a ```python block",
        ),
        ("<!-- docs-test: signature os -->\n", "marks no block"),
        ("<!-- docs-test: requires missing.md -->\n", "does not exist"),
        ("<!-- docs-test: slwo -->\n", "unknown directive"),
    ],
)
def test_parse_rejects_broken_markers(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(DocsTestError, match=re.escape(message)):
        parse_page(tmp_path / "page.md", text)


def test_signature_check_catches_stale_signatures() -> None:
    assert check_signatures("indent(text, prefix, predicate=None) -> str  # a comment\n", "textwrap") == (
        1,
        [],
    )
    assert check_signatures("TextWrapper(width=70, **kwargs)\n    .wrap(text)\n", "textwrap")[1] != []
    assert check_signatures("dedent(text)\nindent(text, prefix, predicate=None)\n", "textwrap") == (2, [])
    for stale in (
        "indent(text, prefix, predicate=1)",  # wrong default
        "indent(text, prefix)",  # a parameter missing
        "indent(text, *, prefix, predicate=None)",  # wrong kind
        "indent(text, prefix, predicate=None, extra=2)",  # a parameter too many
        "indentation(text)",  # no such function
    ):
        _checked, problems = check_signatures(stale + "\n", "textwrap")
        assert problems, stale
    _, problems = check_signatures("shorten(text, width, **kwargs)\n", "textwrap")
    assert problems == [], problems
    assert check_signatures("    .wrap(text)\n", "textwrap")[1]  # a method without its class


def test_runner_runs_in_order_skips_marked_blocks_and_stops_at_a_failure(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nfrom pathlib import Path\nPath('made.txt').write_text('x')\nvalue = 41\n```\n\n"
        "<!-- docs-test: skip (needs a GPU) -->\n```python\nraise RuntimeError('a skipped block ran')\n```\n\n"
        "<!-- docs-test: needs no_such_module_here -->\n```python\nraise RuntimeError('ran without its module')\n```\n\n"
        "<!-- docs-test: needs json -->\n```python\nimport json\nvalue = json.loads('41')\n```\n\n"
        "```python\nassert value == 41\nvalue += 1\nraise KeyError(value)\n```\n\n"
        "```python\nprint('after the failure')\n```\n"
    )
    workdir = tmp_path / "work"
    workdir.mkdir()
    results, output = run_page(page, workdir, timeout=120)
    assert [(r["line"], r["status"]) for r in results] == [
        (2, "ok"),
        (9, "skipped"),
        (14, "skipped"),
        (19, "ok"),
        (24, "failed"),
        (30, "not run"),
    ]
    assert results[2]["arg"] == "needs no_such_module_here, not installed"
    assert "KeyError: 42" in results[4]["error"]
    assert f'File "{page}", line 26' in results[4]["error"]  # the traceback names the markdown line
    assert (workdir / "made.txt").exists()
    assert "after the failure" not in output


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
