"""The verdict of ``stepwatch compare``: is run B a regression of run A, an improvement, both
(mixed), the same (equivalent), or can the two not be compared (inconclusive)?

Pure: two final summaries in (``analysis.summary.build_summary``'s shape), one verdict out.
docs/compare.md publishes the rule; ``exit_code`` is what the CLI exits with.

The signals, each ``worse``, ``better`` or ``same`` (B against A):
- step time: the median step time, beyond +/- ``step_tolerance`` (3 %) relative;
- stall share: the share of step time outside compute (data_load + h2d + residual), beyond
  +/- ``share_tolerance`` (0.05) absolute: more time waiting is worse even at the same speed;
- memory: the largest peak allocated, beyond +/- ``memory_tolerance`` (10 %) relative.
Only worse (and same) signals: ``REGRESSION``; only better: ``IMPROVEMENT``; both: ``MIXED``;
none: ``EQUIVALENT``. ``INCONCLUSIVE`` comes first: fewer than ``min_steps`` steps in a run, no
step time, or different workloads (world sizes, or the scripts, where both are known).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..phases import RESIDUAL

__all__ = ["EXIT_FINE", "EXIT_INCONCLUSIVE", "EXIT_REGRESSION", "CompareRule", "compare_verdict"]

EXIT_FINE = 0
EXIT_INCONCLUSIVE = 3
EXIT_REGRESSION = 4
# the shares of a step that are not compute: the fetch, the copies to the device, the residual
STALL_SHARES = ("data_load", "h2d", RESIDUAL.share)


@dataclass(frozen=True)
class CompareRule:
    step_tolerance: float = 0.03
    share_tolerance: float = 0.05
    memory_tolerance: float = 0.10
    min_steps: int = 20


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _get(summary: Mapping[str, Any], *path: str) -> Any:
    value: Any = summary
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _stall_share(summary: Mapping[str, Any]) -> float | None:
    shares = _get(summary, "overall", "phase_share")
    if not isinstance(shares, Mapping):
        return None
    values = [_number(shares.get(name)) for name in STALL_SHARES]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _memory_peak(summary: Mapping[str, Any]) -> float | None:
    peaks = summary.get("memory_peaks")
    if not isinstance(peaks, Sequence) or isinstance(peaks, str):
        return None
    values = [_number(p.get("peak_allocated_bytes")) for p in peaks if isinstance(p, Mapping)]
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _relative(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a <= 0:
        return None
    return (b - a) / a


def _signal(change: float | None, tolerance: float) -> str | None:
    if change is None:
        return None
    return "worse" if change > tolerance else "better" if change < -tolerance else "same"


def _workload_problem(a: Mapping[str, Any], b: Mapping[str, Any], workload_a: str | None,
                      workload_b: str | None) -> str | None:
    world_a, world_b = _number(a.get("world_size")), _number(b.get("world_size"))
    if world_a is not None and world_b is not None and world_a != world_b:
        return f"different workloads: world size {int(world_a)} vs {int(world_b)}"
    if workload_a and workload_b and workload_a != workload_b:
        return f"different workloads: {workload_a} vs {workload_b}"
    return None


def compare_verdict(a: Mapping[str, Any], b: Mapping[str, Any], *, rule: CompareRule = CompareRule(),
                    max_step_time_regression_pct: float | None = None, workload_a: str | None = None,
                    workload_b: str | None = None) -> dict[str, Any]:
    """The verdict on B against A: ``verdict``, ``reasons`` (one line each), ``signals``, the
    changes it was decided from, and ``exit_code`` (3 inconclusive; 4 when the median step time
    rose by more than ``max_step_time_regression_pct`` percent; else 0)."""
    steps_a, steps_b = _number(_get(a, "overall", "steps")), _number(_get(b, "overall", "steps"))
    median_a, median_b = (_number(_get(a, "overall", "step_ms", "median")),
                          _number(_get(b, "overall", "step_ms", "median")))
    stall_a, stall_b = _stall_share(a), _stall_share(b)
    memory_a, memory_b = _memory_peak(a), _memory_peak(b)
    step_change = _relative(median_a, median_b)
    stall_change = None if stall_a is None or stall_b is None else stall_b - stall_a
    memory_change = _relative(memory_a, memory_b)
    changes = {"step_time_median_ms": {"a": median_a, "b": median_b, "relative": step_change},
               "stall_share": {"a": stall_a, "b": stall_b, "delta": stall_change},
               "memory_peak_allocated_bytes": {"a": memory_a, "b": memory_b, "relative": memory_change}}
    result: dict[str, Any] = {"verdict": "INCONCLUSIVE", "reasons": [], "signals": {}, "changes": changes,
                              "max_step_time_regression_pct": max_step_time_regression_pct,
                              "regression_past_threshold": False, "exit_code": EXIT_INCONCLUSIVE,
                              "rule": {"step_tolerance": rule.step_tolerance, "share_tolerance": rule.share_tolerance,
                                       "memory_tolerance": rule.memory_tolerance, "min_steps": rule.min_steps}}
    problems = [f"too few steps in {name}: {int(n) if n is not None else 'none'} (at least {rule.min_steps})"
                for name, n in (("A", steps_a), ("B", steps_b)) if n is None or n < rule.min_steps]
    if step_change is None:
        problems.append("no step time to compare")
    workload = _workload_problem(a, b, workload_a, workload_b)
    if workload:
        problems.append(workload)
    if problems:
        result["reasons"] = problems
        return result
    assert step_change is not None
    signals = {"step_time": _signal(step_change, rule.step_tolerance),
               "stall_share": _signal(stall_change, rule.share_tolerance),
               "memory": _signal(memory_change, rule.memory_tolerance)}
    result["signals"] = signals
    seen = {s for s in signals.values() if s is not None}
    verdict = ("MIXED" if {"worse", "better"} <= seen else "REGRESSION" if "worse" in seen
               else "IMPROVEMENT" if "better" in seen else "EQUIVALENT")
    reasons = [f"median step time {median_a:.3g} -> {median_b:.3g} ms ({step_change * 100:+.1f}%)"]
    if stall_change is not None:
        reasons.append(f"stall share (data_load + h2d + residual) {stall_a:.3f} -> {stall_b:.3f} "
                       f"({stall_change:+.3f})")
    if memory_change is not None:
        reasons.append(f"peak allocated memory {memory_a / 2**20:.1f} -> {memory_b / 2**20:.1f} MiB "  # type: ignore[operator]
                       f"({memory_change * 100:+.1f}%)")
    past = max_step_time_regression_pct is not None and step_change * 100 > max_step_time_regression_pct
    if past:
        reasons.append(f"the step time rose past the threshold of {max_step_time_regression_pct:g}%")
    result.update(verdict=verdict, reasons=reasons, regression_past_threshold=past,
                  exit_code=EXIT_REGRESSION if past else EXIT_FINE)
    return result
