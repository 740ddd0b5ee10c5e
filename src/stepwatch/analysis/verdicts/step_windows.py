"""The step window of each rank, reduced to the sums the step-time rules read.

A window is the steps completed on every rank: up to the lowest of the ranks' last step
numbers, and (live) the last N of those. Each rank's rows are reduced once to per-component sums,
so the rules never touch a row. The components of a step, which add up to its time:

- ``input``: its fetch (``data_load_ns``), counted once: the residual ``wait_ns`` still holds a
  fetch made inside the step, so the residual is ``wait - data_load``; a fetch made before the
  step opened (``data_load > wait``) lies outside the step's span, and its overhang
  ``data_load - wait`` is added to the step's time (and taken out of the time between steps);
- ``h2d``; ``compute``: forward + backward + optimizer + recompute; ``residual``.

A column with no value (SQL NULL, or a value that is no non-negative finite number) is unknown,
never 0: a component is summed over the steps where it is known, against the time of those same
steps, and is known on a rank only where it is known on ``min_phase_coverage`` of its window
steps (so one partial last step leaves the others' phases standing).

The reduction runs on the numpy columns of ``step_columns`` (which also says which values are
known), a few array passes over every rank at once: the live window's 6,400 rows and a whole
run's 1.28M alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...phases import PHASES, RESIDUAL
from .step_columns import COMPUTE_PHASES, StepColumns, clean_int

__all__ = ["COMPONENTS", "COMPUTE_PHASES", "RankWindow", "StepWindow", "build_window"]

# the components that add up to a step's time, then the phases reported on their own
COMPONENTS: tuple[str, ...] = ("input", "h2d", "compute", "residual", *COMPUTE_PHASES)
_FETCH = next(p.column for p in PHASES if p.share == "data_load")
_IN_STEP = {p.share: p.column for p in PHASES if p.share != "data_load"}
_STEP_LIMIT = float(1 << 53)  # a rank or step number past this is no number a float holds exactly


@dataclass
class RankWindow:
    """One rank's window: its step count and, per component, the time summed over the steps where
    the component is known, the steps it is known on, and the steps' time over those same steps."""

    rank: int
    steps: int
    first_step: int
    last_step: int
    start_ns: int | None
    end_ns: int | None
    step_total_ns: float  # the steps' time (fetch overhang included)
    sums: dict[str, float] = field(default_factory=dict)
    known: dict[str, int] = field(default_factory=dict)
    denominators: dict[str, float] = field(default_factory=dict)
    between_ns: float | None = None  # time between consecutive steps (None: no pair could tell)
    between_wall_ns: float = 0.0  # the wall time those pairs and their steps span
    # each step of the window in order (int64 arrays): the memory samples are bucketed by them
    step_numbers: Any = ()
    step_starts: Any = ()  # its start_ns (0 where unknown)
    starts_known: Any = ()  # which starts are known

    def has(self, component: str, coverage: float) -> bool:
        known = self.known.get(component, 0)
        return known > 0 and known >= coverage * self.steps

    def share(self, component: str, coverage: float) -> float | None:
        """Of the steps' time, the share this component takes (None: unknown on this rank)."""
        if not self.has(component, coverage):
            return None
        denominator = self.denominators.get(component, 0.0)
        if denominator <= 0:
            return None
        return min(1.0, max(0.0, self.sums[component] / denominator))

    def mean_ns(self, component: str, coverage: float) -> float | None:
        if not self.has(component, coverage):
            return None
        return self.sums[component] / self.known[component]

    @property
    def mean_step_ns(self) -> float:
        return self.step_total_ns / self.steps if self.steps else 0.0

    @property
    def between_share(self) -> float | None:
        if self.between_ns is None or self.between_wall_ns <= 0:
            return None
        return min(1.0, max(0.0, self.between_ns / self.between_wall_ns))


@dataclass
class StepWindow:
    """The window over every rank: ``ranks`` holds the ranks with steps in it."""

    ranks: dict[int, RankWindow]
    first_step: int | None
    last_step: int | None
    requested: int | None  # N of a live window, None: all steps
    rows_ignored: int = 0  # rows without a usable rank, step or step time
    ranks_without_steps: tuple[int, ...] = ()

    @property
    def steps(self) -> int:
        """Steps in the window on the rank that has the fewest."""
        return min((r.steps for r in self.ranks.values()), default=0)

    def evidence(self) -> dict[str, Any]:
        starts = [r.start_ns for r in self.ranks.values() if r.start_ns is not None]
        ends = [r.end_ns for r in self.ranks.values() if r.end_ns is not None]
        return {"first_step": self.first_step, "last_step": self.last_step, "steps": self.steps,
                "requested": self.requested, "ranks": sorted(self.ranks),
                "start_ns": min(starts) if starts else None, "end_ns": max(ends) if ends else None,
                "clock": "host wall clock (step span start/end), per rank"}




def build_window(steps: Iterable[Mapping[str, Any]], window: int | None, *,
                 expected_ranks: Sequence[int] = ()) -> StepWindow:
    """The window of ``steps`` (rows of the history's ``steps`` table, or ``StepColumns``):
    ``window`` = N, the last N steps completed on every rank; None: every step completed on every
    rank. A row without a usable rank, step or step time is counted in ``rows_ignored``; of two
    rows of one (rank, step), the later given wins."""
    expected = {int(r) for r in expected_ranks if clean_int(r) is not None}
    columns = steps if isinstance(steps, StepColumns) else StepColumns.from_rows(steps)
    reduced, ignored, last, seen = _reduce(columns, window)
    ranks = {w.rank: w for w in reduced}
    firsts = [w.first_step for w in reduced]
    return StepWindow(ranks, min(firsts) if firsts else None, last if ranks else None, window, ignored,
                      tuple(sorted((expected | set(seen)) - set(ranks))))


def _reduce(columns: StepColumns, window: int | None) -> tuple[list[RankWindow], int, int | None, list[int]]:
    """Per rank of the window: its steps, clocks and per-component sums, in a few array passes over
    every rank at once. Returns (the ranks' windows, rows ignored, the window's last step, every
    rank with a usable row)."""
    import numpy as np

    a = columns.arrays
    rank_f, step_f = a["rank"], a["step"]  # NaN where no number; >= 0 otherwise
    with np.errstate(invalid="ignore"):
        usable = ((np.floor(rank_f) == rank_f) & (np.floor(step_f) == step_f) & (rank_f < _STEP_LIMIT)
                  & (step_f < _STEP_LIMIT) & ~np.isnan(a["step_ns"]))
    ignored = int(columns.length - usable.sum()) + columns.skipped
    if not usable.any():  # no row at all included
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

    def known(name: str) -> Any:
        return columns.known[name] if picked is None else columns.known[name][picked]

    step_ns = col("step_ns")
    fetch, wait = col(_FETCH), col(RESIDUAL.column)
    both = ~np.isnan(fetch) & ~np.isnan(wait)
    # a fetch longer than the residual was (partly) made before the step opened: its overhang
    # belongs to the step's time, and not to the time between steps
    overhang = np.where(both & (fetch > wait), fetch - wait, 0.0)
    totals = step_ns + overhang
    residual = np.where(both, np.maximum(wait - fetch, 0.0), np.nan)
    phases = {share: col(column) for share, column in _IN_STEP.items()}
    # NaN where a part is unknown, but for recompute: activation checkpointing's forwards are
    # carved out of backward, so where they were not timed apart (a store from before they were)
    # they are inside backward, and compute is still whole
    compute = sum(np.nan_to_num(phases[p]) if p == "recompute" else phases[p] for p in COMPUTE_PHASES)
    starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    components = {"input": fetch, "h2d": phases["h2d"], "compute": compute, "residual": residual,
                  **{p: phases[p] for p in COMPUTE_PHASES}}
    sums: dict[str, tuple[list[float], list[int], list[float]]] = {}
    for name, values in components.items():
        have = ~np.isnan(values)
        sums[name] = (np.add.reduceat(np.where(have, values, 0.0), starts).tolist(),
                      np.add.reduceat(have.astype(np.int64), starts).tolist(),
                      np.add.reduceat(np.where(have, totals, 0.0), starts).tolist())
    counts = np.diff(np.r_[starts, len(rank)])
    total_time = np.add.reduceat(totals, starts)
    # time between consecutive steps of one rank: the gap from a step's end to the next one's
    # start, less the next fetch's overhang; clocks are exact int64, >= 0, so the difference fits
    start_col, end_col = col("start_ns"), col("end_ns")
    start_known, end_known = known("start_ns"), known("end_ns")
    pair = (rank[1:] == rank[:-1]) & (step[1:] == step[:-1] + 1) & end_known[:-1] & start_known[1:]
    gap = np.where(pair, np.maximum((start_col[1:] - end_col[:-1]).astype(np.float64) - overhang[1:], 0.0), 0.0)
    owner = np.repeat(np.arange(len(starts)), counts)[1:]
    between = np.bincount(owner, weights=gap, minlength=len(starts)).tolist()
    between_wall = np.bincount(owner, weights=np.where(pair, gap + totals[1:], 0.0), minlength=len(starts)).tolist()
    pairs = np.bincount(owner, weights=pair.astype(np.float64), minlength=len(starts)).tolist()
    # per rank, read as Python numbers once (a numpy scalar per value costs more than the arrays)
    lasts = starts + counts - 1
    firsts = zip(rank[starts].tolist(), step[starts].tolist(), step[lasts].tolist(), start_col[starts].tolist(),
                 start_known[starts].tolist(), end_col[lasts].tolist(), end_known[lasts].tolist())
    out = []
    for i, (begin, count, (rank_i, first, last, start, start_ok, end, end_ok)) in enumerate(
            zip(starts.tolist(), counts.tolist(), firsts)):
        out.append(RankWindow(
            rank=rank_i, steps=count, first_step=first, last_step=last,
            start_ns=start if start_ok else None, end_ns=end if end_ok else None,
            step_total_ns=float(total_time[i]),
            sums={n: v[0][i] for n, v in sums.items()}, known={n: v[1][i] for n, v in sums.items()},
            denominators={n: v[2][i] for n, v in sums.items()},
            between_ns=between[i] if pairs[i] else None, between_wall_ns=between_wall[i] if pairs[i] else 0.0,
            step_numbers=step[begin:begin + count], step_starts=start_col[begin:begin + count],
            starts_known=start_known[begin:begin + count]))
    return out, ignored, high, seen
