"""Replays ``phase_scope`` boundaries into intervals, and attributes samples and alerts to them.

Attribution (spec: "Analyzer phase attribution payloads"):
  * ``exact``        the event is itself a phase boundary: its own scope;
  * ``thread_local`` the event names its thread (``metadata.thread_id``): the innermost scope
                     open on that thread at that instant;
  * ``heuristic``    a background sample: the innermost scopes open on any thread of the
                     same rank and process at that instant — unique if one, else ambiguous.
``phase_summary`` is added only when an ambiguous attribution still has a distinct winner.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

import msgspec

from ..schema import TelemetryEventV3

__all__ = ["PhaseAttribution", "PhaseInterval", "PhaseReplayIndex", "PhaseSummary"]


class PhaseInterval(msgspec.Struct, kw_only=True):
    session_id: str
    scope_id: str
    parent_scope_id: str | None
    path: tuple[str, ...]
    start_ns: int
    end_ns: int
    closed: bool
    rank: int
    local_rank: int
    world_size: int
    pid: int
    thread_id: int
    thread_name: str
    attributes: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        return " / ".join(self.path)


class PhaseSummary(msgspec.Struct, kw_only=True):
    """The display winner of an ambiguous attribution (Stormlog's shape: path and source)."""

    phase_path: str
    source: str  # "heuristic": shown as "(likely) <path>"

    @property
    def label(self) -> str:
        return f"(likely) {self.phase_path}" if self.source == "heuristic" else self.phase_path


class PhaseAttribution(msgspec.Struct, kw_only=True, omit_defaults=True):
    phase_resolution: str  # "unique" | "ambiguous"
    phase_source: str  # "exact" | "thread_local" | "heuristic"
    phase_paths: list[str]
    phase_path: str | None = None
    scope_id: str | None = None
    thread_id: int | None = None
    thread_name: str | None = None
    phase_summary: PhaseSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class PhaseReplayIndex:
    """Intervals of every phase scope in ``events``; unclosed scopes end at the last event."""

    def __init__(self, events: Iterable[TelemetryEventV3]) -> None:
        open_scopes: dict[str, tuple[TelemetryEventV3, dict[str, Any]]] = {}
        intervals: list[PhaseInterval] = []
        last_ns = 0
        for e in events:
            last_ns = max(last_ns, e.timestamp_ns)
            scope = e.metadata.get("phase_scope") if e.event_type in ("phase_enter", "phase_exit") else None
            if not isinstance(scope, dict) or "scope_id" not in scope:
                continue
            key = f"{e.session_id}|{e.rank}|{e.pid}|{scope['scope_id']}"
            if e.event_type == "phase_enter":
                open_scopes[key] = (e, scope)
            elif key in open_scopes:
                start, start_scope = open_scopes.pop(key)
                intervals.append(self._interval(start, start_scope, e.timestamp_ns, True))
        for start, scope in open_scopes.values():
            intervals.append(self._interval(start, scope, last_ns, False))
        intervals.sort(key=lambda i: (i.start_ns, len(i.path)))
        self.intervals = intervals
        self._starts = [i.start_ns for i in intervals]

    @staticmethod
    def _interval(e: TelemetryEventV3, scope: dict[str, Any], end_ns: int, closed: bool) -> PhaseInterval:
        path = scope.get("path") or [scope.get("name", "?")]
        return PhaseInterval(
            session_id=e.session_id, scope_id=str(scope["scope_id"]), parent_scope_id=scope.get("parent_scope_id"),
            path=tuple(str(p) for p in path), start_ns=e.timestamp_ns, end_ns=end_ns, closed=closed,
            rank=e.rank, local_rank=e.local_rank, world_size=e.world_size, pid=e.pid,
            thread_id=int(scope.get("thread_id", 0)), thread_name=str(scope.get("thread_name", "")),
            attributes=scope.get("attributes"),
        )

    def active_at(self, timestamp_ns: int, *, rank: int | None = None, pid: int | None = None,
                  thread_id: int | None = None) -> list[PhaseInterval]:
        """Scopes open at ``timestamp_ns`` (boundaries inclusive), filtered as asked."""
        upto = bisect.bisect_right(self._starts, timestamp_ns)
        return [
            i for i in self.intervals[:upto]
            if i.end_ns >= timestamp_ns
            and (rank is None or i.rank == rank)
            and (pid is None or i.pid == pid)
            and (thread_id is None or i.thread_id == thread_id)
        ]

    def attribute(self, event: TelemetryEventV3) -> PhaseAttribution | None:
        """The phase ``event`` belongs to, or None when no scope was open."""
        scope = event.metadata.get("phase_scope")
        if isinstance(scope, dict) and "scope_id" in scope:
            path = " / ".join(scope.get("path") or [scope.get("name", "?")])
            return PhaseAttribution(
                phase_resolution="unique", phase_source="exact", phase_path=path, phase_paths=[path],
                scope_id=str(scope["scope_id"]), thread_id=scope.get("thread_id"), thread_name=scope.get("thread_name"),
            )
        thread_id = event.metadata.get("thread_id")
        if isinstance(thread_id, int):
            active = self.active_at(event.timestamp_ns, rank=event.rank, pid=event.pid, thread_id=thread_id)
            source = "thread_local"
        else:
            active = self.active_at(event.timestamp_ns, rank=event.rank, pid=event.pid)
            source = "heuristic"
        innermost = _innermost(active)
        if not innermost:
            return None
        if len(innermost) == 1:
            i = innermost[0]
            return PhaseAttribution(
                phase_resolution="unique", phase_source=source, phase_path=i.label, phase_paths=[i.label],
                scope_id=i.scope_id, thread_id=i.thread_id, thread_name=i.thread_name,
            )
        labels = sorted({i.label for i in innermost})
        attribution = PhaseAttribution(phase_resolution="ambiguous", phase_source=source, phase_paths=labels)
        if len(labels) > 1:
            # deepest scope wins, then the most recently entered: one useful display label
            winner = max(innermost, key=lambda i: (len(i.path), i.start_ns))
            attribution.phase_summary = PhaseSummary(phase_path=winner.label, source="heuristic")
        return attribution


def _innermost(active: list[PhaseInterval]) -> list[PhaseInterval]:
    """Drops every scope that is the parent of another active scope."""
    parents = {i.parent_scope_id for i in active if i.parent_scope_id}
    return [i for i in active if i.scope_id not in parents]
