"""The SQLite history store on a real file: WAL, one transaction per append, sessions,
read-only readers, retention, and idempotent span/mark ids."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.errors import StoreError
from stepwatch.store import TABLES, open_store
from stepwatch.store.base import COLUMNS
from stepwatch.store.sqlite import SqliteStore
from tests.support import examples
from tests.support.store_rows import S1, S2, heartbeat, mark, retention_batch, session, span, step, telemetry


@pytest.fixture
def store(tmp_path: Path):
    s = SqliteStore(tmp_path / "history.sqlite")
    yield s
    s.close()


def reader_count(path: Path, table: str) -> int:
    db = sqlite3.connect(path)
    try:
        return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    finally:
        db.close()


def test_wal_mode_and_every_table(store: SqliteStore) -> None:
    db = sqlite3.connect(store.path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        names = dict(db.execute("SELECT name, type FROM sqlite_master").fetchall())
        # readers see every table by its name, with its columns, through the session-key view
        for table, cols in COLUMNS.items():
            assert [r[1] for r in db.execute(f"PRAGMA table_info({table})")] == [c for c, _ in cols]
    finally:
        db.close()
    assert set(TABLES) <= names.keys()
    assert {names[t] for t in TABLES if t != "sessions"} == {"view"}
    store.append("telemetry", [telemetry(S1, 0, 1)])
    assert store.path.with_name("history.sqlite-wal").exists()


def test_commits_are_checkpointed_off_the_writer_and_close_removes_the_wal(store: SqliteStore) -> None:
    """The writer's connection never checkpoints (its commits don't wait on the fsync); the
    checkpointer thread copies each commit into the database file while the store stays open."""
    import time

    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    before = store.path.stat().st_size
    store.append("telemetry", [telemetry(S1, 0, t) for t in range(2000)])  # ~1 MiB: far below 1000 pages
    deadline = time.monotonic() + 10
    while store.path.stat().st_size <= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.path.stat().st_size > before
    store.close()
    assert not store.path.with_name("history.sqlite-wal").exists()
    assert reader_count(store.path, "telemetry") == 2000


def test_the_writer_checkpoints_itself_when_the_wal_outgrows_its_bound(
        store: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lagging (here: stopped) checkpointer must not let the WAL grow without end."""
    from stepwatch.store import sqlite as sqlite_module

    monkeypatch.setattr(sqlite_module, "_WAL_BOUND", 256 << 10)
    assert store._checkpointer is not None
    store._checkpointer.close()
    wal = store.path.with_name("history.sqlite-wal")
    sizes = []
    for commit in range(30):
        store.append("telemetry", [telemetry(S1, 0, commit * 1000 + t, metadata={"pad": "x" * 200}) for t in range(500)])
        sizes.append(wal.stat().st_size)
    assert sum(sizes) / len(sizes) < 2 * (256 << 10) + (2 << 20), sizes
    assert store.count("telemetry") == 30 * 500


def test_a_failing_checkpoint_in_the_writer_loses_no_committed_rows(
        store: SqliteStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from stepwatch.store import sqlite as sqlite_module

    class CheckpointFails:
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def execute(self, sql: str, *args: Any) -> Any:
            if "wal_checkpoint" in sql:
                raise sqlite3.OperationalError("disk I/O error")
            return self.db.execute(sql, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.db, name)

    monkeypatch.setattr(sqlite_module, "_WAL_BOUND", 0)
    store._db = CheckpointFails(store._db)  # type: ignore[assignment]
    for commit in range(2):
        assert store.append("telemetry", [telemetry(S1, 0, commit * 10 + t) for t in range(10)]) == 10
    store._db = store._db.db  # type: ignore[attr-defined]
    assert store.count("telemetry") == 20
    warned = [r for r in caplog.records if r.name == "stepwatch" and "WAL checkpoint failed" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"


def test_open_store_on_a_directory_uses_history_sqlite(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    try:
        s.append("marks", [mark(S1, 0, "m", 1)])
    finally:
        s.close()
    assert (tmp_path / "history.sqlite").is_file()
    assert reader_count(tmp_path / "history.sqlite", "marks") == 1


def test_append_many_writes_all_tables_in_one_commit(store: SqliteStore) -> None:
    written = store.append_many({"telemetry": [telemetry(S1, 0, 1), telemetry(S1, 0, 2)],
                                 "spans": [span(S1, 0, "a", 1)], "marks": [mark(S1, 0, "m", 1)],
                                 "heartbeats": [heartbeat(S1, 0, 1)], "steps": [step(S1, 0, 0, 1)]})
    assert written == 6
    for table, n in (("telemetry", 2), ("spans", 1), ("marks", 1), ("heartbeats", 1), ("steps", 1)):
        assert store.count(table) == n
        assert reader_count(store.path, table) == n
    row = store.query("SELECT attrs FROM spans")[0]
    assert msgspec.json.decode(row["attrs"]) == {"k": [1, 2]}


class _Unencodable:
    pass


@pytest.mark.parametrize("bad", [
    {"bogus_table": [{"x": 1}]},                                                    # unknown table
    {"marks": [{**mark(S1, 0, "bad", 1), "name": {"a": 1}}]},                       # unbindable value
    {"marks": [{**mark(S1, 0, "bad", 1), "ts_ns": 2**70}]},                          # int over 64 bits
    {"spans": [{**span(S1, 0, "bad", 1), "attrs": {"x": _Unencodable()}}]},          # json column not JSON
], ids=["unknown-table", "unbindable", "int-overflow", "unencodable-json"])
def test_a_failing_row_rolls_back_every_table_of_the_batch(store: SqliteStore, bad: dict[str, Any]) -> None:
    batch = {"telemetry": [telemetry(S1, 0, 1)], "heartbeats": [heartbeat(S1, 0, 1)], **bad,
             "steps": [step(S1, 0, 0, 1)]}
    with pytest.raises(StoreError):
        store.append_many(batch)
    for table in ("telemetry", "heartbeats", "marks", "spans", "steps"):
        assert store.count(table) == 0, table  # the writer's own connection sees nothing either
        assert reader_count(store.path, table) == 0, table
    # the store is left usable: the next write commits on its own and is visible to readers
    store.upsert_session(session(S1, 5))
    assert store.append_many({"telemetry": [telemetry(S1, 0, 2)]}) == 1
    assert reader_count(store.path, "telemetry") == 1
    # the session key the failed batch was given went with it: the row is under its session
    assert store.query("SELECT session_id FROM telemetry") == [{"session_id": S1}]
    assert reader_count(store.path, "sessions") == 1


def test_upsert_session_keeps_the_earliest_start_and_fills_fields(store: SqliteStore) -> None:
    store.upsert_session(session(S1, 200, host="a"))
    store.upsert_session(session(S1, 100))
    store.upsert_session(session(S1, 300, status="completed", world_size=4))
    store.upsert_session(session(S1, None, command_line=["python", "x.py"]))
    rows = store.sessions()
    assert len(rows) == 1
    row = rows[0]
    assert row["started_at_ns"] == 100
    assert row["status"] == "completed"
    assert row["host"] == "a"  # a later None does not erase it
    assert row["world_size"] == 4
    assert msgspec.json.decode(row["command_line"]) == ["python", "x.py"]


def test_upsert_session_start_from_nothing(store: SqliteStore) -> None:
    store.upsert_session(session(S2, None))
    store.upsert_session(session(S2, 50))
    assert store.sessions()[0]["started_at_ns"] == 50


def test_sessions_newest_first(store: SqliteStore) -> None:
    store.upsert_session(session(S1, 1))
    store.upsert_session(session(S2, 2))
    assert [s["session_id"] for s in store.sessions()] == [S2, S1]


def test_read_only_store_reads_but_cannot_write(store: SqliteStore) -> None:
    store.append_many({"telemetry": [telemetry(S1, 0, 1)]})
    store.upsert_session(session(S1, 1))
    reader = SqliteStore(store.path, read_only=True)
    try:
        assert reader.count("telemetry") == 1
        assert reader.sessions()[0]["session_id"] == S1
        with pytest.raises(StoreError):
            reader.append_many({"telemetry": [telemetry(S1, 0, 2)]})
        with pytest.raises(StoreError):
            reader.append("marks", [mark(S1, 0, "m", 1)])
        with pytest.raises(StoreError):
            reader.upsert_session(session(S2, 1))
        with pytest.raises(StoreError):
            reader.apply_retention(0)
        with pytest.raises(StoreError):
            reader.query("DELETE FROM telemetry")
        with pytest.raises(StoreError):
            reader.query("INSERT INTO sessions (session_id) VALUES ('x')")
        # the writer keeps writing while the reader is open, and the reader sees the commit
        store.append_many({"telemetry": [telemetry(S1, 0, 3)]})
        assert reader.count("telemetry") == 2
    finally:
        reader.close()
    assert reader_count(store.path, "sessions") == 1


def test_read_only_open_of_a_missing_store(tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        SqliteStore(tmp_path / "nope.sqlite", read_only=True)
    assert not (tmp_path / "nope.sqlite").exists()


def test_unknown_table_in_count(store: SqliteStore) -> None:
    with pytest.raises(StoreError):
        store.count("nope")


def test_retention_deletes_old_rows_per_session_and_rank(store: SqliteStore) -> None:
    # S1 rank 0 newest at 1000, S1 rank 1 newest at 500, S2 rank 0 newest at 10_000
    times = {(S1, 0): [100, 700, 900, 1000], (S1, 1): [100, 200, 450, 500], (S2, 0): [1000, 9000, 10_000]}
    store.append_many(retention_batch(times))
    removed = store.apply_retention(300)
    # kept: t >= newest - 300 of the same session and rank
    kept = {key: [t for t in ts if t >= max(ts) - 300] for key, ts in times.items()}
    lost = sum(len(ts) - len(kept[key]) for key, ts in times.items())
    assert removed == 5 * lost
    for table, column in (("telemetry", "timestamp_ns"), ("heartbeats", "ts_ns"), ("marks", "ts_ns"),
                          ("spans", "start_ns"), ("steps", "start_ns")):
        for (sid, rank), expected in kept.items():
            got = [r["t"] for r in store.query(
                f"SELECT {column} AS t FROM {table} WHERE session_id = ? AND rank = ? ORDER BY t", (sid, rank))]
            assert got == expected, (table, sid, rank)
    assert store.apply_retention(300) == 0


def test_duplicate_span_mark_and_step_ids_are_stored_once(store: SqliteStore) -> None:
    spans = [span(S1, 0, "a", 1), span(S1, 0, "b", 2)]
    marks = [mark(S1, 0, "m1", 1), mark(S1, 0, "m2", 2)]
    store.append_many({"spans": spans, "marks": marks, "steps": [step(S1, 0, 0, 1)]})
    store.append_many({"spans": spans + [{**spans[0], "name": "changed"}], "marks": marks + marks,
                       "steps": [step(S1, 0, 0, 1)]})
    assert store.count("spans") == 2 and store.count("marks") == 2 and store.count("steps") == 1
    assert {r["name"] for r in store.query("SELECT name FROM spans")} == {"forward"}  # the first one wins
    # the same ids on another rank or session are other rows
    store.append_many({"spans": [span(S1, 1, "a", 1), span(S2, 0, "a", 1)],
                       "marks": [mark(S1, 1, "m1", 1), mark(S2, 0, "m1", 1)]})
    assert store.count("spans") == 4 and store.count("marks") == 4
    assert store.count("spans", S2) == 1


def test_step_rows_and_memory_peaks(store: SqliteStore) -> None:
    store.append_many({
        "steps": [step(S1, 1, 1, 20), step(S1, 0, 1, 20), step(S1, 0, 0, 10), step(S2, 0, 0, 1)],
        "telemetry": [telemetry(S1, 0, 1, 100), telemetry(S1, 0, 2, 300), telemetry(S1, 0, 3, 200),
                      telemetry(S1, 1, 1, 50), telemetry(S1, 0, 4, 999, event_type="oom")],
    })
    assert [(r["rank"], r["step"]) for r in store.step_rows(S1)] == [(0, 0), (0, 1), (1, 1)]
    peaks = store.memory_peaks(S1)
    assert [(p["rank"], p["peak_allocated"], p["peak_reserved"]) for p in peaks] == [(0, 300, 600), (1, 50, 100)]


# -- hypothesis: batch splits do not change what is stored ----------------------------------------

_sessions = st.sampled_from([S1, S2])
_ranks = st.integers(0, 2)
_t = st.integers(0, 10_000)
_ids = st.sampled_from([f"id{i}" for i in range(6)])
_rows = st.one_of(
    st.builds(lambda s, r, t, a: ("telemetry", telemetry(s, r, t, a)), _sessions, _ranks, _t, st.integers(0, 2**40)),
    st.builds(lambda s, r, i, t: ("spans", span(s, r, i, t)), _sessions, _ranks, _ids, _t),
    st.builds(lambda s, r, i, t, v: ("marks", mark(s, r, i, t, v)), _sessions, _ranks, _ids, _t,
              st.floats(-1e6, 1e6, allow_nan=False)),
    st.builds(lambda s, r, t: ("heartbeats", heartbeat(s, r, t)), _sessions, _ranks, _t),
    st.builds(lambda s, r, n, t: ("steps", step(s, r, n, t)), _sessions, _ranks, st.integers(0, 5), _t),
)


def _dump(store: SqliteStore) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for table, cols in COLUMNS.items():
        names = ", ".join(c for c, _ in cols)
        out[table] = store.query(f"SELECT {names} FROM {table} ORDER BY {names}")
    for sid in (S1, S2):
        out[f"steps:{sid}"] = store.step_rows(sid)
        out[f"peaks:{sid}"] = store.memory_peaks(sid)
        out[f"count:{sid}"] = [store.count(t, sid) for t in TABLES]
    return out


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_rows, max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_random_batch_splits_store_the_same_rows(rows: list[tuple[str, dict[str, Any]]], cuts: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        whole = SqliteStore(Path(tmp) / "whole.sqlite")
        split = SqliteStore(Path(tmp) / "split.sqlite")
        try:
            batch: dict[str, list[dict[str, Any]]] = {}
            for table, row in rows:
                batch.setdefault(table, []).append(row)
            whole.append_many(batch)
            bounds = sorted({0, len(rows), *(min(c, len(rows)) for c in cuts)})
            for lo, hi in zip(bounds, bounds[1:]):
                part: dict[str, list[dict[str, Any]]] = {}
                for table, row in rows[lo:hi]:
                    part.setdefault(table, []).append(row)
                split.append_many(part)
            assert _dump(split) == _dump(whole)
            unique_spans = {(r["session_id"], r["rank"], r["span_id"]) for t, r in rows if t == "spans"}
            assert whole.count("spans") == len(unique_spans)
            # one row per distinct sample: (session, rank, time, type, collector, device) is its identity
            unique_samples = {(r["session_id"], r["rank"], r["timestamp_ns"]) for t, r in rows if t == "telemetry"}
            assert whole.count("telemetry") == len(unique_samples)
        finally:
            whole.close()
            split.close()


def test_whole_chunks_and_the_rest_keep_each_rows_session(store: SqliteStore) -> None:
    """Rows of three sessions interleaved, over several whole multi-row chunks and a remainder:
    every row reads back under its own session (the key stands in for the id in every chunk)."""
    from stepwatch.store.sqlite import CHUNK_ROWS

    sessions = (S1, S2, "session-three")
    rows = [telemetry(sessions[i % 3], i % 5, i) for i in range(3 * CHUNK_ROWS + 5)]
    spans = [span(sessions[i % 2], 0, f"s{i}", i) for i in range(CHUNK_ROWS + 1)]
    assert store.append_many({"telemetry": rows, "spans": spans}) == len(rows) + len(spans)
    got = store.query("SELECT session_id, rank, timestamp_ns, allocated FROM telemetry ORDER BY timestamp_ns")
    assert got == [{"session_id": r["session_id"], "rank": r["rank"], "timestamp_ns": r["timestamp_ns"],
                    "allocated": r["allocated"]} for r in rows]
    assert [store.count("spans", sid) for sid in sessions] == [CHUNK_ROWS // 2 + 1, CHUNK_ROWS // 2, 0]


_maybe_int = st.none() | st.integers(-(2**63), 2**63 - 1)
_maybe_text = st.none() | st.text(max_size=8)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_maybe_int, _maybe_int, _maybe_int, _maybe_text, _maybe_text,
                          st.none() | st.floats(allow_nan=False)), min_size=1, max_size=12))
def test_often_null_columns_read_back_null_or_their_value(store: SqliteStore, values: list[tuple[Any, ...]]) -> None:
    """The writer binds None as NaN in the columns that are often NULL (SQLite stores it as NULL):
    every None reads back as a real NULL and every value, extremes and empty strings included,
    as itself."""
    base = store.count("telemetry") + store.count("spans") + store.count("marks")
    rows = {"telemetry": [], "spans": [], "marks": []}
    for i, (a, b, c, text, parent, num) in enumerate(values, start=base):
        rows["telemetry"].append(telemetry(S1, 0, i, active=a, inactive=b, free=c, total=None, context=text))
        rows["spans"].append({**span(S1, 0, f"s{i}", i), "parent_id": parent, "idx": a, "gpu_ns": b})
        rows["marks"].append({**mark(S1, 0, f"m{i}", i), "span_id": parent, "value_num": num, "value_text": text})
    store.append_many(rows)
    got = store.query("SELECT active, inactive, free, total, context, typeof(total) AS t FROM telemetry "
                      "WHERE timestamp_ns >= ? ORDER BY timestamp_ns", [base])
    assert [(r["active"], r["inactive"], r["free"], r["context"]) for r in got] == [
        (a, b, c, text) for a, b, c, text, _, _ in values]
    assert {(r["total"], r["t"]) for r in got} == {(None, "null")}
    spans = store.query("SELECT parent_id, idx, gpu_ns FROM spans WHERE start_ns >= ? ORDER BY start_ns", [base])
    assert [tuple(r.values()) for r in spans] == [(parent, a, b) for a, b, _, _, parent, _ in values]
    marks = store.query("SELECT span_id, value_num, value_text FROM marks WHERE ts_ns >= ? ORDER BY ts_ns", [base])
    assert [tuple(r.values()) for r in marks] == [(parent, num, text) for _, _, _, text, parent, num in values]


# -- idempotence, batch ids, an older store ------------------------------------------------------


def snapshot(session: str, rank: int, snapshot_id: str) -> dict[str, Any]:
    return {"session_id": session, "rank": rank, "snapshot_id": snapshot_id, "span_id": "e", "tensor_name": "w",
            "mode": "stats", "ts_ns": 1, "stats": {"mean": 0.0}, "blob_uri": None}


def test_the_same_rows_twice_are_stored_once_in_every_table(store: SqliteStore) -> None:
    batch = {"telemetry": [telemetry(S1, 0, 1), telemetry(S1, 0, 2), telemetry(S1, 1, 1),
                           telemetry(S1, 0, 1, device_id=1), telemetry(S1, 0, 1, event_type="stop", device_id=None)],
             "heartbeats": [heartbeat(S1, 0, 5, 1), heartbeat(S1, 0, 5, 2), {**heartbeat(S1, 0, 5, 2), "msg": None}],
             "snapshots": [snapshot(S1, 0, "x"), snapshot(S1, 0, "y")],
             "spans": [span(S1, 0, "a", 1)], "marks": [mark(S1, 0, "m", 1)], "steps": [step(S1, 0, 0, 1)]}
    store.append_many(batch)
    first = {t: store.count(t) for t in TABLES}
    assert first["telemetry"] == 5 and first["heartbeats"] == 3 and first["snapshots"] == 2
    store.append_many(batch)
    store.append_tuples({"telemetry": [tuple(telemetry(S1, 0, 1, event_type="stop", device_id=None).get(c)
                                             if c != "metadata" else "{}" for c, _ in COLUMNS["telemetry"])]})
    assert {t: store.count(t) for t in TABLES} == first


def test_batch_ids_are_kept_with_their_rows_and_forgotten_after_the_window(store: SqliteStore) -> None:
    store.append_tuples({}, [("a" * 32, 100), ("b" * 32, 200)])
    store.append_tuples({"marks": []}, [("a" * 32, 300)])  # already known: the first time stays
    assert store.seen_batches(0) == {"a" * 32: 100, "b" * 32: 200}
    assert store.seen_batches(150) == {"b" * 32: 200}
    assert store.forget_batches(150) == 1
    assert store.seen_batches(0) == {"b" * 32: 200}
    with pytest.raises(StoreError):  # a failed write records no batch id either
        store.append_tuples({"nope": [(1,)]}, [("c" * 32, 1)])
    assert store.seen_batches(0) == {"b" * 32: 200}


def test_a_store_from_before_the_session_keys_is_migrated_on_open(tmp_path: Path) -> None:
    """Tables with session_id in every row (and, older still, no unique indexes) become the
    keyed tables: every row kept under its session, duplicates of a unique key stored once."""
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    for table, cols in COLUMNS.items():  # steps as it was then: no recompute_ns
        db.execute(f"CREATE TABLE {table} ({', '.join(c for c, _ in cols if c != 'recompute_ns')})")
    for statement in ("CREATE INDEX telemetry_by_session ON telemetry (session_id, rank, timestamp_ns)",
                      "CREATE UNIQUE INDEX spans_unique ON spans (session_id, rank, span_id)",
                      "CREATE INDEX heartbeats_by_session ON heartbeats (session_id, rank, ts_ns)"):
        db.execute(statement)
    row = (S1, 0, 5, "sample", "c", 0) + (None,) * 12
    db.executemany(f"INSERT INTO telemetry VALUES ({', '.join('?' * 18)})",
                   [row, row, (S1, 0, 6, *row[3:]), (S2, 3, 5, *row[3:])])
    db.executemany(f"INSERT INTO spans VALUES ({', '.join('?' * 12)})",
                   [(S2, 1, "a", None, "step", 0, 10, 20, None, 1, 2, '{"k": 1}'), (S1, 0, "a", *(None,) * 9)])
    db.execute(f"INSERT INTO steps VALUES ({', '.join('?' * 12)})", (S2, 1, 0, 10, 20, 10, 1, 0, 2, 3, 4, 0))
    db.execute("INSERT INTO sessions (session_id, status) VALUES (?, 'completed')", (S2,))
    db.commit()
    db.close()
    with SqliteStore(path) as store:
        assert store.query("SELECT session_id, rank, timestamp_ns FROM telemetry ORDER BY 1, 3") == [
            {"session_id": S1, "rank": 0, "timestamp_ns": 5}, {"session_id": S1, "rank": 0, "timestamp_ns": 6},
            {"session_id": S2, "rank": 3, "timestamp_ns": 5}]
        assert store.query("SELECT * FROM spans WHERE session_id = ?", (S2,)) == [
            {"session_id": S2, "rank": 1, "span_id": "a", "parent_id": None, "name": "step", "idx": 0,
             "start_ns": 10, "end_ns": 20, "gpu_ns": None, "thread_id": 1, "pid": 2, "attrs": '{"k": 1}'}]
        assert [(r["step_ns"], r["recompute_ns"]) for r in store.step_rows(S2)] == [(10, None)]  # unknown
        assert store.count("spans", S1) == 1
        names = {r["name"] for r in store.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert "telemetry_by_session" not in names and "heartbeats_by_session" not in names
        assert {"telemetry_unique", "heartbeats_unique", "snapshots_unique", "spans_unique"} <= names
        store.append_many({"telemetry": [{**telemetry(S1, 0, 5), "allocated": None, "reserved": None,
                                          "total": None, "metadata": None}]})  # the same key: ignored
    with SqliteStore(path) as store:  # opening again changes nothing
        assert store.count("telemetry") == 3
        assert store.count("telemetry", S1) == 2


def test_a_store_from_before_a_declared_column_gains_it_on_open(tmp_path: Path) -> None:
    """A keyed store written before ``steps.recompute_ns`` existed: the column is added (NULL in
    the old rows, never 0), the view shows it, and new rows carry it."""
    path = tmp_path / "keyed.sqlite"
    with SqliteStore(path):
        pass
    db = sqlite3.connect(path)
    columns = [c for c, _ in COLUMNS["steps"][1:] if c != "recompute_ns"]
    db.execute("DROP VIEW steps")
    db.execute("DROP TABLE steps_rows")
    db.execute(f"CREATE TABLE steps_rows (session_key INTEGER, {', '.join(columns)})")
    db.execute("INSERT INTO session_keys (session_id) VALUES (?)", (S1,))
    db.execute(f"INSERT INTO steps_rows VALUES (1, {', '.join('?' * len(columns))})",
               (0, 0, 10, 20, 10, 1, 0, 2, 3, 4, 0))
    db.execute(f"CREATE VIEW steps (session_id, {', '.join(columns)}) AS SELECT k.session_id, "
               f"{', '.join('r.' + c for c in columns)} FROM steps_rows r "
               "LEFT JOIN session_keys k ON k.session_key = r.session_key")
    db.commit()
    db.close()
    with SqliteStore(path) as store:
        store.append_many({"steps": [{**dict.fromkeys(c for c, _ in COLUMNS["steps"]), "session_id": S1, "rank": 0,
                                      "step": 1, "start_ns": 20, "end_ns": 30, "step_ns": 10, "recompute_ns": 4}]})
        assert [(r["step"], r["recompute_ns"]) for r in store.step_rows(S1)] == [(0, None), (1, 4)]


def test_retention_needs_no_time_index_and_covers_snapshots(store: SqliteStore) -> None:
    store.append_many({"spans": [span(S1, 0, f"s{t}", t) for t in range(0, 1000, 10)],
                       "snapshots": [{**snapshot(S1, 0, f"x{t}"), "ts_ns": t} for t in (1, 500, 900)]})
    assert store.apply_retention(100) == 89 + 2  # spans before 890, snapshots before 800
    assert [r["start_ns"] for r in store.query("SELECT start_ns FROM spans ORDER BY 1")] == list(range(890, 1000, 10))
    assert [r["ts_ns"] for r in store.query("SELECT ts_ns FROM snapshots")] == [900]
