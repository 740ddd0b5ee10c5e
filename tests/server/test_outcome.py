"""A failed run reads failed: real ``stepwatch run``/``track`` runs (and a plain ``init``) of tiny
torch scripts that raise or are killed, and what run.json, the heartbeat stop record, the final
summary and the timeline say about it (docs/run-outcome.md)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stepwatch.analysis.markers import derive_session_timeline_markers
from stepwatch.artifacts.heartbeat import read_heartbeat
from stepwatch.artifacts.telemetry_loader import load_telemetry_sessions
from tests.support import STEPWATCH, clean_env, free_port
from tests.support.shared import once

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

pytest.importorskip("torch")


TRAIN = '''
import os, signal, sys, time
import torch
import torch.distributed as dist

mode, fail_rank = sys.argv[1], int(sys.argv[2])
rank = int(os.environ.get("RANK", "0"))
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
if rank == fail_rank:
    if mode == "raise":
        raise ValueError(f"bad batch on rank {rank}")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
else:
    time.sleep(60)  # torchrun ends this rank once the failing one is gone
'''

INIT_SCRIPT = '''
import sys, threading
import stepwatch
stepwatch.init(out=sys.argv[1], interval=0.1)
worker = threading.Thread(target=lambda: 1 / 0, name="loader-thread")
worker.start(); worker.join()
raise KeyError("missing column")
'''


def run(base: Path, out: Path, *args: str, nproc: int = 1) -> subprocess.CompletedProcess[str]:
    (base / "train.py").write_text(TRAIN)
    command = [*STEPWATCH, "run", "--interval", "200", "--out", str(out)]
    if nproc > 1:
        command += ["--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    return subprocess.run([*command, "train.py", *args], cwd=base, env=clean_env(), capture_output=True, text=True,
                          timeout=180)


def manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "run.json").read_text())


@pytest.fixture(scope="module")
def one_rank_raises(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return once(tmp_path_factory, "outcome-raise-rank0", lambda base: (base / "run", run(base, base / "run", "raise", "0")))


@pytest.fixture(scope="module")
def rank1_raises(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return once(tmp_path_factory, "outcome-raise-rank1",
                lambda base: (base / "run", run(base, base / "run", "raise", "1", nproc=2)))


def test_one_rank_that_raises_reads_failed_everywhere(one_rank_raises: tuple[Path, Any]) -> None:
    out, proc = one_rank_raises
    assert proc.returncode == 1, proc.stderr[-3000:]  # the training's exit code
    # the user's traceback comes out as Python prints it, once
    assert proc.stderr.count("Traceback (most recent call last):") == 1, proc.stderr
    assert 'raise ValueError(f"bad batch on rank {rank}")' in proc.stderr
    assert "ValueError: bad batch on rank 0" in proc.stderr

    run_json = manifest(out)
    assert run_json["outcome"] == "failed" and run_json["exit_code"] == 1
    assert run_json["status"] == "completed"  # the capture itself closed cleanly (spec status)
    error = run_json["error"]
    assert error["kind"] == "exception" and error["rank"] == 0 and error["type"] == "ValueError"
    assert error["message"] == "bad batch on rank 0" and error["thread"] == "MainThread" and error["fatal"]
    assert "train.py" in error["traceback"] and error["traceback"].rstrip().endswith("ValueError: bad batch on rank 0")
    assert [e["type"] for e in run_json["errors"]] == ["ValueError"]

    stop = [r for r in read_heartbeat(out / "heartbeat_rank0.jsonl") if r["msg"] == "stop"][-1]
    assert stop["outcome"] == "failed" and stop["error"]["type"] == "ValueError"

    summary = json.loads((out / "final_summary.json").read_text())
    assert summary["outcome"] == "failed" and summary["error"]["type"] == "ValueError"
    assert summary["error"]["rank"] == 0 and summary["exit_code"] == 1
    text = (out / "final_summary.txt").read_text()
    assert "outcome failed" in text and "rank 0 raised ValueError" in text and "bad batch on rank 0" in text

    session = next(s for s in load_telemetry_sessions(out) if s.summary.session_id == run_json["session_id"])
    failures = [m for m in derive_session_timeline_markers(session) if m.kind == "failure"]
    assert [(m.rank, m.severity) for m in failures] == [(0, "critical")]
    assert "ValueError" in failures[0].label and failures[0].start_ns == error["at_ns"]


def test_two_ranks_name_the_rank_that_failed_first(rank1_raises: tuple[Path, Any]) -> None:
    out, proc = rank1_raises
    assert proc.returncode == 1, proc.stderr[-3000:]
    run_json = manifest(out)
    assert run_json["outcome"] == "failed"
    first = run_json["error"]
    assert (first["rank"], first["type"], first["message"]) == (1, "ValueError", "bad batch on rank 1")
    # rank 0 was ended by torchrun afterwards: recorded, after the failure that caused it
    others = [e for e in run_json["errors"] if e is not None and e["rank"] == 0]
    assert others and others[0]["kind"] == "signal" and others[0]["signal"] == "SIGTERM"
    assert others[0]["at_ns"] > first["at_ns"]
    assert {e["rank"] for e in run_json["errors"]} == {0, 1}
    for rank, outcome in ((0, "killed"), (1, "failed")):
        stop = [r for r in read_heartbeat(out / f"heartbeat_rank{rank}.jsonl") if r["msg"] == "stop"][-1]
        assert stop["outcome"] == outcome, stop
    summary = json.loads((out / "final_summary.json").read_text())
    assert summary["outcome"] == "failed" and summary["error"]["rank"] == 1
    text = (out / "final_summary.txt").read_text()
    assert "outcome failed: rank 1 raised ValueError" in text and "then rank 0 was ended by SIGTERM" in text


def test_a_rank_killed_by_sigkill_is_recorded_with_its_signal(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run(tmp_path, out, "kill", "0")
    assert proc.returncode == 128 + 9, proc.stderr[-3000:]
    run_json = manifest(out)
    assert run_json["outcome"] == "killed" and run_json["exit_code"] == 137
    error = run_json["error"]
    assert (error["kind"], error["rank"], error["signal"], error["signal_number"]) == ("signal", 0, "SIGKILL", 9)
    assert error["at_ns"] >= run_json["started_at_ns"]
    summary = json.loads((out / "final_summary.json").read_text())
    assert summary["outcome"] == "killed" and summary["error"]["signal"] == "SIGKILL"
    assert "rank 0 was ended by SIGKILL" in (out / "final_summary.txt").read_text()
    from stepwatch.analysis.markers import derive_outcome_markers

    markers = derive_outcome_markers(run_json)
    assert [(m.kind, m.rank, m.label) for m in markers] == [("failure", 0, "rank 0 ended by SIGKILL")]


def test_a_rank_killed_by_sigkill_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run(tmp_path, out, "kill", "1", nproc=2)
    assert proc.returncode != 0
    run_json = manifest(out)
    assert run_json["outcome"] == "killed"
    error = run_json["error"]
    assert (error["rank"], error["signal"], error["seen_by"]) == (1, "SIGKILL", "torchrun")
    assert "rank 1 was ended by SIGKILL" in (out / "final_summary.txt").read_text()


def test_track_of_a_script_that_raises_reads_failed(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    out = tmp_path / "run"
    proc = subprocess.run([*STEPWATCH, "track", "--out", str(out), "--", sys.executable, "train.py", "raise", "0"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    run_json = manifest(out)
    assert run_json["launcher"] == "track" and run_json["outcome"] == "failed"
    assert run_json["error"]["type"] == "ValueError" and run_json["error"]["rank"] == 0


def test_init_in_a_script_records_the_exception_of_each_thread(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(INIT_SCRIPT)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "script.py", str(out)], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    # both tracebacks printed by Python's own hooks, unchanged
    assert "Exception in thread loader-thread" in proc.stderr and "ZeroDivisionError" in proc.stderr
    assert proc.stderr.rstrip().endswith("KeyError: 'missing column'")
    run_json = manifest(out)
    assert run_json["launcher"] == "init" and run_json["outcome"] == "failed"
    assert run_json["error"]["type"] == "KeyError" and run_json["error"]["thread"] == "MainThread"
    thread_error = next(e for e in run_json["errors"] if e["thread"] == "loader-thread")
    assert thread_error["type"] == "ZeroDivisionError" and thread_error["fatal"] is False
    assert "lambda" in thread_error["traceback"]


def test_a_run_stopped_through_its_launcher_reads_halted(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN.replace('time.sleep(60)', 'open("ready", "w").close(); time.sleep(60)'))
    out = tmp_path / "run"
    launcher = subprocess.Popen([*STEPWATCH, "run", "--quiet", "--out", str(out), "train.py", "none", "-1"],
                                cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)  # a scheduler's preemption
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + 15, err[-3000:]
    run_json = manifest(out)
    assert run_json["outcome"] == "halted" and run_json["exit_code"] == 143
    error = run_json["error"]
    assert (error["rank"], error["signal"], error["seen_by"]) == (0, "SIGTERM", "rank")
