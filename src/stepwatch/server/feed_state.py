"""What the aggregator's feeds (Prometheus ``/metrics``, OTLP metrics) report: the current figures
of every rank of the sessions it keeps, read when a scraper asks, never on the ingest path.

The figures are the live view's (``views.live.LiveReader``: each rank's median step time, rate,
phase shares, memory and heartbeat age over its last steps, from the step ledgers or the
history), one reader per session, so ``/metrics``, ``stepwatch top`` and the dashboard agree. To
them it adds what the live view does not carry: the last ``loss`` mark of each rank (the inferred
loss, or the one the program logs), one index seek of the history (``marks_by_session``), and
the upper quantiles of the step time over the ledger's window.

Bounded cardinality: at most ``max_sessions`` sessions are reported (the newest by first frame),
and a session whose ranks have all stopped is dropped ``finished_ttl_s`` after its end. A
``serve`` that has taken a thousand sessions reports the last few, and forgets the readers of the
others, so neither the exposition nor this process grows without end.

Reading costs one snapshot per session and is cached for ``cache_s`` (a Prometheus scrape and an
OTLP export in the same second share one read). Thread-safe: one lock around the readers, and
another around the alert counts, which the aggregator's loop takes (never behind a read).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_FINISHED_TTL_S", "DEFAULT_MAX_SESSIONS", "FeedState", "RankFigures", "SessionFigures"]

DEFAULT_MAX_SESSIONS = 8
DEFAULT_FINISHED_TTL_S = 600.0
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class RankFigures:
    """One rank's figures now (``views.live.RankLive``'s, plus the loss and step-time quantiles)."""

    rank: int
    host: str
    step: int | None
    step_time_quantiles: dict[float, float]
    steps_per_s: float | None
    phase_shares: dict[str, float]
    memory_bytes: int | None
    memory_peak_bytes: int | None
    memory_kind: str | None
    memory_devices: dict[str, tuple[int, int]]  # device ("0", "1", ... or "rss") -> (latest, peak) bytes
    heartbeat_age_s: float | None
    loss: float | None
    state: str


@dataclass(frozen=True)
class SessionFigures:
    session_id: str
    ranks: tuple[RankFigures, ...]
    verdict: dict[str, Any] | None
    ended: bool
    alerts: dict[str, int] = field(default_factory=dict)  # kind -> count since the aggregator started


class FeedState:
    """Example::

        state = FeedState(run_dir, aggregator)
        for session in state.sessions():
            ...
        state.note_event({"event": "alert", "alert": {...}})  # from the aggregator's emit
    """

    def __init__(self, run_dir: Path, aggregator: Any, *, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 finished_ttl_s: float = DEFAULT_FINISHED_TTL_S, cache_s: float = 0.5,
                 clock: Any = time.monotonic) -> None:
        self.run_dir = run_dir
        self.aggregator = aggregator
        self.max_sessions = max(1, max_sessions)
        self.finished_ttl_s = finished_ttl_s
        self.cache_s = cache_s
        self.clock = clock
        self._lock = threading.Lock()  # the readers: held through a read (a scrape, an OTLP collection)
        # the alert counts: taken on the aggregator's loop (its emit), so never behind a read
        self._alert_lock = threading.Lock()
        self._readers: dict[str, Any] = {}
        self._ended_at: dict[str, float] = {}  # session -> when first seen ended (clock)
        self._expired: set[str] = set()
        self._alerts: dict[str, Counter[str]] = {}
        self._cached: tuple[float, list[SessionFigures]] | None = None
        self._db: sqlite3.Connection | None = None
        self.expired_sessions = 0
        self.read_errors = 0

    # -- events (any thread: the aggregator's emit) ----------------------------------------------

    def note_event(self, message: dict[str, Any]) -> None:
        """Counts an alert by session and kind (``stepwatch_alerts_total``)."""
        if message.get("event") != "alert":
            return
        alert = message.get("alert") or {}
        session = alert.get("session_id") or getattr(self.aggregator, "session_id", None) or ""
        kind = str(alert.get("kind") or "UNKNOWN")
        with self._alert_lock:
            if session not in self._alerts and len(self._alerts) >= 4 * self.max_sessions:
                self._alerts.pop(next(iter(self._alerts)))  # the oldest session's counts
            self._alerts.setdefault(session, Counter())[kind] += 1

    # -- reading (the scrape's thread, the OTLP reader's thread) ---------------------------------

    def sessions(self) -> list[SessionFigures]:
        """The kept sessions' figures, newest last; cached for ``cache_s``."""
        with self._lock:
            now = self.clock()
            if self._cached is not None and now - self._cached[0] < self.cache_s:
                return self._cached[1]
            figures = self._read(now)
            self._cached = (now, figures)
            return figures

    def _kept(self, now: float) -> list[str]:
        """The sessions reported: of the newest ``max_sessions``, those not expired (a finished
        session that expired is not replaced by an older one)."""
        seen = self.aggregator.sessions_in_order()[-self.max_sessions:]
        for session, ended in list(self._ended_at.items()):
            if now - ended >= self.finished_ttl_s and session not in self._expired:
                self._expired.add(session)
                self.expired_sessions += 1
        self._expired &= set(seen)  # a session out of the window stays out: no need to remember it
        kept = [s for s in seen if s not in self._expired]
        for session in list(self._readers):
            if session not in kept:
                self._readers.pop(session).close()
                self._ended_at.pop(session, None)
        return kept

    def _read(self, now: float) -> list[SessionFigures]:
        from ..views.live import LiveReader

        out = []
        hosts = self.aggregator.rank_hosts
        for session in self._kept(now):
            reader = self._readers.get(session)
            if reader is None:
                reader = self._readers[session] = LiveReader(self.run_dir, session)
            try:
                snapshot = reader.snapshot()
            except Exception:  # noqa: BLE001 - a feed never fails a scrape for one session's files
                self.read_errors += 1
                continue
            ended = snapshot.ended or bool(snapshot.ranks) and all(r.state in ("stopped", "lost")
                                                                   for r in snapshot.ranks)
            if ended:
                self._ended_at.setdefault(session, now)
            else:
                self._ended_at.pop(session, None)
            ranks = []
            for live in snapshot.ranks:
                quantiles = self._quantiles(reader, live)
                ranks.append(RankFigures(
                    rank=live.rank, host=str(hosts.get((session, live.rank)) or ""), step=live.step,
                    step_time_quantiles=quantiles, steps_per_s=live.steps_per_s, phase_shares=dict(live.phase_shares),
                    memory_bytes=live.memory_bytes, memory_peak_bytes=live.memory_peak_bytes,
                    memory_kind=live.memory_kind, memory_devices=reader.memory_devices(live.rank),
                    heartbeat_age_s=live.heartbeat_age_s,
                    loss=self._loss(session, live.rank), state=live.state))
            with self._alert_lock:
                alerts = dict(self._alerts.get(session, {}))
            out.append(SessionFigures(session, tuple(ranks), snapshot.verdict, ended, alerts))
        return out

    @staticmethod
    def _quantiles(reader: Any, live: Any) -> dict[float, float]:
        """The median is the live view's; the 0.9 and 0.99 quantiles come from the same ledger
        window where the rank has one (a rank only the history knows has its median alone)."""
        found: dict[float, float] = {}
        if live.step_time_s is not None:
            found[0.5] = live.step_time_s
        durations = reader.step_durations(live.rank)
        if durations is not None and len(durations):
            import numpy as np

            for q in QUANTILES[1:]:
                found[q] = float(np.quantile(durations, q)) / 1e9
        return found

    def _loss(self, session: str, rank: int) -> float | None:
        """The rank's last ``loss`` mark: one seek down ``marks_by_session``."""
        db = self._connect()
        if db is None:
            return None
        try:
            row = db.execute("SELECT value_num FROM marks WHERE session_id = ? AND rank = ? AND name = 'loss' "
                             "ORDER BY ts_ns DESC LIMIT 1", (session, rank)).fetchone()
        except sqlite3.Error:
            self.read_errors += 1
            return None
        return float(row[0]) if row is not None and isinstance(row[0], (int, float)) else None

    def _connect(self) -> sqlite3.Connection | None:
        if self._db is None:
            path = self.run_dir / "history.sqlite"
            if not path.is_file():
                return None
            try:
                self._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=0.2,
                                           check_same_thread=False)
            except sqlite3.Error:
                return None
        return self._db

    def close(self) -> None:
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()
            if self._db is not None:
                self._db.close()
                self._db = None
