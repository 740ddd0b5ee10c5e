"""Ingest throughput and end-to-end latency of the aggregator (``python -m stepwatch.server``),
side by side with TraceML 0.5.0's aggregator under an equivalent load.

Usage::

    .venv/bin/python bench/bench_ingest.py [--ranks 64] [--rows 600000] [--gen-procs 4]
        [--steps-per-frame 20] [--http-rows 300000] [--http-clients 16] [--http-batch 1000]
        [--e2e-samples 80] [--e2e-steps-per-frame 10,30] [--e2e-spool-interval 2.0] [--traceml-rows 300000]
        [--only tcp,http,e2e,traceml] [--wire columns|rows] [--tmp-dir DIR] [--profile]

Phases (each one starts a fresh aggregator in a fresh directory):

* ``tcp``: ``--ranks`` simulated ranks, spread over ``--gen-procs`` generator processes (one
  thread and one socket per rank), each sends its share of ``--rows`` wire rows as pre-encoded
  frames (``encode_frame``; telemetry, spans and marks columnar as ``FrameSender`` sends them, or
  row maps with ``--wire rows``), as fast as the aggregator reads them. A frame holds
  ``--steps-per-frame`` training steps; a step is 3 telemetry rows (one ``sample`` and a
  ``phase_enter``/``phase_exit`` pair, built from ``msgspec.to_builtins`` of
  ``TelemetryEventV3``), 5 spans (``step`` carrying the phase times, and its ``data_load``,
  ``forward``, ``backward``, ``optimizer_step`` children) and one ``loss`` mark; a frame adds
  one heartbeat. The store derives one ``steps`` row from each ``step`` span. Every frame is
  generated and encoded before the clock starts; the generator processes then only
  ``sendall``.
* ``http``: ``--http-clients`` keep-alive clients POST ``/v1/traces`` spool batches (gzip, as
  the SDK's exporter sends them) of ``--http-batch`` spans and marks each (same step shape,
  without telemetry), ``--http-rows`` records in all, for 64 ranks.
* ``e2e``: 62 background ranks ship one frame a second (``--e2e-steps-per-frame`` steps each,
  random phase) while two probe ranks append rows at random instants and a reader polls the
  store every 10 ms (read-only, WAL) for them: rank 62 runs the real runtime
  (``stepwatch.init(aggregator=...)``, 1 s tick) and appends a ``progress()`` heartbeat and a
  ``mark()``; rank 63 appends a mark row to a list that a ``FrameSender`` ships once a second.
  Latency = first poll that sees the row - ``time.time_ns()`` at the append.
* ``traceml``: TraceML's standalone aggregator process (``traceml_ai/aggregator/aggregator_main.py``,
  which ``traceml run`` starts; env ``TRACEML_UI_MODE=summary``, ``TRACEML_AGGREGATOR_PORT=0``)
  gets the same ranks and steps in TraceML's wire format (a 4-byte length, then a msgpack list
  of ``{meta, body: {tables}}`` envelopes, as ``TCPClient.send_batch`` sends): per step 3
  ``ProcessSampler`` rows, one ``StepTimeSampler`` row (the 5 phase timings), one
  ``StepMemorySampler`` row. TraceML stores 5 rows per step where stepwatch stores 10, so the
  comparable unit is steps/s; rows/s is given for both.

Measuring: the parent polls the store read-only every 0.25 s (``MAX(rowid)`` of each table:
append-only tables, so that is the row count, at O(log n)), the aggregator's ``/healthz``
counters (stepwatch), and the aggregator process's RSS and CPU time (psutil). The stepwatch
aggregator runs as ``python -c BOOT`` where BOOT patches ``Aggregator.stats`` (a read-only
method, off the hot path) to add the pending-row count and, in the final
``aggregator_stats.json``, the (rows, seconds) of its last 1000 write ticks, then calls
``stepwatch.server.serve.main()``; it also sums the cyclic GC's time through ``gc.callbacks``:
otherwise the process and code paths are those of ``python -m stepwatch.server``. ``--profile`` adds a single-process breakdown of the pipeline
per row (the typed fast path the aggregator takes, decode_typed and wire_tuples; the general
path, decode_body, to_rows, check_rows and row_tuples, for comparison; append_tuples with and
without the secondary indexes) and a cProfile listing.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO_ROOT,
    format_rate,
    load_average,
    machine_header,
    print_header,
    print_table,
    worker_main,
    write_results,
)

SCRIPT = Path(__file__).resolve()
PYTHON = sys.executable
TARGET_ROWS_PER_S = 200_000
TARGET_E2E_P99_S = 2.0
STEP_NS = 40_000_000
PHASES = ("data_load", "forward", "backward", "optimizer_step")
ROWS_PER_STEP = 9  # wire rows: 3 telemetry + 5 spans + 1 mark (the store adds a steps row)
HTTP_ROWS_PER_STEP = 6  # 5 spans + 1 mark
TRACEML_ROWS_PER_STEP = 5  # 3 process + 1 step_time + 1 step_memory
STEPWATCH_TABLES = ("telemetry", "spans", "marks", "heartbeats", "steps")
TRACEML_TABLES = ("process_samples", "step_time_samples", "step_memory_samples")
TRACEML_MAIN = "traceml_ai/aggregator/aggregator_main.py"
E2E_RUNTIME_RANK, E2E_SENDER_RANK = 62, 63

# The aggregator as `python -m stepwatch.server`, with Aggregator.stats() reporting a little more.
BOOT = r"""
import gc, time
_gc = [0.0, 0, 0.0]
def _on_gc(phase, info):
    if phase == "start":
        _gc[2] = time.perf_counter()
    else:
        _gc[0] += time.perf_counter() - _gc[2]
        _gc[1] += 1
gc.callbacks.append(_on_gc)
from stepwatch.server import aggregator as _agg
_stats = _agg.Aggregator.stats
def stats(self):
    out = _stats(self)
    out["bench_pending_rows"] = self._pending_rows
    out["bench_gc_seconds"], out["bench_gc_collections"] = _gc[0], _gc[1]
    if self._stopping.is_set():
        out["bench_batches"] = [list(b) for b in self.write_batches]
    return out
_agg.Aggregator.stats = stats
from stepwatch.server.serve import main
main()
"""


# -- statistics ---------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def time_at(samples: list[tuple[float, int]], target: float) -> float | None:
    """When the polled count first reached ``target`` (linear between polls)."""
    previous = None
    for t, n in samples:
        if n >= target:
            if previous is None or n == previous[1]:
                return t
            t0, n0 = previous
            return t0 + (t - t0) * (target - n0) / (n - n0)
        previous = (t, n)
    return None


def rate_stats(samples: list[tuple[float, int]], total: int, t_go: float) -> dict[str, Any]:
    """Overall rate, the 10%-90% steady rate, and 1-s windows inside it."""
    done = time_at(samples, total)
    t10, t90 = time_at(samples, 0.1 * total), time_at(samples, 0.9 * total)
    out: dict[str, Any] = {"done_s": None if done is None else done - t_go}
    reached = samples[-1][1] if samples else 0
    out["overall_rows_per_s"] = total / (done - t_go) if done else reached / (samples[-1][0] - t_go)
    out["steady_rows_per_s"] = 0.8 * total / (t90 - t10) if t10 is not None and t90 is not None and t90 > t10 else None
    windows = []
    if t10 is not None and t90 is not None:
        inside = [(t, n) for t, n in samples if t10 <= t <= t90]
        start = 0
        for i in range(1, len(inside)):
            if inside[i][0] - inside[start][0] >= 1.0:
                windows.append((inside[i][1] - inside[start][1]) / (inside[i][0] - inside[start][0]))
                start = i
    out["window_rows_per_s"] = {"min": min(windows), "median": statistics.median(windows), "max": max(windows),
                                "n": len(windows)} if windows else None
    # the longest stretch during which no commit became visible, from the first stored row to the last
    changes = [t for (t, n), (_, m) in zip(samples[1:], samples[:-1]) if n > m]
    out["max_commit_gap_s"] = max((b - a for a, b in zip(changes, changes[1:])), default=None)
    out["commits_seen"] = len(changes)
    if t10 is not None and t90 is not None and sum(1 for t in changes if t10 <= t <= t90) < 5:
        out["steady_rows_per_s"] = None  # a few giant commits: no steady state to speak of
    out["first_row_s"] = changes[0] - t_go if changes else None
    return out


# -- the load -----------------------------------------------------------------------------------


def _base_events(sid: str) -> dict[str, dict[str, Any]]:
    """One v3 event of each kind, as the runtime builds them, as plain wire dicts."""
    import msgspec

    from stepwatch.schema import TelemetryEventV3

    common = {"schema_version": 3, "session_id": sid, "collector": "stepwatch.cpu_tracker", "sampling_interval_ms": 1000,
                  "pid": 0, "host": "", "device_id": -1, "allocator_allocated_bytes": 512 << 20,
                  "allocator_reserved_bytes": 576 << 20, "allocator_active_bytes": None, "allocator_inactive_bytes": None,
                  "allocator_change_bytes": 0, "device_used_bytes": 600 << 20, "device_free_bytes": None,
                  "device_total_bytes": None, "job_id": None, "rank": 0, "local_rank": 0, "world_size": 1}
    sample = TelemetryEventV3(**common, timestamp_ns=time.time_ns(), event_type="sample", context=None,
                              metadata={"backend": "cpu", "supports_device_total": False,
                                        "supports_device_free": False, "sampling_source": "psutil"})
    scope = {"action": "enter", "name": "step", "path": ["step"], "depth": 1, "scope_id": "t1:1",
             "parent_scope_id": None, "thread_id": 140000000000000, "thread_name": "MainThread", "sequence": 1}
    enter = TelemetryEventV3(**common, timestamp_ns=time.time_ns(), event_type="phase_enter",
                             context="Phase entered: step", metadata={"phase_scope": scope})
    leave = TelemetryEventV3(**common, timestamp_ns=time.time_ns(), event_type="phase_exit",
                             context="Phase exited: step", metadata={"phase_scope": {**scope, "action": "exit"}})
    return {"sample": msgspec.to_builtins(sample), "enter": msgspec.to_builtins(enter),
            "exit": msgspec.to_builtins(leave)}


def _ident(rank: int, n: int, part: int = 0) -> str:
    return f"{rank:06x}{n:022x}{part:04x}"  # 32 hex, unique per (rank, step, part)


def step_rows(rank: int, n: int, start_ns: int, base: dict[str, dict[str, Any]] | None, world: int,
              pid: int, host: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Telemetry, spans and marks of training step ``n`` of ``rank``."""
    step_id = _ident(rank, n)
    durations = (800_000 + (n % 7) * 10_000, 9_000_000 + rank * 1000, 18_000_000, 4_000_000)
    step_ns = sum(durations) + 300_000
    attrs = {"step_ns": step_ns, "data_load_ns": durations[0], "h2d_ns": 0, "forward_ns": durations[1],
             "backward_ns": durations[2], "optimizer_step_ns": durations[3], "wait_ns": 300_000}
    spans = [{"id": step_id, "name": "step", "parent_id": None, "index": n, "start_ns": start_ns,
              "end_ns": start_ns + step_ns, "cpu_ns": None, "gpu_ns": None, "memory_peak_bytes": None,
              "thread_id": 1, "pid": pid, "rank": rank, "attrs": attrs, "mark_ids": [_ident(rank, n, 9)]}]
    at = start_ns
    for p, (name, d) in enumerate(zip(PHASES, durations), start=1):
        spans.append({"id": _ident(rank, n, p), "name": name, "parent_id": step_id, "index": None, "start_ns": at,
                      "end_ns": at + d, "cpu_ns": None, "gpu_ns": None, "memory_peak_bytes": None, "thread_id": 1,
                      "pid": pid, "rank": rank, "attrs": {}, "mark_ids": []})
        at += d
    marks = [{"id": _ident(rank, n, 9), "span_id": step_id, "name": "loss", "value_type": "float",
              "value": 2.0 / (n + 1), "attrs": {"step": n}, "ts_ns": start_ns + step_ns, "kind": "point"}]
    telemetry: list[dict[str, Any]] = []
    if base is not None:
        ident = {"pid": pid, "host": host, "rank": rank, "local_rank": rank % 8, "world_size": world}
        allocated = (512 << 20) + ((n * 7919 + rank) % 4096) * 4096
        sample = {**base["sample"], **ident, "timestamp_ns": start_ns, "allocator_allocated_bytes": allocated,
                  "allocator_reserved_bytes": allocated + (64 << 20), "allocator_change_bytes": 4096,
                  "device_used_bytes": allocated + (70 << 20)}
        scope = {**base["enter"]["metadata"]["phase_scope"], "scope_id": f"t1:{n}", "sequence": 2 * n}
        enter = {**base["enter"], **ident, "timestamp_ns": start_ns, "metadata": {"phase_scope": scope}}
        leave = {**base["exit"], **ident, "timestamp_ns": start_ns + step_ns,
                 "metadata": {"phase_scope": {**scope, "action": "exit", "sequence": 2 * n + 1}}}
        telemetry = [sample, enter, leave]
    return telemetry, spans, marks


def tcp_frames(rank: int, frames: int, steps: int, sid: str, world: int, base: dict[str, Any],
               start_ns: int, wire: str = "columns") -> tuple[list[bytes], int]:
    """Pre-encoded frames of one rank; returns them and their wire rows. ``wire="columns"``:
    telemetry, spans and marks as ``FrameSender.ship`` sends them (the runtime's Structs through
    ``frames.columnar_table``); ``"rows"``: as row maps (an older sender)."""
    from stepwatch.capture.spans import SpoolMark, SpoolSpan
    from stepwatch.schema import TelemetryEventV3
    from stepwatch.transport.frames import columnar_table, encode_frame

    host, pid = f"node{rank // 8:02d}", 20_000 + rank
    meta = {"session_id": sid, "rank": rank, "local_rank": rank % 8, "world_size": world, "job_id": None,
            "host": host, "pid": pid, "started_ns": start_ns}
    out, rows = [], 0
    for f in range(frames):
        telemetry, spans, marks = [], [], []
        for k in range(steps):
            n = f * steps + k
            t, s, m = step_rows(rank, n, start_ns + n * STEP_NS, base, world, pid, host)
            telemetry += t
            spans += s
            marks += m
        heartbeat = [{"ts": (start_ns + (f + 1) * steps * STEP_NS) / 1e9, "iso": "", "pid": pid, "rank": rank,
                      "step": (f + 1) * steps, "msg": "heartbeat", "phase": "train"}]
        tables = {"telemetry": telemetry, "spans": spans, "marks": marks, "heartbeat": heartbeat}
        if wire == "columns":
            tables["telemetry"] = columnar_table("telemetry", [TelemetryEventV3(**t) for t in telemetry])
            tables["spans"] = columnar_table("spans", [SpoolSpan(**x) for x in spans])
            tables["marks"] = columnar_table("marks", [SpoolMark(**x) for x in marks])
        out.append(encode_frame({**meta, "seq": f, "sent_ns": time.time_ns()}, tables))
        rows += len(telemetry) + len(spans) + len(marks) + 1
    return out, rows


def traceml_frames(rank: int, frames: int, steps: int, session: str, world: int, start_ns: int) -> tuple[list[bytes], int]:
    """The same steps in TraceML's wire format (TCPClient.send_batch: length + msgpack list)."""
    import msgspec

    encoder = msgspec.msgpack.Encoder()
    host, pid = f"node{rank // 8:02d}", 20_000 + rank
    out, rows = [], 0

    def envelope(sampler: str, table: str, table_rows: list[dict[str, Any]], ts: float) -> dict[str, Any]:
        meta = {"rank": rank, "global_rank": rank, "local_rank": rank % 8, "world_size": world,
                "local_world_size": 8, "node_rank": rank // 8, "hostname": host, "pid": pid, "sampler": sampler,
                "timestamp": ts, "session_id": session, "run_nonce": None, "session_source": "explicit"}
        return {"meta": meta, "body": {"tables": {table: table_rows}}}

    for f in range(frames):
        process, step_time, step_memory = [], [], []
        for k in range(steps):
            n = f * steps + k
            ts = (start_ns + n * STEP_NS) / 1e9
            allocated = (512 << 20) + ((n * 7919 + rank) % 4096) * 4096
            for j in range(3):
                process.append({"seq": 3 * n + j, "ts": ts + j * 0.01, "cpu": 35.0 + j, "cpu_cores": 2,
                                "ram_used": float(allocated), "ram_total": 24.0 * 2**30, "gpu_available": False,
                                "gpu_count": 0, "gpu": None})
            durations = (0.8, 9.0 + rank / 1000, 18.0, 4.0)
            events = {name: {"cpu": {"is_gpu": False, "duration_ms": d, "cpu_ms": d, "gpu_ms": None, "n_calls": 1}}
                      for name, d in zip(PHASES, durations)}
            events["step"] = {"cpu": {"is_gpu": False, "duration_ms": sum(durations) + 0.3,
                                      "cpu_ms": sum(durations) + 0.3, "gpu_ms": None, "n_calls": 1}}
            step_time.append({"seq": n, "timestamp": ts, "step": n, "events": events})
            step_memory.append({"seq": n, "ts": ts, "device": "cpu", "step": n, "peak_alloc": float(allocated),
                                "peak_resv": float(allocated + (64 << 20))})
        ts = (start_ns + (f + 1) * steps * STEP_NS) / 1e9
        payload = [envelope("ProcessSampler", "process", process, ts),
                   envelope("StepTimeSampler", "step_time", step_time, ts),
                   envelope("StepMemorySampler", "step_memory", step_memory, ts)]
        body = encoder.encode(payload)
        out.append(len(body).to_bytes(4, "big") + body)
        rows += len(process) + len(step_time) + len(step_memory)
    return out, rows


def http_bodies(rank: int, batches: int, batch_rows: int, gz: bool, start_ns: int) -> tuple[list[bytes], int]:
    """Spool batches (spool-format-v1) of spans and marks of one rank, JSON, gzip as the exporter does."""
    import msgspec

    encoder = msgspec.json.Encoder()
    steps = max(1, batch_rows // HTTP_ROWS_PER_STEP)
    out, rows = [], 0
    for b in range(batches):
        spans, marks = [], []
        for k in range(steps):
            n = b * steps + k
            _, s, m = step_rows(rank, n, start_ns + n * STEP_NS, None, 64, 20_000 + rank, "")
            spans += s
            marks += m
        body = encoder.encode({"schema_version": 1, "sdk_version": "0.1.0", "batch_id": uuid.uuid4().hex,
                               "created_ns": time.time_ns(), "spans": spans, "marks": marks, "snapshots": []})
        out.append(gzip.compress(body, compresslevel=6, mtime=0) if gz else body)
        rows += len(spans) + len(marks)
    return out, rows


# -- generator workers --------------------------------------------------------------------------


def _send_go_wait() -> None:
    print(json.dumps({"event": "ready"}), flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go")


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _run_senders(address: tuple[str, int], per_rank: dict[int, list[bytes]], paced: float | None,
                 seed: int) -> dict[str, Any]:
    """One thread and socket per rank; blast (paced None) or one frame per ``paced`` seconds."""
    done: dict[int, float] = {}
    errors: list[str] = []
    socks = {rank: _connect(address) for rank in per_rank}
    go = time.time()
    rng = random.Random(seed)
    offsets = {rank: rng.uniform(0, paced or 0) for rank in per_rank}

    def run(rank: int) -> None:
        try:
            sock = socks[rank]
            for k, frame in enumerate(per_rank[rank]):
                if paced:
                    delay = go + offsets[rank] + k * paced - time.time()
                    if delay > 0:
                        time.sleep(delay)
                sock.sendall(frame)
            done[rank] = time.time()
        except OSError as exc:
            errors.append(f"rank {rank}: {exc}")
        finally:
            socks[rank].close()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in per_rank]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"t_go": go, "t_last_sent": max(done.values()) if done else None, "errors": errors}


def _ranks_arg(text: str) -> list[int]:
    a, _, b = text.partition("-")
    return list(range(int(a), int(b) + 1))


def worker_gen_tcp(argv: list[str]) -> dict[str, Any]:
    """Generator process: frames of its ranks (stepwatch or traceml format), then sends them on 'go'."""
    p = argparse.ArgumentParser()
    p.add_argument("--address")
    p.add_argument("--ranks", type=_ranks_arg)
    p.add_argument("--frames", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--session")
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--format", default="stepwatch")
    p.add_argument("--wire", default="columns")
    p.add_argument("--paced", type=float, default=None)
    a = p.parse_args(argv)
    host, _, port = a.address.rpartition(":")
    started = time.perf_counter()
    start_ns = time.time_ns()
    per_rank, rows, nbytes = {}, 0, 0
    base = _base_events(a.session) if a.format == "stepwatch" else None
    for rank in a.ranks:
        if a.format == "stepwatch":
            frames, n = tcp_frames(rank, a.frames, a.steps, a.session, a.world, base, start_ns, a.wire)
        else:
            frames, n = traceml_frames(rank, a.frames, a.steps, a.session, a.world, start_ns)
        per_rank[rank] = frames
        rows += n
        nbytes += sum(len(f) for f in frames)
    gen_s = time.perf_counter() - started
    _send_go_wait()
    times = os.times()
    result = _run_senders((host, int(port)), per_rank, a.paced, seed=a.ranks[0])
    after = os.times()
    send_cpu_s = after.user + after.system - times.user - times.system
    return {"rows": rows, "bytes": nbytes, "gen_s": gen_s, "send_cpu_s": send_cpu_s, **result}


def worker_gen_http(argv: list[str]) -> dict[str, Any]:
    """Generator process: HTTP clients, each POSTing the batches of its ranks on one keep-alive connection."""
    p = argparse.ArgumentParser()
    p.add_argument("--address")
    p.add_argument("--ranks", type=_ranks_arg)
    p.add_argument("--clients", type=int)
    p.add_argument("--batches", type=int)
    p.add_argument("--batch-rows", type=int)
    p.add_argument("--session")
    p.add_argument("--no-gzip", action="store_true")
    a = p.parse_args(argv)
    host, _, port = a.address.rpartition(":")
    started = time.perf_counter()
    start_ns = time.time_ns()
    queues: list[list[bytes]] = [[] for _ in range(a.clients)]
    rows = nbytes = 0
    for i, rank in enumerate(a.ranks):
        bodies, n = http_bodies(rank, a.batches, a.batch_rows, not a.no_gzip, start_ns)
        queues[i % a.clients].extend(bodies)
        rows += n
        nbytes += sum(len(b) for b in bodies)
    for q in queues:  # interleave the ranks of a client the way their seals would arrive
        random.Random(len(q)).shuffle(q)
    gen_s = time.perf_counter() - started
    headers = {"Content-Type": "application/json", "X-Stepwatch-Session-Id": a.session}
    if not a.no_gzip:
        headers["Content-Encoding"] = "gzip"
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def client(bodies: list[bytes]) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            for body in bodies:
                while True:
                    t0 = time.perf_counter()
                    conn.request("POST", "/v1/traces", body=body, headers=headers)
                    resp = conn.getresponse()
                    resp.read()
                    elapsed = time.perf_counter() - t0
                    with lock:
                        statuses[resp.status] = statuses.get(resp.status, 0) + 1
                        latencies.append(elapsed)
                    if resp.status == 429:
                        time.sleep(float(resp.getheader("Retry-After") or 1))
                        continue
                    break
        except (OSError, http.client.HTTPException) as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()

    _send_go_wait()
    go = time.time()
    threads = [threading.Thread(target=client, args=(q,)) for q in queues]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"rows": rows, "bytes": nbytes, "gen_s": gen_s, "t_go": go, "t_last_sent": time.time(),
            "requests": len(latencies), "statuses": statuses, "errors": errors,
            "latency_s": {"p50": pct(latencies, 50), "p99": pct(latencies, 99), "max": max(latencies, default=0)}}


def worker_runtime_probe(argv: list[str]) -> dict[str, Any]:
    """Rank E2E_RUNTIME_RANK under the real runtime: progress() and mark() at random instants."""
    p = argparse.ArgumentParser()
    p.add_argument("--address")
    p.add_argument("--out")
    p.add_argument("--session")
    p.add_argument("--samples", type=int)
    p.add_argument("--gap", type=float)
    p.add_argument("--spool-interval", type=float, default=2.0)
    a = p.parse_args(argv)
    import stepwatch

    stepwatch.init(out=a.out, interval=1.0, aggregator=a.address, session_id=a.session, rank=E2E_RUNTIME_RANK,
                   local_rank=0, world_size=64, handle_signals=False, auto_instrument=False,
                   spool_interval=a.spool_interval)
    _send_go_wait()
    rng = random.Random(62)
    for i in range(a.samples):
        time.sleep(rng.uniform(0.5 * a.gap, 1.5 * a.gap))
        t = time.time_ns()
        stepwatch.progress(1_000_000 + i, probe=i)
        stepwatch.mark("e2e_probe", i)
        print(json.dumps({"probe": "runtime", "i": i, "t_ns": t}), flush=True)
    time.sleep(1.5 + a.spool_interval)  # the last rows: one tick for progress, one spool seal for marks
    stepwatch.shutdown()
    return {"samples": a.samples}


def worker_sender_probe(argv: list[str]) -> dict[str, Any]:
    """Rank E2E_SENDER_RANK: rows appended at random instants, a FrameSender shipping once a second."""
    p = argparse.ArgumentParser()
    p.add_argument("--address")
    p.add_argument("--session")
    p.add_argument("--samples", type=int)
    p.add_argument("--gap", type=float)
    a = p.parse_args(argv)
    from stepwatch.transport.sender import FrameSender, parse_address

    sender = FrameSender(parse_address(a.address), {"session_id": a.session, "rank": E2E_SENDER_RANK,
                                                    "local_rank": 0, "world_size": 64, "host": "probe",
                                                    "pid": os.getpid(), "started_ns": time.time_ns()})
    pending: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def ship() -> None:
        next_tick = time.monotonic() + 1.0
        while not stop.is_set():
            stop.wait(max(0.0, next_tick - time.monotonic()))
            next_tick += 1.0
            with lock:
                rows = pending[:]
                pending.clear()
            sender.ship({"marks": rows})

    _send_go_wait()
    shipper = threading.Thread(target=ship, daemon=True)
    shipper.start()
    rng = random.Random(63)
    for i in range(a.samples):
        time.sleep(rng.uniform(0.5 * a.gap, 1.5 * a.gap))
        t = time.time_ns()
        with lock:
            pending.append({"id": uuid.uuid4().hex, "span_id": None, "name": "e2e_sender", "value_type": "int",
                            "value": i, "attrs": {}, "ts_ns": t, "kind": "point"})
        print(json.dumps({"probe": "sender", "i": i, "t_ns": t}), flush=True)
    time.sleep(1.5)
    stop.set()
    shipper.join()
    sender.close(2.0)
    return sender.stats()


def worker_profile(argv: list[str]) -> dict[str, Any]:
    """The aggregator's pipeline in one thread, stage by stage (best of 3), on the same frames:
    the typed fast path the aggregator takes (decode_typed, wire_tuples) and, for comparison,
    the general path (decode_body, to_rows, check_rows, row_tuples); SQLite with and without the
    secondary indexes; then cProfile over Aggregator.accept_body + append_tuples."""
    import cProfile
    import gc
    import pstats

    from _common import GcTimer, current_rss_bytes

    from stepwatch.server.aggregator import Aggregator
    from stepwatch.store.rows import check_rows, row_tuples, to_rows, wire_tuples
    from stepwatch.store.sqlite import _INDEXES, SqliteStore
    from stepwatch.transport.frames import decode_body, decode_typed

    p = argparse.ArgumentParser()
    p.add_argument("--dir")
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    sid = str(uuid.uuid4())
    base = _base_events(sid)
    start_ns = time.time_ns()
    frames: list[bytes] = []
    rows = 0
    for rank in range(a.ranks):
        f, n = tcp_frames(rank, a.frames, a.steps, sid, 64, base, start_ns)
        frames += f
        rows += n
    bodies = [f[4:] for f in frames]
    stages: dict[str, dict[str, float]] = {}
    counter = iter(range(1_000_000))

    def timed(name: str, fn: Any, setup: Any = None, repeat: int = 3) -> Any:
        best = None
        for _ in range(repeat):
            state = setup() if setup is not None else None
            gc.collect()
            with GcTimer() as timer:
                t0 = time.perf_counter()
                result = fn(state)
                elapsed = time.perf_counter() - t0
            if best is None or elapsed < best[0]:
                best = (elapsed, timer.seconds)
        stages[name] = {"us_per_row": best[0] / rows * 1e6, "gc_us_per_row": best[1] / rows * 1e6}
        return result

    def fresh_store(indexes: bool = True) -> Any:
        store = SqliteStore(Path(a.dir) / f"profile-{next(counter)}.sqlite")
        if not indexes:
            for statement in _INDEXES:
                store._db.execute(f"DROP INDEX {statement.split(' EXISTS ')[1].split()[0]}")
        return store

    typed = timed("fast: decode_typed (msgpack -> typed Structs)", lambda _: [decode_typed(b) for b in bodies])
    tuples = timed("fast: wire_tuples (Structs -> store tuples, JSON columns)",
                   lambda _: [wire_tuples(m["session_id"], m["rank"], t) for m, t in typed])
    messages = timed("general: decode_body (msgpack + shape checks)", lambda _: [decode_body(b) for b in bodies])
    converted = timed("general: to_rows (wire -> store dicts)",
                      lambda _: [to_rows(m.tables, m.meta["session_id"], m.meta["rank"]) for m in messages])

    def check(_: Any) -> None:
        for tables in converted:
            for table, table_rows in tables.items():
                check_rows(table, table_rows)

    timed("general: check_rows (per-column type checks)", check)
    timed("general: row_tuples (dicts -> tuples, JSON columns)",
          lambda _: [{t: row_tuples(t, r) for t, r in tables.items()} for tables in converted])
    params: dict[str, list[tuple[Any, ...]]] = {}
    for tables in tuples:
        for table, table_rows in tables.items():
            params.setdefault(table, []).extend(table_rows)
    stored_rows = sum(len(v) for v in params.values())

    def execute(store: Any) -> None:
        store.append_tuples(params)
        store.close()

    timed(f"append_tuples: executemany + COMMIT (fresh store, {len(_INDEXES)} indexes)", execute, setup=fresh_store)
    timed("append_tuples: executemany + COMMIT (fresh store, no secondary index)", execute,
          setup=lambda: fresh_store(False))
    gc.disable()
    t0 = time.perf_counter()
    for m, t in (decode_typed(b) for b in bodies):
        wire_tuples(m["session_id"], m["rank"], t)
    no_gc = time.perf_counter() - t0
    gc.enable()
    # the whole thing again through the real Aggregator, under cProfile
    store2 = fresh_store()
    agg = Aggregator(store2, flush_rows=1 << 62, pause_rows=1 << 62)
    gc.collect()
    rss0 = current_rss_bytes()
    for body in bodies:
        agg.accept_body(body)
    gc.collect()
    rss1 = current_rss_bytes()
    pending_bytes_per_row = (rss1 - rss0) / rows if rss0 and rss1 else None
    agg._take()
    profiler = cProfile.Profile()
    gc.collect()
    with GcTimer() as timer:
        profiler.enable()
        t0 = time.perf_counter()
        for body in bodies:
            agg.accept_body(body)
        t_accept = time.perf_counter() - t0
        store2.append_tuples(agg._take()[0])
        t_all = time.perf_counter() - t0
        profiler.disable()
    store2.close()
    listing_path = Path(a.dir) / "profile.txt"
    with listing_path.open("w") as handle:
        stats = pstats.Stats(profiler, stream=handle)
        stats.sort_stats("tottime").print_stats(16)
    listing = listing_path.read_text()
    return {"wire_rows": rows, "stored_rows": stored_rows, "frames": len(frames), "stages": stages,
            "decode_to_check_gc_off_us_per_row": no_gc / rows * 1e6,
            "accept_us_per_wire_row": t_accept / rows * 1e6, "all_us_per_wire_row": t_all / rows * 1e6,
            "all_gc_us_per_wire_row": timer.seconds / rows * 1e6, "pending_rss_bytes_per_wire_row": pending_bytes_per_row,
            "cprofile_tottime_top": listing[listing.find("   ncalls"):]}


WORKERS = {"gen-tcp": worker_gen_tcp, "gen-http": worker_gen_http, "runtime-probe": worker_runtime_probe,
           "sender-probe": worker_sender_probe, "profile": worker_profile}


# -- the parent: processes ----------------------------------------------------------------------


class Worker:
    """A generator or probe subprocess: ready line, 'go' on stdin, JSON result as its last line."""

    def __init__(self, name: str, args: list[str], log_dir: Path, on_line: Any = None) -> None:
        self.name = name
        self.err = (log_dir / f"{name}-{uuid.uuid4().hex[:6]}.stderr").open("w")
        self.proc = subprocess.Popen([PYTHON, str(SCRIPT), "--worker", name, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=REPO_ROOT)
        self.lines: list[str] = []
        self.on_line = on_line
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            if line == '{"event": "ready"}':
                self.ready.set()
                continue
            self.lines.append(line)
            if self.on_line is not None:
                try:
                    self.on_line(json.loads(line))
                except (ValueError, KeyError):
                    pass

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self, timeout: float) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise SystemExit(f"worker {self.name} did not finish in {timeout:.0f} s") from None
        self._reader.join(5)
        self.err.close()
        if code != 0 or not self.lines:
            raise SystemExit(f"worker {self.name} failed ({code}): {Path(self.err.name).read_text()[-3000:]}")
        return json.loads(self.lines[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_ready(workers: list[Worker], timeout: float) -> None:
    end = time.monotonic() + timeout
    for worker in workers:
        while not worker.ready.wait(0.2):
            if worker.proc.poll() is not None:
                raise SystemExit(f"worker {worker.name} exited: {Path(worker.err.name).read_text()[-3000:]}")
            if time.monotonic() > end:
                raise SystemExit(f"worker {worker.name} not ready in {timeout:.0f} s")


def split(ranks: list[int], parts: int) -> list[list[int]]:
    """Contiguous, nearly equal shares (each generator process gets a range of ranks)."""
    parts = max(1, min(parts, len(ranks)))
    return [ranks[i * len(ranks) // parts:(i + 1) * len(ranks) // parts] for i in range(parts)]


class StepwatchServer:
    """``python -c BOOT --out DIR --http-port 0``: ``python -m stepwatch.server`` with richer stats."""

    def __init__(self, out: Path, dashboard: bool = False, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        """``extra``: more of the server's arguments (``--store URL``); ``env``: added to this
        process's environment for it."""
        self.out = out
        self.err = (out.parent / f"{out.name}.stderr").open("w")
        started = time.perf_counter()
        extra = [*(["--ui-port", "0"] if dashboard else []), *(extra or [])]
        self.proc = subprocess.Popen([PYTHON, "-c", BOOT, "--out", str(out), "--http-port", "0", *extra],
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=REPO_ROOT,
                                     env={**os.environ, **(env or {})})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"aggregator did not start: {(out.parent / f'{out.name}.stderr').read_text()[-3000:]}")
        self.ready_s = time.perf_counter() - started
        self.ready = json.loads(line)
        self.tcp = self.ready["tcp"]
        host, _, port = self.ready["http"].rpartition(":")
        self.http = (host, int(port))
        self.pid = self.ready["pid"]
        self.db_path = out / "history.sqlite"

    def health(self) -> dict[str, Any] | None:
        try:
            conn = http.client.HTTPConnection(*self.http, timeout=5)
            conn.request("GET", "/healthz")
            body = conn.getresponse().read()
            conn.close()
            return json.loads(body)
        except (OSError, ValueError, http.client.HTTPException):
            return None

    def stop(self, timeout: float = 120) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise SystemExit("the stepwatch aggregator did not stop after SIGTERM") from None
        self.err.close()
        stats = json.loads((self.out / "aggregator_stats.json").read_text())
        return stats, time.perf_counter() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class TracemlServer:
    """TraceML's standalone aggregator process, as ``traceml run`` starts it (summary mode)."""

    def __init__(self, root: Path, session: str, world: int) -> None:
        import traceml_ai

        main = Path(traceml_ai.__file__).resolve().parent.parent / TRACEML_MAIN
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TRACEML_UI_MODE": "summary", "TRACEML_AGGREGATOR_PORT": "0",
               "TRACEML_LOGS_DIR": str(root / "logs"), "TRACEML_SESSION_ID": session,
               "TRACEML_EXPECTED_WORLD_SIZE": str(world), "TRACEML_FINALIZE_TIMEOUT_SEC": "120",
               "TRACEML_HISTORY_ENABLED": "1"}
        self.err_path = root / "aggregator.stderr"
        self.err = self.err_path.open("w")
        self.outf = (root / "aggregator.stdout").open("w")
        started = time.perf_counter()
        self.proc = subprocess.Popen([PYTHON, str(main)], env=env, stdout=self.outf, stderr=self.err, cwd=root)
        self.pid = self.proc.pid
        port = None
        while port is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"TraceML aggregator exited {self.proc.returncode}: {self.err_path.read_text()[-2000:]}")
            if time.perf_counter() - started > 120:
                self.kill()
                raise RuntimeError("TraceML aggregator not ready in 120 s")
            for line in self.err_path.read_text().splitlines():
                if "Aggregator ready on" in line:
                    port = int(line.split("Aggregator ready on", 1)[1].split()[0].rpartition(":")[2])
            time.sleep(0.05)
        self.ready_s = time.perf_counter() - started
        self.tcp = f"127.0.0.1:{port}"
        self.db_path = root / "logs" / session / "aggregator" / "telemetry"

    def stop(self, timeout: float = 180) -> float:
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.err.close()
        self.outf.close()
        return time.perf_counter() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class StoreCounter:
    """Read-only row counts of append-only tables: MAX(rowid) (= COUNT(*), at O(log n)); of
    stepwatch's ``<table>_rows`` under the view ``<table>`` where there is one."""

    def __init__(self, path: Path, tables: tuple[str, ...]) -> None:
        self.path = path
        self.tables = tables
        self.db: sqlite3.Connection | None = None

    def counts(self) -> dict[str, int]:
        if self.db is None:
            if not self.path.exists():
                return dict.fromkeys(self.tables, 0)
            self.db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
        try:
            names = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master")}
            physical = [f"{t}_rows" if f"{t}_rows" in names else t for t in self.tables]
            sql = "SELECT " + ", ".join(f"(SELECT MAX(rowid) FROM {t})" for t in physical)
            values = self.db.execute(sql).fetchone()
        except sqlite3.OperationalError:  # a table the writer has not created yet
            return dict.fromkeys(self.tables, 0)
        return {t: int(v or 0) for t, v in zip(self.tables, values)}

    def close(self) -> None:
        if self.db is not None:
            self.db.close()


def release(pid: int, workers: list[Worker], counter: StoreCounter, count_of: Any, expected: int, timeout: float,
            health: Any = None) -> tuple[float, dict[str, Any]]:
    """Lets every ready sender go at once and watches the store until ``expected`` rows are in:
    (the moment they went, ``monitor``'s figures)."""
    t_go = time.time()
    for worker in workers:
        worker.go()
    return t_go, monitor(pid, counter, count_of, expected, t_go, timeout, health=health, senders=workers)


def monitor(pid: int, counter: StoreCounter, count_of: Any, expected: int, t_go: float, timeout: float,
            health: Any = None, period: float = 0.25, senders: list[Worker] | None = None) -> dict[str, Any]:
    """Polls the store, the process and (optionally) its counters until ``expected`` rows are stored."""
    import psutil

    proc = psutil.Process(pid)
    cpu0 = sum(proc.cpu_times()[:2])
    threads0 = {t.id: t.user_time + t.system_time for t in proc.threads()}
    samples: list[tuple[float, int]] = []
    rss: list[int] = []
    healths: list[tuple[float, dict[str, Any]]] = []
    counts: dict[str, int] = {}
    end = t_go + timeout
    stalled_since = None
    while True:
        now = time.time()
        counts = counter.counts()
        n = count_of(counts)
        samples.append((now, n))
        try:
            rss.append(proc.memory_info().rss)
            cpu = sum(proc.cpu_times()[:2])
        except psutil.NoSuchProcess:
            raise SystemExit("the aggregator died during the run") from None
        if health is not None:
            h = health()
            if h is not None:
                healths.append((now, h))
        if n >= expected:
            break
        senders_done = senders is not None and all(w.proc.poll() is not None for w in senders)
        # A stepwatch write tick can hold a commit back for many seconds: while its counters say rows
        # are accepted but not yet written (or /healthz does not answer: its loop is busy), wait.
        writer_busy = health is not None and (not healths or healths[-1][0] != now
                                              or healths[-1][1]["rows_written"] < healths[-1][1]["rows_accepted"])
        if senders_done and len(samples) > 1 and samples[-2][1] == n and not writer_busy:
            stalled_since = stalled_since or now
            if now - stalled_since > (15 if health is not None else 60):
                break  # everything sent, nothing new for a while: rows were lost
        else:
            stalled_since = None
        if now > end:
            break
        time.sleep(period)
    wall = samples[-1][0] - t_go
    thread_cpu = {"main": 0.0, "other": 0.0}
    try:
        for t in proc.threads():
            thread_cpu["main" if t.id == pid else "other"] += t.user_time + t.system_time - threads0.get(t.id, 0.0)
    except psutil.NoSuchProcess:
        pass
    try:
        with open(f"/proc/{pid}/status") as handle:
            hwm = next((int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:")), None)
    except OSError:
        hwm = None
    return {"samples": samples, "counts": counts, "reached": samples[-1][1], "expected": expected,
            "rss_max": max(rss), "rss_start": rss[0], "rss_end": rss[-1], "vm_hwm": hwm,
            "cpu_s": cpu - cpu0, "cpu_pct_of_core": 100 * (cpu - cpu0) / wall if wall > 0 else None,
            "healths": healths, "wall_s": wall, "thread_cpu_s": thread_cpu}


# -- the parent: phases -------------------------------------------------------------------------


def run_tcp(args: argparse.Namespace, work: Path, fmt: str = "stepwatch") -> dict[str, Any]:
    rows_per_frame = args.steps_per_frame * ROWS_PER_STEP + 1
    total_rows = args.rows if fmt == "stepwatch" else args.traceml_rows
    frames = max(1, round(total_rows / (args.ranks * (rows_per_frame if fmt == "stepwatch"
                                                      else args.steps_per_frame * TRACEML_ROWS_PER_STEP))))
    out = work / f"{fmt}-tcp"
    session = str(uuid.uuid4()) if fmt == "stepwatch" else "bench"
    server: StepwatchServer | TracemlServer
    poller: DashboardPoller | None = None
    if fmt == "stepwatch":
        server = StepwatchServer(out, dashboard=args.dashboard)
        counter = StoreCounter(server.db_path, STEPWATCH_TABLES)
        if args.dashboard:
            poller = DashboardPoller(server.ready["ui"], session)
    else:
        server = TracemlServer(out, session, args.ranks)
        counter = StoreCounter(server.db_path, TRACEML_TABLES)
    print(f"  aggregator pid {server.pid} ready in {server.ready_s:.2f} s on {server.tcp}", flush=True)
    workers: list[Worker] = []
    try:
        rss_idle = _rss(server.pid)
        for ranks in split(list(range(args.ranks)), args.gen_procs):
            workers.append(Worker("gen-tcp", ["--address", server.tcp, "--ranks", f"{ranks[0]}-{ranks[-1]}",
                                              "--frames", str(frames), "--steps", str(args.steps_per_frame),
                                              "--session", session, "--world", str(args.ranks), "--format", fmt,
                                              "--wire", args.wire],
                                  work))
        gen_started = time.perf_counter()
        wait_ready(workers, 600)
        gen_s = time.perf_counter() - gen_started
        time.sleep(1.0)  # let the generators' exit from generation settle
        steps_expected = args.ranks * frames * args.steps_per_frame
        if fmt == "stepwatch":
            expected = args.ranks * frames * rows_per_frame
            count_of = lambda c: c["telemetry"] + c["spans"] + c["marks"] + c["heartbeats"]  # noqa: E731
        else:
            expected = steps_expected * TRACEML_ROWS_PER_STEP
            count_of = lambda c: sum(c.values())  # noqa: E731
        if poller is not None:
            poller.start()
        t_go, mon = release(server.pid, workers, counter, count_of, expected, args.timeout,
                            health=server.health if fmt == "stepwatch" else None)
        if poller is not None:
            poller.stop()
            poller.process_cpu_s = _cpu_s(server.ready.get("ui_pid"))
        results = [w.result(60) for w in workers]
        counter.close()
        if fmt == "stepwatch":
            stats, stop_s = server.stop()
        else:
            stats, stop_s = None, server.stop()
    finally:
        for worker in workers:
            worker.kill()
        server.kill()
    sent_done = max((r["t_last_sent"] or 0) for r in results)
    rate = rate_stats(mon["samples"], expected, t_go)
    out_stats: dict[str, Any] = {
        "format": fmt, "ranks": args.ranks, "frames_per_rank": frames, "steps_per_frame": args.steps_per_frame,
        "wire_rows": expected, "steps": steps_expected, "gen_s": gen_s, "frame_bytes": sum(r["bytes"] for r in results),
        "ready_s": server.ready_s, "stop_s": stop_s, "rss_idle": rss_idle,
        "sent_all_s": sent_done - t_go, "errors": [e for r in results for e in r["errors"]],
        **{k: v for k, v in mon.items() if k not in ("samples", "healths")}, **rate,
        "samples": [(round(t - t_go, 3), n) for t, n in mon["samples"]],
    }
    if mon["reached"] < expected:
        out_stats["lost_rows"] = expected - mon["reached"]
    if poller is not None:
        out_stats["dashboard"] = poller.figures()
    if fmt == "traceml":  # its reader threads decode every frame into an unbounded queue as it arrives
        out_stats["intake_all_s"] = sent_done - t_go
    if fmt == "stepwatch":
        out_stats["aggregator_stats"] = {k: v for k, v in stats.items() if k != "bench_batches"}
        out_stats["batches"] = batch_stats(stats.get("bench_batches") or [])
        out_stats["pending_max"] = max((h.get("bench_pending_rows", 0) for _, h in mon["healths"]), default=None)
        accepted = [(t, h["rows_accepted"]) for t, h in mon["healths"]]
        total_accepted = stats["rows_accepted"]
        t_acc = time_at(accepted, total_accepted)
        out_stats["intake_all_s"] = None if t_acc is None else t_acc - t_go
        out_stats["health_samples"] = [(round(t - t_go, 3), h["rows_accepted"], h["rows_written"],
                                        h.get("bench_pending_rows"), h["last_batch_rows"],
                                        round(h["mean_batch_seconds"], 4)) for t, h in mon["healths"]]
    return out_stats


class DashboardPoller:
    """A dashboard page open on the run while it ingests (``--dashboard``): it loads the run page's
    data once it exists, then asks for what is new every second, as the page does (reloading the
    data when the page would: too many new steps at once)."""

    def __init__(self, url: str, session: str) -> None:
        parsed = urllib.parse.urlparse(url)
        self.address = (parsed.hostname, parsed.port)
        self.session = session
        self.done = threading.Event()
        self.loads: list[float] = []
        self.polls: list[float] = []
        self.errors: list[str] = []
        self.process_cpu_s: float | None = None  # the dashboard's own process (ready line's ui_pid), if it has one
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(*self.address, timeout=120)
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        conn.close()
        return response.status, body

    def _run(self) -> None:
        cursor: dict[str, Any] | None = None
        while not self.done.wait(1.0):
            started = time.perf_counter()
            try:
                if cursor is None:
                    status, body = self._get(f"/api/run/{self.session}")
                    if status == 200:
                        cursor = json.loads(body)["cursor"]
                        self.loads.append(time.perf_counter() - started)
                    continue
                query = urllib.parse.quote(json.dumps(cursor))
                status, body = self._get(f"/api/run/{self.session}/updates?cursor={query}")
                update = json.loads(body)
                self.polls.append(time.perf_counter() - started)
                cursor = None if update.get("reload") else update.get("cursor", cursor)
            except (OSError, ValueError, http.client.HTTPException) as exc:
                self.errors.append(str(exc)[:200])

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(180)

    def figures(self) -> dict[str, Any]:
        return {"page_loads": len(self.loads), "load_s_p50": pct(self.loads, 50) if self.loads else None,
                "polls": len(self.polls), "poll_s_p50": pct(self.polls, 50) if self.polls else None,
                "errors": self.errors[:5], "process_cpu_s": self.process_cpu_s}


def batch_stats(batches: list[list[float]]) -> dict[str, Any]:
    full = [(int(r), s) for r, s in batches if r > 0]
    if not full:
        return {"n": 0}
    rows = [r for r, _ in full]
    secs = [s for _, s in full]
    return {"n": len(full), "rows_p50": pct(rows, 50), "rows_p90": pct(rows, 90), "rows_max": max(rows),
            "s_p50": pct(secs, 50), "s_p99": pct(secs, 99), "s_max": max(secs),
            "write_rows_per_s": sum(rows) / sum(secs), "us_per_row_p50": pct([s / r * 1e6 for r, s in full], 50)}


def run_http(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ranks = 64
    steps_per_batch = max(1, args.http_batch // HTTP_ROWS_PER_STEP)
    rows_per_batch = steps_per_batch * HTTP_ROWS_PER_STEP
    batches = max(1, round(args.http_rows / (ranks * rows_per_batch)))
    session = str(uuid.uuid4())
    server = StepwatchServer(work / "stepwatch-http")
    counter = StoreCounter(server.db_path, STEPWATCH_TABLES)
    print(f"  aggregator pid {server.pid} ready in {server.ready_s:.2f} s, HTTP on {server.http}", flush=True)
    workers: list[Worker] = []
    procs = max(1, min(args.gen_procs, args.http_clients))
    try:
        for i, part in enumerate(split(list(range(ranks)), procs)):
            clients = args.http_clients // procs + (1 if i < args.http_clients % procs else 0)
            extra = [] if args.http_gzip else ["--no-gzip"]
            workers.append(Worker("gen-http", ["--address", f"{server.http[0]}:{server.http[1]}",
                                               "--ranks", f"{part[0]}-{part[-1]}", "--clients", str(clients),
                                               "--batches", str(batches), "--batch-rows", str(args.http_batch),
                                               "--session", session, *extra], work))
        gen_started = time.perf_counter()
        wait_ready(workers, 600)
        gen_s = time.perf_counter() - gen_started
        time.sleep(1.0)
        expected = ranks * batches * rows_per_batch
        t_go, mon = release(server.pid, workers, counter, lambda c: c["spans"] + c["marks"], expected, args.timeout,
                            health=server.health)
        results = [w.result(120) for w in workers]
        counter.close()
        stats, stop_s = server.stop()
    finally:
        for worker in workers:
            worker.kill()
        server.kill()
    statuses: dict[str, int] = {}
    for r in results:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return {"clients": args.http_clients, "ranks": ranks, "batches": ranks * batches, "rows_per_batch": rows_per_batch,
            "gzip": args.http_gzip, "wire_rows": expected, "body_bytes": sum(r["bytes"] for r in results),
            "gen_s": gen_s, "intake_all_s": max(r["t_last_sent"] for r in results) - t_go, "statuses": statuses, "errors": [e for r in results for e in r["errors"]],
            "request_latency_p50_worst": max(r["latency_s"]["p50"] for r in results),
            "request_latency_p99_worst": max(r["latency_s"]["p99"] for r in results),
            **{k: v for k, v in mon.items() if k not in ("samples", "healths")},
            **rate_stats(mon["samples"], expected, t_go), "stop_s": stop_s,
            "aggregator_stats": {k: v for k, v in stats.items() if k != "bench_batches"},
            "batches_written": batch_stats(stats.get("bench_batches") or []),
            "pending_max": max((h.get("bench_pending_rows", 0) for _, h in mon["healths"]), default=None)}


def run_e2e(args: argparse.Namespace, work: Path, steps_per_frame: int) -> dict[str, Any]:
    session = str(uuid.uuid4())
    server = StepwatchServer(work / f"stepwatch-e2e-{steps_per_frame}")
    print(f"  aggregator pid {server.pid} ready in {server.ready_s:.2f} s", flush=True)
    gap = 1.0 / args.e2e_rate
    duration = args.e2e_samples * gap + 8
    appended: dict[tuple[str, int], int] = {}
    seen: dict[tuple[str, int], int] = {}
    lock = threading.Lock()

    def on_line(record: dict[str, Any]) -> None:
        if "probe" in record:
            with lock:
                if record["probe"] == "runtime":
                    appended[("progress", record["i"])] = record["t_ns"]
                    appended[("mark", record["i"])] = record["t_ns"]
                else:
                    appended[("sender", record["i"])] = record["t_ns"]

    workers: list[Worker] = []
    background_ranks = list(range(E2E_RUNTIME_RANK))
    probe_out = work / f"e2e-probe-run-{steps_per_frame}"
    poll_durations: list[float] = []
    try:
        for ranks in split(background_ranks, args.gen_procs):
            workers.append(Worker("gen-tcp", ["--address", server.tcp, "--ranks", f"{ranks[0]}-{ranks[-1]}",
                                              "--frames", str(int(duration) + 2), "--steps",
                                              str(steps_per_frame), "--session", session,
                                              "--paced", "1.0"], work))
        probes = [Worker("runtime-probe", ["--address", server.tcp, "--out", str(probe_out), "--session", session,
                                           "--samples", str(args.e2e_samples), "--gap", str(gap),
                                           "--spool-interval", str(args.e2e_spool_interval)], work, on_line),
                  Worker("sender-probe", ["--address", server.tcp, "--session", session,
                                          "--samples", str(args.e2e_samples), "--gap", str(gap)], work, on_line)]
        workers += probes
        wait_ready(workers, 600)
        t_go = time.time()
        for worker in workers:
            worker.go()
        db = None
        last_hb = last_mark = 0
        end = time.time() + duration + 30
        want = 3 * args.e2e_samples
        import psutil

        proc = psutil.Process(server.pid)
        cpu0 = sum(proc.cpu_times()[:2])
        rss_max = 0
        while time.time() < end and len(seen) < want:
            time.sleep(0.01)
            if db is None:
                if not server.db_path.exists():
                    continue
                db = sqlite3.connect(f"{server.db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
            t0 = time.perf_counter()
            hb = db.execute("SELECT rowid, rank, msg, step FROM heartbeats_rows WHERE rowid > ?", (last_hb,)).fetchall()
            mk = db.execute("SELECT rowid, rank, name, value_num FROM marks_rows WHERE rowid > ?", (last_mark,)).fetchall()
            now = time.time_ns()
            poll_durations.append(time.perf_counter() - t0)
            if hb:
                last_hb = hb[-1][0]
            if mk:
                last_mark = mk[-1][0]
            for _, rank, msg, step in hb:
                if rank == E2E_RUNTIME_RANK and msg == "progress" and step >= 1_000_000:
                    seen.setdefault(("progress", step - 1_000_000), now)
            for _, rank, name, value in mk:
                if name == "e2e_probe" and rank == E2E_RUNTIME_RANK:
                    seen.setdefault(("mark", int(value)), now)
                elif name == "e2e_sender" and rank == E2E_SENDER_RANK:
                    seen.setdefault(("sender", int(value)), now)
            if len(poll_durations) % 50 == 0:
                rss_max = max(rss_max, proc.memory_info().rss)
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        wall = time.time() - t_go
        if db is not None:
            db.close()
        bg_rows = 0
        for worker in workers:
            result = worker.result(duration + 60)
            bg_rows += result.get("rows", 0)
        stats, _ = server.stop()
    finally:
        for worker in workers:
            worker.kill()
        server.kill()
    out: dict[str, Any] = {"samples_requested": args.e2e_samples, "append_rate_per_s": args.e2e_rate,
                           "spool_interval_s": args.e2e_spool_interval,
                           "background_steps_per_frame": steps_per_frame,
                           "background_ranks": len(background_ranks),
                           "background_rows_per_s": bg_rows / (int(duration) + 2),
                           "poll_p50_ms": pct(poll_durations, 50) * 1e3, "poll_p99_ms": pct(poll_durations, 99) * 1e3,
                           "aggregator_cpu_pct_of_core": 100 * cpu / wall, "aggregator_rss_max": rss_max,
                           "batches": batch_stats(stats.get("bench_batches") or []), "probes": {}}
    for kind in ("progress", "mark", "sender"):
        lat = [(seen[k] - appended[k]) / 1e9 for k in appended if k[0] == kind and k in seen]
        missing = sum(1 for k in appended if k[0] == kind and k not in seen)
        out["probes"][kind] = {"n": len(lat), "missing": missing, "p50_s": pct(lat, 50), "p90_s": pct(lat, 90),
                               "p99_s": pct(lat, 99), "max_s": max(lat, default=float("nan")),
                               "min_s": min(lat, default=float("nan"))}
    return out


def run_profile(work: Path) -> dict[str, Any]:
    command = [PYTHON, str(SCRIPT), "--worker", "profile", "--dir", str(work)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (None: no such process)."""
    if not pid:
        return None
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)
    except Exception:  # noqa: BLE001 - gone, or no psutil: the figure is left out
        return None


def _rss(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:  # noqa: BLE001
        return None


# -- output -------------------------------------------------------------------------------------


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else format_rate(x)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    rows = []
    for key, label in (("tcp", "stepwatch TCP frames"), ("http", "stepwatch HTTP /v1/traces"),
                       ("traceml", "TraceML TCP (summary mode)")):
        r = results.get(key)
        if r is None or "error" in r:
            continue
        per_step = {"tcp": ROWS_PER_STEP + 1 / args.steps_per_frame, "http": HTTP_ROWS_PER_STEP,
                    "traceml": TRACEML_ROWS_PER_STEP}[key]
        intake = r.get("intake_all_s")
        gap = r.get("max_commit_gap_s")
        rows.append([label, f"{r['wire_rows']:,}", fmt_rate(r["overall_rows_per_s"]),
                     fmt_rate(r["overall_rows_per_s"] / per_step), fmt_rate(r["steady_rows_per_s"]), r["commits_seen"],
                     "-" if intake is None else f"{intake:.1f}",
                     f"{r['done_s']:.1f}" if r["done_s"] else "not all", "-" if gap is None else f"{gap:.1f}",
                     f"{r['cpu_pct_of_core']:.0f}", mib(r.get("rss_idle", None)), mib(r["rss_max"]),
                     f"{r['ready_s']:.2f}" if "ready_s" in r else "-", f"{r['stop_s']:.1f}"])
    if rows:
        print("Ingest: rows stored per second from 'go' until the last row is readable (wire rows: stepwatch "
              "telemetry+spans+marks+heartbeats, TraceML process+step_time+step_memory); 'steady' is the rate "
              "between 10% and 90% stored, shown only when >= 5 commits fall inside it")
        print_table(["contender", "rows", "rows/s", "steps/s", "steady 10-90%", "commits seen", "all accepted s",
                     "all stored s",
                     "max commit gap s", "CPU %core", "RSS idle MiB", "RSS max MiB", "ready s", "stop s"], rows)
        print()
    dashboard = (results.get("tcp") or {}).get("dashboard")
    if dashboard:
        print(f"dashboard open during the TCP phase: {dashboard['page_loads']} page loads (median "
              f"{dashboard['load_s_p50'] or 0:.2f} s), {dashboard['polls']} update polls (median "
              f"{dashboard['poll_s_p50'] or 0:.3f} s), errors {dashboard['errors'] or 'none'}; "
              + (f"the dashboard's process used {dashboard['process_cpu_s']:.1f} s of CPU"
                 if dashboard.get("process_cpu_s") is not None else "served from the aggregator's process"))
        print()
    tcp = results.get("tcp")
    if tcp:
        b = tcp["batches"]
        stats = tcp["aggregator_stats"]
        print(f"stepwatch TCP: {tcp['ranks']} ranks x {tcp['frames_per_rank']} frames x {tcp['steps_per_frame']} steps; "
              f"{tcp['frame_bytes'] / 2**20:.0f} MiB of frames ({tcp['frame_bytes'] / tcp['wire_rows']:.0f} B/row), "
              f"generated in {tcp['gen_s']:.1f} s; the generators' sendall() returned after {tcp['sent_all_s']:.1f} s "
              f"(the kernel's socket buffers), all accepted after {tcp['intake_all_s'] or float('nan'):.1f} s, all stored after "
              f"{tcp['done_s'] or float('nan'):.1f} s")
        if b.get("n"):
            print(f"  write ticks (aggregator_stats + bench patch): {b['n']} non-empty; rows per tick p50 {b['rows_p50']:,} "
                  f"p90 {b['rows_p90']:,} max {b['rows_max']:,}; seconds per tick p50 {b['s_p50']:.3f} p99 "
                  f"{b['s_p99']:.3f} max {b['s_max']:.3f}; writer alone {format_rate(b['write_rows_per_s'])} "
                  f"({b['us_per_row_p50']:.1f} us/stored row p50)")
        print(f"  pending rows max (polled) {tcp['pending_max']:,}; aggregator_stats: rows_accepted "
              f"{stats['rows_accepted']:,}, rows_written {stats['rows_written']:,}, frames {stats['frames_accepted']:,}, "
              f"rejected {stats['rejected']}, last_batch_rows {stats['last_batch_rows']:,}, mean_batch_seconds "
              f"{stats['mean_batch_seconds']:.3f}")
        print(f"  aggregator CPU by thread over the run: event loop (main) {tcp['thread_cpu_s']['main']:.1f} s, "
              f"other threads (the store writer) {tcp['thread_cpu_s']['other']:.1f} s, of {tcp['wall_s']:.1f} s wall; "
              f"cyclic GC {stats.get('bench_gc_seconds', float('nan')):.2f} s in "
              f"{stats.get('bench_gc_collections', 0):,} collections")
        if tcp.get("lost_rows"):
            print(f"  ROWS MISSING from the store: {tcp['lost_rows']:,}")
        print()
    http_r = results.get("http")
    if http_r:
        b = http_r["batches_written"]
        print(f"stepwatch HTTP: {http_r['clients']} clients, {http_r['batches']:,} batches of {http_r['rows_per_batch']} "
              f"spans+marks ({'gzip' if http_r['gzip'] else 'identity'}, {http_r['body_bytes'] / 2**20:.0f} MiB); "
              f"statuses {http_r['statuses']}; request latency p50 {http_r['request_latency_p50_worst'] * 1e3:.0f} ms, "
              f"p99 {http_r['request_latency_p99_worst'] * 1e3:.0f} ms (worst client process)")
        print(f"  aggregator CPU by thread: event loop {http_r['thread_cpu_s']['main']:.1f} s, other threads "
              f"{http_r['thread_cpu_s']['other']:.1f} s, of {http_r['wall_s']:.1f} s wall; cyclic GC "
              f"{http_r['aggregator_stats'].get('bench_gc_seconds', float('nan')):.2f} s")
        if b.get("n"):
            print(f"  write ticks: {b['n']}; rows per tick p50 {b['rows_p50']:,} max {b['rows_max']:,}; seconds p50 "
                  f"{b['s_p50']:.3f} p99 {b['s_p99']:.3f}; writer alone {format_rate(b['write_rows_per_s'])}; "
                  f"pending max {http_r['pending_max']:,}")
        print()
    for e2e in results.get("e2e") or []:
        b = e2e["batches"]
        print(f"End-to-end latency, append in a rank -> readable in history.sqlite: {e2e['background_ranks']} "
              f"background ranks at {format_rate(e2e['background_rows_per_s'])} wire rows (1 frame/s of "
              f"{e2e['background_steps_per_frame'] * ROWS_PER_STEP + 1} rows each); reader polls every 10 ms, poll p99 "
              f"{e2e['poll_p99_ms']:.1f} ms; aggregator CPU {e2e['aggregator_cpu_pct_of_core']:.0f}% of a core, RSS max "
              f"{mib(e2e['aggregator_rss_max'])} MiB; write ticks {b.get('n', 0)}, rows p50 {b.get('rows_p50', 0):,}, "
              f"seconds p50 {b.get('s_p50', 0):.3f} p99 {b.get('s_p99', 0):.3f}")
        labels = {"progress": "runtime progress() -> heartbeats (1 s tick)",
                  "mark": f"runtime mark() -> marks (spool seal, {e2e.get('spool_interval_s', 2.0):g} s)",
                  "sender": "FrameSender.ship() every 1 s -> marks"}
        print_table(["row", "n", "p50 s", "p90 s", "p99 s", "max s", "missing"],
                    [[labels[k], v["n"], f"{v['p50_s']:.3f}", f"{v['p90_s']:.3f}", f"{v['p99_s']:.3f}",
                      f"{v['max_s']:.3f}", v["missing"]] for k, v in e2e["probes"].items()])
        print()
    if results.get("traceml", {}).get("error"):
        print(f"TraceML: {results['traceml']['error']}\n")
    prof = results.get("profile")
    if prof:
        print(f"Pipeline in one thread, cProfile off ({prof['wire_rows']:,} wire rows, {prof['stored_rows']:,} stored "
              f"rows, {prof['frames']} frames; best of 3 per stage, cyclic GC on as in the server):")
        print_table(["stage", "us/wire row", "of which GC"],
                    [[k, f"{v['us_per_row']:.2f}", f"{v['gc_us_per_row']:.2f}"] for k, v in prof["stages"].items()])
        print(f"decode_typed+wire_tuples with the GC disabled: {prof['decode_to_check_gc_off_us_per_row']:.2f} us/row")
        if prof.get("pending_rss_bytes_per_wire_row"):
            print(f"RSS held per accepted, not yet written wire row (Aggregator._pending): "
                  f"{prof['pending_rss_bytes_per_wire_row']:.0f} B")
        print(f"Aggregator.accept_body(...) under cProfile {prof['accept_us_per_wire_row']:.2f} us/row; with "
              f"append_tuples {prof['all_us_per_wire_row']:.2f} us/row, GC {prof['all_gc_us_per_wire_row']:.2f} us/row")
        print(prof["cprofile_tottime_top"])
    if tcp:
        sustained = tcp["overall_rows_per_s"] or 0
        print(f"Target >= {format_rate(TARGET_ROWS_PER_S)} sustained over TCP: "
              f"{'met' if sustained >= TARGET_ROWS_PER_S else 'NOT MET'} ({fmt_rate(sustained)} from go to all stored)")
    for e2e in results.get("e2e") or []:
        for k, v in e2e["probes"].items():
            ok = v["p99_s"] <= TARGET_E2E_P99_S and not v["missing"]
            print(f"Target e2e p99 <= {TARGET_E2E_P99_S:.0f} s at {format_rate(e2e['background_rows_per_s'])} background, "
                  f"{k}: {'met' if ok else 'NOT MET'} ({v['p99_s']:.3f} s, {v['missing']} missing)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--rows", type=int, default=600_000, help="wire rows sent over TCP (default 600000)")
    parser.add_argument("--steps-per-frame", type=int, default=20, help="training steps per frame (default 20)")
    parser.add_argument("--gen-procs", type=int, default=4, help="generator processes (default 4)")
    parser.add_argument("--http-rows", type=int, default=300_000)
    parser.add_argument("--http-clients", type=int, default=16)
    parser.add_argument("--http-batch", type=int, default=1000, help="records per spool batch (default 1000)")
    parser.add_argument("--no-http-gzip", dest="http_gzip", action="store_false")
    parser.add_argument("--e2e-samples", type=int, default=80)
    parser.add_argument("--e2e-rate", type=float, default=2.5, help="appends per second per probe (default 2.5)")
    parser.add_argument("--e2e-steps-per-frame", default="10,30",
                        help="background load(s): steps in each background rank's 1 Hz frame, comma-separated; "
                             "one e2e run each (default 10,30: 91 and 271 rows a frame, ~5.6k and ~16.8k rows/s)")
    parser.add_argument("--e2e-spool-interval", type=float, default=2.0,
                        help="the probe runtime's spool_interval: marks ship when the spool seals (default 2.0, "
                             "the runtime's default)")
    parser.add_argument("--traceml-rows", type=int, default=300_000)
    parser.add_argument("--timeout", type=float, default=180, help="seconds allowed per ingest phase")
    parser.add_argument("--only", default="tcp,http,e2e,traceml")
    parser.add_argument("--wire", choices=("columns", "rows"), default="columns",
                        help="table layout of the TCP frames: columnar as FrameSender sends it (default), "
                             "or row maps as older senders do")
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--keep-data", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--dashboard", action="store_true",
                        help="tcp: the aggregator serves the dashboard (--ui-port; a child process) with a page open on the run, "
                             "loading its data and polling for updates every second")
    args = parser.parse_args()
    phases = [p.strip() for p in args.only.split(",") if p.strip()]
    header = machine_header(args.tmp_dir)
    print_header(f"aggregator ingest: {args.ranks} ranks over TCP, HTTP batches, e2e latency, TraceML", header)
    work = Path(tempfile.mkdtemp(prefix="bench-ingest-", dir=args.tmp_dir))
    results: dict[str, Any] = {}
    try:
        for phase in phases:
            started = time.perf_counter()
            print(f"{phase} ...", flush=True)
            if phase == "tcp":
                results["tcp"] = run_tcp(args, work)
            elif phase == "http":
                results["http"] = run_http(args, work)
            elif phase == "e2e":
                results["e2e"] = [run_e2e(args, work, int(n)) for n in str(args.e2e_steps_per_frame).split(",")]
            elif phase == "traceml":
                try:
                    results["traceml"] = run_tcp(args, work, fmt="traceml")
                except (ImportError, RuntimeError) as exc:
                    results["traceml"] = {"error": f"could not be driven: {exc}"}
            else:
                raise SystemExit(f"unknown phase {phase!r}")
            print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
        if args.profile:
            print("profile ...", flush=True)
            results["profile"] = run_profile(work)
    finally:
        if args.keep_data:
            print(f"data kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    report(results, args)
    header["load_average_at_end"] = load_average()
    print(f"load average at end: {header['load_average_at_end']}")
    path = write_results("ingest", {"header": header, "args": vars(args) | {"tmp_dir": str(args.tmp_dir)},
                                    "results": results})
    print(f"raw results: {path}")


if __name__ == "__main__":
    if not worker_main(WORKERS, sys.argv[1:]):
        main()
