"""Public telemetry API: convert, validate, serialise and load TelemetryEvent records.

Example::

    from stepwatch.telemetry import load_telemetry_sessions, load_telemetry_events

    sessions = load_telemetry_sessions("stepwatch_runs/2026-11-23T01-00-00Z-1a2b3c4d")
    events = load_telemetry_events(path, session_id=sessions[0].summary.session_id)
"""

from __future__ import annotations

from .artifacts.telemetry_loader import (
    LoadedTelemetrySession,
    load_telemetry_events,
    load_telemetry_sessions,
)
from .capture.identity import DistributedIdentity, resolve_distributed_identity
from .schema import (
    SCHEMA_VERSION_V2,
    SCHEMA_VERSION_V3,
    SCHEMA_VERSION_V4,
    SessionSummary,
    TelemetryEvent,
    TelemetryEventV2,
    TelemetryEventV3,
    TelemetryEventV4,
    select_default_session,
    telemetry_event_from_record,
    telemetry_event_to_dict,
    validate_telemetry_record,
)

__all__ = [
    "SCHEMA_VERSION_V2",
    "SCHEMA_VERSION_V3",
    "SCHEMA_VERSION_V4",
    "DistributedIdentity",
    "LoadedTelemetrySession",
    "SessionSummary",
    "TelemetryEvent",
    "TelemetryEventV2",
    "TelemetryEventV3",
    "TelemetryEventV4",
    "load_telemetry_events",
    "load_telemetry_sessions",
    "resolve_distributed_identity",
    "select_default_session",
    "telemetry_event_from_record",
    "telemetry_event_to_dict",
    "validate_telemetry_record",
]
