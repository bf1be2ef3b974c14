"""No import cycle between rlhf_trainers' subpackages and top-level modules (issue #47).

The graph is read from the source with ``ast`` (nothing is imported): every ``import`` and ``from ... import``
statement, at module level or inside a function, is an edge from the subpackage or top-level module that
holds it (``rlhf_trainers.generation``, ``rlhf_trainers.models``, ...) to the one it names. Imports within
one subpackage are not edges. The package's ``__init__`` (the public API, which re-exports every trainer
lazily) is left out: it is the facade, not a part.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlhf_trainers"
ROOT = PACKAGE.name

#: Cycles known and accepted, each as the sorted names of its parts, with the reason. Empty: none.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def _part(module: str) -> str | None:
    """The subpackage or top-level module of ``rlhf_trainers`` that ``module`` (dotted) lies in, or None
    for the package itself and names that are not one of its files (an attribute of the package)."""
    parts = module.split(".")
    if parts[0] != ROOT or len(parts) < 2:
        return None
    name = parts[1]
    if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file():
        return name
    return None


def _imported(node: ast.AST, package: list[str]) -> list[str]:
    """The dotted modules (or module.attribute names) an import statement names; ``package`` is the dotted
    path, as parts, of the package the statement's file belongs to."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package[: len(package) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [module] + [f"{module}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """``{part: parts it imports}`` over every ``.py`` file of the package (module- and function-level)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = [ROOT, *path.relative_to(PACKAGE).with_suffix("").parts]
        package = parts[:-1]  # what relative imports start from, for a module and an __init__ alike
        if parts[-1] == "__init__":
            parts = parts[:-1]
        source = _part(".".join(parts))
        if source is None:
            continue
        edges = graph.setdefault(source, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            for name in _imported(node, package):
                target = _part(name)
                if target is not None and target != source:
                    edges.add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one part (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle through ``component``'s first part, as ``a -> b -> a``."""
    start, members = component[0], set(component)
    trail, seen = [start], {start}
    while True:
        options = sorted(graph[trail[-1]] & members)
        if start in options and len(trail) > 1:
            return " -> ".join([*trail, start])
        nxt = next((o for o in options if o not in seen), start)
        if nxt == start:
            return " -> ".join([*trail, start])
        trail.append(nxt)
        seen.add(nxt)


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert {"onpolicy", "generation", "cpu", "models"} <= set(graph)
    assert "generation" in graph["onpolicy"]  # module level
    assert "cpu" in graph["onpolicy"]
    assert "testing" in graph["scripts"]  # inside functions only


def test_no_import_cycle_between_subpackages_and_modules():
    graph = import_graph()
    found = {tuple(c): _path(graph, c) for c in cycles(graph)}
    unexpected = {c: p for c, p in found.items() if c not in KNOWN_CYCLES}
    assert not unexpected, "import cycles: " + "; ".join(unexpected.values())
    stale = set(KNOWN_CYCLES) - set(found)
    assert not stale, f"KNOWN_CYCLES lists cycles that no longer exist: {sorted(stale)}"


def test_nothing_in_generation_imports_the_cpu_switches():
    assert "cpu" not in import_graph()["generation"]


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert _path(graph, ["a", "b", "c"]) == "a -> b -> c -> a"
