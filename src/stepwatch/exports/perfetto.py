"""A session of the history as a Perfetto / Chrome trace (the Trace Event Format's JSON object,
``{"traceEvents": [...]}``), streamed: each query's rows are read through one cursor a batch at
a time and each event is written as it is built, so a run of a million spans exports in the
memory of one batch (bench/bench_export.py). docs/export.md describes the tracks.

Tracks: a process per rank (``rank N @ host``, sorted by rank), a thread track per thread that
recorded spans (the one with the steps first, named ``training loop``), a ``GPU (measured)``
track with the GPU time of the spans that have it, counter tracks for each device's memory and
the process's RSS, and instants for marks, telemetry markers (start, stop, collector health,
errors and OOMs), alerts and verdict changes.

Clocks: every time in the history is the wall clock (``time.time_ns``) of the host that took
it; ranks on one host share that clock, ranks on other hosts are as aligned as their clocks
(NTP/PTP), since no rank records an offset to another. The trace subtracts one origin from
every time of every rank, the earliest time it exports, so ranks stay aligned with each other
exactly as their clocks were; ``otherData.origin_unix_ns`` gives the origin back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from ..errors import StoreError
from ..phases import SPAN_NAMES
from .selection import StepRange
from .trace_events import Lanes, complete, counter, instant, process_metadata, thread_metadata

__all__ = ["ExportStats", "TraceSelection", "iter_trace_events", "span_category", "span_title", "write_trace", "write_trace_file"]

_SESSION_SPAN = "stepwatch.session"
_STEP_SPANS = frozenset({"step", "eval_step"})
_PHASE_SPANS = frozenset(SPAN_NAMES)
_CPU = -1  # device_id of host memory (the cpu collector's allocated bytes are the RSS)
_GLOBAL_PID = 0  # instants of scope g carry a pid; the ranks' processes are rank + 1
_GPU_TID = 1 << 20  # the GPU track's tid: above any thread track's (numbered from 1)
_OOM_KEYS = ("oom_reason", "oom_dump_path")
_decode = msgspec.json.Decoder().decode


def span_category(name: str) -> str:
    """The ``cat`` of a span's event: session, epoch, step, phase or scope (a user's)."""
    if name == _SESSION_SPAN:
        return "session"
    if name == "epoch":
        return "epoch"
    if name in _STEP_SPANS:
        return "step"
    if name in _PHASE_SPANS:
        return "phase"
    return "scope"


def span_title(name: str, index: int | None) -> str:
    """``step 12``, ``epoch 2``: a span with an index shows it, as its track's label."""
    return name if index is None else f"{name} {index}"


@dataclass(frozen=True)
class TraceSelection:
    """What to export: one session, some steps (None: all), some ranks (None: all)."""

    session_id: str
    steps: StepRange | None = None
    ranks: frozenset[int] | None = None


@dataclass
class ExportStats:
    """What one export wrote, by phase of event, and over which ranks and times."""

    events: dict[str, int] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)
    origin_ns: int = 0
    overlap_tracks: int = 0  # thread tracks opened for spans that overlap without nesting

    def count(self, event: dict[str, Any]) -> None:
        phase = event["ph"]
        self.events[phase] = self.events.get(phase, 0) + 1


@dataclass
class _Rank:
    rank: int
    host: str
    window: tuple[int, int] | None  # [first step's start, last step's end] with --steps
    threads: list[tuple[Any, int, int]]  # (thread id, spans, steps), training loop first


def _args(attrs_text: Any) -> dict[str, Any]:
    if not attrs_text or attrs_text == "{}":
        return {}
    try:
        value = _decode(attrs_text)
    except (msgspec.DecodeError, TypeError):
        return {"attrs": str(attrs_text)}
    return value if isinstance(value, dict) else {"attrs": value}


def _ranks(text: Any) -> list[int]:
    """The ranks of an alert or verdict row (a JSON list; anything else names none)."""
    try:
        value = _decode(text) if text else []
    except (msgspec.DecodeError, TypeError):
        return []
    return [x for x in value if type(x) is int] if isinstance(value, list) else []


# a span in a --steps window: one that overlaps it (not one that only touches an end: the step
# before A ends where step A starts), or one of no length inside it
_SPAN_IN_WINDOW = " AND ((end_ns > ? AND start_ns < ?) OR (end_ns <= start_ns AND start_ns >= ? AND start_ns <= ?))"


def _span_window(window: tuple[int, int]) -> tuple[int, ...]:
    return (window[0], window[1], window[0], window[1])


def _where_window(column: str, window: tuple[int, int] | None) -> tuple[str, tuple[int, ...]]:
    if window is None:
        return "", ()
    return f" AND {column} >= ? AND {column} <= ?", window


def _plan(store: Any, selection: TraceSelection, hosts: Iterable[str]) -> list[_Rank]:
    """The ranks to export, their hosts, threads and (with --steps) time windows: a few
    aggregate queries, each one pass over an index or a table, nothing held per row."""
    sid = selection.session_id
    threads: dict[int, list[tuple[Any, int, int]]] = {}
    for rank, thread, spans, steps in store.iterate(
            "SELECT rank, thread_id, COUNT(*), SUM(name = 'step') FROM spans WHERE session_id = ? "
            "GROUP BY rank, thread_id ORDER BY rank, SUM(name = 'step') DESC, COUNT(*) DESC", (sid,)):
        threads.setdefault(rank, []).append((thread, spans, steps or 0))
    host_of = dict(store.iterate("SELECT rank, MAX(host) FROM telemetry WHERE session_id = ? GROUP BY rank", (sid,)))
    ranks = set(threads) | set(host_of)
    ranks |= {r for (r,) in store.iterate("SELECT DISTINCT rank FROM marks WHERE session_id = ?", (sid,))}
    ranks = {r for r in ranks if isinstance(r, int)}
    if selection.ranks is not None:
        missing = sorted(selection.ranks - ranks)
        if missing:
            raise StoreError(f"session {sid}: no rank {', '.join(map(str, missing))} recorded "
                             f"(its ranks: {', '.join(map(str, sorted(ranks))) or 'none'})")
        ranks &= selection.ranks
    windows: dict[int, tuple[int, int]] = {}
    if selection.steps is not None:
        low = selection.steps.start if selection.steps.start is not None else -(1 << 62)
        high = selection.steps.stop if selection.steps.stop is not None else 1 << 62
        for rank, first, last in store.iterate(
                "SELECT rank, MIN(start_ns), MAX(end_ns) FROM steps WHERE session_id = ? AND step >= ? AND step < ? "
                "GROUP BY rank", (sid, low, high)):
            if rank in ranks and first is not None and last is not None:
                windows[rank] = (first, last)
        if not windows:
            (first, last), = store.query_tuples("SELECT MIN(step), MAX(step) FROM steps WHERE session_id = ?", (sid,))
            held = f"steps {first} to {last} recorded" if first is not None else "no steps recorded"
            text = f"{'' if selection.steps.start is None else selection.steps.start}:" \
                   f"{'' if selection.steps.stop is None else selection.steps.stop}"
            raise StoreError(f"session {sid}: no step in {text} on the ranks exported ({held})")
        ranks &= set(windows)
    default_host = next(iter(hosts), None) or "?"
    return [_Rank(r, str(host_of.get(r) or default_host), windows.get(r), threads.get(r, [])) for r in sorted(ranks)]


def _origin(store: Any, sid: str, plan: list[_Rank]) -> int:
    """The earliest time exported: spans, samples, marks, markers, alerts and verdicts."""
    found: list[int] = []
    for r in plan:
        for table, start in (("spans", "start_ns"), ("telemetry", "timestamp_ns"), ("marks", "ts_ns")):
            if r.window is not None and table == "spans":
                sql, extra = f"SELECT MIN(start_ns) FROM spans WHERE session_id = ? AND rank = ?{_SPAN_IN_WINDOW}", \
                    _span_window(r.window)
            else:
                where, extra = _where_window(start, r.window)
                sql = f"SELECT MIN({start}) FROM {table} WHERE session_id = ? AND rank = ?{where}"
            (value,), = store.query_tuples(sql, (sid, r.rank, *extra))
            if isinstance(value, int):
                found.append(value)
    bounds = _global_window(plan)
    where, extra = _where_window("ts_ns", bounds)
    for table in ("alerts", "verdicts"):
        (value,), = store.query_tuples(f"SELECT MIN(ts_ns) FROM {table} WHERE session_id = ?{where}", (sid, *extra))
        if isinstance(value, int):
            found.append(value)
    return min(found) if found else 0


def _global_window(plan: list[_Rank]) -> tuple[int, int] | None:
    windows = [r.window for r in plan if r.window is not None]
    if not windows:
        return None
    return min(w[0] for w in windows), max(w[1] for w in windows)


def iter_trace_events(store: Any, selection: TraceSelection, hosts: Iterable[str] = (),
                      stats: ExportStats | None = None) -> Iterator[dict[str, Any]]:
    """Every event of the trace, rank by rank, as each row is read. ``hosts``: the run's hosts
    (run.json), for ranks whose telemetry names none. ``stats`` is filled as events go."""
    stats = stats if stats is not None else ExportStats()
    sid = selection.session_id
    plan = _plan(store, selection, hosts)
    origin = _origin(store, sid, plan)
    stats.origin_ns, stats.ranks = origin, [r.rank for r in plan]
    for r in plan:
        yield from _rank_events(store, sid, r, origin, stats)
    yield from _session_events(store, sid, plan, origin)


def _rank_events(store: Any, sid: str, r: _Rank, origin: int, stats: ExportStats) -> Iterator[dict[str, Any]]:
    pid = r.rank + 1
    yield from process_metadata(pid, f"rank {r.rank} @ {r.host}", r.rank)
    tids: dict[Any, int] = {}
    for n, (thread, _spans, steps) in enumerate(r.threads, start=1):
        tids[thread] = n
        name = f"thread {thread if thread is not None else '?'}"
        yield from thread_metadata(pid, n, f"training loop ({name})" if n == 1 and steps else name, n)
    next_tid = len(r.threads) + 1
    where, window = ("", ()) if r.window is None else (_SPAN_IN_WINDOW, _span_window(r.window))
    # spans, thread by thread, each thread's by start (longest first): what Lanes needs
    lanes, lane_tids, current = Lanes(), [0], object()
    last_spanned = -1  # the last step with a span: a killed rank's unshipped steps come after it
    for span_id, parent_id, name, index, start, end, gpu, thread, os_pid, attrs in store.iterate(
            "SELECT span_id, parent_id, name, idx, start_ns, end_ns, gpu_ns, thread_id, pid, attrs FROM spans "
            f"WHERE session_id = ? AND rank = ?{where} ORDER BY thread_id, start_ns, end_ns DESC",
            (sid, r.rank, *window)):
        if not isinstance(start, int) or not isinstance(end, int):
            continue
        if thread != current:
            current, lanes = thread, Lanes()
            if thread not in tids:  # not in the plan's pass (a row written since): a track of its own
                tids[thread] = next_tid
                next_tid += 1
                yield from thread_metadata(pid, tids[thread], f"thread {thread}", tids[thread])
            lane_tids = [tids[thread]]
        lane = lanes.place(start, end)
        if lane == len(lane_tids):
            lane_tids.append(next_tid)
            stats.overlap_tracks += 1
            yield from thread_metadata(pid, next_tid, f"thread {thread} (overlap {lane + 1})", next_tid)
            next_tid += 1
        args: dict[str, Any] = {"span_id": span_id}
        if parent_id:
            args["parent_id"] = parent_id
        if index is not None:
            args["index"] = index
        if type(gpu) is int:
            args["gpu_us"] = gpu / 1000
        if os_pid:
            args["os_pid"] = os_pid
        if attrs and attrs != "{}":
            args.update(_args(attrs))
        if name == "step" and type(index) is int and index > last_spanned:
            last_spanned = index
        event = complete(span_title(name, index), span_category(name), pid, lane_tids[lane], start, end, origin, args)
        yield event
    yield from _ledger_steps(store, sid, r, origin, next_tid, last_spanned)
    yield from _gpu_events(store, sid, r, origin, stats, next_tid + 1)
    yield from _counter_events(store, sid, r, origin, stats)
    yield from _mark_events(store, sid, r, origin, stats)


def _ledger_steps(store: Any, sid: str, r: _Rank, origin: int, tid: int, after: int) -> Iterator[dict[str, Any]]:
    """The steps the history holds past the last step span: a rank killed (SIGKILL) before its
    last spans were shipped keeps every step it closed in its step ledger, and the trace shows
    them on a track of their own rather than end the rank early."""
    where, window = ("", ()) if r.window is None else (_SPAN_IN_WINDOW, _span_window(r.window))
    named = False
    for step, start, end in store.iterate("SELECT step, start_ns, end_ns FROM steps WHERE session_id = ? AND rank = ? "
                                          f"AND step > ?{where} ORDER BY step", (sid, r.rank, after, *window)):
        if not isinstance(start, int) or not isinstance(end, int):
            continue
        if not named:
            named = True
            yield from thread_metadata(r.rank + 1, tid, "steps (from the step ledger: their spans were not shipped)", tid)
        yield complete(span_title("step", step), span_category("step"), r.rank + 1, tid, start, end, origin,
                       {"source": "step ledger"})


def _gpu_events(store: Any, sid: str, r: _Rank, origin: int, stats: ExportStats,
                next_tid: int) -> Iterator[dict[str, Any]]:
    """The GPU time of the spans that measured it, on the rank's ``GPU (measured)`` track: each
    from its span's start, as long as its GPU work took (CUDA events give the duration, not
    when the device began)."""
    pid = r.rank + 1
    where, window = ("", ()) if r.window is None else (_SPAN_IN_WINDOW, _span_window(r.window))
    lanes, lane_tids = Lanes(), [_GPU_TID]
    for span_id, name, index, start, gpu in store.iterate(
            "SELECT span_id, name, idx, start_ns, gpu_ns FROM spans WHERE session_id = ? AND rank = ? "
            f"AND gpu_ns IS NOT NULL{where} ORDER BY start_ns, gpu_ns DESC", (sid, r.rank, *window)):
        if not isinstance(start, int) or not isinstance(gpu, int):
            continue
        if len(lane_tids) == 1 and lanes.count == 0:
            yield from thread_metadata(pid, _GPU_TID, "GPU (measured)", _GPU_TID)
        lane = lanes.place(start, start + max(0, gpu))
        if lane == len(lane_tids):
            lane_tids.append(_GPU_TID + lane)
            stats.overlap_tracks += 1
            yield from thread_metadata(pid, _GPU_TID + lane, f"GPU (measured, overlap {lane + 1})", _GPU_TID + lane)
        event = complete(span_title(name, index), "gpu", pid, lane_tids[lane], start, start + max(0, gpu), origin,
                         {"span_id": span_id, "gpu_us": gpu / 1000})
        yield event


def _rank_rows(store: Any, sid: str, r: _Rank, table: str, time_column: str, columns: str) -> Iterator[tuple[Any, ...]]:
    """The rank's rows of ``table`` in its window, in time order, as (time, *columns); a row whose
    time is not an integer (a damaged one) is left out."""
    where, window = _where_window(time_column, r.window)
    for row in store.iterate(f"SELECT {time_column}, {columns} FROM {table} WHERE session_id = ? AND rank = ?{where} "
                             f"ORDER BY {time_column}", (sid, r.rank, *window)):
        if isinstance(row[0], int):
            yield row


def _counter_events(store: Any, sid: str, r: _Rank, origin: int, stats: ExportStats) -> Iterator[dict[str, Any]]:
    """Memory samples as counters (RSS for host memory; allocated and reserved per device) and
    the other telemetry events (start, stop, collector health, warnings, errors, OOMs) as
    process instants."""
    pid = r.rank + 1
    for ts, kind, collector, device, allocated, reserved, context, metadata in _rank_rows(
            store, sid, r, "telemetry", "timestamp_ns", "event_type, collector, device_id, allocated, reserved, "
                                                        "context, metadata"):
        if kind == "sample":
            if device == _CPU or device is None:
                if isinstance(allocated, int):
                    yield counter("RSS", pid, ts, origin, "bytes", allocated)
                continue
            label = f"{collector} device {device}"
            for series, value in (("allocated", allocated), ("reserved", reserved)):
                if isinstance(value, int):
                    yield counter(f"{label} {series}", pid, ts, origin, "bytes", value)
            continue
        meta = _args(metadata)
        oom = kind == "error" and (any(k in meta for k in _OOM_KEYS) or bool(meta.get("oom") or meta.get("is_oom")))
        name = "OOM" if oom else kind
        args = {"collector": collector, "device_id": device, **({"context": context} if context else {}), **meta}
        yield instant(str(name), "marker", pid, 0, ts, origin, "p", args)


def _mark_events(store: Any, sid: str, r: _Rank, origin: int, stats: ExportStats) -> Iterator[dict[str, Any]]:
    """The rank's marks as process instants; a numeric point mark also as a point of the
    counter ``mark NAME`` (a loss curve under the timeline)."""
    pid = r.rank + 1
    for ts, mark_id, span_id, name, number, text, kind, attrs in _rank_rows(
            store, sid, r, "marks", "ts_ns", "mark_id, span_id, name, value_num, value_text, kind, attrs"):
        value = number if number is not None else text
        args = {"value": value, "kind": kind, "mark_id": mark_id, **({"span_id": span_id} if span_id else {}),
                **_args(attrs)}
        yield instant(str(name), "mark", pid, 0, ts, origin, "p", args)
        if kind == "point" and isinstance(number, (int, float)):
            yield counter(f"mark {name}", pid, ts, origin, "value", number)


def _session_events(store: Any, sid: str, plan: list[_Rank], origin: int) -> Iterator[dict[str, Any]]:
    """Alerts and verdict changes: on the first rank they name when it is exported (scope p),
    else global (scope g)."""
    pids = {r.rank: r.rank + 1 for r in plan}
    where, window = _where_window("ts_ns", _global_window(plan))
    queries: tuple[tuple[str, str, Callable[[tuple[Any, ...]], tuple[str, dict[str, Any]]]], ...] = (
        ("alert", "SELECT ts_ns, ranks, kind, severity, step, message, evidence FROM alerts",
         lambda row: (f"alert {row[2]}", {"kind": row[2], "severity": row[3], "step": row[4], "message": row[5],
                                          "evidence": _args(row[6])})),
        ("verdict", "SELECT ts_ns, ranks, name, severity, step, message, evidence, score, window_steps, next_step "
                    "FROM verdicts",
         lambda row: (f"verdict {row[2]}", {"verdict": row[2], "severity": row[3], "step": row[4], "message": row[5],
                                            "evidence": _args(row[6]), "score": row[7], "window_steps": row[8],
                                            "next_step": row[9]})),
    )
    for cat, select, describe in queries:
        for row in store.iterate(f"{select} WHERE session_id = ?{where} ORDER BY ts_ns", (sid, *window)):
            if not isinstance(row[0], int):
                continue
            ranks = _ranks(row[1])
            name, args = describe(row)
            args["ranks"] = ranks
            if ranks and ranks[0] in pids:
                yield instant(name, cat, pids[ranks[0]], 0, row[0], origin, "p", args)
            else:
                yield instant(name, cat, _GLOBAL_PID, 0, row[0], origin, "g", args)


def write_trace(store: Any, selection: TraceSelection, out: IO[bytes], *, hosts: Iterable[str] = (),
                other: dict[str, Any] | None = None) -> ExportStats:
    """Writes the trace to ``out`` event by event (one encoder, one small buffer), and says what
    it wrote. ``other``: more of ``otherData`` (the run's command line, its versions)."""
    stats = ExportStats()
    encode = msgspec.json.Encoder().encode
    events = iter_trace_events(store, selection, hosts, stats)
    first = next(events, None)  # the plan and the origin are known once the first event is
    header = {"session_id": selection.session_id, "origin_unix_ns": stats.origin_ns, "exporter": "stepwatch",
              "clock": "wall clock of each rank's host (time.time_ns), one origin for all ranks", **(other or {})}
    out.write(b'{"displayTimeUnit":"ms","otherData":' + encode(header) + b',"traceEvents":[')
    if first is not None:
        stats.count(first)
        out.write(b"\n" + encode(first))
        pending: list[bytes] = []
        for event in events:
            stats.count(event)
            pending.append(encode(event))
            if len(pending) >= 512:
                out.write(b",\n" + b",\n".join(pending))
                pending.clear()
        if pending:
            out.write(b",\n" + b",\n".join(pending))
    out.write(b"\n]}\n")
    return stats


def write_trace_file(store: Any, selection: TraceSelection, target: Path, **kwargs: Any) -> ExportStats:
    """``write_trace`` into ``target``, whole or not at all: written beside it, then renamed. A
    name ending ``.gz`` is written gzip-compressed (Perfetto opens it so; a
    trace's JSON shrinks about tenfold)."""
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb", buffering=1 << 20) as raw:
            if target.suffix == ".gz":
                import gzip

                with gzip.GzipFile(filename=target.name[:-3], mode="wb", fileobj=raw, compresslevel=6) as out:
                    stats = write_trace(store, selection, out, **kwargs)  # type: ignore[arg-type]
            else:
                stats = write_trace(store, selection, raw, **kwargs)
        partial.replace(target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return stats
