"""The spool records and the aggregator's wire rows of closed spans and marks, built in one pass
(``SpanRecorder.span_records`` / ``mark_records`` with ``rows``).

The one-pass rows must put on the wire exactly the bytes the columnar table of the spool records
(``transport.frames.columnar_table``, the path they replace) would, for any spans and marks: ids
formatted once and shared (a parent outside the batch, a step's marks, legacy string ids), attrs
that need cleaning or carry a lone surrogate, steps with and without a breakdown, GPU times; and
asking for the rows must not change the records. No process, no model: the recorder is fed the
rows the training thread would leave in its tables.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.capture.rank_outputs import BUILT_COLUMNAR
from stepwatch.capture.spans import MarkRow, OpenSpan, SpanRecorder
from stepwatch.transport.frames import COLUMNAR, columnar_table, decode_body, decode_typed, encode_frame

PHASE_TIMES = {"data_load": 10, "h2d": 0, "forward": 300, "backward": 500, "optimizer_step": 40, "recompute": 0}
LOSS_ATTRS = {"source": "backward root", "inferred": True}  # one dict shared by many marks, as inferred ones are
META = {"session_id": "s", "rank": 3}

texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)
plain = st.dictionaries(st.sampled_from(["k", "implicit", "step_ns", "n"]),
                        st.integers(-3, 3) | st.booleans() | texts | st.just("bad\ud800"), max_size=3)
unclean = st.dictionaries(st.just("v"), st.floats(allow_nan=True) | st.lists(st.integers(), max_size=2), min_size=1)
attrs = st.none() | st.just({}) | plain | unclean
values = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-5, 5) | st.booleans() | texts  # as mark_value leaves them


@st.composite
def batches(draw: Any) -> tuple[SpanRecorder, int]:
    """A recorder whose tables hold a few steps' spans (children before their step, as they
    close) and marks, some on spans outside the batch; returns it and how many spans it holds."""
    recorder = SpanRecorder(rank=draw(st.integers(0, 3)), rows=4096)
    outside = OpenSpan(recorder.new_id(), "epoch", recorder.session.id, 0, 1, None, 7)  # never closed here
    closed = 0
    for step_index in range(draw(st.integers(0, 4))):
        step = OpenSpan(recorder.new_id(), draw(st.sampled_from(["step", "eval_step"])), outside.id, step_index,
                        100, draw(attrs), 7, phase_ns=draw(st.none() | st.just(dict(PHASE_TIMES))))
        for name in draw(st.lists(st.sampled_from(["data_load", "forward", "backward", "user scope"]), max_size=3)):
            child = OpenSpan(recorder.new_id(), name, step.id, None, 110, draw(attrs), 7,
                             gpu=draw(st.none() | st.integers(0, 10**6)), closed=True, end_ns=120)
            recorder.closed.append(child)
            closed += 1
        for _ in range(draw(st.integers(0, 2))):
            mark_id = recorder.new_id()
            step.mark_ids = [*(step.mark_ids or []), mark_id]
            recorder.marks.append(MarkRow(mark_id, step.id, "loss", "float", draw(values), None,
                                          draw(st.sampled_from([LOSS_ATTRS, None])), 130, "point"))
        step.closed, step.end_ns = True, 200
        recorder.closed.append(step)
        closed += 1
    if draw(st.booleans()):  # a mark made before init: a legacy string id on the "root" sentinel
        recorder.marks.append(MarkRow("ab" * 16, "root", "early", "int", 1, None, None, 5, "point"))
    if draw(st.booleans()):  # a mark on the open epoch: its id is outside the batch
        recorder.marks.append(MarkRow(recorder.new_id(), outside.id, "lr", "float", 0.1, None, draw(attrs), 6, "point"))
    return recorder, closed


def encodable(records: list[Any]) -> bool:
    """Whether the records encode as they are (no lone surrogate in an attr)."""
    try:
        msgspec.json.encode(records)
    except UnicodeEncodeError:
        return False
    return True


def wire_tables(spans: list[Any], marks: list[Any], span_rows: list[Any], mark_rows: list[Any]) -> tuple[Any, Any]:
    """The tables as the columnar path built them from the records, and as the one pass built them."""
    before = {k: t for k, t in (("spans", columnar_table("spans", spans)), ("marks", columnar_table("marks", marks)))
              if t is not None}
    after = {k: {"columns": COLUMNAR[k], "rows": r} for k, r in (("spans", span_rows), ("marks", mark_rows)) if r}
    return before, after


@given(batches())
def test_one_pass_rows_put_the_columnar_tables_bytes_on_the_wire(batch: tuple[SpanRecorder, int]) -> None:
    recorder, closed = batch
    span_rows: list[Any] = []
    mark_rows: list[Any] = []
    spans = recorder.span_records(rows=span_rows)
    marks = recorder.mark_records(rows=mark_rows)
    assert len(spans) == len(span_rows) == closed
    assert len(marks) == len(mark_rows)
    before, after = wire_tables(spans, marks, span_rows, mark_rows)
    if not encodable([*spans, *marks]):
        # a lone surrogate: the columnar path could not encode the batch at all; the one pass
        # replaces it as the spool writer does, and the aggregator still gets its rows
        assert decode_body(encode_frame(META, after)[4:]).rows == len(spans) + len(marks)
        return
    assert set(before) == set(after)
    assert encode_frame(META, after) == encode_frame(META, before)
    decoded = decode_body(encode_frame(META, after)[4:])  # the rows the aggregator stores
    for kind, records in (("spans", spans), ("marks", marks)):
        spooled = msgspec.json.decode(msgspec.json.encode(records))  # as the spool's loader reads them
        assert decoded.tables.get(kind, []) == [{field: record.get(field) for field in COLUMNAR[kind]}
                                                for record in spooled]
    if after:
        assert decode_typed(encode_frame(META, after)[4:]) is not None  # the aggregator's fast path takes them


@given(batches())
def test_asking_for_the_rows_does_not_change_the_records(batch: tuple[SpanRecorder, int]) -> None:
    recorder, _ = batch
    twin = SpanRecorder(rank=recorder.rank, rows=4096)
    twin._prefix, twin._base, twin._pair = recorder._prefix, recorder._base, recorder._pair
    spans = list(recorder.closed._rows)
    marks = list(recorder.marks._rows)
    for span in spans:
        twin.closed.append(span)
    for mark in marks:
        twin.marks.append(mark)
    encoder = msgspec.json.Encoder()
    with_rows = (recorder.span_records(rows=[]), recorder.mark_records(rows=[]))
    without = (twin.span_records(), twin.mark_records())
    assert msgspec.to_builtins(with_rows) == msgspec.to_builtins(without)
    if encodable([*with_rows[0], *with_rows[1]]):
        assert encoder.encode(with_rows) == encoder.encode(without)


def test_ids_are_the_recorders_hex_and_shared_between_spans_and_marks() -> None:
    recorder = SpanRecorder(rank=0, rows=64)
    step = OpenSpan(recorder.new_id(), "step", recorder.session.id, 0, 1, None, 7, phase_ns=dict(PHASE_TIMES))
    child = OpenSpan(recorder.new_id(), "forward", step.id, None, 2, None, 7, closed=True, end_ns=3)
    mark_id = recorder.new_id()
    step.mark_ids = [mark_id]
    recorder.marks.append(MarkRow(mark_id, step.id, "loss", "float", 0.5, None, LOSS_ATTRS, 3, "point"))
    step.closed, step.end_ns = True, 4
    recorder.closed.append(child)
    recorder.closed.append(step)
    forward, written = recorder.span_records()
    (mark,) = recorder.mark_records()
    assert forward.parent_id == written.id == recorder.format_id(step.id) == mark.span_id
    assert written.mark_ids == [mark.id] == [recorder.format_id(mark_id)]
    assert msgspec.to_builtins(written.attrs) == {"step_ns": 3, **{f"{k}_ns": v for k, v in PHASE_TIMES.items()},
                                                  "wait_ns": 0}
    assert mark.attrs == LOSS_ATTRS


def test_spans_and_marks_are_the_tables_shipped_prebuilt() -> None:
    assert BUILT_COLUMNAR == ("spans", "marks")
    from stepwatch.capture.spans import MarkWireRow, SpanWireRow

    assert SpanWireRow.__struct_fields__ == COLUMNAR["spans"]
    assert MarkWireRow.__struct_fields__ == COLUMNAR["marks"]


@given(attrs, st.none() | st.fixed_dictionaries({k: st.integers(0, 10**12) for k in PHASE_TIMES}),
       st.integers(0, 10**12))
def test_a_steps_record_attrs_encode_as_the_breakdown_dict(opened: dict[str, Any] | None,
                                                           times: dict[str, int] | None, step_ns: int) -> None:
    """The Structs a plain or inferred step's attrs are made of encode to the very bytes of the
    dict spelled out: the attrs it was opened with, then step_ns, each phase's time, the residual."""
    from stepwatch.capture.spans import clean_attrs, step_attrs, step_record_attrs
    from stepwatch.phases import PHASES, RESIDUAL

    span = OpenSpan(1, "step", None, 0, 1_000, opened, 7, phase_ns=times, closed=True, end_ns=1_000 + step_ns)
    spent = dict.fromkeys(PHASE_TIMES, 0) if times is None else times
    expected = {**(clean_attrs(opened) if opened else {}), "step_ns": step_ns,
                **{p.attr: spent[p.span] for p in PHASES},
                RESIDUAL.attr: max(0, step_ns - sum(spent[p.span] for p in PHASES if p.in_residual))}
    encode = msgspec.json.Encoder().encode
    if not encodable([expected]):
        return  # a lone surrogate: the spool writer's fallback, the same either way
    assert encode(step_record_attrs(span)) == encode(step_attrs(span, span.end_ns)) == encode(expected)
