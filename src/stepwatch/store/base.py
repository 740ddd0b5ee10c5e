"""What every history backend offers: typed row tables, batched appends, the queries the views
and the summary need, retention. Rows are plain dicts whose keys are the columns below, so the
same rows go to SQLite or ClickHouse unchanged.

The interface knows no backend: ``store/open.py`` picks one from a path or URL, so a backend can
import this module without this module importing it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from ..schema.tables import TABLES as HISTORY_TABLES
from ..schema.tables import column_types

__all__ = ["COLUMNS", "TABLES", "HistoryStore"]

# table -> (column, SQL type); `json` columns hold encoded JSON text. Declared once, with where
# each column comes from, in ``schema.tables``.
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {table: column_types(table) for table in HISTORY_TABLES}
TABLES = tuple(COLUMNS)


class HistoryStore(Protocol):
    """The one writer appends; any number of read-only readers query."""

    def append(self, table: str, rows: Iterable[Mapping[str, Any]]) -> int: ...

    def append_many(self, batches: Mapping[str, list[Mapping[str, Any]]]) -> int:
        """All tables of one tick in one transaction."""

    def append_tuples(self, batches: Mapping[str, list[tuple[Any, ...]]],
                      batch_ids: Iterable[tuple[str, int]] = ()) -> int:
        """Like ``append_many``, for rows already as tuples in COLUMNS order with their JSON
        columns encoded (``rows.row_tuples``): what the aggregator's writer hands over. Records
        the (batch id, seen at ns) of the HTTP batches they came in, in the same transaction."""

    def upsert_session(self, row: Mapping[str, Any]) -> None: ...

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]: ...

    def iterate(self, sql: str, params: Iterable[Any] = (), size: int = 2048) -> Iterator[tuple[Any, ...]]:
        """The rows of ``sql`` as tuples, streamed from one cursor (bounded memory)."""

    def count(self, table: str, session_id: str | None = None) -> int: ...

    def sessions(self) -> list[dict[str, Any]]: ...

    def step_rows(self, session_id: str) -> list[dict[str, Any]]: ...

    def memory_peaks(self, session_id: str) -> list[dict[str, Any]]: ...

    def apply_retention(self, window_ns: int, now_ns: int | None = None) -> int: ...

    def seen_batches(self, since_ns: int) -> dict[str, int]:
        """HTTP batch ids recorded at or after ``since_ns`` (the dedupe window), with when."""

    def forget_batches(self, before_ns: int) -> int: ...

    def close(self) -> None: ...
