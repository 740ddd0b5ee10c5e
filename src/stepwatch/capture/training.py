"""The training API: ``trace_step``, ``scope``, ``mark``, ``epochs``, ``batches``, ``snapshot``,
``inference`` — and the phase bookkeeping the torch patches share.

Canonical shape (spool-format-v1.md): ``session > epoch[n] > step[n] > data_load, h2d, forward,
backward, optimizer_step``. Epochs are siblings under the session; work before the loop hangs
under the session; each inference call is its own root ``request`` span.

Attribution rules the tools stepwatch replaces get wrong:
  * a batch fetched just before ``trace_step`` opens is adopted by that step (its ``data_load``
    child, the step starting at the fetch) — counted once, never also outside;
  * marks made after ``optimizer.step()`` still land on the step: only ``trace_step`` closes it,
    and an inferred step stays open for marks until the next fetch, phase, scope or epoch end
    (its ``end_ns`` stays at the end of its optimizer step);
  * a loss module is not a second ``forward``.

Steps without ``trace_step`` (``auto_steps``): after a DataLoader fetch, a step opens at the first
phase and closes when ``optimizer.step()`` returns (forward-only ones, evaluation, become
``eval_step``). Without a DataLoader, steps are driven by the optimizer: each runs from the end of
the previous ``optimizer_step`` (or its first phase) to the end of its own; phases outside any
step are held back (not spooled) until an optimizer step adopts them, or something else (a
forward with no backward before it, a fetch, a scope, an epoch, shutdown) shows they were not a
step's.

Epochs without ``stepwatch.epochs()`` or a framework (``auto_epochs``): an epoch is one pass over
the *training* DataLoader, the loader whose batches fed a step with a backward or an optimizer
step. Its first pass becomes epoch 0 when that first training step closes (starting at the pass's
``__iter__``); every later ``__iter__`` of it opens the next epoch, which closes when the loader
is exhausted, at the next pass, or at shutdown. Passes over other loaders (evaluation: forward
only) never open epochs.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..guard import Site, report_internal
from .spans import PHASES, ROOT_SENTINEL, MarkRow, OpenSpan, SpanRecorder, cut_utf8, mark_value, step_attrs
from .step_inference import Mode, StepHost, StepMachine, StepState

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
# The step machine's states and mode that the hot paths below test or set inline (a call fewer).
_IDLE, _DONE, _OPTIMIZER = StepState.IDLE, StepState.DONE, Mode.OPTIMIZER

_state: TrainingState | None = None
_pre_init_marks: deque[MarkRow] = deque(maxlen=_PRE_INIT_MARKS_MAX)


class _ThreadState:
    """This thread's training bookkeeping, and its span stack and ident, so that a phase reads
    one object (the stack is the very list the recorder uses for the thread). Step inference's
    own state is the thread's ``machine`` (step_inference.py)."""

    __slots__ = ("stack", "ident", "step", "model", "module_id", "pending_fetch", "in_forward", "in_backward",
                 "optimizer_token", "optimizer_depth", "implicit", "live", "source", "step_opts", "opt_label",
                 "opt_nested", "ended_pass", "machine")

    def __init__(self, recorder: SpanRecorder, host: StepHost) -> None:
        self.stack: list[OpenSpan] = recorder.thread_stack()
        self.ident = threading.get_ident()
        self.step: OpenSpan | None = None
        self.model: Any = None
        # id() of the module whose top-level forward began last (an id: a reference would keep a
        # model the program dropped alive): step inference tells a frozen network's forward with
        # gradients off (a teacher, a target network) from evaluation of the model that trains
        self.module_id = 0
        self.pending_fetch: tuple[int, int, Any] | None = None  # (start, end, its pass)
        self.in_forward = False
        self.in_backward = False
        self.optimizer_token: Any = None
        self.optimizer_depth = 0  # optimizer steps nested in the open one (super().step(), wrappers)
        self.implicit = False  # the open step was opened by the patches, not by trace_step
        # The step phases accrue to: ``step`` while it runs, None once an inferred step's optimizer
        # step returned (it stays open for marks) and when no step is open. The one attribute
        # begin_phase tests before taking its slow path; the machine sets it for inferred steps.
        self.live: OpenSpan | None = None
        self.source: tuple[Any, int] | None = None  # (loader, pass start ns) of the last fetch
        self.step_opts: dict[str, int] = {}  # optimizer label -> its own ns in the open step
        self.opt_label = ""
        self.opt_nested = 0  # ns of phases nested in the open optimizer step (its closure)
        # A loader pass exhausted whose end is not yet applied: (its source, end ns, the open
        # step's phase time then). See TrainingState.end_pass.
        self.ended_pass: tuple[tuple[Any, int], int, int] | None = None
        self.machine = StepMachine(host, self)


class _PerThread(threading.local):
    """Each thread's ``_ThreadState``, as ``me``. The hot paths read this thread-local once per
    call and then plain slots: a thread-local attribute costs ~38 ns to read and ~49 to write
    against ~9 for a slot (timeit), and a step reads and writes the bookkeeping ~80 times."""

    def __init__(self, recorder: SpanRecorder, states: dict[int, _ThreadState], host: StepHost) -> None:
        self.me = _ThreadState(recorder, host)
        states[self.me.ident] = self.me  # for the sampler's view of the current phase (controls.py)


class TrainingState:
    """Span bookkeeping of one runtime; the torch patches and the API functions use it."""

    def __init__(self, recorder: SpanRecorder, *, snapshot_sink: Callable[[list[dict[str, Any]], Any], None],
                 blob_uri: Callable[[str, str], str], gpu_timer: Any = None,
                 on_step: Callable[[int, OpenSpan], None] | None = None) -> None:
        self.recorder = recorder
        self.gpu_timer = gpu_timer
        self.snapshot_sink = snapshot_sink
        self.blob_uri = blob_uri
        self.on_step = on_step
        self.thread_states: dict[int, _ThreadState] = {}  # each thread's, by ident: read by the sampler
        self.threads = _PerThread(recorder, self.thread_states, self)
        # What the hot paths below take from the recorder, held here: one attribute read each.
        self._new_id = recorder.new_id
        self._push = recorder.closed.push  # with _tally: SpanTable.append, inline
        self._tally = recorder.closed.tally
        self._max_depth = recorder.max_depth
        self._session_id = recorder.session.id
        self._context_stack = recorder.context_stack  # a request's own stack, else None
        self.requests = 0  # @inference contexts entered and not left: only then is there one to ask
        self.requests_lock = threading.Lock()  # requests run on many threads: no lost update
        self.steps = itertools.count()
        self.epoch: OpenSpan | None = None
        self.owners: set[str] = set()
        self.blob_counts: dict[int, int] = {}  # span id -> its snapshots with blobs so far
        # With no trace_step and no framework integration, steps are inferred: a step opens at
        # the first phase after a fetch and closes when optimizer.step() returns. Forward-only
        # iterations (evaluation) become `eval_step` spans, kept out of the step statistics.
        self.auto_steps = True
        self.eval_steps = itertools.count()
        # Epochs inferred from passes over the training DataLoader, until stepwatch.epochs() or a
        # framework opens one (module docstring).
        self.auto_epochs = True
        self.epoch_is_auto = False
        self.auto_epoch_index = itertools.count()
        self.train_loader: Callable[[], Any] | None = None  # a weakref to it, once known
        self.grad_enabled: Callable[[], bool] = lambda: True  # torch.is_grad_enabled, from the patches
        self.optimizer_labels: dict[int, str] = {}  # id(optimizer) -> "<class>#<order first stepped>"
        self.on_new_optimizer: Callable[[Any], None] | None = None  # at an optimizer's first step
        # The one way to stop the training code from outside (docs/halt.md): when set, it is called
        # on the calling thread before every phase and every step opens, and may raise into the
        # training code (``Halt``, the only thing stepwatch raises there, and only on request).
        # None costs the hot path one attribute read. Set and cleared by its owner (halt_control.py).
        self.trap: Callable[[], None] | None = None

    @property
    def local(self) -> _ThreadState:
        """The calling thread's bookkeeping (the hot paths read ``threads.me`` themselves)."""
        return self.threads.me

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
        """Opens phase ``name`` under the innermost open span of this thread (``phase_begin``
        for a caller that has not read the thread's bookkeeping yet)."""
        return self.phase_begin(self.threads.me, name, timed)

    def phase_begin(self, local: _ThreadState, name: str, timed: bool = True) -> OpenSpan | None:
        """``begin_phase`` for the calling thread's ``local``, which the patches read already.

        The hot path of every patch: the span made and pushed here (no call into the
        recorder), the id a C-level counter, nothing formatted. Outside a running step (or
        while its iterations are watched) the step machine decides first whether a step opens,
        closes, splits or takes the phase (``step_inference``).
        """
        trap = self.trap
        if trap is not None:
            trap()
        now = _time_ns()
        machine = local.machine
        slow = local.live is None or machine.watch
        if slow:
            if local.ended_pass is not None:  # the pass's last step is over: what comes now is not the pass's
                self._settle_pass(local)
            machine.phase(name, now)
        stack = local.stack if not self.requests else (self._context_stack() or local.stack)
        if len(stack) >= self._max_depth:
            self.recorder.depth_dropped += 1
            return None
        span = OpenSpan(self._new_id(), name, stack[-1].id if stack else self._session_id, None, now, None,
                        local.ident)
        stack.append(span)
        if slow and name == "forward" and local.step is not None and (machine.state is _DONE
                                                                       or not self.grad_enabled()):
            machine.forward_opened(span)  # evaluation work, if it comes between training steps
        if self.gpu_timer is not None and timed:
            span.gpu = self.gpu_timer.begin(span)
        return span

    def optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's global optimizer-step pre-hook (torch_patches.py registers it as it is: one
        Python frame less than a hook calling in here). The machine learns which optimizer (a
        GAN's second one joins the iteration, the same one again starts the next), then its
        phase opens."""
        try:
            local = self.threads.me
            token = local.optimizer_token
            if token is not None and not token.closed:
                # an optimizer step inside another (a subclass calling super().step(), a wrapper
                # stepping its inner optimizer): one optimizer_step phase, not a nested one
                local.optimizer_depth += 1
                return
            local.optimizer_depth = 0
            label = self.optimizer_labels.get(id(optimizer))
            if label is None:
                label = self.optimizer_labels[id(optimizer)] = f"{type(optimizer).__name__}#{len(self.optimizer_labels)}"
                if self.on_new_optimizer is not None:
                    self.on_new_optimizer(optimizer)  # its settings (program_settings.py)
            local.opt_label = label
            local.opt_nested = 0
            machine = local.machine
            if machine.mode is not _OPTIMIZER or machine.state is _DONE:
                # Else (an optimizer loop's every step after its first) the machine would change
                # nothing: one call fewer a step.
                machine.optimizer(label)
            local.optimizer_token = self.phase_begin(local, "optimizer_step")
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.PATCH_OPTIMIZER)

    def optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's global optimizer-step post-hook: the phase ``optimizer_pre`` opened closes."""
        try:
            local = self.threads.me
            if local.optimizer_depth > 0:
                local.optimizer_depth -= 1
                return
            token, local.optimizer_token = local.optimizer_token, None
            if token is not None:
                self.phase_end(local, token)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.PATCH_OPTIMIZER_END)

    def settle(self) -> None:
        """Before a scope or an epoch opens: the inferred step that ended at its optimizer step
        closes (a scope must not nest in it) and held phases are resolved."""
        local = self.threads.me
        if local.ended_pass is not None:
            self._settle_pass(local)
        local.machine.settle()

    def end_phase(self, span: OpenSpan | None) -> None:
        """Closes a phase ``begin_phase`` opened (None: it opened none)."""
        if span is not None:
            self.phase_end(self.threads.me, span)

    def phase_end(self, local: _ThreadState, span: OpenSpan) -> None:
        """``end_phase`` of a span (not None) for the calling thread's ``local``."""
        end_ns = _time_ns()
        if span.gpu is not None and self.gpu_timer is not None:
            self.gpu_timer.end(span.gpu)
        stack = local.stack if not self.requests else (self._context_stack() or local.stack)
        step = local.live
        if stack and stack[-1] is span and not span.closed:
            stack.pop()
            span.closed = True
            span.end_ns = end_ns
            machine = local.machine
            if machine.holding and span.name in _NO_PHASE_TIME:
                machine.held.append(span)  # spooled once the machine knows its step
            else:
                self._push(span)
                self._tally()
        else:  # closed already, or children left open above it: the recorder sorts it out
            self.recorder.close(span, end_ns)
        if step is not None:
            name = span.name
            times = step.phase_ns
            if times is not None and name in times:
                duration = end_ns - span.start_ns
                times[name] += duration
                parent = stack[-1] if stack else None
                if parent is not None and parent is not step and parent.name in times:
                    times[parent.name] -= duration  # a phase's time is its own: nested ones count once
                    if parent.name == "optimizer_step":
                        local.opt_nested += duration
                if name == "optimizer_step":
                    opts = local.step_opts
                    opts[local.opt_label] = opts.get(local.opt_label, 0) + duration - local.opt_nested
                    local.opt_nested = 0
                    if local.implicit:  # RUNNING -> DONE: StepMachine.optimizer_done, inline
                        local.live = None
                        machine = local.machine
                        machine.state = _DONE
                        machine.done_ns = step.end_ns = end_ns
                        if step.index is None:
                            step.index = next(self.steps)
                        if self.on_step is not None:
                            self.on_step(step.index + 1, step)

    def record_fetch(self, start_ns: int, end_ns: int, source: Any = None) -> None:
        """A batch fetch (from the DataLoader pass ``source``): a child of the open step, else
        held for the next step to adopt."""
        local = self.threads.me
        if local.ended_pass is not None:
            self._settle_pass(local)
        local.source = source
        step = local.step
        machine = local.machine
        if step is not None:
            if (local.implicit and machine.state is _DONE and not machine.held
                    and not machine.eval_ids):
                # StepMachine.fetch's usual case inline (a call fewer a step): the step that ended
                # at its optimizer step, nothing held since, closes there.
                machine.holding = False
                self.close_step(step, None)
            elif not local.implicit or machine.fetch(start_ns):
                self._data_load_span(start_ns, end_ns)
                return
        elif machine.held:
            machine.flush()
        if local.pending_fetch is not None:  # never adopted (no phase after it): keep it where it ran
            self._data_load_span(*local.pending_fetch[:2])
        local.pending_fetch = (start_ns, end_ns, source)

    def end_inferred_step(self, end_ns: int | None = None) -> None:
        """Closes an inferred step open on this thread: when its loader is exhausted (not at the
        next epoch's fetch) and at epoch boundaries (it must not enclose, then close, an epoch)."""
        self.threads.me.machine.close(end_ns)

    # -- automatic epochs (passes over the training DataLoader) ------------------------------

    def start_pass(self, source: tuple[Any, int]) -> None:
        """A DataLoader ``__iter__`` (``source``: the loader, the pass's start). A fetch still
        waiting from another pass was a peek (``next(iter(loader))``): it stays out of every step.
        A pass over the training loader ends the epoch open; the next opens at this pass's first
        training step, so a pass abandoned after a fetch or two is no epoch."""
        local = self.threads.me
        if local.ended_pass is not None:
            self._settle_pass(local)
        fetch = local.pending_fetch
        if fetch is not None and fetch[2] is not source:
            local.pending_fetch = None
            self._data_load_span(fetch[0], fetch[1])
            if local.source is fetch[2]:  # nor is its pass the one a later step trains in
                local.source = None
        train = self.train_loader
        if train is None or not self.auto_epochs or self.owners or train() is not source[0]:
            return
        self.end_inferred_step()
        self._close_auto_epoch(source[1])

    def end_pass(self, source: tuple[Any, int], end_ns: int) -> None:
        """A DataLoader pass is exhausted. The inferred step in it closes, and the epoch if this
        pass is one, at the next event (a pass, a fetch, a scope, an epoch, shutdown, or a phase
        outside a running step): a loader that reads one batch ahead (Accelerate's
        ``DataLoaderShard`` iterating a ``DataLoader`` inside its own) exhausts it before its last
        batch is trained on, and that batch still belongs to the step and the epoch (one step per
        update, one epoch per pass)."""
        local = self.threads.me
        if local.ended_pass is not None:
            self._settle_pass(local)
        times = local.step.phase_ns if local.step is not None else None
        local.ended_pass = (source, end_ns, sum(times.values()) if times else 0)

    def _settle_pass(self, local: _ThreadState) -> None:
        """Applies the end of the pass ``end_pass`` saw: its inferred step closes (at the pass's end
        unless phases ran since) and its epoch, once that step is over."""
        ended = local.ended_pass
        assert ended is not None
        local.ended_pass = None
        source, end_ns, work = ended
        step = local.step
        times = step.phase_ns if step is not None else None
        moved = bool(times) and sum(times.values()) != work  # type: ignore[union-attr]
        local.machine.close(None if moved else end_ns)
        train = self.train_loader
        if train is not None and self.epoch_is_auto and train() is source[0]:
            if step is not None and step.closed and step.end_ns > end_ns:
                end_ns = step.end_ns
            self._close_auto_epoch(end_ns)

    def _close_auto_epoch(self, end_ns: int | None = None) -> None:
        epoch = self.epoch
        if self.epoch_is_auto and epoch is not None:
            self.epoch = None
            self.epoch_is_auto = False
            if not epoch.closed:
                self.recorder.close(epoch, end_ns)

    def _open_auto_epoch(self, step: OpenSpan, local: _ThreadState) -> None:
        """A training step of a pass over a DataLoader, with no epoch open: that loader is the
        training loader, and this pass (from its ``__iter__``) the next epoch."""
        source = local.source
        times = step.phase_ns
        if (self.owners or step.parent_id != self._session_id or not self.auto_epochs or source is None
                or times is None or not (times["backward"] or times["optimizer_step"])):
            return
        loader, pass_start = source
        train = self.train_loader
        if train is None:
            try:
                self.train_loader = weakref.ref(loader)
            except TypeError:  # a loader class without weakref support: hold it
                self.train_loader = lambda: loader
        elif train() is not loader:
            return
        stack = local.stack if not self.requests else (self._context_stack() or local.stack)
        epoch = OpenSpan(self._new_id(), "epoch", self._session_id, next(self.auto_epoch_index), pass_start,
                         None, local.ident)
        if step in stack:
            stack.insert(stack.index(step), epoch)  # below the step: the step's parent from now on
        else:
            stack.append(epoch)
        step.parent_id = epoch.id
        self.epoch = epoch
        self.epoch_is_auto = True

    def _data_load_span(self, start_ns: int, end_ns: int) -> None:
        """A closed ``data_load`` span under the innermost open one (never pushed: it is over)."""
        local = self.threads.me
        stack = local.stack if not self.requests else (self._context_stack() or local.stack)
        if len(stack) >= self._max_depth:
            self.recorder.depth_dropped += 1
        else:
            span = OpenSpan(self._new_id(), "data_load", stack[-1].id if stack else self._session_id, None,
                            start_ns, None, local.ident, closed=True, end_ns=end_ns)
            machine = local.machine
            if machine.holding:
                machine.held.append(span)
            else:
                self._push(span)
                self._tally()
        step = local.live
        if step is not None and step.phase_ns is not None:
            step.phase_ns["data_load"] += end_ns - start_ns

    # -- steps and epochs -------------------------------------------------------------------

    def open_step(self, model: Any, attrs: dict[str, Any] | None, *, implicit: bool = False,
                  start_ns: int | None = None, local: _ThreadState | None = None,
                  by_machine: bool = False) -> OpenSpan | None:
        """Opens a step on the calling thread (``local``: its bookkeeping, when the caller has
        read it already). An implicit step opened by anyone but the step machine itself (an
        integration's ``eval_step``) is told to the machine (``by_machine``: the machine opens it,
        and makes its own transition)."""
        trap = self.trap
        if trap is not None:
            trap()
        if local is None:
            local = self.threads.me
        if not implicit:
            self.auto_steps = False  # the program marks its own steps from now on
            local.machine.take_over()
            if local.step_opts:
                local.step_opts = {}
        fetch = local.pending_fetch
        local.pending_fetch = None
        index = None if implicit else next(self.steps)
        stack = local.stack if not self.requests else (self._context_stack() or local.stack)
        if len(stack) >= self._max_depth:
            self.recorder.depth_dropped += 1
            return None
        times = _NO_PHASE_TIME.copy()
        span = OpenSpan(self._new_id(), "step", stack[-1].id if stack else self._session_id, index,
                        fetch[0] if fetch else (start_ns or _time_ns()), attrs, local.ident, None, None, times)
        stack.append(span)
        local.step = local.live = span
        local.model = model
        local.implicit = implicit
        if implicit and not by_machine:
            local.machine.opened()
        if fetch is not None:  # the adopted fetch: the step's data_load child (what _data_load_span does)
            start_ns, end_ns = fetch[0], fetch[1]
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
        local = self.threads.me
        if span is None or local.step is not span:
            return
        implicit = local.implicit
        reported = False
        if implicit:
            machine = local.machine  # StepMachine.closed(), inline: the step path's one call fewer
            done_ns = machine.done_ns
            machine.done_ns = 0
            machine.state = _IDLE
            if done_ns:  # an inferred step kept open for marks: it ended at its optimizer step
                end_ns = done_ns
        end_ns = end_ns or _time_ns()
        local.step = local.model = local.live = None
        if implicit:
            local.implicit = False
            times = span.phase_ns or _NO_PHASE_TIME
            if span.index is not None:  # numbered and reported when its optimizer step returned
                reported = True
            else:
                reported = False
                trained = times["backward"] or times["optimizer_step"]
                span.name = "step" if trained else "eval_step"
                span.index = next(self.steps) if trained else next(self.eval_steps)
        opts = local.step_opts
        if len(opts) > 1:  # several optimizers in one iteration: each named, with its time
            span.attrs = {**(span.attrs or {}), "optimizers": opts}
            local.step_opts = {}
        elif opts:
            opts.clear()  # the usual one optimizer: no new dict a step
        if self.epoch is None and local.source is not None and self.auto_epochs:
            self._open_auto_epoch(span, local)
        if error is not None:  # rare: built here, so that "error" follows the breakdown as it always has
            span.attrs = {**step_attrs(span, end_ns), "error": type(error).__name__}
            span.phase_ns = None
        stack = local.stack if not self.requests else (self._context_stack() or local.stack)
        if stack and stack[-1] is span and not span.closed:
            stack.pop()
            span.closed = True
            span.end_ns = end_ns
            self._push(span)
            self._tally()
        else:
            self.recorder.close(span, end_ns)
        if self.on_step is not None and span.index is not None and span.name == "step" and not reported:
            self.on_step(span.index + 1, span)  # the span too: the runtime's step ledger copies its times

    def finish(self) -> None:
        """At shutdown: a step still open on this thread closes as what it was, with its
        breakdown; one that ``trace_step`` opened (cut by SIGTERM or exit) is flagged unclosed.
        An automatic epoch ends here (a loop that stopped before its loader was exhausted)."""
        local = self.threads.me
        if local.ended_pass is not None:
            self._settle_pass(local)
        step = local.step
        if step is not None and not local.implicit:
            step.attrs = {**(step.attrs or {}), "unclosed": True}
            self.close_step(step, None)
        local.machine.interrupt()  # a step cut short closes as what it was (step_inference)
        fetch = local.pending_fetch
        if fetch is not None:
            local.pending_fetch = None
            self._data_load_span(fetch[0], fetch[1])
        self._close_auto_epoch()

    def close_epoch(self, span: OpenSpan) -> None:
        local = self.threads.me
        if local.ended_pass is not None:
            self._settle_pass(local)
        self.end_inferred_step()  # closed as a step with its breakdown, not as an "unclosed" child
        self.recorder.close(span)

    def open_epoch(self, index: int) -> OpenSpan | None:
        """An epoch of ``stepwatch.epochs()`` or a framework: automatic epochs stop here."""
        local = self.threads.me
        if local.ended_pass is not None:
            self._settle_pass(local)
        self.end_inferred_step()
        self.auto_epochs = False
        self._close_auto_epoch()
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
        if state is None:
            return self
        local = state.threads.me
        if local.step is None and (not state.owners or not state.yields(self.framework)):
            try:
                self._span = state.open_step(self.model, self.attrs, local=local)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.TRACE_STEP_ENTER)
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
                state.settle()
                span = state.recorder.open(self.name, attrs=dict(self.attrs) if self.attrs else None)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.SCOPE_ENTER)
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
        state.recorder.mark(name, value, kind, attrs or None)
    except Exception as exc:  # noqa: BLE001
        report_internal(exc, Site.MARK)


def epochs(n: int, *, framework: str = "torch") -> Iterator[int]:
    """``for epoch in stepwatch.epochs(3):`` — each iteration runs inside its ``epoch`` span.
    The first records the plan (``stepwatch.plan``, ``epochs`` n): the live view's total steps."""
    for index in range(n):
        state = _state
        span = None
        if index == 0 and state is not None and not state.yields(framework):
            try:
                from .program_settings import PLAN_MARK

                state.recorder.mark(PLAN_MARK, n, "summary", {"epochs": n})
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.EPOCHS)
        if state is not None and not state.yields(framework):
            try:
                span = state.open_epoch(index)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.EPOCHS)
        try:
            yield index
        finally:
            if state is not None and span is not None:
                try:
                    state.close_epoch(span)
                except Exception as exc:  # noqa: BLE001
                    report_internal(exc, Site.EPOCHS_CLOSE)


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
                report_internal(exc, Site.BATCHES_FETCH)
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
        # Like a scope, a snapshot comes after an inferred step that has ended (at its
        # optimizer step): it lands on the epoch or scope around the step, as it always has.
        state.settle()
        span = state.recorder.current()
        recorder = state.recorder
        blobs = state.blob_counts
        records, job = snapshot_model(model, span_id=recorder.format_id(span.id), mode=mode, sample_rate=sample_rate,
                                      blob_uri=state.blob_uri, ts_ns=time.time_ns(), attrs=attrs,
                                      new_id=lambda: recorder.format_id(recorder.new_id()),
                                      blob_index=blobs.get(span.id, 0))
        if job is not None:  # the span's next snapshot with blobs writes its own files
            if span.id not in blobs and len(blobs) >= 4096:
                blobs.clear()  # ids of long-closed spans: a span snapshotted again after this is rare
            blobs[span.id] = blobs.get(span.id, 0) + 1
    except ValueError:
        raise  # a wrong mode is the caller's error
    except Exception as exc:  # noqa: BLE001
        report_internal(exc, Site.SNAPSHOT)
        return 0
    state.snapshot_sink(records, job)
    return len(records)


def inference(func: F | None = None, *, name: str = "request") -> Any:
    """Each call of the decorated function is its own root ``request`` span (sync, async,
    generators and async generators). Streaming calls get ``time_to_first_token_ms``,
    ``output_tokens``, ``tokens_per_second`` and ``request_duration_ms`` marks.

    Async and streaming calls interleave with other code on one thread, so each gets its own
    open-span stack for its context (``SpanRecorder.enter_context``): its scopes, forwards and
    marks nest under its request, never under a concurrent one. A generator's body runs in its
    consumer's context, so the stack is entered around each resumption only.
    """
    if func is None:
        return functools.partial(inference, name=name)

    def begin(push: bool = False) -> tuple[OpenSpan | None, TrainingState | None]:
        state = _state
        if state is None:
            return None, None
        try:
            span = state.recorder.open(name, attrs={"request_id": uuid.uuid4().hex}, parent_id=None, root=not push)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.INFERENCE)
            return None, None
        return span, state

    def enter(span: OpenSpan | None, state: TrainingState | None) -> Any:
        if span is None or state is None:
            return None
        try:
            token = state.recorder.enter_context(span)
            with state.requests_lock:
                state.requests += 1  # the phase hot path asks for a request's stack only while > 0
            return token
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.INFERENCE_ENTER)
            return None

    def leave(state: TrainingState | None, token: Any) -> None:
        if token is not None and state is not None:
            try:
                with state.requests_lock:
                    state.requests -= 1
                state.recorder.leave_context(token)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.INFERENCE_LEAVE)

    def finish(span: OpenSpan | None, error: BaseException | None,
               stream: tuple[int, int | None] | None = None) -> None:
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
            report_internal(exc, Site.INFERENCE)

    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def agen_wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            span, owner = begin()
            chunks, first, error = 0, None, None
            token = enter(span, owner)
            try:
                inner = func(*args, **kwargs)
            finally:
                leave(owner, token)
            try:
                while True:
                    token = enter(span, owner)
                    try:
                        item = await inner.__anext__()
                    except StopAsyncIteration:
                        break
                    finally:
                        leave(owner, token)
                    if first is None:
                        first = time.time_ns()
                    chunks += 1
                    yield item
            except BaseException as exc:
                error = exc
                raise
            finally:
                token = enter(span, owner)
                try:
                    await inner.aclose()
                finally:
                    leave(owner, token)
                    finish(span, error, (chunks, first))

        return agen_wrapper

    if inspect.isgeneratorfunction(func):

        @functools.wraps(func)
        def gen_wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
            span, owner = begin()
            chunks, first, error = 0, None, None
            token = enter(span, owner)
            try:
                inner = func(*args, **kwargs)
            finally:
                leave(owner, token)
            try:
                while True:
                    token = enter(span, owner)
                    try:
                        item = next(inner)
                    except StopIteration:
                        break
                    finally:
                        leave(owner, token)
                    if first is None:
                        first = time.time_ns()
                    chunks += 1
                    yield item
            except BaseException as exc:
                error = exc
                raise
            finally:
                token = enter(span, owner)
                try:
                    inner.close()
                finally:
                    leave(owner, token)
                    finish(span, error, (chunks, first))

        return gen_wrapper

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            span, owner = begin()
            token = enter(span, owner)
            try:
                result = await func(*args, **kwargs)
            except BaseException as exc:
                leave(owner, token)
                finish(span, exc)
                raise
            leave(owner, token)
            finish(span, None)
            return result

        return async_wrapper

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        span, _owner = begin(push=True)
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            finish(span, exc)
            raise
        finish(span, None)
        return result

    return wrapper
