"""Record types of stepwatch: telemetry events (v2, v3, v4), sessions, and their JSON Schemas."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from ._convert import (
    DEFAULT_LEGACY_COLLECTOR,
    loaded_event,
    loaded_event_from_record,
    synthetic_session_id,
    telemetry_event_from_record,
    telemetry_event_to_dict,
    translate_validation_error,
    v4_to_v3,
    validate_telemetry_record,
)
from ._session import (
    SESSION_STATUSES,
    SessionStatus,
    SessionSummary,
    new_session_id,
    select_default_session,
    sort_sessions,
    worst_status,
)
from ._telemetry import (
    SCHEMA_VERSION_V2,
    SCHEMA_VERSION_V3,
    SCHEMA_VERSION_V4,
    SUPPORTED_SCHEMA_VERSIONS,
    MemoryCapabilities,
    TelemetryEvent,
    TelemetryEventV2,
    TelemetryEventV3,
    TelemetryEventV4,
    identity_problem,
)

LoadedEvent = TelemetryEventV3 | TelemetryEventV4
"""An event as the loaders return it: v3, or v4 where a counter v3 requires is unknown (null)."""

__all__ = [
    "DEFAULT_LEGACY_COLLECTOR",
    "SCHEMA_VERSION_V2",
    "SCHEMA_VERSION_V3",
    "SCHEMA_VERSION_V4",
    "SESSION_STATUSES",
    "SUPPORTED_SCHEMA_VERSIONS",
    "LoadedEvent",
    "MemoryCapabilities",
    "SessionStatus",
    "SessionSummary",
    "TelemetryEvent",
    "TelemetryEventV2",
    "TelemetryEventV3",
    "TelemetryEventV4",
    "identity_problem",
    "json_schema",
    "loaded_event",
    "loaded_event_from_record",
    "new_session_id",
    "select_default_session",
    "sort_sessions",
    "synthetic_session_id",
    "telemetry_event_from_record",
    "telemetry_event_to_dict",
    "translate_validation_error",
    "v4_to_v3",
    "validate_telemetry_record",
    "worst_status",
]


@lru_cache(maxsize=8)
def json_schema(version: int) -> dict[str, Any]:
    """The shipped JSON Schema of TelemetryEvent ``version`` (2, 3 or 4)."""
    from importlib import resources  # ~20 ms of imports (tempfile, zipfile): not in every process

    text = resources.files(__name__).joinpath(f"schemas/telemetry_event_v{version}.schema.json").read_text()
    return json.loads(text)
