"""Who captures under ``stepwatch track``: a reused run directory, an interpreter without
stepwatch, and a Python launcher that only starts the ranks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import clean_env

from .test_track import ALLOCATE, only_session, run_manifest, track, write_script

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def test_a_reused_run_directory_captures_the_new_session(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = write_script(tmp_path, ALLOCATE)
    for _ in range(2):
        proc = track(tmp_path, run, sys.executable, str(script))
        assert proc.returncode == 3, proc.stderr
    from stepwatch.telemetry import load_telemetry_sessions

    sessions = {s.summary.session_id: s for s in load_telemetry_sessions(run)}
    assert len(sessions) == 2
    second = sessions[run_manifest(run)["session_id"]]
    assert second.summary.status == "completed"
    assert second.summary.source == "stepwatch.runtime"
    assert sum(e.event_type == "sample" for e in second.events) >= 5


def _imports_stepwatch(python: str) -> bool:
    return subprocess.run([python, "-c", "import stepwatch"], env=clean_env(), capture_output=True).returncode == 0


@pytest.mark.skipif(_imports_stepwatch(BASE_PYTHON), reason="the base interpreter has stepwatch installed too")
def test_an_interpreter_without_stepwatch_is_sampled_from_outside(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = write_script(tmp_path, "import time\ntime.sleep(4.5)\n")
    proc = track(tmp_path, run, BASE_PYTHON, str(script))
    assert proc.returncode == 0, proc.stderr
    session = only_session(run)
    assert session.summary.source == "stepwatch.track_pid"
    assert session.summary.status == "completed"
    assert sum(e.event_type == "sample" for e in session.events) >= 5


RANK_SCRIPT = """
import os
print("WORKER", os.getpid(), os.environ["RANK"], flush=True)
import time; time.sleep(0.5)
"""


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None, reason="no torchrun")
def test_a_launcher_under_track_leaves_rank_zero_to_its_worker(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = write_script(tmp_path, RANK_SCRIPT)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = clean_env()
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = track(tmp_path, run, torchrun, "--nproc-per-node", "1", "--master-port", "0", str(script), env=env,
                 timeout=120)
    assert proc.returncode == 0, proc.stderr
    worker_pid = int(proc.stdout.split("WORKER")[1].split()[0])
    session = only_session(run)
    assert session.summary.source == "stepwatch.runtime"
    assert {e.pid for e in session.events} == {worker_pid}
