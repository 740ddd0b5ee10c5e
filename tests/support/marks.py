"""Which marks a program made itself, apart from those stepwatch records by itself."""

from __future__ import annotations

from typing import Any

from stepwatch.artifacts.spool import LoadedSpool


def is_own(mark: dict[str, Any]) -> bool:
    """Not the loss and gradient norm stepwatch infers (attrs ``inferred``), nor the program
    settings it records (``stepwatch.*`` names)."""
    return not (mark.get("attrs") or {}).get("inferred") and not mark["name"].startswith("stepwatch.")


def own_marks(spool: LoadedSpool) -> list[dict[str, Any]]:
    return [m for m in spool.marks if is_own(m)]
