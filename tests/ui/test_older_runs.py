"""A run recorded by an older stepwatch, read by today's commands: its history in the first layout
(plain tables, no ``alerts`` or ``verdicts``, no ``steps.recompute_ns``), every other file as the
run wrote it. Each reader answers as it does on today's layout, and none of them writes the
file (a read-only open presents today's tables through TEMP views)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support import run_stepwatch
from tests.support.history import as_first_layout
from tests.support.trace_format import format_problems
from tests.support.web_runs import RUNS, web_runs

pytestmark = pytest.mark.real  # the run is a real stepwatch run

pytest.importorskip("torch")

RANKS, ARGS = RUNS["straggler"]
STEPS = int(ARGS[ARGS.index("--steps") + 1])  # per rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(today's run, the same run with its history in the first layout)."""
    today = web_runs(tmp_path_factory)["straggler"]
    older = tmp_path_factory.mktemp("older") / "run"
    shutil.copytree(today, older, ignore=shutil.ignore_patterns("history.sqlite*"))
    as_first_layout(today / "history.sqlite", older / "history.sqlite")
    return today, older


def _digest(run: Path) -> str:
    return hashlib.sha256((run / "history.sqlite").read_bytes()).hexdigest()


def _json(run: Path, *args: str) -> Any:
    proc = run_stepwatch(*args, cwd=run.parent)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_explain_and_query_read_an_older_history_as_todays(runs: tuple[Path, Path]) -> None:
    today, older = runs
    before = _digest(older)
    then, now = (_json(run, "explain", str(run), "--json")["diagnosis"] for run in (older, today))
    assert then["primary"]["name"] == now["primary"]["name"] != "INCOMPLETE_DATA", then["primary"]
    assert then["primary"]["ranks"] == now["primary"]["ranks"] == [1]  # the straggler, from either layout
    for question in ("--rank-skew", "--ooms"):
        assert _json(older, "query", str(older), question, "--format", "json") == \
            _json(today, "query", str(today), question, "--format", "json"), question
    slowest = [[(r["rank"], r["step"], r["step_ms"], r["recompute_ms"]) for r in
                _json(run, "query", str(run), "--slowest-steps", "5", "--format", "json")] for run in (older, today)]
    assert [r[:3] for r in slowest[0]] == [r[:3] for r in slowest[1]] and {r[3] for r in slowest[0]} == {None}
    assert _json(older, "query", str(older), "--alerts", "--format", "json") == []  # no alerts table then
    steps = _json(older, "query", str(older), "SELECT COUNT(*) AS n, COUNT(recompute_ns) AS r FROM steps",
                  "--format", "json")
    assert steps == [{"n": RANKS * STEPS, "r": 0}]  # every rank's steps; recompute unknown, never 0
    assert _digest(older) == before


def test_the_trace_and_the_report_of_an_older_run(runs: tuple[Path, Path], tmp_path: Path) -> None:
    _, older = runs
    before = _digest(older)
    trace = tmp_path / "trace.json"
    assert run_stepwatch("export", "perfetto", str(older), "-o", str(trace), cwd=tmp_path).returncode == 0
    events = json.loads(trace.read_text())
    assert format_problems(events) == []
    assert sum(1 for e in events["traceEvents"] if e.get("cat") == "step") == RANKS * STEPS
    report = run_stepwatch("report", str(older), "-o", str(tmp_path / "report.html"), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    packed = re.findall(r'<script type="application/octet-stream" id="[^"]+">([^<]+)</script>',
                        (tmp_path / "report.html").read_text())
    assert any("STRAGGLER" in gzip.decompress(base64.b64decode(text)).decode() for text in packed)
    assert _digest(older) == before


def test_an_older_run_goes_to_tensorboard_with_every_step(runs: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, older = runs
    before = _digest(older)
    proc = run_stepwatch("export", "tensorboard", str(older), "-o", str(tmp_path / "tb"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        acc = EventAccumulator(str(tmp_path / "tb" / f"rank_{rank}"), size_guidance={"scalars": 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars("step_time_ms")] == list(range(STEPS))
    assert _digest(older) == before
