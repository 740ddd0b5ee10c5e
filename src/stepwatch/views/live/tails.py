"""Files that only grow, followed from where the last refresh stopped: a rank's memory samples
(``telemetry/rank<N>/segment-*.jsonl``) and the watchdog's ``alerts.jsonl``. Each refresh reads
only the whole lines written since the last; a damaged line is skipped, never an exception."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from ..._decode import DECODE_FAILURES

__all__ = ["ALERTS_KEPT", "AlertTail", "FileTail", "MemoryFold", "MemorySamples"]

ALERTS_KEPT = 5  # the latest alerts a snapshot carries
_LIST_EVERY_S = 5.0  # a rank's telemetry folder is listed this often (a new segment is rare)


class _Sample(msgspec.Struct):
    session_id: str | None = None
    event_type: str | None = None
    device_id: int | None = None
    allocator_allocated_bytes: int | None = None


class _Alert(msgspec.Struct):
    ts: float | None = None
    kind: str | None = None
    severity: str | None = None
    ranks: list[int] | None = None
    step: int | None = None
    message: str | None = None
    session_id: str | None = None


_sample_decoder = msgspec.json.Decoder(_Sample)
_alert_decoder = msgspec.json.Decoder(_Alert)


def _other_session(found: str | None, wanted: str | None) -> bool:
    """A record of another session than the one shown (a reused run directory's)."""
    return wanted is not None and found not in (None, wanted)


class FileTail:
    """New whole lines of a file that only grows (or is replaced: read again from its start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.inode: int | None = None
        self.offset = 0

    def lines(self) -> list[bytes]:
        try:
            stat = self.path.stat()
            if stat.st_ino != self.inode or stat.st_size < self.offset:
                self.inode, self.offset = stat.st_ino, 0
            if stat.st_size == self.offset:
                return []
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read(stat.st_size - self.offset)
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
        self.offset += end
        return data[:end].splitlines()


class MemoryFold:
    """A rank's memory samples folded to its latest value and peak, per device (-1: the process's
    RSS, of a rank that uses no device); a device's samples are preferred where it has one. The
    same fold for the samples followed in files and those read from the history."""

    def __init__(self) -> None:
        self.latest: dict[int, int] = {}
        self.peak: dict[int, int] = {}

    def add(self, device: Any, value: int) -> None:
        device = device if type(device) is int and device >= 0 else -1
        self.latest[device] = value
        self.peak[device] = max(value, self.peak.get(device, value))

    def by_device(self) -> dict[str, tuple[int, int]]:
        """Each device's (latest, peak), by its index as text; the process's RSS as ``rss``."""
        return {("rss" if d < 0 else str(d)): (self.latest[d], self.peak[d]) for d in sorted(self.latest)}

    def now(self) -> tuple[int | None, int | None, str | None]:
        """(latest, peak, kind): ``device`` (the largest device's), else ``rss``; Nones for none."""
        devices = [d for d in self.latest if d >= 0]
        if devices:
            return (max(self.latest[d] for d in devices), max(self.peak[d] for d in devices), "device")
        if -1 in self.latest:
            return self.latest[-1], self.peak[-1], "rss"
        return None, None, None


class MemorySamples:
    """One rank's memory samples, followed in its telemetry folder's segments."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fold = MemoryFold()
        self._files: dict[Path, FileTail] = {}
        self._names: list[Path] = []
        self._listed_at = float("-inf")

    def read(self, session_id: str | None, now: float) -> tuple[int | None, int | None, str | None]:
        """The new samples folded in; (latest, peak, kind) as ``MemoryFold.now``."""
        if now - self._listed_at >= _LIST_EVERY_S:  # a new segment is rare: the folder is listed now and then
            self._listed_at = now
            try:
                self._names = sorted(self.directory.glob("segment-*.jsonl"))
            except OSError:
                return self.fold.now()
        for path in self._names:
            for raw in self._files.setdefault(path, FileTail(path)).lines():
                try:
                    sample = _sample_decoder.decode(raw)
                except DECODE_FAILURES:
                    continue
                if sample.event_type != "sample" or type(sample.allocator_allocated_bytes) is not int:
                    continue
                if not _other_session(sample.session_id, session_id):
                    self.fold.add(sample.device_id, sample.allocator_allocated_bytes)
        return self.fold.now()


class AlertTail:
    """The watchdog's alerts of one session, the latest ``ALERTS_KEPT``, oldest first."""

    def __init__(self, path: Path) -> None:
        self._tail = FileTail(path)
        self._recent: list[dict[str, Any]] = []

    def read(self, session_id: str | None) -> list[dict[str, Any]]:
        for raw in self._tail.lines():
            try:
                alert = _alert_decoder.decode(raw)
            except DECODE_FAILURES:
                continue
            if alert.kind is None or _other_session(alert.session_id, session_id):
                continue
            self._recent.append({"kind": alert.kind, "severity": alert.severity,
                                 "ranks": [r for r in alert.ranks or () if type(r) is int],
                                 "step": alert.step, "message": alert.message, "ts": alert.ts})
            del self._recent[:-ALERTS_KEPT]
        return list(self._recent)
