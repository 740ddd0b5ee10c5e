"""``stepwatch query``'s reading of a history: read-only by the connection (every kind of write is
refused and the file's bytes stay as they were), the named questions on a real run, and the
views documented in docs/query.md."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from stepwatch.errors import StoreError
from stepwatch.store.sqlite import SqliteStore
from stepwatch.store.user_query import NAMED_QUESTIONS, QUERY_VIEWS, ask, named_question
from tests.support.history import T0, write_run
from tests.support.trace_run import STEPS_PER_RANK, trace_run

DOCS = Path(__file__).resolve().parents[2] / "docs" / "query.md"

WRITES = [
    "INSERT INTO sessions (session_id) VALUES ('intruder')",
    "INSERT INTO spans_rows (session_key, span_id) VALUES (1, 'x') RETURNING span_id",
    "REPLACE INTO session_keys (session_key, session_id) VALUES (1, 'x')",
    "UPDATE sessions SET status = 'failed'",
    "DELETE FROM steps_rows",
    "WITH doomed AS (SELECT rowid FROM marks_rows) DELETE FROM marks_rows WHERE rowid IN doomed",
    "DROP TABLE spans_rows",
    "DROP VIEW spans",
    "CREATE TABLE notes (text TEXT)",
    "CREATE TEMP TABLE scratch (x)",
    "CREATE INDEX extra ON steps_rows (step_ns)",
    "ALTER TABLE sessions ADD COLUMN owner TEXT",
    "ATTACH DATABASE ':memory:' AS other",
    "ATTACH DATABASE 'elsewhere.sqlite' AS other",
    "VACUUM",
    "VACUUM INTO 'copy.sqlite'",
    "REINDEX",
    "ANALYZE",
    "BEGIN IMMEDIATE",
    "PRAGMA user_version = 7",
    "PRAGMA journal_mode = DELETE",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    return trace_run(tmp_path_factory)


@pytest.fixture(scope="module")
def copy(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's history, copied: the refused writes are tried on the copy (the shared run stays
    as it was whatever happens)."""
    target = tmp_path_factory.mktemp("query") / "history.sqlite"
    shutil.copyfile(run / "history.sqlite", target)
    return target


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _all(path: Path, sql: str, params: tuple[Any, ...] = ()) -> tuple[list[str], list[tuple[Any, ...]]]:
    with ask(path, sql, params) as answer:
        return answer.columns, list(answer.rows)


@pytest.mark.real
@pytest.mark.parametrize("sql", WRITES)
def test_every_write_is_refused_and_changes_no_byte(copy: Path, sql: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(copy.parent)  # where ATTACH and VACUUM INTO would create their files
    before, counts = _digest(copy), _all(copy, "SELECT (SELECT COUNT(*) FROM spans), (SELECT COUNT(*) FROM steps)")
    with pytest.raises(StoreError, match="refused") as refused:
        _all(copy, sql)
    assert "Traceback" not in str(refused.value) and "\n" not in str(refused.value)
    assert _digest(copy) == before
    assert _all(copy, "SELECT (SELECT COUNT(*) FROM spans), (SELECT COUNT(*) FROM steps)") == counts
    assert sorted(p.name for p in copy.parent.iterdir() if not p.name.startswith("history.sqlite")) == []


@pytest.mark.real
def test_turning_query_only_off_still_writes_nothing(copy: Path) -> None:
    before = _digest(copy)
    assert _all(copy, "PRAGMA query_only = OFF") == ([], [])
    with pytest.raises(StoreError, match="refused"):
        _all(copy, "DELETE FROM steps_rows")
    assert _digest(copy) == before


@pytest.mark.parametrize(("sql", "said"), [("SELEC 1", 'near "SELEC": syntax error'),
                                           ("SELECT * FROM nowhere", "no such table: nowhere"),
                                           ("SELECT 1; SELECT 2", "one statement at a time")])
def test_sql_errors_name_the_problem(tmp_path: Path, sql: str, said: str) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:
        write_run(store, "s", ranks=1, steps=3)
    with pytest.raises(StoreError, match=re.escape(said)):
        _all(tmp_path / "history.sqlite", sql)


def test_a_file_that_is_no_store_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notes.sqlite").write_text("not a database\n" * 100)
    with pytest.raises(StoreError, match="cannot open history store: file is not a database"):
        _all(tmp_path / "notes.sqlite", "SELECT 1")
    with pytest.raises(StoreError, match="no history store here"):
        _all(tmp_path / "missing.sqlite", "SELECT 1")


@pytest.mark.real
def test_named_questions_on_a_real_run(run: Path) -> None:
    history = run / "history.sqlite"
    sid = json.loads((run / "run.json").read_text())["session_id"]
    columns, rows = _all(history, *named_question("sessions"))
    session = dict(zip(columns, rows[0]))
    assert len(rows) == 1 and session["session_id"] == sid and session["status"] == "completed"
    assert session["world_size"] == 2 and session["step_rows"] == 2 * STEPS_PER_RANK and session["duration_s"] > 0

    columns, rows = _all(history, *named_question("slowest-steps", None, 5))
    times = [dict(zip(columns, r))["step_ms"] for r in rows]
    (worst,), = _all(history, "SELECT MAX(step_ns) / 1e6 FROM steps")[1]
    assert len(rows) == 5 and times == sorted(times, reverse=True) and times[0] == pytest.approx(worst, abs=1e-3)
    assert {"data_load_ms", "forward_ms", "backward_ms", "optimizer_ms", "wait_ms"} <= set(columns)

    columns, rows = _all(history, *named_question("rank-skew"))
    skew = [dict(zip(columns, r)) for r in rows]
    assert [s["rank"] for s in skew] == [0, 1] and all(s["steps"] == STEPS_PER_RANK for s in skew)
    assert sum(s["vs_mean_pct"] for s in skew) == pytest.approx(0, abs=0.2)
    assert sum(s["slowest_in_steps"] for s in skew) >= STEPS_PER_RANK  # each step has a slowest rank (ties: both)
    assert min(s["mean_lag_ms"] for s in skew) >= 0

    for name in ("alerts", "ooms"):  # a healthy run: the columns, no row
        columns, rows = _all(history, *named_question(name))
        assert rows == [] and "session_id" in columns
    assert _all(history, *named_question("sessions", "another-session"))[1] == []


def test_ooms_come_from_the_ranks_error_events(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:
        write_run(store, "s1", ranks=1, steps=3)
        error = {"session_id": "s1", "rank": 0, "event_type": "error", "collector": "stepwatch.cuda_tracker",
                 "device_id": 0, "allocated": 7, "reserved": 9, "total": 10}
        store.append_many({"telemetry": [
            {**error, "timestamp_ns": T0 + 1, "metadata": {"oom_reason": "CUDA out of memory", "oom_dump_path": "b/1"}},
            {**error, "timestamp_ns": T0 + 2, "metadata": {"oom": True}},
            {**error, "timestamp_ns": T0 + 3, "metadata": {"oom": False}},  # an error, no OOM
            {**error, "timestamp_ns": T0 + 4, "metadata": {"exception": "ValueError"}}]})
    columns, rows = _all(tmp_path / "history.sqlite", *named_question("ooms"))
    found = [dict(zip(columns, r)) for r in rows]
    assert [(f["reason"], f["dump_path"], f["allocated"]) for f in found] == [("CUDA out of memory", "b/1", 7),
                                                                             (None, None, 7)]


def test_every_view_and_column_and_named_question_is_documented_and_queryable(tmp_path: Path) -> None:
    text = DOCS.read_text()
    with SqliteStore(tmp_path / "history.sqlite") as store:
        write_run(store, "s", ranks=1, steps=3)
    for view in QUERY_VIEWS:
        columns, _ = _all(tmp_path / "history.sqlite", f"SELECT * FROM {view} LIMIT 1")
        section = text.split(f"### `{view}`", 1)
        assert len(section) == 2, f"docs/query.md has no section ### `{view}`"
        body = section[1].split("\n### ", 1)[0]
        missing = [c for c in columns if f"`{c}`" not in body]
        assert missing == [], f"{view}: columns not documented: {missing}"
    for name in NAMED_QUESTIONS:
        assert f"--{name}" in text


def test_beside_a_live_writer_a_query_reads_what_it_committed_and_cannot_checkpoint(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:
        write_run(store, "s", ranks=1, steps=3)
    writer = sqlite3.connect(tmp_path / "history.sqlite", isolation_level=None)  # an aggregator, mid-run
    try:
        writer.execute("PRAGMA wal_autocheckpoint = 0")
        writer.execute("UPDATE steps_rows SET step_ns = step_ns + 1")  # committed, only in the WAL
        # the data: the file and its WAL (a reader writes its read marks into the -shm index, as
        # every WAL reader does; that holds no rows)
        files = {p.name: _digest(p) for p in tmp_path.iterdir() if not p.name.endswith("-shm")}
        assert (tmp_path / "history.sqlite-wal").stat().st_size > 0
        assert _all(tmp_path / "history.sqlite", "SELECT COUNT(*) FROM steps")[1] == [(3,)]
        for sql in ("PRAGMA wal_checkpoint(TRUNCATE)", "PRAGMA wal_checkpoint(PASSIVE)", "DELETE FROM steps_rows"):
            with pytest.raises(StoreError, match="refused"):
                _all(tmp_path / "history.sqlite", sql)
        assert {p.name: _digest(p) for p in tmp_path.iterdir() if not p.name.endswith("-shm")} == files
    finally:
        writer.close()
