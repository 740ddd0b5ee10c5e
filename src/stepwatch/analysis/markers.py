"""Timeline markers: a derived view that puts landmarks of a capture on one timeline.

Not a new record type (spec: "Timeline markers"): lifecycle, collector-health, alert and OOM
point markers are promoted from existing events; phases become interval markers by replaying
``phase_enter``/``phase_exit`` pairs through ``PhaseReplayIndex``. How a rank ended (an uncaught
exception, a signal: the ``error`` events whose metadata holds a ``failure``) becomes a
``failure`` marker; what only the launcher saw (a rank killed without a word) comes from
run.json through ``derive_outcome_markers`` (docs/run-outcome.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from ..schema import TelemetryEventV3
from .phase_replay import PhaseReplayIndex

__all__ = [
    "TimelineMarker",
    "derive_alert_markers",
    "derive_outcome_markers",
    "derive_session_timeline_markers",
    "derive_timeline_markers",
    "derive_verdict_markers",
    "failure_label",
    "timeline_marker_to_dict",
]

MarkerKind = Literal["lifecycle", "collector", "alert", "oom", "phase", "failure", "verdict"]
Severity = Literal["info", "warning", "critical"]

# event_type -> (kind, severity) for promoted point markers
_PROMOTED: dict[str, tuple[MarkerKind, Severity]] = {
    "start": ("lifecycle", "info"),
    "stop": ("lifecycle", "info"),
    "collector_degraded": ("collector", "warning"),
    "collector_recovered": ("collector", "info"),
    "warning": ("alert", "warning"),
    "critical": ("alert", "critical"),
    "error": ("alert", "critical"),
}


class TimelineMarker(msgspec.Struct, kw_only=True, frozen=True):
    session_id: str
    start_ns: int
    end_ns: int | None
    kind: MarkerKind
    source: Literal["telemetry_event", "phase_replay", "annotation", "run_manifest", "watchdog", "history"]
    severity: Severity
    label: str
    rank: int
    local_rank: int
    world_size: int
    event_type: str
    metadata: dict[str, Any]


def _is_oom(event: TelemetryEventV3) -> bool:
    # OOM metadata is there (Stormlog: the key is present, whatever its value); a boolean flag
    # set to false ("oom": false) says the opposite, so for flags only a truthy value counts
    if event.event_type != "error":
        return False
    metadata = event.metadata
    return "oom_reason" in metadata or "oom_dump_path" in metadata or any(
        metadata.get(key) for key in ("oom", "is_oom"))


def derive_timeline_markers(events: Iterable[TelemetryEventV3]) -> list[TimelineMarker]:
    """Point markers for promoted events plus interval markers for replayed phases, by time."""
    events = list(events)
    markers: list[TimelineMarker] = []
    for e in events:
        promoted = _PROMOTED.get(e.event_type)
        if promoted is None:
            continue
        kind, severity = ("oom", "critical") if _is_oom(e) else promoted
        failure = e.metadata.get("failure") if e.event_type == "error" else None
        if isinstance(failure, dict) and kind != "oom":
            kind = "failure"
        label = e.event_type.replace("_", " ")
        if kind == "failure":
            label = failure_label(failure)  # type: ignore[arg-type]
        elif kind == "oom":
            label = f"OOM: {str(e.metadata.get('oom_reason', e.context or ''))[:120]}"
        elif e.context:
            label = f"{label}: {e.context[:120]}"
        markers.append(
            TimelineMarker(
                session_id=e.session_id, start_ns=e.timestamp_ns, end_ns=None, kind=kind,
                source="telemetry_event", severity=severity, label=label, rank=e.rank,
                local_rank=e.local_rank, world_size=e.world_size, event_type=e.event_type,
                metadata=dict(e.metadata),
            )
        )
    for interval in PhaseReplayIndex(events).intervals:
        markers.append(
            TimelineMarker(
                session_id=interval.session_id, start_ns=interval.start_ns, end_ns=interval.end_ns,
                kind="phase", source="phase_replay", severity="info", label=interval.label,
                rank=interval.rank, local_rank=interval.local_rank, world_size=interval.world_size,
                event_type="phase_enter",
                metadata={
                    "scope_id": interval.scope_id, "parent_scope_id": interval.parent_scope_id,
                    "path": list(interval.path), "depth": len(interval.path),
                    "thread_id": interval.thread_id, "thread_name": interval.thread_name,
                    "attributes": interval.attributes or {}, "closed": interval.closed,
                },
            )
        )
    markers.sort(key=lambda m: (m.start_ns, m.end_ns is not None))
    return markers


def failure_label(error: dict[str, Any]) -> str:
    """One line for an ``error`` object of run.json (docs/run-outcome.md)."""
    who = "training process" if not isinstance(error.get("rank"), int) else f"rank {error['rank']}"
    if error.get("kind") == "signal":
        return f"{who} ended by {error.get('signal') or 'an uncatchable signal or a crash'}"
    first = str(error.get("message") or "").splitlines()
    return f"{who} raised {error.get('type')}: {first[0][:120] if first else ''}"


def derive_outcome_markers(run: dict[str, Any]) -> list[TimelineMarker]:
    """``failure`` markers for what run.json's ``errors`` hold beyond the ranks' own records: a
    rank killed without a word, a signal only the launcher saw (the ranks' own exceptions and
    signals are ``error`` events in their telemetry, and ``derive_timeline_markers`` has them)."""
    markers = []
    session_id = str(run.get("session_id") or "")
    world_size = run.get("world_size") if isinstance(run.get("world_size"), int) else 1
    for error in run.get("errors") or []:
        if not isinstance(error, dict) or not isinstance(error.get("at_ns"), int):
            continue
        if error.get("seen_by", "rank") == "rank":  # in the rank's telemetry already
            continue
        rank = error["rank"] if isinstance(error.get("rank"), int) else -1
        markers.append(TimelineMarker(
            session_id=session_id, start_ns=error["at_ns"], end_ns=None, kind="failure", source="run_manifest",
            severity="critical", label=failure_label(error), rank=rank, local_rank=rank, world_size=world_size,
            event_type="error", metadata={"failure": dict(error)},
        ))
    markers.sort(key=lambda m: m.start_ns)
    return markers


_SEVERITY: dict[str, Severity] = {"crit": "critical", "warn": "warning", "info": "info"}


def derive_alert_markers(alerts: Iterable[dict[str, Any]], *, session_id: str = "",
                         world_size: int = 1) -> list[TimelineMarker]:
    """A point marker (kind ``alert``, source ``watchdog``) per watchdog alert, as alerts.jsonl
    or final_summary.json's ``alerts`` hold them (docs/watchdog.md), on the culprit's rank (the
    first one named; -1 for none)."""
    markers = []
    for alert in alerts:
        ts = alert.get("ts")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            continue
        ranks = [r for r in alert.get("ranks") or [] if isinstance(r, int)]
        rank = ranks[0] if ranks else -1
        markers.append(TimelineMarker(
            session_id=str(alert.get("session_id") or session_id), start_ns=int(ts * 1e9), end_ns=None,
            kind="alert", source="watchdog", severity=_SEVERITY.get(str(alert.get("severity")), "warning"),
            label=f"{alert.get('kind')}: {str(alert.get('message') or '')[:120]}", rank=rank, local_rank=rank,
            world_size=world_size, event_type="alert",
            metadata={"kind": alert.get("kind"), "ranks": ranks, "step": alert.get("step"),
                      "evidence": alert.get("evidence") if isinstance(alert.get("evidence"), dict) else {}},
        ))
    markers.sort(key=lambda m: m.start_ns)
    return markers


def derive_verdict_markers(rows: Iterable[dict[str, Any]], world_size: int = 1) -> list[TimelineMarker]:
    """A ``verdict`` point marker for each change of the live primary verdict (rows of the
    history's ``verdicts`` table, as the aggregator stored them), on its first culprit rank
    (-1: the verdict names no rank); the row's fields are the marker's metadata."""
    import json

    markers = []
    for row in rows:
        if not isinstance(row.get("ts_ns"), int):
            continue
        ranks = row.get("ranks")
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except ValueError:
                ranks = []
        ranks = [r for r in ranks if isinstance(r, int)] if isinstance(ranks, list) else []
        rank = ranks[0] if ranks else -1
        metadata = {k: v for k, v in row.items() if k not in ("session_id", "ts_ns")}
        metadata["ranks"] = ranks
        markers.append(TimelineMarker(
            session_id=str(row.get("session_id") or ""), start_ns=row["ts_ns"], end_ns=None, kind="verdict",
            source="history", severity=_SEVERITY.get(str(row.get("severity")), "info"),
            label=f"verdict {row.get('name')}: {str(row.get('message') or '')[:120]}", rank=rank, local_rank=rank,
            world_size=world_size, event_type="verdict", metadata=metadata,
        ))
    markers.sort(key=lambda m: m.start_ns)
    return markers


def derive_session_timeline_markers(session: Any) -> list[TimelineMarker]:
    """Markers of one loaded session (``LoadedTelemetrySession``)."""
    return derive_timeline_markers(session.events)


def timeline_marker_to_dict(marker: TimelineMarker) -> dict[str, Any]:
    return msgspec.to_builtins(marker)
