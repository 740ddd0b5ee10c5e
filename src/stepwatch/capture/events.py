"""Builds canonical v3 records from collector readings, phase rows and lifecycle moments.

Runs on the background thread only. Phase and lifecycle records carry the memory counters of
the latest sample (marked ``counters_source: "last_sample"``) instead of sampling again on the
caller's thread — that is what keeps a phase pair in microseconds. Phase attributes are the
user's objects, made JSON-safe here too (``json_safe``), never on the caller's thread.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ..artifacts.heartbeat import json_safe
from ..schema import SCHEMA_VERSION_V3, TelemetryEventV3
from .collectors.base import Reading
from .identity import DistributedIdentity

__all__ = ["EventFactory", "safe_attributes"]

_NO_READING = Reading(device_id=-1, allocated=0, reserved=0, used=0)
_replace = msgspec.structs.replace
_PHASE_TYPES = {"enter": ("phase_enter", "Phase entered: "), "exit": ("phase_exit", "Phase exited: ")}
_PLAIN = frozenset({bool, int, float, type(None)})


def safe_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """Phase attributes as the sink can always encode them: ``epoch=numpy.int64(3)`` or a custom
    object would otherwise fail the encode of the record (and lose it). The usual attributes
    (ints, floats, ASCII text) pass as they are, uncopied."""
    for value in attributes.values():
        kind = type(value)
        if kind not in _PLAIN and (kind is not str or not value.isascii()):
            return json_safe(attributes)  # type: ignore[no-any-return]
    return attributes


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
        # Point and phase records differ from one another only in four fields: they are copies
        # of one record built from ``last`` (msgspec.structs.replace: ~0.2 us against ~1.3 us
        # for the constructor), rebuilt when a new sample becomes ``last``.
        self._template: TelemetryEventV3 | None = None
        self._template_of: tuple[str, Reading, dict[str, Any]] | None = None
        self._backend = "cpu"
        self._counters_source = "none"

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

    def _base(self) -> TelemetryEventV3:
        """The record every point and phase record is a copy of, for the current ``last``."""
        last = self.last
        template = self._template
        if template is None or self._template_of is not last:
            collector, reading, health = last or ("stepwatch.runtime", _NO_READING, {})
            template = self._template = self._event(
                timestamp_ns=0, event_type="point", collector=collector, reading=reading, change=0,
                context=None, metadata={},
            )
            self._template_of = last
            self._backend = health.get("backend", "cpu")
            self._counters_source = "last_sample" if last else "none"
        return template

    def point(
        self, event_type: str, *, context: str | None = None, metadata: dict[str, Any] | None = None,
        timestamp_ns: int | None = None, collector: str | None = None,
    ) -> TelemetryEventV3:
        """A lifecycle, health, phase or error record carrying the last sampled counters."""
        base = self._base()
        meta = {"backend": self._backend, "counters_source": self._counters_source}
        if metadata:
            meta.update(metadata)
        return _replace(
            base, timestamp_ns=timestamp_ns or time.time_ns(), event_type=event_type,
            collector=collector or base.collector, context=context, metadata=meta,
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
            scope["attributes"] = safe_attributes(attributes)
        event_type, verb = _PHASE_TYPES[action]
        return _replace(
            self._base(), timestamp_ns=timestamp_ns, event_type=event_type,
            context=verb + (path[0] if len(path) == 1 else " / ".join(path)),
            metadata={"backend": self._backend, "counters_source": self._counters_source, "phase_scope": scope},
        )
