"""The training API: ``trace_step``, ``scope``, ``mark``, ``epochs``, ``batches``, ``snapshot``,
``inference`` — and the phase bookkeeping the torch patches share.

Canonical shape (spool-format-v1.md): ``session > epoch[n] > step[n] > data_load, h2d, forward,
backward, optimizer_step``. Epochs are siblings under the session; work before the loop hangs
under the session; each inference call is its own root ``request`` span.

Attribution rules the tools stepwatch replaces get wrong:
  * a batch fetched just before ``trace_step`` opens is adopted by that step (its ``data_load``
    child, the step starting at the fetch) — counted once, never also outside;
  * marks made after ``optimizer.step()`` still land on the step: only ``trace_step`` closes it;
  * a loss module is not a second ``forward``.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, TypeVar

from .guard import report_internal
from .spans import PHASES, ROOT_SENTINEL, MarkRow, OpenSpan, SpanRecorder, cut_utf8, mark_value, step_attrs

__all__ = [
    "FRAMEWORK_PRIORITY", "TrainingState", "activate", "batches", "epochs", "inference", "mark",
    "scope", "snapshot", "trace_step",
]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# Who owns epoch and step when several hooks are active (spool-format-v1.md): highest wins.
FRAMEWORK_PRIORITY = {"transformers": 3, "lightning": 2, "torch": 1}
_PRE_INIT_MARKS_MAX = 1024
_NO_PHASE_TIME = dict.fromkeys(PHASES, 0)  # copied for each step: a small dict's copy beats fromkeys
_time_ns = time.time_ns

_state: TrainingState | None = None
_request: contextvars.ContextVar[OpenSpan | None] = contextvars.ContextVar("stepwatch_request", default=None)
_pre_init_marks: deque[MarkRow] = deque(maxlen=_PRE_INIT_MARKS_MAX)


class _Local(threading.local):
    """This thread's training bookkeeping, and its span stack and ident, so that a phase reads
    one thread-local object (the stack is the very list the recorder uses for the thread)."""

    def __init__(self, recorder: SpanRecorder) -> None:
        self.stack: list[OpenSpan] = recorder.thread_stack()
        self.ident = threading.get_ident()
        self.step: OpenSpan | None = None
        self.model: Any = None
        self.pending_fetch: tuple[int, int] | None = None
        self.in_forward = False
        self.in_backward = False
        self.optimizer_token: Any = None
        self.optimizer_depth = 0  # optimizer steps nested in the open one (super().step(), wrappers)
        self.implicit = False  # the open step was opened by the patches, not by trace_step


class TrainingState:
    """Span bookkeeping of one runtime; the torch patches and the API functions use it."""

    def __init__(self, recorder: SpanRecorder, *, snapshot_sink: Callable[[list[dict[str, Any]], Any], None],
                 blob_uri: Callable[[str, str], str], gpu_timer: Any = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.recorder = recorder
        self.gpu_timer = gpu_timer
        self.snapshot_sink = snapshot_sink
        self.blob_uri = blob_uri
        self.on_step = on_step
        self.local = _Local(recorder)
        # What the hot paths below take from the recorder, held here: one attribute read each.
        self._new_id = recorder.new_id
        self._push = recorder.closed.push  # with _tally: SpanTable.append, inline
        self._tally = recorder.closed.tally
        self._max_depth = recorder.max_depth
        self._session_id = recorder.session.id
        self.steps = itertools.count()
        self.epoch: OpenSpan | None = None
        self.owners: set[str] = set()
        # With no trace_step and no framework integration, steps are inferred: a step opens at
        # the first phase after a fetch and closes when optimizer.step() returns. Forward-only
        # iterations (evaluation) become `eval_step` spans, kept out of the step statistics.
        self.auto_steps = True
        self.eval_steps = itertools.count()

    # -- ownership --------------------------------------------------------------------------

    def claim(self, framework: str) -> None:
        """A framework integration declares it drives epochs and steps."""
        self.owners.add(framework)

    def release(self, framework: str) -> None:
        """The integration's run ended: plain torch loops mark their own steps again."""
        self.owners.discard(framework)

    def yields(self, framework: str) -> bool:
        """True when a higher-priority framework owns epoch/step, so ``framework`` must not open them."""
        mine = FRAMEWORK_PRIORITY.get(framework, 0)
        return any(FRAMEWORK_PRIORITY.get(o, 0) > mine for o in self.owners)

    # -- phases (torch patches) -------------------------------------------------------------

    def begin_phase(self, name: str, *, timed: bool = True) -> OpenSpan | None:
        """Opens phase ``name`` under the innermost open span of this thread.

        The hot path of every patch: one thread-local read, the span made and pushed here
        (no call into the recorder), the id a C-level counter, nothing formatted.
        """
        local = self.local
        # Only after a fetch: a warm-up forward before the loop hangs under the session, not a step.
        if local.step is None and local.pending_fetch is not None and self.auto_steps and not self.owners:
            self.open_step(None, {"implicit": True}, implicit=True)
        stack = local.stack
        if len(stack) >= self._max_depth:
            self.recorder.depth_dropped += 1
            return None
        span = OpenSpan(self._new_id(), name, stack[-1].id if stack else self._session_id, None, _time_ns(), None,
                        local.ident)
        stack.append(span)
        if self.gpu_timer is not None and timed:
            span.gpu = self.gpu_timer.begin(span)
        return span

    def end_phase(self, span: OpenSpan | None) -> None:
        if span is None:
            return
        end_ns = _time_ns()
        if span.gpu is not None and self.gpu_timer is not None:
            self.gpu_timer.end(span.gpu)
        local = self.local
        stack = local.stack
        if stack and stack[-1] is span and not span.closed:
            stack.pop()
            span.closed = True
            span.end_ns = end_ns
            self._push(span)
            self._tally()
        else:  # closed already, or children left open above it: the recorder sorts it out
            self.recorder.close(span, end_ns)
        step = local.step
        if step is not None:
            name = span.name
            times = step.phase_ns
            if times is not None and name in times:
                times[name] += end_ns - span.start_ns
                if local.implicit and name == "optimizer_step":
                    self.close_step(step, None)

    def record_fetch(self, start_ns: int, end_ns: int) -> None:
        """A batch fetch: a child of the open step, else held for the next step to adopt."""
        local = self.local
        if local.step is not None:
            if not local.implicit:
                self._data_load_span(start_ns, end_ns)
                return
            self.close_step(local.step, None, end_ns=start_ns)  # an inferred step ends at the next fetch
        if local.pending_fetch is not None:  # never adopted (no trace_step): keep it where it ran
            self._data_load_span(*local.pending_fetch)
        local.pending_fetch = (start_ns, end_ns)

    def end_inferred_step(self, end_ns: int | None = None) -> None:
        """Closes an inferred step open on this thread: when its loader is exhausted (not at the
        next epoch's fetch) and at epoch boundaries (it must not enclose, then close, an epoch)."""
        local = self.local
        if local.step is not None and local.implicit:
            self.close_step(local.step, None, end_ns=end_ns)

    def _data_load_span(self, start_ns: int, end_ns: int) -> None:
        """A closed ``data_load`` span under the innermost open one (never pushed: it is over)."""
        local = self.local
        stack = local.stack
        if len(stack) >= self._max_depth:
            self.recorder.depth_dropped += 1
        else:
            self._push(OpenSpan(self._new_id(), "data_load", stack[-1].id if stack else self._session_id, None,
                                start_ns, None, local.ident, closed=True, end_ns=end_ns))
            self._tally()
        step = local.step
        if step is not None and step.phase_ns is not None:
            step.phase_ns["data_load"] += end_ns - start_ns

    # -- steps and epochs -------------------------------------------------------------------

    def open_step(self, model: Any, attrs: dict[str, Any] | None, *, implicit: bool = False) -> OpenSpan | None:
        local = self.local
        if not implicit:
            self.auto_steps = False  # the program marks its own steps from now on
            if local.step is not None and local.implicit:
                self.close_step(local.step, None)
        fetch = local.pending_fetch
        local.pending_fetch = None
        index = None if implicit else next(self.steps)
        stack = local.stack
        if len(stack) >= self._max_depth:
            self.recorder.depth_dropped += 1
            return None
        times = _NO_PHASE_TIME.copy()
        span = OpenSpan(self._new_id(), "step", stack[-1].id if stack else self._session_id, index,
                        fetch[0] if fetch else _time_ns(), attrs, local.ident, None, None, times)
        stack.append(span)
        local.step = span
        local.model = model
        local.implicit = implicit
        if fetch is not None:  # the adopted fetch: the step's data_load child (what _data_load_span does)
            start_ns, end_ns = fetch
            if len(stack) >= self._max_depth:
                self.recorder.depth_dropped += 1
            else:
                self._push(OpenSpan(self._new_id(), "data_load", span.id, None, start_ns, None, local.ident,
                                    None, None, None, True, end_ns))
                self._tally()
            times["data_load"] = end_ns - start_ns
        return span

    def close_step(self, span: OpenSpan | None, error: BaseException | None, *, end_ns: int | None = None) -> None:
        """Closes the open step. Its breakdown attrs (step_ns, <phase>_ns, wait_ns) are built
        from ``phase_ns`` by the background thread at the seal (``spans.step_attrs``)."""
        local = self.local
        if span is None or local.step is not span:
            return
        end_ns = end_ns or _time_ns()
        implicit = local.implicit
        local.step = local.model = None
        if implicit:
            local.implicit = False
            times = span.phase_ns or _NO_PHASE_TIME
            trained = times["backward"] or times["optimizer_step"]
            span.name = "step" if trained else "eval_step"
            span.index = next(self.steps) if trained else next(self.eval_steps)
        if error is not None:  # rare: built here, so that "error" follows the breakdown as it always has
            span.attrs = {**step_attrs(span, end_ns), "error": type(error).__name__}
            span.phase_ns = None
        stack = local.stack
        if stack and stack[-1] is span and not span.closed:
            stack.pop()
            span.closed = True
            span.end_ns = end_ns
            self._push(span)
            self._tally()
        else:
            self.recorder.close(span, end_ns)
        if self.on_step is not None and span.index is not None:
            self.on_step(span.index + 1)

    def finish(self) -> None:
        """At shutdown: a step still open on this thread closes as what it was, with its
        breakdown; one that ``trace_step`` opened (cut by SIGTERM or exit) is flagged unclosed."""
        local = self.local
        step = local.step
        if step is None:
            return
        if not local.implicit:
            step.attrs = {**(step.attrs or {}), "unclosed": True}
        self.close_step(step, None)

    def close_epoch(self, span: OpenSpan) -> None:
        self.end_inferred_step()  # closed as a step with its breakdown, not as an "unclosed" child
        self.recorder.close(span)

    def open_epoch(self, index: int) -> OpenSpan | None:
        self.end_inferred_step()
        if self.epoch is not None and not self.epoch.closed:
            self.recorder.close(self.epoch)
        self.epoch = self.recorder.open("epoch", index=index, parent_id=self.recorder.session.id)
        return self.epoch


def activate(state: TrainingState | None) -> None:
    global _state
    _state = state


def pre_init_marks() -> list[MarkRow]:
    """Marks made while no runtime ran (legacy ``"root"`` span id), oldest first."""
    rows = list(_pre_init_marks)
    _pre_init_marks.clear()
    return rows


# -- public API --------------------------------------------------------------------------------


class trace_step:  # noqa: N801 - a statement: `with stepwatch.trace_step(model):`
    """Marks one training step; phases inside it (data_load, h2d, forward, backward,
    optimizer_step) are timed by the torch patches and summed onto the step.

    Example::

        for batch in loader:
            with stepwatch.trace_step(model):
                loss = loss_fn(model(batch.x), batch.y)
                loss.backward(); optimizer.step(); optimizer.zero_grad()
                stepwatch.mark("loss", loss)
    """

    __slots__ = ("model", "framework", "attrs", "_span")

    def __init__(self, model: Any = None, *, framework: str = "torch", **attrs: Any) -> None:
        self.model = model
        self.framework = framework
        self.attrs = attrs or None
        self._span: OpenSpan | None = None

    def __enter__(self) -> trace_step:
        state = _state
        if (state is not None and state.local.step is None
                and (not state.owners or not state.yields(self.framework))):
            try:
                self._span = state.open_step(self.model, self.attrs)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, "trace_step.enter")
        return self

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> bool:
        state = _state
        if state is not None and self._span is not None:
            try:
                state.close_step(self._span, exc)
            except Exception as error:  # noqa: BLE001
                report_internal(error, "trace_step.exit")
        self._span = None
        return False


class scope:  # noqa: N801
    """A named span around any code; a context manager and a decorator.

    Example::

        with stepwatch.scope("validation", split="dev"): ...
    """

    __slots__ = ("name", "attrs", "_spans")

    def __init__(self, name: str, **attrs: Any) -> None:
        self.name = cut_utf8(str(name))
        self.attrs = attrs or None
        self._spans: list[OpenSpan | None] = []

    def __enter__(self) -> scope:
        state = _state
        span = None
        if state is not None:
            try:
                span = state.recorder.open(self.name, attrs=dict(self.attrs) if self.attrs else None)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, "scope.enter")
        self._spans.append(span)
        return self

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> bool:
        span = self._spans.pop() if self._spans else None
        state = _state
        if state is not None and span is not None:
            try:
                if exc is not None:
                    span.attrs = {**(span.attrs or {}), "error": type(exc).__name__}
                state.recorder.close(span)
            except Exception as error:  # noqa: BLE001
                report_internal(error, "scope.exit")
        return False

    def __call__(self, func: F) -> F:
        name, attrs = self.name, self.attrs or {}
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with scope(name, **attrs):
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with scope(name, **attrs):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def mark(name: str, value: Any, kind: str = "point", **attrs: Any) -> None:
    """Records a typed value (bool, int, float, string) on the innermost open span of this thread
    (the request in an async inference call, the session when none is open).

    ``kind`` is ``"point"`` (a value at an instant) or ``"summary"`` (a value for the whole span).
    """
    try:
        if kind not in ("point", "summary"):
            raise ValueError(f"mark kind must be 'point' or 'summary', got {kind!r}")
        state = _state
        if state is None:
            value_type, json_value, nonfinite = mark_value(value)
            _pre_init_marks.append(MarkRow(uuid.uuid4().hex, ROOT_SENTINEL, cut_utf8(str(name)), value_type,
                                           json_value, nonfinite, attrs or None, time.time_ns(), kind))
            return
        request = _request.get()
        if request is not None and not request.closed:
            state.recorder.mark_on(request, name, value, kind, attrs or None)
        else:
            state.recorder.mark(name, value, kind, attrs or None)
    except Exception as exc:  # noqa: BLE001
        report_internal(exc, "mark")


def epochs(n: int, *, framework: str = "torch") -> Iterator[int]:
    """``for epoch in stepwatch.epochs(3):`` — each iteration runs inside its ``epoch`` span."""
    for index in range(n):
        state = _state
        span = None
        if state is not None and not state.yields(framework):
            try:
                span = state.open_epoch(index)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, "epochs")
        try:
            yield index
        finally:
            if state is not None and span is not None:
                try:
                    state.close_epoch(span)
                except Exception as exc:  # noqa: BLE001
                    report_internal(exc, "epochs.close")


def batches(loader: Iterable[T], model: Any = None, *, framework: str = "torch") -> Iterator[T]:
    """``for batch in stepwatch.batches(loader, model):`` — each batch is a step whose
    ``data_load`` is the fetch of that batch."""
    iterator = iter(loader)
    timed = type(iterator).__name__ == "_TimedIterator"  # a patched DataLoader times itself
    while True:
        start = time.time_ns()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        state = _state
        if state is not None and not timed:
            try:
                state.record_fetch(start, time.time_ns())
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, "batches.fetch")
        with trace_step(model, framework=framework):
            yield batch


def snapshot(model: Any, mode: str = "stats", *, sample_rate: float = 0.1, **attrs: Any) -> int:
    """Statistics of every parameter (and gradient) of ``model`` on the current span; with
    ``sampled``/``full`` also safetensors blobs, written off this thread. Returns records made."""
    state = _state
    if state is None:
        return 0
    from .snapshots import snapshot_model

    try:
        span = state.recorder.current()
        recorder = state.recorder
        records, job = snapshot_model(model, span_id=recorder.format_id(span.id), mode=mode, sample_rate=sample_rate,
                                      blob_uri=state.blob_uri, ts_ns=time.time_ns(), attrs=attrs,
                                      new_id=lambda: recorder.format_id(recorder.new_id()))
    except ValueError:
        raise  # a wrong mode is the caller's error
    except Exception as exc:  # noqa: BLE001
        report_internal(exc, "snapshot")
        return 0
    state.snapshot_sink(records, job)
    return len(records)


def inference(func: F | None = None, *, name: str = "request") -> Any:
    """Each call of the decorated function is its own root ``request`` span (sync, async,
    generators and async generators). Streaming calls get ``time_to_first_token_ms``,
    ``output_tokens``, ``tokens_per_second`` and ``request_duration_ms`` marks."""
    if func is None:
        return functools.partial(inference, name=name)

    def begin(push: bool = False) -> tuple[OpenSpan | None, Any]:
        # Only a plain call nests its children on the thread's stack; async and streaming calls
        # interleave with other code on the thread, so they are tracked through a ContextVar.
        state = _state
        if state is None:
            return None, None
        span = state.recorder.open(name, attrs={"request_id": uuid.uuid4().hex}, parent_id=None, root=not push)
        return span, _request.set(span)

    def finish(span: OpenSpan | None, token: Any, error: BaseException | None,
               stream: tuple[int, int | None] | None = None) -> None:
        if token is not None:
            _request.reset(token)
        state = _state
        if span is None or state is None:
            return
        try:
            now = time.time_ns()
            if error is not None:
                span.attrs = {**(span.attrs or {}), "error": type(error).__name__}
            if stream is not None:
                chunks, first_ns = stream
                duration_ms = (now - span.start_ns) / 1e6
                marks = {"output_tokens": chunks, "request_duration_ms": duration_ms}
                if first_ns is not None:
                    marks["time_to_first_token_ms"] = (first_ns - span.start_ns) / 1e6
                if duration_ms > 0:
                    marks["tokens_per_second"] = chunks / (duration_ms / 1000)
                for key, value in marks.items():
                    state.recorder.mark_on(span, key, value, "summary", None)
            state.recorder.close(span, now)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, "inference")

    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def agen_wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            span, token = begin()
            chunks, first, error = 0, None, None
            try:
                async for item in func(*args, **kwargs):
                    if first is None:
                        first = time.time_ns()
                    chunks += 1
                    yield item
            except BaseException as exc:
                error = exc
                raise
            finally:
                finish(span, token, error, (chunks, first))

        return agen_wrapper

    if inspect.isgeneratorfunction(func):

        @functools.wraps(func)
        def gen_wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
            span, token = begin()
            chunks, first, error = 0, None, None
            try:
                for item in func(*args, **kwargs):
                    if first is None:
                        first = time.time_ns()
                    chunks += 1
                    yield item
            except BaseException as exc:
                error = exc
                raise
            finally:
                finish(span, token, error, (chunks, first))

        return gen_wrapper

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            span, token = begin()
            try:
                result = await func(*args, **kwargs)
            except BaseException as exc:
                finish(span, token, exc)
                raise
            finish(span, token, None)
            return result

        return async_wrapper

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        span, token = begin(push=True)
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            finish(span, token, exc)
            raise
        finish(span, token, None)
        return result

    return wrapper
