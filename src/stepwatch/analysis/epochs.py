"""Epochs of a run: how many, how long, how many steps each, and the evaluation inside them.

Built from span rows (the history's ``spans`` table, or a spool's span records): the ``epoch``
spans, and the ``step`` and ``eval_step`` spans of the same rank that start inside each epoch's
time (a step nested under a scope of the epoch still counts). The same function serves the
final summary and ``stepwatch inspect``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from statistics import median
from typing import Any

__all__ = ["epoch_report", "render_epoch_line"]

_MAX_LISTED = 1000  # epochs listed one by one in the report (the statistics take them all)


def _median(values: list[float]) -> float | None:
    return median(values) if values else None


def _interval(span: Mapping[str, Any]) -> tuple[int, int] | None:
    start, end = span.get("start_ns"), span.get("end_ns")
    if type(start) is not int or type(end) is not int or end < start:
        return None
    return start, end


def epoch_report(spans: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The epochs in ``spans`` (dicts with rank, name, start_ns, end_ns and ``idx`` or ``index``),
    or None when there are none. Durations in ms; ``count`` and ``total_ms`` are the busiest
    rank's (every rank runs every epoch), the medians and means are over all ranks' epochs."""
    epochs: dict[int, list[tuple[int, int, Any]]] = defaultdict(list)
    steps: dict[int, list[int]] = defaultdict(list)
    evals: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for span in spans:
        name = span.get("name")
        if name not in ("epoch", "step", "eval_step"):
            continue
        interval = _interval(span)
        if interval is None:
            continue
        rank = span.get("rank")
        rank = rank if type(rank) is int else 0
        if name == "epoch":
            epochs[rank].append((*interval, span.get("idx", span.get("index"))))
        elif name == "step":
            steps[rank].append(interval[0])
        else:
            evals[rank].append(interval)
    if not epochs:
        return None
    listed: list[dict[str, Any]] = []
    durations: list[float] = []
    step_counts: list[int] = []
    per_rank: dict[str, dict[str, Any]] = {}
    for rank in sorted(epochs):
        rank_steps = sorted(steps[rank])
        total_ms = eval_total_ms = 0.0
        for start, end, index in sorted(epochs[rank], key=_epoch_order):
            took = (end - start) / 1e6
            n_steps = sum(1 for s in rank_steps if start <= s < end)
            inside = [(a, b) for a, b in evals[rank] if start <= a < end]
            eval_ms = _covered([(a, min(b, end)) for a, b in inside]) / 1e6
            durations.append(took)
            step_counts.append(n_steps)
            total_ms += took
            eval_total_ms += eval_ms
            if len(listed) < _MAX_LISTED:
                listed.append({"rank": rank, "index": index, "start_ns": start, "duration_ms": round(took, 3),
                               "steps": n_steps, "eval_steps": len(inside), "eval_ms": round(eval_ms, 3)})
        per_rank[str(rank)] = {"count": len(epochs[rank]), "total_ms": round(total_ms, 3),
                               "eval_ms": round(eval_total_ms, 3)}
    busiest = max(per_rank.values(), key=lambda r: (r["count"], r["total_ms"]))
    return {
        "count": busiest["count"],
        "duration_ms": {"median": _round(_median(durations)), "mean": _round(sum(durations) / len(durations)),
                        "total": busiest["total_ms"]},
        "steps_per_epoch": {"median": _median([float(n) for n in step_counts]), "min": min(step_counts),
                            "max": max(step_counts)},
        "eval_ms": {"total": busiest["eval_ms"],
                    "share": round(busiest["eval_ms"] / busiest["total_ms"], 4) if busiest["total_ms"] > 0 else None},
        "per_rank": per_rank,
        "epochs": listed,
    }


def _epoch_order(epoch: tuple[int, int, Any]) -> tuple[int, int, int, int]:
    """By interval, then index (an epoch without one last): any index type, never compared."""
    start, end, index = epoch
    return (start, end, 0 if type(index) is int else 1, index if type(index) is int else 0)


def _covered(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by the intervals, overlaps counted once (eval steps nested in
    another eval span, or on two threads, are not twice the time)."""
    total = 0
    reach = None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _duration(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"


def render_epoch_line(report: Mapping[str, Any] | None) -> str | None:
    """One line for the text summary and ``inspect``, or None without epochs."""
    if not report:
        return None
    duration, per_epoch, evaluation = report["duration_ms"], report["steps_per_epoch"], report["eval_ms"]
    median_steps = per_epoch["median"]
    steps = (f"{median_steps:g}" if per_epoch["min"] == per_epoch["max"]
             else f"median {median_steps:g} ({per_epoch['min']}-{per_epoch['max']})")
    line = (f"epochs {report['count']}  duration median {_duration(duration['median'])}  mean "
            f"{_duration(duration['mean'])}  total {_duration(duration['total'])}  steps/epoch {steps}")
    if evaluation["total"]:
        share = f" ({evaluation['share'] * 100:.1f}% of epoch time)" if evaluation.get("share") is not None else ""
        line += f"  eval {_duration(evaluation['total'])}{share}"
    else:
        line += "  eval none"
    return line
