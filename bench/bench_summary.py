"""The final summary of a big run, read from a real ``history.sqlite``: 64 ranks x 20,000 steps
(1.28M step rows) stored as the aggregator stores them, every rank's steps interleaved in time
(a tick at a time), with one memory sample per rank every 10 steps.

Usage::

    .venv/bin/python bench/bench_summary.py [--ranks R] [--steps N] [--repeat K] [--tmp-dir DIR]
                                            [--sessions-before S]

The history is written once (untimed, kept in ``--tmp-dir`` for the next run); then each round
is a fresh interpreter (``_common.run_worker``) that opens the store read-only and times
``build_summary`` whole, and apart: the session's step read (what the summary's statistics and
its diagnosis take) and the diagnosis. ``--sessions-before S`` stores S other sessions of the
same shape first, so the read cannot lean on a history that holds one session only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import SLOW_RANK, T0, aggregator_ticks, machine_header, peak_rss_bytes, run_worker, worker_main

SCRIPT = Path(__file__).resolve()
SESSION = "5b0c8f4e-3a1d-4c2b-9e7f-0123456789ab"


def _stepwatch_path() -> None:
    sys.path.insert(0, str(SCRIPT.parent.parent / "src"))


def _write(path: Path, ranks: int, steps: int, sessions_before: int) -> float:
    _stepwatch_path()
    from stepwatch.store.sqlite import SqliteStore

    started = time.perf_counter()
    store = SqliteStore(path)
    ids = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(sessions_before)] + [SESSION]
    for number, session in enumerate(ids):
        store.upsert_session({"session_id": session, "status": "completed", "started_at_ns": T0 + number,
                              "ended_at_ns": None, "host": "bench", "world_size": ranks, "source": "bench",
                              "command_line": None})
        for rows, samples in aggregator_ticks(session, ranks, steps, number):
            store.append_many({"steps": rows, "telemetry": samples})
    store.close()
    return time.perf_counter() - started


def worker_summary(args: list[str]) -> dict[str, Any]:
    """args: path: one summary, timed whole and apart."""
    path = Path(args[0])
    _stepwatch_path()
    from stepwatch.analysis.summary import build_summary
    from stepwatch.store.sqlite import SqliteStore

    store = SqliteStore(path, read_only=True)
    started = time.perf_counter()
    summary = build_summary(store, SESSION)
    whole = time.perf_counter() - started
    primary = summary["diagnosis"]["primary"]
    if primary is None or primary["name"] != "COMPUTE_STRAGGLER" or primary["ranks"] != [SLOW_RANK]:
        raise SystemExit(f"unexpected primary: {primary}")
    read = _timed_read(store)
    return {"summary_s": whole, "step_read_s": read, "steps": summary["overall"]["steps"],
            "peak_rss_bytes": peak_rss_bytes()}


def _timed_read(store: Any) -> float | None:
    """The session's one step read, where this version of stepwatch has it."""
    try:
        from stepwatch.analysis.verdicts.inputs import session_steps
    except ImportError:
        return None
    started = time.perf_counter()
    session_steps(store, SESSION)
    return time.perf_counter() - started


def main() -> None:
    if worker_main({"summary": worker_summary}, sys.argv[1:]):
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sessions-before", type=int, default=0)
    parser.add_argument("--tmp-dir", type=Path, default=Path("/tmp/stepwatch-bench-summary"))
    args = parser.parse_args()
    args.tmp_dir.mkdir(parents=True, exist_ok=True)
    header = machine_header(args.tmp_dir)
    print(f"{header['cpu']} x{header['cpu_count']}, stepwatch {header['stepwatch_commit']}, load {os.getloadavg()[0]:.1f}")
    path = args.tmp_dir / f"history-{args.ranks}x{args.steps}-{args.sessions_before}.sqlite"
    if not path.exists():
        built = _write(path, args.ranks, args.steps, args.sessions_before)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in {built:.1f} s")
    rounds = [run_worker(SCRIPT, "summary", [str(path)]) for _ in range(args.repeat)]
    best = min(rounds, key=lambda r: r["summary_s"])
    reads = sorted(r["step_read_s"] for r in rounds if r["step_read_s"] is not None)
    print(f"summary of {best['steps']:,} step rows ({args.ranks} ranks x {args.steps:,} steps, "
          f"{args.sessions_before} sessions before it):")
    every = ", ".join(f"{r['summary_s']:.2f}" for r in rounds)
    print(f"  build_summary: best {best['summary_s']:.2f} s (every round: {every} s)")
    if reads:
        print(f"  its one step read: best {reads[0]:.2f} s")
    print(f"  peak RSS {best['peak_rss_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
