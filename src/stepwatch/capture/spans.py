"""Spans and marks (spool-format-v1.md): the training timeline the spool records.

The calling thread keeps a per-thread stack of open spans and, on close, appends one tuple to
a bounded table; the background thread turns tuples into spool records. Ids are 32 lowercase
hex: a random 64-bit process prefix plus a counter, so making one costs no syscall.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from typing import Any, NamedTuple

import msgspec

from .tables import BoundedTable

__all__ = ["ClosedSpan", "MarkRow", "OpenSpan", "SpanRecorder", "cut_utf8", "mark_value"]

MAX_DEPTH = 64
MAX_STRING_BYTES = 256
ROOT_SENTINEL = "root"  # legacy span id of marks made before init / after shutdown
SESSION_SPAN = "stepwatch.session"


def cut_utf8(text: str, limit: int = MAX_STRING_BYTES) -> str:
    """``text`` cut to ``limit`` UTF-8 bytes, never splitting a code point."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (os.fsdecode of bad bytes): not encodable, replace them
        text = text.encode("utf-8", errors="replace").decode("utf-8")
        raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", errors="ignore")


def mark_value(value: Any) -> tuple[str, Any, str | None]:
    """(value_type, JSON value, value_nonfinite) of a mark value; non-finite floats become null
    plus ``value_nonfinite`` ("nan", "inf", "-inf") as the real SDK writes them."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # torch / numpy scalars
    if isinstance(value, bool):
        return "bool", value, None
    if isinstance(value, int):
        return "int", value, None
    if isinstance(value, float):
        if math.isfinite(value):
            return "float", value, None
        return "float", None, "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return "string", cut_utf8(value if isinstance(value, str) else str(value)), None


class OpenSpan(msgspec.Struct, gc=False):
    """A span being timed. ``phase_ns`` accumulates child phase times when this is a step.

    A C-level Struct kept out of the garbage collector: spans are made several times a step and
    live until the next spool seal, and tracking them made collections part of every step's
    cost (bench/bench_training_overhead.py). The one cycle (``gpu`` -> pending timing -> span)
    is broken when the timing resolves or is dropped.
    """

    id: int
    name: str
    parent_id: int | None
    index: int | None
    start_ns: int
    attrs: dict[str, Any] | None
    thread_id: int
    mark_ids: list[int] | None = None  # made on the first mark: most spans have none
    gpu: Any = None  # a pending GPU timing (start, end events) when CUDA timed it
    phase_ns: dict[str, int] | None = None
    closed: bool = False


class ClosedSpan(NamedTuple):
    span: OpenSpan
    end_ns: int


class MarkRow(NamedTuple):
    id: str
    span_id: str
    name: str
    value_type: str
    value: Any
    nonfinite: str | None
    attrs: dict[str, Any] | None
    ts_ns: int
    kind: str


class SpanRecorder:
    """Per-runtime span state. Thread-safe for many producer threads; one consumer."""

    def __init__(self, *, rank: int, rows: int, max_depth: int = MAX_DEPTH) -> None:
        self.rank = rank
        self.pid = os.getpid()
        self.max_depth = max_depth
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count(1)
        self._local = threading.local()
        self._stacks: dict[int, list[OpenSpan]] = {}  # thread id -> its stack, to close leftovers
        self._orphans: list[list[OpenSpan]] = []  # stacks of exited threads whose ident was reused
        self.closed: BoundedTable[ClosedSpan] = BoundedTable("spans", rows)
        self.marks: BoundedTable[MarkRow] = BoundedTable("marks", rows)
        self.depth_dropped = 0
        self.session = self.open(SESSION_SPAN, parent_id=None, root=True)

    def new_id(self) -> int:
        """A span or mark id: a plain counter on the hot path, formatted by ``format_id`` later."""
        return next(self._counter)

    def format_id(self, value: int | str | None) -> str | None:
        """The 32-hex id of a counter (strings such as the legacy ``"root"`` pass unchanged)."""
        return f"{self._prefix}{value:016x}" if type(value) is int else value  # type: ignore[return-value]

    def _stack(self) -> list[OpenSpan]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
            ident = threading.get_ident()
            left = self._stacks.get(ident)
            if left:  # a finished thread's ident, reused: keep what it left open for close_all
                self._orphans.append(left)
            self._stacks[ident] = stack
        return stack

    def current(self) -> OpenSpan:
        """Innermost open span of this thread, else the session span."""
        stack = self._stack()
        return stack[-1] if stack else self.session

    def open(self, name: str, *, index: int | None = None, attrs: dict[str, Any] | None = None,
             parent_id: str | None | bool = False, root: bool = False, start_ns: int | None = None) -> OpenSpan | None:
        """Opens a span under the innermost open one (or ``parent_id`` when given; ``root``: none).

        Returns None (and counts a drop) past the depth cap.
        """
        stack = self._stack() if not root else None
        if stack is not None and len(stack) >= self.max_depth:
            self.depth_dropped += 1
            return None
        if parent_id is False:
            parent_id = stack[-1].id if stack else (None if root else self.session.id)
        span = OpenSpan(self.new_id(), name, parent_id, index, start_ns or time.time_ns(), attrs,  # type: ignore[arg-type]
                        threading.get_ident())
        if stack is not None:
            stack.append(span)
        return span

    def close(self, span: OpenSpan | None, end_ns: int | None = None) -> None:
        if span is None or span.closed:
            return
        span.closed = True
        end_ns = end_ns or time.time_ns()
        stack = self._stack()
        if stack and stack[-1] is span:
            stack.pop()
        elif span in stack:
            # children left open (an exception skipped their close hook): they end with the parent
            while stack[-1] is not span:
                child = stack.pop()
                child.closed = True
                child.attrs = {**(child.attrs or {}), "unclosed": True}
                self.closed.append(ClosedSpan(child, end_ns))
            stack.pop()
        self.closed.append(ClosedSpan(span, end_ns))

    def mark(self, name: str, value: Any, kind: str, attrs: dict[str, Any] | None) -> str:
        return self.mark_on(self.current(), name, value, kind, attrs)

    def mark_on(self, span: OpenSpan, name: str, value: Any, kind: str, attrs: dict[str, Any] | None) -> str:
        value_type, json_value, nonfinite = mark_value(value)
        mark_id = self.new_id()
        if span.mark_ids is None:
            span.mark_ids = [mark_id]
        else:
            span.mark_ids.append(mark_id)
        self.marks.append(MarkRow(mark_id, span.id, cut_utf8(str(name)), value_type, json_value, nonfinite,
                                  attrs or None, time.time_ns(), kind))
        return mark_id

    def close_all(self) -> int:
        """At shutdown: closes spans left open on any thread (flagged), then the session."""
        now = time.time_ns()
        left = 0
        for stack in [*self._orphans, *self._stacks.values()]:
            while stack:
                span = stack.pop()
                if span.closed:  # closed from another thread: already recorded once
                    continue
                span.attrs = {**(span.attrs or {}), "unclosed": True}
                span.closed = True
                self.closed.append(ClosedSpan(span, now))
                left += 1
        self.session.closed = True
        self.closed.append(ClosedSpan(self.session, now))
        return left
