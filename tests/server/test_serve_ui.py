"""``serve --ui-port`` and ``run --ui-port``: the aggregator serves the dashboard over its directory
from a process of its own (server/dashboard.py, web/process.py), says where in its ready line,
and the dashboard never outlives it: not when it stops, not when it is killed, not after the run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import STEPWATCH, clean_env
from tests.support.aggregator import wait_for

pytestmark = pytest.mark.real

_DASHBOARD = re.compile(r"\[stepwatch\] dashboard: (http://\S+)/run/(\S+)")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read()
    return json.loads(body) if response.headers.get_content_type() == "application/json" else body


def _listeners(process: psutil.Process, port: int) -> bool:
    """Whether ``process`` holds a socket listening on ``port``."""
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in process.net_connections(kind="tcp"))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _serve(tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """``stepwatch serve --ui-port 0`` in a process group of its own (as a terminal's job) and its ready line."""
    proc = subprocess.Popen([*STEPWATCH, "serve", "--out", str(tmp_path / "hub"), "--port", "0", "--ui-port", "0"],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.communicate(timeout=30)
    return proc, json.loads(line)


def test_serve_answers_the_dashboard_from_a_child_that_stops_with_it(tmp_path: Path) -> None:
    proc, ready = _serve(tmp_path)
    try:
        assert ready["event"] == "ready" and ready["ui"].startswith("http://127.0.0.1:")
        body = _get(f"{ready['ui']}api/runs")
        assert body["runs"] == [] and "no sessions under" in body["problems"][0]
        assert b"window.STEPWATCH" in _get(ready["ui"])
        # another process answers it: the aggregator's child, at a lower priority, and the
        # aggregator holds no socket on the dashboard's port (every connection is the child's)
        child = psutil.Process(ready["ui_pid"])
        assert _get(f"{ready['ui']}healthz")["pid"] == child.pid != ready["pid"]
        assert child.ppid() == ready["pid"] and "stepwatch.web.process" in child.cmdline()
        assert child.nice() > psutil.Process(ready["pid"]).nice()
        port = int(ready["ui"].rstrip("/").rsplit(":", 1)[1])
        assert _listeners(child, port) and not _listeners(psutil.Process(ready["pid"]), port)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole group: the child ignores it,
        time.sleep(0.5)  # the aggregator drains, keeps it 2 s more for a page's last polls, then stops it
        assert not _gone(child.pid)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert _gone(ready["ui_pid"])  # stopped before the aggregator exited
    assert "exited with code" not in stderr


def test_a_dashboard_port_in_use_is_the_aggregators_error_and_starts_nothing(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([*STEPWATCH, "serve", "--out", str(tmp_path / "hub"), "--port", "0", "--ui-port", str(port)],
                              env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"cannot listen for the dashboard on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path / "hub") in (p.info["cmdline"] or [])]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="psutil's view of a killed parent's child")
def test_a_killed_aggregator_takes_its_dashboard_with_it(tmp_path: Path) -> None:
    proc, ready = _serve(tmp_path)
    try:
        assert _get(f"{ready['ui']}healthz")["pid"] == ready["ui_pid"]
        os.kill(ready["pid"], signal.SIGKILL)  # no shutdown path runs: the child sees its pipe close
        proc.wait(30)
        assert wait_for(lambda: _gone(ready["ui_pid"]), timeout=15), "the dashboard outlived its aggregator"
    finally:
        if not _gone(ready["ui_pid"]):
            os.kill(ready["ui_pid"], signal.SIGKILL)
        proc.kill()
        proc.communicate(timeout=30)


def test_a_dashboard_that_dies_is_said_once_and_the_aggregator_goes_on(tmp_path: Path) -> None:
    proc, ready = _serve(tmp_path)
    try:
        os.kill(ready["ui_pid"], signal.SIGKILL)
        assert wait_for(lambda: _gone(ready["ui_pid"]), timeout=15)
        time.sleep(0.5)
        assert proc.poll() is None  # the aggregator still runs
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert stderr.count(f"the dashboard (pid {ready['ui_pid']}) exited with code -9; ingestion goes on") == 1


TRAIN = """
import sys, time
from pathlib import Path
deadline = time.monotonic() + 60
while not Path(sys.argv[1]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_run_serves_its_dashboard_from_another_process_gone_with_the_run(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    go = tmp_path / "go"
    log_path = tmp_path / "run.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen([*STEPWATCH, "run", "--ui-port", "0", "--view", "off", "--out", str(tmp_path / "run"),
                                 "train.py", str(go)], cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL,
                                stderr=log_file)
        try:
            assert wait_for(lambda: _DASHBOARD.search(log_path.read_text()) or proc.poll() is not None, 90)
            found = _DASHBOARD.search(log_path.read_text())
            assert found is not None, log_path.read_text()
            base, session = found.group(1), found.group(2)
            health = _get(f"{base}/healthz")
            dashboard = psutil.Process(health["pid"])
            aggregator = psutil.Process(dashboard.ppid())
            assert "stepwatch.server" in aggregator.cmdline() and aggregator.ppid() == proc.pid
            assert dashboard.pid not in (proc.pid, aggregator.pid)
            page = _get(f"{base}/api/run/{session}")  # the run's page, pending until its rank sends
            assert page.get("pending") or page["session"]["session_id"] == session
        finally:
            go.touch()
            proc.wait(timeout=120)
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    assert _gone(dashboard.pid) and _gone(aggregator.pid)


def test_run_with_a_remote_aggregator_has_no_dashboard_to_serve(tmp_path: Path) -> None:
    from tests.support import run_stepwatch

    (tmp_path / "train.py").write_text("print('never run')\n")
    proc = run_stepwatch("run", "--aggregator", "127.0.0.1:9", "--ui-port", "0", "--out", str(tmp_path / "run"),
                         "train.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--ui-port" in proc.stderr and "--aggregator" in proc.stderr
    assert not (tmp_path / "run").exists()
