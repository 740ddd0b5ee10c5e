"""Timeline markers and phase attribution (spec: "Timeline markers", "Analyzer phase attribution
payloads"): hand-built event lists, a real capture, and a property over random phase nestings.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepwatch
from stepwatch.analysis.markers import (
    TimelineMarker,
    derive_session_timeline_markers,
    derive_timeline_markers,
    timeline_marker_to_dict,
)
from stepwatch.analysis.phase_replay import PhaseReplayIndex
from stepwatch.guard import reset_swallowed, swallowed
from stepwatch.schema import TelemetryEventV3
from stepwatch.telemetry import load_telemetry_sessions
from tests.support import examples
from tests.support.records import make_event

SID = "00000000-0000-4000-8000-00000000abcd"
T0 = 1_800_000_000_000_000_000
MARKER_FIELDS = {"session_id", "start_ns", "end_ns", "kind", "source", "severity", "label", "rank", "local_rank",
                 "world_size", "event_type", "metadata"}


def point(event_type: str, t: int, context: str | None = None, **metadata: Any) -> TelemetryEventV3:
    return make_event(SID, event_type=event_type, timestamp_ns=T0 + t, context=context,
                      metadata={"backend": "cpu", **metadata})


def sample(t: int, **metadata: Any) -> TelemetryEventV3:
    return point("sample", t, **metadata)


class Scopes:
    """Builds phase_enter/phase_exit events the way the runtime writes them."""

    def __init__(self) -> None:
        self.seq = 0
        self.stacks: dict[int, list[tuple[str, tuple[str, ...]]]] = {}

    def enter(self, t: int, name: str, thread: int = 1) -> TelemetryEventV3:
        stack = self.stacks.setdefault(thread, [])
        self.seq += 1
        parent = stack[-1] if stack else None
        path = (*parent[1], name) if parent else (name,)
        scope_id = f"{SID}:{self.seq}"
        stack.append((scope_id, path))
        return self._event("enter", t, scope_id, path, parent[0] if parent else None, thread)

    def exit(self, t: int, thread: int = 1) -> TelemetryEventV3:
        stack = self.stacks[thread]
        scope_id, path = stack.pop()
        self.seq += 1
        return self._event("exit", t, scope_id, path, stack[-1][0] if stack else None, thread)

    def _event(self, action: str, t: int, scope_id: str, path: tuple[str, ...], parent: str | None,
               thread: int) -> TelemetryEventV3:
        scope = {"action": action, "name": path[-1], "path": list(path), "depth": len(path), "scope_id": scope_id,
                 "parent_scope_id": parent, "thread_id": thread, "thread_name": f"thread-{thread}",
                 "sequence": self.seq}
        return point(f"phase_{action}", t, f"Phase {action}: {' / '.join(path)}", phase_scope=scope)


# -- point markers -------------------------------------------------------------------------------


def test_promoted_point_markers() -> None:
    events = [
        point("start", 0, "stepwatch capture started"),
        sample(5),
        point("collector_degraded", 10, "RuntimeError: gone", collector_health_status="degraded"),
        point("collector_recovered", 20, "collector works again"),
        point("warning", 30, "memory at 85%"),
        point("critical", 40, "memory at 99%"),
        point("error", 50, "something failed"),
        point("error", 60, "OutOfMemoryError: CUDA out of memory", oom_reason="OutOfMemoryError: CUDA out of memory"),
        point("error", 65, "allocation retried", oom=False),  # flagged as not an OOM: an alert
        point("stop", 70, "stepwatch capture stopped (completed)"),
        point("error", 75, None, is_oom=True),
        point("custom_thing", 80),
        point("error", 85, "bundle only", oom_dump_path="bundles/oom_dump_x"),  # Stormlog: the key is enough
        point("error", 90, "reason unknown", oom_reason=""),
    ]
    markers = derive_timeline_markers(events)
    got = [(m.event_type, m.kind, m.severity, m.source, m.start_ns - T0, m.end_ns) for m in markers]
    assert got == [
        ("start", "lifecycle", "info", "telemetry_event", 0, None),
        ("collector_degraded", "collector", "warning", "telemetry_event", 10, None),
        ("collector_recovered", "collector", "info", "telemetry_event", 20, None),
        ("warning", "alert", "warning", "telemetry_event", 30, None),
        ("critical", "alert", "critical", "telemetry_event", 40, None),
        ("error", "alert", "critical", "telemetry_event", 50, None),
        ("error", "oom", "critical", "telemetry_event", 60, None),
        ("error", "alert", "critical", "telemetry_event", 65, None),
        ("stop", "lifecycle", "info", "telemetry_event", 70, None),
        ("error", "oom", "critical", "telemetry_event", 75, None),
        ("error", "oom", "critical", "telemetry_event", 85, None),
        ("error", "oom", "critical", "telemetry_event", 90, None),
    ]
    assert markers[0].label == "start: stepwatch capture started"
    assert markers[1].label == "collector degraded: RuntimeError: gone"
    assert markers[1].metadata["collector_health_status"] == "degraded"
    assert markers[6].label == "OOM: OutOfMemoryError: CUDA out of memory"
    assert markers[7].label == "error: allocation retried"
    for m in markers:
        assert (m.session_id, m.rank, m.local_rank, m.world_size) == (SID, 0, 0, 1)


def test_marker_dict_has_the_canonical_fields() -> None:
    s = Scopes()
    markers = derive_timeline_markers([point("start", 0), s.enter(10, "train"), s.exit(20), point("stop", 30)])
    for marker in markers:
        as_dict = timeline_marker_to_dict(marker)
        assert set(as_dict) == MARKER_FIELDS
        assert json.loads(json.dumps(as_dict)) == as_dict  # plain JSON
        assert as_dict["start_ns"] == marker.start_ns and as_dict["kind"] == marker.kind


def test_no_events_no_markers() -> None:
    assert derive_timeline_markers([]) == []
    assert derive_timeline_markers([sample(1), sample(2)]) == []


# -- interval markers ----------------------------------------------------------------------------


def test_phases_become_interval_markers() -> None:
    s = Scopes()
    events = [
        point("start", 0),
        s.enter(10, "train"),
        s.enter(20, "forward"),
        sample(25),
        s.exit(30),
        s.enter(40, "backward"),
        s.exit(50),
        s.exit(60),
        point("stop", 70),
    ]
    markers = derive_timeline_markers(events)
    phases = [m for m in markers if m.kind == "phase"]
    assert [(m.label, m.start_ns - T0, m.end_ns - T0 if m.end_ns else None) for m in phases] == [
        ("train", 10, 60), ("train / forward", 20, 30), ("train / backward", 40, 50)]
    for m in phases:
        assert (m.source, m.severity, m.event_type) == ("phase_replay", "info", "phase_enter")
        assert m.metadata["closed"] is True
        assert m.metadata["thread_id"] == 1 and m.metadata["thread_name"] == "thread-1"
    assert phases[1].metadata["parent_scope_id"] == phases[0].metadata["scope_id"]
    assert phases[1].metadata["path"] == ["train", "forward"] and phases[1].metadata["depth"] == 2
    assert [m.start_ns for m in markers] == sorted(m.start_ns for m in markers)


def test_an_unclosed_phase_ends_at_the_last_event() -> None:
    s = Scopes()
    events = [s.enter(10, "train"), s.enter(20, "step"), s.exit(30), sample(95)]
    phases = [m for m in derive_timeline_markers(events) if m.kind == "phase"]
    assert [(m.label, m.end_ns - T0, m.metadata["closed"]) for m in phases] == [  # type: ignore[operator]
        ("train", 95, False), ("train / step", 30, True)]


def test_attributes_are_carried() -> None:
    s = Scopes()
    enter = s.enter(10, "train")
    enter.metadata["phase_scope"]["attributes"] = {"epoch": 3}
    (marker,) = derive_timeline_markers([enter, s.exit(20)])
    assert marker.metadata["attributes"] == {"epoch": 3}


# -- attribution ---------------------------------------------------------------------------------


def test_phase_events_are_attributed_exactly() -> None:
    s = Scopes()
    events = [s.enter(10, "train"), s.enter(20, "forward", thread=1)]
    index = PhaseReplayIndex(events)
    attribution = index.attribute(events[1])
    assert attribution is not None
    assert attribution.to_dict() == {
        "phase_resolution": "unique", "phase_source": "exact", "phase_path": "train / forward",
        "phase_paths": ["train / forward"], "scope_id": f"{SID}:2", "thread_id": 1, "thread_name": "thread-1"}


def test_heuristic_unique_for_a_sample_inside_one_innermost_scope() -> None:
    s = Scopes()
    events = [s.enter(10, "train"), s.enter(20, "forward"), sample(25), s.exit(30), sample(35), s.exit(40), sample(45)]
    index = PhaseReplayIndex(events)
    inner = index.attribute(events[2])
    assert inner is not None and inner.to_dict() == {
        "phase_resolution": "unique", "phase_source": "heuristic", "phase_path": "train / forward",
        "phase_paths": ["train / forward"], "scope_id": f"{SID}:2", "thread_id": 1, "thread_name": "thread-1"}
    outer = index.attribute(events[4])
    assert outer is not None and outer.phase_path == "train" and outer.phase_resolution == "unique"
    assert index.attribute(events[6]) is None  # after every scope closed: no attribution


def test_two_threads_in_different_phases_are_ambiguous_with_a_summary() -> None:
    s = Scopes()
    events = [
        s.enter(10, "train", thread=1),
        s.enter(20, "data", thread=2),
        s.enter(30, "forward", thread=1),
        sample(35),
        sample(36, thread_id=2),
        sample(37, thread_id=1),
        sample(38, thread_id=3),
    ]
    index = PhaseReplayIndex(events)
    ambiguous = index.attribute(events[3])
    assert ambiguous is not None
    assert ambiguous.to_dict() == {
        "phase_resolution": "ambiguous", "phase_source": "heuristic", "phase_paths": ["data", "train / forward"],
        "phase_summary": {"phase_path": "train / forward", "source": "heuristic"}}  # deepest wins; no phase_path, scope or thread
    on_two = index.attribute(events[4])
    assert on_two is not None and on_two.to_dict() == {
        "phase_resolution": "unique", "phase_source": "thread_local", "phase_path": "data", "phase_paths": ["data"],
        "scope_id": f"{SID}:2", "thread_id": 2, "thread_name": "thread-2"}
    on_one = index.attribute(events[5])
    assert on_one is not None and (on_one.phase_source, on_one.phase_path) == ("thread_local", "train / forward")
    assert index.attribute(events[6]) is None  # a thread with no open scope


def test_ambiguity_between_equal_labels_has_no_summary() -> None:
    s = Scopes()
    events = [s.enter(10, "allreduce", thread=1), s.enter(20, "allreduce", thread=2), sample(25)]
    attribution = PhaseReplayIndex(events).attribute(events[2])
    assert attribution is not None
    assert attribution.to_dict() == {
        "phase_resolution": "ambiguous", "phase_source": "heuristic", "phase_paths": ["allreduce"]}


def test_equal_depth_ambiguity_picks_the_most_recent_scope_for_the_summary() -> None:
    s = Scopes()
    events = [s.enter(10, "a", thread=1), s.enter(20, "b", thread=2), sample(25)]
    attribution = PhaseReplayIndex(events).attribute(events[2])
    assert attribution is not None and attribution.phase_summary is not None and attribution.phase_summary.label == "(likely) b"


def test_other_processes_and_ranks_are_not_candidates() -> None:
    s = Scopes()
    enter = s.enter(10, "train")
    other_pid = make_event(SID, event_type="sample", timestamp_ns=T0 + 15, pid=enter.pid + 1,
                           metadata={"backend": "cpu"})
    other_rank = make_event(SID, event_type="sample", timestamp_ns=T0 + 16, rank=1, local_rank=1, world_size=2,
                            metadata={"backend": "cpu"})
    index = PhaseReplayIndex([enter, other_pid, other_rank])
    assert index.attribute(other_pid) is None
    assert index.attribute(other_rank) is None


# -- a real capture ------------------------------------------------------------------------------


def test_markers_of_a_real_capture(tmp_path: Path) -> None:
    reset_swallowed()
    stepwatch.init(out=tmp_path / "run", interval=0.05, auto_instrument=False, handle_signals=False,
                   capture_oom=False)
    try:
        with stepwatch.phase("train"):
            with stepwatch.phase("forward"):
                pass
        worker = threading.Thread(target=lambda: stepwatch.phase("io").__enter__(), name="loader")
        worker.start()  # enters and never exits: an unclosed scope
        worker.join()
    finally:
        stepwatch.shutdown()
    assert swallowed() == {}
    (session,) = load_telemetry_sessions(tmp_path / "run")
    markers = derive_session_timeline_markers(session)
    assert markers == derive_timeline_markers(session.events)
    lifecycle = [m for m in markers if m.kind == "lifecycle"]
    assert [m.event_type for m in lifecycle] == ["start", "stop"]
    phases = {m.label: m for m in markers if m.kind == "phase"}
    assert set(phases) == {"train", "train / forward", "io"}
    by_scope = {}
    for e in session.events:
        if e.event_type in ("phase_enter", "phase_exit"):
            by_scope.setdefault(e.metadata["phase_scope"]["scope_id"], {})[e.event_type] = e.timestamp_ns
    for label in ("train", "train / forward"):
        m = phases[label]
        times = by_scope[m.metadata["scope_id"]]
        assert (m.start_ns, m.end_ns, m.metadata["closed"]) == (times["phase_enter"], times["phase_exit"], True)
        assert m.session_id == session.summary.session_id
    io = phases["io"]
    assert io.metadata["closed"] is False and io.metadata["thread_name"] == "loader"
    assert io.end_ns == max(e.timestamp_ns for e in session.events)
    for m in markers:
        assert isinstance(m, TimelineMarker) and set(timeline_marker_to_dict(m)) == MARKER_FIELDS
        assert m.end_ns is None or m.start_ns <= m.end_ns


# -- property: random well-nested scopes on several threads --------------------------------------


Truth = list[tuple[TelemetryEventV3, dict[int, str]]]  # per sample: thread -> its innermost open scope


@st.composite
def nested_runs(draw: st.DrawFn) -> tuple[list[TelemetryEventV3], Truth]:
    """Events of up to three threads entering and leaving well-nested scopes, interleaved, with samples
    between them; and, per sample, the innermost open scope of each thread at that instant."""
    threads = draw(st.integers(1, 3))
    programs: dict[int, list[str | None]] = {}
    for thread in range(1, threads + 1):
        ops: list[str | None] = []
        depth = 0
        for _ in range(draw(st.integers(0, 10))):
            if depth and (depth >= 4 or draw(st.booleans())):
                ops.append(None)  # exit
                depth -= 1
            else:
                ops.append(draw(st.sampled_from(["train", "fwd", "bwd", "io"])))
                depth += 1
        if draw(st.booleans()):
            ops.extend([None] * depth)  # sometimes every scope is closed, sometimes not
        programs[thread] = ops
    order = draw(st.permutations([t for t, ops in programs.items() for _ in ops]))
    s = Scopes()
    events: list[TelemetryEventV3] = []
    truth: Truth = []
    cursor = dict.fromkeys(programs, 0)
    t = 0
    for thread in order:
        op = programs[thread][cursor[thread]]
        cursor[thread] += 1
        t += 10
        events.append(s.exit(t, thread) if op is None else s.enter(t, op, thread))
        if draw(st.booleans()):
            probe = sample(t + 5)
            events.append(probe)
            truth.append((probe, {th: stack[-1][0] for th, stack in s.stacks.items() if stack}))
    return events, truth


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nested_runs())
def test_replay_of_random_nestings(run: tuple[list[TelemetryEventV3], Truth]) -> None:
    events, truth = run
    index = PhaseReplayIndex(events)
    enters = {e.metadata["phase_scope"]["scope_id"]: e for e in events if e.event_type == "phase_enter"}
    exits = {e.metadata["phase_scope"]["scope_id"]: e for e in events if e.event_type == "phase_exit"}
    last = max((e.timestamp_ns for e in events), default=0)
    assert {i.scope_id for i in index.intervals} == set(enters)
    for interval in index.intervals:
        assert interval.start_ns <= interval.end_ns
        assert interval.start_ns == enters[interval.scope_id].timestamp_ns
        if interval.scope_id in exits:
            assert interval.closed and interval.end_ns == exits[interval.scope_id].timestamp_ns
        else:
            assert not interval.closed and interval.end_ns == last
    markers = [m for m in derive_timeline_markers(events) if m.kind == "phase"]
    assert len(markers) == len(enters)
    assert all(m.end_ns is not None and m.start_ns <= m.end_ns for m in markers)

    for probe, innermost in truth:
        attribution = index.attribute(probe)
        if not innermost:
            assert attribution is None
        elif len(innermost) == 1:
            ((thread, scope_id),) = innermost.items()
            assert attribution is not None
            assert (attribution.phase_resolution, attribution.phase_source) == ("unique", "heuristic")
            assert (attribution.scope_id, attribution.thread_id) == (scope_id, thread)
        else:
            assert attribution is not None and attribution.phase_resolution == "ambiguous"
            labels = sorted({" / ".join(enters[sid].metadata["phase_scope"]["path"]) for sid in innermost.values()})
            assert attribution.phase_paths == labels
            assert (attribution.phase_summary is not None) == (len(labels) > 1)
            assert attribution.phase_path is None and attribution.scope_id is None
        for thread, scope_id in innermost.items():  # told the thread, the answer is exact
            local = index.attribute(make_event(SID, event_type="sample", timestamp_ns=probe.timestamp_ns,
                                               metadata={"backend": "cpu", "thread_id": thread}))
            assert local is not None
            assert (local.phase_resolution, local.phase_source, local.scope_id) == ("unique", "thread_local", scope_id)


def test_the_analysis_package_exports_its_functions() -> None:
    import stepwatch.analysis as analysis
    from stepwatch.analysis import PhaseReplayIndex, derive_timeline_markers  # noqa: F401

    assert set(analysis.__all__) >= {"derive_timeline_markers", "derive_session_timeline_markers",
                                     "timeline_marker_to_dict", "TimelineMarker", "PhaseReplayIndex"}
    assert analysis.derive_timeline_markers.__module__ == "stepwatch.analysis.markers"
