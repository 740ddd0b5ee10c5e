"""One run's page: everything the dashboard's run page and the one-file report draw, from the
history store (and the run directory's run.json, final_summary.json, alerts and stack dumps).

Big runs stay small: the step rows are never fetched one by one. One aggregate query groups them
by rank and bucket of steps (``downsample.bucket_width``) and gives each bucket's lowest and
highest step time with the step each came from (the step packed under the time, so one scan
finds both), its phase sums (the stacked phase shares) and its slowest step (the heatmap). A
64-rank x 20,000-step run comes back as about 40,000 step-time points (bench/bench_dashboard.py).
Memory samples are cut down the same way in SQL (the lowest and highest sample per bucket of
time), marks by ``downsample.minmax`` after a range read.

A store on a server (ClickHouse) answers the reads SQLite answers with SQL of its own (a
recursive CTE, a TEMP table of buckets, a bare column beside MIN/MAX) by methods of its own
(``rank_step_extents``, ``step_bucket_points``, ``phase_bucket_sums``, ``memory_bucket_rows``:
``store.clickhouse_views``), the same numbers; every other read is SQL both speak.

Live growth (``run_updates``): the rows after the page's cursors (each rank's last step, the last
sample's time, the alerts and verdict changes it has), read by index seeks, so a poll costs what
is new, not the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..phases import PHASES, RESIDUAL, SHARES, STEP_COLUMNS
from ..store.base import HistoryStore
from ..store.sqlite import SESSION_RANKS
from .downsample import CHART_POINTS, bucket_width, minmax, points_budget
from .sources import command_of, final_summary_of, run_json_of

__all__ = ["UPDATE_LIMIT", "run_page", "run_updates", "step_spans"]

PHASE_BUCKETS = 200  # columns of the stacked phase-share chart
HEATMAP_CELLS = 20_000  # ranks x step buckets of the heatmap
UPDATE_LIMIT = 5_000  # new step rows one live poll hands over; past it the page reloads its data
FULL_DIAGNOSIS_ROWS = 200_000  # step rows above which a run with no summary is diagnosed on a window
DIAGNOSIS_WINDOW = 500
MIB = 2**20
_OUTSIDE_AT = tuple(STEP_COLUMNS.index(p.column) for p in PHASES if not p.in_residual)
_WAIT = STEP_COLUMNS.index(RESIDUAL.column)
# each rank's last step, by seeks down steps_unique (session, rank, step) (as analysis/verdicts/inputs.py)
_LAST_STEPS = SESSION_RANKS + """SELECT rank,
       (SELECT step FROM steps WHERE session_id = ?1 AND rank = ranks.rank ORDER BY step LIMIT 1) AS first,
       (SELECT step FROM steps WHERE session_id = ?1 AND rank = ranks.rank ORDER BY step DESC LIMIT 1) AS last
FROM ranks WHERE rank IS NOT NULL
"""


def _tuples(store: HistoryStore, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """Rows as tuples (no dict per row) where the store gives them."""
    query_tuples = getattr(store, "query_tuples", None)
    if query_tuples is not None:
        return list(query_tuples(sql, params))
    return [tuple(r.values()) for r in store.query(sql, params)]


def _r(value: float, digits: int = 3) -> float:
    return round(value, digits)


def last_steps(store: HistoryStore, session_id: str) -> dict[int, tuple[int, int]]:
    """rank -> (its first step, its last step)."""
    own = getattr(store, "rank_step_extents", None)
    if own is not None:
        return dict(own(session_id))
    return {int(r["rank"]): (int(r["first"]), int(r["last"])) for r in store.query(_LAST_STEPS, (session_id,))
            if r["last"] is not None}


def session_header(store: HistoryStore, session_id: str, run_dir: Path | None) -> dict[str, Any]:
    """The run's identity and how it ended: the sessions row, run.json's outcome, error and command."""
    rows = store.query("SELECT * FROM sessions WHERE session_id = ?", (session_id,))
    row = rows[0] if rows else {"session_id": session_id}
    run = run_json_of(run_dir, session_id)
    command = command_of(run, row)
    outcome = run.get("outcome")
    if outcome == "running" and row.get("status") not in (None, "running"):
        outcome = None  # the capture ended; the launcher writes how the training ended after it
    return {
        "session_id": session_id, "status": row.get("status"), "outcome": outcome,
        "error": run.get("error") if isinstance(run.get("error"), dict) else None,
        "exit_code": run.get("exit_code"), "command": command,
        "started_at_ns": row.get("started_at_ns") or run.get("started_at_ns"),
        "ended_at_ns": row.get("ended_at_ns") or run.get("ended_at_ns"),
        "world_size": row.get("world_size"), "host": row.get("host"), "source": row.get("source"),
        "run_dir": str(run_dir) if run_dir is not None else None,
    }


def _diagnosis(store: HistoryStore, session_id: str, run_dir: Path | None, status: str | None,
               step_rows: int) -> dict[str, Any]:
    """The primary diagnosis the run's other surfaces show: its final summary's, else (a run
    still going) the live verdict's last change, else computed here (over every step, or the
    last DIAGNOSIS_WINDOW steps of a run too big to read whole on a page load)."""
    summary = final_summary_of(run_dir, session_id)
    if summary is not None and isinstance(summary.get("diagnosis"), dict):
        return {**summary["diagnosis"], "source": "the final summary (final_summary.json)"}
    if status == "running":
        try:
            rows = store.query("SELECT * FROM verdicts WHERE session_id = ? ORDER BY ts_ns DESC LIMIT 1", (session_id,))
        except StoreError:  # a history written before the verdicts table
            rows = []
        if rows:
            row = rows[0]
            primary = {"name": row["name"], "severity": row["severity"], "score": row["score"],
                       "ranks": json.loads(row["ranks"] or "[]"), "message": row["message"],
                       "next_step": row["next_step"], "evidence": json.loads(row["evidence"] or "{}")}
            return {"primary": primary, "step_time": [], "memory": [], "system": [],
                    "source": f"the live verdict at step {row['step']} (last {row['window_steps']} steps)"}
    from ..analysis.verdicts.diagnosis import summary_diagnosis
    from ..analysis.verdicts.inputs import diagnose_store

    if step_rows > FULL_DIAGNOSIS_ROWS:
        try:
            found = diagnose_store(store, session_id, window=DIAGNOSIS_WINDOW).to_dict()
        except Exception as exc:  # noqa: BLE001 - the page shows why, the charts still come
            return {"primary": None, "error": f"{type(exc).__name__}: {exc}"}
        return {**found, "source": f"computed now over the last {DIAGNOSIS_WINDOW} steps of every rank"}
    try:
        found = summary_diagnosis(store, session_id)
    except StoreError as exc:  # a history the engine cannot read (an older one): the charts still come
        return {"primary": None, "error": str(exc)}
    return {**found, "source": "computed now over every step"}


def _bucket_rows(store: HistoryStore, session_id: str, ranks: list[int], first: int, width: int, n_buckets: int,
                 select: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """``SELECT rank, bucket, <select>`` over each rank's buckets of ``width`` steps from ``first``.

    The buckets are a temporary table in (rank, bucket) order, joined to the steps by index range
    (``steps_unique``: session, rank, step): the rows then come bucket by bucket and SQLite groups
    them by the table's rowid as they come, where ``GROUP BY rank, step / width`` would sort
    every step row first (a third of the time on 1.28M rows). ``select`` names the step row
    ``s`` and the bucket ``k`` (``k.lo``: its first step); its parameters are numbered from ?2."""
    values = ", ".join("(?)" for _ in ranks)
    store.query("DROP TABLE IF EXISTS temp.sw_buckets")
    store.query(f"CREATE TEMP TABLE sw_buckets AS WITH RECURSIVE n(b) AS (SELECT 0 UNION ALL SELECT b + 1 FROM n "
                f"WHERE b + 1 < ?), r(rank) AS (VALUES {values}) SELECT r.rank AS rank, n.b AS b, ? + n.b * ? AS lo, "
                f"? + n.b * ? + ? - 1 AS hi FROM r, n ORDER BY r.rank, n.b",
                (n_buckets, *ranks, first, width, first, width, width))
    try:
        return _tuples(store, f"SELECT k.rank, k.b, {select} FROM sw_buckets k CROSS JOIN steps s "
                              f"ON s.session_id = ?1 AND s.rank = k.rank AND s.step BETWEEN k.lo AND k.hi "
                              f"AND s.step_ns IS NOT NULL GROUP BY k.rowid", (session_id, *params))
    finally:
        store.query("DROP TABLE IF EXISTS temp.sw_buckets")


def _step_buckets(store: HistoryStore, session_id: str, ranks: list[int], first: int, width: int,
                  n_buckets: int) -> list[dict[str, Any]]:
    """Per (rank, bucket): its lowest and highest step time with their steps. The step is packed
    under the time (``ns * pack + offset``) so one MIN and one MAX find each point; a time too
    large to pack comes back as a float and the point is put at its bucket's first step."""
    own = getattr(store, "step_bucket_points", None)
    if own is not None:
        return [{"rank": rank, "b": b, "lo": lo, "hi": hi}
                for rank, b, lo, hi in own(session_id, ranks, first, width, n_buckets)]
    pack = 1 << max(1, (width - 1).bit_length())
    rows = _bucket_rows(store, session_id, ranks, first, width, n_buckets,
                        "MIN(s.step_ns * ?2 + s.step - k.lo), MAX(s.step_ns * ?2 + s.step - k.lo)", (pack,))
    out = []
    for rank, b, lo, hi in rows:
        if lo is None:
            continue
        start = first + b * width
        points = []
        for packed in (lo, hi):
            if isinstance(packed, int):
                points.append((start + packed % pack, packed // pack))
            else:  # past 2^63: no step packed, the bucket's first step
                points.append((start, int(packed / pack)))
        out.append({"rank": rank, "b": b, "lo": points[0], "hi": points[1]})
    return out


PHASE_RANKS = 8  # ranks the phase shares are summed over (spread across the run's ranks)


def _phase_sums(store: HistoryStore) -> str:
    """``SUM(s.<column>)`` of each phase column, ``0`` for a column a history written before it
    was declared does not have (``recompute_ns``; such a store is opened read-only, not migrated)."""
    try:
        present = {row["name"] for row in store.query("PRAGMA table_info(steps)")}
    except StoreError:
        present = set(STEP_COLUMNS)
    return ", ".join(f"SUM(s.{c})" if c in present or not present else "0" for c in STEP_COLUMNS)


def _phase_buckets(store: HistoryStore, session_id: str, ranks: list[int], first: int, width: int,
                   n_buckets: int) -> dict[int, list[float]]:
    """bucket -> [each phase column's sum..., the step times' sum] over ``ranks``."""
    out: dict[int, list[float]] = {}
    own = getattr(store, "phase_bucket_sums", None)
    rows = (own(session_id, ranks, first, width, n_buckets) if own is not None else
            _bucket_rows(store, session_id, ranks, first, width, n_buckets, f"SUM(s.step_ns), {_phase_sums(store)}"))
    for _rank, b, total, *sums in rows:
        if total is None:
            continue
        into = out.setdefault(b, [0.0] * (len(sums) + 1))
        for i, value in enumerate(sums):
            into[i] += value or 0
        into[-1] += total
    return out


def _spread(ranks: list[int], count: int) -> list[int]:
    """At most ``count`` of ``ranks``, evenly spread (the first and the last kept)."""
    if len(ranks) <= count:
        return list(ranks)
    return sorted({ranks[round(i * (len(ranks) - 1) / (count - 1))] for i in range(count)})


def _in_parallel(store: HistoryStore, jobs: list[Any]) -> list[Any]:
    """``job(store)`` for each job, on threads with a read-only connection each when the store is
    a SQLite file (SQLite runs each query without the GIL, so two cores scan two ranges at once),
    else one after the other on ``store``."""
    from ..store.sqlite import SqliteStore

    path = store.path if isinstance(store, SqliteStore) else None
    if path is None or len(jobs) < 2:
        return [job(store) for job in jobs]
    from concurrent.futures import ThreadPoolExecutor

    def run(job: Any) -> Any:
        with SqliteStore(path, read_only=True) as own:
            return job(own)

    with ThreadPoolExecutor(max_workers=min(len(jobs), 4), thread_name_prefix="stepwatch-views") as pool:
        return list(pool.map(run, jobs))


def _step_charts(store: HistoryStore, session_id: str, extents: dict[int, tuple[int, int]],
                 extra: list[Any] = ()) -> tuple[dict[str, Any], list[Any]]:
    """Step time per rank, the stacked phase shares and the rank x step heatmap; ``extra`` jobs
    (``job(store)``) run beside the step scans, their results returned in order."""
    if not extents:
        empty = {"step_time": {"width": 1, "series": []}, "phases": {"x": [], "shares": {}, "width": 1},
                 "heatmap": {"x": [], "ranks": [], "z": [], "width": 1}}
        return empty, _in_parallel(store, list(extra))
    first = min(a for a, _ in extents.values())
    last = max(b for _, b in extents.values())
    ranks = sorted(extents)
    per_series = points_budget(len(ranks))
    width = bucket_width(first, last, min(per_series, max(1, HEATMAP_CELLS // len(ranks))))
    n_buckets = (last - first) // width + 1
    group = max(1, -(-n_buckets // PHASE_BUCKETS))  # phase columns: buckets of buckets
    half = (len(ranks) + 1) // 2
    jobs = [lambda st, part=part: _step_buckets(st, session_id, part, first, width, n_buckets)
            for part in (ranks[:half], ranks[half:]) if part]
    jobs.append(lambda st: _phase_buckets(st, session_id, _spread(ranks, PHASE_RANKS), first, width * group,
                                          -(-n_buckets // group)))
    results = _in_parallel(store, [*jobs, *extra])
    buckets = [b for part in results[:len(jobs) - 1] for b in part]
    phase_sums: dict[int, list[float]] = results[len(jobs) - 1]
    series: dict[int, tuple[list[int], list[float]]] = {rank: ([], []) for rank in ranks}
    slowest: dict[tuple[int, int], float] = {}
    for bucket in buckets:
        xs, ys = series.setdefault(bucket["rank"], ([], []))
        for step, ns in sorted({bucket["lo"], bucket["hi"]}):
            xs.append(step)
            ys.append(_r(ns / 1e6))
        slowest[(bucket["rank"], bucket["b"])] = _r(bucket["hi"][1] / 1e6)
    phase_x = sorted(phase_sums)
    shares: dict[str, list[float | None]] = {name: [] for name in SHARES}
    for key in phase_x:
        sums = phase_sums[key]
        total = sums[-1]
        values = list(sums[:-1])
        # the residual still holds the step's own fetch: its share leaves that out (as the summary's)
        values[_WAIT] = max(0.0, values[_WAIT] - sum(values[i] for i in _OUTSIDE_AT))
        for name, value in zip(SHARES, values):
            shares[name].append(_r(value / total, 4) if total > 0 else None)
    charts = {
        "step_time": {"width": width, "series": [{"rank": rank, "x": series[rank][0], "y": series[rank][1]}
                                                 for rank in sorted(series)]},
        "phases": {"x": [first + key * group * width for key in phase_x], "shares": shares, "width": group * width,
                   "ranks": _spread(ranks, PHASE_RANKS)},
        "heatmap": {"x": [first + b * width for b in range(n_buckets)], "ranks": ranks, "width": width,
                    "z": [[slowest.get((rank, b)) for b in range(n_buckets)] for rank in ranks]},
    }
    return charts, results[len(jobs):]


_MEMORY_VALUE = "MAX(COALESCE(allocated, 0), COALESCE(used, 0))"


def _memory(store: HistoryStore, session_id: str, t0: int | None, since_ns: int | None = None,
            budget_total: int = CHART_POINTS) -> tuple[list[dict[str, Any]], int | None]:
    """Memory per rank (and device) over time, in MiB against seconds from ``t0``: the larger of
    allocated and used bytes (a CPU rank's RSS, a GPU's allocator). Few samples come as they are;
    more are cut down in SQL, per series and bucket of time, to the lowest and highest sample
    (SQLite gives a bare column the row of the one MIN or MAX of its query: two scans, no row
    fetched that is not drawn)."""
    after = "AND timestamp_ns > ?2" if since_ns is not None else ""
    params: tuple[Any, ...] = (session_id, since_ns) if since_ns is not None else (session_id,)
    where = f"session_id = ?1 AND event_type = 'sample' {after}"
    own = getattr(store, "memory_bucket_rows", None)
    value = _MEMORY_VALUE
    if own is not None:  # a server store: its own scalar maximum and bucket reads
        from ..store import clickhouse_views

        value = clickhouse_views.MEMORY_VALUE
    extents = _tuples(store, f"SELECT rank, device_id, collector, MIN(timestamp_ns), MAX(timestamp_ns), COUNT(*) "
                             f"FROM telemetry WHERE {where} GROUP BY rank, device_id, collector", params)
    if not extents:
        return [], since_ns
    buckets = points_budget(len(extents), budget_total)
    first = min(e[3] for e in extents)
    last = max(e[4] for e in extents)
    grouped: dict[tuple[int, int, str], list[tuple[int, float]]] = {}
    if max(e[5] for e in extents) <= 2 * buckets:
        rows = _tuples(store, f"SELECT rank, device_id, collector, timestamp_ns, {value} FROM telemetry "
                              f"WHERE {where} ORDER BY rank, device_id, collector, timestamp_ns", params)
        for rank, device, collector, ts, value in rows:
            grouped.setdefault((rank, -1 if device is None else device, collector), []).append((ts, value))
    else:
        width = bucket_width(first, last, buckets)
        n = len(params)
        for pick in ("MIN", "MAX"):
            rows = own(session_id, since_ns, first, width, pick) if own is not None else _tuples(
                store, f"SELECT rank, device_id, collector, (timestamp_ns - ?{n + 1}) / ?{n + 2} AS b, "
                       f"timestamp_ns, {pick}({_MEMORY_VALUE}) FROM telemetry WHERE {where} "
                       f"GROUP BY rank, device_id, collector, b", (*params, first, width))
            for rank, device, collector, _b, ts, value in rows:
                grouped.setdefault((rank, -1 if device is None else device, collector), []).append((ts, value))
    base = t0 if t0 is not None else first
    out = []
    for (rank, device, collector), points in sorted(grouped.items()):
        points = sorted(set(points))
        out.append({"rank": rank, "device": device, "collector": collector,
                    "t": [_r((x - base) / 1e9) for x, _ in points], "y": [_r((y or 0) / MIB, 2) for _, y in points]})
    return out, last if since_ns is None else max(last, since_ns)


def _markers(store: HistoryStore, session_id: str, alerts: list[dict[str, Any]], verdicts: list[dict[str, Any]],
             epochs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Points in time the memory chart marks: OOMs and failures (telemetry events), watchdog
    alerts, verdict changes and epoch starts, as ``{ts_ns, kind, label}``."""
    out: list[dict[str, Any]] = []
    for row in store.query("SELECT rank, timestamp_ns, event_type, context, metadata FROM telemetry "
                           "WHERE session_id = ? AND event_type IN ('error', 'critical', 'warning') "
                           "ORDER BY timestamp_ns LIMIT 200", (session_id,)):
        text = row["metadata"] or ""
        kind = "oom" if ("oom" in text.lower()) else "failure" if row["event_type"] == "error" else "alert"
        out.append({"ts_ns": row["timestamp_ns"], "kind": kind,
                    "label": f"rank {row['rank']} {row['event_type']}: {(row['context'] or '')[:80]}"})
    for alert in alerts[:200]:
        ts = alert.get("ts")
        if isinstance(ts, (int, float)):
            out.append({"ts_ns": int(ts * 1e9), "kind": "alert", "label": f"{alert.get('kind')}: {alert.get('message')}"})
    for verdict in verdicts[:200]:
        out.append({"ts_ns": verdict["ts_ns"], "kind": "verdict", "label": f"verdict {verdict['name']}"})
    for epoch in (epochs or {}).get("epochs") or []:
        if epoch.get("rank") == 0 and isinstance(epoch.get("start_ns"), int):
            out.append({"ts_ns": epoch["start_ns"], "kind": "phase", "label": f"epoch {epoch.get('index')}"})
    return sorted(out, key=lambda m: m["ts_ns"])


def _marks(store: HistoryStore, session_id: str, t0: int | None) -> list[dict[str, Any]]:
    """Numeric marks (the loss, inferred or logged, and any other) per name and rank over time."""
    rows = _tuples(store, "SELECT name, rank, ts_ns, value_num, attrs FROM marks WHERE session_id = ? "
                              "AND value_num IS NOT NULL AND kind = 'point' ORDER BY name, rank, ts_ns", (session_id,))
    grouped: dict[tuple[str, int], tuple[list[int], list[float], bool]] = {}
    for name, rank, ts, value, attrs in rows:
        if ts is None or value != value or value in (float("inf"), float("-inf")):
            continue
        key = (name, rank)
        if key not in grouped:
            grouped[key] = ([], [], '"inferred":true' in (attrs or "").replace(" ", ""))
        grouped[key][0].append(ts)
        grouped[key][1].append(value)
    base = t0 or min((g[0][0] for g in grouped.values()), default=0)
    buckets = points_budget(len(grouped))
    out = []
    for (name, rank), (xs, ys, inferred) in sorted(grouped.items()):
        dx, dy = minmax(xs, ys, buckets)
        out.append({"name": name, "rank": rank, "inferred": inferred, "t": [_r((x - base) / 1e9) for x in dx],
                    "y": [float(f"{y:.6g}") for y in dy]})
    return out


def _verdict_changes(store: HistoryStore, session_id: str, offset: int = 0) -> list[dict[str, Any]]:
    """The live verdict's stored changes ([] from a history written before the verdicts table)."""
    from ..store.sqlite import SqliteStore

    try:
        if isinstance(store, SqliteStore):
            rows = store.query("SELECT ts_ns, step, window_steps, name, severity, ranks, message FROM verdicts "
                               "WHERE session_id = ? ORDER BY ts_ns LIMIT -1 OFFSET ?", (session_id, offset))
        else:  # SQLite's LIMIT -1 (no limit) is its own: the few changes read whole, the seen ones skipped
            rows = store.query("SELECT ts_ns, step, window_steps, name, severity, ranks, message FROM verdicts "
                               "WHERE session_id = ? ORDER BY ts_ns", (session_id,))[offset:]
    except StoreError:
        return []
    return [{**r, "ranks": json.loads(r["ranks"] or "[]")} for r in rows]


def _stack_files(run_dir: Path | None) -> list[dict[str, Any]]:
    """The run's stack dumps (``stacks/*.txt``), newest last."""
    if run_dir is None or not (run_dir / "stacks").is_dir():
        return []
    files = sorted((p for p in (run_dir / "stacks").glob("*.txt") if p.is_file()), key=lambda p: p.stat().st_mtime)
    return [{"name": p.name, "bytes": p.stat().st_size} for p in files[-50:]]


def _alerts(store: HistoryStore, session_id: str, run_dir: Path | None) -> list[dict[str, Any]]:
    from ..analysis.summary import session_alerts

    return session_alerts(store, session_id, run_dir)


def run_page(store: HistoryStore, session_id: str, run_dir: Path | None) -> dict[str, Any]:
    """Everything the run page draws (module docstring), JSON-ready."""
    header = session_header(store, session_id, run_dir)
    extents = last_steps(store, session_id)
    problems: list[str] = []
    step_rows = sum(b - a + 1 for a, b in extents.values())
    if not extents:
        problems.append("no steps recorded in this session (a run captured without step spans, or one that "
                        "ended before its first step): the step charts are empty")
    summary = final_summary_of(run_dir, session_id)
    t0 = header["started_at_ns"]
    from ..analysis.summary import session_epochs

    # the memory, the diagnosis and the marks are read beside the step scans (``_in_parallel``)
    charts, (memory_read, diagnosis, marks, epochs) = _step_charts(store, session_id, extents, [
        lambda st: _memory(st, session_id, t0),
        lambda st: _diagnosis(st, session_id, run_dir, header["status"], step_rows),
        lambda st: _marks(st, session_id, t0),
        lambda st: summary.get("epochs") if summary is not None else session_epochs(st, session_id),
    ])
    memory, memory_last = memory_read
    alerts = _alerts(store, session_id, run_dir)
    verdicts = _verdict_changes(store, session_id)
    if not memory:
        problems.append("no memory samples in this session")
    slowest = _slowest_step(charts)
    return {
        "session": {**header, "ranks": sorted(extents), "steps": max((b + 1 for _, b in extents.values()), default=0),
                    "step_rows": step_rows},
        "t0_ns": t0,
        "diagnosis": diagnosis,
        **charts,
        "memory": {"unit": "MiB", "series": memory,
                   "markers": [{**m, "t": _r((m["ts_ns"] - (t0 or 0)) / 1e9)}
                               for m in _markers(store, session_id, alerts, verdicts, epochs)]},
        "marks": marks,
        "alerts": alerts,
        "stacks": _stack_files(run_dir),
        "verdicts": verdicts,
        "epochs": epochs,
        "slowest_step": slowest,
        "summary": _summary_numbers(summary),
        "summary_text": _summary_text(summary),
        "cursor": {"steps": {str(rank): b for rank, (_, b) in extents.items()}, "memory_ns": memory_last,
                   "alerts": len(alerts), "verdicts": len(verdicts)},
        "problems": problems,
    }


def _slowest_step(charts: dict[str, Any]) -> int | None:
    """The step with the highest step time drawn (the one whose spans the page shows first)."""
    best: tuple[float, int] | None = None
    for series in charts["step_time"]["series"]:
        for x, y in zip(series["x"], series["y"]):
            if best is None or y > best[0]:
                best = (y, x)
    return best[1] if best is not None else None


def _summary_text(summary: dict[str, Any] | None) -> str | None:
    """The final summary as ``stepwatch summary`` prints it (None when the run has none yet)."""
    if summary is None:
        return None
    from ..analysis.summary import render_summary_text

    try:
        return render_summary_text(summary)
    except (KeyError, TypeError, ValueError, AttributeError):  # a summary of another shape: the charts still come
        return None


def _summary_numbers(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    if summary is None:
        return None
    overall = summary.get("overall") or {}
    return {"steps": overall.get("steps"), "step_ms": overall.get("step_ms"),
            "throughput_steps_per_s": overall.get("throughput_steps_per_s"), "phase_share": overall.get("phase_share"),
            "memory_peaks": summary.get("memory_peaks"), "exit_code": summary.get("exit_code")}


def run_updates(store: HistoryStore, session_id: str, run_dir: Path | None, cursor: dict[str, Any]) -> dict[str, Any]:
    """What came after ``cursor`` (``run_page``'s ``cursor``): each rank's new steps, the new
    memory samples, alerts and verdict changes, and the status. ``reload`` is true when more
    steps came than one poll hands over (the page then fetches its downsampled data again)."""
    known = {int(k): int(v) for k, v in (cursor.get("steps") or {}).items()}
    extents = last_steps(store, session_id)
    status_rows = store.query("SELECT status FROM sessions WHERE session_id = ?", (session_id,))
    status = status_rows[0]["status"] if status_rows else None
    new_rows = sum(max(0, last - known.get(rank, first - 1)) for rank, (first, last) in extents.items())
    out: dict[str, Any] = {"status": status, "reload": new_rows > UPDATE_LIMIT, "steps": [], "memory": [],
                           "alerts": [], "verdicts": []}
    if out["reload"]:
        return out
    for rank, (first, last) in sorted(extents.items()):
        after = known.get(rank, first - 1)
        if last <= after:
            continue
        rows = _tuples(store, "SELECT step, step_ns FROM steps WHERE session_id = ? AND rank = ? AND step > ? "
                                  "AND step_ns IS NOT NULL ORDER BY step", (session_id, rank, after))
        out["steps"].append({"rank": rank, "x": [r[0] for r in rows], "y": [_r(r[1] / 1e6) for r in rows]})
    since = cursor.get("memory_ns")
    header = store.query("SELECT started_at_ns FROM sessions WHERE session_id = ?", (session_id,))
    t0 = header[0]["started_at_ns"] if header else None
    memory, last_ns = _memory(store, session_id, t0, since_ns=int(since) if since is not None else None)
    out["memory"] = memory
    alerts = _alerts(store, session_id, run_dir)
    out["alerts"] = alerts[int(cursor.get("alerts") or 0):]
    out["verdicts"] = _verdict_changes(store, session_id, int(cursor.get("verdicts") or 0))
    out["cursor"] = {"steps": {str(rank): b for rank, (_, b) in extents.items()}, "memory_ns": last_ns,
                     "alerts": len(alerts), "verdicts": int(cursor.get("verdicts") or 0) + len(out["verdicts"])}
    return out


def step_spans(store: HistoryStore, session_id: str, step: int) -> dict[str, Any]:
    """The spans of step ``step`` on every rank (its phases and anything else recorded inside its
    interval), in ms from the earliest rank's start of it: the timeline across ranks."""
    bounds = store.query("SELECT rank, start_ns, end_ns FROM steps WHERE session_id = ? AND step = ? ORDER BY rank",
                         (session_id, step))
    if not bounds:
        return {"step": step, "t0_ns": None, "spans": []}
    t0 = min(b["start_ns"] for b in bounds)
    spans = []
    for bound in bounds:
        rows = store.query("SELECT name, start_ns, end_ns FROM spans WHERE session_id = ? AND rank = ? "
                           "AND start_ns >= ? AND end_ns <= ? AND name NOT IN ('epoch', 'stepwatch.session') "
                           "ORDER BY start_ns LIMIT 500", (session_id, bound["rank"], bound["start_ns"], bound["end_ns"]))
        if not rows:  # no span recorded (a step row imported without its spans): the step itself
            rows = [{"name": "step", "start_ns": bound["start_ns"], "end_ns": bound["end_ns"]}]
        for row in rows:
            spans.append({"rank": bound["rank"], "name": row["name"], "start_ms": _r((row["start_ns"] - t0) / 1e6),
                          "ms": _r((row["end_ns"] - row["start_ns"]) / 1e6)})
    return {"step": step, "t0_ns": t0, "spans": spans}
