"""The spool (spool-format-v1.md): ``<run>/spool/<created_ns:020d>-<batch_id>.json`` batches of
spans, marks and snapshots, and its reader, which also reads Cirron's ``.cirron/spool``.

Writes go through a temp file and ``os.replace``, so a reader never sees half a batch. Under a
byte cap the oldest batches are evicted first and what they held is counted.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES, undecodable
from ..errors import ArtifactError
from ._files import atomic_write_bytes

__all__ = ["SPOOL_SCHEMA_VERSION", "LoadedSpool", "SpoolWriter", "find_spool_dir", "is_spool_batch", "read_spool",
           "valid_text"]

SPOOL_SCHEMA_VERSION = 1
_BATCH_GLOB = "[0-9]*-*.json"  # <created_ns, 20 digits>-<batch_id>.json
_BATCH_NAME = re.compile(r"[0-9]{20}-[0-9a-f]{32}\.json")
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


class SpoolWriter:
    """Seals batches into a spool directory.

    Example::

        writer = SpoolWriter(run_dir / "spool", sdk_version="0.1.0", max_bytes=256 << 20)
        path = writer.write(spans, marks, snapshots)
    """

    def __init__(self, root: str | os.PathLike[str], *, sdk_version: str, max_bytes: int = 256 * 1024 * 1024,
                 fsync: bool = False, adopt_existing: bool = True) -> None:
        """``max_bytes`` caps the batches *this writer* keeps: it counts and evicts only its own
        files. ``adopt_existing`` takes the batches already in ``root`` as its own (a restarted
        single writer); ranks sharing one spool directory pass False, so that no rank evicts
        (and counts as its drops) another rank's batches."""
        if max_bytes < 1024:
            raise ValueError(f"spool max_bytes must be >= 1024, got {max_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.sdk_version = sdk_version
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.batches_written = 0
        self.evicted_batches = 0
        self.evicted_records = 0
        self.dropped_records = 0  # single records larger than the whole cap
        # name -> (bytes, records) of this writer's batches on disk, oldest first
        self._on_disk: dict[str, tuple[int, int]] = {
            p.name: (p.stat().st_size, 0) for p in sorted(self.root.glob(_BATCH_GLOB))
        } if adopt_existing else {}
        self._total = sum(size for size, _ in self._on_disk.values())
        self._buffer = bytearray()  # the batch being written (write), reused

    def write(self, spans: list[Any], marks: list[Any], snapshots: list[Any]) -> list[Path]:
        """Seals one batch (or several, if it would not fit the cap); returns the files written.

        Records are dicts or msgspec Structs (the runtime's ``SpoolSpan``/``SpoolMark``): the
        whole batch is one ``encode_into`` call either way.
        """
        if not (spans or marks or snapshots):
            return []
        batch_id = uuid.uuid4().hex
        created_ns = time.time_ns()
        batch = {
            "schema_version": SPOOL_SCHEMA_VERSION, "sdk_version": self.sdk_version, "batch_id": batch_id,
            "created_ns": created_ns, "spans": spans, "marks": marks, "snapshots": snapshots,
        }
        # Into this writer's buffer, kept between batches, and written from there: a batch of a
        # few seconds is megabytes, and encoding it into a fresh bytes object grew that by
        # reallocation, copying it over and over (a fifth of the batch's encoding cost)
        body = self._encode(batch)
        records = len(spans) + len(marks) + len(snapshots)
        if len(body) > self.max_bytes:
            if records == 1:
                self.dropped_records += 1  # one record bigger than the whole spool: cannot keep it
                return []
            # too big for the cap: split in halves rather than evict everything for one batch
            first, second = _halves(spans, marks, snapshots)
            return [*self.write(*first), *self.write(*second)]
        self._evict(len(body))
        name = f"{created_ns:020d}-{batch_id}.json"
        atomic_write_bytes(self.root / name, body, fsync=self.fsync)
        self._on_disk[name] = (len(body), records)
        self._total += len(body)
        self.batches_written += 1
        return [self.root / name]

    def _encode(self, batch: dict[str, Any]) -> bytearray:
        """``batch`` as JSON, in the writer's buffer (valid until the next call)."""
        buffer = self._buffer
        try:
            _encoder.encode_into(batch, buffer)
        except BufferError:  # a view of it outlived a failed write: a buffer of its own from now on
            buffer = self._buffer = bytearray()
            return self._encode(batch)
        except UnicodeEncodeError:  # a lone surrogate in some attr must not cost the whole batch
            _encoder.encode_into(valid_text(msgspec.to_builtins(batch)), buffer)
        return buffer

    def _evict(self, incoming: int) -> None:
        while self._on_disk and self._total + incoming > self.max_bytes:
            name = next(iter(self._on_disk))
            size, records = self._on_disk.pop(name)
            try:
                (self.root / name).unlink()
            except FileNotFoundError:
                pass
            self._total -= size
            self.evicted_batches += 1
            self.evicted_records += records


def valid_text(value: Any) -> Any:
    """``value`` with every string made encodable as UTF-8 (lone surrogates become "?")."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {valid_text(k): valid_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [valid_text(v) for v in value]
    return value


Lists = tuple[list[Any], list[Any], list[Any]]


def _halves(spans: list[Any], marks: list[Any], snapshots: list[Any]) -> tuple[Lists, Lists]:
    """Two batches of about half the records each (both non-empty when there are >= 2)."""
    items = [(0, r) for r in spans] + [(1, r) for r in marks] + [(2, r) for r in snapshots]
    middle = len(items) // 2

    def lists(part: list[tuple[int, Any]]) -> Lists:
        out: Lists = ([], [], [])
        for kind, record in part:
            out[kind].append(record)
        return out

    return lists(items[:middle]), lists(items[middle:])


class LoadedSpool(msgspec.Struct, kw_only=True):
    """Every batch of a spool joined: spans ordered children before parents."""

    root: str
    batches: int
    spans: list[dict[str, Any]]
    marks: list[dict[str, Any]]
    snapshots: list[dict[str, Any]]
    sdk_versions: list[str]
    skipped_files: list[str]

    def span_by_id(self) -> dict[str, dict[str, Any]]:
        return {s["id"]: s for s in self.spans}

    def children(self) -> dict[str | None, list[dict[str, Any]]]:
        tree: dict[str | None, list[dict[str, Any]]] = {}
        for span in self.spans:
            tree.setdefault(span.get("parent_id"), []).append(span)
        return tree


def find_spool_dir(path: Path) -> Path | None:
    """The spool directory at ``path``: itself, ``<run>/spool``, ``.cirron/spool`` or ``<dir>/.cirron/spool``."""
    for candidate in (path / "spool", path / ".cirron" / "spool", path):
        if candidate.is_dir() and any(candidate.glob(_BATCH_GLOB)):
            return candidate
    return None


def is_spool_batch(path: Path) -> bool:
    """True for one spool batch file: named ``<created_ns:020d>-<batch_id>.json``, or a JSON
    object that starts like one (``schema_version`` then ``sdk_version``/``batch_id``)."""
    if not path.is_file():
        return False
    if _BATCH_NAME.fullmatch(path.name):
        return True
    if path.suffix != ".json":
        return False
    try:
        with path.open("rb") as handle:
            head = handle.read(512)
    except OSError:
        return False
    return bool(re.match(rb'\s*\{\s*"schema_version"\s*:\s*\d+\s*,\s*"(sdk_version|batch_id)"', head))


def _iter_batches(root: Path, strict: bool, files: list[Path] | None = None) -> Iterator[tuple[Path, dict[str, Any] | None]]:
    for path in files if files is not None else sorted(root.glob(_BATCH_GLOB)):
        try:
            batch = _decoder.decode(path.read_bytes())
        except (*DECODE_FAILURES, OSError) as exc:
            if strict:
                raise ArtifactError(path, f"not a readable spool batch: {undecodable(exc)}") from None
            yield path, None
            continue
        if not isinstance(batch, dict) or not isinstance(batch.get("schema_version"), int):
            if strict:
                raise ArtifactError(path, "not a spool batch (no integer schema_version)", field="$.schema_version")
            yield path, None
            continue
        if batch["schema_version"] != SPOOL_SCHEMA_VERSION:
            raise ArtifactError(path, f"unsupported spool schema_version {batch['schema_version']}",
                                field="$.schema_version")
        for key in ("spans", "marks", "snapshots"):
            value = batch.get(key, [])
            if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
                raise ArtifactError(path, f"{key} must be a list of objects", field=f"$.{key}")
        yield path, batch


def read_spool(path: str | os.PathLike[str], *, strict: bool = False) -> LoadedSpool:
    """Reads and joins every batch (ours, or Cirron's), tolerating unknown fields.

    Spans are returned children before parents (a parent after all its descendants), whatever
    batch they came in. Unreadable files are skipped and listed unless ``strict``. ``path`` may
    also be one batch file: that batch alone is read.
    """
    given = Path(path)
    files: list[Path] | None = None
    if given.is_file():
        root, files, strict = given.parent, [given], True  # one file asked for: its errors are the answer
    else:
        found = find_spool_dir(given)
        if found is None:
            raise ArtifactError(given, "no spool batches found (looked in ., spool/, .cirron/spool/)")
        root = found
    spans: dict[str, dict[str, Any]] = {}
    marks: list[dict[str, Any]] = []
    snapshots: list[dict[str, Any]] = []
    versions: set[str] = set()
    skipped: list[str] = []
    batches = 0
    seen_batches: set[str] = set()
    seen_records: set[str] = set()
    for file, batch in _iter_batches(root, strict, files):
        if batch is None:
            skipped.append(str(file))
            continue
        batch_id = batch.get("batch_id")
        if isinstance(batch_id, str):
            if batch_id in seen_batches:
                continue  # the same batch re-sent (spool-format-v1.md: idempotent by batch_id)
            seen_batches.add(batch_id)
        batches += 1
        versions.add(str(batch.get("sdk_version", "?")))
        for span in batch.get("spans", []):
            if "id" in span:
                spans[str(span["id"])] = span  # a re-sent batch must not duplicate spans
        for kind, out in (("marks", marks), ("snapshots", snapshots)):
            for record in batch.get(kind, []):
                key = f"{kind}:{record.get('id')}"
                if record.get("id") is not None and key in seen_records:
                    continue  # nor marks and snapshots (re-split under another batch id)
                seen_records.add(key)
                out.append(record)
    marks.sort(key=lambda m: m.get("ts_ns") or 0)
    return LoadedSpool(root=str(root), batches=batches, spans=_children_first(spans), marks=marks,
                       snapshots=snapshots, sdk_versions=sorted(versions), skipped_files=skipped)


def _children_first(spans: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Post-order over the span forest (orphans treated as roots); siblings by start time."""
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans.values():
        parent = span.get("parent_id")
        children.setdefault(parent if parent in spans else None, []).append(span)
    for items in children.values():
        items.sort(key=lambda s: (s.get("start_ns") or 0))
    ordered: list[dict[str, Any]] = []
    stack: list[tuple[dict[str, Any], bool]] = [(s, False) for s in reversed(children.get(None, []))]
    while stack:
        span, expanded = stack.pop()
        if expanded:
            ordered.append(span)
            continue
        stack.append((span, True))
        stack.extend((c, False) for c in reversed(children.get(span["id"], [])))
    if len(ordered) < len(spans):  # parent cycles in hostile input: keep those spans too
        seen = {id(s) for s in ordered}
        ordered.extend(s for s in spans.values() if id(s) not in seen)
    return ordered
