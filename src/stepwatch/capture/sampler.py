"""The runtime's background thread: when it wakes, how it gives way to ``stop``, and what it does
when ``stop`` could not wait for it.

It wakes each period (sooner while a table holds a backlog) and runs the runtime's tick under
``lock``; the final drain in ``stop`` holds the same lock, so the last records are never written
by two threads at once and no file is closed under a tick still appending. A stop that cannot get
the lock before its deadline (a tick stuck in a write that blocks) is handed to this thread, which
runs it once that tick returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..guard import guarded

__all__ = ["Sampler"]


class Sampler:
    """Runs ``tick`` every ``period`` seconds (``backlog_wait`` while ``backlog`` is set) on its own
    daemon thread until ``stop``; ``finish(handoff)`` runs a stop handed to it."""

    def __init__(self, *, period: float, backlog_wait: float, tick: Callable[[], None],
                 finish: Callable[[Any], None]) -> None:
        self.period = period
        self.backlog_wait = min(period, backlog_wait)
        self.backlog = False  # set by the tick: a table is a quarter full, look again soon
        self._tick = tick
        self._finish = finish
        self.lock = threading.RLock()  # held for each tick and for stop's final drain
        self.stopping = threading.Event()
        self._handoff_lock = threading.Lock()  # orders a handed-off stop against the loop's end
        self._handoff: Any = None
        self._loop_done = False
        self.thread = threading.Thread(target=self._loop, name="stepwatch-sampler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        wait = 0.0  # the first tick at once: the rank is known (to the aggregator, to its files) from its start
        while not self.stopping.wait(wait):
            wait = self.backlog_wait if self.backlog else self.period
            with self.lock:
                if self.stopping.is_set():
                    break
                with guarded:
                    self._tick()
        with self._handoff_lock:
            self._loop_done = True
            handoff = self._handoff
        if handoff is not None:  # stop gave up waiting for this thread: finish its work here
            with self.lock, guarded:
                self._finish(handoff)

    def stop(self, deadline: float, handoff: Any, *, now: Callable[[], float]) -> bool:
        """Stops the loop and takes ``lock`` before ``deadline`` (monotonic): True, the caller holds
        it and releases it. False: the thread is stuck in a tick past the deadline, and will run
        ``finish(handoff)`` itself once that tick returns."""
        self.stopping.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(max(0.0, deadline - now()))
        # The tick gives way between chunks, so this wait is short unless a write blocks.
        if self.lock.acquire(timeout=max(0.01, deadline - now())):
            return True
        with self._handoff_lock:
            if not self._loop_done:
                self._handoff = handoff
                return False
        self.lock.acquire()  # the thread has left its loop: the lock is free now
        return True
