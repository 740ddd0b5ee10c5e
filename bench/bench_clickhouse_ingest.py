"""Step rows into a ClickHouse store and into a history.sqlite, in one process, the same rows in
the same batches: wall time, this process's CPU time, the server's CPU time, and one read
(a COUNT and a GROUP BY rank) on each.

Usage::

    .venv/bin/python bench/bench_clickhouse_ingest.py --url clickhouse://default@127.0.0.1:9000/bench \\
        [--rows N] [--batch B] [--server-pid PID]

The database the URL names is made, filled and dropped. With ``--server-pid`` (the
clickhouse-server's pid on this machine) the server's own CPU time is read from /proc too: the
client's CPU is only part of the cost of a columnar insert. This is the first figure of the
store; issue 23 §5's benchmark (64 ranks through the aggregator) is not this.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import cpu_seconds, process_cpu_seconds

from stepwatch.store.base import COLUMNS
from stepwatch.store.clickhouse import ClickHouseStore
from stepwatch.store.sqlite import SqliteStore


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--server-pid", type=int, default=None)
    args = parser.parse_args()
    width = len(COLUMNS["steps"])
    base = 1_700_000_000_000_000_000
    rows = [("bench", r % 8, r // 8, base + r * 1000, base + r * 1000 + 900, 900, *([100] * (width - 6)))
            for r in range(args.rows)]
    ch = ClickHouseStore(args.url)
    try:
        cpu, server, wall = cpu_seconds(), process_cpu_seconds(args.server_pid), time.perf_counter()
        for i in range(0, args.rows, args.batch):
            ch.append_tuples({"steps": rows[i:i + args.batch]})
        print(f"clickhouse: {args.rows} step rows in {time.perf_counter() - wall:.2f} s wall, "
              f"{cpu_seconds() - cpu:.2f} s client CPU, {process_cpu_seconds(args.server_pid) - server:.2f} s server CPU")
        with tempfile.TemporaryDirectory() as tmp, SqliteStore(Path(tmp) / "history.sqlite") as sqlite:
            cpu, wall = cpu_seconds(), time.perf_counter()
            for i in range(0, args.rows, args.batch):
                sqlite.append_tuples({"steps": rows[i:i + args.batch]})
            print(f"sqlite: {args.rows} step rows in {time.perf_counter() - wall:.2f} s wall, "
                  f"{cpu_seconds() - cpu:.2f} s CPU")
            for store in (ch, sqlite):
                wall = time.perf_counter()
                count = store.count("steps")
                store.query("SELECT rank, AVG(step_ns) AS mean FROM steps WHERE session_id = ? GROUP BY rank "
                            "ORDER BY rank", ("bench",))
                print(f"{type(store).__name__}: COUNT ({count}) and GROUP BY rank in "
                      f"{time.perf_counter() - wall:.3f} s")
    finally:
        ch.query_tuples(f"DROP DATABASE IF EXISTS {ch.url.database}")
        ch.close()


if __name__ == "__main__":
    main()
