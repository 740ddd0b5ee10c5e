"""The history store's rows as the tests write them: one builder per table, each row's times
and ids given, the rest fixed; and the batch the retention tests of every store share."""

from __future__ import annotations

from typing import Any

S1, S2 = "session-one", "session-two"


def telemetry(session: str, rank: int, t: int, allocated: int = 100, **extra: Any) -> dict[str, Any]:
    return {"session_id": session, "rank": rank, "timestamp_ns": t, "event_type": "sample", "collector": "c",
            "device_id": 0, "allocated": allocated, "reserved": allocated * 2, "total": 10_000,
            "metadata": {"t": t}, **extra}


def span(session: str, rank: int, span_id: str, start: int, name: str = "forward") -> dict[str, Any]:
    return {"session_id": session, "rank": rank, "span_id": span_id, "parent_id": None, "name": name, "idx": None,
            "start_ns": start, "end_ns": start + 10, "attrs": {"k": [1, 2]}}


def mark(session: str, rank: int, mark_id: str, ts: int, value: float = 0.5) -> dict[str, Any]:
    return {"session_id": session, "rank": rank, "mark_id": mark_id, "span_id": "root", "name": "loss",
            "value_type": "float", "value_num": value, "ts_ns": ts, "kind": "point", "attrs": {}}


def heartbeat(session: str, rank: int, ts: int, step: int = 0) -> dict[str, Any]:
    return {"session_id": session, "rank": rank, "ts_ns": ts, "step": step, "msg": "progress", "pid": 1,
            "fields": {"loss": 1.0}}


def step(session: str, rank: int, n: int, start: int, step_ns: int = 1000) -> dict[str, Any]:
    return {"session_id": session, "rank": rank, "step": n, "start_ns": start, "end_ns": start + step_ns,
            "step_ns": step_ns, "data_load_ns": 1, "h2d_ns": 0, "forward_ns": 2, "backward_ns": 3,
            "optimizer_ns": 4, "wait_ns": 5}


def session(session_id: str, start: int | None, **fields: Any) -> dict[str, Any]:
    return {"session_id": session_id, "status": "running", "started_at_ns": start, "ended_at_ns": None,
            "host": None, "world_size": None, "source": "test", "command_line": None, **fields}


def retention_batch(times: dict[tuple[str, int], list[int]]) -> dict[str, list[dict[str, Any]]]:
    """A row of every timed table at each of ``times[(session, rank)]``, the i-th with ids and
    step ``i``: what retention keeps or drops per session and rank."""
    batch: dict[str, list[dict[str, Any]]] = {"telemetry": [], "heartbeats": [], "marks": [], "spans": [], "steps": []}
    for (sid, rank), ts in times.items():
        for i, t in enumerate(ts):
            batch["telemetry"].append(telemetry(sid, rank, t))
            batch["heartbeats"].append(heartbeat(sid, rank, t, i))
            batch["marks"].append(mark(sid, rank, f"m{i}", t))
            batch["spans"].append(span(sid, rank, f"s{i}", t))
            batch["steps"].append(step(sid, rank, i, t))
    return batch
