"""A synthetic run written straight into a history store (no process): the shapes the dashboard's
views draw, at any size, for the tests that need many ranks or steps fast; and a real run's
history as the first stepwatch stored it, for the readers of older runs."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

from stepwatch.phases import STEP_COLUMNS

T0 = 1_790_000_000_000_000_000
MS = 1_000_000
SPIKE = (5, 2_345)  # (rank, step) ten times slower than the rest


def write_run(store: Any, session_id: str, ranks: int, steps: int, *, status: str = "completed",
              slow_rank: int | None = None, first_step: int = 0) -> None:
    """``ranks`` x ``steps`` step rows from ``first_step`` (about 10 ms each, ``slow_rank``'s 15 ms;
    SPIKE's step 100 ms) with their phases, and a memory sample every 10 steps per rank."""
    store.upsert_session({"session_id": session_id, "status": status, "started_at_ns": T0, "ended_at_ns": None,
                          "host": "test", "world_size": ranks, "source": "test", "command_line": ["train.py"]})
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    for rank in range(ranks):
        t = T0 + first_step * 10 * MS
        for step in range(first_step, first_step + steps):
            step_ns = 10 * MS + rng.randrange(MS) + (90 * MS if (rank, step) == SPIKE else 0) + (5 * MS if rank == slow_rank else 0)
            phases = dict.fromkeys(STEP_COLUMNS, 0)
            phases.update(forward_ns=step_ns // 3, backward_ns=step_ns // 2, data_load_ns=step_ns // 10,
                          wait_ns=step_ns - step_ns // 3 - step_ns // 2)
            rows.append({"session_id": session_id, "rank": rank, "step": step, "start_ns": t, "end_ns": t + step_ns,
                         "step_ns": step_ns, **phases})
            if step % 10 == 0:
                samples.append({"session_id": session_id, "rank": rank, "timestamp_ns": t, "event_type": "sample",
                                "collector": "stepwatch.cpu_tracker", "device_id": -1, "allocated": (1 << 30) + step,
                                "reserved": 1 << 30, "active": None, "inactive": None, "change": 0, "used": 1 << 30,
                                "free": None, "total": None, "pid": 1, "host": "test", "context": None, "metadata": {}})
            t += step_ns
    store.append_many({"steps": rows, "telemetry": samples})


# the tables of the first history layout (before the session keys, the alerts, the verdicts and
# steps.recompute_ns): one plain table each, session_id in every row
FIRST_LAYOUT = ("sessions", "telemetry", "spans", "marks", "snapshots", "heartbeats", "steps")


def as_first_layout(source: Path, target: Path) -> None:
    """``source``'s rows written to a new store at ``target`` as the first stepwatch wrote them."""
    old = sqlite3.connect(target)
    with sqlite3.connect(f"{source.resolve().as_uri()}?mode=ro", uri=True) as new:
        for table in FIRST_LAYOUT:
            columns = [row[1] for row in new.execute(f"PRAGMA table_info({table})") if row[1] != "recompute_ns"]
            old.execute(f"CREATE TABLE {table} ({', '.join(columns)})")
            old.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' for _ in columns)})",
                            new.execute(f"SELECT {', '.join(columns)} FROM {table}"))
    old.commit()
    old.close()
