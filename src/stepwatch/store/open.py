"""Opens the backend a path or URL names: the one module that knows every backend."""

from __future__ import annotations

import os
from pathlib import Path

from .base import HistoryStore

__all__ = ["open_store"]


def open_store(target: str | os.PathLike[str], *, read_only: bool = False) -> HistoryStore:
    """A store from a path or URL: ``*.sqlite`` / a run directory (its history.sqlite) or
    ``clickhouse://host:port/db``."""
    text = os.fspath(target)
    if text.startswith("clickhouse://"):
        from .clickhouse import ClickHouseStore  # type: ignore[import-not-found]

        return ClickHouseStore(text)  # type: ignore[no-any-return]
    from .sqlite import SqliteStore

    path = Path(text)
    if path.is_dir():
        path = path / "history.sqlite"
    return SqliteStore(path, read_only=read_only)
