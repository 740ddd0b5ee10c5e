"""Live verdicts: while ranks send, the verdict engine over the last steps of every session.

A thread of its own, never the asyncio intake path nor the single writer: every ``interval_s``
(``STEPWATCH_VERDICT_INTERVAL_S``, default 3 s; 0 turns it off) it reads, through a read-only
connection of its own, the last ``window`` (100) steps completed on every rank of every session
that received steps since it last looked, and the memory samples over the same span
(``analysis.verdicts.inputs``: index seeks, so the cost does not grow with the run), and runs
``analysis.verdicts.diagnose`` on them.

Intake comes first: a round is skipped while the aggregator is under load (``busy``:
``flush_rows`` rows wait, or its last tick wrote as many), and the next round waits 20 times the last one's CPU time (at most 10 intervals),
so the evaluations take at most 5 % of the GIL the intake and the writer share.

A change of a session's primary verdict (name, severity or ranks), once it holds for ``confirm``
evaluations in a row (so a verdict on a threshold does not flap), is
- stored: a row of the history's ``verdicts`` table, queued to the aggregator's writer;
- emitted: ``{"event": "verdict", "line": "[stepwatch] verdict NAME (severity): ...", ...}``,
  which ``stepwatch run`` prints as it comes;
- and, for ``HIGH_PRESSURE`` or ``CREEP_CONFIRMED`` on a CUDA device, a memory snapshot asked of
  the ranks (``artifacts.memory_snapshots.request_memory_snapshot``, where that module exists).
``WARMUP`` and ``INSUFFICIENT_STEP_TIME_DATA`` are no verdict on the run: never reported.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..analysis.verdicts.inputs import VerdictInputs

__all__ = ["INTERVAL_ENV", "LiveVerdicts", "interval_from_env"]

INTERVAL_ENV = "STEPWATCH_VERDICT_INTERVAL_S"
DEFAULT_INTERVAL_S = 3.0
DEFAULT_WINDOW = 100
MAX_DUTY = 0.05  # the evaluations' share of wall time at most: the next round waits 20x the last one's cost
_NOT_A_VERDICT = frozenset({"WARMUP", "INSUFFICIENT_STEP_TIME_DATA"})
_SNAPSHOT_ON = frozenset({"HIGH_PRESSURE", "CREEP_CONFIRMED"})
log = logging.getLogger("stepwatch.aggregator")


def interval_from_env(default: float = DEFAULT_INTERVAL_S) -> float:
    """The evaluation period in seconds; 0 (or a value that is not a number) turns it off."""
    text = os.environ.get(INTERVAL_ENV)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        log.warning("%s=%r is not a number of seconds: live verdicts are off", INTERVAL_ENV, text)
        return 0.0
    return value if value > 0 else 0.0


class LiveVerdicts:
    """Example::

        live = LiveVerdicts(store_path, progress=lambda: {sid: (steps_seen, ranks)}, emit=print,
                            store_row=lambda table, row: ...)
        live.start(); ...; live.stop()
    """

    def __init__(self, store_path: Path, *, progress: Callable[[], Mapping[str, tuple[int, set[int]]]],
                 emit: Callable[[dict[str, Any]], None], store_row: Callable[[str, dict[str, Any]], None],
                 interval_s: float = DEFAULT_INTERVAL_S, window: int = DEFAULT_WINDOW, confirm: int = 2,
                 run_dir: Path | None = None, policy: Any = None, busy: Callable[[], bool] | None = None) -> None:
        self.store_path = store_path
        self.progress = progress
        self.emit = emit
        self.store_row = store_row
        self.interval_s = interval_s
        self.window = window
        self.confirm = max(1, confirm)
        self.run_dir = run_dir
        self.policy = policy
        self.busy = busy or (lambda: False)  # rows wait for the writer: intake first, this round is skipped
        self.skipped = 0
        self._last_round_s = 0.0
        self.evaluations = 0
        self.changes = 0
        self.seconds = 0.0
        self.max_seconds = 0.0
        self.errors = 0
        self._reported: dict[str, tuple[Any, ...]] = {}  # session -> key of the primary last reported
        self._candidate: dict[str, tuple[tuple[Any, ...], int]] = {}  # session -> (key, times seen in a row)
        self._looked: dict[str, int] = {}  # session -> steps seen when last evaluated
        self._snapshots: set[tuple[str, str]] = set()  # (session, verdict) a snapshot was asked for
        self._store: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepwatch-live-verdicts", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "window_steps": self.window, "evaluations": self.evaluations,
                "changes": self.changes, "errors": self.errors, "skipped_busy": self.skipped,
                "mean_ms": round(1000 * self.seconds / self.evaluations, 3) if self.evaluations else None,
                "max_ms": round(1000 * self.max_seconds, 3)}

    def _run(self) -> None:
        while not self._stop.wait(min(max(self.interval_s, self._last_round_s / MAX_DUTY), 10 * self.interval_s)):
            if self.busy():
                self.skipped += 1
                continue
            first = self.evaluations == 0
            started = time.thread_time()
            self.tick()
            if not first:
                # The first evaluation opens the store and imports what the engine loads (numpy):
                # not the cost of a round. Only then: a job that ends before it imports none of it.
                # A round's cost is its thread's CPU time, its share of the GIL: on a machine busy
                # with other processes its wall time is longer, but it takes no more from intake.
                self._last_round_s = time.thread_time() - started
        if self._store is not None:
            self._store.close()

    def tick(self) -> None:
        """One round: every session with new steps since the last round."""
        for session_id, (seen, ranks) in list(self.progress().items()):
            if seen == self._looked.get(session_id) or not ranks:
                continue
            self._looked[session_id] = seen
            started = time.perf_counter()
            try:
                self.evaluate(session_id, sorted(ranks))
            except Exception as exc:  # noqa: BLE001 - a failed evaluation must not stop the aggregator
                self.errors += 1
                if self.errors == 1:
                    log.warning("live verdicts: an evaluation failed (later failures are only counted): %s: %s",
                                type(exc).__name__, exc)
            spent = time.perf_counter() - started
            self.evaluations += 1
            self.seconds += spent
            self.max_seconds = max(self.max_seconds, spent)

    def _open(self) -> Any:
        if self._store is None:
            from ..store import open_store

            self._store = open_store(self.store_path, read_only=True)  # a path or a store URL
        return self._store

    def evaluate(self, session_id: str, ranks: list[int]) -> Any:
        """The session's diagnosis now; reports its primary verdict when that changed."""
        from ..analysis.verdicts.inputs import diagnose_store, load_verdict_inputs

        inputs = load_verdict_inputs(self._open(), session_id, last_steps=self.window)
        diagnosis = diagnose_store(self._open(), session_id, window=self.window, policy=self.policy, inputs=inputs)
        primary = diagnosis.primary
        if primary.name not in _NOT_A_VERDICT:
            key = (primary.name, primary.severity, tuple(primary.ranks))
            seen, count = self._candidate.get(session_id, (None, 0))
            count = count + 1 if seen == key else 1
            self._candidate[session_id] = (key, count)
            if count >= self.confirm and self._reported.get(session_id) != key:
                self._reported[session_id] = key
                self._report(session_id, primary, inputs)
        self._maybe_snapshot(session_id, diagnosis, inputs)
        return diagnosis

    def _report(self, session_id: str, verdict: Any, inputs: VerdictInputs) -> None:
        self.changes += 1
        steps = [r["step"] for r in inputs.steps if isinstance(r.get("step"), int)]
        data = verdict.to_dict()
        row = {"session_id": session_id, "ts_ns": time.time_ns(), "step": max(steps) if steps else None,
               "window_steps": self.window, "name": verdict.name, "severity": verdict.severity,
               "score": verdict.score, "ranks": list(verdict.ranks), "message": verdict.message,
               "next_step": verdict.next_step, "evidence": dict(verdict.evidence)}
        self.store_row("verdicts", row)
        who = f" rank{'s' if len(verdict.ranks) > 1 else ''} {', '.join(map(str, verdict.ranks))}" if verdict.ranks else ""
        line = f"[stepwatch] verdict {verdict.name} ({verdict.severity}{who}): {verdict.message}"
        if verdict.next_step:
            line += f"; next step: {verdict.next_step}"
        self.emit({"event": "verdict", "line": line, "session_id": session_id, "step": row["step"], "verdict": data})

    def _maybe_snapshot(self, session_id: str, diagnosis: Any, inputs: VerdictInputs) -> None:
        """A CUDA memory snapshot from the ranks, once per session and verdict, where the run uses
        CUDA (a memory sample of a device) and the snapshot requests exist in this build."""
        if self.run_dir is None:
            return
        found = [v for v in diagnosis.memory if v.name in _SNAPSHOT_ON and (session_id, v.name) not in self._snapshots]
        if not found or not any(isinstance(m.get("device_id"), int) and m["device_id"] >= 0 for m in inputs.memory):
            return
        try:
            from ..artifacts.memory_snapshots import request_memory_snapshot  # the controls helper's module
        except ImportError:
            return
        for verdict in found:
            self._snapshots.add((session_id, verdict.name))
            try:
                request_memory_snapshot(self.run_dir, reason=f"verdict {verdict.name}: {verdict.message}",
                                        session_id=session_id)
            except Exception as exc:  # noqa: BLE001 - an unwritable run dir costs the snapshot only
                log.warning("live verdicts: could not ask for a memory snapshot: %s", exc)
