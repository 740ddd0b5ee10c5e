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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...phases import PHASES, RESIDUAL
from .step_columns import COMPUTE_PHASES, StepColumns, clean_int, clean_number, is_clock, reduce_columns

__all__ = ["COMPONENTS", "COMPUTE_PHASES", "RankWindow", "StepWindow", "build_window", "clean_number"]

# phase columns (stepwatch.phases), named by their share
_PHASE_COLUMNS: dict[str, str] = {p.share: p.column for p in PHASES}
_WAIT = RESIDUAL.column
# the components that add up to a step's time, then the phases reported on their own
# from this many rows on, rows are turned into columns and reduced with numpy (where importable)
COLUMNAR_MIN_ROWS = 2000
COMPONENTS: tuple[str, ...] = ("input", "h2d", "compute", "residual", *COMPUTE_PHASES)


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
    step_numbers: Any = ()  # in order (a list, or an array from step_columns); memory samples are bucketed by them
    step_starts: Any = ()  # start_ns of each (None or NaN: unknown)
    starts_known: Any = None  # with arrays: which starts are known

    def step_clock(self) -> tuple[list[Any], list[int]]:
        """(start_ns, step number) of the steps whose start is known, by start time."""
        if self.starts_known is not None:
            known = self.starts_known
            pairs = sorted(zip(self.step_starts[known].tolist(), self.step_numbers[known].tolist()))
        else:
            pairs = sorted((s, n) for s, n in zip(self.step_starts, self.step_numbers) if is_clock(s))
        return [p[0] for p in pairs], [p[1] for p in pairs]

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


def _group(steps: Iterable[Mapping[str, Any]]) -> tuple[dict[int, list[Mapping[str, Any]]], int]:
    by_rank: dict[int, list[Mapping[str, Any]]] = {}
    ignored = 0
    for row in steps:
        try:
            rank, step = clean_int(row.get("rank")), clean_int(row.get("step"))
        except AttributeError:  # not a mapping
            ignored += 1
            continue
        if rank is None or step is None or clean_number(row.get("step_ns")) is None:
            ignored += 1
            continue
        rows = by_rank.get(rank)
        if rows is None:
            by_rank[rank] = [row]
        else:
            rows.append(row)
    return by_rank, ignored


def _ordered(rows: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rank's rows by step, one per step (the last given wins a duplicate)."""
    numbers = [clean_int(r["step"]) for r in rows]
    if all(a < b for a, b in zip(numbers, numbers[1:])):
        return rows
    by_step: dict[int, Mapping[str, Any]] = {}
    for number, row in zip(numbers, rows):
        by_step[number] = row  # type: ignore[index]
    return [by_step[n] for n in sorted(by_step)]


def build_window(steps: Iterable[Mapping[str, Any]], window: int | None, *,
                 expected_ranks: Sequence[int] = (), columnar: bool | None = None) -> StepWindow:
    """The window of ``steps`` (rows of the history's ``steps`` table, or ``StepColumns``):
    ``window`` = N, the last N steps completed on every rank; None: every step completed on every
    rank. ``columnar``: reduce on numpy columns (None: when numpy is importable and the input is
    columns or large)."""
    expected = {int(r) for r in expected_ranks if clean_int(r) is not None}
    columns = steps if isinstance(steps, StepColumns) else None
    large = isinstance(steps, Sequence) and len(steps) >= COLUMNAR_MIN_ROWS
    if columns is None and (columnar or (columnar is None and large)):
        columns = StepColumns.from_rows(steps)
    if columns is not None and columnar is not False:
        reduced, ignored, last, seen = reduce_columns(columns, window)
        ranks = {item["rank"]: RankWindow(**item) for item in reduced}
        firsts = [r.first_step for r in ranks.values()]
        return StepWindow(ranks, min(firsts) if firsts else None, last if ranks else None, window, ignored,
                          tuple(sorted((expected | set(seen)) - set(ranks))))
    by_rank, ignored = _group(steps)
    missing = tuple(sorted(expected - set(by_rank)))
    if not by_rank:
        return StepWindow({}, None, None, window, ignored, missing)
    ordered = {rank: _ordered(rows) for rank, rows in sorted(by_rank.items())}
    last = min(clean_int(rows[-1]["step"]) for rows in ordered.values())  # type: ignore[type-var]
    assert last is not None
    first = last - window + 1 if window is not None else None
    ranks: dict[int, RankWindow] = {}
    for rank, rows in ordered.items():
        chosen = [r for r in rows if (first is None or clean_int(r["step"]) >= first)  # type: ignore[operator]
                  and clean_int(r["step"]) <= last]  # type: ignore[operator]
        if chosen:
            ranks[rank] = _reduce(rank, chosen)
    empty = tuple(sorted(set(ordered) - set(ranks)))
    firsts = [r.first_step for r in ranks.values()]
    return StepWindow(ranks, min(firsts) if firsts else None, last, window, ignored, tuple(sorted({*missing, *empty})))


def _column(rows: list[Mapping[str, Any]], name: str) -> list[Any]:
    return [v if type(v) is int and v >= 0 else clean_number(v) for v in (r.get(name) for r in rows)]


def _sum_known(values: list[Any], totals: list[float]) -> tuple[float, int, float]:
    """(sum of the known values, how many, the steps' time over those steps)."""
    pairs = [(v, t) for v, t in zip(values, totals) if v is not None]
    if len(pairs) == len(values):
        return float(sum(values)), len(values), float(sum(totals))
    return float(sum(v for v, _ in pairs)), len(pairs), float(sum(t for _, t in pairs))


def _reduce(rank: int, rows: list[Mapping[str, Any]]) -> RankWindow:
    step_ns = [clean_number(r.get("step_ns")) for r in rows]  # all known: _group kept only those
    fetch = _column(rows, _PHASE_COLUMNS["data_load"])
    wait = _column(rows, _WAIT)
    # a fetch longer than the residual was (partly) made before the step opened: its overhang
    # belongs to the step's time, and not to the time between steps
    overhang = [d - w if d is not None and w is not None and d > w else 0 for d, w in zip(fetch, wait)]
    totals = [s + o for s, o in zip(step_ns, overhang)]  # type: ignore[operator]
    residual = [None if d is None or w is None else (w - d if w > d else 0) for d, w in zip(fetch, wait)]
    phases = {share: _column(rows, column) for share, column in _PHASE_COLUMNS.items() if share != "data_load"}
    compute_parts = [phases[p] for p in COMPUTE_PHASES]
    compute = [None if None in parts else sum(parts) for parts in zip(*compute_parts)]
    window = RankWindow(rank=rank, steps=len(rows), first_step=clean_int(rows[0]["step"]) or 0,
                        last_step=clean_int(rows[-1]["step"]) or 0,
                        start_ns=clean_int(rows[0].get("start_ns")), end_ns=clean_int(rows[-1].get("end_ns")),
                        step_total_ns=float(sum(totals)))
    for name, values in (("input", fetch), ("h2d", phases["h2d"]), ("compute", compute), ("residual", residual),
                         *((p, phases[p]) for p in COMPUTE_PHASES)):
        total, known, denominator = _sum_known(values, totals)
        window.sums[name], window.known[name], window.denominators[name] = total, known, denominator
    _between(window, rows, totals, overhang)
    return window


def _between(window: RankWindow, rows: list[Mapping[str, Any]], totals: list[float], overhang: list[Any]) -> None:
    """Time outside every step: the gap from one step's end to the next step's start (less the
    next fetch's overhang), over pairs of consecutive step numbers with both clocks known."""
    numbers = [r["step"] for r in rows]
    starts = [r.get("start_ns") for r in rows]
    ends = [r.get("end_ns") for r in rows]
    pairs = [(max(0.0, float(s - e) - o), t)
             for n0, n1, e, s, o, t in zip(numbers, numbers[1:], ends, starts[1:], overhang[1:], totals[1:])
             if n1 == n0 + 1 and is_clock(e) and is_clock(s)]
    window.step_numbers, window.step_starts = numbers, starts
    if pairs:
        gaps = float(sum(g for g, _ in pairs))
        window.between_ns, window.between_wall_ns = gaps, gaps + float(sum(t for _, t in pairs))
