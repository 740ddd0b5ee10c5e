"""The ranks of a run captured before the step ledger existed (or on a disk with no room for one),
from their ``heartbeat_rank<N>.jsonl`` files: re-read every few seconds, and not at all while every
rank has its ledger."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .model import RankLive
from .tails import MemorySamples

__all__ = ["HeartbeatRanks"]

_EVERY_S = 5.0  # the heartbeat files are re-read this often
_SILENT_AFTER_S = 60.0  # a heartbeat is written less often than a ledger's sign of life


class HeartbeatRanks:
    """The ranks with no ledger of the session shown, from their heartbeat files."""

    def __init__(self, run_dir: Path, memory: Callable[[int], MemorySamples]) -> None:
        self.run_dir = run_dir
        self._memory = memory
        self._read_at = 0.0
        self._processes: list[Any] = []

    def ranks(self, session_id: str | None, now: float, covered: set[int]) -> list[RankLive]:
        """The ranks not in ``covered`` (those with a ledger)."""
        if now - self._read_at >= _EVERY_S:
            self._read_at = now
            self._processes = self._read(session_id, covered)
        found = []
        for process in self._processes:
            if process.rank in covered:
                continue
            current, peak, kind = self._memory(process.rank).read(session_id, now)
            age = max(0.0, now - process.step_ts)
            state = "stopped" if process.stopped else ("silent" if age > _SILENT_AFTER_S else "running")
            found.append(RankLive(rank=process.rank, step=process.step, steps_per_s=process.steps_per_s,
                                  memory_bytes=current, memory_peak_bytes=peak, memory_kind=kind,
                                  heartbeat_age_s=age, state=state))
        return found

    def _read(self, session_id: str | None, covered: set[int]) -> list[Any]:
        from ...artifacts.live_ranks import HEARTBEAT_FILE, rank_processes

        try:
            files = [HEARTBEAT_FILE.match(e.name) for e in os.scandir(self.run_dir)]
        except OSError:
            files = []
        if {int(m.group(1)) for m in files if m is not None and not m.group(2)} <= covered:
            return []  # every rank has its ledger: the heartbeat files add nothing
        try:
            processes = rank_processes(self.run_dir)
        except (OSError, ValueError):
            return []
        return [p for p in processes if "-p" not in p.name and (session_id is None or p.session_id in (None, session_id))]
