"""The trace of synthetic histories (no process): alerts and verdicts, GPU time, OOMs, spans
that overlap without nesting, any set of spans (hypothesis), and memory that does not grow
with the run (the export streams)."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.exports.perfetto import TraceSelection, write_trace, write_trace_file
from stepwatch.exports.selection import parse_steps
from stepwatch.store.sqlite import SqliteStore
from tests.support import run_stepwatch
from tests.support.capture import finish, start
from tests.support.history import T0, write_run
from tests.support.trace_format import format_problems, names, nesting_problems

SID = "3f8a7c12-0000-4000-8000-000000000001"
MS = 1_000_000


def _span(rank: int, span_id: str, name: str, start: int, end: int, *, thread: int = 7, parent: str | None = None,
          index: int | None = None, gpu: int | None = None, attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"session_id": SID, "rank": rank, "span_id": span_id, "parent_id": parent, "name": name, "idx": index,
            "start_ns": start, "end_ns": end, "gpu_ns": gpu, "thread_id": thread, "pid": 100 + rank,
            "attrs": attrs or {}}


def _trace(store: SqliteStore, **selection: Any) -> dict[str, Any]:
    path = store.path.with_name("trace.json")
    with open(path, "wb") as out:
        write_trace(store, TraceSelection(SID, **selection), out, hosts=["node-a"])
    trace = json.loads(path.read_text())
    assert format_problems(trace) == [] and nesting_problems(trace["traceEvents"]) == []
    return trace


def test_alerts_and_verdicts_are_instants_on_their_rank_or_global(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:
        write_run(store, SID, ranks=2, steps=30)
        store.append_many({
            "alerts": [{"session_id": SID, "ts_ns": T0 + 50 * MS, "kind": "STALL", "severity": "crit", "ranks": [1],
                        "step": 4, "message": "rank 1 stalled", "evidence": {"age_s": 240}}],
            "verdicts": [{"session_id": SID, "ts_ns": T0 + 80 * MS, "step": 7, "window_steps": 100, "name": "INPUT_BOUND",
                          "severity": "warn", "score": 0.4, "ranks": [], "message": "input-bound", "next_step": "workers",
                          "evidence": {"share": 0.4}}]})
        events = _trace(store)["traceEvents"]
    alert, = (e for e in events if e.get("cat") == "alert")
    verdict, = (e for e in events if e.get("cat") == "verdict")
    assert (alert["name"], alert["s"], alert["pid"], alert["args"]["evidence"]) == ("alert STALL", "p", 2, {"age_s": 240})
    assert (verdict["name"], verdict["s"], verdict["args"]["message"]) == ("verdict INPUT_BOUND", "g", "input-bound")
    assert alert["ts"] == 50_000 and verdict["ts"] == 80_000  # the origin: the first step's start (T0)
    # no span, no telemetry host: the run's host names the rank
    assert set(names(events, "process_name").values()) == {"rank 0 @ test", "rank 1 @ test"}


def test_gpu_time_is_its_own_track_and_ooms_are_named(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:
        store.append_many({
            "spans": [_span(0, "s", "step", T0, T0 + 10 * MS, index=0, gpu=6 * MS),
                      _span(0, "f", "forward", T0 + MS, T0 + 4 * MS, parent="s", gpu=3 * MS),
                      _span(0, "b", "backward", T0 + 4 * MS, T0 + 9 * MS, parent="s")],
            "telemetry": [{"session_id": SID, "rank": 0, "timestamp_ns": T0 + 9 * MS, "event_type": "error",
                           "collector": "stepwatch.cuda_tracker", "device_id": 0, "allocated": 10, "reserved": 20,
                           "metadata": {"oom_reason": "CUDA out of memory"}},
                          {"session_id": SID, "rank": 0, "timestamp_ns": T0 + 2 * MS, "event_type": "sample",
                           "collector": "stepwatch.cuda_tracker", "device_id": 0, "allocated": 10, "reserved": 20,
                           "metadata": {}}]})
        events = _trace(store)["traceEvents"]
    gpu = sorted((e["name"], e["ts"], e["dur"], e["tid"]) for e in events if e.get("cat") == "gpu")
    tracks = names(events, "thread_name")
    assert [g[:3] for g in gpu] == [("forward", 1000, 3000), ("step 0", 0, 6000)]
    assert {tracks[(1, g[3])] for g in gpu} == {"GPU (measured)"}  # forward nests inside the step's GPU time
    assert {e["args"]["gpu_us"] for e in events if e.get("cat") in ("step", "phase") and "gpu_us" in e["args"]} == \
        {6000.0, 3000.0}
    oom, = (e for e in events if e.get("cat") == "marker")
    assert oom["name"] == "OOM" and oom["args"]["oom_reason"] == "CUDA out of memory" and oom["s"] == "p"
    counters = {e["name"]: e["args"]["bytes"] for e in events if e["ph"] == "C"}
    assert counters == {"stepwatch.cuda_tracker device 0 allocated": 10, "stepwatch.cuda_tracker device 0 reserved": 20}


def test_spans_that_overlap_without_nesting_get_a_track_of_their_own(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:  # an eval step that closes after the next epoch began
        store.append_many({"spans": [_span(0, "e0", "epoch", T0, T0 + 10 * MS, index=0),
                                     _span(0, "v0", "eval_step", T0 + 10 * MS, T0 + 12 * MS, index=0),
                                     _span(0, "e1", "epoch", T0 + 11 * MS, T0 + 20 * MS, index=1)]})
        events = _trace(store)["traceEvents"]
    tracks = names(events, "thread_name")
    where = {e["name"]: tracks[(e["pid"], e["tid"])] for e in events if e["ph"] == "X"}
    assert where == {"epoch 0": "thread 7", "eval_step 0": "thread 7", "epoch 1": "thread 7 (overlap 2)"}


def test_a_step_window_takes_the_spans_in_it_not_those_that_only_touch_it(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:  # steps back to back: one ends where the next starts
        write_run(store, SID, ranks=2, steps=0)
        steps = [_span(rank, f"r{rank}s{i}", "step", T0 + i * MS, T0 + (i + 1) * MS, index=i, thread=9 + rank,
                       attrs={"step_ns": MS}) for rank in (0, 1) for i in range(8)]
        marks = [_span(0, "m", "marker_scope", T0 + 5 * MS, T0 + 5 * MS, thread=9)]  # of no length, at the start
        store.append_many({"spans": steps + marks, "steps": [
            {"session_id": SID, "rank": s["rank"], "step": s["idx"], "start_ns": s["start_ns"], "end_ns": s["end_ns"],
             "step_ns": MS} for s in steps]})
        trace = _trace(store, steps=parse_steps("5:7"), ranks=frozenset({0}))
    spans = sorted(e["name"] for e in trace["traceEvents"] if e["ph"] == "X")
    assert spans == ["marker_scope", "step 5", "step 6"]
    assert trace["otherData"]["origin_unix_ns"] == T0 + 5 * MS


span_sets = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 10**6), st.integers(0, 10**6)),
                     min_size=1, max_size=40)


@settings(max_examples=25)
@given(span_sets)
def test_any_set_of_spans_exports_every_span_nested_per_track(items: list[tuple[int, int, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp, SqliteStore(Path(tmp) / "history.sqlite") as store:
        rows = [_span(rank, f"s{n}", "scope", T0 + a, T0 + a + b, thread=thread)
                for n, (rank, thread, a, b) in enumerate(items)]
        store.append_many({"spans": rows})
        events = _trace(store)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted(e["args"]["span_id"] for e in spans) == sorted(r["span_id"] for r in rows)
    assert min(e["ts"] for e in spans) == 0
    assert {e["pid"] - 1 for e in spans} == {r["rank"] for r in rows}


def _peak_export_bytes(store: SqliteStore) -> int:
    with open(os.devnull, "wb") as sink:
        tracemalloc.start()
        try:
            write_trace(store, TraceSelection(SID), sink)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()


def test_the_export_streams_its_memory_does_not_grow_with_the_run(tmp_path: Path) -> None:
    peaks = []
    for n, steps in ((0, 3_000), (1, 12_000)):  # both past a few of iterate()'s batches of rows
        with SqliteStore(tmp_path / f"h{n}.sqlite") as store:
            spans = [_span(0, f"s{i}", "step", T0 + i * MS, T0 + i * MS + MS // 2, index=i, attrs={"step_ns": MS // 2})
                     for i in range(steps)]
            store.append_many({"spans": spans})
            peaks.append(_peak_export_bytes(store))
    assert peaks[1] < peaks[0] * 1.25, peaks  # four times the spans, about the same peak


@pytest.mark.real
def test_a_run_with_no_history_exports_from_its_artifacts_to_standard_output(tmp_path: Path) -> None:
    import stepwatch

    run_dir = tmp_path / "run"
    start(run_dir)
    for n in range(3):
        with stepwatch.scope("work", n=n):
            stepwatch.mark("score", n)
    finish(run_dir)
    files = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    proc = run_stepwatch("export", "perfetto", str(run_dir), "-o", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(proc.stdout)
    assert format_problems(trace) == [] and nesting_problems(trace["traceEvents"]) == []
    work = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "work"]
    assert sorted(e["args"]["n"] for e in work) == [0, 1, 2] and {e["cat"] for e in work} == {"scope"}
    assert sorted(e["args"]["value"] for e in trace["traceEvents"] if e.get("cat") == "mark") == [0, 1, 2]
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == files  # nothing written into the run


def test_a_gz_name_writes_the_same_trace_gzip_compressed_and_whole(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:
        write_run(store, SID, ranks=2, steps=50)
        plain = write_trace_file(store, TraceSelection(SID), tmp_path / "trace.json")
        packed = write_trace_file(store, TraceSelection(SID), tmp_path / "trace.json.gz")
    with gzip.open(tmp_path / "trace.json.gz") as f:
        assert json.load(f) == json.loads((tmp_path / "trace.json").read_text())
    assert plain.events == packed.events and plain.events["C"] == 2 * 5  # a sample every 10 steps
    assert sorted(p.name for p in tmp_path.iterdir() if "trace" in p.name) == ["trace.json", "trace.json.gz"]
