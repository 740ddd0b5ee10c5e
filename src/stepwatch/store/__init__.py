"""The history store: one interface, an embedded SQLite backend (ClickHouse can follow)."""

from .base import TABLES, HistoryStore, open_store

__all__ = ["TABLES", "HistoryStore", "open_store"]
