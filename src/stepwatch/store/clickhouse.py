"""The history on a ClickHouse server, over the native protocol (``clickhouse-driver``,
``pip install 'stepwatch[clickhouse]'``): the ``HistoryStore`` interface the SQLite store
implements, with the same table names and columns for the people and the analysis that query it.

Layout (docs/clickhouse.md). Each row table is stored as ``<table>_rows`` and read through a
view named ``<table>`` with exactly the columns of ``store.base.COLUMNS``, so the same SELECT
reads the same rows as on a ``history.sqlite``:

- ``<table>_rows``: MergeTree ``PARTITION BY`` the day of its time column (UTC), ``ORDER BY``
  (session_id, rank, time, id), the order the analysis reads (a session's ranks, each by time or
  step). Times are UInt64-range epoch nanoseconds in ``Int64`` columns, which every server
  accepts (18.16, Debian's, has no DateTime64). The sorting-key columns cannot be Nullable on
  18.16: a NULL there is stored as 0 or '' (stepwatch never writes one).
- Idempotent as the SQLite store's unique indexes make it: the tables SQLite keeps unique
  (telemetry, spans, marks, snapshots, heartbeats, steps) are ``ReplacingMergeTree`` whose sorting
  key is that same unique key, and their views read ``FINAL``, so a row imported or retried twice
  is seen once (and merged away on disk later). ``alerts`` and ``verdicts``, which SQLite keeps
  without a unique key, are ReplacingMergeTree too, on (session, time, kind or name, step[,
  message]): the aggregator writes a batch again whole after a failure part way, and a row of
  it must not be read twice. A database made before they were is moved over on open.
- ``sessions``: every upsert inserts the merged row with a version (the wall clock in ns); the
  view shows the newest version of each session (``LIMIT 1 BY``), the same row SQLite's
  ``INSERT ... ON CONFLICT DO UPDATE`` leaves.
- Each view wraps every column in ``toNullable`` so an aggregate over no rows is NULL, as in
  SQLite, and not the type's zero.

SQL comes in as the SQLite store takes it (``?`` and ``?N`` placeholders); the values are bound
here as ClickHouse literals (the 18.16 server has no server-side parameters). The few queries
written for SQLite alone (a recursive CTE over an index) have a method of their own here
(``rank_last_steps``), which the readers use where a store has it.

Server features are detected from ``SELECT version()`` in one place (``ServerFeatures``); the DDL
today is the variant every server accepts, and the detected features say what a newer server
could be given (DateTime64, LowCardinality, CODEC, TTL) when that DDL is added.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from ..errors import StoreError
from .base import COLUMNS, SqlReads
from .clickhouse_url import ClickHouseURL, parse_clickhouse_url
from .rows import row_tuples

__all__ = ["ClickHouseStore", "ServerFeatures", "bind", "ddl"]

_TYPES = {"text": "String", "int": "Int64", "real": "Float64", "json": "String"}
_ZERO = {"text": "", "int": 0, "real": 0.0, "json": ""}
# the value types each column kind takes as they are (None: a Nullable column's NULL)
_AS_IS = {"text": {str, type(None)}, "json": {str, type(None)}, "int": {int, type(None)}, "real": {float, type(None)}}


class _Layout(NamedTuple):
    key: tuple[str, ...]  # the sorting key (ReplacingMergeTree: also what makes a row unique)
    time: str | None  # the column partitioned by day
    unique: bool  # ReplacingMergeTree + FINAL in the view (SQLite has a unique index on the key)


# the key columns that are not plain columns are expressions over Nullable ones (ifNull)
_LAYOUT: dict[str, _Layout] = {
    "telemetry": _Layout(("session_id", "rank", "timestamp_ns", "event_type", "collector",
                          "ifNull(device_id, -1)"), "timestamp_ns", True),
    "spans": _Layout(("session_id", "rank", "start_ns", "span_id"), "start_ns", True),
    "marks": _Layout(("session_id", "rank", "ts_ns", "mark_id"), "ts_ns", True),
    "snapshots": _Layout(("session_id", "rank", "ts_ns", "snapshot_id"), "ts_ns", True),
    "heartbeats": _Layout(("session_id", "rank", "ts_ns", "ifNull(step, -1)", "ifNull(msg, '')"), "ts_ns", True),
    "steps": _Layout(("session_id", "rank", "step"), "start_ns", True),
    # no unique index in SQLite, but unique here: a batch the aggregator writes again after a
    # failure part way (server/store_feed.py) must not show an alert or a verdict twice
    "verdicts": _Layout(("session_id", "ts_ns", "ifNull(name, '')", "ifNull(step, -1)"), "ts_ns", True),
    "alerts": _Layout(("session_id", "ts_ns", "ifNull(kind, '')", "ifNull(step, -1)", "ifNull(message, '')"),
                      "ts_ns", True),
}
_SESSION_COLUMNS = tuple(c for c, _ in COLUMNS["sessions"])
_PLAIN_NAME = re.compile(r"[a-z_]+")
_RETENTION_TIME = (("telemetry", "timestamp_ns"), ("heartbeats", "ts_ns"), ("marks", "ts_ns"), ("spans", "start_ns"),
                   ("steps", "start_ns"), ("snapshots", "ts_ns"))


class ServerFeatures(NamedTuple):
    """What the server accepts, from its version: the one place that decides it."""

    version: tuple[int, ...]
    datetime64: bool
    low_cardinality: bool  # without allow_experimental_low_cardinality_type
    codec: bool
    ttl: bool
    map_type: bool

    @classmethod
    def from_version(cls, text: str) -> ServerFeatures:
        parts = tuple(int(p) for p in re.findall(r"\d+", text)[:3]) or (0,)
        at_least = parts.__ge__
        return cls(parts, datetime64=at_least((20, 1)), low_cardinality=at_least((19, 3)),
                   codec=at_least((19, 11)), ttl=at_least((19, 6)), map_type=at_least((21, 1)))


def _key_columns(table: str) -> set[str]:
    return {part for part in _LAYOUT[table].key if _PLAIN_NAME.fullmatch(part)}


def ddl(table: str, features: ServerFeatures) -> list[str]:
    """The CREATE statements of a row table and its view (the variant every server accepts;
    ``features`` is where a newer server's types will be chosen)."""
    del features  # one variant today: 18.16's (see the module docstring)
    columns = COLUMNS[table]
    keys = _key_columns(table)
    body = ", ".join(f"{name} {_TYPES[kind] if name in keys else f'Nullable({_TYPES[kind]})'}"
                     for name, kind in columns)
    layout = _LAYOUT[table]
    engine = "ReplacingMergeTree()" if layout.unique else "MergeTree()"
    day = layout.time if layout.time in keys else f"ifNull({layout.time}, 0)"  # a Nullable column: day 0
    partition = f"PARTITION BY toYYYYMMDD(toDateTime(intDiv({day}, 1000000000))) " if layout.time else ""
    final = " FINAL" if layout.unique else ""
    view_columns = ", ".join(f"toNullable({name}) AS {name}" if name in keys else name for name, _ in columns)
    return [f"CREATE TABLE IF NOT EXISTS {table}_rows ({body}) ENGINE = {engine} {partition}"
            f"ORDER BY ({', '.join(layout.key)})",
            f"CREATE VIEW IF NOT EXISTS {table} AS SELECT {view_columns} FROM {table}_rows{final}"]


def _sessions_ddl() -> list[str]:
    body = ", ".join(f"{name} {'String' if name == 'session_id' else f'Nullable({_TYPES[kind]})'}"
                     for name, kind in COLUMNS["sessions"])
    names = ", ".join("toNullable(session_id) AS session_id" if n == "session_id" else n for n in _SESSION_COLUMNS)
    return [f"CREATE TABLE IF NOT EXISTS sessions_rows ({body}, version UInt64) ENGINE = MergeTree() "
            f"ORDER BY (session_id, version)",
            f"CREATE VIEW IF NOT EXISTS sessions AS SELECT {names} FROM "
            f"(SELECT * FROM sessions_rows ORDER BY session_id, version DESC LIMIT 1 BY session_id)",
            "CREATE TABLE IF NOT EXISTS ingest_batches (batch_id String, seen_at_ns Int64) "
            "ENGINE = ReplacingMergeTree() ORDER BY batch_id"]


# -- binding ``?`` parameters as literals ---------------------------------------------------

_TINY = 2.0 ** -537  # a normal float; its square is the smallest subnormal, 2**-1074
_TOKENS = re.compile(r"'(?:[^'\\]|\\.|'')*'|\"(?:[^\"]|\"\")*\"|`[^`]*`|--[^\n]*|/\*.*?\*/|\?(\d*)", re.S)


def literal(value: Any) -> str:
    """``value`` as a ClickHouse literal."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value != 0 and abs(value) < sys.float_info.min:
            # the server's parser refuses a subnormal literal: k * 2**-1074 as two exact products
            # of normal numbers
            return f"(toFloat64({int(value / _TINY ** 2)}) * {_TINY!r} * {_TINY!r})"
        return repr(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8", "replace")
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def bind(sql: str, params: Iterable[Any] = ()) -> str:
    """``sql`` with its ``?`` (in order) and ``?N`` (the Nth) placeholders replaced by literals;
    placeholders inside quotes and comments are left as they are. A count that does not match is
    a StoreError, as sqlite3 would raise."""
    values = list(params)
    position = 0

    def one(match: re.Match[str]) -> str:
        nonlocal position
        if not match.group(0).startswith("?"):
            return match.group(0)
        number = match.group(1)
        if number:
            index = int(number) - 1
        else:
            index, position = position, position + 1
        if not 0 <= index < len(values):
            raise StoreError(f"query: {len(values)} parameter(s) given, placeholder {match.group(0)} has none")
        return literal(values[index])

    out = _TOKENS.sub(one, sql)
    if position and position != len(values):
        raise StoreError(f"query: {len(values)} parameters given for {position} placeholders")
    return out


def _problem(exc: BaseException) -> str:
    """A server exception's message without its stack trace."""
    text = str(exc)
    for cut in (". Stack trace:", "Stack trace:"):
        if cut in text:
            text = text.split(cut, 1)[0]
    return " ".join(text.split())


def _driver() -> Any:
    try:
        import clickhouse_driver
    except ImportError:
        raise StoreError("a clickhouse:// store needs clickhouse-driver: pip install 'stepwatch[clickhouse]'") from None
    # The driver logs each failed connect with its traceback ("Failed to connect to ..."); every
    # failure reaches the caller here as a StoreError, which the aggregator counts and says once.
    driver_log = logging.getLogger("clickhouse_driver")
    if driver_log.level == logging.NOTSET:  # one the user configured is left alone
        driver_log.setLevel(logging.CRITICAL)
    return clickhouse_driver


class ClickHouseStore(SqlReads):
    """Example::

        store = ClickHouseStore("clickhouse://default@127.0.0.1:9000/stepwatch")
        store.append_many({"steps": rows})
        store.query("SELECT rank, AVG(step_ns) AS ns FROM steps WHERE session_id = ? GROUP BY rank", (sid,))

    Opening creates the database and its tables when missing (``read_only``: never; a missing
    database is then an error naming it).
    """

    def __init__(self, url: str | ClickHouseURL, *, read_only: bool = False) -> None:
        self.url = url if isinstance(url, ClickHouseURL) else parse_clickhouse_url(url)
        self.read_only = read_only
        self.path = str(self.url)  # what messages name, as the SQLite store's path
        self._lock = threading.Lock()
        driver = _driver()
        errors = (driver.errors.Error, OSError, EOFError)
        self._errors = errors
        settings = {"readonly": 1} if read_only else {}
        server = driver.Client(self.url.host, port=self.url.port, user=self.url.user,
                               password=self.url.password, database="default", connect_timeout=5,
                               settings=settings)
        try:
            try:
                (version,), = server.execute("SELECT version()")
                self.features = ServerFeatures.from_version(str(version))
                (exists,), = server.execute(f"SELECT count() FROM system.databases "
                                            f"WHERE name = {literal(self.url.database)}")
                if not exists:
                    if read_only:
                        raise StoreError(f"{self.path}: no database {self.url.database!r} on the server")
                    server.execute(f"CREATE DATABASE IF NOT EXISTS {self.url.database}")
            finally:
                server.disconnect()
            self._client = driver.Client(self.url.host, port=self.url.port, user=self.url.user,
                                         password=self.url.password, database=self.url.database,
                                         connect_timeout=5, settings=settings)
            if not read_only:
                try:
                    self._create()
                except BaseException:
                    self._client.disconnect()
                    raise
        except errors as exc:
            error = StoreError(f"{self.path}: cannot open history store: {_problem(exc)}")
            # no answer at all (refused, reset, timed out), as opposed to an answer that refuses
            # (a wrong password): the aggregator may start and spill until the server answers
            error.unreachable = isinstance(exc, (driver.errors.NetworkError, driver.errors.SocketTimeoutError,
                                                 OSError, EOFError))  # type: ignore[attr-defined]
            raise error from None

    def _create(self) -> None:
        """The tables and views, made where missing, and moved forward where stepwatch's tables
        gained a column since they were made: the column is added (Nullable, NULL in the old
        rows, as SQLite's ALTER TABLE ADD COLUMN leaves them) and the view made again."""
        statements = _sessions_ddl()
        for table in _LAYOUT:
            statements += ddl(table, self.features)
        tables = [x for x in statements if x.startswith("CREATE TABLE")]
        views = [x for x in statements if x.startswith("CREATE VIEW")]
        for statement in tables:
            self._client.execute(statement)
        self._replacing()
        have: dict[str, set[str]] = {}
        for table, column in self._client.execute(
                f"SELECT table, name FROM system.columns WHERE database = {literal(self.url.database)}"):
            have.setdefault(table, set()).add(column)
        for table in ("sessions", *_LAYOUT):
            missing = [(name, kind) for name, kind in COLUMNS[table] if name not in have.get(f"{table}_rows", set())]
            for name, kind in missing:
                self._client.execute(f"ALTER TABLE {table}_rows ADD COLUMN {name} Nullable({_TYPES[kind]})")
            if missing:  # the view names the columns of its time: made again below
                self._client.execute(f"DROP TABLE IF EXISTS {table}")
        for statement in views:  # 18.16 reads a view's SELECT even when it exists: after the columns
            self._client.execute(statement)

    def _replacing(self) -> None:
        """Moves a table made as plain MergeTree whose layout is now unique (alerts and verdicts
        before the spill queue) to its ReplacingMergeTree: copied into a new table, swapped by
        RENAME, the old one dropped, its view made again (below, by ``_create``)."""
        database = literal(self.url.database)
        engines = dict(self._client.execute(f"SELECT name, engine FROM system.tables WHERE database = {database}"))
        for table, layout in _LAYOUT.items():
            if not layout.unique or engines.get(f"{table}_rows") != "MergeTree":
                continue
            old, new = f"{table}_rows", f"{table}_rows_replacing"
            self._client.execute(f"DROP TABLE IF EXISTS {new}")
            create = next(x for x in ddl(table, self.features) if x.startswith("CREATE TABLE"))
            self._client.execute(create.replace(f"EXISTS {old} ", f"EXISTS {new} ", 1))
            names = ", ".join(name for name, _ in COLUMNS[table]
                              if name in {c for t, c in self._client.execute(
                                  f"SELECT table, name FROM system.columns WHERE database = {database} "
                                  f"AND table = {literal(old)}")})
            self._client.execute(f"INSERT INTO {new} ({names}) SELECT {names} FROM {old}")
            self._client.execute(f"DROP TABLE IF EXISTS {table}")
            self._client.execute(f"RENAME TABLE {old} TO {table}_rows_merge_tree, {new} TO {old}")
            self._client.execute(f"DROP TABLE {table}_rows_merge_tree")

    def _execute(self, sql: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                return self._client.execute(sql, *args, **kwargs)
            except self._errors as exc:
                raise StoreError(f"{self.path}: query failed: {_problem(exc)}") from None

    # -- writing -----------------------------------------------------------------------------

    def _writable(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path}: store opened read-only")

    def append(self, table: str, rows: Iterable[Mapping[str, Any]]) -> int:
        return self.append_many({table: list(rows)})

    def append_many(self, batches: Mapping[str, list[Mapping[str, Any]]]) -> int:
        self._writable()
        tuples = {}
        for table, rows in batches.items():
            if table not in _LAYOUT:
                raise StoreError(f"unknown table {table!r}")
            if rows:
                try:
                    tuples[table] = row_tuples(table, list(rows))
                except ValueError as exc:
                    raise StoreError(f"{self.path}: write failed: {table}: {exc}") from None
        return self.append_tuples(tuples)

    def append_tuples(self, batches: Mapping[str, list[tuple[Any, ...]]],
                      batch_ids: Iterable[tuple[str, int]] = ()) -> int:
        """One columnar INSERT per table (ClickHouse has no transaction over tables: a failure
        part way leaves the tables before it written, which the ReplacingMergeTree keys make
        safe to retry), then the batch ids."""
        self._writable()
        total = 0
        for table, rows in batches.items():
            if table not in _LAYOUT:
                raise StoreError(f"unknown table {table!r}")
            if not rows:
                continue
            names = [name for name, _ in COLUMNS[table]]
            columns = [_column(values, kind, name in _key_columns(table))
                       for (name, kind), values in zip(COLUMNS[table], zip(*rows))]
            self._execute(f"INSERT INTO {table}_rows ({', '.join(names)}) VALUES", columns, columnar=True)
            total += len(rows)
        ids = list(batch_ids)
        if ids:
            self._execute("INSERT INTO ingest_batches (batch_id, seen_at_ns) VALUES",
                          [[str(b) for b, _ in ids], [int(t) for _, t in ids]], columnar=True)
        return total

    def upsert_session(self, row: Mapping[str, Any]) -> None:
        """The merged row as SQLite's upsert leaves it (a status only moves forward, the earliest
        start, other columns kept unless given), inserted as a new version."""
        self._writable()
        new = dict(zip(_SESSION_COLUMNS, row_tuples("sessions", [row])[0]))
        old = self.query("SELECT * FROM sessions WHERE session_id = ?", (new["session_id"],))
        merged = dict(new)
        if old:
            before = old[0]
            for name in _SESSION_COLUMNS:
                if name not in ("session_id", "started_at_ns", "status"):
                    merged[name] = new[name] if new[name] is not None else before[name]
            if new["status"] == "running" and before["status"] is not None:
                merged["status"] = before["status"]
            else:
                merged["status"] = new["status"] if new["status"] is not None else before["status"]
            starts = [s for s in (before["started_at_ns"], new["started_at_ns"]) if s is not None]
            merged["started_at_ns"] = min(starts) if starts else None
        columns = [_column([merged[name]], kind, name == "session_id") for name, kind in COLUMNS["sessions"]]
        self._execute(f"INSERT INTO sessions_rows ({', '.join(_SESSION_COLUMNS)}, version) VALUES",
                      [*columns, [time.time_ns()]], columnar=True)

    def apply_retention(self, window_ns: int, now_ns: int | None = None) -> int:
        """Deletes rows older than ``window_ns`` before the newest row of their session and rank,
        as the SQLite store does, by ``ALTER TABLE ... DELETE`` (a mutation the server applies in
        the background). Returns the rows it asked to delete."""
        self._writable()
        removed = 0
        for table, column in _RETENTION_TIME:
            # 18.16 has no correlated subqueries: one mutation per (session, rank) to trim
            cutoffs = self._execute(f"SELECT session_id, rank, max({column}) - {int(window_ns)} FROM {table}_rows "
                                    f"GROUP BY session_id, rank")
            for session_id, rank, cutoff in cutoffs:
                where = (f"session_id = {literal(session_id)} AND rank = {int(rank)} AND {column} < {int(cutoff)}")
                (n,), = self._execute(f"SELECT count() FROM {table}_rows WHERE {where}")
                if n:
                    self._execute(f"ALTER TABLE {table}_rows DELETE WHERE {where}")
                    removed += int(n)
        return removed

    def seen_batches(self, since_ns: int) -> dict[str, int]:
        rows = self.query("SELECT batch_id, seen_at_ns FROM ingest_batches FINAL WHERE seen_at_ns >= ?", (since_ns,))
        return {r["batch_id"]: r["seen_at_ns"] for r in rows}

    def forget_batches(self, before_ns: int) -> int:
        self._writable()
        (n,), = self._execute(f"SELECT count() FROM ingest_batches FINAL WHERE seen_at_ns < {int(before_ns)}")
        if n:
            self._execute(f"ALTER TABLE ingest_batches DELETE WHERE seen_at_ns < {int(before_ns)}")
        return int(n)

    # -- reading -----------------------------------------------------------------------------

    def query_columns(self, sql: str, params: Iterable[Any] = (), *,
                      settings: Mapping[str, Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        """(column names, rows as tuples) of ``sql``."""
        rows, types = self._execute(bind(sql, params), with_column_types=True, settings=dict(settings or {}))
        return [name for name, _ in types], [tuple(r) for r in rows]

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        names, rows = self.query_columns(sql, params)
        return [dict(zip(names, row)) for row in rows]

    def query_tuples(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        return self.query_columns(sql, params)[1]

    def iterate(self, sql: str, params: Iterable[Any] = (), size: int = 2048) -> Iterator[tuple[Any, ...]]:
        """The rows of ``sql``. Read whole before the first is given: one connection runs one
        query at a time, and a reader may ask another question between rows (the Perfetto
        export does), which a stream still open on the connection would block."""
        del size
        yield from self.query_tuples(sql, params)

    def rank_last_steps(self, session_id: str) -> list[dict[str, Any]]:
        """Each rank of the session and its last step (the SQLite store's recursive seek down
        its index, which ClickHouse answers by one pass over the session's key range)."""
        return self.query("SELECT rank, MAX(step) AS last FROM steps WHERE session_id = ? "
                          "GROUP BY rank ORDER BY rank", (session_id,))

    def close(self) -> None:
        with self._lock:
            self._client.disconnect()

    def __enter__(self) -> ClickHouseStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def now_ns() -> int:
        return time.time_ns()


def _column(values: Iterable[Any], kind: str, key: bool) -> list[Any]:
    """One column's values as the driver takes them for its type: SQLite's affinities applied
    (an integral float in an int column is an int, a number in a text column its text), and a
    NULL in a sorting-key column (which cannot be Nullable on 18.16) the type's zero."""
    values = list(values)
    if set(map(type, values)) <= _AS_IS[kind] and not (key and None in values):
        return values  # the usual case: every value already of the column's type (one pass, in C)
    out: list[Any] = []
    for value in values:
        if value is None:
            out.append(_ZERO[kind] if key else None)
        elif kind == "int":
            if isinstance(value, float):
                out.append(int(value) if math.isfinite(value) else (None if not key else 0))
            else:
                out.append(int(value))
        elif kind == "real":
            out.append(float(value))
        else:
            out.append(value if isinstance(value, str) else str(value))
    return out
