"""A plain-Python reference of the step window and the memory facts, for the property tests of the
numpy reduction (analysis/verdicts/step_windows.py, memory_facts.py): one loop per rule, written
from docs/verdicts.md and the rules of step_columns.py, with no care for speed."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stepwatch.phases import PHASES, RESIDUAL

CPU = "stepwatch.cpu_tracker"
NVML = "stepwatch.nvml_tracker"
FETCH = next(p.column for p in PHASES if p.share == "data_load")
IN_STEP = {p.share: p.column for p in PHASES if p.share != "data_load"}
COMPUTE = ("forward", "backward", "optimizer", "recompute")


def number(value: Any) -> float | int | None:
    """Known: an int or float (no bool, no str), finite, >= 0, below 2**63 as a float; a
    subclass of either (numpy's float64) as its float."""
    if type(value) is int:
        return value if 0 <= value < 2**63 and float(value) < 2.0**63 else None
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
        value = float(value)
        return value if value == value and 0 <= value < 2.0**63 else None
    return None


def whole(value: Any, low: int, high: int) -> int | None:
    if type(value) is int:
        return value if low <= value < high else None
    if type(value) is float and value.is_integer() and low <= value < high:
        return int(value)
    return None


def clock(value: Any) -> int | None:
    return whole(value, 0, 2**63)


@dataclass
class Rank:
    rank: int
    steps: int
    first_step: int
    last_step: int
    start_ns: int | None
    end_ns: int | None
    step_total_ns: float
    sums: dict[str, float]
    known: dict[str, int]
    denominators: dict[str, float]
    between_ns: float | None
    between_wall_ns: float
    clocks: list[tuple[int, int | None]]  # (step, its start) in step order


@dataclass
class Window:
    ranks: dict[int, Rank]
    first_step: int | None
    last_step: int | None
    rows_ignored: int
    ranks_without_steps: tuple[int, ...]


def window(rows: list[Any], last_n: int | None, expected: tuple[int, ...] = ()) -> Window:
    ignored = 0
    by_rank: dict[int, dict[int, Mapping[str, Any]]] = {}
    for row in rows:
        if not isinstance(row, Mapping):
            ignored += 1
            continue
        rank, step = whole(row.get("rank"), 0, 2**53), whole(row.get("step"), 0, 2**53)
        if rank is None or step is None or number(row.get("step_ns")) is None:
            ignored += 1
            continue
        by_rank.setdefault(rank, {})[step] = row  # the later given wins
    if not by_rank:
        return Window({}, None, None, ignored, tuple(sorted(set(expected))))
    last = min(max(steps) for steps in by_rank.values())
    first = None if last_n is None else last - last_n + 1
    ranks = {}
    for rank, steps in sorted(by_rank.items()):
        chosen = [steps[s] for s in sorted(steps) if s <= last and (first is None or s >= first)]
        if chosen:
            ranks[rank] = _rank(rank, chosen)
    missing = (set(expected) | set(by_rank)) - set(ranks)
    firsts = [r.first_step for r in ranks.values()]
    return Window(ranks, min(firsts) if firsts else None, last if ranks else None, ignored, tuple(sorted(missing)))


def _rank(rank: int, rows: list[Mapping[str, Any]]) -> Rank:
    parts: dict[str, list[float | None]] = {name: [] for name in ("input", "h2d", "compute", "residual", *COMPUTE)}
    totals: list[float] = []
    overhangs: list[float] = []
    for row in rows:
        fetch, wait = number(row.get(FETCH)), number(row.get(RESIDUAL.column))
        overhang = fetch - wait if fetch is not None and wait is not None and fetch > wait else 0
        overhangs.append(overhang)
        totals.append(number(row["step_ns"]) + overhang)
        parts["input"].append(fetch)
        parts["residual"].append(None if fetch is None or wait is None else max(wait - fetch, 0))
        phases = {share: number(row.get(column)) for share, column in IN_STEP.items()}
        parts["h2d"].append(phases["h2d"])
        for name in COMPUTE:
            parts[name].append(phases[name])
        values = [phases[name] or 0 if name == "recompute" else phases[name] for name in COMPUTE]  # inside backward
        parts["compute"].append(None if None in values else sum(values))
    sums, known, denominators = {}, {}, {}
    for name, values in parts.items():
        pairs = [(v, t) for v, t in zip(values, totals) if v is not None]
        sums[name] = float(sum(v for v, _ in pairs))
        known[name] = len(pairs)
        denominators[name] = float(sum(t for _, t in pairs))
    steps = [whole(r["step"], 0, 2**53) for r in rows]
    between, wall, pairs_seen = 0.0, 0.0, 0
    for i in range(1, len(rows)):
        end, start = clock(rows[i - 1].get("end_ns")), clock(rows[i].get("start_ns"))
        if steps[i] == steps[i - 1] + 1 and end is not None and start is not None:
            gap = max(0.0, float(start - end) - overhangs[i])
            between += gap
            wall += gap + totals[i]
            pairs_seen += 1
    return Rank(rank, len(rows), steps[0], steps[-1], clock(rows[0].get("start_ns")), clock(rows[-1].get("end_ns")),
                float(sum(totals)), sums, known, denominators, between if pairs_seen else None,
                wall if pairs_seen else 0.0, [(s, clock(r.get("start_ns"))) for s, r in zip(steps, rows)])


@dataclass
class Facts:
    kind: str = ""
    samples: int = 0
    peaks: dict[int, float] = field(default_factory=dict)
    totals: dict[int, float] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    worst: list[float] = field(default_factory=list)
    median: list[float] = field(default_factory=list)
    own: dict[int, list[float]] = field(default_factory=dict)
    host_used: dict[str, float] = field(default_factory=dict)
    host_ranks: dict[str, set[int]] = field(default_factory=dict)
    rss: dict[int, float] = field(default_factory=dict)


def facts(rows: list[Any], win: Window) -> Facts:
    if not win.ranks:
        return Facts()
    parsed = []
    for row in rows:
        if not isinstance(row, Mapping) or row.get("event_type", "sample") != "sample":
            continue
        rank, ts = whole(row.get("rank"), -2**63, 2**63), whole(row.get("timestamp_ns"), -2**63, 2**63)
        if rank not in win.ranks or ts is None:
            continue
        w = win.ranks[rank]
        if (w.start_ns is not None and ts < w.start_ns) or (w.end_ns is not None and ts > w.end_ns):
            continue
        collector, host = row.get("collector"), row.get("host")
        parsed.append({"rank": rank, "ts": ts, "device": whole(row.get("device_id"), -2**63, 2**63),
                       "collector": collector if type(collector) is str else "",
                       "allocated": number(row.get("allocated")), "reserved": number(row.get("reserved")),
                       "free": number(row.get("free")), "total": number(row.get("total")) or None,
                       "host": host if type(host) is str else ""})
    device = [s for s in parsed if s["collector"] not in (CPU, NVML) and s["device"] is not None
              and s["device"] >= 0 and s["reserved"] is not None]
    if device:
        peak: dict[tuple[int, int], float] = {}
        for s in device:
            key = (s["rank"], s["device"])
            peak[key] = max(peak.get(key, 0.0), s["reserved"])
        own: dict[int, int] = {}
        for (rank, dev), value in sorted(peak.items()):  # the lowest device wins a tie
            if rank not in own or value > peak[(rank, own[rank])]:
                own[rank] = dev
        kind, chosen, field_name = "device", [s for s in device if own[s["rank"]] == s["device"]], "reserved"
    else:
        kind, chosen, field_name = "rss", [s for s in parsed if s["collector"] == CPU and s["allocated"] is not None], "allocated"
    out = Facts(kind=kind if chosen else "", samples=len(chosen))
    for s in chosen:
        r = s["rank"]
        out.peaks[r] = max(out.peaks.get(r, 0.0), s[field_name])
        if s["total"] is not None:
            out.totals[r] = max(out.totals.get(r, 0.0), s["total"])
        out.hosts[r] = s["host"]
        out.counts[r] = out.counts.get(r, 0) + 1
    _series(out, win, [s for s in chosen if s["allocated"] is not None])
    for s in parsed:
        if s["collector"] != CPU or not s["total"]:
            continue
        if s["free"] is not None:
            used = max(0.0, min(1.0, (s["total"] - s["free"]) / s["total"]))
            out.host_used[s["host"]] = max(out.host_used.get(s["host"], 0.0), used)
            out.host_ranks.setdefault(s["host"], set()).add(s["rank"])
        if s["allocated"] is not None:
            out.rss[s["rank"]] = max(out.rss.get(s["rank"], 0.0), min(1.0, s["allocated"] / s["total"]))
    return out


def _step_of(w: Rank, ts: int) -> int | None:
    """The last step (by start time, then step number) that started at or before ``ts``."""
    started = sorted((start, step) for step, start in w.clocks if start is not None and start <= ts)
    return started[-1][1] if started else None


def _series(out: Facts, win: Window, samples: list[dict[str, Any]]) -> None:
    per_rank: dict[int, dict[int, float]] = {rank: {} for rank in win.ranks}
    for s in samples:
        step = _step_of(win.ranks[s["rank"]], s["ts"])
        if step is not None:
            mine = per_rank[s["rank"]]
            mine[step] = max(mine.get(step, -1.0), s["allocated"])
    steps = sorted({step for mine in per_rank.values() for step in mine})
    last: dict[int, float] = {}
    for step in steps:
        for rank, mine in per_rank.items():
            if step in mine:
                last[rank] = mine[step]
        if len(last) == len(per_rank):
            values = [last[r] for r in sorted(per_rank)]
            out.worst.append(max(values))
            out.median.append(statistics.median(values))
            for r, v in zip(sorted(per_rank), values):
                out.own.setdefault(r, []).append(v)
