"""The real ``stepwatch`` console script, run as a subprocess over real artifacts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stepwatch.artifacts.sink import SinkConfig, TelemetrySink
from stepwatch.schema import SessionSummary, telemetry_event_to_dict
from stepwatch.ui.format import fmt_bytes
from tests.support.records import make_event, make_record

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

GiB = 1024**3
_script = shutil.which("stepwatch", path=str(Path(sys.executable).parent))
COMMAND = [_script] if _script else [sys.executable, "-m", "stepwatch.ui.cli"]


class Result(msgspec.Struct):
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def stepwatch(*args: str, cwd: Path, columns: int | None = None) -> Result:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "COLUMNS", "TTY_COMPATIBLE")}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    proc = subprocess.run([*COMMAND, *args], cwd=cwd, capture_output=True, timeout=60, env=env)
    return Result(proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def assert_clean_error(result: Result, *fragments: str) -> None:
    assert result.code == 2, result
    assert "Traceback" not in result.err + result.out
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    for fragment in fragments:
        assert fragment in lines[0]


def write_sink(root: Path, events_of: Any, summary: SessionSummary | None = None, **config: Any) -> tuple[str, list]:
    sink = TelemetrySink(root, SinkConfig(**config))
    session = sink.start_session(summary)
    events = events_of(session.session_id)
    for event in events:
        sink.append(event)
    sink.close()
    return session.session_id, events


def plain(sid: str) -> list:
    return [make_event(sid, i) for i in range(5)]


def gpu_events(sid: str) -> list:
    """Two CUDA devices and the host, with known peaks."""
    spec = [
        # device, allocated, reserved, total
        (0, 3 * GiB, 4 * GiB, 80 * GiB),
        (0, 7 * GiB, 8 * GiB, 80 * GiB),
        (0, 5 * GiB, 10 * GiB, 80 * GiB),
        (1, 2 * GiB, 2 * GiB, 40 * GiB),
        (1, 1 * GiB, 3 * GiB, 40 * GiB),
    ]
    events = [
        make_event(
            sid, i, device_id=dev, collector="stepwatch.cuda_tracker", allocator_allocated_bytes=alloc,
            allocator_reserved_bytes=res, device_used_bytes=res, device_free_bytes=total - res,
            device_total_bytes=total, event_type="peak" if i == 1 else "sample",
        )
        for i, (dev, alloc, res, total) in enumerate(spec)
    ]
    events.append(make_event(sid, 9, allocator_allocated_bytes=123_456_789, allocator_reserved_bytes=200_000_000))
    return events


# -- validate ----------------------------------------------------------------------------------


def test_validate_good_sink(tmp_path: Path) -> None:
    write_sink(tmp_path / "sink", plain)
    result = stepwatch("validate", "sink", cwd=tmp_path)
    assert result.code == 0, result
    assert "OK" in result.out and "5 records in 2 files: 5 valid, 0 invalid" in result.out
    report = stepwatch("validate", "--json", "sink", cwd=tmp_path)
    assert report.code == 0
    assert report.json() == {"files": 2, "records": 5, "valid": 5, "problems": [], "ok": True}


@pytest.fixture
def bad_sink(tmp_path: Path) -> Path:
    root = tmp_path / "sink"
    sid, events = write_sink(root, plain)
    segment = root / "segment-000001.jsonl"
    lines = segment.read_bytes().splitlines(keepends=True)
    lines[1] = msgspec.json.encode({**telemetry_event_to_dict(events[1]), "rank": 3, "world_size": 2}) + b"\n"
    lines[3] = lines[3][:60] + b"\n"  # malformed middle line
    segment.write_bytes(b"".join(lines))
    return root


def test_validate_reports_each_bad_record_with_file_line_and_reason(bad_sink: Path, tmp_path: Path) -> None:
    result = stepwatch("validate", "sink", cwd=tmp_path)
    assert result.code == 1, result
    assert "Traceback" not in result.err
    rows = [line for line in result.out.splitlines() if "segment-000001.jsonl" in line]
    assert len(rows) == 2
    assert "│ 2 " in rows[0] and "$.rank" in rows[0] and "must be < world_size" in rows[0]
    assert "│ 4 " in rows[1] and "malformed JSON" in rows[1]
    assert "INVALID" in result.out and "3 valid, 2 invalid" in result.out


def test_validate_json_lists_problems(bad_sink: Path, tmp_path: Path) -> None:
    result = stepwatch("validate", "--json", "sink", cwd=tmp_path)
    assert result.code == 1
    report = result.json()
    assert report["ok"] is False
    assert (report["records"], report["valid"]) == (5, 3)
    problems = [(p["file"], p["line"], p["field"], p["severity"]) for p in report["problems"]]
    segment = str(Path("sink") / "segment-000001.jsonl")
    assert problems == [(segment, 2, "$.rank", "error"), (segment, 4, None, "error")]
    assert "world_size" in report["problems"][0]["reason"]
    assert "malformed JSON" in report["problems"][1]["reason"]


def test_validate_torn_tail_is_a_warning(tmp_path: Path) -> None:
    sid, events = write_sink(tmp_path / "sink", plain)
    with (tmp_path / "sink" / "segment-000001.jsonl").open("ab") as handle:
        handle.write(msgspec.json.encode(make_event(sid, 77))[:70])
    result = stepwatch("validate", "--json", "sink", cwd=tmp_path)
    assert result.code == 0, result
    report = result.json()
    assert report["ok"] is True and report["valid"] == 5
    [problem] = report["problems"]
    assert (problem["severity"], problem["line"]) == ("warning", 6)
    assert "torn" in problem["reason"]
    text = stepwatch("validate", "sink", cwd=tmp_path)
    assert text.code == 0 and "warning" in text.out and "torn final line" in text.out and "OK" in text.out


def test_validate_json_export_names_the_index(tmp_path: Path) -> None:
    records = [make_record(timestamp_ns=i) for i in range(3)]
    records[2]["device_used_bytes"] = -1
    (tmp_path / "export.json").write_text(json.dumps(records))
    result = stepwatch("validate", "--json", "export.json", cwd=tmp_path)
    assert result.code == 1
    [problem] = result.json()["problems"]
    assert (problem["file"], problem["index"], problem["field"]) == ("export.json", 2, "$.device_used_bytes")


def test_validate_legacy_records_strict_and_permissive(tmp_path: Path) -> None:
    (tmp_path / "legacy.json").write_text(json.dumps([{"timestamp": 1.5, "memory_allocated": 100, "device": "cuda:0"}]))
    strict = stepwatch("validate", "--json", "legacy.json", cwd=tmp_path)
    assert strict.code == 1 and strict.json()["problems"][0]["field"] == "$.schema_version"
    permissive = stepwatch("validate", "--json", "--permissive-legacy", "legacy.json", cwd=tmp_path)
    assert permissive.code == 0 and permissive.json()["valid"] == 1


def test_validate_corrupt_manifest(tmp_path: Path) -> None:
    write_sink(tmp_path / "sink", plain)
    (tmp_path / "sink" / "manifest.json").write_text('{"schema_version": 2, "segm')
    result = stepwatch("validate", "--json", "sink", cwd=tmp_path)
    assert result.code == 1
    [problem] = result.json()["problems"]
    assert problem["file"] == str(Path("sink") / "manifest.json") and "not valid JSON" in problem["reason"]


# -- sessions ----------------------------------------------------------------------------------


@pytest.fixture
def two_sessions(tmp_path: Path) -> tuple[Path, str, str]:
    root = tmp_path / "sink"
    older, _ = write_sink(root, plain)
    newer, _ = write_sink(root, gpu_events)
    return root, older, newer


def test_sessions_table(two_sessions: tuple, tmp_path: Path) -> None:
    root, older, newer = two_sessions
    result = stepwatch("sessions", "sink", cwd=tmp_path)
    assert result.code == 0, result
    rows = {sid: line for line in result.out.splitlines() for sid in (older, newer) if sid in line}
    assert set(rows) == {older, newer}
    assert "*" in rows[newer] and "*" not in rows[older]
    assert "completed" in rows[newer] and "│ 6 " in rows[newer] and "│ 5 " in rows[older]
    assert "default session" in result.out


def test_sessions_table_fits_an_80_column_terminal(two_sessions: tuple, tmp_path: Path) -> None:
    """At 80 columns the table folds to the narrow layout: nothing cut, each id whole on a line."""
    root, older, newer = two_sessions
    result = stepwatch("sessions", "sink", cwd=tmp_path, columns=80)
    assert result.code == 0, result
    assert max(map(len, result.out.splitlines())) <= 80, result.out
    assert "…" not in result.out
    for sid, events in ((older, 5), (newer, 6)):
        assert any(sid in line for line in result.out.splitlines()), result.out
        assert f"{events} events" in result.out
    assert sum(line.count("│ completed ") for line in result.out.splitlines()) == 2
    # wide enough, the one-row table stays
    wide = stepwatch("sessions", "sink", cwd=tmp_path, columns=200)
    assert any(newer in line and "completed" in line for line in wide.out.splitlines()), wide.out


def test_sessions_json(two_sessions: tuple, tmp_path: Path) -> None:
    root, older, newer = two_sessions
    result = stepwatch("sessions", "--json", "sink", cwd=tmp_path)
    assert result.code == 0
    listed = result.json()
    assert [(s["session_id"], s["status"], s["event_count"], s["ranks"], s["default"]) for s in listed] == [
        (newer, "completed", 6, [0], True),
        (older, "completed", 5, [0], False),
    ]


def test_sessions_json_of_a_run_directory(tmp_path: Path, session_id: str) -> None:
    for rank in (0, 1):
        summary = SessionSummary(session_id=session_id, status="running", started_at_ns=1, rank=rank, world_size=2)
        write_sink(
            tmp_path / "run" / "telemetry" / f"rank{rank}",
            lambda sid, rank=rank: [make_event(sid, i, rank=rank, world_size=2) for i in range(3)],
            summary,
        )
    [merged] = stepwatch("sessions", "--json", "run", cwd=tmp_path).json()
    assert (merged["session_id"], merged["ranks"], merged["event_count"], merged["world_size"]) == (
        session_id, [0, 1], 6, 2,
    )


def test_sessions_shows_interrupted_and_incomplete(tmp_path: Path) -> None:
    root = tmp_path / "sink"
    done, _ = write_sink(root, plain)
    sink = TelemetrySink(root, SinkConfig(flush_every_events=1))
    left = sink.start_session()
    sink.append(make_event(left.session_id))
    os.close(sink._fd)  # type: ignore[arg-type]  # the writer vanishes without close()
    del sink
    TelemetrySink(root)  # recovery
    orphan = [make_event("00000000-0000-4000-8000-00000000cafe", i) for i in range(2)]
    (root / "segment-000009.jsonl").write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in orphan))
    listed = stepwatch("sessions", "--json", "sink", cwd=tmp_path).json()
    assert [(s["session_id"], s["status"], s["default"]) for s in listed] == [
        (done, "completed", True),
        (left.session_id, "interrupted", False),
        (orphan[0].session_id, "incomplete", False),
    ]


# -- inspect -----------------------------------------------------------------------------------


def test_inspect_json_peaks_collectors_and_event_types(two_sessions: tuple, tmp_path: Path) -> None:
    root, older, newer = two_sessions
    result = stepwatch("inspect", "--json", "sink", cwd=tmp_path)
    assert result.code == 0, result
    report = result.json()
    assert (report["session_id"], report["status"], report["event_count"]) == (newer, "completed", 6)
    assert report["collectors"] == {"stepwatch.cuda_tracker": 5, "stepwatch.cpu_tracker": 1}
    assert report["event_types"] == {"sample": 5, "peak": 1}
    peaks = [
        (p["rank"], p["device_id"], p["collector"], p["peak_allocated_bytes"], p["peak_reserved_bytes"], p["device_total_bytes"])
        for p in report["peaks"]
    ]
    assert peaks == [
        (0, -1, "stepwatch.cpu_tracker", 123_456_789, 200_000_000, None),
        (0, 0, "stepwatch.cuda_tracker", 7 * GiB, 10 * GiB, 80 * GiB),
        (0, 1, "stepwatch.cuda_tracker", 2 * GiB, 3 * GiB, 40 * GiB),
    ]
    by_device = {p["device_id"]: p for p in report["peaks"]}
    assert by_device[0]["peak_allocated_at_ns"] < by_device[0]["peak_reserved_at_ns"]  # event 1, then event 2
    assert by_device[1]["peak_allocated_at_ns"] < by_device[1]["peak_reserved_at_ns"]  # event 3, then event 4


def test_inspect_table(two_sessions: tuple, tmp_path: Path) -> None:
    root, older, newer = two_sessions
    result = stepwatch("inspect", "sink", cwd=tmp_path)
    assert result.code == 0, result
    assert newer in result.out and "completed" in result.out and "6 events" in result.out
    lines = result.out.splitlines()
    assert any("collector" in line and "stepwatch.cuda_tracker" in line and line.rstrip("│ ").endswith("5") for line in lines)
    assert any("event type" in line and "peak" in line and line.rstrip("│ ").endswith("1") for line in lines)
    gpu0 = next(line for line in lines if "│ 0 " in line and "cuda_tracker" in line and fmt_bytes(80 * GiB) in line)
    assert fmt_bytes(7 * GiB) in gpu0 and fmt_bytes(10 * GiB) in gpu0
    gpu1 = next(line for line in lines if "cuda_tracker" in line and fmt_bytes(40 * GiB) in line)
    assert fmt_bytes(2 * GiB) in gpu1 and fmt_bytes(3 * GiB) in gpu1
    cpu = next(line for line in lines if "│ cpu " in line)
    assert fmt_bytes(123_456_789) in cpu and fmt_bytes(200_000_000) in cpu
    assert fmt_bytes(7 * GiB) == "7.0 GiB" and fmt_bytes(123_456_789) == "117.7 MiB"


def test_inspect_session_option(two_sessions: tuple, tmp_path: Path) -> None:
    root, older, newer = two_sessions
    report = stepwatch("inspect", "--json", "--session", older, "sink", cwd=tmp_path).json()
    assert (report["session_id"], report["event_count"]) == (older, 5)
    assert report["collectors"] == {"stepwatch.cpu_tracker": 5}
    [peak] = report["peaks"]
    assert (peak["peak_allocated_bytes"], peak["peak_reserved_bytes"]) == (1004, 2048)  # make_event: 1000 + i
    assert_clean_error(stepwatch("inspect", "--session", "no-such-id", "sink", cwd=tmp_path), "no-such-id", "not found")


def test_inspect_run_directory_per_rank_peaks(tmp_path: Path, session_id: str) -> None:
    for rank in (0, 1):
        summary = SessionSummary(session_id=session_id, status="running", started_at_ns=1, rank=rank, world_size=2)
        write_sink(
            tmp_path / "run" / "telemetry" / f"rank{rank}",
            lambda sid, rank=rank: [
                make_event(sid, i, rank=rank, world_size=2, device_id=0, allocator_allocated_bytes=(rank + 1) * 1000 * (i + 1))
                for i in range(3)
            ],
            summary,
        )
    report = stepwatch("inspect", "--json", "run", cwd=tmp_path).json()
    assert report["ranks"] == [0, 1] and report["world_size"] == 2
    assert [(p["rank"], p["peak_allocated_bytes"]) for p in report["peaks"]] == [(0, 3000), (1, 6000)]


def test_inspect_reports_torn_lines_and_warnings(tmp_path: Path) -> None:
    sid, events = write_sink(tmp_path / "sink", plain, rollover_max_events=2)
    (tmp_path / "sink" / "segment-000002.jsonl").unlink()
    with (tmp_path / "sink" / "segment-000003.jsonl").open("ab") as handle:
        handle.write(b'{"schema_version": 3, "sess')
    result = stepwatch("inspect", "sink", cwd=tmp_path)
    assert result.code == 0, result
    assert "1 torn lines" in result.out
    assert "warning:" in result.out and "segment-000002.jsonl" in result.out
    report = stepwatch("inspect", "--json", "sink", cwd=tmp_path).json()
    assert (report["event_count"], report["torn_lines"], len(report["warnings"])) == (3, 1, 1)


# -- unreadable input --------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "sessions", "inspect"])
@pytest.mark.parametrize("as_json", [False, True])
def test_missing_path_is_exit_2_with_one_error_line(tmp_path: Path, command: str, as_json: bool) -> None:
    args = [command, *(["--json"] if as_json else []), "nowhere"]
    result = stepwatch(*args, cwd=tmp_path)
    assert_clean_error(result, "nowhere", "no such file or directory")
    assert result.out == ""


@pytest.mark.parametrize("command", ["sessions", "inspect"])
@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("garbage.json", b"\x00\x01 definitely not json", "not valid JSON"),
        ("empty.json", b"", "not valid JSON"),
        ("bad.jsonl", b'{"schema_version": 3}\n{"a": \n{}\n', "bad.jsonl:1"),
    ],
)
def test_unreadable_file_is_exit_2_with_one_error_line(
    tmp_path: Path, command: str, name: str, content: bytes, fragment: str
) -> None:
    (tmp_path / name).write_bytes(content)
    assert_clean_error(stepwatch(command, name, cwd=tmp_path), name, fragment)


def test_directory_without_telemetry_is_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for command in ("validate", "sessions", "inspect"):
        assert_clean_error(stepwatch(command, "empty", cwd=tmp_path), "empty")


def test_validate_of_a_file_that_is_not_json_reports_it(tmp_path: Path) -> None:
    (tmp_path / "garbage.json").write_bytes(b"\x00\x01 definitely not json")
    result = stepwatch("validate", "--json", "garbage.json", cwd=tmp_path)
    assert result.code == 1 and "Traceback" not in result.err
    [problem] = result.json()["problems"]
    assert problem["file"] == "garbage.json" and "not valid JSON" in problem["reason"]


def test_version_and_help(tmp_path: Path) -> None:
    assert stepwatch("--version", cwd=tmp_path).out.strip().endswith("0.1.0")
    result = stepwatch("--help", cwd=tmp_path)
    assert result.code == 0 and all(c in result.out for c in ("validate", "sessions", "inspect"))


# -- missing, unreadable and empty pieces ------------------------------------------------------


def test_validate_reports_each_missing_listed_segment(tmp_path: Path) -> None:
    write_sink(tmp_path / "sink", plain, rollover_max_events=2)  # segments of 2, 2 and 1 records
    (tmp_path / "sink" / "segment-000001.jsonl").unlink()
    (tmp_path / "sink" / "segment-000003.jsonl").unlink()
    result = stepwatch("validate", "--json", "sink", cwd=tmp_path)
    assert result.code == 1, result  # it used to say OK
    problems = result.json()["problems"]
    assert [(p["file"], p["severity"]) for p in problems] == [
        (str(Path("sink") / "segment-000001.jsonl"), "error"),
        (str(Path("sink") / "segment-000003.jsonl"), "error"),
    ]
    assert all("missing" in p["reason"] for p in problems)
    table = stepwatch("validate", "sink", cwd=tmp_path)
    assert table.code == 1 and "INVALID" in table.out and "segment-000003.jsonl" in table.out
    sessions = stepwatch("sessions", "--json", "sink", cwd=tmp_path).json()
    assert [(s["status"], s["missing_segments"]) for s in sessions] == [("incomplete", 2)]


def test_corrupt_manifest_sessions_load_from_the_segments_and_validate_still_fails(tmp_path: Path) -> None:
    sid, _ = write_sink(tmp_path / "sink", plain)
    (tmp_path / "sink" / "manifest.json").write_text('{"schema_version": 2, "segm')
    result = stepwatch("sessions", "--json", "sink", cwd=tmp_path)
    assert result.code == 0, result  # it used to exit 2
    [session] = result.json()
    assert (session["session_id"], session["status"], session["event_count"]) == (sid, "incomplete", 5)
    assert session["unreadable_manifests"] == 1
    table = stepwatch("sessions", "sink", cwd=tmp_path)
    assert table.code == 0 and "warning:" in table.out and "manifest.json" in table.out
    assert stepwatch("inspect", "sink", cwd=tmp_path).code == 0
    check = stepwatch("validate", "--json", "sink", cwd=tmp_path)
    assert check.code == 1
    [problem] = check.json()["problems"]
    assert problem["file"] == str(Path("sink") / "manifest.json")


@pytest.mark.parametrize("name", ["empty.jsonl", "segment-000001.jsonl", "empty.json"])
def test_empty_file_given_directly_says_so(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"")
    check = stepwatch("validate", "--json", name, cwd=tmp_path)
    assert check.code == 1, check  # an empty .jsonl used to validate as OK
    [problem] = check.json()["problems"]
    assert (problem["file"], problem["reason"]) == (name, "file is empty")
    for command in ("sessions", "inspect"):
        result = stepwatch(command, name, cwd=tmp_path)
        assert_clean_error(result, name, "file is empty")  # not an empty table, not "truncated"
        assert "truncated" not in result.err


def test_empty_manifest_inside_a_sink_is_a_counted_warning(tmp_path: Path) -> None:
    write_sink(tmp_path / "sink", plain)
    (tmp_path / "sink" / "manifest.json").write_bytes(b"")
    [session] = stepwatch("sessions", "--json", "sink", cwd=tmp_path).json()
    assert session["unreadable_manifests"] == 1 and "file is empty" in session["warnings"][0]
    [problem] = stepwatch("validate", "--json", "sink", cwd=tmp_path).json()["problems"]
    assert problem["reason"] == "file is empty"


def test_events_key_that_is_not_a_list_is_an_error_in_validate_and_loaders(tmp_path: Path) -> None:
    (tmp_path / "export.json").write_text('{"events": 5}')
    check = stepwatch("validate", "--json", "export.json", cwd=tmp_path)
    assert check.code == 1 and check.json()["valid"] == 0  # it used to be one (invalid) record
    [problem] = check.json()["problems"]
    assert problem["field"] == "$.events" and "must be an array" in problem["reason"]
    assert_clean_error(stepwatch("sessions", "export.json", cwd=tmp_path), "export.json", "$.events must be an array")


def test_the_commands_other_tests_run_in_process_run_as_the_console_script(tmp_path: Path) -> None:
    # tests.support.run_stepwatch runs these through click's CliRunner; here each is the installed command
    write_sink(tmp_path / "sink", plain)
    assert stepwatch("import", "sink", "--into", "h/history.sqlite", cwd=tmp_path).code == 0
    session = stepwatch("summary", "h", "--json", cwd=tmp_path).json()["session_id"]
    assert stepwatch("query", "h", "SELECT session_id FROM sessions", "--format", "json", cwd=tmp_path).json() \
        == [{"session_id": session}]
    assert stepwatch("explain", "h", "--json", cwd=tmp_path).json()["session_id"] == session
    report = stepwatch("report", "h", "-o", "r.html", cwd=tmp_path)
    assert report.code == 0 and (tmp_path / "r.html").stat().st_size > 0, report
    same = stepwatch("compare", "h", "h", cwd=tmp_path)
    assert same.code == 2 and "the same store" in same.err, same
