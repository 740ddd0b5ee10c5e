"""load_telemetry_sessions / load_telemetry_events over every artifact shape, and their failures."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.artifacts.sink import SinkConfig, TelemetrySink
from stepwatch.errors import ArtifactError
from stepwatch.schema import SessionSummary, TelemetryEventV3, telemetry_event_to_dict
from stepwatch.telemetry import load_telemetry_events, load_telemetry_sessions
from tests.support import examples
from tests.support.records import make_event, make_record

REPO = Path(__file__).resolve().parents[2]
PROPERTY = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(PROPERTY, max_examples=examples(200))


# -- helpers -----------------------------------------------------------------------------------


def write_session(
    root: Path,
    n: int,
    config: SinkConfig | None = None,
    summary: SessionSummary | None = None,
    **overrides: Any,
) -> tuple[str, list[TelemetryEventV3]]:
    sink = TelemetrySink(root, config)
    session = sink.start_session(summary)
    events = [make_event(session.session_id, i, **overrides) for i in range(n)]
    for event in events:
        sink.append(event)
    sink.close()
    return session.session_id, events


def dump_json(path: Path, payload: Any) -> Path:
    path.write_bytes(msgspec.json.encode(payload))
    return path


def as_dicts(events: list[TelemetryEventV3]) -> list[dict[str, Any]]:
    return [telemetry_event_to_dict(e) for e in events]


def overview(sessions: list) -> list[tuple[str, str, int]]:
    return [(s.summary.session_id, s.summary.status, len(s.events)) for s in sessions]


def edit_manifest(root: Path, edit: Any) -> None:
    manifest = json.loads((root / "manifest.json").read_bytes())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


_DYING_WRITER = r"""
import os, signal, sys
sys.path.insert(0, os.getcwd())
from stepwatch.artifacts.sink import SinkConfig, TelemetrySink
from tests.support.records import make_event
sink = TelemetrySink(sys.argv[1], SinkConfig(flush_every_events=1))
session = sink.start_session()
for i in range(int(sys.argv[2])):
    sink.append(make_event(session.session_id, i))
print(session.session_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def kill_writer(root: Path, n: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _DYING_WRITER, str(root), str(n)], cwd=REPO, capture_output=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr.decode()
    return proc.stdout.decode().strip()


def v4_record(**overrides: Any) -> dict[str, Any]:
    caps = {
        "backend": "cpu", "telemetry_collector": "stormlog.cpu_tracker", "sampling_source": "legacy",
        "supports_allocator_allocated": True, "supports_allocator_reserved": True,
        "supports_allocator_active": False, "supports_allocator_inactive": False,
        "supports_device_used": True, "supports_device_free": False, "supports_device_total": False,
        "supports_native_allocator_history": False, "supports_fragmentation_analysis": False,
        "supports_allocator_attribution": True, "supports_bounded_profiling": False,
    }
    record = make_record(schema_version=4, collector="stormlog.cpu_tracker", metadata={"memory_capabilities": caps})
    record.update(overrides)
    return record


@pytest.fixture
def sink_two_sessions(tmp_path: Path) -> tuple[Path, str, list, str, list]:
    root = tmp_path / "sink"
    config = SinkConfig(rollover_max_events=3)
    first, events_a = write_session(root, 7, config)  # segments 1, 2, 3
    second, events_b = write_session(root, 2, config)  # segment 4
    return root, first, events_a, second, events_b


# -- sink shapes -------------------------------------------------------------------------------


def test_sink_directory(sink_two_sessions: tuple) -> None:
    root, first, events_a, second, events_b = sink_two_sessions
    sessions = load_telemetry_sessions(root)
    assert overview(sessions) == [(second, "completed", 2), (first, "completed", 7)]
    a = sessions[1]
    assert a.events == events_a
    assert a.summary.event_count == 7 and a.summary.ranks == (0,)
    assert a.summary.first_timestamp_ns == events_a[0].timestamp_ns
    assert a.summary.last_timestamp_ns == events_a[-1].timestamp_ns
    assert a.summary.pid == os.getpid() and a.summary.ended_at_ns is not None
    assert [Path(p).name for p in a.sources] == ["segment-000001.jsonl", "segment-000002.jsonl", "segment-000003.jsonl"]
    assert (a.torn_lines, a.skipped_records, a.warnings) == (0, 0, [])
    assert load_telemetry_events(root) == events_b  # default: newest completed
    assert load_telemetry_events(root, session_id=first) == events_a


def test_manifest_file(sink_two_sessions: tuple) -> None:
    root, first, events_a, second, events_b = sink_two_sessions
    by_manifest = load_telemetry_sessions(root / "manifest.json")
    assert by_manifest == load_telemetry_sessions(root)
    assert load_telemetry_events(root / "manifest.json", session_id=first) == events_a


def test_one_segment(sink_two_sessions: tuple) -> None:
    root, first, events_a, second, events_b = sink_two_sessions
    [middle] = load_telemetry_sessions(root / "segment-000002.jsonl")
    assert (middle.summary.session_id, middle.summary.status) == (first, "completed")
    assert middle.events == events_a[3:6]
    assert middle.summary.event_count == 3
    [last] = load_telemetry_sessions(root / "segment-000004.jsonl")
    assert last.events == events_b
    assert load_telemetry_events(root / "segment-000001.jsonl") == events_a[:3]


def test_sink_written_out_of_time_order_loads_in_time_order(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path, SinkConfig(rollover_max_events=2))
    session = sink.start_session()
    events = [make_event(session.session_id, i, timestamp_ns=ts) for i, ts in enumerate([50, 10, 40, 20, 30])]
    for event in events:
        sink.append(event)
    sink.close()
    [loaded] = load_telemetry_sessions(tmp_path)
    assert [e.timestamp_ns for e in loaded.events] == [10, 20, 30, 40, 50]
    assert (loaded.summary.first_timestamp_ns, loaded.summary.last_timestamp_ns) == (10, 50)


# -- JSON exports ------------------------------------------------------------------------------


def test_json_array_export(tmp_path: Path, session_id: str) -> None:
    events = [make_event(session_id, i) for i in range(4)]
    path = dump_json(tmp_path / "export.json", as_dicts(events)[::-1])
    [loaded] = load_telemetry_sessions(path)
    assert loaded.events == events
    assert loaded.summary.session_id == session_id
    assert loaded.summary.status == "incomplete"  # no ledger, no stop event: nothing proves a clean stop
    assert loaded.sources == [str(path)]


def test_json_export_with_stop_event_is_completed(tmp_path: Path, session_id: str) -> None:
    events = [make_event(session_id, 0, event_type="start")]
    events += [make_event(session_id, i) for i in range(1, 3)]
    events += [make_event(session_id, 3, event_type="stop")]
    [loaded] = load_telemetry_sessions(dump_json(tmp_path / "export.json", as_dicts(events)))
    assert loaded.summary.status == "completed"
    assert loaded.summary.ended_at_ns == events[-1].timestamp_ns


@pytest.mark.parametrize("key", ["events", "telemetry_events"])
def test_json_object_with_events_list(tmp_path: Path, session_id: str, key: str) -> None:
    events = [make_event(session_id, i) for i in range(3)]
    path = dump_json(tmp_path / "export.json", {"meta": {"tool": "x"}, key: as_dicts(events)})
    assert load_telemetry_events(path) == events


def test_json_with_session_summary(tmp_path: Path, session_id: str) -> None:
    events = [make_event(session_id, i) for i in range(3)]
    summary = {
        "session_id": session_id, "status": "interrupted", "started_at_ns": events[0].timestamp_ns - 5,
        "ended_at_ns": events[-1].timestamp_ns + 5, "host": "node-z", "pid": 4242, "job_id": "job-1",
        "rank": 0, "local_rank": 0, "world_size": 1, "source": "stormlog.cpu_profiler",
    }
    path = dump_json(tmp_path / "export.json", {"telemetry_events": as_dicts(events), "session_summary": summary})
    [loaded] = load_telemetry_sessions(path)
    assert loaded.events == events
    assert (loaded.summary.status, loaded.summary.host, loaded.summary.pid) == ("interrupted", "node-z", 4242)
    assert loaded.summary.event_count == 3


def test_json_session_summary_with_bad_field(tmp_path: Path, session_id: str) -> None:
    payload = {
        "telemetry_events": as_dicts([make_event(session_id)]),
        "session_summary": {"session_id": session_id, "status": "exploded", "started_at_ns": 1},
    }
    with pytest.raises(ArtifactError) as info:
        load_telemetry_sessions(dump_json(tmp_path / "export.json", payload))
    assert info.value.field == "$.session_summary.status"


def test_json_single_object(tmp_path: Path, session_id: str) -> None:
    event = make_event(session_id)
    path = dump_json(tmp_path / "one.json", telemetry_event_to_dict(event))
    assert load_telemetry_events(path) == [event]


def test_json_caller_named_events_key(tmp_path: Path, session_id: str) -> None:
    events = [make_event(session_id, i) for i in range(2)]
    path = dump_json(tmp_path / "custom.json", {"samples": as_dicts(events), "events": "not a list"})
    assert load_telemetry_events(path, events_key="samples") == events
    with pytest.raises(ArtifactError) as info:
        load_telemetry_events(path, events_key="missing")
    assert info.value.field == "$.missing"
    with pytest.raises(ArtifactError, match="no telemetry events found"):
        load_telemetry_events(path)


def test_json_records_from_several_sessions_are_grouped(tmp_path: Path) -> None:
    a = [make_event("00000000-0000-4000-8000-0000000000a1", i) for i in range(2)]
    b = [make_event("00000000-0000-4000-8000-0000000000b2", i) for i in range(3)]
    path = dump_json(tmp_path / "mixed.json", as_dicts([a[0], b[0], a[1], b[1], b[2]]))
    sessions = load_telemetry_sessions(path)
    assert sorted(overview(sessions)) == sorted([(a[0].session_id, "incomplete", 2), (b[0].session_id, "incomplete", 3)])
    assert overview(sessions)[0][0] == b[0].session_id  # newest of equal status first


def test_v4_records_convert_and_null_counters_stay_unknown_not_zero_filled(tmp_path: Path, session_id: str) -> None:
    caps = v4_record()["metadata"]["memory_capabilities"]
    unsupported = {**caps, "supports_allocator_allocated": False}
    records = [
        v4_record(session_id=session_id, timestamp_ns=1),
        v4_record(
            session_id=session_id, timestamp_ns=2, allocator_allocated_bytes=None, allocator_change_bytes=None,
            metadata={"memory_capabilities": unsupported},
        ),
        v4_record(session_id=session_id, timestamp_ns=3),
    ]
    for path in (dump_json(tmp_path / "v4.json", records), tmp_path / "v4.jsonl"):
        if path.suffix == ".jsonl":
            path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in records))
        [loaded] = load_telemetry_sessions(path)
        assert [e.timestamp_ns for e in loaded.events] == [1, 2, 3]
        assert [e.schema_version for e in loaded.events] == [3, 4, 3]  # the unknown one keeps v4
        assert loaded.events[1].allocator_allocated_bytes is None  # unknown, not 0
        assert loaded.events[1].allocator_change_bytes is None
        assert loaded.skipped_records == 0


# -- run directories ---------------------------------------------------------------------------


def test_run_directory_ranks_of_one_session_are_merged(tmp_path: Path, session_id: str) -> None:
    run = tmp_path / "run"
    expected = []
    for rank in (1, 0):  # written out of rank order
        summary = SessionSummary(
            session_id=session_id, status="running", started_at_ns=1, host=socket.gethostname(),
            pid=os.getpid(), rank=rank, world_size=2,
        )
        _, events = write_session(run / "telemetry" / f"rank{rank}", 3, summary=summary, rank=rank, world_size=2)
        expected += events
    (run / "run.json").write_text("{}")
    (run / "spool").mkdir()
    sessions = load_telemetry_sessions(run)
    assert len(sessions) == 1
    [merged] = sessions
    assert merged.summary.session_id == session_id
    assert merged.summary.ranks == (0, 1)
    assert merged.summary.world_size == 2
    assert merged.summary.status == "completed"
    assert merged.summary.event_count == 6
    assert merged.events == sorted(expected, key=lambda e: e.timestamp_ns)
    assert [Path(p).parent.name for p in merged.sources] == ["rank0", "rank1"]
    assert load_telemetry_events(run) == merged.events
    # the telemetry/ folder itself, and one rank's sink, load too
    assert overview(load_telemetry_sessions(run / "telemetry")) == overview(sessions)
    [rank1] = load_telemetry_sessions(run / "telemetry" / "rank1")
    assert rank1.summary.ranks == (1,) and rank1.summary.event_count == 3


@pytest.mark.real
def test_run_directory_merged_status_is_the_least_proven(tmp_path: Path, session_id: str) -> None:
    run = tmp_path / "run"
    summary = SessionSummary(session_id=session_id, status="running", started_at_ns=1, rank=0, world_size=2)
    write_session(run / "telemetry" / "rank0", 2, summary=summary, world_size=2)
    rank1 = run / "telemetry" / "rank1"
    other = kill_writer(rank1, 2)
    # make the killed writer's records and ledger belong to the shared session on rank 1
    for segment in rank1.glob("segment-*.jsonl"):
        segment.write_bytes(segment.read_bytes().replace(other.encode(), session_id.encode()))
    edit_manifest(rank1, lambda m: [e.update(session_id=session_id) for e in m["sessions"] + m["segments"]])
    data = (rank1 / "segment-000001.jsonl").read_bytes().replace(b'"rank":0', b'"rank":1').replace(b'"world_size":1', b'"world_size":2')
    (rank1 / "segment-000001.jsonl").write_bytes(data)
    [merged] = load_telemetry_sessions(run)
    assert merged.summary.ranks == (0, 1)
    assert merged.summary.status == "incomplete"  # rank 1's writer died and nobody recovered it
    TelemetrySink(rank1)  # recovery
    [merged] = load_telemetry_sessions(run)
    assert merged.summary.status == "interrupted"
    assert merged.summary.event_count == 4


def test_run_directory_with_different_sessions_per_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ids = []
    for rank in (0, 1):
        summary = SessionSummary(
            session_id=f"00000000-0000-4000-8000-00000000000{rank}", status="running", started_at_ns=1,
            rank=rank, world_size=2,
        )
        sid, _ = write_session(run / "telemetry" / f"rank{rank}", 2 + rank, summary=summary, rank=rank, world_size=2)
        ids.append(sid)
    sessions = load_telemetry_sessions(run)
    assert {(s.summary.session_id, s.summary.ranks, s.summary.event_count) for s in sessions} == {
        (ids[0], (0,), 2), (ids[1], (1,), 3),
    }
    assert load_telemetry_events(run, session_id=ids[0])[0].rank == 0


# -- torn and malformed lines ------------------------------------------------------------------


def test_truncated_final_line_is_ignored_and_counted(tmp_path: Path) -> None:
    sid, events = write_session(tmp_path, 4)
    segment = tmp_path / "segment-000001.jsonl"
    with segment.open("ab") as handle:
        handle.write(msgspec.json.encode(make_event(sid, 99))[:80])
    for path in (tmp_path, segment):
        [loaded] = load_telemetry_sessions(path)
        assert loaded.events == events
        assert loaded.torn_lines == 1
        assert loaded.summary.event_count == 4


def test_torn_line_in_a_closed_segment_is_counted_and_the_rest_loads(tmp_path: Path) -> None:
    """Closed segments are read through mmap; a torn tail there is handled like in the active one."""
    sid, events = write_session(tmp_path, 6, SinkConfig(rollover_max_events=3))
    first = tmp_path / "segment-000001.jsonl"
    assert (tmp_path / "segment-000002.jsonl").exists()
    with first.open("ab") as handle:
        handle.write(msgspec.json.encode(make_event(sid, 99))[:80])
    [loaded] = load_telemetry_sessions(tmp_path)
    assert loaded.events == events and loaded.torn_lines == 1


def test_only_closed_segments_are_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The newest segment may still be cut back by its writer: a mapping of it could SIGBUS."""
    from stepwatch.artifacts import telemetry_loader

    _, events = write_session(tmp_path, 7, SinkConfig(rollover_max_events=3))
    mapped: list[str] = []
    real = telemetry_loader._mapped
    monkeypatch.setattr(telemetry_loader, "_mapped", lambda path: mapped.append(path.name) or real(path))
    [loaded] = load_telemetry_sessions(tmp_path)
    assert loaded.events == events
    assert mapped == ["segment-000001.jsonl", "segment-000002.jsonl"]


@pytest.mark.parametrize("enabled", [True, False])
def test_load_runs_no_gc_collection_and_restores_the_gc_state(tmp_path: Path, enabled: bool) -> None:
    """Records whose metadata holds lists are GC-tracked; no collection may run inside a load."""
    import gc

    write_session(tmp_path, 3000, metadata={"backend": "cpu", "collector_partial_fields": ["x"]})
    inside_load: list[int] = []

    def callback(phase: str, info: dict) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_load_sessions":
                inside_load.append(info["generation"])
            frame = frame.f_back

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    gc.callbacks.append(callback)
    try:
        [loaded] = load_telemetry_sessions(tmp_path)
        assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(callback)
        (gc.enable if was else gc.disable)()
    assert inside_load == [] and len(loaded.events) == 3000
    assert loaded.events[0].metadata["collector_partial_fields"] == ["x"]


def test_final_line_without_newline_but_complete_is_kept(tmp_path: Path, session_id: str) -> None:
    events = [make_event(session_id, i) for i in range(3)]
    path = tmp_path / "loose.jsonl"
    path.write_bytes(b"\n".join(msgspec.json.encode(e) for e in events))
    [loaded] = load_telemetry_sessions(path)
    assert loaded.events == events and loaded.torn_lines == 0


def test_malformed_middle_line_names_file_and_line(tmp_path: Path) -> None:
    sid, events = write_session(tmp_path, 4)
    segment = tmp_path / "segment-000001.jsonl"
    lines = segment.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2][:40] + b"\n"
    segment.write_bytes(b"".join(lines))
    for path in (tmp_path, segment, tmp_path / "manifest.json"):
        with pytest.raises(ArtifactError) as info:
            load_telemetry_sessions(path)
        assert info.value.path == str(segment)
        assert info.value.line == 3
        assert f"{segment}:3" in str(info.value)
        assert "malformed JSON" in str(info.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rank": 5, "world_size": 2}, "$.rank"),
        ({"device_used_bytes": -3}, "$.device_used_bytes"),
        ({"unknown_thing": True}, "$.unknown_thing"),
        ({"schema_version": "3"}, "$.schema_version"),
        ({"metadata": "text"}, "$.metadata"),
    ],
)
def test_record_with_bad_field_names_file_line_and_field(tmp_path: Path, change: dict, field: str) -> None:
    sid, events = write_session(tmp_path, 3)
    segment = tmp_path / "segment-000001.jsonl"
    lines = segment.read_bytes().splitlines(keepends=True)
    bad = {**telemetry_event_to_dict(events[1]), **change}
    lines.insert(1, msgspec.json.encode(bad) + b"\n")
    segment.write_bytes(b"".join(lines))
    with pytest.raises(ArtifactError) as info:
        load_telemetry_sessions(tmp_path)
    assert (info.value.path, info.value.line, info.value.field) == (str(segment), 2, field)
    assert f"{segment}:2" in str(info.value) and field in str(info.value)


def test_records_of_different_world_sizes_in_one_segment_load(tmp_path: Path, session_id: str) -> None:
    """The identity rule is checked per segment (max rank vs min world size) and, when that
    is inconclusive, per record: valid mixes must still load."""
    events = [make_event(session_id, 0, rank=3, local_rank=3, world_size=4),
              make_event(session_id, 1, rank=0, local_rank=0, world_size=1)]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in events))
    [loaded] = load_telemetry_sessions(path)
    assert loaded.events == sorted(events, key=lambda e: e.timestamp_ns)
    assert loaded.summary.ranks == (0, 3)


def test_events_of_a_session_share_one_session_id_string(tmp_path: Path) -> None:
    """Memory: one session id object per loaded session, not one per record (~88 B each)."""
    sid, _ = write_session(tmp_path, 5, SinkConfig(rollover_max_events=2))
    [loaded] = load_telemetry_sessions(tmp_path)
    assert len({id(e.session_id) for e in loaded.events}) == 1 and loaded.events[0].session_id == sid


@pytest.mark.parametrize(("wrap", "prefix"), [(lambda r: r, "$[1]"), (lambda r: {"events": r}, "$.events[1]")])
def test_json_export_record_with_bad_field(tmp_path: Path, session_id: str, wrap: Any, prefix: str) -> None:
    records = as_dicts([make_event(session_id, i) for i in range(3)])
    records[1]["world_size"] = 0
    path = dump_json(tmp_path / "bad.json", wrap(records))
    with pytest.raises(ArtifactError) as info:
        load_telemetry_sessions(path)
    assert info.value.path == str(path)
    assert info.value.field == f"{prefix}.world_size"


# -- unreadable inputs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.json", b"", "not valid JSON"),
        ("blank.json", b"  \n ", "not valid JSON"),
        ("text.json", b"this is not json", "not valid JSON"),
        ("binary.json", b"\x89PNG\r\n\x1a\n\x00\x00", "not valid JSON"),
        ("number.json", b"42", "expected a JSON array or object"),
        ("other.json", b'{"rows": [1, 2]}', "no telemetry events found"),
        ("scalars.json", b"[1, 2]", "must be a JSON object"),
        ("garbage.jsonl", b"not json\nat all\n", "malformed JSON"),
    ],
)
def test_unreadable_file_raises_artifact_error(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ArtifactError, match=message) as info:
        load_telemetry_sessions(path)
    assert info.value.path == str(path)
    with pytest.raises(ArtifactError):
        load_telemetry_events(path)


def test_empty_segment_given_directly_is_an_error(tmp_path: Path) -> None:
    # (It used to load as no sessions at all, which `stepwatch sessions` printed as an empty
    # table with exit 0.)
    path = tmp_path / "segment-000001.jsonl"
    path.write_bytes(b"")
    with pytest.raises(ArtifactError, match="file is empty") as info:
        load_telemetry_sessions(path)
    assert info.value.path == str(path)
    with pytest.raises(ArtifactError, match="file is empty"):
        load_telemetry_events(path)


@pytest.mark.parametrize("content", [b"", b" \n"])
def test_empty_json_export_says_file_is_empty(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "export.json"
    path.write_bytes(content)
    with pytest.raises(ArtifactError, match="file is empty") as info:
        load_telemetry_sessions(path)
    assert "truncated" not in str(info.value)


def test_empty_segment_inside_a_sink_is_normal_unless_the_manifest_recorded_data(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path)
    session = sink.start_session()  # its segment stays empty until the first flush
    [loaded] = load_telemetry_sessions(tmp_path)
    assert (loaded.summary.status, loaded.empty_segments, loaded.warnings) == ("running", 0, [])
    sink.close()
    sid, events = write_session(tmp_path, 3)
    (tmp_path / "segment-000002.jsonl").write_bytes(b"")  # the manifest says it held 3 records
    sessions = {s.summary.session_id: s for s in load_telemetry_sessions(tmp_path)}
    hit = sessions[sid]
    assert (hit.empty_segments, hit.events) == (1, [])
    [warning] = hit.warnings
    assert "file is empty" in warning and "segment-000002.jsonl" in warning
    assert (sessions[session.session_id].empty_segments, sessions[session.session_id].warnings) == (0, [])


def test_events_key_holding_something_else_names_the_field(tmp_path: Path) -> None:
    path = dump_json(tmp_path / "export.json", {"events": 5})
    with pytest.raises(ArtifactError, match=r"\$\.events must be an array") as info:
        load_telemetry_sessions(path)
    assert info.value.field == "$.events"


def test_missing_path_and_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="no such file"):
        load_telemetry_sessions(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="no telemetry found"):
        load_telemetry_sessions(tmp_path / "empty")


@pytest.mark.parametrize("damage", ["half", "empty", "wrong_type"])
def test_unreadable_manifest_falls_back_to_the_segments_as_incomplete(sink_two_sessions: tuple, damage: str) -> None:
    # (A half-written manifest used to make the whole sink unreadable, its intact segments too.)
    root, first, events_a, second, events_b = sink_two_sessions
    data = (root / "manifest.json").read_bytes()
    broken = {"half": data[: len(data) // 3], "empty": b"", "wrong_type": b'{"segments": "nope"}'}[damage]
    (root / "manifest.json").write_bytes(broken)
    sessions = {s.summary.session_id: s for s in load_telemetry_sessions(root)}
    assert set(sessions) == {first, second}
    assert sessions[first].events == events_a and sessions[second].events == events_b
    for loaded in sessions.values():
        assert loaded.summary.status == "incomplete"
        assert loaded.unreadable_manifests == 1
        [warning] = loaded.warnings
        assert str(root / "manifest.json") in warning
        if damage == "empty":
            assert "file is empty" in warning
    assert load_telemetry_events(root, session_id=first) == events_a
    # named directly, the manifest itself is what was asked for: an error naming it
    with pytest.raises(ArtifactError) as info:
        load_telemetry_sessions(root / "manifest.json")
    assert info.value.path == str(root / "manifest.json")


def test_unreadable_manifest_without_segments_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_bytes(b'{"schema_version": 2, "segm')
    with pytest.raises(ArtifactError, match="no segments") as info:
        load_telemetry_sessions(tmp_path)
    assert info.value.path == str(tmp_path / "manifest.json")


# -- missing pieces and statuses ---------------------------------------------------------------


def test_missing_segment_listed_in_manifest_warns_and_the_rest_loads(sink_two_sessions: tuple) -> None:
    root, first, events_a, second, events_b = sink_two_sessions
    (root / "segment-000002.jsonl").unlink()
    sessions = {s.summary.session_id: s for s in load_telemetry_sessions(root)}
    a, b = sessions[first], sessions[second]
    assert a.events == events_a[:3] + events_a[6:]
    assert len(a.warnings) == 1 and "segment-000002.jsonl" in a.warnings[0]
    assert b.events == events_b and b.warnings == []
    # What is left cannot prove a clean stop (it used to stay "completed" with a warning only).
    assert (a.summary.status, a.missing_segments) == ("incomplete", 1)
    assert (b.summary.status, b.missing_segments) == ("completed", 0)


def test_missing_segments_count_across_a_run_directory(tmp_path: Path, session_id: str) -> None:
    run = tmp_path / "run"
    for rank in (0, 1):
        sink = TelemetrySink(run / "telemetry" / f"rank{rank}", SinkConfig(rollover_max_events=2))
        sink.start_session(SessionSummary(session_id=session_id, status="running", started_at_ns=1, rank=rank,
                                          world_size=2))
        for i in range(5):
            sink.append(make_event(session_id, i, rank=rank, world_size=2))
        sink.close()
    (run / "telemetry" / "rank1" / "segment-000001.jsonl").unlink()
    (run / "telemetry" / "rank1" / "segment-000002.jsonl").unlink()
    [merged] = load_telemetry_sessions(run)
    assert (merged.summary.status, merged.missing_segments, merged.summary.event_count) == ("incomplete", 2, 6)


def test_files_without_a_manifest_are_incomplete(sink_two_sessions: tuple) -> None:
    root, first, events_a, second, events_b = sink_two_sessions
    (root / "manifest.json").unlink()
    sessions = load_telemetry_sessions(root)
    assert {(s.summary.session_id, s.summary.status, s.summary.event_count) for s in sessions} == {
        (first, "incomplete", 7), (second, "incomplete", 2),
    }
    a = next(s for s in sessions if s.summary.session_id == first)
    assert a.events == events_a
    assert a.summary.started_at_ns == events_a[0].timestamp_ns


def test_segment_not_in_manifest_is_incomplete(sink_two_sessions: tuple) -> None:
    root, first, events_a, second, events_b = sink_two_sessions
    orphan = [make_event("00000000-0000-4000-8000-00000000beef", i) for i in range(2)]
    (root / "segment-000009.jsonl").write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in orphan))
    sessions = {s.summary.session_id: s for s in load_telemetry_sessions(root)}
    assert sessions[orphan[0].session_id].summary.status == "incomplete"
    assert sessions[orphan[0].session_id].events == orphan
    assert sessions[first].summary.status == sessions[second].summary.status == "completed"


@pytest.mark.real
def test_running_ledger_entry_status_depends_on_its_writer(tmp_path: Path) -> None:
    dead = kill_writer(tmp_path / "dead", 3)
    assert overview(load_telemetry_sessions(tmp_path / "dead")) == [(dead, "incomplete", 3)]

    live = TelemetrySink(tmp_path / "live", SinkConfig(flush_every_events=1))
    session = live.start_session()
    live.append(make_event(session.session_id))
    assert overview(load_telemetry_sessions(tmp_path / "live")) == [(session.session_id, "running", 1)]
    # the same ledger entry claimed by a process on another host proves nothing here
    edit_manifest(tmp_path / "live", lambda m: m["sessions"][0].update(host="some-other-host"))
    assert overview(load_telemetry_sessions(tmp_path / "live"))[0][1] == "incomplete"
    # a pid that cannot exist on this host
    edit_manifest(tmp_path / "live", lambda m: m["sessions"][0].update(host=socket.gethostname(), pid=2**40))
    assert overview(load_telemetry_sessions(tmp_path / "live"))[0][1] == "incomplete"
    live.close()


def test_ledger_session_without_records_is_listed(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path)
    empty = sink.start_session()
    sink.close()
    sid, events = write_session(tmp_path, 2)
    sessions = load_telemetry_sessions(tmp_path)
    assert overview(sessions) == [(sid, "completed", 2), (empty.session_id, "completed", 0)]


# -- default and explicit selection ------------------------------------------------------------


@pytest.mark.real
def test_default_selection_order(tmp_path: Path) -> None:
    old_done, _ = write_session(tmp_path, 2)
    new_done, new_events = write_session(tmp_path, 2)
    killed = kill_writer(tmp_path, 2)
    TelemetrySink(tmp_path)  # recovers `killed` as interrupted
    orphan = [make_event("00000000-0000-4000-8000-00000000f00d", i) for i in range(2)]
    (tmp_path / "segment-000009.jsonl").write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in orphan))

    sessions = load_telemetry_sessions(tmp_path)
    assert [(s.summary.session_id, s.summary.status) for s in sessions] == [
        (new_done, "completed"),
        (old_done, "completed"),
        (killed, "interrupted"),
        (orphan[0].session_id, "incomplete"),
    ]
    assert load_telemetry_events(tmp_path) == new_events


@pytest.mark.real
def test_default_prefers_interrupted_over_newer_incomplete(tmp_path: Path) -> None:
    killed = kill_writer(tmp_path, 2)
    TelemetrySink(tmp_path)
    orphan = [make_event("00000000-0000-4000-8000-00000000f00d", i) for i in range(3)]
    (tmp_path / "segment-000009.jsonl").write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in orphan))
    assert [s.summary.status for s in load_telemetry_sessions(tmp_path)] == ["interrupted", "incomplete"]
    assert [e.session_id for e in load_telemetry_events(tmp_path)] == [killed, killed]


def test_session_id_selection_and_unknown_id(sink_two_sessions: tuple) -> None:
    root, first, events_a, second, events_b = sink_two_sessions
    assert load_telemetry_events(root, session_id=second) == events_b
    with pytest.raises(ArtifactError) as info:
        load_telemetry_events(root, session_id="no-such-session")
    message = str(info.value)
    assert "no-such-session" in message and first in message and second in message


# -- properties --------------------------------------------------------------------------------

_int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_nonneg = st.integers(min_value=0, max_value=2**63 - 1)
_text = st.text(max_size=12)
_name = st.text(min_size=1, max_size=12)
_json_leaf = st.none() | st.booleans() | _int64 | st.floats(allow_nan=False, allow_infinity=False) | _text
_json = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def v3_records(draw: Any, session_id: str) -> dict[str, Any]:
    world = draw(st.integers(min_value=1, max_value=64))
    return {
        "schema_version": 3,
        "session_id": session_id,
        "timestamp_ns": draw(st.integers(min_value=0, max_value=50) | _nonneg),
        "event_type": draw(st.sampled_from(["sample", "start", "stop", "peak", "phase_enter"]) | _name),
        "collector": draw(_name),
        "sampling_interval_ms": draw(_nonneg),
        "pid": draw(st.integers(min_value=-1, max_value=2**31)),
        "host": draw(_name),
        "device_id": draw(_int64),
        "allocator_allocated_bytes": draw(_nonneg),
        "allocator_reserved_bytes": draw(_nonneg),
        "allocator_active_bytes": draw(st.none() | _nonneg),
        "allocator_inactive_bytes": draw(st.none() | _nonneg),
        "allocator_change_bytes": draw(_int64),
        "device_used_bytes": draw(_nonneg),
        "device_free_bytes": draw(st.none() | _nonneg),
        "device_total_bytes": draw(st.none() | _nonneg),
        "context": draw(st.none() | _text),
        "metadata": draw(st.dictionaries(_text, _json, max_size=3)),
        "job_id": draw(st.none() | _text),
        "rank": draw(st.integers(min_value=0, max_value=world - 1)),
        "local_rank": draw(st.integers(min_value=0, max_value=world - 1)),
        "world_size": world,
    }


_SID = "00000000-0000-4000-8000-00000000a11a"
_sink_configs = st.builds(
    SinkConfig,
    flush_every_events=st.integers(min_value=1, max_value=8),
    flush_every_seconds=st.just(3600.0),
    fsync=st.sampled_from(["close", "never"]),
    rollover_max_events=st.integers(min_value=1, max_value=10),
    rollover_max_bytes=st.integers(min_value=1, max_value=4000),
    retention_max_files=st.just(10_000),
    retention_max_total_bytes=st.just(1 << 40),
)


@PROPERTY
@given(records=st.lists(v3_records(_SID), max_size=25), config=_sink_configs, as_mapping=st.booleans())
def test_property_events_written_through_the_sink_load_back_equal(
    records: list[dict[str, Any]], config: SinkConfig, as_mapping: bool
) -> None:
    events = [msgspec.convert(r, TelemetryEventV3) for r in records]
    with tempfile.TemporaryDirectory() as d:
        sink = TelemetrySink(d, config)
        sink.start_session(SessionSummary(session_id=_SID, status="running", started_at_ns=1))
        for record, event in zip(records, events):
            sink.append(record if as_mapping else event)
        sink.close()
        sessions = load_telemetry_sessions(d)
        assert [(s.summary.session_id, s.summary.status) for s in sessions] == [(_SID, "completed")]
        expected = sorted(events, key=lambda e: e.timestamp_ns)
        assert sessions[0].events == expected
        assert sessions[0].summary.event_count == len(events)
        assert load_telemetry_events(d) == expected


def _fixed_sink(root: Path) -> tuple[list[TelemetryEventV3], list[TelemetryEventV3]]:
    """Session A: 5 records in 2 segments; session B: 4 records, in segments 3 and 4 (3 + 1)."""
    config = SinkConfig(rollover_max_events=3)
    _, a = write_session(root, 5, config)
    _, b = write_session(root, 4, config)
    return a, b


@pytest.fixture(scope="module")
def fixed_sink_bytes() -> tuple[dict[str, bytes], list, list]:
    with tempfile.TemporaryDirectory() as d:
        a, b = _fixed_sink(Path(d))
        return {p.name: p.read_bytes() for p in Path(d).iterdir()}, a, b


@pytest.mark.parametrize("last_segment_of_b", [1, 2])
def test_property_truncated_last_segment(fixed_sink_bytes: tuple, last_segment_of_b: int) -> None:
    files, a, b = fixed_sink_bytes
    if last_segment_of_b == 1:  # B written in one segment only: drop its second segment
        files = {**files}
        manifest = json.loads(files["manifest.json"])
        manifest["segments"] = manifest["segments"][:3]
        files["manifest.json"] = json.dumps(manifest).encode()
        del files["segment-000004.jsonl"]
        b_before, last_name = [], "segment-000003.jsonl"
    else:
        b_before, last_name = b[:3], "segment-000004.jsonl"
    last = files[last_name]

    @PROPERTY
    @given(cut=st.integers(min_value=0, max_value=len(last)))
    def check(cut: int) -> None:
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            for name, data in files.items():
                (root / name).write_bytes(data)
            (root / last_name).write_bytes(last[:cut])
            kept = last[:cut]
            complete = kept.count(b"\n")
            tail = kept[kept.rfind(b"\n") + 1:]
            line_ends = [i for i, ch in enumerate(last) if ch == 0x0A]
            if tail and cut in line_ends:
                complete += 1  # the JSON is whole; only its newline is missing
                tail = b""
            ordered = b_before + sorted(b[len(b_before):], key=lambda e: e.timestamp_ns)
            sessions = {s.summary.session_id: s for s in load_telemetry_sessions(root)}
            loaded_b = sessions[b[0].session_id]
            assert loaded_b.events == b_before + ordered[len(b_before):len(b_before) + complete]
            assert loaded_b.torn_lines == (1 if tail else 0)
            assert sessions[a[0].session_id].events == a
            assert sessions[a[0].session_id].torn_lines == 0
            assert loaded_b.summary.status == "completed"

    check()


# (c) anything at all on disk: results or ArtifactError, never another exception

_record_keys = list(make_record()) + ["timestamp", "memory_mb", "device", "type", "memory_allocated", "metadata_x"]


@st.composite
def mutated_records(draw: Any) -> Any:
    record: dict[str, Any] = make_record()
    version = draw(st.sampled_from([2, 3, 4, None, "absent"]))
    if version == "absent":
        del record["schema_version"]
    else:
        record["schema_version"] = version
    for key in draw(st.lists(st.sampled_from(_record_keys), max_size=4)):
        if draw(st.booleans()):
            record[key] = draw(_json)
        else:
            record.pop(key, None)
    return record


_documents = st.one_of(
    _json,
    st.lists(mutated_records(), max_size=4),
    st.builds(lambda rs: {"events": rs}, st.lists(mutated_records(), max_size=3)),
    st.builds(
        lambda rs, summary: {"telemetry_events": rs, "session_summary": summary},
        st.lists(mutated_records(), max_size=3),
        _json | st.fixed_dictionaries({"session_id": _text, "status": _json, "started_at_ns": _json}),
    ),
    mutated_records(),
)


def _load_anything(path: Path) -> None:
    try:
        sessions = load_telemetry_sessions(path)
    except ArtifactError:
        return
    for loaded in sessions:
        assert all(isinstance(e, TelemetryEventV3) for e in loaded.events)
    try:
        load_telemetry_events(path)
    except ArtifactError:
        pass


@FUZZ
@given(data=st.binary(max_size=400), name=st.sampled_from(["x.json", "x.jsonl", "manifest.json", "segment-000001.jsonl"]))
def test_property_random_bytes_never_escape_as_other_errors(data: bytes, name: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_bytes(data)
        _load_anything(path)
        _load_anything(Path(d))


@FUZZ
@given(document=_documents, as_lines=st.booleans())
def test_property_random_json_never_escapes_as_other_errors(document: Any, as_lines: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        if as_lines and isinstance(document, list):
            path = Path(d) / "x.jsonl"
            path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in document))
        else:
            path = Path(d) / "x.json"
            path.write_bytes(msgspec.json.encode(document))
        _load_anything(path)


_manifest_sessions = st.lists(
    st.fixed_dictionaries(
        {"session_id": _text, "status": st.sampled_from(["running", "completed", "interrupted", "incomplete"])},
        optional={
            "started_at_ns": _json | _int64, "host": st.just(socket.gethostname()) | _json,
            "pid": st.integers() | _json, "ended_at_ns": _json, "rank": _json,
        },
    ),
    max_size=3,
)
_manifest_segments = st.lists(
    st.fixed_dictionaries(
        {"filename": st.sampled_from(["segment-000001.jsonl", "segment-000002.jsonl", "", ".", "x/../y", "manifest.json"]) | _text},
        optional={"event_count": _json, "size_bytes": _json, "closed": _json, "session_id": _json},
    ),
    max_size=3,
)


@FUZZ
@given(
    manifest=st.fixed_dictionaries({"sessions": _manifest_sessions, "segments": _manifest_segments}) | _json,
    with_segment=st.booleans(),
)
def test_property_random_manifest_never_escapes_as_other_errors(manifest: Any, with_segment: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "manifest.json").write_bytes(msgspec.json.encode(manifest))
        if with_segment:
            event = make_event("00000000-0000-4000-8000-000000000001")
            (root / "segment-000001.jsonl").write_bytes(msgspec.json.encode(event) + b"\n")
        _load_anything(root)
        _load_anything(root / "manifest.json")
        if with_segment:
            _load_anything(root / "segment-000001.jsonl")
