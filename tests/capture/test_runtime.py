"""The capture runtime's lifecycle: ``stepwatch.init`` / ``stepwatch.shutdown`` in real processes.

The runtime installs process hooks (atexit, SIGTERM, excepthook, fork), so every lifecycle test
runs its program in a fresh interpreter and reads the run directory back from disk.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest

import stepwatch
from stepwatch.artifacts.heartbeat import read_heartbeat
from stepwatch.artifacts.sink import TelemetrySink
from stepwatch.capture import api
from stepwatch.errors import ConfigError
from stepwatch.guard import reset_swallowed, swallowed
from stepwatch.schema import validate_telemetry_record
from stepwatch.telemetry import load_telemetry_events, load_telemetry_sessions
from tests.support import clean_env

pytestmark = pytest.mark.real  # every test here starts a process or trains a model


def run_py(code: str, cwd: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout,
    )


def start_py(code: str, cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=cwd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_line(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise AssertionError(f"no {prefix!r} line; stderr: {proc.stderr.read() if proc.stderr else ''}")


def finish(proc: subprocess.Popen[str], timeout: float = 15) -> str:
    """Waits for the process (killing it past ``timeout``); returns its stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def only_session(run: Path) -> Any:
    sessions = load_telemetry_sessions(run)
    assert len(sessions) == 1, [s.summary for s in sessions]
    return sessions[0]


def event_types(session: Any) -> list[str]:
    return [e.event_type for e in session.events]


LIFECYCLE = """
import sys, time, stepwatch
rt = stepwatch.init(out=sys.argv[1], interval=0.05)
print("SESSION", rt.session_id, flush=True)
with stepwatch.phase("work"):
    time.sleep(0.15)
"""


# -- layout and lifecycle ------------------------------------------------------------------------


def test_run_directory_layout_and_lifecycle_events(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(LIFECYCLE + "stepwatch.shutdown()\nprint('AFTER', flush=True)\n", tmp_path, str(run))
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    assert "AFTER" in proc.stdout
    session_id = proc.stdout.split()[1]

    assert (run / "run.json").is_file()
    rank_dir = run / "telemetry" / "rank0"
    assert (rank_dir / "manifest.json").is_file()
    assert sorted(p.name for p in rank_dir.glob("segment-*.jsonl")) == ["segment-000001.jsonl"]
    assert (run / "heartbeat_rank0.jsonl").is_file()

    manifest = json.loads((run / "run.json").read_text())
    assert manifest["session_id"] == session_id
    assert manifest["status"] == "completed"
    assert manifest["ended_at_ns"] >= manifest["started_at_ns"]
    sink_manifest = json.loads((rank_dir / "manifest.json").read_text())
    assert sink_manifest["schema_version"] == 2
    assert [s["session_id"] for s in sink_manifest["sessions"]] == [session_id]
    assert sink_manifest["sessions"][0]["status"] == "completed"
    assert all(seg["closed"] for seg in sink_manifest["segments"])

    session = only_session(run)
    assert session.summary.session_id == session_id
    assert session.summary.status == "completed"
    types = event_types(session)
    assert types.count("start") == 1 and types.count("stop") == 1
    starts = [e for e in session.events if e.event_type == "start"]
    stops = [e for e in session.events if e.event_type == "stop"]
    assert starts[0].timestamp_ns < stops[0].timestamp_ns
    # nothing of the session after its stop record
    assert max(e.timestamp_ns for e in session.events) == stops[0].timestamp_ns
    assert "stopped (completed)" in (stops[0].context or "")
    assert types.count("phase_enter") == 1 and types.count("phase_exit") == 1
    for line in (rank_dir / "segment-000001.jsonl").read_bytes().splitlines():
        validate_telemetry_record(json.loads(line))


def test_interpreter_exit_without_shutdown_completes_the_session(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(LIFECYCLE, tmp_path, str(run))  # no shutdown(): the atexit hook closes it
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    session = only_session(run)
    assert session.summary.status == "completed"
    assert event_types(session).count("stop") == 1
    assert json.loads((run / "run.json").read_text())["status"] == "completed"


def test_sigterm_completes_the_session_and_still_ends_the_process_by_sigterm(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_py(LIFECYCLE + "print('READY', flush=True)\ntime.sleep(30)\n", tmp_path, str(run))
    with proc:
        wait_line(proc, "READY")
        proc.send_signal(signal.SIGTERM)
        finish(proc)
    assert proc.returncode == -signal.SIGTERM
    session = only_session(run)
    assert session.summary.status == "completed"
    assert event_types(session)[-1] == "stop"
    assert json.loads((run / "run.json").read_text())["status"] == "completed"


def test_sigterm_chains_to_the_programs_own_handler(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = textwrap.dedent("""
        import json, signal, sys, time
        def on_term(signum, frame):
            manifest = json.load(open(sys.argv[1] + "/run.json"))
            print("USER HANDLER", manifest["status"], flush=True)  # stepwatch closed its session first
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
    """) + LIFECYCLE + "print('READY', flush=True)\ntime.sleep(30)\n"
    proc = start_py(code, tmp_path, str(run))
    with proc:
        wait_line(proc, "READY")
        proc.send_signal(signal.SIGTERM)
        assert wait_line(proc, "USER HANDLER") == "completed"
        finish(proc)
    assert proc.returncode == 0
    assert only_session(run).summary.status == "completed"


def test_sigkill_leaves_the_session_incomplete_until_recovery_marks_it_interrupted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_py(LIFECYCLE + "print('READY', flush=True)\ntime.sleep(30)\n", tmp_path, str(run))
    with proc:
        session_id = wait_line(proc, "SESSION")
        wait_line(proc, "READY")
        proc.send_signal(signal.SIGKILL)
        finish(proc)
    assert proc.returncode == -signal.SIGKILL

    before = only_session(run)
    assert before.summary.session_id == session_id
    assert before.summary.status == "incomplete"
    assert "stop" not in event_types(before)

    sink = TelemetrySink(run / "telemetry" / "rank0")  # opening it recovers the dead writer's session
    assert sink.recovered_sessions == [session_id]
    after = only_session(run)
    assert after.summary.session_id == session_id
    assert after.summary.status == "interrupted"


# -- options -------------------------------------------------------------------------------------


def test_enabled_false_writes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, time, stepwatch
        rt = stepwatch.init(out=sys.argv[1], interval=0.05, enabled=False)
        assert not rt.active and rt.run_dir is None, rt
        with stepwatch.phase("work"):
            stepwatch.progress(1, loss=0.5)
            time.sleep(0.1)
        stepwatch.shutdown()
        print("OK")
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    assert proc.stdout.strip() == "OK"
    assert not run.exists()
    assert list(tmp_path.iterdir()) == []  # and no default ./stepwatch_runs either


@pytest.mark.parametrize(
    "options",
    [
        {"interval": 0},
        {"interval": 0.001},
        {"heartbeat_interval": -1},
        {"table_rows": 3},
        {"oom_ring": 0},
        {"endpoint": "ftp://example"},
        {"no_such_option": 1},
        {"out": 123},
        {"rank": 3, "world_size": 2},
    ],
    ids=lambda o: next(iter(o)),
)
def test_invalid_options_raise_config_error_before_anything_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    monkeypatch.chdir(tmp_path)
    reset_swallowed()
    with pytest.raises(ConfigError):
        stepwatch.init(**{"out": tmp_path / "run", **options})
    assert list(tmp_path.iterdir()) == []
    assert api.current_runtime().active is False
    assert swallowed() == {}


def test_invalid_interval_env_raises_config_error(tmp_path: Path) -> None:
    proc = run_py(
        """
        import os, sys, stepwatch
        from stepwatch.errors import ConfigError
        os.environ["STEPWATCH_INTERVAL_MS"] = "fast"
        try:
            stepwatch.init(out=sys.argv[1])
        except ConfigError as exc:
            print("CONFIG", exc)
        """,
        tmp_path, str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    assert "CONFIG" in proc.stdout and "STEPWATCH_INTERVAL_MS" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_init_twice_returns_the_same_runtime_and_second_cycle_works(tmp_path: Path) -> None:
    proc = run_py(
        """
        import sys, time, stepwatch
        first = stepwatch.init(out=sys.argv[1], interval=0.05)
        again = stepwatch.init(out=sys.argv[2], interval=0.05)
        assert again is first
        with stepwatch.phase("one"):
            time.sleep(0.06)
        stepwatch.shutdown()
        stepwatch.shutdown()  # idempotent
        second = stepwatch.init(out=sys.argv[2], interval=0.05)
        assert second is not first and second.active
        assert second.session_id != first.session_id
        with stepwatch.phase("two"):
            time.sleep(0.06)
        stepwatch.shutdown()
        print(first.session_id, second.session_id)
        """,
        tmp_path, str(tmp_path / "a"), str(tmp_path / "b"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    first_id, second_id = proc.stdout.split()
    assert "[stepwatch]" not in proc.stderr
    for run, session_id, name in ((tmp_path / "a", first_id, "one"), (tmp_path / "b", second_id, "two")):
        session = only_session(run)
        assert session.summary.session_id == session_id
        assert session.summary.status == "completed"
        assert event_types(session).count("start") == 1
        assert event_types(session).count("stop") == 1
        names = {e.metadata["phase_scope"]["name"] for e in session.events if e.event_type == "phase_enter"}
        assert names == {name}
        assert json.loads((run / "run.json").read_text())["status"] == "completed"


def test_start_up_failure_falls_back_to_a_null_runtime_and_the_program_runs_on(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = run_py(
        """
        import sys, stepwatch
        rt = stepwatch.init(out=sys.argv[1], interval=0.05)
        assert rt.active is False, rt
        with stepwatch.phase("still works"):
            stepwatch.progress(1, loss=1.0)
        stepwatch.shutdown()
        print("USER CODE RAN")
        """,
        tmp_path, str(blocker / "run"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "USER CODE RAN"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("[stepwatch]")
    assert blocker.read_text() == "not a directory"


# -- bounded tables ------------------------------------------------------------------------------


def test_phase_rows_past_the_table_bound_are_evicted_and_counted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, threading, stepwatch
        rt = stepwatch.init(out=sys.argv[1], interval=0.05, table_rows=16)
        gate, writing = threading.Event(), threading.Event()
        original = rt.sink.append
        def slow_append(event):
            writing.set()
            gate.wait(10)  # the disk is slow: the sampler thread is stuck in this write
            original(event)
        rt.sink.append = slow_append
        assert writing.wait(5)
        for i in range(100):
            with stepwatch.phase(f"p{i}"):
                pass
        gate.set()
        stepwatch.shutdown()
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    session = only_session(run)
    phases = [e for e in session.events if e.event_type in ("phase_enter", "phase_exit")]
    assert len(phases) == 16  # the bound: the newest rows survive
    assert [e.metadata["phase_scope"]["name"] for e in phases] == [f"p{i}" for i in range(92, 100) for _ in (0, 1)]
    stop = [e for e in session.events if e.event_type == "stop"][0]
    assert stop.metadata["dropped"]["phase_rows_evicted"] == 200 - 16
    assert stop.metadata["dropped"]["sink_records_dropped"] == 0


# The sampler is stuck in a slow write (a gate in sink.append) while the program queues a backlog
# of phase and progress rows, under the table bound; then the program shuts down.
BACKLOG = """
import sys, threading, time, stepwatch
rt = stepwatch.init(out=sys.argv[1], interval=0.05, heartbeat_interval=60)
gate, writing = threading.Event(), threading.Event()
original = rt.sink.append
def slow_append(event):
    writing.set()
    gate.wait(30)
    original(event)
rt.sink.append = slow_append
assert writing.wait(5)
N = 6000
for i in range(N):
    with stepwatch.phase("work"):
        stepwatch.progress(i, loss=i * 0.5)
assert len(rt.phase_rows) == 2 * N and len(rt.progress_rows) == N  # all of it still queued
"""


def backlog_accounting(run: Path, n: int) -> tuple[dict[str, int], int, int]:
    """The stop record's drops, and the phase and progress records that reached disk."""
    session = only_session(run)
    assert session.summary.status == "completed"
    assert event_types(session).count("stop") == 1
    phases = [e for e in session.events if e.event_type in ("phase_enter", "phase_exit")]
    seqs = [e.metadata["phase_scope"]["sequence"] for e in phases]
    assert len(set(seqs)) == len(seqs)  # nothing written twice
    progress = [b["step"] for b in read_heartbeat(run / "heartbeat_rank0.jsonl") if b["msg"] == "progress"]
    assert progress == sorted(set(progress)) and set(progress) <= set(range(n))  # in order, none twice
    dropped = [e for e in session.events if e.event_type == "stop"][0].metadata["dropped"]
    return dropped, len(phases), len(progress)


def test_a_backlog_at_shutdown_is_written_completely(tmp_path: Path) -> None:
    """Shutdown waits for the sampler's chunk in flight (never closing the sink under it), then
    writes the rest of the backlog itself."""
    run = tmp_path / "run"
    proc = run_py(
        BACKLOG + """
threading.Timer(0.3, gate.set).start()  # the slow write returns while shutdown waits
stepwatch.shutdown(timeout=60)  # a deadline no loaded machine reaches: this is about order, not speed
""",
        tmp_path, str(run), timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr  # no "append before start_session (or after close)"
    dropped, phases, progress = backlog_accounting(run, 6000)
    assert phases == 2 * 6000 and progress == 6000
    assert dropped["phase_rows_evicted"] == dropped["progress_rows_evicted"] == 0
    assert dropped["phase_rows_dropped_at_stop"] == dropped["progress_rows_dropped_at_stop"] == 0
    assert dropped["sink_records_dropped"] == dropped["rows_unwritable"] == 0


def test_a_progress_row_that_cannot_become_a_record_is_counted_and_the_rest_are_written(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05)
        stepwatch.progress(1, loss=1.0)
        stepwatch.progress(2, msg="clashes with the record's own msg field")
        stepwatch.progress(3, loss=0.5)
        stepwatch.shutdown()
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("[stepwatch]") and "drain.progress" in lines[0], proc.stderr
    progress = [b for b in read_heartbeat(run / "heartbeat_rank0.jsonl") if b["msg"] == "progress"]
    assert [(b["step"], b["loss"]) for b in progress] == [(1, 1.0), (3, 0.5)]
    stop = [e for e in only_session(run).events if e.event_type == "stop"][0]
    assert stop.metadata["dropped"]["rows_unwritable"] == 1


def test_a_sampler_stuck_past_the_deadline_finishes_the_stop_and_counts_what_it_could_not_write(
    tmp_path: Path,
) -> None:
    """``shutdown(timeout=0)`` returns while the sampler is still stuck in its write; the sampler
    then closes the session itself: every queued row is either on disk or counted as dropped."""
    run = tmp_path / "run"
    proc = run_py(
        BACKLOG + """
stepwatch.shutdown(timeout=0)
print("RETURNED_BEFORE_THE_WRITE", not gate.is_set())
gate.set()
rt.sampler.thread.join(30)
print("SAMPLER_DONE", not rt.sampler.thread.is_alive())
""",
        tmp_path, str(run), timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "RETURNED_BEFORE_THE_WRITE True" in proc.stdout and "SAMPLER_DONE True" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("[stepwatch]") and "stop deadline" in lines[0], proc.stderr
    dropped, phases, progress = backlog_accounting(run, 6000)
    assert dropped["phase_rows_evicted"] == dropped["progress_rows_evicted"] == 0
    assert phases + dropped["phase_rows_dropped_at_stop"] == 2 * 6000
    assert progress + dropped["progress_rows_dropped_at_stop"] == 6000
    assert dropped["phase_rows_dropped_at_stop"] > 0  # a deadline of 0: only the chunk in flight is written


# -- fork ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("child_exit", ["os._exit", "interpreter_exit"])
def test_forked_child_does_not_write_into_the_parents_session(tmp_path: Path, child_exit: str) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import os, sys, time, stepwatch
        rt = stepwatch.init(out=sys.argv[1], interval=0.05, heartbeat_interval=0.05)
        with stepwatch.phase("parent"):
            stepwatch.progress(1, loss=1.0)
            time.sleep(0.12)
        pid = os.fork()
        if pid == 0:  # a DataLoader-style worker
            with stepwatch.phase("child-phase"):
                stepwatch.progress(99, loss=9.0)
                time.sleep(0.3)
            assert not stepwatch.current_runtime().active
            if sys.argv[2] == "os._exit":
                os._exit(0)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        with stepwatch.phase("parent-after"):
            time.sleep(0.06)
        stepwatch.shutdown()
        print("PARENT", os.getpid(), "CHILD", pid)
        """,
        tmp_path, str(run), child_exit,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    _, parent_pid, _, child_pid = proc.stdout.split()
    session = only_session(run)
    assert session.summary.status == "completed"
    assert {e.pid for e in session.events} == {int(parent_pid)}
    names = {e.metadata["phase_scope"]["name"] for e in session.events if e.event_type == "phase_enter"}
    assert names == {"parent", "parent-after"}
    assert event_types(session).count("stop") == 1
    beats = read_heartbeat(run / "heartbeat_rank0.jsonl")
    assert {b["pid"] for b in beats} == {int(parent_pid)}
    assert [b["msg"] for b in beats].count("boot") == 1
    assert [b["msg"] for b in beats].count("stop") == 1
    assert 99 not in {b["step"] for b in beats}
    ts = [b["ts"] for b in beats]
    assert ts == sorted(ts)  # no duplicated stale buffer flushed by the child
    assert not (tmp_path / "stepwatch_runs").exists()


# -- sampler cadence -----------------------------------------------------------------------------


def test_sampler_samples_at_the_configured_sub_second_interval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, time, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05)
        time.sleep(1.0)
        stepwatch.shutdown()
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    session = only_session(run)
    samples = [e for e in session.events if e.event_type == "sample"]
    assert {e.sampling_interval_ms for e in samples} == {50}
    # 1 s at 20 Hz: about 20 (+ one at start, one at stop); loose for a busy 2-core machine
    assert 10 <= len(samples) <= 30, len(samples)
    stamps = [e.timestamp_ns for e in samples]
    gaps = [(b - a) / 1e9 for a, b in zip(stamps, stamps[1:])]
    assert min(gaps) >= 0  # time-ordered
    assert sorted(gaps)[len(gaps) // 2] < 0.2  # the median gap is sub-second, near 0.05 s
    for event in samples:
        validate_telemetry_record(msgspec.to_builtins(event))
        assert event.metadata["backend"] == "cpu" and event.metadata["sampling_source"] == "psutil"
        assert event.metadata["supports_device_total"] is True and event.metadata["supports_device_free"] is True
        assert event.metadata["collector_health_status"] == "healthy"


# -- values that JSON cannot hold as they are ------------------------------------------------------


def test_phase_attributes_and_progress_metrics_of_any_type_are_written_json_safe(tmp_path: Path) -> None:
    """numpy scalars and arrays, custom objects (one whose ``__str__`` raises) and non-UTF-8
    text in phase attributes and progress metrics: every record is written, readable by the
    loaders and the CLI, and nothing is counted as lost."""
    pytest.importorskip("numpy")
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, numpy as np, stepwatch
        class Config:
            def __str__(self): return "Config(lr=0.1)"
        class Broken:
            def __str__(self): raise RuntimeError("no text for you")
        stepwatch.init(out=sys.argv[1], interval=0.05)
        with stepwatch.phase("before"):
            pass
        with stepwatch.phase("epoch", epoch=np.int64(3), lr=np.float32(0.5), ok=np.bool_(True), cfg=Config(),
                             broken=Broken(), weights=np.arange(3), nested={"ids": (np.int8(1), 2)},
                             path="bad\\udc80name"):
            stepwatch.progress(1, loss=np.float64(0.25), cfg=Config(), weights=np.arange(2), tags=["a", np.int16(7)])
        with stepwatch.phase("after"):
            stepwatch.progress(2, loss=0.125)
        stepwatch.shutdown()
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    for line in (run / "telemetry" / "rank0" / "segment-000001.jsonl").read_bytes().splitlines():
        validate_telemetry_record(json.loads(line))  # every line is a whole, valid record
    session = only_session(run)
    enters = [e.metadata["phase_scope"] for e in session.events if e.event_type == "phase_enter"]
    assert [s["name"] for s in enters] == ["before", "epoch", "after"]
    exits = [e.metadata["phase_scope"] for e in session.events if e.event_type == "phase_exit"]
    assert [s["name"] for s in exits] == ["before", "epoch", "after"]
    attributes = enters[1]["attributes"]
    assert attributes == exits[1]["attributes"]
    assert (attributes["epoch"], attributes["lr"], attributes["ok"]) == (3, 0.5, True)
    assert type(attributes["epoch"]) is int and type(attributes["ok"]) is bool
    assert attributes["cfg"] == "Config(lr=0.1)"
    assert attributes["broken"] == "<unprintable Broken>"
    assert attributes["weights"] == "[0 1 2]"
    assert attributes["nested"] == {"ids": [1, 2]}
    assert attributes["path"] == "bad?name"  # a lone surrogate cannot be UTF-8: replaced
    progress = [b for b in read_heartbeat(run / "heartbeat_rank0.jsonl") if b["msg"] == "progress"]
    assert [(b["step"], b["loss"]) for b in progress] == [(1, 0.25), (2, 0.125)]
    assert (progress[0]["cfg"], progress[0]["weights"], progress[0]["tags"]) == ("Config(lr=0.1)", "[0 1]", ["a", 7])
    stop = [e for e in session.events if e.event_type == "stop"][0]
    assert stop.metadata["dropped"]["rows_unwritable"] == 0
    for command in ("sessions", "inspect"):
        cli = subprocess.run([str(Path(sys.executable).with_name("stepwatch")), command, str(run)],
                             cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, (command, cli.stdout, cli.stderr)


def test_a_record_the_sink_cannot_encode_is_counted_and_the_rest_of_its_chunk_is_written(tmp_path: Path) -> None:
    """The drain guards each record: one the sink rejects (here a phase record given a metadata
    value no encoder takes) is counted, and the 600 phases queued after it still reach disk."""
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, threading, stepwatch
        rt = stepwatch.init(out=sys.argv[1], interval=0.05, heartbeat_interval=60)
        build = rt.factory.phase
        def phase(row, prefix):
            event = build(row, prefix)
            if row[2] == "poison":
                event.metadata["poison"] = object()  # cannot be encoded, whatever json_safe did
            return event
        rt.factory.phase = phase
        with rt.sampler.lock:  # the sampler waits: all of this is drained as one chunk
            with stepwatch.phase("poison"):
                pass
            for i in range(600):
                with stepwatch.phase(f"p{i}"):
                    pass
        stepwatch.shutdown()
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 0, proc.stderr
    session = only_session(run)
    assert session.summary.status == "completed"
    names = [e.metadata["phase_scope"]["name"] for e in session.events if e.event_type == "phase_enter"]
    assert names == [f"p{i}" for i in range(600)]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("[stepwatch]") and "sink.encode" in lines[0], proc.stderr
    stop = [e for e in session.events if e.event_type == "stop"][0]
    assert stop.metadata["dropped"]["rows_unwritable"] >= 1


# -- ranks of one job without --out -----------------------------------------------------------------

# A stand-in for the torchrun agent: it starts rank 0, waits until the wall clock has moved on to
# the next second, then starts rank 1 (plain `stepwatch.init()`, no --out, no `stepwatch run`).
AGENT = """
import os, subprocess, sys, time
RANK = '''
import os, sys, time, stepwatch
rt = stepwatch.init(interval=0.05)
print("RANK", os.environ["RANK"], rt.session_id, rt.run_dir, int(rt.started_ns // 10**9), flush=True)
with stepwatch.phase("work"):
    time.sleep(0.1)
stepwatch.shutdown()
'''
def start(rank):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    return subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True)
first = start(0)
line = first.stdout.readline()
print(line, end="", flush=True)
started_second = int(line.split()[-1])
while int(time.time()) <= started_second:
    time.sleep(0.01)
second = start(1)
print(second.stdout.readline(), end="", flush=True)
sys.exit(first.wait() or second.wait())
"""


@pytest.mark.parametrize("job_id", [None, "job-42"])
def test_ranks_started_in_different_seconds_share_one_default_run_directory(tmp_path: Path, job_id: str | None) -> None:
    env = clean_env()
    if job_id is not None:
        env["TORCHELASTIC_RUN_ID"] = job_id
    proc = subprocess.run([sys.executable, "-c", AGENT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    ranks = [line.split() for line in proc.stdout.splitlines() if line.startswith("RANK")]
    assert [r[1] for r in ranks] == ["0", "1"]
    assert ranks[0][4] != ranks[1][4]  # they did start in different seconds
    assert ranks[0][2] == ranks[1][2]  # one session id
    assert ranks[0][3] == ranks[1][3]  # one run directory
    (run,) = (tmp_path / "stepwatch_runs").iterdir()
    assert run.name.endswith(ranks[0][2][:8])
    assert sorted(p.name for p in (run / "telemetry").iterdir()) == ["rank0", "rank1"]
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["session_id"] == ranks[0][2] and manifest["world_size"] == 2
    session = only_session(run)  # the ranks' sinks load as one session
    assert session.summary.session_id == ranks[0][2]
    assert session.summary.ranks == (0, 1) and session.summary.status == "completed"
    assert {e.rank for e in session.events} == {0, 1}


@pytest.mark.parametrize(("given", "expected_ms"), [("", 200), ("interval=1.0", 1000), ("interval=0.5", 500)])
def test_an_explicit_interval_wins_over_the_environment(tmp_path: Path, given: str, expected_ms: int) -> None:
    proc = run_py(
        f"""
        import os, sys, stepwatch
        os.environ["STEPWATCH_INTERVAL_MS"] = "200"  # what `stepwatch track --interval 200` sets
        stepwatch.init(out=sys.argv[1], {given})
        stepwatch.shutdown()
        """,
        tmp_path, str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr
    events = load_telemetry_events(tmp_path / "run")
    assert {e.sampling_interval_ms for e in events if e.event_type == "sample"} == {expected_ms}
