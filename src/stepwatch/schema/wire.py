"""The typed rows of a frame's tables, as the aggregator decodes them in bulk.

They sit here, below both their users: the wire format (``transport.frames`` decodes frames into
them) and the history (``store.rows`` turns them into its tuples), so the history does not
import the transport to read its own rows. Field names are the wire's; defaults mirror the
``.get`` defaults of ``store.rows``; a field without a default is one ``store.rows`` reads with
``[...]``. Integers are 64-bit (``I64``), as the store's columns.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

__all__ = ["I64", "ColumnarMarks", "ColumnarSpans", "ColumnarTelemetry", "WireMark", "WireSpan", "WireTables",
           "WireTelemetry"]

I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class WireTelemetry(msgspec.Struct, gc=False):
    session_id: str
    timestamp_ns: I64 | None
    event_type: str | None
    collector: str | None
    device_id: I64 | None
    allocator_allocated_bytes: I64 | None
    allocator_reserved_bytes: I64 | None
    rank: I64 | None = 0
    allocator_active_bytes: I64 | None = None
    allocator_inactive_bytes: I64 | None = None
    allocator_change_bytes: I64 | None = None
    device_used_bytes: I64 | None = None
    device_free_bytes: I64 | None = None
    device_total_bytes: I64 | None = None
    pid: I64 | None = None
    host: str | None = None
    context: str | None = None
    metadata: Any = None


class WireSpan(msgspec.Struct, gc=False):
    id: str | None
    name: str | None
    start_ns: I64 | None
    end_ns: I64 | None
    parent_id: str | None = None
    index: I64 | None = None
    gpu_ns: I64 | None = None
    thread_id: I64 | None = None
    pid: I64 | None = None
    rank: Any = 0  # not stored (the frame's rank is); HTTP ingestion reads the first span's
    attrs: dict[str, Any] | None = None


class WireMark(msgspec.Struct, gc=False):
    id: str | None
    name: str | None
    span_id: str | None = None
    value_type: str | None = None
    value: Any = None
    value_nonfinite: str | None = None
    ts_ns: I64 | None = None
    kind: str | None = "point"
    attrs: Any = None


_S = str | None
_I = I64 | None


class ColumnarTelemetry(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A columnar telemetry table whose rows are already the store's tuples (metadata as text)."""
    columns: tuple[str, ...]
    rows: list[tuple[str, _I, _I, _S, _S, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _S, _S, str]]


class ColumnarSpans(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    columns: tuple[str, ...]
    rows: list[tuple[_S, _S, _S, _I, _I, _I, _I, _I, _I, str]]


class ColumnarMarks(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    columns: tuple[str, ...]
    rows: list[tuple[_S, _S, _S, _S, Any, _S, _I, _S, str]]


class WireTables(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    telemetry: list[WireTelemetry] | ColumnarTelemetry = []
    spans: list[WireSpan] | ColumnarSpans = []
    marks: list[WireMark] | ColumnarMarks = []
    snapshots: list[dict[str, Any]] = []
    heartbeat: list[dict[str, Any]] = []
