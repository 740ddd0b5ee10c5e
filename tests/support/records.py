"""Canonical telemetry records, built the way stepwatch's collectors build them."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from stepwatch.schema import TelemetryEventV3


def make_record(**overrides: Any) -> dict[str, Any]:
    """A valid v3 record as a plain dict; override any field."""
    record: dict[str, Any] = {
        "schema_version": 3,
        "session_id": "00000000-0000-4000-8000-000000000001",
        "timestamp_ns": 1_700_000_000_000_000_000,
        "event_type": "sample",
        "collector": "stepwatch.cpu_tracker",
        "sampling_interval_ms": 1000,
        "pid": 1234,
        "host": "node-a",
        "device_id": -1,
        "allocator_allocated_bytes": 1024,
        "allocator_reserved_bytes": 2048,
        "allocator_active_bytes": None,
        "allocator_inactive_bytes": None,
        "allocator_change_bytes": 0,
        "device_used_bytes": 1024,
        "device_free_bytes": None,
        "device_total_bytes": None,
        "context": None,
        "metadata": {"backend": "cpu"},
        "job_id": None,
        "rank": 0,
        "local_rank": 0,
        "world_size": 1,
    }
    record.update(overrides)
    return record


def make_event(session_id: str, i: int = 0, **overrides: Any) -> TelemetryEventV3:
    """A v3 event of ``session_id`` from this process, ``i`` making it distinct."""
    fields = make_record(
        session_id=session_id,
        timestamp_ns=time.time_ns(),
        pid=os.getpid(),
        host=socket.gethostname(),
        allocator_allocated_bytes=1000 + i,
        device_used_bytes=1000 + i,
        metadata={"backend": "cpu", "i": i},
    )
    fields.update(overrides)
    return TelemetryEventV3(**fields)
