"""TelemetryEvent records (v2, v3, v4) as msgspec Structs.

One Struct per schema version so that decoding, type checks and the integer minimums run in
msgspec's C core in one pass. The cross-field rules the JSON Schemas cannot express: v4's
capability/null pairing and identity live in its ``__post_init__``; v3's `rank < world_size`
is checked where records enter (``validate_telemetry_record``, ``telemetry_event_from_record``,
the loaders, through ``identity_problem``), not per decoded Struct: a Python ``__post_init__``
call per record was ~0.2 µs of the ~2 µs a loaded v3 event costs (CHANGELOG.md).
Specs: ``telemetry-event-v3.md``, ``telemetry-event-v2.md``, ``telemetry-current-practice.md``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "SCHEMA_VERSION_V2",
    "SCHEMA_VERSION_V3",
    "SCHEMA_VERSION_V4",
    "SUPPORTED_SCHEMA_VERSIONS",
    "MemoryCapabilities",
    "TelemetryEvent",
    "TelemetryEventV2",
    "TelemetryEventV3",
    "TelemetryEventV4",
    "identity_problem",
]

SCHEMA_VERSION_V2 = 2
SCHEMA_VERSION_V3 = 3
SCHEMA_VERSION_V4 = 4
SUPPORTED_SCHEMA_VERSIONS = (SCHEMA_VERSION_V2, SCHEMA_VERSION_V3, SCHEMA_VERSION_V4)

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Pid = Annotated[int, msgspec.Meta(ge=-1)]
WorldSize = Annotated[int, msgspec.Meta(ge=1)]
Name = Annotated[str, msgspec.Meta(min_length=1)]
# v4 strings must hold a non-space character (telemetry-current-practice.md).
Word = Annotated[str, msgspec.Meta(pattern=r"\S")]


class _RecordError(ValueError):
    """Raised from ``__post_init__``; carries the field so the caller can name it."""

    def __init__(self, field: str, rule: str) -> None:
        self.field = field
        self.rule = rule
        super().__init__(f"{rule} - at `$.{field}`")


def identity_problem(rank: int, local_rank: int, world_size: int) -> tuple[str, str] | None:
    """``(field, rule)`` of the first broken `rank`/`local_rank` < `world_size` rule, else None."""
    if rank >= world_size:
        return "rank", f"must be < world_size ({world_size}), got {rank}"
    if local_rank >= world_size:
        return "local_rank", f"must be < world_size ({world_size}), got {local_rank}"
    return None


def _check_identity(rank: int, local_rank: int, world_size: int) -> None:
    problem = identity_problem(rank, local_rank, world_size)
    if problem is not None:
        raise _RecordError(*problem)


class TelemetryEventV2(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """Legacy v2 record: v3 without a session.

    The distributed identity (`job_id`, `rank`, `local_rank`, `world_size`) is optional, as in
    the JSON Schema the format's owners publish, with v3's defaults and its `rank`/`local_rank`
    < `world_size` rule (telemetry-current-practice.md "v2 as published").
    """

    schema_version: Literal[2]
    timestamp_ns: NonNegative
    event_type: Name
    collector: Name
    sampling_interval_ms: NonNegative
    pid: Pid
    host: Name
    device_id: int
    allocator_allocated_bytes: NonNegative
    allocator_reserved_bytes: NonNegative
    allocator_active_bytes: NonNegative | None
    allocator_inactive_bytes: NonNegative | None
    allocator_change_bytes: int
    device_used_bytes: NonNegative
    device_free_bytes: NonNegative | None
    device_total_bytes: NonNegative | None
    context: str | None
    metadata: dict[str, Any]
    job_id: Name | None = None
    rank: NonNegative = 0
    local_rank: NonNegative = 0
    world_size: WorldSize = 1


class TelemetryEventV3(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """The canonical record stepwatch writes and every loader returns.

    The identity rule (`rank`, `local_rank` < `world_size`) is not checked on construction or
    by a bare ``msgspec`` decode: ``validate_telemetry_record``, ``telemetry_event_from_record``
    and the loaders check it (``identity_problem``); stepwatch's own collectors build valid
    identities from ``resolve_distributed_identity``.

    Example::

        TelemetryEventV3(schema_version=3, session_id=sid, timestamp_ns=time.time_ns(),
                         event_type="sample", collector="stepwatch.cpu_tracker", ...)
    """

    schema_version: Literal[3]
    session_id: Name
    timestamp_ns: NonNegative
    event_type: Name
    collector: Name
    sampling_interval_ms: NonNegative
    pid: Pid
    host: Name
    device_id: int
    allocator_allocated_bytes: NonNegative
    allocator_reserved_bytes: NonNegative
    allocator_active_bytes: NonNegative | None
    allocator_inactive_bytes: NonNegative | None
    allocator_change_bytes: int
    device_used_bytes: NonNegative
    device_free_bytes: NonNegative | None
    device_total_bytes: NonNegative | None
    context: str | None
    metadata: dict[str, Any]
    job_id: str | None = None
    rank: NonNegative = 0
    local_rank: NonNegative = 0
    world_size: WorldSize = 1


class MemoryCapabilities(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """``metadata.memory_capabilities`` of a v4 record: which counters the backend can fill."""

    backend: Word
    telemetry_collector: Word
    sampling_source: Word
    supports_allocator_allocated: bool
    supports_allocator_reserved: bool
    supports_allocator_active: bool
    supports_allocator_inactive: bool
    supports_device_used: bool
    supports_device_free: bool
    supports_device_total: bool
    supports_native_allocator_history: bool
    supports_fragmentation_analysis: bool
    supports_allocator_attribution: bool
    supports_bounded_profiling: bool


# counter field -> the capability that must be true for it to be non-null
V4_COUNTER_CAPABILITIES = {
    "allocator_allocated_bytes": "supports_allocator_allocated",
    "allocator_change_bytes": "supports_allocator_allocated",
    "allocator_reserved_bytes": "supports_allocator_reserved",
    "allocator_active_bytes": "supports_allocator_active",
    "allocator_inactive_bytes": "supports_allocator_inactive",
    "device_used_bytes": "supports_device_used",
    "device_free_bytes": "supports_device_free",
    "device_total_bytes": "supports_device_total",
}


class TelemetryEventV4(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """The record Stormlog 0.4.3 writes; read, never written, by stepwatch."""

    schema_version: Literal[4]
    session_id: Word
    timestamp_ns: NonNegative
    event_type: Word
    collector: Word
    sampling_interval_ms: NonNegative
    pid: Pid
    host: Word
    device_id: int
    allocator_allocated_bytes: NonNegative | None
    allocator_reserved_bytes: NonNegative | None
    allocator_active_bytes: NonNegative | None
    allocator_inactive_bytes: NonNegative | None
    allocator_change_bytes: int | None
    device_used_bytes: NonNegative | None
    device_free_bytes: NonNegative | None
    device_total_bytes: NonNegative | None
    context: str | None
    metadata: dict[str, Any]
    job_id: str | None = None
    rank: NonNegative = 0
    local_rank: NonNegative = 0
    world_size: WorldSize = 1

    def __post_init__(self) -> None:
        _check_identity(self.rank, self.local_rank, self.world_size)
        raw = self.metadata.get("memory_capabilities")
        if raw is None:
            raise _RecordError("metadata.memory_capabilities", "is required in v4")
        try:
            caps = msgspec.convert(raw, MemoryCapabilities, strict=True)
        except msgspec.ValidationError as exc:
            # name the offending key ("... - at `$.backend`"), not just the capabilities object
            rule, at, path = str(exc).rpartition(" - at `$")
            if not at:
                rule, path = str(exc), "`"
            raise _RecordError(f"metadata.memory_capabilities{path[:-1]}", rule) from None
        for counter, capability in V4_COUNTER_CAPABILITIES.items():
            if not getattr(caps, capability) and getattr(self, counter) is not None:
                raise _RecordError(counter, f"must be null when {capability} is false")
        total = self.device_total_bytes
        if total is not None:
            for name in ("device_used_bytes", "device_free_bytes"):
                value = getattr(self, name)
                if value is not None and value > total:
                    raise _RecordError(name, f"must be <= device_total_bytes ({total})")


TelemetryEvent = TelemetryEventV2 | TelemetryEventV3 | TelemetryEventV4
