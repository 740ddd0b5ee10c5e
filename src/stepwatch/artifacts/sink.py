"""The append-only telemetry sink: ``manifest.json`` plus ``segment-NNNNNN.jsonl`` files.

Crash safety rests on three rules:
  * segments are only appended to (``O_APPEND``), one canonical v3 record per line;
  * the manifest is only ever replaced atomically (temp file, fsync, rename);
  * on open, a session a dead writer left ``running`` is closed as ``interrupted``, torn
    segment tails are cut back, and new records go to a new session in a new segment;
  * one writer process per directory: ``.writer.lock`` (a POSIX lock the OS drops when its
    process dies) refuses a second live writer, whose recovery would otherwise interrupt the
    first one's session and whose manifest writes would overwrite the first one's;
  * only whole lines reach a segment: a record that cannot be encoded is dropped before any
    of its bytes are buffered, and a write that fails part-way is cut back (or the segment is
    closed) so nothing is ever appended after a partial line.
A reader therefore trusts the segment files over the manifest's counts.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..errors import ArtifactError, ConfigError, ValidationError
from ..schema import (
    SessionStatus,
    SessionSummary,
    TelemetryEventV3,
    new_session_id,
    telemetry_event_from_record,
)
from ._files import (
    WRITER_LOCK_FILENAME,
    WriterLockBusy,
    acquire_writer_lock,
    cut_torn_tail,
    process_alive,
    release_writer_lock,
)
from .manifest import (
    MANIFEST_FILENAME,
    SEGMENT_PREFIX,
    SEGMENT_SUFFIX,
    SegmentEntry,
    SinkManifest,
    read_manifest,
    segment_filename,
    write_manifest,
)

__all__ = ["RecordNotEncodable", "SinkConfig", "TelemetrySink"]

_monotonic = time.monotonic
# Records appended are encoded together once this many are pending (or a flush bound or the
# flush interval is reached first): one msgspec call per batch instead of one per record.
_ENCODE_BATCH = 256
# fsync="close": a closed segment at least this large is synced on a helper thread
_BACKGROUND_SYNC_BYTES = 1 << 20

FsyncPolicy = Literal["flush", "close", "never"]
# What msgspec raises for a value it cannot write as JSON (RecursionError: nested too deeply).
_ENCODE_ERRORS = (TypeError, ValueError, OverflowError, RecursionError)


class RecordNotEncodable(ValidationError, TypeError):
    """A record appended to the sink cannot be written as JSON; it was dropped, nothing of it written.

    A ``ValidationError`` (``field`` names the value, e.g. ``$.metadata.handle``) and, as
    msgspec's own error was, a ``TypeError``. ``dropped`` counts the records this error stands for.
    """

    def __init__(self, field: str, rule: str, dropped: int = 1) -> None:
        super().__init__(field, rule)
        self.dropped = dropped


class SinkConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How often the sink writes, syncs, rolls over and prunes.

    Example::

        SinkConfig(flush_every_events=50, flush_every_seconds=2.0, fsync="flush")

    Attributes:
        flush_every_events: write the buffer once it holds this many records.
        flush_every_seconds: ... or once this long has passed since the last write.
        fsync: ``"flush"`` syncs data and manifest at every flush (crash- and power-safe),
            ``"close"`` only at rollover and close (crash-safe: the page cache survives a
            killed process), ``"never"`` leaves it to the OS.
        rollover_max_bytes / rollover_max_events: start a new segment past either.
        retention_max_files / retention_max_total_bytes: prune the oldest closed segments
            past either; the segment being written is never pruned.
        manifest_every_seconds: with ``fsync`` other than ``"flush"``, a flush that only
            grew the open segment rewrites ``manifest.json`` (its counts and sizes) at most this
            often; a new segment, a pruned one, a session begun or closed rewrite it at once.
            Readers never depend on those counts (a loader reads the segments whole, recovery
            recounts them); 0 rewrites it at every flush.
    """

    flush_every_events: int = 50
    flush_every_seconds: float = 2.0
    fsync: FsyncPolicy = "flush"
    rollover_max_bytes: int = 64 * 1024 * 1024
    rollover_max_events: int = 10_000
    retention_max_files: int = 8
    retention_max_total_bytes: int = 512 * 1024 * 1024
    manifest_every_seconds: float = 0.0

    def __post_init__(self) -> None:
        # Types first, so a string from an environment variable fails with the option's name
        # rather than as a TypeError from a comparison below.
        for name in ("flush_every_events", "rollover_max_bytes", "rollover_max_events",
                     "retention_max_files", "retention_max_total_bytes", "flush_every_seconds",
                     "manifest_every_seconds"):
            value = getattr(self, name)
            allowed = (int, float) if name.endswith("_seconds") else (int,)
            if isinstance(value, bool) or not isinstance(value, allowed):
                raise ConfigError(f"SinkConfig.{name} must be a number, got {value!r}")
        checks = (
            ("flush_every_events", self.flush_every_events >= 1, ">= 1"),
            ("flush_every_seconds", self.flush_every_seconds > 0, "> 0"),
            ("manifest_every_seconds", self.manifest_every_seconds >= 0, ">= 0"),
            ("rollover_max_bytes", self.rollover_max_bytes >= 1, ">= 1"),
            ("rollover_max_events", self.rollover_max_events >= 1, ">= 1"),
            ("retention_max_files", self.retention_max_files >= 1, ">= 1"),
            ("retention_max_total_bytes", self.retention_max_total_bytes >= self.rollover_max_bytes,
             ">= rollover_max_bytes"),
            ("fsync", self.fsync in ("flush", "close", "never"), "one of flush, close, never"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"SinkConfig.{name} must be {rule}, got {getattr(self, name)!r}")


class TelemetrySink:
    """Appends v3 records of one session at a time to a sink directory.

    Example::

        sink = TelemetrySink("run/telemetry/rank0")
        session = sink.start_session()
        sink.append(event)           # buffered; written per SinkConfig
        sink.close("completed")

    Not thread-safe by design beyond its own lock: the runtime's one background thread is its
    only writer.
    """

    def __init__(self, root: str | os.PathLike[str], config: SinkConfig | None = None) -> None:
        self.root = Path(root)
        self.config = config or SinkConfig()
        self.root.mkdir(parents=True, exist_ok=True)
        self._manifest_path = self.root / MANIFEST_FILENAME
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()
        self._pending: list[TelemetryEventV3] = []  # appended, not yet encoded
        self._pending_room = 1
        # Encoded, not yet written: the first `_buffer_size` bytes of `_buf` (whole lines, their
        # count in `_buffered`). `_buf` keeps its size between writes: a new buffer per write
        # would be page-faulted in again each time (glibc gives large blocks back to the OS).
        self._buf = bytearray()
        self._buffer_size = 0
        self._buffered = 0
        self._session_id: str | None = None
        self._last_flush = time.monotonic()
        self._fd: int | None = None
        self._sync_thread: threading.Thread | None = None
        self._sync_errors: list[OSError] = []
        self._session: SessionSummary | None = None
        self._closed = False
        self._bytes_room = 0
        self._events_room = 0
        self._flush_deadline = 0.0
        self.recovered_sessions: list[str] = []
        # sessions left `running` whose writer process is still alive: not recovered
        self.live_sessions: list[str] = []
        self.torn_bytes_cut = 0
        # records dropped because they could not be encoded (each also raised, see append)
        self.unencodable_dropped = 0
        self._doomed: list[Path] = []  # pruned segments, unlinked once the manifest forgets them
        self._manifest_written = 0.0  # monotonic time of the last manifest write (manifest_every_seconds)
        self._lock_key: str | None = None
        self._take_writer_lock()
        self._release_on_gc = weakref.finalize(self, release_writer_lock, self._lock_key)
        try:
            self._manifest = self._recover()
        except BaseException:
            self._release_writer_lock()
            raise

    # -- public verbs ------------------------------------------------------------------------

    @property
    def session(self) -> SessionSummary | None:
        return self._session

    @property
    def ledger(self) -> list[SessionSummary]:
        """Every session this sink directory has recorded, oldest first."""
        return list(self._manifest.sessions)

    def start_session(self, summary: SessionSummary | None = None) -> SessionSummary:
        """Registers the session that following records belong to (a new one when not given)."""
        with self._lock:
            if self._session is not None:
                return self._session
            if self._lock_key is None and not self._release_on_gc.alive:
                self._take_writer_lock()  # given back by close(): this sink writes again
                self._release_on_gc = weakref.finalize(self, release_writer_lock, self._lock_key)
            summary = summary or SessionSummary(
                session_id=new_session_id(),
                status="running",
                started_at_ns=time.time_ns(),
                host=socket.gethostname(),
                pid=os.getpid(),
                source="stepwatch.telemetry_sink",
            )
            summary = msgspec.structs.replace(summary, status="running", ended_at_ns=None)
            self._session = summary
            self._session_id = summary.session_id
            self._closed = False
            self._manifest.sessions.append(summary)
            self._new_segment()
            self._prune()  # a new session's segment counts against retention like a rollover's
            self._write_manifest()
            return summary

    def append(self, event: TelemetryEventV3 | Mapping[str, Any]) -> None:
        """Buffers one record of the active session; writes when the flush policy says so.

        Structs built by stepwatch are trusted; a mapping is validated as v3 first. The sink
        keeps the struct (up to ``_ENCODE_BATCH`` of them) and encodes them together, so do
        not change an event after appending it. A record ``msgspec`` cannot encode (a metadata
        value of an unsupported type) is dropped when its batch is encoded, before any of its
        bytes are buffered, counted in ``unencodable_dropped``, and raised as
        ``RecordNotEncodable`` from the call that encoded it (this one or a later append, flush
        or close); the other records of the batch are kept.
        """
        if type(event) is not TelemetryEventV3 and not isinstance(event, TelemetryEventV3):
            event = telemetry_event_from_record(event, permissive_legacy=False)
        with self._lock:
            if event.session_id != self._session_id:
                self._reject(event)
            pending = self._pending
            pending.append(event)
            # The per-record work is one list append and two comparisons; the bounds are
            # checked per batch (CHANGELOG.md, "Where the time goes").
            if len(pending) >= self._pending_room or _monotonic() >= self._flush_deadline:
                self._encode_pending_locked()
                self._flush_if_due_locked()

    def _take_writer_lock(self) -> None:
        try:
            self._lock_key = acquire_writer_lock(self.root)
        except WriterLockBusy as busy:
            raise ArtifactError(
                self.root,
                f"another process is writing this sink ({busy.holder}, holding {WRITER_LOCK_FILENAME}); "
                "two writers would interrupt each other's session and overwrite each other's manifest: "
                "give each process its own directory",
            ) from None

    def _release_writer_lock(self) -> None:
        self._release_on_gc.detach()
        release_writer_lock(self._lock_key)
        self._lock_key = None

    def _reject(self, event: TelemetryEventV3) -> None:
        if self._session is None:
            raise ArtifactError(self.root, "append before start_session (or after close)")
        raise ArtifactError(
            self.root,
            f"record of session {event.session_id} appended to session {self._session_id}",
            field="$.session_id",
        )

    def _encode_pending_locked(self) -> None:
        """Moves the pending records into the byte buffer, rolling over at the exact bound."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        try:
            lines = self._encoder.encode_lines(pending)  # one C loop for the batch
        except _ENCODE_ERRORS:
            lines = None  # some record cannot be encoded: find it below, keep the others
        try:
            if (
                lines is not None
                and self._buffer_size + len(lines) <= self._bytes_room  # the segment's byte bound
                and self._buffered + len(pending) <= self._events_room
            ):
                self._put(lines)
                self._buffered += len(pending)
            else:
                self._encode_each_locked(pending)
        finally:
            self._update_pending_room()

    def _encode_each_locked(self, pending: list[TelemetryEventV3]) -> None:
        """Record by record: near a rollover bound, or to isolate a record that cannot be encoded.

        Each record is encoded to its own bytes object before anything is buffered, so a record
        that fails leaves no byte behind. The first such failure is raised, once the others are
        buffered, as ``RecordNotEncodable`` counting every record dropped.
        """
        error: RecordNotEncodable | None = None
        encode = self._encoder.encode
        for i, event in enumerate(pending):
            try:
                line = encode(event) + b"\n"
            except _ENCODE_ERRORS as exc:
                self.unencodable_dropped += 1
                if error is None:
                    error = _not_encodable(event, exc)
                else:
                    error.dropped += 1
                continue
            self._put(line)
            self._buffered += 1
            if self._buffer_size >= self._bytes_room or self._buffered >= self._events_room:
                try:
                    self._near_bound_locked(line)
                except BaseException:
                    # The disk failed: the records not buffered yet stay pending, so they are
                    # written by the next flush or counted by discard_buffer, never lost unseen.
                    self._pending[:0] = pending[i + 1:]
                    raise
        if error is not None:
            raise error

    def _flush_if_due_locked(self) -> None:
        """Writes the buffer if a flush bound is reached (events, a segment bound, or time)."""
        if (
            self._buffered >= self._events_room
            or self._buffer_size >= self._bytes_room
            or _monotonic() >= self._flush_deadline
        ):
            self._flush_at_bounds_locked(self._manifest.segments[-1])

    def _put(self, data: bytes) -> None:
        end = self._buffer_size + len(data)
        buf = self._buf
        if end <= len(buf):
            buf[self._buffer_size:end] = data  # same length: a copy, no resize
        else:
            del buf[self._buffer_size:]
            buf += data
        self._buffer_size = end

    def _near_bound_locked(self, line: bytes) -> None:
        """After ``line``, the last record buffered, reached a bound: roll over before it if it
        would carry the segment past its byte bound, then flush if a bound says so."""
        segment = self._manifest.segments[-1]
        before = self._buffer_size - len(line)
        if before + segment.size_bytes and segment.size_bytes + self._buffer_size > self.config.rollover_max_bytes:
            # This record would carry the segment past its byte bound: it starts the next one.
            self._buffer_size = before
            self._buffered -= 1
            try:
                self._flush_locked()
                if self._manifest.segments[-1] is segment:
                    self._rollover()
                    self._write_manifest()
            finally:
                self._put(line)  # buffered again whatever happened: written or counted later
                self._buffered += 1
            segment = self._manifest.segments[-1]
        self._flush_at_bounds_locked(segment)

    def _flush_at_bounds_locked(self, segment: SegmentEntry) -> None:
        if (
            self._buffered >= self.config.flush_every_events
            # a segment never grows past its rollover bounds, whatever the flush cadence
            or segment.event_count + self._buffered >= self.config.rollover_max_events
            or segment.size_bytes + self._buffer_size >= self.config.rollover_max_bytes
            or time.monotonic() - self._last_flush >= self.config.flush_every_seconds
        ):
            self._flush_locked()
        self._update_rooms()

    def _update_rooms(self) -> None:
        """Buffer sizes at which the sink must look closer (flush or roll over)."""
        segments = self._manifest.segments
        if not segments:
            self._bytes_room = self._events_room = 0
            self._update_pending_room()
            return
        segment = segments[-1]
        self._flush_deadline = self._last_flush + self.config.flush_every_seconds
        self._bytes_room = max(1, self.config.rollover_max_bytes - segment.size_bytes)
        self._events_room = max(1, min(self.config.flush_every_events,
                                       self.config.rollover_max_events - segment.event_count))
        self._update_pending_room()

    def _update_pending_room(self) -> None:
        # Encode at the latest when the buffered records reach the events bound, so a flush by
        # count happens on the same append as when every record was encoded at once.
        self._pending_room = max(1, min(_ENCODE_BATCH, self._events_room - self._buffered))

    def flush(self) -> None:
        """Writes the buffer to the segment (and syncs, per policy) before returning."""
        with self._lock:
            try:
                self._encode_pending_locked()
            finally:
                self._flush_locked()

    def maybe_flush(self) -> None:
        """Writes the buffer if ``flush_every_seconds`` has passed (the runtime calls it per tick)."""
        with self._lock:
            if (self._buffer_size or self._pending) and time.monotonic() - self._last_flush >= self.config.flush_every_seconds:
                try:
                    self._encode_pending_locked()
                finally:
                    self._flush_locked()

    def discard_buffer(self) -> int:
        """Drops what a failing disk could not take, so memory stays bounded; returns the count."""
        with self._lock:
            dropped = self._buffered + len(self._pending)
            self._pending, self._buf, self._buffer_size, self._buffered = [], bytearray(), 0, 0
            self._update_pending_room()
            return dropped

    def close(self, status: SessionStatus = "completed") -> SessionSummary | None:
        """Flushes, closes the segment and records the session's terminal ``status``."""
        with self._lock:
            if self._session is None:
                return None
            deferred: Exception | None = None  # raised once the session is closed
            try:
                self._encode_pending_locked()
            except RecordNotEncodable as exc:
                deferred = exc  # that record is dropped, the others are written
            self._flush_locked()
            if self._fd is not None:
                if self.config.fsync != "never":
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
            try:
                self._join_sync()
            except OSError as exc:
                deferred = deferred or exc
            self._manifest.segments[-1].closed = True
            finished = self._session.finished(status)
            self._replace_session(finished)
            self._session = None
            self._session_id = None
            self._buf = bytearray()  # an idle sink holds no write buffer
            self._write_manifest(force_sync=True)
            self._release_writer_lock()  # another process may write here now
            if deferred is not None:
                raise deferred
            return finished

    def __enter__(self) -> TelemetrySink:
        self.start_session()
        return self

    def __exit__(self, typ: object, exc: object, tb: object) -> None:
        self.close("completed" if typ is None else "interrupted")

    # -- internals ---------------------------------------------------------------------------

    def _flush_locked(self) -> None:
        """Writes the encoded buffer (pending records stay pending: callers encode them first)."""
        self._last_flush = time.monotonic()
        self._flush_deadline = self._last_flush + self.config.flush_every_seconds
        if not self._buffer_size or self._fd is None:
            return
        segment = self._manifest.segments[-1]
        with memoryview(self._buf) as view:
            data = view[:self._buffer_size]
            try:
                while data:
                    data = data[os.write(self._fd, data):]
            except BaseException:
                if len(data) != self._buffer_size:
                    self._cut_partial_write(segment)
                raise
            finally:
                data.release()
        segment.event_count += self._buffered
        segment.size_bytes += self._buffer_size
        self._buffer_size = 0
        self._buffered = 0
        if self.config.fsync == "flush":
            os.fsync(self._fd)
        if (
            segment.size_bytes >= self.config.rollover_max_bytes
            or segment.event_count >= self.config.rollover_max_events
        ):
            self._rollover()
            self._write_manifest()
        else:
            self._prune()  # the growing segment counts against the total-size bound too
            if self._doomed or self._manifest_due():
                self._write_manifest()
        self._update_rooms()

    def _manifest_due(self) -> bool:
        """Whether a flush that only grew the open segment rewrites the manifest now."""
        every = self.config.manifest_every_seconds
        return (every <= 0 or self.config.fsync == "flush"
                or time.monotonic() - self._manifest_written >= every)

    def _cut_partial_write(self, segment: SegmentEntry) -> None:
        """A write failed after part of the buffer reached the segment (disk full, say): cut the
        segment back to its last whole line so the retried buffer never follows a partial line;
        where even that fails, close the segment (a torn *final* line is what loaders skip)."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, segment.size_bytes)
            return
        except OSError:
            pass
        fd, self._fd = self._fd, None
        try:
            os.close(fd)
        except OSError:
            pass
        segment.closed = True
        try:
            self._new_segment()
        except OSError:
            pass  # no segment open: the next flush keeps the buffer until one can be opened

    def _write_manifest(self, force_sync: bool = False) -> None:
        sync = force_sync and self.config.fsync != "never" or self.config.fsync == "flush"
        write_manifest(self._manifest_path, self._manifest, fsync=sync)
        self._manifest_written = time.monotonic()
        # Pruned segments go only now: a crash in between leaves a file the manifest no longer
        # lists (adopted by recovery), never a listed segment that is missing.
        while self._doomed:
            try:
                self._doomed.pop().unlink()
            except FileNotFoundError:
                pass

    def _new_segment(self) -> None:
        index = 1 + max((_segment_index(s.filename) for s in self._manifest.segments), default=0)
        index = max(index, 1 + max((_segment_index(p.name) for p in self._segment_files()), default=0))
        entry = SegmentEntry(filename=segment_filename(index), session_id=self._session.session_id)  # type: ignore[union-attr]
        self._fd = os.open(self.root / entry.filename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._manifest.segments.append(entry)
        self._update_rooms()

    def _rollover(self) -> None:
        assert self._fd is not None
        fd, self._fd = self._fd, None
        segment = self._manifest.segments[-1]
        segment.closed = True
        if self.config.fsync == "close" and segment.size_bytes >= _BACKGROUND_SYNC_BYTES:
            # The disk writes the closed segment while this thread encodes the next one; at
            # most one such sync is in flight, and close() waits for it (CHANGELOG.md).
            self._join_sync()
            self._sync_thread = threading.Thread(
                target=_sync_and_close, args=(fd, self._sync_errors), name="stepwatch-sink-sync", daemon=True
            )
            self._sync_thread.start()
        else:
            try:
                if self.config.fsync != "never":
                    os.fsync(fd)
            finally:
                os.close(fd)
        self._new_segment()
        self._prune()

    def _join_sync(self) -> None:
        """Waits for the background sync of the last closed segment; raises its error, if any."""
        if self._sync_thread is not None:
            self._sync_thread.join()
            self._sync_thread = None
        if self._sync_errors:
            raise self._sync_errors.pop()

    def _prune(self) -> None:
        closed = [s for s in self._manifest.segments if s.closed]
        total = sum(s.size_bytes for s in self._manifest.segments)
        files = len(self._manifest.segments)
        for segment in closed:
            if files <= self.config.retention_max_files and total <= self.config.retention_max_total_bytes:
                break
            self._doomed.append(self.root / segment.filename)
            self._manifest.segments.remove(segment)
            self._manifest.pruned_segment_count += 1
            self._manifest.pruned_bytes += segment.size_bytes
            files -= 1
            total -= segment.size_bytes

    def _replace_session(self, summary: SessionSummary) -> None:
        self._manifest.sessions = [
            summary if s.session_id == summary.session_id else s for s in self._manifest.sessions
        ]

    def _segment_files(self) -> list[Path]:
        return sorted(self.root.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}"))

    def _recover(self) -> SinkManifest:
        """Brings a directory a previous writer left behind into a consistent state."""
        manifest = SinkManifest()
        if self._manifest_path.exists():
            try:
                manifest = read_manifest(self._manifest_path)
            except ArtifactError:
                # Never overwrite evidence: keep the bad manifest aside and rebuild from segments.
                aside = self._manifest_path.with_name(f"{MANIFEST_FILENAME}.corrupt-{time.time_ns()}")
                os.replace(self._manifest_path, aside)
                manifest = SinkManifest()
        known = {s.filename for s in manifest.segments}
        for path in self._segment_files():
            if path.name not in known:  # created after the last manifest write
                manifest.segments.append(SegmentEntry(filename=path.name, session_id=_first_session_id(path)))
        manifest.segments.sort(key=lambda s: _segment_index(s.filename))
        changed = False
        for segment in manifest.segments:
            path = self.root / segment.filename
            if segment.closed or not path.exists():
                continue
            self.torn_bytes_cut += cut_torn_tail(path)
            data = path.read_bytes()
            segment.event_count = data.count(b"\n")
            segment.size_bytes = len(data)
            segment.closed = True
            changed = True
        ledger = {s.session_id for s in manifest.sessions}
        for segment in manifest.segments:
            if segment.session_id and segment.session_id not in ledger:
                manifest.sessions.append(
                    SessionSummary(session_id=segment.session_id, status="running", started_at_ns=0)
                )
                ledger.add(segment.session_id)
        me = os.getpid()
        for i, summary in enumerate(manifest.sessions):
            if summary.status == "running" and summary.pid != me and process_alive(
                summary.host, summary.pid, summary.started_at_ns
            ):
                # Its writer still runs (we hold the lock, so it is not a stepwatch sink writer
                # of this version; or it is the process `stepwatch track --pid` samples): only a
                # session left by a dead process is closed.
                self.live_sessions.append(summary.session_id)
                continue
            if summary.status == "running":
                ended = _last_timestamp_ns(self.root, manifest, summary.session_id) or time.time_ns()
                manifest.sessions[i] = summary.finished("interrupted", ended)
                self.recovered_sessions.append(summary.session_id)
                changed = True
        if changed:
            write_manifest(self._manifest_path, manifest, fsync=self.config.fsync != "never")
        return manifest


def _not_encodable(event: TelemetryEventV3, exc: BaseException) -> RecordNotEncodable:
    """The error for a record msgspec could not encode, naming the value that broke it."""
    field = _unencodable_path(event, "$") or "$"
    return RecordNotEncodable(
        field, f"cannot be encoded as JSON ({type(exc).__name__}: {exc}); the record was dropped"
    )


_probe_encoder = msgspec.json.Encoder()


def _unencodable_path(value: Any, path: str, depth: int = 0) -> str | None:
    """The JSON path of the first value inside ``value`` that msgspec cannot encode (error path only)."""
    if depth > 32:
        return path
    if isinstance(value, TelemetryEventV3):
        items: Any = ((f"{path}.{name}", getattr(value, name)) for name in value.__struct_fields__)
    elif isinstance(value, dict):
        items = ((f"{path}.{key}", item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return path
    for where, item in items:
        try:
            _probe_encoder.encode(item)
        except _ENCODE_ERRORS:
            return _unencodable_path(item, where, depth + 1)
    return path  # the container itself (a key msgspec cannot write, say)


def _sync_and_close(fd: int, errors: list[OSError]) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        errors.append(exc)
    finally:
        os.close(fd)


def _segment_index(filename: str) -> int:
    stem = filename[len(SEGMENT_PREFIX):-len(SEGMENT_SUFFIX)]
    return int(stem) if stem.isdigit() else 0


_probe = msgspec.json.Decoder(dict)


def _first_session_id(path: Path) -> str | None:
    with path.open("rb") as handle:
        line = handle.readline()
    try:
        value = _probe.decode(line).get("session_id")
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _last_timestamp_ns(root: Path, manifest: SinkManifest, session_id: str) -> int | None:
    for segment in reversed(manifest.segments):
        path = root / segment.filename
        if segment.session_id != session_id or not path.exists():
            continue
        lines = path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)
        try:
            value = _probe.decode(lines[-1]).get("timestamp_ns")
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, AttributeError):
            continue
        if type(value) is int:
            return value
    return None
