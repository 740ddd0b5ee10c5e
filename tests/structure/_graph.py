"""The package's import graph, from the source (every import statement, at any depth: an import
inside a function is a dependency all the same, only a later one)."""

from __future__ import annotations

import ast
from functools import cache

from ._source import modules


def _is_package(name: str) -> bool:
    return modules()[name][0].name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer if _is_package(importer) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def _owner(name: str) -> str | None:
    """``name`` when it is one of the package's modules (None: not ours, or not there, such as
    an optional backend's module that a lazy import tries)."""
    return name if name in modules() else None


def _in_type_checking(tree: ast.Module) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


@cache
def import_graph(*, typing_too: bool = False) -> dict[str, frozenset[str]]:
    """Module -> the package modules it imports. ``typing.TYPE_CHECKING`` blocks are left out
    (they never run, so they make no cycle) unless ``typing_too``: a layer that names another's
    types depends on it all the same."""
    known = modules()
    graph: dict[str, frozenset[str]] = {}
    for name, (_, tree) in known.items():
        skipped = set() if typing_too else _in_type_checking(tree)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets.update(t for alias in node.names if (t := _owner(alias.name)))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node)
                for alias in node.names:  # a submodule by name, else a name the module defines
                    target = _owner(f"{base}.{alias.name}") or _owner(base)
                    if target:
                        targets.add(target)
        targets.discard(name)
        graph[name] = frozenset(targets)
    return graph


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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
    return sorted(found)
