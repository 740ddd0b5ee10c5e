"""What a ClickHouse store must answer as the SQLite store does on the same rows: the SELECTs,
the retention check and the named questions, shared by the tests of the 18.16 server and of
chdb's current engine; and both stores opened read-only side by side."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stepwatch.store import open_store
from stepwatch.store.sqlite import SqliteStore

from .clickhouse import mutations_done
from .store_rows import S1, S2, retention_batch


def both_stores(sqlite_path: Path | str, url: str) -> Iterator[tuple[SqliteStore, Any]]:
    """(the history.sqlite, the ClickHouse store of ``url``), both read-only, closed after."""
    sqlite = SqliteStore(sqlite_path, read_only=True)
    ch = open_store(url, read_only=True)
    try:
        yield sqlite, ch
    finally:
        sqlite.close()
        ch.close()


SELECTS = (
    "SELECT * FROM steps ORDER BY rank, step",
    "SELECT * FROM sessions",
    "SELECT session_id, rank, span_id, parent_id, name, idx, start_ns, end_ns, gpu_ns, thread_id, pid, attrs "
    "FROM spans ORDER BY rank, start_ns, span_id",
    "SELECT * FROM telemetry ORDER BY rank, timestamp_ns, event_type, collector",
    "SELECT * FROM marks ORDER BY rank, ts_ns, mark_id",
    "SELECT * FROM heartbeats ORDER BY rank, ts_ns",
    "SELECT rank, COUNT(*) AS n, MIN(step) AS first, MAX(step) AS last, SUM(step_ns) AS total FROM steps "
    "GROUP BY rank ORDER BY rank",
    "SELECT name, COUNT(*) AS n FROM spans GROUP BY name ORDER BY name",
    "SELECT MIN(step) AS none_here, COUNT(*) AS n FROM steps WHERE session_id = 'no-such-session'",
    "SELECT rank, MAX(allocated) AS peak FROM telemetry WHERE event_type = 'sample' GROUP BY rank ORDER BY rank",
)


DAY = 86_400_000_000_000
T0 = 1_700_000_000_000_000_000  # 2023-11-14T22:13:20Z


def retention_rows() -> dict[str, list[dict[str, Any]]]:
    """Rows of three sessions and ranks over three UTC days, for a window of 300 ns: S1 rank 0
    keeps only its last day's rows (the middle day holds nothing else: a partition to drop),
    S1 rank 1 and S2 lose some rows of a day that keeps others (deleted row by row)."""
    return retention_batch({(S1, 0): [T0, T0 + DAY, T0 + 2 * DAY + 700, T0 + 2 * DAY + 1000],
                            (S1, 1): [T0 + 100, T0 + 200, T0 + 450, T0 + 500],
                            (S2, 0): [T0 + 1000, T0 + 9000, T0 + 10_000]})


RETAINED = ("SELECT session_id, rank, timestamp_ns FROM telemetry ORDER BY 1, 2, 3",
            "SELECT session_id, rank, ts_ns, step FROM heartbeats ORDER BY 1, 2, 3",
            "SELECT session_id, rank, mark_id, ts_ns FROM marks ORDER BY 1, 2, 4",
            "SELECT session_id, rank, span_id, start_ns FROM spans ORDER BY 1, 2, 4",
            "SELECT session_id, rank, step, start_ns FROM steps ORDER BY 1, 2, 3")


def check_retention(ch: Any, sqlite: SqliteStore) -> list[str]:
    """Applies a 300 ns window to the same rows on both stores: the same count, then the same
    rows, and the day with no row left in its window gone as a whole partition. Returns the
    mutations the server was given (what deleted the rest)."""
    def days() -> set[str]:
        return {p for (p,) in ch.query_tuples("SELECT DISTINCT partition FROM system.parts WHERE database = ? "
                                              "AND table = 'steps_rows' AND active", (ch.url.database,))}

    for store in (sqlite, ch):
        store.append_many(retention_rows())
    assert len(days()) == 3
    assert ch.apply_retention(300) == sqlite.apply_retention(300) == 5 * 5  # 5 rows in each of 5 tables
    mutations_done(ch)
    for sql in RETAINED:
        assert ch.query(sql) == sqlite.query(sql), sql
    assert len(days()) == 2  # the middle day dropped whole
    assert ch.apply_retention(300) == 0
    return [c for (c,) in ch.query_tuples("SELECT command FROM system.mutations WHERE database = ?",
                                          (ch.url.database,))]


def named_answers(sqlite_path: Path, ch: Any, session_id: str | None = None) -> Iterator[tuple[str, Any, Any]]:
    """(question, SQLite's (columns, rows), the ClickHouse store's) for every named question."""
    from stepwatch.store.clickhouse_questions import ask_named
    from stepwatch.store.user_query import NAMED_QUESTIONS, ask, named_question

    for name in NAMED_QUESTIONS:
        question = named_question(name, session_id, 5)
        with ask(sqlite_path, *question) as answer:
            expected = (answer.columns, list(answer.rows))
        yield name, expected, ask_named(ch, name, question, session_id, 5)
