"""The final summary reads a session's steps once (``session_steps``), in the order the store
keeps them, and gives from that one read the statistics a row-by-row reading gives and the
diagnosis the verdicts' own window read gives: on real SQLite histories whose rows arrive
interleaved across ranks and sessions, as the aggregator stores them."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.analysis.summary import build_summary, percentile
from stepwatch.analysis.verdicts.inputs import diagnose_store, load_verdict_inputs, session_steps
from stepwatch.phases import PHASES, RESIDUAL, SHARES, STEP_COLUMNS
from stepwatch.store.sqlite import SqliteStore

SID = "00000000-0000-4000-8000-0000000000aa"
OTHER = "00000000-0000-4000-8000-0000000000bb"
MS = 1_000_000
_OUTSIDE = tuple(p.column for p in PHASES if not p.in_residual)


def reference_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The statistics read row by row, as the summary computed them before its one columnar read."""
    times = sorted(r["step_ns"] / 1e6 for r in rows if r["step_ns"] is not None)
    total = sum(r["step_ns"] for r in rows if r["step_ns"] is not None) / 1e6
    shares = {}
    for name, column in zip(SHARES, STEP_COLUMNS):
        if name == RESIDUAL.share:
            spent = sum(max(0, (r[column] or 0) - sum(r[c] or 0 for c in _OUTSIDE)) for r in rows) / 1e6
        else:
            spent = sum(r[column] or 0 for r in rows) / 1e6
        shares[name] = round(spent / total, 4) if total > 0 else None
    span_s = (max(r["end_ns"] for r in rows) - min(r["start_ns"] for r in rows)) / 1e9
    return {"steps": len(times),
            "step_ms": {"median": percentile(times, 0.5), "p90": percentile(times, 0.9),
                        "p99": percentile(times, 0.99), "mean": total / len(times) if times else None,
                        "max": times[-1] if times else None},
            "phase_share": shares,
            "throughput_steps_per_s": round(len(times) / span_s, 3) if span_s > 0 else None}


def close(found: Any, expected: Any) -> bool:
    """Equal, floats to within their last bits (the row-by-row sums rounded at every row)."""
    if isinstance(expected, dict):
        return found.keys() == expected.keys() and all(close(found[k], v) for k, v in expected.items())
    if isinstance(expected, float):
        return found == pytest.approx(expected, rel=1e-12)
    return bool(found == expected)


def step_row(session: str, rank: int, step: int, start: int, draw: Any) -> dict[str, Any]:
    step_ns = draw(st.integers(1, 50 * MS))
    phases = {c: draw(st.one_of(st.none(), st.integers(0, step_ns))) for c in STEP_COLUMNS}
    return {"session_id": session, "rank": rank, "step": step, "start_ns": start, "end_ns": start + step_ns,
            "step_ns": step_ns, **phases}


@st.composite
def histories(draw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(this session's rows, another session's rows), each rank with its own number of steps."""
    ours: list[dict[str, Any]] = []
    for rank in range(draw(st.integers(1, 4))):
        start = 1_790_000_000_000_000_000 + rank
        for step in range(draw(st.integers(1, 30))):
            ours.append(step_row(SID, rank, step, start, draw))
            start = ours[-1]["end_ns"] + 1000
    other = [step_row(OTHER, 0, step, step * MS, draw) for step in range(draw(st.integers(0, 5)))]
    return ours, other


def store_of(path: Path, ours: list[dict[str, Any]], other: list[dict[str, Any]], seed: int) -> SqliteStore:
    """The rows stored in an order of their own (interleaved across ranks and both sessions)."""
    path.unlink(missing_ok=True)
    store = SqliteStore(path)
    for session in (OTHER, SID):
        store.upsert_session({"session_id": session, "status": "completed", "started_at_ns": 0, "ended_at_ns": None,
                              "host": "h", "world_size": None, "source": "test", "command_line": None})
    rows = ours + other
    random.Random(seed).shuffle(rows)
    for begin in range(0, len(rows), 7):
        store.append("steps", rows[begin:begin + 7])
    return store


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=30)
@given(history=histories(), seed=st.integers(0, 2**16))
def test_one_read_gives_the_row_by_row_statistics_and_the_windows_diagnosis(
        tmp_path: Path, history: tuple[list[dict[str, Any]], list[dict[str, Any]]], seed: int) -> None:
    ours, other = history
    store = store_of(tmp_path / "h.sqlite", ours, other, seed)
    try:
        summary = build_summary(store, SID)
        assert close(summary["overall"], reference_stats(ours) | {
            "throughput_steps_per_s": summary["overall"]["throughput_steps_per_s"]})
        for rank in sorted({r["rank"] for r in ours}):
            assert close(summary["per_rank"][str(rank)], reference_stats([r for r in ours if r["rank"] == rank]))
        # the run's rate is its slowest rank's
        assert summary["overall"]["throughput_steps_per_s"] == min(
            s["throughput_steps_per_s"] for s in summary["per_rank"].values())
        read = session_steps(store, SID)
        assert [(r["rank"], r["step"]) for r in read] == sorted((r["rank"], r["step"]) for r in ours)
        for window in (None, 5):
            assert load_verdict_inputs(store, SID, last_steps=window, steps=read).steps[:] == \
                load_verdict_inputs(store, SID, last_steps=window).steps[:]
        assert summary["diagnosis"] == diagnose_store(store, SID).to_dict()
    finally:
        store.close()


def test_the_summary_reads_the_steps_table_once(tmp_path: Path) -> None:
    rows = [{"session_id": SID, "rank": rank, "step": step, "start_ns": step * 10 * MS, "end_ns": (step + 1) * 10 * MS,
             "step_ns": 10 * MS, **dict.fromkeys(STEP_COLUMNS, MS)} for step in range(50) for rank in range(2)]
    store = store_of(tmp_path / "h.sqlite", rows, [], 0)
    reads: list[str] = []
    store._db.set_trace_callback(lambda sql: reads.append(sql) if "steps_rows" in sql or "FROM steps " in sql else None)
    try:
        summary = build_summary(store, SID)
    finally:
        store.close()
    assert summary["overall"]["steps"] == 100 and summary["diagnosis"]["primary"] is not None
    whole = [sql for sql in reads if "rowid BETWEEN" in sql]
    assert len(whole) == 1  # the one read of every row...
    assert not [sql for sql in reads if "step_ns" in sql and sql not in whole]  # ...and no other read of them


def test_a_history_without_session_keys_is_read_through_its_view(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    columns = ("session_id", "rank", "step", "start_ns", "end_ns", "step_ns", *STEP_COLUMNS)
    db.execute(f"CREATE TABLE steps ({', '.join(columns)})")
    db.executemany(f"INSERT INTO steps VALUES ({', '.join('?' * len(columns))})",
                   [(SID, 0, step, step * MS, (step + 1) * MS, MS, *([0] * len(STEP_COLUMNS))) for step in range(3)])
    db.commit()
    db.close()
    store = SqliteStore(path, read_only=True)
    try:
        assert [(r["rank"], r["step"], r["step_ns"]) for r in session_steps(store, SID)] == [(0, s, MS) for s in range(3)]
    finally:
        store.close()
