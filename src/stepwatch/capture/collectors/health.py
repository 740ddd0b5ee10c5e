"""Collector health: backoff on failure, degraded/recovered transitions, and the health metadata
of the spec ("Collector health metadata"). A failing collector emits no sample at all — never
synthetic zeros — until a retry succeeds.
"""

from __future__ import annotations

from typing import Any, Literal

from .base import Collector, Reading

__all__ = ["CollectorHealth"]

HealthStatus = Literal["healthy", "degraded", "unhealthy"]


class CollectorHealth:
    """Wraps one collector.

    Example::

        health = CollectorHealth(CpuCollector())
        readings, transition = health.poll(time.time())   # transition: None, "collector_degraded"
                                                          # or "collector_recovered"
    """

    def __init__(
        self,
        collector: Collector,
        *,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        unhealthy_after: int = 5,
    ) -> None:
        self.collector = collector
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.unhealthy_after = unhealthy_after
        self.status: HealthStatus = "healthy"
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.next_retry_epoch_s: float | None = None
        self.partial_fields: tuple[str, ...] = ()
        self.failures_total = 0

    def poll(self, now: float) -> tuple[list[Reading], str | None]:
        if self.next_retry_epoch_s is not None and now < self.next_retry_epoch_s:
            return [], None
        try:
            readings = self.collector.read()
        except Exception as exc:  # noqa: BLE001 - a backend failing is data, not a crash
            self.consecutive_failures += 1
            self.failures_total += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:500]
            self.status = "unhealthy" if self.consecutive_failures >= self.unhealthy_after else "degraded"
            delay = min(self.max_backoff_s, self.base_backoff_s * 2 ** (self.consecutive_failures - 1))
            self.next_retry_epoch_s = now + delay
            return [], "collector_degraded"
        recovered = self.consecutive_failures > 0
        self.consecutive_failures = 0
        self.next_retry_epoch_s = None
        self.partial_fields = tuple(sorted({f for r in readings for f in r.partial_fields}))
        self.status = "degraded" if self.partial_fields else "healthy"
        return readings, ("collector_recovered" if recovered else None)

    def metadata(self) -> dict[str, Any]:
        """The spec's health fields plus the backend capability hints."""
        c = self.collector
        return {
            "backend": c.backend,
            "supports_device_total": c.supports_device_total,
            "supports_device_free": c.supports_device_free,
            "sampling_source": c.sampling_source,
            "collector_health_status": self.status,
            "telemetry_partial": bool(self.partial_fields),
            "collector_partial_fields": list(self.partial_fields),
            "collector_last_error": self.last_error,
            "collector_consecutive_failures": self.consecutive_failures,
            "collector_next_retry_epoch_s": self.next_retry_epoch_s,
        }
