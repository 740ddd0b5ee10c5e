"""Step inference for loops with no ``trace_step``: one ``StepMachine`` per thread.

The hot path (``TrainingState.phase_begin``/``phase_end``) handles a running step itself; every
event that can open, close, split or merge a step is passed in here, and only this module moves
the machine from one state to another. ``docs/step-inference.md`` has the table of loop shapes
and what each becomes.

States (``StepState``, held in ``StepMachine.state``):

* **IDLE**: no inferred step open. A fetch waits as the thread's ``pending_fetch``; the next
  phase opens a step there (at the fetch when there is one).
* **RUNNING**: a step is open and its phases accrue to it (the thread's ``live`` is the step).
* **DONE**: the step's optimizer step returned (``live`` is None, ``done_ns`` its end). It stays
  open for the marks made after ``optimizer.step()``; phases that come now are *held* (closed
  but not spooled) until the next event says whose they are.

Modes (``Mode``, what ends a step, learned from the loop, per thread):

* **UNKNOWN** until the first optimizer step: a step with a backward that reaches a new
  iteration (a fetch, or a top-level forward after its backward) holds that iteration's phases:
  an optimizer step then adopts them all (gradient accumulation), anything else splits them into
  one step per iteration (``_split``).
* **OPTIMIZER**: a step ends at its optimizer update. A fetch after a backward is the next
  micro-batch of the same step; another optimizer stepping in DONE joins the same step (a GAN's
  generator after its discriminator); the same optimizer again starts the next step.
* **BACKWARD**: no optimizer object (a manual ``p.data.add_(...)`` update): a step is one
  iteration, from its fetch or first forward through its backward.

Forwards with gradients off after a step (validation inside the loop) are evaluation work:
``eval_step`` spans, never part of a training step. A step cut short by the end of the process
(``interrupt``) is what it was: a training step (flagged ``unclosed``, with the phase it was in)
when it had a forward with gradients, a backward or an optimizer step, begun or done.

The machine does its span bookkeeping through its ``StepHost`` (the ``TrainingState``) and its
thread's ``ThreadBook``: two protocols, so this module imports nothing of ``training.py``.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..phases import PHASES as PHASE_TABLE
from .spans import PHASES, OpenSpan, SpanRecorder

__all__ = ["MAX_HELD", "Mode", "StepHost", "StepMachine", "StepState", "ThreadBook", "own_times"]

MAX_HELD = 64  # held phases before the machine decides without waiting any longer
_PHASE_SET = frozenset(PHASES)
_TRAINING_PHASES = frozenset(p.span for p in PHASE_TABLE if p.trains)


class StepState(enum.Enum):
    """Where the thread's inferred step is (module docstring)."""

    IDLE = "idle"
    RUNNING = "running"
    DONE = "done"


class Mode(enum.Enum):
    """What ends a step in this thread's loop, as learned so far (module docstring)."""

    UNKNOWN = "unknown"
    OPTIMIZER = "optimizer"
    BACKWARD = "backward"


class _Forwards(enum.Enum):
    """The forwards of the iteration in progress."""

    NONE = 0
    EVAL = 1  # gradients off only
    GRAD = 2  # at least one with gradients


# The members as module constants: the machine compares them on every event, and a module global
# reads in a fraction of an enum class attribute's time (~40 ns against ~250, timeit).
_IDLE, _RUNNING, _DONE = StepState.IDLE, StepState.RUNNING, StepState.DONE
_UNKNOWN, _OPTIMIZER, _BACKWARD = Mode.UNKNOWN, Mode.OPTIMIZER, Mode.BACKWARD
_FWD_NONE, _FWD_EVAL, _FWD_GRAD = _Forwards.NONE, _Forwards.EVAL, _Forwards.GRAD
_IMPLICIT = {"implicit": True}  # an inferred step's attrs, shared (never changed in place: replaced)


class ThreadBook(Protocol):
    """The thread's bookkeeping the machine reads and writes besides its own (training.py's
    ``_ThreadState``): the open step, the step phases accrue to, the span stack."""

    stack: list[OpenSpan]
    ident: int
    step: OpenSpan | None
    live: OpenSpan | None
    implicit: bool
    in_backward: bool
    module_id: int
    optimizer_token: Any
    step_opts: dict[str, int]


class StepHost(Protocol):
    """What the machine asks of the training state (training.py's ``TrainingState``)."""

    recorder: SpanRecorder
    steps: itertools.count[int]
    eval_steps: itertools.count[int]
    on_step: Callable[[int, OpenSpan], None] | None
    auto_steps: bool
    owners: set[str]
    requests: int
    grad_enabled: Callable[[], bool]

    def open_step(self, model: Any, attrs: dict[str, Any] | None, *, implicit: bool = False,
                  start_ns: int | None = None, local: Any = None, by_machine: bool = False) -> OpenSpan | None: ...

    def close_step(self, span: OpenSpan | None, error: BaseException | None, *,
                   end_ns: int | None = None) -> None: ...


def own_times(spans: list[OpenSpan]) -> dict[str, int]:
    """Each phase's own time over ``spans`` (closed): a phase nested in another one counts once,
    as itself, and not again in its parent (a forward in an optimizer's closure, a recompute in
    backward)."""
    times = dict.fromkeys(PHASES, 0)
    by_id = {s.id: s for s in spans}
    for span in spans:
        if span.name not in _PHASE_SET:
            continue
        duration = span.end_ns - span.start_ns
        times[span.name] += duration
        parent = by_id.get(span.parent_id)  # type: ignore[arg-type]
        if parent is not None and parent.name in _PHASE_SET:
            times[parent.name] -= duration
    return times


def _groups(spans: list[OpenSpan], cuts: list[int]) -> list[list[OpenSpan]]:
    """``spans`` by the iteration they started in (``cuts``: each iteration's start)."""
    groups: list[list[OpenSpan]] = [[] for _ in cuts]
    for span in spans:
        groups[max(0, bisect.bisect_right(cuts, span.start_ns) - 1)].append(span)
    return groups


class StepMachine:
    """One thread's step inference: its state, its mode and everything held while a step's
    extent is undecided. The training state passes events in (``phase``, ``fetch``,
    ``optimizer``, ``optimizer_done``, ``close``, ``settle``, ``interrupt``, ``take_over``) and
    tells it of steps opened and closed elsewhere (``opened``, ``closed``); every transition of
    ``state`` happens in a method of this class.

    ``watch`` and ``holding`` are what the hot path reads: ``watch`` sends a running step's
    phases here too (its iterations are watched), ``holding`` makes ``phase_end`` hand closed
    phases to ``held`` instead of spooling them."""

    __slots__ = ("host", "local", "state", "mode", "watch", "holding", "held", "cuts", "first_times", "eval_ids",
                 "forward_modules", "it_fwd", "it_module", "it_bwd", "done_ns")

    def __init__(self, host: StepHost, local: ThreadBook) -> None:
        self.host = host
        self.local = local
        self.state = _IDLE
        self.mode = _UNKNOWN
        self.watch = False
        self.holding = False
        self.held: list[OpenSpan] = []
        self.cuts: list[int] = []  # starts of the held iterations of the open step (UNKNOWN mode)
        self.first_times: dict[str, int] | None = None  # the open step's times before its held iterations
        self.eval_ids: set[int] = set()  # held forwards that ran with gradients off
        self.forward_modules: dict[int, int] = {}  # held top-level forward -> id() of its module
        self.it_fwd = _FWD_NONE
        self.it_module = 0  # id() of the module of the iteration's first forward, gradients off
        self.it_bwd = False
        self.done_ns = 0  # DONE: the end of the step's optimizer step

    # -- notifications from the training state -------------------------------------------------

    def opened(self) -> None:
        """An inferred step opened (by this machine, or as an integration's ``eval_step``)."""
        self.state = _RUNNING

    def closed(self) -> int:
        """The inferred step closed; returns where it ended when it was DONE (else 0).
        ``TrainingState.close_step`` does the same inline (one call fewer a step)."""
        done_ns, self.done_ns = self.done_ns, 0
        self.state = _IDLE
        return done_ns

    def take_over(self) -> None:
        """``trace_step`` opens a step: the program delimits its steps from now on; an inferred
        step still open closes, held phases go where they ran."""
        if self.local.step is not None and self.local.implicit:
            self.close()
        if self.held:
            self.flush()
        self.watch = False

    # -- events ------------------------------------------------------------------------------------

    def phase(self, name: str, now: int) -> None:
        """A phase begins outside a running step, or in a step whose iterations are watched."""
        host, local = self.host, self.local
        step = local.step
        if step is not None and not local.implicit:
            return  # trace_step's step: the program delimits it
        if not host.auto_steps or host.owners or (host.requests and host.recorder.context_stack() is not None):
            if self.held:
                self.flush()
            return
        state = self.state
        if state is _IDLE:  # IDLE -> RUNNING: ``_open`` inline (the first phase of every step)
            step = host.open_step(None, _IMPLICIT, implicit=True, start_ns=now, local=local, by_machine=True)
            if step is not None:
                self.state = _RUNNING
            self.watch = watch = self.mode is not _OPTIMIZER
            self.it_fwd, self.it_bwd = _FWD_NONE, False
            if local.step_opts:
                local.step_opts = {}
            if step is not None and watch:
                self._iteration_phase(name)
            return
        if state is _DONE:  # hold until the next event decides
            if len(self.held) >= MAX_HELD:
                self._resolve_done(reopen=True)
            else:
                self.holding = True
            return
        # RUNNING in UNKNOWN or BACKWARD mode: a top-level forward may begin the next iteration:
        # after a backward, or after a forward of the same module with gradients off (evaluation,
        # one forward an iteration). A forward with gradients off after one with them waits for
        # what follows (a backward makes it all one training iteration); and a frozen network's
        # forward with gradients off (a teacher's, a target network's) is the iteration's own.
        stack = local.stack
        if stack and stack[-1] is step:
            if name == "forward" and (self.it_bwd or (self.it_fwd is _FWD_EVAL and local.module_id == self.it_module)):
                self._next_iteration(now, reopen=True)
            self._iteration_phase(name)

    def forward_opened(self, span: OpenSpan) -> None:
        """A top-level forward opened on the slow path, a step open, with gradients off or held
        after a step's optimizer step: with gradients off, evaluation work if it comes between
        training steps (``_eval_runs`` says, from the modules of the forwards held beside it)."""
        self.forward_modules[span.id] = self.local.module_id
        if not self.host.grad_enabled():
            self.eval_ids.add(span.id)

    def _forget_forwards(self) -> None:
        """The held forwards are decided: what was kept of them goes."""
        self.eval_ids.clear()
        self.forward_modules.clear()

    def optimizer(self, label: str) -> None:
        """An optimizer's step begins (before its phase opens); ``label`` names the optimizer.
        Not called in OPTIMIZER mode outside DONE, where it changes nothing
        (``TrainingState.optimizer_pre``)."""
        host, local = self.host, self.local
        if local.step is None:
            self.mode = _OPTIMIZER
            return
        if not local.implicit or not host.auto_steps or host.owners:
            return
        if self.state is _DONE:
            if label in local.step_opts:
                self._resolve_done(reopen=True)  # the same optimizer again: the next step
            else:
                self._adopt_held()  # another optimizer of the same iteration
        elif self.mode is not _OPTIMIZER:
            if self.cuts:  # the held micro-batches were gradient accumulation
                held, self.held = self.held, []
                self.holding = False
                self.cuts = []
                self.first_times = None
                self._forget_forwards()
                self._push_all(held)
            self.watch = False
        self.mode = _OPTIMIZER

    def optimizer_done(self, step: OpenSpan, end_ns: int) -> None:
        """RUNNING -> DONE: the inferred step's optimizer step returned at ``end_ns``. The step ends
        here but stays open for the marks made after ``optimizer.step()``; the next event decides
        what follows. It is done: numbered and reported now (heartbeat, step ledger), not when it
        closes, which a killed rank may never reach. ``TrainingState.phase_end`` does the same
        inline (one call fewer a step): a change here goes there too."""
        host = self.host
        self.local.live = None
        self.state = _DONE
        self.done_ns = step.end_ns = end_ns
        if step.index is None:
            step.index = next(host.steps)
        if host.on_step is not None:
            host.on_step(step.index + 1, step)

    def fetch(self, start_ns: int) -> bool:
        """A fetch with an inferred step open. True when the fetch joined the step (a micro-batch
        of gradient accumulation), False when the step closed first."""
        step = self.local.step
        assert step is not None
        if self.state is _DONE:  # nothing held: TrainingState.record_fetch closed it inline
            self._resolve_done(reopen=False)
            return False
        times = step.phase_ns
        trained = bool(times and times["backward"]) or self.it_bwd
        if trained and self.mode is _OPTIMIZER:
            return True
        if trained and self.mode is _UNKNOWN:
            self._next_iteration(start_ns, reopen=False)
            return self.local.step is step
        self.close(end_ns=start_ns)
        return False

    def close(self, end_ns: int | None = None) -> None:
        """Closes the open inferred step wherever it is: DONE resolves its held phases, RUNNING
        with held iterations splits them."""
        local = self.local
        step = local.step
        if step is None or not local.implicit:
            if self.held:
                self.flush()
            return
        if self.state is _DONE:
            self._resolve_done(reopen=False, end_ns=end_ns)
        elif self.cuts:
            self._split(end_ns=end_ns)
        else:
            self.host.close_step(step, None, end_ns=end_ns)

    def settle(self) -> None:
        """Before a scope, an epoch or a snapshot: the inferred step that ended at its optimizer
        step closes (a scope must not nest in it) and held phases are resolved."""
        local = self.local
        if self.state is _DONE and local.implicit:
            self._resolve_done(reopen=False)
        elif self.held and local.step is None:
            self.flush()

    def interrupt(self) -> None:
        """The process ends with the inferred step still running (a kill, a stop in the middle of
        a step): it closes as what it was, never as evaluation it was not. A training step (a
        forward with gradients, a backward or an optimizer step, begun or done) is flagged
        ``unclosed``, with ``phase`` the phase it was cut in, and numbered but not reported as a
        completed step. Only a step with nothing but forwards with gradients off is an
        ``eval_step``; one with no forward yet (a fetch, a copy) is taken for a training step."""
        local = self.local
        step = local.step
        stack = local.stack
        above = stack[stack.index(step) + 1:] if step is not None and step in stack else []
        if step is None or not local.implicit or (self.state is _DONE and not above):
            self.close()
            return
        open_phases = {s.name for s in above}
        grad = self.host.grad_enabled()
        running = self.state is _RUNNING
        # the step's times hold every held iteration's: with iterations held, the last one's own
        # flags say what it was (an evaluation after a manual update's training is no training)
        times = step.phase_ns if running and not self.cuts else None
        trained = (local.in_backward or local.optimizer_token is not None
                   or bool(_TRAINING_PHASES.intersection(open_phases)) or ("forward" in open_phases and grad)
                   or (running and (self.it_bwd or self.it_fwd is _FWD_GRAD))
                   or bool(times and (times["backward"] or times["optimizer_step"] or times["recompute"])))
        evaluation = ((running and (self.it_fwd is _FWD_EVAL or bool(self.eval_ids)))
                      or ("forward" in open_phases and not grad))
        cut: dict[str, Any] | None = None
        if trained or not evaluation:
            phase = next((s.name for s in reversed(above) if s.name in _PHASE_SET), None)
            cut = {"unclosed": True, **({"phase": phase} if phase is not None else {})}
        if self.cuts or not running:
            # Phases held after the step: those still open belong to the last iteration, the one
            # cut short; they close now and are held with it.
            now = time.time_ns()
            for span in reversed(above):
                stack.remove(span)
                span.closed = True
                span.end_ns = now
                span.attrs = {**(span.attrs or {}), "unclosed": True}
                self.held.append(span)
            if running:
                self._split(interrupted=cut)
            else:
                self._resolve_done(reopen=False, interrupted=cut)
            return
        if cut is not None:
            step.attrs = {**(step.attrs or {}), **cut}
            step.name = "step"
            if step.index is None:  # numbered, never reported as a completed step
                step.index = next(self.host.steps)
        self.host.close_step(step, None)

    def flush(self) -> None:
        """Held phases no step adopts: spooled where they ran."""
        held, self.held = self.held, []
        self.holding = False
        self.cuts = []
        self._forget_forwards()
        self._push_all(held)

    # -- transitions ---------------------------------------------------------------------------------

    def _open(self, start_ns: int | None = None) -> OpenSpan | None:
        """IDLE -> RUNNING: a step opens at the pending fetch, else at ``start_ns``, else now.
        ``phase`` does the same inline: a change here goes there too."""
        step = self.host.open_step(None, _IMPLICIT, implicit=True, start_ns=start_ns, local=self.local,
                                   by_machine=True)
        if step is not None:
            self.state = _RUNNING
        self.watch = self.mode is not _OPTIMIZER
        self.it_fwd, self.it_bwd = _FWD_NONE, False
        if self.local.step_opts:
            self.local.step_opts = {}
        return step

    def _resolve_done(self, *, reopen: bool, end_ns: int | None = None,
                      interrupted: dict[str, Any] | None = None) -> None:
        """DONE -> IDLE (or RUNNING with ``reopen``): the step closes at the end of its optimizer
        step; the phases held since become evaluation steps (gradients off) and the next step (the
        rest): kept open with ``reopen``, else closed as they are (``interrupted``: the last was
        cut short, a training step with these attrs)."""
        step = self.local.step
        assert step is not None
        held, self.held = self.held, []
        self.holding = False
        owner = step.id
        done_ns = self.done_ns
        self.host.close_step(step, None)
        parent_id = step.parent_id  # the step's epoch, when closing it opened one
        if not held:
            self._forget_forwards()
            if reopen:
                self._open(start_ns=done_ns)
            return
        cuts = self._eval_runs(held, owner)
        groups = _groups(held, cuts)
        last = len(groups) - 1
        for i, group in enumerate(groups):
            top = [s for s in group if s.parent_id == owner]
            training = any(s.name == "forward" and s.id not in self.eval_ids or s.name == "backward" for s in top)
            if i == last and reopen and training:
                start = done_ns if i == 0 else cuts[i]  # contiguous with the step before it
                new = self._open(start_ns=start)
                if new is not None:
                    for s in top:
                        s.parent_id = new.id
                    times = own_times(group)
                    new_times = new.phase_ns
                    if new_times is not None:
                        for name, value in times.items():
                            new_times[name] += value
                    if times["backward"]:
                        self.it_bwd = True
                self._push_all(group)
                self._forget_forwards()
                return
            end = cuts[i + 1] if i < last else max(s.end_ns for s in group)
            self._new_step(parent_id, cuts[i], end, group, owner, interrupted if i == last else None)
            self._push_all(group)
        self._forget_forwards()
        if reopen:
            self._open(start_ns=end_ns)

    def _adopt_held(self) -> None:
        """DONE -> RUNNING: another optimizer of the same iteration steps; the phases held since the
        step's last optimizer step are its own."""
        step = self.local.step
        assert step is not None
        held, self.held = self.held, []
        self.holding = False
        times = step.phase_ns
        if times is not None:
            for name, value in own_times(held).items():
                times[name] += value
        self._push_all(held)
        self._forget_forwards()
        self.local.live = step
        self.done_ns = 0
        self.state = _RUNNING

    def _split(self, end_ns: int | None = None, interrupted: dict[str, Any] | None = None) -> None:
        """UNKNOWN mode, no optimizer step came: the held iterations are steps of their own (one per
        forward-backward iteration; ``BACKWARD`` mode from now on). The last ends at ``end_ns``;
        ``interrupted``: it was cut short (``interrupt``), a training step with these attrs."""
        step = self.local.step
        assert step is not None
        held, cuts = self.held, self.cuts
        self.held, self.cuts = [], []
        self.holding = False
        if self.first_times is not None:
            step.phase_ns = self.first_times
            self.first_times = None
        self.mode = _BACKWARD
        owner = step.id
        self.host.close_step(step, None, end_ns=cuts[0])
        parent_id = step.parent_id  # the step's epoch, when closing it opened one
        groups = _groups(held, cuts)
        last = len(groups) - 1
        for i, group in enumerate(groups):
            end = cuts[i + 1] if i < last else (end_ns or max((s.end_ns for s in group), default=cuts[i]))
            self._new_step(parent_id, cuts[i], end, group, owner, interrupted if i == last else None)
            self._push_all(group)
        self._forget_forwards()

    def _next_iteration(self, start_ns: int, *, reopen: bool) -> None:
        """RUNNING, not OPTIMIZER mode: the iteration in progress ended at ``start_ns``; with
        ``reopen`` the next one opens there (a forward), else at its fetch's first phase."""
        step = self.local.step
        assert step is not None
        times = step.phase_ns
        trained = bool(times and (times["backward"] or times["optimizer_step"])) or self.it_bwd
        if self.mode is _BACKWARD or not trained or len(self.held) >= MAX_HELD:
            if self.cuts:
                self._split(end_ns=start_ns)  # waited long enough: no optimizer step comes
            else:
                self.host.close_step(step, None, end_ns=start_ns)
            if reopen:
                self._open(start_ns=start_ns)
        else:  # UNKNOWN: maybe gradient accumulation; held until an optimizer step or a boundary says
            if not self.cuts:
                self.first_times = dict(times) if times is not None else None
                self.holding = True
            self.cuts.append(start_ns)
        self.it_fwd, self.it_bwd = _FWD_NONE, False

    def _iteration_phase(self, name: str) -> None:
        """What a top-level phase tells about the iteration in progress."""
        if name == "backward":
            self.it_bwd = True
        elif name == "forward" and self.it_fwd is not _FWD_GRAD:
            if self.host.grad_enabled():
                self.it_fwd = _FWD_GRAD
            elif self.it_fwd is _FWD_NONE:
                self.it_fwd, self.it_module = _FWD_EVAL, self.local.module_id

    def _frozen(self, top: list[OpenSpan], i: int) -> bool:
        """Whether ``top[i]``, a forward with gradients off, is a frozen network's inside a
        training iteration: next to it, with only forwards between, a forward with gradients
        of another module (a distillation's teacher before or after its student)."""
        module = self.forward_modules.get(top[i].id)
        for way in (-1, 1):
            j = i + way
            while 0 <= j < len(top) and top[j].name == "forward":
                other = top[j].id
                if other not in self.eval_ids and self.forward_modules.get(other, module) != module:
                    return True
                j += way
        return False

    # -- spans made after the fact -------------------------------------------------------------

    def _push_all(self, spans: list[OpenSpan]) -> None:
        closed = self.host.recorder.closed
        for span in spans:
            closed.push(span)
            closed.tally()

    def _new_step(self, parent_id: Any, start_ns: int, end_ns: int, spans: list[OpenSpan], reparent: int,
                  interrupted: dict[str, Any] | None = None) -> OpenSpan:
        """A closed step (or ``eval_step``) made after the fact from held ``spans``: their top-level
        ones (children of span ``reparent``) move under it. ``interrupted``: a training step cut
        short, with these attrs, numbered but not reported as completed."""
        host = self.host
        times = own_times(spans)
        trained = interrupted is not None or bool(times["backward"] or times["optimizer_step"])
        span = OpenSpan(host.recorder.new_id(), "step" if trained else "eval_step", parent_id,
                        next(host.steps) if trained else next(host.eval_steps), start_ns,
                        {"implicit": True, **(interrupted or {})}, self.local.ident, None, None, times, True, end_ns)
        for child in spans:
            if child.parent_id == reparent:
                child.parent_id = span.id
        self._push_all([span])
        if trained and interrupted is None and host.on_step is not None:
            host.on_step(span.index + 1, span)
        return span

    def _eval_runs(self, spans: list[OpenSpan], owner: int) -> list[int]:
        """Iteration starts for the phases held after a step: each top-level forward with gradients
        off (with the fetch just before it) is an evaluation iteration of its own; a run of training
        phases is one iteration."""
        top = sorted((s for s in spans if s.parent_id == owner), key=lambda s: s.start_ns)
        cuts: list[int] = []
        previous = None
        for i, span in enumerate(top):
            if span.name == "data_load":
                continue
            kind = "eval" if span.name == "forward" and span.id in self.eval_ids and not self._frozen(top, i) else "train"
            if kind == "eval" or previous != "train":
                start = top[i - 1].start_ns if i and top[i - 1].name == "data_load" else span.start_ns
                if not cuts or start > cuts[-1]:
                    cuts.append(start)
            previous = kind
        return cuts or ([top[0].start_ns] if top else [])
