"""The live terminal view (``stepwatch.ui.live_view``) on a terminal: ``stepwatch run`` under a
pseudo-terminal (``pty.fork``), a real training run whose own lines must scroll above the view
whole, and ``stepwatch top`` under one too; the plain line's form and the folded table drawn from
snapshots."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from stepwatch.ui.live_view import OutputPump, phase_bar, plain_line, render_view
from stepwatch.views.live import SHARE_NAMES, LiveSnapshot, RankLive
from tests.support import STEPWATCH, clean_env
from tests.support.live_program import LINE_EVERY, PROGRAM, TOTAL

_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class Terminal:
    output: str  # everything the terminal received
    status: int
    run_dir: Path


def _in_terminal(argv: list[str], cwd: Path, env: dict[str, str], *, columns: int = 140,
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


@pytest.fixture(scope="module")
def terminal(tmp_path_factory: pytest.TempPathFactory) -> Terminal:
    base = tmp_path_factory.mktemp("live_tty")
    program = base / "train.py"
    program.write_text(PROGRAM)
    run_dir = base / "run"
    env = clean_env(LIVE_SLEEP="0.03", TERM="xterm-256color")
    output, status = _in_terminal([*STEPWATCH, "run", "--out", str(run_dir), "--view-every", "0.3", str(program)],
                                  base, env, resize=(b"program line 10:", 120))
    return Terminal(output, status, run_dir)


@pytest.mark.real
def test_run_on_a_terminal_draws_the_live_view(terminal: Terminal) -> None:
    assert terminal.status == 0, terminal.output[-3000:]
    assert _ESCAPE.search(terminal.output)  # a terminal gets the live view
    text = _ESCAPE.sub("", terminal.output)
    assert "stepwatch summary" in text  # the summary after the view
    frames = text.count("heartbeat")  # one header a frame
    assert frames >= 3, text[-3000:]
    assert f"step {TOTAL} of {TOTAL} (100%)" in text  # the last frame, with the plan's total


@pytest.mark.real
def test_the_programs_lines_scroll_above_the_view_whole(terminal: Terminal) -> None:
    # each line the program printed reaches the terminal in one piece, never cut by a redraw
    lines = re.findall(r"program line (\d+): loss \d+\.\d{4}\r\n", terminal.output)
    assert [int(n) for n in lines] == list(range(LINE_EVERY, TOTAL + 1, LINE_EVERY)), terminal.output[-3000:]
    # and the program still wrote to a terminal (its own, the view's pseudo-terminal)
    assert "program stdout is a tty: True\r\n" in terminal.output
    assert "\x1b[31mprogram in red\x1b[0m" in terminal.output  # its colours pass as it wrote them
    assert "program columns at the end: 120\r\n" in terminal.output  # the terminal resized: the job's too


@pytest.mark.real
def test_top_on_a_terminal_shows_the_ended_run_and_returns(terminal: Terminal) -> None:
    output, status = _in_terminal([*STEPWATCH, "top", str(terminal.run_dir)], terminal.run_dir.parent,
                                  clean_env(TERM="xterm-256color"), timeout=60)
    assert status == 0, output
    text = _ESCAPE.sub("", output)
    assert _ESCAPE.search(output) and f"step {TOTAL} of {TOTAL} (100%)" in text and "ended" in text


def test_the_pump_passes_whole_lines_and_keeps_the_partial_one() -> None:
    seen: list[str] = []
    pump = OutputPump(seen.extend)
    writer = os.dup(pump.slave)
    pump.job_started()
    os.write(writer, b"first line\nsecond \xc3")
    os.write(writer, b"\xa9 line\n  0%|\r 50%|")
    deadline = time.monotonic() + 10
    while pump.partial != " 50%|" and time.monotonic() < deadline:
        time.sleep(0.02)  # the pump's thread: no event to await from here
    assert pump.partial == " 50%|"
    os.close(writer)
    pump.close()
    assert seen == ["first line", "second \u00e9 line", " 50%|"]  # a terminal's \r\n, and \r keeps the rest


# -- drawing snapshots -------------------------------------------------------------------------


def _snapshot(ranks: int, **extra: object) -> LiveSnapshot:
    rows = tuple(RankLive(rank=r, step=100 + r, step_time_s=0.01 * (1 + r % 7), steps_per_s=50.0,
                          phase_shares={"forward": 0.5, "backward": 0.3, "wait": 0.2}, memory_bytes=2**30,
                          memory_peak_bytes=2**31, memory_kind="device", heartbeat_age_s=0.5)
                 for r in range(ranks))
    return LiveSnapshot(run_dir="runs/x", session_id="abcdef12-3456", taken_at=1000.0, ranks=rows,
                        **extra)  # type: ignore[arg-type]


def _drawn(snapshot: LiveSnapshot) -> str:
    console = Console(width=160, record=True, force_terminal=False, color_system=None)
    console.print(render_view(snapshot))
    return console.export_text()


def _rows(text: str) -> list[int]:
    return [int(line.split()[0]) for line in text.splitlines() if re.match(r"^\s*\d+\s+\d+\s", line)]


def test_many_ranks_fold_to_the_extremes_and_the_named() -> None:
    snapshot = _snapshot(40, alerts=({"kind": "STALL", "ranks": [33], "severity": "crit"},),
                         verdict={"name": "STRAGGLER", "severity": "warn", "ranks": [12], "message": "rank 12 lags"})
    text = _drawn(snapshot)
    shown = _rows(text)
    assert {12, 33} <= set(shown) and len(shown) <= 5
    assert {r % 7 for r in shown} >= {6, 0}  # a slowest (r % 7 == 6: 70 ms) and a fastest (10 ms)
    assert "of 40 ranks shown" in text
    assert "verdict STRAGGLER (warn, rank 12): rank 12 lags" in text and "alert STALL (crit) (rank 33)" in text


def test_sixteen_ranks_are_all_shown() -> None:
    assert _rows(_drawn(_snapshot(16))) == list(range(16))


def test_the_plain_line_has_the_documented_form() -> None:
    snapshot = _snapshot(2, total_steps=500, verdict={"name": "INPUT_BOUND", "severity": "crit", "ranks": [0]})
    assert plain_line(snapshot) == ("[stepwatch] step 100 (of 500) · 50 steps/s · step time 20 ms · "
                                    "INPUT_BOUND (crit, rank 0)")
    assert plain_line(_snapshot(0)) == "[stepwatch] step - · - steps/s · step time - · no verdict yet"


@given(st.text(max_size=60), st.text(max_size=60))
def test_the_plain_line_never_carries_a_control_character(name: str, kind: str) -> None:
    snapshot = _snapshot(1, verdict={"name": name, "severity": "warn"}, alerts=({"kind": kind, "ranks": [0]},))
    line = plain_line(snapshot)
    assert "\n" not in line and all(ch.isprintable() for ch in line)


@given(st.dictionaries(st.sampled_from(SHARE_NAMES), st.floats(0, 5, allow_nan=False)),
       st.integers(1, 40))
def test_the_phase_bar_always_fills_its_width(shares: dict[str, float], width: int) -> None:
    assert len(phase_bar(shares, width).plain) == width
