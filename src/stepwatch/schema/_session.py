"""Capture sessions: one UUID per capture, shared by all ranks of a run.

The ledger fields (``session_id`` .. ``source``) are what a sink manifest records; the
counts (``event_count``, first/last timestamp, ``ranks``) are filled by the loaders.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any, Literal, TypeVar

import msgspec

__all__ = [
    "SESSION_STATUSES",
    "SessionStatus",
    "SessionSummary",
    "new_session_id",
    "select_default_session",
    "sort_sessions",
    "worst_status",
]

SessionStatus = Literal["running", "completed", "interrupted", "incomplete"]
SESSION_STATUSES: tuple[str, ...] = ("running", "completed", "interrupted", "incomplete")
# Default selection (telemetry-event-v3.md): newest completed, then interrupted, then incomplete;
# a session still running is shown but chosen last.
_SELECTION_RANK = {"completed": 0, "interrupted": 1, "incomplete": 2, "running": 3}
# How badly a session ended, best first: a session is as bad as its worst rank (the aggregator folds
# its ranks' stop events, the launcher its ranks' ledgers and the status other nodes stored).
# ``failed``: a rank's stop event when its training raised (docs/run-outcome.md); ``running``: a
# rank whose end is not known. Any other text counts as the worst.
_SEVERITY = {status: i for i, status in enumerate(("completed", "interrupted", "failed", "incomplete", "running"))}
_LEDGER_FIELDS = (
    "session_id", "status", "started_at_ns", "ended_at_ns", "host", "pid",
    "job_id", "rank", "local_rank", "world_size", "source",
)


def new_session_id() -> str:
    """An opaque session id (UUID4 string)."""
    return str(uuid.uuid4())


class SessionSummary(msgspec.Struct, kw_only=True):
    """Identity, lifecycle and size of one capture session.

    Example::

        summary = SessionSummary(session_id=new_session_id(), status="running",
                                 started_at_ns=time.time_ns(), host="node1", pid=os.getpid())
    """

    session_id: str
    status: SessionStatus
    started_at_ns: int
    ended_at_ns: int | None = None
    host: str = "unknown"
    pid: int = -1
    job_id: str | None = None
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    source: str = "stepwatch"
    event_count: int = 0
    first_timestamp_ns: int | None = None
    last_timestamp_ns: int | None = None
    ranks: tuple[int, ...] = ()

    def ledger_entry(self) -> dict[str, Any]:
        """The fields a sink manifest's session ledger holds."""
        return {name: getattr(self, name) for name in _LEDGER_FIELDS}

    def finished(self, status: SessionStatus, ended_at_ns: int | None = None) -> SessionSummary:
        """A copy closed with ``status`` at ``ended_at_ns`` (now when not given)."""
        return msgspec.structs.replace(
            self, status=status, ended_at_ns=ended_at_ns if ended_at_ns is not None else time.time_ns()
        )


_S = TypeVar("_S")


def _summary_of(item: Any) -> SessionSummary:
    return item if isinstance(item, SessionSummary) else item.summary


def sort_sessions(items: Iterable[_S]) -> list[_S]:
    """Orders sessions (or loaded sessions) by default-selection priority, newest first."""

    def key(item: _S) -> tuple[int, int]:
        summary = _summary_of(item)
        newest = summary.last_timestamp_ns or summary.ended_at_ns or summary.started_at_ns or 0
        return (_SELECTION_RANK.get(summary.status, 9), -newest)

    return sorted(items, key=key)


def worst_status(statuses: Iterable[str]) -> str:
    """The worst of ``statuses`` (at least one)."""
    return max(statuses, key=lambda status: _SEVERITY.get(status, len(_SEVERITY)))


def select_default_session(items: Iterable[_S]) -> _S | None:
    """Newest completed, then newest interrupted, then newest incomplete (then running)."""
    ordered = sort_sessions(items)
    return ordered[0] if ordered else None
