"""Documents nested deeper than any decoder follows (a few hundred kB, 100,000 levels deep):
every reader of files refuses them with its documented error naming the file, never a
RecursionError. One test per reader; HTTP bodies and TCP frames are in tests/server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stepwatch.errors import ArtifactError
from tests.support.records import make_record

REPO = Path(__file__).resolve().parents[2]
DEPTH = 100_000
DEEP = b"[" * DEPTH + b"]" * DEPTH  # 200 kB


def deep_in(key: str = "metadata") -> bytes:
    """A record whose ``key`` holds the deep array: valid JSON, nested too deeply to decode."""
    head = json.dumps({k: v for k, v in make_record().items() if k != key})[:-1].encode()
    return head + f', "{key}": '.encode() + DEEP + b"}"


def refused(call: Any, path: Path) -> ArtifactError:
    with pytest.raises(ArtifactError) as info:
        call()
    assert info.value.path == str(path)
    assert "nested too deeply" in str(info.value)
    return info.value


def test_json_export(tmp_path: Path) -> None:
    from stepwatch.telemetry import load_telemetry_sessions

    for name, data in (("a.json", DEEP), ("b.json", b'{"events": [' + deep_in() + b"]}")):
        path = tmp_path / name
        path.write_bytes(data)
        refused(lambda path=path: load_telemetry_sessions(path), path)


@pytest.mark.parametrize("newline", [b"\n", b""])
def test_segment_line_names_its_line(tmp_path: Path, newline: bytes) -> None:
    from stepwatch.telemetry import load_telemetry_sessions

    path = tmp_path / "segment-000001.jsonl"
    path.write_bytes(json.dumps(make_record()).encode() + b"\n" + deep_in() + newline)
    error = refused(lambda: load_telemetry_sessions(path), path)
    assert error.line == 2


def test_sink_directory(tmp_path: Path) -> None:
    from stepwatch.telemetry import load_telemetry_sessions

    path = tmp_path / "segment-000001.jsonl"
    path.write_bytes(deep_in() + b"\n")
    refused(lambda: load_telemetry_sessions(tmp_path), path)


def test_sink_manifest(tmp_path: Path) -> None:
    from stepwatch.artifacts.manifest import read_manifest
    from stepwatch.telemetry import load_telemetry_sessions

    path = tmp_path / "manifest.json"
    path.write_bytes(b'{"schema_version": 2, "unknown_field": ' + DEEP + b"}")
    refused(lambda: read_manifest(path), path)
    refused(lambda: load_telemetry_sessions(path), path)


@pytest.mark.real
def test_validate_reports_the_file_and_exits_1(tmp_path: Path) -> None:
    from stepwatch.artifacts.record_check import check_artifact

    for name, data in (("x.json", DEEP), ("segment-000001.jsonl", deep_in() + b"\n"), ("y.jsonl", deep_in())):
        path = tmp_path / name
        path.write_bytes(data)
        report = check_artifact(path)
        [problem] = report.problems
        assert problem.file == str(path) and "nested too deeply" in problem.reason
        proc = subprocess.run([sys.executable, "-m", "stepwatch", "validate", str(path)], capture_output=True,
                              text=True, cwd=REPO, timeout=60, check=False)
        assert proc.returncode == 1, proc.stderr
        assert "RecursionError" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_spool_batch(tmp_path: Path) -> None:
    from stepwatch.artifacts.spool import read_spool

    spool = tmp_path / "spool"
    spool.mkdir()
    path = spool / f"1-{'a' * 32}.json"
    path.write_bytes(b'{"schema_version": 1, "batch_id": "' + b"a" * 32 + b'", "spans": ' + DEEP + b"}")
    refused(lambda: read_spool(path), path)  # one file asked for: its error is the answer
    assert read_spool(tmp_path).skipped_files == [str(path)]  # in a spool: skipped and listed


def test_heartbeat(tmp_path: Path) -> None:
    from stepwatch.artifacts.heartbeat import read_heartbeat

    path = tmp_path / "heartbeat_rank0.jsonl"
    good = json.dumps({"ts": 1.0, "rank": 0, "step": 1, "msg": "beat"}).encode()
    for tail in (b"\n", b""):  # a deep last line is no torn write either
        path.write_bytes(good + b"\n" + b'{"ts": 2.0, "rank": 0, "step": 2, "msg": ' + DEEP + b"}" + tail)
        assert refused(lambda: read_heartbeat(path), path).line == 2


def test_run_manifest(tmp_path: Path) -> None:
    from stepwatch.artifacts.run_manifest import read_run_manifest

    path = tmp_path / "run.json"
    path.write_bytes(b'{"session_id": "s", "extra": {"x": ' + DEEP + b"}}")
    refused(lambda: read_run_manifest(tmp_path), path)


def test_bundle(tmp_path: Path) -> None:
    from stepwatch.artifacts.bundles import read_bundle, read_bundle_manifest

    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(b'{"files": ' + DEEP + b"}")
    refused(lambda: read_bundle_manifest(tmp_path), manifest)
    manifest.write_text(json.dumps({"schema_version": 2, "files": ["manifest.json", "metadata.json"]}))
    metadata = tmp_path / "metadata.json"
    metadata.write_bytes(DEEP)
    refused(lambda: read_bundle(tmp_path), metadata)
    metadata.write_text('{"reason": "oom"}')
    assert read_bundle(tmp_path)["metadata.json"] == {"reason": "oom"}


def test_import_of_a_run_whose_run_json_is_nested_too_deeply(tmp_path: Path) -> None:
    from stepwatch.store.importers import import_path
    from stepwatch.store.sqlite import SqliteStore

    (tmp_path / "run.json").write_bytes(b'{"session_id": ' + DEEP + b"}")
    heartbeat = tmp_path / "heartbeat_rank0.jsonl"
    heartbeat.write_text(json.dumps({"ts": 1.0, "rank": 0, "step": 1, "msg": "beat"}) + "\n")
    store = SqliteStore(tmp_path / "h.sqlite")
    try:
        # an unreadable run.json names no session, as a malformed one: the rest still imports
        assert import_path(tmp_path, store) == {"heartbeats": 1}
        deep_beat = tmp_path / "heartbeat_rank1.jsonl"
        deep_beat.write_bytes(b'{"ts": 1.0, "rank": 1, "step": ' + DEEP + b"}\n")
        refused(lambda: import_path(deep_beat, store), deep_beat)
    finally:
        store.close()


def test_summary_names_a_run_json_nested_too_deeply(tmp_path: Path) -> None:
    from stepwatch.analysis.summary import build_summary
    from stepwatch.store.sqlite import SqliteStore

    path = tmp_path / "run.json"
    path.write_bytes(b'{"session_id": ' + DEEP + b"}")
    store = SqliteStore(tmp_path / "h.sqlite")
    store.upsert_session({"session_id": "s", "status": "completed", "started_at_ns": 1, "ended_at_ns": 2,
                          "host": "h", "world_size": 1, "source": "test", "command_line": None})
    try:
        refused(lambda: build_summary(store, "s", run_dir=tmp_path), path)
    finally:
        store.close()


def test_a_run_json_nested_too_deeply_names_no_session(tmp_path: Path) -> None:
    from stepwatch.artifacts.run_manifest import run_session_id  # serve, watch, summary, explain

    (tmp_path / "run.json").write_bytes(b'{"session_id": ' + DEEP + b"}")
    assert run_session_id(tmp_path) is None  # as for any run.json that does not name a session
