"""The aggregator's spill queue (store/spill.py) alone: step rows pushed in tick-sized batches into
``store_spill.sqlite`` (msgpack, WAL, ``synchronous=FULL``: an fsync a batch) and read back in
order, as the store feed does while ClickHouse is down and when it replays. Wall time, this
process's CPU time and its peak RSS for each half, rows per second.

Usage::

    .venv/bin/python bench/bench_spill.py [--rows N] [--batch B] [--dir DIR]

``--dir``: where the file goes (default a temporary directory; the disk under it is what an
fsync costs). No server is involved: what the spill costs the aggregator while the server is
down, and the local half of a replay (the server's half is bench_clickhouse_ingest.py).
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from stepwatch.store.base import COLUMNS
from stepwatch.store.spill import SpillBatch, SpillQueue


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_rows(first: int, n: int) -> list[tuple[int | str | None, ...]]:
    """``n`` step rows of one session over 64 ranks, in COLUMNS order."""
    names = [name for name, _ in COLUMNS["steps"]]
    rows = []
    for i in range(first, first + n):
        values = {"session_id": "bench-session", "rank": i % 64, "step": i // 64, "start_ns": 1_800_000_000 + i,
                  "end_ns": 1_800_000_000 + i + 5_000_000, "step_ns": 5_000_000, "data_load_ns": 1_000,
                  "h2d_ns": 0, "forward_ns": 1_000_000, "backward_ns": 2_000_000, "optimizer_ns": 500_000,
                  "recompute_ns": None, "wait_ns": 10}
        rows.append(tuple(values.get(name) for name in names))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=10_000, help="rows a tick (the aggregator's flush_rows)")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    batches = [step_rows(first, min(args.batch, args.rows - first)) for first in range(0, args.rows, args.batch)]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        queue = SpillQueue(Path(tmp) / "store_spill.sqlite")
        wall, cpu = time.perf_counter(), _cpu()
        for seq, rows in enumerate(batches, 1):
            queue.push(SpillBatch(seq, {"steps": rows}, [], [], []))
        push_wall, push_cpu = time.perf_counter() - wall, _cpu() - cpu
        size = (Path(tmp) / "store_spill.sqlite").stat().st_size + sum(
            p.stat().st_size for p in Path(tmp).glob("store_spill.sqlite-*"))
        wall, cpu = time.perf_counter(), _cpu()
        read = 0
        while (batch := queue.first()) is not None:
            read += batch.rows
            queue.remove(batch.seq)
        read_wall, read_cpu = time.perf_counter() - wall, _cpu() - cpu
        queue.close()
    assert read == args.rows, (read, args.rows)
    print(f"spill  {args.rows} rows in {len(batches)} batches: {push_wall:.2f} s wall, {push_cpu:.2f} s CPU, "
          f"{args.rows / push_wall:,.0f} rows/s; file {size / 2**20:.1f} MiB")
    print(f"replay read+remove: {read_wall:.2f} s wall, {read_cpu:.2f} s CPU, {args.rows / read_wall:,.0f} rows/s")
    print(f"peak RSS {_rss_mib():.0f} MiB (the rows built up front included)")


if __name__ == "__main__":
    main()
