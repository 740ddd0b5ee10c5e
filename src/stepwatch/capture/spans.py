"""Spans and marks (spool-format-v1.md): the training timeline the spool records.

The calling thread keeps a per-thread stack of open spans and, on close, appends the span
itself to a bounded table; the background thread turns closed spans into spool records
(``span_records``), formatting ids, building a step's phase breakdown and cleaning attrs there,
never on the training thread. Ids are 32 lowercase hex: a random 64-bit process prefix plus a
counter, so making one costs no syscall.
"""

from __future__ import annotations

import contextvars
import itertools
import math
import os
import sys
import threading
import time
from array import array
from collections.abc import Callable
from itertools import repeat
from operator import sub
from typing import Any

import msgspec

from ..artifacts.heartbeat import json_safe
from ..artifacts.spool import valid_text
from ..phases import PHASES as PHASES_TABLE
from ..phases import RESIDUAL, SPAN_NAMES
from .tables import BoundedTable

__all__ = ["InferredColumns", "MarkRow", "MarkWireRow", "OneId", "OpenSpan", "SpanRecorder", "SpanWireRow", "SpoolMark", "SpoolSpan", "clean_attrs",
           "cut_utf8", "json_text", "mark_value", "step_attrs"]

MAX_DEPTH = 64
MAX_STRING_BYTES = 256
ROOT_SENTINEL = "root"  # legacy span id of marks made before init / after shutdown
SESSION_SPAN = "stepwatch.session"
PHASES = SPAN_NAMES  # the phase names (stepwatch.phases), as spans and as keys of a step's phase times
_NO_TIMES = dict.fromkeys(PHASES, 0)
# The attrs of every record of a span opened with none: one dict, shared (records are encoded,
# never changed), so that such a record allocates nothing the cyclic GC counts: the sampler's
# allocations set off collections of the whole process, and it pays for them.
_NO_ATTRS: dict[str, Any] = {}


def _breakdown_function() -> Any:
    """``breakdown(attrs, times, step_ns)``: a step's attrs followed by its ``step_ns``,
    ``<phase>_ns`` and residual, as one dict, written out from the phase table once at import,
    so that closing a step costs what the dict spelled out by hand did (a loop over the table
    took about twice as long per step, and a second dict merged into the first one more)."""
    phases = ", ".join(f"{p.attr!r}: times[{p.span!r}]" for p in PHASES_TABLE)
    spent = " - ".join(f"times[{p.span!r}]" for p in PHASES_TABLE if p.in_residual)
    # the residual's floor at 0 as a conditional, not max(): max allocates an iterator, which
    # counts towards the cyclic GC's next collection
    source = (f"def breakdown(attrs, times, step_ns):\n"
              f"    return {{**attrs, 'step_ns': step_ns, {phases}, "
              f"{RESIDUAL.attr!r}: wait if (wait := step_ns - {spent}) > 0 else 0}}\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, "<stepwatch.phases breakdown>", "exec"), namespace)
    return namespace["breakdown"]


_breakdown = _breakdown_function()


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
    if type(value) is float and value - value == 0.0:  # a finite float (a loss read on the host): at once
        return "float", value, None
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


_PLAIN_TYPES = frozenset({int, str, bool, type(None)})


def clean_attrs(attrs: dict[str, Any] | None) -> dict[str, Any]:
    """Attrs of plain values pass as they are (the usual case, once per span); others are cleaned."""
    if not attrs:
        return {}
    for value in attrs.values():
        if type(value) not in _PLAIN_TYPES:
            return json_safe(attrs, finite=True)  # type: ignore[no-any-return]
    return attrs


class OpenSpan(msgspec.Struct, gc=False):
    """A span being timed, and once closed (``end_ns`` set) the row the background thread turns
    into a spool record. ``phase_ns`` accumulates child phase times when this is a step.

    A C-level Struct kept out of the garbage collector: spans are made several times a step and
    live until the next spool seal, and tracking them made collections part of every step's
    cost (bench/bench_training_overhead.py). The one cycle (``gpu`` -> pending timing -> span)
    is broken when the timing resolves or is dropped.
    """

    id: int
    name: str
    parent_id: int | str | None
    index: int | None
    start_ns: int
    attrs: dict[str, Any] | None
    thread_id: int
    mark_ids: list[int] | None = None  # made on the first mark: most spans have none
    gpu: Any = None  # a pending GPU timing (start, end events) when CUDA timed it; then its ns
    phase_ns: dict[str, int] | None = None  # a step's phase breakdown; its attrs are built at seal
    closed: bool = False
    end_ns: int = 0


class MarkRow(msgspec.Struct, gc=False):
    """A mark as the training thread (or the sampler, for an inferred value) records it; the
    background thread turns it into a ``SpoolMark``. An untracked Struct: made in C, and
    nothing for the cyclic GC to count or scan while it waits for the seal."""

    id: int | str
    span_id: int | str
    name: str
    value_type: str
    value: Any
    nonfinite: str | None
    attrs: dict[str, Any] | None
    ts_ns: int
    kind: str


class SpoolSpan(msgspec.Struct, gc=False):
    """One ``spans[]`` record of a spool batch (spool-format-v1.md), in the spec's field order.

    Encoded by msgspec straight from the Struct: no dict per span, and nothing for the cyclic
    GC to track while thousands of them wait for the next seal."""

    id: str
    name: str
    parent_id: str | None
    index: int | None
    start_ns: int
    end_ns: int
    cpu_ns: None
    gpu_ns: int | None
    memory_peak_bytes: None
    thread_id: int
    pid: int
    rank: int
    attrs: dict[str, Any]
    mark_ids: list[str] | tuple[()] | OneId


class SpoolMark(msgspec.Struct, gc=False, omit_defaults=True):
    """One ``marks[]`` record; ``value_nonfinite`` is written only for nan/inf values."""

    id: str
    span_id: str
    name: str
    value_type: str
    value: Any
    attrs: dict[str, Any]
    ts_ns: int
    kind: str
    value_nonfinite: str | None = None


class OneId(msgspec.Struct, array_like=True, gc=False):
    """A ``mark_ids`` of one id (a step's loss): encoded as the one-element array a list would
    be, and, unlike a list, nothing the cyclic GC counts towards its next collection (which the
    sampler's allocations set off for the whole process, and pay for)."""

    id: str


class SpanWireRow(msgspec.Struct, array_like=True, gc=False):
    """A span's row of the aggregator's columnar ``spans`` table (``transport.frames.COLUMNAR``:
    the store's column order, attrs as JSON text): encoded as the array a tuple of these values
    would be, and made in C, untracked."""

    id: str
    parent_id: str | None
    name: str
    index: int | None
    start_ns: int
    end_ns: int
    gpu_ns: int | None
    thread_id: int
    pid: int
    attrs: str


class MarkWireRow(msgspec.Struct, array_like=True, gc=False):
    """A mark's row of the columnar ``marks`` table (``transport.frames.COLUMNAR``)."""

    id: str
    span_id: str
    name: str
    value_type: str
    value: Any
    value_nonfinite: str | None
    ts_ns: int
    kind: str
    attrs: str


class SpanTable(BoundedTable[OpenSpan]):
    """The closed-span table: a ``BoundedTable`` whose append the training thread makes inline.

    ``push(span)`` (the deque's own append) and ``tally()`` (an ``itertools.count``'s
    ``__next__``) are two C calls and no Python frame. ``appended`` reads the count without
    advancing it.
    """

    __slots__ = ("push", "tally", "_count")

    def __init__(self, name: str, maxlen: int) -> None:
        super().__init__(name, maxlen)
        self.push = self._rows.append
        self._count = itertools.count()
        self.tally = self._count.__next__

    def append(self, row: OpenSpan) -> None:
        self.push(row)
        self.tally()

    @property  # type: ignore[override]
    def appended(self) -> int:
        """Rows ever appended (approximate under races, as ``BoundedTable.appended``): the next
        value of the tally, read from its repr (``count(N)``), which does not advance it."""
        return int(repr(self._count)[6:-1])

    @appended.setter
    def appended(self, value: int) -> None:  # BoundedTable.__init__ sets 0; the tally holds it
        if value:
            raise AttributeError("SpanTable.appended is counted by its tally")


def step_attrs(span: OpenSpan, end_ns: int) -> dict[str, Any]:
    """A step's attrs with its breakdown: ``step_ns``, ``<phase>_ns`` and ``wait_ns``, the
    residual (aggregator-architecture.md), after the attrs it was opened with (cleaned)."""
    attrs = span.attrs
    return _breakdown(clean_attrs(attrs) if attrs else _NO_ATTRS, span.phase_ns or _NO_TIMES, end_ns - span.start_ns)


def _step_breakdowns() -> Any:
    """``step_record_attrs(span)``: a closed step's attrs as its spool record carries them,
    written out from the phase table once at import. A step opened with no attrs, or with the
    inferred step's ``{"implicit": true}`` alone, gets a Struct whose fields are those keys in
    that order: msgspec encodes it to the very bytes the dict would be, and making it costs about
    a third of building the dict. Other attrs take ``step_attrs``."""
    fields = [("step_ns", int), *((p.attr, int) for p in PHASES_TABLE), (RESIDUAL.attr, int)]
    namespace: dict[str, Any] = {
        "Plain": msgspec.defstruct("StepBreakdown", fields, gc=False, module=__name__),
        "Implicit": msgspec.defstruct("ImplicitStepBreakdown", [("implicit", bool), *fields], gc=False,
                                      module=__name__),
        "NO_TIMES": _NO_TIMES, "step_attrs": step_attrs,
    }
    values = ", ".join(f"times[{p.span!r}]" for p in PHASES_TABLE)
    spent = " - ".join(f"times[{p.span!r}]" for p in PHASES_TABLE if p.in_residual)
    source = (f"def step_record_attrs(span):\n"
              f"    times = span.phase_ns or NO_TIMES\n"
              f"    step_ns = span.end_ns - span.start_ns\n"
              f"    wait = step_ns - {spent}\n"
              f"    attrs = span.attrs\n"
              f"    if not attrs:\n"
              f"        return Plain(step_ns, {values}, wait if wait > 0 else 0)\n"
              f"    if len(attrs) == 1 and attrs.get('implicit') is True:\n"
              f"        return Implicit(True, step_ns, {values}, wait if wait > 0 else 0)\n"
              f"    return step_attrs(span, span.end_ns)\n")
    exec(compile(source, "<stepwatch.phases step_record_attrs>", "exec"), namespace)
    return namespace["step_record_attrs"]


step_record_attrs = _step_breakdowns()


class SpanRecorder:
    """Per-runtime span state. Thread-safe for many producer threads; one consumer.

    ``new_id`` is the counter's C-level ``__next__``; the hot paths of ``TrainingState`` use it
    and the thread's stack (``thread_stack``, or a request's, ``context_stack``) directly, so a
    phase costs no call into here.
    """

    def __init__(self, *, rank: int, rows: int, max_depth: int = MAX_DEPTH) -> None:
        self.rank = rank
        self.pid = os.getpid()
        self.max_depth = max_depth
        self._prefix = os.urandom(8).hex()
        self._base = int(self._prefix, 16) << 64  # an id is base | counter, written as 32 hex digits
        self._pair = array("Q", [int(self._prefix, 16), 0])  # (prefix, counter) words: _id_range
        self._ids: tuple[int, int, list[str]] | None = None  # the run of hex ids span_records wrote, for mark_records
        self._far: dict[int, str] = {}  # hex of ids outside a batch's run (_outside)
        self._counter = itertools.count(1)
        self.new_id = self._counter.__next__  # a plain counter on the hot path, formatted by ``format_id`` later
        self._local = threading.local()
        # The open-span stack of an ``@inference`` request (async and streaming calls interleave
        # on one thread): set for the request's context only; elsewhere it is None and the
        # thread's own stack applies. One C-level ``get`` on the hot path.
        self._context: contextvars.ContextVar[list[OpenSpan] | None] = contextvars.ContextVar(
            "stepwatch_span_stack", default=None)
        self.context_stack = self._context.get
        self._stacks: dict[int, list[OpenSpan]] = {}  # thread id -> its stack, to close leftovers
        self._orphans: list[list[OpenSpan]] = []  # stacks of exited threads whose ident was reused
        self.closed = SpanTable("spans", rows)
        self.marks: BoundedTable[MarkRow] = BoundedTable("marks", rows)
        # Marks the sampler made itself (inferred_metrics.py: the loss of each step), as columns
        # (``InferredColumns``): written by ``mark_records`` with no row per mark in between.
        self.inferred: list[InferredColumns] = []
        # A step's one inferred mark (its loss), by the step's id, until the step is written: kept
        # here rather than in the step's ``mark_ids``, a list made per step (InferredMetrics).
        self.step_marks: dict[int, int] = {}
        self._deferred: list[OpenSpan] = []  # closed spans whose GPU time is not resolved yet
        # Called by the sampler before each drain of the marks: values the patches read late (the
        # loss of a step on the GPU, inferred_metrics.py) become mark rows first.
        self.before_marks: Callable[[], Any] | None = None
        self.depth_dropped = 0
        session = self.open(SESSION_SPAN, parent_id=None, root=True)
        assert session is not None
        self.session = session

    def format_id(self, value: int | str | None) -> str | None:
        """The 32-hex id of a counter (strings such as the legacy ``"root"`` pass unchanged)."""
        if type(value) is int:
            return (self._base | value).to_bytes(16, "big").hex()
        return value  # type: ignore[return-value]

    def thread_stack(self) -> list[OpenSpan]:
        """This thread's stack of open spans (registered for ``close_all`` on first use)."""
        stack: list[OpenSpan] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
            ident = threading.get_ident()
            left = self._stacks.get(ident)
            if left:  # a finished thread's ident, reused: keep what it left open for close_all
                self._orphans.append(left)
            self._stacks[ident] = stack
        return stack

    def stack(self) -> list[OpenSpan]:
        """The open spans of the current context: a request's own stack inside an
        ``@inference`` call (``enter_context``), else this thread's."""
        return self._context.get() or self.thread_stack()

    _stack = stack

    def enter_context(self, span: OpenSpan) -> contextvars.Token[list[OpenSpan] | None]:
        """Makes ``span`` the bottom of the current context's own stack (a request's scope tree)."""
        return self._context.set([span])

    def leave_context(self, token: contextvars.Token[list[OpenSpan] | None]) -> None:
        try:
            self._context.reset(token)
        except ValueError:  # resumed in another context (a stream consumed across tasks)
            self._context.set(token.old_value if token.old_value is not contextvars.Token.MISSING else None)

    def current(self) -> OpenSpan:
        """Innermost open span of this context (request or thread), else the session span."""
        stack = self.stack()
        return stack[-1] if stack else self.session

    def open(self, name: str, *, index: int | None = None, attrs: dict[str, Any] | None = None,
             parent_id: int | str | None | bool = False, root: bool = False,
             start_ns: int | None = None) -> OpenSpan | None:
        """Opens a span under the innermost open one (or ``parent_id`` when given; ``root``: none).

        Returns None (and counts a drop) past the depth cap.
        """
        stack = self.stack() if not root else None
        if stack is not None and len(stack) >= self.max_depth:
            self.depth_dropped += 1
            return None
        if parent_id is False:
            parent_id = stack[-1].id if stack else (None if root else self.session.id)
        span = OpenSpan(self.new_id(), name, parent_id, index, start_ns or time.time_ns(),  # type: ignore[arg-type]
                        attrs, threading.get_ident())
        if stack is not None:
            stack.append(span)
        return span

    def close(self, span: OpenSpan | None, end_ns: int | None = None) -> None:
        if span is None or span.closed:
            return
        span.closed = True
        end_ns = end_ns or time.time_ns()
        stack = self.stack()
        if stack and stack[-1] is span:
            stack.pop()
        elif span in stack:
            # children left open (an exception skipped their close hook): they end with the parent
            while stack[-1] is not span:
                child = stack.pop()
                child.closed = True
                child.attrs = {**(child.attrs or {}), "unclosed": True}
                child.end_ns = end_ns
                self.closed.append(child)
            stack.pop()
        span.end_ns = end_ns
        self.closed.append(span)

    def mark(self, name: str, value: Any, kind: str, attrs: dict[str, Any] | None) -> int:
        return self.mark_on(self.current(), name, value, kind, attrs)

    def mark_on(self, span: OpenSpan, name: str, value: Any, kind: str, attrs: dict[str, Any] | None) -> int:
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
                span.end_ns = now
                self.closed.append(span)
                left += 1
        self.session.closed = True
        self.session.end_ns = now
        self.closed.append(self.session)
        return left

    # -- background thread: closed spans and marks to spool records ------------------------------
    #
    # One pass builds both what the spool writes (``SpoolSpan``, ``SpoolMark``) and, when ``rows``
    # is given, what the aggregator gets (``SpanWireRow``, ``MarkWireRow``: the columnar wire rows).
    # The ids are written as hex once per batch, for the whole run of counter values the batch's
    # spans and marks were made in (``_id_range``: one C pass, no dict), and each record finds its
    # own id, its parent's and its marks' by index into that run. Python runs per record only
    # where one needs it: a step's breakdown, attrs to clean, mark ids, a GPU time still pending.
    # Both kinds of record are untracked Structs: a batch of thousands sets off no collection of
    # the cyclic GC, whose cost the whole process would pay.

    def _id_range(self, lowest: int, records: int) -> tuple[int, int, list[str]]:
        """(lo, top, hexes): ``hexes[i - lo]`` is the 32-hex id of counter value ``i`` for
        ``lo <= i < top``, ``top`` being the next value the counter gives. ``lowest`` is the
        smallest id the batch holds; a run longer than the batch needs (a span opened long ago,
        an epoch, the session) starts later, and the ids below it are formatted one by one
        (``_outside``). One C pass: the (prefix, counter) pairs as big-endian 64-bit words,
        written as hex with a space after each 16 bytes, then split (~1.2k instructions an id,
        most of it the string made; 1.7k for ``to_bytes().hex()`` one by one, 2.3k for ``str``
        of a 16-digit counter)."""
        top = int(repr(self._counter)[6:-1])  # count(N): the next id, read without advancing
        lo = max(lowest, top - 4 * records - 4096, 1)
        if lo >= top:
            return top, top, []
        try:
            words = array("Q", self._pair) * (top - lo)
            words[1::2] = array("Q", range(lo, top))
        except OverflowError:  # a counter past 64 bits: every id one by one
            return top, top, []
        if _LITTLE_ENDIAN:
            words.byteswap()
        return lo, top, words.tobytes().hex(" ", 16).split()

    def _outside(self, value: int | str | None) -> str | None:
        """The hex of an id outside the batch's run (an epoch, the session, a span opened long
        ago), kept: the same few come back batch after batch. Strings (the legacy ``"root"``)
        and None pass unchanged."""
        if type(value) is not int:
            return value  # type: ignore[return-value]
        known = self._far
        text = known.get(value)
        if text is None:
            if len(known) >= 4096:
                known.clear()
            text = known[value] = (self._base | value).to_bytes(16, "big").hex()
        return text

    def span_records(self, timer: Any = None, *, final: bool = False,
                     rows: list[SpanWireRow] | None = None) -> list[SpoolSpan]:
        """Spool records of the spans closed since the last call, oldest first; ``rows``, when
        given, is extended with their wire rows.

        Values read late (``before_marks``: the loss of each step) become marks first, so that a
        step's record lists them. A span whose GPU events ``timer`` has not resolved yet is held
        for a later call (every span is written once); ``final`` writes them all.
        """
        if self.before_marks is not None:
            self.before_marks()
        if timer is not None:
            timer.resolve()
        spans = self.closed.drain()
        if self._deferred:
            spans = [*self._deferred, *spans]
            self._deferred = []
        if not spans:
            return []
        if timer is not None:  # CUDA timed them: a span whose time is pending waits for a later call
            spans = self._settle_gpu(spans, timer, final)
            if not spans:
                return []
        # The batch's ids are a run of the counter: a span's children and marks were made after it
        # (its lowest id is among the first spans closed: a step, or the fetch opened before it; an
        # older span, an epoch closing, is found outside the run)
        lo, top, hexes = self._ids = self._id_range(min([span.id for span in spans[:16]]),
                                                    len(spans) + len(self.marks) + 2 * len(self.inferred))
        return self._records_in_run(spans, lo, hexes, rows)

    def _records_in_run(self, spans: list[OpenSpan], lo: int, hexes: list[str],
                        rows: list[SpanWireRow] | None) -> list[SpoolSpan]:
        """The records of ``spans`` (and their wire rows into ``rows``), for a batch whose parents
        are counter values below the run's end. A phase (no attrs, no marks) costs one record and
        a lookup of each id; a step its breakdown and its marks. Written out inline: a call per
        step costs more than the loop saves. From the first span that breaks the assumption (a
        None parent raises TypeError, an id past the run IndexError, both before anything of that
        span is taken or written) the rest go one by one (``_records``)."""
        far = self._outside
        known = self._far.get  # an epoch's id, formatted once (_outside)
        step_marks = self.step_marks
        pid, rank = self.pid, self.rank
        top = lo + len(hexes)
        out: list[SpoolSpan] = []
        append = out.append
        wire = rows.append if rows is not None else None
        try:
            for span in spans:
                parent = span.parent_id
                parent = hexes[parent - lo] if parent >= lo else known(parent) or far(parent)
                own = span.id
                own = hexes[own - lo] if own >= lo else far(own)
                attrs = span.attrs
                marks = span.mark_ids
                if attrs is None and marks is None and span.phase_ns is None:  # a phase
                    append(SpoolSpan(own, span.name, parent, span.index, span.start_ns, span.end_ns, None, span.gpu,
                                     None, span.thread_id, pid, rank, _NO_ATTRS, ()))
                    if wire is not None:
                        wire(SpanWireRow(own, parent, span.name, span.index, span.start_ns, span.end_ns, span.gpu,
                                         span.thread_id, pid, _EMPTY_TEXT))
                    continue
                listed: list[str] | tuple[()] | OneId = ()
                if span.phase_ns is not None:
                    attrs = step_record_attrs(span)
                    loss = step_marks.pop(span.id, None)
                    if loss is not None:  # its loss (InferredMetrics)
                        if marks is None and lo <= loss < top:
                            listed = OneId(hexes[loss - lo])
                        else:
                            marks = [*(marks or ()), loss]
                elif attrs:
                    attrs = clean_attrs(attrs)
                else:
                    attrs = _NO_ATTRS
                if marks is not None:
                    listed = [hexes[m - lo] if type(m) is int and lo <= m < top else far(m) for m in marks]
                append(SpoolSpan(own, span.name, parent, span.index, span.start_ns, span.end_ns, None, span.gpu, None,
                                 span.thread_id, pid, rank, attrs, listed))
                if wire is not None:
                    wire(SpanWireRow(own, parent, span.name, span.index, span.start_ns, span.end_ns, span.gpu,
                                     span.thread_id, pid, _EMPTY_TEXT if attrs is _NO_ATTRS else json_text(attrs)))
        except (TypeError, IndexError):
            out.extend(self._records(spans[len(out):], lo, top, hexes, rows))
        return out

    def _record(self, span: OpenSpan, own: str, parent: str | None, lo: int, top: int, hexes: list[str]) -> SpoolSpan:
        """One span's record, its ids formatted already: a step's breakdown, attrs cleaned, its
        marks' ids."""
        marks = span.mark_ids
        if span.phase_ns is not None:
            attrs = step_record_attrs(span)
            loss = self.step_marks.pop(span.id, None)  # its loss (InferredMetrics)
            if loss is not None:
                marks = [*(marks or ()), loss]
        elif span.attrs:
            attrs = clean_attrs(span.attrs)
        else:
            attrs = _NO_ATTRS
        if marks is None:
            listed: list[str] | tuple[()] | OneId = ()
        elif len(marks) == 1 and type(first := marks[0]) is int and lo <= first < top:  # a step's loss, usually
            listed = OneId(hexes[first - lo])
        else:
            listed = [hexes[m - lo] if type(m) is int and lo <= m < top else self._outside(m) for m in marks]
        return SpoolSpan(own, span.name, parent, span.index, span.start_ns, span.end_ns, None, span.gpu, None,
                         span.thread_id, self.pid, self.rank, attrs, listed)

    def _records(self, spans: list[OpenSpan], lo: int, top: int, hexes: list[str],
                 rows: list[SpanWireRow] | None) -> list[SpoolSpan]:
        """The records of ``spans`` (and their wire rows into ``rows``), any id inside the run
        ``hexes`` (from ``lo`` to ``top``) or not."""
        far = self._outside
        pid = self.pid
        out: list[SpoolSpan] = []
        append = out.append
        wire = rows.append if rows is not None else None
        for span in spans:
            own = span.id
            own = hexes[own - lo] if lo <= own < top else far(own)
            parent = span.parent_id
            parent = hexes[parent - lo] if type(parent) is int and lo <= parent < top else far(parent)
            record = self._record(span, own, parent, lo, top, hexes)  # type: ignore[arg-type]
            append(record)
            if wire is not None:
                attrs = record.attrs
                wire(SpanWireRow(own, parent, span.name, span.index, span.start_ns, span.end_ns, span.gpu,
                                 span.thread_id, pid, _EMPTY_TEXT if attrs is _NO_ATTRS else json_text(attrs)))
        return out

    def _settle_gpu(self, spans: list[OpenSpan], timer: Any, final: bool) -> list[OpenSpan]:
        """The spans to write now: one whose GPU timing ``timer`` has not resolved waits for a
        later call (in order), unless ``final``; one never resolved is written without it."""
        kept: list[OpenSpan] = []
        for span in spans:
            gpu = span.gpu
            if gpu is not None and type(gpu) is not int:
                if not final and timer.outstanding(span):
                    self._deferred.append(span)
                    continue
                if span.gpu is gpu:  # never resolved: written without it (which breaks the span's cycle)
                    span.gpu = None
            kept.append(span)
        return kept

    def mark_records(self, rows: list[MarkWireRow] | None = None) -> list[SpoolMark]:
        """Spool records of the marks made since the last call, oldest first (the sampler's own,
        ``inferred``, after those of the training threads); ``rows``, when given, is extended
        with their wire rows. Their ids come from the run the last ``span_records`` wrote (a
        step's marks and the step itself are in it)."""
        if self.before_marks is not None:
            self.before_marks()
        ids, self._ids = self._ids, None
        drained = self.marks.drain()
        inferred, self.inferred = self.inferred, []
        if not (drained or inferred):
            return []
        if ids is None:
            mark_ids = [row.id for row in drained]
            for columns in inferred:
                mark_ids.extend(columns.ids)
            lowest = min([i for i in mark_ids if type(i) is int], default=0)
            ids = self._id_range(lowest, len(mark_ids)) if lowest else (0, 0, [])
        lo, top, hexes = ids
        far = self._outside
        # Marks share their attrs (the inferred loss's are one dict): each distinct one is cleaned,
        # and encoded for the wire, once.
        cleaned: dict[int, tuple[dict[str, Any], str | None]] = {}
        last: Any = cleaned  # the previous mark's attrs (never a mark's: the dict above)
        attrs: dict[str, Any] = _NO_ATTRS
        text: str | None = None
        out: list[SpoolMark] = []
        append = out.append
        wire = rows.append if rows is not None else None
        for row in drained:
            own = row.id
            own = hexes[own - lo] if type(own) is int and lo <= own < top else far(own)
            span_id = row.span_id
            span_id = hexes[span_id - lo] if type(span_id) is int and lo <= span_id < top else far(span_id)
            raw = row.attrs
            if raw is not last:
                last = raw
                seen = cleaned.get(id(raw))
                if seen is None:
                    made = clean_attrs(raw) if raw else _NO_ATTRS
                    seen = cleaned[id(raw)] = (made, json_text(made) if wire is not None else None)
                attrs, text = seen
            append(SpoolMark(own, span_id, row.name, row.value_type, row.value, attrs, row.ts_ns, row.kind,
                             row.nonfinite))
            if wire is not None:
                wire(MarkWireRow(own, span_id, row.name, row.value_type, row.value, row.nonfinite, row.ts_ns,
                                 row.kind, text))
        for columns in inferred:
            self._inferred_records(columns, lo, top, hexes, out, rows)
        return out

    def _inferred_records(self, columns: InferredColumns, lo: int, top: int, hexes: list[str],
                          out: list[SpoolMark], rows: list[MarkWireRow] | None) -> None:
        """The sampler's own marks (finite floats, attrs of plain values) as records, made by
        ``map`` over their columns: no Python per mark where the ids are in the batch's run."""
        ids, span_ids = columns.ids, columns.span_ids
        count = len(ids)
        if min(ids) >= lo and max(ids) < top:
            own: Any = list(map(hexes.__getitem__, map(sub, ids, repeat(lo, count))))
        else:
            own = [hexes[i - lo] if lo <= i < top else self._outside(i) for i in ids]
        if min(span_ids) >= lo and max(span_ids) < top:
            spans: Any = list(map(hexes.__getitem__, map(sub, span_ids, repeat(lo, count))))
        else:
            spans = [hexes[i - lo] if lo <= i < top else self._outside(i) for i in span_ids]
        attrs = columns.attrs
        out.extend(map(SpoolMark, own, spans, columns.names, repeat("float", count), columns.values, attrs,
                       columns.stamps, repeat("point", count)))
        if rows is not None:
            first = attrs[0]
            if all(map(first.__eq__, attrs)):  # one dict for all (the loss's): encoded once
                texts: Any = repeat(json_text(first), count)
            else:
                known: dict[int, str] = {}
                texts = [known.get(id(a)) or known.setdefault(id(a), json_text(a)) for a in attrs]
            rows.extend(map(MarkWireRow, own, spans, columns.names, repeat("float", count), columns.values,
                            repeat(None, count), columns.stamps, repeat("point", count), texts))


class InferredColumns(msgspec.Struct, gc=False):
    """Marks the sampler made from values the training thread read (the loss of each step: finite
    floats, attrs of plain values shared by many), as columns: ``ids[i]`` is mark ``i``'s id,
    ``span_ids[i]`` its span's."""

    ids: list[int]
    span_ids: list[int]
    names: tuple[str, ...]
    values: tuple[float, ...]
    stamps: tuple[int, ...]
    attrs: tuple[dict[str, Any], ...]


_EMPTY_TEXT = "{}"
_LITTLE_ENDIAN = sys.byteorder == "little"
_json_encoder = msgspec.json.Encoder()


def json_text(value: dict[str, Any]) -> str:
    """``value`` as the JSON text the aggregator stores (the wire's JSON field); a string no
    UTF-8 can hold (a lone surrogate) is replaced, as the spool writer replaces it."""
    if not value:
        return _EMPTY_TEXT
    try:
        return _json_encoder.encode(value).decode()
    except UnicodeEncodeError:
        return _json_encoder.encode(valid_text(value)).decode()
