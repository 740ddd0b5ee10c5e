"""Accelerator memory through torch: CUDA and ROCm (HIP builds share torch.cuda), and MPS.

The torch module is passed in, so tests drive these collectors with a fake backend on CPU.
A device is sampled only once the program itself has initialised it: stepwatch never creates
a CUDA context (DataLoader workers, CPU-only ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Reading

__all__ = ["CudaCollector", "MpsCollector"]


class CudaCollector:
    """Caching-allocator stats per visible device, plus the driver's free/total."""

    supports_device_total = True
    supports_device_free = True
    sampling_source = "torch.cuda.memory_stats"

    def __init__(self, torch_module: Any, program_device: Callable[[], int | None] | None = None) -> None:
        """``program_device``: the device the program works on, as its own thread sees it.

        The current device is per thread: on the sampler thread ``current_device()`` is 0 on
        every rank, so the runtime passes the one it saw on the training thread (None while it
        has not seen one yet).
        """
        self._torch = torch_module
        self._cuda = torch_module.cuda
        self._program_device = program_device
        self.current_device: int | None = None  # the device the last read took as the program's
        self.backend = "rocm" if getattr(torch_module.version, "hip", None) else "cuda"
        self.name = f"stepwatch.{self.backend}_tracker"

    @staticmethod
    def usable(torch_module: Any) -> bool:
        cuda = getattr(torch_module, "cuda", None)
        # initialised first: the cheap question, and false on most ranks' discoveries
        return bool(cuda is not None and cuda.is_initialized() and cuda.is_available())

    def read(self) -> list[Reading]:
        readings = []
        # allocator stats need no CUDA context; the driver's free/total (mem_get_info) do
        all_stats = [self._cuda.memory_stats(device) for device in range(self._cuda.device_count())]
        current = self._program_device() if self._program_device is not None else None
        if current is None:
            # Not known yet: this thread's device stands in, but is read only if the process
            # holds memory there, or nowhere yet (it is 0 on every rank's sampler thread).
            current = int(self._cuda.current_device())
            held = _reserved(all_stats[current]) if 0 <= current < len(all_stats) else 0
            if not held and any(_reserved(stats) for stats in all_stats):
                current = None
        self.current_device = current
        for device, stats in enumerate(all_stats):
            allocated = int(stats.get("allocated_bytes.all.current", 0))
            reserved = _reserved(stats)
            if device != current and reserved == 0:
                # untouched by this process: asking the driver about it would create a CUDA
                # context there (hundreds of MB on every GPU, from every rank)
                continue
            partial: tuple[str, ...] = ()
            try:
                free, total = self._cuda.mem_get_info(device)
                free, total = int(free), int(total)
            except Exception:  # noqa: BLE001 - allocator view is still valid without the driver's
                free = total = None
                partial = ("device_free_bytes", "device_total_bytes")
            readings.append(
                Reading(
                    device_id=device,
                    allocated=allocated,
                    reserved=reserved,
                    active=_opt(stats, "active_bytes.all.current"),
                    inactive=_opt(stats, "inactive_split_bytes.all.current"),
                    # device view: everything in use on the card (other processes included)
                    used=(total - free) if total is not None and free is not None else reserved,
                    free=free,
                    total=total,
                    partial_fields=partial,
                    extra={
                        "peak_allocated_bytes": _opt(stats, "allocated_bytes.all.peak"),
                        "num_alloc_retries": _opt(stats, "num_alloc_retries"),
                        "num_ooms": _opt(stats, "num_ooms"),
                    },
                )
            )
        return readings


class MpsCollector:
    """Apple MPS: tensors allocated by torch, and what the Metal driver holds for the process."""

    name = "stepwatch.mps_tracker"
    backend = "mps"
    supports_device_free = False
    sampling_source = "torch.mps"

    def __init__(self, torch_module: Any) -> None:
        self._mps = torch_module.mps
        self.supports_device_total = hasattr(self._mps, "recommended_max_memory")

    @staticmethod
    def usable(torch_module: Any) -> bool:
        backend = getattr(getattr(torch_module, "backends", None), "mps", None)
        return bool(backend is not None and backend.is_available() and hasattr(torch_module, "mps"))

    def read(self) -> list[Reading]:
        allocated = int(self._mps.current_allocated_memory())
        driver = int(self._mps.driver_allocated_memory())
        total = int(self._mps.recommended_max_memory()) if self.supports_device_total else None
        return [
            Reading(
                device_id=0,
                allocated=allocated,
                reserved=max(driver, allocated),
                used=driver,
                total=total if total is None or total >= driver else None,
            )
        ]


def _reserved(stats: dict[str, Any]) -> int:
    return int(stats.get("reserved_bytes.all.current", 0))


def _opt(stats: dict[str, Any], key: str) -> int | None:
    value = stats.get(key)
    return None if value is None else int(value)
