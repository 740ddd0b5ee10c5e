"""Read-only SQL over a history store, for ``stepwatch query``: people's own SQL and the named
questions (docs/query.md lists the views and their columns).

Read-only by the connection, never by reading the SQL: the file is opened with SQLite's
``mode=ro`` (no statement can write it, whatever it is), ``PRAGMA query_only`` refuses the
writes SQLite would allow a read-only connection (a temporary table), and the limit on attached
databases is 0, so ``ATTACH`` and ``VACUUM INTO`` (which attaches its target) cannot write any
other file either. A refused write, like any SQL error, is a ``StoreError`` that says what
SQLite objected to, and the store's bytes are as they were.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import StoreError
from ..phases import STEP_COLUMNS
from ..schema.tables import TABLES
from .sqlite import see_todays_tables

__all__ = ["NAMED_QUESTIONS", "QUERY_VIEWS", "Answer", "ask", "ask_named_url", "ask_url", "named_question",
           "read_only_connection"]

# the views a query may read (each table's columns in docs/query.md); every one a view or a
# table of every stepwatch store
QUERY_VIEWS: tuple[str, ...] = tuple(TABLES)

_ISO = "strftime('%Y-%m-%dT%H:%M:%fZ', {0} / 1e9, 'unixepoch')"
_SESSION = "(?1 IS NULL OR {0}session_id = ?1)"
_PHASE_MS = ", ".join(f"ROUND({c} / 1e6, 3) AS {c[:-3]}_ms" for c in STEP_COLUMNS)
_TRUE = "COALESCE(json_extract(metadata, '$.{0}'), 0) NOT IN (0, '', 'false')"

# name -> (SQL, what it answers). ?1: the session (NULL: every session), ?2: the question's N.
# Each ORDER BY names columns enough to leave no tie between distinct rows, so a ClickHouse
# store gives the same rows in the same order (store.clickhouse_questions).
NAMED_QUESTIONS: dict[str, tuple[str, str]] = {
    "sessions": (
        f"SELECT s.session_id, s.status, {_ISO.format('s.started_at_ns')} AS started, "
        "ROUND((s.ended_at_ns - s.started_at_ns) / 1e9, 3) AS duration_s, s.world_size, s.host, s.source, "
        "(SELECT COUNT(*) FROM steps t WHERE t.session_id = s.session_id) AS step_rows, "
        "(SELECT COUNT(*) FROM alerts a WHERE a.session_id = s.session_id) AS alerts "
        f"FROM sessions s WHERE {_SESSION.format('s.')} ORDER BY s.started_at_ns DESC, s.session_id",
        "every session of the store: status, start, duration, ranks, step rows and alerts",
    ),
    "ooms": (
        f"SELECT session_id, rank, {_ISO.format('timestamp_ns')} AS at, collector, device_id, allocated, reserved, "
        "total, context, CASE WHEN json_valid(metadata) THEN json_extract(metadata, '$.oom_reason') END AS reason, "
        "CASE WHEN json_valid(metadata) THEN json_extract(metadata, '$.oom_dump_path') END AS dump_path "
        f"FROM telemetry WHERE event_type = 'error' AND {_SESSION.format('')} AND CASE WHEN json_valid(metadata) THEN "
        "json_type(metadata, '$.oom_reason') IS NOT NULL OR json_type(metadata, '$.oom_dump_path') IS NOT NULL "
        f"OR {_TRUE.format('oom')} OR {_TRUE.format('is_oom')} ELSE 0 END "
        "ORDER BY session_id, timestamp_ns, rank, collector, device_id",
        "the out-of-memory errors the ranks reported, with the memory at that moment",
    ),
    "alerts": (
        f"SELECT session_id, {_ISO.format('ts_ns')} AS at, kind, severity, ranks, step, message FROM alerts "
        f"WHERE {_SESSION.format('')} ORDER BY session_id, ts_ns, kind, message",
        "the watchdog's alerts (stall, rank lost, non-finite values...), oldest first",
    ),
    "slowest-steps": (
        f"SELECT session_id, rank, step, ROUND(step_ns / 1e6, 3) AS step_ms, {_PHASE_MS}, "
        f"{_ISO.format('start_ns')} AS started FROM steps WHERE {_SESSION.format('')} "
        "ORDER BY step_ns DESC, session_id, rank, step LIMIT ?2",
        "the N slowest steps of any rank, with their phase times",
    ),
    "rank-skew": (
        "WITH s AS (SELECT session_id, rank, step, step_ns, end_ns, wait_ns FROM steps "
        f"WHERE step >= 0 AND {_SESSION.format('')}), "
        "per_step AS (SELECT session_id, step, MAX(step_ns) AS slowest, MIN(end_ns) AS first_end, "
        "COUNT(*) AS ranks FROM s GROUP BY session_id, step), "
        "mean AS (SELECT session_id, AVG(step_ns) AS step_ns FROM s GROUP BY session_id) "
        "SELECT s.session_id, s.rank, COUNT(*) AS steps, ROUND(AVG(s.step_ns) / 1e6, 3) AS mean_step_ms, "
        "ROUND(100.0 * (AVG(s.step_ns) - m.step_ns) / m.step_ns, 1) AS vs_mean_pct, "
        "ROUND(AVG(s.wait_ns) / 1e6, 3) AS mean_wait_ms, "
        "ROUND(AVG(s.end_ns - p.first_end) / 1e6, 3) AS mean_lag_ms, "
        "SUM(p.ranks > 1 AND s.step_ns = p.slowest) AS slowest_in_steps "
        "FROM s JOIN per_step p ON p.session_id = s.session_id AND p.step = s.step "
        "JOIN mean m ON m.session_id = s.session_id GROUP BY s.session_id, s.rank ORDER BY s.session_id, s.rank",
        "per rank: mean step time and its distance from the mean of all ranks, mean wait, how far behind "
        "the first rank to finish each step it finishes (lag), and in how many steps it was the slowest",
    ),
}


class Answer(NamedTuple):
    """The columns of a query and its rows, read as they are iterated (one cursor)."""

    columns: list[str]
    rows: Iterator[tuple[Any, ...]]


def read_only_connection(path: str | Path) -> sqlite3.Connection:
    """A connection to the store at ``path`` that cannot write it or any other file."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: no history store here")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None,
                             check_same_thread=False)
        db.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # "file is not a database" here, not later
        see_todays_tables(db)  # an older stepwatch's store answers with today's views
        db.execute("PRAGMA query_only = ON")
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open history store: {exc}") from None
    return db


def _problem(exc: Exception) -> str:
    """What SQLite objected to, in words that say why for the refusals of a read-only query."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc)
    if name.startswith("SQLITE_READONLY") or "readonly database" in text:
        return f"refused: stepwatch query is read-only and nothing was changed ({text})"
    if "too many attached databases" in text:
        return f"refused: ATTACH and VACUUM cannot run in a read-only query ({text})"
    if name.startswith("SQLITE_IOERR"):
        return f"refused: the store is opened read-only; this statement needs to write it ({text})"
    return text


@contextmanager
def ask(path: str | Path, sql: str, params: tuple[Any, ...] = ()) -> Iterator[Answer]:
    """The answer to ``sql`` over the store at ``path``, read-only; its rows stream from one
    cursor while the context is open. SQL errors and refused writes are StoreError."""
    db = read_only_connection(path)
    try:
        try:
            cursor = db.execute(sql, params)
        except (sqlite3.Error, sqlite3.Warning) as exc:  # Warning: more than one statement
            raise StoreError(f"query: {_problem(exc)}") from None
        columns = [d[0] for d in cursor.description or ()]
        yield Answer(columns, _rows(cursor))
    finally:
        db.close()


@contextmanager
def ask_url(url: str, sql: str, params: tuple[Any, ...] = ()) -> Iterator[Answer]:
    """The answer to ``sql`` over the store a URL names (``clickhouse://...``), read-only by the
    server: the connection and each query carry ClickHouse's ``readonly=1`` setting, under which
    the server refuses any write or settings change, whatever the SQL says."""
    from .clickhouse import ClickHouseStore

    store = ClickHouseStore(url, read_only=True)
    try:
        try:
            columns, rows = store.query_columns(sql, params, settings={"readonly": 1})
        except StoreError as exc:
            text = str(exc)
            if "readonly mode" in text or "Code: 164" in text:
                raise StoreError(f"query: refused: stepwatch query is read-only and nothing was changed ({text})") from None
            raise
        yield Answer(columns, iter(rows))
    finally:
        store.close()


@contextmanager
def ask_named_url(url: str, name: str, session_id: str | None = None, n: int | None = None) -> Iterator[Answer]:
    """The named question ``name`` over the store a URL names, read-only: the rows SQLite gives
    on the same history (store.clickhouse_questions)."""
    from .clickhouse import ClickHouseStore
    from .clickhouse_questions import ask_named

    question = named_question(name, session_id, n)  # an unknown name: the error naming those there are
    store = ClickHouseStore(url, read_only=True)
    try:
        columns, rows = ask_named(store, name, question, session_id, n)
        yield Answer(columns, iter(rows))
    finally:
        store.close()


def _rows(cursor: sqlite3.Cursor) -> Iterator[tuple[Any, ...]]:
    while True:
        try:
            batch = cursor.fetchmany(1024)
        except sqlite3.Error as exc:
            raise StoreError(f"query: {_problem(exc)}") from None
        if not batch:
            return
        yield from batch


def named_question(name: str, session_id: str | None = None, n: int | None = None) -> tuple[str, tuple[Any, ...]]:
    """The SQL of a named question and its parameters."""
    if name not in NAMED_QUESTIONS:
        raise StoreError(f"no named question {name!r} (there are: {', '.join(NAMED_QUESTIONS)})")
    sql = NAMED_QUESTIONS[name][0]
    return sql, (session_id, n) if "?2" in sql else (session_id,)
