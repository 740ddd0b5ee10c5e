"""The live view's real runs, each made once per test session (``shared.once``) and read by both
its test modules (tests/views/test_live.py, the data; tests/ui/test_live_view.py, the drawing):

- ``watched_run``: a 2-rank ``stepwatch run`` through a pipe (plain lines every 0.5 s), watched
  while it trains by a ``LiveReader`` in this process and by ``stepwatch top`` in another;
- ``short_run``: a 1-rank ``stepwatch run`` through a pipe, shorter than its plain line's period
  (60 s here: the default 10 s is the same code, and a loaded machine may take 10 s to start);
- ``terminal_run``: a 1-rank ``stepwatch run`` under a pseudo-terminal (the live view), its
  terminal resized mid-run;
- ``killed_run``: ``stepwatch track`` with no history, its program SIGKILLed mid-run.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from stepwatch.views.live import LiveReader, LiveSnapshot
from tests.support import STEPWATCH, clean_env
from tests.support.live_program import PROGRAM
from tests.support.shared import once

# ``[stepwatch] step N (of M) · X steps/s · step time T · <verdict>``: step, total, rate, time, verdict
PLAIN = re.compile(r"^\[stepwatch\] step (\d+|-)(?: \(of (\d+)\))? · (\S+) steps/s · step time (\S+(?: m?s)?) · (.+)$")
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class Watched:
    run_dir: Path
    stdout: str
    stderr: str
    returncode: int
    during: list[LiveSnapshot]  # this process's reader, while the run trained
    top_stdout: str
    top_returncode: int
    final: LiveSnapshot


@dataclass
class Finished:
    run_dir: Path
    output: str  # a pipe's stderr, or everything a terminal received
    status: int
    stdout: str = ""


@dataclass
class Killed:
    run_dir: Path
    during: list[LiveSnapshot]
    killed_at_step: int


def _program(base: Path) -> Path:
    program = base / "train.py"
    program.write_text(PROGRAM)
    return program


def _snapshot(run_dir: Path) -> LiveSnapshot:
    reader = LiveReader(run_dir)
    try:
        return reader.snapshot()
    finally:
        reader.close()


def watched_run(factory: pytest.TempPathFactory) -> Watched:
    return once(factory, "live-watched", _watch)


def _watch(base: Path) -> Watched:
    program, run_dir = _program(base), base / "run"
    job = subprocess.Popen([*STEPWATCH, "run", "--nproc-per-node", "2", "--out", str(run_dir), "--view-every", "0.5",
                            str(program)], cwd=base, env=clean_env(LIVE_SLEEP="0.04"), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    top = None
    during: list[LiveSnapshot] = []
    reader = LiveReader(run_dir)
    deadline = time.monotonic() + 120
    try:
        while job.poll() is None and time.monotonic() < deadline:
            if top is None and (run_dir / "run.json").is_file():
                # ``stepwatch top`` from "another terminal": a pipe, so the plain form
                top = subprocess.Popen([*STEPWATCH, "top", str(run_dir), "--every", "0.5"], cwd=base, env=clean_env(),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if (run_dir / "ledger").is_dir():
                during.append(reader.snapshot())
            time.sleep(0.25)  # sampling a live state: there is no event to await
        stdout, stderr = job.communicate(timeout=120)
        assert top is not None
        top_stdout, top_stderr = top.communicate(timeout=60)
    finally:
        reader.close()
        for process in (job, top):
            if process is not None and process.poll() is None:
                process.kill()
    return Watched(run_dir, stdout, stderr, job.returncode, during, top_stdout + top_stderr, top.returncode,
                   _snapshot(run_dir))


def short_run(factory: pytest.TempPathFactory) -> Finished:
    """No sleep between steps: done well inside the plain line's period."""
    def build(base: Path) -> Finished:
        run_dir = base / "run"
        done = subprocess.run([*STEPWATCH, "run", "--out", str(run_dir), "--view-every", "60", str(_program(base))],
                              cwd=base,
                              env=clean_env(LIVE_SLEEP="0"), capture_output=True, text=True, timeout=120)
        return Finished(run_dir, done.stderr, done.returncode, done.stdout)

    return once(factory, "live-short", build)


def terminal_run(factory: pytest.TempPathFactory) -> Finished:
    def build(base: Path) -> Finished:
        run_dir = base / "run"
        output, status = in_terminal([*STEPWATCH, "run", "--out", str(run_dir), "--view-every", "0.3",
                                      str(_program(base))], base, clean_env(LIVE_SLEEP="0.03", TERM="xterm-256color"),
                                     resize=(b"program line 10:", 120))
        return Finished(run_dir, output, status)

    return once(factory, "live-terminal", build)


def killed_run(factory: pytest.TempPathFactory) -> Killed:
    return once(factory, "live-killed", _kill)


def _kill(base: Path) -> Killed:
    run_dir = base / "run"
    job = subprocess.Popen([*STEPWATCH, "track", "--out", str(run_dir), sys.executable, str(_program(base))], cwd=base,
                           env=clean_env(LIVE_SLEEP="0.03"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader = LiveReader(run_dir)
    during: list[LiveSnapshot] = []
    step = 0
    try:
        deadline = time.monotonic() + 120
        while job.poll() is None and time.monotonic() < deadline:
            snapshot = reader.snapshot()
            during.append(snapshot)
            if (snapshot.step or 0) >= 60:
                (ledger,) = (run_dir / "ledger").iterdir()
                os.kill(int(ledger.stem.split("-")[1]), signal.SIGKILL)  # the training process: rank<R>-<pid>
                step = snapshot.step or 0
                break
            time.sleep(0.2)  # sampling a live state: there is no event to await
        job.communicate(timeout=120)
    finally:
        reader.close()
        if job.poll() is None:
            job.kill()
    assert step, [s.step for s in during]
    return Killed(run_dir, during, step)


def in_terminal(argv: list[str], cwd: Path, env: dict[str, str], *, columns: int = 140,
                timeout: float = 120, resize: tuple[bytes, int] | None = None) -> tuple[str, int]:
    """``argv`` with a pseudo-terminal as its stdin, stdout and stderr; what it wrote and its exit
    status. ``resize``: once the output holds the marker, the terminal becomes that many columns."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is ours now
        try:
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                break
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal (it ended)
            break
        if not data:
            break
        chunks.append(data)
        if resize is not None and resize[0] in b"".join(chunks[-8:]):
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, resize[1], 0, 0))  # and the kernel's SIGWINCH
            resize = None
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        status = 0
    os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace"), os.waitstatus_to_exitcode(status)
