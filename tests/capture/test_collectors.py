"""Memory collectors: the real psutil one, and each accelerator backend driven by a fake module
(CI has no CUDA, ROCm, MPS, TensorFlow or NVML), through discovery to v3 records.
"""

from __future__ import annotations

import gc
import importlib.machinery
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import psutil
import pytest

import stepwatch.nvml
from stepwatch.capture.collectors import (
    CollectorHealth,
    CpuCollector,
    Reading,
    discover_accelerators,
    discover_nvml,
)
from stepwatch.capture.collectors.nvml import NvmlCollector
from stepwatch.capture.collectors.tensorflow import TensorflowCollector
from stepwatch.capture.collectors.torch_devices import CudaCollector, MpsCollector
from stepwatch.capture.events import EventFactory
from stepwatch.capture.identity import DistributedIdentity
from stepwatch.nvml import load_nvml
from stepwatch.schema import json_schema, validate_telemetry_record
from stepwatch.telemetry import load_telemetry_sessions

MB = 1 << 20
GB = 1 << 30
CAPABILITY_KEYS = ("backend", "supports_device_total", "supports_device_free", "sampling_source")


# -- fakes ---------------------------------------------------------------------------------------


class FakeCuda:
    """torch.cuda as the collector uses it: per-device allocator stats and driver free/total."""

    def __init__(self, devices: list[dict[str, int]], *, available: bool = True, initialized: bool = True,
                 total: int = 16 * GB, driver_fails: bool = False, current: int = 0) -> None:
        self.devices = devices
        self.current = current
        self.driver_asked: list[int] = []
        self.available = available
        self.initialized = initialized
        self.total = total
        self.driver_fails = driver_fails
        self.calls: list[str] = []

    def is_available(self) -> bool:
        self.calls.append("is_available")
        return self.available

    def is_initialized(self) -> bool:
        self.calls.append("is_initialized")
        return self.initialized

    def device_count(self) -> int:
        return len(self.devices)

    def memory_stats(self, device: int) -> dict[str, int]:
        return dict(self.devices[device])

    def current_device(self) -> int:
        return self.current

    def mem_get_info(self, device: int) -> tuple[int, int]:
        self.driver_asked.append(device)  # the real call creates a context on that device
        if self.driver_fails:
            raise RuntimeError("driver went away")
        used = self.devices[device]["reserved_bytes.all.current"] + 300 * MB  # + CUDA context etc.
        return self.total - used, self.total


def fake_torch(cuda: FakeCuda | None = None, *, hip: str | None = None, mps: Any = None) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    torch.cuda = cuda or FakeCuda([], available=False, initialized=False)  # type: ignore[attr-defined]
    torch.version = types.SimpleNamespace(hip=hip, cuda=None if hip else "12.4")  # type: ignore[attr-defined]
    mps_available = mps is not None
    mps_backend = types.SimpleNamespace(is_available=lambda: mps_available)
    torch.backends = types.SimpleNamespace(mps=mps_backend)  # type: ignore[attr-defined]
    if mps is not None:
        torch.mps = mps  # type: ignore[attr-defined]
    return torch


def stats(allocated: int, reserved: int, *, active: int | None = None, peak: int | None = None) -> dict[str, int]:
    out = {"allocated_bytes.all.current": allocated, "reserved_bytes.all.current": reserved,
           "allocated_bytes.all.peak": peak if peak is not None else allocated, "num_alloc_retries": 0, "num_ooms": 0,
           "inactive_split_bytes.all.current": reserved - allocated}
    if active is not None:
        out["active_bytes.all.current"] = active
    return out


class FakeMps:
    def __init__(self, allocated: int, driver: int, recommended: int | None) -> None:
        self._allocated, self._driver = allocated, driver
        if recommended is not None:
            self.recommended_max_memory = lambda: recommended

    def current_allocated_memory(self) -> int:
        return self._allocated

    def driver_allocated_memory(self) -> int:
        return self._driver


def fake_tf(memory: list[dict[str, int]]) -> types.ModuleType:
    tf = types.ModuleType("tensorflow")
    asked: list[str] = []

    def get_memory_info(device: str) -> dict[str, int]:
        asked.append(device)
        return dict(memory[int(device.split(":")[1])])

    tf.config = types.SimpleNamespace(  # type: ignore[attr-defined]
        list_physical_devices=lambda kind: [f"/physical_device:{kind}:{i}" for i in range(len(memory))]
        if kind == "GPU" else [],
        experimental=types.SimpleNamespace(get_memory_info=get_memory_info),
    )
    tf.asked = asked  # type: ignore[attr-defined]
    return tf


def fake_pynvml(devices: list[tuple[int, int]], processes: dict[int, list[tuple[int, int | None]]]) -> types.ModuleType:
    """``devices``: (used, total) per card; ``processes``: card -> [(pid, usedGpuMemory)]."""
    nvml = types.ModuleType("pynvml")
    nvml.__spec__ = importlib.machinery.ModuleSpec("pynvml", None)
    nvml.initialised = False  # type: ignore[attr-defined]

    def init() -> None:
        nvml.initialised = True  # type: ignore[attr-defined]

    nvml.nvmlInit = init  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        used=devices[h[1]][0], free=devices[h[1]][1] - devices[h[1]][0], total=devices[h[1]][1])
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes.get(h[1], [])]
    return nvml


# -- records -------------------------------------------------------------------------------------


def sample_records(health: CollectorHealth, *, now: float = 1_800_000_000.0) -> list[dict[str, Any]]:
    """Polls once and builds the sample records the runtime would write, as plain dicts."""
    factory = EventFactory(session_id="00000000-0000-4000-8000-0000000000aa", identity=DistributedIdentity(),
                           host="node-a", pid=4321, interval_ms=50)
    readings, transition = health.poll(now)
    assert transition is None
    events = [factory.sample(health.collector.name, r, health.metadata(), int(now * 1e9), primary=True)
              for r in readings]
    return [msgspec.to_builtins(e) for e in events]


def check_records(records: list[dict[str, Any]], collector: Any) -> None:
    schema = json_schema(3)
    for record in records:
        validate_telemetry_record(record)
        jsonschema.validate(record, schema)
        assert record["collector"] == collector.name
        meta = record["metadata"]
        assert {k: meta[k] for k in CAPABILITY_KEYS} == {
            "backend": collector.backend,
            "supports_device_total": collector.supports_device_total,
            "supports_device_free": collector.supports_device_free,
            "sampling_source": collector.sampling_source,
        }
        assert meta["collector_health_status"] in ("healthy", "degraded")


# -- CPU -----------------------------------------------------------------------------------------


def test_cpu_collector_rss_grows_when_the_process_allocates() -> None:
    collector = CpuCollector()
    (before,) = collector.read()
    block = bytearray(b"\x01") * (200 * MB)  # written, so the pages are really resident
    try:
        (during,) = collector.read()
    finally:
        del block
        gc.collect()
    assert before.device_id == -1
    assert during.allocated - before.allocated >= 150 * MB
    assert during.used == during.allocated == during.reserved
    assert during.total is not None and during.free is not None and 0 < during.free <= during.total
    assert during.extra is not None and during.extra["vms_bytes"] >= during.allocated
    check_records(sample_records(CollectorHealth(collector)), collector)


def test_cpu_collector_of_another_process() -> None:
    collector = CpuCollector(os.getppid())
    assert collector.pid == os.getppid()
    (reading,) = collector.read()
    assert reading.allocated > 0


def test_cpu_collector_without_machine_view_reports_partial_fields() -> None:
    class NoVirtualMemory:
        Process = psutil.Process

        @staticmethod
        def virtual_memory() -> Any:
            raise OSError("no /proc/meminfo")

    collector = CpuCollector(psutil_module=NoVirtualMemory)
    health = CollectorHealth(collector)
    records = sample_records(health)
    assert records[0]["device_total_bytes"] is None and records[0]["device_free_bytes"] is None
    assert records[0]["allocator_allocated_bytes"] > 0
    assert records[0]["metadata"]["telemetry_partial"] is True
    assert records[0]["metadata"]["collector_partial_fields"] == ["device_free_bytes", "device_total_bytes"]
    check_records(records, collector)


def test_nvml_collector_records_utilisation_where_the_driver_tells() -> None:
    nvml = fake_pynvml([(3 * GB, 16 * GB)], {})
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=17, memory=3)  # type: ignore[attr-defined]
    collector = NvmlCollector(nvml)
    assert collector.read()[0].extra == {"gpu_util_pct": 17}
    assert sample_records(CollectorHealth(collector))[0]["metadata"]["gpu_util_pct"] == 17


# -- CUDA / ROCm ---------------------------------------------------------------------------------


def test_cuda_collector_reads_allocator_and_driver_view_per_device() -> None:
    cuda = FakeCuda([stats(1 * GB, 2 * GB, active=1 * GB, peak=3 * GB), stats(10 * MB, 20 * MB)])
    collector = CudaCollector(fake_torch(cuda))
    assert (collector.backend, collector.name) == ("cuda", "stepwatch.cuda_tracker")
    first, second = collector.read()
    assert (first.device_id, second.device_id) == (0, 1)
    assert (first.allocated, first.reserved, first.active, first.inactive) == (1 * GB, 2 * GB, 1 * GB, 1 * GB)
    assert first.total == 16 * GB and first.free == 16 * GB - 2 * GB - 300 * MB
    assert first.used == first.total - first.free  # the device view: everything on the card
    assert first.extra == {"peak_allocated_bytes": 3 * GB, "num_alloc_retries": 0, "num_ooms": 0}
    assert second.active is None  # not reported: None, never 0
    check_records(sample_records(CollectorHealth(collector)), collector)


def test_cuda_collector_leaves_devices_this_process_never_used_alone() -> None:
    # rank 1 of a node: its own device is 1; device 0 and 2 hold nothing of this process
    cuda = FakeCuda([stats(0, 0), stats(1 * GB, 2 * GB), stats(0, 0)], current=1)
    (reading,) = CudaCollector(fake_torch(cuda)).read()
    assert reading.device_id == 1
    assert cuda.driver_asked == [1]  # no driver call (no context) on devices 0 and 2
    cuda.devices[2] = stats(5 * MB, 8 * MB)  # the program moved a tensor to device 2
    assert [r.device_id for r in CudaCollector(fake_torch(cuda)).read()] == [1, 2]


def test_cuda_collector_without_driver_view_keeps_allocator_counters() -> None:
    collector = CudaCollector(fake_torch(FakeCuda([stats(5 * MB, 8 * MB)], driver_fails=True)))
    (reading,) = collector.read()
    assert (reading.allocated, reading.reserved, reading.used) == (5 * MB, 8 * MB, 8 * MB)
    assert reading.free is None and reading.total is None
    health = CollectorHealth(collector)
    records = sample_records(health)
    assert health.status == "degraded"
    assert records[0]["metadata"]["telemetry_partial"] is True
    check_records(records, collector)


def test_rocm_build_is_reported_as_rocm() -> None:
    collector = CudaCollector(fake_torch(FakeCuda([stats(1 * MB, 2 * MB)]), hip="6.0"))
    assert (collector.backend, collector.name) == ("rocm", "stepwatch.rocm_tracker")
    records = sample_records(CollectorHealth(collector))
    assert records[0]["collector"] == "stepwatch.rocm_tracker"
    assert records[0]["metadata"]["backend"] == "rocm"
    check_records(records, collector)


# -- MPS -----------------------------------------------------------------------------------------


def test_mps_collector() -> None:
    collector = MpsCollector(fake_torch(mps=FakeMps(100 * MB, 300 * MB, 8 * GB)))
    assert (collector.backend, collector.name) == ("mps", "stepwatch.mps_tracker")
    assert collector.supports_device_total is True and collector.supports_device_free is False
    (reading,) = collector.read()
    assert (reading.device_id, reading.allocated, reading.reserved, reading.used) == (0, 100 * MB, 300 * MB, 300 * MB)
    assert reading.total == 8 * GB and reading.free is None
    check_records(sample_records(CollectorHealth(collector)), collector)


def test_mps_collector_without_recommended_max_memory_has_no_total() -> None:
    collector = MpsCollector(fake_torch(mps=FakeMps(100 * MB, 50 * MB, None)))
    assert collector.supports_device_total is False
    (reading,) = collector.read()
    assert reading.total is None
    assert reading.reserved == 100 * MB  # never below what is allocated
    check_records(sample_records(CollectorHealth(collector)), collector)


# -- TensorFlow ----------------------------------------------------------------------------------


def test_tensorflow_collector() -> None:
    tf = fake_tf([{"current": 7 * MB, "peak": 9 * MB}, {"current": 1 * MB, "peak": 1 * MB}])
    collector = TensorflowCollector(tf)
    assert TensorflowCollector.usable(tf)
    readings = collector.read()
    assert tf.asked == ["GPU:0", "GPU:1"]  # type: ignore[attr-defined]
    assert [(r.device_id, r.allocated, r.used) for r in readings] == [(0, 7 * MB, 7 * MB), (1, 1 * MB, 1 * MB)]
    assert readings[0].extra == {"peak_bytes": 9 * MB}
    assert readings[0].total is None and readings[0].free is None
    check_records(sample_records(CollectorHealth(collector)), collector)


def test_tensorflow_without_gpus_is_not_usable() -> None:
    assert not TensorflowCollector.usable(fake_tf([]))


# -- NVML ----------------------------------------------------------------------------------------


def test_nvml_collector_device_view() -> None:
    nvml = fake_pynvml([(3 * GB, 16 * GB), (1 * GB, 16 * GB)], {0: [(111, 2 * GB)]})
    collector = NvmlCollector(nvml)
    readings = collector.read()
    assert [(r.device_id, r.used, r.free, r.total) for r in readings] == [
        (0, 3 * GB, 13 * GB, 16 * GB), (1, 1 * GB, 15 * GB, 16 * GB)]
    assert readings[0].allocated == 3 * GB and readings[0].extra is None
    check_records(sample_records(CollectorHealth(collector)), collector)


def test_nvml_collector_per_process_memory() -> None:
    nvml = fake_pynvml(
        [(6 * GB, 16 * GB), (2 * GB, 16 * GB)],
        {0: [(111, 2 * GB), (222, 1 * GB), (111, 512 * MB)], 1: [(222, 2 * GB), (111, None)]},
    )
    collector = NvmlCollector(nvml, pid=111)
    first, second = collector.read()
    assert (first.allocated, first.reserved, first.used) == (2 * GB + 512 * MB, 2 * GB + 512 * MB, 6 * GB)
    assert first.extra == {"process_gpu_bytes": 2 * GB + 512 * MB}
    assert second.allocated == 0 and second.extra == {"process_gpu_bytes": 0}  # unknown usage is not counted
    records = sample_records(CollectorHealth(collector))
    assert records[0]["metadata"]["process_gpu_bytes"] == 2 * GB + 512 * MB
    check_records(records, collector)


@pytest.fixture
def driver_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library that loads stands for the driver's (this host has none), so that the fake
    ``pynvml`` is asked."""
    monkeypatch.setattr(stepwatch.nvml, "_LINUX_LIBRARY", "libc.so.6")


@pytest.mark.usefixtures("driver_library")
def test_load_and_discover_nvml_with_a_fake_module(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml([(1 * GB, 8 * GB)], {0: [(5, 1 * GB)]})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert load_nvml() is nvml and nvml.initialised  # type: ignore[attr-defined]
    collector = discover_nvml(pid=5)
    assert isinstance(collector, NvmlCollector) and collector.pid == 5
    assert collector.read()[0].allocated == 1 * GB


@pytest.mark.usefixtures("driver_library")
def test_nvml_without_a_driver_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml([], {})

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    nvml.nvmlInit = no_driver  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert load_nvml() is None
    assert discover_nvml() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the driver's library is looked for on Linux")
def test_a_host_without_the_driver_never_imports_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    try:
        ctypes.CDLL(stepwatch.nvml._LINUX_LIBRARY)
        pytest.skip("this host has NVIDIA's driver")
    except OSError:
        pass
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    assert load_nvml() is None and discover_nvml() is None
    assert "pynvml" not in sys.modules  # ~0.13 s of each rank's start on a CPU host


# -- discovery -----------------------------------------------------------------------------------


@pytest.fixture
def no_frameworks(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("torch", "tensorflow"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return monkeypatch


def test_discovery_finds_nothing_without_imported_frameworks(no_frameworks: pytest.MonkeyPatch) -> None:
    assert discover_accelerators(set()) == []


@pytest.mark.parametrize(("available", "initialized"), [(False, False), (True, False), (False, True)])
def test_discovery_skips_cuda_until_the_program_initialised_it(
    no_frameworks: pytest.MonkeyPatch, available: bool, initialized: bool
) -> None:
    cuda = FakeCuda([stats(1, 1)], available=available, initialized=initialized)
    no_frameworks.setitem(sys.modules, "torch", fake_torch(cuda))
    assert discover_accelerators(set()) == []


@pytest.mark.parametrize(("hip", "name"), [(None, "stepwatch.cuda_tracker"), ("6.0", "stepwatch.rocm_tracker")])
def test_discovery_picks_an_initialised_cuda_or_rocm_device_once(
    no_frameworks: pytest.MonkeyPatch, hip: str | None, name: str
) -> None:
    no_frameworks.setitem(sys.modules, "torch", fake_torch(FakeCuda([stats(1, 1)]), hip=hip))
    (found,) = discover_accelerators(set())
    assert isinstance(found, CudaCollector) and found.name == name
    assert discover_accelerators({name}) == []  # already known: not added twice


def test_discovery_does_not_ask_a_build_without_cuda_or_rocm(no_frameworks: pytest.MonkeyPatch) -> None:
    """A CPU-only torch (``torch.version.cuda`` and ``.hip`` both None) never has a CUDA device:
    its ``cuda.is_available`` is not called at each discovery (it raises inside torch)."""
    cuda = FakeCuda([stats(1, 1)])
    asked: list[str] = []
    cuda.is_available = lambda: asked.append("is_available") or True  # type: ignore[method-assign]
    torch = fake_torch(cuda)
    torch.version = types.SimpleNamespace(hip=None, cuda=None)  # type: ignore[attr-defined]
    no_frameworks.setitem(sys.modules, "torch", torch)
    assert discover_accelerators(set()) == [] and asked == []


def test_discovery_picks_mps(no_frameworks: pytest.MonkeyPatch) -> None:
    no_frameworks.setitem(sys.modules, "torch", fake_torch(mps=FakeMps(1, 1, None)))
    (found,) = discover_accelerators(set())
    assert isinstance(found, MpsCollector)
    assert discover_accelerators({"stepwatch.mps_tracker"}) == []


def test_discovery_picks_tensorflow_only_with_gpus(no_frameworks: pytest.MonkeyPatch) -> None:
    no_frameworks.setitem(sys.modules, "tensorflow", fake_tf([]))
    assert discover_accelerators(set()) == []
    no_frameworks.setitem(sys.modules, "tensorflow", fake_tf([{"current": 1, "peak": 1}]))
    (found,) = discover_accelerators(set())
    assert isinstance(found, TensorflowCollector)
    assert discover_accelerators({found.name}) == []


def test_discovery_does_not_import_frameworks(no_frameworks: pytest.MonkeyPatch) -> None:
    discover_accelerators(set())
    assert "torch" not in sys.modules and "tensorflow" not in sys.modules


# -- end to end: a runtime discovers a fake CUDA device and writes its samples ------------------


@pytest.mark.real
def test_runtime_writes_samples_of_a_discovered_cuda_device(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = textwrap.dedent(
        """
        import importlib.machinery, sys, time, types
        GB = 1 << 30
        class Cuda:
            def is_available(self): return True
            def is_initialized(self): return True
            def device_count(self): return 1
            def current_device(self): return 0
            def memory_stats(self, d): return {"allocated_bytes.all.current": GB, "reserved_bytes.all.current": 2 * GB}
            def mem_get_info(self, d): return (10 * GB, 16 * GB)
        torch = types.ModuleType("torch")
        torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
        torch.cuda = Cuda()
        torch.version = types.SimpleNamespace(hip=None, cuda="12.4")
        sys.modules["torch"] = torch
        import stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05)
        time.sleep(0.6)
        stepwatch.shutdown()
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    proc = subprocess.run([sys.executable, "-c", script, str(run)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    (session,) = load_telemetry_sessions(run)
    cuda = [e for e in session.events if e.event_type == "sample" and e.collector == "stepwatch.cuda_tracker"]
    assert len(cuda) >= 3, [e.collector for e in session.events]
    assert {(e.device_id, e.allocator_allocated_bytes, e.device_total_bytes) for e in cuda} == {(0, GB, 16 * GB)}
    # the CPU view goes on beside it
    assert any(e.collector == "stepwatch.cpu_tracker" and e.event_type == "sample" for e in session.events)
    check_records([msgspec.to_builtins(e) for e in cuda], CudaCollector(fake_torch(FakeCuda([]))))
    # once an accelerator is sampled, lifecycle records carry its counters
    stop = next(e for e in session.events if e.event_type == "stop")
    assert stop.collector == "stepwatch.cuda_tracker" and stop.device_id == 0


def test_reading_is_plain_data() -> None:
    reading = Reading(device_id=0, allocated=1, reserved=2, used=3)
    assert (reading.active, reading.inactive, reading.free, reading.total, reading.partial_fields) == (
        None, None, None, None, ())


@pytest.mark.usefixtures("driver_library")
def test_environment_inventory_lists_nvml_gpus_without_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from stepwatch.artifacts.bundles import environment_info

    nvml = fake_pynvml([(1 * GB, 80 * GB), (0, 80 * GB)], {})
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA H100"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # the CLI never imports torch
    devices = environment_info()["devices"]
    assert [(d["kind"], d["index"]) for d in devices] == [("cpu", -1), ("cuda", 0), ("cuda", 1)]
    assert devices[1]["name"] == "NVIDIA H100" and devices[1]["total_bytes"] == 80 * GB


def test_cpu_collector_reads_its_own_statm_as_psutil_does() -> None:
    """Linux, this process: RSS and virtual size come from /proc/<pid>/statm directly (psutil's
    source for memory_info), and agree with psutil's; a statm that cannot be read hands over to
    psutil for good."""
    if not sys.platform.startswith("linux"):
        pytest.skip("statm is Linux's")
    collector = CpuCollector()
    assert collector._statm is not None
    (reading,) = collector.read()
    info = psutil.Process().memory_info()
    assert abs(reading.allocated - info.rss) < 64 * MB
    assert reading.extra is not None and abs(reading.extra["vms_bytes"] - info.vms) < 256 * MB
    collector._statm = b"/proc/no-such-process/statm"
    (fallback,) = collector.read()
    assert collector._statm is None and fallback.allocated > 0
    assert CpuCollector(os.getppid())._statm is None  # another process: psutil's
