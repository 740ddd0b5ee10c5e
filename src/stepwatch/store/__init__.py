"""The history store: one interface, an embedded SQLite backend (ClickHouse can follow)."""

from .base import TABLES, HistoryStore
from .open import open_store

__all__ = ["TABLES", "HistoryStore", "open_store"]
