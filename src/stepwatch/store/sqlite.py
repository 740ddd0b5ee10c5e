"""SQLite history in WAL mode: one writer with batched transactions, read-only readers.

Why WAL: renderers and ``stepwatch summary`` read while the aggregator writes, and in WAL
readers never block the writer nor see half a transaction.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from ..errors import StoreError
from .base import COLUMNS

__all__ = ["SqliteStore"]

_SQL_TYPES = {"text": "TEXT", "int": "INTEGER", "real": "REAL", "json": "TEXT"}
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS telemetry_by_session ON telemetry (session_id, rank, timestamp_ns)",
    "CREATE INDEX IF NOT EXISTS spans_by_session ON spans (session_id, rank, start_ns)",
    "CREATE INDEX IF NOT EXISTS spans_by_parent ON spans (session_id, parent_id)",
    "CREATE UNIQUE INDEX IF NOT EXISTS spans_unique ON spans (session_id, rank, span_id)",
    "CREATE INDEX IF NOT EXISTS marks_by_session ON marks (session_id, rank, name, ts_ns)",
    "CREATE UNIQUE INDEX IF NOT EXISTS marks_unique ON marks (session_id, rank, mark_id)",
    "CREATE INDEX IF NOT EXISTS snapshots_by_span ON snapshots (session_id, span_id)",
    "CREATE INDEX IF NOT EXISTS heartbeats_by_session ON heartbeats (session_id, rank, ts_ns)",
    "CREATE UNIQUE INDEX IF NOT EXISTS steps_unique ON steps (session_id, rank, step)",
    "CREATE INDEX IF NOT EXISTS steps_by_time ON steps (session_id, start_ns)",
)
_encoder = msgspec.json.Encoder()


class SqliteStore:
    """Example::

        store = SqliteStore(run_dir / "history.sqlite")
        store.append_many({"telemetry": rows, "spans": span_rows})
        store.step_rows(session_id)
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self._lock = threading.Lock()
        try:
            if read_only:
                if not self.path.exists():
                    raise StoreError(f"{self.path}: no history store here")
                self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True,
                                           check_same_thread=False)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._create()
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open history store: {exc}") from exc
        self._db.row_factory = sqlite3.Row
        self._inserts = {
            table: (
                f"INSERT OR IGNORE INTO {table} ({', '.join(c for c, _ in cols)}) "
                f"VALUES ({', '.join('?' for _ in cols)})",
                tuple(c for c, _ in cols),
                tuple(c for c, t in cols if t == "json"),
            )
            for table, cols in COLUMNS.items()
        }

    def _create(self) -> None:
        for table, cols in COLUMNS.items():
            body = ", ".join(f"{c} {_SQL_TYPES[t]}" for c, t in cols)
            if table == "sessions":
                body = body.replace("session_id TEXT", "session_id TEXT PRIMARY KEY")
            self._db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({body})")
        for statement in _INDEXES:
            self._db.execute(statement)

    # -- writing -----------------------------------------------------------------------------

    def _params(self, table: str, rows: Iterable[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
        _, columns, json_columns = self._inserts[table]
        out = []
        for row in rows:
            if json_columns:
                row = {**row, **{c: _encoder.encode(row[c]).decode() if row.get(c) is not None else None
                                 for c in json_columns}}
            out.append(tuple(row.get(c) for c in columns))
        return out

    def append(self, table: str, rows: Iterable[Mapping[str, Any]]) -> int:
        return self.append_many({table: list(rows)})

    def append_many(self, batches: Mapping[str, list[Mapping[str, Any]]]) -> int:
        if self.read_only:
            raise StoreError(f"{self.path}: store opened read-only")
        total = 0
        with self._lock:
            try:
                self._db.execute("BEGIN")
                for table, rows in batches.items():
                    if table not in self._inserts:
                        raise StoreError(f"unknown table {table!r}")
                    if rows:
                        self._db.executemany(self._inserts[table][0], self._params(table, rows))
                        total += len(rows)
                self._db.execute("COMMIT")
            except BaseException as exc:
                # Any failure (a bad table, a value SQLite or JSON cannot take, an interrupt) must
                # undo the whole batch: an open transaction would swallow later writes.
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if isinstance(exc, StoreError) or not isinstance(exc, Exception):
                    raise
                raise StoreError(f"{self.path}: write failed: {exc}") from exc
        return total

    def upsert_session(self, row: Mapping[str, Any]) -> None:
        """Creates or updates a session; an existing status only moves forward."""
        params = self._params("sessions", [row])[0]
        cols = self._inserts["sessions"][1]
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
        """Deletes rows older than ``window_ns`` before the newest row of their session and rank."""
        removed = 0
        if self.read_only:
            raise StoreError(f"{self.path}: store opened read-only")
        with self._lock:
            try:
                for table, time_column in (("telemetry", "timestamp_ns"), ("heartbeats", "ts_ns"),
                                           ("marks", "ts_ns"), ("spans", "start_ns"), ("steps", "start_ns")):
                    cursor = self._db.execute(
                        f"DELETE FROM {table} WHERE {time_column} < "
                        f"(SELECT MAX(t.{time_column}) FROM {table} t WHERE t.session_id = {table}.session_id "
                        f"AND t.rank = {table}.rank) - ?",
                        (window_ns,),
                    )
                    removed += cursor.rowcount
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: retention failed: {exc}") from exc
        return removed

    # -- reading -----------------------------------------------------------------------------

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            try:
                return [dict(r) for r in self._db.execute(sql, tuple(params)).fetchall()]
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: query failed: {exc}") from exc

    def count(self, table: str, session_id: str | None = None) -> int:
        if table not in COLUMNS:
            raise StoreError(f"unknown table {table!r}")
        where, params = ("WHERE session_id = ?", (session_id,)) if session_id else ("", ())
        return int(self.query(f"SELECT COUNT(*) AS n FROM {table} {where}", params)[0]["n"])

    def sessions(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM sessions ORDER BY started_at_ns DESC")

    def step_rows(self, session_id: str) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM steps WHERE session_id = ? ORDER BY rank, step", (session_id,))

    def memory_peaks(self, session_id: str) -> list[dict[str, Any]]:
        return self.query(
            "SELECT rank, collector, device_id, MAX(allocated) AS peak_allocated, MAX(reserved) AS peak_reserved, "
            "MAX(total) AS total FROM telemetry WHERE session_id = ? AND event_type = 'sample' "
            "GROUP BY rank, collector, device_id ORDER BY rank, device_id",
            (session_id,),
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def now_ns() -> int:
        return time.time_ns()
