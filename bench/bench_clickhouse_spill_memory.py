"""The aggregator's memory while its ClickHouse server is down and while it replays: ``serve
--store clickhouse://...`` under load from simulated ranks, the server killed (or paused) part
way, started again, and the spill queue drained (issue 23 §3 and §5).

Usage::

    .venv/bin/python bench/bench_clickhouse_spill_memory.py [--ranks 64] [--frames 40]
        [--steps-per-frame 20] [--paced 1.0] [--down-at 5] [--down-for 20] [--mode kill|stop]
        [--retry-max-s 2] [--tmp-dir DIR]

A private Debian ``clickhouse-server`` is started from ``--tmp-dir`` (``tests/support/
clickhouse.py``'s ``PrivateClickHouse``). ``bench_ingest.py``'s ``gen-tcp`` workers send
``--frames`` frames per rank, one every ``--paced`` seconds (a frame: ``--steps-per-frame``
training steps, 9 wire rows each, plus a heartbeat). ``--down-at`` seconds after the ranks start
the server is killed (``--mode kill``: SIGKILL, connection refused) or paused (``stop``:
SIGSTOP, a hung server the feed notices after ``STEPWATCH_STORE_SLOW_S``), and ``--down-for``
seconds later started again (kill) or resumed (stop). The feed's longest retry gap is set to
``--retry-max-s`` (``STEPWATCH_STORE_RETRY_MAX_S``; the default 30 s would add up to 30 s of
waiting to the drain).

Sampled every 0.1 s: the aggregator's RSS (psutil) and, every 0.25 s, ``/healthz`` (spilled,
replayed and pending rows). Printed: peak RSS in each phase (healthy, down, replaying, after),
rows spilled and replayed, the spill file's peak size, the time from the restart to an empty
queue, and the rows the server holds at the end (its views, read FINAL: each row once) against
the rows sent.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ingest as ingest
from _common import load_average, machine_header, print_header, process_cpu_seconds
from bench_clickhouse_aggregator import WIRE_TABLES, Aggregator, start_server


class Sampler:
    """RSS every 0.1 s and /healthz every 0.25 s of the aggregator, with the time (since t0)."""

    def __init__(self, aggregator: Aggregator, spill_path: Path) -> None:
        import psutil

        self.proc = psutil.Process(aggregator.pid)
        self.aggregator = aggregator
        self.spill_path = spill_path
        self.rss: list[tuple[float, int]] = []
        self.health: list[tuple[float, dict[str, Any]]] = []
        self.spill_bytes: list[int] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(0.1):
            now = time.monotonic() - self.t0
            try:
                self.rss.append((now, self.proc.memory_info().rss))
            except Exception:  # noqa: BLE001 - the process is gone
                return
            if tick % 3 == 0:
                h = self.aggregator.health()
                if h is not None:
                    self.health.append((now, h))
                size = sum(p.stat().st_size for p in self.spill_path.parent.glob(self.spill_path.name + "*")
                           if p.exists())
                self.spill_bytes.append(size)
            tick += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def last(self) -> dict[str, Any]:
        return self.health[-1][1] if self.health else {}


def _final_counts(url: str) -> dict[str, int]:
    """Rows of each wire table the server holds, through the views (FINAL: a row written twice once)."""
    from stepwatch.store.clickhouse import ClickHouseStore

    store = ClickHouseStore(url, read_only=True)
    try:
        return {t: int(store.query_tuples(f"SELECT count() FROM {t}")[0][0]) for t in WIRE_TABLES}
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--frames", type=int, default=40, help="frames per rank (default 40)")
    parser.add_argument("--steps-per-frame", type=int, default=20)
    parser.add_argument("--paced", type=float, default=1.0, help="seconds between a rank's frames (default 1.0)")
    parser.add_argument("--gen-procs", type=int, default=2)
    parser.add_argument("--down-at", type=float, default=5.0)
    parser.add_argument("--down-for", type=float, default=20.0)
    parser.add_argument("--mode", choices=("kill", "stop"), default="kill")
    parser.add_argument("--retry-max-s", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    header = machine_header(args.tmp_dir)
    print_header(f"aggregator memory through a ClickHouse outage ({args.mode}) and the replay", header)
    work = Path(tempfile.mkdtemp(prefix="bench-chspill-", dir=args.tmp_dir))
    server = start_server(work)
    url = server.url(f"bench_spill_{uuid.uuid4().hex[:8]}")
    out = work / "agg"
    from stepwatch.store.spill import SPILL_FILE

    rows_per_frame = args.steps_per_frame * ingest.ROWS_PER_STEP + 1
    expected = args.ranks * args.frames * rows_per_frame
    aggregator = Aggregator(out, url, env={"STEPWATCH_STORE_RETRY_MAX_S": str(args.retry_max_s)})
    workers: list[Any] = []
    sampler = Sampler(aggregator, out / SPILL_FILE)
    marks: dict[str, float] = {}
    try:
        common = ["--paced", str(args.paced)]
        workers = []
        for ranks in ingest.split(list(range(args.ranks)), args.gen_procs):
            workers.append(ingest.Worker("gen-tcp", ["--address", aggregator.tcp, "--ranks", f"{ranks[0]}-{ranks[-1]}",
                                                     "--frames", str(args.frames), "--steps", str(args.steps_per_frame),
                                                     "--session", str(uuid.uuid4()), "--world", str(args.ranks),
                                                     *common], work))
        ingest.wait_ready(workers, 600)
        time.sleep(1.0)
        rss_idle = sampler.proc.memory_info().rss
        load_start = load_average()
        cpu0 = process_cpu_seconds(aggregator.pid)
        t0, t0_wall = time.monotonic(), time.time()
        sampler.start(t0)
        for worker in workers:
            worker.go()
        time.sleep(args.down_at)
        if args.mode == "kill":
            server.kill()
        else:
            server.pause()
        marks["down"] = time.monotonic() - t0
        print(f"  server {'killed' if args.mode == 'kill' else 'paused'} at {marks['down']:.1f} s", flush=True)
        time.sleep(args.down_for)
        if args.mode == "kill":
            server.start()
        else:
            os.kill(server.pid, signal.SIGCONT)
        marks["up"] = time.monotonic() - t0
        print(f"  server back at {marks['up']:.1f} s (load {load_average()})", flush=True)
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            time.sleep(0.25)
            h = sampler.last()
            senders_done = all(w.proc.poll() is not None for w in workers)
            if (senders_done and h and h.get("store_spill_pending_rows") == 0 and not h.get("store_degraded")
                    and h.get("rows_accepted", 0) >= expected and h.get("pending_rows") == 0
                    and h.get("store_memory_batches") == 0):
                break
        marks["drained"] = time.monotonic() - t0
        sampler.stop()
        cpu = process_cpu_seconds(aggregator.pid) - cpu0
        load_end = load_average()
        results = [w.result(120) for w in workers]
        stats, _ = aggregator.stop()
        counts = _final_counts(url)
    finally:
        sampler.stop()
        for worker in workers:
            worker.kill()
        aggregator.kill()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    first_spill = next((t for t, h in sampler.health if h.get("store_spilled_rows", 0) > 0), None)
    replay_seen = next((t for t, h in sampler.health if h.get("store_replayed_rows", 0) > 0), None)

    def peak(low: float, high: float) -> int:
        return max((r for t, r in sampler.rss if low <= t < high), default=0)

    phases = {"healthy": (0, marks["down"]), "down (spilling)": (marks["down"], marks["up"]),
              "replaying": (marks["up"], marks["drained"]), "whole run": (0, 1e9)}
    sent = sum(r["rows"] for r in results)
    print(f"\n{args.ranks} ranks x {args.frames} frames of {rows_per_frame} wire rows, one a rank every "
          f"{args.paced:g} s (~{args.ranks * rows_per_frame / args.paced:,.0f} rows/s); load {load_start} -> {load_end}")
    print(f"  server down {marks['down']:.1f}-{marks['up']:.1f} s ({args.mode}); first spill seen at "
          f"{first_spill if first_spill is None else round(first_spill, 1)} s; first replay seen at "
          f"{replay_seen if replay_seen is None else round(replay_seen, 1)} s; queue empty at {marks['drained']:.1f} s "
          f"= {marks['drained'] - marks['up']:.1f} s after the restart (senders done at "
          f"{max(r['t_last_sent'] or 0 for r in results) - t0_wall:.1f} s)")
    print(f"  rows spilled {stats.get('store_spilled_rows'):,} in {stats.get('store_spilled_batches')} batches; "
          f"replayed {stats.get('store_replayed_rows'):,}; lost {stats.get('rows_lost')}; degraded episodes "
          f"{stats.get('store_degraded_episodes')}, {stats.get('store_degraded_s')} s")
    print(f"  the feed's last {min(100, stats.get('store_replayed_batches') or 100)} writes to the server: "
          f"{stats.get('mean_batch_seconds', 0):.3f} s each on average (one INSERT per table); last batch "
          f"{stats.get('last_batch_rows')} rows")
    print(f"  spill file peak {max(sampler.spill_bytes, default=0) / 2**20:.1f} MiB (with its WAL)")
    print(f"  aggregator CPU {cpu:.2f} s over the run; RSS idle {rss_idle / 2**20:.0f} MiB")
    for name, (low, high) in phases.items():
        print(f"    peak RSS {name:<16} {peak(low, high) / 2**20:6.1f} MiB")
    held = sum(counts.values())
    print(f"  the server holds {held:,} wire rows of {sent:,} sent ({counts}): "
          f"{'every row once' if held == sent else 'MISMATCH'}")


if __name__ == "__main__":
    main()
