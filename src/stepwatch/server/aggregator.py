"""The aggregator core: accepts messages, batches their rows, writes one transaction per tick.

Asyncio receives; the store write of each tick runs in one worker thread, so the event loop
keeps reading other ranks while SQLite commits. Rejected frames are counted by reason and the
connection that sent them is dropped only when the stream cannot continue (oversize).

Rows wait as tuples in column order (JSON columns already text), so the writer only binds them.
A tick writes when ``tick_s`` has passed or ``flush_rows`` rows are waiting, whichever is first;
while ``pause_rows`` rows wait, TCP connections stop reading (their ranks' sockets fill and
their senders queue, then drop, as for a slow aggregator) and HTTP uploads wait for room. So
memory and the size of a commit stay bounded however fast the ranks send.

Sessions: a session is ``running`` from its first frame; once every rank seen in it has sent its
``stop`` telemetry event it is closed (status from the stop events, the worst of them, and
``ended_at_ns`` the last stop), written by the writer after the stop rows themselves. The
launcher's own final upsert comes after the aggregator has stopped, so it has the last word.

Connections: each TCP connection carries one rank's frames (transport/sender.py). When the
last connection of a rank closes from the rank's end (EOF or a reset: its process died, or its
host) and no ``stop`` event came from it, the watchdog is told (``feed_disconnect``): a rank on
another host, whose pid no one here can check, is known lost this way (docs/watchdog.md). A
connection the aggregator hangs up itself (a bad frame, shutdown) tells nothing.

A remote store (``feed``: server/store_feed.py, for ClickHouse): a tick hands its batch to the
feed, which writes it on a thread of its own, and spills it to a local durable queue while the
server is down or slow (replayed in order when it is back): no tick waits on the server, so
intake never pauses for it. The session upserts of ranks first seen go with the tick's batch then
(on SQLite they are written at once). When the feed degrades, each running session gets a
``STORE_DEGRADED`` alert (docs/clickhouse.md).

Retention (``retention_ns``): the writer applies ``HistoryStore.apply_retention`` every tenth of
the window (between 1 s and an hour), and forgets HTTP batch ids older than the 24 h dedupe
window as often.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import StepwatchError, StoreError, TransportError
from ..log import logger
from ..schema import worst_status
from ..schema.limits import bounded_columns, rows_problem, sender_problem, shape_problem
from ..store.base import COLUMNS, HistoryStore
from ..store.rows import CarryUpdate, PhaseCarry, check_rows, row_tuples, to_rows, wire_tuples
from ..transport.frames import DEFAULT_MAX_FRAME, FrameDecoder, Message, WireTables, decode_body, decode_typed

__all__ = ["Aggregator"]

_ROW_ERRORS = (KeyError, TypeError, ValueError, AttributeError, OverflowError)
# the runtime's stop event says how it stopped: context "stepwatch capture stopped (<status>)"
_STOP_STATUS = re.compile(r"\((completed|interrupted|failed|incomplete)\)\s*$")
DEDUPE_WINDOW_NS = 24 * 3600 * 10**9
# A session whose ranks heard here have all stopped, but fewer than its world size (the other
# nodes' ranks send to aggregators of their own, into the same store, or have not been heard
# from yet) stays running until every rank's stop is in the store, or for this long at most
# (then it is closed with what is known: a world size only some ranks ever reported).
WORLD_WAIT_S = 60.0
WORLD_WAIT_ENV = "STEPWATCH_WORLD_WAIT_S"
# The columns of each table that a sender fills with what it claims (ids, names, hosts, ranks),
# bounded by schema.limits before anything of a frame is kept. Spans, marks and snapshots
# take their session and rank from the frame's meta (checked once per sender); steps are derived.
_BOUNDED = {table: bounded_columns([c for c, _ in COLUMNS[table]],
                                   () if table == "telemetry" else ("session_id",) if table == "heartbeats"
                                   else ("session_id", "rank"))
            for table in ("telemetry", "spans", "marks", "snapshots", "heartbeats")}
# What is left to check of typed wire rows (decode_typed checked lengths and ranges in C): the
# ids' and hosts' shape. Snapshots and heartbeats come as maps: all of _BOUNDED.
_SHAPED = {table: tuple(c for c in columns if c[2] in ("id", "session", "host"))
           for table, columns in _BOUNDED.items() if table in ("telemetry", "spans", "marks")}

_SQLITE_FULL = 13  # sqlite3's result code for "database or disk is full"
log = logging.getLogger("stepwatch.aggregator")


def _stop_status(context: Any) -> str:
    found = _STOP_STATUS.search(context) if type(context) is str else None
    return found.group(1) if found else "completed"


def is_disk_full(exc: BaseException) -> bool:
    """Whether a failed write failed for want of space (ENOSPC, EDQUOT, SQLITE_FULL), along
    the chain of causes: then every later write fails alike, and saying so once is enough."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(seen, sqlite3.Error) and getattr(seen, "sqlite_errorcode", None) == _SQLITE_FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Aggregator:
    """Example::

        aggregator = Aggregator(SqliteStore(path))
        server = await asyncio.start_server(aggregator.handle_connection, "127.0.0.1", 0)
        writer = asyncio.create_task(aggregator.write_loop())
    """

    def __init__(self, store: HistoryStore, *, max_frame: int = DEFAULT_MAX_FRAME, tick_s: float = 0.2,
                 max_pending_rows: int = 2_000_000, flush_rows: int = 10_000, pause_rows: int = 50_000,
                 session_id: str | None = None, retention_ns: int | None = None,
                 emit: Callable[[dict[str, Any]], None] | None = None, watchdog: Any = None,
                 feed: Any = None, world_wait_s: float = WORLD_WAIT_S) -> None:
        self.store = store
        # the remote store's writer (server/store_feed.py): ticks go to it and never wait on the server
        self.feed = feed
        self._session_opens: list[dict[str, Any]] = []  # upserts of ranks first seen, written with the next tick
        self.store_alerts = 0  # STORE_DEGRADED alert rows queued for the history (one per running session and episode)
        # the alert rules' runner (server/watchdog.py), fed the rows of every accepted frame
        self.watchdog = watchdog
        # live event lines (a verdict change, an alert) for whoever started this server: ``stepwatch
        # run`` reads them from stdout (launcher.AggregatorEvents) and prints them as they come
        self.emit = emit or (lambda message: None)
        self.session_id = session_id  # this aggregator's own session (``stepwatch run``'s), for legacy frames
        self.retention_ns = retention_ns
        self.maintenance_s = (3600.0 if retention_ns is None
                              else min(3600.0, max(1.0, retention_ns / 1e9 / 10)))
        self._last_maintenance = float("-inf")
        self.retention_removed = 0
        self.carry = PhaseCarry()  # phase times of steps still to come (store.rows.derive_steps)
        self._session_ranks: dict[str, set[int]] = {}
        self._stops: dict[str, dict[int, tuple[int, str]]] = {}  # session -> rank -> (stop ns, status)
        self._world: dict[str, int] = {}  # session -> the largest world size its ranks reported
        # session -> when it is closed anyway: every rank heard here stopped, the world is larger
        self._awaiting_world: dict[str, float] = {}
        self.world_wait_s = world_wait_s
        self._session_updates: dict[str, dict[str, Any]] = {}
        self._pending_batches: list[tuple[str, int]] = []
        self._logged_reasons: set[str] = set()
        self.max_frame = max_frame
        self.tick_s = tick_s
        self.max_pending_rows = max_pending_rows
        self.flush_rows = flush_rows
        self.pause_rows = min(pause_rows, max_pending_rows)
        self._pending: dict[str, list[tuple[Any, ...]]] = {}
        self._pending_rows = 0
        self._sessions_seen: set[str] = set()
        self._good_senders: set[tuple[Any, ...]] = set()  # (session, rank, world size, host) in bounds
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()  # flush_rows reached, or stopping: write now
        self._room = asyncio.Event()  # a tick took the pending rows: paused readers may go on
        self.frames_accepted = 0
        self.rows_accepted = 0
        self.rows_written = 0
        self.rejected: Counter[str] = Counter()
        self.connections = 0
        self.write_batches: list[tuple[int, float]] = []  # (rows, seconds) of recent ticks
        self.ranks: set[tuple[str, int]] = set()
        self.write_errors = 0
        self.rows_lost = 0
        self.disk_full_errors = 0  # of write_errors, those for want of space
        self._first_write_error: str | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._links: Counter[tuple[str, int]] = Counter()  # open TCP connections carrying each rank's frames
        self._last_sender: tuple[str, int] | None = None  # of the frame ``_queue`` took last
        self.dropped_without_stop = 0  # ranks whose last connection closed from their end, no stop sent
        self.steps_seen: Counter[str] = Counter()  # step rows queued per session (live verdicts look at new ones)
        self.rank_hosts: dict[tuple[str, int], str] = {}  # (session, rank) -> its host, as its first frame said
        # the feeds' tap (server/feeds.py): each frame's span rows, handed over as they are (one call
        # a frame, no work a row: the OTLP exporter's thread does the rest)
        self.span_tap: Callable[[str, int, Any, list[tuple[Any, ...]]], None] | None = None

    # -- intake --------------------------------------------------------------------------------

    @property
    def full(self) -> bool:
        return self._pending_rows >= self.max_pending_rows

    @property
    def pending_rows(self) -> int:
        """Rows waiting for the writer: the queue's depth."""
        return self._pending_rows

    @property
    def paused(self) -> bool:
        """Enough rows wait that intake should pause until the writer takes them."""
        return self._pending_rows >= self.pause_rows

    async def wait_for_room(self, timeout: float | None = None) -> bool:
        """Waits while ``paused`` (until a tick takes the pending rows); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.paused and not self._stopping.is_set():
            self._room.clear()
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(self._room.wait(), left)
            except TimeoutError:
                return False
        return True

    def accept(self, message: Message, source: str = "tcp") -> int:
        """Queues the rows of one message for the next write; returns how many.

        Raises TransportError ("bad_meta", "bad_rows") for a message whose rows or sender fields
        the store cannot take, before anything of it is queued.
        """
        meta = message.meta
        self._check_sender(meta, meta["session_id"], meta.get("rank", 0))
        session_id, rank = str(meta["session_id"]), int(meta.get("rank", 0))
        update = CarryUpdate()
        try:
            tables = to_rows(message.tables, session_id, rank, self.carry, update)
            rows = {}
            for table, table_rows in tables.items():
                check_rows(table, table_rows)
                rows[table] = row_tuples(table, table_rows)
        except _ROW_ERRORS as exc:
            raise TransportError("bad_rows", f"{type(exc).__name__}: {exc}") from None
        for table, table_rows in rows.items():
            bounded = _BOUNDED.get(table)
            why = rows_problem(table, table_rows, bounded) if bounded else None
            if why is not None:
                raise TransportError("bad_rows", why)
        count = self._queue(meta, session_id, rank, rows, source)
        self.carry.apply(update)
        return count

    def accept_body(self, body: bytes, source: str = "tcp") -> int:
        """``accept(decode_body(body))``, by the typed fast path when the frame fits it: the rows
        go from msgpack to store tuples without a dict per row. Same rows, same refusals."""
        typed = decode_typed(body)
        if typed is not None:
            meta, tables = typed
            count = self.accept_wire(meta, meta["session_id"], meta.get("rank", 0), tables, source)
            if count is not None:
                return count
        return self.accept(decode_body(body, self.session_id), source)

    def accept_wire(self, meta: Mapping[str, Any], session_id: str, rank: int, tables: WireTables,
                    source: str) -> int | None:
        """Queues typed wire rows (``decode_typed``); None, with nothing queued, when a value
        needs the general path (``accept``) to be stored or refused with its reason."""
        self._check_sender(meta, session_id, rank)
        update = CarryUpdate()
        try:
            rows = wire_tuples(session_id, rank, tables, self.carry, update)
        except _ROW_ERRORS:
            return None
        for table, table_rows in rows.items():
            shaped = _SHAPED.get(table)
            bounded = _BOUNDED.get(table) if shaped is None else None
            why = (shape_problem(table, table_rows, shaped) if shaped is not None
                   else rows_problem(table, table_rows, bounded) if bounded else None)
            if why is not None:
                raise TransportError("bad_rows", why)
        count = self._queue(meta, session_id, rank, rows, source)
        self.carry.apply(update)
        return count

    def _check_sender(self, meta: Mapping[str, Any], session_id: Any, rank: Any) -> None:
        """Raises TransportError("bad_meta") for a sender field out of its bounds
        (schema/limits.py); first, so a frame of a bad sender is refused as such."""
        sender = (session_id, rank, meta.get("world_size"), meta.get("host"))
        try:
            known = sender in self._good_senders  # a sender's fields are checked once
        except TypeError:  # a list or map where a host goes: not hashable, refused below
            known = False
        if not known:
            problem = sender_problem(*sender)
            if problem is not None:
                raise TransportError("bad_meta", f"meta.{problem[0]}: {problem[1]}")
            if len(self._good_senders) >= 100_000:
                self._good_senders.clear()
            self._good_senders.add(sender)

    def _queue(self, meta: Mapping[str, Any], session_id: str, rank: int, rows: dict[str, list[tuple[Any, ...]]],
               source: str) -> int:
        """Queues the rows of one frame, whose sender and rows ``accept``/``accept_wire`` have
        checked against their bounds (schema/limits.py) before anything of it is kept."""
        if (session_id, rank) not in self.ranks:  # each rank's start counts: the session keeps the earliest
            session = {
                "session_id": session_id, "status": "running", "started_at_ns": meta.get("started_ns") or time.time_ns(),
                "host": meta.get("host"), "world_size": meta.get("world_size"), "source": f"stepwatch.{source}",
                "command_line": None, "ended_at_ns": None,
            }
            try:
                check_rows("sessions", [session])
            except ValueError as exc:
                raise TransportError("bad_meta", str(exc)) from None
            self._sessions_seen.add(session_id)
            if self.feed is not None:  # a remote store: never a round trip on the event loop
                self._session_opens.append(session)
            else:
                self.store.upsert_session(session)
            self._session_ranks.setdefault(session_id, set()).add(rank)
            world = meta.get("world_size")
            if type(world) is int and world > self._world.get(session_id, 0):
                self._world[session_id] = world
            if len(self.rank_hosts) < 1_000_000:
                self.rank_hosts[(session_id, rank)] = str(meta.get("host") or "")
        self.ranks.add((session_id, rank))
        self._last_sender = (session_id, rank)
        telemetry = rows.get("telemetry")
        if telemetry:
            stops = [row for row in telemetry if row[3] == "stop"]
            if stops:
                self._note_stops(session_id, rank, stops)
                if self.watchdog is not None:
                    self.watchdog.feed_stop(session_id, rank)
        if self.watchdog is not None:
            self.watchdog.feed(session_id, rank, meta.get("host"), rows)
        steps = rows.get("steps")
        if steps:
            self.steps_seen[session_id] += len(steps)
        if self.span_tap is not None and rows.get("spans"):
            self.span_tap(session_id, rank, meta.get("host"), rows["spans"])
        count = 0
        pending = self._pending
        for table, table_rows in rows.items():
            if table in pending:
                pending[table].extend(table_rows)
            else:
                pending[table] = table_rows
            count += len(table_rows)
        self._pending_rows += count
        if self._pending_rows >= self.flush_rows:
            self._wake.set()
        self.frames_accepted += 1
        self.rows_accepted += count
        return count

    def _note_stops(self, session_id: str, rank: int, stops: list[tuple[Any, ...]]) -> None:
        """A rank's stop event(s); once every rank of the session has stopped, the session is
        closed by the next write. Every rank: those heard here, and as many as its world size
        says (``close_awaited_sessions`` looks for the others' stops in the store)."""
        ended = max((row[2] for row in stops if type(row[2]) is int), default=time.time_ns())
        self._stops.setdefault(session_id, {})[rank] = (ended, _stop_status(stops[-1][16]))
        stopped = self._stops[session_id]
        if self._session_ranks.get(session_id, set()) <= stopped.keys():
            if len(stopped) < self._world.get(session_id, 0):
                self._awaiting_world[session_id] = time.monotonic() + self.world_wait_s
            else:
                self._close_session(session_id, stopped)

    def _close_session(self, session_id: str, stopped: Mapping[int, tuple[int, str]]) -> None:
        """The session's row as its ranks' stops leave it (the worst status, the last stop), to
        be written by the next tick."""
        self._awaiting_world.pop(session_id, None)
        status = worst_status(status for _, status in stopped.values())
        self._session_updates[session_id] = {
            "session_id": session_id, "status": status, "started_at_ns": None,
            "ended_at_ns": max(ns for ns, _ in stopped.values()), "host": None, "world_size": None,
            "source": None, "command_line": None,
        }

    def _stops_in_store(self, session_ids: list[str]) -> dict[str, dict[int, tuple[int, str]]]:
        """Worker thread: the stop records the store holds for these sessions (the other nodes'
        ranks', written by their own aggregators)."""
        found: dict[str, dict[int, tuple[int, str]]] = {}
        marks = ", ".join("?" for _ in session_ids)
        for session_id, rank, ended, context in self.store.query_tuples(
                f"SELECT session_id, rank, timestamp_ns, context FROM telemetry WHERE event_type = 'stop' "
                f"AND session_id IN ({marks})", session_ids):
            if type(rank) is int and type(ended) is int:
                found.setdefault(session_id, {})[rank] = (ended, _stop_status(context))
        return found

    async def close_awaited_sessions(self, *, final: bool = False) -> None:
        """The sessions waiting for ranks heard elsewhere: closed once the store holds every
        rank's stop, at their deadline, or (``final``) as this aggregator stops, with what is
        known then. Only a remote store is read (other nodes' aggregators write to it; a run's
        history.sqlite holds only what this one heard), on a worker thread: never on the intake
        path."""
        if not self._awaiting_world:
            return
        waiting = list(self._awaiting_world)
        shared = self.feed is not None and not final
        try:  # a store that hangs holds this loop for 5 s at most (then the stop's final pass is not kept waiting)
            elsewhere = await asyncio.wait_for(asyncio.to_thread(self._stops_in_store, waiting), 5.0) if shared else {}
        except (StepwatchError, sqlite3.Error, TimeoutError) as exc:  # the store down, busy or slow: asked again
            log.debug("cannot read the stops of sessions awaiting other ranks: %s", exc)
            elsewhere = {}
        now = time.monotonic()
        for session_id in waiting:
            deadline = self._awaiting_world.get(session_id)
            if deadline is None:  # closed meanwhile by a stop heard here
                continue
            stopped = {**elsewhere.get(session_id, {}), **self._stops[session_id]}
            if final or now >= deadline or len(stopped) >= self._world.get(session_id, 0):
                self._close_session(session_id, stopped)

    async def world_loop(self, period_s: float = 1.0) -> None:
        """``close_awaited_sessions`` every ``period_s`` until stopped, then once more (final)."""
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), period_s)
            except TimeoutError:
                await self.close_awaited_sessions()
        await self.close_awaited_sessions(final=True)

    def queue_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Rows the aggregator makes itself (a live verdict): written by the next tick, like a
        rank's. Call on the event loop (``loop.call_soon_threadsafe`` from another thread)."""
        tuples = row_tuples(table, rows)
        self._pending.setdefault(table, []).extend(tuples)
        self._pending_rows += len(tuples)

    def under_load(self) -> bool:
        """Rows come faster than a tick's worth: ``flush_rows`` wait, or the last tick wrote as
        many (a burst). Live verdicts skip their round then: intake first."""
        batches = self.feed.write_batches if self.feed is not None else self.write_batches
        last = batches[-1][0] if batches else 0
        behind = self.feed is not None and self.feed.busy  # the store is behind or down: verdicts would read a past
        return self._pending_rows >= self.flush_rows or last >= self.flush_rows or behind

    def live_progress(self) -> dict[str, tuple[int, set[int]]]:
        """session -> (step rows queued so far, its ranks): what live verdicts look at."""
        seen = dict(self.steps_seen)
        return {session: (count, set(self._session_ranks.get(session, ()))) for session, count in seen.items()}

    def sessions_in_order(self) -> list[str]:
        """Every session seen, oldest first (by its first frame): the feeds keep the newest."""
        return list(self._session_ranks)

    def note_batch(self, batch_id: str, seen_at_ns: int) -> None:
        """An HTTP batch whose rows were just queued: its id is stored with them (dedupe)."""
        self._pending_batches.append((batch_id, seen_at_ns))

    def reject(self, reason: str, detail: str) -> None:
        """Counts a refused frame; the first of each reason is also said on stderr, with why."""
        self.rejected[reason] += 1
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.warning("aggregator: refused a frame (%s): %s (later ones of this reason are only counted)",
                           reason, detail)

    def accept_tables(self, meta: Mapping[str, Any], tables: Mapping[str, list[dict[str, Any]]], source: str) -> int:
        return self.accept(Message(meta=dict(meta), tables={k: list(v) for k, v in tables.items()}), source)

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        decoder = FrameDecoder(self.max_frame)
        carried: set[tuple[str, int]] = set()  # the ranks whose frames came on this connection
        rank_hung_up = False
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    if decoder.pending_bytes:
                        self.reject("truncated", f"the connection closed {decoder.pending_bytes} bytes into a frame")
                    rank_hung_up = True
                    break
                try:
                    bodies = decoder.feed(data)
                except TransportError as exc:
                    self.reject(exc.reason, str(exc))
                    break  # cannot resynchronise after a bad length prefix
                for body in bodies:
                    try:
                        self.accept_body(body)
                    except TransportError as exc:
                        self.reject(exc.reason, str(exc))
                        continue
                    sender = self._last_sender
                    if sender is not None and sender not in carried:
                        carried.add(sender)
                        self._links[sender] += 1
                if self.paused:
                    await self.wait_for_room()  # backpressure: stop reading this rank
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            self.reject("connection_reset", f"{type(exc).__name__}: {exc}")
            rank_hung_up = True
        finally:
            self._closed_link(carried, rank_hung_up and not self._stopping.is_set())
            self._writers.discard(writer)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    def _closed_link(self, carried: set[tuple[str, int]], rank_hung_up: bool) -> None:
        """A connection ended: a rank it carried, with no other connection open and no stop
        event sent, is dropped (the watchdog judges whether it is lost)."""
        for sender in carried:
            self._links[sender] -= 1
            if self._links[sender] > 0:
                continue
            del self._links[sender]
            session_id, rank = sender
            if rank_hung_up and rank not in self._stops.get(session_id, {}):
                self.dropped_without_stop += 1
                if self.watchdog is not None:
                    self.watchdog.feed_disconnect(session_id, rank)

    # -- the single writer -----------------------------------------------------------------------

    def _take(self) -> tuple[dict[str, list[tuple[Any, ...]]], list[tuple[str, int]], list[dict[str, Any]]]:
        batch, self._pending, self._pending_rows = self._pending, {}, 0
        batch_ids, self._pending_batches = self._pending_batches, []
        sessions = list(self._session_updates.values())
        self._session_updates = {}
        self._room.set()
        return batch, batch_ids, sessions

    def _write(self, batch: dict[str, list[tuple[Any, ...]]], batch_ids: list[tuple[str, int]],
               sessions: list[dict[str, Any]]) -> int:
        """One tick in the writer thread: the rows (with their batch ids), then the sessions
        closed by stop events among them."""
        written = self.store.append_tuples(batch, batch_ids) if batch or batch_ids else 0
        for row in sessions:
            self.store.upsert_session(row)
        return written

    async def flush(self) -> int:
        if self.feed is not None:
            return await self._flush_to_feed()
        batch, batch_ids, sessions = self._take()
        if not batch and not batch_ids and not sessions:
            return 0
        started = time.perf_counter()
        try:
            written = await asyncio.to_thread(self._write, batch, batch_ids, sessions)
        except StoreError as exc:  # the single writer must outlive one failed write
            self._note_write_error(exc, sum(len(rows) for rows in batch.values()))
            return 0
        if batch:
            self.write_batches.append((written, time.perf_counter() - started))
            del self.write_batches[:-1000]
        self.rows_written += written
        return written

    async def _flush_to_feed(self) -> int:
        """A tick for a remote store: the batch goes to the feed (memory, or the spill file on a
        worker thread), never to the server from here. Returns the rows handed over."""
        batch, batch_ids, closes = self._take()
        opens, self._session_opens = self._session_opens, []
        assert self.feed is not None
        rows = sum(len(r) for r in batch.values())
        if batch or batch_ids or opens or closes:
            await asyncio.to_thread(self.feed.submit, batch, batch_ids, opens, closes)
        self.store_events()
        return rows

    def store_events(self) -> None:
        """The feed's news, on the loop: a ``STORE_DEGRADED`` alert for each running session when
        an episode starts (queued for the history like any alert: it is spilled and replayed
        with the rows), a line when the store took every spilled batch again."""
        if self.feed is None:
            return
        for event in self.feed.take_events():
            if event["event"] == "degraded":
                self._store_alert(event)
            else:
                self.emit({"event": "store_recovered", **event,
                           "line": f"[stepwatch] the history store took every spilled batch again after "
                                   f"{event['seconds']:.1f} s ({event['replayed_rows']} rows replayed)"})

    def _store_alert(self, event: Mapping[str, Any]) -> None:
        from ..analysis.alerts import Alert
        from .watchdog import alert_row

        store = str(getattr(self.store, "path", "the history store"))
        why = {"slow": "slow", "failed": "failing", "queued": "behind"}.get(str(event["reason"]), str(event["reason"]))
        running = [s for s, ranks in self._session_ranks.items() if not ranks <= self._stops.get(s, {}).keys()]
        if not running and self.session_id is not None:
            running = [self.session_id]
        message = (f"the history store {store} is {why} ({event['detail']}): rows are spilled to "
                   f"{event['spill_path']} and replayed in order when it takes them again; no rank waits")
        evidence = {"store": store, "reason": event["reason"], "detail": event["detail"],
                    "spill_path": event["spill_path"]}
        for session_id in running or [None]:
            alert = Alert(ts=float(event["ts"]), kind="STORE_DEGRADED", severity="warn", ranks=(), step=None,
                          message=message, evidence=evidence, session_id=session_id)
            if session_id is not None:  # none running yet (at start): said and logged, not stored
                self._pending.setdefault("alerts", []).append(alert_row(alert, session_id))
                self._pending_rows += 1
                self.store_alerts += 1
            if self.watchdog is not None:
                try:
                    self.watchdog.log.append(alert.to_dict())
                except OSError as exc:
                    log.debug("cannot write the STORE_DEGRADED alert to alerts.jsonl: %s", exc)
            self.emit({"event": "alert", "line": alert.line(), "alert": alert.to_dict()})

    def close_feed(self) -> bool:
        """Writer thread, at the end: the feed drains what it can and spills the rest (True when
        its thread ended; False: a write still hangs on the server)."""
        return True if self.feed is None else bool(self.feed.close())

    def _note_write_error(self, exc: StoreError, rows: int) -> None:
        """Counts a failed write. A full disk fails every write after the first, so it is said
        once, with its count, when the aggregator stops (``report_losses``); another failure
        is said the first time, since it may be the only one."""
        self.write_errors += 1
        self.rows_lost += rows
        if self._first_write_error is None:
            self._first_write_error = str(exc)
        if is_disk_full(exc):
            self.disk_full_errors += 1
            log.debug("write failed for want of space (%d rows lost): %s", rows, exc)
        elif self.write_errors - self.disk_full_errors == 1:
            log.warning("aggregator: a write failed, its %d rows are lost (later failures are counted "
                        "and totalled when the aggregator stops): %s", rows, exc)

    def report_losses(self) -> str | None:
        """The one line that says what the history lost (logged, and returned), or None."""
        stats = self.stats()
        if not stats["write_errors"]:
            return None
        cause = "the disk is full" if self.disk_full_errors else "writes failed"
        line = (f"aggregator: {cause}: {stats['write_errors']} writes to the history failed, "
                f"{stats['rows_lost']} of {self.rows_accepted} rows are not in it "
                f"(the ranks' local artifacts keep what they could write); first error: "
                f"{self._first_write_error or (self.feed.last_error if self.feed is not None else None)}")
        log.warning("%s", line)
        return line

    def _maintain(self) -> None:
        """Writer thread: retention over the window, and batch ids out of the dedupe window."""
        if self.retention_ns is not None:
            self.retention_removed += self.store.apply_retention(self.retention_ns)
        self.store.forget_batches(time.time_ns() - DEDUPE_WINDOW_NS)

    async def maintain(self) -> None:
        """Runs ``_maintain`` when it is due (every ``maintenance_s``)."""
        now = time.monotonic()
        if now - self._last_maintenance < self.maintenance_s:
            return
        self._last_maintenance = now
        if self.feed is not None:  # on the feed's thread, between its writes, while the store is healthy
            self.feed.run_maintenance(self._maintain)
            return
        try:
            await asyncio.to_thread(self._maintain)
        except StoreError as exc:
            logger.warning("aggregator: retention failed (tried again later): %s", exc)

    async def write_loop(self) -> None:
        # Every waiting row is a tuple the cyclic GC tracks, and rows wait up to a tick, so the
        # default threshold (700 net allocations) ran ~1,000 young collections over a 600k-row
        # burst, each walking the rows that came since the last (0.13-0.3 s, bench_ingest.py). With
        # the threshold above what can wait (pending + the batch being written, each bounded by
        # pause_rows and a frame), collections come only when objects outlive the tick that
        # wrote them; the rows never form cycles, so nothing waits longer to be freed.
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], 4 * self.pause_rows), *thresholds[1:])
        try:
            while not self._stopping.is_set():
                if self._pending_rows < self.flush_rows:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), self.tick_s)
                    except TimeoutError:
                        pass
                await self.flush()
                await self.maintain()
            await self.flush()
        finally:
            gc.set_threshold(*thresholds)

    # -- the watchdog (docs/watchdog.md) -----------------------------------------------------------

    async def watch_loop(self, period_s: float = 1.0) -> None:
        """Runs the watchdog's checks every ``period_s`` off the intake path, until stopped."""
        if self.watchdog is None:
            return
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), period_s)
            except TimeoutError:
                pass
            if not self._stopping.is_set():
                await self.check_alerts()

    async def check_alerts(self, *, final: bool = False) -> int:
        """One watchdog check on a worker thread (stack dumps can take seconds); each new alert's
        row is queued for the history and its line emitted (``stepwatch run`` prints it)."""
        if self.watchdog is None:
            return 0
        try:
            found = await asyncio.to_thread(self.watchdog.tick, final=final)
        except Exception as exc:  # noqa: BLE001 - the watchdog must never take the aggregator down
            logger.warning("aggregator: the watchdog's check failed: %s: %s", type(exc).__name__, exc)
            return 0
        for alert, row in found:
            self._pending.setdefault("alerts", []).append(row)
            self._pending_rows += 1
            self.emit({"event": "alert", "line": alert.line(), "alert": alert.to_dict()})
        return len(found)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._room.set()

    def close_connections(self) -> None:
        """Hangs up on every rank still connected (Server.wait_closed() waits for them on 3.12+)."""
        for writer in list(self._writers):
            writer.close()

    def written_rows(self) -> int:
        """Rows the history took (with a remote store: what its server took)."""
        return self.rows_written + (self.feed.rows_written if self.feed is not None else 0)

    def lost_rows(self) -> int:
        """Rows accepted that the history will never have (failed writes; a remote store's batches
        refused for good or not spillable)."""
        return self.rows_lost + (self.feed.rows_lost if self.feed is not None else 0)

    def stats(self) -> dict[str, Any]:
        batches = (self.feed.write_batches if self.feed is not None else self.write_batches)[-100:]
        stats = {
            "connections": self.connections, "dropped_without_stop": self.dropped_without_stop,
            "frames_accepted": self.frames_accepted,
            "rows_accepted": self.rows_accepted, "rows_written": self.rows_written,
            "rejected": dict(self.rejected), "ranks": len(self.ranks), "pending_rows": self._pending_rows,
            "write_errors": self.write_errors, "rows_lost": self.rows_lost,
            "disk_full_errors": self.disk_full_errors,
            "retention_removed": self.retention_removed,
            "last_batch_rows": batches[-1][0] if batches else 0,
            "mean_batch_seconds": sum(s for _, s in batches) / len(batches) if batches else 0.0,
        }
        if self.feed is not None:  # what the server took, lost, and what waits in the spill queue
            stats.update(self.feed.stats())
            stats["rows_written"] = self.rows_written + self.feed.rows_written
            stats["rows_lost"] = self.rows_lost + self.feed.rows_lost
            stats["write_errors"] = self.write_errors + self.feed.write_errors
            stats["store_alerts"] = self.store_alerts
        return stats
