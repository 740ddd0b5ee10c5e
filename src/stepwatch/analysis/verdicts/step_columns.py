"""The step rows as columns, and the window's per-rank reduction done on them with numpy.

A summary judges every step of a run: 64 ranks x 20,000 steps is 1.28M rows, which the
row-at-a-time reduction of ``step_windows`` walks in seconds. Where numpy is importable (it comes
with torch; the core install does without it) the same reduction runs on columns, a few array
passes over all ranks at once. ``StepColumns`` holds the columns; ``load_verdict_inputs`` builds
it straight from the history's tuples, and ``diagnose`` builds it from rows when it gets rows.
Both reductions give the same sums (tests/analysis/test_verdicts_properties.py checks it).

numpy is imported inside the functions, never at import, so ``stepwatch.analysis`` stays light.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ...phases import PHASES, RESIDUAL, STEP_COLUMNS

__all__ = ["COLUMNS", "COMPUTE_PHASES", "StepColumns", "clean_int", "clean_number", "numpy_or_none", "reduce_columns"]

COLUMNS: tuple[str, ...] = ("rank", "step", "start_ns", "end_ns", "step_ns", *STEP_COLUMNS)
_INT_LIMIT = float(1 << 62)
_PAST_INT64 = 2.0**63
_TWO_63 = 1 << 63
# the phases that make up compute (stepwatch.phases: in the residual, and not h2d)
COMPUTE_PHASES: tuple[str, ...] = tuple(p.share for p in PHASES if p.in_residual and p.share != "h2d")


def clean_int(value: Any) -> int | None:
    """A whole number in int64's range (an int, or a float without a fraction), else None:
    ranks, steps, times (the columnar path holds them in int64 arrays)."""
    if type(value) is int:
        return value if -_TWO_63 <= value < _TWO_63 else None
    if isinstance(value, float) and value.is_integer() and -_PAST_INT64 <= value < _PAST_INT64:
        return int(value)
    return None


def is_clock(value: Any) -> bool:
    """An int in int64's range: a nanosecond clock a step's start or end can be compared on."""
    return type(value) is int and -_TWO_63 <= value < _TWO_63


def clean_number(value: Any) -> float | int | None:
    """A non-negative finite number, or None (unknown): bools, strings, NaN, negatives are unknown."""
    kind = type(value)
    if kind is int:
        return value if value >= 0 else None
    if kind is float:
        return value if value >= 0 and math.isfinite(value) else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        return number if number >= 0 and math.isfinite(number) else None
    return None


def numpy_or_none() -> Any:
    try:
        import numpy
    except ImportError:  # the core install: the row reduction does the work
        return None
    return numpy


class StepColumns(Sequence[Mapping[str, Any]]):
    """Step rows held as one array per column (float64, NaN where the value is unknown; the clocks
    as int64 with a mask where every value is known). Reads as a sequence of row dicts too, so a
    caller that iterates rows still can."""

    def __init__(self, arrays: Mapping[str, Any], length: int) -> None:
        self.arrays = dict(arrays)
        self.length = length

    @classmethod
    def from_lists(cls, columns: Mapping[str, Sequence[Any]]) -> StepColumns | None:
        """From one list per column (None: unknown); None when numpy is not importable."""
        np = numpy_or_none()
        if np is None:
            return None
        length = len(next(iter(columns.values()))) if columns else 0
        arrays = {name: _array(np, columns.get(name, [None] * length), clock=name in ("start_ns", "end_ns"))
                  for name in COLUMNS}
        return cls(arrays, length)

    @classmethod
    def from_rows(cls, rows: Iterable[Any]) -> StepColumns | None:
        """From row mappings (anything else in the sequence is skipped); None without numpy."""
        if numpy_or_none() is None:
            return None
        mappings = [r for r in rows if isinstance(r, Mapping)]
        try:
            lists = {name: [r[name] for r in mappings] for name in COLUMNS}
        except KeyError:
            lists = {name: [r.get(name) for r in mappings] for name in COLUMNS}
        return cls.from_lists(lists)

    @classmethod
    def from_tuples(cls, rows: list[tuple[Any, ...]]) -> StepColumns | None:
        """From tuples in ``COLUMNS`` order (the history's SELECT); None without numpy."""
        if numpy_or_none() is None:
            return None
        lists = list(zip(*rows)) if rows else [() for _ in COLUMNS]
        return cls.from_lists(dict(zip(COLUMNS, lists)))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.length))]
        if index < 0:
            index += self.length
        if not 0 <= index < self.length:
            raise IndexError(index)
        return {name: _value(self.arrays[name], index) for name in COLUMNS}

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        for i in range(self.length):
            yield self[i]


def _value(array: Any, index: int) -> Any:
    value = array[index]
    if array.dtype.kind == "f":
        return None if value != value else (int(value) if float(value).is_integer() else float(value))
    return int(value)


def _array(np: Any, values: Sequence[Any], *, clock: bool = False) -> Any:
    """float64 with NaN for unknown (None, NaN, inf, negatives, anything not a number, anything
    past int64: no clock or byte count is that large); a clock column stays int64 when every
    value is an int64 (exact nanoseconds)."""
    try:
        inferred = np.array(values)  # all ints: int64, the common case and the fastest
    except (TypeError, ValueError, OverflowError):
        inferred = None
    if inferred is not None and inferred.ndim == 1 and inferred.dtype.kind == "i":
        if clock:
            return inferred.astype(np.int64)
        array = inferred.astype(np.float64)
        array[inferred < 0] = np.nan
        return array
    if inferred is not None and inferred.ndim == 1 and inferred.dtype.kind == "f":
        array = inferred
        with np.errstate(invalid="ignore"):
            array[~(np.isfinite(array) & (array >= 0) & (array < _PAST_INT64))] = np.nan
        return array
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        array = None
    if array is None or array.ndim != 1:
        array = np.array([clean_number(v) for v in values], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        array[~(np.isfinite(array) & (array >= 0) & (array < _PAST_INT64))] = np.nan
    return array


_FETCH = next(p.column for p in PHASES if p.share == "data_load")
_IN_STEP = {p.share: p.column for p in PHASES if p.share != "data_load"}


def reduce_columns(columns: StepColumns, window: int | None) -> tuple[list[dict[str, Any]], int, int | None, list[int]]:
    """Per rank of the window: its step count, first and last step, clocks, and per component the
    known sum, known count and the steps' time over those steps, with the time between
    consecutive steps (the same quantities ``step_windows._reduce`` gives, row by row).
    Returns (one dict per rank, rows ignored, the window's last step, every rank with a step)."""
    np = numpy_or_none()
    a = columns.arrays
    rank_f = np.asarray(a["rank"], dtype=np.float64)
    step_f = np.asarray(a["step"], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        usable = (np.isfinite(rank_f) & np.isfinite(step_f) & (np.floor(rank_f) == rank_f)
                  & (np.floor(step_f) == step_f) & (np.abs(rank_f) < _INT_LIMIT) & (np.abs(step_f) < _INT_LIMIT)
                  & ~np.isnan(a["step_ns"]))
    ignored = int(columns.length - usable.sum())
    if not usable.any():
        return [], ignored, None, []
    every = bool(usable.all())
    keep = None if every else np.flatnonzero(usable)
    rank = (rank_f if every else rank_f[keep]).astype(np.int64)
    step = (step_f if every else step_f[keep]).astype(np.int64)
    # the history gives rows by (rank, step) already: sort only when they are not
    ordered = bool(np.all((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (step[1:] > step[:-1]))))
    if ordered:
        picked = keep
    else:
        order = np.lexsort((step, rank))  # stable: of two rows of one (rank, step), the later given stays last
        rank, step = rank[order], step[order]
        last_of_key = np.ones(len(rank), dtype=bool)
        last_of_key[:-1] = (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])
        rank, step = rank[last_of_key], step[last_of_key]
        picked = (order if keep is None else keep[order])[last_of_key]
    rank_end = np.flatnonzero(np.r_[rank[1:] != rank[:-1], True])
    seen = rank[rank_end].tolist()
    high = int(step[rank_end].min())
    low = high - window + 1 if window is not None else None
    inside = step <= high if low is None else (step <= high) & (step >= low)
    if not inside.all():
        index = np.flatnonzero(inside)
        rank, step = rank[index], step[index]
        picked = index if picked is None else picked[index]
    if not len(rank):
        return [], ignored, high, seen

    def col(name: str) -> Any:
        return a[name] if picked is None else a[name][picked]

    step_ns = col("step_ns")
    fetch, wait = col(_FETCH), col(RESIDUAL.column)
    both = ~np.isnan(fetch) & ~np.isnan(wait)
    overhang = np.where(both & (fetch > wait), fetch - wait, 0.0)
    overhang = np.nan_to_num(overhang, nan=0.0)
    totals = step_ns + overhang
    residual = np.where(both, np.maximum(wait - fetch, 0.0), np.nan)
    phases = {share: col(column) for share, column in _IN_STEP.items()}
    compute = sum(phases[p] for p in COMPUTE_PHASES)
    starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    components = {"input": fetch, "h2d": phases["h2d"], "compute": compute, "residual": residual,
                  **{p: phases[p] for p in COMPUTE_PHASES}}
    sums: dict[str, Any] = {}
    for name, values in components.items():
        known = ~np.isnan(values)
        sums[name] = (np.add.reduceat(np.where(known, values, 0.0), starts),
                      np.add.reduceat(known.astype(np.int64), starts),
                      np.add.reduceat(np.where(known, totals, 0.0), starts))
    counts = np.diff(np.r_[starts, len(rank)])
    total_time = np.add.reduceat(totals, starts)
    # time between consecutive steps of one rank
    start_col, end_col = col("start_ns"), col("end_ns")
    rank_index = np.repeat(np.arange(len(starts)), counts)
    start_known = ~np.isnan(start_col) if start_col.dtype.kind == "f" else np.ones(len(rank), dtype=bool)
    end_known = ~np.isnan(end_col) if end_col.dtype.kind == "f" else np.ones(len(rank), dtype=bool)
    pair = (rank[1:] == rank[:-1]) & (step[1:] == step[:-1] + 1) & end_known[:-1] & start_known[1:]
    gap_raw = (start_col[1:] - end_col[:-1]).astype(np.float64) - overhang[1:]
    gap = np.where(pair, np.maximum(gap_raw, 0.0), 0.0)
    owner = rank_index[1:]
    between = np.bincount(owner, weights=gap, minlength=len(starts))
    between_wall = np.bincount(owner, weights=np.where(pair, gap + totals[1:], 0.0), minlength=len(starts))
    pairs = np.bincount(owner, weights=pair.astype(np.float64), minlength=len(starts))
    # per rank, read as Python numbers once (a numpy scalar per value costs more than the arrays)
    names = list(sums)
    per_name = {n: (sums[n][0].tolist(), sums[n][1].tolist(), sums[n][2].tolist()) for n in names}
    lasts = starts + counts - 1
    totals_l, between_l, wall_l, pairs_l = total_time.tolist(), between.tolist(), between_wall.tolist(), pairs.tolist()
    firsts = zip(rank[starts].tolist(), step[starts].tolist(), step[lasts].tolist(), start_col[starts].tolist(),
                 start_known[starts].tolist(), end_col[lasts].tolist(), end_known[lasts].tolist())
    out = []
    for i, (begin, count, (rank_i, first, last, start, start_ok, end, end_ok)) in enumerate(
            zip(starts.tolist(), counts.tolist(), firsts)):
        out.append({
            "rank": rank_i, "steps": count, "first_step": first, "last_step": last,
            "start_ns": int(start) if start_ok else None, "end_ns": int(end) if end_ok else None,
            "step_total_ns": totals_l[i],
            "sums": {n: per_name[n][0][i] for n in names},
            "known": {n: per_name[n][1][i] for n in names},
            "denominators": {n: per_name[n][2][i] for n in names},
            "between_ns": between_l[i] if pairs_l[i] else None,
            "between_wall_ns": wall_l[i] if pairs_l[i] else 0.0,
            "step_numbers": step[begin:begin + count], "step_starts": start_col[begin:begin + count],
            "starts_known": start_known[begin:begin + count],
        })
    return out, ignored, high, seen
