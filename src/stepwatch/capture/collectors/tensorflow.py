"""TensorFlow's allocator view per GPU (``tf.config.experimental.get_memory_info``)."""

from __future__ import annotations

from typing import Any

from .base import Reading

__all__ = ["TensorflowCollector"]


class TensorflowCollector:
    name = "stepwatch.tensorflow_tracker"
    backend = "tensorflow"
    supports_device_total = False
    supports_device_free = False
    sampling_source = "tf.config.experimental.get_memory_info"

    def __init__(self, tf_module: Any) -> None:
        self._tf = tf_module

    @staticmethod
    def usable(tf_module: Any) -> bool:
        return bool(tf_module.config.list_physical_devices("GPU"))

    def read(self) -> list[Reading]:
        readings = []
        for index, _ in enumerate(self._tf.config.list_physical_devices("GPU")):
            info = self._tf.config.experimental.get_memory_info(f"GPU:{index}")
            current = int(info["current"])
            readings.append(
                Reading(device_id=index, allocated=current, reserved=current, used=current,
                        extra={"peak_bytes": int(info.get("peak", current))})
            )
        return readings
