"""What every history backend offers: typed row tables, batched appends, the queries the views
and the summary need, retention. Rows are plain dicts whose keys are the columns below, so the
same rows go to SQLite or ClickHouse unchanged.

The interface knows no backend: ``store/open.py`` picks one from a path or URL, so a backend can
import this module without this module importing it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from ..errors import StoreError
from ..schema.tables import TABLES as HISTORY_TABLES
from ..schema.tables import column_types

__all__ = ["COLUMNS", "TABLES", "HistoryStore", "SqlReads"]

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

    def step_tuples(self, session_id: str, columns: Sequence[str]) -> list[tuple[Any, ...]]: ...

    def query_tuples(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]: ...

    def memory_peaks(self, session_id: str) -> list[dict[str, Any]]: ...

    def apply_retention(self, window_ns: int, now_ns: int | None = None) -> int: ...

    def seen_batches(self, since_ns: int) -> dict[str, int]:
        """HTTP batch ids recorded at or after ``since_ns`` (the dedupe window), with when."""

    def forget_batches(self, before_ns: int) -> int: ...

    def close(self) -> None: ...


class SqlReads:
    """The reads every SQL store answers with the same SQL over the same views: one copy, each
    store bringing its own ``query``."""

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        raise NotImplementedError

    def count(self, table: str, session_id: str | None = None) -> int:
        if table not in COLUMNS:
            raise StoreError(f"unknown table {table!r}")
        where, params = ("WHERE session_id = ?", (session_id,)) if session_id else ("", ())
        return int(self.query(f"SELECT COUNT(*) AS n FROM {table} {where}", params)[0]["n"])

    def sessions(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM sessions ORDER BY started_at_ns DESC")

    def step_rows(self, session_id: str) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM steps WHERE session_id = ? ORDER BY rank, step", (session_id,))

    def step_tuples(self, session_id: str, columns: Sequence[str]) -> list[tuple[Any, ...]]:
        """Every step row of ``session_id`` as a tuple of ``columns``, in no set order: the
        summary's one read of a session, which it orders itself (a store reads fastest in the
        order it keeps them)."""
        return self.query_tuples(f"SELECT {', '.join(columns)} FROM steps WHERE session_id = ?", (session_id,))

    def query_tuples(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def memory_peaks(self, session_id: str) -> list[dict[str, Any]]:
        return self.query(
            "SELECT rank, collector, device_id, MAX(allocated) AS peak_allocated, MAX(reserved) AS peak_reserved, "
            "MAX(total) AS total FROM telemetry WHERE session_id = ? AND event_type = 'sample' "
            "GROUP BY rank, collector, device_id ORDER BY rank, device_id",
            (session_id,),
        )
