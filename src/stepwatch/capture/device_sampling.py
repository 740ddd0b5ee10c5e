"""The rank's collectors: discovered, polled each sample interval into telemetry records, and the
memory of the program's own accelerator kept for its heartbeat.

The CUDA device current on the program's thread is the one it works on; the sampler thread's is
always 0, so it is read on the program's thread (``note_program_device``, called at init and
now and then from a step or progress call) and remembered here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..guard import guarded
from ..schema import TelemetryEventV3
from .collectors import CollectorHealth, CpuCollector, Reading, discover_accelerators, discover_nvml
from .events import EventFactory

__all__ = ["DISCOVER_EVERY_S", "DeviceSampling", "fully_imported_torch", "program_cuda_device"]

DISCOVER_EVERY_S = 5.0


def fully_imported_torch() -> Any:
    """torch once its import has finished, else None.

    The sampler thread can run while the training thread is still inside ``import torch``; the
    half-built module then lacks ``cuda``/``optim`` and touching them raises.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "optim") or not hasattr(getattr(torch, "utils", None), "data"):
        return None
    return torch if hasattr(torch, "cuda") else None


def program_cuda_device() -> int | None:
    """The CUDA device current on the calling thread, once the program has initialised CUDA
    (never initialises it). Called on the program's threads: the current device is per thread."""
    try:
        torch = fully_imported_torch()
        if torch is None or not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - a broken CUDA setup is not the program's problem here
        return None


class DeviceSampling:
    """The collectors of one rank (CPU always, NVML when present, accelerators as they appear)."""

    def __init__(self) -> None:
        self.collectors = [CollectorHealth(CpuCollector())]
        with guarded:
            nvml = discover_nvml()
            if nvml is not None:
                self.collectors.append(CollectorHealth(nvml))
        # The first tick (at init) looks right away, and the next ones again after as long as it
        # has been since then, up to DISCOVER_EVERY_S: a device the program sets up before init()
        # or just after it (the usual ``model.cuda()``) must not wait that long for its first sample.
        self.next_discovery = 0.0
        self.first_discovery: float | None = None
        self.program_device: int | None = program_cuda_device()
        self.gpu_mb: tuple[int, int] | None = None  # (allocated, reserved) MiB of the program's device

    def note_program_device(self) -> None:
        """Remembers the CUDA device current on the calling (the program's) thread."""
        device = program_cuda_device()
        if device is not None:
            self.program_device = device

    def backends(self) -> set[str]:
        return {h.collector.backend for h in self.collectors}

    def discover(self, mono: float) -> bool:
        """Looks for new accelerators every ``DISCOVER_EVERY_S`` (True when it looked)."""
        if mono < self.next_discovery:
            return False
        if self.first_discovery is None:
            self.first_discovery = mono
        self.next_discovery = mono + min(DISCOVER_EVERY_S, mono - self.first_discovery)
        known = {h.collector.name for h in self.collectors}
        for collector in discover_accelerators(known, lambda: self.program_device):
            self.collectors.append(CollectorHealth(collector))
        return True

    def sample(self, now: float, factory: EventFactory, write: Callable[[TelemetryEventV3], None]) -> None:
        """Polls every collector: its readings (and its health's transitions) as records."""
        timestamp_ns = int(now * 1e9)
        accelerators = any(h.collector.backend not in ("cpu",) for h in self.collectors)
        for health in self.collectors:
            readings, transition = health.poll(now)
            meta = health.metadata()
            if transition is not None:
                context = health.last_error if transition == "collector_degraded" else "collector works again"
                write(factory.point(transition, context=context, metadata=meta, timestamp_ns=timestamp_ns,
                                    collector=health.collector.name))
            primary = health.collector.backend != "cpu" or not accelerators
            for reading in readings:
                write(factory.sample(health.collector.name, reading, meta, timestamp_ns, primary=primary))
            if readings and health.collector.backend in ("cuda", "rocm"):
                self._note_gpu_memory(readings, getattr(health.collector, "current_device", None))

    def _note_gpu_memory(self, readings: list[Reading], current: int | None) -> None:
        """The heartbeat's ``gpu_mem_*``: the program's own device (seen on its thread, else the
        collector's ``current``), else the one it holds most memory on."""
        device = self.program_device if self.program_device is not None else current
        chosen = next((r for r in readings if r.device_id == device), None)
        if chosen is None:
            chosen = max(readings, key=lambda r: (r.reserved, -r.device_id))
        self.gpu_mb = (chosen.allocated >> 20, chosen.reserved >> 20)

    def failures(self) -> dict[str, int]:
        """Failures per collector, for the stop record."""
        return {h.collector.name: h.failures_total for h in self.collectors}
