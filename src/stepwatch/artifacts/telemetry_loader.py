"""Loaders: every telemetry artifact shape, read back into sessions of canonical v3 events.

Shapes (``telemetry-current-practice.md``): a JSON export (array, ``{"events": [...]}``,
``{"telemetry_events": [...], "session_summary": {...}}``, one record, or a caller-named key),
a sink directory, its ``manifest.json``, one ``*.jsonl`` segment, and a whole run directory
whose ``telemetry/rank<N>/`` sinks are merged into one session per session id.

What is skipped rather than raised, and counted on the session (each with a warning, except
the first two):
  * a torn final JSONL line (a write cut by a crash) - ``torn_lines``;
  * a segment the manifest lists but that is gone - ``missing_segments``; its session is
    ``incomplete`` (what is left cannot prove a clean stop);
  * a segment the manifest says held data but that is empty - ``empty_segments`` (a segment
    empty because nothing was flushed to it yet is normal and not counted);
  * an unreadable (empty, half-written, mistyped) ``manifest.json`` inside a sink -
    ``unreadable_manifests``: the sink's segments load without it, their sessions ``incomplete``.
A v4 record whose v3-required counter is null (unknown when it was written) is loaded as its
``TelemetryEventV4``, the unknown counters left null (never zero-filled, never skipped), so a
session keeps the records Stormlog's own loader returns. Everything else that is wrong raises ``ArtifactError`` naming the file, the line and the field,
and so does an empty file, or an unreadable manifest, given directly ("file is empty").
"""

from __future__ import annotations

import gc
import mmap
import os
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from itertools import repeat
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES, undecodable
from ..errors import ArtifactError, ValidationError
from ..schema import (
    LoadedEvent,
    SessionSummary,
    TelemetryEventV3,
    TelemetryEventV4,
    identity_problem,
    loaded_event,
    loaded_event_from_record,
    select_default_session,
    sort_sessions,
    synthetic_session_id,
    translate_validation_error,
    worst_status,
)
from ._files import process_alive
from .manifest import MANIFEST_FILENAME, SEGMENT_PREFIX, SEGMENT_SUFFIX, SinkManifest, read_manifest

__all__ = [
    "LoadedTelemetrySession",
    "find_sink_dirs",
    "load_telemetry_events",
    "load_telemetry_sessions",
]

_v3_lines = msgspec.json.Decoder(TelemetryEventV3)
_v4_lines = msgspec.json.Decoder(TelemetryEventV4)
_any = msgspec.json.Decoder()
_by_time = attrgetter("timestamp_ns")
_session_of = attrgetter("session_id")
_rank_of = attrgetter("rank")
_local_rank_of = attrgetter("local_rank")
_world_of = attrgetter("world_size")
_drain = partial(deque, maxlen=0)  # runs an iterator to its end in C
_EVENT_KEYS = ("events", "telemetry_events")
# POSIX only (elsewhere segments are read): a mapped file there can still be pruned by a writer
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0) if hasattr(mmap, "MAP_SHARED") else None
# msgspec raises UnicodeDecodeError (not a DecodeError) for bytes that are not UTF-8 in a string,
# RecursionError for a document nested deeper than it follows (stepwatch._decode)
_UNREADABLE = DECODE_FAILURES


class LoadedTelemetrySession(msgspec.Struct, kw_only=True):
    """One session as loaded: its summary, its events in time order, and what was skipped.

    ``events`` are v3, except v4 records with a counter v3 requires unknown (null), which stay
    ``TelemetryEventV4``; ``skipped_records`` is kept for callers and no longer counts them."""

    summary: SessionSummary
    events: list[LoadedEvent]
    sources: list[str] = msgspec.field(default_factory=list)
    skipped_records: int = 0
    torn_lines: int = 0
    warnings: list[str] = msgspec.field(default_factory=list)
    missing_segments: int = 0
    empty_segments: int = 0
    unreadable_manifests: int = 0


class _Segment(msgspec.Struct):
    events: list[LoadedEvent]
    skipped: int = 0
    torn: int = 0
    # the ranks of `events`, where the fast path collected them
    ranks: set[int] | None = None


def load_telemetry_events(
    path: str | os.PathLike[str],
    permissive_legacy: bool = True,
    events_key: str | None = None,
    session_id: str | None = None,
) -> list[LoadedEvent]:
    """Events of one session: ``session_id``, else the default selection.

    Raises:
        ArtifactError: unreadable artifact, or ``session_id`` not present.
    """
    sessions = load_telemetry_sessions(path, permissive_legacy=permissive_legacy, events_key=events_key)
    if session_id is not None:
        for loaded in sessions:
            if loaded.summary.session_id == session_id:
                return loaded.events
        known = ", ".join(s.summary.session_id for s in sessions) or "none"
        raise ArtifactError(path, f"session {session_id} not found (sessions: {known})")
    chosen = select_default_session([s for s in sessions if s.events] or sessions)
    return chosen.events if chosen is not None else []


def load_telemetry_sessions(
    path: str | os.PathLike[str],
    permissive_legacy: bool = True,
    events_key: str | None = None,
) -> list[LoadedTelemetrySession]:
    """All sessions found at ``path``, ordered by default selection (the first is the default).

    Raises:
        ArtifactError: naming the file, line and field of the first record that cannot be read.
    """
    with _gc_paused():
        return _load_sessions(Path(path), permissive_legacy, events_key)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic GC off while a load builds its objects, back as it was afterwards.

    Real records carry containers in ``metadata`` (the collector's ``collector_partial_fields``
    list), so each event adds two GC-tracked objects; with the GC on, its ever larger
    collections over a load's millions of new, acyclic objects took half of a 1M-event load
    (2.6 of 5.2 s, CHANGELOG.md). A load creates no reference cycles, so nothing is missed.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _load_sessions(root: Path, permissive_legacy: bool, events_key: str | None) -> list[LoadedTelemetrySession]:
    if not root.exists():
        raise ArtifactError(root, "no such file or directory")
    if root.is_dir():
        sinks = find_sink_dirs(root)
        if not sinks:
            raise ArtifactError(root, "no telemetry found (no manifest.json, segment-*.jsonl or telemetry/rank*/)")
        return _merge([session for sink in sinks for session in _load_sink(sink, None, permissive_legacy)])
    if root.name == MANIFEST_FILENAME:
        return _load_sink(root.parent, None, permissive_legacy, manifest_given=True)
    if root.suffix == ".jsonl":
        if _is_empty(root):
            raise ArtifactError(root, "file is empty")
        return _load_sink(root.parent, [root], permissive_legacy)
    return _load_json_export(root, permissive_legacy, events_key)


def find_sink_dirs(root: Path) -> list[Path]:
    """Sink directories at ``root``: itself, or the per-rank sinks of a run directory."""
    if _is_sink(root):
        return [root]
    base = root / "telemetry" if (root / "telemetry").is_dir() else root
    return sorted((p for p in base.iterdir() if p.is_dir() and _is_sink(p)), key=_rank_order)


def _is_sink(path: Path) -> bool:
    return (path / MANIFEST_FILENAME).is_file() or any(path.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}"))


def _is_empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False  # the read that follows names the problem


def _rank_order(path: Path) -> tuple[int, str]:
    digits = "".join(ch for ch in path.name if ch.isdigit())
    return (int(digits) if digits else 1 << 30, path.name)


# -- sinks -------------------------------------------------------------------------------------


def _load_sink(
    root: Path, only: list[Path] | None, permissive_legacy: bool, manifest_given: bool = False
) -> list[LoadedTelemetrySession]:
    manifest_path = root / MANIFEST_FILENAME
    manifest, manifest_problem = _read_sink_manifest(manifest_path, manifest_given)
    if only is None:
        paths, missing, on_disk = _sink_segments(root, manifest)
        if missing and manifest is not None:
            # A writer prunes by rewriting the manifest first, then unlinking: a manifest read
            # just before that names a file already gone. Read it once more before believing it.
            manifest, manifest_problem = _read_sink_manifest(manifest_path, manifest_given)
            paths, missing, on_disk = _sink_segments(root, manifest)
        if manifest is not None and not paths and not manifest.sessions:
            raise ArtifactError(manifest_path, "sink holds no segments and no sessions")
        if manifest is None and not on_disk and manifest_problem is not None:
            raise ArtifactError(manifest_path, f"{manifest_problem}, and the sink holds no segments")
    else:
        paths, missing = only, []
    owner = {s.filename: s.session_id for s in manifest.segments} if manifest else {}
    recorded = {s.filename: s.size_bytes for s in manifest.segments} if manifest else {}
    emptied = [p.name for p in paths if recorded.get(p.name) and _is_empty(p)] if only is None else []
    fallback = synthetic_session_id(str(root.resolve()), "sink")
    groups: dict[str, LoadedTelemetrySession] = {}
    order: dict[str, _Order] = {}
    newest = paths[-1] if paths else None
    for path in paths:
        hint = owner.get(path.name) or fallback
        # Only the newest segment can still be written to (and cut back by its writer).
        segment = _read_jsonl(path, hint, permissive_legacy, closed=path != newest)
        events = segment.events
        source = str(path)
        # Every pass here is one C-level loop per segment, while its ~10 MB of new objects are
        # still in cache; the per-event Python loop runs only for a segment of several sessions.
        owners = list(map(_session_of, events))
        if owners and owners.count(owners[0]) == len(owners):  # usual: one segment, one session
            session_id = owners[0]
            group = groups.get(session_id) or groups.setdefault(session_id, _empty(session_id))
            # One string object for the whole session instead of one per record: 88 bytes less
            # per event, and the freed blocks take the next segment's objects (fewer page faults).
            _drain(map(setattr, events, repeat("session_id"), repeat(group.summary.session_id)))
            group.events.extend(events)
            group.sources.append(source)
            known = order.get(session_id) or order.setdefault(session_id, _Order())
            known.add_sorted(events[0].timestamp_ns, events[-1].timestamp_ns, segment.ranks)
        else:
            for event in events:
                group = groups.get(event.session_id)
                if group is None:
                    group = groups[event.session_id] = _empty(event.session_id)
                group.events.append(event)
                if not group.sources or group.sources[-1] != source:
                    group.sources.append(source)
                    order.setdefault(event.session_id, _Order()).unknown()
        target = groups.get(hint)
        if target is None and path.name in owner and owner[path.name] and (segment.skipped or segment.torn):
            # nothing of the segment loaded, but the manifest names its session: count it there
            target = groups[hint] = _empty(hint)
        if target is None and groups:
            target = groups[next(iter(groups))]
        if target is not None:
            target.skipped_records += segment.skipped
            target.torn_lines += segment.torn
    ledger = {s.session_id: s for s in manifest.sessions} if manifest else {}
    if only is None:
        for session_id in ledger:
            groups.setdefault(session_id, _empty(session_id))
    sessions = []
    for session_id, loaded in groups.items():
        known = order.get(session_id)
        if known is None or not known.ordered:
            loaded.events.sort(key=_by_time)
        ranks = known.ranks if known is not None else None
        loaded.summary = _summarise(ledger.get(session_id), session_id, loaded.events, sorted_=True, ranks=ranks)
        lost = [name for name in missing if owner.get(name) in (session_id, None)]
        if lost:
            loaded.missing_segments = len(lost)
            loaded.warnings.append(
                f"segments listed in the manifest are missing: {', '.join(lost)} (session incomplete)"
            )
        gone = [name for name in emptied if owner.get(name) in (session_id, None)]
        if gone:
            # Like a segment cut short by a crash (records lost, a torn tail), not a missing
            # one: the session keeps its status, the loss is counted and said.
            loaded.empty_segments = len(gone)
            loaded.warnings.append(f"file is empty although the manifest recorded data: {', '.join(gone)}")
        if manifest_problem is not None:
            loaded.unreadable_manifests = 1
            loaded.warnings.append(
                f"{manifest_path}: {manifest_problem}; sessions rebuilt from the segments (incomplete)"
            )
        if lost or manifest_problem is not None:
            # What is left cannot prove a clean or recovered stop (spec: `incomplete`).
            loaded.summary = msgspec.structs.replace(loaded.summary, status="incomplete")
        sessions.append(loaded)
    return sort_sessions(sessions)


def _read_sink_manifest(path: Path, given: bool) -> tuple[SinkManifest | None, str | None]:
    """The sink's manifest, or (None, why) when a present one cannot be read.

    Only a manifest named by the caller is an error; inside a sink the segments are the data
    and the manifest an index, so an unreadable one is skipped (telemetry-current-practice.md:
    files without a manifest load as ``incomplete``).
    """
    if not path.is_file():
        return None, None
    try:
        return read_manifest(path), None
    except ArtifactError as exc:
        if given:
            raise
        return None, exc.reason


def _sink_segments(
    root: Path, manifest: SinkManifest | None
) -> tuple[list[Path], list[str], list[Path]]:
    """(segments to read, names listed but missing, segment files on disk) of one sink."""
    listed = [root / s.filename for s in manifest.segments] if manifest else []
    known = {p.name for p in listed}
    on_disk = sorted(root.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}"))
    present = [p for p in listed if p.exists()]
    paths = present + [p for p in on_disk if p.name not in known]
    missing = [p.name for p in listed if not p.exists()]
    return paths, missing, on_disk


class _Order:
    """What the segments of one session already proved: time order and the ranks seen."""

    __slots__ = ("last_ns", "ordered", "ranks")

    def __init__(self) -> None:
        self.last_ns = -1
        self.ordered = True
        self.ranks: set[int] | None = set()

    def add_sorted(self, first_ns: int, last_ns: int, ranks: set[int] | None) -> None:
        """A time-sorted segment appended whole: still in order if it starts after the last."""
        if first_ns < self.last_ns:
            self.ordered = False
        self.last_ns = max(self.last_ns, last_ns)
        if ranks is None or self.ranks is None:
            self.ranks = None
        else:
            self.ranks |= ranks

    def unknown(self) -> None:
        self.ordered = False
        self.ranks = None


def _empty(session_id: str) -> LoadedTelemetrySession:
    return LoadedTelemetrySession(
        summary=SessionSummary(session_id=session_id, status="incomplete", started_at_ns=0), events=[]
    )


def _read_jsonl(path: Path, session_hint: str, permissive_legacy: bool, closed: bool = False) -> _Segment:
    """The records of one segment, in time order."""
    try:
        data = _mapped(path) if closed else None
        if data is None:
            data = path.read_bytes()
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror}") from exc
    torn = 0
    if data and data[-1] != 0x0A:  # no final newline
        data = bytes(data)
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        data = data[:cut]
        try:
            _any.decode(tail)
            data += tail + b"\n"  # complete record, only its newline missing
        except RecursionError:
            data += tail + b"\n"  # not a write cut short: the line-by-line reader names it
        except _UNREADABLE:
            torn = 1  # a write cut short by a crash: ignored, spec "truncated final JSONL line"
    segment = _decode_segment(data, torn)
    if segment is None:
        segment = _read_jsonl_slow(path, bytes(data), session_hint, permissive_legacy, torn)
    segment.events.sort(key=_by_time)
    return segment


def _mapped(path: Path) -> mmap.mmap | None:
    """A closed segment mapped read-only, or None where mapping is not possible (empty file).

    Decoding straight from the page cache skips the copy ``read`` makes into a fresh buffer
    that must be faulted in: ~0.1-0.2 µs of the ~1.6 µs per loaded event (CHANGELOG.md).
    Only closed segments: a writer may cut back the active one, and a mapped page past a
    truncation would raise SIGBUS.
    """
    if _MAP_FLAGS is None:
        return None
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            return None
        try:
            return mmap.mmap(file.fileno(), size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None


def _decode_segment(data: bytes | mmap.mmap, torn: int) -> _Segment | None:
    """All of a segment in one msgspec call (all v3, or all v4); None: go line by line."""
    try:
        events = _v3_lines.decode_lines(data)
    except (msgspec.MsgspecError, *_UNREADABLE):
        pass
    else:
        # The identity rule for the whole segment at once: every rank and local_rank below
        # the smallest world_size. Three C-level passes over ints (no tuple per record, which
        # would also wake the cyclic GC); the line-by-line path names a record that breaks it.
        ranks = set(map(_rank_of, events))
        if events:
            smallest_world = min(map(_world_of, events))
            beyond = max(ranks) >= smallest_world or max(map(_local_rank_of, events)) >= smallest_world
            if beyond and _identity_broken(events):
                return None
        return _Segment(events, 0, torn, ranks)
    try:
        v4_events = _v4_lines.decode_lines(data)
    except (msgspec.MsgspecError, *_UNREADABLE):
        return None
    return _Segment(list(map(loaded_event, v4_events)), 0, torn)


def _identity_broken(events: list[LoadedEvent]) -> bool:
    """Whether a record breaks `rank`/`local_rank` < `world_size` (mixed world sizes need this)."""
    return any(identity_problem(e.rank, e.local_rank, e.world_size) for e in events)


def _read_jsonl_slow(
    path: Path, data: bytes, session_hint: str, permissive_legacy: bool, torn: int
) -> _Segment:
    """Line by line: mixed versions, legacy records, and precise errors."""
    segment = _Segment([], 0, torn)
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = _any.decode(line)
        except _UNREADABLE as exc:
            raise ArtifactError(path, f"malformed JSON: {undecodable(exc)}", line=number) from None
        try:
            segment.events.append(
                loaded_event_from_record(
                    record, permissive_legacy=permissive_legacy, default_session_id=session_hint
                )
            )
        except ValidationError as exc:
            raise ArtifactError(path, str(exc), line=number, field=exc.field) from None
    return segment


# -- JSON exports ------------------------------------------------------------------------------


def _load_json_export(
    path: Path, permissive_legacy: bool, events_key: str | None
) -> list[LoadedTelemetrySession]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror}") from exc
    if not data.strip():
        raise ArtifactError(path, "not valid JSON: file is empty")
    try:
        payload = _any.decode(data)
    except _UNREADABLE as exc:
        raise ArtifactError(path, f"not valid JSON: {undecodable(exc)}") from None
    records, key = _event_list(path, payload, events_key)
    ledger: dict[str, SessionSummary] = {}
    if isinstance(payload, dict) and isinstance(payload.get("session_summary"), dict):
        try:
            summary = msgspec.convert(payload["session_summary"], SessionSummary, strict=False)
        except msgspec.ValidationError as exc:
            error = translate_validation_error(exc, "$.session_summary")
            raise ArtifactError(path, str(error), field=error.field) from None
        ledger[summary.session_id] = summary
    fallback = synthetic_session_id(str(path.resolve()), events_key or "json")
    groups: dict[str, LoadedTelemetrySession] = {}
    for index, record in enumerate(records):
        try:
            event = loaded_event_from_record(
                record, permissive_legacy=permissive_legacy, default_session_id=fallback
            )
        except ValidationError as exc:
            field = exc.field.replace("$", f"$.{key}[{index}]" if key else f"$[{index}]", 1)
            raise ArtifactError(path, f"{field}: {exc.rule}", field=field) from None
        group = groups.get(event.session_id) or groups.setdefault(event.session_id, _empty(event.session_id))
        group.events.append(event)
    sessions = []
    for session_id, loaded in groups.items():
        loaded.sources.append(str(path))
        loaded.summary = _summarise(ledger.get(session_id), session_id, loaded.events)
        sessions.append(loaded)
    return sort_sessions(sessions)


def _event_list(path: Path, payload: Any, events_key: str | None) -> tuple[list[Any], str | None]:
    if isinstance(payload, list):
        return payload, None
    if not isinstance(payload, dict):
        raise ArtifactError(path, f"expected a JSON array or object of telemetry events, got {type(payload).__name__}")
    if events_key is not None:
        if not isinstance(payload.get(events_key), list):
            raise ArtifactError(path, f"key {events_key!r} does not hold a list of events", field=f"$.{events_key}")
        return payload[events_key], events_key
    for key in _EVENT_KEYS:
        if isinstance(payload.get(key), list):
            return payload[key], key
    for key in _EVENT_KEYS:
        if key in payload:  # the events' key, holding something else: say so, as validate does
            raise ArtifactError(
                path, f"no telemetry events found: {events_key_problem(key, payload[key])}", field=f"$.{key}"
            )
    if "timestamp_ns" in payload or "timestamp" in payload or "schema_version" in payload:
        return [payload], None
    raise ArtifactError(path, f"no telemetry events found (looked for {', '.join(_EVENT_KEYS)}, or one record)")


def events_key_problem(key: str, value: Any) -> str:
    """Why ``{"<key>": value}`` is not a list of events (shared with ``stepwatch validate``)."""
    return f"$.{key} must be an array of telemetry events, got {_json_type(value)}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else type(value).__name__


# -- summaries and merging ---------------------------------------------------------------------


def _summarise(
    ledger: SessionSummary | None,
    session_id: str,
    events: list[LoadedEvent],
    sorted_: bool = False,
    ranks: set[int] | None = None,
) -> SessionSummary:
    """The session's summary; sorts ``events`` by time unless the caller says they are."""
    if not sorted_:
        events.sort(key=_by_time)
    first = events[0] if events else None
    last = events[-1] if events else None
    ranks = tuple(sorted(set(map(_rank_of, events)) if ranks is None else ranks))
    counts = {
        "event_count": len(events),
        "first_timestamp_ns": first.timestamp_ns if first else None,
        "last_timestamp_ns": last.timestamp_ns if last else None,
        "ranks": ranks,
    }
    if ledger is None:
        # No ledger entry: only a `stop` event proves a clean stop (as Stormlog's reader infers);
        # otherwise nothing proves a clean or recovered stop (spec: `incomplete`).
        stops = [e.timestamp_ns for e in events if e.event_type == "stop"]
        return SessionSummary(
            session_id=session_id,
            status="completed" if stops else "incomplete",
            started_at_ns=first.timestamp_ns if first else 0,
            ended_at_ns=stops[-1] if stops else None,
            host=first.host if first else "unknown",
            pid=first.pid if first else -1,
            job_id=first.job_id if first else None,
            rank=first.rank if first else 0,
            local_rank=first.local_rank if first else 0,
            world_size=first.world_size if first else 1,
            source="artifact",
            **counts,
        )
    status = ledger.status
    if status == "running" and not process_alive(ledger.host, ledger.pid, ledger.started_at_ns):
        status = "incomplete"  # left running by a process that is gone, and not yet recovered
    return msgspec.structs.replace(ledger, status=status, **counts)


def _merge(sessions: Iterable[LoadedTelemetrySession]) -> list[LoadedTelemetrySession]:
    """Joins the per-rank parts of each session id into one session."""
    merged: dict[str, list[LoadedTelemetrySession]] = {}
    for loaded in sessions:
        merged.setdefault(loaded.summary.session_id, []).append(loaded)
    out = []
    for parts in merged.values():
        if len(parts) == 1:
            out.append(parts[0])
            continue
        events = [e for p in parts for e in p.events]
        events.sort(key=_by_time)
        summaries = [p.summary for p in parts]
        status = worst_status(s.status for s in summaries)
        ended = [s.ended_at_ns for s in summaries]
        base = min(summaries, key=lambda s: s.rank)
        out.append(
            LoadedTelemetrySession(
                summary=msgspec.structs.replace(
                    base,
                    status=status,
                    started_at_ns=min(s.started_at_ns for s in summaries),
                    ended_at_ns=None if None in ended else max(ended),  # type: ignore[type-var]
                    world_size=max(s.world_size for s in summaries),
                    event_count=len(events),
                    first_timestamp_ns=events[0].timestamp_ns if events else None,
                    last_timestamp_ns=events[-1].timestamp_ns if events else None,
                    ranks=tuple(sorted({r for s in summaries for r in s.ranks})),
                ),
                events=events,
                sources=[src for p in parts for src in p.sources],
                skipped_records=sum(p.skipped_records for p in parts),
                torn_lines=sum(p.torn_lines for p in parts),
                warnings=[w for p in parts for w in p.warnings],
                missing_segments=sum(p.missing_segments for p in parts),
                empty_segments=sum(p.empty_segments for p in parts),
                unreadable_manifests=sum(p.unreadable_manifests for p in parts),
            )
        )
    return sort_sessions(out)
