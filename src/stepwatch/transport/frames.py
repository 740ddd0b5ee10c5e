"""Wire frames: a 4-byte big-endian length, then a msgpack body ``{meta, body: {tables}}``.

``meta`` names the sender (session_id, rank, host, pid, seq...); ``tables`` maps a table name
to the rows appended since the last frame. The receiver also accepts the legacy flat envelope
(meta keys and tables side by side at the top level) and rejects frames over a size limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ..errors import TransportError

__all__ = ["DEFAULT_MAX_FRAME", "TABLE_NAMES", "FrameDecoder", "Message", "decode_body", "encode_frame"]

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
TABLE_NAMES = frozenset({"telemetry", "spans", "marks", "snapshots", "heartbeat"})
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class Message(msgspec.Struct, frozen=True):
    meta: dict[str, Any]
    tables: dict[str, list[dict[str, Any]]]

    @property
    def rows(self) -> int:
        return sum(len(rows) for rows in self.tables.values())


def encode_frame(meta: Mapping[str, Any], tables: Mapping[str, list[Any]]) -> bytes:
    body = _encoder.encode({"meta": meta, "body": {"tables": tables}})
    return len(body).to_bytes(4, "big") + body


def decode_body(body: bytes) -> Message:
    """Validates one frame body; raises TransportError with a reason on anything malformed."""
    try:
        payload = _decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # msgspec raises the latter on bad UTF-8
        raise TransportError("not_msgpack", str(exc)) from None
    except RecursionError:  # msgspec's nesting limit: a hostile frame, not a crash of the receiver
        raise TransportError("not_msgpack", "frame body nested too deeply") from None
    if not isinstance(payload, dict):
        raise TransportError("bad_shape", f"frame body must be a map, got {type(payload).__name__}")
    if "meta" in payload and "body" in payload:
        meta, inner = payload["meta"], payload["body"]
        if not isinstance(meta, dict) or not isinstance(inner, dict):
            raise TransportError("bad_shape", "meta and body must be maps")
        tables = inner.get("tables", inner)
    else:  # legacy flat envelope: meta fields and tables at the top level
        tables = payload.get("tables", {k: v for k, v in payload.items() if isinstance(v, list)})
        meta = {k: v for k, v in payload.items() if k != "tables" and not isinstance(v, list)}
    if not isinstance(tables, dict):
        raise TransportError("bad_shape", "tables must be a map of table name to rows")
    session_id, rank = meta.get("session_id"), meta.get("rank", 0)
    if not isinstance(session_id, str) or not session_id:
        raise TransportError("bad_meta", "meta.session_id must be a non-empty string")
    if type(rank) is not int or rank < 0:
        raise TransportError("bad_meta", f"meta.rank must be a non-negative integer, got {rank!r}")
    clean: dict[str, list[dict[str, Any]]] = {}
    for name, rows in tables.items():
        if name not in TABLE_NAMES:
            raise TransportError("unknown_table", f"unknown table {name!r}")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise TransportError("bad_rows", f"table {name!r} must be a list of maps")
        clean[name] = rows
    return Message(meta=meta, tables=clean)


class FrameDecoder:
    """Incremental: ``feed`` bytes as they arrive, get back whole frame bodies.

    An oversize length prefix raises TransportError("oversize"): the stream cannot be
    resynchronised after it, so the caller closes the connection.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer.extend(data)
        bodies = []
        while len(self._buffer) >= 4:
            length = int.from_bytes(self._buffer[:4], "big")
            if length > self.max_frame:
                raise TransportError("oversize", f"frame of {length} bytes over the {self.max_frame}-byte limit")
            if len(self._buffer) < 4 + length:
                break
            bodies.append(bytes(self._buffer[4:4 + length]))
            del self._buffer[:4 + length]
        return bodies

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)
