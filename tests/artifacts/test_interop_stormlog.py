"""Both directions with the real Stormlog 0.4.3 package.

stepwatch reads what Stormlog's CPUMemoryTracker writes (sink directory, manifest, segment,
JSON export), and Stormlog's own reader accepts the sinks stepwatch writes, with the same
sessions, statuses and event counts on both sides.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

stormlog = pytest.importorskip("stormlog", reason="the interoperability tests need stormlog==0.4.3")

from stormlog.cpu_profiler import CPUMemoryTracker  # noqa: E402
from stormlog.telemetry import load_telemetry_events as sl_load_events  # noqa: E402
from stormlog.telemetry import load_telemetry_sessions as sl_load  # noqa: E402
from stormlog.telemetry import validate_telemetry_record as sl_validate  # noqa: E402
from stormlog.telemetry_sink import TelemetrySinkConfig  # noqa: E402

from stepwatch.artifacts.sink import SinkConfig, TelemetrySink  # noqa: E402
from stepwatch.schema import SessionSummary, telemetry_event_to_dict  # noqa: E402
from stepwatch.telemetry import load_telemetry_events as sw_load_events  # noqa: E402
from stepwatch.telemetry import load_telemetry_sessions as sw_load  # noqa: E402
from tests.support.records import make_event  # noqa: E402
from tests.support.shared import once  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def sessions_of(loaded: list, *, with_events_only: bool = False) -> set[tuple[str, str, int]]:
    return {
        (s.summary.session_id, s.summary.status, len(s.events))
        for s in loaded
        if s.events or not with_events_only
    }


def default_id(loaded: list) -> str:
    return loaded[0].summary.session_id


def key_fields(events: list) -> list[tuple[Any, ...]]:
    return sorted(
        (e.timestamp_ns, e.event_type, e.collector, e.allocator_allocated_bytes, e.allocator_reserved_bytes,
         e.device_used_bytes, e.pid, e.rank)
        for e in events
    )


def run_tracker(sink_dir: Path, export: Path | None, seconds: float) -> None:
    tracker = CPUMemoryTracker(
        sampling_interval=0.02,
        telemetry_sink_config=TelemetrySinkConfig(
            root_dir=sink_dir, flush_every_events=2, rollover_max_events=4, retention_max_files=1000
        ),
    )
    tracker.start_tracking()
    with tracker.phase("train"):
        hold = [bytearray(200_000) for _ in range(20)]
        time.sleep(seconds)
        del hold
    tracker.stop_tracking()
    if export is not None:
        tracker.export_events(str(export), format="json")


@pytest.fixture(scope="module")
def stormlog_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return once(tmp_path_factory, "artifacts-stormlog-interop", _stormlog_artifacts)


def _stormlog_artifacts(base: Path) -> dict[str, Path]:
    sink = base / "sink"
    run_tracker(sink, None, 0.15)
    run_tracker(sink, base / "export.json", 0.25)
    return {"sink": sink, "export": base / "export.json"}


# -- stepwatch reads Stormlog ------------------------------------------------------------------


def test_stormlog_sink_is_what_the_spec_describes(stormlog_artifacts: dict[str, Path]) -> None:
    sink = stormlog_artifacts["sink"]
    manifest = json.loads((sink / "manifest.json").read_bytes())
    assert (manifest["schema_version"], manifest["format"]) == (2, "stormlog.append_only_telemetry_sink")
    assert len(manifest["sessions"]) == 2 and len(manifest["segments"]) >= 3  # rolled over
    first = json.loads((sink / "segment-000001.jsonl").read_bytes().splitlines()[0])
    assert first["schema_version"] == 4


@pytest.mark.parametrize("target", ["sink", "manifest"])
def test_stepwatch_reads_stormlog_sink_like_stormlog(stormlog_artifacts: dict[str, Path], target: str) -> None:
    path = stormlog_artifacts["sink"]
    if target == "manifest":
        path = path / "manifest.json"
    theirs, ours = sl_load(path), sw_load(path)
    assert sessions_of(ours) == sessions_of(theirs)
    assert {status for _, status, _ in sessions_of(ours)} == {"completed"}
    assert default_id(ours) == default_id(theirs)
    for mine in ours:
        other = next(s for s in theirs if s.summary.session_id == mine.summary.session_id)
        assert key_fields(mine.events) == key_fields(other.events)
        assert mine.skipped_records == mine.torn_lines == 0
        assert all(e.schema_version == 3 for e in mine.events)
        assert (mine.summary.started_at_ns, mine.summary.ended_at_ns) == (
            other.summary.started_at_ns, other.summary.ended_at_ns,
        )
    assert key_fields(sw_load_events(path)) == key_fields(sl_load_events(path))


def test_stepwatch_reads_each_stormlog_segment_like_stormlog(stormlog_artifacts: dict[str, Path]) -> None:
    segments = sorted(stormlog_artifacts["sink"].glob("segment-*.jsonl"))
    assert len(segments) >= 3
    for segment in segments:
        theirs, ours = sl_load(segment), sw_load(segment)
        # Stormlog also lists the ledger's other sessions, without events; compare what has records
        assert sessions_of(ours) == sessions_of(theirs, with_events_only=True), segment.name
        assert key_fields(ours[0].events) == key_fields([e for s in theirs for e in s.events]), segment.name


def test_stepwatch_reads_stormlog_json_export_like_stormlog(stormlog_artifacts: dict[str, Path]) -> None:
    export = stormlog_artifacts["export"]
    theirs, ours = sl_load(export), sw_load(export)
    assert sessions_of(ours) == sessions_of(theirs)
    [mine] = ours
    assert mine.summary.status == "completed"  # the export ends with the tracker's `stop` event
    assert key_fields(mine.events) == key_fields(theirs[0].events)
    # the export is the tracker's second session, also in the sink
    in_sink = {s.summary.session_id: len(s.events) for s in sw_load(stormlog_artifacts["sink"])}
    assert in_sink[mine.summary.session_id] == len(mine.events)


def test_stepwatch_validate_accepts_stormlog_artifacts(stormlog_artifacts: dict[str, Path]) -> None:
    for path in (stormlog_artifacts["sink"], stormlog_artifacts["export"]):
        proc = subprocess.run(
            [sys.executable, "-m", "stepwatch.ui.cli", "validate", "--json", str(path)],
            capture_output=True, timeout=60, cwd=REPO,
        )
        assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
        report = json.loads(proc.stdout)
        assert report["ok"] is True and report["problems"] == []
        assert report["records"] == report["valid"] > 0


# -- Stormlog reads stepwatch ------------------------------------------------------------------


_DYING_WRITER = r"""
import os, signal, sys
sys.path.insert(0, os.getcwd())
from stepwatch.artifacts.sink import SinkConfig, TelemetrySink
from tests.support.records import make_event
sink = TelemetrySink(sys.argv[1], SinkConfig(flush_every_events=2, rollover_max_events=3))
session = sink.start_session()
for i in range(int(sys.argv[2])):
    sink.append(make_event(session.session_id, i))
sink.flush()
print(session.session_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def stepwatch_sink(tmp_path: Path) -> tuple[Path, str, list, str]:
    """A completed session over three segments, then one killed and recovered as interrupted."""
    root = tmp_path / "sink"
    sink = TelemetrySink(root, SinkConfig(rollover_max_events=3))
    session = sink.start_session()
    events = [make_event(session.session_id, i, event_type="start" if i == 0 else "sample") for i in range(8)]
    for event in events:
        sink.append(event)
    sink.close()
    proc = subprocess.run(
        [sys.executable, "-c", _DYING_WRITER, str(root), "5"], cwd=REPO, capture_output=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    killed = proc.stdout.decode().strip()
    return root, session.session_id, events, killed


def test_stormlog_reads_stepwatch_sink(stepwatch_sink: tuple) -> None:
    root, completed, events, killed = stepwatch_sink
    TelemetrySink(root)  # recovery: the killed session becomes `interrupted`
    for path in (root, root / "manifest.json"):
        theirs, ours = sl_load(path), sw_load(path)
        assert sessions_of(theirs) == sessions_of(ours) == {(completed, "completed", 8), (killed, "interrupted", 5)}
        assert default_id(theirs) == default_id(ours) == completed
        for mine in ours:
            other = next(s for s in theirs if s.summary.session_id == mine.summary.session_id)
            assert [_comparable(telemetry_event_to_dict(e)) for e in mine.events] == [
                _comparable(_stormlog_dict(e)) for e in other.events
            ]
            assert (other.summary.started_at_ns, other.summary.ended_at_ns) == (
                mine.summary.started_at_ns, mine.summary.ended_at_ns,
            )
    assert key_fields(sl_load_events(root, session_id=killed)) == key_fields(sw_load_events(root, session_id=killed))


def test_stormlog_reads_stepwatch_segments(stepwatch_sink: tuple) -> None:
    root, completed, events, killed = stepwatch_sink
    TelemetrySink(root)
    segments = sorted(root.glob("segment-*.jsonl"))
    assert len(segments) == 5  # 3 + 3 + 2 of the completed session, 3 + 2 of the killed one
    for segment in segments:
        theirs, ours = sl_load(segment), sw_load(segment)
        assert sessions_of(theirs, with_events_only=True) == sessions_of(ours), segment.name


def test_stormlog_and_stepwatch_agree_before_recovery(stepwatch_sink: tuple) -> None:
    root, completed, events, killed = stepwatch_sink
    theirs = {s.summary.session_id: s for s in sl_load(root)}
    ours = {s.summary.session_id: s for s in sw_load(root)}
    assert len(theirs[killed].events) == len(ours[killed].events) == 5
    assert theirs[completed].summary.status == ours[completed].summary.status == "completed"
    # The ledger still says `running`. Stormlog reports that as written; stepwatch, seeing the
    # writer's pid gone, reports `incomplete` (spec: cannot prove a clean or recovered stop).
    assert theirs[killed].summary.status == "running"
    assert ours[killed].summary.status == "incomplete"


def test_stormlog_validates_every_record_stepwatch_writes(stepwatch_sink: tuple) -> None:
    root = stepwatch_sink[0]
    records = [json.loads(line) for p in sorted(root.glob("segment-*.jsonl")) for line in p.read_bytes().splitlines()]
    assert len(records) == 13
    for record in records:
        sl_validate(record)  # raises on anything Stormlog's reader rejects


def test_stormlog_reads_stepwatch_events_as_json_export(tmp_path: Path, session_id: str) -> None:
    events = [make_event(session_id, i, event_type=t) for i, t in enumerate(["start", "sample", "stop"])]
    path = tmp_path / "export.json"
    path.write_text(json.dumps([telemetry_event_to_dict(e) for e in events]))
    theirs, ours = sl_load(path), sw_load(path)
    assert sessions_of(theirs) == sessions_of(ours) == {(session_id, "completed", 3)}


def _stormlog_dict(event: Any) -> dict[str, Any]:
    from stormlog.telemetry import telemetry_event_to_dict as sl_to_dict

    return sl_to_dict(event)


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    """Stormlog reads v3 as v4: it bumps schema_version and infers memory_capabilities."""
    metadata = {k: v for k, v in record["metadata"].items() if k != "memory_capabilities"}
    return {**{k: v for k, v in record.items() if k != "schema_version"}, "metadata": metadata}


# -- run directories ---------------------------------------------------------------------------


def test_two_rank_run_directory_written_by_stepwatch(tmp_path: Path, session_id: str) -> None:
    run = tmp_path / "run"
    written = []
    for rank in (0, 1):
        sink = TelemetrySink(run / "telemetry" / f"rank{rank}", SinkConfig(rollover_max_events=4))
        sink.start_session(
            SessionSummary(
                session_id=session_id, status="running", started_at_ns=time.time_ns(), host=socket.gethostname(),
                pid=os.getpid(), rank=rank, local_rank=rank, world_size=2,
            )
        )
        for i in range(5 + rank):
            event = make_event(session_id, i, rank=rank, local_rank=rank, world_size=2)
            sink.append(event)
            written.append(event)
        sink.close()
    [merged] = sw_load(run)
    assert merged.summary.session_id == session_id
    assert merged.summary.ranks == (0, 1)
    assert merged.summary.status == "completed"
    assert merged.summary.event_count == len(written) == 11
    assert merged.events == sorted(written, key=lambda e: e.timestamp_ns)
    # Stormlog reads each rank's sink on its own with the same counts
    for rank in (0, 1):
        rank_dir = run / "telemetry" / f"rank{rank}"
        assert sessions_of(sl_load(rank_dir)) == sessions_of(sw_load(rank_dir)) == {(session_id, "completed", 5 + rank)}
