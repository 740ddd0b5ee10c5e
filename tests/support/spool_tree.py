"""The span tree of a loaded spool, as the framework tests walk it: spans by name and a span's
children, each in start order."""

from __future__ import annotations

from typing import Any

from stepwatch.artifacts.spool import LoadedSpool


def named(spool: LoadedSpool, name: str) -> list[dict[str, Any]]:
    """Every span called ``name``."""
    return sorted((s for s in spool.spans if s["name"] == name), key=lambda s: s["start_ns"])


def children(spool: LoadedSpool, parent: dict[str, Any], name: str | None = None) -> list[dict[str, Any]]:
    """``parent``'s children (those called ``name`` only, when given)."""
    return sorted((s for s in spool.spans if s["parent_id"] == parent["id"] and name in (None, s["name"])),
                  key=lambda s: s["start_ns"])
