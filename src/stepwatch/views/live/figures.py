"""A rank's figures over its last steps (the median step time, the rate, each phase's share), the
one computation for a window read from the step ledger and one read from the history, so both
sources of a rank always show the same numbers for the same steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...phases import PHASES, RESIDUAL


@dataclass(frozen=True)
class WindowFigures:
    """``step``: steps completed (the last index + 1); ``last_end_ns``: the last step's end (0: none)."""

    step: int | None = None
    step_time_s: float | None = None
    steps_per_s: float | None = None
    phase_shares: dict[str, float] = field(default_factory=dict)
    last_end_ns: int = 0


def window_figures(index: Any, start: Any, end: Any, phases: Any) -> WindowFigures:
    """The figures of a window of steps, oldest first: numpy int64 arrays of each step's ``index``,
    ``start`` and ``end`` (ns: exact in int64 only) and a (steps × phases) array of its phase
    times, in ``stepwatch.phases`` order (a ledger of an older layout may have fewer columns).
    ``wait``, the residual, is the step less every phase (never below 0)."""
    import numpy as np

    if not len(index):
        return WindowFigures()
    durations = (end - start).astype(np.float64)
    last_end = int(end[-1])
    rate = None
    if len(index) > 1:
        span = (last_end - int(end[0])) / 1e9
        rate = (len(index) - 1) / span if span > 0 else None
    shares: dict[str, float] = {}
    total = float(durations.sum())
    if total > 0:
        spent = phases.astype(np.float64)
        for column, phase in enumerate(PHASES[:spent.shape[1]]):
            shares[phase.share] = float(spent[:, column].sum()) / total
        shares[RESIDUAL.share] = float(np.maximum(durations - spent.sum(axis=1), 0.0).sum()) / total
    return WindowFigures(step=int(index[-1]) + 1, step_time_s=float(np.median(durations)) / 1e9, steps_per_s=rate,
                         phase_shares=shares, last_end_ns=last_end)
