"""The live view's data: what every rank of a running job is doing now, the run's current primary
verdict and its latest alerts, as one pure ``LiveSnapshot``, and the rule that folds many ranks
down to the few worth a row (``fold_ranks``).

``LiveReader`` builds snapshots from the run directory's own files, the ones the ranks write
whatever else runs, so the same view works under ``stepwatch run``, for ``stepwatch top`` of a job
started elsewhere (``init``, ``track``, another terminal) and for a finished run:

- ``ledger/rank<R>-<pid>.steps`` (each rank's step ledger, a memory-mapped ring written on every
  step): the latest step, the last 100 steps' times and phase times, and the sampler's sign of
  life (``alive_ns``, every tick) and clean stop (``closed_ns``). Mapped read-only and read with
  numpy: a refresh costs the same at step 100 and step 10 million;
- ``heartbeat_rank<N>.jsonl``: the ranks of a run captured before the ledger existed (or on a
  disk with no room for one);
- ``telemetry/rank<N>/segment-*.jsonl``: the memory samples (device, else the process's RSS),
  followed from where the last refresh stopped, for the current value and the peak;
- ``alerts.jsonl``: the watchdog's alerts, followed the same way;
- ``history.sqlite`` (read-only, when there is one): the live verdicts the aggregator stored,
  and the ranks no local file describes (another node's; a ``serve --out`` directory's);
  ``final_summary.json``: the diagnosis of a run that has ended; with neither (``init``,
  ``track``), the verdict engine over the ledgers' last steps, every 10 s;
- ``spool/`` batch files: the ``stepwatch.plan`` and ``stepwatch.dataloader`` marks that make
  the run's total steps known (read only until it is known).

Nothing here writes, talks to the aggregator or imports torch; reading is fail-open: a file that
is missing, torn or damaged leaves its part of the snapshot empty, never an exception.
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import sqlite3
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES
from ..artifacts.alerts_log import ALERTS_FILE
from ..artifacts.step_ledger import HEADER, HEADER_SIZE, LEDGER_DIR, MAGIC, READS
from ..phases import PHASES, RESIDUAL

__all__ = ["FOLD_ABOVE", "WINDOW", "LiveReader", "LiveSnapshot", "RankLive", "fold_ranks", "job_progress",
           "named_ranks"]

WINDOW = 100  # steps the step time (median), rate and phase shares are measured over
FOLD_ABOVE = 16  # ranks shown one a row up to this many; above, folded (``fold_ranks``)
ALERTS_KEPT = 5  # the latest alerts a snapshot carries
PLAN_MARK = "stepwatch.plan"  # the run's plan (epochs, max_steps), as capture records it
DATALOADER_MARK = "stepwatch.dataloader"  # capture/program_settings.py's: a loader's settings, ``batches`` among them
SILENT_AFTER_S = 15.0  # a rank with no sign of life for this long is shown ``silent`` (``lost`` once its pid is gone)
OWN_VERDICT_EVERY_S = 10.0  # a run with no history: the engine over the ledgers this often
LAUNCHER_GRACE_S = 90.0  # a ``run`` whose ranks all stopped ends once its launcher says so, or this long after
_PLAN_EVERY_S = 2.0  # the spool is looked at this often while the total is unknown
_HEARTBEAT_EVERY_S = 5.0  # ranks without a ledger (older runs) are re-read this often
_HISTORY_EVERY_S = 2.0  # ranks only the history knows (another node's, a serve directory's) are re-read this often
_LIST_EVERY_S = 5.0  # a rank's telemetry folder is listed this often (a new segment is rare)
_LEDGER_NAME = re.compile(r"^rank(\d+)-(\d+)\.steps$")
_SINK_RANK = re.compile(r"^rank(\d+)$")
_BATCH = re.compile(r"^\d{20}-.+\.json$")
# each rank of a session, by a skip-scan down steps_unique (session_key, rank, step)
_HISTORY_RANKS = """
WITH RECURSIVE ranks(rank) AS (
    SELECT (SELECT rank FROM steps WHERE session_id = ?1 ORDER BY rank LIMIT 1)
    UNION ALL
    SELECT (SELECT rank FROM steps WHERE session_id = ?1 AND rank > ranks.rank ORDER BY rank LIMIT 1)
    FROM ranks WHERE ranks.rank IS NOT NULL
)
SELECT rank FROM ranks
"""
SHARE_NAMES: tuple[str, ...] = (*(p.share for p in PHASES), RESIDUAL.share)


@dataclass(frozen=True)
class RankLive:
    """One rank now. ``step``: steps it completed; ``step_time_s``: median of its last ``WINDOW``
    steps; ``steps_per_s``: its rate over them; ``phase_shares``: each phase's share of their
    time (``stepwatch.phases`` share names, ``wait`` the rest); ``memory_bytes``/``memory_peak_bytes``:
    its latest and highest memory sample, of ``memory_kind`` ``"device"`` (an accelerator's
    allocation) or ``"rss"`` (the process, when it uses no device); ``heartbeat_age_s``: seconds
    since its last sign of life; ``state``: ``running``, ``stopped`` (a clean end), ``silent``
    (no sign of life for ``SILENT_AFTER_S``) or ``lost`` (silent, and its process is gone: killed)."""

    rank: int
    step: int | None = None
    step_time_s: float | None = None
    steps_per_s: float | None = None
    phase_shares: dict[str, float] = field(default_factory=dict)
    memory_bytes: int | None = None
    memory_peak_bytes: int | None = None
    memory_kind: str | None = None
    heartbeat_age_s: float | None = None
    state: str = "running"


@dataclass(frozen=True)
class LiveSnapshot:
    """The whole view at ``taken_at`` (seconds since the epoch). ``verdict``: the current primary
    verdict (``name``, ``severity``, ``ranks``, ``message``, ``next_step``) or None; ``alerts``: the
    latest alerts, oldest first (``kind``, ``severity``, ``ranks``, ``step``, ``message``, ``ts``);
    ``total_steps``: the steps the run will take where known; ``ended``: every rank stopped or
    the launcher recorded the run's end; ``started_at``/``ended_at``: run.json's (seconds)."""

    run_dir: str
    session_id: str | None
    taken_at: float
    ranks: tuple[RankLive, ...] = ()
    world_size: int | None = None
    total_steps: int | None = None
    verdict: dict[str, Any] | None = None
    alerts: tuple[dict[str, Any], ...] = ()
    ended: bool = False
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def elapsed_s(self) -> float | None:
        """How long the run has gone (went, once ended), from run.json's times."""
        if self.started_at is None:
            return None
        return max(0.0, (self.ended_at or self.taken_at) - self.started_at)

    @property
    def step(self) -> int | None:
        """The job's step: the least any rank completed (a collective job goes at its slowest; a
        rank with no step yet has done none). None before any rank's first step."""
        if all(r.step is None for r in self.ranks):
            return None
        return min(r.step or 0 for r in self.ranks)

    @property
    def steps_per_s(self) -> float | None:
        """The job's rate: its slowest running rank's."""
        rates = [r.steps_per_s for r in self.ranks if r.steps_per_s is not None]
        return min(rates) if rates else None

    @property
    def step_time_s(self) -> float | None:
        """The job's step time: its slowest rank's median."""
        times = [r.step_time_s for r in self.ranks if r.step_time_s is not None]
        return max(times) if times else None


def named_ranks(snapshot: LiveSnapshot) -> set[int]:
    """The ranks the primary verdict or an alert names: never folded away. A verdict or alert
    on every rank of a run of several (a run-wide finding) names none in particular."""
    named: set[int] = set()
    everyone = {r.rank for r in snapshot.ranks}
    for source in (snapshot.verdict, *snapshot.alerts):
        ranks = {rank for rank in (source or {}).get("ranks") or () if type(rank) is int}
        if len(everyone) > 1 and ranks >= everyone:
            continue
        named |= ranks
    return named


def fold_ranks(ranks: tuple[RankLive, ...] | list[RankLive], named: set[int] | frozenset[int] = frozenset(),
               limit: int = FOLD_ABOVE) -> list[RankLive]:
    """The ranks to show, by rank. Up to ``limit`` ranks: all of them. Above: the slowest, the
    fastest and the median rank (by step time; ranks with none yet by their step count, fewest
    first, as the slowest), plus every rank in ``named`` (an alert's or the verdict's culprits)."""
    if len(ranks) <= limit:
        return sorted(ranks, key=lambda r: r.rank)
    # slowest first: the longest step time; a rank with no step time yet, behind, counts slowest
    ordered = sorted(ranks, key=lambda r: (r.step_time_s is not None, -(r.step_time_s or 0.0),
                                           r.step if r.step is not None else -1, r.rank))
    keep = {ordered[0].rank, ordered[-1].rank, ordered[len(ordered) // 2].rank} | set(named)
    return sorted((r for r in ranks if r.rank in keep), key=lambda r: r.rank)


def job_progress(snapshot: LiveSnapshot) -> tuple[int | None, int | None]:
    """(steps done, total steps) for the progress bar; the total None where unknown."""
    return snapshot.step, snapshot.total_steps


# -- reading the run directory -----------------------------------------------------------------


class _Sample(msgspec.Struct):
    session_id: str | None = None
    event_type: str | None = None
    device_id: int | None = None
    allocator_allocated_bytes: int | None = None


class _Alert(msgspec.Struct):
    ts: float | None = None
    kind: str | None = None
    severity: str | None = None
    ranks: list[int] | None = None
    step: int | None = None
    message: str | None = None
    session_id: str | None = None


class _Mark(msgspec.Struct):
    name: str | None = None
    value: Any = None
    attrs: dict[str, Any] | None = None


class _Batch(msgspec.Struct):
    marks: list[_Mark] = []


_sample_decoder = msgspec.json.Decoder(_Sample)
_alert_decoder = msgspec.json.Decoder(_Alert)
_batch_decoder = msgspec.json.Decoder(_Batch)
_json = msgspec.json.Decoder()
_U64 = struct.Struct("<Q")


class _Ledger:
    """One step ledger, mapped read-only. The ring's records are viewed in place as a numpy
    structured array; each read copies out only the last ``WINDOW`` records."""

    def __init__(self, path: Path) -> None:
        import numpy as np

        self.path = path
        with path.open("rb") as file:
            head = file.read(HEADER_SIZE)
            if len(head) < HEADER.size:
                raise ValueError("short header")
            magic, version, record_size, capacity, rank, pid, started_ns, _, _, raw_id = HEADER.unpack_from(head)
            if magic != MAGIC or version not in READS or record_size % 8 or record_size < 48 or capacity <= 0:
                raise ValueError("not a step ledger")
            stat = os.fstat(file.fileno())
            full = HEADER_SIZE + capacity * record_size
            if stat.st_size < full:  # still being allocated (or cut short): asked again next refresh
                raise ValueError("not allocated in full")
            self.map = mmap.mmap(file.fileno(), full, access=mmap.ACCESS_READ)
            self.inode, self.size = stat.st_ino, full
            size = full
        self.rank, self.pid, self.started_ns = rank, pid, started_ns
        self.session_id = raw_id.rstrip(b"\0").decode("ascii", "replace")
        self.phases = record_size // 8 - 5
        self.record_size = record_size
        self._newest = 0
        self.capacity = min(capacity, max(0, size - HEADER_SIZE) // record_size)
        self.dtype = np.dtype([("seq", "<u8"), ("index", "<i8"), ("start", "<i8"), ("end", "<i8"),
                               ("phases", "<i8", (self.phases,)), ("tail", "<u8")])

    def intact(self) -> bool:
        """The file is still the one mapped, at its full size: reading a mapped page a truncated
        file no longer has would kill this process (SIGBUS), so a changed file is mapped anew."""
        try:
            stat = self.path.stat()
        except OSError:
            return False
        return stat.st_ino == self.inode and stat.st_size >= self.size

    def header_times(self) -> tuple[int, int]:
        """(alive_ns, closed_ns): the sampler's last sign of life, the clean stop (0: none)."""
        _, _, _, _, _, _, _, alive_ns, closed_ns, _ = HEADER.unpack_from(self.map, 0)
        return alive_ns, closed_ns

    def _whole(self, seq: int) -> bool:
        """Record ``seq`` sits whole in its slot (its first and last words both say ``seq``)."""
        offset = HEADER_SIZE + ((seq - 1) % self.capacity) * self.record_size
        if offset + self.record_size > len(self.map):
            return False
        return bool(_U64.unpack_from(self.map, offset)[0] == seq
                    == _U64.unpack_from(self.map, offset + self.record_size - 8)[0])

    def newest(self) -> int:
        """The newest whole record's sequence number (0: none). From the last one known, a
        binary search over the ring's next ``capacity`` numbers (a dozen reads: record n lives in
        slot n - 1 modulo capacity, whole up to the newest); a full scan when the ring lapped
        the last one known, or at first."""
        known = self._newest
        if known and self._whole(known):
            low, high = known, known + self.capacity
            while high - low > 1:
                middle = (low + high) // 2
                if self._whole(middle):
                    low = middle
                else:
                    high = middle
            self._newest = low
            return low
        import numpy as np

        records = np.frombuffer(self.map, dtype=self.dtype, count=self.capacity, offset=HEADER_SIZE)
        try:
            seq = records["seq"]
            whole = (seq == records["tail"]) & (seq > 0)
            self._newest = int(seq[whole].max()) if whole.any() else 0
        finally:
            del records  # no view may outlive the mapping
        return self._newest

    def window(self, size: int) -> Any:
        """The last ``size`` whole records, oldest first (a numpy structured array, copied)."""
        import numpy as np

        newest = self.newest()
        first = max(1, newest - min(size, self.capacity) + 1)
        if newest == 0:
            return np.zeros(0, dtype=self.dtype)
        start_slot, end_slot = (first - 1) % self.capacity, (newest - 1) % self.capacity
        pieces = [(start_slot, end_slot + 1)] if start_slot <= end_slot else [(start_slot, self.capacity),
                                                                               (0, end_slot + 1)]
        parts = []
        for low, high in pieces:
            view = np.frombuffer(self.map, dtype=self.dtype, count=high - low,
                                 offset=HEADER_SIZE + low * self.record_size)
            parts.append(view.copy())
            del view  # no view may outlive the mapping
        chosen = np.concatenate(parts) if len(parts) > 1 else parts[0]
        seq = chosen["seq"]
        keep = ((seq == chosen["tail"]) & (seq >= first) & (seq <= newest) & (chosen["end"] >= chosen["start"])
                & (chosen["start"] > 0))
        return chosen[keep]

    def close(self) -> None:
        try:
            self.map.close()
        except (BufferError, ValueError):
            pass


class _Follower:
    """New whole lines of a file that only grows (or is replaced: read again from its start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.inode: int | None = None
        self.offset = 0

    def lines(self) -> list[bytes]:
        try:
            stat = self.path.stat()
            if stat.st_ino != self.inode or stat.st_size < self.offset:
                self.inode, self.offset = stat.st_ino, 0
            if stat.st_size == self.offset:
                return []
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read(stat.st_size - self.offset)
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
        self.offset += end
        return data[:end].splitlines()


class _Memory:
    """A rank's memory samples: the latest per device and the peak, device samples preferred."""

    def __init__(self) -> None:
        self.files: dict[Path, _Follower] = {}
        self.names: list[Path] = []
        self.listed_at = float("-inf")
        self.latest: dict[int, int] = {}
        self.peak: dict[int, int] = {}

    def read(self, directory: Path, session_id: str | None, now: float) -> None:
        if now - self.listed_at >= _LIST_EVERY_S:  # a new segment is rare: the folder is listed now and then
            self.listed_at = now
            try:
                self.names = sorted(p for p in directory.glob("segment-*.jsonl"))
            except OSError:
                return
        for path in self.names:
            follower = self.files.setdefault(path, _Follower(path))
            for raw in follower.lines():
                try:
                    sample = _sample_decoder.decode(raw)
                except DECODE_FAILURES:
                    continue
                if sample.event_type != "sample" or type(sample.allocator_allocated_bytes) is not int:
                    continue
                if session_id is not None and sample.session_id not in (None, session_id):
                    continue
                device = sample.device_id if type(sample.device_id) is int else -1
                value = sample.allocator_allocated_bytes
                self.latest[device] = value
                self.peak[device] = max(value, self.peak.get(device, value))

    def now(self) -> tuple[int | None, int | None, str | None]:
        devices = [d for d in self.latest if d >= 0]
        if devices:
            return (max(self.latest[d] for d in devices), max(self.peak[d] for d in devices), "device")
        if -1 in self.latest:
            return self.latest[-1], self.peak[-1], "rss"
        return None, None, None


class LiveReader:
    """Builds ``LiveSnapshot``s of one run directory (one session: ``session_id``, else the one
    run.json names, else the newest ledger's). Keep one reader for the life of a view: it keeps
    its place in the files it follows, so each refresh reads only what is new.

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
        self._ledgers: dict[Path, _Ledger | None] = {}
        self._memory: dict[int, _Memory] = {}
        self._alerts = _Follower(self.run_dir / ALERTS_FILE)
        self._recent_alerts: list[dict[str, Any]] = []
        self._history: sqlite3.Connection | None = None
        self._plan: dict[str, Any] = {}
        self._batches_seen: set[str] = set()
        self._plan_at = 0.0
        self._heartbeat_at = 0.0
        self._heartbeat_ranks: list[Any] = []
        self._final: dict[str, Any] | None = None
        self._history_at = float("-inf")
        self._history_ranks: list[RankLive] = []
        self._history_seen: dict[int, list[Any]] = {}
        self._windows: dict[int, Any] = {}  # rank -> its last ledger window (for ``_own_verdict``)
        self._own: dict[str, Any] | None = None
        self._own_at = float("-inf")
        self._local = True  # the ranks ran on this host (run.json's hosts): a dead pid means a dead rank

    # -- the snapshot ----------------------------------------------------------------------------

    def snapshot(self) -> LiveSnapshot:
        """The run now. Never raises for what the files hold."""
        now = self.clock()
        manifest = self._manifest()
        hosts = manifest.get("hosts")
        self._local = not isinstance(hosts, list) or not hosts or socket.gethostname() in hosts
        if self.session_id is None:
            self.session_id = manifest.get("session_id") if isinstance(manifest.get("session_id"), str) else None
        ranks = self._ranks(now)  # a session still unknown becomes the newest ledger's
        alerts = self._read_alerts()
        final = self._final_summary(manifest)
        # an ended run's diagnosis (of the whole run) has the last word over the live window's
        verdict = _primary_of(final) or self._live_verdict() or self._own_verdict(now)
        ended = bool(manifest.get("ended_at_ns")) or self._all_stopped(ranks, manifest)
        world = manifest.get("world_size") if type(manifest.get("world_size")) is int else None
        started, stopped = (manifest.get(k) for k in ("started_at_ns", "ended_at_ns"))
        return LiveSnapshot(run_dir=str(self.run_dir), session_id=self.session_id, taken_at=now, ranks=tuple(ranks),
                            world_size=world or (len(ranks) or None), total_steps=self._total(now),
                            verdict=verdict, alerts=tuple(alerts), ended=ended,
                            started_at=started / 1e9 if type(started) is int and started > 0 else None,
                            ended_at=stopped / 1e9 if type(stopped) is int and stopped > 0 else None)

    @staticmethod
    def _all_stopped(ranks: list[RankLive], manifest: dict[str, Any]) -> bool:
        """Every rank stopped. Under ``stepwatch run`` the run ends when its launcher has written
        the summary (run.json's ``ended_at_ns``): until then, or ``LAUNCHER_GRACE_S`` after the
        last rank's end (a launcher that died), it is not over."""
        if not ranks or any(r.state not in ("stopped", "lost") for r in ranks):
            return False
        if manifest.get("launcher") != "run":
            return True
        return min(r.heartbeat_age_s or 0.0 for r in ranks) > LAUNCHER_GRACE_S

    def close(self) -> None:
        for ledger in self._ledgers.values():
            if ledger is not None:
                ledger.close()
        self._ledgers.clear()
        if self._history is not None:
            self._history.close()
            self._history = None

    # -- ranks -----------------------------------------------------------------------------------

    def _ranks(self, now: float) -> list[RankLive]:
        newest: dict[int, _Ledger] = {}
        for ledger in self._open_ledgers():
            if self.session_id is not None and ledger.session_id != self.session_id:
                continue
            if ledger.rank not in newest or ledger.started_ns > newest[ledger.rank].started_ns:
                newest[ledger.rank] = ledger
        if self.session_id is None and newest:
            self.session_id = max(newest.values(), key=lambda led: led.started_ns).session_id
            newest = {r: led for r, led in newest.items() if led.session_id == self.session_id}
        ranks = {rank: self._from_ledger(ledger, now) for rank, ledger in newest.items()}
        for process in self._heartbeat_only(now, set(ranks)):
            ranks.setdefault(process.rank, process)
        for remote in self._from_history(now, set(ranks)):
            ranks.setdefault(remote.rank, remote)
        return [ranks[r] for r in sorted(ranks)]

    def _open_ledgers(self) -> list[_Ledger]:
        directory = self.run_dir / LEDGER_DIR
        try:
            paths = [p for p in directory.iterdir() if _LEDGER_NAME.match(p.name)]
        except OSError:
            paths = []
        for path, known in list(self._ledgers.items()):
            if known is not None and not known.intact():
                known.close()
                del self._ledgers[path]  # replaced or cut: mapped anew below
        for path in paths:
            if path not in self._ledgers:
                try:
                    self._ledgers[path] = _Ledger(path)
                except (OSError, ValueError):
                    self._ledgers[path] = None  # not (yet) a whole ledger: asked again below
        found = [ledger for ledger in self._ledgers.values() if ledger is not None]
        for path in [p for p, led in self._ledgers.items() if led is None]:
            del self._ledgers[path]  # a header still being written: try again next refresh
        return found

    def _from_ledger(self, ledger: _Ledger, now: float) -> RankLive:
        import numpy as np

        records = ledger.window(self.window)
        self._windows[ledger.rank] = records
        alive_ns, closed_ns = ledger.header_times()
        step = step_time = rate = None
        shares: dict[str, float] = {}
        last_end = 0
        if len(records):
            step = int(records["index"][-1]) + 1
            durations = (records["end"] - records["start"]).astype(np.float64)
            step_time = float(np.median(durations)) / 1e9
            last_end = int(records["end"][-1])
            if len(records) > 1:
                span = (last_end - int(records["end"][0])) / 1e9
                rate = (len(records) - 1) / span if span > 0 else None
            total = float(durations.sum())
            if total > 0:
                phases = records["phases"].astype(np.float64)
                spent = phases.sum(axis=1)
                for column, phase in enumerate(PHASES[:ledger.phases]):
                    shares[phase.share] = float(phases[:, column].sum()) / total
                shares[RESIDUAL.share] = float(np.maximum(durations - spent, 0.0).sum()) / total
        last_sign = max(alive_ns, last_end, closed_ns) / 1e9
        age = max(0.0, now - last_sign) if last_sign > 0 else None
        state = "stopped" if closed_ns else ("silent" if age is not None and age > SILENT_AFTER_S else "running")
        if state == "silent" and self._local and not _pid_alive(ledger.pid, ledger.started_ns):
            state = "lost"  # killed (SIGKILL, the OOM killer): its ledger was never closed
        memory = self._memory.setdefault(ledger.rank, _Memory())
        memory.read(self.run_dir / "telemetry" / f"rank{ledger.rank}", self.session_id, now)
        current, peak, kind = memory.now()
        return RankLive(rank=ledger.rank, step=step, step_time_s=step_time, steps_per_s=rate, phase_shares=shares,
                        memory_bytes=current, memory_peak_bytes=peak, memory_kind=kind, heartbeat_age_s=age,
                        state=state)

    def _heartbeat_only(self, now: float, covered: set[int]) -> list[RankLive]:
        """Ranks with no ledger of this session (a run from before the ledger, a full disk): from
        their heartbeat files, re-read every ``_HEARTBEAT_EVERY_S``."""
        if now - self._heartbeat_at >= _HEARTBEAT_EVERY_S:
            self._heartbeat_at = now
            from ..artifacts.live_ranks import HEARTBEAT_FILE, rank_processes

            try:
                files = [HEARTBEAT_FILE.match(e.name) for e in os.scandir(self.run_dir)]
            except OSError:
                files = []
            if {int(m.group(1)) for m in files if m is not None and not m.group(2)} <= covered:
                self._heartbeat_ranks = []
                return []  # every rank has its ledger: the heartbeat files add nothing

            try:
                processes = rank_processes(self.run_dir)
            except (OSError, ValueError):
                processes = []
            self._heartbeat_ranks = [p for p in processes if "-p" not in p.name
                                     and (self.session_id is None or p.session_id in (None, self.session_id))]
        found = []
        for process in self._heartbeat_ranks:
            if process.rank in covered:
                continue
            memory = self._memory.setdefault(process.rank, _Memory())
            memory.read(self.run_dir / "telemetry" / f"rank{process.rank}", self.session_id, now)
            current, peak, kind = memory.now()
            age = max(0.0, now - process.step_ts)
            state = "stopped" if process.stopped else ("silent" if age > 60 else "running")
            found.append(RankLive(rank=process.rank, step=process.step, steps_per_s=process.steps_per_s,
                                  memory_bytes=current, memory_peak_bytes=peak, memory_kind=kind,
                                  heartbeat_age_s=age, state=state))
        return found

    # -- the run ---------------------------------------------------------------------------------

    def _manifest(self) -> dict[str, Any]:
        try:
            value = _json.decode((self.run_dir / "run.json").read_bytes())
        except (OSError, *DECODE_FAILURES):
            return {}
        if not isinstance(value, dict):
            return {}
        if self.session_id is not None and value.get("session_id") not in (None, self.session_id):
            return {}  # a reused run directory's manifest of another session
        return value

    def _read_alerts(self) -> list[dict[str, Any]]:
        for raw in self._alerts.lines():
            try:
                alert = _alert_decoder.decode(raw)
            except DECODE_FAILURES:
                continue
            if alert.kind is None or (self.session_id is not None and alert.session_id not in (None, self.session_id)):
                continue
            self._recent_alerts.append({"kind": alert.kind, "severity": alert.severity,
                                        "ranks": [r for r in alert.ranks or () if type(r) is int],
                                        "step": alert.step, "message": alert.message, "ts": alert.ts})
            del self._recent_alerts[:-ALERTS_KEPT]
        return list(self._recent_alerts)

    def _connect(self) -> sqlite3.Connection | None:
        """A read-only connection to the run's history.sqlite (None: there is none yet)."""
        if self._history is None:
            path = self.run_dir / "history.sqlite"
            if not path.is_file():
                return None
            try:
                self._history = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=0.2,
                                                check_same_thread=False)
            except sqlite3.Error:
                return None
        return self._history

    def _from_history(self, now: float, covered: set[int]) -> list[RankLive]:
        """Ranks no local file describes, from the history: another node's ranks in a multi-node
        run's hub, the sessions of a ``serve --out`` directory. Index seeks only (each rank's last
        steps down ``steps_unique``, its newest samples down ``telemetry_unique``), at most every
        ``_HISTORY_EVERY_S``; the peak is kept from the samples read since the last look."""
        if now - self._history_at < _HISTORY_EVERY_S:
            return [r for r in self._history_ranks if r.rank not in covered]
        self._history_at = now
        history = self._connect()
        if history is None:
            return []
        try:
            if self.session_id is None:
                found = history.execute("SELECT session_id FROM sessions ORDER BY started_at_ns DESC LIMIT 1").fetchone()
                if found is None:
                    return []
                self.session_id = found[0]
            ranks = [r for (r,) in history.execute(_HISTORY_RANKS, (self.session_id,)) if r is not None]
            rows = [self._history_rank(history, rank, now) for rank in ranks if rank not in covered]
        except sqlite3.Error:
            return [r for r in self._history_ranks if r.rank not in covered]
        self._history_ranks = rows
        return rows

    def _history_rank(self, history: sqlite3.Connection, rank: int, now: float) -> RankLive:
        import numpy as np

        columns = ", ".join(["step", "start_ns", "end_ns", "step_ns", *(p.column for p in PHASES)])
        steps = history.execute(f"SELECT {columns} FROM steps WHERE session_id = ? AND rank = ? "
                                "ORDER BY step DESC LIMIT ?", (self.session_id, rank, self.window)).fetchall()[::-1]
        step = step_time = rate = None
        shares: dict[str, float] = {}
        last_end = 0
        if steps:
            table = np.array([[v or 0 for v in row] for row in steps], dtype=np.int64)  # ns: exact in int64 only
            step, last_end = int(table[-1, 0]) + 1, int(table[-1, 2])
            durations = (table[:, 2] - table[:, 1]).astype(np.float64)
            step_time = float(np.median(durations)) / 1e9
            span = (table[-1, 2] - table[0, 2]) / 1e9
            rate = (len(steps) - 1) / span if len(steps) > 1 and span > 0 else None
            total = float(durations.sum())
            if total > 0:
                phases = table[:, 4:].astype(np.float64)
                for column, phase in enumerate(PHASES):
                    shares[phase.share] = float(phases[:, column].sum()) / total
                shares[RESIDUAL.share] = float(np.maximum(durations - phases.sum(axis=1), 0.0).sum()) / total
        seen = self._history_seen.setdefault(rank, [0, None, None, None])  # last ts, latest, peak, kind
        for ts, device, allocated in history.execute(
                "SELECT timestamp_ns, device_id, allocated FROM telemetry WHERE session_id = ? AND rank = ? "
                "AND timestamp_ns > ? AND event_type = 'sample' ORDER BY timestamp_ns", (self.session_id, rank, seen[0])):
            seen[0] = max(seen[0], ts or 0)
            if type(allocated) is not int:
                continue
            kind = "device" if type(device) is int and device >= 0 else "rss"
            if seen[3] == "device" and kind == "rss":
                continue  # a device's samples, where the rank has one
            if seen[3] != kind:
                seen[1:] = [None, None, kind]
            seen[1] = allocated
            seen[2] = allocated if seen[2] is None else max(seen[2], allocated)
        last = history.execute("SELECT timestamp_ns, event_type FROM telemetry WHERE session_id = ? AND rank = ? "
                               "ORDER BY timestamp_ns DESC LIMIT 1", (self.session_id, rank)).fetchone()
        sign = max(last_end, last[0] or 0 if last else 0) / 1e9
        age = max(0.0, now - sign) if sign > 0 else None
        stopped = bool(last and last[1] == "stop")
        state = "stopped" if stopped else ("silent" if age is not None and age > SILENT_AFTER_S else "running")
        return RankLive(rank=rank, step=step, step_time_s=step_time, steps_per_s=rate, phase_shares=shares,
                        memory_bytes=seen[1], memory_peak_bytes=seen[2], memory_kind=seen[3], heartbeat_age_s=age,
                        state=state)

    def _live_verdict(self) -> dict[str, Any] | None:
        """The newest primary verdict the aggregator stored for this session (None: none yet, or
        no history)."""
        if self.session_id is None:
            return None
        history = self._connect()
        if history is None:
            return None
        try:
            row = history.execute(
                "SELECT name, severity, ranks, message, next_step, step, ts_ns FROM verdicts "
                "WHERE session_id = ? ORDER BY ts_ns DESC LIMIT 1", (self.session_id,)).fetchone()
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

    def _own_verdict(self, now: float) -> dict[str, Any] | None:
        """A run with no history (``init``, ``track``, an aggregator that never started): the
        verdict engine over the ledgers' last ``window`` steps, every ``OWN_VERDICT_EVERY_S``.
        WARMUP and too few steps are no verdict; with a history, the aggregator's verdicts are
        the run's (``_live_verdict``) and this is never computed."""
        if (self.run_dir / "history.sqlite").exists() or not self._windows:
            return None
        if now - self._own_at < OWN_VERDICT_EVERY_S:
            return self._own
        self._own_at = now
        try:
            from ..analysis.verdicts.engine import diagnose

            primary = diagnose(self._window_rows(), window=self.window).primary
        except Exception:  # noqa: BLE001 - a view without a verdict is still a view
            return self._own
        if primary.name in ("WARMUP", "INSUFFICIENT_STEP_TIME_DATA"):
            self._own = None
        else:
            self._own = {"name": primary.name, "severity": primary.severity, "ranks": list(primary.ranks),
                         "message": primary.message, "next_step": primary.next_step, "source": "view"}
        return self._own

    def _window_rows(self) -> list[dict[str, Any]]:
        """The ledger windows as the history's ``steps`` rows (store/rows: ``wait`` is the step
        less every phase inside the residual)."""
        rows = []
        for rank, records in self._windows.items():
            for record in records.tolist():
                _, index, start, end, phases, _ = record
                row = {"session_id": self.session_id, "rank": rank, "step": index, "start_ns": start, "end_ns": end,
                       "step_ns": end - start}
                inside = 0
                for phase, value in zip(PHASES, (int(v) for v in phases), strict=False):  # numpy's, as ints
                    row[phase.column] = value
                    inside += value if phase.in_residual else 0
                row[RESIDUAL.column] = max(0, end - start - inside)
                rows.append(row)
        return rows

    def _final_summary(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """final_summary.json of this session, once the run has ended (read once)."""
        if self._final is not None or not manifest.get("ended_at_ns"):
            return self._final
        try:
            value = _json.decode((self.run_dir / "final_summary.json").read_bytes())
        except (OSError, *DECODE_FAILURES):
            return None
        if isinstance(value, dict) and value.get("session_id") in (None, self.session_id):
            self._final = value
        return self._final

    def _total(self, now: float) -> int | None:
        """The run's total steps: a framework's ``max_steps``, else epochs (``stepwatch.epochs``)
        times the batches of the first loader the run iterated."""
        if "total" not in self._plan and now - self._plan_at >= _PLAN_EVERY_S:
            self._plan_at = now
            self._read_plan()
        total = self._plan.get("total")
        if total is None:
            epochs, batches = self._plan.get("epochs"), self._plan.get("batches")
            if epochs and batches:
                total = epochs * batches
        return total

    def _read_plan(self) -> None:
        spool = self.run_dir / "spool"
        try:
            names = sorted(e.name for e in os.scandir(spool) if _BATCH.match(e.name) and e.name not in self._batches_seen)
        except OSError:
            return
        for name in names:
            self._batches_seen.add(name)
            try:
                batch = _batch_decoder.decode((spool / name).read_bytes())
            except (OSError, *DECODE_FAILURES):
                continue
            for mark in batch.marks:
                attrs = mark.attrs or {}
                if mark.name == PLAN_MARK:
                    _positive_into(self._plan, "total", attrs.get("max_steps"))
                    _positive_into(self._plan, "epochs", attrs.get("epochs"))
                elif mark.name == DATALOADER_MARK and attrs.get("index") in (0, None):
                    _positive_into(self._plan, "batches", attrs.get("batches"))


def _positive_into(plan: dict[str, Any], key: str, value: Any) -> None:
    if key not in plan and type(value) is int and value > 0:
        plan[key] = value


def _primary_of(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """The primary verdict of a final summary's diagnosis."""
    if not summary:
        return None
    primary = (summary.get("diagnosis") or {}).get("primary") if isinstance(summary.get("diagnosis"), dict) else None
    if not isinstance(primary, dict) or not isinstance(primary.get("name"), str):
        return None
    return {key: primary.get(key) for key in ("name", "severity", "ranks", "message", "next_step")}


def _pid_alive(pid: int, started_ns: int) -> bool:
    """Whether ``pid`` on this host may still be the rank that started its ledger at ``started_ns``."""
    from ..artifacts._files import process_alive

    return process_alive(socket.gethostname(), pid, started_ns or None)
