"""The job dies with its launcher: ``kill -9`` of ``stepwatch run`` (or SIGHUP, its terminal
closing) leaves no torchrun, rank or aggregator behind, and the run directory says why the run
ended. Real processes: torchrun, two gloo ranks, the aggregator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support import STEPWATCH, clean_env, free_port

pytest.importorskip("torch")
pytestmark = [pytest.mark.real, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")]

FOREVER = """
import os, time, torch
import torch.distributed as dist
if "RANK" in os.environ:
    dist.init_process_group("gloo")
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8)
while True:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    time.sleep(0.01)
"""


def _start(tmp_path: Path, nproc: int) -> tuple[subprocess.Popen[bytes], Path, list[psutil.Process]]:
    script = tmp_path / "forever.py"
    script.write_text(FOREVER)
    out = tmp_path / "run"
    launcher = subprocess.Popen([*STEPWATCH, "run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
                                 "--out", str(out), str(script)], cwd=tmp_path, env=clean_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # every rank started and has begun its capture
        if len(list(out.glob("heartbeat_rank*.jsonl"))) >= nproc:
            break
        assert launcher.poll() is None, "the launcher ended early"
        time.sleep(0.1)
    else:
        pytest.fail("the ranks did not start")
    while time.monotonic() < deadline:  # a few steps on every rank (torch's import is slow on a busy machine)
        stepped = [p for p in out.glob("heartbeat_rank*.jsonl")
                   if (lines := p.read_text().splitlines()) and '"step":0,' not in lines[-1]]
        if len(stepped) >= nproc:
            break
        time.sleep(0.2)
    job = psutil.Process(launcher.pid).children(recursive=True)
    ranks = [p for p in job if str(out.parent / "forever.py") in p.cmdline() and "torch.distributed.run" not in p.cmdline()]
    assert len(ranks) == nproc, [p.cmdline() for p in job]
    return launcher, out, job


def _assert_all_gone(job: list[psutil.Process], within_s: float) -> None:
    _, alive = psutil.wait_procs(job, timeout=within_s)
    leftover = [(p.pid, p.cmdline()) for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        p.kill()
    assert not leftover, f"still running {within_s} s after the launcher died: {leftover}"


def _last_heartbeat(path: Path) -> dict[str, object]:
    return json.loads(path.read_text().splitlines()[-1])


def test_kill_9_of_the_launcher_takes_the_whole_job_with_it(tmp_path: Path) -> None:
    launcher, out, job = _start(tmp_path, nproc=2)
    assert {"stepwatch.server", "torch.distributed.run"} <= {w for p in job for w in p.cmdline()}
    os.kill(launcher.pid, signal.SIGKILL)
    _assert_all_gone(job, within_s=8.0)
    launcher.wait()
    # the run directory says how the run ended, though the launcher could write nothing
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "interrupted"
    assert run["extra"]["ended_by"] == "launcher_died" and run["extra"]["launcher_pid"] == launcher.pid
    for rank in (0, 1):
        stop = _last_heartbeat(out / f"heartbeat_rank{rank}.jsonl")
        assert stop["msg"] == "stop" and stop["status"] == "interrupted", stop
        assert stop["ended_by"] == "launcher_died"


def test_sighup_to_the_launcher_stops_the_job_and_is_recorded(tmp_path: Path) -> None:
    launcher, out, job = _start(tmp_path, nproc=1)
    os.kill(launcher.pid, signal.SIGHUP)  # the terminal closed
    _assert_all_gone(job, within_s=15.0)
    assert launcher.wait(30) != 0
    run = json.loads((out / "run.json").read_text())
    assert run["extra"]["ended_by"] == "launcher_hangup" and run["status"] == "interrupted", run
    assert run["exit_code"] is not None
    assert (out / "final_summary.json").is_file()
