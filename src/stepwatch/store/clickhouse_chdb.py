"""The ClickHouse store on chdb, ClickHouse's engine in-process (``pip install chdb``): the part
of clickhouse-driver's ``Client`` the store uses (``execute``), answered by a current engine (26.x).

Why: the only server this machine and Debian have is 18.16, so the modern DDL (DateTime64,
LowCardinality, CODEC, TTL) and every view and read the store sends are run here, for real, on a
current ClickHouse (tests/store/test_clickhouse_modern.py). ``ClickHouseStore.on_chdb(path)``
opens a store on a chdb data directory; one process may hold a directory at a time.

Inserts go in as ``INSERT ... SELECT ... FROM values('<structure>', <literals>)``, a DateTime64
column's epoch nanoseconds through ``fromUnixTimestamp64Nano`` (chdb reads an integer given to a
DateTime64 column as seconds; the driver sends it as ticks). Results come back as Arrow tables.
Settings the driver would send with a query (``readonly``) are not applied here.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from .clickhouse_ddl import literal

__all__ = ["ChdbClient", "chdb_errors"]

_SESSIONS: dict[str, Any] = {}  # data directory -> its chdb session (one per directory and process)
_LOCK = threading.Lock()
_ROWS_PER_INSERT = 1000  # literal rows per statement (max_query_size: 256 KiB)
_INSERT = re.compile(r"\s*INSERT INTO (\w+) \(([^)]*)\) VALUES\s*$", re.S)


def chdb_errors() -> tuple[type[BaseException], ...]:
    from chdb import ChdbError

    return (ChdbError, RuntimeError)


def _session(path: str) -> Any:
    from chdb import session

    with _LOCK:
        if path not in _SESSIONS:
            _SESSIONS[path] = [session.Session(path), None]  # [session, its current database]
        return _SESSIONS[path]


class ChdbClient:
    """``execute`` as clickhouse-driver's, on the chdb session of ``path`` in ``database``."""

    def __init__(self, path: str, database: str = "default") -> None:
        self._state = _session(path)
        self.database = database

    def _query(self, sql: str, fmt: str = "ArrowTable") -> Any:
        state = self._state
        if state[1] != self.database:
            state[0].query(f"USE {self.database}", "CSV")
            state[1] = self.database
        return state[0].query(sql, fmt)

    def execute(self, sql: str, params: Any = None, *, columnar: bool = False, with_column_types: bool = False,
                settings: Any = None) -> Any:
        del settings
        insert = _INSERT.match(sql)
        if insert is not None and params is not None:
            self._insert(insert.group(1), [c.strip() for c in insert.group(2).split(",")], params, columnar)
            return []
        if re.match(r"\s*(CREATE|ALTER|DROP|INSERT|OPTIMIZE|SYSTEM|USE|RENAME|TRUNCATE)\b", sql, re.I):
            self._query(sql, "CSV")
            return ([], []) if with_column_types else []
        table = self._query(sql)
        columns = [column.to_pylist() for column in table.columns]
        out = columns if columnar else (list(zip(*columns)) if columns else [])
        if with_column_types:
            return out, [(field.name, str(field.type)) for field in table.schema]
        return out

    def _insert(self, table: str, names: list[str], params: Any, columnar: bool) -> None:
        types = {r["name"]: r["type"] for r in self._query(
            f"SELECT name, type FROM system.columns WHERE database = currentDatabase() AND table = {literal(table)}"
        ).to_pylist()}
        rows = list(zip(*params)) if columnar else [tuple(r) for r in params]
        if not rows:
            return
        structure, select = [], []
        for name in names:
            kind = types[name]
            nullable = "Nullable(" in kind
            plain = re.sub(r"^LowCardinality\((.*)\)$", r"\1", kind)
            plain = re.sub(r"^Nullable\((.*)\)$", r"\1", plain)
            if plain.startswith("DateTime64"):
                structure.append(f"{name} {'Nullable(Int64)' if nullable else 'Int64'}")
                select.append(f"fromUnixTimestamp64Nano({name}, 'UTC')")
            else:
                structure.append(f"{name} {'Nullable(' + plain + ')' if nullable else plain}")
                select.append(name)
        for start in range(0, len(rows), _ROWS_PER_INSERT):  # each under the engine's max_query_size
            values = ", ".join("(" + ", ".join(literal(v) for v in row) + ")"
                               for row in rows[start:start + _ROWS_PER_INSERT])
            self._query(f"INSERT INTO {table} ({', '.join(names)}) SELECT {', '.join(select)} "
                        f"FROM values({literal(', '.join(structure))}, {values})", "CSV")

    def disconnect(self) -> None:
        """The session stays open for the process (a chdb directory is opened once)."""
