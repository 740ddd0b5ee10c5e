"""Wire frames: a 4-byte big-endian length, then a msgpack body ``{meta, body: {tables}}``.

``meta`` names the sender (session_id, rank, host, pid, seq...); ``tables`` maps a table name
to the rows appended since the last frame. The receiver also accepts the legacy flat envelope
(meta keys and tables side by side at the top level) and rejects frames over a size limit.

A table is either a list of row maps, or columnar: ``{"columns": [name, ...], "rows": [[value,
...], ...]}``, which means the row maps ``dict(zip(columns, row))``, except that the JSON-typed
field of telemetry, spans and marks (``JSON_FIELD``) is carried as its JSON text. The sender
ships telemetry, spans and marks columnar in the store's column order, so the aggregator decodes
them into the tuples it binds, with no map or Struct per row: telemetry through
``columnar_table``, spans and marks as the rows the rank's span recorder built in the same pass as
their spool records (``capture.spans.SpanWireRow``, ``MarkWireRow``).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import repeat
from operator import add, attrgetter
from typing import Any

import msgspec

from ..errors import TransportError
from ..schema.tables import fields
from ..schema.wire import WireMark, WireSpan, WireTables, WireTelemetry

__all__ = ["COLUMNAR", "DEFAULT_MAX_FRAME", "FrameDecoder", "JSON_FIELD", "Message", "TABLE_NAMES", "WireMark",
           "WireSpan", "WireTables", "WireTelemetry", "columnar_table", "decode_body", "decode_typed",
           "encode_frame", "json_objects"]

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
TABLE_NAMES = frozenset({"telemetry", "spans", "marks", "snapshots", "heartbeat"})
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()
_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder()
_json_raw_decoder = msgspec.json.Decoder(list[msgspec.Raw])

# Columnar tables as the sender writes them: the wire field names in the store's column order
# (schema.tables; spans and marks without the session and rank, which the frame's meta gives),
# the JSON-typed field last, as text. A mark's value is one field that becomes two columns.
COLUMNAR: dict[str, tuple[str, ...]] = {
    "telemetry": fields("telemetry"),
    "spans": fields("spans", skip_session=True),
    "marks": ("id", "span_id", "name", "value_type", "value", "value_nonfinite", "ts_ns", "kind", "attrs"),
}
JSON_FIELD = {"telemetry": "metadata", "spans": "attrs", "marks": "attrs"}


def columnar_table(name: str, rows: list[Any]) -> dict[str, Any] | None:
    """``rows`` (msgspec Structs with the fields of ``COLUMNAR[name]``, as the runtime holds
    them) as a columnar table, the JSON field encoded once here, on the rank's background thread,
    as the store will keep it (``value or {}``); None when a row is not such a Struct (a dict,
    say): the table then goes as row maps, which mean the same."""
    fields = COLUMNAR.get(name)
    if fields is None or not rows or not all(isinstance(r, msgspec.Struct) for r in rows):
        return None
    # Column by column in C (attrgetter, map, zip): no Python frame per row. A row is the
    # tuple of its plain fields plus the 1-tuple of its JSON text (``operator.add``).
    try:
        values = list(map(attrgetter(*fields[:-1]), rows))
        objects = list(map(attrgetter(fields[-1]), rows))
        if not all(objects):
            objects = [o or {} for o in objects]
        texts = _json_encoder.encode_lines(objects).decode().split("\n")
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None
    return {"columns": fields, "rows": list(map(add, values, zip(texts)))}


def json_objects(texts: list[str]) -> bool:
    """Whether every text is exactly one JSON object (nothing around it), checked in one pass:
    the texts joined as a JSON array must split back into elements of exactly their lengths, so
    no text can borrow a bracket or a comma from its neighbour."""
    if not all(map(str.startswith, texts, repeat("{"))):  # in C: no Python frame per text
        return False
    joined = "[" + ",".join(texts) + "]"
    try:
        raws = _json_raw_decoder.decode(joined)
    except (msgspec.DecodeError, RecursionError):
        return False
    sizes = map(len, texts) if joined.isascii() else map(len, map(str.encode, texts))  # Raw sizes are bytes
    return len(raws) == len(texts) and list(map(len, raws)) == list(sizes)


def _expand(name: str, table: dict[str, Any]) -> list[dict[str, Any]]:
    """A columnar table as the row maps it means (the JSON field decoded from its text)."""
    columns, rows = table.get("columns"), table.get("rows")
    if (set(table) != {"columns", "rows"} or not isinstance(columns, list) or not isinstance(rows, list)
            or not all(type(c) is str for c in columns) or len(set(columns)) != len(columns)):
        raise TransportError("bad_rows", f"columnar table {name!r} needs distinct string columns and rows")
    width, json_field = len(columns), JSON_FIELD.get(name)
    out = []
    for row in rows:
        if not isinstance(row, list) or len(row) != width:
            raise TransportError("bad_rows", f"table {name!r}: a row of {len(row) if isinstance(row, list) else '?'}"
                                             f" values for {width} columns")
        record = dict(zip(columns, row))
        text = record.get(json_field) if json_field else None
        if text is not None:
            if type(text) is not str:
                raise TransportError("bad_rows", f"{name}.{json_field}: JSON text expected")
            try:
                record[json_field] = _json_decoder.decode(text)
            except (msgspec.DecodeError, RecursionError) as exc:
                raise TransportError("bad_rows", f"{name}.{json_field}: not JSON ({exc})") from None
        out.append(record)
    return out


class Message(msgspec.Struct, frozen=True):
    meta: dict[str, Any]
    tables: dict[str, list[dict[str, Any]]]

    @property
    def rows(self) -> int:
        return sum(len(rows) for rows in self.tables.values())


def encode_frame(meta: Mapping[str, Any], tables: Mapping[str, Any], buffer: bytearray | None = None) -> bytes:
    """One frame: the length prefix and the msgpack body. ``buffer``: a bytearray the caller
    keeps from frame to frame, encoded into after its first 4 bytes and copied out once (a
    frame of a second's rows grown by reallocation, then prefixed, was copied three times)."""
    payload = {"meta": meta, "body": {"tables": tables}}
    if buffer is None:
        body = _encoder.encode(payload)
        return len(body).to_bytes(4, "big") + body
    _encoder.encode_into(payload, buffer, 4)
    buffer[:4] = (len(buffer) - 4).to_bytes(4, "big")
    return bytes(buffer)


def _sender(meta: dict[str, Any], default_session: str | None) -> dict[str, Any]:
    """``meta`` with its rank and session settled: the rank is ``global_rank`` where given (the
    envelope prefers it, aggregator-architecture.md "Glossary"), else ``rank``, else 0, written
    back as ``meta["rank"]`` for every reader after this; a meta without ``session_id`` (a
    legacy sender's) takes ``default_session``, the aggregator's own session, when it has one."""
    if meta.get("global_rank") is not None:
        meta["rank"] = meta["global_rank"]
    if meta.get("session_id") is None and default_session:
        meta["session_id"] = default_session
    return meta


def decode_body(body: bytes, default_session: str | None = None) -> Message:
    """Validates one frame body; raises TransportError with a reason on anything malformed.
    ``default_session``: the session of a frame whose meta names none (see ``_sender``)."""
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
    meta = _sender(meta, default_session)
    session_id, rank = meta.get("session_id"), meta.get("rank", 0)
    if not isinstance(session_id, str) or not session_id:
        raise TransportError("bad_meta", "meta.session_id must be a non-empty string")
    if type(rank) is not int or rank < 0:
        raise TransportError("bad_meta", f"meta.global_rank/rank must be a non-negative integer, got {rank!r}")
    clean: dict[str, list[dict[str, Any]]] = {}
    for name, rows in tables.items():
        if name not in TABLE_NAMES:
            raise TransportError("unknown_table", f"unknown table {name!r}")
        if isinstance(rows, dict):
            rows = _expand(name, rows)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise TransportError("bad_rows", f"table {name!r} must be a list of maps")
        clean[name] = rows
    return Message(meta=meta, tables=clean)


# -- the typed fast path ---------------------------------------------------------------------------
#
# The rows the aggregator receives in bulk (telemetry, spans, marks), decoded straight into
# untracked Structs that hold only the fields the store keeps, typed as strictly as the store's
# columns: text is ``str``, integers are 64-bit ints. Decoding then checks most of what
# ``check_rows`` checks, skips the fields nobody stores, and leaves nothing for the cyclic GC to
# scan. Anything these types refuse (a float in an integer field, a number where text belongs, a
# legacy envelope, an unknown table, a malformed body) makes ``decode_typed`` return None and the
# caller takes the general path (``decode_body``), which accepts or rejects exactly as before.
# The typed rows live in ``schema.wire``, below both this module and the store that reads them.


class _WireBody(msgspec.Struct, gc=False):
    tables: WireTables


class _WireEnvelope(msgspec.Struct, gc=False):
    meta: dict[str, Any]
    body: _WireBody


_typed_decoder = msgspec.msgpack.Decoder(_WireEnvelope)


def decode_typed(body: bytes) -> tuple[dict[str, Any], WireTables] | None:
    """The meta and typed tables of a current-envelope frame whose rows all fit the store's
    column types, or None: then ``decode_body`` decides (and names the reason if it refuses)."""
    try:
        envelope = _typed_decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # ValidationError is a DecodeError
        return None
    meta = _sender(envelope.meta, None)  # no session: decode_body gives it the default one
    session_id, rank = meta.get("session_id"), meta.get("rank", 0)
    if not isinstance(session_id, str) or not session_id or type(rank) is not int or rank < 0:
        return None
    tables = envelope.body.tables
    for name in ("telemetry", "spans", "marks"):
        table = getattr(tables, name)
        if not isinstance(table, list) and (table.columns != COLUMNAR[name]
                                            or not json_objects([row[-1] for row in table.rows])):
            return None  # other columns, or a JSON text that is not one object: decode_body decides
    return meta, tables


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
