"""The CUDA paths on a real GPU: the allocator and NVML collectors, CUDA-event phase timing, h2d
copies, snapshots of device tensors, a real CUDA OOM and ``stepwatch run`` on a GPU training.

Everything here is skipped without a CUDA device (CI has none: the same paths run on CPU there
with fake devices and fake events, test_gpu_timing.py and tests/capture/). Run it on a GPU
machine with ``python -m pytest tests/capture/test_cuda_device.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stepwatch
from stepwatch.artifacts.spool import LoadedSpool, read_spool
from stepwatch.capture.snapshots import load_snapshot_tensor, tensor_stats
from stepwatch.telemetry import load_telemetry_sessions
from tests.support.capture import start

pytestmark = [pytest.mark.real, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), pytest.mark.usefixtures("training_test")]

MiB = 1 << 20
PHASES = ("forward", "backward", "optimizer_step")


def named(spool: LoadedSpool, name: str) -> list[dict[str, Any]]:
    return sorted((s for s in spool.spans if s["name"] == name), key=lambda s: s["start_ns"])


def run_script(code: str, cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    script = cwd / "script.py"
    script.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


class _SyncCounter:
    """Counts every way of blocking the host on the device, to prove stepwatch never does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Event, "wait"), (torch.cuda.Stream, "synchronize")):
            monkeypatch.setattr(owner, name, self._counting(f"{getattr(owner, '__name__', owner)}.{name}",
                                                            getattr(owner, name)))

    def _counting(self, label: str, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(label)
            return original(*args, **kwargs)

        return wrapper


# -- collectors --------------------------------------------------------------------------------


def test_cuda_collector_reads_the_allocator_and_the_driver() -> None:
    from stepwatch.capture.collectors.torch_devices import CudaCollector

    block = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    assert CudaCollector.usable(torch)
    collector = CudaCollector(torch, lambda: 0)
    (reading,) = [r for r in collector.read() if r.device_id == 0]
    free, total = torch.cuda.mem_get_info(0)
    assert reading.allocated == torch.cuda.memory_allocated(0) >= 256 * MiB
    assert reading.reserved == torch.cuda.memory_reserved(0) >= reading.allocated
    assert reading.total == total
    assert abs(reading.free - free) <= 64 * MiB  # read a moment apart, other processes may run
    assert reading.used == reading.total - reading.free >= reading.reserved
    assert reading.extra["peak_allocated_bytes"] >= 256 * MiB
    assert reading.extra["num_ooms"] == torch.cuda.memory_stats(0)["num_ooms"]
    del block


def test_runtime_samples_cuda_memory_into_the_sink(tmp_path: Path) -> None:
    start(tmp_path, interval=0.05)
    block = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    time.sleep(0.5)
    del block
    torch.cuda.empty_cache()
    time.sleep(0.3)
    stepwatch.shutdown()

    (session,) = load_telemetry_sessions(tmp_path)
    assert session.summary.status == "completed"
    cuda = [e for e in session.events if e.collector == "stepwatch.cuda_tracker"]
    assert cuda, sorted({e.collector for e in session.events})
    assert {e.device_id for e in cuda} == {0}
    _, total = torch.cuda.mem_get_info(0)
    assert max(e.allocator_allocated_bytes for e in cuda) >= 512 * MiB
    assert all(e.device_total_bytes == total for e in cuda)
    assert all(e.allocator_reserved_bytes >= e.allocator_allocated_bytes for e in cuda)
    # the block was freed and the cache emptied before the end: the last samples show it
    assert cuda[-1].allocator_reserved_bytes < 512 * MiB


def test_stepwatch_never_creates_a_cuda_context(tmp_path: Path) -> None:
    """A rank that never touches the GPU (a CPU-only rank, a DataLoader worker) gets no context
    from stepwatch's sampler: hundreds of MB per process on a shared card."""
    proc = run_script(
        """
        import sys, time, torch, stepwatch
        to = torch.Tensor.to
        stepwatch.init(out=sys.argv[1], interval=0.02, handle_signals=False)
        print("H2D_PATCHED", torch.Tensor.to is not to)  # the accelerator check made no context
        model = torch.nn.Linear(8, 8)
        with stepwatch.trace_step(model):
            model(torch.randn(4, 8)).sum().backward()
        time.sleep(0.3)
        stepwatch.shutdown()
        print("INITIALIZED", torch.cuda.is_initialized())
        """,
        tmp_path, str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["H2D_PATCHED", "True", "INITIALIZED", "False"]


def test_nvml_reads_the_device_and_this_process() -> None:
    pytest.importorskip("pynvml")
    from stepwatch.capture.collectors.nvml import NvmlCollector
    from stepwatch.nvml import load_nvml

    nvml = load_nvml()
    assert nvml is not None
    block = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    device = NvmlCollector(nvml).read()[0]
    free, total = torch.cuda.mem_get_info(0)
    # NVML counts memory the driver keeps for itself (~0.5 GiB on an H100), the runtime does not
    assert total <= device.total <= total + 1024 * MiB
    assert device.used >= 256 * MiB and device.used + device.free == device.total
    mine = NvmlCollector(nvml, pid=os.getpid()).read()[0]
    # Some containers hide processes from NVML (other PID namespaces): then 0, never garbage.
    assert mine.extra["process_gpu_bytes"] == 0 or mine.extra["process_gpu_bytes"] >= 256 * MiB
    del block


# -- CUDA-event timing -------------------------------------------------------------------------


def _gpu_training(run_dir: Path, *, steps: int = 12, width: int = 2048) -> tuple[LoadedSpool, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(steps * 256, width), torch.randn(steps * 256, 1))
    loader = DataLoader(data, batch_size=256, pin_memory=True)
    runtime = start(run_dir, interval=0.05)
    for x, y in loader:
        with stepwatch.trace_step(model):
            x, y = x.to("cuda", non_blocking=True), y.cuda(non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    timer = runtime.training.gpu_timer
    stepwatch.shutdown()
    return read_spool(run_dir), timer


def test_phases_get_gpu_time_from_real_cuda_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    syncs = _SyncCounter(monkeypatch)
    spool, timer = _gpu_training(tmp_path)
    assert syncs.calls == []  # resolved with query() alone

    assert timer is not None, "GPU timing was not enabled once CUDA was initialised"
    assert timer.unresolved_dropped == 0 and timer.pool_exhausted == 0
    steps = named(spool, "step")
    assert len(steps) == 12
    # The timer starts on the runtime's first tick after CUDA is initialised: the steps after
    # that have every phase timed on the device.
    timed_steps = [s for s in steps if all(
        k["gpu_ns"] for k in spool.spans if k["parent_id"] == s["id"] and k["name"] in PHASES)]
    assert len(timed_steps) >= 6
    for step in timed_steps:
        kids = {k["name"]: k for k in spool.spans if k["parent_id"] == step["id"]}
        assert {"data_load", "h2d", *PHASES} <= set(kids)
        for name in PHASES:
            gpu_ns = kids[name]["gpu_ns"]
            assert 0 < gpu_ns < 5 * 10**9
        assert kids["data_load"]["gpu_ns"] is None  # host work: never timed on the device
    assert timer.resolved >= 3 * len(timed_steps)


def test_events_are_recorded_on_the_current_stream() -> None:
    """The fast ``record`` (a cached Stream per current stream) records where ``Event.record()``
    would: on the stream the program made current, not on the default one."""
    from stepwatch.capture.gpu_timing import cuda_event_source

    make_event, record = cuda_event_source(torch)
    big = torch.randn(4096, 4096, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        begin, end = make_event(), make_event()
        record(begin)
        for _ in range(20):
            big @ big
        record(end)
    end.synchronize()  # the test may wait; stepwatch never does
    assert begin.elapsed_time(end) > 0.5  # ms; ~0 had the pair gone to the idle default stream


def test_gpu_time_agrees_with_an_independent_measurement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward span's GPU time against the same forward timed by the test's own events."""
    torch.manual_seed(0)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # a slow, steady product
    model = nn.Linear(4096, 4096, bias=False).cuda()
    x = torch.randn(4096, 4096, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            model(x)  # warm-up: kernel selection, allocator
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for _ in range(5):
            model(x)
        end.record()
        torch.cuda.synchronize()
        reference_ns = begin.elapsed_time(end) * 1e6 / 5

        start(tmp_path, interval=0.02)
        time.sleep(0.1)  # the runtime's tick sees CUDA initialised and starts the GPU timer
        for _ in range(10):
            with stepwatch.trace_step(model):
                model(x)
        stepwatch.shutdown()
    forwards = [s["gpu_ns"] for s in named(read_spool(tmp_path), "forward") if s["gpu_ns"]]
    assert len(forwards) >= 8
    measured = statistics.median(forwards)
    assert 0.7 * reference_ns <= measured <= 1.5 * reference_ns + 200_000, (measured, reference_ns)


def test_step_breakdown_adds_up_on_the_gpu(tmp_path: Path) -> None:
    spool, _ = _gpu_training(tmp_path)
    for step in named(spool, "step"):
        a = step["attrs"]
        parts = a["h2d_ns"] + a["forward_ns"] + a["backward_ns"] + a["optimizer_step_ns"] + a["wait_ns"]
        assert parts == a["step_ns"] or a["wait_ns"] == 0
        assert a["h2d_ns"] > 0 and a["forward_ns"] > 0 and a["backward_ns"] > 0 and a["optimizer_step_ns"] > 0


def test_copies_inside_forward_are_not_h2d(tmp_path: Path) -> None:
    class CopiesInside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(64, 64).cuda()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x.to("cuda"))

    model = CopiesInside()
    start(tmp_path)
    for _ in range(3):
        with stepwatch.trace_step(model):
            model(torch.randn(32, 64)).sum().backward()
    stepwatch.shutdown()
    spool = read_spool(tmp_path)
    assert named(spool, "h2d") == []
    assert len(named(spool, "forward")) == 3


# -- snapshots ---------------------------------------------------------------------------------


def test_snapshot_of_device_tensors_matches_the_host_computation(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 3)).cuda()
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    start(tmp_path)
    with stepwatch.scope("probe"):
        made = stepwatch.snapshot(model, mode="full")
    stepwatch.shutdown()
    spool = read_spool(tmp_path)
    assert made == len(spool.snapshots) == 8  # 4 parameters and their 4 gradients
    tensors = dict(model.named_parameters())
    for record in spool.snapshots:
        name = record["tensor_name"]
        param = tensors[name.removesuffix(".grad")]
        tensor = (param.grad if name.endswith(".grad") else param).detach()
        stats, host = record["stats"], tensor_stats(tensor.cpu())
        assert record["shape"] == list(tensor.shape) and record["mode"] == "full"
        assert sum(stats["histogram"]["counts"]) == tensor.numel()
        for key in ("mean", "std", "min", "max", "norm"):
            assert stats[key] == pytest.approx(host[key], rel=1e-4, abs=1e-6), (name, key)
        # device and host histc may place a value sitting on a bin edge differently
        diff = sum(abs(a - b) for a, b in zip(stats["histogram"]["counts"], host["histogram"]["counts"]))
        assert diff <= max(2, tensor.numel() // 10_000), name
        blob = load_snapshot_tensor(record, tmp_path)
        assert blob.device.type == "cpu" and torch.equal(blob, tensor.cpu())


# -- OOM and the launcher ----------------------------------------------------------------------


def test_a_real_cuda_oom_is_recorded_and_still_raised(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_script(
        """
        import sys, time, torch, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05)
        keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        time.sleep(0.2)
        with stepwatch.oom_guard():
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 1
    assert proc.stderr.rstrip().splitlines()[-1].startswith("torch.OutOfMemoryError: CUDA out of memory")
    (session,) = load_telemetry_sessions(run)
    (error,) = [e for e in session.events if e.event_type == "error"]
    assert error.metadata["oom_reason"].startswith("OutOfMemoryError: CUDA out of memory")
    assert error.metadata["exception_type"] == "torch.OutOfMemoryError"
    (bundle,) = sorted((run / "bundles").glob("oom_dump_*_cuda_*"))
    environment = json.loads((bundle / "environment.json").read_text())
    assert environment["cuda_available"] is True
    assert any(d["kind"] == "cuda" and d.get("name") for d in environment["devices"])
    allocator = json.loads((bundle / "allocator_summary.json").read_text())
    assert allocator["backend"] == "cuda"
    assert allocator["devices"]["0"]["num_ooms"] >= 1
    assert allocator["devices"]["0"]["allocated_bytes.all.current"] >= 64 << 20


def test_stepwatch_run_summarises_a_gpu_training(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(
        """
        import torch, stepwatch
        from torch import nn
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1)).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(60):
            with stepwatch.trace_step(model):
                x = torch.randn(512, 1024).to("cuda")
                loss = model(x).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                stepwatch.mark("loss", loss.item())
        """))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    proc = subprocess.run([sys.executable, "-m", "stepwatch", "run", "--out", str(out), str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "final_summary.json").read_text())
    assert summary["overall"]["steps"] == 60, summary["overall"]
    cuda = [p for p in summary["memory_peaks"] if p["collector"] == "stepwatch.cuda_tracker"]
    assert [p["device_id"] for p in cuda] == [0]
    # the weights (4 MiB), gradients and activations of a 1024-wide MLP on 512 rows
    assert cuda[0]["peak_allocated_bytes"] >= 4 * MiB
    assert cuda[0]["peak_reserved_bytes"] >= cuda[0]["peak_allocated_bytes"]
