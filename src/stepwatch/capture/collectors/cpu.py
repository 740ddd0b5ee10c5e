"""Host memory of this process (RSS) and of the machine, through psutil."""

from __future__ import annotations

import os
import sys
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
        # Linux: this process's RSS and virtual size straight from /proc/<pid>/statm, the file
        # psutil's memory_info() parses, in three C calls instead of psutil's Python layers (a
        # fifth of a sample's instructions, bench/bench_sampler_instructions.py). Only for the
        # real psutil and our own process (a process that ends is psutil's to report).
        self._statm: bytes | None = None
        if psutil_module.__name__ == "psutil" and sys.platform.startswith("linux") and self.pid == os.getpid():
            statm = f"/proc/{self.pid}/statm".encode()
            if os.path.exists(statm):
                self._statm = statm
        self._page = os.sysconf("SC_PAGE_SIZE") if self._statm is not None else 0
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

    def _memory(self) -> tuple[int, int | None]:
        """(RSS, virtual size) in bytes."""
        statm = self._statm
        if statm is not None:
            try:
                fd = os.open(statm, os.O_RDONLY)
                try:
                    fields = os.read(fd, 256).split(None, 2)
                finally:
                    os.close(fd)
                return int(fields[1]) * self._page, int(fields[0]) * self._page
            except (OSError, ValueError, IndexError):
                self._statm = None  # psutil from now on, which says what is wrong
        info = self._process.memory_info()
        return info.rss, getattr(info, "vms", None)

    def read(self) -> list[Reading]:
        rss, vms = self._memory()
        partial: tuple[str, ...] = ()
        try:
            system = self._system_memory()
            free, total = system.available, system.total
        except Exception:  # noqa: BLE001 - the process view still stands alone
            free = total = None
            partial = ("device_free_bytes", "device_total_bytes")
        return [
            Reading(
                device_id=-1,
                allocated=rss,
                reserved=rss,
                used=rss,
                free=free,
                total=total,
                partial_fields=partial,
                extra={"vms_bytes": vms},
            )
        ]
