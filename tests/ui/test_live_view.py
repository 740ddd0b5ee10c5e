"""The live terminal view (``stepwatch.ui.live``): ``stepwatch run`` under a pseudo-terminal, a real
training run whose own lines must scroll above the view whole, and ``stepwatch top`` under one
too; through a pipe, the plain lines of ``run`` and ``top`` and the last line ``run`` prints when
the job ends; the plain line's form and the folded table drawn from snapshots. The runs are
tests/support/live_runs.py's, shared with the data's tests (tests/views/test_live.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from stepwatch.ui.live.pump import OutputPump
from stepwatch.ui.live.table import phase_bar, render_view
from stepwatch.ui.live.text import plain_line
from stepwatch.views.live import SHARE_NAMES, LiveSnapshot, RankLive
from tests.support import STEPWATCH, clean_env
from tests.support.live_program import LINE_EVERY, TOTAL
from tests.support.live_runs import ESCAPE, PLAIN, Finished, Watched, in_terminal, short_run, terminal_run, watched_run


@pytest.fixture(scope="module")
def terminal(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    return terminal_run(tmp_path_factory)


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Watched:
    return watched_run(tmp_path_factory)


def _primary(run_dir: Path) -> dict[str, object]:
    """The run's final diagnosis's primary verdict (final_summary.json)."""
    return json.loads((run_dir / "final_summary.json").read_text())["diagnosis"]["primary"]  # type: ignore[no-any-return]


# -- on a terminal -----------------------------------------------------------------------------


@pytest.mark.real
def test_run_on_a_terminal_draws_the_live_view(terminal: Finished) -> None:
    assert terminal.status == 0, terminal.output[-3000:]
    assert ESCAPE.search(terminal.output)  # a terminal gets the live view
    text = ESCAPE.sub("", terminal.output)
    assert "stepwatch summary" in text  # the summary after the view
    frames = text.count("heartbeat")  # one header a frame
    assert frames >= 3, text[-3000:]
    assert f"step {TOTAL} of {TOTAL} (100%)" in text  # the last frame, with the plan's total


# through a pipe, but beside the terminal run's first test: parallel workers take tests in turn, so
# one builds this run while another builds that one
@pytest.mark.real
def test_a_run_shorter_than_the_period_prints_its_final_line_only(tmp_path_factory: pytest.TempPathFactory) -> None:
    short = short_run(tmp_path_factory)
    assert short.status == 0, short.output[-3000:]
    assert "\x1b" not in short.output + short.stdout
    plain = [line for line in short.output.splitlines() if line.startswith("[stepwatch] step ")]
    assert len(plain) == 1, short.output[-2000:]  # no period passed: the final line alone
    _final_line(short.output, short.run_dir)


@pytest.mark.real
def test_the_programs_lines_scroll_above_the_view_whole(terminal: Finished) -> None:
    # each line the program printed reaches the terminal in one piece, never cut by a redraw; a
    # line read before its newline is the view's pending line until the newline comes, so a frame
    # drawn in between shows it once more (each line counts at its first whole appearance)
    lines = re.findall(r"program line (\d+): loss \d+\.\d{4}\r\n", terminal.output)
    assert list(dict.fromkeys(int(n) for n in lines)) == list(range(LINE_EVERY, TOTAL + 1, LINE_EVERY)), \
        terminal.output[-3000:]
    # and the program still wrote to a terminal (its own, the view's pseudo-terminal)
    assert "program stdout is a tty: True\r\n" in terminal.output
    assert "\x1b[31mprogram in red\x1b[0m" in terminal.output  # its colours pass as it wrote them
    assert "program columns at the end: 120\r\n" in terminal.output  # the terminal resized: the job's too


@pytest.mark.real
def test_top_on_a_terminal_shows_the_ended_run_and_returns(terminal: Finished) -> None:
    output, status = in_terminal([*STEPWATCH, "top", str(terminal.run_dir)], terminal.run_dir.parent,
                                  clean_env(TERM="xterm-256color"), timeout=60)
    assert status == 0, output
    text = ESCAPE.sub("", output)
    assert ESCAPE.search(output) and f"step {TOTAL} of {TOTAL} (100%)" in text and "ended" in text


# -- through a pipe ------------------------------------------------------------------------------


@pytest.mark.real
def test_through_a_pipe_run_prints_plain_lines_and_no_escape_codes(watched: Watched) -> None:
    assert "\x1b" not in watched.stdout + watched.stderr
    plain = [line for line in watched.stderr.splitlines() if line.startswith("[stepwatch] step ")]
    assert plain, watched.stderr[-2000:]
    for line in plain:
        assert PLAIN.match(line), line
    numbers = [int(m.group(1)) for line in plain if (m := PLAIN.match(line)) and m.group(1) != "-"]
    assert numbers == sorted(numbers) and max(numbers) <= TOTAL
    assert any(f"(of {TOTAL})" in line for line in plain)
    # the program's own lines pass through untouched (stdout is its own, not the view's)
    assert f"program line {TOTAL}: loss" in watched.stdout
    assert "program stdout is a tty: False" in watched.stdout


def _final_line(stderr: str, run_dir: Path) -> re.Match[str]:
    """The last plain line: the final step of the total, a rate and a step time, the diagnosis's
    primary verdict; after it, only ``run``'s closing lines."""
    lines = stderr.splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("[stepwatch] step "))
    assert [line.split(";")[0] for line in lines[last + 1:]][:1] == ["[stepwatch] exit code 0"], lines[last:]
    found = PLAIN.match(lines[last])
    assert found is not None, lines[last]
    step, total, rate, step_time, verdict = found.groups()
    assert (step, total) == (str(TOTAL), str(TOTAL))
    assert float(rate.replace(",", "")) > 0 and re.fullmatch(r"[\d.]+ m?s", step_time), lines[last]
    assert verdict.startswith(f"{_primary(run_dir)['name']} ("), verdict
    return found


@pytest.mark.real
def test_the_last_plain_line_is_the_final_step_and_verdict(watched: Watched) -> None:
    _final_line(watched.stderr, watched.run_dir)


@pytest.mark.real
def test_top_from_another_terminal_follows_the_run_to_its_end(watched: Watched) -> None:
    assert watched.top_returncode == 0, watched.top_stdout
    assert "\x1b" not in watched.top_stdout
    lines = [line for line in watched.top_stdout.splitlines() if line.strip()]
    assert len(lines) >= 2 and all(PLAIN.match(line) for line in lines), lines
    last = PLAIN.match(lines[-1])
    assert last is not None and (last.group(1), last.group(2)) == (str(TOTAL), str(TOTAL))
    assert last.group(5).startswith(watched.final.verdict["name"])  # type: ignore[index]


@pytest.mark.real
def test_top_once_prints_the_table(watched: Watched) -> None:
    shown = subprocess.run([*STEPWATCH, "top", str(watched.run_dir), "--once"], env=clean_env(), capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout
    header, *rows = shown.stdout.splitlines()[1:4]
    assert header.split()[:4] == ["rank", "step", "step", "time"]
    assert [row.split()[:2] for row in rows] == [["0", str(TOTAL)], ["1", str(TOTAL)]]
    assert all("stopped" in row for row in rows)
    assert f"step {TOTAL} of {TOTAL} (100%)" in shown.stdout
    assert f"verdict {watched.final.verdict['name']}" in shown.stdout  # type: ignore[index]


@pytest.mark.real
def test_top_refuses_what_is_no_run_directory(tmp_path: Path) -> None:
    shown = subprocess.run([*STEPWATCH, "top", str(tmp_path), "--once"], env=clean_env(), capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 2 and "not a run directory" in shown.stderr and "Traceback" not in shown.stderr


# -- the job's output through the pump -----------------------------------------------------------


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
