"""Opens NVIDIA's management library (NVML), for whoever needs the cards' view: the live collector
(``capture.collectors.nvml``) and the OOM bundle's device list (``artifacts.bundles``). It sits
below both so that writing a file never imports the capture side.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["load_nvml"]

# the driver's library, by the name nvidia-ml-py opens it on Linux (WSL2 included)
_LINUX_LIBRARY = "libnvidia-ml.so.1"


def load_nvml() -> Any | None:
    """The initialised ``pynvml`` module of nvidia-ml-py, or None when absent or no driver.

    On Linux the driver's library is looked for first: where there is none (every CPU host),
    importing ``pynvml`` would cost each rank ~0.13 s of CPU at start for nothing."""
    try:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(_LINUX_LIBRARY)
        import pynvml  # provided by the nvidia-ml-py distribution
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library or no driver: NVML simply is not present
        return None
    return pynvml
