"""Step inference for loops with no ``trace_step``: one state machine per thread.

The hot path (``TrainingState.begin_phase``/``end_phase``) handles a running step itself; every
event that can open, close, split or merge a step comes here. ``docs/step-inference.md`` has the
table of loop shapes and what each becomes.

States (per thread, from ``_ThreadState``):

* **IDLE**: no inferred step open (``step is None``). A fetch waits as ``pending_fetch``; the next
  phase opens a step there (at the fetch when there is one).
* **RUNNING**: a step is open and its phases accrue to it (``live is step``).
* **DONE**: the step's optimizer step returned (``live is None``, ``done_ns`` its end). It stays
  open for the marks made after ``optimizer.step()``; phases that come now are *held* (closed
  but not spooled) until the next event says whose they are.

Modes (what ends a step, learned from the loop, per thread):

* **UNKNOWN** until the first optimizer step: a step with a backward that reaches a new
  iteration (a fetch, or a top-level forward after its backward) holds that iteration's phases:
  an optimizer step then adopts them all (gradient accumulation), anything else splits them into
  one step per iteration (``split``).
* **OPTIMIZER**: a step ends at its optimizer update. A fetch after a backward is the next
  micro-batch of the same step; another optimizer stepping in DONE joins the same step (a GAN's
  generator after its discriminator); the same optimizer again starts the next step.
* **BACKWARD**: no optimizer object (a manual ``p.data.add_(...)`` update): a step is one
  iteration, from its fetch or first forward through its backward.

Forwards with gradients off after a step (validation inside the loop) are evaluation work:
``eval_step`` spans, never part of a training step.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

from .spans import PHASES, OpenSpan

if TYPE_CHECKING:
    from .training import TrainingState, _ThreadState

UNKNOWN, OPTIMIZER, BACKWARD = 0, 1, 2
MAX_HELD = 64  # held phases before the machine decides without waiting any longer
_PHASE_SET = frozenset(PHASES)
_FWD_NONE, _FWD_EVAL, _FWD_GRAD = 0, 1, 2


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


def _push_all(state: TrainingState, spans: list[OpenSpan]) -> None:
    closed = state.recorder.closed
    for span in spans:
        closed.push(span)
        closed.tally()


def _new_step(state: TrainingState, local: _ThreadState, parent_id: Any, start_ns: int, end_ns: int,
              spans: list[OpenSpan], reparent: int) -> OpenSpan:
    """A closed step (or ``eval_step``) made after the fact from held ``spans``: their top-level
    ones (children of span ``reparent``) move under it."""
    times = own_times(spans)
    trained = bool(times["backward"] or times["optimizer_step"])
    span = OpenSpan(state.recorder.new_id(), "step" if trained else "eval_step", parent_id,
                    next(state.steps) if trained else next(state.eval_steps), start_ns, {"implicit": True},
                    local.ident, None, None, times, True, end_ns)
    for child in spans:
        if child.parent_id == reparent:
            child.parent_id = span.id
    _push_all(state, [span])
    if trained and state.on_step is not None:
        state.on_step(span.index + 1, span)
    return span


def _groups(spans: list[OpenSpan], cuts: list[int]) -> list[list[OpenSpan]]:
    """``spans`` by the iteration they started in (``cuts``: each iteration's start)."""
    groups: list[list[OpenSpan]] = [[] for _ in cuts]
    for span in spans:
        groups[max(0, bisect.bisect_right(cuts, span.start_ns) - 1)].append(span)
    return groups


def _eval_runs(local: _ThreadState, spans: list[OpenSpan], owner: int) -> list[int]:
    """Iteration starts for the phases held after a step: each top-level forward with gradients
    off (with the fetch just before it) is an evaluation iteration of its own; a run of training
    phases is one iteration."""
    top = sorted((s for s in spans if s.parent_id == owner), key=lambda s: s.start_ns)
    cuts: list[int] = []
    previous = None
    for i, span in enumerate(top):
        if span.name == "data_load":
            continue
        kind = "eval" if span.name == "forward" and span.id in local.eval_ids else "train"
        if kind == "eval" or previous != "train":
            start = top[i - 1].start_ns if i and top[i - 1].name == "data_load" else span.start_ns
            if not cuts or start > cuts[-1]:
                cuts.append(start)
        previous = kind
    return cuts or ([top[0].start_ns] if top else [])


def open_inferred(state: TrainingState, local: _ThreadState, start_ns: int | None = None) -> OpenSpan | None:
    """IDLE -> RUNNING: a step opens at the pending fetch, else at ``start_ns``, else now."""
    step = state.open_step(None, {"implicit": True}, implicit=True, start_ns=start_ns, local=local)
    local.watch = local.mode != OPTIMIZER
    local.it_fwd, local.it_bwd = _FWD_NONE, False
    if local.step_opts:
        local.step_opts = {}
    return step


def close_inferred(state: TrainingState, local: _ThreadState, end_ns: int | None = None) -> None:
    """Closes the open inferred step wherever it is: DONE resolves its held phases, RUNNING with
    held iterations splits them."""
    step = local.step
    if step is None or not local.implicit:
        if local.held:
            flush_held(state, local)
        return
    if local.live is None:
        resolve_done(state, local, reopen=False, end_ns=end_ns)
    elif local.cuts:
        split(state, local, end_ns=end_ns)
    else:
        state.close_step(step, None, end_ns=end_ns)


def flush_held(state: TrainingState, local: _ThreadState) -> None:
    """Held phases no step adopts: spooled where they ran."""
    held, local.held = local.held, []
    local.holding = False
    local.cuts = []
    local.eval_ids.clear()
    _push_all(state, held)


def resolve_done(state: TrainingState, local: _ThreadState, *, reopen: bool, end_ns: int | None = None) -> None:
    """DONE -> IDLE (or RUNNING with ``reopen``): the step closes at the end of its optimizer
    step; the phases held since become evaluation steps (gradients off) and the next step (the
    rest): kept open with ``reopen``, else closed as they are."""
    step = local.step
    assert step is not None
    held, local.held = local.held, []
    local.holding = False
    owner = step.id
    done_ns = local.done_ns
    state.close_step(step, None)
    parent_id = step.parent_id  # the step's epoch, when closing it opened one
    if not held:
        local.eval_ids.clear()
        if reopen:
            open_inferred(state, local, start_ns=done_ns)
        return
    cuts = _eval_runs(local, held, owner)
    groups = _groups(held, cuts)
    last = len(groups) - 1
    for i, group in enumerate(groups):
        top = [s for s in group if s.parent_id == owner]
        training = any(s.name == "forward" and s.id not in local.eval_ids or s.name == "backward" for s in top)
        if i == last and reopen and training:
            start = done_ns if i == 0 else cuts[i]  # contiguous with the step before it
            new = open_inferred(state, local, start_ns=start)
            if new is not None:
                for s in top:
                    s.parent_id = new.id
                times = own_times(group)
                new_times = new.phase_ns
                if new_times is not None:
                    for name, value in times.items():
                        new_times[name] += value
                if times["backward"]:
                    local.it_bwd = True
            _push_all(state, group)
            local.eval_ids.clear()
            return
        end = cuts[i + 1] if i < last else max(s.end_ns for s in group)
        _new_step(state, local, parent_id, cuts[i], end, group, owner)
        _push_all(state, group)
    local.eval_ids.clear()
    if reopen:
        open_inferred(state, local, start_ns=end_ns)


def adopt_held(state: TrainingState, local: _ThreadState) -> None:
    """DONE -> RUNNING: another optimizer of the same iteration steps; the phases held since the
    step's last optimizer step are its own."""
    step = local.step
    assert step is not None
    held, local.held = local.held, []
    local.holding = False
    times = step.phase_ns
    if times is not None:
        for name, value in own_times(held).items():
            times[name] += value
    _push_all(state, held)
    local.eval_ids.clear()
    local.live = step
    local.done_ns = 0


def split(state: TrainingState, local: _ThreadState, end_ns: int | None = None) -> None:
    """UNKNOWN mode, no optimizer step came: the held iterations are steps of their own (one per
    forward-backward iteration; ``BACKWARD`` mode from now on). The last ends at ``end_ns``."""
    step = local.step
    assert step is not None
    held, cuts = local.held, local.cuts
    local.held, local.cuts = [], []
    local.holding = False
    if local.first_times is not None:
        step.phase_ns = local.first_times
        local.first_times = None
    local.mode = BACKWARD
    owner = step.id
    state.close_step(step, None, end_ns=cuts[0])
    parent_id = step.parent_id  # the step's epoch, when closing it opened one
    groups = _groups(held, cuts)
    last = len(groups) - 1
    for i, group in enumerate(groups):
        end = cuts[i + 1] if i < last else (end_ns or max((s.end_ns for s in group), default=cuts[i]))
        _new_step(state, local, parent_id, cuts[i], end, group, owner)
        _push_all(state, group)
    local.eval_ids.clear()


def before_phase(state: TrainingState, local: _ThreadState, name: str, now: int) -> None:
    """A phase begins outside a running step, or in a step whose iterations are watched."""
    step = local.step
    if step is not None and not local.implicit:
        return  # trace_step's step: the program delimits it
    if not state.auto_steps or state.owners or (state.requests and state.recorder.context_stack() is not None):
        if local.held:
            flush_held(state, local)
        return
    if step is None:
        step = open_inferred(state, local, start_ns=now)
        if step is not None and local.watch:
            _iteration_phase(state, local, name)
        return
    if local.live is None:  # DONE: hold until the next event decides
        if len(local.held) >= MAX_HELD:
            resolve_done(state, local, reopen=True)
        else:
            local.holding = True
        return
    # RUNNING in UNKNOWN or BACKWARD mode: a top-level forward may begin the next iteration.
    stack = local.stack
    if stack and stack[-1] is step:
        if name == "forward" and (local.it_bwd or local.it_fwd == _FWD_EVAL
                                  or (local.it_fwd == _FWD_GRAD and not state.grad_enabled())):
            next_iteration(state, local, now, reopen=True)
        _iteration_phase(state, local, name)


def _iteration_phase(state: TrainingState, local: _ThreadState, name: str) -> None:
    """What a top-level phase tells about the iteration in progress."""
    if name == "backward":
        local.it_bwd = True
    elif name == "forward" and local.it_fwd != _FWD_GRAD:
        local.it_fwd = _FWD_GRAD if state.grad_enabled() else _FWD_EVAL


def next_iteration(state: TrainingState, local: _ThreadState, start_ns: int, *, reopen: bool) -> None:
    """RUNNING, not OPTIMIZER mode: the iteration in progress ended at ``start_ns``; with
    ``reopen`` the next one opens there (a forward), else at its fetch's first phase."""
    step = local.step
    assert step is not None
    times = step.phase_ns
    trained = bool(times and (times["backward"] or times["optimizer_step"])) or local.it_bwd
    if local.mode == BACKWARD or not trained or len(local.held) >= MAX_HELD:
        if local.cuts:
            split(state, local, end_ns=start_ns)  # waited long enough: no optimizer step comes
        else:
            state.close_step(step, None, end_ns=start_ns)
        if reopen:
            open_inferred(state, local, start_ns=start_ns)
    else:  # UNKNOWN: maybe gradient accumulation; held until an optimizer step or a boundary says
        if not local.cuts:
            local.first_times = dict(times) if times is not None else None
            local.holding = True
        local.cuts.append(start_ns)
    local.it_fwd, local.it_bwd = _FWD_NONE, False


def before_optimizer(state: TrainingState, local: _ThreadState, label: str) -> None:
    """An optimizer's step begins (before its phase opens)."""
    step = local.step
    if step is None or not local.implicit:
        return
    if local.live is None:  # DONE
        if label in local.step_opts:
            resolve_done(state, local, reopen=True)  # the same optimizer again: the next step
        else:
            adopt_held(state, local)  # another optimizer of the same iteration
    elif local.mode != OPTIMIZER:
        if local.cuts:  # the held micro-batches were gradient accumulation
            held, local.held = local.held, []
            local.holding = False
            local.cuts = []
            local.first_times = None
            local.eval_ids.clear()
            _push_all(state, held)
        local.mode = OPTIMIZER
        local.watch = False
    local.mode = OPTIMIZER


def on_fetch(state: TrainingState, local: _ThreadState, start_ns: int, end_ns: int) -> bool:
    """A fetch with an inferred step open. True when the fetch joined the step (a micro-batch of
    gradient accumulation), False when the step closed first."""
    step = local.step
    assert step is not None
    if local.live is None:  # DONE
        resolve_done(state, local, reopen=False)
        return False
    times = step.phase_ns
    trained = bool(times and times["backward"]) or local.it_bwd
    if trained and local.mode == OPTIMIZER:
        return True
    if trained and local.mode == UNKNOWN:
        next_iteration(state, local, start_ns, reopen=False)
        return local.step is step
    close_inferred(state, local, end_ns=start_ns)
    return False
