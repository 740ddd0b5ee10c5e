"""Rows of the history's ``steps`` and ``telemetry`` tables, built the way stepwatch's capture
writes them, for the verdict tests (a fetch inside the step: ``wait_ns`` still holds it)."""

from __future__ import annotations

from typing import Any

MS = 1_000_000
T0 = 1_800_000_000_000_000_000
CPU = "stepwatch.cpu_tracker"
CUDA = "stepwatch.cuda_tracker"


def steps(rank: int, count: int, *, fetch: float = 0.2, h2d: float = 0.0, forward: float = 3.0,
          backward: float = 4.0, optimizer: float = 1.0, other: float = 0.3, gap: float = 0.05,
          first: int = 0, t0: int = T0, fetch_before: bool = False) -> list[dict[str, Any]]:
    """``count`` steps of rank ``rank``; times in ms. ``other``: host work inside the step outside
    every phase; ``gap``: wall time after each step; ``fetch_before``: the fetch happens before
    the step opens (a user-marked step that does not hold its fetch)."""
    out = []
    t = t0
    for i in range(count):
        inside = h2d + forward + backward + optimizer
        step = inside + other + (0 if fetch_before else fetch)
        start = t + int((fetch if fetch_before else 0) * MS)
        out.append({"rank": rank, "step": first + i, "start_ns": start, "end_ns": start + int(step * MS),
                    "step_ns": int(step * MS), "data_load_ns": int(fetch * MS), "h2d_ns": int(h2d * MS),
                    "forward_ns": int(forward * MS), "backward_ns": int(backward * MS),
                    "optimizer_ns": int(optimizer * MS), "recompute_ns": 0,
                    "wait_ns": int(step * MS) - int(inside * MS)})
        t = start + int(step * MS) + int(gap * MS)
    return out


def memory(rank: int, step_rows: list[dict[str, Any]], values: list[int], *, collector: str = CPU,
           total: int = 64 << 30, free: int | None = None, device: int = -1, host: str = "h") -> list[dict[str, Any]]:
    """One telemetry sample in the middle of each step, holding ``values[i]`` bytes."""
    out = []
    mine = [r for r in step_rows if r["rank"] == rank]
    for row, value in zip(mine, values):
        out.append({"rank": rank, "timestamp_ns": (row["start_ns"] + row["end_ns"]) // 2, "event_type": "sample",
                    "collector": collector, "device_id": device, "allocated": value, "reserved": value,
                    "free": (total - value) if free is None else free, "total": total, "host": host})
    return out
