"""The package's modules as parsed source, for the structure tests (read, never imported)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import stepwatch

SRC = Path(stepwatch.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, tuple[Path, ast.Module]]:
    """Every module of the package by dotted name: its file and its syntax tree."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        found[module_name(path)] = (path, ast.parse(path.read_text(), filename=str(path)))
    return found
