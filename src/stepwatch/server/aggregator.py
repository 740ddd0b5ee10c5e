"""The aggregator core: accepts messages, batches their rows, writes one transaction per tick.

Asyncio receives; the store write of each tick runs in one worker thread, so the event loop
keeps reading other ranks while SQLite commits. Rejected frames are counted by reason and the
connection that sent them is dropped only when the stream cannot continue (oversize).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ..errors import StoreError, TransportError
from ..store.base import HistoryStore
from ..store.rows import check_rows, to_rows
from ..transport.frames import DEFAULT_MAX_FRAME, FrameDecoder, Message, decode_body

__all__ = ["Aggregator"]


class Aggregator:
    """Example::

        aggregator = Aggregator(SqliteStore(path))
        server = await asyncio.start_server(aggregator.handle_connection, "127.0.0.1", 0)
        writer = asyncio.create_task(aggregator.write_loop())
    """

    def __init__(self, store: HistoryStore, *, max_frame: int = DEFAULT_MAX_FRAME, tick_s: float = 0.2,
                 max_pending_rows: int = 2_000_000) -> None:
        self.store = store
        self.max_frame = max_frame
        self.tick_s = tick_s
        self.max_pending_rows = max_pending_rows
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._pending_rows = 0
        self._sessions_seen: set[str] = set()
        self._stopping = asyncio.Event()
        self.frames_accepted = 0
        self.rows_accepted = 0
        self.rows_written = 0
        self.rejected: Counter[str] = Counter()
        self.connections = 0
        self.write_batches: list[tuple[int, float]] = []  # (rows, seconds) of recent ticks
        self.ranks: set[tuple[str, int]] = set()
        self.write_errors = 0
        self.rows_lost = 0
        self._writers: set[asyncio.StreamWriter] = set()

    # -- intake --------------------------------------------------------------------------------

    @property
    def full(self) -> bool:
        return self._pending_rows >= self.max_pending_rows

    def accept(self, message: Message, source: str = "tcp") -> int:
        """Queues the rows of one message for the next write; returns how many.

        Raises TransportError ("bad_meta", "bad_rows") for a message whose rows or sender fields
        the store cannot take, before anything of it is queued.
        """
        meta = message.meta
        session_id, rank = str(meta["session_id"]), int(meta.get("rank", 0))
        try:
            tables = to_rows(message.tables, session_id, rank)
            for table, rows in tables.items():
                check_rows(table, rows)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise TransportError("bad_rows", f"{type(exc).__name__}: {exc}") from None
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
            self.store.upsert_session(session)
        self.ranks.add((session_id, rank))
        count = 0
        for table, rows in tables.items():
            self._pending.setdefault(table, []).extend(rows)
            count += len(rows)
        self._pending_rows += count
        self.frames_accepted += 1
        self.rows_accepted += count
        return count

    def accept_tables(self, meta: Mapping[str, Any], tables: Mapping[str, list[dict[str, Any]]], source: str) -> int:
        return self.accept(Message(meta=dict(meta), tables={k: list(v) for k, v in tables.items()}), source)

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        decoder = FrameDecoder(self.max_frame)
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    if decoder.pending_bytes:
                        self.rejected["truncated"] += 1
                    break
                try:
                    bodies = decoder.feed(data)
                except TransportError as exc:
                    self.rejected[exc.reason] += 1
                    break  # cannot resynchronise after a bad length prefix
                for body in bodies:
                    try:
                        self.accept(decode_body(body))
                    except TransportError as exc:
                        self.rejected[exc.reason] += 1
                        continue
                    while self.full and not self._stopping.is_set():
                        await asyncio.sleep(self.tick_s)  # backpressure: stop reading this rank
        except (ConnectionError, asyncio.IncompleteReadError):
            self.rejected["connection_reset"] += 1
        finally:
            self._writers.discard(writer)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    # -- the single writer -----------------------------------------------------------------------

    def _take(self) -> dict[str, list[dict[str, Any]]]:
        batch, self._pending, self._pending_rows = self._pending, {}, 0
        return batch

    async def flush(self) -> int:
        batch = self._take()
        if not batch:
            return 0
        started = time.perf_counter()
        try:
            written = await asyncio.to_thread(self.store.append_many, batch)
        except StoreError as exc:  # the single writer must outlive one failed write
            self.write_errors += 1
            self.rows_lost += sum(len(rows) for rows in batch.values())
            print(f"[stepwatch] aggregator: a write failed, its rows are lost: {exc}", file=sys.stderr, flush=True)
            return 0
        self.write_batches.append((written, time.perf_counter() - started))
        del self.write_batches[:-1000]
        self.rows_written += written
        return written

    async def write_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), self.tick_s)
            except asyncio.TimeoutError:
                pass
            await self.flush()
        await self.flush()

    def stop(self) -> None:
        self._stopping.set()

    def close_connections(self) -> None:
        """Hangs up on every rank still connected (Server.wait_closed() waits for them on 3.12+)."""
        for writer in list(self._writers):
            writer.close()

    def stats(self) -> dict[str, Any]:
        batches = self.write_batches[-100:]
        return {
            "connections": self.connections, "frames_accepted": self.frames_accepted,
            "rows_accepted": self.rows_accepted, "rows_written": self.rows_written,
            "rejected": dict(self.rejected), "ranks": len(self.ranks),
            "write_errors": self.write_errors, "rows_lost": self.rows_lost,
            "last_batch_rows": batches[-1][0] if batches else 0,
            "mean_batch_seconds": sum(s for _, s in batches) / len(batches) if batches else 0.0,
        }
