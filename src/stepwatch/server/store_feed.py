"""Between the aggregator's ticks and a remote store (ClickHouse): the ticks never wait on the
server, and no row is lost while it is slow or down
(docs/clickhouse.md, "When the server is down or slow").

The aggregator hands each tick's batch to ``submit`` (on a worker thread; it only ever touches
local memory or the local spill file) and goes back to reading the ranks. A thread of this
feed writes the batches to the store, oldest first:

- **healthy**: a batch waits in memory (at most ``memory_batches`` batches and ``memory_rows``
  rows) until the thread writes it, with the others waiting then as one INSERT per table
  (``MERGE_ROWS``);
- **degraded**: a write failed (the server is unreachable, refused, or dropped the connection),
  or the server is slow: the batches in memory are full (it takes them slower than the ranks
  send), or a write has waited on it for ``slow_s`` (5 s; ``STEPWATCH_STORE_SLOW_S``) when the
  next batch comes (a hung server: the write may wait minutes for its socket timeout). Every
  batch then goes to the spill queue (store/spill.py: an SQLite file beside the run, durable
  when ``submit`` returns), the ones still in memory first, each with its sequence number so
  the order is kept. The thread retries with exponential backoff (``backoff_s``: 0.5 s doubling
  to 30 s, ``STEPWATCH_STORE_RETRY_MAX_S``) and, once a write succeeds, replays the queue in order, removing each batch only
  after the store took it (several at once, as in memory); when the queue is empty the feed is
healthy again.

Exactly once: a batch whose write failed part way (ClickHouse has no transaction over tables)
is written again whole. Every ClickHouse table is a ReplacingMergeTree on a key that makes a row
unique (store/clickhouse.py), and its view reads FINAL, so a row written twice is read once.

A batch the server refuses while it answers (``SELECT 1`` works right after the failure) three
times in a row cannot be written by waiting: its rows are counted lost and it is removed, so one
bad batch does not hold the queue back for ever. A batch the spill file cannot take (the local
disk is full, or it holds ``spill_max_bytes``: 2 GiB, ``STEPWATCH_STORE_SPILL_MAX_MB``) is counted
lost too; the ranks' own artifacts still hold its rows.

Events for the aggregator (``take_events``, polled every tick on its loop): ``degraded`` (when an
episode starts: it raises the ``STORE_DEGRADED`` alert) and ``recovered``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..store.spill import SpillBatch, SpillFull, SpillQueue, UnreadableBatch
from .settings import positive_from_env

__all__ = ["RETRY_MAX_ENV", "SLOW_ENV", "SPILL_MAX_ENV", "StoreFeed", "UnopenedStore", "backoff_from_env",
           "open_remote_store", "slow_s_from_env", "spill_max_bytes_from_env"]

log = logging.getLogger("stepwatch.aggregator")
_REFUSALS_BEFORE_DROP = 3
# Consecutive ticks' batches, waiting in memory or spilled, go to the server as one INSERT per
# table of up to this many rows: 18.16 spent 24.5-38.1 us of CPU a row taking 92,672 rows in 38
# tick-sized INSERTs and 0.86-1.29 us taking them in one (bench/bench_clickhouse_aggregator.py
# --profile), so a feed that wrote tick by tick fell behind a busy run and spilled it all.
MERGE_ROWS = 200_000
SLOW_ENV = "STEPWATCH_STORE_SLOW_S"
RETRY_MAX_ENV = "STEPWATCH_STORE_RETRY_MAX_S"
SPILL_MAX_ENV = "STEPWATCH_STORE_SPILL_MAX_MB"
SPILL_MAX_MB = 2048


def slow_s_from_env(default: float = 5.0) -> float:
    """``STEPWATCH_STORE_SLOW_S``: how long a write may wait on the server before the next batch
    is spilled instead of waiting behind it."""
    return positive_from_env(SLOW_ENV, default)


def backoff_from_env(first: float = 0.5, longest: float = 30.0) -> tuple[float, float]:
    """(first wait, longest wait) between tries of a store that failed; the longest from
    ``STEPWATCH_STORE_RETRY_MAX_S`` (how late a server that is back may be noticed)."""
    longest = positive_from_env(RETRY_MAX_ENV, longest)
    return min(first, longest), longest


def spill_max_bytes_from_env() -> int:
    """``STEPWATCH_STORE_SPILL_MAX_MB``: how large the spill queue may grow (MiB of batches)."""
    return int(positive_from_env(SPILL_MAX_ENV, SPILL_MAX_MB, unit="MiB") * 2**20)


def _problem(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, StoreError) else f"{type(exc).__name__}: {text}"


class UnopenedStore:
    """A store URL whose server did not answer when the aggregator started: opened by the first
    call that needs it (the feed's thread, on its backoff: meanwhile every batch is spilled);
    until then each call raises the StoreError of that try."""

    def __init__(self, url: str, error: StoreError) -> None:
        from ..store.clickhouse_url import parse_clickhouse_url

        self.url = url
        self.path = str(parse_clickhouse_url(url))  # without the password, as the store's own
        self.error = error
        self._store: Any = None
        self._lock = threading.Lock()

    def _opened(self) -> Any:
        with self._lock:
            if self._store is None:
                from ..store import open_store

                self._store = open_store(self.url)
            return self._store

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._opened(), name)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def merged(batches: list[SpillBatch]) -> SpillBatch:
    """Consecutive ticks' writes as one batch (the last one's seq): each table's rows in tick
    order, the sessions opened before them and closed after them (``group`` ends a run of ticks
    at one that closes sessions, so no close comes before rows of its own tick)."""
    if len(batches) == 1:
        return batches[0]
    tables: dict[str, list[Any]] = {}
    for batch in batches:
        for table, rows in batch.tables.items():
            tables.setdefault(table, []).extend(rows)
    return SpillBatch(batches[-1].seq, tables, [i for b in batches for i in b.batch_ids],
                      [o for b in batches for o in b.opens], [c for b in batches for c in b.closes])


def group(batches: list[SpillBatch], max_rows: int) -> list[SpillBatch]:
    """The first batches that go to the server together: up to ``max_rows`` rows (at least one
    batch), ending at the first that closes sessions."""
    chosen: list[SpillBatch] = []
    rows = 0
    for batch in batches:
        if chosen and (rows + batch.rows > max_rows or chosen[-1].closes):
            break
        chosen.append(batch)
        rows += batch.rows
    return chosen


def open_remote_store(url: str) -> Any:
    """The store of ``url``; an ``UnopenedStore`` when its server does not answer yet (any other
    failure, a wrong password or a missing driver, is raised: waiting would not mend it)."""
    from ..store import open_store

    try:
        return open_store(url)
    except StoreError as exc:
        if not getattr(exc, "unreachable", False):
            raise
        log.warning("aggregator: %s; the rows are spilled until it answers", exc)
        return UnopenedStore(url, exc)


class StoreFeed:
    """Example::

        feed = StoreFeed(ClickHouseStore(url), out / SPILL_FILE)
        feed.submit(tables, batch_ids, opens, closes)   # never waits on the server
        feed.stats()["store_spill_pending_rows"]
        feed.close()                                    # drains what it can, spills the rest
    """

    def __init__(self, store: Any, spill_path: str | Path, *, memory_batches: int = 64, memory_rows: int = 500_000,
                 backoff_s: tuple[float, float] = (0.5, 30.0), drain_s: float = 30.0, slow_s: float = 5.0,
                 spill_max_bytes: int | None = SPILL_MAX_MB * 2**20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.queue = SpillQueue(spill_path, spill_max_bytes)
        self.memory_batches, self.memory_rows = memory_batches, memory_rows
        self.backoff_s, self.drain_s, self.slow_s, self.clock = backoff_s, drain_s, slow_s, clock
        self._in_flight_since: float | None = None  # clock() when the call to the server under way began
        self._memory: deque[SpillBatch] = deque()
        self._memory_rows = 0
        self._cond = threading.Condition()
        self._next_seq = self.queue.last_seq + 1
        self._failures = 0  # consecutive failed writes
        # a merged write the server refused while it answered: its batches go one at a time, to
        # find the one it refuses (counted, then lost alone), up to this seq
        self._solo_until = -1
        self._writing_upto = -1  # the last seq of the memory batches the write under way holds
        self._retry_at = 0.0
        self._refusals: dict[int, int] = {}  # seq -> failures while the server answered
        self._stopping = False
        self._drain_until = float("inf")
        self._maintenance: Callable[[], None] | None = None
        self._events: list[dict[str, Any]] = []
        self._degraded_at: float | None = None  # clock() when the episode began
        self._degraded_s = 0.0
        self.rows_written = 0
        self.rows_lost = 0
        self.write_errors = 0  # batches lost: refused for good, or not spillable
        self.write_batches: list[tuple[int, float]] = []  # (rows, seconds) of recent writes
        self.write_failures = 0
        self.episodes = 0
        self.spilled_batches = self.spilled_rows = 0
        self.replayed_batches = self.replayed_rows = 0
        self.last_error: str | None = None
        self._logged_loss = False
        if self.queue.batches:  # left by an earlier aggregator on this directory: replayed first
            self._degrade("queued", f"{self.queue.batches} batches ({self.queue.rows} rows) left in "
                                    f"{self.queue.path} by an earlier run")
        elif isinstance(store, UnopenedStore):
            self._degrade("failed", str(store.error))
        self._thread = threading.Thread(target=self._run, name="stepwatch-store-feed", daemon=True)
        self._thread.start()

    # -- the aggregator's side ---------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self._degraded_at is not None

    @property
    def busy(self) -> bool:
        """Degraded, or a batch waits behind the one being written: the store is behind (live
        verdicts skip their round, they would read the past)."""
        return self._degraded_at is not None or len(self._memory) > 1

    def submit(self, tables: dict[str, list[Any]], batch_ids: list[Any], opens: list[dict[str, Any]],
               closes: list[dict[str, Any]]) -> None:
        """One tick's writes, queued in memory or spilled to the local file; never waits on the
        store (call it off the event loop: a spill is an SQLite write and an fsync)."""
        with self._cond:
            batch = SpillBatch(self._next_seq, tables, list(batch_ids), opens, closes)
            self._next_seq += 1
            waited = self.clock() - self._in_flight_since if self._in_flight_since is not None else 0.0
            if (self._degraded_at is None and waited < self.slow_s and len(self._memory) < self.memory_batches
                    and self._memory_rows + batch.rows <= max(self.memory_rows, batch.rows)):
                self._memory.append(batch)
                self._memory_rows += batch.rows
                self._cond.notify()
                return
            if self._degraded_at is None:
                self._degrade("slow", f"a call has waited {waited:.1f} s on the server" if waited >= self.slow_s
                              else f"{len(self._memory)} batches ({self._memory_rows} rows) still wait for it")
                while self._memory and self._memory[-1].seq > self._writing_upto:  # behind the write under way
                    behind = self._memory.pop()
                    self._memory_rows -= behind.rows
                    self._spill(behind)
            self._spill(batch)
            self._cond.notify()

    def run_maintenance(self, task: Callable[[], None]) -> None:
        """Runs ``task`` (retention, forgetting old batch ids) on the feed's thread, between
        writes, when the store is healthy; a task already waiting is replaced."""
        with self._cond:
            self._maintenance = task
            self._cond.notify()

    def take_events(self) -> list[dict[str, Any]]:
        with self._cond:
            events, self._events = self._events, []
        return events

    def close(self) -> bool:
        """Writes what waits for up to ``drain_s`` (a failure ends the try at once; so does a
        write that has hung on the server for ``slow_s``), then spills what is still in memory.
        True when the thread ended (False: a write still hangs on the server; the store must not
        be closed under it)."""
        with self._cond:
            self._stopping = True
            self._drain_until = self.clock() + self.drain_s
            self._cond.notify()
        deadline = time.monotonic() + self.drain_s + 5.0
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(0.1)
            with self._cond:
                if self._in_flight_since is not None and self.clock() - self._in_flight_since > self.slow_s:
                    break  # hung: what waits is spilled now, the hung batch with it (a replay reads once)
        finished = not self._thread.is_alive()
        with self._cond:
            self._spill_memory()
            self._end_episode()
        if finished:  # else the hung write may still come back and touch the queue; the process ends anyway
            self.queue.close()
        return finished

    def stats(self) -> dict[str, Any]:
        """The counters, read without the lock (``/healthz`` asks on the event loop, which must
        not wait for a spill's fsync): each is one value the GIL reads whole."""
        since = self._degraded_at
        degraded_s = self._degraded_s + (self.clock() - since if since is not None else 0.0)
        return {
            "store_degraded": since is not None, "store_degraded_episodes": self.episodes,
            "store_degraded_s": round(degraded_s, 3), "store_write_failures": self.write_failures,
            "store_spilled_batches": self.spilled_batches, "store_spilled_rows": self.spilled_rows,
            "store_replayed_batches": self.replayed_batches, "store_replayed_rows": self.replayed_rows,
            "store_spill_pending_batches": self.queue.batches, "store_spill_pending_rows": self.queue.rows,
            "store_spill_pending_bytes": self.queue.bytes,
            "store_memory_batches": len(self._memory), "store_last_error": self.last_error,
            "store_spill_path": str(self.queue.path),
        }

    # -- under the lock ------------------------------------------------------------------------

    def _degrade(self, reason: str, detail: str) -> None:
        if self._degraded_at is not None:
            return
        self._degraded_at = self.clock()
        self.episodes += 1
        self._events.append({"event": "degraded", "reason": reason, "detail": detail, "ts": time.time(),
                             "spill_path": str(self.queue.path)})
        log.warning("aggregator: the history store is %s (%s): batches go to %s until it takes them again",
                    {"slow": "slow", "queued": "behind", "failed": "failing"}.get(reason, reason), detail,
                    self.queue.path)

    def _end_episode(self) -> None:
        if self._degraded_at is not None and not self.queue.batches and not self._memory:
            seconds = self.clock() - self._degraded_at
            self._degraded_s += seconds
            self._degraded_at = None
            self._events.append({"event": "recovered", "seconds": round(seconds, 3), "ts": time.time(),
                                 "replayed_rows": self.replayed_rows})
            log.warning("aggregator: the history store took every spilled batch again after %.1f s "
                        "(%d rows replayed)", seconds, self.replayed_rows)

    def _spill(self, batch: SpillBatch, capped: bool = True) -> None:
        try:
            self.queue.push(batch, capped)
        except SpillFull as exc:
            self._lose(batch.rows, f"{exc} ({SPILL_MAX_ENV} raises the cap; the ranks' artifacts still hold "
                                   f"the rows: stepwatch import RUN_DIR --into URL)")
            if batch.opens or batch.closes:
                # its sessions' upserts are kept, past the cap (a few hundred bytes): without its
                # close a session would read running for ever
                self._spill(SpillBatch(batch.seq, {}, [], batch.opens, batch.closes), capped=False)
            return
        except StoreError as exc:
            self._lose(batch.rows, f"the spill queue cannot take it: {exc}")
            return
        self.spilled_batches += 1
        self.spilled_rows += batch.rows

    def _spill_memory(self) -> None:
        while self._memory:
            self._spill(self._memory.popleft())
        self._memory_rows = 0

    def _lose(self, rows: int, why: str) -> None:
        self.rows_lost += rows
        self.write_errors += 1
        if not self._logged_loss:
            self._logged_loss = True
            log.warning("aggregator: %d rows are lost to the history (later losses are counted): %s", rows, why)

    # -- the feed's thread -------------------------------------------------------------------------

    def _limit(self) -> int:
        return 0 if self._solo_until >= 0 else MERGE_ROWS

    def _next(self) -> tuple[str, list[SpillBatch] | None] | None:
        """What to do next (under the lock): ("memory", the batches to write together),
        ("spill", None), ("maintain", None), or None to end."""
        while True:
            now = self.clock()
            if self._stopping and now >= self._drain_until:
                return None
            if self._memory:
                chosen = group(list(self._memory), self._limit())
                self._writing_upto = chosen[-1].seq
                return "memory", chosen
            if self.queue.batches and (self._stopping or now >= self._retry_at):
                return "spill", None
            if self._stopping:
                return None
            if self._maintenance is not None and self._degraded_at is None:
                return "maintain", None
            self._cond.wait(max(0.0, self._retry_at - now) if self.queue.batches else None)

    def _run(self) -> None:
        while True:
            with self._cond:
                step = self._next()
                if step is None:
                    return
                source, batches = step
                limit = self._limit()
                task = None
                if source == "maintain":
                    task, self._maintenance = self._maintenance, None
            if task is not None:
                try:
                    with self._on_server():
                        task()
                except Exception as exc:  # noqa: BLE001 - retention fails alone, it is tried again later
                    log.warning("aggregator: retention failed (tried again later): %s", _problem(exc))
                continue
            if batches is None:
                try:
                    batches = group(self.queue.head(limit), limit)
                except UnreadableBatch as exc:
                    with self._cond:
                        self._lose(exc.rows, str(exc))
                        self.queue.remove(exc.seq)
                        self._end_episode()
                    continue
                except StoreError as exc:
                    log.warning("aggregator: %s", exc)
                    with self._cond:
                        self._retry_at = self.clock() + self.backoff_s[1]
                    continue
                if not batches:  # the counts said a batch waits: they are corrected
                    with self._cond:
                        self.queue.batches = self.queue.rows = 0
                        self._end_episode()
                    continue
            batch = merged(batches)
            started = time.perf_counter()
            try:
                with self._on_server():
                    self._write(batch)
            except Exception as exc:  # noqa: BLE001 - the feed outlives every failed write
                self._failed(source, batches, batch, exc)
                with self._cond:
                    if self._stopping:
                        self._spill_memory()
                        return
                continue
            self._written(source, batches, batch, time.perf_counter() - started)

    def _write(self, batch: SpillBatch) -> None:
        for row in batch.opens:
            self.store.upsert_session(row)
        if batch.tables or batch.batch_ids:
            self.store.append_tuples(batch.tables, batch.batch_ids)
        for row in batch.closes:
            self.store.upsert_session(row)

    @contextlib.contextmanager
    def _on_server(self) -> Iterator[None]:
        """Marks a call to the server (a write, the probe, retention) as under way: a call that
        has hung on it for ``slow_s`` makes the next batch spill, and ends ``close``'s wait."""
        with self._cond:
            self._in_flight_since = self.clock()
        try:
            yield
        finally:
            with self._cond:
                self._in_flight_since = None

    def _written(self, source: str, batches: list[SpillBatch], batch: SpillBatch, seconds: float) -> None:
        with self._cond:
            self._writing_upto = -1
            if source == "memory":
                while self._memory and self._memory[0].seq <= batch.seq:
                    self._memory_rows -= self._memory.popleft().rows
            else:
                for done in batches:
                    self.queue.remove(done.seq)
                self.replayed_batches += len(batches)
                self.replayed_rows += batch.rows
            for done in batches:
                self._refusals.pop(done.seq, None)
            self._failures = 0
            if batch.seq >= self._solo_until:
                self._solo_until = -1
            self.rows_written += batch.rows
            self.write_batches.append((batch.rows, seconds))
            del self.write_batches[:-1000]
            self._end_episode()

    def _answers(self) -> bool:
        try:
            with self._on_server():
                self.store.query("SELECT 1 AS one")
        except Exception:  # noqa: BLE001 - any failure: the server does not answer
            return False
        return True

    def _failed(self, source: str, batches: list[SpillBatch], batch: SpillBatch, exc: BaseException) -> None:
        problem = _problem(exc)
        answers = self._answers()
        with self._cond:
            self._writing_upto = -1
            self.write_failures += 1
            self.last_error = problem
            if source == "memory":
                self._spill_memory()  # the failed batches first: they have the lowest seqs
            if answers and len(batches) > 1:
                self._solo_until = batch.seq  # refused several ticks at once: each alone, to find it
            elif answers:
                self._refusals[batch.seq] = self._refusals.get(batch.seq, 0) + 1
                if self._refusals[batch.seq] >= _REFUSALS_BEFORE_DROP:
                    del self._refusals[batch.seq]
                    self._lose(batch.rows, f"the store refused the batch {_REFUSALS_BEFORE_DROP} times while it "
                                           f"answered: {problem}")
                    self.queue.remove(batch.seq)
                    if batch.seq >= self._solo_until:
                        self._solo_until = -1
                    self._end_episode()
                    return
            self._failures += 1
            low, high = self.backoff_s
            self._retry_at = self.clock() + min(high, low * 2 ** (self._failures - 1))
            self._degrade("failed", problem)
