"""The min/max downsampler: properties over any series (hypothesis), and the spike a mean would hide."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.views.downsample import MIN_BUCKETS, bucket_width, minmax, points_budget

_values = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False)


@st.composite
def series(draw: st.DrawFn) -> tuple[list[int], list[float], int]:
    xs = sorted(draw(st.lists(st.integers(-10**6, 10**6), max_size=400)))
    ys = draw(st.lists(_values, min_size=len(xs), max_size=len(xs)))
    return xs, ys, draw(st.integers(1, 60))


@given(series())
def test_minmax_keeps_only_input_points_in_order_within_the_budget(data: tuple[list[int], list[float], int]) -> None:
    xs, ys, buckets = data
    ox, oy = minmax(xs, ys, buckets)
    assert len(ox) == len(oy) <= max(len(xs), 0) and len(ox) <= max(2 * buckets, len(xs) if len(xs) <= 2 * buckets else 0)
    pairs = list(zip(xs, ys))
    assert all(p in pairs for p in zip(ox, oy))
    assert ox == sorted(ox)
    if xs:
        assert min(oy) == min(ys) and max(oy) == max(ys)  # the spikes survive
    if len(xs) <= 2 * buckets:
        assert (ox, oy) == (xs, ys)


@given(series())
def test_every_bucket_keeps_its_extremes(data: tuple[list[int], list[float], int]) -> None:
    xs, ys, buckets = data
    if len(xs) <= 2 * buckets:
        return
    ox, oy = minmax(xs, ys, buckets)
    span = xs[-1] - xs[0]
    index = [min(buckets - 1, int((x - xs[0]) * buckets / span)) if span else 0 for x in xs]
    kept = list(zip(ox, oy))
    for b in set(index):
        members = [y for y, i in zip(ys, index) if i == b]
        out = [y for (x, y) in kept if (min(buckets - 1, int((x - xs[0]) * buckets / span)) if span else 0) == b]
        assert min(out) == min(members) and max(out) == max(members)


def test_one_spike_in_20000_steps_survives_a_1000_point_chart() -> None:
    xs = list(range(20_000))
    ys = [10.0] * 20_000
    ys[12_345] = 250.0
    ox, oy = minmax(xs, ys, 500)
    assert len(ox) <= 1000
    assert (12_345, 250.0) in zip(ox, oy)


@given(st.integers(-10**9, 10**9), st.integers(0, 10**9), st.integers(1, 10**5))
def test_bucket_width_covers_the_range_in_at_most_that_many_buckets(first: int, length: int, buckets: int) -> None:
    width = bucket_width(first, first + length, buckets)
    assert width >= 1
    assert length // width < buckets  # the last x falls in a bucket below ``buckets``
    assert width == 1 or length // (width - 1) >= buckets  # and no narrower width would do


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        minmax([1, 2], [1.0], 10)
    with pytest.raises(ValueError, match="at least 1"):
        minmax([1], [1.0], 0)
    with pytest.raises(ValueError, match="at least 1"):
        bucket_width(0, 10, 0)


def test_points_budget_shares_a_chart_between_series() -> None:
    assert points_budget(1) == 20_000
    assert points_budget(64) == 312
    assert points_budget(100_000) == MIN_BUCKETS
