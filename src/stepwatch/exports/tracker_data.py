"""What the experiment trackers (TensorBoard, MLflow, W&B) get from a session's history: one
point per rank per step with the same scalars for all three, and the run's params.

Pure over the store (no tracker package is imported here), any store (a history.sqlite, a
ClickHouse URL: only SQL both speak, and the one join SQLite does in SQL made of lookups
elsewhere): ``tracker_points`` reads the steps, the memory samples and the numeric marks of one session, ``tracker_params`` the command, world
size, versions and the program's loader and optimizer settings. The writers
(``exports.tensorboard``, ``exports.mlflow_export``, ``exports.wandb_export``) turn them into each
tool's records. docs/export.md lists the names.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..analysis.program_settings import load_program_settings, session_versions
from ..phases import SHARES
from ..store.base import HistoryStore

__all__ = ["RATE_WINDOW", "StepPoint", "points_by_rank", "summary_metrics", "tracker_params", "tracker_points"]

RATE_WINDOW = 10
"""``steps_per_s`` at a step: the steps finished over the last ``RATE_WINDOW`` step ends (fewer at
the start; the first step's own time for the first), so one slow step shows without the curve
being as noisy as 1 / step time."""

_CPU = -1  # device_id of host memory: the cpu collector's allocated bytes are the process's RSS


@dataclass(slots=True)
class StepPoint:
    """One rank's step: its number, when it ended (wall clock, ns) and its scalars by name."""

    rank: int
    step: int
    end_ns: int
    values: dict[str, float] = field(default_factory=dict)


def _step_scalars(row: tuple[Any, ...], columns: tuple[str, ...]) -> dict[str, float]:
    step_ns = row[3]
    values: dict[str, float] = {}
    if not isinstance(step_ns, int) or step_ns <= 0:
        return values
    values["step_time_ms"] = step_ns / 1e6
    for share, ns in zip(SHARES, row[4:4 + len(columns)], strict=True):
        if isinstance(ns, int):
            values[f"phase_share/{share}"] = ns / step_ns
    return values


def tracker_points(store: HistoryStore, session_id: str) -> list[StepPoint]:
    """Every recorded step of the session, by rank then step, with ``step_time_ms``,
    ``phase_share/<phase>`` (of the step's time), ``steps_per_s``, ``memory/...`` (the last
    sample at or before the step's end) and ``mark/<name>`` (the last numeric point mark recorded
    up to the step's end and after the previous step's)."""
    columns = tuple(f"{share}_ns" for share in SHARES)
    points: list[StepPoint] = []
    for row in store.iterate(
            f"SELECT rank, step, end_ns, step_ns, {', '.join(columns)} FROM steps WHERE session_id = ? "
            "ORDER BY rank, step", (session_id,)):
        if not isinstance(row[2], int):
            continue
        points.append(StepPoint(int(row[0]), int(row[1]), int(row[2]), _step_scalars(row, columns)))
    by_rank = points_by_rank(points)
    for series in by_rank.values():
        _rates(series)
    _memory(store, session_id, by_rank)
    _marks(store, session_id, by_rank)
    return points


def points_by_rank(points: list[StepPoint]) -> dict[int, list[StepPoint]]:
    """The points of each rank, in step order (as ``tracker_points`` returns them)."""
    out: dict[int, list[StepPoint]] = {}
    for point in points:
        out.setdefault(point.rank, []).append(point)
    return out


def _rates(series: list[StepPoint]) -> None:
    for i, point in enumerate(series):
        back = min(i, RATE_WINDOW)
        if back:
            elapsed = point.end_ns - series[i - back].end_ns
            if elapsed > 0:
                point.values["steps_per_s"] = back / (elapsed / 1e9)
        elif "step_time_ms" in point.values:
            point.values["steps_per_s"] = 1000.0 / point.values["step_time_ms"]


def _memory(store: HistoryStore, session_id: str, by_rank: Mapping[int, list[StepPoint]]) -> None:
    """The last sample at or before each step's end; a step with no sample before it has none.
    Host memory is ``memory/rss_bytes``; a device's ``memory/device_N/allocated_bytes`` and
    ``reserved_bytes`` (the collector that sampled it first: one series a device, however many collectors read it)."""
    for rank, series in by_rank.items():
        ends = [p.end_ns for p in series]
        owner: dict[int, str] = {}
        for ts, collector, device, allocated, reserved in store.iterate(
                "SELECT timestamp_ns, collector, device_id, allocated, reserved FROM telemetry "
                "WHERE session_id = ? AND rank = ? AND event_type = 'sample' ORDER BY timestamp_ns",
                (session_id, rank)):
            if not isinstance(ts, int) or owner.setdefault(device, collector) != collector:
                continue
            i = bisect.bisect_left(ends, ts)  # after the previous step's end, at or before this one's
            if i >= len(series):
                continue  # after the last step: no step holds it
            if device == _CPU:
                if isinstance(allocated, int):
                    series[i].values["memory/rss_bytes"] = float(allocated)
                continue
            for name, value in (("allocated_bytes", allocated), ("reserved_bytes", reserved)):
                if isinstance(value, int):
                    series[i].values[f"memory/device_{device}/{name}"] = float(value)
        # a step with no sample of its own has the last one before it
        last: dict[str, float] = {}
        for point in series:
            for key in [k for k in point.values if k.startswith("memory/")]:
                last[key] = point.values[key]
            for key, value in last.items():
                point.values.setdefault(key, value)


_MARKS = (
    "SELECT m.ts_ns, m.name, m.value_num, m.attrs, s.name, s.idx, p.name, p.idx, g.name, g.idx FROM marks m "
    "LEFT JOIN spans s ON s.session_id = m.session_id AND s.rank = m.rank AND s.span_id = m.span_id "
    "LEFT JOIN spans p ON p.session_id = s.session_id AND p.rank = s.rank AND p.span_id = s.parent_id "
    "LEFT JOIN spans g ON g.session_id = p.session_id AND g.rank = p.rank AND g.span_id = p.parent_id "
    "WHERE m.session_id = ? AND m.rank = ? AND m.kind = 'point' AND m.value_num IS NOT NULL ORDER BY m.ts_ns")


def _marks(store: HistoryStore, session_id: str, by_rank: Mapping[int, list[StepPoint]]) -> None:
    """A numeric point mark goes to the step it was recorded in: the step span it names (its own
    span, or that span's parent or grandparent: a phase, a scope), else, by time, the first step
    that ended at or after it. The last one of a name in a step wins, and one the program
    recorded wins over one stepwatch inferred (the loss from the backward's root)."""
    for rank, series in by_rank.items():
        at = {p.step: p for p in series}
        ends = [p.end_ns for p in series]
        own: set[tuple[int, str]] = set()  # (step, name) the program marked itself
        for ts, name, value, attrs, *chain in _mark_rows(store, session_id, rank):
            if not isinstance(name, str) or not name or not isinstance(value, (int, float)) or not isinstance(ts, int):
                continue
            point = next((at.get(idx) for kind, idx in zip(chain[::2], chain[1::2], strict=True)
                          if kind == "step" and idx in at), None)
            if point is None:
                point = series[min(bisect.bisect_left(ends, ts), len(series) - 1)]
            inferred = isinstance(attrs, str) and '"inferred":true' in attrs.replace(" ", "")
            key = (point.step, name)
            if inferred and key in own:
                continue
            if not inferred:
                own.add(key)
            point.values[f"mark/{name}"] = float(value)


_SPAN_CHUNK = 1_000  # span ids one lookup names


def _mark_rows(store: HistoryStore, session_id: str, rank: int) -> Iterable[tuple[Any, ...]]:
    """``_MARKS``'s rows: on SQLite that query (three LEFT JOINs down ``spans_unique``), on a store
    without joins on several keys (ClickHouse 18.16: one JOIN a SELECT, on USING columns) the
    marks, then their spans, parents and grandparents looked up by id, a level at a time."""
    from ..store.sqlite import SqliteStore

    if isinstance(store, SqliteStore):
        return store.iterate(_MARKS, (session_id, rank))
    marks = store.query_tuples("SELECT ts_ns, name, value_num, attrs, span_id FROM marks WHERE session_id = ? "
                               "AND rank = ? AND kind = 'point' AND value_num IS NOT NULL ORDER BY ts_ns",
                               (session_id, rank))
    spans: dict[str, tuple[Any, Any, Any]] = {}  # span id -> (name, idx, parent id)
    wanted = {row[4] for row in marks if row[4] is not None}
    for _level in range(3):
        wanted -= spans.keys()
        ids = sorted(wanted)
        for at in range(0, len(ids), _SPAN_CHUNK):
            chunk = ids[at:at + _SPAN_CHUNK]
            for span_id, name, idx, parent in store.query_tuples(
                    f"SELECT span_id, name, idx, parent_id FROM spans WHERE session_id = ? AND rank = ? "
                    f"AND span_id IN ({', '.join('?' for _ in chunk)})", (session_id, rank, *chunk)):
                spans[span_id] = (name, idx, parent)
        wanted = {spans[i][2] for i in ids if i in spans and spans[i][2] is not None}
    out = []
    for ts, name, value, attrs, span_id in marks:
        chain: list[Any] = []
        for _level in range(3):
            found = spans.get(span_id) if span_id is not None else None
            chain += [found[0], found[1]] if found is not None else [None, None]
            span_id = found[2] if found is not None else None
        out.append((ts, name, value, attrs, *chain))
    return out


def _scalar(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def tracker_params(store: HistoryStore, session_id: str, run: Mapping[str, Any]) -> dict[str, str]:
    """The run's params as text: ``session_id``, ``command``, ``world_size``, ``status``,
    ``outcome``, ``hosts``, ``version/<name>`` (torch, cuda, python, stepwatch, platform as the
    lowest training rank recorded them, ``stepwatch.versions``; run.json's for the rest: a
    launcher never imports torch), and the program's settings as the
    capture recorded them on the lowest rank: ``dataloader/<attr>`` and ``optimizer/<attr>``
    (``dataloader1/...`` for a second loader)."""
    session = next((s for s in store.sessions() if s.get("session_id") == session_id), {})
    command = run.get("command_line") or session.get("command_line")
    if isinstance(command, str):
        try:
            command = json.loads(command)
        except ValueError:
            pass
    params: dict[str, str | None] = {
        "session_id": session_id,
        "command": " ".join(map(str, command)) if isinstance(command, list) else _scalar(command),
        "world_size": _scalar(run.get("world_size") or session.get("world_size")),
        "status": _scalar(run.get("status") or session.get("status")),
        "outcome": _scalar(run.get("outcome")),
        "hosts": ",".join(h for h in run.get("hosts") or [] if isinstance(h, str)) or _scalar(session.get("host")),
    }
    versions = dict(run.get("versions") or {}) if isinstance(run.get("versions"), Mapping) else {}
    versions.update(session_versions(store, session_id))  # the training processes' own, where recorded
    for name, version in sorted(versions.items()):
        params[f"version/{name}"] = _scalar(version)
    settings = load_program_settings(store, session_id)
    if settings:
        kinds = settings[min(settings)]
        for kind, prefix in (("dataloaders", "dataloader"), ("optimizers", "optimizer")):
            for n, record in enumerate(kinds.get(kind, [])):
                for key, value in sorted(record.items()):
                    if key != "index":
                        params[f"{prefix}{n or ''}/{key}"] = _scalar(value)
    return {k: v for k, v in params.items() if v not in (None, "")}


def summary_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The summary's headline figures as final scalars: ``summary/step_ms_<stat>``,
    ``summary/phase_share/<phase>``, ``summary/steps_per_s``, ``summary/steps``."""
    overall = summary.get("overall") or {}
    out: dict[str, float] = {}
    for stat, value in (overall.get("step_ms") or {}).items():
        if isinstance(value, (int, float)):
            out[f"summary/step_ms_{stat}"] = float(value)
    for share, value in (overall.get("phase_share") or {}).items():
        if isinstance(value, (int, float)):
            out[f"summary/phase_share/{share}"] = float(value)
    for key, name in (("throughput_steps_per_s", "steps_per_s"), ("steps", "steps")):
        if isinstance(overall.get(key), (int, float)):
            out[f"summary/{name}"] = float(overall[key])
    return out
