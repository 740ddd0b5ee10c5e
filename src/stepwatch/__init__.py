"""stepwatch: a flight recorder for deep-learning training runs.

``import stepwatch`` stays light: the telemetry API loads on first attribute access.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it; resolved on first use so importing stepwatch costs nothing.
_LAZY = {
    "init": "stepwatch.capture.api",
    "shutdown": "stepwatch.capture.api",
    "progress": "stepwatch.capture.api",
    "oom_guard": "stepwatch.capture.api",
    "current_runtime": "stepwatch.capture.api",
    "halt_requested": "stepwatch.capture.api",
    "Halt": "stepwatch.capture.controls",
    "request_halt": "stepwatch.artifacts.halt",
    "read_halt": "stepwatch.artifacts.halt",
    "dump_stacks": "stepwatch.artifacts.stacks",
    "request_memory_snapshot": "stepwatch.artifacts.memory_snapshots",
    "phase": "stepwatch.capture.phases",
    "trace_step": "stepwatch.capture.training",
    "scope": "stepwatch.capture.training",
    "mark": "stepwatch.capture.training",
    "epochs": "stepwatch.capture.training",
    "batches": "stepwatch.capture.training",
    "snapshot": "stepwatch.capture.training",
    "load_snapshot_tensor": "stepwatch.capture.snapshots",
    "inference": "stepwatch.capture.training",
    "load_telemetry_events": "stepwatch.telemetry",
    "load_telemetry_sessions": "stepwatch.telemetry",
    "telemetry_event_from_record": "stepwatch.telemetry",
    "telemetry_event_to_dict": "stepwatch.telemetry",
    "validate_telemetry_record": "stepwatch.telemetry",
    "TelemetrySink": "stepwatch.artifacts.sink",
    "SinkConfig": "stepwatch.artifacts.sink",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stepwatch' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
