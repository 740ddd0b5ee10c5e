"""The trace's event builders: ``Lanes`` keeps every thread track properly nested whatever the
spans, and the microsecond floors keep nesting and order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.exports.trace_events import Lanes, complete, counter, instant, to_us
from tests.support.trace_format import format_problems, nesting_problems

intervals = st.lists(st.tuples(st.integers(0, 10**7), st.integers(0, 10**7)).map(lambda t: (min(t), max(t))),
                     max_size=60)


@given(intervals)
def test_lanes_keep_each_lane_nested_and_use_one_lane_for_a_nested_set(spans: list[tuple[int, int]]) -> None:
    spans.sort(key=lambda s: (s[0], -s[1]))
    lanes = Lanes()
    events = [complete("s", "scope", 1, lanes.place(start, end), start * 1000, end * 1000, 0) for start, end in spans]
    assert nesting_problems(events) == []
    assert lanes.count == len({e["tid"] for e in events})
    if not nesting_problems([complete("s", "scope", 1, 0, a * 1000, b * 1000, 0) for a, b in spans]):
        assert lanes.count <= 1  # nothing overlaps without nesting: no second lane


def test_lanes_refuse_intervals_out_of_order() -> None:
    lanes = Lanes()
    lanes.place(5, 10)
    with pytest.raises(ValueError, match="by start"):
        lanes.place(4, 6)
    with pytest.raises(ValueError, match="longest first"):
        lanes.place(5, 11)


@given(st.integers(-10**15, 10**15), st.integers(0, 10**12), st.integers(0, 10**12), st.integers(0, 10**12))
def test_flooring_to_microseconds_keeps_a_child_inside_its_parent(origin: int, start: int, lead: int,
                                                                   length: int) -> None:
    parent_start, child_start = origin + start, origin + start + lead
    child_end = child_start + length
    parent_end = child_end + lead  # the parent holds the child
    parent = complete("p", "step", 1, 1, parent_start, parent_end, origin)
    child = complete("c", "phase", 1, 1, child_start, child_end, origin)
    assert parent["ts"] <= child["ts"] and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"]
    assert parent["ts"] == to_us(parent_start, origin) and parent["ts"] + parent["dur"] == to_us(parent_end, origin)


def test_each_builder_writes_its_phases_required_fields() -> None:
    events = [complete("step 1", "step", 1, 1, 5_000, 9_000, 0, {"index": 1}), instant("stop", "marker", 1, 0, 7_000, 0, "p"),
              counter("RSS", 1, 8_000, 0, "bytes", 1 << 30)]
    assert format_problems({"traceEvents": events}) == []
    assert events[0]["ts"] == 5 and events[0]["dur"] == 4 and events[1]["s"] == "p"
    with pytest.raises(ValueError, match="scope"):
        instant("x", "mark", 1, 0, 0, 0, "q")
