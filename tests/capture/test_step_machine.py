"""The step machine driven with real events (capture/step_inference.py): a ``TrainingState`` and
its ``SpanRecorder`` receive fetches, forwards, backwards and optimizer steps exactly as the torch
patches pass them, and a kill (the process ending: ``TrainingState.finish``, then the recorder's
``close_all``) may come at any point, inside a phase or between two.

Property (issue 20, section 7): no interleaving produces an ``eval_step`` out of a training step.
An ``eval_step`` never holds a backward or an optimizer step, and a step cut while a backward,
an optimizer step or a forward with gradients was running is a ``step``, flagged ``unclosed``
with the phase it was cut in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from stepwatch.capture.spans import OpenSpan, SpanRecorder
from stepwatch.capture.step_inference import Mode, StepState
from stepwatch.capture.training import TrainingState
from tests.support import examples

OPS = ("fetch", "pass", "forward", "forward_nograd", "backward", "optimizer", "optimizer2")
KILLS = ("kill", "kill_in_forward", "kill_in_forward_nograd", "kill_in_backward", "kill_in_optimizer")
_TRAINING = frozenset({"backward", "optimizer_step"})


class _Loader:
    """Stands for a DataLoader: only its identity matters to the machine (the pass it names)."""


class _Optimizer:
    """Stands for an optimizer object: the machine tells optimizers apart by identity."""


class _Loop:
    """A training thread's events, as the patches would pass them to the state."""

    def __init__(self) -> None:
        self.recorder = SpanRecorder(rank=0, rows=100_000)
        self.state = TrainingState(self.recorder, snapshot_sink=lambda records, job: None,
                                   blob_uri=lambda span_id, kind: "")
        self.grad = True
        self.state.grad_enabled = lambda: self.grad
        self.loader = _Loader()
        self.source: tuple[Any, int] | None = None
        self.optimizers = (_Optimizer(), _Optimizer())
        self.cut: list[tuple[OpenSpan, bool]] = []  # phases open at the kill, and whether they train

    def run(self, ops: list[str]) -> list[OpenSpan]:
        for op in ops:
            if op.startswith("kill"):
                self.kill(op)
                break
            self.event(op)
        else:
            self.kill("kill")
        return self.recorder.closed.drain()

    def event(self, op: str) -> None:
        state = self.state
        if op == "pass":
            self.source = (self.loader, _now())
            state.start_pass(self.source)
        elif op == "fetch":
            if self.source is None:
                self.event("pass")
            start = _now()
            state.record_fetch(start, _now(), self.source)
        elif op in ("forward", "forward_nograd"):
            self.grad = op == "forward"
            state.end_phase(state.begin_phase("forward"))
            self.grad = True
        elif op == "backward":
            local = state.local
            span = state.begin_phase("backward")
            local.in_backward = True
            local.in_backward = False
            state.end_phase(span)
        else:
            optimizer = self.optimizers[op == "optimizer2"]
            state.optimizer_pre(optimizer, (), {})
            state.optimizer_post(optimizer, (), {})

    def kill(self, op: str) -> None:
        """The process ends here: a phase may be open (its wrapper never returned)."""
        state = self.state
        if op in ("kill_in_forward", "kill_in_forward_nograd"):
            self.grad = op == "kill_in_forward"
            span = state.begin_phase("forward")
            if span is not None:
                self.cut.append((span, self.grad))
        elif op == "kill_in_backward":
            span = state.begin_phase("backward")
            state.local.in_backward = True
            if span is not None:
                self.cut.append((span, True))
        elif op == "kill_in_optimizer":
            state.optimizer_pre(self.optimizers[0], (), {})
            token = state.local.optimizer_token
            if token is not None:
                self.cut.append((token, True))
        state.finish()
        self.recorder.close_all()


def _now() -> int:
    import time

    return time.time_ns()


def _step_of(span: OpenSpan, by_id: dict[int, OpenSpan]) -> OpenSpan | None:
    parent = by_id.get(span.parent_id)  # type: ignore[arg-type]
    while parent is not None and parent.name not in ("step", "eval_step"):
        parent = by_id.get(parent.parent_id)  # type: ignore[arg-type]
    return parent


def _check(loop: _Loop, spans: list[OpenSpan]) -> None:
    by_id = {s.id: s for s in spans}
    for span in spans:
        if span.name in _TRAINING:
            step = _step_of(span, by_id)
            assert step is None or step.name == "step", (span.name, step.name, step.attrs)
    for span, trains in loop.cut:
        step = _step_of(span, by_id)
        if trains:
            assert step is not None and step.name == "step", (span.name, step and step.name)
            assert (step.attrs or {}).get("unclosed") is True
            assert (step.attrs or {}).get("phase") == span.name
    assert len({s.id for s in spans}) == len(spans)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.sampled_from(OPS), max_size=24), st.sampled_from(KILLS))
@example(["fetch", "forward"], "kill_in_backward")  # issue 20: rank 0 killed in backward's all-reduce
@example(["fetch", "forward", "backward", "optimizer", "fetch", "forward"], "kill_in_backward")
@example(["forward", "backward", "forward", "backward"], "kill_in_backward")  # UNKNOWN mode, held iterations
@example(["fetch", "forward", "backward"], "kill_in_optimizer")
@example(["optimizer", "fetch"], "kill_in_forward")
def test_no_interleaving_makes_an_eval_step_of_a_training_step(ops: list[str], kill: str) -> None:
    loop = _Loop()
    _check(loop, loop.run([*ops, kill]))


def test_killed_in_backward_the_step_is_a_training_step_cut_in_backward() -> None:
    """The issue's case, event by event: a fetch, a forward, then the process ends in backward."""
    loop = _Loop()
    spans = loop.run(["fetch", "forward", "kill_in_backward"])
    steps = [s for s in spans if s.name in ("step", "eval_step")]
    assert [(s.name, s.attrs) for s in steps] == [("step", {"implicit": True, "unclosed": True, "phase": "backward"})]


def test_a_killed_evaluation_stays_evaluation() -> None:
    """Forwards with gradients off only: what it was is evaluation."""
    loop = _Loop()
    spans = loop.run(["fetch", "forward", "backward", "optimizer", "fetch", "forward_nograd", "fetch",
                      "kill_in_forward_nograd"])
    names = [s.name for s in sorted(spans, key=lambda s: s.start_ns) if s.name in ("step", "eval_step")]
    assert names == ["step", "eval_step", "eval_step"]


def test_the_machine_holds_its_state_explicitly() -> None:
    """IDLE -> RUNNING at the first phase, DONE at the optimizer step's end, IDLE when closed."""
    loop = _Loop()
    machine = loop.state.local.machine
    assert (machine.state, machine.mode) == (StepState.IDLE, Mode.UNKNOWN)
    loop.event("fetch")
    loop.event("forward")
    assert machine.state is StepState.RUNNING
    loop.event("backward")
    loop.event("optimizer")
    assert (machine.state, machine.mode) == (StepState.DONE, Mode.OPTIMIZER)
    loop.event("fetch")
    assert machine.state is StepState.IDLE


def test_the_machine_imports_nothing_of_the_training_state() -> None:
    """No import cycle, not even for type checking: the machine knows the training state through
    its ``StepHost`` and ``ThreadBook`` protocols only."""
    import ast

    from stepwatch.capture import step_inference

    tree = ast.parse(Path(step_inference.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "training" not in imported and not any((m or "").endswith(".training") for m in imported)
