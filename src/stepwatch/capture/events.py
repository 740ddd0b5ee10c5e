"""Builds canonical v3 records from collector readings, phase rows and lifecycle moments.

Runs on the background thread only. Phase and lifecycle records carry the memory counters of
the latest sample (marked ``counters_source: "last_sample"``) instead of sampling again on the
caller's thread — that is what keeps a phase pair in microseconds.
"""

from __future__ import annotations

import time
from typing import Any

from ..schema import SCHEMA_VERSION_V3, TelemetryEventV3
from .collectors.base import Reading
from .identity import DistributedIdentity

__all__ = ["EventFactory"]

_NO_READING = Reading(device_id=-1, allocated=0, reserved=0, used=0)


class EventFactory:
    def __init__(
        self, *, session_id: str, identity: DistributedIdentity, host: str, pid: int, interval_ms: int
    ) -> None:
        self.session_id = session_id
        self.identity = identity
        self.host = host
        self.pid = pid
        self.interval_ms = interval_ms
        self._previous: dict[tuple[str, int], int] = {}
        self.last: tuple[str, Reading, dict[str, Any]] | None = None  # collector, reading, its metadata

    def _event(
        self, *, timestamp_ns: int, event_type: str, collector: str, reading: Reading, change: int,
        context: str | None, metadata: dict[str, Any],
    ) -> TelemetryEventV3:
        ident = self.identity
        return TelemetryEventV3(
            schema_version=SCHEMA_VERSION_V3,
            session_id=self.session_id,
            timestamp_ns=timestamp_ns,
            event_type=event_type,
            collector=collector,
            sampling_interval_ms=self.interval_ms,
            pid=self.pid,
            host=self.host,
            device_id=reading.device_id,
            allocator_allocated_bytes=reading.allocated,
            allocator_reserved_bytes=reading.reserved,
            allocator_active_bytes=reading.active,
            allocator_inactive_bytes=reading.inactive,
            allocator_change_bytes=change,
            device_used_bytes=reading.used,
            device_free_bytes=reading.free,
            device_total_bytes=reading.total,
            context=context,
            metadata=metadata,
            job_id=ident.job_id,
            rank=ident.rank,
            local_rank=ident.local_rank,
            world_size=ident.world_size,
        )

    def sample(
        self, collector: str, reading: Reading, health: dict[str, Any], timestamp_ns: int, *, primary: bool
    ) -> TelemetryEventV3:
        key = (collector, reading.device_id)
        previous = self._previous.get(key)
        self._previous[key] = reading.allocated
        metadata = dict(health)
        if reading.extra:
            metadata.update({k: v for k, v in reading.extra.items() if v is not None})
        if primary or self.last is None:
            self.last = (collector, reading, health)
        return self._event(
            timestamp_ns=timestamp_ns, event_type="sample", collector=collector, reading=reading,
            change=0 if previous is None else reading.allocated - previous, context=None, metadata=metadata,
        )

    def point(
        self, event_type: str, *, context: str | None = None, metadata: dict[str, Any] | None = None,
        timestamp_ns: int | None = None, collector: str | None = None,
    ) -> TelemetryEventV3:
        """A lifecycle, health, phase or error record carrying the last sampled counters."""
        last_collector, reading, health = self.last or ("stepwatch.runtime", _NO_READING, {})
        meta = {"backend": health.get("backend", "cpu"), "counters_source": "last_sample" if self.last else "none"}
        if metadata:
            meta.update(metadata)
        return self._event(
            timestamp_ns=timestamp_ns or time.time_ns(), event_type=event_type,
            collector=collector or last_collector, reading=reading, change=0, context=context, metadata=meta,
        )

    def phase(self, row: tuple[Any, ...], prefix: str) -> TelemetryEventV3:
        """A ``phase_enter``/``phase_exit`` record from a row in ``PhaseRow`` order."""
        action, timestamp_ns, name, path, scope_seq, parent_seq, thread_id, thread_name, sequence, attributes = row
        scope: dict[str, Any] = {
            "action": action,
            "name": name,
            "path": list(path),
            "depth": len(path),
            "scope_id": f"{prefix}{scope_seq}",
            "parent_scope_id": None if parent_seq is None else f"{prefix}{parent_seq}",
            "thread_id": thread_id,
            "thread_name": thread_name,
            "sequence": sequence,
        }
        if attributes:
            scope["attributes"] = attributes
        verb = "entered" if action == "enter" else "exited"
        return self.point(
            f"phase_{action}", context=f"Phase {verb}: {' / '.join(path)}",
            metadata={"phase_scope": scope}, timestamp_ns=timestamp_ns,
        )
