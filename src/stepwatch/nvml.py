"""Opens NVIDIA's management library (NVML), for whoever needs the cards' view: the live collector
(``capture.collectors.nvml``) and the OOM bundle's device list (``artifacts.bundles``). It sits
below both so that writing a file never imports the capture side.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_nvml"]


def load_nvml() -> Any | None:
    """The initialised ``pynvml`` module of nvidia-ml-py, or None when absent or no driver."""
    try:
        import pynvml  # provided by the nvidia-ml-py distribution
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library or no driver: NVML simply is not present
        return None
    return pynvml
