"""CollectorHealth (spec: "Collector health metadata"): backoff, degraded/unhealthy/recovered,
no synthetic samples while a collector fails, and the same story end to end in a real runtime.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from stepwatch.capture.collectors import CollectorHealth, Reading
from stepwatch.schema import validate_telemetry_record
from stepwatch.telemetry import load_telemetry_sessions

HEALTH_KEYS = {
    "backend", "supports_device_total", "supports_device_free", "sampling_source",
    "collector_health_status", "telemetry_partial", "collector_partial_fields", "collector_last_error",
    "collector_consecutive_failures", "collector_next_retry_epoch_s",
}


class ScriptedCollector:
    """Fails or answers as scripted; counts every read."""

    name = "stepwatch.cuda_tracker"
    backend = "cuda"
    supports_device_total = True
    supports_device_free = True
    sampling_source = "scripted"

    def __init__(self, script: list[object]) -> None:
        self.script = list(script)
        self.reads = 0

    def read(self) -> list[Reading]:
        self.reads += 1
        step = self.script.pop(0) if self.script else "ok"
        if isinstance(step, BaseException):
            raise step
        partial = tuple(step) if isinstance(step, tuple) else ()
        return [Reading(device_id=0, allocated=100, reserved=200, used=300, free=None if partial else 700,
                        total=None if partial else 1000, partial_fields=partial)]


def test_a_healthy_collector() -> None:
    health = CollectorHealth(ScriptedCollector(["ok"]))
    readings, transition = health.poll(10.0)
    assert transition is None and len(readings) == 1
    meta = health.metadata()
    assert set(meta) == HEALTH_KEYS
    assert meta == {
        "backend": "cuda", "supports_device_total": True, "supports_device_free": True, "sampling_source": "scripted",
        "collector_health_status": "healthy", "telemetry_partial": False, "collector_partial_fields": [],
        "collector_last_error": None, "collector_consecutive_failures": 0, "collector_next_retry_epoch_s": None,
    }


def test_failure_degrades_and_schedules_a_retry() -> None:
    collector = ScriptedCollector([RuntimeError("CUDA driver gone")])
    health = CollectorHealth(collector, base_backoff_s=1.0)
    readings, transition = health.poll(100.0)
    assert readings == []  # no sample at all: never zeros
    assert transition == "collector_degraded"
    meta = health.metadata()
    assert meta["collector_health_status"] == "degraded"
    assert meta["collector_last_error"] == "RuntimeError: CUDA driver gone"
    assert meta["collector_consecutive_failures"] == 1
    assert meta["collector_next_retry_epoch_s"] == 101.0


def test_exponential_backoff_no_read_before_the_retry_and_unhealthy_after_five() -> None:
    collector = ScriptedCollector([OSError(f"fail {i}") for i in range(7)])
    health = CollectorHealth(collector, base_backoff_s=1.0, max_backoff_s=60.0, unhealthy_after=5)
    now = 0.0
    expected_delays = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0]  # doubling, capped at max_backoff_s
    for failure, delay in enumerate(expected_delays, start=1):
        readings, transition = health.poll(now)
        assert (readings, transition) == ([], "collector_degraded")
        assert collector.reads == failure
        assert health.consecutive_failures == failure
        assert health.next_retry_epoch_s == now + delay
        assert health.status == ("unhealthy" if failure >= 5 else "degraded")
        assert health.last_error == f"OSError: fail {failure - 1}"
        # inside the backoff window: nothing is read, nothing is reported
        for probe in (now, now + delay / 2, now + delay - 1e-6):
            assert health.poll(probe) == ([], None)
        assert collector.reads == failure
        now += delay
    assert health.failures_total == 7
    assert health.metadata()["collector_health_status"] == "unhealthy"


def test_first_success_recovers() -> None:
    collector = ScriptedCollector([RuntimeError("a"), RuntimeError("b"), "ok", "ok"])
    health = CollectorHealth(collector, base_backoff_s=0.5)
    assert health.poll(0.0)[1] == "collector_degraded"
    assert health.poll(0.5)[1] == "collector_degraded"
    assert health.poll(1.0) == ([], None)  # retry at 1.5
    readings, transition = health.poll(1.5)
    assert transition == "collector_recovered" and len(readings) == 1
    meta = health.metadata()
    assert meta["collector_health_status"] == "healthy"
    assert meta["collector_consecutive_failures"] == 0
    assert meta["collector_next_retry_epoch_s"] is None
    readings, transition = health.poll(1.6)  # no backoff once healthy; no second "recovered"
    assert transition is None and len(readings) == 1
    assert health.failures_total == 2


def test_partial_fields_mark_the_telemetry_partial_and_degraded() -> None:
    collector = ScriptedCollector([("device_free_bytes", "device_total_bytes"), "ok"])
    health = CollectorHealth(collector)
    readings, transition = health.poll(0.0)
    assert transition is None and len(readings) == 1  # the allocator view still stands
    meta = health.metadata()
    assert meta["collector_health_status"] == "degraded"
    assert meta["telemetry_partial"] is True
    assert meta["collector_partial_fields"] == ["device_free_bytes", "device_total_bytes"]
    health.poll(0.1)
    meta = health.metadata()
    assert (meta["collector_health_status"], meta["telemetry_partial"], meta["collector_partial_fields"]) == (
        "healthy", False, [])


def test_a_keyboard_interrupt_is_not_a_collector_failure() -> None:
    health = CollectorHealth(ScriptedCollector([KeyboardInterrupt()]))
    with pytest.raises(KeyboardInterrupt):
        health.poll(0.0)


# -- end to end ----------------------------------------------------------------------------------

FLAKY_RUN = """
import sys, time, stepwatch
from stepwatch.capture.collectors import CollectorHealth, Reading

class Flaky:
    name = "stepwatch.cuda_tracker"
    backend = "cuda"
    supports_device_total = True
    supports_device_free = True
    sampling_source = "flaky"
    def __init__(self):
        self.reads = 0
    def read(self):
        self.reads += 1
        if self.reads <= 2:
            raise RuntimeError(f"device lost {self.reads}")
        return [Reading(device_id=0, allocated=123, reserved=456, used=789, free=211, total=1000)]

rt = stepwatch.init(out=sys.argv[1], interval=0.05)
flaky = Flaky()
rt.devices.collectors.append(CollectorHealth(flaky, base_backoff_s=0.05))
deadline = time.monotonic() + 10
while flaky.reads < 5 and time.monotonic() < deadline:
    time.sleep(0.05)
stepwatch.shutdown()
print("READS", flaky.reads)
"""


@pytest.mark.real
def test_runtime_records_degraded_then_recovered(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(FLAKY_RUN), str(run)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr  # a failing collector is data, not an internal error
    (session,) = load_telemetry_sessions(run)
    mine = [e for e in session.events if e.collector == "stepwatch.cuda_tracker"]
    kinds = [e.event_type for e in mine if e.event_type != "sample" or e.device_id == 0]
    first_sample = kinds.index("sample")
    assert kinds[:first_sample] == ["collector_degraded", "collector_degraded", "collector_recovered"]
    assert "collector_degraded" not in kinds[first_sample:]

    degraded = [e for e in mine if e.event_type == "collector_degraded"]
    assert [e.metadata["collector_consecutive_failures"] for e in degraded] == [1, 2]
    assert [e.context for e in degraded] == ["RuntimeError: device lost 1", "RuntimeError: device lost 2"]
    for e in degraded:
        assert e.metadata["collector_health_status"] == "degraded"
        assert e.metadata["collector_last_error"] == e.context
        assert e.metadata["collector_next_retry_epoch_s"] > e.timestamp_ns / 1e9
        assert e.metadata["backend"] == "cuda"
    recovered = next(e for e in mine if e.event_type == "collector_recovered")
    assert recovered.metadata["collector_health_status"] == "healthy"
    assert recovered.metadata["collector_consecutive_failures"] == 0
    samples = [e for e in mine if e.event_type == "sample"]
    assert samples and all(e.timestamp_ns >= recovered.timestamp_ns for e in samples)
    assert {(e.allocator_allocated_bytes, e.allocator_reserved_bytes, e.device_used_bytes) for e in samples} == {
        (123, 456, 789)}  # never a zero-filled sample
    stop = next(e for e in session.events if e.event_type == "stop")
    assert stop.metadata["collector_failures"]["stepwatch.cuda_tracker"] == 2
    for e in session.events:
        validate_telemetry_record(msgspec.to_builtins(e))
