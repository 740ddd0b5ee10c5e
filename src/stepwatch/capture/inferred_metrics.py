"""The loss and the gradient norm of a program with no stepwatch code: the scalar root of each
``backward()`` and the value ``torch.nn.utils.clip_grad_norm_`` returns, recorded as ``loss``
and ``grad_norm`` marks (the path ``stepwatch.mark`` takes: the spool, the aggregator, the
watchdog's ``NONFINITE`` and ``ZERO_GRAD`` rules), each with ``source`` in its attrs so that a
value the program logs itself stays distinct (and wins, docs/watchdog.md).

No device sync on the training thread: a value on the host is read there at once (``item()``
of a CPU scalar costs less than the ``detach()`` that keeping it would); a value on a CUDA
device is copied into pinned host memory without blocking, behind an event, and read by the
sampler once the event has passed (``resolve``, called before each drain of the marks). The
training thread only appends to ``pending``; the sampler builds the mark rows.

Only scalar roots are losses: ``torch.autograd.grad`` (a gradient penalty) is not patched, and
the backward of a non-scalar (or of several tensors at once) is not a loss. A root that
``GradScaler.scale`` made is recorded unscaled (the scaler's input), and a gradient norm taken
while a ``GradScaler`` is in use says so (``scaler: true``): such a step with inf or NaN
gradients is skipped by the scaler, not a failure.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import repeat
from math import isfinite
from operator import attrgetter
from operator import call as _call
from typing import Any

from ..guard import Site, report_internal
from .spans import InferredColumns, MarkRow, OpenSpan, SpanRecorder, mark_value

__all__ = ["GRAD_NORM_SOURCE", "LOSS_ATTRS", "LOSS_SOURCE", "PENDING_MAX", "InferredMetrics"]

LOSS_SOURCE = "backward root"
GRAD_NORM_SOURCE = "clip_grad_norm_"
LOSS_ATTRS = {"source": LOSS_SOURCE, "inferred": True}
_NORM_ATTRS = {"source": GRAD_NORM_SOURCE, "inferred": True}
_NORM_SCALER_ATTRS = {**_NORM_ATTRS, "scaler": True}
PENDING_MAX = 4096  # values not yet read; past it the newest are dropped (counted)
_SLOTS_MAX = 64  # pinned host slots per dtype for device values in flight
_time_ns = time.time_ns
_FLOAT = {float}
_INT = {int}
_SPAN_ID = attrgetter("id")
_PHASE_NS = attrgetter("phase_ns")  # set on a step, None on any other span
# Steps whose loss waits for the step's record: taken out as each step is written, a tick or two
# later; past this (steps never written: evicted from a full table) the loss goes in the step's
# own mark_ids, as before, and the table is emptied of them.
_STEP_MARKS_MAX = 8192


class _Slot:
    """A pinned host scalar and the event after the copy into it."""

    __slots__ = ("buffer", "event")

    def __init__(self, buffer: Any, event: Any) -> None:
        self.buffer = buffer
        self.event = event


class InferredMetrics:
    """The pending values of one runtime's training threads, and their reading."""

    def __init__(self, recorder: SpanRecorder, torch: Any, threads: Any = None,
                 register_post_hook: Callable[[Any], Any] | None = None) -> None:
        self.recorder = recorder
        self.torch = torch
        self.threads = threads  # training.py's per-thread bookkeeping (``threads.me``)
        self._register = register_post_hook  # torch's register_optimizer_step_post_hook
        self._lock = threading.Lock()
        self._waiting: dict[int, list[tuple[str, Any, int, dict[str, Any]]]] = {}  # thread -> values held
        self._hook: Any = None
        # (span, name, value: float | _Slot, ts_ns, attrs), appended by training threads
        self.pending: deque[tuple[OpenSpan, str, Any, int, dict[str, Any]]] = deque()
        self.dropped = 0
        self.scaled: tuple[Any, Any] | None = None  # GradScaler.scale's (output, input) for a scalar
        self.scaler_seen = False
        self._free: dict[Any, list[_Slot]] = {}  # dtype -> free pinned slots
        self._made: dict[Any, int] = {}

    # -- training thread ------------------------------------------------------------------------

    def loss(self, local: Any, root: Any) -> None:
        """A scalar ``root`` went through ``backward()`` on the thread whose bookkeeping is
        ``local`` (training.py's ``_ThreadState``): the loss of its step."""
        scaled = self.scaled
        if scaled is not None and scaled[0] is root:
            root = scaled[1]
            self.scaled = None
        self._note(local, "loss", root, LOSS_ATTRS)

    def grad_norm(self, local: Any, norm: Any) -> None:
        """What ``clip_grad_norm_`` returned."""
        self._note(local, "grad_norm", norm, _NORM_SCALER_ATTRS if self.scaler_seen else _NORM_ATTRS)

    def _note(self, local: Any, name: str, tensor: Any, attrs: dict[str, Any]) -> None:
        """The value goes on the thread's innermost open span (where a mark made on the next line
        lands: the running step), except when that is a step whose optimizer step has returned
        (kept open for marks; a loop with no DataLoader holds the next iteration's phases until
        its optimizer step makes their step): then on the step the next optimizer step makes."""
        if len(self.pending) >= PENDING_MAX:
            self.dropped += 1
            return
        value = self._read(tensor)
        if value is None:
            return
        if local.step is not None and local.live is None:
            self._defer(local, name, value, attrs)
            return
        stack = local.stack
        self.pending.append((stack[-1] if stack else self.recorder.session, name, value, _time_ns(), attrs))


    def _read(self, tensor: Any) -> Any:
        """A host scalar's value, a device scalar's slot (its copy started), else None."""
        if tensor.is_cpu:
            return tensor.item()
        if tensor.device.type == "cuda":
            slot = self._copy_async(tensor)
            if slot is None:
                self.dropped += 1
            return slot
        return None  # another accelerator (MPS, XLA): reading it would sync or run the graph

    def _defer(self, local: Any, name: str, value: Any, attrs: dict[str, Any]) -> None:
        """Held for the step the thread's next optimizer step makes: a global optimizer post-hook
        registered for as long as values wait (after the training state's own, so that the step
        is made when it runs)."""
        with self._lock:
            self._waiting.setdefault(local.ident, []).append((name, value, _time_ns(), attrs))
            if self._hook is None and self._register is not None:
                self._hook = self._register(self._adopt)

    def _adopt(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            local = self.threads.me
            with self._lock:
                held = self._waiting.pop(local.ident, None)
                if not self._waiting and self._hook is not None:
                    self._hook.remove()
                    self._hook = None
            if held:
                span = local.step if local.step is not None else self.recorder.session
                for name, value, ts_ns, attrs in held:
                    self.pending.append((span, name, value, ts_ns, attrs))
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.INFERRED_RESOLVE)

    def flush(self) -> None:
        """At uninstall: every value becomes a mark row (waiting for the device if need be)."""
        try:
            self.release()
            self.resolve(wait=True)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.INFERRED_RESOLVE)

    def release(self) -> None:
        """At uninstall: values still waiting for a step go on the session span."""
        with self._lock:
            waiting, self._waiting = self._waiting, {}
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
        for held in waiting.values():
            for name, value, ts_ns, attrs in held:
                self.pending.append((self.recorder.session, name, value, ts_ns, attrs))

    def _copy_async(self, tensor: Any) -> _Slot | None:
        """Starts the copy of a device scalar into a pinned host slot; None when every slot is
        in flight (the sampler is behind)."""
        torch = self.torch
        dtype = tensor.dtype
        free = self._free.setdefault(dtype, [])
        if free:
            slot = free.pop()
        elif self._made.get(dtype, 0) < _SLOTS_MAX:
            self._made[dtype] = self._made.get(dtype, 0) + 1
            slot = _Slot(torch.empty((), dtype=dtype, pin_memory=True), torch.cuda.Event())
        else:
            return None
        slot.buffer.copy_(tensor.detach(), non_blocking=True)
        slot.event.record(torch.cuda.current_stream(tensor.device))
        return slot

    # -- sampler thread -------------------------------------------------------------------------

    def resolve(self, wait: bool = False) -> int:
        """Turns the values read so far into mark rows (oldest first); a device value whose copy
        has not completed stops the pass, unless ``wait`` (at stop). Returns the rows made.

        The usual batch (finite floats read on the host, one a step) is turned into rows column
        by column (``_resolve_host``); anything else takes the loop (``_resolve_each``)."""
        pending = self.pending
        count = len(pending)
        if not count:
            return 0
        if type(pending[0][2]) is not float:  # a device value (CUDA) or another type: one at a time
            return self._resolve_each(wait)
        taken = list(map(_call, repeat(pending.popleft, count)))  # only this thread takes them out
        made = self._resolve_host(taken)
        if made:
            return made
        pending.extendleft(reversed(taken))  # back in front, in order; training threads append behind
        return self._resolve_each(wait)

    def _resolve_host(self, taken: list[tuple[OpenSpan, str, Any, int, dict[str, Any]]]) -> int:
        """``taken`` as marks when every value is a finite float (``mark_value``'s first case):
        ids drawn, each span's marks noted (``SpanRecorder.step_marks``, or its ``mark_ids``), and
        the columns handed to the recorder (``SpanRecorder.inferred``), which writes them with no
        row per mark. Returns 0, having done nothing, when one value is anything else, or a span's
        id is not the counter's."""
        spans, names, values, stamps, attrs = zip(*taken)
        if set(map(type, values)) != _FLOAT or not all(map(isfinite, values)):
            return 0
        span_ids = list(map(_SPAN_ID, spans))
        if set(map(type, span_ids)) != _INT:
            return 0
        count = len(taken)
        recorder = self.recorder
        ids = list(map(_call, repeat(recorder.new_id, count)))
        later = recorder.step_marks
        if len(later) >= _STEP_MARKS_MAX:
            later.clear()  # steps never written: their losses are still written, listed by no step
        if None not in map(_PHASE_NS, spans) and len(set(span_ids)) == count and later.keys().isdisjoint(span_ids):
            # one value a step (the loss), each on a step: listed by the step's record from the
            # recorder's table, with no list per step
            later.update(zip(span_ids, ids))
        else:
            for span, mark_id in zip(spans, ids):
                held = span.mark_ids
                if held is None:
                    span.mark_ids = [mark_id]
                else:
                    held.append(mark_id)
        recorder.inferred.append(InferredColumns(ids, span_ids, names, values, stamps, attrs))
        return count

    def _resolve_each(self, wait: bool) -> int:
        """``resolve`` one value at a time: device values (their copy may still run), values of
        other types, non-finite ones."""
        made = 0
        pending = self.pending
        marks = self.recorder.marks
        new_id = self.recorder.new_id
        while pending:
            span, name, value, ts_ns, attrs = pending[0]
            if type(value) is _Slot:
                slot = value
                try:
                    if not slot.event.query():
                        if not wait:
                            break
                        slot.event.synchronize()
                    value = slot.buffer.item()
                except Exception as exc:  # noqa: BLE001 - a device gone bad: this value is lost
                    report_internal(exc, Site.INFERRED_RESOLVE)
                    value = None
                self._free.setdefault(slot.buffer.dtype, []).append(slot)
            pending.popleft()
            if value is None:
                self.dropped += 1
                continue
            value_type, json_value, nonfinite = mark_value(value)
            mark_id = new_id()
            ids = span.mark_ids
            if ids is None:
                span.mark_ids = [mark_id]
            else:
                ids.append(mark_id)
            marks.append(MarkRow(mark_id, span.id, name, value_type, json_value, nonfinite, attrs, ts_ns, "point"))
            made += 1
        return made
