"""HttpExporter against a real HTTP server on 127.0.0.1 (no mocks): the wire contract of
spool-format-v1.md "Wire format: POST /v1/traces", retries, rejections, close() and resume."""

from __future__ import annotations

import email.utils
import gzip
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from stepwatch.artifacts.spool import SpoolWriter, read_spool
from stepwatch.errors import ConfigError, StepwatchError
from stepwatch.transport.http_exporter import (
    GZIP_MIN_BYTES,
    THREAD_NAME,
    UPLOADED_FILE,
    HttpExporter,
    batch_id_of,
    parse_retry_after,
)
from tests.support import free_port

KEY = "sk-test-123"
SDK = "9.9.9"

# -- a scripted trace server -------------------------------------------------------------------


@dataclass
class Seen:
    at: float  # time.monotonic() when the request arrived
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    @property
    def json_body(self) -> dict[str, Any]:
        raw = gzip.decompress(self.body) if self.header("Content-Encoding") == "gzip" else self.body
        return json.loads(raw)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        trace = self.server.trace
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        status, extra = trace.record(Seen(time.monotonic(), "POST", self.path, list(self.headers.items()), body))
        if trace.gate is not None:
            trace.gate.wait(10)
        self.send_response(status)
        for key, value in extra.items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


class _Server(HTTPServer):
    trace: TraceServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (timeout) is not a test failure; keep stderr clean


class _ThreadingServer(ThreadingHTTPServer, _Server):
    daemon_threads = True


class TraceServer:
    """Records every request; answers each with the next scripted (status, headers), then ``default``."""

    def __init__(self, port: int = 0, *, threading_: bool = True) -> None:
        self.requests: list[Seen] = []
        self.script: deque[tuple[int, dict[str, str]]] = deque()
        self.default: tuple[int, dict[str, str]] = (202, {})
        self.gate: threading.Event | None = None  # when set, handlers wait on it before answering
        self._lock = threading.Lock()
        cls = _ThreadingServer if threading_ else _Server
        self.httpd = cls(("127.0.0.1", port), _Handler)
        self.httpd.trace = self
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                       name="test-trace-server", daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def answer(self, *responses: int | tuple[int, dict[str, str]]) -> None:
        for r in responses:
            self.script.append(r if isinstance(r, tuple) else (r, {}))

    def record(self, seen: Seen) -> tuple[int, dict[str, str]]:
        with self._lock:
            self.requests.append(seen)
            return self.script.popleft() if self.script else self.default

    def ids(self) -> list[str]:
        with self._lock:
            return [r.header("X-Stepwatch-Batch-Id") or "" for r in self.requests]

    def stop(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


# -- spool batch files -------------------------------------------------------------------------

_seq = iter(range(1, 1 << 30))


def write_batch(spool: Path, *, size: int | None = None) -> tuple[Path, bytes]:
    """A spool batch file named as SpoolWriter names them; ``size``: its exact byte length."""
    batch_id = uuid.uuid4().hex
    created_ns = time.time_ns() + next(_seq)
    doc: dict[str, Any] = {
        "schema_version": 1, "sdk_version": SDK, "batch_id": batch_id, "created_ns": created_ns,
        "spans": [{"id": uuid.uuid4().hex, "name": "step", "parent_id": None, "index": 0, "start_ns": 1,
                   "end_ns": 2, "attrs": {"pad": ""}, "mark_ids": []}],
        "marks": [], "snapshots": [],
    }
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if size is not None:
        assert size >= len(raw)
        doc["spans"][0]["attrs"]["pad"] = "x" * (size - len(raw))
        raw = json.dumps(doc, separators=(",", ":")).encode()
        assert len(raw) == size
    spool.mkdir(parents=True, exist_ok=True)
    path = spool / f"{created_ns:020d}-{batch_id}.json"
    path.write_bytes(raw)
    return path, raw


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib honours *_proxy variables; the tests talk to 127.0.0.1 directly."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.fixture
def server() -> Iterator[TraceServer]:
    srv = TraceServer()
    yield srv
    srv.stop()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "spool").mkdir()
    return tmp_path


@pytest.fixture
def spool(run_dir: Path) -> Path:
    return run_dir / "spool"


@pytest.fixture
def make_exporter(run_dir: Path) -> Iterator[Callable[..., HttpExporter]]:
    made: list[HttpExporter] = []

    def make(endpoint: str, **options: Any) -> HttpExporter:
        options = {"sdk_version": SDK, "spool_root": run_dir, "backoff_s": 0.02, "max_backoff_s": 0.1,
                   "retry_after_cap_s": 5.0, "request_timeout_s": 2.0, **options}
        exporter = HttpExporter(endpoint, KEY, **options)
        made.append(exporter)
        return exporter

    yield make
    for exporter in made:
        exporter.close(0.5)
        assert exporter.errors == 0, exporter.last_error  # nothing swallowed unexpectedly


def flushed(exporter: HttpExporter, timeout: float = 5.0) -> dict[str, Any]:
    exporter.close(timeout)
    return exporter.counters()


# -- the wire contract -------------------------------------------------------------------------


def test_headers_and_gzipped_body_are_the_batch_file(server: TraceServer, make_exporter: Any, spool: Path) -> None:
    writer = SpoolWriter(spool, sdk_version=SDK)
    spans = [{"id": uuid.uuid4().hex, "name": "step", "parent_id": None, "index": i, "start_ns": i,
              "end_ns": i + 1, "attrs": {"note": "é"}, "mark_ids": []} for i in range(40)]
    (path,) = writer.write(spans, [], [])
    raw = path.read_bytes()
    assert len(raw) >= GZIP_MIN_BYTES
    exporter = make_exporter(server.endpoint)

    assert exporter.submit(path)
    assert flushed(exporter)["sent"] == 1

    (req,) = server.requests
    assert (req.method, req.path) == ("POST", "/v1/traces")
    assert req.header("Authorization") == f"Bearer {KEY}"
    assert req.header("Content-Type") == "application/json"
    assert req.header("Content-Encoding") == "gzip"
    assert req.header("X-Stepwatch-SDK-Version") == SDK
    assert req.header("X-Stepwatch-Batch-Id") == json.loads(raw)["batch_id"] == path.stem.split("-", 1)[1]
    assert req.header("Content-Length") == str(len(req.body))
    assert gzip.decompress(req.body) == raw  # the file's exact bytes
    assert req.body[4:8] == b"\0\0\0\0"  # gzip mtime 0: deterministic
    assert req.body == gzip.compress(raw, compresslevel=6, mtime=0)
    assert (spool / UPLOADED_FILE).read_text() == batch_id_of(path) + "\n"


@pytest.mark.parametrize(("size", "gzipped"), [(400, False), (GZIP_MIN_BYTES - 1, False),
                                               (GZIP_MIN_BYTES, True)])
def test_gzip_only_from_one_kib(server: TraceServer, make_exporter: Any, spool: Path, size: int,
                                gzipped: bool) -> None:
    path, raw = write_batch(spool, size=size)
    exporter = make_exporter(server.endpoint)
    exporter.submit(path)
    assert flushed(exporter)["sent"] == 1
    (req,) = server.requests
    assert (req.header("Content-Encoding") == "gzip") is gzipped
    assert (gzip.decompress(req.body) if gzipped else req.body) == raw
    assert req.header("Content-Type") == "application/json"
    assert req.header("X-Stepwatch-Batch-Id") == json.loads(raw)["batch_id"]


def test_endpoint_prefix_and_trailing_slash(server: TraceServer, make_exporter: Any, spool: Path) -> None:
    path, _ = write_batch(spool)
    exporter = make_exporter(server.endpoint + "/ingest/")
    exporter.submit(path)
    assert flushed(exporter)["sent"] == 1
    assert server.requests[0].path == "/ingest/v1/traces"


@pytest.mark.parametrize("status", [200, 202, 204])
def test_any_2xx_is_success(server: TraceServer, make_exporter: Any, spool: Path, status: int) -> None:
    server.default = (status, {})
    paths = [write_batch(spool)[0] for _ in range(3)]
    exporter = make_exporter(server.endpoint)
    for path in paths:
        exporter.submit(path)
    counts = flushed(exporter)
    assert (counts["sent"], counts["retries"], counts["failed"], counts["rejected"]) == (3, 0, 0, 0)
    assert sorted(server.ids()) == sorted(batch_id_of(p) for p in paths)
    assert exporter.pending_on_disk() == []


# -- retries -----------------------------------------------------------------------------------


def _assert_identical(requests: list[Seen]) -> None:
    first = requests[0]
    for other in requests[1:]:
        assert other.body == first.body
        assert other.headers == first.headers


def test_429_retry_after_seconds_is_honoured(server: TraceServer, make_exporter: Any, spool: Path) -> None:
    server.answer((429, {"Retry-After": "1"}))
    path, _ = write_batch(spool, size=4000)
    exporter = make_exporter(server.endpoint)
    exporter.submit(path)
    wait_until(lambda: exporter.sent == 1)
    first, second = server.requests
    assert 0.9 <= second.at - first.at < 3.0
    _assert_identical(server.requests)
    assert exporter.retries == 1


def test_429_retry_after_http_date_is_honoured(server: TraceServer, make_exporter: Any, spool: Path) -> None:
    # a date has whole seconds: "now + 2 s" truncated means a wait in (1, 2] s
    server.answer((429, {"Retry-After": email.utils.formatdate(time.time() + 2, usegmt=True)}))
    path, _ = write_batch(spool)
    exporter = make_exporter(server.endpoint)
    exporter.submit(path)
    wait_until(lambda: exporter.sent == 1)
    first, second = server.requests
    assert 0.8 <= second.at - first.at < 3.5
    _assert_identical(server.requests)


def test_retry_after_is_capped(server: TraceServer, make_exporter: Any, spool: Path) -> None:
    server.answer((429, {"Retry-After": "3600"}))
    path, _ = write_batch(spool)
    exporter = make_exporter(server.endpoint, retry_after_cap_s=0.2)
    exporter.submit(path)
    wait_until(lambda: exporter.sent == 1)
    first, second = server.requests
    assert 0.15 <= second.at - first.at < 2.0


def test_5xx_is_retried_with_backoff(server: TraceServer, make_exporter: Any, spool: Path) -> None:
    server.answer(503, 500, 202)
    path, _ = write_batch(spool, size=3000)
    exporter = make_exporter(server.endpoint, backoff_s=0.1, max_backoff_s=1.0)
    exporter.submit(path)
    wait_until(lambda: exporter.sent == 1)
    a, b, c = server.requests
    assert b.at - a.at >= 0.05  # 0.1 s with jitter x0.5-1
    assert c.at - b.at >= 0.1  # doubled
    _assert_identical(server.requests)
    assert (exporter.retries, exporter.failed) == (2, 0)


@pytest.mark.parametrize("status", [408, 500, 502, 503, 504])
def test_transient_statuses_are_retried(server: TraceServer, make_exporter: Any, spool: Path, status: int) -> None:
    server.answer(status)
    path, _ = write_batch(spool)
    exporter = make_exporter(server.endpoint)
    exporter.submit(path)
    wait_until(lambda: exporter.sent == 1)
    assert len(server.requests) == 2
    _assert_identical(server.requests)


def test_a_failed_round_keeps_the_batch_queued(server: TraceServer, make_exporter: Any, spool: Path) -> None:
    server.answer(503, 503, 503, 202)
    path, _ = write_batch(spool)
    exporter = make_exporter(server.endpoint, max_attempts=2)
    exporter.submit(path)
    wait_until(lambda: exporter.sent == 1)
    assert len(server.requests) == 4  # two rounds of two
    _assert_identical(server.requests)
    assert exporter.retries == 3
    assert exporter.pending_on_disk() == []


def test_server_down_is_retried_until_it_is_up(make_exporter: Any, spool: Path) -> None:
    port = free_port()
    path, raw = write_batch(spool)
    exporter = make_exporter(f"http://127.0.0.1:{port}", max_attempts=2)
    exporter.submit(path)
    wait_until(lambda: exporter.retries >= 4)  # several rounds refused
    assert exporter.sent == 0
    assert exporter.counters()["queued"] == 1
    assert exporter.pending_on_disk() == [path]
    assert exporter.last_error is not None and "refused" in exporter.last_error.lower()

    server = TraceServer(port)
    try:
        wait_until(lambda: exporter.sent == 1)
        (req,) = server.requests
        assert req.body == raw
        assert exporter.pending_on_disk() == []
    finally:
        server.stop()


# -- rejections --------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 413])
def test_rejected_batches_are_not_retried(server: TraceServer, make_exporter: Any, spool: Path,
                                          capfd: pytest.CaptureFixture[str], status: int) -> None:
    server.answer(status)
    bad, _ = write_batch(spool)
    good, _ = write_batch(spool)
    exporter = make_exporter(server.endpoint)
    exporter.submit(bad)
    wait_until(lambda: exporter.rejected == 1)
    exporter.submit(good)
    counts = flushed(exporter)
    assert server.ids() == [batch_id_of(bad), batch_id_of(good)]  # once each: no retry
    assert (counts["rejected"], counts["sent"], counts["retries"]) == (1, 1, 0)
    assert not exporter.disabled
    assert exporter.pending_on_disk() == [bad]  # still on disk, not marked uploaded
    assert "[stepwatch]" not in capfd.readouterr().err


@pytest.mark.parametrize(("status", "extra"), [(404, {}), (422, {}), (307, {"Location": "/v2/traces"}),
                                               (301, {"Location": "/v2/traces"})])
def test_other_client_errors_and_redirects_are_rejected(server: TraceServer, make_exporter: Any, spool: Path,
                                                        status: int, extra: dict[str, str]) -> None:
    """Re-sending the same bytes cannot fix them; urllib would replay a redirected POST as a GET."""
    server.answer((status, extra))
    path, _ = write_batch(spool)
    exporter = make_exporter(server.endpoint)
    exporter.submit(path)
    counts = flushed(exporter)
    assert [(r.method, r.path) for r in server.requests] == [("POST", "/v1/traces")]
    assert (counts["rejected"], counts["sent"]) == (1, 0)
    assert exporter.last_error is not None and str(status) in exporter.last_error


@pytest.mark.parametrize("status", [401, 403])
def test_bad_key_is_warned_once_and_stops_sending(server: TraceServer, make_exporter: Any, spool: Path,
                                                  capfd: pytest.CaptureFixture[str], status: int) -> None:
    server.default = (status, {})
    paths = [write_batch(spool)[0] for _ in range(3)]
    exporter = make_exporter(server.endpoint)
    for path in paths:
        exporter.submit(path)
    wait_until(lambda: exporter.disabled)
    late, _ = write_batch(spool)
    assert exporter.submit(late) is False
    counts = flushed(exporter)
    assert len(server.requests) == 1
    assert (counts["rejected"], counts["sent"], counts["retries"]) == (1, 0, 0)
    assert counts["dropped"] == 3 and counts["drops"] == {"bad_key": 3}
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[stepwatch]")]
    assert len(lines) == 1, err
    assert str(status) in lines[0] and "API key" in lines[0]
    assert KEY not in err
    assert len(exporter.pending_on_disk()) == 4


# -- close -------------------------------------------------------------------------------------


def test_close_uploads_the_last_batch_before_returning(server: TraceServer, make_exporter: Any,
                                                       spool: Path) -> None:
    exporter = make_exporter(server.endpoint)
    for _ in range(5):
        exporter.submit(write_batch(spool)[0])
    last, raw = write_batch(spool, size=2048)
    exporter.submit(last)
    exporter.close(5.0)
    assert batch_id_of(last) in server.ids()
    assert gzip.decompress(server.requests[server.ids().index(batch_id_of(last))].body) == raw
    assert (exporter.sent, exporter.failed) == (6, 0)
    assert exporter.pending_on_disk() == []


def test_close_sends_the_last_batch_first_after_an_outage(make_exporter: Any, spool: Path) -> None:
    """The server was down (the exporter is cooling down for 30 s) and comes back just before the
    end of the run: close() must not wait out the cool-down, and the session batch goes first."""
    port = free_port()
    exporter = make_exporter(f"http://127.0.0.1:{port}", backoff_s=30.0, max_backoff_s=30.0)
    backlog = [write_batch(spool)[0] for _ in range(3)]
    for path in backlog:
        exporter.submit(path)
    wait_until(lambda: exporter.last_error is not None)  # refused once, now backing off
    server = TraceServer(port)
    try:
        last, _ = write_batch(spool)
        exporter.submit(last)
        started = time.monotonic()
        exporter.close(5.0)
        assert time.monotonic() - started < 3.0
        assert server.ids()[0] == batch_id_of(last)
        assert sorted(server.ids()) == sorted(batch_id_of(p) for p in [*backlog, last])
        assert (exporter.sent, exporter.failed) == (4, 0)
    finally:
        server.stop()


def test_close_gives_up_at_the_deadline_and_counts_what_is_left(make_exporter: Any, spool: Path) -> None:
    exporter = make_exporter(f"http://127.0.0.1:{free_port()}", backoff_s=30.0, max_backoff_s=30.0)
    paths = [write_batch(spool)[0] for _ in range(3)]
    for path in paths:
        exporter.submit(path)
    started = time.monotonic()
    exporter.close(0.5)
    assert time.monotonic() - started < 1.5
    assert (exporter.sent, exporter.failed) == (0, 3)
    assert exporter.pending_on_disk() == paths  # a later process can resume them
    exporter.close(0.5)  # idempotent
    assert exporter.failed == 3


def test_close_without_batches_makes_no_request(server: TraceServer, make_exporter: Any) -> None:
    before = set(threading.enumerate())
    exporter = make_exporter(server.endpoint)
    started = time.monotonic()
    exporter.close(2.0)
    assert time.monotonic() - started < 0.5
    assert server.requests == []
    assert not [t for t in set(threading.enumerate()) - before if t.name == THREAD_NAME]  # no thread started


def test_submit_after_close_is_counted(server: TraceServer, make_exporter: Any, spool: Path) -> None:
    exporter = make_exporter(server.endpoint)
    exporter.close(1.0)
    assert exporter.submit(write_batch(spool)[0]) is False
    assert exporter.drops == {"closed": 1}
    assert server.requests == []


# -- bounded, background, fail-open ------------------------------------------------------------


def test_one_named_daemon_thread_does_the_work(server: TraceServer, make_exporter: Any, spool: Path) -> None:
    exporter = make_exporter(server.endpoint)
    for _ in range(3):
        exporter.submit(write_batch(spool)[0])
    wait_until(lambda: exporter.sent == 3)
    workers = [t for t in threading.enumerate() if t.name == THREAD_NAME]
    assert len(workers) == 1 and workers[0].daemon
    exporter.close(2.0)
    workers[0].join(2.0)
    assert not workers[0].is_alive()


def test_queue_overflow_is_counted_and_submit_never_waits(server: TraceServer, make_exporter: Any,
                                                          spool: Path) -> None:
    server.gate = threading.Event()  # the server holds the first request
    exporter = make_exporter(server.endpoint, max_queue=2, request_timeout_s=8.0)
    first, _ = write_batch(spool)
    exporter.submit(first)
    wait_until(lambda: len(server.requests) == 1)
    rest = [write_batch(spool)[0] for _ in range(4)]
    started = time.monotonic()
    for path in rest:
        assert exporter.submit(path)
    assert time.monotonic() - started < 0.2  # only enqueues, while a request hangs
    assert exporter.dropped == 2 and exporter.drops == {"queue_full": 2}
    server.gate.set()
    counts = flushed(exporter)
    assert counts["sent"] == 3
    # the oldest were dropped (the newest, which may hold the session span, got in); on disk still
    assert sorted(server.ids()) == sorted(batch_id_of(p) for p in [first, *rest[2:]])
    assert exporter.pending_on_disk() == rest[:2]


def test_nothing_raises_into_the_caller(server: TraceServer, make_exporter: Any, spool: Path,
                                        capfd: pytest.CaptureFixture[str]) -> None:
    from stepwatch.guard import reset_swallowed

    exporter = make_exporter(server.endpoint)
    exporter.submit(spool / f"{time.time_ns():020d}-{uuid.uuid4().hex}.json")  # evicted before its turn
    exporter.close(2.0)
    assert exporter.drops == {"evicted": 1}
    assert server.requests == []

    broken = make_exporter(server.endpoint)
    try:
        assert broken.submit(None) is False  # type: ignore[arg-type]
        assert broken.errors == 1
        assert "[stepwatch] internal error" in capfd.readouterr().err
    finally:
        broken.errors = 0
        reset_swallowed()


def test_thread_start_failure_at_shutdown_still_flushes(spool: Path, run_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    server = TraceServer(threading_=False)  # serves on its own thread, started before the fault
    try:
        def refuse(self: threading.Thread) -> None:
            raise RuntimeError("can't create new thread at interpreter shutdown")

        exporter = HttpExporter(server.endpoint, KEY, sdk_version=SDK, spool_root=run_dir)
        path, _ = write_batch(spool)
        monkeypatch.setattr(threading.Thread, "start", refuse)
        assert exporter.submit(path)
        monkeypatch.undo()
        exporter.close(3.0)  # drains on the caller's thread
        assert server.ids() == [batch_id_of(path)]
        assert (exporter.sent, exporter.errors) == (1, 0)
    finally:
        server.stop()


# -- .uploaded and resume ----------------------------------------------------------------------


def test_uploaded_file_is_respected_by_a_later_exporter(server: TraceServer, make_exporter: Any,
                                                        spool: Path) -> None:
    a, _ = write_batch(spool)
    b, _ = write_batch(spool)
    first = make_exporter(server.endpoint)
    first.submit(a)
    first.submit(b)
    first.close(5.0)
    assert (spool / UPLOADED_FILE).read_text().splitlines() == [batch_id_of(a), batch_id_of(b)]
    (spool / UPLOADED_FILE).write_bytes((spool / UPLOADED_FILE).read_bytes() + b"0123")  # a torn line

    c, _ = write_batch(spool)
    second = make_exporter(server.endpoint)
    assert second.pending_on_disk() == [c]
    assert second.submit(a) is False and second.skipped == 1  # not sent again
    assert second.resume() == 1
    second.close(5.0)
    assert server.ids() == [batch_id_of(p) for p in (a, b, c)]
    assert second.pending_on_disk() == []
    assert (spool / UPLOADED_FILE).read_text().splitlines()[-1] == batch_id_of(c)
    assert len(read_spool(spool).spans) == 3  # the spool's readers ignore .uploaded


# -- construction and parsing ------------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "key"), [
    ("", KEY), ("   ", KEY), ("http://127.0.0.1:9", ""), ("ftp://example.com", KEY), ("example.com", KEY),
    ("http://127.0.0.1:9", "two words"), ("http://127.0.0.1:9", "key\r\nX-Injected: 1"),
])
def test_constructor_refuses_missing_or_bad_settings(run_dir: Path, endpoint: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        HttpExporter(endpoint, key, sdk_version=SDK, spool_root=run_dir)
    assert isinstance(info.value, StepwatchError)
    assert not key or key not in str(info.value)


@pytest.mark.parametrize("option", [{"max_queue": 0}, {"max_attempts": 0}, {"backoff_s": -1},
                                    {"request_timeout_s": 0}, {"retry_after_cap_s": float("inf")}])
def test_constructor_refuses_bad_bounds(run_dir: Path, option: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        HttpExporter("http://127.0.0.1:9", KEY, spool_root=run_dir, **option)


def test_spool_root_may_be_the_run_dir_or_the_spool_dir(run_dir: Path) -> None:
    assert HttpExporter("http://h", KEY, spool_root=run_dir).spool_dir == run_dir / "spool"
    assert HttpExporter("http://h", KEY, spool_root=run_dir / "spool").spool_dir == run_dir / "spool"


def test_parse_retry_after() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("5") == 5.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), now=now) == 30.0
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now=now) == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("") is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None


# -- end to end through the runtime ------------------------------------------------------------


@pytest.mark.real
def test_a_real_run_uploads_its_session_span(server: TraceServer, tmp_path: Path) -> None:
    """The mistake of the SDK this replaces: the batch sealed at shutdown holds the session span."""
    script = textwrap.dedent(f"""
        import stepwatch
        stepwatch.init({str(tmp_path / "run")!r}, endpoint={server.endpoint!r}, api_key={KEY!r},
                       handle_signals=False, capture_oom=False, auto_instrument=False)
        stepwatch.mark("loss", 0.5)
        stepwatch.shutdown(timeout=5.0)
    """)
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("STEPWATCH_")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names = {span["name"] for req in server.requests for span in req.json_body["spans"]}
    assert "stepwatch.session" in names, (names, done.stderr)
    uploaded = (tmp_path / "run" / "spool" / UPLOADED_FILE).read_text().split()
    on_disk = sorted(batch_id_of(p) for p in (tmp_path / "run" / "spool").glob("[0-9]*-*.json"))
    assert sorted(uploaded) == on_disk == sorted(server.ids())
