"""Host memory of this process (RSS) and of the machine, through psutil."""

from __future__ import annotations

import time
from typing import Any

from .base import Reading

__all__ = ["CpuCollector"]

SYSTEM_REFRESH_S = 5.0


class CpuCollector:
    """Process RSS as allocated/used; the machine's total and available memory as total/free."""

    name = "stepwatch.cpu_tracker"
    backend = "cpu"
    supports_device_total = True
    supports_device_free = True
    sampling_source = "psutil"

    def __init__(self, pid: int | None = None, *, psutil_module: Any = None) -> None:
        if psutil_module is None:
            import psutil as psutil_module
        self._psutil = psutil_module
        self._process = psutil_module.Process(pid)
        self.pid = self._process.pid
        self._system: Any = None
        self._system_at = 0.0

    def _system_memory(self) -> Any:
        # Parsing /proc/meminfo is most of a sample's cost (bench/bench_capture_overhead.py);
        # the machine's available memory is read at most once per SYSTEM_REFRESH_S.
        now = time.monotonic()
        if self._system is None or now - self._system_at >= SYSTEM_REFRESH_S:
            self._system = self._psutil.virtual_memory()
            self._system_at = now
        return self._system

    def read(self) -> list[Reading]:
        info = self._process.memory_info()
        partial: tuple[str, ...] = ()
        try:
            system = self._system_memory()
            free, total = system.available, system.total
        except Exception:  # noqa: BLE001 - the process view still stands alone
            free = total = None
            partial = ("device_free_bytes", "device_total_bytes")
        rss = info.rss
        return [
            Reading(
                device_id=-1,
                allocated=rss,
                reserved=rss,
                used=rss,
                free=free,
                total=total,
                partial_fields=partial,
                extra={"vms_bytes": getattr(info, "vms", None)},
            )
        ]
