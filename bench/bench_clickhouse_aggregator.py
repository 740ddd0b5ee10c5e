"""Ingest from simulated ranks through the aggregator into a real ClickHouse server, against the
same load into today's ``history.sqlite``, in one run (issue 23 §5).

Usage::

    .venv/bin/python bench/bench_clickhouse_aggregator.py [--ranks 64] [--rows 600000]
        [--steps-per-frame 20] [--gen-procs 2] [--stores sqlite,clickhouse]
        [--url clickhouse://default@127.0.0.1:PORT/db --server-pid PID] [--tmp-dir DIR]

The rank simulation is ``bench_ingest.py``'s ``tcp`` phase (its ``gen-tcp`` workers: one thread
and socket per rank, frames built and encoded before the clock starts, then sent as fast as the
aggregator reads them; a training step is 9 wire rows and the store derives a tenth, the
``steps`` row). For each store a fresh aggregator (``python -m stepwatch.server --out DIR
[--store URL]``, with ``bench_ingest.BOOT``'s extra counters) takes ``--rows`` wire rows.

Measured, for each store: rows/s stored (the store's own count: ``MAX(rowid)`` on SQLite,
``count()`` of the ``*_rows`` tables on ClickHouse, polled every 0.25 s), the aggregator's CPU
time split into its event-loop thread (frame decode and the tick) and its other threads (the
SQLite writer; or the ClickHouse feed: the columnar encode in ``clickhouse-driver`` and the
socket), its peak RSS, the ClickHouse server's CPU time (``/proc/<pid>/stat``), the generator
processes' CPU while sending, and the load average. From the CPU seconds per stored row of every
process the run needs, the rows/s two cores could reach with nothing else on the machine (the
ceiling this design has on this machine, whatever the scheduling).

Without ``--url`` a private Debian ``clickhouse-server`` (18.16) is started from ``--tmp-dir`` as
the tests' fixture starts it (``tests/support/clickhouse.py``) and stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ingest as ingest
from _common import REPO_ROOT, load_average, machine_header, print_header, process_cpu_seconds, run_worker, worker_main

PYTHON = sys.executable
WIRE_TABLES = ("telemetry", "spans", "marks", "heartbeats")
TARGET_ROWS_PER_S = 1_000_000
TICK_ROWS = 2_700  # rows of a tick batch the feed wrote under 64 paced ranks (bench_clickhouse_spill_memory.py)


class Aggregator(ingest.StepwatchServer):
    """``python -c BOOT --out DIR --http-port 0 [--store URL]``: the aggregator ``serve`` runs."""

    def __init__(self, out: Path, store_url: str | None, env: dict[str, str] | None = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        super().__init__(out, extra=["--store", store_url] if store_url else [], env=env)

    def stop(self, timeout: float = 300) -> tuple[dict[str, Any], float]:
        started = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise SystemExit("the aggregator did not stop after SIGTERM") from None
        self.err.close()
        return json.loads((self.out / "aggregator_stats.json").read_text()), time.perf_counter() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ClickHouseCounter:
    """Rows of each table the server holds now (``count()`` of the ``*_rows`` tables: MergeTree
    answers it from part metadata, a few ms)."""

    def __init__(self, url: str, tables: tuple[str, ...]) -> None:
        from stepwatch.store.clickhouse_url import parse_clickhouse_url

        self.url = parse_clickhouse_url(url)
        self.tables = tables
        self.client: Any = None

    def counts(self) -> dict[str, int]:
        import clickhouse_driver

        if self.client is None:
            self.client = clickhouse_driver.Client(self.url.host, port=self.url.port, user=self.url.user,
                                                   database="default", connect_timeout=5)
        sql = "SELECT " + ", ".join(f"(SELECT count() FROM {self.url.database}.{t}_rows)" for t in self.tables)
        try:
            values = self.client.execute(sql)[0]
        except Exception:  # noqa: BLE001 - the database or a table not made yet
            return dict.fromkeys(self.tables, 0)
        return {t: int(v) for t, v in zip(self.tables, values)}

    def close(self) -> None:
        if self.client is not None:
            self.client.disconnect()


def start_server(home: Path) -> Any:
    """A private ``clickhouse-server`` (tests/support/clickhouse.py's ``PrivateClickHouse``)."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.support.clickhouse import PrivateClickHouse

    return PrivateClickHouse(home)


def start_generators(tcp: str, args: argparse.Namespace, frames: int, session: str, work: Path) -> list[Any]:
    workers = []
    for ranks in ingest.split(list(range(args.ranks)), args.gen_procs):
        workers.append(ingest.Worker("gen-tcp", ["--address", tcp, "--ranks", f"{ranks[0]}-{ranks[-1]}",
                                                 "--frames", str(frames), "--steps", str(args.steps_per_frame),
                                                 "--session", session, "--world", str(args.ranks)], work))
    ingest.wait_ready(workers, 900)
    return workers


def run_store(kind: str, args: argparse.Namespace, work: Path, server: Any) -> dict[str, Any]:
    rows_per_frame = args.steps_per_frame * ingest.ROWS_PER_STEP + 1
    frames = max(1, round(args.rows / (args.ranks * rows_per_frame)))
    expected = args.ranks * frames * rows_per_frame
    session = str(uuid.uuid4())
    out = work / f"{kind}-agg"
    url = None
    server_pid = None
    if kind == "clickhouse":
        url = f"{args.url.rstrip('/').rpartition('/')[0]}/bench_agg_{uuid.uuid4().hex[:8]}"
        server_pid = args.server_pid
    aggregator = Aggregator(out, url)
    counter: Any = ClickHouseCounter(url, WIRE_TABLES) if url else ingest.StoreCounter(out / "history.sqlite",
                                                                                      ingest.STEPWATCH_TABLES)
    print(f"  {kind}: aggregator pid {aggregator.pid} ready in {aggregator.ready_s:.2f} s", flush=True)
    workers: list[Any] = []
    try:
        workers = start_generators(aggregator.tcp, args, frames, session, work)
        time.sleep(1.0)
        poll_cpu_per_s = 0.0
        if server_pid is not None:  # what the count() polls alone cost the server: 2 s of them, idle
            idle0, idle_t = process_cpu_seconds(server_pid), time.perf_counter()
            while time.perf_counter() - idle_t < 2.0:
                counter.counts()
                time.sleep(0.25)
            poll_cpu_per_s = (process_cpu_seconds(server_pid) - idle0) / (time.perf_counter() - idle_t)
        load_before = load_average()
        server_cpu0 = process_cpu_seconds(server_pid)
        t_go, mon = ingest.release(aggregator.pid, workers, counter, lambda c: sum(c[t] for t in WIRE_TABLES),
                                   expected, args.timeout, health=aggregator.health)
        server_cpu = process_cpu_seconds(server_pid) - server_cpu0
        load_after = load_average()
        results = [w.result(120) for w in workers]
        counter.close()
        stats, stop_s = aggregator.stop()
    finally:
        for worker in workers:
            worker.kill()
        aggregator.kill()
    rate = ingest.rate_stats(mon["samples"], expected, t_go)
    wall = mon["wall_s"]
    stored = mon["reached"]
    gen_cpu = sum(r["send_cpu_s"] for r in results)
    figures = {
        "store": kind, "rows_expected": expected, "rows_stored": stored, "wall_s": wall,
        "rows_per_s": stored / wall if wall > 0 else None, "rate": rate,
        "aggregator_cpu_s": mon["cpu_s"], "aggregator_thread_cpu_s": mon["thread_cpu_s"],
        "aggregator_rss_max": mon["rss_max"], "aggregator_vm_hwm": mon["vm_hwm"], "rss_start": mon["rss_start"],
        "server_cpu_s": server_cpu, "server_poll_cpu_s": poll_cpu_per_s * wall, "generator_send_cpu_s": gen_cpu,
        "load_before": load_before, "load_after": load_after, "stop_s": stop_s,
        "sent_all_s": max(r["t_last_sent"] or 0 for r in results) - t_go,
        "frame_bytes": sum(r["bytes"] for r in results),
        "spilled_rows": stats.get("store_spilled_rows"), "replayed_rows": stats.get("store_replayed_rows"),
        "degraded_episodes": stats.get("store_degraded_episodes"), "rows_lost": stats.get("rows_lost"),
        "gc_s": stats.get("bench_gc_seconds"), "mean_batch_s": stats.get("mean_batch_seconds"),
        "last_batch_rows": stats.get("last_batch_rows"),
    }
    return figures


def _cpu() -> float:
    return time.process_time()  # this process, every thread, at the clock's resolution (not 10 ms)


def worker_profile(argv: list[str]) -> dict[str, Any]:
    """argv: url, server pid, ranks, frames, steps. The ClickHouse path of one batch, stage by
    stage, in one thread: the aggregator's decode (``decode_typed`` + ``wire_tuples``, as its
    loop runs them), the store's column build (``clickhouse._column``), the driver's columnar
    INSERT of each table (client CPU: its encode and the socket; server CPU over the same call),
    the same rows through ``append_tuples`` whole and in tick-sized batches (``TICK_ROWS``, what the
    feed writes), and the batch into a fresh ``history.sqlite`` (``append_tuples``) for comparison."""
    from stepwatch.store import clickhouse as ch
    from stepwatch.store.base import COLUMNS
    from stepwatch.store.rows import wire_tuples
    from stepwatch.store.sqlite import SqliteStore
    from stepwatch.transport.frames import decode_typed

    url, pid_text, ranks, frames, steps = argv
    pid = int(pid_text)
    sid = str(uuid.uuid4())
    base = ingest._base_events(sid)
    bodies, wire = [], 0
    for rank in range(int(ranks)):
        encoded, n = ingest.tcp_frames(rank, int(frames), int(steps), sid, int(ranks), base, time.time_ns())
        bodies += [f[4:] for f in encoded]
        wire += n
    stages: dict[str, dict[str, float]] = {}

    def timed(name: str, fn: Any) -> Any:
        wall, cpu, server = time.perf_counter(), _cpu(), process_cpu_seconds(pid)
        out = fn()
        stages[name] = {"wall_s": time.perf_counter() - wall, "cpu_s": _cpu() - cpu,
                        "server_cpu_s": process_cpu_seconds(pid) - server}
        return out

    typed = timed("aggregator decode: decode_typed", lambda: [decode_typed(b) for b in bodies])
    parts = timed("aggregator decode: wire_tuples", lambda: [wire_tuples(m["session_id"], m["rank"], t) for m, t in typed])
    batch: dict[str, list[tuple[Any, ...]]] = {}
    for tables in parts:
        for table, rows in tables.items():
            batch.setdefault(table, []).extend(rows)
    typed = parts = []
    stored = sum(len(rows) for rows in batch.values())
    store = ch.ClickHouseStore(url)
    columns = {}
    for table, rows in batch.items():
        columns[table] = timed(f"store column build: {table}", lambda table=table, rows=rows: [
            ch._column(values, kind, name in ch._key_columns(table))
            for (name, kind), values in zip(COLUMNS[table], zip(*rows))])
    for table, cols in columns.items():
        names = ", ".join(name for name, _ in COLUMNS[table])
        timed(f"driver INSERT: {table} ({len(batch[table]):,} rows, {len(cols)} columns)",
              lambda table=table, cols=cols, names=names: store._client.execute(
                  f"INSERT INTO {table}_rows ({names}) VALUES", cols, columnar=True))
    # the same rows through the store's append_tuples: whole, then in tick-sized batches (what the
    # feed writes, one batch at a time, healthy or replaying)
    chunks = max(1, stored // TICK_ROWS)
    store.query_tuples("SELECT 1")
    timed("append_tuples: the batch whole", lambda: store.append_tuples(batch))
    pieces = [{t: rows[i * len(rows) // chunks:(i + 1) * len(rows) // chunks] for t, rows in batch.items()}
              for i in range(chunks)]
    timed(f"append_tuples: in {chunks} tick-sized batches of ~{stored // chunks:,} rows",
          lambda: [store.append_tuples(piece) for piece in pieces])
    store.query_tuples(f"DROP DATABASE IF EXISTS {store.url.database}")
    store.close()
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = SqliteStore(Path(tmp) / "history.sqlite")
        timed("SQLite append_tuples (same batch)", lambda: sqlite.append_tuples(batch))
        sqlite.close()
    return {"wire_rows": wire, "stored_rows": stored, "stages": stages}


def print_profile(profile: dict[str, Any]) -> None:
    wire, stored = profile["wire_rows"], profile["stored_rows"]
    print(f"\none batch, stage by stage in one process ({wire:,} wire rows -> {stored:,} stored rows with the "
          f"derived steps rows; us per wire row):")
    sums = {"aggregator decode": 0.0, "store column build": 0.0, "driver INSERT": 0.0}  # append_tuples: apart
    server = 0.0
    for name, t in profile["stages"].items():
        print(f"  {name:<58} client CPU {t['cpu_s'] * 1e6 / wire:6.2f} us, server CPU "
              f"{t['server_cpu_s'] * 1e6 / wire:6.2f} us, wall {t['wall_s'] * 1e6 / wire:6.2f} us")
        for key in sums:
            if name.startswith(key):
                sums[key] += t["cpu_s"]
        if name.startswith("driver INSERT"):
            server += t["server_cpu_s"]
    total = sum(sums.values()) + server
    print("  sum: " + ", ".join(f"{k} {v * 1e6 / wire:.2f} us" for k, v in sums.items())
          + f", server {server * 1e6 / wire:.2f} us = {total * 1e6 / wire:.2f} us/wire row "
          f"-> {2 * wire / total:,.0f} wire rows/s on 2 idle cores")


def report(results: list[dict[str, Any]]) -> None:
    print()
    print("| store | wire rows stored | wall s (load 1m before/after) | rows/s | aggregator CPU s (loop / other threads) "
          "| server CPU s | generators' send CPU s | aggregator peak RSS MiB | spilled / replayed rows |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t = r["aggregator_thread_cpu_s"]
        print(f"| {r['store']} | {r['rows_stored']:,} of {r['rows_expected']:,} | {r['wall_s']:.2f} "
              f"({r['load_before'][0]:.1f}/{r['load_after'][0]:.1f}) | {r['rows_per_s']:,.0f} | "
              f"{r['aggregator_cpu_s']:.2f} ({t['main']:.2f} / {t['other']:.2f}) | {r['server_cpu_s']:.2f} | "
              f"{r['generator_send_cpu_s']:.2f} | {r['aggregator_rss_max'] / 2**20:.0f} | "
              f"{r['spilled_rows'] if r['spilled_rows'] is not None else '-'} / "
              f"{r['replayed_rows'] if r['replayed_rows'] is not None else '-'} |")
    print()
    print("CPU per stored wire row, and the rows/s 2 idle cores would allow (2 / CPU-s per row):")
    for r in results:
        n = r["rows_stored"] or 1
        t = r["aggregator_thread_cpu_s"]
        parts = {"aggregator loop (decode, tick)": t["main"], "aggregator other threads (store write)": t["other"],
                 "clickhouse-server": r["server_cpu_s"] - r["server_poll_cpu_s"],
                 "generators (send)": r["generator_send_cpu_s"]}
        total = sum(parts.values())
        detail = ", ".join(f"{k} {v * 1e6 / n:.2f} us" for k, v in parts.items() if v)
        store_only = total - r["generator_send_cpu_s"]
        if r["server_poll_cpu_s"]:
            detail += f" (the server's count() polls, {r['server_poll_cpu_s']:.2f} s, taken out)"
        print(f"  {r['store']}: {detail}; total {total * 1e6 / n:.2f} us/row -> ceiling {2 * n / total:,.0f} rows/s "
              f"on 2 cores ({2 * n / store_only:,.0f} rows/s with the ranks on other machines)")
    for r in results:
        print(f"  {r['store']}: the last 100 store writes took {r['mean_batch_s'] or 0:.3f} s each on average "
              f"(last one {r['last_batch_rows']} rows)")
    print(f"  target: {TARGET_ROWS_PER_S:,} rows/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--rows", type=int, default=600_000, help="wire rows per store (default 600000)")
    parser.add_argument("--steps-per-frame", type=int, default=20)
    parser.add_argument("--gen-procs", type=int, default=2)
    parser.add_argument("--stores", default="sqlite,clickhouse")
    parser.add_argument("--url", default=None, help="a ClickHouse URL (its database is ignored: one per run is made)")
    parser.add_argument("--server-pid", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--profile", action="store_true",
                        help="also one batch stage by stage in one process (decode, column build, INSERT, server)")
    parser.add_argument("--profile-ranks", type=int, default=64)
    parser.add_argument("--profile-frames", type=int, default=8)
    args = parser.parse_args()
    args.tmp_dir.mkdir(parents=True, exist_ok=True)
    header = machine_header(args.tmp_dir)
    print_header(f"aggregator ingest into ClickHouse vs SQLite: {args.ranks} ranks over TCP", header)
    work = Path(tempfile.mkdtemp(prefix="bench-chagg-", dir=args.tmp_dir))
    server = None
    results = []
    profile = None
    try:
        stores = [s.strip() for s in args.stores.split(",") if s.strip()]
        if "clickhouse" in stores and args.url is None:
            server = start_server(work)
            args.url, args.server_pid = server.url("unused"), server.pid
            print(f"clickhouse-server pid {server.pid} on {args.url}")
        for kind in stores:
            results.append(run_store(kind, args, work, server))
        if args.profile and args.url:
            url = f"{args.url.rstrip('/').rpartition('/')[0]}/bench_profile_{uuid.uuid4().hex[:8]}"
            profile = run_worker(Path(__file__).resolve(), "profile",
                                 [url, str(args.server_pid), str(args.profile_ranks), str(args.profile_frames),
                                  str(args.steps_per_frame)])
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(results)
    if profile is not None:
        print_profile(profile)
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    if not worker_main({"profile": worker_profile}, sys.argv[1:]):
        main()
