"""Memory verdicts (pressure, imbalance, creep) and system verdicts (host memory, process RSS,
GPU utilisation) over the step window's time span.

The memory a run is judged on is the device's where a GPU (or another accelerator) is used: the
allocator's reserved bytes against the device's total for pressure and imbalance, its allocated
bytes for creep (a leak shows there before the cache hides it). A CPU-only run is judged on its
process RSS (the cpu collector's ``allocated``) against the host's memory, so a CPU run that leaks
is caught too. Samples are bucketed by step: each step holds the largest sample taken during it,
and a step without a sample carries the last one forward (docs/verdicts.md). The rules read the
facts ``memory_facts`` reduces once from the samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from statistics import median as _median
from typing import Any

from .memory_facts import MemoryFacts
from .model import Severity, Verdict
from .policy import VerdictPolicy
from .step_columns import clean_int, clean_number
from .step_windows import StepWindow

__all__ = ["memory_verdicts", "system_verdicts"]

MIN_SAMPLES = 3  # per rank in the window, for a creep trend
_GIB = float(1 << 30)


def _gib(value: float | None) -> float | None:
    return None if value is None else round(value / _GIB, 3)


def _r4(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 4)


def _band(series: Sequence[float], band: tuple[float, float]) -> float:
    n = len(series)
    low = min(n - 1, int(math.floor(band[0] * n)))
    high = max(low + 1, min(n, int(math.ceil(band[1] * n))))
    chunk = series[low:high]
    return sum(chunk) / len(chunk)


def _bands(series: list[float], policy: VerdictPolicy) -> tuple[float, float, float]:
    return (_band(series, policy.creep_baseline_band), _band(series, policy.creep_mid_band),
            _band(series, policy.creep_recent_band))


def memory_verdicts(window: StepWindow, facts: MemoryFacts, policy: VerdictPolicy) -> list[Verdict]:
    """HIGH_PRESSURE, IMBALANCE, CREEP_CONFIRMED or CREEP_EARLY, once the window holds
    ``memory_min_steps`` steps."""
    if window.steps < policy.memory_min_steps or not facts.kind:
        return []
    kind, peaks, totals, hosts = facts.kind, facts.peaks, facts.totals, facts.hosts
    label = "device memory (allocator reserved)" if kind == "device" else "process RSS"
    base = {"window": window.evidence(), "memory": kind, "samples": facts.samples}
    found: list[Verdict] = []
    pressure = _pressure(kind, peaks, totals, hosts)
    if pressure:
        worst_rank = max(sorted(pressure), key=lambda r: pressure[r])
        worst = pressure[worst_rank]
        if worst >= policy.pressure_warn:
            severity: Severity = "crit" if worst >= policy.pressure_crit else "warn"
            culprits = tuple(sorted(r for r, p in pressure.items() if p >= policy.pressure_warn))
            where = "of the device" if kind == "device" else "of the host's memory (every rank on it together)"
            found.append(Verdict(
                "HIGH_PRESSURE", severity, _r4(worst), culprits,
                f"{label} reaches {worst * 100:.0f}% {where}: close to out of memory",
                "a smaller batch, activation checkpointing, mixed precision, or free what the loop keeps",
                {**base, "pressure": _r4(worst), "pressure_per_rank": {str(r): _r4(p) for r, p in sorted(pressure.items())},
                 "peak_gib": {str(r): _gib(v) for r, v in sorted(peaks.items())},
                 "thresholds": {"warn": policy.pressure_warn, "crit": policy.pressure_crit}}))
    imbalance = _imbalance(peaks, totals, policy, label, base)
    if imbalance is not None:
        found.append(imbalance)
    creep = _creep(window, facts, "allocated", policy, label if kind == "rss" else "device memory (allocated)", base)
    if creep is not None:
        found.append(creep)
    return found


def _pressure(kind: str, peaks: dict[int, float], totals: dict[int, float], hosts: dict[int, str]) -> dict[int, float]:
    if kind == "device":
        return {r: min(1.0, peaks[r] / totals[r]) for r in peaks if totals.get(r)}
    # RSS: the ranks of one host share its memory
    by_host: dict[str, float] = {}
    for rank, peak in peaks.items():
        by_host[hosts.get(rank, "")] = by_host.get(hosts.get(rank, ""), 0.0) + peak
    return {r: min(1.0, by_host[hosts.get(r, "")] / totals[r]) for r in peaks if totals.get(r)}


def _imbalance(peaks: dict[int, float], totals: dict[int, float], policy: VerdictPolicy, label: str,
               base: dict[str, Any]) -> Verdict | None:
    """Cross-rank skew of the peaks, (worst - median) / median, judged only where the worst rank
    holds a real share of its memory (skew on a nearly empty device is noise)."""
    if len(peaks) < 2:
        return None
    median = _median(list(peaks.values()))
    worst_rank = max(sorted(peaks), key=lambda r: peaks[r])
    if median <= 0 or not totals.get(worst_rank):
        return None
    skew = (peaks[worst_rank] - median) / median
    pressure = peaks[worst_rank] / totals[worst_rank]
    if skew >= policy.imbalance_skew_crit and pressure >= policy.imbalance_pressure_crit:
        severity: Severity = "crit"
    elif skew >= policy.imbalance_skew_warn and pressure >= policy.imbalance_pressure_warn:
        severity = "warn"
    else:
        return None
    return Verdict("IMBALANCE", severity, _r4(skew), (worst_rank,),
                   f"rank {worst_rank} holds {skew * 100:.0f}% more {label} than the median rank "
                   f"({_gib(peaks[worst_rank])} GiB, {pressure * 100:.0f}% of its memory)",
                   "look for work only that rank does (rank-0 logging, evaluation, uneven sharding or batch shapes)",
                   {**base, "skew": _r4(skew), "pressure": _r4(pressure), "median_peak_gib": _gib(median),
                    "peak_gib": {str(r): _gib(v) for r, v in sorted(peaks.items())},
                    "thresholds": {"skew_warn": policy.imbalance_skew_warn, "skew_crit": policy.imbalance_skew_crit,
                                   "pressure_warn": policy.imbalance_pressure_warn,
                                   "pressure_crit": policy.imbalance_pressure_crit}})


def _creep(window: StepWindow, facts: MemoryFacts, field: str, policy: VerdictPolicy, label: str,
           base: dict[str, Any]) -> Verdict | None:
    """Memory rising across the window: the averages of the baseline, middle and recent bands
    rise in turn for the worst rank and the median rank; CREEP_CONFIRMED once the worst rank's
    recent band is ``creep_confirmed_delta_bytes`` above its baseline, else CREEP_EARLY."""
    counts = facts.counts
    if not counts or min(counts.get(r, 0) for r in window.ranks) < MIN_SAMPLES:
        return None
    worst, median, own = facts.worst, facts.median, facts.own
    if len(worst) < MIN_SAMPLES:
        return None
    w_base, w_mid, w_recent = _bands(worst, policy)
    m_base, m_mid, m_recent = _bands(median, policy)
    rising = w_recent > w_mid > w_base and m_recent > m_mid > m_base
    delta = w_recent - w_base
    if not rising or delta <= policy.creep_early_min_delta_bytes:
        return None
    confirmed = delta >= policy.creep_confirmed_delta_bytes
    worst_growth = delta / w_base if w_base > 0 else 0.0
    median_growth = (m_recent - m_base) / m_base if m_base > 0 else 0.0
    score = delta / policy.creep_score_scale_bytes + 10 * max(0.0, worst_growth) + 6 * max(0.0, median_growth)
    deltas = {}
    for rank in own.ranks():
        b, _, r = _bands(own[rank], policy)
        deltas[rank] = r - b
    culprits = tuple(sorted(r for r, d in deltas.items() if d > policy.creep_early_min_delta_bytes))
    # the bands' averages are over series entries, one a sampled step: the rate is per step of
    # training between the bands' average steps, however many steps a sample stood for
    at = facts.series_steps
    steps_between = _band(at, policy.creep_recent_band) - _band(at, policy.creep_baseline_band)
    per_step = delta / max(1.0, steps_between)
    name = "CREEP_CONFIRMED" if confirmed else "CREEP_EARLY"
    message = (f"{label} rises across the window: +{delta / 2**20:.0f} MiB from the early to the recent steps "
               f"({worst_growth * 100:.0f}%, about {per_step / 1024:.1f} KiB a step)")
    return Verdict(name, "warn" if confirmed else "info", _r4(score), culprits, message,
                   "look for tensors kept across steps (a list of losses without .item(), growing caches, "
                   "autograd history held by a stored output)" if confirmed else "watch the next window",
                   {**base, "metric": field, "series_steps": len(worst), "delta_gib": _gib(delta),
                    "baseline_gib": _gib(w_base), "mid_gib": _gib(w_mid), "recent_gib": _gib(w_recent),
                    "worst_growth": _r4(worst_growth), "median_growth": _r4(median_growth),
                    "growth_bytes_per_step": round(per_step),
                    "delta_gib_per_rank": {str(r): _gib(d) for r, d in sorted(deltas.items())},
                    "bands": {"baseline": list(policy.creep_baseline_band), "mid": list(policy.creep_mid_band),
                              "recent": list(policy.creep_recent_band)},
                    "thresholds": {"early_min_delta_bytes": policy.creep_early_min_delta_bytes,
                                   "confirmed_delta_bytes": policy.creep_confirmed_delta_bytes}})


def system_verdicts(window: StepWindow, facts: MemoryFacts, system: Iterable[Mapping[str, Any]],
                    policy: VerdictPolicy) -> list[Verdict]:
    """HOST_MEMORY_HIGH and PROCESS_RSS_HIGH from the cpu collector's samples (RSS, the host's
    available and total memory), GPU_UTILIZATION_LOW from NVML utilisation samples."""
    if not window.ranks:
        return []
    base = {"window": window.evidence()}
    found: list[Verdict] = []
    host_used, host_ranks, rss = facts.host_used, facts.host_ranks, facts.rss
    for host in sorted(host_used):
        used = host_used[host]
        if used >= policy.host_memory_warn:
            severity: Severity = "crit" if used >= policy.host_memory_crit else "warn"
            found.append(Verdict("HOST_MEMORY_HIGH", severity, _r4(used), tuple(sorted(host_ranks[host])),
                                 f"host {host or '?'} used {used * 100:.0f}% of its memory during the window",
                                 "fewer DataLoader workers or a smaller prefetch, or less held in host memory",
                                 {**base, "host": host, "used_fraction": _r4(used),
                                  "thresholds": {"warn": policy.host_memory_warn, "crit": policy.host_memory_crit}}))
    high = {r: v for r, v in rss.items() if v >= policy.process_rss_warn}
    if high:
        worst = max(high.values())
        severity = "crit" if worst >= policy.process_rss_crit else "warn"
        found.append(Verdict("PROCESS_RSS_HIGH", severity, _r4(worst), tuple(sorted(high)),
                             f"a rank's process RSS reached {worst * 100:.0f}% of its host's memory",
                             "look for host-side copies kept across steps (datasets loaded whole, cached batches)",
                             {**base, "rss_fraction_per_rank": {str(r): _r4(v) for r, v in sorted(rss.items())},
                              "thresholds": {"warn": policy.process_rss_warn, "crit": policy.process_rss_crit}}))
    low = _gpu_utilisation(window, system, policy, base)
    if low is not None:
        found.append(low)
    return found


def _gpu_utilisation(window: StepWindow, rows: Iterable[Mapping[str, Any]], policy: VerdictPolicy,
                     base: dict[str, Any]) -> Verdict | None:
    start = min((w.start_ns for w in window.ranks.values() if w.start_ns is not None), default=None)
    end = max((w.end_ns for w in window.ranks.values() if w.end_ns is not None), default=None)
    by_device: dict[int, list[float]] = {}
    for row in rows:
        if not isinstance(row, Mapping):
            continue
        value, ts, device = clean_number(row.get("gpu_util_pct")), clean_int(row.get("timestamp_ns")), clean_int(row.get("device_id"))
        if value is None or value > 100 or device is None or ts is None:
            continue
        if (start is not None and ts < start) or (end is not None and ts > end):
            continue
        by_device.setdefault(device, []).append(float(value))
    means = {d: sum(v) / len(v) for d, v in by_device.items() if len(v) >= policy.gpu_util_min_samples}
    low = {d: m for d, m in means.items() if m < policy.gpu_util_low_pct}
    if not low:
        return None
    worst = min(low.values())
    return Verdict("GPU_UTILIZATION_LOW", "warn", _r4(worst), (),
                   f"GPU utilisation averaged {worst:.0f}% on device(s) {', '.join(str(d) for d in sorted(low))} "
                   f"during the window (low under {policy.gpu_util_low_pct:.0f}%)",
                   "the GPU waits on something: see the step-time verdict (input, host work, between steps)",
                   {**base, "mean_pct_per_device": {str(d): _r4(m) for d, m in sorted(means.items())},
                    "samples": {str(d): len(v) for d, v in sorted(by_device.items())},
                    "threshold_pct": policy.gpu_util_low_pct})
