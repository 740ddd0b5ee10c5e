"""GPU phase timing from pooled event pairs (gpu_timing.py, aggregator-architecture.md): a capped
pool, resolution only through ``query()``, unresolved pairs given up after ``max_wait_s`` — with
fake events, so it runs on CPU — and end to end through a traced loop into the spool."""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stepwatch
from stepwatch.artifacts.spool import read_spool
from stepwatch.capture.gpu_timing import GpuTimer, cuda_event_source

pytestmark = pytest.mark.usefixtures("training_test")


class FakeGpu:
    """A fake device clock and the events recorded on it. ``done_until`` is how far the
    "stream" has executed: events recorded at a later tick are not complete yet."""

    def __init__(self, *, ms_per_tick: float = 1.5) -> None:
        self.ticks = itertools.count(1)
        self.done_until = float("inf")
        self.ms_per_tick = ms_per_tick
        self.events: list[FakeEvent] = []
        self.calls: list[str] = []

    def make_event(self) -> FakeEvent:
        event = FakeEvent(self)
        self.events.append(event)
        return event


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.tick: int | None = None
        self.records = 0

    def record(self) -> None:
        self.gpu.calls.append("record")
        self.tick = next(self.gpu.ticks)
        self.records += 1

    def query(self) -> bool:
        self.gpu.calls.append("query")
        return self.tick is not None and self.tick <= self.gpu.done_until

    def elapsed_time(self, end: FakeEvent) -> float:
        self.gpu.calls.append("elapsed_time")
        assert self.query() and end.query(), "elapsed_time on an event that is not complete"
        return (end.tick - self.tick) * self.gpu.ms_per_tick

    def synchronize(self) -> None:
        raise AssertionError("GpuTimer must never synchronize")

    wait = synchronize


class Span:
    def __init__(self) -> None:
        self.gpu: Any = None


def timed(timer: GpuTimer, span: Span) -> Span:
    span.gpu = timer.begin(span)
    timer.end(span.gpu)
    return span


# -- the pool --------------------------------------------------------------------------------


def test_pool_is_capped_and_exhaustion_is_counted() -> None:
    gpu = FakeGpu()
    gpu.done_until = 0  # the device is behind: no pair can be reused yet
    timer = GpuTimer(gpu.make_event, capacity=4)
    first, second = timed(timer, Span()), timed(timer, Span())
    third = timed(timer, Span())  # the pool is empty: no GPU time for this one
    assert len(gpu.events) == 4
    assert timer.pool_exhausted == 1 and third.gpu is None

    gpu.done_until = float("inf")
    assert timer.resolve() == 2
    assert first.gpu == second.gpu == 1_500_000  # ticks 1 -> 2 at 1.5 ms a tick, in ns
    assert not timer.outstanding(first)


def test_start_event_returned_when_no_end_event_is_left() -> None:
    gpu = FakeGpu()
    gpu.done_until = 0
    timer = GpuTimer(gpu.make_event, capacity=3)
    timed(timer, Span())
    starved = timed(timer, Span())  # got a start event, then no end event
    assert timer.pool_exhausted == 1
    assert not timer.outstanding(starved)
    gpu.done_until = float("inf")
    timer.resolve()
    assert not isinstance(starved.gpu, int)
    reused = timed(timer, Span())  # the start event went back to the pool
    assert len(gpu.events) == 3 and timer.pool_exhausted == 1
    timer.resolve()
    assert reused.gpu == 1_500_000


def test_an_empty_pool_reuses_finished_pairs_on_the_spot() -> None:
    """Hundreds of steps a second run through a 512-event pool between two background ticks: the
    training thread takes back the pairs the device has finished instead of dropping spans."""
    gpu = FakeGpu()
    timer = GpuTimer(gpu.make_event, capacity=4)
    spans = [timed(timer, Span()) for _ in range(50)]  # no resolve() from any tick in between
    assert timer.pool_exhausted == 0 and len(gpu.events) == 4
    timer.resolve()
    assert all(s.gpu == 1_500_000 for s in spans)
    assert "synchronize" not in gpu.calls


class DeviceBoundEvent(FakeEvent):
    """Like a CUDA event: bound to the device of its first record, refusing any other."""

    def __init__(self, gpu: FakeGpu, current: dict[str, int]) -> None:
        super().__init__(gpu)
        self.current = current
        self.device: int | None = None

    def record(self) -> None:
        if self.device is not None and self.device != self.current["device"]:
            raise RuntimeError("Event device does not match recording stream's device")
        self.device = self.current["device"]
        super().record()

    def elapsed_time(self, end: FakeEvent) -> float:
        if self.device != getattr(end, "device", None):
            raise RuntimeError("events from different devices")
        return super().elapsed_time(end)


def test_a_change_of_current_device_costs_timings_not_errors() -> None:
    gpu = FakeGpu()
    current = {"device": 0}
    timer = GpuTimer(lambda: DeviceBoundEvent(gpu, current), capacity=4)
    before = [timed(timer, Span()) for _ in range(3)]
    timer.resolve()
    assert all(s.gpu == 1_500_000 for s in before)

    current["device"] = 1  # the program moved on to another device
    after = [timed(timer, Span()) for _ in range(6)]
    timer.resolve()
    # the device-0 events failed once each and were replaced by events of device 1
    assert timer.record_failed >= 1 and all(e.device in (0, 1) for e in gpu.events)
    assert after[-1].gpu == 1_500_000 and timer.pool_exhausted == 0

    span = Span()
    span.gpu = timer.begin(span)  # a phase that starts on device 1 ...
    current["device"] = 0  # ... and ends on device 0: no elapsed time between the two
    timer.end(span.gpu)
    timer.resolve()
    assert not isinstance(span.gpu, int) and not timer.outstanding(span)
    assert timer.unresolved_dropped == 0  # counted as record_failed, not as unresolved


def test_events_are_reused_after_resolution() -> None:
    gpu = FakeGpu()
    timer = GpuTimer(gpu.make_event, capacity=4)
    spans = []
    for _ in range(50):
        spans.append(timed(timer, Span()))
        timer.resolve()
    assert len(gpu.events) == 2  # one pair, recorded 50 times
    assert all(event.records == 50 for event in gpu.events)
    assert timer.resolved == 50 and timer.pool_exhausted == 0
    assert all(span.gpu == 1_500_000 for span in spans)


# -- resolution ------------------------------------------------------------------------------


def test_resolution_only_by_query_in_stream_order() -> None:
    gpu = FakeGpu()
    timer = GpuTimer(gpu.make_event, capacity=16, max_wait_s=60)
    gpu.done_until = 0  # nothing has run on the "device" yet
    spans = [timed(timer, Span()) for _ in range(3)]
    assert timer.resolve() == 0
    assert all(timer.outstanding(s) and not isinstance(s.gpu, int) for s in spans)

    gpu.done_until = 4  # the first two pairs (ticks 1-2, 3-4) are done
    assert timer.resolve() == 2
    assert [isinstance(s.gpu, int) for s in spans] == [True, True, False]
    assert timer.outstanding(spans[2])

    gpu.done_until = float("inf")
    assert timer.resolve() == 1 and spans[2].gpu == 1_500_000
    assert set(gpu.calls) == {"record", "query", "elapsed_time"}  # never synchronize() / wait()


def test_unresolved_pairs_are_dropped_after_max_wait() -> None:
    gpu = FakeGpu()
    timer = GpuTimer(gpu.make_event, capacity=4, max_wait_s=0.02)
    gpu.done_until = 0
    stuck = timed(timer, Span())
    assert timer.resolve() == 0 and timer.unresolved_dropped == 0
    time.sleep(0.05)
    assert timer.resolve() == 0
    assert timer.unresolved_dropped == 1
    assert stuck.gpu is None and not timer.outstanding(stuck)
    gpu.done_until = float("inf")
    again = timed(timer, Span())  # the stuck pair's events went back to the pool
    assert len(gpu.events) == 2
    timer.resolve()
    assert again.gpu == 1_500_000


def test_outstanding_is_safe_while_the_training_thread_records() -> None:
    """The spool thread asks ``outstanding`` while the training thread appends pairs."""
    gpu = FakeGpu()
    gpu.done_until = 0
    timer = GpuTimer(gpu.make_event, capacity=10**7, max_wait_s=3600)
    for _ in range(2000):
        timed(timer, Span())
    stop = threading.Event()

    def training_thread() -> None:
        while not stop.is_set():
            timed(timer, Span())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=training_thread)
    thread.start()
    try:
        deadline = time.monotonic() + 0.3
        probe = Span()
        while time.monotonic() < deadline:
            assert timer.outstanding(probe) is False
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


# -- end to end ------------------------------------------------------------------------------



def _train(runs: int = 2) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    for _ in stepwatch.epochs(runs):
        for x, y in loader:
            with stepwatch.trace_step(model):
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    return model


@pytest.mark.real
def test_gpu_ns_lands_on_phase_spans_in_the_spool(tmp_path: Path) -> None:
    gpu = FakeGpu(ms_per_tick=2.5)
    runtime = stepwatch.init(out=tmp_path, handle_signals=False, capture_oom=False)
    runtime.training.gpu_timer = GpuTimer(gpu.make_event, capacity=64)
    _train()
    stepwatch.shutdown()
    spool = read_spool(tmp_path)

    timed_spans = [s for s in spool.spans if s["name"] in ("forward", "backward", "optimizer_step")]
    assert len(timed_spans) == 3 * 4
    assert all(s["gpu_ns"] == 2_500_000 for s in timed_spans)
    assert all(s["gpu_ns"] is None for s in spool.spans if s not in timed_spans)
    assert len(gpu.events) <= 64
    assert "synchronize" not in gpu.calls


@pytest.mark.real
def test_spans_wait_for_their_gpu_time_across_seals(tmp_path: Path) -> None:
    """A span whose events are not complete at a seal is held for a later batch, then written
    with its GPU time; nothing is lost or written twice."""
    gpu = FakeGpu()
    gpu.done_until = 0
    runtime = stepwatch.init(out=tmp_path, handle_signals=False, capture_oom=False, interval=0.02,
                             spool_interval=0.05)
    runtime.training.gpu_timer = GpuTimer(gpu.make_event, capacity=256, max_wait_s=60)
    _train()
    spool_dir = tmp_path / "spool"

    def sealed() -> list[dict[str, Any]]:
        return read_spool(tmp_path).spans if list(spool_dir.glob("*.json")) else []

    deadline = time.monotonic() + 10
    while sum(s["name"] == "step" for s in sealed()) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    early = sealed()
    assert sum(s["name"] == "step" for s in early) == 4 and sum(s["name"] == "data_load" for s in early) == 4
    assert not [s for s in early if s["name"] in ("forward", "backward", "optimizer_step")]  # held back

    gpu.done_until = float("inf")  # the device catches up
    stepwatch.shutdown()
    spool = read_spool(tmp_path)
    raw = [s["id"] for p in sorted(spool_dir.glob("*.json")) for s in json.loads(p.read_text())["spans"]]
    assert len(raw) == len(set(raw)) == len(spool.spans)
    timed_spans = [s for s in spool.spans if s["name"] in ("forward", "backward", "optimizer_step")]
    assert len(timed_spans) == 12
    assert all(s["gpu_ns"] == 1_500_000 for s in timed_spans)


@pytest.mark.real
def test_shutdown_waits_briefly_for_the_last_gpu_times(tmp_path: Path) -> None:
    """The device runs behind the host: at shutdown the last steps' events are polled (never
    synchronized) for a moment, so the end of a run keeps its GPU time."""
    gpu = FakeGpu()
    gpu.done_until = 0
    runtime = stepwatch.init(out=tmp_path, handle_signals=False, capture_oom=False)
    runtime.training.gpu_timer = timer = GpuTimer(gpu.make_event, capacity=64, max_wait_s=60)
    _train()
    catch_up = threading.Timer(0.1, lambda: setattr(gpu, "done_until", float("inf")))
    catch_up.start()
    stepwatch.shutdown()
    catch_up.join()
    timed_spans = [s for s in read_spool(tmp_path).spans if s["name"] in ("forward", "backward", "optimizer_step")]
    assert len(timed_spans) == 12 and all(s["gpu_ns"] == 1_500_000 for s in timed_spans)
    assert timer.unresolved_dropped == 0 and "synchronize" not in gpu.calls


@pytest.mark.real
def test_gpu_times_still_pending_at_shutdown_are_counted(tmp_path: Path) -> None:
    gpu = FakeGpu()
    gpu.done_until = 0  # a device that never catches up: shutdown gives up after its wait
    runtime = stepwatch.init(out=tmp_path, handle_signals=False, capture_oom=False)
    runtime.training.gpu_timer = timer = GpuTimer(gpu.make_event, capacity=64, max_wait_s=60)
    _train()
    began = time.monotonic()
    stepwatch.shutdown()
    assert time.monotonic() - began < 1.8  # the wait is bounded (1 s) within the stop's 2 s
    spans = read_spool(tmp_path).spans
    assert all(s["gpu_ns"] is None for s in spans)
    assert timer.unresolved_dropped == 12 and runtime.drops()["gpu_timing_unresolved"] == 12


# -- recording on CUDA ------------------------------------------------------------------------


def _fake_cuda_torch(current: dict[str, Any], recorded: list[Any]) -> Any:
    """The torch internals ``cuda_event_source`` uses, shaped as torch has them."""

    class Stream:
        made: list[tuple[int, int, int]] = []

        def __init__(self, stream_id: int, device_index: int, device_type: int) -> None:
            self.key = (stream_id, device_index, device_type)
            Stream.made.append(self.key)

    C = SimpleNamespace(  # noqa: N806 - stands in for torch._C
        _CudaEventBase=SimpleNamespace(record=lambda event, stream: recorded.append((event, stream.key))),
        _cuda_getDevice=lambda: current["device"],
        _cuda_getCurrentStream=lambda device: (current["stream"], device, 1),
    )
    return SimpleNamespace(_C=C, cuda=SimpleNamespace(Stream=Stream, Event=lambda enable_timing: object()))


def test_cuda_events_are_recorded_on_the_current_stream_of_the_current_device() -> None:
    current = {"device": 0, "stream": 7}
    recorded: list[Any] = []
    fake = _fake_cuda_torch(current, recorded)
    make_event, record = cuda_event_source(fake)
    event = make_event()
    record(event)
    record(event)
    current["stream"] = 9  # the program made another stream current (torch.cuda.stream(s))
    record(event)
    current["device"] = 1
    record(event)
    assert recorded == [(event, (7, 0, 1)), (event, (7, 0, 1)), (event, (9, 0, 1)), (event, (9, 1, 1))]
    assert fake.cuda.Stream.made == [(7, 0, 1), (9, 0, 1), (9, 1, 1)]  # one Stream object per stream


def test_cuda_event_source_without_torch_internals_uses_the_public_record() -> None:
    gpu = FakeGpu()
    fake = SimpleNamespace(cuda=SimpleNamespace(Event=lambda enable_timing: gpu.make_event()))
    make_event, record = cuda_event_source(fake)
    event = make_event()
    record(event)
    assert event.records == 1
