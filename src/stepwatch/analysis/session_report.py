"""What ``stepwatch inspect`` shows of one session: span, collectors, event types, memory peaks."""

from __future__ import annotations

from collections import Counter

import msgspec

from ..artifacts.telemetry_loader import LoadedTelemetrySession

__all__ = ["DevicePeak", "SessionReport", "report_session"]


class DevicePeak(msgspec.Struct, kw_only=True):
    """Peak memory seen on one device of one rank, and when."""

    rank: int
    device_id: int
    collector: str
    # None while every record of the device left the counter unknown (v4 nulls)
    peak_allocated_bytes: int | None
    peak_allocated_at_ns: int | None
    peak_reserved_bytes: int | None
    peak_reserved_at_ns: int | None
    device_total_bytes: int | None


class SessionReport(msgspec.Struct, kw_only=True):
    session_id: str
    status: str
    host: str
    ranks: tuple[int, ...]
    world_size: int
    event_count: int
    first_timestamp_ns: int | None
    last_timestamp_ns: int | None
    duration_s: float | None
    collectors: dict[str, int]
    event_types: dict[str, int]
    peaks: list[DevicePeak]
    skipped_records: int
    torn_lines: int
    warnings: list[str]


def report_session(session: LoadedTelemetrySession) -> SessionReport:
    """Summarises one loaded session in one pass over its events."""
    collectors: Counter[str] = Counter()
    event_types: Counter[str] = Counter()
    peaks: dict[tuple[int, int, str], DevicePeak] = {}
    for e in session.events:
        collectors[e.collector] += 1
        event_types[e.event_type] += 1
        key = (e.rank, e.device_id, e.collector)
        peak = peaks.get(key)
        if peak is None:
            allocated, reserved = e.allocator_allocated_bytes, e.allocator_reserved_bytes
            peaks[key] = DevicePeak(
                rank=e.rank, device_id=e.device_id, collector=e.collector,
                peak_allocated_bytes=allocated, peak_allocated_at_ns=None if allocated is None else e.timestamp_ns,
                peak_reserved_bytes=reserved, peak_reserved_at_ns=None if reserved is None else e.timestamp_ns,
                device_total_bytes=e.device_total_bytes,
            )
            continue
        # an unknown (null) counter of a v4 record is no reading: it never lowers nor raises a peak
        if e.allocator_allocated_bytes is not None and (
                peak.peak_allocated_bytes is None or e.allocator_allocated_bytes > peak.peak_allocated_bytes):
            peak.peak_allocated_bytes = e.allocator_allocated_bytes
            peak.peak_allocated_at_ns = e.timestamp_ns
        if e.allocator_reserved_bytes is not None and (
                peak.peak_reserved_bytes is None or e.allocator_reserved_bytes > peak.peak_reserved_bytes):
            peak.peak_reserved_bytes = e.allocator_reserved_bytes
            peak.peak_reserved_at_ns = e.timestamp_ns
        if e.device_total_bytes is not None:
            peak.device_total_bytes = e.device_total_bytes
    s = session.summary
    duration = (
        (s.last_timestamp_ns - s.first_timestamp_ns) / 1e9
        if s.first_timestamp_ns is not None and s.last_timestamp_ns is not None
        else None
    )
    return SessionReport(
        session_id=s.session_id, status=s.status, host=s.host, ranks=s.ranks, world_size=s.world_size,
        event_count=s.event_count, first_timestamp_ns=s.first_timestamp_ns,
        last_timestamp_ns=s.last_timestamp_ns, duration_s=duration,
        collectors=dict(collectors.most_common()), event_types=dict(event_types.most_common()),
        peaks=sorted(peaks.values(), key=lambda p: (p.rank, p.device_id, p.collector)),
        skipped_records=session.skipped_records, torn_lines=session.torn_lines,
        warnings=list(session.warnings),
    )

