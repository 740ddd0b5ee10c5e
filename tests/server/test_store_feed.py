"""When ClickHouse is slow or down (issue 23 §3): real ``stepwatch serve --store clickhouse://``
processes with two simulated ranks (FrameSender, as a rank's runtime ships) write into a real
clickhouse-server of this module's own, which the test hangs (SIGSTOP), kills (SIGKILL) and
starts again mid-run, stopping one aggregator while a write hangs and starting the next while
the server is down. The ranks never wait, the aggregators spill to the local queue and replay
it, and every row is in ClickHouse exactly once. One run, shared by the tests here (``_scenario``);
the last test drives a feed in process on the shared server."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stepwatch.analysis.summary import build_summary, render_summary_text
from stepwatch.store import open_store
from stepwatch.store.base import COLUMNS
from stepwatch.transport.sender import FrameSender
from tests.support.aggregator import Aggregator, wait_for
from tests.support.clickhouse import PrivateClickHouse
from tests.support.records import make_event

pytestmark = pytest.mark.real

SID = str(uuid.uuid4())
RANKS = 2
BASE_NS = 1_800_000_000_000_000_000
BURST_ROWS = 60_000  # while the server hangs: more than the aggregator's pause_rows (50,000)


def frame(rank: int, n: int) -> dict[str, list[Any]]:
    """Frame ``n`` of ``rank``: one telemetry sample, two steps (spans), two loss marks, a heartbeat."""
    spans, marks = [], []
    for k in range(2):
        step = 2 * n + k
        start = BASE_NS + step * 10_000_000
        step_id = uuid.uuid4().hex
        spans.append({"id": step_id, "name": "step", "parent_id": None, "index": step, "start_ns": start,
                      "end_ns": start + 5_000_000, "rank": rank, "pid": 100 + rank, "thread_id": 1, "gpu_ns": None,
                      "attrs": {"step_ns": 5_000_000, "forward_ns": 1_000_000, "backward_ns": 2_000_000}})
        marks.append({"id": uuid.uuid4().hex, "span_id": step_id, "name": "loss", "value_type": "float",
                      "value": 1.0 / (step + 1), "attrs": {"step": step}, "ts_ns": start + 5, "kind": "point"})
    telemetry = [msgspec.to_builtins(make_event(SID, n, rank=rank, world_size=RANKS, timestamp_ns=BASE_NS + n * 1000))]
    heartbeat = [{"ts": 1_800_000_000.0 + n, "iso": "x", "pid": 100 + rank, "rank": rank, "step": 2 * n,
                  "msg": "progress", "loss": 0.5}]
    return {"telemetry": telemetry, "spans": spans, "marks": marks, "heartbeat": heartbeat}


def burst(rank: int, part: int, rows: int) -> dict[str, list[Any]]:
    return {"marks": [{"id": f"burst-{rank}-{part}-{i}", "name": "tokens", "value_type": "int", "value": i,
                       "ts_ns": BASE_NS + part * rows + i, "kind": "point"} for i in range(rows)]}


def stop(rank: int) -> dict[str, list[Any]]:
    return {"telemetry": [msgspec.to_builtins(make_event(SID, 999, rank=rank, world_size=RANKS,
                                                         timestamp_ns=BASE_NS + 10**12, event_type="stop",
                                                         context="stepwatch capture stopped (completed)"))]}


def health(agg: Aggregator) -> dict[str, Any]:
    host, port = agg.http
    with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5) as answer:
        return dict(json.loads(answer.read()))


class Run:
    """The ranks' side: ships frames and keeps what it sent and how long each ship took."""

    def __init__(self, agg: Aggregator, first: int = 0) -> None:
        self.agg = agg
        self.senders = [FrameSender(agg.tcp, {"session_id": SID, "rank": r, "world_size": RANKS,
                                              "host": "node-a", "pid": 100 + r, "started_ns": BASE_NS})
                        for r in range(RANKS)]
        self.frames = self.marks_burst = 0
        self.ship_s: list[float] = []
        self.n = first  # the next frame of steps (a second aggregator's ranks go on from the first's)

    def ship(self, tables_of: Any) -> None:
        for sender in self.senders:
            started = time.perf_counter()
            sender.ship(tables_of(sender.meta["rank"]))
            self.ship_s.append(time.perf_counter() - started)
            self.frames += 1

    def step_frame(self) -> None:
        n = self.n
        self.ship(lambda rank: frame(rank, n))
        self.n += 1

    def accepted(self, timeout: float = 10.0) -> float:
        """Seconds until the aggregator has accepted every frame shipped (AssertionError past ``timeout``)."""
        started = time.perf_counter()
        assert wait_for(lambda: health(self.agg)["frames_accepted"] == self.frames, timeout), health(self.agg)
        return time.perf_counter() - started


def _scenario(base: Path) -> dict[str, Any]:
    """Aggregator A writes while the server is healthy, then hangs (SIGSTOP) under a burst; A is
    stopped while a write hangs (what waits stays in the spill file); the server is killed;
    aggregator B starts on the same directory while it is down, takes its ranks' frames and
    spills them; the server starts again and B replays A's batches and its own, in order."""
    server = PrivateClickHouse(base / "clickhouse")
    url = server.url("spill")
    out = base / "hub"
    env = {"STEPWATCH_VERDICT_INTERVAL_S": "0", "STEPWATCH_STORE_SLOW_S": "1", "STEPWATCH_STORE_RETRY_MAX_S": "1"}
    seen: dict[str, Any] = {"url": url, "out": out}
    agg = Aggregator(out, "--store", url, "--http-port", "0", env=env)
    try:
        run = Run(agg)
        store = open_store(url, read_only=True)
        try:
            for _ in range(2):  # healthy: written as it comes
                run.step_frame()
            run.accepted()
            assert wait_for(lambda: store.count("steps", SID) == 2 * 2 * RANKS, 20), health(agg)
        finally:
            store.close()
        seen["healthy"] = health(agg)

        server.pause()  # hung: connections open, nothing answered
        for part in range(6):  # a burst past pause_rows: intake must not pause for the hung server
            run.ship(lambda rank, part=part: burst(rank, part, BURST_ROWS // 6 // RANKS))
            run.marks_burst += BURST_ROWS // 6
        seen["burst_accepted_s"] = run.accepted()
        deadline = time.monotonic() + 15
        while not health(agg)["store_degraded"]:  # a batch after the write under way waited past 1 s: spilled
            assert time.monotonic() < deadline, health(agg)
            run.step_frame()
            wait_for(lambda: health(agg)["store_degraded"], 0.3)
        run.accepted()
        seen["hung"], seen["hung_frames"] = health(agg), run.frames
        for sender in run.senders:
            sender.close(1.0)
        started = time.perf_counter()
        seen["stats_a"] = agg.stop()  # a write still hangs: what waits is spilled, and A exits
        seen["stop_hung_s"] = time.perf_counter() - started
        seen["stderr_a"] = agg.stderr()

        server.kill()  # down: B starts anyway and spills from its first batch
        agg = Aggregator(out, "--store", url, "--http-port", "0", env=env)
        seen["ready_b"] = agg.ready
        run_a, run = run, Run(agg, first=run.n)
        run.step_frame()
        run.step_frame()
        seen["down_accepted_s"] = run.accepted()
        assert wait_for(lambda: health(agg)["store_write_failures"] >= 1, 10), health(agg)
        seen["down"] = health(agg)

        server.start()
        run.step_frame()
        assert wait_for(lambda: not health(agg)["store_degraded"], 60), health(agg)
        seen["recovered"] = health(agg)
        run.ship(stop)
        run.accepted()
        for sender in run.senders:
            sender.close(5.0)
            assert sender.frames_dropped == 0 and sender.queued_rows == 0, sender.stats()
        seen["stats"] = agg.stop()
        seen["stderr"] = agg.stderr()
        seen["steps_frames"], seen["burst_marks"] = run.n, run_a.marks_burst
        seen["max_ship_s"] = max(run_a.ship_s + run.ship_s)
        store = open_store(url, read_only=True)
        try:
            seen["counts"] = {t: store.count(t, SID) for t in ("telemetry", "spans", "steps", "marks", "heartbeats")}
            seen["raw_steps"] = store.query_tuples("SELECT count() FROM steps_rows")[0][0]
            seen["duplicate_keys"] = {
                "steps": store.query_tuples("SELECT count() FROM (SELECT rank, step FROM steps WHERE session_id = ? "
                                            "GROUP BY rank, step HAVING count() > 1)", (SID,))[0][0],
                "marks": store.query_tuples("SELECT count() FROM (SELECT rank, mark_id FROM marks WHERE session_id = ? "
                                            "GROUP BY rank, mark_id HAVING count() > 1)", (SID,))[0][0]}
            seen["alerts"] = store.query("SELECT kind, severity, message, evidence FROM alerts WHERE session_id = ? "
                                         "ORDER BY ts_ns", (SID,))
            seen["sessions"] = store.query("SELECT session_id, status FROM sessions")
            summary = build_summary(store, SID, out)
            seen["summary"] = summary
            seen["summary_text"] = render_summary_text(summary)
        finally:
            store.close()
        return seen
    finally:
        agg.kill()
        server.stop()


@pytest.fixture(scope="module")
def spilled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _scenario(tmp_path_factory.mktemp("store-feed"))


def test_every_row_is_in_clickhouse_exactly_once_after_a_hang_a_kill_and_restarts(spilled: dict[str, Any]) -> None:
    steps_frames = spilled["steps_frames"]
    per_rank = {"telemetry": steps_frames + 1, "spans": 2 * steps_frames, "steps": 2 * steps_frames,
                "heartbeats": steps_frames}
    expected = {t: n * RANKS for t, n in per_rank.items()}
    expected["marks"] = 2 * steps_frames * RANKS + spilled["burst_marks"]
    assert spilled["counts"] == expected, spilled["stderr"]
    assert spilled["duplicate_keys"] == {"steps": 0, "marks": 0}
    assert spilled["sessions"] == [{"session_id": SID, "status": "completed"}]
    a, b = spilled["stats_a"], spilled["stats"]
    assert a["rows_lost"] == b["rows_lost"] == 0 and a["write_errors"] == b["write_errors"] == 0, (a, b)
    # A stopped with its batches in the spill file; B replayed them before its own, then its own
    assert a["store_spill_pending_rows"] > 0 and a["rows_written"] + a["store_spill_pending_rows"] >= a["rows_accepted"]
    assert b["store_replayed_rows"] == a["store_spill_pending_rows"] + b["store_spilled_rows"], (a, b)
    assert b["rows_written"] == a["store_spill_pending_rows"] + b["rows_accepted"] + b["store_alerts"], (a, b)
    assert b["store_spill_pending_rows"] == 0 and b["store_spill_pending_batches"] == 0, b
    assert (spilled["out"] / "store_spill.sqlite").is_file()
    for stderr in (spilled["stderr_a"], spilled["stderr"]):
        assert "Traceback" not in stderr, stderr


def test_an_aggregator_stopped_while_a_write_hangs_exits_and_one_started_while_the_server_is_down_runs(
        spilled: dict[str, Any]) -> None:
    assert spilled["stop_hung_s"] < 10, spilled["stop_hung_s"]  # the hung write is given up after 1 s
    assert spilled["stats_a"]["store_degraded"] and spilled["stats_a"]["store_spill_pending_batches"] > 0
    assert spilled["ready_b"]["store"] == spilled["url"]
    assert "cannot open history store" in spilled["stderr"] and "spilled until it answers" in spilled["stderr"]


def test_the_ranks_never_wait_while_the_server_hangs_or_is_down(spilled: dict[str, Any]) -> None:
    """Every ``ship`` returned at once (a blocked aggregator would make the sender's send wait
    its 1 s timeout), and the aggregator took every frame within seconds of it being sent, the
    60,000-row burst while the server hung included."""
    assert spilled["max_ship_s"] < 0.9, spilled["max_ship_s"]  # blocked: the send waits its 1 s timeout
    assert spilled["burst_accepted_s"] < 5 and spilled["down_accepted_s"] < 5, spilled
    hung, down = spilled["hung"], spilled["down"]
    assert hung["store_degraded"] and hung["frames_accepted"] == spilled["hung_frames"], hung
    # the burst is waiting for the store (in the write under way, or spilled), not in the intake queue
    assert hung["rows_accepted"] - hung["rows_written"] >= spilled["burst_marks"], hung
    # (ticks that waited together go to the server as one write, so the burst may all be in it)
    assert hung["store_spill_pending_rows"] + hung["store_memory_batches"] > 0 and hung["pending_rows"] < 50_000, hung
    assert down["store_degraded"] and down["store_write_failures"] >= 1 and down["store_spill_pending_rows"] > 0, down
    assert "cannot open history store" in down["store_last_error"], down


def test_healthz_counts_the_episode_and_the_store_degraded_alert_is_stored_once(spilled: dict[str, Any]) -> None:
    healthy, recovered = spilled["healthy"], spilled["recovered"]
    assert not healthy["store_degraded"] and healthy["store_spilled_rows"] == 0, healthy
    assert recovered["store_degraded_episodes"] == 1 and recovered["store_spill_pending_rows"] == 0, recovered
    assert recovered["store_replayed_rows"] > recovered["store_spilled_rows"] > 0, recovered
    degraded = {json.loads(a["evidence"])["reason"]: a for a in spilled["alerts"] if a["kind"] == "STORE_DEGRADED"}
    # A's, stored once (spilled with the rows, replayed by B); B's own, for A's batches it found
    # waiting, is stored too when a rank of the session had come before B's first tick
    stored = [a["kind"] for a in spilled["alerts"]].count("STORE_DEGRADED")
    assert stored == len(degraded) and set(degraded) in ({"slow"}, {"slow", "queued"}), spilled["alerts"]
    alert = degraded["slow"]
    assert alert["severity"] == "warn" and "is slow (" in alert["message"]  # waited 1 s, or 64 batches wait
    assert json.loads(alert["evidence"])["spill_path"] == str(spilled["out"] / "store_spill.sqlite")
    assert [a["kind"] for a in spilled["summary"]["alerts"]].count("STORE_DEGRADED") == stored
    lines = [json.loads(line) for line in (spilled["out"] / "alerts.jsonl").read_text().splitlines()]
    # A's (its session's, stored), and B's when it found A's batches waiting (before any rank came)
    assert sorted(a["evidence"]["reason"] for a in lines if a["kind"] == "STORE_DEGRADED") == ["queued", "slow"]


def test_the_summary_counts_the_degraded_store(spilled: dict[str, Any]) -> None:
    aggregator = spilled["summary"]["aggregator"]
    assert aggregator["store_degraded_episodes"] == 1 and aggregator["store_spill_pending_rows"] == 0, aggregator
    assert aggregator["store_replayed_rows"] > aggregator["store_spilled_rows"] > 0
    assert "history store: degraded 1 time(s)" in spilled["summary_text"] and "none lost" in spilled["summary_text"]


def test_batches_left_by_an_earlier_aggregator_are_replayed_first_and_a_refused_one_does_not_block(
        clickhouse_server: Any, tmp_path: Path) -> None:
    """In process, on the shared server: a spill file left by an aggregator that stopped while the
    server was down holds a batch the server can never take (a step index that is not a number)
    between two good ones. A new feed replays them in order on its own, counts the bad batch's
    row lost after three refusals while the server answered, and writes the next tick's batch
    after them."""
    from stepwatch.server.store_feed import StoreFeed
    from stepwatch.store.rows import row_tuples
    from stepwatch.store.spill import SpillBatch, SpillQueue
    from tests.support.store_rows import step

    sid = "left-over"
    good = row_tuples("steps", [step(sid, 0, n, 100 * n) for n in range(3)])
    bad = [tuple("x" if name == "step" else value for (name, _), value in zip(COLUMNS["steps"], good[0]))]
    left = SpillQueue(tmp_path / "store_spill.sqlite")
    left.push(SpillBatch(1, {"steps": good[:2]}, [], [{"session_id": sid, "status": "running",
                                                      "started_at_ns": 1}], []))
    left.push(SpillBatch(2, {"steps": bad}, [], [], []))
    left.push(SpillBatch(3, {"steps": good[2:]}, [], [], [{"session_id": sid, "status": "completed",
                                                          "ended_at_ns": 9}]))
    left.close()
    store = open_store(clickhouse_server.database_url("leftover"))
    feed = StoreFeed(store, tmp_path / "store_spill.sqlite", backoff_s=(0.05, 0.1))
    try:
        assert feed.take_events()[0]["reason"] == "queued"
        feed.submit({"steps": row_tuples("steps", [step(sid, 1, 0, 50)])}, [], [], [])
        assert wait_for(lambda: not feed.stats()["store_degraded"] and feed.rows_written == 4, 20), feed.stats()
        assert [e["event"] for e in feed.take_events()] == ["recovered"]
        stats = feed.stats()
        # the new tick's batch went behind them (spilled: the store was behind), then all were replayed
        assert (stats["store_spilled_rows"], stats["store_replayed_rows"], stats["store_spill_pending_rows"]) == (1, 4, 0)
        # the three as one INSERT, refused; then each alone: the bad one refused three times, lost
        assert (feed.rows_lost, feed.write_errors) == (1, 1) and stats["store_write_failures"] == 4, stats
        assert store.query("SELECT rank, step FROM steps ORDER BY rank, step") == [
            {"rank": 0, "step": 0}, {"rank": 0, "step": 1}, {"rank": 0, "step": 2}, {"rank": 1, "step": 0}]
        assert store.query("SELECT status, ended_at_ns FROM sessions") == [{"status": "completed", "ended_at_ns": 9}]
    finally:
        assert feed.close()
        store.close()


def test_waiting_batches_go_to_the_server_as_one_insert_per_table(clickhouse_server: Any, tmp_path: Path) -> None:
    """Twelve ticks left in the spill file are replayed in one write (18.16 takes one INSERT of
    many rows for a thirtieth of the CPU of many small ones), in order, each row once."""
    from stepwatch.server.store_feed import StoreFeed
    from stepwatch.store.rows import row_tuples
    from stepwatch.store.spill import SpillBatch, SpillQueue
    from tests.support.store_rows import step

    sid = "merged"
    left = SpillQueue(tmp_path / "store_spill.sqlite")
    for tick in range(12):
        opens = [{"session_id": sid, "status": "running", "started_at_ns": 1}] if tick == 0 else []
        left.push(SpillBatch(tick + 1, {"steps": row_tuples("steps", [step(sid, 0, tick, 100 * tick)])}, [], opens, []))
    left.close()
    store = open_store(clickhouse_server.database_url("merged"))
    writes: list[int] = []
    append = store.append_tuples

    def counted(tables: dict[str, list[Any]], batch_ids: Any = ()) -> int:
        writes.append(sum(len(rows) for rows in tables.values()))
        return append(tables, batch_ids)

    store.append_tuples = counted
    feed = StoreFeed(store, tmp_path / "store_spill.sqlite", backoff_s=(0.05, 0.1))
    try:
        assert wait_for(lambda: feed.rows_written == 12, 20), feed.stats()
        assert writes == [12]
        assert feed.stats()["store_replayed_batches"] == 12
        assert [r["step"] for r in store.query("SELECT step FROM steps ORDER BY step")] == list(range(12))
    finally:
        assert feed.close()
        store.close()
