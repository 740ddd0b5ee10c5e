"""Trace ingestion over HTTP (spool-format-v1 "Wire format", and the SDK's real paths): the
aggregator process with --http-port and --token-env, in-thread servers for small limits, a
fuzzed endpoint, and the real cirron SDK uploading from a torch loop."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.server.http_ingest import OPENAPI
from stepwatch.store.sqlite import SqliteStore
from tests.support import examples
from tests.support.aggregator import Aggregator, query, wait_for
from tests.support.http import AUTH, TOKEN, ThreadServer, batch, hexid, mark, post, request, snapshot, span

pytestmark = pytest.mark.real  # every test here starts a process or trains a model


def full_batch() -> dict[str, Any]:
    step = span("step", index=7, attrs={"step_ns": 900, "forward_ns": 300, "backward_ns": 400,
                                        "optimizer_step_ns": 100, "data_load_ns": 50})
    child = span("forward", parent_id=step["id"])
    return batch([child, step], [mark(step["id"])], [snapshot(step["id"])])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    agg = Aggregator(tmp_path_factory.mktemp("http") / "agg", "--http-port", "0", "--token-env", "SW_TEST_TOKEN",
                     env={"SW_TEST_TOKEN": TOKEN})
    yield agg
    stats = agg.stop()
    assert "Traceback" not in agg.stderr(), agg.stderr()
    assert stats["write_errors"] == 0


def session_header() -> dict[str, str]:
    return {**AUTH, "X-Stepwatch-Session-Id": "http-" + hexid()}


def count(server: Aggregator, table: str, session_id: str) -> int:
    store = server.out / "history.sqlite"
    if not store.exists():
        return 0
    return query(store, f"SELECT COUNT(*) FROM {table} WHERE session_id = ?", (session_id,))[0][0]


# -- the contract -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/traces", "/api/traces"])
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_batch_is_accepted_and_stored(server: Aggregator, path: str, gz: bool) -> None:
    headers = session_header()
    sid = headers["X-Stepwatch-Session-Id"]
    body = full_batch()
    resp = post(server.http, body, headers, path, gz=gz)
    assert resp.status == 202, resp
    assert resp.json() == {"batch_id": body["batch_id"]}
    assert wait_for(lambda: count(server, "snapshots", sid) == 1)
    store = server.out / "history.sqlite"
    assert count(server, "spans", sid) == 2 and count(server, "marks", sid) == 1
    steps = query(store, "SELECT step, step_ns, forward_ns, backward_ns, optimizer_ns, data_load_ns FROM steps "
                         "WHERE session_id = ?", (sid,))
    assert steps == [(7, 900, 300, 400, 100, 50)]
    (source, status), = query(store, "SELECT source, status FROM sessions WHERE session_id = ?", (sid,))
    assert (source, status) == ("stepwatch.http", "running")


def test_large_batch_arriving_in_many_segments(server: Aggregator) -> None:
    headers = session_header()
    sid = headers["X-Stepwatch-Session-Id"]
    spans = [span(attrs={"pad": "x" * 300}) for _ in range(3000)]  # about 1.3 MB of JSON
    assert post(server.http, batch(spans), headers).status == 202
    # no Content-Length: a chunked body in 7-byte pieces is read to its end
    raw = json.dumps(batch([span() for _ in range(3)])).encode()
    chunked = request(server.http, "POST", "/v1/traces", iter([raw[i:i + 7] for i in range(0, len(raw), 7)]),
                      {**headers, "Content-Type": "application/json"}, chunked=True)
    assert chunked.status == 202, chunked
    assert wait_for(lambda: count(server, "spans", sid) == 3003)


def test_repeated_batch_id_is_a_duplicate_stored_once(server: Aggregator) -> None:
    headers = session_header()
    sid = headers["X-Stepwatch-Session-Id"]
    body = full_batch()
    first = post(server.http, body, headers)
    again = post(server.http, body, headers, "/api/traces", gz=True)
    assert first.status == again.status == 202
    assert first.json() == {"batch_id": body["batch_id"]}
    assert again.json() == {"batch_id": body["batch_id"], "duplicate": True}
    assert wait_for(lambda: count(server, "marks", sid) == 1)
    time.sleep(0.5)  # a second copy would have been written by now
    assert count(server, "spans", sid) == 2 and count(server, "marks", sid) == 1


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": "Bearer "},
], ids=["none", "wrong", "no-scheme", "basic", "longer", "empty"])
def test_missing_or_wrong_token_is_401(server: Aggregator, headers: dict[str, str]) -> None:
    body = full_batch()
    resp = post(server.http, body, headers)
    assert resp.status == 401 and resp.json()["error"]
    blob = request(server.http, "PUT", "/api/traces/blobs/snapshots/abc/weights.safetensors", b"x", headers)
    assert blob.status == 401
    assert not (server.out / "blobs" / "snapshots" / "abc").exists()


def test_bearer_scheme_is_case_insensitive(server: Aggregator) -> None:
    assert post(server.http, full_batch(), {"Authorization": f"bearer {TOKEN}"}).status == 202


BAD_BODIES: list[tuple[str, Any, str]] = [
    ("not-json", b"{nope", "JSON"),
    ("not-utf8", b'{"a": "\xff"}', "JSON"),
    ("array", [1, 2], "object"),
    ("string", "batch", "object"),
    ("no-schema-version", {k: v for k, v in batch().items() if k != "schema_version"}, "schema_version"),
    ("schema-version-2", batch(schema_version=2), "schema_version"),
    ("schema-version-str", batch(schema_version="1"), "schema_version"),
    ("no-batch-id", {k: v for k, v in batch().items() if k != "batch_id"}, "batch_id"),
    ("batch-id-upper", batch(batch_id=hexid().upper()), "batch_id"),
    ("batch-id-short", batch(batch_id="abc"), "batch_id"),
    ("batch-id-int", batch(batch_id=12), "batch_id"),
    ("batch-id-dashes", batch(batch_id=str(uuid.uuid4())), "batch_id"),
    ("spans-not-list", batch(spans={"id": "x"}), "spans"),
    ("spans-of-strings", batch(spans=["x"]), "spans"),
    ("marks-not-list", batch(marks="x"), "marks"),
    ("snapshots-not-list", batch(snapshots=5), "snapshots"),
    ("span-no-id", batch([{k: v for k, v in span().items() if k != "id"}]), "id"),
    ("span-no-name", batch([{k: v for k, v in span().items() if k != "name"}]), "name"),
    ("span-no-start", batch([{k: v for k, v in span().items() if k != "start_ns"}]), "start_ns"),
    ("span-no-end", batch([{k: v for k, v in span().items() if k != "end_ns"}]), "end_ns"),
    ("span-start-float", batch([span(start_ns=1.5)]), "start_ns"),
    ("mark-no-id", batch(marks=[{k: v for k, v in mark("x").items() if k != "id"}]), "mark"),
    ("snapshot-no-id", batch(snapshots=[{k: v for k, v in snapshot("x").items() if k != "id"}]), "snapshot"),
    ("span-start-over-64-bits", batch([span(start_ns=2**63)]), "64-bit"),
    ("span-name-object", batch([span(name={"a": 1})]), "stored"),
    ("step-attrs-not-object", batch([span("step", attrs=["step_ns"])]), "stored"),
    ("step-ns-text", batch([span("step", attrs={"step_ns": "fast"})]), "stored"),
    ("deeply-nested", b'{"schema_version": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON"),
]


@pytest.mark.parametrize(("body", "fragment"), [(b, f) for _, b, f in BAD_BODIES], ids=[i for i, _, _ in BAD_BODIES])
def test_malformed_batches_are_400_with_a_reason(server: Aggregator, body: Any, fragment: str) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = post(server.http, raw)
    assert resp.status == 400, resp
    assert fragment in resp.json()["error"]


def test_bad_encodings_are_400(server: Aggregator) -> None:
    raw = json.dumps(full_batch()).encode()
    not_gzip = post(server.http, raw, {**AUTH, "Content-Encoding": "gzip"})
    assert not_gzip.status == 400 and "gzip" in not_gzip.json()["error"]
    truncated = post(server.http, gzip.compress(raw)[:-12], {**AUTH, "Content-Encoding": "gzip"})
    assert truncated.status == 400 and "gzip" in truncated.json()["error"]
    brotli = post(server.http, raw, {**AUTH, "Content-Encoding": "br"})
    assert brotli.status == 400 and "Content-Encoding" in brotli.json()["error"]


def test_rejected_batch_leaves_no_rows_and_the_writer_keeps_going(server: Aggregator) -> None:
    headers = session_header()
    sid = headers["X-Stepwatch-Session-Id"]
    good = span()
    bad = batch([good, span(end_ns=2**64 - 1)])
    assert post(server.http, bad, headers).status == 400
    body = full_batch()
    assert post(server.http, body, headers).status == 202
    assert wait_for(lambda: count(server, "spans", sid) == 2)
    ids = {r[0] for r in query(server.out / "history.sqlite", "SELECT span_id FROM spans WHERE session_id = ?", (sid,))}
    assert good["id"] not in ids
    # the rejected batch id was not remembered: once fixed it is accepted
    fixed = {**bad, "spans": [good]}
    assert post(server.http, fixed, headers).json() == {"batch_id": bad["batch_id"]}


def test_blob_upload_is_stored_under_its_key(server: Aggregator) -> None:
    span_id = hexid()
    data = os.urandom(4096)
    resp = request(server.http, "PUT", f"/api/traces/blobs/snapshots/{span_id}/weights.safetensors", data,
                   {**AUTH, "Content-Type": "application/octet-stream",
                    "X-Cirron-Blob-Key": f"snapshots/{span_id}/weights.safetensors"})
    assert resp.status == 201, resp
    stored = server.out / "blobs" / "snapshots" / span_id / "weights.safetensors"
    assert stored.read_bytes() == data
    assert resp.headers["location"] == stored.resolve().as_uri()
    again = request(server.http, "PUT", f"/api/traces/blobs/snapshots/{span_id}/weights.safetensors", b"new", AUTH)
    assert again.status == 201 and stored.read_bytes() == b"new"
    assert not list(stored.parent.glob(".*tmp"))


@pytest.mark.parametrize("key", [
    "snapshots/../../escape.safetensors", "../escape", "snapshots/%2e%2e/%2e%2e/escape", "snapshots/a/..%2f..%2fescape",
    "snapshots/.hidden/x", "snapshots//x", "snapshots/a%20b/x", "%2Fetc%2Fescape",
])
def test_blob_keys_that_leave_the_blob_folder_are_refused(server: Aggregator, key: str) -> None:
    resp = request(server.http, "PUT", f"/api/traces/blobs/{key}", b"evil", AUTH)
    assert resp.status in (400, 404), resp
    assert not list(server.out.parent.rglob("escape*"))
    assert not (Path("/etc/escape")).exists()


def test_openapi_document(server: Aggregator) -> None:
    resp = request(server.http, "GET", "/openapi.json")
    assert resp.status == 200
    doc = resp.json()
    assert doc == json.loads(json.dumps(OPENAPI))
    from openapi_spec_validator import validate  # type: ignore[import-not-found]

    validate(doc)
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["title"] and doc["info"]["version"]
    served = {("/v1/traces", "post"), ("/api/traces", "post"), ("/api/traces/blobs/{key}", "put"),
              ("/healthz", "get"), ("/openapi.json", "get")}
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert served <= documented
    for path, ops in doc["paths"].items():
        assert path.startswith("/")
        for method, op in ops.items():
            assert method in {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
            assert op["responses"] and all(code.isdigit() and "description" in r for code, r in op["responses"].items())
            for template in [part[1:-1] for part in path.split("/") if part.startswith("{")]:
                assert any(p["name"] == template and p["in"] == "path" and p["required"] for p in op["parameters"])
            for name in op.get("security", []):
                assert set(name) <= set(doc["components"]["securitySchemes"])
    for code in ("202", "400", "401", "413", "429"):
        assert code in doc["paths"]["/v1/traces"]["post"]["responses"]

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    for ref in refs(doc):
        target: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        assert isinstance(target, dict)
    batch_schema = doc["components"]["schemas"]["Batch"]
    assert {"schema_version", "batch_id", "spans", "marks", "snapshots"} <= set(batch_schema["required"])


def test_healthz_counts(server: Aggregator) -> None:
    # its own accepted and refused requests: under xdist the module's other tests may run elsewhere
    assert post(server.http, full_batch(), session_header()).status == 202
    assert post(server.http, full_batch(), {"Authorization": "Bearer wrong"}).status == 401
    resp = request(server.http, "GET", "/healthz")
    assert resp.status == 200
    health = resp.json()
    assert health["ok"] is True and health["http_accepted"] >= 1 and "401" in health["http_rejected"]


# -- in-thread servers: small limits, no token, a full queue ----------------------------------------




@pytest.fixture
def small(tmp_path: Path):
    srv = ThreadServer(tmp_path, max_body=64 * 1024)
    yield srv
    srv.close()


def test_body_over_the_limit_is_413(small: ThreadServer) -> None:
    limit = small.app.max_body
    padded = batch([span(attrs={"pad": "x" * limit})])
    resp = post(small.address, padded)
    assert resp.status == 413 and "limit" in resp.json()["error"]
    # the same size without a Content-Length (chunked)
    raw = json.dumps(padded).encode()
    chunked = request(small.address, "POST", "/v1/traces", iter([raw[i:i + 8192] for i in range(0, len(raw), 8192)]),
                      {**AUTH, "Content-Type": "application/json"}, chunked=True)
    assert chunked.status == 413
    # a gzip bomb: small on the wire, over the limit once inflated
    bomb = gzip.compress(json.dumps(batch([span(attrs={"pad": " " * (limit * 20)})])).encode())
    assert len(bomb) < limit
    resp = post(small.address, bomb, {**AUTH, "Content-Encoding": "gzip"})
    assert resp.status == 413 and "decompressed" in resp.json()["error"]
    blob = request(small.address, "PUT", "/api/traces/blobs/snapshots/a/weights.safetensors", b"x" * (limit + 1), AUTH)
    assert blob.status == 413
    assert small.app.rejected == {413: 4}
    # just under the limit is fine, plain and gzip
    fits = batch([span(attrs={"pad": "y" * (limit - 1000)})])
    assert len(json.dumps(fits)) <= limit
    assert post(small.address, fits).status == 202
    assert post(small.address, batch([span(attrs={"pad": "z" * (limit - 1000)})]), gz=True).status == 202


def test_no_token_configured_allows_loopback_only(tmp_path: Path) -> None:
    srv = ThreadServer(tmp_path, token=None, host="0.0.0.0")
    try:
        body = full_batch()
        assert post(srv.address, body, {}).status == 202
        assert post(srv.address, full_batch(), {"Authorization": "Bearer anything"}).status == 202
        others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")]
        for ip in others:
            resp = post((ip, srv.port), full_batch(), {})
            assert resp.status == 403, resp
            assert "loopback" in resp.json()["error"]
    finally:
        srv.close()
    assert srv.store.path.exists()


def test_full_write_queue_is_429_with_retry_after(tmp_path: Path) -> None:
    srv = ThreadServer(tmp_path, max_pending_rows=1, write_loop=False)
    try:
        first = full_batch()
        assert post(srv.address, first).status == 202
        assert srv.aggregator.full
        busy = post(srv.address, full_batch())
        assert busy.status == 429, busy
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["error"]
        assert post(srv.address, first).json()["duplicate"] is True  # known batches stay idempotent
        assert srv.call(srv.aggregator.flush()) == 5  # 2 spans, the step row, a mark, a snapshot
        assert post(srv.address, full_batch()).status == 202
    finally:
        srv.close()
    with SqliteStore(tmp_path / "history.sqlite", read_only=True) as store:
        assert store.count("spans") == 4


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory):
    srv = ThreadServer(tmp_path_factory.mktemp("fuzz"), max_body=16 * 1024)
    yield srv
    srv.close()


_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                          st.text(max_size=10))
_json = st.recursive(_json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=16)
_span_keys = st.sampled_from(["id", "name", "parent_id", "index", "start_ns", "end_ns", "rank", "attrs", "gpu_ns",
                              "thread_id", "pid", "value", "value_nonfinite", "span_id", "ts_ns", "kind"])
_records = st.dictionaries(_span_keys, st.one_of(_json_scalars, st.just("step"), st.dictionaries(
    st.sampled_from(["step_ns", "forward_ns", "x"]), _json_scalars, max_size=3)), max_size=10)
_batches = st.fixed_dictionaries(
    {"schema_version": st.one_of(st.just(1), _json_scalars),
     "batch_id": st.one_of(st.uuids().map(lambda u: u.hex), st.text(max_size=40))},
    optional={"spans": st.one_of(st.lists(_records, max_size=3), _json), "marks": st.one_of(st.lists(_records, max_size=3), _json),
              "snapshots": st.one_of(st.lists(_records, max_size=3), _json), "sdk_version": _json, "created_ns": _json})
_bodies = st.one_of(st.binary(max_size=64), _json.map(lambda v: json.dumps(v).encode()),
                    _batches.map(lambda v: json.dumps(v).encode()))
_headers = st.fixed_dictionaries({}, optional={
    "Authorization": st.sampled_from([f"Bearer {TOKEN}", f"Bearer {TOKEN}", "Bearer nope", "", "Basic x"]),
    "Content-Type": st.sampled_from(["application/json", "text/plain", "application/octet-stream"]),
    "X-Stepwatch-Session-Id": st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20),
    "X-Cirron-Batch-Id": st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
})


@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.function_scoped_fixture])
@given(body=_bodies, headers=_headers, encoding=st.sampled_from(["none", "gzip", "gzip-label-only", "deflate"]),
       path=st.sampled_from(["/v1/traces", "/api/traces"]))
def test_fuzz_endpoint_never_500(fuzz_server: ThreadServer, body: bytes, headers: dict[str, str], encoding: str,
                                 path: str) -> None:
    headers = dict(headers)
    if encoding == "gzip":
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    elif encoding in ("gzip-label-only", "deflate"):
        headers["Content-Encoding"] = "gzip" if encoding == "gzip-label-only" else "deflate"
    resp = request(fuzz_server.address, "POST", path, body, headers)
    assert resp.status in (202, 400, 401, 413), resp
    assert isinstance(resp.json(), dict)


def test_fuzzed_server_still_writes(fuzz_server: ThreadServer) -> None:
    headers = session_header()
    sid = headers["X-Stepwatch-Session-Id"]
    assert post(fuzz_server.address, full_batch(), headers).status == 202
    assert wait_for(lambda: fuzz_server.store.count("spans", sid) == 2)
    assert fuzz_server.aggregator.write_errors == 0
    assert fuzz_server.writer is not None and not fuzz_server.writer.done()


# -- interop: the real cirron SDK ---------------------------------------------------------------------

CIRRON_LOOP = textwrap.dedent("""
    import cirron as ci
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    ci.profile(frameworks=["torch"], flush_interval=0.2, snapshots="full")
    torch.manual_seed(0)
    x = torch.randn(192, 4)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
    model = ci.watch(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(3):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ci.mark("loss", loss.item())
        import time; time.sleep(0.3)
    ci.flush()
    time.sleep(0.5)
    ci.shutdown()
""")


def test_cirron_sdk_uploads_into_the_history(server: Aggregator, tmp_path: Path) -> None:
    pytest.importorskip("cirron")
    pytest.importorskip("torch")
    script = tmp_path / "loop.py"
    script.write_text(CIRRON_LOOP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CIRRON_")}
    env.update(CIRRON_API_KEY=TOKEN, CIRRON_API_ENDPOINT=f"http://{server.http[0]}:{server.http[1]}",
               CIRRON_OUTPUT_DIR=str(tmp_path / ".cirron"), HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "rejected" not in proc.stderr and "auth failed" not in proc.stderr, proc.stderr
    batches = [json.loads(p.read_text()) for p in sorted((tmp_path / ".cirron" / "spool").glob("*.json"))]
    assert len(batches) >= 3
    store = server.out / "history.sqlite"
    sdk_spans = {s["id"]: s for b in batches for s in b["spans"]}
    # the SDK never uploads its last batch (spool-current-practice.md); every earlier one must be stored
    expected = {s["id"] for b in batches[:-1] for s in b["spans"]}
    expected_marks = {m["id"] for b in batches[:-1] for m in b["marks"]}

    def stored() -> set[str]:
        return {r[0] for r in query(store, f"SELECT span_id FROM spans WHERE span_id IN ({','.join('?' * len(sdk_spans))})", tuple(sdk_spans))}

    assert wait_for(lambda: expected <= stored()), (len(expected), len(stored()))
    sessions = query(store, f"SELECT DISTINCT session_id FROM spans WHERE span_id IN ({','.join('?' * len(expected))})",
                     tuple(expected))
    assert len(sessions) == 1  # one uploading process, one session
    (sid,), = sessions
    names = dict(query(store, "SELECT name, COUNT(*) FROM spans WHERE session_id = ? GROUP BY name", (sid,)))
    assert names.get("step", 0) >= 6 and names.get("forward", 0) >= 6 and names.get("optimizer_step", 0) >= 6
    # the SDK's step spans carry no breakdown: their step rows come from the span tree
    steps = query(store, "SELECT step_ns, forward_ns, backward_ns, optimizer_ns, data_load_ns FROM steps "
                         "WHERE session_id = ?", (sid,))
    assert len(steps) >= 6 and all(s[0] > 0 and s[1] > 0 and s[2] > 0 and s[3] > 0 for s in steps), steps
    marks = {r[0] for r in query(store, "SELECT mark_id FROM marks WHERE session_id = ? AND name = 'loss'", (sid,))}
    assert expected_marks <= marks and marks
    snaps = query(store, "SELECT tensor_name, blob_uri FROM snapshots WHERE session_id = ?", (sid,))
    assert snaps
    blobs = sorted((server.out / "blobs" / "snapshots").rglob("*.safetensors"))
    assert blobs, "the SDK uploads snapshot blobs with PUT"
    stored_uris = {b.resolve().as_uri() for b in blobs}
    # a blob the SDK could not upload in time (its PUT timed out on a loaded machine) keeps the
    # SDK's own file:// URI under CIRRON_OUTPUT_DIR: that is the SDK's fallback, not ours
    local = (tmp_path / ".cirron").resolve().as_uri()
    uploaded = {uri for _, uri in snaps if uri and not uri.startswith(local)}
    assert uploaded and uploaded <= stored_uris  # blob_uri is where the aggregator put the blob
