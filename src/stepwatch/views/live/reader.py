"""``LiveReader``: one run directory's snapshot, composed from its sources (the ledgers, the
heartbeat files, the history, the memory samples and alerts followed in their files, the plan in
the spool, the final summary). Each source keeps its place between refreshes, so a refresh reads
only what is new."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from ...artifacts.alerts_log import ALERTS_FILE
from .figures import window_figures
from .heartbeats import HeartbeatRanks
from .history import HistoryReader
from .ledger import LedgerDirectory, MappedLedger
from .model import WINDOW, LiveSnapshot, RankLive, rank_state
from .plan import PlanReader
from .tails import AlertTail, MemorySamples
from .verdicts import OwnVerdict, final_primary, final_summary, read_json_object

__all__ = ["LiveReader"]

SUMMARY_GRACE_S = 15.0  # a ``run`` that says it ended and writes no summary (a remote aggregator's) ends this long after
LAUNCHER_GRACE_S = 90.0  # a ``run`` whose ranks all stopped ends once its launcher says so, or this long after


class LiveReader:
    """Builds ``LiveSnapshot``s of one run directory (one session: ``session_id``, else the one
    run.json names, else the newest ledger's, else the history's newest). Keep one reader for the
    life of a view: it keeps its place in the files it follows, so each refresh reads only what is
    new.

    Example::

        reader = LiveReader(run_dir)
        while not (snapshot := reader.snapshot()).ended:
            draw(snapshot); time.sleep(1)
        reader.close()
    """

    def __init__(self, run_dir: str | os.PathLike[str], session_id: str | None = None, *,
                 window: int = WINDOW, clock: Any = time.time) -> None:
        self.run_dir = Path(run_dir)
        self.session_id = session_id
        self.window = window
        self.clock = clock
        self._ledgers = LedgerDirectory(self.run_dir)
        self._memory: dict[int, MemorySamples] = {}
        self._heartbeats = HeartbeatRanks(self.run_dir, self._memory_of)
        self._history = HistoryReader(self.run_dir, window)
        self._alerts = AlertTail(self.run_dir / ALERTS_FILE)
        self._plan = PlanReader(self.run_dir)
        self._own = OwnVerdict(window)
        self._summary: dict[str, Any] | None = None  # the session's final_summary.json, once the run ended
        self._windows: dict[int, Any] = {}  # rank -> its last ledger window (for the engine's own verdict)
        self._local = True  # the ranks ran on this host (run.json's hosts): a dead pid means a dead rank

    def snapshot(self) -> LiveSnapshot:
        """The run now. Never raises for what the files hold."""
        now = self.clock()
        manifest = self._manifest()
        hosts = manifest.get("hosts")
        self._local = not isinstance(hosts, list) or not hosts or socket.gethostname() in hosts
        if self.session_id is None:
            self.session_id = manifest.get("session_id") if isinstance(manifest.get("session_id"), str) else None
        ranks = self._ranks(now)  # a session still unknown becomes the newest ledger's
        alerts = self._alerts.read(self.session_id)
        ended_at = _seconds(manifest.get("ended_at_ns"))
        if self._summary is None and ended_at is not None:
            self._summary = final_summary(self.run_dir, self.session_id)
        # an ended run's diagnosis (of the whole run) has the last word over the live window's
        final = final_primary(self._summary) if self._summary is not None else None
        verdict = final or self._history.live_verdict(self.session_id) or self._own_verdict(now)
        ended = (ended_at is not None and self._summarised(manifest, ended_at, now)) or _all_stopped(ranks, manifest)
        world = manifest.get("world_size") if type(manifest.get("world_size")) is int else None
        return LiveSnapshot(run_dir=str(self.run_dir), session_id=self.session_id, taken_at=now, ranks=tuple(ranks),
                            world_size=world or (len(ranks) or None), total_steps=self._plan.total(now),
                            verdict=verdict, alerts=tuple(alerts), ended=ended,
                            started_at=_seconds(manifest.get("started_at_ns")),
                            ended_at=_seconds(manifest.get("ended_at_ns")))

    def step_durations(self, rank: int) -> Any:
        """The step times (ns, a numpy array, oldest first) of the rank's last ledger window, as
        the last snapshot read it; None for a rank with no ledger here (the history's, another
        node's). The metrics feeds take upper quantiles from it."""
        records = self._windows.get(rank)
        if records is None:
            return None
        return records["end"] - records["start"]

    def memory_devices(self, rank: int) -> dict[str, tuple[int, int]]:
        """The rank's (latest, peak) memory per device (``MemoryFold.by_device``: ``"0"``, ``"1"``,
        ..., ``"rss"``), as the last snapshot read them; empty when none was read."""
        samples = self._memory.get(rank)
        fold = samples.fold if samples is not None else self._history.memory_fold(rank)
        return fold.by_device() if fold is not None else {}

    def close(self) -> None:
        """Unmaps the ledgers and closes the history (a later snapshot opens them again)."""
        self._ledgers.close()
        self._history.close()

    def _manifest(self) -> dict[str, Any]:
        value = read_json_object(self.run_dir / "run.json") or {}
        if self.session_id is not None and value.get("session_id") not in (None, self.session_id):
            return {}  # a reused run directory's manifest of another session
        return value

    def _summarised(self, manifest: dict[str, Any], ended_at: float, now: float) -> bool:
        """``stepwatch run`` writes run.json's end before the final summary (which reads it): its
        run has ended once the summary is there too, so the last frame shows the run's diagnosis."""
        return manifest.get("launcher") != "run" or self._summary is not None or now - ended_at > SUMMARY_GRACE_S

    def _own_verdict(self, now: float) -> dict[str, Any] | None:
        """With a history, the aggregator's verdicts are the run's and this is never computed."""
        if self._history.exists():
            return None
        return self._own.get(self.session_id, self._windows, now)

    # -- ranks: the ledgers first, then the heartbeat files, then the history --------------------

    def _ranks(self, now: float) -> list[RankLive]:
        newest = self._ledgers.newest_per_rank(self.session_id)
        if self.session_id is None and newest:
            self.session_id = next(iter(newest.values())).session_id
        ranks = {rank: self._from_ledger(ledger, now) for rank, ledger in newest.items()}
        for process in self._heartbeats.ranks(self.session_id, now, set(ranks)):
            ranks.setdefault(process.rank, process)
        if self.session_id is None:
            self.session_id = self._history.newest_session()
        for remote in self._history.ranks(self.session_id, now, set(ranks)):
            ranks.setdefault(remote.rank, remote)
        return [ranks[r] for r in sorted(ranks)]

    def _memory_of(self, rank: int) -> MemorySamples:
        if rank not in self._memory:
            self._memory[rank] = MemorySamples(self.run_dir / "telemetry" / f"rank{rank}")
        return self._memory[rank]

    def _from_ledger(self, ledger: MappedLedger, now: float) -> RankLive:
        records = ledger.window(self.window)
        self._windows[ledger.rank] = records
        figures = window_figures(records["index"], records["start"], records["end"], records["phases"])
        alive_ns, closed_ns = ledger.header_times()
        last_sign = max(alive_ns, figures.last_end_ns, closed_ns) / 1e9
        age = max(0.0, now - last_sign) if last_sign > 0 else None
        state = rank_state(age, bool(closed_ns))
        if state == "silent" and self._local and not _pid_alive(ledger.pid, ledger.started_ns):
            state = "lost"  # killed (SIGKILL, the OOM killer): its ledger was never closed
        current, peak, kind = self._memory_of(ledger.rank).read(self.session_id, now)
        return RankLive(rank=ledger.rank, step=figures.step, step_time_s=figures.step_time_s,
                        steps_per_s=figures.steps_per_s, phase_shares=figures.phase_shares, memory_bytes=current,
                        memory_peak_bytes=peak, memory_kind=kind, heartbeat_age_s=age, state=state)


def _all_stopped(ranks: list[RankLive], manifest: dict[str, Any]) -> bool:
    """Every rank stopped. Under ``stepwatch run`` the run ends when its launcher has written the
    summary (run.json's ``ended_at_ns``): until then, or ``LAUNCHER_GRACE_S`` after the last
    rank's end (a launcher that died), it is not over."""
    if not ranks or any(r.state not in ("stopped", "lost") for r in ranks):
        return False
    if manifest.get("launcher") != "run":
        return True
    return min(r.heartbeat_age_s or 0.0 for r in ranks) > LAUNCHER_GRACE_S


def _seconds(ns: Any) -> float | None:
    """run.json's nanoseconds in seconds (None: not there, or not a positive whole number)."""
    return ns / 1e9 if type(ns) is int and ns > 0 else None


def _pid_alive(pid: int, started_ns: int) -> bool:
    """Whether ``pid`` on this host may still be the rank that started its ledger at ``started_ns``."""
    from ...artifacts._files import process_alive

    return process_alive(socket.gethostname(), pid, started_ns or None)

