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

from .limits import MAX_HOST_BYTES, MAX_ID_CHARS, MAX_NAME_BYTES, MAX_RANK

__all__ = ["I64", "ColumnarMarks", "ColumnarSpans", "ColumnarTelemetry", "WireMark", "WireSpan", "WireTables",
           "WireTelemetry"]

I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
# The bounds of schema/limits.py that msgspec checks in C while it decodes (lengths, ranges):
# a value past them sends the frame to the general path, whose checks name it and refuse it.
# Names and hosts go this way up to a quarter of their byte bound in characters, which no
# encoding can take past it; a longer one takes the general path, which counts its bytes.
# What is left to check on typed rows is the shape of the ids (limits.ids_shape_problem).
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_BYTES // 4)]
Host = Annotated[str, msgspec.Meta(max_length=MAX_HOST_BYTES // 4)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)]


class WireTelemetry(msgspec.Struct, gc=False):
    session_id: Id
    timestamp_ns: I64 | None
    event_type: Name | None
    collector: Name | None
    device_id: I64 | None
    allocator_allocated_bytes: I64 | None
    allocator_reserved_bytes: I64 | None
    rank: Rank | None = 0
    allocator_active_bytes: I64 | None = None
    allocator_inactive_bytes: I64 | None = None
    allocator_change_bytes: I64 | None = None
    device_used_bytes: I64 | None = None
    device_free_bytes: I64 | None = None
    device_total_bytes: I64 | None = None
    pid: I64 | None = None
    host: Host | None = None
    context: str | None = None
    metadata: dict[str, Any] | None = None


class WireSpan(msgspec.Struct, gc=False):
    id: Id | None
    name: Name | None
    start_ns: I64 | None
    end_ns: I64 | None
    parent_id: Id | None = None
    index: I64 | None = None
    gpu_ns: I64 | None = None
    thread_id: I64 | None = None
    pid: I64 | None = None
    rank: Any = 0  # not stored (the frame's rank is); HTTP ingestion reads the first span's
    attrs: dict[str, Any] | None = None


class WireMark(msgspec.Struct, gc=False):
    id: Id | None
    name: Name | None
    span_id: Id | None = None
    value_type: str | None = None
    value: Any = None
    value_nonfinite: str | None = None
    ts_ns: I64 | None = None
    kind: str | None = "point"
    attrs: dict[str, Any] | None = None


_S = str | None
_I = I64 | None
_Id = Id | None
_N = Name | None


class ColumnarTelemetry(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A columnar telemetry table whose rows are already the store's tuples (metadata as text)."""
    columns: tuple[str, ...]
    rows: list[tuple[Id, Rank | None, _I, _N, _N, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, Host | None, _S, str]]


class ColumnarSpans(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    columns: tuple[str, ...]
    rows: list[tuple[_Id, _Id, _N, _I, _I, _I, _I, _I, _I, str]]


class ColumnarMarks(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    columns: tuple[str, ...]
    rows: list[tuple[_Id, _Id, _N, _S, Any, _S, _I, _S, str]]


class WireTables(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    telemetry: list[WireTelemetry] | ColumnarTelemetry = []
    spans: list[WireSpan] | ColumnarSpans = []
    marks: list[WireMark] | ColumnarMarks = []
    snapshots: list[dict[str, Any]] = []
    heartbeat: list[dict[str, Any]] = []
