"""Each history table is declared once (``stepwatch.schema.tables``): the store's columns, the
columns bound as NaN, the row builders, the typed wire path and the columnar wire fields all
follow from it, and a row means the same whichever way it reaches the store."""

from __future__ import annotations

import ast
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.schema.tables import TABLES, column_types, fields
from stepwatch.schema.wire import ColumnarSpans, ColumnarTelemetry, WireSpan, WireTables, WireTelemetry
from stepwatch.store import rows as store_rows
from stepwatch.store import sqlite as store_sqlite
from stepwatch.store.base import COLUMNS
from stepwatch.transport.frames import COLUMNAR
from tests.support.records import make_record

from ._source import modules

S = "00000000-0000-4000-8000-000000000001"


def _names(table: str) -> list[str]:
    return [c.name for c in TABLES[table]]


def test_the_store_and_the_wire_take_their_columns_from_the_declaration() -> None:
    assert {table: column_types(table) for table in TABLES} == COLUMNS
    assert store_sqlite._OFTEN_NULL_COLUMNS["telemetry"] == ("active", "inactive", "free", "total", "context")
    assert COLUMNAR["telemetry"] == fields("telemetry")
    assert COLUMNAR["spans"] == fields("spans", skip_session=True)
    assert set(fields("telemetry")) <= set(WireTelemetry.__struct_fields__)
    assert set(fields("spans", skip_session=True)) <= set(WireSpan.__struct_fields__)
    columnar = {"telemetry": ColumnarTelemetry, "spans": ColumnarSpans}
    for table, struct in columnar.items():
        row_type = struct.__annotations__["rows"]
        assert str(row_type).count(",") + 1 == len(COLUMNAR[table]), table


def test_every_row_builder_gives_exactly_its_tables_columns() -> None:
    span = {"id": "a" * 32, "name": "step", "start_ns": 1, "end_ns": 5, "attrs": {"step_ns": 4}}
    built = {
        "telemetry": store_rows.telemetry_row(make_record()),
        "spans": store_rows.span_row(span, S, 0),
        "marks": store_rows.mark_row({"id": "m", "name": "loss", "value": 0.5}, S, 0),
        "snapshots": store_rows.snapshot_row({"id": "s"}, S, 0),
        "heartbeats": store_rows.heartbeat_row({"ts": 1.5, "msg": "boot"}, S),
        "steps": store_rows.step_row(span, S, 0),
    }
    assert {table: list(row or {}) for table, row in built.items()} == {table: _names(table) for table in built}


def test_no_module_spells_the_telemetry_columns_again() -> None:
    """A list of the history's telemetry column names outside the declaration is a second one."""
    names = {"allocated", "reserved", "active", "inactive", "change", "used", "free", "total"}
    spelled = []
    for name, (path, tree) in modules().items():
        if name == "stepwatch.schema.tables":
            continue
        for node in ast.walk(tree):
            items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else \
                node.keys if isinstance(node, ast.Dict) else []
            found = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
            if len(found) >= 4:
                spelled.append(f"{path.name}:{node.lineno}")
    assert spelled == []


_i64 = st.integers(-(1 << 63), (1 << 63) - 1)
_opt = st.none() | _i64
_text = st.text(max_size=8)


@given(st.fixed_dictionaries({
    "session_id": st.just(S), "rank": st.integers(0, 1000), "timestamp_ns": _i64,
    "event_type": _text, "collector": _text, "device_id": _i64,
    "allocator_allocated_bytes": _i64, "allocator_reserved_bytes": _i64, "allocator_active_bytes": _opt,
    "allocator_inactive_bytes": _opt, "allocator_change_bytes": _opt, "device_used_bytes": _opt,
    "device_free_bytes": _opt, "device_total_bytes": _opt, "pid": _opt, "host": st.none() | _text,
    "context": st.none() | _text, "metadata": st.dictionaries(_text, st.integers(), max_size=3),
}))
def test_a_telemetry_row_is_the_same_from_a_map_and_from_the_typed_wire(record: dict[str, Any]) -> None:
    """The general path (``telemetry_row`` + ``row_tuples``) and the typed fast path
    (``wire_tuples`` over ``WireTelemetry``) store the same tuple."""
    general = store_rows.row_tuples("telemetry", [store_rows.telemetry_row(record)])
    wire = msgspec.convert({"telemetry": [record]}, WireTables)
    fast = store_rows.wire_tuples(S, record["rank"], wire)["telemetry"]
    assert general == fast
