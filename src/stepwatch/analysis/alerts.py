"""The watchdog's rules: liveness and health alerts from what the ranks report (pure).

Verdicts say why a run is slow; alerts say that something is wrong *now* and may be acted on:
``STALL``, ``RANK_LOST``, ``THROUGHPUT_DROP``, ``NONFINITE``, ``ZERO_GRAD`` (docs/watchdog.md has
each rule in words). ``AlertRules`` is fed observations (heartbeat records, completed steps,
marks, closed spans, stop records, a process found gone, a connection to the aggregator closed
without a stop record, a frame that came) with the time the feeder saw them, and
``check(now)`` returns the alerts that became true since the last check. Each condition alerts
once per episode: it must clear (the rank steps again, a finite value comes, ...) before the
same alert can fire again. No I/O, no clock of its own: the same observations and the same
``now`` give the same alerts (the aggregator and ``stepwatch watch`` feed it,
``server/watchdog.py``).

The culprit of a stall (``Alert.ranks`` names it, never the ranks that wait for it): under DDP
every rank stops when one does, since the others block in backward's all-reduce. Among the ranks
that are not advancing, the culprit is

1. the rank(s) with the lowest last completed step; among ties,
2. the rank(s) whose heartbeat stopped altogether (the GIL held in C code, a frozen process),
   where some tied ranks still beat and others do not;
3. else the rank(s) whose current ``phase`` (heartbeat records) is not one where the collectives
   of a step run (``backward``, ``optimizer_step``), where the others are in one;
4. else the rank whose last activity (a closed span, a step, a progress record) is the oldest,
   by a second at least: the others went on until they blocked;
5. else all of the tied ranks (said as ``culprit_rule: "undecided"``).

The other ranks that are not advancing are the ``waiting`` ranks of the evidence.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

__all__ = ["ALERT_KINDS", "COLLECTIVE_PHASES", "Alert", "AlertPolicy", "AlertRules", "alert_from_dict",
           "inferred_source", "is_nonfinite", "iso_time"]

# STORE_DEGRADED is the aggregator's own (server/store_feed.py), not a rule of AlertRules: its
# remote history store is down or slow and the rows wait in the local spill queue
ALERT_KINDS = ("STALL", "RANK_LOST", "THROUGHPUT_DROP", "NONFINITE", "ZERO_GRAD", "STORE_DEGRADED")
SEVERITY = {"STALL": "crit", "RANK_LOST": "crit", "NONFINITE": "crit", "THROUGHPUT_DROP": "warn",
            "ZERO_GRAD": "warn", "STORE_DEGRADED": "warn"}
# the phases (stepwatch.phases span names) in which DDP's collectives of a step run: a rank in one
# of them may be waiting for another rank, a rank elsewhere is not waiting in a collective
COLLECTIVE_PHASES = frozenset({"backward", "optimizer_step"})
WATCHED_METRICS = ("loss", "grad_norm")
ACTIVITY_GAP_S = 1.0
STEP_WAIT_S = 2.0  # how long a non-finite value without its step waits for the step's span
_NONFINITE_TEXT = {"nan": "nan", "+nan": "nan", "-nan": "nan", "inf": "inf", "+inf": "inf", "infinity": "inf",
                   "+infinity": "inf", "-inf": "-inf", "-infinity": "-inf"}


def inferred_source(attrs: Mapping[str, Any] | None) -> str | None:
    """The ``source`` of a value stepwatch inferred with no code (capture/inferred_metrics.py:
    ``"backward root"``, ``"clip_grad_norm_"``), None for a value the program logged."""
    if not isinstance(attrs, Mapping) or attrs.get("inferred") is not True:
        return None
    source = attrs.get("source")
    return source if isinstance(source, str) and source else "inferred"


def iso_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def is_nonfinite(value: Any, *, null_is_nonfinite: bool = False) -> str | None:
    """"nan", "inf" or "-inf" when ``value`` is a non-finite number (or its text, as the spool's
    ``value_nonfinite`` writes it), else None. ``null_is_nonfinite``: a JSON null counts as a
    non-finite value whose sign is unknown ("nan"): the heartbeat writer leaves absent metrics
    out and writes a non-finite one as null (artifacts/heartbeat.py), so a null ``loss`` in a
    progress record was NaN or an infinity."""
    if value is None:
        return "nan" if null_is_nonfinite else None
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return "nan" if value != value else ("inf" if value > 0 else "-inf")
        return None
    if isinstance(value, str):
        return _NONFINITE_TEXT.get(value.strip().lower())
    return None


@dataclass(frozen=True)
class AlertPolicy:
    """The watchdog's thresholds (docs/watchdog.md). Example::

        AlertPolicy(stall_after_s=60, throughput_window_s=5)
    """

    stall_after_s: float = 180.0
    # a rank that has not stepped yet gets this long (imports, data set-up, compilation) or
    # stall_after_s, whichever is longer
    startup_grace_s: float = 300.0
    throughput_window_s: float = 10.0
    throughput_ratio: float = 0.5
    throughput_windows_low: int = 3
    throughput_min_windows: int = 8  # closed windows before a median is trusted
    throughput_min_steps: int = 5  # a window is widened until the run's mean window holds this many
    zero_grad_steps: int = 10
    lost_grace_s: float = 2.0  # a process gone this long without a stop record is lost
    heartbeat_interval_s: float = 5.0  # until the rank's own cadence is learned

    def __post_init__(self) -> None:
        for name in ("stall_after_s", "throughput_window_s", "lost_grace_s", "heartbeat_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"AlertPolicy.{name} must be a positive number, not {value!r}")
        if not 0 < self.throughput_ratio < 1:
            raise ValueError("AlertPolicy.throughput_ratio must be in (0, 1)")


@dataclass(frozen=True)
class Alert:
    """One alert; ``ranks`` names the culprit rank(s) only (the ranks waiting for a stuck one are
    in ``evidence``)."""

    ts: float
    kind: str
    severity: str
    ranks: tuple[int, ...]
    step: int | None
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None

    @property
    def iso(self) -> str:
        return iso_time(self.ts)

    def to_dict(self) -> dict[str, Any]:
        """The alerts.jsonl line (docs/watchdog.md)."""
        record: dict[str, Any] = {"ts": round(self.ts, 6), "iso": self.iso, "kind": self.kind,
                                  "severity": self.severity, "ranks": list(self.ranks), "step": self.step,
                                  "message": self.message, "evidence": self.evidence}
        if self.session_id is not None:
            record["session_id"] = self.session_id
        return record

    def line(self) -> str:
        """What ``stepwatch run`` prints."""
        return f"[stepwatch] ALERT {self.kind} ({self.severity}) {self.message}"


def alert_from_dict(record: Mapping[str, Any]) -> Alert:
    """An alerts.jsonl record back as an Alert; ValueError for a record without its fields."""
    try:
        ts = float(record["ts"])
        kind, severity, message = str(record["kind"]), str(record["severity"]), str(record["message"])
        ranks = tuple(int(r) for r in record.get("ranks") or ())
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not an alert record: {exc}") from None
    step = record.get("step")
    evidence = record.get("evidence")
    session = record.get("session_id")
    return Alert(ts=ts, kind=kind, severity=severity, ranks=ranks, step=step if type(step) is int else None,
                 message=message, evidence=evidence if isinstance(evidence, dict) else {},
                 session_id=session if isinstance(session, str) else None)


def _fmt_ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


class _Rank:
    """What the rules know of one rank."""

    __slots__ = ("rank", "pid", "first_seen_at", "step", "advanced_at", "activity_ts", "hb_seen_at", "hb_ts",
                 "hb_gaps", "has_phase", "phase", "phase_ts", "stopped", "gone_at", "lost", "last_step_end",
                 "origin", "buckets", "closed_cache", "in_drop", "zero_run", "zero_key", "zero_steps",
                 "zero_alerted", "hb_step", "has_steps", "host", "heard_at", "dropped_at")

    def __init__(self, rank: int, at: float) -> None:
        self.rank = rank
        self.pid: int | None = None
        self.first_seen_at = at
        self.step: int | None = None  # the last completed step
        # A heartbeat's ``step`` counts the steps done (1 after the first); a completed step's
        # index starts at 0. Once a rank's steps come, its step is theirs alone, so that ranks
        # are compared in one numbering.
        self.hb_step: int | None = None
        self.has_steps = False
        self.advanced_at: float | None = None  # watchdog clock: when it last advanced
        self.activity_ts: float | None = None  # rank clock: its last sign of work
        self.hb_seen_at: float | None = None
        self.hb_ts: float | None = None
        self.hb_gaps: list[float] = []
        self.has_phase = False
        self.phase: str | None = None
        self.phase_ts: float | None = None
        self.stopped = False
        self.gone_at: float | None = None
        self.lost = False
        self.last_step_end: int = -1  # the highest step index fed to the throughput windows
        self.origin: float | None = None
        self.buckets: list[int] = []
        self.closed_cache: tuple[int, list[float], float] | None = None
        self.in_drop = False
        self.zero_run = 0
        self.zero_key: Any = None
        self.zero_steps: list[int | None] = []
        self.zero_alerted = False
        self.host: str | None = None  # as its frames name it (the aggregator's feed)
        self.heard_at: float | None = None  # watchdog clock: its last frame to the aggregator
        # watchdog clock: its connection to the aggregator closed without a stop record, and
        # nothing came from it since (None once it is heard again, or its process is seen alive)
        self.dropped_at: float | None = None


class AlertRules:
    """The rule state of one session. Example::

        rules = AlertRules(AlertPolicy(stall_after_s=3))
        rules.observe_heartbeat(0, {"ts": t, "pid": 42, "step": 5, "msg": "heartbeat"}, at=t)
        rules.observe_step(0, 5, end_ts=t, at=t)
        alerts = rules.check(now=t + 4)
    """

    def __init__(self, policy: AlertPolicy | None = None, *, session_id: str | None = None) -> None:
        self.policy = policy or AlertPolicy()
        self.session_id = session_id
        self.ranks: dict[int, _Rank] = {}
        self._stall_covered: set[int] = set()  # ranks named (culprit or waiting) by an open STALL
        self._stall_since: float | None = None  # when a stall was first seen undecided (deferral)
        self._nonfinite: dict[str, dict[int, dict[str, Any]]] = {}  # metric -> rank -> first seen
        self._nonfinite_open: set[str] = set()
        self._drop_open = False
        self._zero_new: list[int] = []
        self._unnamed: dict[int, dict[Any, float]] = {}
        self._logged: set[tuple[int, str]] = set()  # (rank, metric) the program logs itself
        self._first_key: dict[tuple[str, int], Any] = {}  # the key of a rank's first non-finite value  # rank -> key -> when: values waiting for their step

    # -- observations --------------------------------------------------------------------------

    def _rank(self, rank: int, at: float) -> _Rank:
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = _Rank(rank, at)
        return state

    def _advance(self, state: _Rank, at: float, ts: float | None) -> None:
        state.advanced_at = at if state.advanced_at is None else max(state.advanced_at, at)
        if ts is not None:
            state.activity_ts = ts if state.activity_ts is None else max(state.activity_ts, ts)
        if state.rank in self._stall_covered:
            self._stall_covered.discard(state.rank)

    def observe_heartbeat(self, rank: int, record: Mapping[str, Any], at: float) -> None:
        """One heartbeat record (heartbeat-jsonl.md): liveness, the step it names, its phase,
        progress metrics, the stop record."""
        state = self._rank(rank, at)
        ts = record.get("ts")
        ts = float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else None
        msg = record.get("msg")
        pid = record.get("pid")
        if type(pid) is int:
            state.pid = pid
        if msg == "stop":
            self.observe_stop(rank, at)
            return
        if msg == "heartbeat":
            if state.hb_seen_at is not None and at > state.hb_seen_at:
                state.hb_gaps.append(at - state.hb_seen_at)
                del state.hb_gaps[:-8]
            if "phase" in record:
                state.has_phase = True
                phase = record.get("phase")
                state.phase = phase if isinstance(phase, str) and phase else None
                state.phase_ts = ts
        state.hb_seen_at = at if state.hb_seen_at is None else max(state.hb_seen_at, at)
        if ts is not None:
            state.hb_ts = ts if state.hb_ts is None else max(state.hb_ts, ts)
        step = record.get("step")
        if type(step) is int and (state.hb_step is None or step > state.hb_step):
            # the first record a rank is seen with sets the baseline; once its completed steps
            # come (at every tick), they say when it advanced: a periodic heartbeat's count
            # catches up with them seconds late and would restart a stalled rank's clock
            if state.hb_step is not None and not state.has_steps:
                self._advance(state, at, None)
            state.hb_step = step
            if step > 0 and not state.has_steps:  # completed steps name them by index; a heartbeat by count
                state.step = step
        if msg == "progress":
            self._advance(state, at, ts)
            for name in WATCHED_METRICS:
                if name in record:
                    self.observe_value(rank, name, record[name], step=step if type(step) is int else None,
                                       key=("progress", step), ts=ts, at=at, source="progress",
                                       null_is_nonfinite=True)

    def observe_step(self, rank: int, step: int, *, end_ts: float, at: float) -> None:
        """A completed training step (its index and end time on the rank's clock)."""
        state = self._rank(rank, at)
        if not state.has_steps or state.step is None or step > state.step:
            state.step = step
            state.has_steps = True
        self._advance(state, at, end_ts)
        if step > state.last_step_end:
            state.last_step_end = step
            self._count_step(state, end_ts)

    def observe_activity(self, rank: int, *, ts: float, at: float) -> None:
        """Any other sign of work from the training thread (a closed span, an eval step): not a
        stalled rank's, so it resets the stall clock."""
        self._advance(self._rank(rank, at), at, ts)

    def observe_mark(self, rank: int, name: str, value: Any, *, step: int | None = None, key: Any = None,
                     ts: float | None = None, at: float, attrs: Mapping[str, Any] | None = None) -> None:
        """A ``loss`` or ``grad_norm`` mark (others are ignored); ``value`` a number, or the text
        of a non-finite one (the spool's ``value_nonfinite``); ``key`` the step it belongs to
        (its span), so one step's value counts once. ``attrs``: the mark's; an inferred value
        (``inferred``, ``source``: the backward root, ``clip_grad_norm_``) counts only while the
        program logs no value of that name itself, and a non-finite gradient norm taken under
        a ``GradScaler`` (``scaler``) is a step the scaler skips, not a failure."""
        if name not in WATCHED_METRICS:
            return
        inferred = inferred_source(attrs)
        if inferred is not None and attrs is not None and attrs.get("scaler") is True and is_nonfinite(value):
            return
        self.observe_value(rank, name, value, step=step, key=("mark", key if key is not None else step), ts=ts,
                           at=at, source="mark", inferred=inferred)

    def observe_value(self, rank: int, name: str, value: Any, *, step: int | None, key: Any, ts: float | None,
                      at: float, source: str, null_is_nonfinite: bool = False, inferred: str | None = None) -> None:
        if inferred is None:
            self._logged.add((rank, name))
        elif (rank, name) in self._logged:
            return  # the program logs this value itself: its own series is the one watched
        state = self._rank(rank, at)
        bad = is_nonfinite(value, null_is_nonfinite=null_is_nonfinite)
        ranks = self._nonfinite.setdefault(name, {})
        if bad is not None:
            seen = ranks.setdefault(rank, {"value": bad, "step": step, "source": source,
                                           "ts": ts, "iso": iso_time(ts) if ts is not None else None})
            if inferred is not None:
                seen.setdefault("inferred", inferred)
            if seen["step"] is None and step is not None:  # a mark whose step span had not come yet
                seen["step"] = step
            if seen["step"] is None:
                self._unnamed.setdefault(rank, {})[key] = at
                self._first_key.setdefault((name, rank), key)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and ranks.pop(rank, None) is not None:
            self._first_key.pop((name, rank), None)
        if name != "grad_norm":
            return
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if step is not None:
            key = ("step", step)  # one step's value, from a mark and a progress record alike
        if number is not None and number == 0 and bad is None:
            if key is not None and key == state.zero_key:
                return  # the same step's value from a second source
            state.zero_key = key
            state.zero_run += 1
            state.zero_steps.append(step)
            del state.zero_steps[:-self.policy.zero_grad_steps]
            if state.zero_run >= self.policy.zero_grad_steps and not state.zero_alerted:
                state.zero_alerted = True
                self._zero_new.append(rank)
        elif number is not None or bad is not None:
            state.zero_run, state.zero_key, state.zero_steps, state.zero_alerted = 0, None, [], False

    def name_step(self, rank: int, key: Any, step: int) -> None:
        """The step a value's ``key`` (a mark's span) turned out to be: a mark made after the
        optimizer step arrives before its step span, which names the step."""
        if self._unnamed.get(rank, {}).pop(("mark", key), None) is None:
            return
        for name, ranks in self._nonfinite.items():
            seen = ranks.get(rank)
            if seen is not None and seen["step"] is None and self._first_key.get((name, rank)) == ("mark", key):
                seen["step"] = step

    def observe_stop(self, rank: int, at: float) -> None:
        """The rank's stop record (heartbeat ``stop``, telemetry ``stop`` event, or its
        ``outcome_rank<N>.json``): it ended and said so."""
        state = self._rank(rank, at)
        state.stopped = True
        self._stall_covered.discard(rank)

    def observe_gone(self, rank: int, at: float) -> None:
        """The rank's process no longer exists (the feeder checked its pid)."""
        state = self._rank(rank, at)
        if state.gone_at is None:
            state.gone_at = at

    def observe_frame(self, rank: int, at: float, *, host: str | None = None) -> None:
        """A frame of the rank reached the aggregator: it is connected, whatever closed before."""
        state = self._rank(rank, at)
        state.heard_at = at
        state.dropped_at = None
        if host is not None:
            state.host = host

    def observe_disconnect(self, rank: int, at: float) -> None:
        """The rank's last connection to the aggregator closed from its end (the aggregator saw
        it) with no stop record sent: the process died, or its host, or the network between; or
        its sender will reconnect, which ``observe_frame`` then says. The one view of a rank on
        another host, where no pid can be checked."""
        state = self._rank(rank, at)
        if not state.stopped and not state.lost and state.dropped_at is None:
            state.dropped_at = at

    def observe_process_alive(self, rank: int) -> None:
        """The feeder saw the rank's process alive (same host, its pid): a connection it closed
        is its sender's to reopen, not a loss. The pid is the better evidence where there is one."""
        state = self.ranks.get(rank)
        if state is not None:
            state.dropped_at = None

    # -- the rules -----------------------------------------------------------------------------

    def check(self, now: float, *, final: bool = False) -> list[Alert]:
        """The alerts that became true since the last check. ``final``: the job has ended
        (the aggregator is stopping): a rank gone without a stop record is lost at once, and
        no stall is judged."""
        alerts: list[Alert] = []
        alerts += self._lost(now, final)
        if not final:
            alerts += self._stall(now)
        alerts += self._nonfinite_alerts(now)
        alerts += self._zero_grad(now)
        alerts += self._throughput(now)
        return alerts

    def active(self) -> list[_Rank]:
        return [s for s in self.ranks.values() if not s.stopped and not s.lost]

    def all_ended(self) -> bool:
        """Every rank seen has stopped or is lost (``stepwatch watch`` exits then)."""
        return bool(self.ranks) and not self.active()

    def _alert(self, now: float, kind: str, ranks: Iterable[int], step: int | None, message: str,
               evidence: dict[str, Any]) -> Alert:
        return Alert(ts=now, kind=kind, severity=SEVERITY[kind], ranks=tuple(sorted(ranks)), step=step,
                     message=message, evidence=evidence, session_id=self.session_id)

    def _drop_grace(self, state: _Rank) -> float:
        """How long a dropped connection waits for the rank to be heard again before it is lost:
        as long as its heartbeat may be silent (``_hb_silent``), ``lost_grace_s`` at least. A
        living sender that closed its socket (a send that timed out) reconnects within its 1 s
        backoff and sends what it queued, a heartbeat among it, well within that."""
        interval = self._hb_interval(state)
        return max(self.policy.lost_grace_s, 2.5 * interval, interval + 2.0)

    def _lost(self, now: float, final: bool) -> list[Alert]:
        out = []
        for state in sorted(self.ranks.values(), key=lambda s: s.rank):
            if state.stopped or state.lost:
                continue
            if state.gone_at is not None:
                if not final and now - state.gone_at < self.policy.lost_grace_s:
                    continue
                out.append(self._lost_by_process(state, now))
            elif state.dropped_at is not None:
                if not final and now - state.dropped_at < self._drop_grace(state):
                    continue
                out.append(self._lost_by_connection(state, now))
            else:
                continue
            state.lost = True
            self._stall_covered.discard(state.rank)
        return out

    def _lost_evidence(self, state: _Rank, lost_by: str) -> dict[str, Any]:
        return {"lost_by": lost_by, "host": state.host, "pid": state.pid, "last_step": state.step,
                "last_heartbeat": iso_time(state.hb_ts) if state.hb_ts is not None else None,
                "stop_records_looked_for": ["heartbeat stop record", "telemetry stop event",
                                            f"outcome_rank{state.rank}.json"]}

    def _lost_by_process(self, state: _Rank, now: float) -> Alert:
        assert state.gone_at is not None
        seen = state.hb_seen_at if state.hb_seen_at is not None else state.first_seen_at
        return self._alert(
            now, "RANK_LOST", [state.rank], state.step,
            f"rank {state.rank} (pid {state.pid}) is gone without a stop record; last step "
            f"{state.step if state.step is not None else '-'}, last heard {max(0.0, now - seen):.0f} s ago",
            {**self._lost_evidence(state, "process"), "gone_seen_at": iso_time(state.gone_at)})

    def _lost_by_connection(self, state: _Rank, now: float) -> Alert:
        assert state.dropped_at is not None
        who = ", ".join(part for part in (f"on {state.host}" if state.host else "",
                                          f"pid {state.pid}" if state.pid is not None else "") if part)
        heartbeat = iso_time(state.hb_ts) if state.hb_ts is not None else "none"
        return self._alert(
            now, "RANK_LOST", [state.rank], state.step,
            f"rank {state.rank}{f' ({who})' if who else ''} is gone without a stop record: its connection to "
            f"the aggregator closed at {iso_time(state.dropped_at)} and nothing came since "
            f"({max(0.0, now - state.dropped_at):.0f} s); last step {state.step if state.step is not None else '-'}, "
            f"last heartbeat {heartbeat}",
            {**self._lost_evidence(state, "connection"), "connection_dropped_at": iso_time(state.dropped_at),
             "silent_since_drop_s": round(max(0.0, now - state.dropped_at), 3),
             "grace_s": round(self._drop_grace(state), 3),
             "last_frame_at": iso_time(state.heard_at) if state.heard_at is not None else None})

    def _hb_interval(self, state: _Rank) -> float:
        return statistics.median(state.hb_gaps) if state.hb_gaps else self.policy.heartbeat_interval_s

    def _hb_silent(self, state: _Rank, now: float) -> bool:
        interval = self._hb_interval(state)
        seen = state.hb_seen_at if state.hb_seen_at is not None else state.first_seen_at
        return now - seen > max(2.5 * interval, interval + 2.0)

    def _stuck_for(self, state: _Rank, now: float) -> float:
        since = state.advanced_at if state.advanced_at is not None else state.first_seen_at
        return now - since

    def _stall(self, now: float) -> list[Alert]:
        policy = self.policy
        active = self.active()
        if any(s.gone_at is not None or s.dropped_at is not None for s in active) \
                or any(s.lost for s in self.ranks.values()):
            self._stall_since = None
            return []  # a rank died (or may have): RANK_LOST says so, the others wait for a rank that is gone

        def threshold(state: _Rank) -> float:
            return policy.stall_after_s if state.advanced_at is not None else max(policy.stall_after_s,
                                                                                  policy.startup_grace_s)

        stalled = [s for s in active if self._stuck_for(s, now) >= threshold(s) and s.rank not in self._stall_covered]
        if not stalled:
            self._stall_since = None
            return []
        # not advancing: stalled, or on the way (a waiter's last step came a little later)
        candidates = [s for s in active if s.rank not in self._stall_covered
                      and self._stuck_for(s, now) >= threshold(s) / 2]
        if self._stall_since is None:
            self._stall_since = now
        decided = self._culprit(candidates, now)
        if decided is None:
            return []  # wait for a heartbeat that tells the tied ranks apart
        culprits, rule = decided
        self._stall_since = None
        self._stall_covered |= {s.rank for s in candidates}
        advancing = sorted(s.rank for s in active if s not in candidates)
        culprit_set = {s.rank for s in culprits}
        first = culprits[0]
        stuck = max(self._stuck_for(s, now) for s in culprits)
        waiting = [self._rank_evidence(s, now) for s in sorted(candidates, key=lambda s: s.rank)
                   if s.rank not in culprit_set]
        phase = f", phase {first.phase}" if first.phase else ""
        wait_text = (f"; {_fmt_ranks(w['rank'] for w in waiting)} "
                     f"{'waits' if len(waiting) == 1 else 'wait'} for it") if waiting else ""
        message = (f"{_fmt_ranks(culprit_set)} made no progress for {stuck:.0f} s "
                   f"(last step {first.step if first.step is not None else '-'}{phase}){wait_text}")
        evidence = {
            "stall_after_s": policy.stall_after_s, "culprit_rule": rule,
            "stuck": [self._rank_evidence(s, now) for s in sorted(culprits, key=lambda s: s.rank)],
            "waiting": waiting, "advancing": advancing,
        }
        return [self._alert(now, "STALL", culprit_set, first.step, message, evidence)]

    def _rank_evidence(self, state: _Rank, now: float) -> dict[str, Any]:
        return {"rank": state.rank, "pid": state.pid, "last_step": state.step,
                "stuck_for_s": round(self._stuck_for(state, now), 3), "phase": state.phase,
                "heartbeat_silent": self._hb_silent(state, now),
                "last_activity": iso_time(state.activity_ts) if state.activity_ts is not None else None}

    def _culprit(self, candidates: list[_Rank], now: float) -> tuple[list[_Rank], str] | None:
        low = min((s.step if s.step is not None else -1) for s in candidates)
        tied = sorted((s for s in candidates if (s.step if s.step is not None else -1) == low), key=lambda s: s.rank)
        if len(tied) == 1:
            return tied, "lowest last step" if len(candidates) > 1 else "only rank not advancing"
        silent = [s for s in tied if self._hb_silent(s, now)]
        if 0 < len(silent) < len(tied):
            return silent, "heartbeat silent"
        gap = min(1.0, self.policy.stall_after_s / 2)
        current = [s for s in tied if s.phase_ts is not None and s.activity_ts is not None
                   and s.phase_ts >= s.activity_ts + gap]
        if len(current) == len(tied):
            idle = [s for s in tied if s.phase not in COLLECTIVE_PHASES]
            if 0 < len(idle) < len(tied):
                return idle, "phase outside collectives"
        elif any(s.has_phase for s in tied):
            grace = max(2.0 * max(self._hb_interval(s) for s in tied) + 1.0, 1.0)
            if self._stall_since is not None and now - self._stall_since < grace:
                return None
        with_ts = [s for s in tied if s.activity_ts is not None]
        if len(with_ts) == len(tied):
            by_time = sorted(with_ts, key=lambda s: s.activity_ts)  # type: ignore[arg-type,return-value]
            # the others went on after it until they blocked; a second apart at least: ranks in
            # lockstep end a step within a millisecond of each other, in either order, and a
            # step's spans are shipped when it closes (measured: the waiting rank's last activity
            # came 1 ms *before* the stuck one's), so a small gap is no answer
            if by_time[1].activity_ts - by_time[0].activity_ts >= ACTIVITY_GAP_S:  # type: ignore[operator]
                return [by_time[0]], "earliest last activity"
        return tied, "undecided"

    def _nonfinite_alerts(self, now: float) -> list[Alert]:
        out = []
        for name in WATCHED_METRICS:
            ranks = self._nonfinite.get(name) or {}
            if not ranks:
                self._nonfinite_open.discard(name)
                continue
            if name in self._nonfinite_open:
                continue
            waiting = [at for r in ranks for at in self._unnamed.get(r, {}).values()]
            if waiting and all(v["step"] is None for v in ranks.values()) and now - min(waiting) < STEP_WAIT_S:
                continue  # give the step a moment to be named (the next frame, within a second)
            self._nonfinite_open.add(name)
            first_rank = min(ranks, key=lambda r: (ranks[r]["ts"] or 0, r))
            first = ranks[first_rank]
            step = first["step"]
            out.append(self._alert(
                now, "NONFINITE", ranks.keys(), step,
                f"{name} is {first['value']} on {_fmt_ranks(ranks)}"
                + (f" at step {step}" if step is not None else "")
                + (f" (inferred: {first['inferred']})" if first.get("inferred") else ""),
                {"metric": name, "values": {str(r): v for r, v in sorted(ranks.items())}}))
        return out

    def _zero_grad(self, now: float) -> list[Alert]:
        if not self._zero_new:
            return []
        ranks, self._zero_new = sorted(set(self._zero_new)), []
        state = self.ranks[ranks[0]]
        steps = [s for s in state.zero_steps if s is not None]
        span = f" (steps {steps[0]}-{steps[-1]})" if steps else ""
        return [self._alert(
            now, "ZERO_GRAD", ranks, steps[-1] if steps else state.step,
            f"grad_norm has been exactly 0 for {self.policy.zero_grad_steps} steps in a row on {_fmt_ranks(ranks)}{span}",
            {"metric": "grad_norm", "consecutive": self.policy.zero_grad_steps,
             "steps": {str(r): [s for s in self.ranks[r].zero_steps if s is not None] for r in ranks}})]

    # -- throughput ----------------------------------------------------------------------------

    def _count_step(self, state: _Rank, end_ts: float) -> None:
        if state.origin is None:
            state.origin = end_ts  # windows start at the first step's end: start-up is not a window
            return
        index = int((end_ts - state.origin) // self.policy.throughput_window_s)
        if index < 0:
            return
        if index >= len(state.buckets):
            state.buckets.extend([0] * (index + 1 - len(state.buckets)))
        state.buckets[index] += 1

    def _rates(self, state: _Rank) -> tuple[list[float], float]:
        """Steps/s of the rank's closed windows (every bucket but the one still filling), and
        the window's length: ``throughput_window_s``, widened to the multiple whose mean count
        holds ``throughput_min_steps`` (a run slower than a step per window is judged on wider
        windows, never on counts of 0 and 1)."""
        closed = len(state.buckets) - 1
        if closed < 1:
            return [], self.policy.throughput_window_s
        if state.closed_cache is not None and state.closed_cache[0] == closed:
            return state.closed_cache[1], state.closed_cache[2]
        counts = state.buckets[:closed]
        mean = sum(counts) / closed
        group = max(1, math.ceil(self.policy.throughput_min_steps / mean)) if mean > 0 else closed + 1
        width = group * self.policy.throughput_window_s
        rates = [sum(counts[i:i + group]) / width for i in range(0, closed - group + 1, group)]
        state.closed_cache = (closed, rates, width)
        return rates, width

    def _throughput(self, now: float) -> list[Alert]:
        policy = self.policy
        dropped: dict[int, dict[str, Any]] = {}
        for state in self.active():
            rates, width = self._rates(state)
            if len(rates) < policy.throughput_min_windows:
                state.in_drop = False
                continue
            median = statistics.median(rates)
            last = rates[-policy.throughput_windows_low:]
            low = median > 0 and all(rate < policy.throughput_ratio * median for rate in last)
            state.in_drop = low
            if low:
                dropped[state.rank] = {"rank": state.rank, "median_steps_per_s": round(median, 4),
                                       "last_windows_steps_per_s": [round(r, 4) for r in last],
                                       "window_s": width, "windows": len(rates)}
        if not dropped:
            if not any(s.in_drop for s in self.ranks.values()):
                self._drop_open = False
            return []
        if self._drop_open:
            return []
        self._drop_open = True
        first = dropped[min(dropped)]
        step = self.ranks[min(dropped)].step
        return [self._alert(
            now, "THROUGHPUT_DROP", dropped, step,
            f"steps/s fell to {first['last_windows_steps_per_s'][-1]:.3g} on {_fmt_ranks(dropped)}, under "
            f"{policy.throughput_ratio:g} x the run's median {first['median_steps_per_s']:.3g} for "
            f"{policy.throughput_windows_low} windows of {first['window_s']:g} s in a row",
            {"ratio": policy.throughput_ratio, "ranks": [dropped[r] for r in sorted(dropped)]})]
