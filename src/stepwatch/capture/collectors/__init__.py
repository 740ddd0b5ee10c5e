"""Memory collectors, one per backend, discovered lazily: a backend is touched only when its
library is already imported by the program (torch, tensorflow) or installed (nvidia-ml-py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .base import Collector, Reading
from .cpu import CpuCollector
from .health import CollectorHealth

__all__ = [
    "Collector", "CollectorHealth", "CpuCollector", "Reading", "discover_accelerators", "discover_nvml",
]


def discover_accelerators(
    known: set[str], program_cuda_device: Callable[[], int | None] | None = None
) -> list[Collector]:
    """Collectors for backends that became usable since the last call (``known``: names taken).

    ``program_cuda_device``: the CUDA device the program's own thread works on, when known
    (see ``CudaCollector``).
    """
    found: list[Collector] = []
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda"):
        from .torch_devices import CudaCollector, MpsCollector

        # a build without CUDA or ROCm never has a device: not asked (is_available costs an
        # exception inside torch, every discovery, on every CPU-only rank)
        version = getattr(torch, "version", None)
        built = getattr(version, "cuda", True) is not None or getattr(version, "hip", None) is not None
        if built and CudaCollector.usable(torch):
            collector = CudaCollector(torch, program_cuda_device)
            if collector.name not in known:
                found.append(collector)
        if "stepwatch.mps_tracker" not in known and MpsCollector.usable(torch):
            found.append(MpsCollector(torch))
    tf = sys.modules.get("tensorflow")
    if tf is not None and "stepwatch.tensorflow_tracker" not in known:
        from .tensorflow import TensorflowCollector

        if TensorflowCollector.usable(tf):
            found.append(TensorflowCollector(tf))
    return found


def discover_nvml(pid: int | None = None) -> Collector | None:
    """The NVML device view when nvidia-ml-py is installed and a driver answers (checked once)."""
    from importlib.util import find_spec

    if find_spec("pynvml") is None:
        return None
    from ...nvml import load_nvml
    from .nvml import NvmlCollector

    nvml = load_nvml()
    return None if nvml is None else NvmlCollector(nvml, pid=pid)
