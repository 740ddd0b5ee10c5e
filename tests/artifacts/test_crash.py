"""A real writer process killed with SIGKILL at random moments, then read and recovered.

Every kill must leave: every record the writer reported flushed loadable; its session
``incomplete`` until a new TelemetrySink opens the directory, ``interrupted`` after; and the
directory writable by the next session.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepwatch.artifacts.sink import SinkConfig, TelemetrySink
from stepwatch.errors import ArtifactError
from stepwatch.telemetry import load_telemetry_sessions
from tests.support.records import make_event

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

REPO = Path(__file__).resolve().parents[2]
RUNS = 24
KEEP_ALL = SinkConfig(retention_max_files=100_000)  # the writers keep every segment too

# argv: root fsync flush_every_events rollover_max_events explicit_flush_every pause_after_flush_s
WRITER = r"""
import os, socket, sys, time
from stepwatch.artifacts.sink import SinkConfig, TelemetrySink
from stepwatch.schema import TelemetryEventV3

root, fsync = sys.argv[1], sys.argv[2]
flush_every, rollover, explicit = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
pause = float(sys.argv[6])
sink = TelemetrySink(root, SinkConfig(
    fsync=fsync, flush_every_events=flush_every, flush_every_seconds=3600.0,
    rollover_max_events=rollover, retention_max_files=100_000,
))
session = sink.start_session()
print(f"SESSION {session.session_id}", flush=True)
host, pid = socket.gethostname(), os.getpid()
i = 0
while True:
    sink.append(TelemetryEventV3(
        schema_version=3, session_id=session.session_id, timestamp_ns=time.time_ns(),
        event_type="sample", collector="stepwatch.cpu_tracker", sampling_interval_ms=1,
        pid=pid, host=host, device_id=-1, allocator_allocated_bytes=i, allocator_reserved_bytes=i,
        allocator_active_bytes=None, allocator_inactive_bytes=None, allocator_change_bytes=0,
        device_used_bytes=i, device_free_bytes=None, device_total_bytes=None,
        context="x" * (i % 97), metadata={"i": i},
    ))
    i += 1
    if i % explicit == 0:
        sink.flush()
        print(f"FLUSHED {i}", flush=True)
        if pause:
            time.sleep(pause)  # widens the window right after a flush for the kill to land in
"""


def _start(script: Path, root: Path, out: Path, rng: random.Random) -> tuple[subprocess.Popen, str]:
    args = [
        rng.choice(["flush", "close", "never"]),
        str(rng.randint(1, 4)),  # flush_every_events
        str(rng.randint(3, 12)),  # rollover_max_events
        str(rng.randint(1, 6)),  # explicit flush every
        str(rng.choice([0.0, 0.0, 0.001, 0.005])),  # pause after each reported flush
    ]
    handle = out.open("wb")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-u", str(script), str(root), *args],
            cwd=REPO, stdout=handle, stderr=subprocess.PIPE,
        )
    finally:
        handle.close()
    return proc, " ".join(args)


def _kill(proc: subprocess.Popen) -> bytes:
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    return err


def _wait_for_session(proc: subprocess.Popen, out: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while b"\n" not in out.read_bytes():
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert time.monotonic() < deadline, "writer never started"
        time.sleep(0.005)


def _reported(out: Path) -> tuple[str | None, int]:
    """(session id, highest n of a complete "FLUSHED n" line) from the writer's stdout."""
    session, flushed = None, 0
    for line in out.read_bytes().split(b"\n")[:-1]:  # the text after the last newline may be torn
        word, _, value = line.decode().partition(" ")
        if word == "SESSION":
            session = value
        elif word == "FLUSHED":
            flushed = max(flushed, int(value))
    return session, flushed


def _load_or_nothing(root: Path) -> list:
    try:
        return load_telemetry_sessions(root)
    except ArtifactError as exc:  # killed before it wrote anything
        assert "no telemetry found" in str(exc) or "no such file" in str(exc)
        return []


def _indexes(loaded) -> list[int]:
    return [e.metadata["i"] for e in loaded.events]


def _check_killed(root: Path, sid: str, flushed: int, where: str) -> list[int]:
    """Before recovery: `incomplete`, and every reported record (and nothing torn) is there."""
    sessions = {s.summary.session_id: s for s in load_telemetry_sessions(root)}
    loaded = sessions[sid]
    assert loaded.summary.status == "incomplete", where
    got = _indexes(loaded)
    assert got == list(range(len(got))), f"{where}: records lost or reordered: {got}"
    assert len(got) >= flushed, f"{where}: reported {flushed} flushed, loaded {len(got)}"
    assert loaded.torn_lines <= 1, where
    return got


def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    for run in range(RUNS):
        root = tmp_path / f"sink{run}"
        out = tmp_path / f"out{run}.txt"
        proc, args = _start(script, root, out, rng)
        try:
            if run % 6 == 5:  # now and then, kill during start-up rather than while writing
                time.sleep(rng.uniform(0.0, 0.25))
            else:
                _wait_for_session(proc, out)
                time.sleep(rng.uniform(0.0, 0.3))
        finally:
            _kill(proc)
        sid, flushed = _reported(out)
        where = f"seed={seed} run={run} args={args} flushed={flushed}"

        if sid is None:  # died before its session was announced
            before = _load_or_nothing(root)
            assert all(s.summary.status in ("incomplete", "running") for s in before), where
            assert sum(len(s.events) for s in before) == 0, where
            recovered = TelemetrySink(root, KEEP_ALL)
            assert {s.summary.status for s in _load_or_nothing(root)} <= {"interrupted"}, where
            assert len(recovered.recovered_sessions) == len(before), where
        else:
            got = _check_killed(root, sid, flushed, where)
            recovered = TelemetrySink(root, KEEP_ALL)
            assert recovered.recovered_sessions == [sid], where
            [loaded] = load_telemetry_sessions(root)
            assert loaded.summary.status == "interrupted", where
            assert _indexes(loaded) == got, where
            assert loaded.torn_lines == 0, where
            if got:  # ended when its last record was written
                assert loaded.summary.ended_at_ns == loaded.events[-1].timestamp_ns, where

        # the directory takes the next session, in a new segment
        new = recovered.start_session()
        recovered.append(make_event(new.session_id))
        recovered.close()
        statuses = {s.summary.session_id: (s.summary.status, len(s.events)) for s in load_telemetry_sessions(root)}
        assert statuses[new.session_id] == ("completed", 1), where
        segments = json.loads((root / "manifest.json").read_bytes())["segments"]
        mine = [s["filename"] for s in segments if s["session_id"] == new.session_id]
        assert mine == [segments[-1]["filename"]], where
        assert all(s["closed"] for s in segments), where
        assert mine[0] not in {s["filename"] for s in segments if s["session_id"] != new.session_id}, where
        if sid is not None:
            assert statuses[sid] == ("interrupted", len(got)), where


def test_each_writer_recovers_the_one_killed_before_it(tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "sink"
    killed: list[tuple[str, int]] = []
    for run in range(6):
        out = tmp_path / f"out{run}.txt"
        proc, args = _start(script, root, out, rng)
        try:
            _wait_for_session(proc, out)
            time.sleep(rng.uniform(0.02, 0.2))
        finally:
            _kill(proc)
        sid, flushed = _reported(out)
        assert sid is not None
        _check_killed(root, sid, flushed, f"seed={seed} run={run} args={args}")
        killed.append((sid, flushed))

    sessions = {s.summary.session_id: s for s in load_telemetry_sessions(root)}
    assert set(sessions) == {sid for sid, _ in killed}
    for n, (sid, flushed) in enumerate(killed):
        loaded = sessions[sid]
        # each writer, on start, closed the one before it as interrupted; the last is unrecovered
        expected = "incomplete" if n == len(killed) - 1 else "interrupted"
        assert loaded.summary.status == expected, f"seed={seed} session {n}"
        assert _indexes(loaded) == list(range(len(loaded.events)))
        assert len(loaded.events) >= flushed
    TelemetrySink(root, KEEP_ALL)
    assert {s.summary.status for s in load_telemetry_sessions(root)} == {"interrupted"}


@pytest.mark.parametrize("fsync", ["flush", "close", "never"])
def test_kill_right_after_a_reported_flush(tmp_path: Path, fsync: str) -> None:
    """Only explicit flushes write here; the writer is killed while it pauses after the first."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    out = tmp_path / "out.txt"
    handle = out.open("wb")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-u", str(script), str(tmp_path / "sink"), fsync, "1000", "1000", "5", "30"],
            cwd=REPO, stdout=handle, stderr=subprocess.PIPE,
        )
    finally:
        handle.close()
    try:
        _wait_for_session(proc, out)
        deadline = time.monotonic() + 20
        while b"FLUSHED" not in out.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.002)
    finally:
        _kill(proc)
    sid, flushed = _reported(out)
    assert flushed == 5
    got = _check_killed(tmp_path / "sink", sid, flushed, f"fsync={fsync}")
    assert got == [0, 1, 2, 3, 4]
    TelemetrySink(tmp_path / "sink", KEEP_ALL)
    [loaded] = load_telemetry_sessions(tmp_path / "sink")
    assert (loaded.summary.status, _indexes(loaded)) == ("interrupted", got)
