"""The append-only sink's ``manifest.json`` (schema 2): segment order and the session ledger.

Read leniently (unknown keys ignored, so Stormlog's manifests load too) and strictly typed
(a wrong type names the manifest and the field).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from .._decode import DECODE_FAILURES, undecodable
from ..errors import ArtifactError
from ..schema import SessionSummary, translate_validation_error
from ._files import atomic_write_bytes

__all__ = [
    "MANIFEST_FILENAME",
    "MANIFEST_FORMAT",
    "MANIFEST_SCHEMA_VERSION",
    "SEGMENT_PREFIX",
    "SEGMENT_SUFFIX",
    "SegmentEntry",
    "SinkManifest",
    "read_manifest",
    "segment_filename",
    "write_manifest",
]

MANIFEST_FILENAME = "manifest.json"
MANIFEST_FORMAT = "stepwatch.append_only_telemetry_sink"
MANIFEST_SCHEMA_VERSION = 2
SEGMENT_PREFIX = "segment-"
SEGMENT_SUFFIX = ".jsonl"


def segment_filename(index: int) -> str:
    return f"{SEGMENT_PREFIX}{index:06d}{SEGMENT_SUFFIX}"


class SegmentEntry(msgspec.Struct, kw_only=True):
    """One segment file: which session owns it and how much it held at the last manifest write."""

    filename: str
    event_count: int = 0
    size_bytes: int = 0
    closed: bool = False
    session_id: str | None = None


class SinkManifest(msgspec.Struct, kw_only=True):
    schema_version: int = MANIFEST_SCHEMA_VERSION
    format: str = MANIFEST_FORMAT
    sessions: list[SessionSummary] = msgspec.field(default_factory=list)
    segments: list[SegmentEntry] = msgspec.field(default_factory=list)
    pruned_segment_count: int = 0
    pruned_bytes: int = 0


_decoder = msgspec.json.Decoder(SinkManifest)
_encoder = msgspec.json.Encoder()


def read_manifest(path: Path) -> SinkManifest:
    """Reads a manifest.

    Raises:
        ArtifactError: the file is empty, not JSON, or a field has the wrong type.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ArtifactError(path, f"cannot read manifest: {exc.strerror}") from exc
    if not data.strip():
        raise ArtifactError(path, "file is empty")
    try:
        manifest = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        error = translate_validation_error(exc)
        raise ArtifactError(path, f"invalid manifest: {error}", field=error.field) from exc
    except DECODE_FAILURES as exc:  # msgspec: UnicodeDecodeError for non-UTF-8, RecursionError for nesting
        raise ArtifactError(path, f"manifest is not valid JSON (half-written?): {undecodable(exc)}") from None
    return manifest


def write_manifest(path: Path, manifest: SinkManifest, *, fsync: bool = True) -> None:
    """Writes the manifest atomically; sessions are written as ledger entries only."""
    payload = {
        "schema_version": manifest.schema_version,
        "format": manifest.format,
        "sessions": [s.ledger_entry() for s in manifest.sessions],
        "segments": manifest.segments,
        "pruned_segment_count": manifest.pruned_segment_count,
        "pruned_bytes": manifest.pruned_bytes,
    }
    atomic_write_bytes(path, msgspec.json.format(_encoder.encode(payload), indent=2), fsync=fsync)
