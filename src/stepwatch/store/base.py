"""What every history backend offers: typed row tables, batched appends, the queries the views
and the summary need, retention. Rows are plain dicts whose keys are the columns below, so the
same rows go to SQLite or ClickHouse unchanged.

The interface knows no backend: ``store/open.py`` picks one from a path or URL, so a backend can
import this module without this module importing it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ..phases import STEP_COLUMNS

__all__ = ["COLUMNS", "TABLES", "HistoryStore"]

# table -> (column, SQL type); `json` columns hold encoded JSON text.
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "sessions": (
        ("session_id", "text"), ("status", "text"), ("started_at_ns", "int"), ("ended_at_ns", "int"),
        ("host", "text"), ("world_size", "int"), ("source", "text"), ("command_line", "json"),
    ),
    "telemetry": (
        ("session_id", "text"), ("rank", "int"), ("timestamp_ns", "int"), ("event_type", "text"),
        ("collector", "text"), ("device_id", "int"), ("allocated", "int"), ("reserved", "int"),
        ("active", "int"), ("inactive", "int"), ("change", "int"), ("used", "int"), ("free", "int"),
        ("total", "int"), ("pid", "int"), ("host", "text"), ("context", "text"), ("metadata", "json"),
    ),
    "spans": (
        ("session_id", "text"), ("rank", "int"), ("span_id", "text"), ("parent_id", "text"), ("name", "text"),
        ("idx", "int"), ("start_ns", "int"), ("end_ns", "int"), ("gpu_ns", "int"), ("thread_id", "int"),
        ("pid", "int"), ("attrs", "json"),
    ),
    "marks": (
        ("session_id", "text"), ("rank", "int"), ("mark_id", "text"), ("span_id", "text"), ("name", "text"),
        ("value_type", "text"), ("value_num", "real"), ("value_text", "text"), ("ts_ns", "int"), ("kind", "text"),
        ("attrs", "json"),
    ),
    "snapshots": (
        ("session_id", "text"), ("rank", "int"), ("snapshot_id", "text"), ("span_id", "text"),
        ("tensor_name", "text"), ("mode", "text"), ("ts_ns", "int"), ("stats", "json"), ("blob_uri", "text"),
    ),
    "heartbeats": (
        ("session_id", "text"), ("rank", "int"), ("ts_ns", "int"), ("step", "int"), ("msg", "text"),
        ("pid", "int"), ("fields", "json"),
    ),
    "steps": (
        ("session_id", "text"), ("rank", "int"), ("step", "int"), ("start_ns", "int"), ("end_ns", "int"),
        ("step_ns", "int"), *((column, "int") for column in STEP_COLUMNS),  # stepwatch.phases
    ),
}
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

    def count(self, table: str, session_id: str | None = None) -> int: ...

    def sessions(self) -> list[dict[str, Any]]: ...

    def step_rows(self, session_id: str) -> list[dict[str, Any]]: ...

    def memory_peaks(self, session_id: str) -> list[dict[str, Any]]: ...

    def apply_retention(self, window_ns: int, now_ns: int | None = None) -> int: ...

    def seen_batches(self, since_ns: int) -> dict[str, int]:
        """HTTP batch ids recorded at or after ``since_ns`` (the dedupe window), with when."""

    def forget_batches(self, before_ns: int) -> int: ...

    def close(self) -> None: ...
