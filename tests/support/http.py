"""Plain HTTP requests and spool-format-v1 batches for the ingestion tests, and a threaded
aggregator the fuzz and limit tests start in-process."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from stepwatch.server.aggregator import Aggregator as AggregatorCore
from stepwatch.server.http_ingest import IngestApp
from stepwatch.store.sqlite import SqliteStore

TOKEN = "tok-" + uuid.uuid4().hex


AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<{self.status} {self.body[:200]!r}>"


def request(address: tuple[str, int], method: str, path: str, body: Any = b"",
            headers: dict[str, str] | None = None, *, chunked: bool = False) -> Response:
    conn = http.client.HTTPConnection(*address, timeout=20)
    try:
        conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
        resp = conn.getresponse()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def post(address: tuple[str, int], body: bytes | dict[str, Any], headers: dict[str, str] | None = None,
         path: str = "/v1/traces", *, gz: bool = False) -> Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(AUTH if headers is None else headers)}
    if gz:
        raw = gzip.compress(raw, mtime=0)
        headers["Content-Encoding"] = "gzip"
    return request(address, "POST", path, raw, headers)


def hexid() -> str:
    return uuid.uuid4().hex


def span(name: str = "forward", **fields: Any) -> dict[str, Any]:
    start = fields.pop("start_ns", time.time_ns())
    return {"id": hexid(), "name": name, "parent_id": None, "index": None, "start_ns": start, "end_ns": start + 1000,
            "cpu_ns": None, "gpu_ns": None, "memory_peak_bytes": None, "thread_id": 1, "pid": os.getpid(),
            "rank": 0, "attrs": {}, "mark_ids": [], **fields}


def mark(span_id: str, value: Any = 0.5, **fields: Any) -> dict[str, Any]:
    return {"id": hexid(), "span_id": span_id, "name": "loss", "value_type": "float", "value": value,
            "attrs": {"step": 1}, "ts_ns": time.time_ns(), "kind": "point", **fields}


def snapshot(span_id: str) -> dict[str, Any]:
    return {"id": hexid(), "span_id": span_id, "tensor_name": "layer.weight", "shape": [2, 2], "dtype": "float32",
            "mode": "stats", "stats": {"mean": 0.0, "std": 1.0, "min": -1.0, "max": 1.0, "norm": 2.0,
                                       "histogram": {"bins": [0.0, 1.0], "counts": [4]}},
            "blob_uri": None, "ts_ns": time.time_ns(), "attrs": {}}


def batch(spans: list[dict[str, Any]] | None = None, marks: list[dict[str, Any]] | None = None,
          snapshots: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    return {"schema_version": 1, "sdk_version": "0.3.0", "batch_id": hexid(), "created_ns": time.time_ns(),
            "spans": spans or [], "marks": marks or [], "snapshots": snapshots or [], **fields}


class ThreadServer:
    """IngestApp + Aggregator + SqliteStore on an event loop in a thread."""

    def __init__(self, run_dir: Path, *, token: str | None = TOKEN, max_body: int = 32 * 1024 * 1024,
                 max_pending_rows: int = 2_000_000, write_loop: bool = True, host: str = "127.0.0.1") -> None:
        self.run_dir = run_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.store = SqliteStore(run_dir / "history.sqlite")
        self.aggregator = AggregatorCore(self.store, max_pending_rows=max_pending_rows, tick_s=0.05)
        self.app = IngestApp(self.aggregator, run_dir=run_dir, token=token, max_body=max_body)
        self.writer: Any = None
        self.call(self._start(host, write_loop))

    async def _start(self, host: str, write_loop: bool) -> None:
        from aiohttp import web

        self.runner = web.AppRunner(self.app.build(), access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, 0).start()
        self.port = self.runner.addresses[0][1]
        if write_loop:
            self.writer = asyncio.create_task(self.aggregator.write_loop())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def close(self) -> None:
        async def stop() -> None:
            self.aggregator.stop()
            await self.runner.cleanup()
            if self.writer is not None:
                await self.writer
            await self.aggregator.flush()

        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            self.store.close()
