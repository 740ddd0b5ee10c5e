"""Epochs of a run: how many, how long, how many steps each, and the evaluation of each.

Built from span rows (the history's ``spans`` table, or a spool's span records): the ``epoch``
spans, the ``step`` spans of the same rank that start inside each epoch's time (a step nested
under a scope of the epoch still counts), and the ``eval_step`` spans of each epoch
(``eval_owner``): those that start inside it, and those that follow it, before the rank's next
epoch starts or the run ends. An epoch inferred from a pass over the training DataLoader ends
when the loader is exhausted, and a loop that evaluates after each pass (minGPT's trainer, most
hand-written loops) evaluates outside every epoch span: that evaluation is still the epoch's.
The same function serves the final summary and ``stepwatch inspect``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping
from statistics import median
from typing import Any

__all__ = ["epoch_report", "eval_owner", "render_epoch_line"]

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
        ordered = sorted(epochs[rank], key=_epoch_order)
        owned: list[list[tuple[int, int]]] = [[] for _ in ordered]
        starts = sorted(start for start, _, _ in ordered)
        for a, b in evals[rank]:
            owner = eval_owner(ordered, a)
            if owner is not None:
                # up to the rank's next epoch: evaluation that runs on into it is that one's time
                following = bisect_right(starts, a)
                owned[owner].append((a, min(b, starts[following]) if following < len(starts) else b))
        total_ms = eval_total_ms = after_total_ms = 0.0
        for (start, end, index), mine in zip(ordered, owned):
            took = (end - start) / 1e6
            n_steps = sum(1 for s in rank_steps if start <= s < end)
            eval_ms = _covered(mine) / 1e6
            after_ms = _covered([(max(a, end), b) for a, b in mine if b > end]) / 1e6
            durations.append(took)
            step_counts.append(n_steps)
            total_ms += took
            eval_total_ms += eval_ms
            after_total_ms += after_ms
            if len(listed) < _MAX_LISTED:
                listed.append({"rank": rank, "index": index, "start_ns": start, "duration_ms": round(took, 3),
                               "steps": n_steps, "eval_steps": len(mine), "eval_ms": round(eval_ms, 3),
                               "eval_after_ms": round(after_ms, 3)})
        per_rank[str(rank)] = {"count": len(epochs[rank]), "total_ms": round(total_ms, 3),
                               "eval_ms": round(eval_total_ms, 3), "eval_after_ms": round(after_total_ms, 3)}
    busiest = max(per_rank.values(), key=lambda r: (r["count"], r["total_ms"]))
    # the share of the epochs' time with the evaluation that followed them (<= 1)
    spent = busiest["total_ms"] + busiest["eval_after_ms"]
    return {
        "count": busiest["count"],
        "duration_ms": {"median": _round(_median(durations)), "mean": _round(sum(durations) / len(durations)),
                        "total": busiest["total_ms"]},
        "steps_per_epoch": {"median": _median([float(n) for n in step_counts]), "min": min(step_counts),
                            "max": max(step_counts)},
        "eval_ms": {"total": busiest["eval_ms"], "after_epochs": busiest["eval_after_ms"],
                    "share": round(min(1.0, busiest["eval_ms"] / spent), 4) if spent > 0 else None},
        "per_rank": per_rank,
        "epochs": listed,
    }


def eval_owner(epochs: list[tuple[int, int, Any]], start_ns: int) -> int | None:
    """Which of a rank's ``epochs`` (start, end, index), in ``_epoch_order``, an evaluation step
    that starts at ``start_ns`` belongs to: the epoch that holds it (the latest started of those
    that do, an epoch nested in another); else the epoch it follows (of those started before it,
    the latest ended, then the latest started); None before every epoch."""
    holding = None
    following = None
    for i, (start, end, _) in enumerate(epochs):
        if start > start_ns:
            continue
        if start_ns < end:
            if holding is None or start >= epochs[holding][0]:
                holding = i
        elif following is None or (end, start) >= (epochs[following][1], epochs[following][0]):
            following = i
    return holding if holding is not None else following


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
