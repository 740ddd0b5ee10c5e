"""The Trace Event Format's events, built from plain values: what ui.perfetto.dev and
``chrome://tracing`` open. Pure code: the history is read in ``perfetto.py``.

The rules kept (the format's own, and what its viewers need to draw a track right):

- ``ts`` and ``dur`` are integer microseconds from the trace's origin. Both ends of a span are
  floored to the microsecond (``dur`` is the floored end minus the floored start), so a span
  that nests inside another in nanoseconds nests in microseconds too, and an integer is read
  exactly by every viewer (a fractional ``ts`` is turned into nanoseconds by a float product,
  which can move an end past its parent's by one).
- Complete events (``"ph": "X"``) on one thread track must nest: each starts after, or ends
  before or with, the ones still open there. Spans of one thread that overlap without nesting
  (two scopes closed out of order, say) cannot be drawn on one track, so ``Lanes`` gives each
  such span the first lane of its thread where it nests; a lane past the first is a track of
  its own (``thread ... (overlap 2)``).
- Process and thread names are metadata events (``"ph": "M"``: ``process_name``,
  ``process_sort_index``, ``thread_name``, ``thread_sort_index``), counters ``"ph": "C"`` with
  numeric ``args`` (one series per event here, so viewers draw each on its own track rather
  than stacked), instants ``"ph": "i"`` with a scope ``s`` of ``g`` (global), ``p`` (process)
  or ``t`` (thread).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["Lanes", "complete", "counter", "instant", "process_metadata", "thread_metadata", "to_us"]


def to_us(ns: int, origin_ns: int) -> int:
    """Integer microseconds from ``origin_ns``, floored (so the order of times is kept)."""
    return (ns - origin_ns) // 1000


def complete(name: str, cat: str, pid: int, tid: int, start_ns: int, end_ns: int, origin_ns: int,
             args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A complete event for [start_ns, end_ns] (an end before the start is taken as the start)."""
    ts = (start_ns - origin_ns) // 1000  # to_us, inline: once per span
    dur = (end_ns - origin_ns) // 1000 - ts
    event: dict[str, Any] = {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts,
                             "dur": dur if dur > 0 else 0}
    if args:
        event["args"] = args
    return event


def instant(name: str, cat: str, pid: int, tid: int, ts_ns: int, origin_ns: int, scope: str,
            args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An instant event of scope ``g``, ``p`` or ``t``."""
    if scope not in ("g", "p", "t"):
        raise ValueError(f"instant event scope {scope!r}: must be g, p or t")
    event: dict[str, Any] = {"ph": "i", "name": name, "cat": cat, "pid": pid, "tid": tid,
                             "ts": to_us(ts_ns, origin_ns), "s": scope}
    if args:
        event["args"] = args
    return event


def counter(name: str, pid: int, ts_ns: int, origin_ns: int, series: str, value: int | float) -> dict[str, Any]:
    """One value of the counter track ``name`` of process ``pid``."""
    return {"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": to_us(ts_ns, origin_ns), "args": {series: value}}


def process_metadata(pid: int, name: str, sort_index: int) -> list[dict[str, Any]]:
    """The process track's name and its place among the processes."""
    return [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort_index}}]


def thread_metadata(pid: int, tid: int, name: str, sort_index: int) -> list[dict[str, Any]]:
    """The thread track's name and its place among the process's threads."""
    return [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}},
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": sort_index}}]


class Lanes:
    """Places intervals, given in order of start (and, for equal starts, longest first), on the
    first lane where each nests: every lane is a stack of the ends still open on it. Memory is
    the nesting depth times the lanes, whatever the number of intervals.

    Example::

        lanes = Lanes()
        lanes.place(0, 10), lanes.place(2, 5), lanes.place(4, 12)  # -> 0, 0, 1
    """

    __slots__ = ("_open", "_last")

    def __init__(self) -> None:
        self._open: list[list[int]] = []
        self._last: tuple[int, int] | None = None

    def place(self, start: int, end: int) -> int:
        """The lane of [start, end]; ValueError when called out of order."""
        if end < start:
            end = start
        last = self._last
        if last is not None and (start < last[0] or (start == last[0] and end > last[1])):
            raise ValueError(f"interval {start}..{end} placed after {last[0]}..{last[1]}: "
                             "intervals must come by start, then longest first")
        self._last = (start, end)
        lane = 0
        for stack in self._open:
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                return lane
            lane += 1
        self._open.append([end])
        return lane

    @property
    def count(self) -> int:
        """How many lanes were opened."""
        return len(self._open)
