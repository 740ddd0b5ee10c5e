"""Opens the backend a path or URL names: the one module that knows every backend."""

from __future__ import annotations

import os
from pathlib import Path

from .base import HistoryStore
from .clickhouse_url import is_clickhouse_url

__all__ = ["is_store_url", "open_store"]


def is_store_url(target: object) -> bool:
    """Whether ``target`` names a store by URL (``clickhouse://...``) rather than a path. A
    ``Path`` never does (``Path("clickhouse://h/db")`` has lost a slash already)."""
    return is_clickhouse_url(target) or (isinstance(target, str) and "://" in target)


def open_store(target: str | os.PathLike[str], *, read_only: bool = False) -> HistoryStore:
    """A store from a path or URL: ``*.sqlite`` / a run directory (its history.sqlite) or
    ``clickhouse://[user[:password]@]host[:port][/database]`` (docs/clickhouse.md). Any other
    ``scheme://`` is a StoreError naming it."""
    if isinstance(target, str) and "://" in target:
        if not is_clickhouse_url(target):
            from ..errors import StoreError

            scheme = target.split("://", 1)[0]
            raise StoreError(f"store URL {target!r}: scheme: {scheme!r} is not a store this build knows "
                             f"(a history.sqlite path, a run directory, or clickhouse://host:port/db)")
        from .clickhouse import ClickHouseStore

        return ClickHouseStore(target, read_only=read_only)
    from .sqlite import SqliteStore

    path = Path(os.fspath(target))
    if path.is_dir():
        path = path / "history.sqlite"
    return SqliteStore(path, read_only=read_only)
