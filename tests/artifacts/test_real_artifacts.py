"""Real artifacts read whole: v2 exports with the published identity fields, Stormlog's v4
records with unknown (null) counters, and documents nested deeper than any decoder recurses."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stepwatch.telemetry import load_telemetry_sessions
from tests.support.records import make_record
from tests.support.shared import once


def v2_record(**overrides: Any) -> dict[str, Any]:
    record = make_record(schema_version=2)
    for name in ("session_id", "job_id", "rank", "local_rank", "world_size"):
        del record[name]
    record.update(overrides)
    return record


def test_a_distributed_v2_export_loads_with_its_identity(tmp_path: Path) -> None:
    records = [v2_record(timestamp_ns=i, job_id="job-1", rank=r, local_rank=r, world_size=2)
               for i, r in enumerate([0, 1, 0, 1])]
    path = tmp_path / "export.json"
    path.write_bytes(msgspec.json.encode({"events": records}))
    [loaded] = load_telemetry_sessions(path)
    assert [(e.rank, e.world_size, e.job_id) for e in loaded.events] == [(r, 2, "job-1") for r in [0, 1, 0, 1]]
    assert loaded.summary.ranks == (0, 1)


# -- Stormlog 0.4.3's OOM run: v4 records whose counters are unknown (null) ---------------------


def _stormlog_oom_run(root: Path) -> dict[str, Path]:
    """A real Stormlog MemoryTracker run with its sink and OOM flight recorder, on a device whose
    memory cannot be read at times (as a device out of memory does: the reads the program's own calls
    make, and every third of the tracker thread's):
    Stormlog then writes its `start`, `phase_enter`, `peak` and `sample` records with null
    counters. The collector is Stormlog's own collector contract, answering with this process's
    RSS when it can."""
    psutil = pytest.importorskip("psutil")
    from stormlog.device_collectors import (
        DeviceMemoryCapabilities,
        DeviceMemoryCollector,
        DeviceMemorySample,
    )
    from stormlog.telemetry_sink import TelemetrySinkConfig
    from stormlog.tracker import MemoryTracker

    class FlakyDevice(DeviceMemoryCollector):
        def __init__(self) -> None:
            self.reads = 0
            self.owner = threading.get_ident()  # the program's thread (a worker's own under xdist)

        def name(self) -> str:
            return "cuda"

        def is_available(self) -> bool:
            return True

        def capabilities(self) -> DeviceMemoryCapabilities:
            return DeviceMemoryCapabilities(
                backend="cuda", telemetry_collector="stormlog.cuda_tracker", sampling_source="memory_stats",
                supports_allocator_allocated=True, supports_allocator_reserved=True,
                supports_allocator_active=False, supports_allocator_inactive=False, supports_device_used=True,
                supports_device_free=False, supports_device_total=False, supports_native_allocator_history=False,
                supports_fragmentation_analysis=False, supports_allocator_attribution=False,
                supports_bounded_profiling=False,
            )

        def sample(self) -> DeviceMemorySample:
            self.reads += 1
            # the reads made with the program's own calls (its start and its phase) fail always, the
            # tracker thread's every third: which records get null counters does not hang on timing
            if threading.get_ident() == self.owner or self.reads % 3 == 1:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            rss = psutil.Process().memory_info().rss
            return DeviceMemorySample(allocated_bytes=rss, reserved_bytes=rss, used_bytes=rss, free_bytes=None,
                                      total_bytes=None, active_bytes=None, inactive_bytes=None, device_id=0)

    tracker = MemoryTracker(
        collector=FlakyDevice(), sampling_interval=0.01, enable_oom_flight_recorder=True,
        oom_dump_dir=str(root / "oom"),
        telemetry_sink_config=TelemetrySinkConfig(root_dir=root / "sink", flush_every_events=3, rollover_max_events=4,
                                                  retention_max_files=1000),
    )
    tracker.start_tracking()
    with pytest.raises(RuntimeError), tracker.capture_oom(context="train"), tracker.phase("train"):
        time.sleep(0.15)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    tracker.stop_tracking()
    tracker.export_events(str(root / "export.json"), format="json")
    return {"sink": root / "sink", "manifest": root / "sink" / "manifest.json", "export": root / "export.json"}


@pytest.fixture(scope="module")
def stormlog_oom_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("stormlog", reason="needs stormlog==0.4.3")
    return once(tmp_path_factory, "artifacts-stormlog-oom", _stormlog_oom_run_of_its_shape)


def _stormlog_oom_run_of_its_shape(root: Path) -> dict[str, Path]:
    """Stormlog's run, made again (three tries) where a starved machine gave it another shape: at
    load 12 its tracker thread once wrote before the program's own `start` record, which then held
    counters. The tests read what stepwatch makes of that shape, not Stormlog's timing."""
    for attempt in range(3):
        run = _stormlog_oom_run(root / f"try-{attempt}")
        if {"start", "phase_enter"} <= _null_counter_types(run["sink"]):
            return run
    return run


def _null_counter_types(path: Path) -> set[str]:
    records = [json.loads(line) for file in sorted(path.glob("segment-*.jsonl")) for line in file.read_text().splitlines()]
    return {r["event_type"] for r in records if r["allocator_allocated_bytes"] is None}


def test_the_oom_run_sink_holds_v4_records_with_unknown_counters(stormlog_oom_run: dict[str, Path]) -> None:
    # what makes the artifact worth reading: the records stepwatch used to drop
    assert {"start", "phase_enter"} <= _null_counter_types(stormlog_oom_run["sink"])


def test_every_stormlog_artifact_loads_the_counts_stormlogs_loader_gives(stormlog_oom_run: dict[str, Path]) -> None:
    from stormlog.telemetry import load_telemetry_sessions as stormlog_load

    sink = stormlog_oom_run["sink"]
    artifacts = [sink, stormlog_oom_run["manifest"], stormlog_oom_run["export"], *sorted(sink.glob("segment-*.jsonl"))]
    assert len(artifacts) > 4  # several segments
    for artifact in artifacts:
        theirs = {s.summary.session_id: len(s.events) for s in stormlog_load(str(artifact))}
        ours = {s.summary.session_id: len(s.events) for s in load_telemetry_sessions(artifact)}
        assert ours == theirs, artifact.name


def test_unknown_counters_stay_unknown_and_the_session_keeps_its_start_and_peak(
        stormlog_oom_run: dict[str, Path]) -> None:
    from stormlog.telemetry import load_telemetry_events as stormlog_events

    [loaded] = load_telemetry_sessions(stormlog_oom_run["sink"])
    theirs = stormlog_events(str(stormlog_oom_run["sink"]))
    assert [(e.timestamp_ns, e.event_type, e.allocator_allocated_bytes) for e in loaded.events] == sorted(
        (e.timestamp_ns, e.event_type, e.allocator_allocated_bytes) for e in theirs)
    types = [e.event_type for e in loaded.events]
    assert types[0] == "start" and "peak" in types and types[-1] == "stop"
    unknown = [e for e in loaded.events if e.allocator_allocated_bytes is None]
    assert unknown and all(e.schema_version == 4 for e in unknown)  # kept as v4, never zero-filled
    assert all(e.schema_version == 3 for e in loaded.events if e.allocator_allocated_bytes is not None
               and e.allocator_change_bytes is not None)
    assert loaded.skipped_records == 0


def test_inspect_and_diagnose_read_a_session_with_unknown_counters(stormlog_oom_run: dict[str, Path]) -> None:
    from stepwatch.analysis.bundle_risks import assess_risks, timeline_from_events
    from stepwatch.analysis.session_report import report_session

    [loaded] = load_telemetry_sessions(stormlog_oom_run["sink"])
    [peak] = report_session(loaded).peaks
    known = [e.allocator_allocated_bytes for e in loaded.events if e.allocator_allocated_bytes is not None]
    assert peak.peak_allocated_bytes == max(known)  # unknown readings neither raise nor lower a peak
    timeline = timeline_from_events(loaded.events)
    assert None not in timeline["allocated"] and timeline["allocated"]
    assert isinstance(assess_risks(loaded.events, timeline), list)


def test_import_stores_every_record_of_the_oom_run_with_its_unknowns_null(
        stormlog_oom_run: dict[str, Path], tmp_path: Path) -> None:
    import sqlite3

    from stepwatch.store.importers import import_path
    from stepwatch.store.sqlite import SqliteStore

    [loaded] = load_telemetry_sessions(stormlog_oom_run["sink"])
    store = SqliteStore(tmp_path / "h.sqlite")
    assert import_path(stormlog_oom_run["sink"], store)["telemetry"] == len(loaded.events)
    store.close()
    with sqlite3.connect(tmp_path / "h.sqlite") as db:
        nulls = db.execute("SELECT COUNT(*) FROM telemetry WHERE allocated IS NULL").fetchone()[0]
    assert nulls == sum(e.allocator_allocated_bytes is None for e in loaded.events) > 0
