"""The final summary of a run: step-time statistics per rank and overall, phase shares,
throughput, memory peaks, drops, collector health and session status.

Built from the history store, so ``stepwatch run``, ``stepwatch summary`` and the importers all
give the same numbers. ``final_summary.json`` carries ``schema_version``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC
from pathlib import Path
from typing import Any

from .._decode import read_json_file
from ..phases import PHASES as PHASE_TABLE
from ..phases import RESIDUAL, SHARES, STEP_COLUMNS
from ..store.base import QUANTILES, HistoryStore, StepAggregate, quantile_positions
from .epochs import epoch_report, render_epoch_line
from .program_settings import session_versions
from .verdicts.diagnosis import diagnosis_lines, summary_diagnosis
from .verdicts.inputs import session_steps
from .verdicts.step_columns import StepColumns

__all__ = ["SUMMARY_SCHEMA_VERSION", "build_summary", "compare_summaries", "outcome_lines", "percentile",
           "render_summary_text", "run_outcome", "step_aggregate", "step_stats"]

SUMMARY_SCHEMA_VERSION = "1.1"  # 1.1: ``diagnosis`` (analysis/diagnosis.py, docs/summary.md)
PHASES = SHARES  # the phase shares' names (stepwatch.phases): "optimizer" is the optimizer_step phase
_COLUMNS = STEP_COLUMNS  # each share's column in the history's steps table, in the same order
_OUTSIDE_RESIDUAL = tuple(p.column for p in PHASE_TABLE if not p.in_residual)


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), on pre-sorted values."""
    if len(sorted_values) == 0:
        return None
    position = (len(sorted_values) - 1) * q
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def step_aggregate(steps: StepColumns) -> StepAggregate:
    """What the step statistics need of ``steps`` (store.base.StepAggregate): the numbers a
    ClickHouse store reduces the same rows to on its server (``step_aggregates``), so the
    statistics of either are the same. Whole nanoseconds below 2**53 sum exactly as float64."""
    import numpy as np

    step_ns = steps.arrays["step_ns"]
    known = np.sort(step_ns[~np.isnan(step_ns)])
    n = len(known)
    picks = tuple((int(known[lo]), int(known[hi])) for lo, hi in (quantile_positions(n, q) for q in QUANTILES)) \
        if n else ()
    phase = {column: np.nan_to_num(steps.arrays[column]) for column in _COLUMNS}  # unknown: none spent
    sums = []
    for column in _COLUMNS:
        if column == RESIDUAL.column:
            # wait_ns is the spec's residual (step - h2d - forward - backward - optimizer), which
            # still holds the step's own fetch; its share excludes data_load (the phases outside
            # the residual) so shares sum to 1.
            outside = sum((phase[c] for c in _OUTSIDE_RESIDUAL), np.zeros(len(steps)))
            sums.append(int(np.maximum(0.0, phase[column] - outside).sum()))
        else:
            sums.append(int(phase[column].sum()))
    span = steps.span()
    return StepAggregate(len(steps), n, picks, int(known[-1]) if n else None, int(known.sum()), tuple(sums),
                         None if span is None else int(span[0]), None if span is None else int(span[1]))


def _step_stats(steps: StepColumns) -> dict[str, Any]:
    """Step-time statistics and phase shares of ``steps`` (one rank's rows, or every rank's)."""
    return step_stats(step_aggregate(steps))


def step_stats(agg: StepAggregate) -> dict[str, Any]:
    """The statistics of a set of steps from their ``StepAggregate`` (made here from the rows or
    on a ClickHouse server: the same numbers). The quantiles interpolate between the sorted step
    times at ``quantile_positions``, as ``percentile`` does over all of them."""
    n = agg.n
    quantiles: list[float | None] = []
    for q, (low_ns, high_ns) in zip(QUANTILES, agg.picks or [(0, 0)] * len(QUANTILES)):
        if not n:
            quantiles.append(None)
            continue
        low, high = low_ns / 1e6, high_ns / 1e6
        position = (n - 1) * q
        quantiles.append(low + (high - low) * (position - int(position)))
    total = agg.total_ns / 1e6
    shares = {name: round(spent / 1e6 / total, 4) if total > 0 else None for name, spent in zip(PHASES, agg.phase_ns)}
    span_s = ((agg.last_end_ns - agg.first_start_ns) / 1e9
              if agg.rows and agg.last_end_ns is not None and agg.first_start_ns is not None else 0.0)
    median, p90, p99 = quantiles
    return {
        "steps": n,
        "step_ms": {"median": median, "p90": p90, "p99": p99,
                    "mean": total / n if n else None, "max": agg.max_ns / 1e6 if agg.max_ns is not None else None},
        "phase_share": shares,
        "throughput_steps_per_s": round(n / span_s, 3) if span_s > 0 else None,
    }


def _per_rank(steps: StepColumns) -> dict[int, StepColumns]:
    """Each rank's rows, from rows ordered by rank."""
    import numpy as np

    rank = steps.arrays["rank"]
    starts = np.flatnonzero(np.insert(rank[1:] != rank[:-1], 0, True)) if len(rank) else np.array([], dtype=int)
    bounds = [*starts.tolist(), len(rank)]
    return {int(rank[a]): steps.take(slice(a, b)) for a, b in zip(bounds, bounds[1:]) if rank[a] == rank[a]}


# a remote store's degraded episodes and spill queue (server/store_feed.py; docs/clickhouse.md)
STORE_COUNTERS = ("store_degraded_episodes", "store_degraded_s", "store_write_failures", "store_spilled_rows",
                  "store_replayed_rows", "store_spill_pending_rows")


def _read_aggregator_stats(run_dir: Path | None) -> dict[str, Any]:
    """The aggregator's counters; a file a full disk left empty or cut short counts as none."""
    if run_dir is None:
        return {}
    try:
        value = json.loads((run_dir / "aggregator_stats.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def build_summary(store: HistoryStore, session_id: str | None = None, run_dir: Path | None = None, *,
                  policy: Any = None) -> dict[str, Any]:
    """Summary of ``session_id`` (default: the newest session in the store); ``policy``: the
    verdict policy of its ``diagnosis`` (default: the engine's)."""
    sessions = store.sessions()
    if session_id is None:
        if not sessions:
            raise ValueError("the store holds no session")
        session = sessions[0]
        session_id = session["session_id"]
    else:
        session = next((s for s in sessions if s["session_id"] == session_id), {"session_id": session_id})
    steps = session_steps(store, session_id)  # one read: the statistics and the diagnosis share it
    stops = store.query(
        "SELECT rank, metadata FROM telemetry WHERE session_id = ? AND event_type = 'stop' ORDER BY timestamp_ns",
        (session_id,),
    )
    drops: dict[str, dict[str, int]] = {}
    for row in stops:
        metadata = json.loads(row["metadata"] or "{}")
        dropped = metadata.get("dropped")
        if isinstance(dropped, dict):
            drops[str(row["rank"])] = {k: v for k, v in dropped.items() if isinstance(v, int) and v}
    health = store.query(
        "SELECT rank, collector, event_type, COUNT(*) AS n FROM telemetry WHERE session_id = ? "
        "AND event_type IN ('collector_degraded', 'collector_recovered') GROUP BY rank, collector, event_type "
        "ORDER BY rank, collector, event_type",  # the order SQLite's GROUP BY gave, on any store
        (session_id,),
    )
    aggregator_stats = _read_aggregator_stats(run_dir)
    exit_code = None
    outcome = run_outcome(run_dir, session_id)
    if run_dir is not None and (run_dir / "run.json").is_file():
        run = read_json_file(run_dir / "run.json")  # ArtifactError naming it, nesting included
        if run.get("session_id") == session_id:
            exit_code = run.get("exit_code")
    per_rank = {str(rank): _step_stats(rows) for rank, rows in sorted(_per_rank(steps).items())}
    overall = _step_stats(steps)
    # A training step is done when every rank has done it: the run's rate is its slowest rank's.
    rates = [r["throughput_steps_per_s"] for r in per_rank.values() if r["throughput_steps_per_s"] is not None]
    overall["throughput_steps_per_s"] = min(rates) if rates else None
    world_seen, workers = session_processes(store, session_id)
    ranks_seen = sorted({r["rank"] for r in store.query(
        # UNION ALL: SQL both the SQLite and the ClickHouse store take (18.16 has no plain UNION)
        "SELECT DISTINCT rank FROM telemetry WHERE session_id = ? UNION ALL SELECT DISTINCT rank FROM steps WHERE session_id = ?",
        (session_id, session_id))})
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "session_id": session_id,
        "status": session.get("status"),
        "exit_code": exit_code,
        **outcome,
        "started_at_ns": session.get("started_at_ns"),
        "ended_at_ns": session.get("ended_at_ns"),
        "world_size": max(session.get("world_size") or 0, world_seen) or (len(ranks_seen) - len(workers) or None),
        "ranks": [rank for rank in ranks_seen if rank not in workers],
        "workers": workers,
        "versions": session_versions(store, session_id),
        "overall": overall,
        "per_rank": per_rank,
        "epochs": session_epochs(store, session_id),
        "memory_peaks": [
            {"rank": p["rank"], "collector": p["collector"], "device_id": p["device_id"],
             "peak_allocated_bytes": p["peak_allocated"], "peak_reserved_bytes": p["peak_reserved"],
             "total_bytes": p["total"]}
            for p in store.memory_peaks(session_id)
        ],
        "drops": drops,
        "unrecorded_tail": _unrecorded_tail(run_dir, session_id),
        "collector_health": [dict(h) for h in health],
        "aggregator": {k: aggregator_stats[k] for k in ("rows_written", "rejected", "frames_accepted", "rows_lost",
                                                        "write_errors", "disk_full_errors", *STORE_COUNTERS)
                       if k in aggregator_stats},
        "counts": {table: store.count(table, session_id) for table in ("telemetry", "spans", "marks", "heartbeats")},
        "alerts": session_alerts(store, session_id, run_dir),
        "diagnosis": summary_diagnosis(store, session_id, policy, steps),
    }


def session_alerts(store: HistoryStore, session_id: str, run_dir: Path | None = None) -> list[dict[str, Any]]:
    """The watchdog's alerts of the session (docs/watchdog.md), oldest first, as alerts.jsonl
    has them: from the history's ``alerts`` table, else from the run's alerts.jsonl (a run
    watched by ``stepwatch watch`` has no aggregator to store them)."""
    from ..errors import StoreError
    from .alerts import iso_time

    try:
        rows = store.query("SELECT ts_ns, kind, severity, ranks, step, message, evidence FROM alerts "
                           "WHERE session_id = ? ORDER BY ts_ns", (session_id,))
    except StoreError:  # a history written before the alerts table, opened read-only
        rows = []
    if rows:
        return [{"ts": r["ts_ns"] / 1e9, "iso": iso_time(r["ts_ns"] / 1e9), "kind": r["kind"],
                 "severity": r["severity"], "ranks": json.loads(r["ranks"] or "[]"), "step": r["step"],
                 "message": r["message"], "evidence": json.loads(r["evidence"] or "{}")} for r in rows]
    if run_dir is None:
        return []
    from ..artifacts.alerts_log import read_alerts
    from ..errors import ArtifactError

    try:
        return [{k: v for k, v in r.items() if k != "session_id"} for r in read_alerts(run_dir, session_id)]
    except ArtifactError:
        return []


def _alert_lines(summary: dict[str, Any]) -> list[str]:
    return [f"alert {a.get('iso', '?')} {a.get('kind')} ({a.get('severity')}): {a.get('message')}"
            for a in summary.get("alerts") or []]


def run_outcome(run_dir: Path | None, session_id: str) -> dict[str, Any]:
    """``outcome``, ``error`` and ``errors`` of the run (docs/run-outcome.md), from its run.json
    when that describes this session; all None (unknown) otherwise."""
    unknown: dict[str, Any] = {"outcome": None, "error": None, "errors": []}
    if run_dir is None or not (run_dir / "run.json").is_file():
        return unknown
    try:
        run = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError, RecursionError):
        return unknown
    if not isinstance(run, dict) or run.get("session_id") != session_id:
        return unknown
    errors = run.get("errors")
    return {"outcome": run.get("outcome"), "error": run.get("error") if isinstance(run.get("error"), dict) else None,
            "errors": [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []}


def _fmt_time_ns(value: Any) -> str:
    if not isinstance(value, int):
        return "?"
    from datetime import datetime

    return datetime.fromtimestamp(value / 1e9, tz=UTC).strftime("%H:%M:%S.%f")[:-3] + "Z"


def _describe_error(error: dict[str, Any]) -> str:
    who = "the training process" if error.get("rank") is None else f"rank {error['rank']}"
    when = _fmt_time_ns(error.get("at_ns"))
    if error.get("kind") == "watchdog":  # --on-stall kill (docs/watchdog.md)
        return f"at {when}: {error.get('message')}"
    if error.get("kind") == "halt":
        return f"{who if error.get('rank') is not None else 'every rank'} {error.get('message')} (at {when})"
    if error.get("kind") == "signal":
        if not error.get("signal"):
            return f"{who} ended without a word (no end record; SIGKILL or a crash), last seen at {when}"
        return f"{who} was ended by {error.get('signal')} at {when}"
    thread = f" in thread {error['thread']}" if error.get("thread") not in (None, "MainThread") else ""
    message = str(error.get("message") or "").splitlines()
    return f"{who} raised {error.get('type')}{thread} at {when}: {message[0][:200] if message else ''}"


def outcome_lines(summary: dict[str, Any]) -> list[str]:
    """The text summary's lines on how the run ended: which rank failed first, with what, the
    last lines of its traceback, and what the other ranks saw."""
    outcome = summary.get("outcome")
    error = summary.get("error")
    if outcome is None or (error is None and not summary.get("errors")):
        return []  # the header line says the outcome; there is nothing more to tell
    lines = [f"outcome {outcome}" + (f": {_describe_error(error)}" if error else "")]
    if error and error.get("traceback"):
        tail = list(str(error["traceback"]).rstrip().splitlines())[-4:]
        lines += [f"    {line}" for line in tail]
    first_ns = (error or {}).get("at_ns") or 0
    for other in summary.get("errors") or []:
        if other != error:
            after = error is not None and (other.get("at_ns") or 0) >= first_ns
            lines.append(f"  {'then' if after else 'also'} {_describe_error(other)}")
    return lines


def session_processes(store: HistoryStore, session_id: str) -> tuple[int, list[int]]:
    """(the largest world size a rank that a training process started reported, the keys of its
    workers), from the ``process`` object of the start records (capture/children.py): a process
    that ``torch.multiprocessing.spawn`` started and ``init_process_group`` named is a rank of
    that world; one that trained without either is a worker, keyed from the world size up."""
    world, workers = 0, set()
    for row in store.query(
        "SELECT rank, metadata FROM telemetry WHERE session_id = ? AND event_type = 'start'", (session_id,)
    ):
        try:
            process = json.loads(row["metadata"] or "{}").get("process")
        except (ValueError, AttributeError):
            continue
        if not isinstance(process, dict):
            continue
        if process.get("role") == "worker":
            workers.add(row["rank"])
        elif type(process.get("world_size")) is int:  # not a bool
            world = max(world, process["world_size"])
    return world, sorted(workers)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def render_summary_text(summary: dict[str, Any]) -> str:
    lines = [
        f"stepwatch summary  session {summary['session_id']}"
        + (f"  outcome {summary['outcome']}" if summary.get("outcome") else "")
        + f"  {'capture' if summary.get('outcome') else 'status'} {summary.get('status')}"
        + (f"  exit code {summary['exit_code']}" if summary.get("exit_code") is not None else ""),
        f"ranks {summary.get('ranks')} of world size {summary.get('world_size')}"
        + (f", workers {summary['workers']}" if summary.get("workers") else ""),
    ]
    lines[1:1] = outcome_lines(summary)
    lines.extend(diagnosis_lines(summary.get("diagnosis")))  # first after the header: what to do
    overall = summary["overall"]
    lines.append(
        f"steps {overall['steps']}  step time median {_ms(overall['step_ms']['median'])}  "
        f"p90 {_ms(overall['step_ms']['p90'])}  p99 {_ms(overall['step_ms']['p99'])}  "
        f"throughput {overall['throughput_steps_per_s'] or '-'} steps/s"
    )
    epochs = render_epoch_line(summary.get("epochs"))
    if epochs:
        lines.append(epochs)
    shares = overall["phase_share"]
    if any(v is not None for v in shares.values()):
        lines.append("phase share  " + "  ".join(f"{k} {v * 100:.1f}%" for k, v in shares.items() if v is not None))
    workers = {str(w) for w in summary.get("workers") or ()}
    for rank, stats in summary["per_rank"].items():
        lines.append(
            f"  {'worker' if rank in workers else 'rank'} {rank}: {stats['steps']} steps, median {_ms(stats['step_ms']['median'])}, "
            f"p90 {_ms(stats['step_ms']['p90'])}, p99 {_ms(stats['step_ms']['p99'])}, "
            f"{stats['throughput_steps_per_s'] or '-'} steps/s"
        )
    for peak in summary["memory_peaks"]:
        device = "cpu" if peak["device_id"] < 0 else f"device {peak['device_id']}"
        who = "worker" if str(peak["rank"]) in workers else "rank"
        lines.append(f"  memory peak {who} {peak['rank']} {device} ({peak['collector']}): "
                     f"{(peak['peak_allocated_bytes'] or 0) / 2**20:.1f} MiB allocated, "
                     f"{(peak['peak_reserved_bytes'] or 0) / 2**20:.1f} MiB reserved")
    dropped = {rank: d for rank, d in summary["drops"].items() if d}
    tails = _tail_text(summary.get("unrecorded_tail") or {})
    lines.append(f"drops: {dropped if dropped else ('none counted' if tails else 'none')}")
    lines.extend(tails)
    lines.extend(_loss_lines(summary))
    lines.extend(_alert_lines(summary))
    degraded = [h for h in summary["collector_health"] if h["event_type"] == "collector_degraded"]
    lines.append("collector health: " + (", ".join(f"rank {h['rank']} {h['collector']} degraded x{h['n']}" for h in degraded)
                                         if degraded else "all healthy"))
    if summary.get("aggregator", {}).get("rejected"):
        lines.append(f"aggregator rejected frames: {summary['aggregator']['rejected']}")
    versions = summary.get("versions") or {}
    if versions.get("torch"):  # last: what it ran on, after what to do about it
        lines.append(f"versions torch {versions['torch']}" + (f" (cuda {versions['cuda']})" if versions.get("cuda") else "")
                     + "".join(f", {k} {versions[k]}" for k in ("python", "stepwatch") if versions.get(k)))
    return "\n".join(lines) + "\n"


def session_epochs(store: HistoryStore, session_id: str) -> dict[str, Any] | None:
    """The session's epochs (analysis/epochs.py) from its epoch, step and eval_step spans."""
    spans = store.query(
        "SELECT rank, name, idx, start_ns, end_ns FROM spans WHERE session_id = ? "
        "AND name IN ('epoch', 'step', 'eval_step')", (session_id,))
    return epoch_report(spans)


def _unrecorded_tail(run_dir: Path | None, session_id: str) -> dict[str, dict[str, Any]]:
    """Ranks that ended without stopping their capture (SIGKILL, a crash of the interpreter):
    from their step ledgers, the last step recorded and the last sign of life after it."""
    if run_dir is None:
        return {}
    from ..artifacts.step_ledger import unrecorded_tails

    try:
        tails = unrecorded_tails(run_dir, session_id)
    except OSError:
        return {}
    ended = None
    try:
        run = json.loads((run_dir / "run.json").read_text())
        if run.get("session_id") == session_id:
            ended = (run.get("extra") or {}).get("training_ended_ns")
    except (OSError, ValueError, AttributeError):
        pass
    for tail in tails.values():  # the process was gone by the time the launcher saw the training end
        last = tail.get("last_step_end_ns")
        if isinstance(ended, int) and isinstance(last, int) and ended > last:
            tail["ended_by_ns"] = ended
            tail["unrecorded_ms"] = max(tail.get("unrecorded_ms") or 0.0, round((ended - last) / 1e6, 1))
    return tails


def _tail_text(tails: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for rank, tail in sorted(tails.items(), key=lambda item: int(item[0])):
        if tail.get("last_step") is None:
            lines.append(f"  rank {rank} ended without stopping its capture (killed?) before recording a step")
            continue
        after = (f"; it ended at most {tail['unrecorded_ms']:.0f} ms after that step, and what it did in between "
                 "(the step in progress) is not recorded" if tail.get("unrecorded_ms") else "")
        lines.append(f"  rank {rank} ended without stopping its capture (killed?): its last recorded step is "
                     f"{tail['last_step']}{after}")
    return lines


def _loss_lines(summary: dict[str, Any]) -> list[str]:
    """What a full disk (or another failed write) kept out of the history and the summary files."""
    lines = []
    aggregator = summary.get("aggregator") or {}
    if aggregator.get("rows_lost"):
        cause = "the disk was full" if aggregator.get("disk_full_errors") else "writes failed"
        lines.append(f"history: {aggregator['rows_lost']} rows lost ({cause}: {aggregator.get('write_errors', '?')} "
                     "failed writes); the ranks' own files keep what fit")
    if aggregator.get("store_degraded_episodes"):
        pending = aggregator.get("store_spill_pending_rows") or 0
        lines.append(f"history store: degraded {aggregator['store_degraded_episodes']} time(s) for "
                     f"{aggregator.get('store_degraded_s', 0):.1f} s; {aggregator.get('store_spilled_rows', 0)} rows "
                     f"spilled to the local queue, {aggregator.get('store_replayed_rows', 0)} replayed"
                     + (f", {pending} still queued (store_spill.sqlite: replayed by the next serve --out on "
                        f"this directory)" if pending else ", none lost"))
    if summary.get("unwritten"):
        lines.append(f"not written: {summary['unwritten']}")
    return lines


def compare_summaries(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Metric-by-metric differences of two summaries (B relative to A)."""
    def metrics(s: dict[str, Any]) -> dict[str, float | None]:
        o = s["overall"]
        out: dict[str, float | None] = {
            "steps": o["steps"], "step_ms.median": o["step_ms"]["median"], "step_ms.p90": o["step_ms"]["p90"],
            "step_ms.p99": o["step_ms"]["p99"], "throughput_steps_per_s": o["throughput_steps_per_s"],
        }
        for phase, share in o["phase_share"].items():
            out[f"phase_share.{phase}"] = share
        peak = max((p["peak_allocated_bytes"] or 0 for p in s["memory_peaks"]), default=None)
        out["memory_peak_allocated_bytes"] = peak
        return out

    ma, mb = metrics(a), metrics(b)
    rows = []
    for key in ma:
        va, vb = ma[key], mb.get(key)
        delta = (vb - va) if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else None
        relative = (delta / va) if delta is not None and va else None
        rows.append({"metric": key, "a": va, "b": vb, "delta": delta, "relative": relative})
    return rows
