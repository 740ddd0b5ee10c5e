"""Gaps closed in the history path (aggregator, HTTP ingestion, importers, store), each on the real
thing: the aggregator as its own process on loopback sockets, real SQLite files, the real cirron
SDK writing a spool, and the ``stepwatch`` CLI."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stepwatch.server.settings import parse_duration
from stepwatch.transport.frames import decode_body, decode_typed, encode_frame
from tests.support import STEPWATCH, clean_env, run_stepwatch
from tests.support.aggregator import Aggregator, query, raw_client, wait_for
from tests.support.http import AUTH, TOKEN, batch, hexid, mark, post, request, span
from tests.support.records import make_event
from tests.support.shared import once

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

BASE_NS = 1_900_000_000_000_000_000


def telemetry(sid: str, rank: int, t: int, event_type: str = "sample", context: str | None = None) -> dict[str, Any]:
    event = msgspec.to_builtins(make_event(sid, t, rank=rank, world_size=2))
    event.update(timestamp_ns=BASE_NS + t, event_type=event_type, context=context)
    return event


def count(store: Path, table: str, sid: str) -> int:
    return query(store, f"SELECT COUNT(*) FROM {table} WHERE session_id = ?", (sid,))[0][0]


# -- 1. cirron spans give step rows ---------------------------------------------------------------

CIRRON_LOOP = textwrap.dedent("""
    import time
    import cirron as ci
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    ci.profile(frameworks=["torch"], flush_interval=0.2)
    torch.manual_seed(0)
    x = torch.randn(160, 4)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
    model = ci.watch(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ci.mark("loss", loss.item())
            time.sleep(0.01)
    ci.flush()
    ci.shutdown()
""")


@pytest.fixture(scope="module")
def cirron_spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return once(tmp_path_factory, "history-cirron-spool", _cirron_spool)


def _cirron_spool(base: Path) -> Path:
    pytest.importorskip("cirron")
    pytest.importorskip("torch")
    (base / "loop.py").write_text(CIRRON_LOOP)
    env = {**clean_env(), "CIRRON_OUTPUT_DIR": str(base / ".cirron"), "HOME": str(base)}
    proc = subprocess.run([sys.executable, "loop.py"], cwd=base, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return base / ".cirron"


def _spool_spans(spool: Path) -> list[dict[str, Any]]:
    return [s for f in sorted((spool / "spool").glob("*.json")) for s in json.loads(f.read_text())["spans"]]


def test_imported_cirron_spool_has_step_rows_from_the_span_tree(cirron_spool: Path, tmp_path: Path) -> None:
    store = tmp_path / "history.sqlite"
    proc = run_stepwatch("import", str(cirron_spool), "--into", str(store), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    spans = _spool_spans(cirron_spool)
    sdk_steps = [s for s in spans if s["name"] == "step"]
    assert len(sdk_steps) == 10 and all("step_ns" not in s["attrs"] for s in sdk_steps)
    assert json.loads(proc.stdout)["steps"] == len(sdk_steps)
    rows = query(store, "SELECT step, start_ns, end_ns, step_ns, data_load_ns, h2d_ns, forward_ns, backward_ns, "
                        "optimizer_ns, wait_ns FROM steps ORDER BY step")
    assert [r[0] for r in rows] == sorted(s["index"] for s in sdk_steps)
    children: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        children.setdefault(s["parent_id"], []).append(s)
    for step, (_n, start, end, step_ns, data_load, h2d, forward, backward, optimizer, wait) in zip(
            sorted(sdk_steps, key=lambda s: s["index"]), rows):
        kids = children[step["id"]]

        def took(name: str, kids: list[dict] = kids) -> int:
            return sum(k["end_ns"] - k["start_ns"] for k in kids if k["name"] == name)

        assert (start, end, step_ns) == (step["start_ns"], step["end_ns"], step["end_ns"] - step["start_ns"])
        assert (forward, backward, optimizer, h2d) == (took("forward"), took("backward"), took("optimizer_step"), 0)
        assert forward > 0 and backward > 0 and optimizer > 0
        # the SDK's data_load span brackets only the tail of the fetch; the fetch time is in its attrs
        assert data_load == sum(k["attrs"]["data_load_ns"] for k in kids if k["name"] == "data_load") > 0
        assert wait == max(0, step_ns - forward - backward - optimizer)
    summary = run_stepwatch("summary", str(store), cwd=tmp_path)
    assert summary.returncode == 0, summary.stderr
    assert f"steps {len(sdk_steps)}" in summary.stdout, summary.stdout


def test_a_steps_children_in_an_earlier_batch_still_count(tmp_path: Path) -> None:
    """Children close (and ship) before their step: batches split a step from its children."""
    agg = Aggregator(tmp_path / "agg", "--http-port", "0", "--token-env", "SW_T", env={"SW_T": TOKEN})
    try:
        headers = {**AUTH, "X-Stepwatch-Session-Id": "split-" + hexid()}
        sid = headers["X-Stepwatch-Session-Id"]
        step_id, t0 = hexid(), time.time_ns()
        first = [span("data_load", parent_id=step_id, start_ns=t0, attrs={"data_load_ns": 70}),
                 span("forward", parent_id=step_id, start_ns=t0 + 100)]
        later = [span("backward", parent_id=step_id, start_ns=t0 + 2000),
                 span("step", id=step_id, index=4, start_ns=t0, end_ns=t0 + 10_000)]
        assert post(agg.http, batch(first), headers).status == 202
        assert post(agg.http, batch(later), headers).status == 202
        store = agg.out / "history.sqlite"
        assert wait_for(lambda: store.exists() and count(store, "steps", sid) == 1)
        row = query(store, "SELECT step, step_ns, data_load_ns, forward_ns, backward_ns, optimizer_ns, wait_ns "
                           "FROM steps WHERE session_id = ?", (sid,))
        assert row == [(4, 10_000, 70, 1000, 1000, 0, 8000)]
    finally:
        agg.stop()


# -- 2. re-imports and retries store nothing twice --------------------------------------------------

TRIVIAL = "import time\nfor _ in range(8):\n    time.sleep(0.05)\n"


def test_importing_a_run_twice_stores_nothing_twice(tmp_path: Path, cirron_spool: Path) -> None:
    (tmp_path / "job.py").write_text(TRIVIAL)
    run_dir = tmp_path / "tracked"
    proc = run_stepwatch("track", "--interval", "50", "--out", str(run_dir), "--", sys.executable, "job.py",
                     cwd=tmp_path, timeout=90)
    assert proc.returncode == 0, proc.stderr
    store = tmp_path / "again.sqlite"
    tables = ("telemetry", "heartbeats", "spans", "marks", "snapshots", "steps")

    def counts() -> dict[str, int]:
        return {t: query(store, f"SELECT COUNT(*) FROM {t}")[0][0] for t in tables}

    for target in (run_dir, cirron_spool):
        assert run_stepwatch("import", str(target), "--into", str(store), cwd=tmp_path).returncode == 0
    once = counts()
    assert once["telemetry"] > 0 and once["heartbeats"] > 0 and once["spans"] > 0 and once["steps"] > 0
    for target in (run_dir, cirron_spool, run_dir):
        again = run_stepwatch("import", str(target), "--into", str(store), cwd=tmp_path)
        assert again.returncode == 0, again.stderr
    assert counts() == once


def test_a_retried_batch_is_stored_once_across_a_restart(tmp_path: Path) -> None:
    out = tmp_path / "agg"
    headers = {**AUTH, "X-Stepwatch-Session-Id": "restart-" + hexid()}
    sid = headers["X-Stepwatch-Session-Id"]
    body = batch([span()], [mark("root")])
    agg = Aggregator(out, "--http-port", "0", "--token-env", "SW_T", env={"SW_T": TOKEN})
    try:
        assert post(agg.http, body, headers).json() == {"batch_id": body["batch_id"]}
    finally:
        agg.stop()
    store = out / "history.sqlite"
    assert count(store, "spans", sid) == 1
    agg = Aggregator(out, "--http-port", "0", "--token-env", "SW_T", env={"SW_T": TOKEN})
    try:
        again = post(agg.http, body, headers, "/api/traces", gz=True)
        assert again.status == 202 and again.json() == {"batch_id": body["batch_id"], "duplicate": True}
        assert post(agg.http, batch([span()]), headers).status == 202  # a new batch still goes in
        assert wait_for(lambda: count(store, "spans", sid) == 2)
    finally:
        agg.stop()
    assert count(store, "spans", sid) == 2 and count(store, "marks", sid) == 1
    (seen,), = query(store, "SELECT COUNT(*) FROM ingest_batches WHERE batch_id = ?", (body["batch_id"],))
    assert seen == 1


# -- 3. HTTP batches of one process share a session ----------------------------------------------------


def test_marks_only_batches_land_in_their_processs_session(tmp_path: Path) -> None:
    agg = Aggregator(tmp_path / "agg", "--http-port", "0", "--token-env", "SW_T", env={"SW_T": TOKEN})
    store = agg.out / "history.sqlite"
    try:
        epoch, step = hexid(), hexid()
        # the step's children close first; the epoch and the step are still open
        spans = [span("forward", parent_id=step, pid=4242, rank=1), span("backward", parent_id=step, pid=4242, rank=1)]
        assert post(agg.http, batch(spans)).status == 202
        # marks on the open step and on the open epoch (no pid anywhere in these batches)
        on_step, on_epoch = mark(step), mark(epoch)
        assert post(agg.http, batch(marks=[on_step])).status == 202
        assert post(agg.http, batch([span("step", id=step, parent_id=epoch, index=0, pid=4242, rank=1)])).status == 202
        assert post(agg.http, batch(marks=[on_epoch])).status == 202
        # a marks-only batch naming nothing seen yet: the client's last session
        stray = mark(hexid())
        assert post(agg.http, batch(marks=[stray])).status == 202
        ids = [s["id"] for s in spans] + [step]
        assert wait_for(lambda: store.exists() and query(store, "SELECT COUNT(*) FROM marks")[0][0] == 3)
        sessions = set(query(store, "SELECT session_id, rank FROM spans WHERE span_id IN (?, ?, ?)", tuple(ids)))
        sessions |= set(query(store, "SELECT session_id, rank FROM marks"))
        assert len(sessions) == 1, sessions
        assert next(iter(sessions))[1] == 1
    finally:
        agg.stop()


# -- 4. stop events close the session -------------------------------------------------------------------


def test_sessions_close_when_every_rank_has_stopped(tmp_path: Path) -> None:
    """Every rank: those heard, and as many as the world size says; a world size that never
    fills (one rank of two ever heard) is closed with what is known after STEPWATCH_WORLD_WAIT_S."""
    agg = Aggregator(tmp_path / "agg", env={"STEPWATCH_WORLD_WAIT_S": "5"})
    store = agg.out / "history.sqlite"
    sid, other, late = "close-" + hexid(), "hurt-" + hexid(), "late-" + hexid()

    def frame(session: str, rank: int, rows: list[dict[str, Any]]) -> bytes:
        return encode_frame({"session_id": session, "rank": rank, "world_size": 2}, {"telemetry": rows})

    def status(session: str) -> tuple[Any, ...]:
        rows = query(store, "SELECT status, ended_at_ns FROM sessions WHERE session_id = ?", (session,))
        return rows[0] if rows else (None, None)

    try:
        with socket.create_connection(agg.tcp) as sock:
            sock.sendall(frame(sid, 0, [telemetry(sid, 0, 1)]) + frame(sid, 1, [telemetry(sid, 1, 2)]))
            sock.sendall(frame(sid, 0, [telemetry(sid, 0, 50, "stop", "stepwatch capture stopped (completed)")]))
            assert wait_for(lambda: store.exists() and count(store, "telemetry", sid) == 3)
            time.sleep(0.5)
            assert status(sid) == ("running", None)  # rank 1 is still going
            sock.sendall(frame(sid, 1, [telemetry(sid, 1, 70, "stop", "stepwatch capture stopped (completed)")]))
            assert wait_for(lambda: status(sid)[0] == "completed")
            assert status(sid) == ("completed", BASE_NS + 70)
            # a rank not heard from yet (another node's, slow to connect) keeps its session running
            stopped = "stepwatch capture stopped (completed)"
            sock.sendall(frame(late, 0, [telemetry(late, 0, 1), telemetry(late, 0, 9, "stop", stopped)]))
            assert wait_for(lambda: count(store, "telemetry", late) == 2)
            time.sleep(1.5)  # awaited sessions are looked at every second
            assert status(late) == ("running", None)
            sock.sendall(frame(late, 1, [telemetry(late, 1, 2), telemetry(late, 1, 11, "stop", stopped)]))
            assert wait_for(lambda: status(late)[0] == "completed")
            assert status(late) == ("completed", BASE_NS + 11)
            # the worst rank's status wins; rank 1 of this world of two never comes: closed after the wait
            sock.sendall(frame(other, 0, [telemetry(other, 0, 5, "stop", "stepwatch capture stopped (interrupted)")]))
            assert wait_for(lambda: count(store, "telemetry", other) == 1)
            assert status(other) == ("running", None)
            assert wait_for(lambda: status(other)[0] == "interrupted", 20)
    finally:
        agg.stop()
    # the launcher's final word (written after the aggregator stopped) still wins
    from stepwatch.store.sqlite import SqliteStore

    with SqliteStore(store) as s:
        s.upsert_session({"session_id": sid, "status": "interrupted", "started_at_ns": None, "ended_at_ns": 123,
                          "host": None, "world_size": 2, "source": None, "command_line": None})
    assert status(sid) == ("interrupted", 123)


# -- 5. retention ---------------------------------------------------------------------------------------


def test_parse_duration() -> None:
    assert parse_duration("7d") == 7 * 86400 * 10**9
    assert parse_duration("12h") == 12 * 3600 * 10**9
    assert parse_duration("1.5m") == 90 * 10**9
    assert parse_duration("30") == 30 * 10**9
    for bad in ("", "7x", "-1d", "0s", "d"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_serve_applies_retention_while_it_runs(tmp_path: Path) -> None:
    agg = Aggregator(tmp_path / "agg", "--retention", "10s")
    store = agg.out / "history.sqlite"
    sid = "ret-" + hexid()
    try:
        # telemetry a minute apart: only the last 10 s of the rank's history stays
        rows = [telemetry(sid, 0, i * 60 * 10**9) for i in range(5)]
        raw_client(agg.tcp, encode_frame({"session_id": sid, "rank": 0}, {"telemetry": rows}), wait_close=False)
        assert wait_for(lambda: store.exists() and count(store, "telemetry", sid) == 1, timeout=15), agg.stderr()
    finally:
        stats = agg.stop()
    assert stats["retention_removed"] == 4
    assert query(store, "SELECT timestamp_ns FROM telemetry") == [(BASE_NS + 4 * 60 * 10**9,)]


def test_retention_option_is_checked(tmp_path: Path) -> None:
    bad = run_stepwatch("serve", "--out", str(tmp_path / "s"), "--retention", "soon", cwd=tmp_path)
    assert bad.returncode == 2 and "--retention" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_stepwatch("run", "--retention", "7x", "--out", str(tmp_path / "r"), "x.py", cwd=tmp_path)
    assert bad.returncode == 2 and "--retention" in bad.stderr


# -- 6. frames: global_rank, legacy envelopes, rejection details --------------------------------------


def test_global_rank_is_the_frames_rank() -> None:
    for meta, rank in (({"session_id": "s", "global_rank": 3}, 3), ({"session_id": "s", "global_rank": 3, "rank": 1}, 3),
                       ({"session_id": "s", "rank": 1, "local_rank": 0}, 1), ({"session_id": "s"}, 0)):
        body = encode_frame(meta, {"marks": []})[4:]
        assert decode_body(body).meta.get("rank", 0) == rank
        typed = decode_typed(body)
        assert typed is not None and typed[0].get("rank", 0) == rank


def test_legacy_envelope_without_session_joins_the_aggregators_own_session(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    own = str(uuid.uuid4())
    (out / "run.json").write_text(json.dumps({"session_id": own}))
    agg = Aggregator(out)
    store = out / "history.sqlite"
    try:
        legacy = msgspec.msgpack.encode({"global_rank": 2, "marks": [{"id": "m1", "name": "loss", "value": 1.0}]})
        raw_client(agg.tcp, len(legacy).to_bytes(4, "big") + legacy, wait_close=False)
        assert wait_for(lambda: store.exists() and query(store, "SELECT session_id, rank FROM marks") == [(own, 2)])
    finally:
        stats = agg.stop()
    assert stats["rejected"] == {}
    assert decode_body(legacy, "fallback").meta["session_id"] == "fallback"
    assert decode_body(encode_frame({"session_id": "mine"}, {})[4:], "fallback").meta["session_id"] == "mine"


def test_the_first_rejection_of_each_reason_is_explained_on_stderr(tmp_path: Path) -> None:
    agg = Aggregator(tmp_path / "agg")
    try:
        for rank in (-1, -2, -3):
            raw_client(agg.tcp, encode_frame({"session_id": "s", "rank": rank}, {}), wait_close=False)
        raw_client(agg.tcp, b"\x00\x00\x00\x05hello", wait_close=False)
        raw_client(agg.tcp, b"\x00\x00\x00\x05hello", wait_close=False)
        assert wait_for(lambda: agg.stderr().count("refused a frame") == 2)
        time.sleep(0.3)
    finally:
        stats = agg.stop()
    assert stats["rejected"] == {"bad_meta": 3, "not_msgpack": 2}
    lines = [line for line in agg.stderr().splitlines() if "refused a frame" in line]
    assert len(lines) == 2, lines
    assert any("(bad_meta)" in line and "-1" in line for line in lines)
    assert any("(not_msgpack)" in line for line in lines)


# -- 7. 401 says how to authenticate --------------------------------------------------------------------


def test_401_carries_www_authenticate_bearer(tmp_path: Path) -> None:
    agg = Aggregator(tmp_path / "agg", "--http-port", "0", "--token-env", "SW_T", env={"SW_T": TOKEN})
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = post(agg.http, batch([span()]), headers)
            assert resp.status == 401 and resp.headers["www-authenticate"].startswith("Bearer")
            blob = request(agg.http, "PUT", "/api/traces/blobs/snapshots/a/weights.safetensors", b"x", headers)
            assert blob.status == 401 and blob.headers["www-authenticate"].startswith("Bearer")
    finally:
        agg.stop()


# -- 8. a port in use is one clear line -------------------------------------------------------------------


@pytest.mark.parametrize("which", ["--port", "--http-port"])
def test_port_in_use_is_one_error_line(tmp_path: Path, which: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command in ([sys.executable, "-m", "stepwatch.server", "--out", str(tmp_path / "a")],
                        [*STEPWATCH, "serve", "--out", str(tmp_path / "b")]):
            extra = [which, str(port)] if which == "--port" else ["--http-port", str(port)]
            proc = subprocess.run([*command, *extra], env=clean_env(), capture_output=True, text=True, timeout=60)
            assert proc.returncode != 0
            assert "Traceback" not in proc.stderr, proc.stderr
            errors = [line for line in proc.stderr.splitlines() if "error:" in line]
            assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], proc.stderr
            assert proc.stdout == ""  # no ready line
