"""What the memory and system rules read, reduced once from a window's samples on numpy arrays: a
whole run's samples (64 ranks, one a second over hours) in a few array passes.

The memory a run is judged on is the device's where a GPU (or another accelerator) is used: the
allocator's reserved bytes on each rank's own device (the one where it holds the most; the lowest
on a tie) for pressure and imbalance, its allocated bytes for creep. A CPU-only run is judged on
its process RSS (the cpu collector's ``allocated``) against the host's memory. A sample belongs to
the step of its rank that started last at or before it (a sample taken as a step starts is that
step's). What a value means is ``step_columns``' rule: counters are numbers (``total`` 0: no
total), rank, time and device are whole numbers in int64's range, anything else is unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .step_columns import clean_int, number_array
from .step_windows import RankWindow, StepWindow

__all__ = ["CPU_COLLECTOR", "NVML_COLLECTOR", "MemoryFacts", "SeriesColumns", "memory_facts"]

CPU_COLLECTOR = "stepwatch.cpu_tracker"
NVML_COLLECTOR = "stepwatch.nvml_tracker"
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_CPU, _NVML, _OTHER = 0, 1, 2


class SeriesColumns(dict):  # type: ignore[type-arg]
    """rank -> its series, each built on first use from the points' rows."""

    def __init__(self, order: list[int], rows: list[list[float]]) -> None:
        super().__init__()
        self._index = {rank: i for i, rank in enumerate(order)}
        self._rows = rows

    def __missing__(self, rank: int) -> list[float]:
        i = self._index[rank]
        series = self[rank] = [row[i] for row in self._rows]
        return series

    def ranks(self) -> list[int]:
        return sorted(self._index)


@dataclass
class MemoryFacts:
    """What the memory and system rules read, reduced once from the window's samples."""

    kind: str = ""  # "device", "rss", or "" with no sample to judge
    samples: int = 0  # samples of the judged memory
    peaks: dict[int, float] = field(default_factory=dict)  # per rank
    totals: dict[int, float] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    worst: list[float] = field(default_factory=list)  # the creep series (allocated), per sampled step
    median: list[float] = field(default_factory=list)
    series_steps: list[int] = field(default_factory=list)  # the step of each entry of the creep series
    own: Any = None  # rank -> its own series (SeriesColumns)
    host_used: dict[str, float] = field(default_factory=dict)  # system: a host's used fraction, peak
    host_ranks: dict[str, set[int]] = field(default_factory=dict)
    rss: dict[int, float] = field(default_factory=dict)  # system: a rank's RSS over its host's total, peak


def _ints(np: Any, values: Sequence[Any]) -> tuple[Any, Any]:
    """(int64 array, which values are whole numbers in int64's range); others read as 0."""
    if set(map(type, values)) == {int}:  # the common case (no bool: a bool is no number here)
        try:
            inferred = np.array(values)
        except (TypeError, ValueError, OverflowError):
            inferred = None
        if inferred is not None and inferred.ndim == 1 and inferred.dtype == np.int64:
            return inferred, np.ones(len(values), dtype=bool)
    clean = [clean_int(v) for v in values]
    valid = np.array([v is not None for v in clean], dtype=bool)
    return np.array([0 if v is None else v for v in clean], dtype=np.int64), valid


def memory_facts(rows: Iterable[Any], window: StepWindow) -> MemoryFacts:
    """The facts of the window's memory samples (telemetry ``sample`` rows of the window's ranks
    taken during their window)."""
    import numpy as np

    if not window.ranks:
        return MemoryFacts(own=SeriesColumns([], []))
    maps = [r for r in rows if type(r) is dict or isinstance(r, Mapping)]  # the ABC check only for others
    n = len(maps)
    is_sample = np.array([r.get("event_type", "sample") == "sample" for r in maps], dtype=bool)
    rank, rank_ok = _ints(np, [r.get("rank") for r in maps])
    ts, ts_ok = _ints(np, [r.get("timestamp_ns") for r in maps])
    device, device_ok = _ints(np, [r.get("device_id") for r in maps])
    codes = {CPU_COLLECTOR: _CPU, NVML_COLLECTOR: _NVML}
    collector = np.array([codes.get(c, _OTHER) if type(c) is str else _OTHER
                          for c in (r.get("collector") for r in maps)], dtype=np.int8)
    host_names: dict[str, int] = {}
    host = np.array([host_names.setdefault(h if type(h) is str else "", len(host_names))
                     for h in (r.get("host") for r in maps)], dtype=np.int64)
    hosts_by_code = {code: name for name, code in host_names.items()}
    allocated, reserved = number_array([r.get("allocated") for r in maps]), number_array([r.get("reserved") for r in maps])
    free, total = number_array([r.get("free") for r in maps]), number_array([r.get("total") for r in maps])
    total[total == 0] = np.nan  # no total: nothing to hold a share of

    # the samples of the window's ranks taken during their window
    window_ranks = sorted(window.ranks)
    wr = np.array(window_ranks, dtype=np.int64)
    starts = np.array([_I64_MIN if window.ranks[r].start_ns is None else window.ranks[r].start_ns
                       for r in window_ranks], dtype=np.int64)
    ends = np.array([_I64_MAX if window.ranks[r].end_ns is None else window.ranks[r].end_ns
                     for r in window_ranks], dtype=np.int64)
    slot = np.minimum(np.searchsorted(wr, rank), len(wr) - 1)
    inside = (is_sample & rank_ok & ts_ok & (wr[slot] == rank) & (ts >= starts[slot]) & (ts <= ends[slot])
              if n else np.zeros(0, dtype=bool))

    facts = MemoryFacts()
    device_mask = inside & (collector == _OTHER) & device_ok & (device >= 0) & ~np.isnan(reserved)
    if device_mask.any():
        own_device = _own_devices(np, slot[device_mask], device[device_mask], reserved[device_mask], len(wr))
        source = device_mask & (device == own_device[slot])
        kind, value = "device", reserved
    else:
        source = inside & (collector == _CPU) & ~np.isnan(allocated)
        kind, value = "rss", allocated
    count = int(source.sum())
    facts.kind, facts.samples = (kind if count else ""), count
    if count:
        where = np.flatnonzero(source)
        at = slot[where]
        counts = np.bincount(at, minlength=len(wr))
        peaks = np.zeros(len(wr))
        np.maximum.at(peaks, at, value[where])
        has_total = ~np.isnan(total[where])
        totals = np.zeros(len(wr))
        np.maximum.at(totals, at[has_total], total[where][has_total])
        total_seen = np.bincount(at[has_total], minlength=len(wr)) > 0
        last = np.full(len(wr), -1, dtype=np.int64)
        np.maximum.at(last, at, np.arange(len(where)))
        last_host = host[where][np.maximum(last, 0)].tolist()
        for r, samples_r, peak, code, seen, most in zip(window_ranks, counts.tolist(), peaks.tolist(), last_host,
                                                        total_seen.tolist(), totals.tolist()):
            if samples_r:
                facts.peaks[r] = peak
                facts.counts[r] = samples_r
                facts.hosts[r] = hosts_by_code[code]
                if seen:
                    facts.totals[r] = most
        series_mask = source & ~np.isnan(allocated)
        facts.worst, facts.median, facts.own, facts.series_steps = _series(np, window, window_ranks, slot, ts,
                                                                           allocated, series_mask)
    else:
        facts.own = SeriesColumns([], [])
    _system(np, facts, inside & (collector == _CPU), slot, window_ranks, host, hosts_by_code, allocated, free, total)
    return facts


def _own_devices(np: Any, at: Any, device: Any, reserved: Any, ranks: int) -> Any:
    """Each rank's own device: where it holds the most (the lowest device on a tie); -1: none."""
    order = np.lexsort((device, at))
    at, device, reserved = at[order], device[order], reserved[order]
    first = np.flatnonzero(np.r_[True, (at[1:] != at[:-1]) | (device[1:] != device[:-1])])
    peaks = np.maximum(np.maximum.reduceat(reserved, first), 0.0)
    own = np.full(ranks, -1, dtype=np.int64)
    best = np.full(ranks, -1.0)
    for slot, dev, peak in zip(at[first].tolist(), device[first].tolist(), peaks.tolist()):
        if own[slot] < 0 or peak > best[slot]:
            own[slot], best[slot] = dev, peak
    return own


def _series(np: Any, window: StepWindow, window_ranks: list[int], slot: Any, ts: Any, value: Any,
            mask: Any) -> tuple[list[float], list[float], SeriesColumns, list[int]]:
    """The creep series: per sampled step (a step during which some rank took a sample), each
    rank's largest sample, carried forward to the steps where it took none; the worst and the
    median over ranks, from the first step where every rank has a value; and those steps (a
    sampler ticks by time, so an entry is one step only when a step lasts a tick or more)."""
    step_of = np.zeros(len(ts), dtype=np.int64)
    has_step = np.zeros(len(ts), dtype=bool)
    # Each sample's step: the last step of its rank that started at or before it. One sort of
    # every rank's step starts and samples together (by rank, then time), then the last step
    # seen carried forward: no numpy call per rank.
    step_times, numbers, step_slots = _step_clocks(np, [window.ranks[r] for r in window_ranks])
    samples = np.flatnonzero(mask)
    if len(numbers) and len(samples):
        n_steps = len(numbers)
        when = np.concatenate([step_times, ts[samples]])
        where = np.concatenate([step_slots, slot[samples]])
        # lexsort is stable: at the same time, the steps (given first) stay before the samples
        order = np.lexsort((when, where))
        sample_at = order >= n_steps
        positions = np.arange(len(order))
        last_step = np.maximum.accumulate(np.where(sample_at, -1, positions))
        at = np.flatnonzero(sample_at)
        before = last_step[at]
        found = (before >= 0) & (where[order][np.maximum(before, 0)] == where[order][at])
        sample = samples[order[at[found]] - n_steps]
        step_of[sample] = numbers[order[before[found]]]
        has_step[sample] = True
    use = np.flatnonzero(has_step)
    if not len(use) or not window_ranks:
        return [], [], SeriesColumns([], []), []
    steps = np.unique(step_of[use])
    grid = np.full((len(steps), len(window_ranks)), np.nan)
    np.fmax.at(grid, (np.searchsorted(steps, step_of[use]), slot[use]), value[use])
    known = ~np.isnan(grid)
    latest = np.maximum.accumulate(np.where(known, np.arange(len(steps))[:, None], 0), axis=0)
    filled = grid[latest, np.arange(len(window_ranks))[None, :]]
    whole = ~np.isnan(filled).any(axis=1)
    complete = filled[whole]
    if not len(complete):
        return [], [], SeriesColumns([], []), []
    return (complete.max(axis=1).tolist(), np.median(complete, axis=1).tolist(),
            SeriesColumns(window_ranks, complete.tolist()), steps[whole].tolist())


def _step_clocks(np: Any, ranks: list[RankWindow]) -> tuple[Any, Any, Any]:
    """Every rank's known step starts, step numbers and rank slot, concatenated (int64), in a few
    numpy calls for all of them, not a few per rank."""
    if not ranks:
        return (np.zeros(0, dtype=np.int64),) * 3
    known = np.concatenate([w.starts_known for w in ranks])
    slots = np.repeat(np.arange(len(ranks), dtype=np.int64), [len(w.starts_known) for w in ranks])
    return (np.concatenate([w.step_starts for w in ranks])[known].astype(np.int64),
            np.concatenate([w.step_numbers for w in ranks])[known].astype(np.int64), slots[known])


def _system(np: Any, facts: MemoryFacts, cpu: Any, slot: Any, window_ranks: list[int], host: Any,
            hosts_by_code: dict[int, str], allocated: Any, free: Any, total: Any) -> None:
    has_total = cpu & ~np.isnan(total)
    used_mask = has_total & ~np.isnan(free)
    if used_mask.any():
        where = np.flatnonzero(used_mask)
        used = np.clip((total[where] - free[where]) / total[where], 0.0, 1.0)
        peak = np.zeros(len(hosts_by_code))
        np.maximum.at(peak, host[where], used)
        for code in np.unique(host[where]).tolist():
            facts.host_used[hosts_by_code[code]] = float(peak[code])
        for code, at in set(zip(host[where].tolist(), slot[where].tolist())):
            facts.host_ranks.setdefault(hosts_by_code[code], set()).add(window_ranks[at])
    rss_mask = has_total & ~np.isnan(allocated)
    if rss_mask.any():
        where = np.flatnonzero(rss_mask)
        fraction = np.minimum(1.0, allocated[where] / total[where])
        peak = np.zeros(len(window_ranks))
        np.maximum.at(peak, slot[where], fraction)
        for at in np.unique(slot[where]).tolist():
            facts.rss[window_ranks[at]] = float(peak[at])
