"""The aggregator's local durable queue for a remote store: the write batches a ClickHouse server
did not take (down, refusing, or slower than the ranks send) wait here, in order, until it does
(server/store_feed.py replays them; docs/clickhouse.md).

One SQLite file (``store_spill.sqlite`` in the aggregator's ``--out`` directory), one table:
``batches(seq INTEGER PRIMARY KEY, queued_ns, rows, payload)``. ``seq`` is the order the
aggregator's ticks made the batches in, so a batch spilled late (the one that was being written
when the server went away) still replays before the batches spilled after it. ``payload`` is
the batch as msgpack: the row tuples of each table (JSON columns already text, as the store
takes them), the HTTP batch ids, and the session upserts before and after the rows.

Why SQLite: a batch is durable once ``push`` returns (WAL, ``synchronous=FULL``: a process
killed, or a machine that loses power, after the push still has it), the file is readable with
any SQLite tool, and a batch is removed in the same file only once the store has taken it. The
file outlives the aggregator: a later ``serve`` with the same ``--out`` replays what is left.

Capped (``max_bytes`` of payload): the file sits beside the run, usually on the disk the training
writes its checkpoints to, and a long outage must not fill it. A batch past the cap is refused
(``SpillFull``) and the feed counts its rows lost to the remote history; the ranks' own artifacts
still hold them (``stepwatch import RUN_DIR --into URL``).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from ..errors import StoreError

__all__ = ["SPILL_FILE", "SpillBatch", "SpillFull", "SpillQueue", "UnreadableBatch"]

SPILL_FILE = "store_spill.sqlite"
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class UnreadableBatch(StoreError):
    """A queued batch whose payload cannot be decoded (the file was damaged): ``seq`` and
    ``rows`` say which and how many rows it held, so it can be counted as lost and removed."""

    def __init__(self, message: str, seq: int, rows: int) -> None:
        super().__init__(message)
        self.seq, self.rows = seq, rows


class SpillFull(StoreError):
    """The queue holds ``max_bytes`` already: the batch was not queued."""


class SpillBatch(NamedTuple):
    """One tick's writes, in the order the store must take them: ``opens`` (session upserts of
    ranks first seen), the rows of ``tables`` with their HTTP ``batch_ids``, then ``closes``
    (sessions every rank of which stopped)."""

    seq: int
    tables: dict[str, list[Any]]
    batch_ids: list[Any]
    opens: list[dict[str, Any]]
    closes: list[dict[str, Any]]

    @property
    def rows(self) -> int:
        return sum(len(rows) for rows in self.tables.values())


class SpillQueue:
    """Example::

        queue = SpillQueue(out / SPILL_FILE)
        queue.push(batch)                 # durable when it returns
        first = queue.first()             # the lowest seq, or None
        queue.remove(first.seq)           # once the store took it

    Thread-safe (one connection behind a lock): the aggregator's writer thread pushes while the
    feeder's thread reads and removes. Errors are StoreError naming the file.
    """

    def __init__(self, path: str | Path, max_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("CREATE TABLE IF NOT EXISTS batches (seq INTEGER PRIMARY KEY, queued_ns INTEGER NOT NULL, "
                             "rows INTEGER NOT NULL, payload BLOB NOT NULL)")
            batches, rows, size, last = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(rows), 0), COALESCE(SUM(LENGTH(payload)), 0), COALESCE(MAX(seq), 0) "
                "FROM batches").fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open the spill queue: {exc}") from None
        self.batches, self.rows, self.bytes, self.last_seq = int(batches), int(rows), int(size), int(last)

    def push(self, batch: SpillBatch, capped: bool = True) -> None:
        """Stores ``batch`` (a seq already queued is replaced: the same batch spilled again).
        SpillFull when it would take the queue past ``max_bytes`` (unless not ``capped``)."""
        payload = _encoder.encode({"tables": batch.tables, "batch_ids": batch.batch_ids,
                                   "opens": batch.opens, "closes": batch.closes})
        with self._lock:
            try:
                old = self._db.execute("SELECT rows, LENGTH(payload) FROM batches WHERE seq = ?",
                                       (batch.seq,)).fetchone()
                grown = self.bytes + len(payload) - (int(old[1]) if old is not None else 0)
                if capped and self.max_bytes is not None and grown > self.max_bytes:
                    raise SpillFull(f"{self.path}: the spill queue holds {self.bytes} bytes, its cap is "
                                    f"{self.max_bytes}: a batch of {batch.rows} rows is not queued")
                self._db.execute("INSERT OR REPLACE INTO batches (seq, queued_ns, rows, payload) VALUES (?, ?, ?, ?)",
                                 (batch.seq, time.time_ns(), batch.rows, payload))
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: cannot spill a batch of {batch.rows} rows: {exc}") from None
            if old is None:
                self.batches += 1
                self.rows += batch.rows
            else:
                self.rows += batch.rows - int(old[0])
            self.bytes = grown
            self.last_seq = max(self.last_seq, batch.seq)

    def first(self) -> SpillBatch | None:
        """The batch with the lowest seq, or None when the queue is empty."""
        batches = self.head(0)
        return batches[0] if batches else None

    def head(self, max_rows: int) -> list[SpillBatch]:
        """The first batches in seq order, as many as fit in ``max_rows`` (at least one; none when
        the queue is empty): what a replay writes as one INSERT per table. UnreadableBatch when
        the first cannot be read back; a later one that cannot ends the list before it."""
        with self._lock:
            try:
                sizes = self._db.execute("SELECT seq, rows FROM batches ORDER BY seq LIMIT 64").fetchall()
                total = last = 0
                for number, (seq, rows) in enumerate(sizes):
                    if number and total + int(rows) > max_rows:
                        break
                    total, last = total + int(rows), int(seq)
                found = self._db.execute("SELECT seq, payload, rows FROM batches WHERE seq <= ? ORDER BY seq",
                                         (last,)).fetchall() if sizes else []
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: cannot read the spill queue: {exc}") from None
        batches: list[SpillBatch] = []
        for seq, payload, rows in found:
            try:
                body = _decoder.decode(payload)
                batch = SpillBatch(int(seq), {str(t): list(r) for t, r in body["tables"].items()},
                                   list(body["batch_ids"]), list(body["opens"]), list(body["closes"]))
            except (msgspec.DecodeError, KeyError, TypeError, AttributeError) as exc:
                if batches:
                    break
                raise UnreadableBatch(f"{self.path}: batch {seq} cannot be read back: {exc}", int(seq),
                                      int(rows)) from None
            batches.append(batch)
        return batches

    def remove(self, seq: int) -> None:
        with self._lock:
            try:
                found = self._db.execute("SELECT rows, LENGTH(payload) FROM batches WHERE seq = ?", (seq,)).fetchone()
                self._db.execute("DELETE FROM batches WHERE seq = ?", (seq,))
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: cannot remove batch {seq} from the spill queue: {exc}") from None
            if found is not None:
                self.batches -= 1
                self.rows -= int(found[0])
                self.bytes -= int(found[1])

    def close(self) -> None:
        with self._lock:
            self._db.close()
