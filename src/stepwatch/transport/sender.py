"""Ships new rows to the aggregator from the runtime's background thread.

Never blocks training (it runs on the sampler thread, with short socket timeouts) and never
grows without bound: frames wait in a bounded queue; when it is full the oldest frame is
dropped and its rows counted. A dead aggregator costs one connection attempt per backoff
period (1 s doubling to 30 s); the local artifacts are complete either way.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from .frames import columnar_table, encode_frame

__all__ = ["FrameSender", "parse_address"]


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"aggregator address must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


class FrameSender:
    def __init__(self, address: tuple[str, int], meta: Mapping[str, Any], *, max_frames: int = 512,
                 timeout_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
        self.address = address
        self.meta = dict(meta)
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self._queue: deque[tuple[bytes, int]] = deque()
        self._buffer = bytearray()  # each frame is encoded here, then copied into the queue
        self.max_frames = max_frames
        self._sock: socket.socket | None = None
        self._seq = itertools.count()
        self._failures = 0
        self._next_attempt = 0.0
        self.frames_sent = 0
        self.rows_sent = 0
        self.frames_dropped = 0
        self.rows_dropped = 0
        self.connects = 0
        self.last_error: str | None = None

    def ship(self, tables: Mapping[str, list[Any] | dict[str, Any]]) -> None:
        """Queues one frame of the rows new since the last call, then sends what it can. A table
        is a list of rows, or a columnar table already built (``{"columns", "rows"}``)."""
        tables = {k: v for k, v in tables.items() if v}
        if tables:
            rows = sum(len(v["rows"]) if type(v) is dict else len(v) for v in tables.values())
            # telemetry, spans and marks go columnar (frames.columnar_table): half the bytes, and
            # the aggregator decodes them into the tuples it stores with no per-row work
            tables = {k: v if type(v) is dict else columnar_table(k, v) or v for k, v in tables.items()}
            frame = encode_frame({**self.meta, "seq": next(self._seq), "sent_ns": time.time_ns()}, tables,
                                 self._buffer)
            if len(self._queue) >= self.max_frames:
                _, lost = self._queue.popleft()
                self.frames_dropped += 1
                self.rows_dropped += lost
            self._queue.append((frame, rows))
        self.flush()

    def flush(self) -> bool:
        """Sends queued frames; False when the aggregator cannot be reached right now."""
        if self._queue and self._sock is not None and self._peer_closed():
            # The aggregator never writes to us, so a readable socket means it hung up (or died):
            # a frame sent now would vanish into the dead connection yet count as sent.
            self._fail(ConnectionResetError("the aggregator closed the connection"))
            return False
        while self._queue:
            if self._sock is None and not self._connect():
                return False
            frame, rows = self._queue[0]
            try:
                self._sock.sendall(frame)  # type: ignore[union-attr]
            except OSError as exc:
                self._fail(exc)
                return False
            self._queue.popleft()
            self.frames_sent += 1
            self.rows_sent += rows
        return True

    def _peer_closed(self) -> bool:
        sock = self._sock
        assert sock is not None
        try:
            sock.setblocking(False)  # a peek that never waits (select() would fail on fds >= 1024)
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False  # nothing to read: the connection is up
        except OSError:
            return True
        finally:
            try:
                sock.settimeout(self.timeout_s)
            except OSError:
                pass

    def _connect(self) -> bool:
        now = time.monotonic()
        if now < self._next_attempt:
            return False
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
            sock.settimeout(self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            self._fail(exc)
            return False
        self._sock = sock
        self._failures = 0
        self.connects += 1
        return True

    def _fail(self, exc: OSError) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._disconnect()
        self._failures += 1
        self._next_attempt = time.monotonic() + min(self.max_backoff_s, 2 ** (self._failures - 1))

    @property
    def queued_rows(self) -> int:
        return sum(rows for _, rows in self._queue)

    def stats(self) -> dict[str, Any]:
        return {"frames_sent": self.frames_sent, "rows_sent": self.rows_sent, "frames_dropped": self.frames_dropped,
                "rows_dropped": self.rows_dropped, "rows_unsent": self.queued_rows, "connects": self.connects,
                "last_error": self.last_error}

    def close(self, deadline_s: float = 1.0) -> None:
        end = time.monotonic() + deadline_s
        self._next_attempt = 0.0
        while self._queue and time.monotonic() < end:
            if not self.flush():
                time.sleep(0.05)
        self._disconnect()

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
