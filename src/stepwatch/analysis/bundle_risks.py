"""The content of a diagnose bundle (``stepwatch diagnose``): a short memory timeline and the
risks it shows. Named apart from ``diagnose``, the verdict engine's entry point that
``stepwatch.analysis`` exports, so importing this module never hides that function.

Memory near its limit is the verdict policy's one rule (``pressure_warn``, the threshold of
``HIGH_PRESSURE``), so a bundle and a run's verdicts call the same peak the same way.
"""

from __future__ import annotations

import time
from typing import Any

from ..schema import TelemetryEventV3
from .verdicts.policy import DEFAULT_POLICY, VerdictPolicy

__all__ = ["assess_risks", "sample_timeline", "timeline_from_events"]


def timeline_from_events(events: list[TelemetryEventV3]) -> dict[str, list[float]]:
    """Parallel arrays (seconds, allocated, reserved) of the samples of the busiest collector."""
    # a sample whose counters are unknown (a v4 null) is no point on the timeline
    samples = [e for e in events if e.event_type == "sample"
               and e.allocator_allocated_bytes is not None and e.allocator_reserved_bytes is not None]
    if not samples:
        return {"timestamps": [], "allocated": [], "reserved": []}
    counts: dict[tuple[str, int, int], int] = {}
    for e in samples:
        key = (e.collector, e.device_id, e.rank)
        counts[key] = counts.get(key, 0) + 1
    collector, device, rank = max(counts, key=lambda k: (k[0] != "stepwatch.cpu_tracker", counts[k]))
    chosen = [e for e in samples if (e.collector, e.device_id, e.rank) == (collector, device, rank)]
    return {
        "timestamps": [e.timestamp_ns / 1e9 for e in chosen],
        "allocated": [float(e.allocator_allocated_bytes) for e in chosen],
        "reserved": [float(e.allocator_reserved_bytes) for e in chosen],
        "collector": collector,  # type: ignore[dict-item]
        "device_id": device,  # type: ignore[dict-item]
        "rank": rank,  # type: ignore[dict-item]
    }


def sample_timeline(duration_s: float, hz: float = 10.0) -> dict[str, Any]:
    """A short machine-memory timeline taken now (used / available of the host)."""
    import psutil

    stamps: list[float] = []
    used: list[float] = []
    available: list[float] = []
    end = time.monotonic() + duration_s
    while True:
        memory = psutil.virtual_memory()
        stamps.append(time.time())
        used.append(float(memory.total - memory.available))
        available.append(float(memory.available))
        if time.monotonic() >= end:
            break
        time.sleep(1 / hz)
    return {"timestamps": stamps, "allocated": used, "reserved": used, "available": available,
            "collector": "stepwatch.cpu_tracker", "device_id": -1, "total": float(psutil.virtual_memory().total)}


def assess_risks(events: list[TelemetryEventV3], timeline: dict[str, Any],
                 policy: VerdictPolicy = DEFAULT_POLICY) -> list[dict[str, Any]]:
    """Named, threshold-based risks: OOMs, degraded collectors, memory near the device's limit
    (a peak at or over ``policy.pressure_warn`` of it)."""
    risks: list[dict[str, Any]] = []
    ooms = [e for e in events if e.event_type == "error" and "oom_reason" in e.metadata]
    if ooms:
        risks.append({"name": "OOM_RECORDED", "count": len(ooms), "detail": str(ooms[-1].metadata["oom_reason"])[:300]})
    degraded = [e for e in events if e.event_type == "collector_degraded"]
    if degraded:
        risks.append({"name": "COLLECTOR_DEGRADED", "count": len(degraded), "detail": degraded[-1].context})
    peak_fraction = 0.0
    for e in events:
        if e.event_type == "sample" and e.device_total_bytes:
            used = e.device_used_bytes if e.device_id >= 0 else e.device_total_bytes - (e.device_free_bytes or 0)
            if used is None:
                continue
            peak_fraction = max(peak_fraction, used / e.device_total_bytes)
    total = timeline.get("total")
    if total and timeline.get("allocated"):
        peak_fraction = max(peak_fraction, max(timeline["allocated"]) / total)
    if peak_fraction >= policy.pressure_warn:
        risks.append({"name": "MEMORY_NEAR_LIMIT", "peak_fraction": round(peak_fraction, 4),
                      "threshold": policy.pressure_warn})
    return risks
