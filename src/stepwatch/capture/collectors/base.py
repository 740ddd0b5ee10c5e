"""What a memory collector is: a named backend that returns readings or raises.

Collectors do no error handling of their own; ``CollectorHealth`` wraps each one, so backoff,
degraded/recovered events and the health metadata are the same for every backend.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

__all__ = ["Collector", "Reading"]


class Reading(msgspec.Struct, kw_only=True, gc=False):
    """One device's memory at one instant, in bytes (None: the backend cannot tell).

    ``partial_fields`` names the fields that should have had a value but failed this time.
    """

    device_id: int
    allocated: int
    reserved: int
    used: int
    active: int | None = None
    inactive: int | None = None
    free: int | None = None
    total: int | None = None
    partial_fields: tuple[str, ...] = ()
    extra: dict[str, Any] | None = None


class Collector(Protocol):
    """A memory backend. ``read`` raises on failure; it never invents zeros."""

    name: str  # collector id written in records, e.g. "stepwatch.cuda_tracker"
    backend: str  # "cpu", "cuda", "rocm", "mps", "nvml", "tensorflow"
    supports_device_total: bool
    supports_device_free: bool
    sampling_source: str

    def read(self) -> list[Reading]: ...
