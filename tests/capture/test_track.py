"""``stepwatch track`` and ``stepwatch diagnose`` through the real CLI, on real child processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stepwatch.schema import validate_telemetry_record
from stepwatch.telemetry import load_telemetry_sessions
from tests.support import clean_env

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

STEPWATCH = str(Path(sys.executable).with_name("stepwatch"))
MB = 1 << 20


def track_env(**extra: str) -> dict[str, str]:
    """A clean environment without PYTHONPATH: ``track`` must put its own start-up first."""
    env = clean_env()
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def write_script(tmp_path: Path, code: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


def track(tmp_path: Path, run: Path, *command: str, env: dict[str, str] | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([STEPWATCH, "track", "--interval", "50", "--out", str(run), "--", *command],
                          cwd=tmp_path, env=env or track_env(), capture_output=True, text=True, timeout=timeout)


def only_session(run: Path) -> Any:
    sessions = load_telemetry_sessions(run)
    assert len(sessions) == 1, [s.summary for s in sessions]
    return sessions[0]


def run_manifest(run: Path) -> dict[str, Any]:
    return json.loads((run / "run.json").read_text())


ALLOCATE = """
import os, sys, time
print("CHILD", os.getpid(), flush=True)
time.sleep(0.3)
block = bytearray(b"\\x01") * (200 << 20)
time.sleep(0.4)
del block
time.sleep(0.3)
sys.exit(3)
"""


def test_track_a_python_script(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = write_script(tmp_path, ALLOCATE)
    proc = track(tmp_path, run, sys.executable, str(script))
    assert proc.returncode == 3, proc.stderr
    child_pid = int(proc.stdout.split("CHILD")[1].split()[0])
    assert f"exit code 3, session completed; run directory: {run}" in proc.stderr

    manifest = run_manifest(run)
    assert (manifest["launcher"], manifest["status"], manifest["exit_code"]) == ("track", "completed", 3)
    assert manifest["command_line"] == [sys.executable, str(script)]
    session = only_session(run)
    assert session.summary.session_id == manifest["session_id"]  # one id: launcher and child
    assert session.summary.status == "completed"
    assert session.summary.source == "stepwatch.runtime"  # captured in-process, no code change
    samples = [e for e in session.events if e.event_type == "sample" and e.collector == "stepwatch.cpu_tracker"]
    assert {e.pid for e in samples} == {child_pid}
    assert {e.sampling_interval_ms for e in samples} == {50}
    assert len(samples) >= 10
    rss = [e.allocator_allocated_bytes for e in samples]
    assert max(rss) - rss[0] >= 150 * MB  # the 200 MB block shows
    assert rss[-1] < max(rss) - 100 * MB  # and its release
    for e in session.events:
        validate_telemetry_record(msgspec.to_builtins(e))
    assert (run / "heartbeat_rank0.jsonl").is_file()
    assert not (tmp_path / "stepwatch_runs").exists()


SELF_SIGNAL = """
import os, signal, time
time.sleep(0.3)
os.kill(os.getpid(), signal.{sig})
time.sleep(10)
"""


def test_child_killed_by_sigkill_is_interrupted_with_exit_137(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = write_script(tmp_path, SELF_SIGNAL.format(sig="SIGKILL"))
    proc = track(tmp_path, run, sys.executable, str(script))
    assert proc.returncode == 137, proc.stderr
    assert "session interrupted" in proc.stderr
    session = only_session(run)
    assert session.summary.status == "interrupted"
    assert session.summary.session_id == run_manifest(run)["session_id"]
    assert "stop" not in [e.event_type for e in session.events]
    manifest = run_manifest(run)
    assert (manifest["status"], manifest["exit_code"]) == ("interrupted", 137)


def test_child_sigterm_completes_with_exit_143(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = write_script(tmp_path, SELF_SIGNAL.format(sig="SIGTERM"))
    proc = track(tmp_path, run, sys.executable, str(script))
    assert proc.returncode == 143, proc.stderr
    session = only_session(run)
    assert session.summary.status == "completed"
    assert session.events[-1].event_type == "stop"
    assert (run_manifest(run)["status"], run_manifest(run)["exit_code"]) == ("completed", 143)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_to_the_track_process_group(tmp_path: Path, sig: signal.Signals) -> None:
    run = tmp_path / "run"
    script = write_script(tmp_path, """
        import time
        print("READY", flush=True)
        time.sleep(30)
    """)
    # A shell without job control starts background jobs with SIGINT ignored, and an ignored
    # signal stays ignored across exec: give track (and so its child) the default disposition.
    default_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.argv[1], sys.argv[1:])")
    command = [STEPWATCH, "track", "--interval", "50", "--out", str(run), "--", sys.executable, str(script)]
    with subprocess.Popen([sys.executable, "-c", default_sigint, *command], cwd=tmp_path, env=track_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
            deadline = time.monotonic() + 10
            while not (run / "telemetry" / "rank0" / "manifest.json").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
            if sig == signal.SIGINT:
                os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole group
            else:
                proc.send_signal(sig)  # SIGTERM to track itself: forwarded to the child
            _, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    assert proc.returncode == 128 + sig, err
    session = only_session(run)
    assert session.summary.status == "completed"
    assert session.events[-1].event_type == "stop"
    assert run_manifest(run)["status"] == "completed"


def test_a_non_python_command_is_sampled_from_outside(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = track(tmp_path, run, "sleep", "1")
    assert proc.returncode == 0, proc.stderr
    session = only_session(run)
    assert session.summary.source == "stepwatch.track_pid"
    assert session.summary.status == "completed"
    assert session.summary.session_id == run_manifest(run)["session_id"]
    samples = [e for e in session.events if e.event_type == "sample"]
    assert len(samples) >= 5
    assert len({e.pid for e in samples}) == 1 and samples[0].pid != os.getpid()
    assert all(e.allocator_allocated_bytes > 0 for e in samples)
    assert [e.event_type for e in session.events if e.event_type in ("start", "stop")] == ["start", "stop"]


def test_track_pid_samples_a_running_process(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # 4 s: long enough for a loaded machine to start `track` and take samples before it ends
    with subprocess.Popen(["sleep", "4"]) as target:
        started = time.monotonic()
        proc = subprocess.run([STEPWATCH, "track", "--interval", "50", "--out", str(run), "--pid", str(target.pid)],
                              cwd=tmp_path, env=track_env(), capture_output=True, text=True, timeout=30)
        elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert "session completed" in proc.stderr
    assert elapsed < 15  # stopped when the process ended (a zombie counts as ended)
    session = only_session(run)
    assert session.summary.source == "stepwatch.track_pid"
    assert session.summary.status == "completed"
    assert session.summary.pid == target.pid
    samples = [e for e in session.events if e.event_type == "sample"]
    assert len(samples) >= 5 and {e.pid for e in samples} == {target.pid}


def test_track_pid_of_a_missing_process(tmp_path: Path) -> None:
    proc = subprocess.run([STEPWATCH, "track", "--out", str(tmp_path / "run"), "--pid", "999999999"],
                          cwd=tmp_path, env=track_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "no process with pid 999999999" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_user_sitecustomize_still_runs_under_track(tmp_path: Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text(
        "import os\nopen(os.path.join(os.environ['MARKER_DIR'], f'ran-{os.getpid()}'), 'w').close()\n"
    )
    run = tmp_path / "run"
    script = write_script(tmp_path, """
        import os, sys, time
        import sitecustomize
        print("CHILD", os.getpid(), sitecustomize.__file__, flush=True)
        import stepwatch
        assert stepwatch.current_runtime().active
        time.sleep(0.2)
    """)
    proc = track(tmp_path, run, sys.executable, str(script),
                 env=track_env(PYTHONPATH=str(user), MARKER_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    _, pid, module_file = proc.stdout.split()
    assert (tmp_path / f"ran-{pid}").exists()
    assert Path(module_file) == user / "sitecustomize.py"
    session = only_session(run)
    assert session.summary.status == "completed"
    assert {e.pid for e in session.events} == {int(pid)}


# -- diagnose ------------------------------------------------------------------------------------

MANIFEST_KEYS = {"schema_version", "files", "exit_code", "risk_detected", "session_id", "session_status", "session",
                 "command_line"}


def check_diagnose_bundle(bundle: Path) -> dict[str, Any]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert set(manifest) >= MANIFEST_KEYS
    assert manifest["schema_version"] == 2
    assert manifest["exit_code"] == 0  # no --fail-on-risk
    summary = json.loads((bundle / "diagnostic_summary.json").read_text())
    assert manifest["risk_detected"] is bool(summary["risks"])  # (a busy machine may be near its limit)
    assert {"environment.json", "telemetry_timeline.json"} <= set(manifest["files"])
    for name in manifest["files"]:
        assert (bundle / name).is_file()
    assert manifest["session"]["session_id"] == manifest["session_id"]
    assert manifest["command_line"][1:2] == ["diagnose"]
    environment = json.loads((bundle / "environment.json").read_text())
    assert environment["devices"][0]["kind"] == "cpu" and environment["devices"][0]["total_bytes"] > 0
    timeline = json.loads((bundle / "telemetry_timeline.json").read_text())
    n = len(timeline["timestamps"])
    assert n >= 2 and len(timeline["allocated"]) == n and len(timeline["reserved"]) == n
    assert timeline["timestamps"] == sorted(timeline["timestamps"])
    assert all(isinstance(t, float) and t > 1e9 for t in timeline["timestamps"])  # float seconds
    return manifest


def test_diagnose_a_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = write_script(tmp_path, "import time\ntime.sleep(0.5)\n")
    assert track(tmp_path, run, sys.executable, str(script)).returncode == 0
    out = tmp_path / "bundle"
    proc = subprocess.run([STEPWATCH, "diagnose", str(run), "--output", str(out)], cwd=tmp_path, env=track_env(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    manifest = check_diagnose_bundle(out)
    session = only_session(run)
    assert manifest["session_id"] == session.summary.session_id == run_manifest(run)["session_id"]
    assert manifest["session_status"] == "completed"
    timeline = json.loads((out / "telemetry_timeline.json").read_text())
    samples = [e for e in session.events if e.event_type == "sample"]
    assert timeline["timestamps"] == [e.timestamp_ns / 1e9 for e in samples]
    assert timeline["allocated"] == [float(e.allocator_allocated_bytes) for e in samples]


def test_diagnose_samples_the_machine(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    proc = subprocess.run([STEPWATCH, "diagnose", "--duration", "0.3", "--output", str(out)], cwd=tmp_path,
                          env=track_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    manifest = check_diagnose_bundle(out)
    assert manifest["session_status"] == "completed"
    timeline = json.loads((out / "telemetry_timeline.json").read_text())
    span = timeline["timestamps"][-1] - timeline["timestamps"][0]
    assert 0.25 <= span < 2.0


def test_diagnose_fails_on_a_recorded_oom_when_asked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = write_script(tmp_path, """
        import stepwatch
        try:
            with stepwatch.oom_guard():
                raise MemoryError("boom")
        except MemoryError:
            pass
    """)
    assert track(tmp_path, run, sys.executable, str(script)).returncode == 0
    out = tmp_path / "bundle"
    proc = subprocess.run([STEPWATCH, "diagnose", str(run), "--output", str(out), "--fail-on-risk"], cwd=tmp_path,
                          env=track_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["exit_code"], manifest["risk_detected"]) == (1, True)
    risks = json.loads((out / "diagnostic_summary.json").read_text())["risks"]
    assert [r["name"] for r in risks if r["name"] == "OOM_RECORDED"] == ["OOM_RECORDED"]
    assert "MemoryError: boom" in next(r for r in risks if r["name"] == "OOM_RECORDED")["detail"]
    assert len(list((run / "bundles").glob("oom_dump_*"))) == 1  # the in-process capture wrote its bundle too


def test_track_pid_writes_the_run_manifest_and_a_heartbeat(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with subprocess.Popen(["sleep", "4"]) as target:
        started_ns = time.time_ns()
        proc = subprocess.run([STEPWATCH, "track", "--interval", "50", "--out", str(run), "--pid", str(target.pid)],
                              cwd=tmp_path, env=track_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    manifest = run_manifest(run)
    session = only_session(run)
    assert manifest["session_id"] == session.summary.session_id
    assert manifest["launcher"] == "track"
    assert manifest["pid"] == target.pid
    assert manifest["command_line"] == ["sleep", "4"]
    assert manifest["status"] == "completed" == session.summary.status
    assert started_ns <= manifest["started_at_ns"] <= manifest["ended_at_ns"] <= time.time_ns()
    from stepwatch.artifacts.heartbeat import read_heartbeat

    beats = read_heartbeat(run / "heartbeat_rank0.jsonl")
    assert [b["msg"] for b in beats][0] == "boot" and beats[-1]["msg"] == "stop"
    assert beats[-1]["status"] == "completed"
    assert {b["pid"] for b in beats} == {target.pid} and {b["rank"] for b in beats} == {0}
