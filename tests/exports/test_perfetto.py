"""``stepwatch export perfetto`` on a real two-rank run: the trace keeps the Trace Event Format's
documented rules (phases, required fields, integer microseconds, pid/tid metadata, nested
complete events per thread) and holds every span, sample and mark of the history, on one clock."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.support import run_stepwatch
from tests.support.trace_format import format_problems, names, nesting_problems
from tests.support.trace_run import STEPS_PER_RANK

pytestmark = pytest.mark.real  # the run is a real stepwatch run (torchrun, two ranks)

pytest.importorskip("torch")


def _rows(run: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"{(run / 'history.sqlite').as_uri()}?mode=ro", uri=True) as db:
        return db.execute(sql, params).fetchall()


def _export(run: Path, out: Path, *args: str) -> dict[str, Any]:
    proc = run_stepwatch("export", "perfetto", str(run), "-o", str(out), *args, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out) and "ui.perfetto.dev" in proc.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def trace(run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _export(run, tmp_path_factory.mktemp("trace") / "trace.json")


def test_the_trace_keeps_the_formats_rules(trace: dict[str, Any]) -> None:
    assert format_problems(trace) == []
    assert nesting_problems(trace["traceEvents"]) == []
    assert {e["ph"] for e in trace["traceEvents"]} == {"M", "X", "C", "i"}


def test_one_process_track_per_rank_named_with_its_host_and_a_thread_track_per_thread(
        run: Path, trace: dict[str, Any]) -> None:
    events = trace["traceEvents"]
    hosts = dict(_rows(run, "SELECT rank, MAX(host) FROM telemetry GROUP BY rank"))
    processes = names(events, "process_name")
    assert processes == {(rank + 1, 0): f"rank {rank} @ {host}" for rank, host in hosts.items()}
    sort = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert sort == {1: 0, 2: 1}
    threads = names(events, "thread_name")
    for e in events:  # every track that holds an event is named
        if e["ph"] in ("X", "C") or e.get("s") == "p":
            assert (e["pid"], 0) in processes, e
        if e["ph"] == "X":
            assert (e["pid"], e["tid"]) in threads, e
    for rank in (0, 1):
        loop, writer = (_rows(run, "SELECT thread_id FROM spans WHERE rank = ? AND name = ? LIMIT 1", (rank, name))[0][0]
                        for name in ("step", "checkpoint_write"))
        on = {e["name"].split()[0]: e["tid"] for e in events if e["ph"] == "X" and e["pid"] == rank + 1}
        assert threads[(rank + 1, on["step"])] == f"training loop (thread {loop})"
        assert threads[(rank + 1, on["checkpoint_write"])].startswith(f"thread {writer}")
        assert on["step"] != on["checkpoint_write"]


def test_every_span_is_a_complete_event_with_its_attrs_in_microseconds_on_one_clock(
        run: Path, trace: dict[str, Any]) -> None:
    origin = trace["otherData"]["origin_unix_ns"]
    spans = {r[0]: r for r in _rows(run, "SELECT span_id, rank, name, idx, start_ns, end_ns, attrs FROM spans")}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(spans)
    for e in complete:
        span_id, rank, name, index, start, end, attrs = spans[e["args"]["span_id"]]
        assert e["pid"] == rank + 1 and e["name"] == (name if index is None else f"{name} {index}")
        # both ends floored to the microsecond from the one origin of every rank
        assert e["ts"] == (start - origin) // 1000 and e["ts"] + e["dur"] == (end - origin) // 1000
        assert json.loads(attrs).items() <= e["args"].items()
    categories = {e["name"].split()[0]: e["cat"] for e in complete}
    assert categories == {"stepwatch.session": "session", "epoch": "epoch", "step": "step", "data_load": "phase",
                          "forward": "phase", "backward": "phase", "optimizer_step": "phase",
                          "clip_grads": "scope", "checkpoint_write": "scope"}
    steps = [e for e in complete if e["cat"] == "step"]
    assert sorted(e["args"]["index"] for e in steps if e["pid"] == 1) == list(range(STEPS_PER_RANK))
    assert all(e["args"]["max_norm"] == 1.0 for e in complete if e["name"] == "clip_grads")
    assert min(e["ts"] for e in trace["traceEvents"] if "ts" in e) == 0


def test_memory_samples_are_rss_counters_and_marks_and_markers_are_instants(run: Path, trace: dict[str, Any]) -> None:
    events = trace["traceEvents"]
    origin = trace["otherData"]["origin_unix_ns"]
    for rank in (0, 1):
        samples = _rows(run, "SELECT timestamp_ns, allocated FROM telemetry WHERE rank = ? AND event_type = 'sample' "
                             "AND device_id = -1 ORDER BY timestamp_ns", (rank,))
        rss = [e for e in events if e["ph"] == "C" and e["name"] == "RSS" and e["pid"] == rank + 1]
        assert [(e["ts"], e["args"]["bytes"]) for e in rss] == [((t - origin) // 1000, b) for t, b in samples]
        # the program's loss marks and the ones stepwatch inferred (attrs.inferred)
        losses = _rows(run, "SELECT ts_ns, value_num, json_extract(attrs, '$.inferred') FROM marks "
                            "WHERE rank = ? AND name = 'loss'", (rank,))
        assert sum(1 for *_, inferred in losses if not inferred) == STEPS_PER_RANK
        marks = [e for e in events if e["ph"] == "i" and e["cat"] == "mark" and e["name"] == "loss"
                 and e["pid"] == rank + 1]
        assert sorted((e["ts"], e["args"]["value"], e["s"], e["args"].get("inferred")) for e in marks) == sorted(
            ((t - origin) // 1000, v, "p", inferred and True) for t, v, inferred in losses)
        curve = [e for e in events if e["ph"] == "C" and e["name"] == "mark loss" and e["pid"] == rank + 1]
        assert sorted((e["ts"], e["args"]["value"]) for e in curve) == sorted(
            ((t - origin) // 1000, v) for t, v, _ in losses)
        markers = sorted(e["name"] for e in events if e["ph"] == "i" and e["cat"] == "marker" and e["pid"] == rank + 1)
        assert markers == ["start", "stop"]


def test_steps_and_ranks_select_a_window_of_one_rank(run: Path, tmp_path: Path) -> None:
    trace = _export(run, tmp_path / "part.json", "--steps", "5:10", "--ranks", "1")
    events = trace["traceEvents"]
    assert format_problems(trace) == [] and nesting_problems(events) == []
    assert {e["pid"] for e in events} == {2}
    assert sorted(e["args"]["index"] for e in events if e.get("cat") == "step") == [5, 6, 7, 8, 9]
    (first, last), = _rows(run, "SELECT MIN(start_ns), MAX(end_ns) FROM steps WHERE rank = 1 AND step >= 5 AND step < 10")
    origin = trace["otherData"]["origin_unix_ns"]
    for e in events:
        if e["ph"] == "X":  # every span overlaps the window (its session and epoch hold it)
            assert e["ts"] <= (last - origin) // 1000 and e["ts"] + e["dur"] >= (first - origin) // 1000, e
        elif e["ph"] in ("C", "i"):
            assert (first - origin) // 1000 <= e["ts"] <= (last - origin) // 1000, e


@pytest.mark.parametrize(("args", "said"), [
    (["--steps", "9:3"], "B must be greater than A"),
    (["--steps", "x"], "is not a step number"),
    (["--ranks", "1-0"], "runs backwards"),
    (["--ranks", "7"], "no rank 7 recorded (its ranks: 0, 1)"),
    (["--steps", "900:"], "no step in 900: on the ranks exported (steps 0 to 23 recorded)"),
])
def test_a_selection_that_matches_nothing_or_does_not_parse_is_one_clear_error(
        run: Path, tmp_path: Path, args: list[str], said: str) -> None:
    proc = run_stepwatch("export", "perfetto", str(run), "-o", str(tmp_path / "t.json"), *args, cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert said in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written, not even a partial file
