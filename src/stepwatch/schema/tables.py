"""The history's tables, each declared once: its columns in order, each with its SQL type, the
record field it is read from, how it is read, and whether it is NULL in many rows.

Everything else is derived from ``TABLES``: the store's ``COLUMNS`` (and with them the SQLite
schema, views, inserts and row tuples), the columns bound as NaN (``store.sqlite``), the row
builders of the tables whose columns are copied from a record (``store.rows``: telemetry, spans,
snapshots), the typed wire path's telemetry tuple, and the columnar wire tables' fields
(``transport.frames.COLUMNAR``: the fields a rank sends, in the store's order). Columns computed
from several fields (a mark's value, a heartbeat's time, a step's phase times) have no
``field``; their row builders are written out beside the others in ``store.rows``, and
``tests/structure/test_tables.py`` checks that every builder gives exactly these columns.

This module sits below transport and store, which both read it, and imports only the phase table.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..phases import STEP_COLUMNS

__all__ = ["EMPTY", "Column", "TABLES", "column_types", "fields", "record_reader"]

_SQL_TYPES = frozenset({"text", "int", "real", "json"})  # json: encoded JSON text
EMPTY = "{}"  # the default of a JSON column whose absent or empty value is stored as the empty object


class Column(NamedTuple):
    name: str
    type: str  # text, int, real or json
    field: str | None = None  # the record field it copies (None: the caller or a rule fills it)
    required: bool = False  # read as ``record[field]`` (a missing field refuses the record)
    default: Any = None  # else ``record.get(field, default)``; ``EMPTY``: a falsy value is stored as {}
    often_null: bool = False  # NULL in many rows: bound as NaN, which SQLite stores as NULL


def _c(name: str, type_: str, field: str | None = None, **kw: Any) -> Column:
    return Column(name, type_, field, **kw)


_SESSION = (_c("session_id", "text"), _c("rank", "int"))  # from the frame or the caller

TABLES: dict[str, tuple[Column, ...]] = {
    "sessions": (
        _c("session_id", "text"), _c("status", "text"), _c("started_at_ns", "int"), _c("ended_at_ns", "int"),
        _c("host", "text"), _c("world_size", "int"), _c("source", "text"), _c("command_line", "json"),
    ),
    "telemetry": (  # a TelemetryEventV3 (or its wire row), field for field
        _c("session_id", "text", "session_id", required=True), _c("rank", "int", "rank", default=0),
        _c("timestamp_ns", "int", "timestamp_ns", required=True),
        _c("event_type", "text", "event_type", required=True), _c("collector", "text", "collector", required=True),
        _c("device_id", "int", "device_id", required=True),
        _c("allocated", "int", "allocator_allocated_bytes", required=True),
        _c("reserved", "int", "allocator_reserved_bytes", required=True),
        _c("active", "int", "allocator_active_bytes", often_null=True),
        _c("inactive", "int", "allocator_inactive_bytes", often_null=True),
        _c("change", "int", "allocator_change_bytes"), _c("used", "int", "device_used_bytes"),
        _c("free", "int", "device_free_bytes", often_null=True),
        _c("total", "int", "device_total_bytes", often_null=True),
        _c("pid", "int", "pid"), _c("host", "text", "host"), _c("context", "text", "context", often_null=True),
        _c("metadata", "json", "metadata", default=EMPTY),
    ),
    "spans": (  # a spool span (spool-format-v1.md)
        *_SESSION, _c("span_id", "text", "id", required=True),
        _c("parent_id", "text", "parent_id", often_null=True), _c("name", "text", "name", required=True),
        _c("idx", "int", "index", often_null=True), _c("start_ns", "int", "start_ns", required=True),
        _c("end_ns", "int", "end_ns", required=True), _c("gpu_ns", "int", "gpu_ns", often_null=True),
        _c("thread_id", "int", "thread_id"), _c("pid", "int", "pid"), _c("attrs", "json", "attrs", default=EMPTY),
    ),
    "marks": (  # a spool mark; value_num and value_text come from its value (store.rows.mark_row)
        *_SESSION, _c("mark_id", "text"), _c("span_id", "text", often_null=True), _c("name", "text"),
        _c("value_type", "text"), _c("value_num", "real", often_null=True),
        _c("value_text", "text", often_null=True), _c("ts_ns", "int"), _c("kind", "text"), _c("attrs", "json"),
    ),
    "snapshots": (  # a spool snapshot
        *_SESSION, _c("snapshot_id", "text", "id", required=True),
        _c("span_id", "text", "span_id", often_null=True), _c("tensor_name", "text", "tensor_name"),
        _c("mode", "text", "mode"), _c("ts_ns", "int", "ts_ns"), _c("stats", "json", "stats"),
        _c("blob_uri", "text", "blob_uri", often_null=True),
    ),
    "heartbeats": (  # a heartbeat-jsonl.md record; ts_ns from ts, fields the rest (store.rows)
        *_SESSION, _c("ts_ns", "int"), _c("step", "int", often_null=True), _c("msg", "text", often_null=True),
        _c("pid", "int"), _c("fields", "json"),
    ),
    "steps": (  # one step's phase times (stepwatch.phases), from its span's attrs or its children
        *_SESSION, _c("step", "int"), _c("start_ns", "int"), _c("end_ns", "int"), _c("step_ns", "int"),
        *(_c(column, "int") for column in STEP_COLUMNS),
    ),
    "verdicts": (  # a change of the live primary verdict (analysis.verdicts), as the aggregator decided it
        _c("session_id", "text"), _c("ts_ns", "int"), _c("step", "int", often_null=True),
        _c("window_steps", "int"), _c("name", "text"), _c("severity", "text"), _c("score", "real", often_null=True),
        _c("ranks", "json"), _c("message", "text"), _c("next_step", "text", often_null=True), _c("evidence", "json"),
    ),
    "alerts": (  # a watchdog alert (alerts.jsonl, one row per line)
        _c("session_id", "text"), _c("ts_ns", "int"), _c("kind", "text"), _c("severity", "text"),
        _c("ranks", "json"), _c("step", "int", often_null=True), _c("message", "text"), _c("evidence", "json"),
    ),
}

for _table, _columns in TABLES.items():  # at import: a table that cannot be read one way
    if len({c.name for c in _columns}) != len(_columns) or not all(c.type in _SQL_TYPES for c in _columns):
        raise ValueError(f"history table {_table!r}: a repeated column or an unknown type")


def column_types(table: str) -> tuple[tuple[str, str], ...]:
    """(column, type) in order: the store's ``COLUMNS[table]``."""
    return tuple((c.name, c.type) for c in TABLES[table])


def fields(table: str, *, skip_session: bool = False) -> tuple[str, ...]:
    """The record fields the table's copied columns read, in column order."""
    columns = TABLES[table][2:] if skip_session else TABLES[table]
    return tuple(c.field for c in columns if c.field is not None)


def record_reader(table: str, *, skip_session: bool = False) -> Any:
    """``read(record) -> {column: value}`` for the columns copied from a record, written out from
    the declaration once as the dict display a hand-written builder would be, so that a row
    costs what it did when each builder spelled its columns; ``skip_session`` leaves out
    ``session_id`` and ``rank``, which the caller gives."""
    items = []
    for c in TABLES[table][2:] if skip_session else TABLES[table]:
        if c.field is None:
            continue
        if c.required:
            read = f"e[{c.field!r}]"
        elif c.default == EMPTY:
            read = f"(e.get({c.field!r}) or {{}})"
        elif c.default is not None:
            read = f"e.get({c.field!r}, {c.default!r})"
        else:
            read = f"e.get({c.field!r})"
        items.append(f"{c.name!r}: {read}")
    source = f"def read(e):\n    return {{{', '.join(items)}}}\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<stepwatch.schema.tables {table}>", "exec"), namespace)
    return namespace["read"]
