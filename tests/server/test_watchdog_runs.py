"""The watchdog on real runs (docs/watchdog.md): tiny torch loops under ``stepwatch run`` (and one
under ``stepwatch.init`` followed by ``stepwatch watch``) that hang, go NaN, lose their gradient,
die without a word or slow down, and one clean run that must raise nothing."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stepwatch.server.launcher import STALL_KILL_EXIT
from tests.support import STEPWATCH, clean_env, free_port

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

pytest.importorskip("torch")

SLEEPER = '''
import os, sys, time
import torch
import torch.distributed as dist
import stepwatch

if len(sys.argv) > 2:
    stepwatch.init(out=sys.argv[2], interval=0.2)
rank = int(os.environ.get("RANK", "0"))
model = torch.nn.Linear(4, 1)
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def sleep_forever():
    while True:
        time.sleep(3600)

for step in range(100000):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    time.sleep(0.01)
    if step == 20 and rank == int(sys.argv[1]):
        sleep_forever()
'''

MODES = '''
import os, sys, time
import torch
import stepwatch

mode, steps = sys.argv[1], int(sys.argv[2])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, steps + 1):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    value = float("nan") if mode == "nan" and step >= 15 else loss.item()
    stepwatch.mark("loss", value)
    stepwatch.progress(step, loss=value, grad_norm=0.0 if mode == "zero" else 0.5 + 0.001 * step)
    if mode == "exit" and step == 10:
        os._exit(3)
    time.sleep(0.25 if mode == "slow" and step > 150 else 0.02)
'''


def _run(base: Path, script: str, *args: str, options: tuple[str, ...] = (), nproc: int = 1,
         timeout: float = 120) -> tuple[Path, subprocess.CompletedProcess[str], float]:
    (base / "train.py").write_text(script)
    out = base / "run"
    command = [*STEPWATCH, "run", "--interval", "200", "--out", str(out), "--stall-after", "2", *options]
    if nproc > 1:
        command += ["--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    started = time.monotonic()
    proc = subprocess.run([*command, "train.py", *args], cwd=base, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    return out, proc, time.monotonic() - started


def alerts_of(out: Path) -> list[dict[str, Any]]:
    path = out / "alerts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def history_alerts(out: Path) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(out / "history.sqlite")
    try:
        return db.execute("SELECT kind, ranks, step FROM alerts ORDER BY ts_ns").fetchall()
    finally:
        db.close()


def test_a_rank_that_sleeps_forever_stalls_and_kill_ends_the_job(tmp_path: Path) -> None:
    out, proc, elapsed = _run(tmp_path, SLEEPER, "0", options=("--on-stall", "kill"))
    assert proc.returncode == STALL_KILL_EXIT, proc.stderr[-3000:]
    [alert] = alerts_of(out)
    assert alert["kind"] == "STALL" and alert["ranks"] == [0] and alert["severity"] == "crit"
    assert set(alert) >= {"ts", "iso", "kind", "severity", "ranks", "step", "message", "evidence"}
    assert "[stepwatch] ALERT STALL (crit) rank 0" in proc.stderr
    assert alert["evidence"]["action"] == "kill"
    [dump] = alert["evidence"]["stacks"]
    assert "sleep_forever" in Path(dump).read_text()  # the sleeping function, in the rank's own dump
    run = json.loads((out / "run.json").read_text())
    assert run["outcome"] == "killed" and run["exit_code"] == STALL_KILL_EXIT
    assert run["error"]["kind"] == "watchdog" and run["error"]["type"] == "STALL"
    assert run["extra"]["ended_by"] == "watchdog_stall"
    assert [row[0] for row in history_alerts(out)] == ["STALL"]
    summary = json.loads((out / "final_summary.json").read_text())
    assert [a["kind"] for a in summary["alerts"]] == ["STALL"] and summary["alerts"][0]["ranks"] == [0]
    assert elapsed < 60


def test_under_ddp_the_stall_names_the_sleeping_rank_only(tmp_path: Path) -> None:
    out, proc, _ = _run(tmp_path, SLEEPER, "1", options=("--on-stall", "kill"), nproc=2)
    assert proc.returncode == STALL_KILL_EXIT, proc.stderr[-3000:]
    [alert] = alerts_of(out)
    assert alert["kind"] == "STALL" and alert["ranks"] == [1], alert
    assert [w["rank"] for w in alert["evidence"]["waiting"]] == [0]  # blocked in backward's all-reduce
    dumps = {Path(p).name.split("-")[0]: Path(p).read_text() for p in alert["evidence"]["stacks"]}
    assert "sleep_forever" in dumps["rank1"] and "sleep_forever" not in dumps["rank0"]


def test_a_nan_loss_fires_nonfinite_and_halt_stops_the_run(tmp_path: Path) -> None:
    out, proc, _ = _run(tmp_path, MODES, "nan", "600", options=("--on-nonfinite", "halt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    alerts = alerts_of(out)
    assert [a["kind"] for a in alerts] == ["NONFINITE"]
    assert alerts[0]["ranks"] == [0] and alerts[0]["evidence"]["metric"] == "loss"
    assert alerts[0]["step"] is not None and alerts[0]["step"] >= 13
    run = json.loads((out / "run.json").read_text())
    assert run["outcome"] == "halted", run
    steps = sqlite3.connect(out / "history.sqlite").execute("SELECT MAX(step) FROM steps").fetchone()[0]
    assert steps < 599  # stopped before the loop's end


def test_a_zero_grad_norm_fires_zero_grad_only(tmp_path: Path) -> None:
    out, proc, _ = _run(tmp_path, MODES, "zero", "40")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(a["kind"], a["ranks"]) for a in alerts_of(out)] == [("ZERO_GRAD", [0])]
    assert "ALERT ZERO_GRAD (warn)" in proc.stderr


def test_a_rank_that_exits_without_a_word_is_lost(tmp_path: Path) -> None:
    out, proc, _ = _run(tmp_path, MODES, "exit", "40")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert [(a["kind"], a["ranks"]) for a in alerts_of(out)] == [("RANK_LOST", [0])]
    assert [row[0] for row in history_alerts(out)] == ["RANK_LOST"]


def test_a_rank_killed_before_its_first_interval_is_known_and_lost(tmp_path: Path) -> None:
    """The sampler's first tick runs at once, not an interval (1 s by default) after the start:
    a rank killed in its first moments is known to the aggregator, which names it lost."""
    (tmp_path / "train.py").write_text("import os, signal, time\ntime.sleep(0.6)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    out = tmp_path / "run"
    proc = subprocess.run([*STEPWATCH, "run", "--out", str(out), "train.py"], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
    assert [(a["kind"], a["ranks"]) for a in alerts_of(out)] == [("RANK_LOST", [0])]
    with sqlite3.connect(out / "history.sqlite") as db:
        host, started = db.execute("SELECT host, started_at_ns FROM sessions").fetchone()
    assert host and started


def test_a_sharp_slowdown_fires_throughput_drop(tmp_path: Path) -> None:
    out, proc, _ = _run(tmp_path, MODES, "slow", "175", options=("--throughput-window", "0.5"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    alerts = alerts_of(out)
    assert [(a["kind"], a["ranks"]) for a in alerts] == [("THROUGHPUT_DROP", [0])], alerts
    evidence = alerts[0]["evidence"]["ranks"][0]
    assert all(rate < 0.5 * evidence["median_steps_per_s"] for rate in evidence["last_windows_steps_per_s"])


def test_a_clean_run_raises_no_alert(tmp_path: Path) -> None:
    out, proc, _ = _run(tmp_path, MODES, "clean", "150", options=("--throughput-window", "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert alerts_of(out) == [] and "ALERT" not in proc.stderr
    assert history_alerts(out) == []
    assert json.loads((out / "final_summary.json").read_text())["alerts"] == []


def test_watch_catches_a_stall_of_a_job_it_did_not_launch(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SLEEPER)
    out = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "train.py", "0", str(out)], cwd=tmp_path, env=clean_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (out / "heartbeat_rank0.jsonl").exists():  # the run directory, once init has made it
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.2)
        watcher = subprocess.Popen([*STEPWATCH, "watch", str(out), "--stall-after", "2", "--json"],
                                   env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        again: subprocess.Popen[str] | None = None
        try:
            assert watcher.stdout is not None
            line = watcher.stdout.readline()  # blocks until the first alert
            alert = json.loads(line)
            assert alert["kind"] == "STALL" and alert["ranks"] == [0]
            assert "sleep_forever" in Path(alert["evidence"]["stacks"][0]).read_text()
            dumps = sorted((out / "stacks").iterdir())
            # a second watch of the same hang: the STALL is in alerts.jsonl already, so it is
            # neither raised nor acted on again (no second stack dump)
            again = subprocess.Popen([*STEPWATCH, "watch", str(out), "--stall-after", "2"],
                                     env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert again.stderr is not None
            assert again.stderr.readline().startswith("[stepwatch] watching")  # it has read alerts.jsonl
            time.sleep(3)  # polls every 0.5 s; the hang is older than --stall-after already
            job.send_signal(signal.SIGTERM)  # the job ends: the watchers see its stop record and end
            assert watcher.wait(30) == 1
            assert again.wait(30) == 0
            assert "STALL" not in again.communicate()[1]
            assert sorted((out / "stacks").iterdir()) == dumps
        finally:
            for proc in (watcher, again):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                if proc is not None:
                    proc.communicate()
    finally:
        if job.poll() is None:
            job.kill()
        job.wait()
    assert [a["kind"] for a in alerts_of(out)] == ["STALL"]


def test_watch_halts_a_job_it_did_not_launch_when_its_loss_goes_nan(tmp_path: Path) -> None:
    # MODES under stepwatch.init alone: nothing of stepwatch's launcher around it
    (tmp_path / "train.py").write_text(MODES.replace("import stepwatch\n",
                                                     "import stepwatch\nstepwatch.init(out=sys.argv[3], interval=0.2)\n"))
    out = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "train.py", "nan", "3000", str(out)], cwd=tmp_path, env=clean_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "heartbeat_rank0.jsonl").exists():
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.2)
        watcher = subprocess.run([*STEPWATCH, "watch", str(out), "--on-nonfinite", "halt", "--json"],
                                 env=clean_env(), capture_output=True, text=True, timeout=120)
        assert job.wait(60) == 0  # stepwatch.Halt: SystemExit(0), long before its 3000 steps
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()
    assert watcher.returncode == 1, watcher.stderr
    alert = json.loads(watcher.stdout.splitlines()[0])
    assert alert["kind"] == "NONFINITE" and alert["evidence"]["action"] == "halt"
    assert "--on-nonfinite halt: every rank stops at step" in watcher.stderr
    request = json.loads((out / ".HALT").read_text())
    assert request["by"] == "stepwatch watch" and request["reason"].startswith("NONFINITE: ")
    end = json.loads((out / "outcome_rank0.json").read_text())
    assert end["outcome"] == "halted" and end["halt"]["step"] == request["target_step"] < 3000


def test_watch_says_what_is_wrong_with_its_input(tmp_path: Path) -> None:
    missing = subprocess.run([*STEPWATCH, "watch", str(tmp_path / "nope")], env=clean_env(), capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.startswith("error:") and "nope" in missing.stderr
    empty = subprocess.run([*STEPWATCH, "watch", str(tmp_path)], env=clean_env(), capture_output=True, text=True,
                           timeout=60)
    assert empty.returncode == 2 and "not a run directory" in empty.stderr
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "alerts.jsonl").mkdir()  # cannot be appended to
    unwritable = subprocess.run([*STEPWATCH, "watch", str(tmp_path)], env=clean_env(), capture_output=True,
                                text=True, timeout=60)
    assert unwritable.returncode == 2 and "alerts.jsonl" in unwritable.stderr
    assert len(unwritable.stderr.strip().splitlines()) == 1
    assert os.path.isdir(tmp_path / "alerts.jsonl")
