"""Records as they are written (telemetry events, spool spans/marks/snapshots, heartbeat lines)
turned into store rows. The aggregator, the importers and the summary share these, so a row
means the same whichever way it arrived.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from .base import COLUMNS

__all__ = ["check_rows", "heartbeat_row", "mark_row", "snapshot_row", "span_row", "step_row", "telemetry_row",
           "to_rows"]


def telemetry_row(e: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "session_id": e["session_id"], "rank": e.get("rank", 0), "timestamp_ns": e["timestamp_ns"],
        "event_type": e["event_type"], "collector": e["collector"], "device_id": e["device_id"],
        "allocated": e["allocator_allocated_bytes"], "reserved": e["allocator_reserved_bytes"],
        "active": e.get("allocator_active_bytes"), "inactive": e.get("allocator_inactive_bytes"),
        "change": e.get("allocator_change_bytes"), "used": e.get("device_used_bytes"),
        "free": e.get("device_free_bytes"), "total": e.get("device_total_bytes"), "pid": e.get("pid"),
        "host": e.get("host"), "context": e.get("context"), "metadata": e.get("metadata") or {},
    }


def span_row(s: Mapping[str, Any], session_id: str, rank: int | None = None) -> dict[str, Any]:
    return {
        "session_id": session_id, "rank": s.get("rank", 0) if rank is None else rank, "span_id": s["id"],
        "parent_id": s.get("parent_id"), "name": s["name"], "idx": s.get("index"), "start_ns": s["start_ns"],
        "end_ns": s["end_ns"], "gpu_ns": s.get("gpu_ns"), "thread_id": s.get("thread_id"), "pid": s.get("pid"),
        "attrs": s.get("attrs") or {},
    }


def step_row(s: Mapping[str, Any], session_id: str, rank: int | None = None) -> dict[str, Any] | None:
    """The per-step phase row of a ``step`` span (its attrs carry the phase times)."""
    attrs = s.get("attrs") or {}
    if s.get("name") != "step" or "step_ns" not in attrs:
        return None
    return {
        "session_id": session_id, "rank": s.get("rank", 0) if rank is None else rank,
        "step": s.get("index") if s.get("index") is not None else -1,
        "start_ns": s["start_ns"], "end_ns": s["end_ns"], "step_ns": attrs.get("step_ns"),
        "data_load_ns": attrs.get("data_load_ns", 0), "h2d_ns": attrs.get("h2d_ns", 0),
        "forward_ns": attrs.get("forward_ns", 0), "backward_ns": attrs.get("backward_ns", 0),
        "optimizer_ns": attrs.get("optimizer_step_ns", 0), "wait_ns": attrs.get("wait_ns", 0),
    }


def mark_row(m: Mapping[str, Any], session_id: str, rank: int) -> dict[str, Any]:
    value = m.get("value")
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) or isinstance(value, bool)
    return {
        "session_id": session_id, "rank": rank, "mark_id": m["id"], "span_id": m.get("span_id"),
        "name": m["name"], "value_type": m.get("value_type"),
        "value_num": float(value) if numeric and value is not None else None,
        "value_text": value if isinstance(value, str) else m.get("value_nonfinite"),
        "ts_ns": m.get("ts_ns"), "kind": m.get("kind", "point"), "attrs": m.get("attrs") or {},
    }


def snapshot_row(s: Mapping[str, Any], session_id: str, rank: int) -> dict[str, Any]:
    return {
        "session_id": session_id, "rank": rank, "snapshot_id": s["id"], "span_id": s.get("span_id"),
        "tensor_name": s.get("tensor_name"), "mode": s.get("mode"), "ts_ns": s.get("ts_ns"),
        "stats": s.get("stats"), "blob_uri": s.get("blob_uri"),
    }


_HEARTBEAT_CORE = ("ts", "iso", "pid", "rank", "step", "msg")


def heartbeat_row(h: Mapping[str, Any], session_id: str) -> dict[str, Any]:
    return {
        "session_id": session_id, "rank": h.get("rank", 0), "ts_ns": int(float(h["ts"]) * 1e9),
        "step": h.get("step", 0), "msg": h.get("msg"), "pid": h.get("pid"),
        "fields": {k: v for k, v in h.items() if k not in _HEARTBEAT_CORE},
    }


def to_rows(tables: Mapping[str, list[Mapping[str, Any]]], session_id: str, rank: int) -> dict[str, list[dict[str, Any]]]:
    """Wire/artifact tables of one rank into store tables (spans also give step rows)."""
    out: dict[str, list[dict[str, Any]]] = {}
    if tables.get("telemetry"):
        out["telemetry"] = [telemetry_row(e) for e in tables["telemetry"]]
    if tables.get("spans"):
        spans = tables["spans"]
        out["spans"] = [span_row(s, session_id, rank) for s in spans]
        steps = [r for r in (step_row(s, session_id, rank) for s in spans) if r is not None]
        if steps:
            out["steps"] = steps
    if tables.get("marks"):
        out["marks"] = [mark_row(m, session_id, rank) for m in tables["marks"]]
    if tables.get("snapshots"):
        out["snapshots"] = [snapshot_row(s, session_id, rank) for s in tables["snapshots"]]
    if tables.get("heartbeat"):
        out["heartbeats"] = [heartbeat_row(h, session_id) for h in tables["heartbeat"]]
    return out


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_json = msgspec.json.Encoder()
_NUMBER = {type(None), int, float, bool}
_ALLOWED = {"text": _NUMBER | {str}, "int": _NUMBER, "real": _NUMBER}


def check_rows(table: str, rows: list[dict[str, Any]]) -> None:
    """Raises ValueError, naming the column, for a row the store cannot take: an integer over 64
    bits, text in a numeric column, a map or list outside a JSON column, a JSON column that does
    not encode. Checked where rows come in, so one sender's bad row never fails a shared write.
    Column at a time, so the common case costs a few C-level passes."""
    for name, kind in COLUMNS[table]:
        values = [row.get(name) for row in rows]
        if kind == "json":
            try:
                _json.encode(values)
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"{table}.{name}: not encodable as JSON ({exc})") from None
            continue
        kinds = set(map(type, values))
        if not kinds <= _ALLOWED[kind]:
            bad = next(type(v).__name__ for v in values if type(v) not in _ALLOWED[kind])
            raise ValueError(f"{table}.{name}: a {bad} cannot be stored in a {kind} column")
        if int in kinds:
            ints = [v for v in values if type(v) is int]
            if min(ints) < _INT64_MIN or max(ints) > _INT64_MAX:
                raise ValueError(f"{table}.{name}: an integer outside the 64-bit range")
