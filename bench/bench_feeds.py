"""The aggregator's feeds (docs/metrics.md): what a Prometheus scrape of ``/metrics`` costs with 64
ranks, and the OTLP span export's rate.

Usage::

    .venv/bin/python bench/bench_feeds.py [--ranks 64] [--steps 2000] [--spans 100000] [--tmp-dir DIR]

* **scrape**: a ``serve --out`` directory whose history holds one session of ``--ranks`` ranks x
  ``--steps`` steps (each with its phases) and a memory sample every 10 steps, announced to a real
  aggregator core by one frame a rank. A scrape is ``generate_latest`` over the feeds' collector:
  *cold* with a new collector (opens the history, reads every rank's last 100 steps, its memory
  samples and its last loss), *warm* with the same one after that (the figures the live view's
  history reader keeps for 2 s, plus the exposition). CPU time (user + system) is the figure to
  trust on a shared machine; best of 5.
* **otlp**: ``--spans`` span rows (a step and four phases each, 1,000 steps an epoch) handed to the
  OTLP exporter as the aggregator's tap does (frames of 500 rows), sampled by the default rule,
  converted and POSTed as OTLP/HTTP protobuf to a receiver in this process that answers at once:
  spans looked at per second of CPU, and the spans exported.
* **tap**: what the OTLP tap adds to the aggregator's intake: ``Aggregator.accept`` of 100 frames
  of 500 span rows each, with ``span_tap`` unset and set to the exporter's (one list copy a
  frame), best of 3 rounds each, alternated.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine_header, print_header, print_table, write_results

T0 = 1_790_000_000_000_000_000
MS = 1_000_000
PHASE_NS = {"data_load_ns": 1, "h2d_ns": 0, "forward_ns": 3, "backward_ns": 4, "optimizer_ns": 1, "recompute_ns": 0}


def _history(run_dir: Path, session: str, ranks: int, steps: int) -> Any:
    from stepwatch.server.aggregator import Aggregator
    from stepwatch.store.sqlite import SqliteStore
    from stepwatch.transport.frames import Message

    store = SqliteStore(run_dir / "history.sqlite")
    store.upsert_session({"session_id": session, "status": "running", "started_at_ns": T0, "ended_at_ns": None,
                          "host": "bench", "world_size": ranks, "source": "bench", "command_line": ["train.py"]})
    for rank in range(ranks):
        rows, samples, marks = [], [], []
        t = T0
        for step in range(steps):
            step_ns = 10 * MS + (step * 7919 + rank) % MS
            phases = {k: v * step_ns // 10 for k, v in PHASE_NS.items()}
            rows.append({"session_id": session, "rank": rank, "step": step, "start_ns": t, "end_ns": t + step_ns,
                         "step_ns": step_ns, "wait_ns": step_ns - sum(phases.values()), **phases})
            if step % 10 == 0:
                samples.append({"session_id": session, "rank": rank, "timestamp_ns": t, "event_type": "sample",
                                "collector": "bench", "device_id": 0, "allocated": (1 << 30) + step,
                                "reserved": 1 << 30, "active": None, "inactive": None, "change": 0, "used": 1 << 30,
                                "free": None, "total": None, "pid": 1, "host": "bench", "context": None,
                                "metadata": {}})
                marks.append({"session_id": session, "rank": rank, "mark_id": f"{rank:08d}{step:024d}",
                              "span_id": None, "name": "loss", "value_type": "num", "value_num": 1.0 / (step + 1),
                              "value_text": None, "ts_ns": t, "kind": "metric", "attrs": {}})
            t += step_ns
        store.append_many({"steps": rows, "telemetry": samples, "marks": marks})
    core = Aggregator(store)
    for rank in range(ranks):
        core.accept(Message(meta={"session_id": session, "rank": rank, "host": f"node{rank // 8}"},
                            tables={"marks": [{"id": f"{rank:032d}", "name": "hello", "value": 1.0}]}))
    return core, store


def _cpu() -> float:
    """This process's CPU time, every thread's (the exporter's and the receiver's included)."""
    return time.process_time()


def bench_scrape(tmp: Path, ranks: int, steps: int, rounds: int = 5) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, generate_latest

    from stepwatch.server.feed_state import FeedState
    from stepwatch.server.metrics import StepwatchCollector

    core, store = _history(tmp, "bench-session", ranks, steps)
    cold, warm, size = [], [], 0
    for _ in range(rounds):
        state = FeedState(tmp, core, cache_s=0)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StepwatchCollector(state, core))
        for bucket in (cold, warm):
            started, cpu = time.perf_counter(), _cpu()
            body = generate_latest(registry)
            bucket.append((time.perf_counter() - started, _cpu() - cpu))
            size = len(body)
        state.close()
    store.close()
    return {"ranks": ranks, "steps": steps, "bytes": size, "series": body.count(b"\n") - body.count(b"\n#"),
            "cold_wall_s": min(w for w, _ in cold), "cold_cpu_s": min(c for _, c in cold),
            "warm_wall_s": min(w for w, _ in warm), "warm_cpu_s": min(c for _, c in warm)}


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass


def bench_otlp(tmp: Path, spans: int) -> dict[str, Any]:
    from stepwatch.server.feed_state import FeedState
    from stepwatch.server.otlp import OtlpExporter

    core, store = _history(tmp, "otlp-session", 1, 10)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    exporter = OtlpExporter(f"http://127.0.0.1:{server.server_address[1]}", FeedState(tmp, core), core,
                            interval_s=3600)
    rows: list[tuple[Any, ...]] = []
    t = T0
    for step in range(spans // 5):
        step_id = f"s{step:031d}"
        epoch_id = f"e{step // 1000:031d}"
        for i, name in enumerate(("data_load", "forward", "backward", "optimizer_step")):
            rows.append(("otlp-session", 0, f"p{step:027d}{i:04d}", step_id, name, None, t + i, t + i + 1, None,
                         1, 1, "{}"))
        rows.append(("otlp-session", 0, step_id, epoch_id, "step", step, t, t + 10, None, 1, 1,
                     '{"step_ns":10,"forward_ns":3}'))
        t += 10
    started, cpu = time.perf_counter(), _cpu()
    for first in range(0, len(rows), 500):
        exporter.take_spans("otlp-session", 0, "bench", rows[first:first + 500])
    exporter._export_spans(final=True)  # the exporter thread's round, timed here
    wall, spent = time.perf_counter() - started, _cpu() - cpu
    stats = exporter.stats()
    exporter.close()
    server.shutdown()
    store.close()
    return {"span_rows": len(rows), "spans_exported": stats["spans_exported"], "exports": stats["exports"],
            "wall_s": wall, "cpu_s": spent, "rows_per_cpu_s": len(rows) / spent if spent else None}


def bench_tap(tmp: Path, frames: int = 100, rows: int = 500) -> dict[str, Any]:
    from collections import deque

    from stepwatch.server.aggregator import Aggregator
    from stepwatch.store.sqlite import SqliteStore
    from stepwatch.transport.frames import Message

    store = SqliteStore(tmp / "history.sqlite")
    core = Aggregator(store, max_pending_rows=10**9, pause_rows=10**9, flush_rows=10**9)
    messages = [Message(meta={"session_id": "tap", "rank": 0, "host": "h"}, tables={"spans": [
        {"id": f"{k:016x}{i:016x}", "name": "forward", "start_ns": T0 + i, "end_ns": T0 + 100 + i, "parent_id": None}
        for i in range(rows)]}) for k in range(frames)]
    taken: deque[Any] = deque()

    def tap(session: str, rank: int, host: Any, span_rows: list[Any]) -> None:
        taken.append(span_rows[:])  # what OtlpExporter.take_spans does

    best = {"off": float("inf"), "on": float("inf")}
    for _ in range(3):
        for name in ("off", "on"):
            core.span_tap = tap if name == "on" else None
            core._pending.clear()  # no writer runs here: the queue is emptied by hand
            core._pending_rows = 0
            taken.clear()
            cpu = _cpu()
            for message in messages:
                core.accept(message)
            best[name] = min(best[name], _cpu() - cpu)
    store.close()
    return {"frames": frames, "rows_per_frame": rows, "off_cpu_s": best["off"], "on_cpu_s": best["on"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--tmp-dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        header = machine_header(Path(tmp))
        print_header("feeds: /metrics scrape and OTLP span export", header)
        (Path(tmp) / "scrape").mkdir()
        (Path(tmp) / "otlp").mkdir()
        (Path(tmp) / "tap").mkdir()
        tap = bench_tap(Path(tmp) / "tap")
        scrape = bench_scrape(Path(tmp) / "scrape", args.ranks, args.steps)
        otlp = bench_otlp(Path(tmp) / "otlp", args.spans)
    print_table(["measure", "wall", "CPU", "notes"], [
        [f"/metrics cold, {scrape['ranks']} ranks", f"{scrape['cold_wall_s'] * 1000:.1f} ms",
         f"{scrape['cold_cpu_s'] * 1000:.1f} ms", f"{scrape['series']} series, {scrape['bytes']} bytes"],
        [f"/metrics warm, {scrape['ranks']} ranks", f"{scrape['warm_wall_s'] * 1000:.1f} ms",
         f"{scrape['warm_cpu_s'] * 1000:.1f} ms", ""],
        [f"OTLP {otlp['span_rows']} span rows", f"{otlp['wall_s']:.2f} s", f"{otlp['cpu_s']:.2f} s",
         f"{otlp['spans_exported']} exported in {otlp['exports']} posts, "
         f"{(otlp['rows_per_cpu_s'] or 0):,.0f} rows per CPU second"],
        [f"intake, {tap['frames']} frames x {tap['rows_per_frame']} spans, no tap", "",
         f"{tap['off_cpu_s'] * 1000:.1f} ms", ""],
        [f"intake, {tap['frames']} frames x {tap['rows_per_frame']} spans, OTLP tap", "",
         f"{tap['on_cpu_s'] * 1000:.1f} ms", f"{(tap['on_cpu_s'] / tap['off_cpu_s'] - 1) * 100:+.1f}%"],
    ])
    print(f"load average after: {load_average()}")
    path = write_results("bench_feeds", {"header": header, "scrape": scrape, "otlp": otlp, "tap": tap})
    print(json.dumps({"results": str(path)}))


if __name__ == "__main__":
    main()
