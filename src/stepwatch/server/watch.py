"""``stepwatch watch RUN_DIR``: the watchdog for a job stepwatch did not launch (plain torchrun
with ``stepwatch.init``, or ``stepwatch track``), from the run directory's files alone.

It follows, read-only, every ``heartbeat_rank<N>.jsonl`` (liveness, step, phase, progress
metrics, the stop record), the spool's batch files (steps, closed spans, ``loss`` and
``grad_norm`` marks) and the ranks' ``outcome_rank<N>.json``, feeds the same rules as the
aggregator (server/watchdog.py), and appends its alerts to ``<run>/alerts.jsonl``. It ends once
every rank it has seen has stopped (or is lost), or on Ctrl-C. A record older than the watcher
counts at its own time, so a job that hung before ``watch`` started is caught at once.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..analysis.alerts import Alert, AlertPolicy, alert_from_dict
from ..artifacts.alerts_log import ALERTS_FILE, read_alerts
from ..artifacts.live_ranks import HEARTBEAT_FILE
from ..artifacts.run_manifest import run_session_id
from ..errors import ArtifactError
from .watchdog import Watchdog

__all__ = ["RunWatcher", "check_run_dir"]

_BATCH = re.compile(r"\d{20}-.+\.json")


def check_run_dir(run_dir: Path) -> None:
    """Raises ArtifactError when ``run_dir`` is no run directory, or one the watcher cannot
    write its alerts.jsonl into (before anything is followed)."""
    if not run_dir.exists():
        raise ArtifactError(run_dir, "no such directory")
    if not run_dir.is_dir():
        raise ArtifactError(run_dir, "not a run directory (a file)")
    markers = ("run.json", "telemetry", "spool")
    if not any((run_dir / m).exists() for m in markers) and not any(run_dir.glob("heartbeat_rank*.jsonl")):
        raise ArtifactError(run_dir, "not a run directory (no run.json, heartbeat_rank<N>.jsonl, telemetry/ or spool/)")
    target = run_dir / ALERTS_FILE
    try:
        with target.open("ab"):
            pass
    except OSError as exc:
        raise ArtifactError(target, f"cannot write the alerts here: {exc.strerror or exc}") from None


def _session_of(run_dir: Path) -> str:
    return run_session_id(run_dir) or f"run:{run_dir.resolve()}"


class RunWatcher:
    """Example::

        watcher = RunWatcher(run_dir, AlertPolicy(stall_after_s=60))
        while not watcher.done:
            for alert in watcher.poll():
                print(alert.line())
            time.sleep(0.5)
    """

    def __init__(self, run_dir: Path, policy: AlertPolicy | None = None, *, dump_stacks: bool = True,
                 actions: dict[str, str] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.run_dir = run_dir
        self.clock = clock
        self.session_id = _session_of(run_dir)
        # alerts of an earlier watch of this run are not raised (nor acted on) twice
        self._known = {self._key(alert_from_dict(r)) for r in self._earlier()}
        self.watchdog = Watchdog(run_dir, policy, dump_stacks=dump_stacks, actions=actions, clock=clock,
                                 forget_after_s=None, already_raised=lambda alert: self._key(alert) in self._known)
        self._offsets: dict[Path, tuple[int, int]] = {}  # heartbeat file -> (inode, bytes read)
        self._batches: set[str] = set()
        self._ends: set[int] = set()
        self._span_rank: dict[str, int] = {}
        self._step_index: dict[Any, int] = {}

    def _earlier(self) -> list[dict[str, Any]]:
        try:
            return read_alerts(self.run_dir)
        except ArtifactError:
            return []

    @staticmethod
    def _key(alert: Alert) -> tuple[Any, ...]:
        return (alert.session_id, alert.kind, alert.ranks, alert.step)

    @property
    def done(self) -> bool:
        return self.watchdog.all_ended()

    def poll(self, *, final: bool = False) -> list[Alert]:
        """Reads what is new, checks; returns the new alerts (written to alerts.jsonl already)."""
        now = self.clock()
        self._read_heartbeats(now)
        self._read_spool(now)
        self._read_ends(now)
        fresh = [alert for alert, _ in self.watchdog.tick(final=final)]
        self._known |= {self._key(a) for a in fresh}
        return fresh

    def _read_heartbeats(self, now: float) -> None:
        for path in sorted(self.run_dir.glob("heartbeat_rank*.jsonl")):
            found = HEARTBEAT_FILE.fullmatch(path.name)
            if found is None:
                continue
            try:
                stat = path.stat()
                inode, offset = self._offsets.get(path, (stat.st_ino, 0))
                if inode != stat.st_ino or stat.st_size < offset:
                    offset = 0  # rotated: the new file from its start
                with path.open("rb") as handle:
                    handle.seek(offset)
                    data = handle.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
            self._offsets[path] = (stat.st_ino, offset + end)
            for raw in data[:end].splitlines():
                try:
                    record = json.loads(raw)
                except (ValueError, RecursionError):  # a damaged line (nested past the parser's depth too)
                    continue
                if not isinstance(record, dict):
                    continue
                rank = record.get("rank") if type(record.get("rank")) is int else int(found.group(1))
                ts = record.get("ts")
                at = min(float(ts), now) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else now
                self.watchdog.feed_heartbeat(self.session_id, rank, record, at)

    def _read_spool(self, now: float) -> None:
        from ..artifacts.spool import read_spool

        spool = self.run_dir / "spool"
        try:
            names = sorted(p.name for p in spool.iterdir() if _BATCH.fullmatch(p.name))
        except OSError:
            return
        rules = self.watchdog.rules_of(self.session_id)
        for name in names:
            if name in self._batches:
                continue
            self._batches.add(name)
            try:
                batch = read_spool(spool / name)
            except (ArtifactError, OSError):
                continue
            for span in batch.spans:
                rank = span.get("rank") if type(span.get("rank")) is int else 0
                if isinstance(span.get("id"), str):
                    self._span_rank[span["id"]] = rank
                end = span.get("end_ns")
                if type(end) is not int:
                    continue
                at = min(end / 1e9, now)
                if span.get("name") == "step" and type(span.get("index")) is int:
                    rules.observe_step(rank, span["index"], end_ts=end / 1e9, at=at)
                    self._step_index[span.get("id")] = span["index"]
                    rules.name_step(rank, span.get("id"), span["index"])
                else:
                    rules.observe_activity(rank, ts=end / 1e9, at=at)
            for mark in batch.marks:
                name_ = mark.get("name")
                if not isinstance(name_, str):
                    continue
                ts = mark.get("ts_ns")
                ts_s = ts / 1e9 if type(ts) is int else None
                value = mark.get("value") if mark.get("value") is not None else mark.get("value_nonfinite")
                span_id = mark.get("span_id")
                attrs = mark.get("attrs")
                rules.observe_mark(self._span_rank.get(span_id, 0), name_, value, key=span_id, ts=ts_s,
                                   step=self._step_index.get(span_id),
                                   at=min(ts_s, now) if ts_s is not None else now,
                                   attrs=attrs if isinstance(attrs, dict) else None)

    def _read_ends(self, now: float) -> None:
        rules = self.watchdog.rules_of(self.session_id)
        for path in self.run_dir.glob("outcome_rank*.json"):
            found = re.fullmatch(r"outcome_rank(\d+)\.json", path.name)
            if found is None or int(found.group(1)) in self._ends:
                continue
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError, RecursionError):
                continue
            if not isinstance(record, dict):
                continue
            if self.session_id.startswith("run:") or record.get("session_id") in (None, self.session_id):
                self._ends.add(int(found.group(1)))
                rules.observe_stop(int(found.group(1)), now)


def exit_code(alerts: list[Alert]) -> int:
    """0: no alert; 1: at least one (docs/watchdog.md)."""
    return 1 if alerts else 0

