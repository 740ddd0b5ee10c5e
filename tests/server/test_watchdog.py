"""The watchdog runner in the aggregator (server/watchdog.py): what it is fed from accepted
frames, what each alert becomes (alerts.jsonl, the alerts table, an event line), and the
history rebuilt from the artifacts importing alerts.jsonl."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from stepwatch.analysis.alerts import AlertPolicy
from stepwatch.analysis.summary import build_summary, session_alerts
from stepwatch.artifacts.alerts_log import read_alerts
from stepwatch.schema import new_session_id
from stepwatch.server.aggregator import Aggregator
from stepwatch.server.watchdog import Watchdog
from stepwatch.store.importers import import_alerts
from stepwatch.store.sqlite import SqliteStore

T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def frame(sid: str, rank: int, step: int, *, loss: float = 0.5, phase: str | None = None) -> dict[str, Any]:
    end = int((T0 + step * 0.1) * 1e9)
    span = {"id": f"{rank:04x}{step:012x}", "parent_id": None, "name": "step", "index": step,
            "start_ns": end - 50_000_000, "end_ns": end, "pid": 100 + rank, "thread_id": 1,
            "attrs": {"step_ns": 50_000_000}}
    heartbeat = {"ts": end / 1e9, "iso": "x", "pid": 100 + rank, "rank": rank, "step": step, "msg": "progress",
                 "loss": loss}
    beat = {"ts": end / 1e9 + 0.01, "iso": "x", "pid": 100 + rank, "rank": rank, "step": step,
            "msg": "heartbeat", "phase": phase}
    return {"spans": [span], "heartbeat": [heartbeat, beat]}


def meta(sid: str, rank: int) -> dict[str, Any]:
    return {"session_id": sid, "rank": rank, "world_size": 2, "host": "elsewhere", "pid": 100 + rank}


def test_alerts_from_accepted_frames_reach_every_output(tmp_path: Path) -> None:
    sid = new_session_id()
    clock = Clock()
    store = SqliteStore(tmp_path / "history.sqlite")
    events: list[dict[str, Any]] = []
    dog = Watchdog(tmp_path, AlertPolicy(stall_after_s=3), dump_stacks=False, clock=clock,
                   actions={"STALL": "dump"})
    aggregator = Aggregator(store, emit=events.append, watchdog=dog)

    async def scenario() -> None:
        for step in range(1, 6):
            clock.now = T0 + step * 0.1
            for rank in (0, 1):
                aggregator.accept_tables(meta(sid, rank), frame(sid, rank, step), "tcp")
        aggregator.accept_tables(meta(sid, 0), frame(sid, 0, 6, loss=float("nan")), "tcp")
        clock.now = T0 + 1
        assert await aggregator.check_alerts() == 1  # NONFINITE
        clock.now = T0 + 1.5  # rank 1 went quiet between steps, rank 0 waits in backward
        aggregator.accept_tables(meta(sid, 0), {"heartbeat": [
            {"ts": T0 + 1.5, "iso": "x", "pid": 100, "rank": 0, "step": 6, "msg": "heartbeat", "phase": "backward"}]},
            "tcp")
        aggregator.accept_tables(meta(sid, 1), {"heartbeat": [
            {"ts": T0 + 1.5, "iso": "x", "pid": 101, "rank": 1, "step": 5, "msg": "heartbeat", "phase": None}]},
            "tcp")
        clock.now = T0 + 4
        assert await aggregator.check_alerts() == 1  # STALL of rank 1
        await aggregator.flush()

    asyncio.run(scenario())
    lines = read_alerts(tmp_path)
    assert [(a["kind"], a["ranks"]) for a in lines] == [("NONFINITE", [0]), ("STALL", [1])]
    assert lines[0]["step"] == 6 and lines[1]["evidence"]["action"] == "dump"
    assert [e["event"] for e in events] == ["alert", "alert"]
    assert events[1]["line"].startswith("[stepwatch] ALERT STALL (crit) rank 1")
    assert events[1]["alert"] == lines[1]
    stored = store.query("SELECT kind, ranks, step, evidence FROM alerts WHERE session_id = ? ORDER BY ts_ns", (sid,))
    assert [(r["kind"], json.loads(r["ranks"])) for r in stored] == [("NONFINITE", [0]), ("STALL", [1])]
    assert json.loads(stored[1]["evidence"])["waiting"][0]["rank"] == 0
    assert [a["kind"] for a in build_summary(store, sid)["alerts"]] == ["NONFINITE", "STALL"]
    # a rebuilt history imports alerts.jsonl, once
    rebuilt = SqliteStore(tmp_path / "rebuilt.sqlite")
    assert import_alerts(tmp_path, rebuilt) == 2 and import_alerts(tmp_path, rebuilt) == 0
    assert [a["kind"] for a in session_alerts(rebuilt, sid)] == ["NONFINITE", "STALL"]
    assert import_alerts(tmp_path, store) == 0  # the live history has them already
    store.close()
    rebuilt.close()


def test_the_summary_reads_alerts_jsonl_when_the_history_has_none(tmp_path: Path) -> None:
    sid = new_session_id()
    (tmp_path / "alerts.jsonl").write_text(json.dumps(
        {"ts": T0, "iso": "x", "kind": "RANK_LOST", "severity": "crit", "ranks": [3], "step": 9,
         "message": "rank 3 is gone", "evidence": {}, "session_id": sid}) + "\n" + '{"ts": 1, "kind"')  # torn tail
    with SqliteStore(tmp_path / "history.sqlite") as store:
        [alert] = session_alerts(store, sid, tmp_path)
    assert alert["kind"] == "RANK_LOST" and alert["ranks"] == [3] and "session_id" not in alert


def test_an_ended_session_is_forgotten(tmp_path: Path) -> None:
    clock = Clock()
    dog = Watchdog(tmp_path, dump_stacks=False, clock=clock, forget_after_s=10)
    dog.rules_of("s").observe_heartbeat(0, {"ts": T0, "pid": 1, "step": 1, "msg": "stop"}, at=T0)
    dog.tick()
    clock.now = T0 + 11
    dog.tick()
    assert dog.rules == {}


def test_a_dropped_connection_is_lost_where_no_pid_can_tell_and_the_pid_decides_on_this_host(tmp_path: Path) -> None:
    """Rank 0 runs on this host and lives (this process), rank 1 runs on another host: both
    connections close without a stop event."""
    import os
    import socket

    sid = new_session_id()
    clock = Clock()
    dog = Watchdog(tmp_path, AlertPolicy(stall_after_s=60, lost_grace_s=1), dump_stacks=False, clock=clock)
    aggregator = Aggregator(SqliteStore(tmp_path / "history.sqlite"), watchdog=dog)
    ranks = {0: (socket.gethostname(), os.getpid()), 1: ("node-b", 4242)}
    for step in range(1, 11):  # a heartbeat every 0.5 s: the drop's grace is 2.5 s
        clock.now = T0 + step * 0.5
        for rank, (host, pid) in ranks.items():
            beat = {"ts": clock.now, "iso": "x", "pid": pid, "rank": rank, "step": step, "msg": "heartbeat"}
            aggregator.accept_tables({"session_id": sid, "rank": rank, "world_size": 2, "host": host, "pid": pid},
                                     {"heartbeat": [beat]}, "tcp")
        assert dog.tick() == []
    clock.now = T0 + 5.2
    for rank in ranks:
        dog.feed_disconnect(sid, rank)
    assert dog.tick() == []  # within the grace
    clock.now = T0 + 5.2 + 2.6
    [(alert, _)] = dog.tick()  # rank 0's process lives: its sender will reconnect
    assert alert.kind == "RANK_LOST" and alert.ranks == (1,) and alert.evidence["lost_by"] == "connection"
    assert alert.evidence["host"] == "node-b" and alert.evidence["pid"] == 4242
    assert alert.evidence["connection_dropped_at"] == "2027-01-15T08:00:05.200Z"
    assert alert.evidence["last_heartbeat"] == "2027-01-15T08:00:05.000Z"
    assert "(on node-b, pid 4242)" in alert.message and "connection to the aggregator closed at" in alert.message
    clock.now = T0 + 30
    assert dog.tick() == []
    # rank 0 was never lost: its pid said it lives
    assert not dog.rules[sid].ranks[0].lost
