"""The training thread's bounded tables (phases, error events, progress) drained into the rank's
outputs, oldest first, a chunk at a time.

On the sampler a drain takes at most the rows queued when it starts (later ones wait for the
next tick, so a fast producer cannot starve sampling) and gives way as soon as ``stop`` waits.
In ``stop`` it writes everything until a deadline; the phase and progress rows still queued then
are counted in ``dropped_at_stop`` (error events are few and always written).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..guard import Site, report_internal
from ..schema import TelemetryEventV3
from .events import EventFactory
from .rank_outputs import RankOutputs
from .tables import BoundedTable

__all__ = ["DRAIN_CHUNK", "TableDrain"]

# Rows taken out of a table per step of a drain: the extra memory while the table refills, and
# how long ``stop`` waits for the sampler to give way (about 2048 records at ~5-20 us each).
DRAIN_CHUNK = 2048


class TableDrain:
    """Drains ``phases``, ``errors`` and ``progress`` into ``outputs``. ``factory`` builds the
    phase events (read at each chunk: a test may replace its ``phase``), ``prefix`` is the scopes'
    id prefix, ``heartbeat(msg, ts=, step=, **metrics)`` builds a progress record and
    ``stopping()`` says that ``stop`` is waiting."""

    def __init__(self, phases: BoundedTable[tuple[Any, ...]], errors: BoundedTable[TelemetryEventV3],
                 progress: BoundedTable[tuple[float, int, dict[str, Any]]], outputs: RankOutputs, *,
                 factory: EventFactory, prefix: str, heartbeat: Callable[..., dict[str, Any]],
                 stopping: Callable[[], bool]) -> None:
        self.phases = phases
        self.errors = errors
        self.progress = progress
        self.outputs = outputs
        self.factory = factory
        self._prefix = prefix
        self._heartbeat = heartbeat
        self._stopping = stopping
        self.dropped_at_stop: dict[str, int] = {"phases": 0, "progress": 0}

    def backlog(self) -> bool:
        """A table is a quarter full (or more): the sampler looks again soon, not a period later."""
        quarter = self.phases.maxlen // 4
        return len(self.phases) >= quarter or len(self.progress) >= quarter

    def run(self, deadline: float | None = None) -> bool:
        """Writes the queued rows; on the sampler (``deadline`` None) False as soon as ``stop``
        waits, the rest left queued for it. In ``stop``: until ``deadline`` (monotonic)."""
        for table, write in ((self.phases, self._write_phases), (self.errors, self._write_errors),
                             (self.progress, self._write_progress)):
            budget = len(table)
            while budget > 0:
                if deadline is not None and table is not self.errors and time.monotonic() >= deadline:
                    self.dropped_at_stop[table.name] += len(table.drain())
                    break
                rows = table.drain(min(budget, DRAIN_CHUNK))
                if not rows:
                    break
                budget -= len(rows)
                write(rows)
                if deadline is None and self._stopping():  # set by stop() before it waits for the lock
                    return False
        return True

    def _write_phases(self, rows: list[tuple[Any, ...]]) -> None:
        phase, prefix, write, outputs = self.factory.phase, self._prefix, self.outputs.write, self.outputs
        for row in rows:
            try:
                event = phase(row, prefix)
            except Exception as exc:  # noqa: BLE001 - one bad row must not lose the chunk
                outputs.rows_unwritable += 1
                report_internal(exc, Site.DRAIN_PHASE)
                continue
            write(event)

    def _write_errors(self, rows: list[TelemetryEventV3]) -> None:
        write = self.outputs.write
        for event in rows:
            write(event)

    def _write_progress(self, rows: list[tuple[float, int, dict[str, Any]]]) -> None:
        outputs = self.outputs
        for ts, step, metrics in rows:
            try:
                outputs.heartbeat_write(self._heartbeat("progress", ts=ts, step=step, **metrics))
            except Exception as exc:  # noqa: BLE001 - e.g. a metric named like a required field
                outputs.rows_unwritable += 1
                report_internal(exc, Site.DRAIN_PROGRESS)
