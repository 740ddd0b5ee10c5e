"""Bounds on what arrives from the wire (schema/limits.py, docs/ingestion-limits.md): ids,
names, hosts, ranks and world sizes out of bounds are refused with a counted reason and create
nothing, over real TCP connections and real HTTP requests to a running aggregator; frames
inside the bounds create exactly their session."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import time
import unicodedata
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.schema.limits import (
    MAX_HOST_BYTES,
    MAX_ID_CHARS,
    MAX_NAME_BYTES,
    MAX_RANK,
    MAX_WORLD_SIZE,
    column_problem,
    id_problem,
    sender_problem,
)
from stepwatch.transport.frames import encode_frame
from tests.support import examples
from tests.support.http import AUTH, ThreadServer, post
from tests.support.records import make_event

# -- the bounds, written from docs/ingestion-limits.md (not read back from the code) ----------


def ok_id(value: str) -> bool:
    return 1 <= len(value) <= 128 and all(0x20 <= ord(ch) <= 0x7E for ch in value)


def ok_name(value: str) -> bool:
    return len(value.encode("utf-8")) <= 256


def ok_host(value: str | None) -> bool:
    # no control characters: str.isprintable's definition (categories C* and Z*, except space)
    return value is None or (len(value.encode("utf-8")) <= 256
                             and all(ch == " " or unicodedata.category(ch)[0] not in "CZ" for ch in value))


def ok_rank(value: int) -> bool:
    return 0 <= value < 2**20


def ok_world_size(value: int | None) -> bool:
    return value is None or 1 <= value <= 2**20


def test_the_documented_bounds() -> None:
    assert (MAX_ID_CHARS, MAX_NAME_BYTES, MAX_HOST_BYTES, MAX_RANK, MAX_WORLD_SIZE) == (128, 256, 256, 2**20 - 1, 2**20)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "ingestion-limits.md").read_text()
    for figure in ("128", "256", "2**20"):
        assert figure in doc


def test_every_legitimate_producer_is_inside_the_bounds() -> None:
    import os

    from stepwatch.schema import new_session_id

    stormlog_style = str(uuid.uuid4())
    cirron_style = os.urandom(16).hex()
    for value in (new_session_id(), stormlog_style, cirron_style, uuid.uuid4().hex, "root"):
        assert id_problem(value) is None
    assert sender_problem(new_session_id(), MAX_RANK, MAX_WORLD_SIZE, socket.gethostname()) is None
    assert column_problem("name", {"é" * 128}) is None  # 256 bytes, as capture cuts them
    assert column_problem("name", {"é" * 128 + "e"}) is not None


# -- strategies around the bounds ----------------------------------------------------------------

_printable_ascii = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
_any_char = st.characters(blacklist_categories=("Cs",))  # msgpack carries no lone surrogates
ids = st.one_of(
    st.text(_printable_ascii, min_size=1, max_size=128),
    st.text(_printable_ascii, min_size=120, max_size=140),
    st.text(_any_char, min_size=1, max_size=12),
    st.builds(lambda a, c, b: a + c + b, st.text(_printable_ascii, max_size=5),
              st.sampled_from(["\x00", "\n", "\x7f", "\x1b", "é", "\u2028"]), st.text(_printable_ascii, max_size=5)),
)
names = st.one_of(st.text(_any_char, max_size=20), st.text(_any_char, min_size=60, max_size=130),
                  st.text("é", min_size=126, max_size=130), st.text("a", min_size=254, max_size=258))
hosts = st.one_of(st.none(), st.sampled_from(["node0", "gpu-7.cluster.local"]), names)
ranks = st.one_of(st.integers(0, 7), st.integers(MAX_RANK - 2, MAX_RANK + 2), st.integers(-3, -1),
                  st.sampled_from([10**12, 2**31, 2**63 - 1]))
world_sizes = st.one_of(st.none(), st.integers(1, 8), st.integers(MAX_WORLD_SIZE - 1, MAX_WORLD_SIZE + 2),
                        st.sampled_from([0, -1, 10**12]))


def _texts_problem(kind: str, value: Any) -> bool:
    return column_problem(kind, {value}) is not None


@given(value=ids)
def test_id_bound(value: str) -> None:
    assert (id_problem(value) is None) == ok_id(value)
    assert (column_problem("id", [value, None, "ok"]) is None) == ok_id(value)


@given(value=names)
def test_name_bound(value: str) -> None:
    assert (column_problem("name", {value, None}) is None) == ok_name(value)


@given(value=hosts)
def test_host_bound(value: str | None) -> None:
    assert (column_problem("host", {value}) is None) == ok_host(value)


@given(rank=ranks, world_size=world_sizes)
def test_rank_and_world_size_bounds(rank: int, world_size: int | None) -> None:
    assert (column_problem("rank", {rank, None}) is None) == ok_rank(rank)
    assert (column_problem("world_size", {world_size}) is None) == ok_world_size(world_size)
    assert (sender_problem("s", rank, world_size, None) is None) == (ok_rank(rank) and ok_world_size(world_size))


# -- over a real TCP connection to a running aggregator -----------------------------------------


class Server(ThreadServer):
    """The HTTP test server of test_http_ingest with the aggregator's TCP listener beside it."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)

        async def listen() -> int:
            self.tcp_server = await asyncio.start_server(self.aggregator.handle_connection, "127.0.0.1", 0)
            return self.tcp_server.sockets[0].getsockname()[1]

        self.tcp = ("127.0.0.1", self.call(listen()))

    def close(self) -> None:
        self.call(self._close_tcp())
        super().close()

    async def _close_tcp(self) -> None:
        self.tcp_server.close()
        self.aggregator.close_connections()

    def sessions(self) -> set[str]:
        db = sqlite3.connect(f"{(self.run_dir / 'history.sqlite').resolve().as_uri()}?mode=ro", uri=True)
        try:
            return {row[0] for row in db.execute("SELECT session_id FROM sessions")}
        finally:
            db.close()

    def handled(self) -> int:
        return self.aggregator.frames_accepted + sum(self.aggregator.rejected.values())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tmp_path_factory.mktemp("limits"))
    yield srv
    srv.close()


class Connection:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.sock = socket.create_connection(server.tcp, timeout=10)

    def send(self, meta: dict[str, Any], tables: dict[str, Any]) -> None:
        """Sends one frame and waits until the aggregator has accepted or refused it."""
        before = self.server.handled()
        self.sock.sendall(encode_frame(meta, tables))
        end = time.monotonic() + 10
        while self.server.handled() == before:
            assert time.monotonic() < end, "the frame was neither accepted nor refused"
            time.sleep(0.001)


@pytest.fixture(scope="module")
def connection(server: Server):
    conn = Connection(server)
    yield conn
    conn.sock.close()


def _frame(session_id: str, rank: int, world_size: int | None, host: str | None, span_id: str, parent_id: str,
           span_name: str, mark_id: str, mark_name: str, row_session: str, row_rank: int,
           columnar: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    meta = {"session_id": session_id, "rank": rank, "world_size": world_size, "host": host, "pid": 1}
    span = {"id": span_id, "parent_id": parent_id, "name": span_name, "index": 0, "start_ns": 1, "end_ns": 2,
            "attrs": {}}
    mark = {"id": mark_id, "span_id": span_id, "name": mark_name, "value_type": "float", "value": 0.5, "ts_ns": 1,
            "kind": "point", "attrs": {}}
    event = msgspec.to_builtins(make_event(row_session, 0, rank=0))
    event["rank"] = row_rank
    tables: dict[str, Any] = {"spans": [span], "marks": [mark], "telemetry": [event]}
    if columnar:  # as the sender ships them: columnar, JSON fields as text
        from stepwatch.transport.frames import COLUMNAR, JSON_FIELD

        for name in ("spans", "marks"):
            columns = COLUMNAR[name]
            rows = [[json.dumps(r.get(c) or {}) if c == JSON_FIELD[name] else r.get(c) for c in columns]
                    for r in tables[name]]
            tables[name] = {"columns": list(columns), "rows": rows}
    return meta, tables


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(session_id=ids, rank=ranks, world_size=world_sizes, host=hosts, span_id=ids, parent_id=ids, span_name=names,
       mark_id=ids, mark_name=names, row_session=ids, row_rank=ranks, columnar=st.booleans())
def test_a_frame_creates_exactly_its_session_or_is_refused_and_counted(
        server: Server, connection: Connection, session_id: str, rank: int, world_size: int | None,
        host: str | None, span_id: str, parent_id: str, span_name: str, mark_id: str, mark_name: str,
        row_session: str, row_rank: int, columnar: bool) -> None:
    meta_ok = ok_id(session_id) and ok_rank(rank) and ok_world_size(world_size) and ok_host(host)
    rows_ok = (all(map(ok_id, (span_id, parent_id, mark_id, row_session))) and ok_name(span_name)
               and ok_name(mark_name) and ok_rank(row_rank))
    sessions = server.sessions()
    rejected = dict(server.aggregator.rejected)
    accepted = server.aggregator.frames_accepted
    pending = server.aggregator.rows_accepted
    meta, tables = _frame(session_id, rank, world_size, host, span_id, parent_id, span_name, mark_id, mark_name,
                          row_session, row_rank, columnar)
    connection.send(meta, tables)
    if meta_ok and rows_ok:
        assert server.aggregator.frames_accepted == accepted + 1
        assert server.sessions() - sessions == {session_id} - sessions
        assert session_id in server.sessions()
    else:
        reason = "bad_meta" if not meta_ok else "bad_rows"
        assert server.aggregator.rejected[reason] == rejected.get(reason, 0) + 1
        assert server.aggregator.frames_accepted == accepted
        assert server.aggregator.rows_accepted == pending  # no row of it waits to be written
        assert server.sessions() == sessions


def test_the_hostile_frames_of_the_report_are_refused_and_a_real_run_is_stored(server: Server) -> None:
    conn = Connection(server)
    sessions = server.sessions()
    rejected = dict(server.aggregator.rejected)
    real = str(uuid.uuid4())
    hostile = [
        ({"session_id": "s" * 100_000, "rank": 0}, "bad_meta"),
        ({"session_id": "with\x00nul", "rank": 0}, "bad_meta"),
        ({"session_id": real, "rank": 10**12}, "bad_meta"),
        ({"session_id": real, "rank": 0, "world_size": 10**12}, "bad_meta"),
        ({"session_id": real, "rank": 0, "host": "h" * 1000}, "bad_meta"),
        ({"session_id": real, "global_rank": 2**20, "rank": 0}, "bad_meta"),
    ]
    for meta, _ in hostile:
        conn.send(meta, {"marks": [{"id": uuid.uuid4().hex, "name": "x", "value": 1}]})
    rows = [
        {"spans": [{"id": "i" * 129, "name": "step", "start_ns": 1, "end_ns": 2}]},
        {"spans": [{"id": uuid.uuid4().hex, "name": "n" * 257, "start_ns": 1, "end_ns": 2}]},
        {"marks": [{"id": "line\nbreak", "name": "loss", "value": 1}]},
        {"telemetry": [{**msgspec.to_builtins(make_event("s\x00", 0)), "session_id": "s\x00"}]},
        {"telemetry": [{**msgspec.to_builtins(make_event(real, 0)), "rank": 10**12}]},
    ]
    for tables in rows:
        conn.send({"session_id": real, "rank": 0}, tables)
    counted = {k: v - rejected.get(k, 0) for k, v in server.aggregator.rejected.items() if v != rejected.get(k, 0)}
    assert counted == {"bad_meta": len(hostile), "bad_rows": len(rows)}
    assert server.sessions() == sessions  # nothing created
    conn.send({"session_id": real, "rank": 3, "world_size": 4, "host": "node1"},
              {"marks": [{"id": uuid.uuid4().hex, "name": "loss", "value": 0.25}]})
    assert server.sessions() - sessions == {real}
    conn.sock.close()


# -- over HTTP: the same bounds, a 400 with the reason, nothing created -------------------------


def _batch(**span: Any) -> dict[str, Any]:
    return {"schema_version": 1, "batch_id": uuid.uuid4().hex, "sdk_version": "0.3.0",
            "spans": [{"id": uuid.uuid4().hex, "name": "step", "start_ns": 1, "end_ns": 2, "pid": 7, **span}],
            "marks": [], "snapshots": []}


@pytest.mark.parametrize(("headers", "span", "fragment"), [
    ({"X-Stepwatch-Session-Id": "s" * 200}, {}, "session_id"),
    ({"X-Stepwatch-Session-Id": "caf\xe9"}, {}, "session_id"),
    ({}, {"rank": 10**12}, "rank"),
    ({}, {"id": "i" * 129}, "spans.span_id"),
    ({}, {"name": "n" * 257}, "spans.name"),
    ({}, {"parent_id": "p\x00"}, "spans.parent_id"),
], ids=["long-session-header", "non-ascii-session-header", "rank", "span-id", "span-name", "parent-id"])
def test_http_batches_out_of_bounds_are_400_and_create_nothing(server: Server, headers: dict[str, str],
                                                               span: dict[str, Any], fragment: str) -> None:
    sessions = server.sessions()
    refused = server.app.rejected.get(400, 0)
    response = post(server.address, _batch(**span), {**AUTH, **headers})
    assert response.status == 400, response
    assert fragment in response.json()["error"]
    assert server.app.rejected[400] == refused + 1
    assert server.sessions() == sessions
    ok = post(server.address, _batch(rank=5), {**AUTH, "X-Stepwatch-Session-Id": f"run-{uuid.uuid4().hex}"})
    assert ok.status == 202, ok
