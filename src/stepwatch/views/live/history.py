"""The run's ``history.sqlite``, read-only: the live verdicts the aggregator stored, and the ranks
no local file describes (another node's ranks in a multi-node run's hub, the sessions of a
``serve --out`` directory). Index seeks only, so a refresh costs the same on a long history."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgspec

from ..._decode import DECODE_FAILURES
from ...phases import PHASES
from ...store.sqlite import SESSION_RANKS
from .figures import window_figures
from .model import RankLive, rank_state
from .tails import MemoryFold

__all__ = ["HistoryReader"]

_RANKS_EVERY_S = 2.0  # the ranks only the history knows are re-read this often
# each rank of a session, by a skip-scan down steps_unique (session_key, rank, step)
_SESSION_RANKS = SESSION_RANKS + """SELECT rank FROM ranks
"""
_STEP_COLUMNS = ", ".join(["step", "start_ns", "end_ns", *(p.column for p in PHASES)])
_json = msgspec.json.Decoder()


class HistoryReader:
    """One run directory's history store, opened read-only once it exists."""

    def __init__(self, run_dir: Path, window: int) -> None:
        self.path = run_dir / "history.sqlite"
        self.window = window
        self._db: sqlite3.Connection | None = None
        self._ranks_at = float("-inf")
        self._ranks: list[RankLive] = []
        self._memory: dict[int, MemoryFold] = {}
        self._memory_ts: dict[int, int] = {}  # each rank's newest sample read

    def exists(self) -> bool:
        return self.path.exists()

    def _connect(self) -> sqlite3.Connection | None:
        """A read-only connection (None: there is no history yet)."""
        if self._db is None:
            if not self.path.is_file():
                return None
            try:
                self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=0.2,
                                           check_same_thread=False)
            except sqlite3.Error:
                return None
        return self._db

    def newest_session(self) -> str | None:
        """The newest session the history holds (a ``serve --out`` directory's)."""
        db = self._connect()
        if db is None:
            return None
        try:
            found = db.execute("SELECT session_id FROM sessions ORDER BY started_at_ns DESC LIMIT 1").fetchone()
        except sqlite3.Error:
            return None
        return found[0] if found is not None else None

    def ranks(self, session_id: str | None, now: float, covered: set[int]) -> list[RankLive]:
        """The session's ranks not in ``covered`` (those a local file describes), at most every
        ``_RANKS_EVERY_S``: each rank's last steps down ``steps_unique``, its newest samples down
        ``telemetry_unique``; the peak is kept from the samples read since the last look."""
        if now - self._ranks_at < _RANKS_EVERY_S:
            return [r for r in self._ranks if r.rank not in covered]
        self._ranks_at = now
        db = self._connect()
        if db is None or session_id is None:
            return []
        try:
            ranks = [r for (r,) in db.execute(_SESSION_RANKS, (session_id,)) if r is not None]
            rows = [self._rank(db, session_id, rank, now) for rank in ranks if rank not in covered]
        except sqlite3.Error:
            return [r for r in self._ranks if r.rank not in covered]
        self._ranks = rows
        return rows

    def _rank(self, db: sqlite3.Connection, session_id: str, rank: int, now: float) -> RankLive:
        import numpy as np

        steps = db.execute(f"SELECT {_STEP_COLUMNS} FROM steps WHERE session_id = ? AND rank = ? "
                           "ORDER BY step DESC LIMIT ?", (session_id, rank, self.window)).fetchall()[::-1]
        # ns: exact in int64 only
        table = np.array([[v or 0 for v in row] for row in steps] or np.zeros((0, 3 + len(PHASES))), dtype=np.int64)
        figures = window_figures(table[:, 0], table[:, 1], table[:, 2], table[:, 3:])
        fold = self._memory.setdefault(rank, MemoryFold())
        newest = self._memory_ts.get(rank, 0)
        for ts, device, allocated in db.execute(
                "SELECT timestamp_ns, device_id, allocated FROM telemetry WHERE session_id = ? AND rank = ? "
                "AND timestamp_ns > ? AND event_type = 'sample' ORDER BY timestamp_ns", (session_id, rank, newest)):
            newest = max(newest, ts or 0)
            if type(allocated) is int:
                fold.add(device, allocated)
        self._memory_ts[rank] = newest
        last = db.execute("SELECT timestamp_ns, event_type FROM telemetry WHERE session_id = ? AND rank = ? "
                          "ORDER BY timestamp_ns DESC LIMIT 1", (session_id, rank)).fetchone()
        sign = max(figures.last_end_ns, last[0] or 0 if last else 0) / 1e9
        age = max(0.0, now - sign) if sign > 0 else None
        current, peak, kind = fold.now()
        return RankLive(rank=rank, step=figures.step, step_time_s=figures.step_time_s,
                        steps_per_s=figures.steps_per_s, phase_shares=figures.phase_shares, memory_bytes=current,
                        memory_peak_bytes=peak, memory_kind=kind, heartbeat_age_s=age,
                        state=rank_state(age, bool(last and last[1] == "stop")))

    def memory_fold(self, rank: int) -> MemoryFold | None:
        """The rank's memory samples read so far (None: a rank this reader has not read)."""
        return self._memory.get(rank)

    def live_verdict(self, session_id: str | None) -> dict[str, Any] | None:
        """The newest primary verdict the aggregator stored for the session (None: none yet, or
        no history)."""
        db = self._connect() if session_id is not None else None
        if db is None:
            return None
        try:
            row = db.execute(
                "SELECT name, severity, ranks, message, next_step, step, ts_ns FROM verdicts "
                "WHERE session_id = ? ORDER BY ts_ns DESC LIMIT 1", (session_id,)).fetchone()
        except sqlite3.Error:
            return None  # not created yet, busy, or damaged: the view goes on without it
        if row is None:
            return None
        try:
            ranks = _json.decode(row[2]) if isinstance(row[2], str) else []
        except DECODE_FAILURES:
            ranks = []
        return {"name": row[0], "severity": row[1], "ranks": [r for r in ranks if type(r) is int]
                if isinstance(ranks, list) else [], "message": row[3], "next_step": row[4], "step": row[5]}

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
