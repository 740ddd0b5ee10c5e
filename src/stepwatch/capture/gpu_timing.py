"""GPU time of a span from a pair of CUDA events, resolved later with ``query()``.

Never ``synchronize()``: reading a timing must not stall the stream being measured. Events
come from a capped pool. The background thread resolves finished pairs at each tick; a training
thread that finds the pool empty first resolves what has finished itself (at a few hundred steps
a second the pool would otherwise run dry between ticks), and only when the device is that far
behind does the span get no GPU time (counted). An event pair still unresolved after
``max_wait_s`` is given up (counted).

An event belongs to the device it was first recorded on. A program that changes its current
device between phases makes a pooled event fail to record there, or a pair span two devices:
the event is discarded (the pool makes a new one, which binds to the new device) and the pair
given up, counted as ``record_failed``; neither the span nor the program sees an error.

The event source is a parameter, so the path is tested on CPU with fake events.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["GpuTimer", "PendingTiming", "cuda_event_source"]


class PendingTiming:
    __slots__ = ("start", "end", "span", "recorded_at")

    def __init__(self, start: Any, span: Any) -> None:
        self.start = start
        self.end: Any = None
        self.span = span
        self.recorded_at = time.monotonic()


class GpuTimer:
    """A capped pool of timing events.

    Example::

        timer = GpuTimer(lambda: torch.cuda.Event(enable_timing=True), capacity=256)
        pending = timer.begin(span)      # records a start event on the current stream
        ...
        timer.end(pending)               # records the end event
        timer.resolve()                  # background thread: fills span.gpu_ns when ready
    """

    def __init__(self, make_event: Callable[[], Any], *, capacity: int = 512, max_wait_s: float = 5.0,
                 record: Callable[[Any], None] | None = None) -> None:
        """``record(event)`` records an event on the current stream (default: ``event.record()``)."""
        self._make_event = make_event
        self._record = record or _record
        self.capacity = capacity
        self.max_wait_s = max_wait_s
        self._free: deque[Any] = deque()
        self._created = 0
        self._pending: deque[PendingTiming] = deque()
        self.pool_exhausted = 0
        self.unresolved_dropped = 0
        self.record_failed = 0
        self.resolved = 0
        self._resolving = threading.Lock()

    def _take(self) -> Any | None:
        try:
            return self._free.pop()
        except IndexError:
            if self._created < self.capacity:
                self._created += 1
                return self._make_event()
        if self.resolve():  # the device has finished some pairs since the last tick: reuse them
            try:
                return self._free.pop()
            except IndexError:
                pass
        self.pool_exhausted += 1
        return None

    def begin(self, span: Any) -> PendingTiming | None:
        start = self._take()
        if start is None or not self._recorded(start):
            return None
        return PendingTiming(start, span)

    def end(self, pending: PendingTiming | None) -> None:
        if pending is None:
            return
        end = self._take()
        if end is None or not self._recorded(end):
            self._free.append(pending.start)
            pending.span.gpu = None
            return
        pending.end = end
        self._pending.append(pending)

    def _recorded(self, event: Any) -> bool:
        try:
            self._record(event)
        except Exception:  # noqa: BLE001 - an event of another device: dropped, a new one is made
            self._created -= 1
            self.record_failed += 1
            return False
        return True

    def outstanding(self, span: Any) -> bool:
        # From the span, not by scanning ``_pending``: the training thread appends to it while
        # the spool thread asks, and iterating a deque being appended to raises RuntimeError.
        pending = span.gpu
        return isinstance(pending, PendingTiming) and pending.end is not None and pending.span is span

    def resolve(self) -> int:
        """Fills ``span.gpu_ns`` of every finished pair, oldest first; returns how many.

        One thread at a time (the training thread and the background one both call it); a caller
        that finds it busy returns at once rather than wait.
        """
        if not self._resolving.acquire(blocking=False):
            return 0
        try:
            return self._resolve_locked()
        finally:
            self._resolving.release()

    def _resolve_locked(self) -> int:
        done = 0
        now = time.monotonic()
        while self._pending:
            pending = self._pending[0]
            if not pending.end.query():
                if now - pending.recorded_at > self.max_wait_s:
                    self._give_up(self._pending.popleft())
                    continue
                break  # events complete in stream order: later ones are not done either
            self._pending.popleft()
            try:
                gpu_ns = int(pending.start.elapsed_time(pending.end) * 1_000_000)
            except Exception:  # noqa: BLE001 - a pair across two devices has no elapsed time
                self.record_failed += 1
                self._give_up(pending, counted=False)
                continue
            pending.span.gpu = gpu_ns
            self._free.extend((pending.start, pending.end))
            done += 1
        self.resolved += done
        return done

    def settle(self, timeout_s: float) -> int:
        """At shutdown: gives the last pairs up to ``timeout_s`` to complete, polling ``query()``
        (the device is usually a few ms behind the host); what is still pending is given up and
        counted. Returns how many were given up."""
        deadline = time.monotonic() + timeout_s
        self.resolve()
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.001)
            self.resolve()
        with self._resolving:
            given_up = len(self._pending)
            while self._pending:
                self._give_up(self._pending.popleft())
        return given_up

    def _give_up(self, pending: PendingTiming, *, counted: bool = True) -> None:
        self.unresolved_dropped += counted
        self._free.extend((pending.start, pending.end))
        pending.span.gpu = None


def _record(event: Any) -> None:
    event.record()


def cuda_event_source(torch: Any) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """``make_event`` and ``record`` for a ``GpuTimer`` on CUDA.

    ``torch.cuda.Event.record()`` builds a ``Stream`` object for the current stream at every
    call, inside a device context switch: 8.2-9.5 µs a call on an H100 host, ten calls a step.
    Recording with the current stream's ``Stream`` kept per (stream, device) took 4.7 µs there,
    about half of it the driver's own cudaEventRecord (CHANGELOG.md). Where torch lacks the
    internals this needs, the public call is used.
    """
    cuda = torch.cuda

    def make_event() -> Any:
        return cuda.Event(enable_timing=True)

    try:
        C = torch._C
        raw_record = C._CudaEventBase.record
        current_device = C._cuda_getDevice
        current_stream = C._cuda_getCurrentStream
    except AttributeError:
        return make_event, _record
    streams: dict[Any, Any] = {}

    def record(event: Any) -> None:
        key = current_stream(current_device())  # (stream id, device index, device type)
        stream = streams.get(key)
        if stream is None:
            if len(streams) >= 64:  # a program that makes streams on the fly: stay bounded
                streams.clear()
            stream = streams[key] = cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        raw_record(event, stream)

    return make_event, record
