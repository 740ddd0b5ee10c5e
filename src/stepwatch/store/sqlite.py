"""SQLite history in WAL mode: one writer with batched transactions, read-only readers.

Why WAL: renderers and ``stepwatch summary`` read while the aggregator writes, and in WAL
readers never block the writer nor see half a transaction.

Pages of 16 KiB and a 32 MiB page cache: every row extends several indexes, whose pages with
SQLite's defaults (4 KiB, 2 MiB) split more often and fall out of the cache; the larger ones
cut the writer's CPU time per row by about a sixth under the aggregator's load (CHANGELOG.md).
Checkpoints (copying the WAL back into the database file, then fsync) run on a thread and a
connection of their own, started by each commit, instead of SQLite's automatic checkpoint inside
the writer's commit every 1000 pages: the fsync no longer stalls the writer, which under the
aggregator's load wrote ~13% more rows per second for it (CHANGELOG.md). Under a load with
no pause the checkpointer can lag (the WAL restarts only once a checkpoint copied every frame), so
past ``_WAL_BOUND`` the writer checkpoints itself, as SQLite's automatic checkpoint would, and
``journal_size_limit`` shrinks the file back after each restart.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..log import logger
from ..schema.tables import TABLES as HISTORY_TABLES
from .base import COLUMNS, SqlReads
from .rows import row_tuples

__all__ = ["SESSION_RANKS", "SqliteStore", "see_todays_tables"]

# The ranks of session ?1 as the table `ranks(rank)` (a last NULL row ends it), one index seek a
# rank down steps_unique (session, rank, step): SELECT DISTINCT would read every step row. The
# prefix of a query that selects FROM ranks.
SESSION_RANKS = """
WITH RECURSIVE ranks(rank) AS (
    SELECT (SELECT rank FROM steps WHERE session_id = ?1 ORDER BY rank LIMIT 1)
    UNION ALL
    SELECT (SELECT rank FROM steps WHERE session_id = ?1 AND rank > ranks.rank ORDER BY rank LIMIT 1)
    FROM ranks WHERE ranks.rank IS NOT NULL
)
"""

_SQL_TYPES = {"text": "TEXT", "int": "INTEGER", "real": "REAL", "json": "TEXT"}
# Every row table is stored as ``<table>_rows`` with an integer ``session_key`` where the others
# have ``session_id``, and read through a view named ``<table>`` with the columns of COLUMNS, so
# every reader's SQL (``WHERE session_id = ?``) is unchanged. The 36-character uuid in every row
# and in every unique key cost the writer ~20% of its time per row (CHANGELOG.md); the keys
# live in ``session_keys`` and never change (a VACUUM keeps an INTEGER PRIMARY KEY).
_KEYS_TABLE = ("CREATE TABLE IF NOT EXISTS session_keys "
               "(session_key INTEGER PRIMARY KEY, session_id TEXT NOT NULL UNIQUE)")
# table -> its columns after session_id, as ``<table>_rows`` holds them after ``session_key``
_ROW_COLUMNS = {table: tuple(c for c, _ in cols[1:]) for table, cols in COLUMNS.items() if table != "sessions"}
_SESSION_COLUMNS = tuple(c for c, _ in COLUMNS["sessions"])
# Every index costs each insert a B-tree descent (CHANGELOG.md: 7.7 us a row with ten, 4.3 with
# none), so there is one only where a query reads it or it keeps a table idempotent. The unique
# ones make re-imports and retried batches store nothing twice (INSERT OR IGNORE): spans, marks,
# snapshots and steps by their ids; telemetry by (session, rank, time, type, collector, device)
# and heartbeats by (session, rank, time, step, msg), which no two distinct records share. Their
# (session_key, rank, time) prefix serves the per-rank time queries and retention.
_INDEXES = (
    "CREATE UNIQUE INDEX IF NOT EXISTS telemetry_unique ON telemetry_rows "
    "(session_key, rank, timestamp_ns, event_type, collector, ifnull(device_id, -1))",
    "CREATE UNIQUE INDEX IF NOT EXISTS spans_unique ON spans_rows (session_key, rank, span_id)",
    "CREATE INDEX IF NOT EXISTS marks_by_session ON marks_rows (session_key, rank, name, ts_ns)",
    "CREATE UNIQUE INDEX IF NOT EXISTS marks_unique ON marks_rows (session_key, rank, mark_id)",
    "CREATE INDEX IF NOT EXISTS snapshots_by_span ON snapshots_rows (session_key, span_id)",
    "CREATE UNIQUE INDEX IF NOT EXISTS snapshots_unique ON snapshots_rows (session_key, rank, snapshot_id)",
    "CREATE UNIQUE INDEX IF NOT EXISTS heartbeats_unique ON heartbeats_rows "
    "(session_key, rank, ts_ns, step, ifnull(msg, ''))",
    "CREATE UNIQUE INDEX IF NOT EXISTS steps_unique ON steps_rows (session_key, rank, step)",
)
# pysqlite binds None through its adapter registry (a tuple, a dict lookup and two attribute
# lookups: ~250 ns a value, where an int, float or str binds in 20-70 ns), and SQLite stores a
# bound NaN as NULL (sqlite3_bind_double). So in the columns that are NULL in many rows (absent
# allocator or device counters, no context, a span without an index or GPU time, a mark without
# a span or text value...), None is bound as NaN: the same NULL, ~0.2 µs less per value, about
# a fifth of the writer's time on the aggregator's rows (CHANGELOG.md). Other columns bind None
# as it is.
_NULL = math.nan
_OFTEN_NULL_COLUMNS = {table: tuple(c.name for c in columns if c.often_null)  # schema.tables
                       for table, columns in HISTORY_TABLES.items()}
_OFTEN_NULL = {table: tuple(i for i, (name, _) in enumerate(cols) if name in _OFTEN_NULL_COLUMNS.get(table, ()))
               for table, cols in COLUMNS.items()}
# HTTP batch ids already stored, with when (wall clock): a retried batch is not stored twice, also
# across a restart of the server (spool-format-v1.md: idempotent by batch_id for 24 hours).
_BATCHES_TABLE = "CREATE TABLE IF NOT EXISTS ingest_batches (batch_id TEXT PRIMARY KEY, seen_at_ns INTEGER) WITHOUT ROWID"
_RETENTION_TIME = (("telemetry", "timestamp_ns"), ("heartbeats", "ts_ns"), ("marks", "ts_ns"), ("spans", "start_ns"),
                   ("steps", "start_ns"), ("snapshots", "ts_ns"))

# Rows go in as multi-row INSERTs of this many rows (the remainder by one statement of its own
# length): one statement step per chunk instead of per row, so fewer VDBE resets and one GIL
# release per chunk rather than per row. Measured in one process, interleaved, 103k wire rows:
# 3.2-3.4 us per stored row against 4.1-4.5 with executemany alone, and 5.0-5.5 against 6.0-6.7
# with a decoding thread beside it (CHANGELOG.md). Each step must take the GIL back, which a
# busy thread beside it holds for up to the switch interval (5 ms): beside a thread that never
# waits, 103k rows took 5.5 s in chunks of 128, 1.0 s of 1024, 0.6 s of 4096 (0.3 s alone). The
# aggregator's loop thread is idle most of a tick (backpressure), and in the server 1024 and 4096
# measured no better than 128 (4096: slower, and +150 MiB RSS), so 128 stays. Capped by the
# build's variable limit (999 before SQLite 3.32).
CHUNK_ROWS = 128

_SQLITE_FULL = 13  # sqlite3's result code for "database or disk is full"
_WAL_BOUND = 64 << 20  # bytes of WAL past which the writer checkpoints in its own commit
_PAGE_SIZE = 16384  # takes effect for a new file only (set before WAL mode)
_CACHE_KIB = 32 * 1024


class SqliteStore(SqlReads):
    """Example::

        store = SqliteStore(run_dir / "history.sqlite")
        store.append_many({"telemetry": rows, "spans": span_rows})
        store.step_rows(session_id)
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self._lock = threading.Lock()
        self._checkpointer: _Checkpointer | None = None
        self._wal = self.path.with_name(self.path.name + "-wal")
        try:
            if read_only:
                if not self.path.exists():
                    raise StoreError(f"{self.path}: no history store here")
                self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True,
                                           check_same_thread=False)
                see_todays_tables(self._db)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                self._db.execute(f"PRAGMA page_size={_PAGE_SIZE}")  # a new file only; before WAL
                self._db.execute("PRAGMA journal_mode=WAL")
                # NORMAL in WAL: a commit survives a crash of this process (not a power loss)
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute("PRAGMA wal_autocheckpoint=0")  # _Checkpointer does it
                self._db.execute(f"PRAGMA journal_size_limit={_WAL_BOUND}")
                self._db.execute(f"PRAGMA cache_size=-{_CACHE_KIB}")
                self._create()
                self._checkpointer = _Checkpointer(self.path)
                if not self._checkpointer.start():  # no thread to be had: SQLite's own, in the commit
                    self._checkpointer = None
                    self._db.execute("PRAGMA wal_autocheckpoint=1000")
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open history store: {exc}") from exc
        self._db.row_factory = sqlite3.Row
        self._keys = _SessionKeys(self._db)
        try:  # the most parameters one statement may bind in this build (999 before SQLite 3.32)
            limit = self._db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        except (AttributeError, sqlite3.Error):  # Python < 3.11
            limit = 32766 if sqlite3.sqlite_version_info >= (3, 32) else 999
        self._chunk_rows = {table: max(1, min(CHUNK_ROWS, limit // len(cols))) for table, cols in COLUMNS.items()}

    def _create(self) -> None:
        body = _column_defs(COLUMNS["sessions"]).replace("session_id TEXT", "session_id TEXT PRIMARY KEY")
        self._db.execute(f"CREATE TABLE IF NOT EXISTS sessions ({body})")
        self._db.execute(_BATCHES_TABLE)
        self._db.execute(_KEYS_TABLE)
        kinds = dict(self._db.execute("SELECT name, type FROM sqlite_master").fetchall())
        old = [t for t in _ROW_COLUMNS if kinds.get(t) == "table"]  # a store from before the session keys
        self._db.execute("BEGIN")
        for table in old:  # their index names are the new tables' (dropped with them in any case)
            for (name,) in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ? "
                                            "AND sql IS NOT NULL", (table,)).fetchall():
                self._db.execute(f"DROP INDEX {name}")
        for table in _ROW_COLUMNS:
            body = _column_defs(COLUMNS[table][1:])
            self._db.execute(f"CREATE TABLE IF NOT EXISTS {table}_rows (session_key INTEGER, {body})")
            # a store written before a column was declared (steps.recompute_ns): added, its view remade
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table}_rows)")}
            missing = [(name, kind) for name, kind in COLUMNS[table][1:] if name not in have]
            for name, kind in missing:
                self._db.execute(f"ALTER TABLE {table}_rows ADD COLUMN {_column_defs([(name, kind)])}")
            if missing:
                self._db.execute(f"DROP VIEW IF EXISTS {table}")
        for statement in _INDEXES:
            self._db.execute(statement)
        for table, columns in _ROW_COLUMNS.items():
            names = ", ".join(columns)
            if table in old:  # move its rows
                self._db.execute(f"INSERT OR IGNORE INTO session_keys (session_id) "
                                 f"SELECT DISTINCT session_id FROM {table} WHERE session_id IS NOT NULL")
                # INSERT OR IGNORE in rowid order: the first of rows the unique keys call the same
                # stays (older stores had no unique indexes)
                present = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
                self._db.execute(f"INSERT OR IGNORE INTO {table}_rows (session_key, {names}) "
                                 f"SELECT k.session_key, {', '.join('t.' + c if c in present else 'NULL' for c in columns)} "
                                 f"FROM {table} t LEFT JOIN session_keys k ON k.session_id = t.session_id "
                                 f"ORDER BY t.rowid")
                self._db.execute(f"DROP TABLE {table}")
            self._db.execute(
                f"CREATE VIEW IF NOT EXISTS {table} (session_id, {names}) AS SELECT k.session_id, "
                f"{', '.join('r.' + c for c in columns)} FROM {table}_rows r "
                f"LEFT JOIN session_keys k ON k.session_key = r.session_key")
        self._db.execute("COMMIT")

    # -- writing -----------------------------------------------------------------------------

    def _params(self, table: str, rows: list[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
        try:
            return row_tuples(table, rows)
        except ValueError as exc:  # a JSON column that does not encode
            raise StoreError(f"{self.path}: write failed: {table}: {exc}") from None

    def append(self, table: str, rows: Iterable[Mapping[str, Any]]) -> int:
        return self.append_many({table: list(rows)})

    def append_many(self, batches: Mapping[str, list[Mapping[str, Any]]]) -> int:
        if self.read_only:
            raise StoreError(f"{self.path}: store opened read-only")
        for table in batches:
            if table not in _ROW_COLUMNS:
                raise StoreError(f"unknown table {table!r}")
        return self.append_tuples({table: self._params(table, rows) for table, rows in batches.items() if rows})

    def append_tuples(self, batches: Mapping[str, list[tuple[Any, ...]]],
                      batch_ids: Iterable[tuple[str, int]] = ()) -> int:
        """Writes rows already in column order (``rows.row_tuples``/``rows.wire_tuples``), all
        tables in one transaction: the aggregator's path, with no per-row work left but binding.
        ``batch_ids``: (batch id, seen at ns) of the HTTP batches whose rows these are, recorded
        in the same transaction, so a batch is remembered exactly when its rows are stored."""
        if self.read_only:
            raise StoreError(f"{self.path}: store opened read-only")
        total = 0
        with self._lock:
            try:
                self._db.execute("BEGIN")
                for table, rows in batches.items():
                    if table not in _ROW_COLUMNS:
                        raise StoreError(f"unknown table {table!r}")
                    if rows:
                        self._insert(table, rows)
                        total += len(rows)
                if batch_ids:
                    self._db.executemany("INSERT OR IGNORE INTO ingest_batches VALUES (?, ?)", batch_ids)
                self._db.execute("COMMIT")
                self._checkpoint_soon()
            except BaseException as exc:
                # Any failure (a bad table, a value SQLite cannot take, an interrupt) must undo the
                # whole batch: an open transaction would swallow later writes.
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                self._keys.clear()  # keys given out in the transaction are gone with it
                if isinstance(exc, StoreError) or not isinstance(exc, Exception):
                    raise
                raise StoreError(f"{self.path}: write failed: {exc}") from exc
        return total

    def _insert(self, table: str, rows: list[tuple[Any, ...]]) -> None:
        """Whole chunks by one multi-row statement, the rest by one statement of its own length
        (see CHUNK_ROWS); the same rows in the same order, so INSERT OR IGNORE keeps the same
        first of duplicates. Each row's session id is bound as its session key."""
        size, width, nullable = self._chunk_rows[table], len(COLUMNS[table]), _OFTEN_NULL[table]
        whole = len(rows) - len(rows) % size
        if whole:
            self._db.executemany(self._values_insert(table, size),
                                 (self._keyed(rows[i:i + size], width, nullable) for i in range(0, whole, size)))
        if whole < len(rows):
            self._db.execute(self._values_insert(table, len(rows) - whole),
                             self._keyed(rows[whole:], width, nullable))

    def _keyed(self, rows: list[tuple[Any, ...]], width: int, nullable: tuple[int, ...]) -> list[Any]:
        """The rows' values in one list, each row's first (its session id) replaced by the key,
        and None in the often-NULL columns bound as NaN (see _OFTEN_NULL): one pass per column,
        not a new tuple per row."""
        flat = list(chain.from_iterable(rows))
        flat[::width] = map(self._keys.__getitem__, flat[::width])
        for column in nullable:
            flat[column::width] = [_NULL if value is None else value for value in flat[column::width]]
        return flat

    def _values_insert(self, table: str, count: int) -> str:
        """``INSERT OR IGNORE`` of ``count`` rows in one statement (sqlite3 caches the prepared
        statements by their text)."""
        names = ", ".join(_ROW_COLUMNS[table])
        one = f"({', '.join('?' for _ in COLUMNS[table])})"
        return f"INSERT OR IGNORE INTO {table}_rows (session_key, {names}) VALUES " + ", ".join([one] * count)

    def upsert_session(self, row: Mapping[str, Any]) -> None:
        """Creates or updates a session; an existing status only moves forward."""
        params = self._params("sessions", [row])[0]
        cols = _SESSION_COLUMNS
        updates = ", ".join(
            f"{c} = COALESCE(excluded.{c}, {c})" for c in cols if c not in ("session_id", "started_at_ns", "status")
        )
        if self.read_only:
            raise StoreError(f"{self.path}: store opened read-only")
        with self._lock:
            try:
                self._db.execute(
                    f"INSERT INTO sessions ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)}) "
                    f"ON CONFLICT(session_id) DO UPDATE SET {updates}, "
                    # a final status is never turned back into "running"
                    f"status = CASE WHEN excluded.status = 'running' AND status IS NOT NULL THEN status "
                    f"ELSE COALESCE(excluded.status, status) END, "
                    f"started_at_ns = MIN(COALESCE(started_at_ns, excluded.started_at_ns), "
                    f"COALESCE(excluded.started_at_ns, started_at_ns))",
                    params,
                )
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: session write failed: {exc}") from exc

    def apply_retention(self, window_ns: int, now_ns: int | None = None) -> int:
        """Deletes rows older than ``window_ns`` before the newest row of their session and rank
        (a window per identity, aggregator-architecture.md), in one transaction.

        Each table is read once for the newest time of each (session, rank), then once more to
        delete against those cutoffs: linear, with no index on the time column needed."""
        removed = 0
        if self.read_only:
            raise StoreError(f"{self.path}: store opened read-only")
        with self._lock:
            try:
                self._db.execute("BEGIN")
                self._db.execute("CREATE TEMP TABLE IF NOT EXISTS retention_cutoff "
                                 "(session_key INTEGER, rank INTEGER, cutoff INTEGER, PRIMARY KEY (session_key, rank))")
                for table, column in _RETENTION_TIME:
                    self._db.execute("DELETE FROM retention_cutoff")
                    self._db.execute(
                        f"INSERT INTO retention_cutoff SELECT session_key, rank, MAX({column}) - ? FROM {table}_rows "
                        f"WHERE {column} IS NOT NULL GROUP BY session_key, rank", (window_ns,))
                    cursor = self._db.execute(
                        f"DELETE FROM {table}_rows WHERE {column} < (SELECT c.cutoff FROM retention_cutoff c "
                        f"WHERE c.session_key IS {table}_rows.session_key AND c.rank = {table}_rows.rank)")
                    removed += cursor.rowcount
                self._db.execute("COMMIT")
                self._checkpoint_soon()
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise StoreError(f"{self.path}: retention failed: {exc}") from exc
        return removed

    def seen_batches(self, since_ns: int) -> dict[str, int]:
        """The HTTP batch ids stored at or after ``since_ns``, with when."""
        rows = self.query("SELECT batch_id, seen_at_ns FROM ingest_batches WHERE seen_at_ns >= ?", (since_ns,))
        return {r["batch_id"]: r["seen_at_ns"] for r in rows}

    def forget_batches(self, before_ns: int) -> int:
        """Drops batch ids stored before ``before_ns`` (out of the dedupe window)."""
        if self.read_only:
            raise StoreError(f"{self.path}: store opened read-only")
        with self._lock:
            try:
                return self._db.execute("DELETE FROM ingest_batches WHERE seen_at_ns < ?", (before_ns,)).rowcount
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: forgetting batch ids failed: {exc}") from exc

    # -- reading -----------------------------------------------------------------------------

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            try:
                return [dict(r) for r in self._db.execute(sql, tuple(params)).fetchall()]
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: query failed: {exc}") from exc

    def query_tuples(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        """Like ``query``, each row as a tuple in the SELECT's order: no dict per row, for the
        readers that turn a window of rows into columns (analysis/verdicts/inputs.py)."""
        with self._lock:
            try:
                cursor = self._db.execute(sql, tuple(params))
                cursor.row_factory = None
                return cursor.fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: query failed: {exc}") from exc

    def step_tuples(self, session_id: str, columns: Sequence[str]) -> list[tuple[Any, ...]]:
        """The session's step rows in the order they were stored: the rowid range they span, read
        page after page, filtered by session. Down the (session, rank, step) index each row is a
        random access into the table, whose rows arrive interleaved across ranks: 8.8 s of the
        14-26 s a 1.28M-row session took (bench/bench_summary.py). A history written before
        ``session_keys`` is read through its view."""
        with self._lock:
            try:
                key = self._db.execute("SELECT session_key FROM session_keys WHERE session_id = ?",
                                       (session_id,)).fetchone()
                if key is None:
                    return []
                low, high = self._db.execute("SELECT MIN(rowid), MAX(rowid) FROM steps_rows WHERE session_key = ?",
                                             key).fetchone()
                if low is None:
                    return []
                cursor = self._db.execute(f"SELECT {', '.join(columns)} FROM steps_rows "
                                          "WHERE rowid BETWEEN ? AND ? AND +session_key = ?", (low, high, key[0]))
                cursor.row_factory = None
                return cursor.fetchall()
            except sqlite3.OperationalError:
                pass  # an older layout (no session_keys, or a column it lacked): its views answer
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: query failed: {exc}") from exc
        return super().step_tuples(session_id, columns)

    def iterate(self, sql: str, params: Iterable[Any] = (), size: int = 2048) -> Iterator[tuple[Any, ...]]:
        """The rows of ``sql`` as tuples, fetched ``size`` at a time from one cursor: a reader
        that streams a whole run (the Perfetto export) holds one batch, never the result. The
        lock is held per batch only, so other users of this store interleave between batches."""
        with self._lock:
            try:
                cursor = self._db.execute(sql, tuple(params))
                cursor.row_factory = None
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: query failed: {exc}") from exc
        try:
            while True:
                with self._lock:
                    try:
                        rows = cursor.fetchmany(size)
                    except sqlite3.Error as exc:
                        raise StoreError(f"{self.path}: query failed: {exc}") from exc
                if not rows:
                    return
                yield from rows
                del rows  # not held while the next batch is fetched
        finally:
            cursor.close()

    def _checkpoint_soon(self) -> None:
        """After a commit (lock held): the checkpointer's turn, or the writer's own past the bound."""
        if self._checkpointer is None:
            return
        self._checkpointer.request()
        try:
            behind = self._wal.stat().st_size > _WAL_BOUND
        except OSError:
            return
        if behind:
            try:
                self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error as exc:  # the rows are committed: a failed checkpoint loses nothing
                self._checkpointer.warn(exc)

    def close(self) -> None:
        """Stops the checkpointer first: the last connection to close checkpoints what is left
        and removes the WAL."""
        if self._checkpointer is not None:
            self._checkpointer.close()
        with self._lock:
            self._db.close()



def see_todays_tables(db: sqlite3.Connection) -> None:
    """Lets a read-only connection to a store an older stepwatch wrote read today's tables and
    columns: each one it lacks (``alerts``, ``verdicts``, ``steps.recompute_ns``) becomes a TEMP
    view, NULL where a column was not kept yet and empty where a table did not exist. TEMP names
    shadow the file's own and write nothing to it; a writable open moves the file itself
    (``_create``). A store of today's layout gets no view."""
    kinds = dict(db.execute("SELECT name, type FROM main.sqlite_master").fetchall())
    for table, cols in COLUMNS.items():
        names = [name for name, _ in cols]
        if table not in kinds:
            db.execute(f"CREATE TEMP VIEW {table} ({', '.join(names)}) AS SELECT "
                       f"{', '.join('NULL' for _ in names)} WHERE 0")
            continue
        have = {row[1] for row in db.execute(f"PRAGMA main.table_info({table})")}
        if not have.issuperset(names):
            db.execute(f"CREATE TEMP VIEW {table} ({', '.join(names)}) AS SELECT "
                       f"{', '.join(n if n in have else 'NULL' for n in names)} FROM main.{table}")


def _column_defs(columns: Iterable[tuple[str, str]]) -> str:
    return ", ".join(f"{name} {_SQL_TYPES[kind]}" for name, kind in columns)


class _SessionKeys(dict):  # type: ignore[type-arg]
    """session id -> session key, filled from ``session_keys`` as ids come; a new id gets its key
    inside the writer's open transaction (so ``clear()`` after a rollback)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        super().__init__()
        self._db = db

    def __missing__(self, session_id: Any) -> int | None:
        if session_id is None:  # stored with no key, as the row had no session
            return None
        self._db.execute("INSERT OR IGNORE INTO session_keys (session_id) VALUES (?)", (session_id,))
        key: int = self._db.execute("SELECT session_key FROM session_keys WHERE session_id = ?",
                                    (session_id,)).fetchone()[0]
        self[session_id] = key
        return key


class _Checkpointer:
    """Runs ``PRAGMA wal_checkpoint(PASSIVE)`` on its own connection and thread when asked.

    The writer's connection has automatic checkpoints off and asks after each commit. A passive
    checkpoint never blocks the writer nor readers; it copies the frames committed so far, and the
    writer's next transaction restarts the WAL from its start once all were copied, so the WAL
    stays about one tick of writes long. Errors are said once and never reach the writer (a
    failed checkpoint leaves the data in the WAL, where readers still see it).
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._due = threading.Event()
        self._closing = False
        self._failed = False
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="stepwatch-sqlite-checkpoint", daemon=True)

    def start(self) -> bool:
        try:
            self._thread.start()
        except RuntimeError:  # interpreter shutting down
            return False
        return True

    def request(self) -> None:
        self._due.set()

    def close(self) -> None:
        self._closing = True
        self._due.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            self.warn(exc)
            return
        try:
            while True:
                self._due.wait()
                self._due.clear()
                if self._closing:
                    return
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:
                    self.warn(exc)
        finally:
            db.close()

    def warn(self, exc: sqlite3.Error) -> None:
        self.failures += 1
        if getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL:
            # a full disk: the writer's own failures say so once, with their count (the
            # aggregator's report); a checkpoint loses nothing, so this one stays quiet
            logging.getLogger("stepwatch.store").debug("%s: WAL checkpoint failed: %s", self._path, exc)
            return
        if not self._failed:
            self._failed = True
            logger.warning("store: %s: WAL checkpoint failed (later failures are not shown; "
                           "the rows stay in the WAL): %s", self._path, exc)
