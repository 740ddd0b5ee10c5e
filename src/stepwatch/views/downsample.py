"""Series cut down to what a chart can show, keeping every spike: per bucket of x, the lowest and
the highest point (in x order), so a 20,000-step series drawn as 1,000 points still shows the one
step that took ten times the others, where averaging or striding would hide it.

Pure functions over plain lists (and one SQL form for the history's step table, where the rows
are too many to fetch: ``bucket_width``), shared by the dashboard's run page, its live updates
and the one-file report, so each draws the same points.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["bucket_width", "minmax", "points_budget"]

# The run page's total points per chart (all ranks together): at about 14 bytes a point in its
# JSON, the step-time and memory charts of a 64-rank run stay near half a megabyte each.
CHART_POINTS = 40_000
MIN_BUCKETS = 50  # however many ranks, a series keeps at least this many buckets (100 points)


def points_budget(series: int, total: int = CHART_POINTS) -> int:
    """Buckets per series when ``series`` series share one chart of ``total`` points (each bucket
    gives at most two points)."""
    return max(MIN_BUCKETS, total // max(1, series) // 2)


def bucket_width(first: int, last: int, buckets: int) -> int:
    """The width (in x units, at least 1) of buckets that cover ``first..last`` in at most
    ``buckets`` buckets: bucket ``i`` holds the x with ``(x - first) // width == i``."""
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    span = max(0, last - first) + 1
    return max(1, -(-span // buckets))


def minmax(xs: Sequence[float], ys: Sequence[float], buckets: int) -> tuple[list[float], list[float]]:
    """At most ``2 * buckets`` of the points ``(xs[i], ys[i])`` (xs ascending): the series itself
    when it has that few, else per bucket of equal x width its lowest and its highest point, in x
    order (one point where they are the same). Every point returned is one of the input's, the
    series' lowest and highest values are always among them, and the first and last x are kept
    whenever the lowest or highest of their bucket (ties go to the earlier point)."""
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys differ in length ({len(xs)} and {len(ys)})")
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    n = len(xs)
    if n <= 2 * buckets:
        return list(xs), list(ys)
    first, last = xs[0], xs[-1]
    span = last - first
    out_x: list[float] = []
    out_y: list[float] = []
    current = -1
    low = high = 0
    for i in range(n):
        # the bucket of x: equal widths over first..last, the last x in the last bucket
        index = min(buckets - 1, int((xs[i] - first) * buckets / span)) if span > 0 else 0
        if index != current:
            if current >= 0:
                _emit(xs, ys, low, high, out_x, out_y)
            current, low, high = index, i, i
            continue
        if ys[i] < ys[low]:
            low = i
        if ys[i] > ys[high]:
            high = i
    if current >= 0:
        _emit(xs, ys, low, high, out_x, out_y)
    return out_x, out_y


def _emit(xs: Sequence[float], ys: Sequence[float], low: int, high: int, out_x: list[float],
          out_y: list[float]) -> None:
    for i in sorted({low, high}):
        out_x.append(xs[i])
        out_y.append(ys[i])
