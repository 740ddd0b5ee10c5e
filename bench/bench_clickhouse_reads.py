"""The summary's step statistics of one session, three ways, on the same rows: reduced on the
ClickHouse server (``ClickHouseStore.step_aggregates``: counts, exact sums and the quantiles'
sorted neighbours, one row per rank), from every step row moved to the client (the path a
store without server-side reductions takes, ``SqlReads.step_aggregates``), and on a
history.sqlite (the SQLite store, rows read in-process). Wall time, this process's CPU time, the
server's CPU time (``--server-pid``), and the rows that crossed the connection; the results are
checked equal.

Usage::

    .venv/bin/python bench/bench_clickhouse_reads.py --url clickhouse://default@127.0.0.1:9000/bench \\
        [--ranks 64] [--steps 4096] [--server-pid PID] [--repeat 3]
    .venv/bin/python bench/bench_clickhouse_reads.py --chdb DIR ...      # ClickHouse 26.x in-process (chdb)

The database is made, filled and dropped (a chdb directory: use a new one). Times are the best
of ``--repeat``.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import cpu_seconds, process_cpu_seconds

from stepwatch.store.base import COLUMNS, SqlReads
from stepwatch.store.clickhouse import ClickHouseStore
from stepwatch.store.sqlite import SqliteStore


def _best(read: Callable[[], Any], repeat: int, pid: int | None) -> tuple[Any, float, float, float]:
    """(result, wall s, client CPU s, server CPU s) of the fastest of ``repeat`` reads."""
    best = None
    for _ in range(repeat):
        cpu, server, wall = cpu_seconds(), process_cpu_seconds(pid), time.perf_counter()
        result = read()
        took = (result, time.perf_counter() - wall, cpu_seconds() - cpu, process_cpu_seconds(pid) - server)
        if best is None or took[1] < best[1]:
            best = took
    assert best is not None
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url")
    where.add_argument("--chdb", metavar="DIR")
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4096)
    parser.add_argument("--server-pid", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    width = len(COLUMNS["steps"])
    base = 1_700_000_000_000_000_000
    rnd = random.Random(7)
    rows = []
    for step in range(args.steps):
        for rank in range(args.ranks):
            start = base + step * 10_000_000 + rank
            took = rnd.randint(8_000_000, 12_000_000)
            rows.append(("bench", rank, step, start, start + took, took,
                         *(rnd.randint(0, 2_000_000) for _ in range(width - 6))))
    ch = ClickHouseStore.on_chdb(args.chdb, "bench_reads") if args.chdb else ClickHouseStore(args.url)
    pid = None if args.chdb else args.server_pid
    print(f"server {'.'.join(map(str, ch.features.version))} ({'modern' if ch.features.modern else '18.16'} DDL), "
          f"{len(rows)} step rows ({args.ranks} ranks x {args.steps} steps), best of {args.repeat}; "
          f"load average {os.getloadavg()[0]:.2f}")
    try:
        for i in range(0, len(rows), 50_000):
            ch.append_tuples({"steps": rows[i:i + 50_000]})
        on_server = _best(lambda: ch.step_aggregates("bench"), args.repeat, pid)
        moved = _best(lambda: SqlReads.step_aggregates(ch, "bench"), args.repeat, pid)
        with tempfile.TemporaryDirectory() as tmp, SqliteStore(Path(tmp) / "history.sqlite") as sqlite:
            sqlite.append_tuples({"steps": rows})
            local = _best(lambda: sqlite.step_aggregates("bench"), args.repeat, None)
        assert on_server[0] == moved[0] == local[0], "the three paths disagree"
        for name, (_, wall, cpu, server), crossed in (
                ("reduced on the server", on_server, 1 + args.ranks),
                ("rows moved to the client", moved, len(rows)),
                ("sqlite (rows in-process)", local, 0)):
            print(f"  {name:26s} {wall:7.3f} s wall  {cpu:7.3f} s client CPU  "
                  f"{server:6.2f} s server CPU  {crossed:>9} rows over the connection")
    finally:
        if not args.chdb:
            ch.query_tuples(f"DROP DATABASE {ch.url.database}")
        ch.close()


if __name__ == "__main__":
    main()
