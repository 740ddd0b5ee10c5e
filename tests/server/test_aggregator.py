"""The aggregator as its own process (``python -m stepwatch.server``) on real loopback sockets:
four simulated ranks ship rows with FrameSender, hostile clients are refused and counted, and the
history lands in a real SQLite file."""

from __future__ import annotations

import json
import socket
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from stepwatch.transport.frames import encode_frame
from stepwatch.transport.sender import FrameSender
from tests.support.aggregator import Aggregator, query, raw_client, wait_for
from tests.support.records import make_event

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

SID = "5e551017-0000-4000-8000-00000000000a"
RANKS = 4
FRAMES_PER_RANK = 5
STEPS_PER_FRAME = 3
BASE_NS = 1_800_000_000_000_000_000




@pytest.fixture
def aggregator(tmp_path: Path):
    agg = Aggregator(tmp_path / "agg")
    yield agg
    agg.kill()




def hexid() -> str:
    return uuid.uuid4().hex


def rank_tables(rank: int, frame: int) -> dict[str, list[Any]]:
    """One frame's worth of new rows of ``rank``: telemetry, spans (steps and phases), marks, heartbeat."""
    telemetry = [msgspec.to_builtins(make_event(SID, frame * 10 + i, rank=rank, local_rank=rank % 2, world_size=RANKS,
                                                allocator_allocated_bytes=(rank + 1) * 1000 + frame * 10 + i))
                 for i in range(4)]
    spans, marks = [], []
    for k in range(STEPS_PER_FRAME):
        n = frame * STEPS_PER_FRAME + k
        start = BASE_NS + n * 10_000_000
        step_id = hexid()
        step_ns = 5_000_000 + rank * 100_000 + n
        spans.append({"id": hexid(), "name": "forward", "parent_id": step_id, "index": None, "start_ns": start + 10,
                      "end_ns": start + 1_000_010, "rank": rank, "pid": 100 + rank, "attrs": {"mode": "train"}})
        spans.append({"id": step_id, "name": "step", "parent_id": None, "index": n, "start_ns": start,
                      "end_ns": start + step_ns, "rank": rank, "pid": 100 + rank, "thread_id": 1, "gpu_ns": None,
                      "attrs": {"step_ns": step_ns, "data_load_ns": 1000, "h2d_ns": 0, "forward_ns": 1_000_000,
                                "backward_ns": 2_000_000, "optimizer_step_ns": 500_000, "wait_ns": 10}})
        marks.append({"id": hexid(), "span_id": step_id, "name": "loss", "value_type": "float",
                      "value": 1.0 / (n + 1), "attrs": {"step": n}, "ts_ns": start + 5, "kind": "point"})
    heartbeat = [{"ts": 1_800_000_000.0 + frame, "iso": "x", "pid": 100 + rank, "rank": rank, "step": frame,
                  "msg": "progress", "loss": 0.5}]
    return {"telemetry": telemetry, "spans": spans, "marks": marks, "heartbeat": heartbeat}


def rank_meta(rank: int) -> dict[str, Any]:
    return {"session_id": SID, "rank": rank, "local_rank": rank % 2, "world_size": RANKS, "host": f"node{rank // 2}",
            "pid": 100 + rank, "started_ns": BASE_NS + rank * 1_000_000}






def test_four_ranks_and_hostile_clients(aggregator: Aggregator) -> None:
    address = aggregator.tcp
    store = aggregator.out / "history.sqlite"
    good = encode_frame({"session_id": "intruder-ok", "rank": 0}, {"marks": [{"id": "ok", "name": "fine", "value": 1}]})

    # hostile clients first: none of them may stop the ranks that come after
    assert raw_client(address, b"\xff\xff\xff\xff" + b"\x00" * 64), "oversize prefix: the server must hang up"
    raw_client(address, b"\x00\x00\x00\x05hello" + good, wait_close=False)  # garbage body, then a good frame
    raw_client(address, good[:-3], wait_close=False)  # truncated frame, then close
    raw_client(address, encode_frame({"rank": 1}, {"marks": []}), wait_close=False)  # no session_id
    raw_client(address, encode_frame({"session_id": SID, "rank": -2}, {"marks": []}), wait_close=False)
    # well-formed frames whose rows cannot be stored
    raw_client(address, encode_frame({"session_id": SID, "rank": 0}, {"telemetry": [{"nothing": 1}]}),
               wait_close=False)
    raw_client(address, encode_frame({"session_id": SID, "rank": 0}, {
        "spans": [{"id": "huge", "name": "step", "start_ns": 2**64 - 1, "end_ns": 2**64 - 1, "attrs": {"step_ns": 1}}],
    }), wait_close=False)
    raw_client(address, encode_frame({"session_id": SID, "rank": 0}, {
        "spans": [{"id": "dict-name", "name": {"a": 1}, "start_ns": 1, "end_ns": 2}],
    }), wait_close=False)

    # four ranks, connecting in reverse order, each shipping several frames
    senders = [FrameSender(address, rank_meta(rank)) for rank in reversed(range(RANKS))]
    for frame in range(FRAMES_PER_RANK):
        for sender in senders:
            sender.ship(rank_tables(sender.meta["rank"], frame))
    for sender in senders:
        sender.close(5.0)
        assert sender.frames_sent == FRAMES_PER_RANK and sender.frames_dropped == 0, sender.stats()

    # readers see committed rows while the aggregator is still running (WAL)
    expected_spans = RANKS * FRAMES_PER_RANK * STEPS_PER_FRAME * 2
    assert wait_for(lambda: store.exists() and query(store, "SELECT COUNT(*) FROM spans")[0][0] == expected_spans), \
        aggregator.stderr()
    stats = aggregator.stop()
    assert "Traceback" not in aggregator.stderr(), aggregator.stderr()

    assert stats["rejected"] == {"oversize": 1, "not_msgpack": 1, "truncated": 1, "bad_meta": 2, "bad_rows": 3}
    assert stats["frames_accepted"] == RANKS * FRAMES_PER_RANK + 1
    # every sender hung up without a stop event: the watchdog calls each rank lost as the
    # aggregator stops, and those alerts are the rows it wrote beyond the ranks' own
    assert stats["dropped_without_stop"] == RANKS + 1
    lost = query(store, "SELECT session_id, kind, ranks FROM alerts ORDER BY session_id, ranks")
    assert sorted(lost) == sorted([(SID, "RANK_LOST", f"[{r}]") for r in range(RANKS)]
                                  + [("intruder-ok", "RANK_LOST", "[0]")])
    assert stats["rows_written"] == stats["rows_accepted"] + len(lost)

    per_rank = {
        "telemetry": 4 * FRAMES_PER_RANK,
        "spans": 2 * STEPS_PER_FRAME * FRAMES_PER_RANK,
        "steps": STEPS_PER_FRAME * FRAMES_PER_RANK,
        "marks": STEPS_PER_FRAME * FRAMES_PER_RANK,
        "heartbeats": FRAMES_PER_RANK,
    }
    for table, n in per_rank.items():
        counts = dict(query(store, f"SELECT rank, COUNT(*) FROM {table} WHERE session_id = ? GROUP BY rank", (SID,)))
        assert counts == dict.fromkeys(range(RANKS), n), table
    assert query(store, "SELECT COUNT(*) FROM marks WHERE session_id = 'intruder-ok'") == [(1,)]
    assert query(store, "SELECT COUNT(*) FROM spans WHERE span_id IN ('huge', 'dict-name')") == [(0,)]

    sessions = query(store, "SELECT session_id, status, started_at_ns, world_size, source FROM sessions "
                            "WHERE session_id = ?", (SID,))
    # the earliest rank start, although rank 0 connected last
    assert sessions == [(SID, "running", BASE_NS, RANKS, "stepwatch.tcp")]

    steps = query(store, "SELECT rank, step, start_ns, end_ns, step_ns, data_load_ns, forward_ns, backward_ns, "
                         "optimizer_ns, wait_ns FROM steps WHERE session_id = ? ORDER BY rank, step", (SID,))
    assert len(steps) == RANKS * FRAMES_PER_RANK * STEPS_PER_FRAME
    for rank, n, start, end, step_ns, data_load, forward, backward, optimizer, wait in steps:
        assert start == BASE_NS + n * 10_000_000
        assert step_ns == 5_000_000 + rank * 100_000 + n == end - start
        assert (data_load, forward, backward, optimizer, wait) == (1000, 1_000_000, 2_000_000, 500_000, 10)
    assert [n for r, n, *_ in steps if r == 2] == list(range(FRAMES_PER_RANK * STEPS_PER_FRAME))

    peaks = query(store, "SELECT rank, MAX(allocated) FROM telemetry WHERE session_id = ? GROUP BY rank", (SID,))
    assert dict(peaks) == {r: (r + 1) * 1000 + (FRAMES_PER_RANK - 1) * 10 + 3 for r in range(RANKS)}
    losses = query(store, "SELECT value_num FROM marks WHERE session_id = ? AND rank = 1 ORDER BY ts_ns", (SID,))
    assert [v for (v,) in losses] == pytest.approx([1.0 / (n + 1) for n in range(FRAMES_PER_RANK * STEPS_PER_FRAME)])
    hb = query(store, "SELECT rank, step, msg, fields FROM heartbeats WHERE session_id = ? AND rank = 3 ORDER BY ts_ns",
               (SID,))
    assert [(r, s, m, json.loads(f)) for r, s, m, f in hb] == [(3, i, "progress", {"loss": 0.5})
                                                                for i in range(FRAMES_PER_RANK)]


def test_binds_to_loopback_by_default(tmp_path: Path) -> None:
    agg = Aggregator(tmp_path / "agg", "--http-port", "0")
    try:
        assert agg.ready["tcp"].startswith("127.0.0.1:") and agg.ready["http"].startswith("127.0.0.1:")
        assert agg.ready["pid"] == agg.proc.pid
        listening = [c for c in psutil.Process(agg.proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert {c.laddr.port for c in listening} == {agg.tcp[1], agg.http[1]}
        assert {c.laddr.ip for c in listening} == {"127.0.0.1"}
        others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")]
        for ip in others:  # the same port on any other address of this machine: nobody there
            with pytest.raises(OSError):
                socket.create_connection((ip, agg.tcp[1]), timeout=2).close()
        assert agg.stop()["frames_accepted"] == 0
    finally:
        agg.kill()


def test_sigterm_stops_promptly_with_clients_still_connected(aggregator: Aggregator) -> None:
    sender = FrameSender(aggregator.tcp, rank_meta(0))
    idle = socket.create_connection(aggregator.tcp, timeout=5)  # a client that never sends nor closes
    try:
        sender.ship(rank_tables(0, 0))
        assert sender.frames_sent == 1
        store = aggregator.out / "history.sqlite"
        assert wait_for(lambda: store.exists() and query(store, "SELECT COUNT(*) FROM marks")[0][0] == STEPS_PER_FRAME)
        started = time.monotonic()
        stats = aggregator.stop(timeout=15)
        assert time.monotonic() - started < 10
        assert stats["rows_written"] == stats["rows_accepted"] > 0
        assert stats["connections"] == 2
    finally:
        idle.close()
        sender.close(0.1)


def test_sigterm_stops_promptly_when_nobody_reads_its_event_lines(aggregator: Aggregator) -> None:
    """A reader that takes the ready line and then reads no more (a benchmark, a stuck launcher):
    the alert lines fill the pipe, and the aggregator must still write every row it received and
    stop on SIGTERM. Before, its event loop blocked in write(): no flush, no SIGTERM handled."""
    import fcntl

    assert aggregator.proc.stdout is not None
    fcntl.fcntl(aggregator.proc.stdout.fileno(), 1031, 4096)  # F_SETPIPE_SZ: a 4 KiB pipe, the least
    ranks = 8  # each hangs up without a stop record: 8 RANK_LOST alerts, about 1.5 KiB of line each
    for rank in range(ranks):
        sender = FrameSender(aggregator.tcp, {**rank_meta(rank), "world_size": ranks})
        sender.ship(rank_tables(rank, 0))
        assert sender.frames_sent == 1
        sender.close(0.1)
    store = aggregator.out / "history.sqlite"
    assert wait_for(lambda: store.exists() and query(store, "SELECT COUNT(*) FROM marks")[0][0] == ranks * STEPS_PER_FRAME)
    started = time.monotonic()
    stats = aggregator.stop(timeout=15)  # its last check calls the 8 ranks lost: 8 lines at once
    assert time.monotonic() - started < 10
    assert query(store, "SELECT COUNT(*) FROM marks")[0][0] == ranks * STEPS_PER_FRAME
    assert query(store, "SELECT COUNT(*) FROM alerts WHERE kind = 'RANK_LOST'")[0][0] == ranks
    assert stats["rows_written"] == stats["rows_accepted"] + ranks
    assert stats["event_lines_dropped"] == 0  # queued, not dropped: only a pipe nobody reads kept them


def test_writer_outlives_a_failed_write(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A write SQLite refuses (here a trigger) loses that tick's rows, counted; later ticks land."""
    import asyncio

    from stepwatch.server.aggregator import Aggregator as Core
    from stepwatch.store.sqlite import SqliteStore
    from stepwatch.transport.frames import Message

    path = tmp_path / "history.sqlite"
    store = SqliteStore(path)
    db = sqlite3.connect(path)
    db.execute("CREATE TRIGGER refuse BEFORE INSERT ON marks_rows WHEN NEW.name = 'boom' "
               "BEGIN SELECT RAISE(ABORT, 'refused by trigger'); END")
    db.commit()
    db.close()

    def message(name: str) -> Message:
        return Message(meta={"session_id": SID, "rank": 0},
                       tables={"marks": [{"id": hexid(), "name": name, "value": 1.0}]})

    async def main() -> Core:
        core = Core(store, tick_s=0.02)
        writer = asyncio.create_task(core.write_loop())
        core.accept(message("boom"))
        await asyncio.sleep(0.2)
        core.accept(message("fine"))
        await asyncio.sleep(0.2)
        core.stop()
        await writer  # the loop ended normally, not with the StoreError
        return core

    try:
        core = asyncio.run(main())
    finally:
        store.close()
    assert core.write_errors == 1 and core.rows_lost == 1
    assert core.stats()["rows_written"] == 1
    assert query(path, "SELECT name FROM marks") == [("fine",)]
    said = [r.getMessage() for r in caplog.records if r.name == "stepwatch.aggregator"]
    assert len(said) == 1 and "refused by trigger" in said[0]  # the `stepwatch` logger, once
    assert "1 writes to the history failed, 1 of 2 rows are not in it" in (core.report_losses() or "")


def test_backpressure_bounds_pending_rows_and_a_full_batch_writes_before_the_tick(tmp_path: Path) -> None:
    """With no writer running, a rank's connection stops being read once ``pause_rows`` wait;
    once the writer runs, ``flush_rows`` waiting rows are written without waiting for the tick."""
    import asyncio

    from stepwatch.server.aggregator import Aggregator as Core
    from stepwatch.store.sqlite import SqliteStore

    path = tmp_path / "history.sqlite"
    store = SqliteStore(path)
    frames = [encode_frame({"session_id": SID, "rank": 0}, {"marks": [
        {"id": hexid(), "name": "loss", "value": float(i), "ts_ns": i, "attrs": {"pad": "x" * 1000}}
        for i in range(10)]}) for _ in range(50)]  # ~10 KiB a frame: one 64 KiB read holds a few frames, not all

    async def main() -> tuple[int, int, float]:
        core = Core(store, tick_s=30.0, flush_rows=40, pause_rows=100)
        server = await asyncio.start_server(core.handle_connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for frame in frames:  # 500 rows; each frame a write of its own so the reader sees them one by one
            writer.write(frame)
            await writer.drain()
        await asyncio.sleep(0.5)
        paused_at = core.stats()["pending_rows"]
        started = time.monotonic()
        loop_task = asyncio.create_task(core.write_loop())
        while core.rows_written < 500 and time.monotonic() - started < 10:
            await asyncio.sleep(0.01)
        elapsed = time.monotonic() - started
        core.stop()
        await loop_task
        writer.close()
        core.close_connections()
        server.close()
        await server.wait_closed()
        return paused_at, core.rows_written, elapsed

    try:
        paused_at, written, elapsed = asyncio.run(main())
    finally:
        store.close()
    assert 100 <= paused_at <= 200  # stopped reading past the bound (one read chunk may overshoot it)
    assert written == 500
    assert elapsed < 5  # written in flush_rows batches, not one per 30 s tick
    assert query(path, "SELECT COUNT(*) FROM marks") == [(500,)]


def test_a_full_store_is_said_once_with_its_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every write to a full database fails alike (SQLITE_FULL, here from max_page_count): no line
    per failure, one line at the end with the count."""
    import asyncio
    import logging

    from stepwatch.server.aggregator import Aggregator as Core
    from stepwatch.store.sqlite import SqliteStore
    from stepwatch.transport.frames import Message

    path = tmp_path / "history.sqlite"
    store = SqliteStore(path)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count={pages}")

    async def main() -> Core:
        core = Core(store, tick_s=0.01)
        writer = asyncio.create_task(core.write_loop())
        for i in range(30):
            core.accept(Message(meta={"session_id": SID, "rank": 0},
                                tables={"marks": [{"id": hexid(), "name": f"m{i}", "value": "x" * 20_000}]}))
            await asyncio.sleep(0.03)
        core.stop()
        await writer
        return core

    caplog.set_level(logging.INFO, logger="stepwatch")
    try:
        core = asyncio.run(main())
    finally:
        store.close()
    assert core.write_errors >= 25 and core.disk_full_errors == core.write_errors
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # nothing said per failure
    line = core.report_losses()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [line] and line is not None
    assert f"the disk is full: {core.write_errors} writes to the history failed" in line
    assert f"{core.rows_lost} of {core.rows_accepted} rows" in line
