"""Validation and conversion of telemetry records into canonical v3 events.

Strict where the spec is strict (a present `schema_version` is never guessed at), permissive
for legacy records that carry no version at all (spec: "Legacy compatibility").
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from ..errors import UnsupportedSchemaVersion, ValidationError
from ._telemetry import (
    SCHEMA_VERSION_V2,
    SCHEMA_VERSION_V3,
    SCHEMA_VERSION_V4,
    SUPPORTED_SCHEMA_VERSIONS,
    TelemetryEvent,
    TelemetryEventV2,
    TelemetryEventV3,
    TelemetryEventV4,
    identity_problem,
)

__all__ = [
    "DEFAULT_LEGACY_COLLECTOR",
    "loaded_event",
    "loaded_event_from_record",
    "synthetic_session_id",
    "telemetry_event_from_record",
    "telemetry_event_to_dict",
    "translate_validation_error",
    "validate_telemetry_record",
]

DEFAULT_LEGACY_COLLECTOR = "legacy.unknown"

_STRUCT_BY_VERSION: dict[int, type[TelemetryEvent]] = {
    SCHEMA_VERSION_V2: TelemetryEventV2,
    SCHEMA_VERSION_V3: TelemetryEventV3,
    SCHEMA_VERSION_V4: TelemetryEventV4,
}
# Counters that v3 requires to be integers; a v4 record with one of them null cannot become v3.
_V3_REQUIRED_COUNTERS = (
    "allocator_allocated_bytes",
    "allocator_reserved_bytes",
    "allocator_change_bytes",
    "device_used_bytes",
)
_LEGACY_BACKEND_COLLECTORS = {
    "cuda": "stepwatch.cuda_tracker",
    "rocm": "stepwatch.rocm_tracker",
    "mps": "stepwatch.mps_tracker",
    "cpu": "stepwatch.cpu_tracker",
    "tensorflow": "stepwatch.tensorflow_tracker",
}
_AT_PATH = re.compile(r"^(?P<rule>.*?) - at `(?P<path>\$[^`]*)`$", re.S)
# The name is matched lazily up to an optional trailing location, so a key holding a backtick
# (or the empty key) is still named whole.
_NAMED_FIELD = re.compile(
    r"^Object (?P<what>contains unknown|missing required) field `(?P<name>.*?)`"
    r"(?: - at `(?P<path>\$[^`]*)`)?$",
    re.S,
)


def translate_validation_error(exc: msgspec.ValidationError, prefix: str = "$") -> ValidationError:
    """Turns msgspec's message into a ValidationError that names the field and the rule."""
    message = str(exc)
    named = _NAMED_FIELD.match(message)
    if named:
        base = named.group("path") or "$"
        field = f"{base}.{named.group('name')}".replace("$", prefix, 1)
        rule = "unknown field (not allowed)" if named.group("what") == "contains unknown" else "is required"
        return ValidationError(field, rule)
    located = _AT_PATH.match(message)
    if located:
        return ValidationError(located.group("path").replace("$", prefix, 1), located.group("rule"))
    return ValidationError(prefix, message)


def _schema_version(record: Mapping[str, Any]) -> int:
    version = record["schema_version"]
    if type(version) is not int:
        raise UnsupportedSchemaVersion(
            "$.schema_version", f"must be an integer, got {type(version).__name__} {version!r}"
        )
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise UnsupportedSchemaVersion(
            "$.schema_version",
            f"unsupported version {version} (supported: {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))})",
        )
    return version


def _convert(record: Mapping[str, Any], struct: type[TelemetryEvent]) -> Any:
    try:
        event = msgspec.convert(record, struct, strict=True)
    except msgspec.ValidationError as exc:
        raise translate_validation_error(exc) from None
    if struct is not TelemetryEventV4:  # v2/v3's cross-field rule is not in the Struct (see _telemetry.py)
        problem = identity_problem(event.rank, event.local_rank, event.world_size)
        if problem is not None:
            raise ValidationError(f"$.{problem[0]}", problem[1])
    return event


def validate_telemetry_record(record: Any) -> TelemetryEvent:
    """Validates a record strictly against the schema its `schema_version` names.

    Returns:
        The typed event (v2, v3 or v4), unchanged.

    Raises:
        ValidationError: naming the field and the rule it breaks.
    """
    if not isinstance(record, Mapping):
        raise ValidationError("$", f"must be a JSON object, got {type(record).__name__}")
    if "schema_version" not in record:
        raise ValidationError("$.schema_version", "is required")
    return _convert(record, _STRUCT_BY_VERSION[_schema_version(record)])


def synthetic_session_id(*parts: object) -> str:
    """A deterministic session id for artifacts written before sessions existed."""
    seed = "::".join(str(part) for part in parts if part is not None)
    return f"legacy-{uuid.uuid5(uuid.NAMESPACE_URL, seed)}"


def telemetry_event_to_dict(event: TelemetryEvent) -> dict[str, Any]:
    """The JSON-ready dict of an event, every field present (nulls included)."""
    return msgspec.to_builtins(event)


def telemetry_event_from_record(
    record: Any,
    permissive_legacy: bool = True,
    default_collector: str = DEFAULT_LEGACY_COLLECTOR,
    default_sampling_interval_ms: int = 0,
    default_session_id: str | None = None,
) -> TelemetryEventV3:
    """Builds a canonical v3 event from a v4, v3, v2 or legacy (unversioned) record.

    Args:
        record: the decoded JSON object.
        permissive_legacy: convert records without `schema_version`; when false they are rejected.
        default_collector: collector of a legacy record that names none and no backend.
        default_sampling_interval_ms: sampling interval of a legacy record that has none.
        default_session_id: session of a record that carries none (v2, legacy, v3 written
            without one); when absent a deterministic synthetic id is derived.

    Raises:
        UnsupportedSchemaVersion: `schema_version` present but not 2, 3 or 4.
        ValidationError: any other rule broken, naming the field.
    """
    if not isinstance(record, Mapping):
        raise ValidationError("$", f"must be a JSON object, got {type(record).__name__}")
    if "schema_version" not in record:
        if not permissive_legacy:
            raise ValidationError("$.schema_version", "is required (legacy conversion is off)")
        return _from_legacy(record, default_collector, default_sampling_interval_ms, default_session_id)

    version = _schema_version(record)
    if version == SCHEMA_VERSION_V3:
        if "session_id" not in record:
            record = {**record, "session_id": default_session_id or _session_of(record)}
        return _convert(record, TelemetryEventV3)
    if version == SCHEMA_VERSION_V2:
        v2: TelemetryEventV2 = _convert(record, TelemetryEventV2)
        fields = msgspec.structs.asdict(v2)
        fields.update(schema_version=SCHEMA_VERSION_V3, session_id=default_session_id or _session_of(record))
        return TelemetryEventV3(**fields)
    return v4_to_v3(_convert(record, TelemetryEventV4))


def loaded_event(event: TelemetryEventV4) -> TelemetryEventV3 | TelemetryEventV4:
    """What a loader returns for a v4 record: its v3 form, or the v4 record itself where a
    counter v3 requires is null (unknown at that moment: Stormlog writes such `start`, `peak`,
    `sample` records when its collector cannot read the device). Never zero-filled, never
    dropped (telemetry-current-practice.md "v4 records with unknown counters")."""
    if (event.allocator_allocated_bytes is None or event.allocator_reserved_bytes is None
            or event.allocator_change_bytes is None or event.device_used_bytes is None):
        return event
    return v4_to_v3(event)


def loaded_event_from_record(
    record: Any, permissive_legacy: bool = True, default_session_id: str | None = None
) -> TelemetryEventV3 | TelemetryEventV4:
    """``telemetry_event_from_record``, except that a valid v4 record with a null v3-required
    counter comes back as its v4 event (``loaded_event``) instead of being refused."""
    if isinstance(record, Mapping) and record.get("schema_version") == SCHEMA_VERSION_V4:
        return loaded_event(_convert(record, TelemetryEventV4))
    return telemetry_event_from_record(
        record, permissive_legacy=permissive_legacy, default_session_id=default_session_id
    )


def v4_to_v3(event: TelemetryEventV4) -> TelemetryEventV3:
    """Narrows a v4 event to v3; refuses (never zero-fills) a counter v3 requires but v4 left null."""
    fields = msgspec.structs.asdict(event)
    for name in _V3_REQUIRED_COUNTERS:
        if fields[name] is None:
            raise ValidationError(
                f"$.{name}", "is null in this v4 record; v3 requires a value (not zero-filled)"
            )
    fields["schema_version"] = SCHEMA_VERSION_V3
    return TelemetryEventV3(**fields)


def _session_of(record: Mapping[str, Any]) -> str:
    return synthetic_session_id(record.get("host", "unknown"), record.get("pid", -1))


def _int_field(record: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        if name in record and record[name] is not None:
            value = record[name]
            if type(value) is float and value.is_integer():
                value = int(value)  # legacy writers stored byte counts as floats
            if type(value) is not int:
                raise ValidationError(f"$.{name}", f"must be an integer, got {value!r}")
            return value
    return None


def _int_or(record: Mapping[str, Any], default: int, *names: str) -> int:
    value = _int_field(record, *names)
    return default if value is None else value


def _legacy_timestamp_ns(record: Mapping[str, Any]) -> int:
    if "timestamp_ns" in record:
        value = record["timestamp_ns"]
        if type(value) is int and value >= 0:
            return value
        raise ValidationError("$.timestamp_ns", f"must be a non-negative integer, got {value!r}")
    seconds = record.get("timestamp")
    if type(seconds) is int and seconds >= 0:
        return seconds * 1_000_000_000  # exact; math.isfinite() overflows on huge ints
    if type(seconds) is float and seconds >= 0 and math.isfinite(seconds * 1_000_000_000):
        return int(round(seconds * 1_000_000_000))
    raise ValidationError("$.timestamp", "a legacy record needs a valid timestamp (seconds) or timestamp_ns")


def _legacy_device_id(record: Mapping[str, Any]) -> int:
    if "device_id" in record:
        value = _int_field(record, "device_id")
        return -1 if value is None else value
    device = record.get("device")
    if type(device) is int:
        return device
    if isinstance(device, str):
        head, _, index = device.strip().lower().partition(":")
        if head == "cpu":
            return -1
        if index.isascii() and index.isdigit():  # '²'.isdigit() is true, int('²') fails
            return int(index)
        if head in ("cuda", "mps", "rocm", "gpu"):
            return 0
    return -1


def _legacy_metadata(record: Mapping[str, Any]) -> dict[str, Any]:
    metadata = record.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, Mapping):
        raise ValidationError("$.metadata", f"must be a JSON object, got {type(metadata).__name__}")
    folded = dict(metadata)
    for key, value in record.items():
        if key.startswith("metadata_") and len(key) > len("metadata_"):
            folded.setdefault(key[len("metadata_"):], value)
    return folded


def _from_legacy(
    record: Mapping[str, Any],
    default_collector: str,
    default_sampling_interval_ms: int,
    default_session_id: str | None,
) -> TelemetryEventV3:
    metadata = _legacy_metadata(record)
    allocated = _int_field(record, "allocator_allocated_bytes", "memory_allocated", "allocated_bytes")
    if allocated is None:
        megabytes = record.get("memory_mb")
        if type(megabytes) is float and not math.isfinite(megabytes * 1024 * 1024):
            raise ValidationError("$.memory_mb", f"must be a finite number, got {megabytes!r}")
        allocated = int(megabytes * 1024 * 1024) if type(megabytes) in (int, float) else 0
    reserved = _int_field(record, "allocator_reserved_bytes", "memory_reserved", "reserved_bytes")
    used = _int_field(record, "device_used_bytes")
    backend = record.get("backend", metadata.get("backend"))
    collector = record.get("collector")
    if not (isinstance(collector, str) and collector):
        collector = _LEGACY_BACKEND_COLLECTORS.get(str(backend).lower(), default_collector)
    event_type = record.get("event_type", record.get("type")) or "sample"
    host = record.get("host") or "unknown"
    fields = {
        "schema_version": SCHEMA_VERSION_V3,
        "session_id": record.get("session_id") or default_session_id or _session_of(record),
        "timestamp_ns": _legacy_timestamp_ns(record),
        "event_type": event_type,
        "collector": collector,
        "sampling_interval_ms": _int_or(record, default_sampling_interval_ms, "sampling_interval_ms"),
        "pid": _int_or(record, -1, "pid"),
        "host": host,
        "device_id": _legacy_device_id(record),
        "allocator_allocated_bytes": allocated,
        "allocator_reserved_bytes": allocated if reserved is None else reserved,
        "allocator_active_bytes": _int_field(record, "allocator_active_bytes"),
        "allocator_inactive_bytes": _int_field(record, "allocator_inactive_bytes"),
        "allocator_change_bytes": _int_or(record, 0, "allocator_change_bytes", "memory_change"),
        "device_used_bytes": allocated if used is None else used,
        "device_free_bytes": _int_field(record, "device_free_bytes", "free_memory"),
        "device_total_bytes": _int_field(record, "device_total_bytes", "total_memory"),
        "context": record.get("context", record.get("message")),
        "metadata": metadata,
        "job_id": record.get("job_id"),
        "rank": _int_or(record, 0, "rank"),
        "local_rank": _int_or(record, 0, "local_rank"),
        "world_size": _int_or(record, 1, "world_size"),
    }
    return _convert(fields, TelemetryEventV3)
