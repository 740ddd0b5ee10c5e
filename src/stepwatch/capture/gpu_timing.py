"""GPU time of a span from a pair of CUDA events, resolved later with ``query()``.

Never ``synchronize()``: reading a timing must not stall the stream being measured. Events
come from a capped pool; when the pool is empty the span gets no GPU time (counted), and an
event pair still unresolved after ``max_wait_s`` is given up (counted). The event source is a
parameter so the path is tested on CPU with fake events.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["GpuTimer", "PendingTiming"]


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

    def __init__(self, make_event: Callable[[], Any], *, capacity: int = 512, max_wait_s: float = 5.0) -> None:
        self._make_event = make_event
        self.capacity = capacity
        self.max_wait_s = max_wait_s
        self._free: deque[Any] = deque()
        self._created = 0
        self._pending: deque[PendingTiming] = deque()
        self.pool_exhausted = 0
        self.unresolved_dropped = 0
        self.resolved = 0

    def _take(self) -> Any | None:
        try:
            return self._free.pop()
        except IndexError:
            if self._created >= self.capacity:
                self.pool_exhausted += 1
                return None
            self._created += 1
            return self._make_event()

    def begin(self, span: Any) -> PendingTiming | None:
        start = self._take()
        if start is None:
            return None
        start.record()
        return PendingTiming(start, span)

    def end(self, pending: PendingTiming | None) -> None:
        if pending is None:
            return
        end = self._take()
        if end is None:
            self._free.append(pending.start)
            return
        end.record()
        pending.end = end
        self._pending.append(pending)

    def outstanding(self, span: Any) -> bool:
        # From the span, not by scanning ``_pending``: the training thread appends to it while
        # the spool thread asks, and iterating a deque being appended to raises RuntimeError.
        pending = span.gpu
        return isinstance(pending, PendingTiming) and pending.end is not None and pending.span is span

    def resolve(self) -> int:
        """Fills ``span.gpu_ns`` of every finished pair, oldest first; returns how many."""
        done = 0
        now = time.monotonic()
        while self._pending:
            pending = self._pending[0]
            if not pending.end.query():
                if now - pending.recorded_at > self.max_wait_s:
                    self._pending.popleft()
                    self.unresolved_dropped += 1
                    self._free.extend((pending.start, pending.end))
                    pending.span.gpu = None
                    continue
                break  # events complete in stream order: later ones are not done either
            self._pending.popleft()
            pending.span.gpu = int(pending.start.elapsed_time(pending.end) * 1_000_000)
            self._free.extend((pending.start, pending.end))
            done += 1
        self.resolved += done
        return done
