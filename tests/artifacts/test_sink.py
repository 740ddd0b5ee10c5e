"""TelemetrySink: layout, rollover, retention, flush policy, validation and recovery.

Everything here writes real files; crashed writers are real processes killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.artifacts.manifest import MANIFEST_FORMAT
from stepwatch.artifacts.sink import RecordNotEncodable, SinkConfig, TelemetrySink
from stepwatch.errors import ArtifactError, ConfigError, StepwatchError, ValidationError
from stepwatch.schema import SessionSummary, json_schema, telemetry_event_to_dict
from stepwatch.telemetry import load_telemetry_events, load_telemetry_sessions
from tests.support import examples
from tests.support.records import make_event, make_record

REPO = Path(__file__).resolve().parents[2]
LEDGER_KEYS = {
    "session_id", "status", "started_at_ns", "ended_at_ns", "host", "pid",
    "job_id", "rank", "local_rank", "world_size", "source",
}
SEGMENT_KEYS = {"filename", "event_count", "size_bytes", "closed", "session_id"}


# -- helpers -----------------------------------------------------------------------------------


def read_manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_bytes())


def segment_files(root: Path) -> list[Path]:
    return sorted(root.glob("segment-*.jsonl"))


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def fixed_size_event(session_id: str, ts: int) -> object:
    """Events of identical encoded size (same digit counts everywhere)."""
    return make_event(session_id, 0, timestamp_ns=ts, metadata={"i": 0})


def encoded_size(event: object) -> int:
    return len(msgspec.json.encode(event)) + 1


# A writer that dies without closing: appends `total` records, flushes after the first
# `flushed`, prints its session id, then SIGKILLs itself.
_DYING_WRITER = r"""
import os, signal, socket, sys, time
from stepwatch.artifacts.sink import RecordNotEncodable, SinkConfig, TelemetrySink
from stepwatch.schema import TelemetryEventV3
root, total, flushed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sink = TelemetrySink(root, SinkConfig(flush_every_events=10_000, flush_every_seconds=3600.0))
session = sink.start_session()
for i in range(total):
    sink.append(TelemetryEventV3(
        schema_version=3, session_id=session.session_id, timestamp_ns=time.time_ns(),
        event_type="sample", collector="stepwatch.cpu_tracker", sampling_interval_ms=10,
        pid=os.getpid(), host=socket.gethostname(), device_id=-1,
        allocator_allocated_bytes=i, allocator_reserved_bytes=i, allocator_active_bytes=None,
        allocator_inactive_bytes=None, allocator_change_bytes=0, device_used_bytes=i,
        device_free_bytes=None, device_total_bytes=None, context=None, metadata={"i": i}))
    if i + 1 == flushed:
        sink.flush()
print(session.session_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def kill_writer(root: Path, total: int, flushed: int) -> str:
    """Runs a writer that is SIGKILLed with `total - flushed` records still buffered."""
    proc = subprocess.run(
        [sys.executable, "-c", _DYING_WRITER, str(root), str(total), str(flushed)],
        cwd=REPO, capture_output=True, timeout=60,
    )
    assert proc.returncode == -9, proc.stderr.decode()
    return proc.stdout.decode().strip()


def write_session(root: Path, n: int, config: SinkConfig | None = None) -> tuple[str, list]:
    sink = TelemetrySink(root, config)
    session = sink.start_session()
    events = [make_event(session.session_id, i) for i in range(n)]
    for event in events:
        sink.append(event)
    sink.close()
    return session.session_id, events


# -- layout ------------------------------------------------------------------------------------


def test_start_append_close_writes_manifest_and_one_record_per_line(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path)
    session = sink.start_session()
    assert session.status == "running"
    events = [make_event(session.session_id, i) for i in range(5)]
    for event in events:
        sink.append(event)
    finished = sink.close()

    assert finished is not None and finished.status == "completed"
    assert finished.ended_at_ns is not None and finished.ended_at_ns >= finished.started_at_ns
    manifest = read_manifest(tmp_path)
    assert manifest["schema_version"] == 2
    assert manifest["format"] == MANIFEST_FORMAT == "stepwatch.append_only_telemetry_sink"
    [ledger] = manifest["sessions"]
    assert set(ledger) == LEDGER_KEYS
    assert ledger["session_id"] == session.session_id
    assert ledger["status"] == "completed"
    assert ledger["pid"] == os.getpid()
    assert ledger["started_at_ns"] <= ledger["ended_at_ns"]
    [segment] = manifest["segments"]
    assert set(segment) == SEGMENT_KEYS
    path = tmp_path / "segment-000001.jsonl"
    assert segment == {
        "filename": "segment-000001.jsonl",
        "event_count": 5,
        "size_bytes": path.stat().st_size,
        "closed": True,
        "session_id": session.session_id,
    }
    assert manifest["pruned_segment_count"] == 0 and manifest["pruned_bytes"] == 0
    data = path.read_bytes()
    assert data.endswith(b"\n")
    lines = data.splitlines()
    assert len(lines) == 5
    schema = json_schema(3)
    for line, event in zip(lines, events):
        record = json.loads(line)
        jsonschema.validate(record, schema)
        assert record == telemetry_event_to_dict(event)
    # no temp files left behind by the atomic manifest writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "segment-000001.jsonl"]
    assert load_telemetry_events(tmp_path) == events


def test_each_session_gets_its_own_segment(tmp_path: Path) -> None:
    first, events_a = write_session(tmp_path, 3)
    second, events_b = write_session(tmp_path, 2)
    manifest = read_manifest(tmp_path)
    assert [(s["filename"], s["session_id"], s["event_count"]) for s in manifest["segments"]] == [
        ("segment-000001.jsonl", first, 3),
        ("segment-000002.jsonl", second, 2),
    ]
    assert [s["status"] for s in manifest["sessions"]] == ["completed", "completed"]
    assert load_telemetry_events(tmp_path, session_id=first) == events_a
    assert load_telemetry_events(tmp_path, session_id=second) == events_b


def test_context_manager_completes_or_interrupts(tmp_path: Path) -> None:
    with TelemetrySink(tmp_path / "ok") as sink:
        ok_id = sink.session.session_id
        sink.append(make_event(ok_id))
    with pytest.raises(RuntimeError, match="boom"):
        with TelemetrySink(tmp_path / "bad") as sink:
            bad_id = sink.session.session_id
            sink.append(make_event(bad_id))
            raise RuntimeError("boom")
    assert read_manifest(tmp_path / "ok")["sessions"][0]["status"] == "completed"
    bad = read_manifest(tmp_path / "bad")["sessions"][0]
    assert bad["session_id"] == bad_id and bad["status"] == "interrupted"
    assert len(lines_of(tmp_path / "bad" / "segment-000001.jsonl")) == 1


def test_append_outside_a_session_is_rejected(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path)
    with pytest.raises(ArtifactError, match="start_session"):
        sink.append(make_event("00000000-0000-4000-8000-00000000000a"))
    session = sink.start_session()
    sink.append(make_event(session.session_id))
    sink.close()
    with pytest.raises(ArtifactError):
        sink.append(make_event(session.session_id))
    assert sink.close() is None  # closing twice is harmless
    assert len(lines_of(tmp_path / "segment-000001.jsonl")) == 1


def test_record_of_another_session_is_rejected(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path)
    session = sink.start_session()
    sink.append(make_event(session.session_id, 1))
    with pytest.raises(ArtifactError) as info:
        sink.append(make_event("00000000-0000-4000-8000-0000000000ff", 2))
    assert info.value.field == "$.session_id"
    assert "00000000-0000-4000-8000-0000000000ff" in str(info.value)
    with pytest.raises(ArtifactError):
        sink.append(make_record(session_id="someone-else"))
    sink.append(make_event(session.session_id, 3))
    sink.close()
    events = load_telemetry_events(tmp_path)
    assert [e.metadata["i"] for e in events] == [1, 3]
    assert {e.session_id for e in events} == {session.session_id}


# -- batched encoding and background sync ------------------------------------------------------


def test_a_record_that_cannot_be_encoded_is_dropped_and_its_error_raised(tmp_path: Path) -> None:
    """Records are encoded per batch: a bad one is dropped there, the rest of the batch kept."""
    sink = TelemetrySink(tmp_path, SinkConfig(flush_every_events=1000, flush_every_seconds=3600.0))
    session = sink.start_session()
    sid = session.session_id
    sink.append(make_event(sid, 0))
    sink.append(make_event(sid, 1, metadata={"handle": object()}))  # msgspec cannot encode it
    sink.append(make_event(sid, 2))
    with pytest.raises(TypeError):
        sink.flush()
    assert len(lines_of(tmp_path / "segment-000001.jsonl")) == 2
    sink.append(make_event(sid, 3, metadata={"handle": object()}))
    with pytest.raises(TypeError):
        sink.close()  # the session is still closed and the manifest written
    assert read_manifest(tmp_path)["sessions"][0]["status"] == "completed"
    assert [e.metadata["i"] for e in load_telemetry_events(tmp_path)] == [0, 2]


def test_unencodable_records_are_counted_and_raised_as_one_clear_error(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path, SinkConfig(flush_every_events=1000, flush_every_seconds=3600.0))
    sid = sink.start_session().session_id
    deep: list = []
    for _ in range(100_000):  # msgspec raises RecursionError: it used to escape and lose the batch
        deep = [deep]
    sink.append(make_event(sid, 0))
    sink.append(make_event(sid, 1, metadata={"ok": 1, "handle": {"inner": object()}}))
    sink.append(make_event(sid, 2, metadata={"deep": deep}))
    sink.append(make_event(sid, 3))
    with pytest.raises(RecordNotEncodable) as info:
        sink.flush()
    error = info.value
    assert isinstance(error, ValidationError) and isinstance(error, TypeError)
    assert (error.field, error.dropped) == ("$.metadata.handle.inner", 2)
    assert "cannot be encoded as JSON" in str(error) and "dropped" in str(error)
    assert sink.unencodable_dropped == 2
    sink.append(make_event(sid, 4))
    sink.close()
    segment = tmp_path / "segment-000001.jsonl"
    assert [json.loads(line)["metadata"]["i"] for line in lines_of(segment)] == [0, 3, 4]
    assert [e.metadata["i"] for e in load_telemetry_events(tmp_path)] == [0, 3, 4]


# A writer whose disk fills up mid-write (RLIMIT_FSIZE: the write crossing the limit is cut
# short, the next one fails with EFBIG), that then gets room again and goes on writing.
_FULL_DISK_WRITER = r"""
import errno, resource, signal, sys
from stepwatch.artifacts.sink import RecordNotEncodable, SinkConfig, TelemetrySink
from tests.support.records import make_event
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
sink = TelemetrySink(sys.argv[1], SinkConfig(flush_every_events=3, flush_every_seconds=3600.0))
sid = sink.start_session().session_id
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), hard))
failed = dropped = 0
for i in range(30):
    try:
        sink.append(make_event(sid, i))
    except OSError as exc:
        assert exc.errno == errno.EFBIG, exc
        failed += 1
        dropped += sink.discard_buffer()  # what the runtime does
        if failed == 2:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
sink.close()
print(failed, dropped)
"""


@pytest.mark.real
def test_a_write_cut_short_never_leaves_a_partial_line_in_the_segment(tmp_path: Path) -> None:
    line = encoded_size(make_event("00000000-0000-4000-8000-000000000001", 10))
    limit = 4 * line + line // 2  # the second flush of three records breaks off mid-record
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK_WRITER, str(tmp_path), str(limit)],
                          cwd=REPO, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    failed, dropped = map(int, proc.stdout.split())
    assert failed == 2 and dropped > 0
    records = [json.loads(raw) for path in segment_files(tmp_path) for raw in lines_of(path)]
    assert len(records) == 30 - dropped  # every line whole: the cut-off bytes were taken back
    [loaded] = load_telemetry_sessions(tmp_path)
    assert loaded.summary.status == "completed" and loaded.summary.event_count == 30 - dropped
    assert loaded.torn_lines == 0


def test_discard_buffer_counts_pending_and_encoded_records(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path, SinkConfig(flush_every_events=1000, flush_every_seconds=3600.0))
    session = sink.start_session()
    for i in range(300):  # more than one encoding batch: some encoded, some still pending
        sink.append(make_event(session.session_id, i))
    assert sink.discard_buffer() == 300
    sink.close()
    assert lines_of(tmp_path / "segment-000001.jsonl") == []


def test_rolled_over_segments_synced_in_the_background_are_whole_after_close(tmp_path: Path) -> None:
    pad = "x" * 1000  # ~1.6 kB records: 1,000 of them pass the background-sync size
    config = SinkConfig(flush_every_events=1000, rollover_max_events=1000, fsync="close",
                        retention_max_files=100, flush_every_seconds=3600.0)
    sink = TelemetrySink(tmp_path, config)
    session = sink.start_session()
    for i in range(3500):
        sink.append(make_event(session.session_id, i, context=pad))
    sink.close()
    assert not any(t.name == "stepwatch-sink-sync" for t in threading.enumerate())
    assert [len(lines_of(p)) for p in segment_files(tmp_path)] == [1000, 1000, 1000, 500]
    assert load_telemetry_sessions(tmp_path)[0].summary.event_count == 3500


# -- mappings are validated --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rank": 2, "world_size": 2}, "$.rank"),
        ({"allocator_allocated_bytes": -1}, "$.allocator_allocated_bytes"),
        ({"metadata": ["not", "an", "object"]}, "$.metadata"),
        ({"bogus_field": 1}, "$.bogus_field"),
        ({"timestamp_ns": 1.5}, "$.timestamp_ns"),
        ({"collector": ""}, "$.collector"),
        ({"schema_version": 7}, "$.schema_version"),
        ({"schema_version": None}, "$.schema_version"),
    ],
)
def test_bad_mapping_names_the_field_and_loses_nothing(tmp_path: Path, change: dict, field: str) -> None:
    sink = TelemetrySink(tmp_path, SinkConfig(flush_every_events=2))
    session = sink.start_session()
    sid = session.session_id
    good = [make_record(session_id=sid, timestamp_ns=1_000 + i, metadata={"i": i}) for i in range(3)]
    sink.append(good[0])
    sink.append(good[1])  # flushed (flush_every_events=2)
    sink.append(good[2])  # buffered
    with pytest.raises(ValidationError) as info:
        sink.append(make_record(session_id=sid, **change))
    assert info.value.field == field
    assert isinstance(info.value, StepwatchError) and isinstance(info.value, ValueError)
    sink.close()
    assert [json.loads(line) for line in lines_of(tmp_path / "segment-000001.jsonl")] == good
    assert read_manifest(tmp_path)["segments"][0]["event_count"] == 3


def test_mapping_without_schema_version_is_not_converted_as_legacy(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path)
    session = sink.start_session()
    record = make_record(session_id=session.session_id)
    del record["schema_version"]
    with pytest.raises(ValidationError) as info:
        sink.append(record)
    assert info.value.field == "$.schema_version"
    sink.close()
    assert (tmp_path / "segment-000001.jsonl").read_bytes() == b""


def test_valid_mapping_is_written_canonically(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path)
    session = sink.start_session()
    record = make_record(session_id=session.session_id, rank=1, world_size=4, job_id="job-7")
    sink.append(record)
    sink.close()
    assert [json.loads(line) for line in lines_of(tmp_path / "segment-000001.jsonl")] == [record]


# -- rollover ----------------------------------------------------------------------------------


@pytest.mark.parametrize("flush_every", [1, 3, 100])
def test_rollover_by_events(tmp_path: Path, flush_every: int) -> None:
    config = SinkConfig(flush_every_events=flush_every, rollover_max_events=4)
    sid, events = write_session(tmp_path, 10, config)
    manifest = read_manifest(tmp_path)
    assert [(s["filename"], s["event_count"], s["closed"]) for s in manifest["segments"]] == [
        ("segment-000001.jsonl", 4, True),
        ("segment-000002.jsonl", 4, True),
        ("segment-000003.jsonl", 2, True),
    ]
    for entry in manifest["segments"]:
        path = tmp_path / entry["filename"]
        assert len(lines_of(path)) == entry["event_count"]
        assert path.stat().st_size == entry["size_bytes"]
        assert entry["session_id"] == sid
    assert load_telemetry_events(tmp_path) == events


@pytest.mark.parametrize("flush_every", [1, 2, 100])
def test_rollover_by_bytes_never_exceeds_the_bound(tmp_path: Path, flush_every: int) -> None:
    probe = fixed_size_event("00000000-0000-4000-8000-000000000001", time.time_ns())
    size = encoded_size(probe)
    bound = size * 3 + size // 2  # room for three records and a half
    sink = TelemetrySink(tmp_path, SinkConfig(flush_every_events=flush_every, rollover_max_bytes=bound))
    session = sink.start_session()
    events = [fixed_size_event(session.session_id, time.time_ns() + i) for i in range(10)]
    assert {encoded_size(e) for e in events} == {size}
    for event in events:
        sink.append(event)
        for entry in read_manifest(tmp_path)["segments"]:
            assert entry["size_bytes"] <= bound
        for path in segment_files(tmp_path):
            assert path.stat().st_size <= bound
    sink.close()
    manifest = read_manifest(tmp_path)
    assert [s["event_count"] for s in manifest["segments"]] == [3, 3, 3, 1]
    assert all(s["size_bytes"] <= bound for s in manifest["segments"])
    assert load_telemetry_events(tmp_path) == events


def test_rollover_at_the_exact_byte_bound(tmp_path: Path) -> None:
    probe = fixed_size_event("00000000-0000-4000-8000-000000000001", time.time_ns())
    size = encoded_size(probe)
    sink = TelemetrySink(tmp_path, SinkConfig(flush_every_events=100, rollover_max_bytes=2 * size))
    session = sink.start_session()
    for i in range(5):
        sink.append(fixed_size_event(session.session_id, time.time_ns() + i))
    sink.close()
    sizes = [(s["event_count"], s["size_bytes"]) for s in read_manifest(tmp_path)["segments"]]
    assert sizes == [(2, 2 * size), (2, 2 * size), (1, size)]


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pads=st.lists(st.integers(min_value=0, max_value=400), min_size=1, max_size=40),
    slack=st.integers(min_value=0, max_value=1500),
    flush_every=st.integers(min_value=1, max_value=12),
    max_events=st.integers(min_value=1, max_value=15),
)
def test_segments_never_exceed_either_bound(pads: list[int], slack: int, flush_every: int, max_events: int) -> None:
    sid = "00000000-0000-4000-8000-000000000042"
    events = [make_event(sid, i, timestamp_ns=10_000 + i, metadata={"pad": "x" * pad}) for i, pad in enumerate(pads)]
    bound = max(encoded_size(e) for e in events) + slack
    config = SinkConfig(
        flush_every_events=flush_every,
        flush_every_seconds=3600.0,
        rollover_max_bytes=bound,
        rollover_max_events=max_events,
        retention_max_files=10_000,
        retention_max_total_bytes=1 << 40,
    )
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        sink = TelemetrySink(root, config)
        sink.start_session(SessionSummary(session_id=sid, status="running", started_at_ns=1))
        for event in events:
            sink.append(event)
        sink.close()
        manifest = read_manifest(root)
        for entry in manifest["segments"]:
            path = root / entry["filename"]
            assert path.stat().st_size == entry["size_bytes"] <= bound
            assert len(lines_of(path)) == entry["event_count"] <= max_events
        assert sum(s["event_count"] for s in manifest["segments"]) == len(events)
        assert load_telemetry_events(root) == events


# -- retention ---------------------------------------------------------------------------------


def test_retention_by_file_count_prunes_oldest_closed(tmp_path: Path) -> None:
    config = SinkConfig(flush_every_events=1, rollover_max_events=2, retention_max_files=3)
    sink = TelemetrySink(tmp_path, config)
    session = sink.start_session()
    events = [make_event(session.session_id, i) for i in range(13)]
    for event in events:
        sink.append(event)
        files = segment_files(tmp_path)
        assert len(files) <= 3
        listed = [s["filename"] for s in read_manifest(tmp_path)["segments"]]
        assert listed == [p.name for p in files]
    sink.close()
    manifest = read_manifest(tmp_path)
    # 13 events, 2 per segment: segments 1..7 were created; 1..4 pruned, the newest three kept.
    assert [s["filename"] for s in manifest["segments"]] == [
        "segment-000005.jsonl", "segment-000006.jsonl", "segment-000007.jsonl",
    ]
    assert manifest["pruned_segment_count"] == 4
    assert manifest["pruned_bytes"] == sum(encoded_size(e) for e in events[:8])
    assert load_telemetry_events(tmp_path) == events[8:]


@pytest.mark.parametrize(("per_segment", "total"), [(2, 5), (4, 5), (3, 7), (1, 1)])
def test_retention_by_total_size_holds_after_every_flush(tmp_path: Path, per_segment: int, total: int) -> None:
    probe = fixed_size_event("00000000-0000-4000-8000-000000000001", time.time_ns())
    size = encoded_size(probe)
    config = SinkConfig(
        flush_every_events=1,
        rollover_max_bytes=per_segment * size,
        retention_max_files=100,
        retention_max_total_bytes=total * size,
    )
    sink = TelemetrySink(tmp_path, config)
    session = sink.start_session()
    events = [fixed_size_event(session.session_id, time.time_ns() + i) for i in range(12)]
    for event in events:
        sink.append(event)
        on_disk = sum(p.stat().st_size for p in segment_files(tmp_path))
        assert on_disk <= total * size
        manifest = read_manifest(tmp_path)
        assert sum(s["size_bytes"] for s in manifest["segments"]) == on_disk
    sink.close()
    manifest = read_manifest(tmp_path)
    kept = sum(s["event_count"] for s in manifest["segments"])
    assert manifest["pruned_bytes"] == (12 - kept) * size
    assert manifest["pruned_segment_count"] * per_segment == 12 - kept
    assert load_telemetry_events(tmp_path) == events[12 - kept:]


def test_retention_never_prunes_the_current_segment(tmp_path: Path) -> None:
    config = SinkConfig(flush_every_events=1, rollover_max_events=3, retention_max_files=1)
    sink = TelemetrySink(tmp_path, config)
    session = sink.start_session()
    events = [make_event(session.session_id, i) for i in range(10)]
    for n, event in enumerate(events, start=1):
        sink.append(event)
        files = segment_files(tmp_path)
        assert len(files) == 1
        kept = n % 3
        current = read_manifest(tmp_path)["segments"][-1]
        assert current["closed"] is False and current["filename"] == files[0].name
        assert len(lines_of(files[0])) == kept
    sink.close()
    manifest = read_manifest(tmp_path)
    assert manifest["pruned_segment_count"] == 3
    assert load_telemetry_events(tmp_path) == events[9:]


def test_retention_holds_across_sessions(tmp_path: Path) -> None:
    config = SinkConfig(flush_every_events=1, retention_max_files=3)
    ids = [write_session(tmp_path, 2, config)[0] for _ in range(6)]
    files = segment_files(tmp_path)
    assert len(files) <= 3
    manifest = read_manifest(tmp_path)
    assert [s["session_id"] for s in manifest["segments"]] == ids[-len(files):]
    assert manifest["pruned_segment_count"] == 6 - len(files)
    # the ledger still knows every session, even those whose records were pruned
    assert [s["session_id"] for s in manifest["sessions"]] == ids


# -- flush policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("fsync", ["flush", "close", "never"])
def test_records_are_on_disk_after_flush(tmp_path: Path, fsync: str) -> None:
    config = SinkConfig(fsync=fsync, flush_every_events=1000, flush_every_seconds=3600.0)
    sink = TelemetrySink(tmp_path, config)
    session = sink.start_session()
    events = [make_event(session.session_id, i) for i in range(3)]
    for event in events:
        sink.append(event)
    segment = tmp_path / "segment-000001.jsonl"
    assert segment.read_bytes() == b""  # buffered
    assert read_manifest(tmp_path)["sessions"][0]["status"] == "running"
    sink.flush()
    assert len(lines_of(segment)) == 3
    assert read_manifest(tmp_path)["segments"][0]["event_count"] == 3
    assert load_telemetry_events(tmp_path) == events  # a reader sees them while it runs
    sink.flush()  # nothing buffered: a no-op
    assert len(lines_of(segment)) == 3
    sink.append(make_event(session.session_id, 3))
    sink.close()
    assert len(lines_of(segment)) == 4
    assert read_manifest(tmp_path)["sessions"][0]["status"] == "completed"


def test_flush_every_events(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path, SinkConfig(flush_every_events=3, flush_every_seconds=3600.0))
    session = sink.start_session()
    segment = tmp_path / "segment-000001.jsonl"
    counts = []
    for i in range(7):
        sink.append(make_event(session.session_id, i))
        counts.append(len(lines_of(segment)))
    assert counts == [0, 0, 3, 3, 3, 6, 6]
    sink.close()
    assert len(lines_of(segment)) == 7


def test_flush_every_seconds(tmp_path: Path) -> None:
    # fsync="never": a slow disk must not make start-up itself take longer than the interval
    sink = TelemetrySink(tmp_path, SinkConfig(fsync="never", flush_every_events=1000, flush_every_seconds=0.5))
    session = sink.start_session()
    segment = tmp_path / "segment-000001.jsonl"
    sink.append(make_event(session.session_id, 0))
    assert len(lines_of(segment)) == 0
    time.sleep(0.6)
    sink.append(make_event(session.session_id, 1))
    assert len(lines_of(segment)) == 2
    sink.close()


@pytest.mark.real
@pytest.mark.parametrize("fsync", ["flush", "close", "never"])
def test_flushed_records_survive_a_killed_writer(tmp_path: Path, fsync: str) -> None:
    script = _DYING_WRITER.replace(
        "SinkConfig(flush_every_events=10_000", f"SinkConfig(fsync={fsync!r}, flush_every_events=10_000"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), "9", "6"], cwd=REPO, capture_output=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr.decode()
    sid = proc.stdout.decode().strip()
    [loaded] = load_telemetry_sessions(tmp_path)
    assert loaded.summary.session_id == sid
    assert [e.metadata["i"] for e in loaded.events] == list(range(6))


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"flush_every_events": 0}, "flush_every_events"),
        ({"flush_every_seconds": 0}, "flush_every_seconds"),
        ({"flush_every_seconds": -1.0}, "flush_every_seconds"),
        ({"flush_every_seconds": float("nan")}, "flush_every_seconds"),
        ({"fsync": "always"}, "fsync"),
        ({"fsync": True}, "fsync"),
        ({"rollover_max_bytes": 0}, "rollover_max_bytes"),
        ({"rollover_max_events": 0}, "rollover_max_events"),
        ({"retention_max_files": 0}, "retention_max_files"),
        ({"retention_max_total_bytes": 10, "rollover_max_bytes": 100}, "retention_max_total_bytes"),
        ({"flush_every_events": "50"}, "flush_every_events"),
        ({"rollover_max_bytes": None}, "rollover_max_bytes"),
        ({"flush_every_seconds": "2"}, "flush_every_seconds"),
    ],
)
def test_config_rejects_invalid_options(options: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"SinkConfig\.{name}\b"):
        SinkConfig(**options)


def test_config_defaults_match_the_spec() -> None:
    config = SinkConfig()
    assert (config.flush_every_events, config.flush_every_seconds) == (50, 2.0)
    assert (config.rollover_max_bytes, config.rollover_max_events) == (64 * 1024 * 1024, 10_000)
    assert (config.retention_max_files, config.retention_max_total_bytes) == (8, 512 * 1024 * 1024)
    assert config.fsync == "flush"


# -- recovery ----------------------------------------------------------------------------------


@pytest.mark.real
def test_killed_session_is_closed_as_interrupted_and_new_writes_start_a_new_segment(tmp_path: Path) -> None:
    sid = kill_writer(tmp_path, total=8, flushed=5)
    before = read_manifest(tmp_path)
    assert before["sessions"][0]["status"] == "running"
    [loaded] = load_telemetry_sessions(tmp_path)
    assert loaded.summary.status == "incomplete"  # its writer is dead, nobody recovered it yet
    assert [e.metadata["i"] for e in loaded.events] == list(range(5))

    sink = TelemetrySink(tmp_path)
    assert sink.recovered_sessions == [sid]
    assert sink.torn_bytes_cut == 0
    after = read_manifest(tmp_path)
    [ledger] = after["sessions"]
    assert ledger["status"] == "interrupted"
    last = json.loads(lines_of(tmp_path / "segment-000001.jsonl")[-1])
    assert ledger["ended_at_ns"] == last["timestamp_ns"]
    assert after["segments"][0]["closed"] is True and after["segments"][0]["event_count"] == 5

    new = sink.start_session()
    sink.append(make_event(new.session_id, 0))
    sink.close()
    manifest = read_manifest(tmp_path)
    assert [(s["filename"], s["session_id"]) for s in manifest["segments"]] == [
        ("segment-000001.jsonl", sid),
        ("segment-000002.jsonl", new.session_id),
    ]
    statuses = {s.summary.session_id: s.summary.status for s in load_telemetry_sessions(tmp_path)}
    assert statuses == {sid: "interrupted", new.session_id: "completed"}
    assert len(load_telemetry_events(tmp_path, session_id=sid)) == 5


@pytest.mark.real
def test_recovery_cuts_a_torn_tail(tmp_path: Path) -> None:
    sid = kill_writer(tmp_path, total=4, flushed=4)
    segment = tmp_path / "segment-000001.jsonl"
    whole = segment.read_bytes()
    torn = whole.splitlines(keepends=True)[1][:57]  # a record cut mid-write
    with segment.open("ab") as handle:
        handle.write(torn)
    [loaded] = load_telemetry_sessions(tmp_path)
    assert loaded.torn_lines == 1 and len(loaded.events) == 4

    sink = TelemetrySink(tmp_path)
    assert sink.torn_bytes_cut == len(torn)
    assert sink.recovered_sessions == [sid]
    assert segment.read_bytes() == whole
    entry = read_manifest(tmp_path)["segments"][0]
    assert (entry["event_count"], entry["size_bytes"], entry["closed"]) == (4, len(whole), True)
    new = sink.start_session()
    sink.append(make_event(new.session_id))
    sink.close()
    assert segment.read_bytes() == whole  # new writes never extend the recovered segment
    sessions = load_telemetry_sessions(tmp_path)
    assert [(s.summary.session_id, s.summary.status, len(s.events), s.torn_lines) for s in sessions] == [
        (new.session_id, "completed", 1, 0),
        (sid, "interrupted", 4, 0),
    ]


@pytest.mark.real
def test_recovery_of_a_segment_that_is_all_torn(tmp_path: Path) -> None:
    sid = kill_writer(tmp_path, total=3, flushed=0)  # nothing flushed: an empty segment
    segment = tmp_path / "segment-000001.jsonl"
    assert segment.read_bytes() == b""
    segment.write_bytes(b'{"schema_version": 3, "sess')
    sink = TelemetrySink(tmp_path)
    assert sink.torn_bytes_cut == 27
    assert segment.read_bytes() == b""
    assert sink.recovered_sessions == [sid]
    [loaded] = load_telemetry_sessions(tmp_path)
    assert (loaded.summary.session_id, loaded.summary.status, loaded.events) == (sid, "interrupted", [])


def test_recovery_of_an_abandoned_in_process_sink(tmp_path: Path) -> None:
    sink = TelemetrySink(tmp_path, SinkConfig(flush_every_events=2))
    session = sink.start_session()
    for i in range(5):
        sink.append(make_event(session.session_id, i))  # 4 flushed, 1 buffered
    # The writer is gone without close(): this process still holds its fd, nothing more.
    recovered = TelemetrySink(tmp_path)
    assert recovered.recovered_sessions == [session.session_id]
    events = load_telemetry_events(tmp_path, session_id=session.session_id)
    assert [e.metadata["i"] for e in events] == [0, 1, 2, 3]
    os.close(sink._fd)  # type: ignore[arg-type]  # release the abandoned descriptor


# A writer that stays alive: one flushed record, then it waits for "close" (or to be killed).
_LIVE_WRITER = r"""
import sys
from stepwatch.artifacts.sink import TelemetrySink
from tests.support.records import make_event
sink = TelemetrySink(sys.argv[1])
sid = sink.start_session().session_id
sink.append(make_event(sid, 0))
sink.flush()
print(sid, flush=True)
if sys.stdin.readline().strip() == "close":
    sink.close()
    print("closed", flush=True)
    sys.stdin.readline()
"""


def start_live_writer(root: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, str(root)], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


@pytest.mark.real
def test_a_second_writer_on_a_live_sink_is_refused_and_interrupts_nothing(tmp_path: Path) -> None:
    proc, sid = start_live_writer(tmp_path)
    try:
        assert sid, proc.stderr.read() if proc.stderr else ""
        before = (tmp_path / "manifest.json").read_bytes()
        with pytest.raises(ArtifactError, match=rf"another process is writing this sink \(pid {proc.pid} on "):
            TelemetrySink(tmp_path)  # it used to mark the live session interrupted
        assert (tmp_path / "manifest.json").read_bytes() == before
        assert read_manifest(tmp_path)["sessions"][0]["status"] == "running"
        [loaded] = load_telemetry_sessions(tmp_path)
        assert loaded.summary.status == "running"
        proc.stdin.write("close\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        assert proc.stdout.readline().strip() == "closed"  # type: ignore[union-attr]
        # closed, still alive: the lock is given back (and its file removed)
        assert not (tmp_path / ".writer.lock").exists()
        sink = TelemetrySink(tmp_path)
        assert sink.recovered_sessions == [] and sink.ledger[0].status == "completed"
        sink.start_session()
        sink.close()
    finally:
        proc.kill()
        proc.communicate()  # and close its pipes
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "manifest.json", "segment-000001.jsonl", "segment-000002.jsonl",
    ]


@pytest.mark.real
def test_a_killed_writer_leaves_the_lock_to_the_next_one(tmp_path: Path) -> None:
    proc, sid = start_live_writer(tmp_path)
    proc.kill()
    proc.communicate()
    sink = TelemetrySink(tmp_path)  # the OS dropped the dead writer's lock
    assert sink.recovered_sessions == [sid]
    assert sink.ledger[0].status == "interrupted"


@pytest.mark.real
def test_a_running_session_whose_process_is_alive_is_not_recovered(tmp_path: Path) -> None:
    sid, _ = write_session(tmp_path, 2)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        # The ledger names a live process of this host (no lock: not a stepwatch writer of
        # this version, or the process `stepwatch track --pid` samples): it is not recovered.
        manifest = read_manifest(tmp_path)
        manifest["sessions"][0].update(status="running", ended_at_ns=None, pid=other.pid,
                                       host=socket.gethostname(), started_at_ns=time.time_ns())
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        sink = TelemetrySink(tmp_path)
        assert (sink.recovered_sessions, sink.live_sessions) == ([], [sid])
        assert read_manifest(tmp_path)["sessions"][0]["status"] == "running"
        del sink
        # The same pid, but the process started long after the session: a reused pid.
        manifest["sessions"][0]["started_at_ns"] = time.time_ns() - 3600 * 10**9
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        again = TelemetrySink(tmp_path)
        assert again.recovered_sessions == [sid]
        assert read_manifest(tmp_path)["sessions"][0]["status"] == "interrupted"
    finally:
        other.kill()
        other.wait()


@pytest.mark.real
def test_repeated_recovery_is_a_no_op(tmp_path: Path) -> None:
    sid = kill_writer(tmp_path, total=3, flushed=3)
    TelemetrySink(tmp_path)
    manifest = (tmp_path / "manifest.json").read_bytes()
    again = TelemetrySink(tmp_path)
    assert again.recovered_sessions == [] and again.torn_bytes_cut == 0
    assert (tmp_path / "manifest.json").read_bytes() == manifest
    assert [s.summary.status for s in load_telemetry_sessions(tmp_path)] == ["interrupted"]
    assert load_telemetry_sessions(tmp_path)[0].summary.session_id == sid


@pytest.mark.real
@pytest.mark.parametrize("damage", ["half", "empty", "garbage", "wrong_type"])
def test_corrupt_manifest_is_kept_aside_and_rebuilt_from_segments(tmp_path: Path, damage: str) -> None:
    config = SinkConfig(rollover_max_events=3)
    first, events_a = write_session(tmp_path, 7, config)  # segments 1-3
    second = kill_writer(tmp_path, total=4, flushed=4)  # segment 4, left running
    original = (tmp_path / "manifest.json").read_bytes()
    broken = {
        "half": original[: len(original) // 2],
        "empty": b"",
        "garbage": b"\x00\xff not json",
        "wrong_type": b'{"schema_version": 2, "segments": "nope"}',
    }[damage]
    (tmp_path / "manifest.json").write_bytes(broken)

    sink = TelemetrySink(tmp_path)
    aside = list(tmp_path.glob("manifest.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == broken
    manifest = read_manifest(tmp_path)
    assert [(s["filename"], s["session_id"], s["event_count"], s["closed"]) for s in manifest["segments"]] == [
        ("segment-000001.jsonl", first, 3, True),
        ("segment-000002.jsonl", first, 3, True),
        ("segment-000003.jsonl", first, 1, True),
        ("segment-000004.jsonl", second, 4, True),
    ]
    for entry in manifest["segments"]:
        assert entry["size_bytes"] == (tmp_path / entry["filename"]).stat().st_size
    # the ledger was lost: nothing proves either session stopped cleanly any more
    assert {s["session_id"]: s["status"] for s in manifest["sessions"]} == {
        first: "interrupted", second: "interrupted",
    }
    assert sorted(sink.recovered_sessions) == sorted([first, second])
    assert load_telemetry_events(tmp_path, session_id=first) == events_a
    assert [e.metadata["i"] for e in load_telemetry_events(tmp_path, session_id=second)] == [0, 1, 2, 3]

    new = sink.start_session()
    sink.append(make_event(new.session_id))
    sink.close()
    assert read_manifest(tmp_path)["segments"][-1]["filename"] == "segment-000005.jsonl"
    assert len(list(tmp_path.glob("manifest.json.corrupt-*"))) == 1


def test_segments_written_after_the_last_manifest_are_adopted(tmp_path: Path) -> None:
    first, events_a = write_session(tmp_path, 3)
    # A writer that died between creating its segment and writing the manifest:
    orphan_id = "00000000-0000-4000-8000-00000000abcd"
    orphan = [make_event(orphan_id, i) for i in range(4)]
    (tmp_path / "segment-000002.jsonl").write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in orphan))
    statuses = {s.summary.session_id: s.summary.status for s in load_telemetry_sessions(tmp_path)}
    assert statuses == {first: "completed", orphan_id: "incomplete"}

    sink = TelemetrySink(tmp_path)
    assert sink.recovered_sessions == [orphan_id]
    manifest = read_manifest(tmp_path)
    assert manifest["segments"][1] == {
        "filename": "segment-000002.jsonl",
        "event_count": 4,
        "size_bytes": (tmp_path / "segment-000002.jsonl").stat().st_size,
        "closed": True,
        "session_id": orphan_id,
    }
    ledger = {s["session_id"]: s for s in manifest["sessions"]}
    assert ledger[first]["status"] == "completed"
    assert ledger[orphan_id]["status"] == "interrupted"
    assert ledger[orphan_id]["ended_at_ns"] == orphan[-1].timestamp_ns
    new = sink.start_session()
    sink.close()
    assert read_manifest(tmp_path)["segments"][-1] == {
        "filename": "segment-000003.jsonl", "event_count": 0, "size_bytes": 0, "closed": True,
        "session_id": new.session_id,
    }
    assert load_telemetry_events(tmp_path, session_id=orphan_id) == orphan
    assert load_telemetry_events(tmp_path, session_id=first) == events_a


def test_sink_without_manifest_is_rebuilt(tmp_path: Path) -> None:
    sid, events = write_session(tmp_path, 4)
    (tmp_path / "manifest.json").unlink()
    [loaded] = load_telemetry_sessions(tmp_path)
    assert loaded.summary.status == "incomplete" and loaded.events == events
    sink = TelemetrySink(tmp_path)
    assert sink.recovered_sessions == [sid]
    assert not list(tmp_path.glob("manifest.json.corrupt-*"))
    assert read_manifest(tmp_path)["segments"][0]["event_count"] == 4
    assert load_telemetry_events(tmp_path) == events


# -- manifest cadence (manifest_every_seconds) ---------------------------------------------------


def test_a_flush_that_only_grows_the_segment_leaves_the_manifest_until_its_cadence(tmp_path: Path) -> None:
    """The runtime's sink flushes every second; its manifest's counts are rewritten only every
    ``manifest_every_seconds``, while a new segment and the close rewrite it at once, and every
    record written is loaded whatever the manifest says."""
    config = SinkConfig(flush_every_events=1, fsync="close", rollover_max_events=6, manifest_every_seconds=3600.0)
    sink = TelemetrySink(tmp_path, config)
    session = sink.start_session()
    events = [make_event(session.session_id, i) for i in range(8)]
    for event in events[:4]:
        sink.append(event)  # a write each, no new segment
    segment = tmp_path / "segment-000001.jsonl"
    assert len(lines_of(segment)) == 4
    assert read_manifest(tmp_path)["segments"][0]["event_count"] == 0  # counts not rewritten yet
    assert load_telemetry_events(tmp_path) == events[:4]  # the segment is read whole
    for event in events[4:7]:
        sink.append(event)  # the 6th fills the segment: it rolls over, and the manifest says so
    manifest = read_manifest(tmp_path)
    assert [(s["filename"], s["event_count"], s["closed"]) for s in manifest["segments"]] == [
        ("segment-000001.jsonl", 6, True), ("segment-000002.jsonl", 0, False)]
    sink.append(events[7])
    sink.close()
    manifest = read_manifest(tmp_path)
    assert [(s["event_count"], s["closed"]) for s in manifest["segments"]] == [(6, True), (2, True)]
    assert manifest["sessions"][0]["status"] == "completed"
    assert load_telemetry_events(tmp_path) == events


def test_manifest_cadence_zero_or_fsync_flush_rewrites_it_at_every_flush(tmp_path: Path) -> None:
    for name, config in (("zero", SinkConfig(flush_every_events=1, fsync="close")),
                         ("sync", SinkConfig(flush_every_events=1, fsync="flush", manifest_every_seconds=3600.0))):
        root = tmp_path / name
        sink = TelemetrySink(root, config)
        session = sink.start_session()
        for i in range(3):
            sink.append(make_event(session.session_id, i))
            assert read_manifest(root)["segments"][0]["event_count"] == i + 1
        sink.close()


@pytest.mark.parametrize("value", [-1.0, "10", True])
def test_manifest_cadence_must_be_a_number_at_least_zero(value: object) -> None:
    with pytest.raises(ConfigError, match="manifest_every_seconds"):
        SinkConfig(manifest_every_seconds=value)  # type: ignore[arg-type]
