"""The watchdog runner: feeds the alert rules (analysis/alerts.py), checks them about once a
second, and makes each alert everything it must be (docs/watchdog.md).

Two feeders share it: the aggregator (``Aggregator._queue`` hands it the rows of each accepted
frame: a reference and a length, nothing decoded on the intake path) and ``stepwatch watch``
(server/watch.py, which follows a run directory's files). ``tick`` runs off the event loop: it
decodes what was fed, checks which ranks' processes are gone, runs the rules, and for each alert
takes the stack dumps (STALL) and appends the line to ``<run>/alerts.jsonl``; the caller stores
the returned rows and prints the lines. Nothing here writes into a heartbeat file.

Whether a rank is lost: its pid, where it runs on this host (gone: lost; alive: not lost,
whatever its connection did); else, under the aggregator, its connection (closed from the rank's
end without a stop record, nothing heard since: ``feed_disconnect``), the one view there is of a
rank on another host. ``stepwatch watch`` has no connections: it judges local pids only.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from operator import itemgetter
from pathlib import Path
from typing import Any

from ..analysis.alerts import WATCHED_METRICS, Alert, AlertPolicy, AlertRules
from ..artifacts.alerts_log import AlertLog
from ..store.base import COLUMNS

__all__ = ["DUMP_TIMEOUT_S", "Watchdog", "alert_row", "halt_on_nonfinite"]

log = logging.getLogger("stepwatch.watchdog")
DUMP_TIMEOUT_S = 5.0  # how long a STALL waits for the ranks' stack dumps
_FED = ("heartbeats", "steps", "marks", "spans")
_IDX = {table: {name: i for i, (name, _) in enumerate(COLUMNS[table])} for table in (*_FED, "alerts")}


def alert_row(alert: Alert, session_id: str) -> tuple[Any, ...]:
    """The alert as an ``alerts`` table tuple (COLUMNS order, JSON columns as text)."""
    values = {"session_id": session_id, "ts_ns": int(alert.ts * 1e9), "kind": alert.kind,
              "severity": alert.severity, "ranks": json.dumps(list(alert.ranks)), "step": alert.step,
              "message": alert.message, "evidence": json.dumps(alert.evidence, default=str)}
    return tuple(values[name] for name, _ in COLUMNS["alerts"])


def halt_on_nonfinite(run_dir: Path, message: Any, *, by: str) -> str:
    """``--on-nonfinite halt`` (``run`` and ``watch``): asks every rank to stop at the same step
    (docs/halt.md), or keeps the step of a halt already asked for. Returns the line to print:
    the step, or why no halt was requested (the run goes on; nothing raised)."""
    from ..artifacts.halt import request_halt

    try:
        request = request_halt(run_dir, reason=f"NONFINITE: {message}", by=by, keep_pending=True)
    except Exception as exc:  # noqa: BLE001 - say why the run was not halted
        return f"[stepwatch] --on-nonfinite halt: could not request the halt: {exc}"
    return f"[stepwatch] --on-nonfinite halt: every rank stops at step {request.target_step}"


class _Process:
    """Whether a rank's process still exists (same host only; psutil)."""

    def __init__(self) -> None:
        self._host = socket.gethostname()

    def gone(self, pid: int, started_before: float | None, host: str | None) -> bool | None:
        """True: gone (or its pid now names a younger process); False: alive; None: cannot tell
        (another host)."""
        if host is not None and host != self._host:
            return None
        import psutil

        try:
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
            created = process.create_time()
        except psutil.NoSuchProcess:
            return True
        except (psutil.AccessDenied, OSError):
            return None
        return started_before is not None and created > started_before + 2.0


class Watchdog:
    """Example (the aggregator's use)::

        dog = Watchdog(run_dir, AlertPolicy(stall_after_s=60))
        dog.feed(session_id, rank, host, rows)      # on the intake path: references only
        for alert, row in dog.tick():               # every second, on a worker thread
            ...                                     # store the row, print alert.line()
    """

    def __init__(self, run_dir: Path, policy: AlertPolicy | None = None, *, dump_stacks: bool = True,
                 actions: Mapping[str, str] | None = None, clock: Callable[[], float] = time.time,
                 check_processes: bool = True, forget_after_s: float | None = 600.0,
                 already_raised: Callable[[Alert], bool] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.policy = policy or AlertPolicy()
        self.dump_stacks = dump_stacks
        self.actions = dict(actions or {})  # {"STALL": "dump"|"kill", "NONFINITE": "alert"|"halt"}
        self.clock = clock
        self.log = AlertLog(self.run_dir)
        self.rules: dict[str, AlertRules] = {}
        self._fed: deque[tuple[Any, ...]] = deque()
        self._hosts: dict[tuple[str, int], str | None] = {}
        self._first_ts: dict[tuple[str, int], float] = {}
        self._step_spans: OrderedDict[str, int] = OrderedDict()  # span id -> step index (marks name it)
        self._processes = _Process() if check_processes else None
        self._log_failed = False
        self.alerts: list[Alert] = []
        # a standing server sees session after session: one whose ranks have all ended is
        # forgotten this long after (None: never; ``stepwatch watch`` ends with its run)
        self.forget_after_s = forget_after_s
        self._ended: dict[str, float] = {}
        # alerts already raised elsewhere (an earlier ``stepwatch watch`` of the run): neither
        # acted on (no second stack dump) nor written again
        self.already_raised = already_raised or (lambda alert: False)

    def rules_of(self, session_id: str) -> AlertRules:
        rules = self.rules.get(session_id)
        if rules is None:
            rules = self.rules[session_id] = AlertRules(self.policy, session_id=session_id)
        return rules

    # -- feeding -------------------------------------------------------------------------------

    def feed(self, session_id: str, rank: int, host: Any, rows: Mapping[str, list[tuple[Any, ...]]]) -> None:
        """The rows of one accepted frame (store tuples). Keeps a reference and the length: the
        aggregator only ever appends to its pending lists, so the first ``n`` stay this frame's."""
        at = self.clock()
        fed = len(self._fed)
        for table in _FED:
            table_rows = rows.get(table)
            if table_rows:
                self._fed.append((session_id, rank, host, table, table_rows, len(table_rows), at))
        if len(self._fed) == fed:  # rows the rules do not read (memory samples): still a sign of life
            self._fed.append((session_id, rank, host, "frame", None, 0, at))

    def feed_stop(self, session_id: str, rank: int) -> None:
        """The rank's telemetry ``stop`` event."""
        self._fed.append((session_id, rank, None, "stop", None, 0, self.clock()))

    def feed_disconnect(self, session_id: str, rank: int) -> None:
        """The rank's last connection to the aggregator closed from its end, no stop event sent
        on it (``Aggregator.handle_connection``)."""
        self._fed.append((session_id, rank, None, "disconnect", None, 0, self.clock()))

    def feed_heartbeat(self, session_id: str, rank: int, record: Mapping[str, Any], at: float) -> None:
        """A heartbeat record read from a file (``stepwatch watch``)."""
        key = (session_id, rank)
        ts = record.get("ts")
        if key not in self._first_ts and isinstance(ts, (int, float)):
            self._first_ts[key] = float(ts)
        self.rules_of(session_id).observe_heartbeat(rank, record, at)

    def _drain(self) -> None:
        while self._fed:
            session_id, rank, host, table, table_rows, count, at = self._fed.popleft()
            if host is not None:
                self._hosts[(session_id, rank)] = str(host)
            rules = self.rules_of(session_id)
            if table == "stop":
                rules.observe_stop(rank, at)
                continue
            if table == "disconnect":
                rules.observe_disconnect(rank, at)
                continue
            rules.observe_frame(rank, at, host=self._hosts.get((session_id, rank)))
            if table == "frame":
                continue
            try:
                getattr(self, f"_rows_{table}")(rules, session_id, table_rows[:count], at)
            except (TypeError, ValueError, KeyError, IndexError) as exc:  # rows the store took, we cannot read
                log.debug("watchdog: could not read %s rows: %s", table, exc)

    def _rows_heartbeats(self, rules: AlertRules, session_id: str, rows: list[tuple[Any, ...]], at: float) -> None:
        idx = _IDX["heartbeats"]
        for row in rows:
            fields = row[idx["fields"]]
            if isinstance(fields, str):
                fields = json.loads(fields)
            record = dict(fields) if isinstance(fields, dict) else {}
            record.update(ts=row[idx["ts_ns"]] / 1e9, step=row[idx["step"]], msg=row[idx["msg"]], pid=row[idx["pid"]])
            self.feed_heartbeat(session_id, row[idx["rank"]], record, at)

    def _rows_steps(self, rules: AlertRules, session_id: str, rows: list[tuple[Any, ...]], at: float) -> None:
        idx = _IDX["steps"]
        for row in sorted(rows, key=lambda r: (r[idx["rank"]], r[idx["step"]])):
            rules.observe_step(row[idx["rank"]], row[idx["step"]], end_ts=row[idx["end_ns"]] / 1e9, at=at)

    def _rows_spans(self, rules: AlertRules, session_id: str, rows: list[tuple[Any, ...]], at: float) -> None:
        # one frame's rows are one rank's (the frame's meta): its latest span end is its activity
        idx = _IDX["spans"]
        rank_i, end_i, name_i, idx_i, id_i = idx["rank"], idx["end_ns"], idx["name"], idx["idx"], idx["span_id"]
        ends = [end for end in map(itemgetter(end_i), rows) if type(end) is int]
        if ends:
            rules.observe_activity(rows[0][rank_i], ts=max(ends) / 1e9, at=at)
        for row in rows:
            if row[name_i] == "step" and type(row[idx_i]) is int:
                self._step_spans[row[id_i]] = row[idx_i]
                rules.name_step(row[rank_i], row[id_i], row[idx_i])
        while len(self._step_spans) > 4096:
            self._step_spans.popitem(last=False)

    def _rows_marks(self, rules: AlertRules, session_id: str, rows: list[tuple[Any, ...]], at: float) -> None:
        idx = _IDX["marks"]
        name_i = idx["name"]
        for row in [row for row in rows if row[name_i] in WATCHED_METRICS]:
            name = row[name_i]
            number, text = row[idx["value_num"]], row[idx["value_text"]]
            value = number if number is not None else text
            span = row[idx["span_id"]]
            ts = row[idx["ts_ns"]]
            attrs = row[idx["attrs"]]
            if isinstance(attrs, str) and '"inferred"' in attrs:  # JSON text; a user mark's is left unread
                attrs = json.loads(attrs)
            rules.observe_mark(row[idx["rank"]], name, value, step=self._step_spans.get(span), key=span,
                               ts=ts / 1e9 if isinstance(ts, int) else None, at=at,
                               attrs=attrs if isinstance(attrs, dict) else None)

    # -- checking ------------------------------------------------------------------------------

    def _check_processes(self, now: float) -> None:
        """The pid where it can be checked (this host); a dropped connection where it cannot.
        A rank whose end records are on disk (a shared run directory) stopped, whichever."""
        for session_id, rules in self.rules.items():
            for state in rules.active():
                if state.gone_at is not None:
                    continue
                gone = None
                if self._processes is not None and state.pid is not None:
                    gone = self._processes.gone(state.pid, self._first_ts.get((session_id, state.rank)),
                                                self._hosts.get((session_id, state.rank)))
                if gone is False:
                    if state.dropped_at is not None:
                        rules.observe_process_alive(state.rank)
                    continue
                if gone is None and state.dropped_at is None:
                    continue
                if self._stopped_on_disk(session_id, state.rank):
                    rules.observe_stop(state.rank, now)
                elif gone:
                    rules.observe_gone(state.rank, now)

    def _stopped_on_disk(self, session_id: str, rank: int) -> bool:
        """The rank's own end records in the run directory (written before its process exits):
        ``outcome_rank<N>.json`` of this session, or a heartbeat file ending in ``stop``."""
        end = self.run_dir / f"outcome_rank{rank}.json"
        try:
            record = json.loads(end.read_text())
            if isinstance(record, dict) and record.get("session_id") == session_id:
                return True
        except (OSError, ValueError):
            pass
        try:
            with (self.run_dir / f"heartbeat_rank{rank}.jsonl").open("rb") as handle:
                handle.seek(0, 2)
                size = handle.tell()
                handle.seek(max(0, size - 65536))
                lines = handle.read().splitlines()
            last = json.loads(lines[-1]) if lines else None
        except (OSError, ValueError, IndexError):
            return False
        return isinstance(last, dict) and last.get("msg") == "stop"

    def tick(self, *, final: bool = False) -> list[tuple[Alert, tuple[Any, ...]]]:
        """Runs the rules; returns each new alert with its ``alerts`` table row, its stack dumps
        taken and its alerts.jsonl line written."""
        self._drain()
        now = self.clock()
        self._check_processes(now)
        out = []
        for session_id, rules in list(self.rules.items()):
            for alert in rules.check(now, final=final):
                if self.already_raised(alert):
                    continue
                alert = self._act(alert)
                self._write(alert)
                self.alerts.append(alert)
                out.append((alert, alert_row(alert, session_id)))
            self._forget(session_id, rules, now)
        del self.alerts[:-1000]
        return out

    def _forget(self, session_id: str, rules: AlertRules, now: float) -> None:
        if self.forget_after_s is None:
            return
        if not rules.all_ended():
            self._ended.pop(session_id, None)
            return
        if now - self._ended.setdefault(session_id, now) >= self.forget_after_s:
            del self.rules[session_id]
            del self._ended[session_id]
            for key in [k for k in self._hosts if k[0] == session_id]:
                del self._hosts[key]
            for key in [k for k in self._first_ts if k[0] == session_id]:
                del self._first_ts[key]

    def _act(self, alert: Alert) -> Alert:
        """The evidence of what was done: stack dumps for a STALL, the action ``run`` takes."""
        evidence = dict(alert.evidence)
        action = self.actions.get(alert.kind)
        if action is not None:
            evidence["action"] = action
        if alert.kind == "STALL" and self.dump_stacks:
            from ..artifacts.stacks import dump_stacks

            try:
                paths = dump_stacks(self.run_dir, timeout_s=DUMP_TIMEOUT_S, reason=f"STALL: {alert.message}")
                evidence["stacks"] = [str(Path(p).resolve()) for p in paths]
                if getattr(paths, "problems", None):
                    evidence["stacks_problems"] = dict(paths.problems)
            except Exception as exc:  # noqa: BLE001 - the alert goes out without its dumps, saying why
                evidence["stacks"] = []
                evidence["stacks_error"] = f"{type(exc).__name__}: {exc}"
        return Alert(ts=alert.ts, kind=alert.kind, severity=alert.severity, ranks=alert.ranks, step=alert.step,
                     message=alert.message, evidence=evidence, session_id=alert.session_id)

    def _write(self, alert: Alert) -> None:
        try:
            self.log.append(alert.to_dict())
        except OSError as exc:
            if not self._log_failed:
                self._log_failed = True
                log.warning("watchdog: cannot write %s (the alerts still go to the history): %s", self.log.path, exc)

    def all_ended(self) -> bool:
        return bool(self.rules) and all(rules.all_ended() for rules in self.rules.values())
