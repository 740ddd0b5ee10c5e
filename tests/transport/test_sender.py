"""FrameSender against real loopback sockets: no server, a black-hole server, a server that
appears late, and one that hangs up. Training must never wait on any of them."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from stepwatch.transport.frames import FrameDecoder, decode_body
from stepwatch.transport.sender import FrameSender, parse_address
from tests.support import free_port

META = {"session_id": "sender-test", "rank": 1, "host": "h"}


def tables(i: int) -> dict[str, list[Any]]:
    return {"marks": [{"id": f"{i}-{k}", "name": "loss", "value": float(i)} for k in range(i % 3 + 1)]}


class FrameServer:
    """Accepts connections on ``port`` in a thread and decodes every frame each one sends."""

    def __init__(self, port: int = 0, *, hang_up_after: int | None = None) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.hang_up_after = hang_up_after
        self.connections: list[list[dict[str, Any]]] = []
        self.hung_up = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            frames: list[dict[str, Any]] = []
            self.connections.append(frames)
            conn.settimeout(0.1)
            decoder = FrameDecoder()
            with conn:
                while not self._stop.is_set():
                    try:
                        data = conn.recv(65536)
                    except TimeoutError:
                        continue
                    if not data:
                        break
                    for body in decoder.feed(data):
                        message = decode_body(body)
                        frames.append({"seq": message.meta["seq"], "rows": message.rows, "meta": message.meta,
                                       **message.tables})
                    if self.hang_up_after is not None and len(frames) >= self.hang_up_after:
                        self.hang_up_after = None
                        break
            self.hung_up.set()

    @property
    def seqs(self) -> list[list[int]]:
        return [[f["seq"] for f in frames] for frames in self.connections]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def flush_until(sender: FrameSender, done: Any, timeout: float = 6.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sender.flush()
        if done():
            return
        time.sleep(0.02)
    raise AssertionError(f"not delivered in {timeout} s: {sender.stats()}")


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert parse_address("[::1]:7") == ("::1", 7)
    for bad in ("nohost", ":5", "h:", "h:x"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_no_server_ship_is_fast_and_the_queue_is_bounded() -> None:
    sender = FrameSender(("127.0.0.1", free_port()), META, max_frames=8)
    durations = []
    rows = []
    for i in range(200):
        rows.append(sum(len(v) for v in tables(i).values()))
        started = time.perf_counter()
        sender.ship(tables(i))
        durations.append(time.perf_counter() - started)
    later = sorted(durations[1:])
    assert later[len(later) // 2] < 0.005 and later[-1] < 0.1, later[-5:]
    assert sum(durations) < 1.0
    stats = sender.stats()
    assert stats["frames_sent"] == 0 and stats["connects"] == 0
    assert stats["frames_dropped"] == 192
    assert stats["rows_dropped"] == sum(rows[:192])
    assert stats["rows_unsent"] == sender.queued_rows == sum(rows[192:])
    assert "ConnectionRefused" in (stats["last_error"] or "")
    # empty tables queue nothing
    sender.ship({"marks": [], "spans": []})
    assert sender.stats()["frames_dropped"] == 192
    started = time.perf_counter()
    sender.close(0.2)
    assert time.perf_counter() - started < 0.5


def test_black_hole_server_costs_one_timeout_per_backoff_period() -> None:
    # a listener whose accept queue is full: SYNs are dropped and connect() hangs until its timeout
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    port = hole.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            fillers.append(s)
        time.sleep(0.1)
        sender = FrameSender(("127.0.0.1", port), META, timeout_s=0.2)
        started = time.perf_counter()
        sender.ship(tables(0))
        first = time.perf_counter() - started
        assert first < 0.6  # bounded by timeout_s
        slow = 0
        end = time.monotonic() + 0.6  # inside the first backoff period (1 s)
        calls = 0
        while time.monotonic() < end:
            t = time.perf_counter()
            sender.ship(tables(calls))
            if time.perf_counter() - t > 0.15:  # a connect attempt here blocks for timeout_s (0.2 s)
                slow += 1
            calls += 1
        assert calls > 20 and slow == 0
        assert sender.frames_sent == 0 and sender.queued_rows > 0
    finally:
        for s in fillers:
            s.close()
        hole.close()


def test_reconnects_once_a_server_appears_and_delivers_the_queue_in_order() -> None:
    port = free_port()
    sender = FrameSender(("127.0.0.1", port), META, max_frames=4)
    for i in range(10):
        sender.ship(tables(i))
    assert sender.frames_dropped == 6
    assert sender.rows_dropped == sum(i % 3 + 1 for i in range(6))
    server = FrameServer(port)
    try:
        flush_until(sender, lambda: sender.frames_sent == 4)
        sender.ship(tables(10))
        sender.ship(tables(11))
        sender.close(2.0)
        end = time.monotonic() + 3
        while time.monotonic() < end and sum(map(len, server.seqs)) < 6:
            time.sleep(0.02)
        assert server.seqs == [[6, 7, 8, 9, 10, 11]]
        assert [f["rows"] for f in server.connections[0]] == [i % 3 + 1 for i in range(6, 12)]
        assert sender.connects == 1
        assert sender.stats()["rows_unsent"] == 0
    finally:
        sender.close(0.1)
        server.close()


def test_a_server_that_hangs_up_loses_no_frame_silently() -> None:
    server = FrameServer(hang_up_after=2)
    sender = FrameSender(("127.0.0.1", server.port), META)
    try:
        sender.ship(tables(0))
        sender.ship(tables(1))
        assert server.hung_up.wait(3)
        time.sleep(0.1)  # the FIN has reached the sender's socket
        for i in range(2, 6):
            sender.ship(tables(i))
        flush_until(sender, lambda: sender.queued_rows == 0 and sum(map(len, server.seqs)) == 6)
        sender.close(1.0)
        assert server.seqs == [[0, 1], [2, 3, 4, 5]]
        assert sender.frames_sent == 6 and sender.frames_dropped == 0
        assert sender.connects == 2
    finally:
        sender.close(0.1)
        server.close()


def test_frames_carry_meta_seq_and_sent_time() -> None:
    server = FrameServer()
    sender = FrameSender(("127.0.0.1", server.port), META)
    before = time.time_ns()
    try:
        sender.ship(tables(1))
        sender.ship(tables(2))
        sender.close(1.0)
        end = time.monotonic() + 3
        while time.monotonic() < end and sum(map(len, server.seqs)) < 2:
            time.sleep(0.02)
        first, second = server.connections[0]
        assert (first["seq"], second["seq"]) == (0, 1)
        assert first["marks"] == tables(1)["marks"] and second["marks"] == tables(2)["marks"]
        for frame in (first, second):
            assert {k: frame["meta"][k] for k in META} == META
            assert before <= frame["meta"]["sent_ns"] <= time.time_ns()
    finally:
        sender.close(0.1)
        server.close()


def test_runtime_structs_go_columnar_and_mean_the_same_rows() -> None:
    """The runtime's Structs leave columnar (``frames.columnar_table``); the receiver reads them
    back as the row maps they stand for, the JSON field as the store keeps it."""
    from stepwatch.capture.spans import SpoolMark, SpoolSpan

    span = SpoolSpan(id="a" * 32, name="forward", parent_id="b" * 32, index=None, start_ns=5, end_ns=9, cpu_ns=None,
                     gpu_ns=None, memory_peak_bytes=None, thread_id=1, pid=2, rank=1, attrs={"k": [1, 2]},
                     mark_ids=[])
    mark = SpoolMark(id="c" * 32, span_id="b" * 32, name="loss", value_type="float", value=0.25, attrs={},
                     ts_ns=9, kind="point")
    server = FrameServer()
    sender = FrameSender(("127.0.0.1", server.port), META)
    try:
        sender.ship({"spans": [span], "marks": [mark], "heartbeat": [{"ts": 1.0, "msg": "progress"}]})
        flush_until(sender, lambda: server.connections and server.connections[0])
        frame = server.connections[0][0]
        assert frame["rows"] == 3
        assert frame["spans"] == [{"id": "a" * 32, "parent_id": "b" * 32, "name": "forward", "index": None,
                                   "start_ns": 5, "end_ns": 9, "gpu_ns": None, "thread_id": 1, "pid": 2,
                                   "attrs": {"k": [1, 2]}}]
        assert frame["marks"][0]["value"] == 0.25 and frame["marks"][0]["attrs"] == {}
        assert frame["heartbeat"] == [{"ts": 1.0, "msg": "progress"}]
        assert sender.stats()["rows_sent"] == 3
    finally:
        sender.close()
        server.close()
