"""The sampler's inferred marks written as columns (``InferredMetrics._resolve_host`` ->
``SpanRecorder.inferred`` -> ``mark_records``), against the one-at-a-time path they skip
(``_resolve_each``: ``mark_value``, a ``MarkRow`` each, the marks table): for any values,
spans and attrs, the spool batch the writer seals reads back through today's loader
(``read_spool``) to the same spans and marks, and the aggregator gets the same rows. And a
step's spool record lists the loss its backward left, when both are written in the same tick.

No process, no model: the recorder is fed what the training thread leaves (closed spans, the
pending values of ``backward()``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.artifacts.spool import SpoolWriter, read_spool
from stepwatch.capture.inferred_metrics import LOSS_ATTRS, InferredMetrics
from stepwatch.capture.spans import OpenSpan, SpanRecorder
from stepwatch.capture.spool_seal import SpoolSealer
from stepwatch.capture.tables import BoundedTable
from stepwatch.transport.frames import COLUMNAR, decode_body, encode_frame
from tests.support import examples

PHASE_TIMES = {"data_load": 10, "h2d": 0, "forward": 300, "backward": 500, "optimizer_step": 40, "recompute": 0}
NORM_ATTRS = {"source": "clip_grad_norm_", "inferred": True}
META = {"session_id": "s", "rank": 0}

values = (st.floats(allow_nan=False, allow_infinity=False)
          | st.floats(allow_nan=True, allow_infinity=True)  # non-finite ones: the loop decides
          | st.integers(-5, 5) | st.booleans())


@st.composite
def steps(draw: Any) -> tuple[list[tuple[int, int, list[tuple[str, Any, dict[str, Any]]], Any]], bool]:
    """A few steps (children, a time, the values their backward left: name, value, attrs, and
    the attrs the step was opened with); whether one value goes on the session span; and where a
    span with no parent closes in the batch (none, first, last: it takes the loop from there)."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        children = draw(st.integers(0, 3))
        marks = draw(st.lists(st.tuples(st.sampled_from(["loss", "grad_norm"]), values,
                                        st.sampled_from([LOSS_ATTRS, NORM_ATTRS])), max_size=2))
        opened = draw(st.sampled_from([None, {"implicit": True}, {"epoch": 2}]))
        out.append((children, draw(st.integers(0, 10**6)), marks, opened))
    return out, draw(st.booleans()), draw(st.sampled_from(["", "first", "last"]))


def feed(recorder: SpanRecorder, metrics: InferredMetrics, drawn: tuple[list[Any], bool, str]) -> None:
    """The closed spans and pending values a training thread would leave, in close order."""
    plan, on_session, root = drawn
    epoch = recorder.open("epoch", index=0, parent_id=recorder.session.id, root=True)
    assert epoch is not None
    if root == "first":
        recorder.close(recorder.open("warm-up", parent_id=None, root=True, start_ns=50), 60)
    for index, (children, ts, marks, opened) in enumerate(plan):
        step = OpenSpan(recorder.new_id(), "step", epoch.id, index, 100, opened, 7, phase_ns=dict(PHASE_TIMES))
        for _ in range(children):
            recorder.closed.append(OpenSpan(recorder.new_id(), "forward", step.id, None, 110, None, 7, closed=True,
                                            end_ns=120))
        for name, value, attrs in marks:
            metrics.pending.append((step, name, value, 1_000 + ts, attrs))
        step.closed, step.end_ns = True, 200
        recorder.closed.append(step)
    if on_session:
        metrics.pending.append((recorder.session, "loss", 0.5, 5, LOSS_ATTRS))
    if root == "last":
        recorder.close(recorder.open("cool-down", parent_id=None, root=True, start_ns=300), 310)


def seal(tmp: Path, drawn: tuple[list[Any], bool, str], *, columns: bool) -> tuple[Any, list[bytes]]:
    """One seal of a fresh recorder fed ``drawn``, by the column path or (``columns`` False) the
    loop: what ``read_spool`` reads back, with the recorder's ids made comparable, and the
    frames the aggregator would get."""
    recorder = SpanRecorder(rank=0, rows=4096)
    recorder._prefix, recorder._base = "ab" * 8, int("ab" * 8, 16) << 64  # the same ids in both runs
    recorder._pair[0] = recorder._base >> 64
    metrics = InferredMetrics(recorder, None)
    if not columns:
        metrics._resolve_host = lambda taken: 0  # type: ignore[method-assign]
    recorder.before_marks = metrics.resolve
    feed(recorder, metrics, drawn)
    frames: list[bytes] = []

    def wire(kind: str, rows: list[Any]) -> None:
        if rows:
            frames.append(encode_frame(META, {kind: {"columns": COLUMNAR[kind], "rows": rows}
                                              if kind in ("spans", "marks") else rows}))

    spool = SpoolWriter(tmp / ("columns" if columns else "loop"), sdk_version="0.1.0")
    SpoolSealer(recorder, BoundedTable("snapshots", 8), spool, tmp, gpu_timer=lambda: None, wire=wire).seal()
    loaded = read_spool(spool.root, strict=True)
    return loaded, frames


@settings(max_examples=examples(60), deadline=None)
@given(steps())
def test_the_column_path_writes_what_the_loop_writes(tmp_path_factory: Any, drawn: tuple[list[Any], bool, str]) -> None:
    tmp = tmp_path_factory.mktemp("inferred")
    by_columns, frames_columns = seal(tmp, drawn, columns=True)
    by_loop, frames_loop = seal(tmp, drawn, columns=False)
    assert msgspec.to_builtins(by_columns.spans) == msgspec.to_builtins(by_loop.spans)
    key = (lambda mark: (mark["ts_ns"], mark["name"], mark["id"]))  # noqa: E731 - the same marks, any order
    assert sorted(by_columns.marks, key=key) == sorted(by_loop.marks, key=key)

    def rows(frames: list[bytes]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for frame in frames:
            for kind, table in decode_body(frame[4:]).tables.items():
                out.setdefault(kind, []).extend(table)
        out["marks"] = sorted(out.get("marks", []), key=key)
        return out

    assert rows(frames_columns) == rows(frames_loop)


@given(steps())
@settings(max_examples=30, deadline=None)
def test_a_steps_record_lists_the_values_its_backward_left(tmp_path_factory: Any,
                                                            drawn: tuple[list[Any], bool, str]) -> None:
    loaded, _ = seal(tmp_path_factory.mktemp("listed"), drawn, columns=True)
    marks = {mark["id"]: mark for mark in loaded.marks}
    steps_by_id = {span["id"]: span for span in loaded.spans if span["name"] == "step"}
    plan, _, _ = drawn
    listed = [mark_id for span in steps_by_id.values() for mark_id in span["mark_ids"]]
    assert len(listed) == sum(len(marks_of) for _, _, marks_of, _ in plan)
    for mark_id in listed:
        assert marks[mark_id]["span_id"] in steps_by_id
    for step in steps_by_id.values():  # every mark on a step is in that step's mark_ids, and its breakdown
        assert sorted(step["mark_ids"]) == sorted(m["id"] for m in loaded.marks if m["span_id"] == step["id"])
        assert step["attrs"]["step_ns"] == 100 and step["attrs"]["forward_ns"] == PHASE_TIMES["forward"]


def test_finite_losses_take_the_column_path_and_anything_else_the_loop() -> None:
    recorder = SpanRecorder(rank=0, rows=64)
    metrics = InferredMetrics(recorder, None)
    step = OpenSpan(recorder.new_id(), "step", recorder.session.id, 0, 1, {"implicit": True}, 7,
                    phase_ns=dict(PHASE_TIMES))
    metrics.pending.append((step, "loss", 0.5, 3, LOSS_ATTRS))
    assert metrics.resolve() == 1
    assert len(recorder.inferred) == 1 and recorder.marks.appended == 0
    assert step.mark_ids is None and list(recorder.step_marks) == [step.id]  # no list made for the step
    metrics.pending.append((step, "loss", float("nan"), 4, LOSS_ATTRS))
    assert metrics.resolve() == 1
    assert len(recorder.inferred) == 1 and recorder.marks.appended == 1  # the loop: nan is written as null
    (row,) = recorder.marks.drain()
    assert (row.value, row.nonfinite) == (None, "nan") and step.mark_ids == [row.id]


def test_losses_of_steps_never_written_do_not_pile_up() -> None:
    """A step evicted from a full table is never written: its loss's entry is never taken out.
    Past the bound the entries go, and the losses are still written (listed by no step)."""
    from stepwatch.capture import inferred_metrics

    recorder = SpanRecorder(rank=0, rows=64)
    metrics = InferredMetrics(recorder, None)
    recorder.step_marks.update((-i, i) for i in range(1, inferred_metrics._STEP_MARKS_MAX + 1))
    step = OpenSpan(recorder.new_id(), "step", recorder.session.id, 0, 1, None, 7, phase_ns=dict(PHASE_TIMES))
    metrics.pending.append((step, "loss", 0.5, 3, LOSS_ATTRS))
    assert metrics.resolve() == 1
    assert recorder.step_marks == {step.id: recorder.inferred[0].ids[0]}
