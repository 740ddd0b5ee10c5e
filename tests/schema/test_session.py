"""Session ids, lifecycle and default session selection (telemetry-event-v3.md, "Session identity").

Default selection: newest ``completed``, then newest ``interrupted``, then newest ``incomplete``;
a session still ``running`` is chosen only when there is nothing else.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.schema import (
    SESSION_STATUSES,
    SessionSummary,
    new_session_id,
    select_default_session,
    sort_sessions,
    worst_status,
)

PRIORITY = ("completed", "interrupted", "incomplete", "running")


def summary(name: str, status: str, at: int, **fields: object) -> SessionSummary:
    return SessionSummary(session_id=name, status=status, started_at_ns=at, **fields)  # type: ignore[arg-type]


@dataclass
class Loaded:
    """The shape of a loaded session: anything with a ``summary``."""

    summary: SessionSummary


def test_session_statuses_are_the_four_of_the_spec() -> None:
    assert set(SESSION_STATUSES) == set(PRIORITY)


def test_no_sessions_selects_nothing() -> None:
    assert select_default_session([]) is None
    assert sort_sessions([]) == []


@pytest.mark.parametrize(
    ("present", "chosen"),
    [
        (("completed", "interrupted", "incomplete", "running"), "completed"),
        (("interrupted", "incomplete", "running"), "interrupted"),
        (("incomplete", "running"), "incomplete"),
        (("running",), "running"),
        (("running", "incomplete"), "incomplete"),
    ],
)
def test_status_priority_beats_recency(present: tuple[str, ...], chosen: str) -> None:
    # the preferred status is the oldest session here, so recency alone would pick another
    sessions = [summary(status, status, at=1000 * (i + 1)) for i, status in enumerate(present)]
    assert select_default_session(list(reversed(sessions))).status == chosen  # type: ignore[union-attr]
    assert select_default_session(sessions).status == chosen  # type: ignore[union-attr]


def test_newest_of_the_preferred_status_is_chosen() -> None:
    sessions = [
        summary("old-completed", "completed", at=100, ended_at_ns=200),
        summary("new-completed", "completed", at=300, ended_at_ns=400),
        summary("newest-interrupted", "interrupted", at=500, ended_at_ns=600),
        summary("mid-completed", "completed", at=250, ended_at_ns=260),
    ]
    assert select_default_session(sessions).session_id == "new-completed"  # type: ignore[union-attr]


def test_sort_orders_by_status_then_newest_first() -> None:
    sessions = [
        summary("r1", "running", at=900),
        summary("c1", "completed", at=100, ended_at_ns=150),
        summary("i2", "incomplete", at=700),
        summary("x1", "interrupted", at=300, ended_at_ns=350),
        summary("c2", "completed", at=500, ended_at_ns=550),
        summary("i1", "incomplete", at=200),
        summary("x2", "interrupted", at=800, ended_at_ns=850),
    ]
    order = [s.session_id for s in sort_sessions(sessions)]
    assert order == ["c2", "c1", "x2", "x1", "i2", "i1", "r1"]


def test_loaded_sessions_are_ordered_by_their_summary() -> None:
    loaded = [Loaded(summary("a", "incomplete", at=5)), Loaded(summary("b", "completed", at=1))]
    assert select_default_session(loaded) is loaded[1]
    assert [item.summary.session_id for item in sort_sessions(loaded)] == ["b", "a"]


def test_last_event_time_makes_a_session_newer() -> None:
    """A session whose events run later is newer than one that merely started later."""
    early_start = summary("long", "completed", at=100, ended_at_ns=1000, last_timestamp_ns=990)
    late_start = summary("short", "completed", at=200, ended_at_ns=300, last_timestamp_ns=290)
    assert select_default_session([late_start, early_start]) is early_start


@st.composite
def session_lists(draw: st.DrawFn) -> list[SessionSummary]:
    starts = draw(st.lists(st.integers(min_value=1, max_value=10**18), min_size=1, max_size=12, unique=True))
    sessions = []
    for i, start in enumerate(starts):
        status = draw(st.sampled_from(PRIORITY))
        ended = None if status == "running" else start + draw(st.integers(min_value=0, max_value=10**6))
        sessions.append(summary(f"s{i}", status, at=start, ended_at_ns=ended))
    return sessions


@given(session_lists())
def test_selection_is_newest_of_the_best_status_present(sessions: list[SessionSummary]) -> None:
    best = min(PRIORITY.index(s.status) for s in sessions)
    candidates = [s for s in sessions if PRIORITY.index(s.status) == best]
    expected = max(candidates, key=lambda s: s.started_at_ns)
    # when starts and ends disagree on which is newest the spec is silent; keep to agreeing cases
    if all((a.started_at_ns < b.started_at_ns) == ((a.ended_at_ns or a.started_at_ns) < (b.ended_at_ns or b.started_at_ns))
           for a in candidates for b in candidates if a is not b):
        assert select_default_session(sessions) is expected
    ordered = sort_sessions(sessions)
    assert sorted(map(id, ordered)) == sorted(map(id, sessions))
    assert [PRIORITY.index(s.status) for s in ordered] == sorted(PRIORITY.index(s.status) for s in sessions)
    assert ordered[0] is select_default_session(sessions)


# --------------------------------------------------------------------------------------------
# ids and lifecycle


def test_new_session_id_is_a_uuid4_string() -> None:
    ids = [new_session_id() for _ in range(500)]
    assert len(set(ids)) == len(ids)
    for value in ids:
        assert isinstance(value, str)
        parsed = uuid.UUID(value)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert str(parsed) == value  # canonical lower-case hyphenated form


def test_finished_closes_a_copy_with_the_given_status_and_time() -> None:
    running = summary("s", "running", at=100, host="node", pid=7, job_id="j", rank=1, world_size=2)
    done = running.finished("completed", 12345)
    assert (done.status, done.ended_at_ns) == ("completed", 12345)
    assert (running.status, running.ended_at_ns) == ("running", None)  # the original is untouched
    assert msgspec.structs.replace(done, status="running", ended_at_ns=None) == running


@pytest.mark.parametrize("status", ["completed", "interrupted", "incomplete"])
def test_finished_without_a_time_uses_now(status: str) -> None:
    before = time.time_ns()
    done = summary("s", "running", at=before - 10).finished(status)  # type: ignore[arg-type]
    after = time.time_ns()
    assert done.status == status
    assert done.ended_at_ns is not None and before <= done.ended_at_ns <= after


def test_finished_keeps_an_explicit_zero_time() -> None:
    assert summary("s", "running", at=0).finished("interrupted", 0).ended_at_ns == 0


def test_ledger_entry_holds_the_manifest_fields() -> None:
    entry = summary("s", "completed", at=1, ended_at_ns=2, host="h", pid=3, job_id=None, rank=0,
                    local_rank=0, world_size=1, source="stepwatch", event_count=9).ledger_entry()
    assert entry == {
        "session_id": "s", "status": "completed", "started_at_ns": 1, "ended_at_ns": 2, "host": "h",
        "pid": 3, "job_id": None, "rank": 0, "local_rank": 0, "world_size": 1, "source": "stepwatch",
    }


_ENDS = ("completed", "interrupted", "failed", "incomplete", "running")


@given(st.lists(st.sampled_from(_ENDS), min_size=1), st.sampled_from(_ENDS))
def test_the_worst_status_is_one_given_and_no_better_one_changes_it(statuses: list[str], other: str) -> None:
    worst = worst_status(statuses)
    assert worst in statuses
    assert all(_ENDS.index(status) <= _ENDS.index(worst) for status in statuses)
    if _ENDS.index(other) <= _ENDS.index(worst):
        assert worst_status([*statuses, other]) == worst
    assert worst_status(["completed", *statuses]) == worst


def test_a_status_no_one_knows_is_the_worst() -> None:
    assert worst_status(["running", "from-a-newer-stepwatch", "failed"]) == "from-a-newer-stepwatch"
