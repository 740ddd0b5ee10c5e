"""Trace ingestion over HTTP (spool-format-v1.md "Wire format"): ``POST /v1/traces``, and the
paths the real SDK uses today, ``POST /api/traces`` and ``PUT /api/traces/blobs/<key>``
(spool-current-practice.md "Uploads"), so an unmodified SDK can upload into the history.

Contract: bearer-token auth (no token configured: loopback clients only), gzip bodies,
``202 Accepted`` with the batch id, idempotent by batch id for 24 hours, ``400`` with a reason,
``413`` over the size limit (compressed or not), ``429`` with ``Retry-After`` when the write
queue is full (its hard bound, or its pause bound still reached after ``ROOM_WAIT_S`` of waiting
for the writer). ``GET /openapi.json`` serves the OpenAPI description of all of it.

Batches are decoded straight into the aggregator's typed wire rows when they fit them (the
usual case); anything else goes through the general JSON path, which stores or refuses it.

Idempotence survives a restart: the batch ids are stored with their rows (``ingest_batches``, in
the same transaction) and read back when the app starts.

Sessions: the ``X-Stepwatch-Session-Id`` header names one; otherwise every batch of one
uploading process lands in one session. A batch with spans is keyed by (token, client address,
the spans' pid); a batch that refers to a span an earlier batch brought or named as a parent
(its marks' and snapshots' ``span_id``, its spans' ``parent_id``) joins that batch's session, so
a marks-only batch (no pid to read) still lands with its process's spans; failing both, the last
session of the same client.
"""

from __future__ import annotations

import gzip
import hmac
import ipaddress
import re
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import msgspec

from ..errors import StoreError, TransportError
from ..log import logger
from ..transport.frames import WireMark, WireSpan, WireTables
from .aggregator import Aggregator

__all__ = ["IngestApp", "OPENAPI"]

DEDUPE_WINDOW_S = 24 * 3600
SPAN_MEMORY = 200_000  # span ids remembered for session assignment (oldest forgotten first)
ROOM_WAIT_S = 5.0  # how long an upload waits for the writer to catch up before it is told 429
_BLOB_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")
_BATCH_ID = re.compile(r"[0-9a-f]{32}")
_decoder = msgspec.json.Decoder()


class _TypedBatch(msgspec.Struct, gc=False):
    """A spool batch decoded straight into the aggregator's typed wire rows (``decode_typed``'s
    HTTP twin). Whatever does not fit these types goes through ``IngestApp._batch`` instead."""

    schema_version: Any = None
    batch_id: Any = None
    sdk_version: Any = None
    spans: list[WireSpan] = []
    marks: list[WireMark] = []
    snapshots: list[dict[str, Any]] = []


_typed_decoder = msgspec.json.Decoder(_TypedBatch)


class _Reject(Exception):
    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers or {}


def _json_error(status: int, reason: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"],
            "description": reason}


OPENAPI: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "stepwatch trace ingestion", "version": "1"},
    "paths": {
        path: {
            "post": {
                "summary": "Ingest one spool batch (spool-format-v1)",
                "security": [{"bearer": []}],
                "parameters": [
                    {"name": "Content-Encoding", "in": "header", "required": False,
                     "schema": {"type": "string", "enum": ["gzip", "identity"]}},
                    {"name": "X-Stepwatch-Session-Id", "in": "header", "required": False, "schema": {"type": "string"}},
                ],
                "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Batch"}}}},
                "responses": {
                    "202": {"description": "Accepted (also for a batch already received)",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Accepted"}}}},
                    "400": {"description": "Malformed body", "content": {"application/json": {"schema": _json_error(400, "why")}}},
                    "401": {"description": "Missing or wrong bearer token",
                            "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
                            "content": {"application/json": {"schema": _json_error(401, "auth")}}},
                    "403": {"description": "No token configured and the client is not on loopback", "content": {"application/json": {"schema": _json_error(403, "forbidden")}}},
                    "413": {"description": "Body over the size limit", "content": {"application/json": {"schema": _json_error(413, "size")}}},
                    "429": {"description": "Write queue full; retry after Retry-After seconds",
                            "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                            "content": {"application/json": {"schema": _json_error(429, "busy")}}},
                },
            }
        }
        for path in ("/v1/traces", "/api/traces")
    }
    | {
        "/api/traces/blobs/{key}": {
            "put": {
                "summary": "Upload a snapshot blob (safetensors)",
                "security": [{"bearer": []}],
                "parameters": [{"name": "key", "in": "path", "required": True, "schema": {"type": "string"}}],
                "requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                "responses": {"201": {"description": "Stored; Location is the stored blob's URI",
                                      "headers": {"Location": {"schema": {"type": "string"}}}},
                              "400": {"description": "Bad key"},
                              "401": {"description": "Auth",
                                      "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}}},
                              "403": {"description": "Forbidden"},
                              "413": {"description": "Too large"}},
            }
        },
        "/healthz": {"get": {"summary": "Liveness and counters", "responses": {"200": {"description": "OK"}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3"}}}},
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Batch": {
                "type": "object",
                "required": ["schema_version", "batch_id", "spans", "marks", "snapshots"],
                "properties": {
                    "schema_version": {"type": "integer", "enum": [1]},
                    "sdk_version": {"type": "string"},
                    "batch_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                    "created_ns": {"type": "integer"},
                    "spans": {"type": "array", "items": {"type": "object"}},
                    "marks": {"type": "array", "items": {"type": "object"}},
                    "snapshots": {"type": "array", "items": {"type": "object"}},
                },
            },
            "Accepted": {"type": "object", "required": ["batch_id"],
                         "properties": {"batch_id": {"type": "string"}, "duplicate": {"type": "boolean"}}},
        },
    },
}


class IngestApp:
    """Builds the aiohttp application around one aggregator."""

    def __init__(self, aggregator: Aggregator, *, run_dir: Path, token: str | None,
                 max_body: int = 32 * 1024 * 1024) -> None:
        self.aggregator = aggregator
        self.run_dir = run_dir
        self.token = token
        self.max_body = max_body
        # batch_id -> accepted at (wall-clock ns), 24 h window; the store holds those of earlier runs
        try:
            self._seen: dict[str, int] = aggregator.store.seen_batches(time.time_ns() - DEDUPE_WINDOW_S * 10**9)
        except StoreError as exc:  # a remote store not answering yet: this run's batches are still deduped
            logger.warning("HTTP ingest: the batch ids of earlier runs cannot be read (%s); a batch they stored "
                           "and sent again is stored again, and read once (docs/clickhouse.md)", exc)
            self._seen = {}
        self._span_sessions: dict[str, tuple[str, int]] = {}  # span id -> (session, rank)
        self._client_sessions: dict[tuple[str, str], tuple[str, int]] = {}  # (token, address) -> last one
        self.accepted = 0
        self.duplicates = 0
        self.rejected: dict[int, int] = {}

    def build(self) -> Any:
        from aiohttp import web

        # auto_decompress off: this app inflates gzip itself, bounded by max_body (aiohttp would
        # inflate first, so the body read here would no longer be gzip, nor bounded).
        app = web.Application(client_max_size=self.max_body + 1024, handler_args={"auto_decompress": False})
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/api/traces", self._traces)
        app.router.add_put("/api/traces/blobs/{key:.+}", self._blob)
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get("/healthz", self._health)
        return app

    # -- checks ----------------------------------------------------------------------------------

    def _authorise(self, request: Any) -> None:
        if self.token is None:
            try:
                loopback = ipaddress.ip_address(request.remote or "").is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise _Reject(403, "no token is configured, so only loopback clients may upload")
            return
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise _Reject(401, "missing or wrong bearer token", {"WWW-Authenticate": 'Bearer realm="stepwatch"'})

    async def _body(self, request: Any) -> bytes:
        length = request.content_length
        if length is not None and length > self.max_body:
            raise _Reject(413, f"body of {length} bytes over the {self.max_body}-byte limit")
        chunks: list[bytes] = []
        size = 0
        try:
            while True:  # read() returns what has arrived so far, not the whole body: loop to EOF
                chunk = await request.content.read(1 << 16)
                if not chunk:
                    break
                size += len(chunk)
                if size > self.max_body:
                    raise _Reject(413, f"body over the {self.max_body}-byte limit")
                chunks.append(chunk)
        except _Reject:
            raise
        except Exception as exc:  # noqa: BLE001 - aiohttp raises its own errors for oversize bodies
            raise _Reject(413, f"body over the {self.max_body}-byte limit ({type(exc).__name__})") from None
        raw = b"".join(chunks)
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        if encoding == "gzip":
            try:
                inflater = zlib.decompressobj(wbits=31)
                raw = inflater.decompress(raw, self.max_body + 1)
                if len(raw) > self.max_body or inflater.unconsumed_tail:
                    raise _Reject(413, f"decompressed body over the {self.max_body}-byte limit")
                if not inflater.eof:
                    raise _Reject(400, "body is not valid gzip: the stream is truncated")
            except (zlib.error, EOFError, gzip.BadGzipFile) as exc:
                raise _Reject(400, f"body is not valid gzip: {exc}") from None
        elif encoding not in ("identity", ""):
            raise _Reject(400, f"unsupported Content-Encoding {encoding!r}")
        return raw

    @staticmethod
    def _batch(raw: bytes) -> dict[str, Any]:
        try:
            batch = _decoder.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise _Reject(400, f"body is not JSON: {exc}") from None
        except RecursionError:
            raise _Reject(400, "body is not JSON: nested too deeply") from None
        if not isinstance(batch, dict):
            raise _Reject(400, "body must be a JSON object (a spool batch)")
        if batch.get("schema_version") != 1:
            raise _Reject(400, f"schema_version must be 1, got {batch.get('schema_version')!r}")
        batch_id = batch.get("batch_id")
        if not isinstance(batch_id, str) or not re.fullmatch(r"[0-9a-f]{32}", batch_id):
            raise _Reject(400, "batch_id must be 32 lowercase hex characters")
        for key in ("spans", "marks", "snapshots"):
            value = batch.get(key, [])
            if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
                raise _Reject(400, f"{key} must be a list of objects")
        for span in batch.get("spans", []):
            for field in ("id", "name", "start_ns", "end_ns"):
                if field not in span:
                    raise _Reject(400, f"every span needs {field!r}")
            if not isinstance(span["start_ns"], int) or not isinstance(span["end_ns"], int):
                raise _Reject(400, "span start_ns and end_ns must be integers")
        for mark in batch.get("marks", []):
            if "id" not in mark or "name" not in mark:
                raise _Reject(400, "every mark needs 'id' and 'name'")
        for snap in batch.get("snapshots", []):
            if "id" not in snap:
                raise _Reject(400, "every snapshot needs 'id'")
        return batch

    @staticmethod
    def _typed_batch(raw: bytes) -> _TypedBatch | None:
        """The batch by the typed fast path, when it passes every check ``_batch`` makes; None
        sends it to ``_batch``, which accepts it too or says why not."""
        try:
            batch = _typed_decoder.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return None
        if batch.schema_version != 1 or type(batch.batch_id) is not str or not _BATCH_ID.fullmatch(batch.batch_id):
            return None
        if None in [s.start_ns for s in batch.spans] or None in [s.end_ns for s in batch.spans]:
            return None
        if not all("id" in snap for snap in batch.snapshots):
            return None
        return batch

    def _session_of(self, request: Any, spans: list[tuple[Any, Any, Any, Any]], refs: list[Any]) -> tuple[str, int]:
        """(session, rank) of a batch; ``spans``: (id, parent_id, pid, rank) of its spans, ``refs``:
        the span ids its marks and snapshots name. See the module docstring."""
        # the first span's rank; one out of bounds (schema/limits.py) refuses the batch
        rank = next((r for *_, r in spans if type(r) is int), None)
        given = request.headers.get("X-Stepwatch-Session-Id")
        if given:
            return given, rank or 0
        known = self._span_sessions
        for span_id, parent, _, _ in spans:
            for ref in (parent, span_id):
                if type(ref) is str and ref in known:
                    session, ref_rank = known[ref]
                    return session, ref_rank if rank is None else rank
        for ref in refs:
            if type(ref) is str and ref in known:
                return known[ref]
        token = request.headers.get("Authorization", "anonymous")
        pid = next((p for _, _, p, _ in spans if p is not None), None)
        if pid is None:
            last = self._client_sessions.get((token, str(request.remote)))
            if last is not None:
                return last[0], last[1] if rank is None else rank
            pid = "?"
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"stepwatch-http:{token}:{request.remote}:{pid}")), rank or 0

    def _remember(self, request: Any, session: tuple[str, int], spans: list[tuple[Any, Any, Any, Any]],
                  refs: list[Any]) -> None:
        """After a batch is queued: its span ids (and the parents and spans it names) point to
        its session, for the batches of the same process that carry no pid."""
        known = self._span_sessions
        for span_id, parent, _, _ in spans:
            for ref in (span_id, parent):
                if type(ref) is str:
                    known[ref] = session
        for ref in refs:
            if type(ref) is str and ref != "root":  # "root" is every process's sentinel
                known[ref] = session
        if len(known) > SPAN_MEMORY:
            for key in list(known)[: len(known) - SPAN_MEMORY // 2]:
                del known[key]
        token = request.headers.get("Authorization", "anonymous")
        self._client_sessions[(token, str(request.remote))] = session
        if len(self._client_sessions) > 10_000:
            self._client_sessions.clear()

    @staticmethod
    def _views(batch: dict[str, Any]) -> tuple[list[tuple[Any, Any, Any, Any]], list[Any]]:
        spans = [(s.get("id"), s.get("parent_id"), s.get("pid"), s.get("rank", 0)) for s in batch.get("spans", [])]
        refs = [m.get("span_id") for m in batch.get("marks", [])] + [x.get("span_id") for x in batch.get("snapshots", [])]
        return spans, refs

    @staticmethod
    def _typed_views(batch: _TypedBatch) -> tuple[list[tuple[Any, Any, Any, Any]], list[Any]]:
        spans = [(s.id, s.parent_id, s.pid, s.rank) for s in batch.spans]
        refs = [m.span_id for m in batch.marks] + [x.get("span_id") for x in batch.snapshots]
        return spans, refs

    def _expire(self) -> None:
        cutoff = time.time_ns() - DEDUPE_WINDOW_S * 10**9
        if len(self._seen) > 100_000 or (self._seen and next(iter(self._seen.values())) < cutoff):
            self._seen = {k: t for k, t in self._seen.items() if t >= cutoff}

    # -- handlers --------------------------------------------------------------------------------

    async def _traces(self, request: Any) -> Any:
        from aiohttp import web

        try:
            self._authorise(request)
            raw = await self._body(request)
            typed = self._typed_batch(raw)
            batch = self._batch(raw) if typed is None else None
            batch_id = typed.batch_id if typed is not None else batch["batch_id"]  # type: ignore[index]
            # backpressure: while the writer catches up, answer later rather than 429 at once
            room = not self.aggregator.full and await self.aggregator.wait_for_room(ROOM_WAIT_S)
            self._expire()
            if batch_id in self._seen:
                self.duplicates += 1
                return web.json_response({"batch_id": batch_id, "duplicate": True}, status=202)
            if not room or self.aggregator.full:
                raise _Reject(429, "write queue full", {"Retry-After": "1"})
            if typed is None or not self._accept_typed(request, typed):
                if batch is None:
                    batch = self._batch(raw)
                spans, refs = self._views(batch)
                session_id, rank = self._session_of(request, spans, refs)
                tables = {k: batch.get(k, []) for k in ("spans", "marks", "snapshots")}
                meta = {"session_id": session_id, "rank": rank, "sdk_version": batch.get("sdk_version"),
                        "batch_id": batch_id}
                try:
                    self.aggregator.accept_tables(meta, tables, source="http")
                except TransportError as exc:
                    raise _Reject(400, f"batch cannot be stored: {exc}") from None
                self._remember(request, (session_id, rank), spans, refs)
            now = time.time_ns()
            self._seen[batch_id] = now
            self.aggregator.note_batch(batch_id, now)
            self.accepted += 1
            return web.json_response({"batch_id": batch_id}, status=202)
        except _Reject as exc:
            self.rejected[exc.status] = self.rejected.get(exc.status, 0) + 1
            return web.json_response({"error": exc.reason}, status=exc.status, headers=exc.headers)

    def _accept_typed(self, request: Any, batch: _TypedBatch) -> bool:
        """Queues a typed batch's rows; False (nothing queued) where the general path must decide."""
        spans, refs = self._typed_views(batch)
        session_id, rank = self._session_of(request, spans, refs)
        meta = {"session_id": session_id, "rank": rank, "sdk_version": batch.sdk_version, "batch_id": batch.batch_id}
        tables = WireTables(spans=batch.spans, marks=batch.marks, snapshots=batch.snapshots)
        try:
            if self.aggregator.accept_wire(meta, session_id, rank, tables, source="http") is None:
                return False
        except TransportError:
            return False  # bad session fields: the general path gives the 400 with its reason
        self._remember(request, (session_id, rank), spans, refs)
        return True

    async def _blob(self, request: Any) -> Any:
        from aiohttp import web

        try:
            self._authorise(request)
            key = request.match_info["key"]
            if not _BLOB_KEY.fullmatch(key) or ".." in key.split("/"):
                raise _Reject(400, "blob key must be a relative path of [A-Za-z0-9_.-] parts")
            raw = await self._body(request)
            target = self.run_dir / "blobs" / key
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_bytes(raw)
            tmp.replace(target)
            # The SDK records the Location header (else the whole response body) as the blob_uri.
            uri = target.resolve().as_uri()
            return web.json_response({"key": key, "bytes": len(raw), "uri": uri}, status=201,
                                     headers={"Location": uri})
        except _Reject as exc:
            self.rejected[exc.status] = self.rejected.get(exc.status, 0) + 1
            return web.json_response({"error": exc.reason}, status=exc.status, headers=exc.headers)

    async def _openapi(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(OPENAPI)

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"ok": True, "http_accepted": self.accepted, "http_duplicates": self.duplicates,
                                  "http_rejected": self.rejected, **self.aggregator.stats()})
