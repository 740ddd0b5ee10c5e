"""Trace ingestion over HTTP (spool-format-v1.md "Wire format"): ``POST /v1/traces``, and the
paths the real SDK uses today, ``POST /api/traces`` and ``PUT /api/traces/blobs/<key>``
(spool-current-practice.md "Uploads"), so an unmodified SDK can upload into the history.

Contract: bearer-token auth (no token configured: loopback clients only), gzip bodies,
``202 Accepted`` with the batch id, idempotent by batch id for 24 hours, ``400`` with a reason,
``413`` over the size limit (compressed or not), ``429`` with ``Retry-After`` when the write
queue is full. ``GET /openapi.json`` serves the OpenAPI description of all of it.
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

from ..errors import TransportError
from .aggregator import Aggregator

__all__ = ["IngestApp", "OPENAPI"]

DEDUPE_WINDOW_S = 24 * 3600
_BLOB_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")
_decoder = msgspec.json.Decoder()


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
                    "401": {"description": "Missing or wrong bearer token", "content": {"application/json": {"schema": _json_error(401, "auth")}}},
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
                              "401": {"description": "Auth"}, "403": {"description": "Forbidden"},
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
        self._seen: dict[str, float] = {}  # batch_id -> accepted at (monotonic), 24 h window
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
            raise _Reject(401, "missing or wrong bearer token")

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

    def _session_of(self, request: Any, batch: dict[str, Any]) -> tuple[str, int]:
        """Which session a batch belongs to: the header if given, else one per uploading process."""
        spans = batch.get("spans") or [{}]
        rank = spans[0].get("rank", 0)
        rank = rank if type(rank) is int and 0 <= rank < 1 << 31 else 0
        given = request.headers.get("X-Stepwatch-Session-Id")
        if given:
            return given, rank
        pid = spans[0].get("pid", "?")
        token = request.headers.get("Authorization", "anonymous")
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"stepwatch-http:{token}:{request.remote}:{pid}")), rank

    def _expire(self) -> None:
        cutoff = time.monotonic() - DEDUPE_WINDOW_S
        if len(self._seen) > 100_000 or (self._seen and next(iter(self._seen.values())) < cutoff):
            self._seen = {k: t for k, t in self._seen.items() if t >= cutoff}

    # -- handlers --------------------------------------------------------------------------------

    async def _traces(self, request: Any) -> Any:
        from aiohttp import web

        try:
            self._authorise(request)
            batch = self._batch(await self._body(request))
            batch_id = batch["batch_id"]
            self._expire()
            if batch_id in self._seen:
                self.duplicates += 1
                return web.json_response({"batch_id": batch_id, "duplicate": True}, status=202)
            if self.aggregator.full:
                raise _Reject(429, "write queue full", {"Retry-After": "1"})
            session_id, rank = self._session_of(request, batch)
            tables = {k: batch.get(k, []) for k in ("spans", "marks", "snapshots")}
            meta = {"session_id": session_id, "rank": rank, "sdk_version": batch.get("sdk_version"),
                    "batch_id": batch_id}
            try:
                self.aggregator.accept_tables(meta, tables, source="http")
            except TransportError as exc:
                raise _Reject(400, f"batch cannot be stored: {exc}") from None
            self._seen[batch_id] = time.monotonic()
            self.accepted += 1
            return web.json_response({"batch_id": batch_id}, status=202)
        except _Reject as exc:
            self.rejected[exc.status] = self.rejected.get(exc.status, 0) + 1
            return web.json_response({"error": exc.reason}, status=exc.status, headers=exc.headers)

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
