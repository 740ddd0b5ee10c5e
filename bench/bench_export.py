"""The Perfetto export of a synthetic history of 1M spans: time, CPU time and peak RSS, with the
same export of a history ten times smaller to show the memory does not grow with the run.

Usage::

    .venv/bin/python bench/bench_export.py [--spans N] [--ranks R] [--tmp-dir DIR] [--whole-list]

The history (``R`` ranks, default 8; each step a ``step`` span and its four phase spans, under
one epoch per 1,000 steps and the session span; a memory sample and a loss mark per step) is
written once per size into ``DIR`` by a worker of its own, untimed. Then one fresh subprocess per
contender exports it with ``write_trace_file`` and reports its wall time, its CPU time (user +
system, the figure to trust on a shared machine), the peak RSS of the whole worker (interpreter
and stepwatch included) and the trace's size:

  * ``streamed N/10`` and ``streamed N``: the export as ``stepwatch export perfetto`` runs it;
  * ``whole list N/10`` (with ``--whole-list``): the same events gathered in one list before one
    ``json`` dump, what a non-streamed export would hold, for the memory it costs per event.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import SESSION_ID, T0, Measured, finish_report, peak_rss_bytes, run_worker, start_report, worker_main

SESSION = SESSION_ID
PHASES = ("data_load", "forward", "backward", "optimizer_step")
SPANS_PER_STEP = 1 + len(PHASES)


def build(args: list[str]) -> dict[str, Any]:
    """Writes the synthetic history (untimed)."""
    from stepwatch.store.sqlite import SqliteStore

    path, spans, ranks = Path(args[0]), int(args[1]), int(args[2])
    steps = max(1, spans // (ranks * SPANS_PER_STEP))
    started = time.perf_counter()
    with SqliteStore(path) as store:
        store.upsert_session({"session_id": SESSION, "status": "completed", "started_at_ns": T0, "ended_at_ns": None,
                              "host": "bench", "world_size": ranks, "source": "bench", "command_line": ["train.py"]})
        for rank in range(ranks):
            thread = 140_000_000_000_000 + rank
            root = f"r{rank}-session"
            total_ns = steps * 10_000_000
            batch: dict[str, list[dict[str, Any]]] = {"spans": [], "telemetry": [], "marks": []}

            batch["spans"].append({"session_id": SESSION, "rank": rank, "span_id": root, "parent_id": None,
                                   "name": "stepwatch.session", "idx": None, "start_ns": T0, "end_ns": T0 + total_ns + 1,
                                   "gpu_ns": None, "thread_id": thread, "pid": 1000 + rank, "attrs": {}})
            for step in range(steps):
                t = T0 + step * 10_000_000
                if step % 1000 == 0:
                    batch["spans"].append({"session_id": SESSION, "rank": rank, "span_id": f"r{rank}-e{step}",
                                           "parent_id": root, "name": "epoch", "idx": step // 1000, "start_ns": t,
                                           "end_ns": min(t + 1000 * 10_000_000, T0 + total_ns), "gpu_ns": None,
                                           "thread_id": thread, "pid": 1000 + rank, "attrs": {}})
                sid = f"r{rank}-s{step}"
                batch["spans"].append({"session_id": SESSION, "rank": rank, "span_id": sid,
                                       "parent_id": f"r{rank}-e{step // 1000 * 1000}", "name": "step", "idx": step,
                                       "start_ns": t, "end_ns": t + 9_000_000, "gpu_ns": None, "thread_id": thread,
                                       "pid": 1000 + rank,
                                       "attrs": {"step_ns": 9_000_000, "forward_ns": 3_000_000, "backward_ns": 4_000_000}})
                for k, phase in enumerate(PHASES):
                    batch["spans"].append({"session_id": SESSION, "rank": rank, "span_id": f"{sid}-{k}",
                                           "parent_id": sid, "name": phase, "idx": None,
                                           "start_ns": t + k * 2_000_000, "end_ns": t + k * 2_000_000 + 1_900_000,
                                           "gpu_ns": 1_500_000 if phase in ("forward", "backward") else None,
                                           "thread_id": thread, "pid": 1000 + rank, "attrs": {}})
                batch["telemetry"].append({"session_id": SESSION, "rank": rank, "timestamp_ns": t, "event_type": "sample",
                                           "collector": "stepwatch.cpu_tracker", "device_id": -1,
                                           "allocated": (1 << 30) + step, "reserved": 1 << 30, "change": 0,
                                           "used": 1 << 30, "pid": 1000 + rank, "host": "bench", "metadata": {}})
                batch["marks"].append({"session_id": SESSION, "rank": rank, "mark_id": f"{sid}-m", "span_id": sid,
                                       "name": "loss", "value_type": "float", "value_num": 1.0 / (step + 1),
                                       "value_text": None, "ts_ns": t + 8_500_000, "kind": "point", "attrs": {}})
                if len(batch["spans"]) >= 20_000:
                    _flush(store, batch)
            _flush(store, batch)
        stored = store.count("spans")
    return {"spans": stored, "steps_per_rank": steps, "build_s": round(time.perf_counter() - started, 1)}


def _flush(store: Any, batch: dict[str, list[dict[str, Any]]]) -> None:
    store.append_many(batch)
    for rows in batch.values():
        rows.clear()


def export(args: list[str]) -> dict[str, Any]:
    """``write_trace_file`` of the whole session, as the command runs it."""
    from stepwatch.exports.perfetto import TraceSelection, write_trace_file
    from stepwatch.store.sqlite import SqliteStore

    path, target = Path(args[0]), Path(args[1])
    rss_before = peak_rss_bytes()
    with Measured() as took, SqliteStore(path, read_only=True) as store:
        stats = write_trace_file(store, TraceSelection(SESSION), target)
    size = target.stat().st_size
    target.unlink()
    return took.result(rss_before_bytes=rss_before, events=sum(stats.events.values()),
                       x_events=stats.events.get("X", 0), trace_bytes=size)


def whole_list(args: list[str]) -> dict[str, Any]:
    """The same events gathered in one list, then dumped: what streaming avoids holding."""
    from stepwatch.exports.perfetto import TraceSelection, iter_trace_events
    from stepwatch.store.sqlite import SqliteStore

    path, target = Path(args[0]), Path(args[1])
    with Measured() as took:
        with SqliteStore(path, read_only=True) as store:
            events = list(iter_trace_events(store, TraceSelection(SESSION)))
        target.write_text(json.dumps({"traceEvents": events}))
    size = target.stat().st_size
    target.unlink()
    return took.result(events=len(events), x_events=sum(1 for e in events if e["ph"] == "X"), trace_bytes=size)


def _count_spans(path: Path) -> int:
    import sqlite3

    with sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) as db:
        return int(db.execute("SELECT COUNT(*) FROM spans_rows").fetchone()[0])


WORKERS = {"build": build, "export": export, "whole-list": whole_list}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tmp-dir", type=Path, default=None)
    parser.add_argument("--whole-list", action="store_true")
    options = parser.parse_args()
    tmp = options.tmp_dir or Path(tempfile.mkdtemp(prefix="stepwatch-bench-export-"))
    tmp.mkdir(parents=True, exist_ok=True)
    header = start_report("Perfetto export", tmp)
    sizes = {"N/10": options.spans // 10, "N": options.spans}
    stores: dict[str, Path] = {}
    spans_of: dict[str, int] = {}
    for label, spans in sizes.items():
        store = tmp / f"history-{spans}-{options.ranks}.sqlite"
        if not store.exists():
            built = run_worker(Path(__file__), "build", [str(store), str(spans), str(options.ranks)], timeout=3600)
            print(f"  built {store.name}: {built}")
        stores[label] = store
        spans_of[label] = _count_spans(store)
    results: dict[str, dict[str, Any]] = {}
    for label in sizes:
        results[f"streamed {label}"] = run_worker(Path(__file__), "export",
                                                  [str(stores[label]), str(tmp / "trace.json")], timeout=3600)
    if options.whole_list:
        results["whole list N/10"] = run_worker(Path(__file__), "whole-list",
                                                [str(stores["N/10"]), str(tmp / "trace.json")], timeout=3600)
    rows = []
    for name, r in results.items():
        spans = spans_of[name.split()[-1]]
        rows.append((name, f"{spans:,}", f"{r['x_events']:,}", f"{r['events']:,}", r["wall_s"], r["cpu_s"],
                     f"{spans / max(r['cpu_s'], 1e-9) / 1e3:.0f}k", f"{r['peak_rss_bytes'] / 2**20:.0f}",
                     f"{r['trace_bytes'] / 2**20:.0f}"))
    finish_report("bench_export", ("contender", "history spans", "X events", "events", "wall s", "cpu s", "spans/cpu s",
                                   "peak RSS MiB", "trace MiB"), rows,
                  {"header": header, "options": {**vars(options), "tmp_dir": str(tmp)}, "results": results})


if __name__ == "__main__":
    if not worker_main(WORKERS, sys.argv[1:]):
        main()
