"""The ClickHouse store's tables and views, as a pure function of what the server accepts.

``ServerFeatures`` is read once from ``SELECT version()``; ``ddl(table, features, database)``
gives the CREATE statements for that server, so the DDL of every server version can be tested
without one. Two variants:

- **compatible** (every server, Debian's 18.16 included): times are epoch nanoseconds in
  ``Int64``, text is ``String``, no codecs, no TTL. The sorting-key columns cannot be Nullable on
  18.16: a NULL there is stored as 0 or '' (stepwatch writes none).
- **modern** (a server with DateTime64, LowCardinality without a setting, CODEC and TTL; 20.1 or
  later): the time columns (``_TIME``) are ``DateTime64(9, 'UTC')`` with ``DoubleDelta``, the
  few-valued text columns (``_LOW_CARDINALITY``) ``LowCardinality(String)``, the numbers
  compressed for what they hold (``_codec``), and each row table deletes its rows out of their
  retention window at its merges: ``TTL ... DELETE WHERE time < dictGet(<the session and rank's
  cutoff>)``, the cutoffs written by ``apply_retention`` into ``retention_cutoffs`` and read
  through the dictionary ``retention_cutoffs_dict`` (a row of a session and rank with no cutoff
  is kept). That is the SQLite store's ``--retention`` meaning (rows older than the window
  before the newest row of their session and rank), which a plain ``TTL time + INTERVAL`` (the
  window before *now*) is not: it would empty a finished session that SQLite keeps the last
  window of.

Either way every user-facing view has SQLite's names and columns, each column of SQLite's type
(a DateTime64 column read back as its epoch nanoseconds): the same SELECT reads the same rows.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any, NamedTuple

from .base import COLUMNS

__all__ = ["LAYOUT", "RETENTION_TIME", "ServerFeatures", "column_type", "ddl", "is_time", "key_columns", "partition_of",
           "literal", "retention_ddl", "sessions_ddl", "time_ns"]

_TYPES = {"text": "String", "int": "Int64", "real": "Float64", "json": "String"}


class Layout(NamedTuple):
    key: tuple[str, ...]  # the sorting key (ReplacingMergeTree: also what makes a row unique)
    time: str | None  # the column partitioned by day
    unique: bool  # ReplacingMergeTree + FINAL in the view (SQLite has a unique index on the key)


# the key columns that are not plain columns are expressions over Nullable ones (ifNull)
LAYOUT: dict[str, Layout] = {
    "telemetry": Layout(("session_id", "rank", "timestamp_ns", "event_type", "collector",
                         "ifNull(device_id, -1)"), "timestamp_ns", True),
    "spans": Layout(("session_id", "rank", "start_ns", "span_id"), "start_ns", True),
    "marks": Layout(("session_id", "rank", "ts_ns", "mark_id"), "ts_ns", True),
    "snapshots": Layout(("session_id", "rank", "ts_ns", "snapshot_id"), "ts_ns", True),
    "heartbeats": Layout(("session_id", "rank", "ts_ns", "ifNull(step, -1)", "ifNull(msg, '')"), "ts_ns", True),
    "steps": Layout(("session_id", "rank", "step"), "start_ns", True),
    # no unique index in SQLite, but unique here: a batch the aggregator writes again after a
    # failure part way (server/store_feed.py) must not show an alert or a verdict twice
    "verdicts": Layout(("session_id", "ts_ns", "ifNull(name, '')", "ifNull(step, -1)"), "ts_ns", True),
    "alerts": Layout(("session_id", "ts_ns", "ifNull(kind, '')", "ifNull(step, -1)", "ifNull(message, '')"),
                     "ts_ns", True),
}
# the tables retention trims, each by its time column (as the SQLite store's _RETENTION_TIME)
RETENTION_TIME = (("telemetry", "timestamp_ns"), ("heartbeats", "ts_ns"), ("marks", "ts_ns"), ("spans", "start_ns"),
                  ("steps", "start_ns"), ("snapshots", "ts_ns"))
_RETAINED = dict(RETENTION_TIME)

# modern variant: the columns that are points in time (DateTime64(9) there), and the text columns
# with few distinct values (LowCardinality: a dictionary per part, read as the text)
_TIME = frozenset({"timestamp_ns", "ts_ns", "start_ns", "end_ns"})
_LOW_CARDINALITY = frozenset({"session_id", "event_type", "collector", "host", "context", "name", "value_type",
                              "kind", "severity", "mode", "tensor_name", "status", "source"})
_PLAIN_NAME = re.compile(r"[a-z_]+")
_NO_CUTOFF = "-9223372036854775808"


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

    @property
    def modern(self) -> bool:
        """The modern DDL needs all four (DDL dictionaries, which its TTL reads, are 19.17+)."""
        return self.datetime64 and self.low_cardinality and self.codec and self.ttl


def key_columns(table: str) -> set[str]:
    return {part for part in LAYOUT[table].key if _PLAIN_NAME.fullmatch(part)}


def is_time(name: str, features: ServerFeatures) -> bool:
    """Whether ``name`` is stored as DateTime64 on this server (read back as epoch ns)."""
    return features.modern and name in _TIME


def _codec(name: str, kind: str) -> str:
    if name in _TIME:
        return " CODEC(DoubleDelta, ZSTD(1))"  # regular clocks: deltas of deltas are near 0
    if name in ("step", "rank", "idx", "window_steps"):
        return " CODEC(Delta, ZSTD(1))"  # counters along the sorting key
    if kind == "real":
        return " CODEC(Gorilla, ZSTD(1))"
    if name in _LOW_CARDINALITY:
        return ""  # a dictionary already
    return " CODEC(ZSTD(1))" if kind == "int" else " CODEC(ZSTD(3))"  # byte counts, durations; text, JSON


def column_type(table: str, name: str, kind: str, features: ServerFeatures, *, nullable: bool | None = None) -> str:
    """The stored type of one column on this server (with its codec on a modern one)."""
    if nullable is None:
        nullable = name not in key_columns(table) if table in LAYOUT else name != "session_id"
    if not features.modern:
        return f"Nullable({_TYPES[kind]})" if nullable else _TYPES[kind]
    base = "DateTime64(9, 'UTC')" if name in _TIME else _TYPES[kind]
    if name in _LOW_CARDINALITY:
        return f"LowCardinality({'Nullable(String)' if nullable else 'String'})"
    return (f"Nullable({base})" if nullable else base) + _codec(name, kind)


def _read_as(name: str, features: ServerFeatures, key: bool) -> str:
    """A view's column: SQLite's value of the stored one (Nullable, as every SQLite column)."""
    if is_time(name, features):
        return f"toNullable(toUnixTimestamp64Nano({name})) AS {name}" if key else \
            f"toUnixTimestamp64Nano({name}) AS {name}"
    if name in _LOW_CARDINALITY and features.modern:  # LowCardinality reads as plain String
        return f"CAST({name} AS Nullable(String)) AS {name}"
    return f"toNullable({name}) AS {name}" if key else name


def _seconds(name: str, features: ServerFeatures, key: bool) -> str:
    """The column as a DateTime (UTC seconds): what day partitions and TTL are computed from."""
    if is_time(name, features):
        return f"toDateTime({name}, 'UTC')" if key else f"toDateTime(assumeNotNull({name}), 'UTC')"
    column = name if key else f"ifNull({name}, 0)"  # a Nullable column: day 0
    return f"toDateTime(intDiv({column}, 1000000000), 'UTC')"


def ddl(table: str, features: ServerFeatures, database: str = "") -> list[str]:
    """The CREATE statements of a row table and its view for this server (``database``: where
    the modern variant's TTL finds the retention dictionary)."""
    columns = COLUMNS[table]
    keys = key_columns(table)
    body = ", ".join(f"{name} {column_type(table, name, kind, features)}" for name, kind in columns)
    layout = LAYOUT[table]
    engine = "ReplacingMergeTree()" if layout.unique else "MergeTree()"
    partition = ""
    if layout.time:
        partition = f"PARTITION BY {partition_of(table, features)} "
    ttl = ""
    if features.modern and table in _RETAINED:
        time = _RETAINED[table]
        ttl = (f" TTL {_seconds(time, features, time in keys)} DELETE WHERE "
               f"{_nanoseconds(time, features)} < dictGetInt64('{database + '.' if database else ''}"
               f"retention_cutoffs_dict', 'cutoff_ns', ('{table}', toString(session_id), rank))")
    final = " FINAL" if layout.unique else ""
    view_columns = ", ".join(_read_as(name, features, name in keys) for name, _ in columns)
    return [f"CREATE TABLE IF NOT EXISTS {table}_rows ({body}) ENGINE = {engine} {partition}"
            f"ORDER BY ({', '.join(layout.key)}){ttl}",
            f"CREATE VIEW IF NOT EXISTS {table} AS SELECT {view_columns} FROM {table}_rows{final}"]


def partition_of(table: str, features: ServerFeatures) -> str:
    """The table's partition expression (the UTC day of its time column; 18.16's as it always
    was, the server's time zone); retention asks the server for it to find whole days to drop."""
    time = LAYOUT[table].time
    assert time is not None
    key = time in key_columns(table)
    if features.modern:
        return f"toYYYYMMDD({_seconds(time, features, key)})"
    return f"toYYYYMMDD(toDateTime(intDiv({time if key else f'ifNull({time}, 0)'}, 1000000000)))"


def _nanoseconds(name: str, features: ServerFeatures) -> str:
    return f"toUnixTimestamp64Nano({name})" if is_time(name, features) else name


def time_ns(name: str, features: ServerFeatures) -> str:
    """SQL for a stored time column's epoch nanoseconds (retention's cutoffs compare them)."""
    return _nanoseconds(name, features)


def sessions_ddl(features: ServerFeatures) -> list[str]:
    """``sessions_rows`` (a version per upsert), its view (the newest version of each session),
    and the HTTP batch ids."""
    body = ", ".join(f"{name} {column_type('sessions', name, kind, features)}" for name, kind in COLUMNS["sessions"])
    names = ", ".join(_read_as(name, features, name == "session_id") for name, _ in COLUMNS["sessions"])
    return [f"CREATE TABLE IF NOT EXISTS sessions_rows ({body}, version UInt64) ENGINE = MergeTree() "
            f"ORDER BY (session_id, version)",
            f"CREATE VIEW IF NOT EXISTS sessions AS SELECT {names} FROM "
            f"(SELECT * FROM sessions_rows ORDER BY session_id, version DESC LIMIT 1 BY session_id)",
            "CREATE TABLE IF NOT EXISTS ingest_batches (batch_id String, seen_at_ns Int64) "
            "ENGINE = ReplacingMergeTree() ORDER BY batch_id"]


def retention_ddl(features: ServerFeatures, database: str, user: str = "default", password: str = "") -> list[str]:
    """The modern variant's retention cutoffs and the dictionary its TTLs read (made before the
    tables, whose TTL names it); none on a server without TTL (partition drops and mutations
    there, ``ClickHouseStore.apply_retention``). The dictionary reads its table as the store's
    user (a ClickHouse source on this server; the server hides the password in what it shows)."""
    if not features.modern:
        return []
    credentials = f" USER {literal(user)}" + (f" PASSWORD {literal(password)}" if password else "")
    return ["CREATE TABLE IF NOT EXISTS retention_cutoffs (tbl String, session_id String, rank Int64, "
            "cutoff_ns Int64, version UInt64) ENGINE = ReplacingMergeTree(version) ORDER BY (tbl, session_id, rank)",
            f"CREATE DICTIONARY IF NOT EXISTS retention_cutoffs_dict (tbl String, session_id String, rank Int64, "
            f"cutoff_ns Int64 DEFAULT {_NO_CUTOFF}) PRIMARY KEY tbl, session_id, rank "
            f"SOURCE(CLICKHOUSE(TABLE 'retention_cutoffs' DB '{database}'{credentials})) LIFETIME(MIN 1 MAX 10) "
            f"LAYOUT(COMPLEX_KEY_HASHED())"]


_TINY = 2.0 ** -537  # a normal float; its square is the smallest subnormal, 2**-1074


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
