"""Two nodes on one machine (issue 23 §2): two ``stepwatch serve`` aggregators bound to different
loopback addresses (127.0.0.1 and 127.0.0.2), each with ranks of its own (FrameSender, as a
rank's runtime ships), both writing to one database of the real clickhouse-server. The session
id is shared as on a real multi-node job (every node is given the same ``--session-id``, and
its ranks ``STEPWATCH_SESSION_ID``): ``summary`` and ``query`` over the clickhouse:// URL see one
session with every rank of both nodes."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
import uuid
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from stepwatch.transport.sender import FrameSender
from stepwatch.ui.cli import cli
from tests.support.aggregator import Aggregator, wait_for
from tests.support.records import make_event

pytestmark = pytest.mark.real

NODES = {"node-a": ("127.0.0.1", (0, 1)), "node-b": ("127.0.0.2", (2, 3))}
WORLD = 4
STEPS = 6
BASE_NS = 1_800_000_000_000_000_000


def rank_frames(sid: str, rank: int) -> list[dict[str, list[Any]]]:
    """The frames of one rank: its steps (step spans, with their phases), a sample, and its stop."""
    spans = []
    for step in range(STEPS):
        start = BASE_NS + step * 20_000_000 + rank * 1000
        step_ns = 10_000_000 + rank * 1_000_000  # rank 3 (node-b) the slowest
        spans.append({"id": uuid.uuid4().hex, "name": "step", "parent_id": None, "index": step, "start_ns": start,
                      "end_ns": start + step_ns, "rank": rank, "pid": 200 + rank, "thread_id": 1, "gpu_ns": None,
                      "attrs": {"step_ns": step_ns, "forward_ns": step_ns // 3, "backward_ns": step_ns // 2}})
    node = next(name for name, (_, ranks) in NODES.items() if rank in ranks)
    sample = msgspec.to_builtins(make_event(sid, rank, rank=rank, world_size=WORLD, timestamp_ns=BASE_NS + rank,
                                            host=node))
    stop = msgspec.to_builtins(make_event(sid, 99, rank=rank, world_size=WORLD, timestamp_ns=BASE_NS + 10**12,
                                          event_type="stop", context="stepwatch capture stopped (completed)"))
    return [{"spans": spans[:3], "telemetry": [sample]}, {"spans": spans[3:]}, {"telemetry": [stop]}]


def _loopback_alias_works() -> bool:
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.2", 0))
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def two_nodes(clickhouse_server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _loopback_alias_works():
        pytest.skip("127.0.0.2 cannot be bound here (no 127.0.0.0/8 loopback)")
    base = tmp_path_factory.mktemp("two-nodes")
    url = clickhouse_server.database_url("nodes")
    sid = str(uuid.uuid4())
    aggregators: dict[str, Aggregator] = {}
    try:
        for node, (address, _) in NODES.items():  # as `stepwatch serve` on each node, one session id
            aggregators[node] = Aggregator(base / node, "--host", address, "--http-port", "0", "--store", url,
                                           "--session-id", sid, env={"STEPWATCH_VERDICT_INTERVAL_S": "0"})
        senders = [FrameSender(aggregators[node].tcp, {"session_id": sid, "rank": rank, "world_size": WORLD,
                                                       "host": node, "pid": 200 + rank, "started_ns": BASE_NS})
                   for node, (_, ranks) in NODES.items() for rank in ranks]
        frames = {s.meta["rank"]: rank_frames(sid, s.meta["rank"]) for s in senders}
        for i in range(2):
            for sender in senders:
                sender.ship(frames[sender.meta["rank"]][i])
        # node-a's ranks stop first: the session runs on while node-b's do
        for sender in senders[:2]:
            sender.ship(frames[sender.meta["rank"]][2])
        assert wait_for(lambda: _health(aggregators["node-a"])["frames_accepted"] == 6, 20)
        time.sleep(2.5)  # node-a's aggregator looks for the other ranks' stops in the store every second
        status_while_b_runs = _status(url, sid)
        for sender in senders[2:]:
            sender.ship(frames[sender.meta["rank"]][2])
        for sender in senders:
            sender.close(5.0)
            assert sender.frames_sent == 3 and sender.frames_dropped == 0, sender.stats()
        for node, (_, ranks) in NODES.items():  # taken in before the stop, which hangs up on what is unread
            assert wait_for(lambda node=node, ranks=ranks: _health(aggregators[node])["frames_accepted"] == 3 * len(ranks),
                            20), _health(aggregators[node])
        # both nodes' aggregators close it, each once the store holds all four stops
        assert wait_for(lambda: _status(url, sid) == "completed", 20), _status(url, sid)
        stats = {node: agg.stop() for node, agg in aggregators.items()}
    finally:
        for agg in aggregators.values():
            agg.kill()
    return {"url": url, "sid": sid, "ready": {n: a.ready for n, a in aggregators.items()}, "stats": stats,
            "base": base, "status_while_b_runs": status_while_b_runs}


def _status(url: str, sid: str) -> str | None:
    rows = json.loads(_cli("query", url, f"SELECT status FROM sessions WHERE session_id = '{sid}'", "--format", "json"))
    return rows[0]["status"] if rows else None


def _health(agg: Aggregator) -> dict[str, Any]:
    host, port = agg.http
    with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5) as answer:
        return dict(json.loads(answer.read()))


def _cli(*args: str) -> Any:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_each_node_listens_on_its_own_address_and_writes_its_own_ranks(two_nodes: dict[str, Any]) -> None:
    for node, (address, ranks) in NODES.items():
        assert two_nodes["ready"][node]["tcp"].startswith(f"{address}:"), two_nodes["ready"][node]
        stats = two_nodes["stats"][node]
        assert stats["ranks"] == len(ranks) and stats["rows_lost"] == 0 and not stats["store_degraded"], stats
        assert stats["rows_written"] == stats["rows_accepted"] > 0, stats
        assert not (two_nodes["base"] / node / "history.sqlite").exists()


def test_summary_over_the_url_sees_one_session_spanning_both_nodes(two_nodes: dict[str, Any]) -> None:
    summary = json.loads(_cli("summary", two_nodes["url"], "--session", two_nodes["sid"], "--json"))
    assert summary["session_id"] == two_nodes["sid"]
    assert summary["ranks"] == [0, 1, 2, 3] and summary["world_size"] == WORLD
    assert sorted(summary["per_rank"]) == ["0", "1", "2", "3"]
    assert all(r["steps"] == STEPS for r in summary["per_rank"].values()), summary["per_rank"]
    assert summary["overall"]["steps"] == WORLD * STEPS
    assert summary["status"] == "completed"
    assert two_nodes["status_while_b_runs"] == "running"  # node-a's ranks had stopped, node-b's had not


def test_query_over_the_url_sees_every_rank_of_both_nodes_once(two_nodes: dict[str, Any]) -> None:
    url, sid = two_nodes["url"], two_nodes["sid"]
    sessions = json.loads(_cli("query", url, "SELECT session_id, world_size FROM sessions", "--format", "json"))
    assert sessions == [{"session_id": sid, "world_size": WORLD}]
    hosts = json.loads(_cli("query", url, "SELECT rank, host, count(*) AS n FROM telemetry WHERE event_type = 'sample' "
                                          "GROUP BY rank, host ORDER BY rank", "--format", "json"))
    assert hosts == [{"rank": r, "host": node, "n": 1} for node, (_, ranks) in NODES.items() for r in ranks]
    steps = json.loads(_cli("query", url, "SELECT rank, count(*) AS n, max(step) AS last FROM steps "
                                          "GROUP BY rank ORDER BY rank", "--format", "json"))
    assert steps == [{"rank": r, "n": STEPS, "last": STEPS - 1} for r in range(WORLD)]
